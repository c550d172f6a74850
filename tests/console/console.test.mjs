// make test-console: the operator console in Debian's chromium, driven by
// playwright-core, through a realistic day of an operator (docs/console.md,
// docs/operations.md): an order paid twice through WeChat Pay and Alipay, a
// payment after close, a payment of the wrong amount, refunds, record-only
// with waiting records, a reconciliation difference, a failing webhook
// endpoint. It asserts what an operator reads: money as money (`¥258.00`),
// the twice-paid order flagged, its timeline telling both payments in time
// order, the overview's bars equal to GET /v1/admin/stats, and those counts
// equal to the database after a restart; every view in English and Chinese,
// the order page and findings at 390 px, the sign-in page silent before a
// token is accepted. Every write button is clicked twice and has one
// effect; every free-text field is probed with markup that must come back
// as text; a JavaScript error, a CSP violation or a literal `null` on a page
// fails the run. Screenshots of each view go to target/console-screenshots/.
//
// PAYONCE_BIN names the payonce binary; CHROMIUM the browser
// (default /usr/bin/chromium).

import { chromium } from 'playwright-core';
import { spawn, execFileSync } from 'node:child_process';
import { createCipheriv, createHmac, generateKeyPairSync, randomBytes, randomUUID, sign } from 'node:crypto';
import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:http';
import { createInterface } from 'node:readline';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import assert from 'node:assert/strict';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '../..');
const SHOTS = join(ROOT, 'target/console-screenshots');
const BIN = process.env.PAYONCE_BIN || join(ROOT, 'target/debug/payonce');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const TOKEN = 'console-test-token';
const CALLBACK_SECRET = 'console-callback-secret';
const ALIPAY_APP_ID = '2021000000000001';
const PROBE = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script>';

// ---- payonce, started for this run ----

const work = mkdtempSync(join(tmpdir(), 'payonce-console-'));
const alipayKeys = generateKeyPairSync('rsa', { modulusLength: 2048 });
writeFileSync(join(work, 'alipay.pem'), alipayKeys.publicKey.export({ type: 'spki', format: 'pem' }));

function startPayonce(extra = [], dbName = 'payonce.db') {
  const child = spawn(BIN, [
    'serve', '--db', join(work, dbName), '--listen', '127.0.0.1:0',
    '--callback-secret', CALLBACK_SECRET, '--api-token', `ops:${TOKEN}`,
    '--coupon', 'NEW10', '--points-per-yuan', '1',
    '--alipay-public-key', join(work, 'alipay.pem'), '--alipay-app-id', ALIPAY_APP_ID,
    // Nothing listens on port 9: every delivery fails at once and, after
    // the one retry, is a dead letter for the webhook view to retry.
    '--webhook-url', 'http://127.0.0.1:9/payonce', '--webhook-retry-s', '0.05',
    // The sweeper would decide the record-only records itself; the test drains them.
    ...(extra.length ? extra : ['--sweep-interval-s', '3600']),
  ], {
    env: { ...process.env, PAYONCE_WEBHOOK_SECRET: 'whsec_Y29uc29sZS10ZXN0LXdlYmhvb2stc2VjcmV0', PAYONCE_LOG: 'warn' },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  return new Promise((resolvePromise, reject) => {
    const lines = createInterface({ input: child.stdout });
    lines.once('line', (line) => {
      const match = /^listening on (http:\/\/\S+)$/.exec(line);
      if (match) resolvePromise({ child, base: match[1] });
      else reject(new Error(`unexpected first line ${line}`));
    });
    child.once('exit', (code) => reject(new Error(`payonce exited with ${code}`)));
  });
}


let BASE;

async function call(method, path, { json, body, headers = {}, auth = true, base = BASE } = {}) {
  const allHeaders = { ...headers };
  if (auth) allHeaders.Authorization = `Bearer ${TOKEN}`;
  let sent = body;
  if (json !== undefined) {
    allHeaders['Content-Type'] = 'application/json';
    sent = JSON.stringify(json);
  }
  const response = await fetch(base + path, { method, headers: allHeaders, body: sent });
  const text = await response.text();
  return { status: response.status, headers: response.headers, body: text ? JSON.parse(text) : null };
}

function genericCallback(path, payload, base = BASE) {
  const body = JSON.stringify(payload);
  const t = Math.floor(Date.now() / 1000);
  const v1 = createHmac('sha256', CALLBACK_SECRET).update(`${t}.${body}`).digest('hex');
  return call('POST', path, { body, base, auth: false, headers: { 'Content-Type': 'application/json', 'Payonce-Signature': `t=${t},v1=${v1}` } });
}

async function alipayCallback(params, base = BASE) {
  const form = { app_id: ALIPAY_APP_ID, charset: 'utf-8', ...params };
  const content = Object.keys(form).sort().map((k) => `${k}=${form[k]}`).join('&');
  const signature = sign('sha256', Buffer.from(content), alipayKeys.privateKey).toString('base64');
  const body = new URLSearchParams({ ...form, sign_type: 'RSA2', sign: signature }).toString();
  const response = await fetch(base + '/v1/callbacks/alipay', {
    method: 'POST', headers: { 'Content-Type': 'application/x-www-form-urlencoded; charset=utf-8' }, body,
  });
  return { status: response.status, text: await response.text() };
}

async function createOrder(orderNo, userId, amount = 1000, base = BASE, extra = {}) {
  const created = await call('POST', '/v1/orders', { json: { order_no: orderNo, user_id: userId, amount, ...extra }, base });
  assert.equal(created.status, 201, JSON.stringify(created.body));
}

async function order(orderNo, base = BASE) {
  const answer = await call('GET', `/v1/orders/${orderNo}`, { base });
  assert.equal(answer.status, 200);
  return answer.body;
}

async function eventually(what, check, ms = 15000) {
  const until = Date.now() + ms;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

// ---- WeChat Pay, played by this test (its refund API and its notices) ----

const WECHAT_APIV3_KEY = 'console-test-apiv3-key-32-bytes!';
const WECHAT_SERIAL = 'S1';
const WECHAT_MCHID = '1900000100';
const wechatPlatformKey = readFileSync(join(ROOT, 'tests/fixtures/keys/platform.pem'), 'utf8');

/** Headers of a message WeChat Pay signs with its platform key. */
function wechatSigned(body) {
  const t = String(Math.floor(Date.now() / 1000));
  const nonce = randomBytes(16).toString('hex');
  const signature = sign('sha256', Buffer.from(`${t}\n${nonce}\n${body}\n`), wechatPlatformKey).toString('base64');
  return { 'Wechatpay-Serial': WECHAT_SERIAL, 'Wechatpay-Timestamp': t, 'Wechatpay-Nonce': nonce, 'Wechatpay-Signature': signature };
}

function chinaTime() {
  return new Date(Date.now() + 8 * 3600 * 1000).toISOString().replace(/\.\d+Z$/, '+08:00');
}

/**
 * Every request payonce makes (`requests`); the refunds by out_refund_no,
 * each one refund however often it is asked for (WeChat Pay's idempotency);
 * the trades' orders by transaction_id, as the notices below told payonce.
 */
const wechat = { requests: [], refunds: new Map(), orders: new Map() };

function wechatRefundAnswer(refund) {
  return {
    refund_id: refund.refund_id,
    out_refund_no: refund.out_refund_no,
    transaction_id: refund.transaction_id,
    out_trade_no: wechat.orders.get(refund.transaction_id),
    channel: 'ORIGINAL',
    user_received_account: '支付用户零钱',
    status: refund.status,
    create_time: refund.create_time,
    ...(refund.status === 'SUCCESS' ? { success_time: chinaTime() } : {}),
    amount: { ...refund.amount, payer_total: refund.amount.total, payer_refund: refund.amount.refund },
  };
}

const wechatServer = createServer((req, res) => {
  let body = '';
  req.setEncoding('utf8');
  req.on('data', (chunk) => { body += chunk; });
  req.on('end', () => {
    wechat.requests.push({ method: req.method, url: req.url, body });
    let status = 404;
    let answer = { code: 'RESOURCE_NOT_EXISTS', message: 'the console test plays refunds only' };
    const queried = /^\/v3\/refund\/domestic\/refunds\/([^/?]+)/.exec(req.url);
    if (req.method === 'POST' && req.url === '/v3/refund/domestic/refunds') {
      const asked = JSON.parse(body);
      if (!wechat.refunds.has(asked.out_refund_no)) {
        wechat.refunds.set(asked.out_refund_no, {
          ...asked, refund_id: `5030000${wechat.refunds.size + 1}`, status: 'PROCESSING', create_time: chinaTime(),
        });
      }
      [status, answer] = [200, wechatRefundAnswer(wechat.refunds.get(asked.out_refund_no))];
    } else if (req.method === 'GET' && queried && wechat.refunds.has(decodeURIComponent(queried[1]))) {
      [status, answer] = [200, wechatRefundAnswer(wechat.refunds.get(decodeURIComponent(queried[1])))];
    }
    const text = JSON.stringify(answer);
    res.writeHead(status, { 'Content-Type': 'application/json', ...wechatSigned(text) });
    res.end(text);
  });
});

/** One API v3 notice to `base + path`: its resource encrypted with the APIv3 key, the whole signed. */
async function wechatNotice(base, path, eventType, resource) {
  const kind = eventType.startsWith('REFUND.') ? 'refund' : 'transaction';
  const nonce = randomBytes(6).toString('hex');
  const cipher = createCipheriv('aes-256-gcm', Buffer.from(WECHAT_APIV3_KEY), Buffer.from(nonce));
  cipher.setAAD(Buffer.from(kind));
  const ciphertext = Buffer.concat([cipher.update(JSON.stringify(resource)), cipher.final(), cipher.getAuthTag()]).toString('base64');
  const body = JSON.stringify({
    id: randomUUID(), create_time: chinaTime(), resource_type: 'encrypt-resource', event_type: eventType, summary: eventType,
    resource: { original_type: kind, algorithm: 'AEAD_AES_256_GCM', ciphertext, associated_data: kind, nonce },
  });
  const response = await fetch(base + path, { method: 'POST', headers: { 'Content-Type': 'application/json', ...wechatSigned(body) }, body });
  return { status: response.status, text: await response.text() };
}

/** The buyer pays `orderNo` through WeChat Pay: its transaction notice. */
async function wechatPaid(base, orderNo, transactionId, total = 1000) {
  wechat.orders.set(transactionId, orderNo);
  const answer = await wechatNotice(base, '/v1/callbacks/wechatpay', 'TRANSACTION.SUCCESS', {
    mchid: WECHAT_MCHID, appid: 'wxd678efh567hg6787', out_trade_no: orderNo, transaction_id: transactionId,
    trade_type: 'NATIVE', trade_state: 'SUCCESS', trade_state_desc: '支付成功', bank_type: 'OTHERS',
    success_time: chinaTime(), payer: { openid: 'o-console-buyer' },
    amount: { total, payer_total: total, currency: 'CNY', payer_currency: 'CNY' },
  });
  assert.equal(answer.status, 204, answer.text);
}

/** WeChat Pay settles refund `refundNo` (`SUCCESS` or `ABNORMAL`) and says so in a refund notice. */
async function wechatRefundSettled(base, refundNo, status) {
  const refund = wechat.refunds.get(refundNo);
  assert.ok(refund, `WeChat Pay was asked for ${refundNo}`);
  refund.status = status;
  const answer = await wechatNotice(base, '/v1/callbacks/wechatpay/refund', `REFUND.${status}`, {
    mchid: WECHAT_MCHID, out_trade_no: wechat.orders.get(refund.transaction_id), transaction_id: refund.transaction_id,
    out_refund_no: refundNo, refund_id: refund.refund_id, refund_status: status,
    ...(status === 'SUCCESS' ? { success_time: chinaTime() } : {}),
    user_received_account: '支付用户零钱',
    amount: { total: refund.amount.total, refund: refund.amount.refund, payer_total: refund.amount.total, payer_refund: refund.amount.refund },
  });
  assert.equal(answer.status, 204, answer.text);
}

/** The refund requests WeChat Pay received, by out_refund_no. */
function wechatRefundRequests(refundNo) {
  return wechat.requests
    .filter((r) => r.method === 'POST' && r.url === '/v3/refund/domestic/refunds')
    .map((r) => JSON.parse(r.body))
    .filter((b) => refundNo === undefined || b.out_refund_no === refundNo);
}


// A webhook endpoint that answers 410 Gone: payonce disables it, the console re-enables it.
const goneServer = createServer((req, res) => { req.resume(); req.on('end', () => { res.writeHead(410); res.end(); }); });
await new Promise((r) => goneServer.listen(0, '127.0.0.1', r));
const GONE_URL = `http://127.0.0.1:${goneServer.address().port}/gone`;
// The main payonce hears WeChat Pay's notices too (its APIv3 key and platform
// certificate); it calls no platform.
const MAIN_ARGS = [
  '--wechatpay-apiv3-key', WECHAT_APIV3_KEY,
  '--wechatpay-public-key', `${WECHAT_SERIAL}=${join(ROOT, 'tests/fixtures/keys/platform-cert-valid.pem')}`,
  '--webhook-url', GONE_URL, '--sweep-interval-s', '3600',
];
let payonce;
({ child: payonce, base: BASE } = await startPayonce(MAIN_ARGS));

/** A count from the ledger itself (python3's sqlite3: the test reads the database file, not the API). */
function db(sql, file = join(work, 'payonce.db')) {
  const out = execFileSync('python3', ['-c',
    'import sqlite3,sys,json; c=sqlite3.connect("file:"+sys.argv[1]+"?mode=ro", uri=True); print(json.dumps(c.execute(sys.argv[2]).fetchall()))',
    file, sql]);
  return JSON.parse(out.toString());
}

// ---- the day's data ----

const TX_TWICE = '4200000001202612040000000001';
await createOrder('ORD-TWICE', 'u-twice', 25800);
await wechatPaid(BASE, 'ORD-TWICE', TX_TWICE, 25800);
await new Promise((r) => setTimeout(r, 30));
const alipay = await alipayCallback({ trade_no: 'ALI-T1', out_trade_no: 'ORD-TWICE', trade_status: 'TRADE_SUCCESS', total_amount: '258.00' });
assert.equal(alipay.status, 200, alipay.text);
// A PENDING order that received ¥5.99 instead of ¥10.00.
await createOrder('ORD-WRONG', 'u-wrong', 1000);
assert.equal((await genericCallback('/v1/callbacks/generic', { pay_no: 'PAY-W1', order_no: 'ORD-WRONG', amount: 599, status: 'SUCCESS' })).body.outcome, 'amount_mismatch');
// The platform says it again: a duplicate, counted by this process only.
assert.equal((await genericCallback('/v1/callbacks/generic', { pay_no: 'PAY-W1', order_no: 'ORD-WRONG', amount: 599, status: 'SUCCESS' })).body.outcome, 'duplicate');
// Paid after its close.
await createOrder('ORD-CLOSED', 'u-closed', 1500);
const closed = await call('POST', '/v1/orders/ORD-CLOSED/close', { json: {} });
assert.equal(closed.status, 200, JSON.stringify(closed.body));
assert.equal((await genericCallback('/v1/callbacks/generic', { pay_no: 'PAY-C1', order_no: 'ORD-CLOSED', amount: 1500, status: 'SUCCESS' })).body.outcome, 'paid_after_close');
await createOrder('ORD-LATE', 'u-late');
await createOrder('ORD-MISSING', 'u-missing');
await createOrder('ORD-REFUNDED', 'u-refund');
for (let n = 0; n < 3; n += 1) await createOrder(`ORD-OTHER-${n}`, 'u-other');
assert.equal((await genericCallback('/v1/callbacks/generic', { pay_no: 'PAY-R1', order_no: 'ORD-REFUNDED', amount: 1000, status: 'SUCCESS' })).body.outcome, 'applied');
// A refund payonce never requested: an unexpected_refund finding.
assert.equal((await genericCallback('/v1/callbacks/generic/refund', { refund_no: 'RX-1', order_no: 'ORD-REFUNDED', status: 'SUCCESS' })).status, 200);

// ---- the browser ----

// Only this run's pictures: the directory is the CI artifact.
rmSync(SHOTS, { recursive: true, force: true });
mkdirSync(SHOTS, { recursive: true });
const browser = await chromium.launch({
  executablePath: CHROMIUM,
  headless: true,
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking'],
});
const pageErrors = [];
const writes = [];
const requests = [];

/** A tab in a browser of `locale` (its language is what the console starts in), watched for errors and writes. */
async function newTab(locale, viewport = { width: 1280, height: 860 }) {
  const context = await browser.newContext({ locale, viewport, timezoneId: 'Europe/Berlin' });
  const tab = await context.newPage();
  tab.on('pageerror', (err) => pageErrors.push(`page error: ${err.message}`));
  tab.on('console', (message) => {
    // A refused API call is logged by Chromium as "Failed to load resource";
    // the probes below cause some on purpose. Anything else is a failure.
    if (message.type() === 'error' && !message.text().startsWith('Failed to load resource')) {
      pageErrors.push(`console error: ${message.text()}`);
    }
  });
  tab.on('request', (request) => {
    requests.push(request.url());
    const key = request.headers()['idempotency-key'];
    if (key) writes.push({ method: request.method(), url: request.url(), key });
  });
  return tab;
}

let page = await newTab('en-US');

async function shot(name, target = page) {
  await target.screenshot({ path: join(SHOTS, `${name}.png`), fullPage: true });
}

async function signIn(base = BASE, target = page) {
  await target.goto(base + '/console');
  await target.locator('input[name=token]').fill(TOKEN);
  await target.locator('button[type=submit]').click();
  await target.locator('#nav a').first().waitFor();
}

/** Clicks a dialog's submit button twice, as an impatient operator does. */
async function doubleSubmit(perClick = 1) {
  const before = writes.length;
  await page.locator('dialog[open] button[type=submit]').dblclick();
  await page.waitForFunction(() => !document.getElementById('dialog').open, null, { timeout: 15000 });
  const sent = await eventually(`every submit (${2 * perClick})`, () => (writes.length >= before + 2 * perClick ? writes.slice(before) : null))
    .catch((err) => { throw new Error(`${err.message}: ${JSON.stringify(writes.slice(before))}`); });
  await new Promise((r) => setTimeout(r, 100));
  assert.equal(writes.length - before, 2 * perClick, `a double click sends twice: ${JSON.stringify(writes.slice(before))}`);
  assert.ok(sent.every((w) => w.key === sent[0].key), 'every request with the key the dialog made when it opened');
  return sent[0];
}

/** Clicks a dialog's submit button twice when payonce refuses it: the dialog stays, with `text`, one key. */
async function doubleSubmitRefused(text) {
  const before = writes.length;
  await page.locator('dialog[open] button[type=submit]').dblclick();
  await page.locator('dialog[open] .error', { hasText: text }).waitFor();
  const sent = await eventually('both submits', () => (writes.length >= before + 2 ? writes.slice(before) : null));
  assert.equal(sent.length, 2, `a double click sends twice: ${JSON.stringify(sent)}`);
  assert.equal(sent[0].key, sent[1].key, 'both with the key the dialog made when it opened');
  await page.locator('dialog[open] .error', { hasText: text }).waitFor();
  const message = await page.locator('dialog[open] .error').textContent();
  await page.locator('dialog[open] button', { hasText: 'Cancel' }).click();
  return { sent: sent[0], message };
}

async function assertNoInjection(base = BASE, target = page) {
  const injected = await target.evaluate(() => ({
    xss: window.__xss,
    images: document.querySelectorAll('img').length,
    scripts: Array.from(document.scripts).map((s) => s.src),
  }));
  assert.equal(injected.xss, undefined, 'no probe ran');
  assert.equal(injected.images, 0, 'no probe became an element');
  assert.deepEqual(injected.scripts, [`${base}/console/console.js`], 'the only script is the console');
}

/** What the operator reads never holds a literal null, undefined or NaN. */
async function assertReadable(target = page) {
  const text = await target.evaluate(() => document.body.innerText);
  for (const bad of [/\bnull\b/, /\bundefined\b/, /\bNaN\b/, /\[object Object\]/]) {
    assert.ok(!bad.test(text), `${bad} on ${await target.evaluate(() => location.hash)}: ${text.slice(0, 2000)}`);
  }
}

/** The overview's bars are the stats API's counts, bucket by bucket. */
async function assertChartsMatch(windowName) {
  await page.goto(BASE + '/console#/overview?window=' + windowName);
  await page.locator(`.tabs a.current[data-window="${windowName}"]`).waitFor();
  await page.locator('#chart-payments').waitFor();
  const stats = (await call('GET', `/v1/admin/stats?window=${windowName}`)).body;
  assert.equal(stats.window, windowName);
  assert.equal(stats.buckets.length, windowName === '1h' ? 60 : 96, 'every bucket, empty ones too');
  const drawn = await page.evaluate(() => Array.from(document.querySelectorAll('#chart-payments rect.bar'),
    (r) => [r.getAttribute('data-start'), r.getAttribute('data-series'), Number(r.getAttribute('data-count'))]));
  const expected = stats.buckets.flatMap((b) => Object.entries(b.payments).filter(([, n]) => n > 0).map(([o, n]) => [b.start, o, n]));
  const key = (rows) => rows.map((r) => r.join(' ')).sort();
  assert.deepEqual(key(drawn), key(expected), 'one bar part per bucket and outcome, of its count');
  assert.ok(expected.length > 0, 'the day has payments');
  const findings = await page.evaluate(() => Object.fromEntries(Array.from(document.querySelectorAll('#chart-findings rect.bar'),
    (r) => [r.getAttribute('data-series'), Number(r.getAttribute('data-count'))])));
  assert.deepEqual(findings, Object.fromEntries(Object.entries(stats.now.findings).filter(([, n]) => n > 0)));
  const pending = Number(await page.locator('#backlog-pending').textContent());
  assert.ok(Math.abs(pending - stats.now.webhook_pending) <= 2, `backlog ${pending} vs ${stats.now.webhook_pending}`);
  return stats;
}

const views = [];
function covered(view, what) {
  views.push(`${view}: ${what}`);
}

try {
  // The page and its headers.
  const served = await fetch(BASE + '/console');
  const csp = served.headers.get('content-security-policy');
  assert.ok(csp.includes("script-src 'self'") && !csp.includes('unsafe'), csp);
  assert.equal(served.headers.get('set-cookie'), null, 'no cookie');

  // Sign in: nothing is asked or shown before the API accepts the token.
  await page.goto(BASE + '/console');
  await page.locator('input[name=token]').waitFor();
  await page.locator('input[name=token]').fill('a-wrong-token');
  await page.locator('button[type=submit]').click();
  await page.locator('.error', { hasText: 'refused the token' }).waitFor();
  assert.equal(await page.locator('#status').textContent(), '', 'no count before a token is accepted');
  assert.equal(await page.locator('#nav').isHidden(), true);
  assert.deepEqual(requests.filter((u) => /metrics|stats|healthz|inspections|orders/.test(u)), [], 'nothing but the token check was asked');
  await assertReadable();
  await page.locator('input[name=token]').fill(TOKEN);
  await shot('01-sign-in');
  await page.locator('button[type=submit]').click();
  await page.locator('h1', { hasText: 'Overview' }).waitFor();
  assert.equal(await page.evaluate(() => sessionStorage.getItem('payonce.console.token')), TOKEN);
  assert.equal((await page.context().cookies()).length, 0, 'no cookie');
  await page.locator('#health', { hasText: 'healthy' }).waitFor();
  covered('sign in + header', 'silent before the token is accepted (a wrong one shows no count), sessionStorage, no cookie');

  // Every word in both languages.
  const strings = await page.evaluate(() => window.PAYONCE_STRINGS);
  assert.deepEqual(Object.keys(strings).sort(), ['en', 'zh-CN']);
  assert.deepEqual(Object.keys(strings['zh-CN']).sort(), Object.keys(strings.en).sort(), 'the same sentences in zh-CN and en');
  for (const [name, text] of Object.entries(strings.en)) {
    const vars = (x) => (x.match(/\{\w+\}/g) || []).sort().join();
    assert.equal(vars(strings['zh-CN'][name]), vars(text), `${name} takes the same values in both languages`);
  }

  // The overview: the charts are the stats API's counts.
  await assertChartsMatch('24h');
  const hour = await assertChartsMatch('1h');
  assert.deepEqual(Object.fromEntries(Object.entries((await page.evaluate(() => Object.fromEntries(Array.from(
    document.querySelectorAll('#chart-payments [data-total]'), (e) => [e.getAttribute('data-total'), Number(e.textContent)]))))).sort()),
  Object.fromEntries(Object.entries(hour.buckets.reduce((acc, b) => { for (const [o, n] of Object.entries(b.payments)) acc[o] = (acc[o] || 0) + n; return acc; }, {})).filter(([, n]) => n >= 0).sort()));
  await page.locator('#duplicates', { hasText: /^[1-9]/ }).waitFor();
  assert.ok((await page.locator('main').textContent()).includes('since this process started'));
  await page.locator('#callbacks', { hasText: 'paid twice 1' }).waitFor();
  await assertReadable();
  await shot('02-overview');
  copyFileSync(join(SHOTS, '02-overview.png'), join(SHOTS, 'readme-overview.png'));
  covered('overview', 'payments by outcome per bucket equal to GET /v1/admin/stats (1h and 24h), findings by kind, backlog, duplicates since this process started');

  // Orders: what needs attention, money, channel.
  await page.goto(BASE + '/console#/orders');
  const twiceRow = page.locator('#orders tbody tr', { hasText: 'ORD-TWICE' });
  await twiceRow.waitFor();
  assert.ok((await twiceRow.textContent()).includes('¥258.00'), await twiceRow.textContent());
  assert.equal(await twiceRow.locator('[data-channels]').getAttribute('data-channels'), 'wechatpay alipay');
  const twiceFlags = (await twiceRow.locator('[data-flags]').getAttribute('data-flags')).split(' ');
  assert.ok(twiceFlags.includes('extra') && twiceFlags.includes('finding'), twiceFlags.join(' '));
  const flagsOf = async (orderNo) => {
    const row = page.locator('#orders tbody tr', { hasText: orderNo }).first();
    return (await row.locator('[data-flags]').count()) ? (await row.locator('[data-flags]').getAttribute('data-flags')) : '';
  };
  assert.ok((await flagsOf('ORD-CLOSED')).includes('extra'));
  assert.ok((await flagsOf('ORD-WRONG')).includes('finding'));
  assert.ok((await flagsOf('ORD-REFUNDED')).includes('finding'), 'the unexpected refund');
  assert.equal(await flagsOf('ORD-OTHER-1'), '');
  assert.ok((await page.locator('#orders tbody tr', { hasText: 'ORD-WRONG' }).textContent()).includes('waiting for payment'));
  await assertReadable();
  await shot('03-orders');
  await page.locator('select[name=attention]').selectOption('extra');
  await page.locator('button', { hasText: 'Search' }).click();
  await page.waitForFunction(() => location.hash.includes('attention=extra'));
  await page.locator('#orders tbody tr', { hasText: 'ORD-CLOSED' }).waitFor();
  const extra = (await page.locator('#orders tbody tr td:first-child').allTextContents()).sort();
  assert.deepEqual(extra, ['ORD-CLOSED', 'ORD-TWICE', 'ORD-WRONG'], extra.join(','));
  await page.goto(BASE + '/console#/orders?attention=dead');
  await page.locator('.note', { hasText: 'needing attention' }).waitFor();
  await page.locator('select[name=attention]').selectOption('');
  await page.locator('input[name=user_id]').fill('u-other');
  await page.locator('button', { hasText: 'Search' }).click();
  await page.waitForFunction(() => document.querySelectorAll('#orders tbody tr').length === 3);
  await page.locator('input[name=user_id]').fill(PROBE);
  await page.locator('button', { hasText: 'Search' }).click();
  await page.locator('.error, .empty').first().waitFor();
  await assertNoInjection();
  await page.locator('input[name=order_no]').fill(PROBE);
  await page.locator('button', { hasText: 'Search' }).click();
  // The probe holds a `/`, so the API refuses the path itself (404 not_found); the heading shows it as text.
  await page.locator('.error', { hasText: '404' }).waitFor();
  assert.ok((await page.locator('h1').textContent()).includes('<script>window.__xss=2</script>'), 'the probe is shown as text');
  await assertNoInjection();
  covered('orders', 'flags (open finding, extra payment, refund in flight, dead letter) and their filters, channel column, money; search with the probe as text');

  // The order paid twice: its story in time order.
  await page.goto(BASE + '/console#/order/ORD-TWICE');
  await page.locator('#timeline').waitFor();
  assert.equal(await page.locator('#order-amount').textContent(), '¥258.00');
  const marks = (await page.locator('.summary [data-flags]').getAttribute('data-flags')).split(' ');
  assert.ok(['finding', 'extra', 'dead'].every((f) => marks.includes(f)), `the order page marks it too: ${marks}`);
  const story = await page.locator('#timeline > li').evaluateAll((items) => items.map((li) => ({
    kind: li.getAttribute('data-kind'), pay: li.getAttribute('data-pay-no'), text: li.querySelector('.tl-text').textContent,
    at: li.querySelector('time').getAttribute('datetime'),
  })));
  assert.equal(story[0].kind, 'created', JSON.stringify(story));
  const paid = story.filter((item) => item.kind === 'payment');
  assert.deepEqual(paid.map((p) => p.pay), [TX_TWICE, 'ALI-T1'], 'both payments, WeChat Pay first');
  assert.ok(paid[0].text.includes('WeChat Pay') && paid[0].text.includes('¥258.00') && paid[0].text.includes('paid the order'), paid[0].text);
  assert.ok(paid[1].text.includes('Alipay') && paid[1].text.includes('¥258.00') && paid[1].text.includes('paid again'), paid[1].text);
  assert.ok(paid[1].text.includes('needs a decision'), paid[1].text);
  assert.deepEqual(story.map((s) => s.at), story.map((s) => s.at).slice().sort(), 'in time order');
  assert.ok(story.some((s) => s.kind === 'event' && s.text.includes('order paid')), 'the order.paid event in words');
  const deliveryLines = story.filter((s) => s.kind === 'webhook');
  assert.equal(deliveryLines.length, (await order('ORD-TWICE')).webhook_deliveries.length, 'each of its webhook deliveries');
  assert.ok(deliveryLines.length > 0 && deliveryLines.every((d) => d.text.includes('attempt')), JSON.stringify(deliveryLines));
  await page.locator(`#timeline li[data-pay-no="ALI-T1"] button[data-resolve="ALI-T1"]`).waitFor();
  await assertReadable();
  await shot('04-order-timeline');
  await page.screenshot({ path: join(SHOTS, 'readme-timeline.png'), clip: { x: 0, y: 0, width: 1280, height: 860 } });
  covered('order', 'money, flags, the timeline (created, both payments with channel/source/decision/resolution, events, webhook attempts) in time order, actions in place');

  // Display zone: UTC on hover, the switch moves every time.
  const created = page.locator('#timeline > li').first().locator('time');
  const iso = await created.getAttribute('datetime');
  assert.ok((await created.getAttribute('title')).endsWith('UTC'));
  await page.locator('#zone').selectOption('UTC');
  await page.locator('#timeline').waitFor();
  const hhmm = (date, offset) => new Date(new Date(date).getTime() + offset * 3600000).toISOString().slice(11, 16);
  await page.locator('#timeline > li time').first().filter({ hasText: hhmm(iso, 0) }).waitFor();
  await page.locator('#zone').selectOption('Asia/Shanghai');
  await page.locator('#timeline > li time').first().filter({ hasText: hhmm(iso, 8) }).waitFor();
  covered('time', 'display zone switch (browser, Asia/Shanghai, UTC), UTC on hover, durations in words');

  // Refund part of a paid order, once, from its page, in money.
  await createOrder('ORD-PART', 'u-part');
  assert.equal((await genericCallback('/v1/callbacks/generic', { pay_no: 'PAY-P1', order_no: 'ORD-PART', amount: 1000, status: 'SUCCESS' })).body.outcome, 'applied');
  await page.goto(BASE + '/console#/order/ORD-PART');
  await page.locator('button[data-refund-part="ORD-PART"]').click();
  await page.locator('dialog[open]', { hasText: '¥10.00 of ¥10.00' }).waitFor();
  await page.locator('dialog[open] input[name=refund_no]').fill('RF-PART-1');
  await page.locator('dialog[open] input[name=amount]').fill('3.00');
  await page.locator('dialog[open] input[name=reason]').fill(`one cup broken ${PROBE}`);
  await shot('05-refund-part');
  const partial = await doubleSubmit();
  assert.equal(partial.method, 'POST');
  await page.locator('#timeline li[data-kind=refund]', { hasText: 'RF-PART-1' }).waitFor();
  const refundText = await page.locator('#timeline li[data-kind=refund]', { hasText: 'RF-PART-1' }).textContent();
  assert.ok(refundText.includes('¥3.00') && refundText.includes('one cup broken <img src=x'), refundText);
  const part = await order('ORD-PART');
  assert.equal(part.status, 'REFUNDING');
  assert.equal(part.refunding_amount, 300);
  assert.equal(part.refunds.length, 1, JSON.stringify(part.refunds));
  await assertNoInjection();
  await page.goto(BASE + '/console#/orders?attention=refunding');
  await page.locator('#orders tbody tr', { hasText: 'ORD-PART' }).locator('[data-flag=refunding]').waitFor();
  covered('order', 'refund part in money: one refund of ¥3.00, the probe in its reason shown as text');

  // Record-only, with its confirmation.
  await page.locator('#nav a[data-view=mode]').click();
  await page.locator('#switch-mode[data-target=record_only]').click();
  await page.locator('dialog[open]', { hasText: 'decides nothing' }).waitFor();
  await shot('06-mode-confirm');
  const toRecordOnly = await doubleSubmit();
  assert.equal(toRecordOnly.method, 'PUT');
  await page.locator('#mode-now[data-mode=record_only]').waitFor();
  assert.equal((await call('GET', '/v1/admin/mode')).body.mode, 'record_only');
  assert.equal((await genericCallback('/v1/callbacks/generic', { pay_no: 'PAY-L1', order_no: 'ORD-LATE', amount: 1000, status: 'SUCCESS' })).body.outcome, 'recorded');
  await page.reload();
  await page.locator('#waiting-now', { hasText: '1' }).waitFor();
  await page.locator('#waiting', { hasText: 'records waiting: 1' }).waitFor();
  await shot('07-record-only-waiting');
  covered('mode', 'the switch, its confirmation, the count of records waiting');

  // Findings in words: refuse, resolve, and one resolved in place from its order.
  await page.locator('#nav a[data-view=findings]').click();
  await page.locator('button[data-resolve="ALI-T1"]').waitFor();
  const aliFinding = await page.locator('#findings li', { hasText: 'ALI-T1' }).textContent();
  assert.ok(aliFinding.includes('¥258.00') && aliFinding.includes('Alipay') && aliFinding.includes('paid again'), aliFinding);
  const wrongFinding = await page.locator('#findings li', { hasText: 'PAY-W1' }).textContent();
  assert.ok(wrongFinding.includes('¥5.99') && wrongFinding.includes('different amount'), wrongFinding);
  assert.ok((await page.locator('#findings li[data-kind=unexpected_refund]').textContent()).includes('never requested'));
  await page.locator('#findings li[data-kind=unexpected_refund] details summary').click();
  await page.locator('#findings li[data-kind=unexpected_refund] details pre', { hasText: '"refund_no": "RX-1"' }).waitFor();
  await assertReadable();
  await shot('08-findings');
  await page.screenshot({ path: join(SHOTS, 'readme-findings.png'), clip: { x: 0, y: 0, width: 1280, height: 400 } });
  await page.locator('button[data-refund="ALI-T1"]').click();
  await page.locator('dialog[open] [data-field=channel]', { hasText: 'Alipay' }).waitFor();
  const refusedAlipay = await doubleSubmitRefused('channel_not_configured');
  assert.ok(refusedAlipay.sent.url.endsWith('/v1/admin/payments/ALI-T1/refund'), refusedAlipay.sent.url);
  assert.ok(refusedAlipay.message.includes('404') && refusedAlipay.message.includes('by hand'), refusedAlipay.message);
  assert.equal((await order('ORD-TWICE')).payments.find((p) => p.pay_no === 'ALI-T1').resolution ?? null, null, 'nothing changed');
  await page.locator('button[data-resolve="ALI-T1"]').click();
  await page.locator('dialog[open] textarea[name=reason]').fill(`refunded by hand ${PROBE}`);
  await page.locator('dialog[open] select[name=resolution]').selectOption('refunded_externally');
  await doubleSubmit();
  await page.locator('button[data-resolve="RX-1"]').click();
  await page.locator('dialog[open] textarea[name=reason]').fill(`platform refund accepted ${PROBE}`);
  await page.locator('dialog[open] select[name=resolution]').selectOption('accepted');
  await doubleSubmit();
  await page.waitForFunction(() => !document.querySelector('button[data-resolve="ALI-T1"], button[data-resolve="RX-1"]'));
  const twice = await order('ORD-TWICE');
  assert.equal(twice.audit.filter((a) => a.action.includes('resolved')).length, 1, `one resolution of ALI-T1: ${JSON.stringify(twice.audit)}`);
  const refunded = await order('ORD-REFUNDED');
  assert.equal(refunded.audit.filter((a) => a.action.includes('resolved')).length, 1, JSON.stringify(refunded.audit));
  // The payment after close, resolved where it is told: on its order's timeline.
  await page.goto(BASE + '/console#/order/ORD-CLOSED');
  await page.locator('#timeline li[data-pay-no="PAY-C1"] button[data-resolve="PAY-C1"]').click();
  await page.locator('dialog[open] textarea[name=reason]').fill(`kept as a tip ${PROBE}`);
  await page.locator('dialog[open] select[name=resolution]').selectOption('accepted');
  await doubleSubmit();
  await page.locator('#timeline li[data-kind=audit]', { hasText: 'kept as a tip <img src=x' }).waitFor();
  assert.ok((await page.locator('#timeline li[data-pay-no="PAY-C1"]').textContent()).includes('accepted as it is'));
  assert.equal((await order('ORD-CLOSED')).audit.filter((a) => a.action === 'payment_resolved').length, 1);
  await page.goto(BASE + '/console#/order/ORD-TWICE');
  await page.locator('#timeline li[data-kind=audit]', { hasText: 'refunded by hand <img src=x' }).waitFor();
  assert.ok((await page.locator('#timeline li[data-pay-no="ALI-T1"]').textContent()).includes('refunded outside payonce'));
  await assertNoInjection();
  await shot('09-order-audit');
  covered('findings', 'one sentence per kind with money, raw JSON behind a disclosure; refund refused on a channel without outgoing settings; resolved once each, from the findings and in place on the timeline; the probe as reasons');

  // Back to normal, then drain.
  await page.goto(BASE + '/console#/mode');
  await page.locator('#switch-mode[data-target=normal]').click();
  await doubleSubmit();
  await page.locator('#mode-now[data-mode=normal]').waitFor();
  await page.locator('#drain').click();
  await doubleSubmit();
  await page.locator('#drained', { hasText: 'Decided 1 record' }).waitFor();
  await page.locator('#waiting-now', { hasText: '0' }).waitFor();
  const late = await order('ORD-LATE');
  assert.equal(late.status, 'PAID');
  assert.equal(late.coupons.length, 1, 'one coupon after a double-clicked drain');

  // Reconcile a statement with one payment payonce never recorded, then repair it.
  const today = new Date().toISOString();
  const statement = join(work, 'statement.csv');
  writeFileSync(statement, 'pay_no,order_no,amount,status,paid_at\n'
    + `PAY-P1,ORD-PART,1000,SUCCESS,${today}\n`
    + `PAY-R1,ORD-REFUNDED,1000,SUCCESS,${today}\n`
    + `PAY-L1,ORD-LATE,1000,SUCCESS,${today}\n`
    + `MISS-1,ORD-MISSING,1000,SUCCESS,${today}\n`);
  await page.locator('#nav a[data-view=reconcile]').click();
  await page.locator('input[name=date]').fill(PROBE);
  await page.locator('input[type=file]').setInputFiles(statement);
  await page.locator('#compare').click();
  await page.locator('#recon-result .error').waitFor();
  await assertNoInjection();
  const hostile = join(work, 'hostile.csv');
  writeFileSync(hostile, `pay_no,order_no,amount,status,paid_at\n${PROBE},ORD-X,1,SUCCESS,${new Date().toISOString()}\n`);
  await page.locator('input[name=date]').fill('');
  await page.locator('input[type=file]').setInputFiles(hostile);
  await page.locator('#compare').click();
  await page.locator('#recon-result .error, #recon-result table').first().waitFor();
  await assertNoInjection();
  await page.locator('input[type=file]').setInputFiles(statement);
  await page.locator('#compare').click();
  await page.locator('#recon-result table', { hasText: 'MISS-1' }).waitFor();
  const summary = await page.locator('#recon-summary').textContent();
  assert.ok(summary.includes('3 matched'), summary);
  assert.ok((await page.locator('#recon-result table tr', { hasText: 'MISS-1' }).textContent()).includes('¥10.00'));
  await assertReadable();
  await shot('10-reconcile-differences');
  await page.locator('#repair').click();
  await page.locator('dialog[open]', { hasText: 'never recorded' }).waitFor();
  await doubleSubmit();
  await page.locator('#recon-result', { hasText: 'Repaired' }).waitFor();
  await shot('11-reconcile-repaired');
  const missing = await order('ORD-MISSING');
  assert.equal(missing.status, 'PAID');
  assert.deepEqual(missing.payments.map((p) => p.source), ['reconciliation'], 'repaired once');
  covered('reconcile', 'upload, format, differences in money, repair with its confirmation, once; the probe as date and as statement text');

  // Webhooks per endpoint: a dead letter retried, all of them at once, a replay, the gone endpoint re-enabled.
  const failedNow = async () => (await call('GET', '/v1/webhooks/deliveries?status=failed&limit=1000')).body.deliveries;
  const failing = 'http://127.0.0.1:9/payonce';
  await eventually('dead letters', async () => (await failedNow()).filter((d) => d.endpoint === failing).length >= 5);
  await eventually('the gone endpoint disabled', async () => (await call('GET', '/v1/webhooks/deliveries?status=disabled')).body.deliveries.length > 0);
  const target = (await failedNow()).find((d) => d.endpoint === failing);
  await page.goto(BASE + '/console#/webhooks?status=failed');
  await page.locator(`#deliveries button[data-retry="${target.id}"]`).click();
  await doubleSubmit();
  assert.deepEqual(db("SELECT count(*) FROM audit_log WHERE action = 'webhook_delivery_retried'"), [[1]]);
  await eventually('the retried one dead again', async () => (await failedNow()).some((d) => d.id === target.id));
  await page.goto(BASE + '/console#/webhooks');
  const card = page.locator(`#endpoints li[data-endpoint="${failing}"]`);
  await card.waitFor();
  assert.equal(await card.getAttribute('data-state'), 'failing');
  const dead = (await failedNow()).filter((d) => d.endpoint === failing);
  assert.equal(Number(await card.locator('.counts').getAttribute('data-failed')), dead.length);
  const gone = page.locator(`#endpoints li[data-endpoint="${GONE_URL}"]`);
  assert.equal(await gone.getAttribute('data-state'), 'disabled');
  await assertReadable();
  await shot('12-webhooks');
  await card.locator('button[data-retry-all]').click();
  await page.locator('dialog[open]', { hasText: `Send ${dead.length} dead letter(s)` }).waitFor();
  await doubleSubmit(dead.length);
  await page.locator('#retried-all', { hasText: `${dead.length} delivery` }).waitFor();
  assert.deepEqual(db("SELECT count(*) FROM audit_log WHERE action = 'webhook_delivery_retried'"), [[1 + dead.length]], 'each dead letter retried once');
  await page.locator(`#endpoints li[data-endpoint="${failing}"] button[data-replay]`).click();
  await page.locator('dialog[open] input[name=after_seq]').fill('0');
  await page.locator('dialog[open] input[name=until_seq]').fill('2');
  await doubleSubmit();
  await page.locator('#replayed', { hasText: '2 event(s) queued' }).waitFor();
  assert.deepEqual(db("SELECT count(*) FROM audit_log WHERE action = 'webhook_replayed'"), [[1]]);
  await page.locator(`#endpoints li[data-endpoint="${GONE_URL}"] button[data-enable]`).click();
  await doubleSubmit();
  await page.locator('#enabled', { hasText: 'enabled' }).waitFor();
  assert.deepEqual(db("SELECT count(*) FROM audit_log WHERE action = 'webhook_endpoint_enabled'"), [[1]]);
  covered('webhooks', 'per endpoint (state, delivered/pending/failed, oldest pending); retry one, retry every dead letter, replay a range, re-enable: each double-clicked, once');

  // Both languages, every view: Chinese chosen from the browser, English by the switch.
  const zh = await newTab('zh-CN');
  await signIn(BASE, zh);
  assert.equal(await zh.evaluate(() => document.documentElement.lang), 'zh-CN');
  const routes = [['overview', '概览', 'Overview'], ['orders', '订单', 'Orders'], ['order/ORD-TWICE', '订单 ORD-TWICE', 'Order ORD-TWICE'],
    ['findings', '巡检发现', 'Findings'], ['mode', '运行模式', 'Mode'], ['reconcile', '对账', 'Reconcile'], ['webhooks', 'Webhook', 'Webhooks']];
  for (const [view, chinese] of routes) {
    await zh.goto(`${BASE}/console#/${view}`);
    await zh.locator('h1', { hasText: chinese }).waitFor();
    await zh.locator('main :is(table, ol, ul, figure, form, section)').first().waitFor();
    await assertReadable(zh);
    await assertNoInjection(BASE, zh);
    await shot(`zh-${view.replace('/', '-')}`, zh);
  }
  await zh.goto(`${BASE}/console#/order/ORD-TWICE`);
  const zhStory = await zh.locator('#timeline li[data-pay-no="ALI-T1"]').textContent();
  assert.ok(zhStory.includes('支付宝') && zhStory.includes('¥258.00') && zhStory.includes('重复支付'), zhStory);
  await zh.goto(`${BASE}/console#/findings`);
  await zh.locator('#findings li[data-kind=refund_required]', { hasText: '支付金额与订单不符' }).waitFor();
  await zh.locator('#lang').selectOption('en');
  await zh.locator('h1', { hasText: 'Findings' }).waitFor();
  for (const [view, , english] of routes) {
    await zh.goto(`${BASE}/console#/${view}`);
    await zh.locator('h1', { hasText: english }).waitFor();
    await zh.locator('main :is(table, ol, ul, figure, form, section)').first().waitFor();
    await assertReadable(zh);
    await shot(`en-${view.replace('/', '-')}`, zh);
  }
  await zh.context().close();
  covered('languages', 'every view in zh-CN (from the browser) and en (by the switch), no literal null');

  // A phone: the order page and the findings at 390 px, nothing wider than the screen.
  const phone = await newTab('zh-CN', { width: 390, height: 844 });
  await signIn(BASE, phone);
  for (const view of ['order/ORD-TWICE', 'findings', 'orders']) {
    await phone.goto(`${BASE}/console#/${view}`);
    await phone.locator('main :is(ol, ul, table)').first().waitFor();
    const wide = await phone.evaluate(() => document.documentElement.scrollWidth);
    assert.ok(wide <= 390, `${view} is ${wide} px wide at 390`);
    await shot(`phone-${view.replace('/', '-')}`, phone);
  }
  await phone.context().close();
  covered('small screens', 'order page, findings and orders at 390 px without horizontal scrolling');

  // The counts are the database's, across a restart.
  const byName = (rows) => Object.fromEntries(rows.filter(([, n]) => n > 0).sort());
  const statsTotals = (stats) => ({
    payments: byName(Object.entries(stats.buckets.reduce((acc, b) => { for (const [o, n] of Object.entries(b.payments)) acc[o] = (acc[o] || 0) + n; return acc; }, {}))),
    refunds: byName(Object.entries(stats.buckets.reduce((acc, b) => { for (const [o, n] of Object.entries(b.refunds)) acc[o] = (acc[o] || 0) + n; return acc; }, {}))),
  });
  const before = statsTotals((await call('GET', '/v1/admin/stats?window=24h')).body);
  payonce.kill();
  await new Promise((r) => payonce.once('exit', r));
  ({ child: payonce, base: BASE } = await startPayonce(MAIN_ARGS));
  const after = statsTotals((await call('GET', '/v1/admin/stats?window=24h')).body);
  assert.deepEqual(after, before, 'the same counts after a restart');
  const ledger = {
    payments: byName(db("SELECT CASE WHEN state = 'received' THEN 'recorded' ELSE outcome END, count(*) FROM pay_callback_log GROUP BY 1")),
    refunds: byName(db('SELECT status, count(*) FROM refund GROUP BY 1')),
  };
  assert.deepEqual(after, ledger, 'the stats API is the database');
  assert.equal(after.payments.already_paid, 1);
  await signIn();
  await page.locator('#callbacks', { hasText: `paid ${ledger.payments.applied}` }).waitFor();
  covered('stats', 'GET /v1/admin/stats equal to the database after a restart; the header from it');

  // close_unconfirmed (docs/platforms.md): a second payonce whose WeChat Pay never answers gives up on an
  // expired order's close, closes it here and says so; the console resolves it, once.
  const second = await startPayonce([
    '--wechatpay-mchid', '1900000100', '--wechatpay-merchant-serial', 'M1',
    '--wechatpay-merchant-key', join(ROOT, 'tests/fixtures/keys/merchant.pem'),
    '--wechatpay-public-key', `S1=${join(ROOT, 'tests/fixtures/keys/platform-cert-valid.pem')}`,
    '--wechatpay-api-base', 'http://127.0.0.1:9', '--platform-timeout-ms', '500',
    '--platform-retry-s', '0.1', '--close-give-up-s', '1', '--sweep-interval-s', '1',
  ], 'second.db');
  try {
    const created = await call('POST', '/v1/orders', { json: { order_no: 'ORD_GIVEN_UP', user_id: 'u-gone', amount: 1000, expires_in_s: 1 }, base: second.base });
    assert.equal(created.status, 201, JSON.stringify(created.body));
    let unconfirmed = [];
    const until = Date.now() + 20000;
    while (!unconfirmed.length && Date.now() < until) {
      unconfirmed = (await call('GET', '/v1/inspections', { base: second.base })).body.findings.filter((f) => f.kind === 'close_unconfirmed');
      if (!unconfirmed.length) await new Promise((r) => setTimeout(r, 200));
    }
    assert.equal(unconfirmed.length, 1, 'payonce gave up and reported close_unconfirmed');
    // Another origin, another tab's storage: sign in there too.
    await signIn(second.base);
    await page.goto(second.base + '/console#/findings');
    await page.locator('button[data-resolve-close="ORD_GIVEN_UP"]').click();
    await page.locator('dialog[open] textarea[name=reason]').fill(`never paid, checked by hand ${PROBE}`);
    await shot('14-close-unconfirmed');
    await doubleSubmit();
    await page.waitForFunction(() => !document.querySelector('button[data-resolve-close]'));
    const gone = await call('GET', '/v1/orders/ORD_GIVEN_UP', { base: second.base });
    assert.equal(gone.body.audit.filter((a) => a.action === 'close_resolved').length, 1, JSON.stringify(gone.body.audit));
    await page.goto(second.base + '/console#/order/ORD_GIVEN_UP');
    await page.locator('#timeline li[data-kind=audit]', { hasText: 'never paid, checked by hand <img src=x' }).waitFor();
    const calls = await page.locator('#timeline li[data-kind=call]').allTextContents();
    assert.ok(calls.some((c) => c.includes('WeChat Pay') && c.includes('close the trade') && c.includes('given up')), calls.join('\n'));
    await shot('13-order-platform-calls');
    await assertNoInjection(second.base);
    covered('findings', 'close_unconfirmed resolved once through resolve-close, the probe as its reason');
    covered('order', 'platform calls in words on the timeline (channel, kind, status, attempts)');
  } finally {
    second.child.kill();
  }

  // Money payonce did not want, returned once (docs/platforms.md, "Money payonce did not want"): a third payonce whose WeChat Pay
  // is this test. Two orders paid through generic and then again through WeChat Pay, one paid twice
  // through generic.
  await new Promise((resolvePromise) => wechatServer.listen(0, '127.0.0.1', resolvePromise));
  const wechatBase = `http://127.0.0.1:${wechatServer.address().port}`;
  const third = await startPayonce([
    '--wechatpay-apiv3-key', WECHAT_APIV3_KEY,
    '--wechatpay-public-key', `${WECHAT_SERIAL}=${join(ROOT, 'tests/fixtures/keys/platform-cert-valid.pem')}`,
    '--wechatpay-mchid', WECHAT_MCHID, '--wechatpay-merchant-serial', 'M1',
    '--wechatpay-merchant-key', join(ROOT, 'tests/fixtures/keys/merchant.pem'),
    // The platform-call pool looks for due calls every sweep interval.
    '--wechatpay-api-base', wechatBase, '--platform-retry-s', '0.2', '--sweep-interval-s', '1',
  ], 'third.db');
  try {
    const wx = third.base;
    const TX1 = '4200000001202607010000000001';
    const TX2 = '4200000001202607010000000002';
    for (const [orderNo, first, again] of [['ORD-WX-1', 'PAY-WXG1', TX1], ['ORD-WX-2', 'PAY-WXG2', TX2], ['ORD-WX-3', 'PAY-WXG3', null]]) {
      await createOrder(orderNo, 'u-wechat', 1000, wx);
      assert.equal((await genericCallback('/v1/callbacks/generic', { pay_no: first, order_no: orderNo, amount: 1000, status: 'SUCCESS' }, wx)).body.outcome, 'applied');
      if (again) await wechatPaid(wx, orderNo, again);
      else assert.equal((await genericCallback('/v1/callbacks/generic', { pay_no: 'PAY-WXG3B', order_no: orderNo, amount: 1000, status: 'SUCCESS' }, wx)).body.outcome, 'already_paid');
    }
    const required = (await call('GET', '/v1/inspections', { base: wx })).body.findings.filter((f) => f.kind === 'refund_required');
    assert.deepEqual(required.map((f) => f.detail.pay_no).sort(), ['PAY-WXG3B', TX1, TX2].sort(), JSON.stringify(required));
    await signIn(wx);
    await page.goto(wx + '/console#/findings');

    // The generic channel never calls out: 404 channel_not_configured, then resolved by hand.
    await page.locator('button[data-refund="PAY-WXG3B"]').click();
    await page.locator('dialog[open] [data-field=channel]', { hasText: 'generic' }).waitFor();
    const refusedGeneric = await doubleSubmitRefused('channel_not_configured');
    assert.ok(refusedGeneric.message.includes('generic has no outgoing settings') && refusedGeneric.message.includes('by hand'), refusedGeneric.message);
    await page.locator('button[data-resolve="PAY-WXG3B"]').click();
    await page.locator('dialog[open] textarea[name=reason]').fill('refunded by hand in the generic platform');
    await page.locator('dialog[open] select[name=resolution]').selectOption('refunded_externally');
    await doubleSubmit();
    await page.waitForFunction(() => !document.querySelector('button[data-refund="PAY-WXG3B"]'));

    // Refund to the buyer, double-clicked: one refund at WeChat Pay, by transaction_id, of the whole amount.
    await page.locator(`button[data-refund="${TX1}"]`).click();
    const dialogText = await page.locator('dialog[open]').textContent();
    for (const shown of [TX1, 'WeChat Pay', 'wechatpay', '¥10.00', 'already_paid']) assert.ok(dialogText.includes(shown), `${shown} in ${dialogText}`);
    assert.equal(await page.locator('dialog[open] input[name=reason]').inputValue(), 'Duplicate payment refunded');
    await page.locator('dialog[open] input[name=reason]').fill(`dup ${PROBE}`);
    await shot('15-refund-to-buyer');
    const refundSent = await doubleSubmit();
    assert.ok(refundSent.url.endsWith(`/v1/admin/payments/${TX1}/refund`), refundSent.url);
    await page.locator('#refund-requested', { hasText: `U-${TX1} of ¥10.00` }).waitFor();
    await page.locator('#refund-requested', { hasText: 'requested at WeChat Pay' }).waitFor();
    await page.locator(`[data-refund-in-flight="${TX1}"]`, { hasText: `refund in flight (U-${TX1})` }).waitFor();
    assert.equal(await page.locator(`button[data-refund="${TX1}"], button[data-resolve="${TX1}"]`).count(), 0, 'no action while the refund is in flight');
    await assertNoInjection(wx);
    await shot('16-refund-in-flight');
    await eventually('the refund at WeChat Pay', () => wechatRefundRequests().length > 0);
    await new Promise((r) => setTimeout(r, 500));
    const asked = wechatRefundRequests();
    assert.equal(asked.length, 1, `one refund request: ${JSON.stringify(asked)}`);
    assert.equal(asked[0].out_refund_no, `U-${TX1}`);
    assert.equal(asked[0].transaction_id, TX1);
    assert.equal(asked[0].out_trade_no, undefined, 'by transaction_id alone');
    assert.deepEqual([asked[0].amount.refund, asked[0].amount.total, asked[0].amount.currency], [1000, 1000, 'CNY']);
    let wx1 = await order('ORD-WX-1', wx);
    let paid = wx1.payments.find((p) => p.pay_no === TX1);
    assert.equal(paid.resolution, 'refunding', JSON.stringify(paid));
    assert.deepEqual(paid.refunds.map((r) => [r.refund_no, r.status, r.amount]), [[`U-${TX1}`, 'REQUESTED', 1000]]);

    // WeChat Pay refuses it: the finding shows the failure and offers the refund again, under -2.
    await wechatRefundSettled(wx, `U-${TX1}`, 'ABNORMAL');
    await page.goto(wx + '/console#/orders');
    await page.goto(wx + '/console#/findings');
    await page.locator(`[data-refund-failed="${TX1}"]`, { hasText: `refund U-${TX1} failed` }).waitFor();
    await shot('17-refund-failed');
    await page.locator(`button[data-refund="${TX1}"]`).click();
    await page.locator('dialog[open]', { hasText: `The last refund, U-${TX1}, failed` }).waitFor();
    await doubleSubmit();
    await page.locator('#refund-requested', { hasText: `U-${TX1}-2 of ¥10.00` }).waitFor();
    await page.locator(`[data-refund-in-flight="${TX1}"]`, { hasText: `U-${TX1}-2` }).waitFor();
    await eventually('the second refund at WeChat Pay', () => wechatRefundRequests(`U-${TX1}-2`).length > 0);

    // It succeeds: the payment is refunded and the finding is gone; the order is untouched.
    await wechatRefundSettled(wx, `U-${TX1}-2`, 'SUCCESS');
    await eventually('the refunded payment', async () => (await order('ORD-WX-1', wx)).payments.find((p) => p.pay_no === TX1).resolution === 'refunded');
    await page.goto(wx + '/console#/orders');
    await page.goto(wx + '/console#/findings');
    await page.locator(`button[data-refund="${TX2}"]`).waitFor();
    await page.waitForFunction((tx) => document.getElementById('findings')
      && !Array.from(document.querySelectorAll('#findings li'), (li) => li.textContent).some((text) => text.includes(tx)), TX1);
    await new Promise((r) => setTimeout(r, 300));
    assert.deepEqual(wechatRefundRequests().map((b) => b.out_refund_no), [`U-${TX1}`, `U-${TX1}-2`], 'one request per refund');
    wx1 = await order('ORD-WX-1', wx);
    paid = wx1.payments.find((p) => p.pay_no === TX1);
    assert.deepEqual(paid.refunds.map((r) => [r.refund_no, r.status]), [[`U-${TX1}`, 'FAILED'], [`U-${TX1}-2`, 'SUCCEEDED']]);
    assert.equal(wx1.status, 'PAID');
    assert.equal(wx1.pay_no, 'PAY-WXG1');
    assert.deepEqual(wx1.refunds, [], "the order's own refunds leave payment refunds out");
    assert.equal(wx1.audit.filter((a) => a.action === 'payment_refund_requested').length, 2, JSON.stringify(wx1.audit));
    assert.equal(wx1.audit.filter((a) => a.action === 'payment_refunded').length, 1, JSON.stringify(wx1.audit));
    assert.equal(wx1.events.filter((e) => e.type === 'payment.refunded').length, 1, JSON.stringify(wx1.events));
    await page.goto(wx + '/console#/order/ORD-WX-1');
    await page.locator(`#timeline li[data-pay-no="${TX1}"]`, { hasText: 'refunded to the buyer' }).waitFor();
    const refundStory = await page.locator('#timeline li[data-kind=refund]').allTextContents();
    assert.ok(refundStory.some((r) => r.includes(`U-${TX1}-2`) && r.includes('succeeded')), refundStory.join('\n'));
    assert.ok(refundStory.some((r) => r.includes(`U-${TX1} `) && r.includes('failed')), refundStory.join('\n'));
    await assertReadable();
    await shot('18-order-payment-refunded');
    await page.goto(wx + '/console#/findings');

    // A dialog left open while someone else resolved the payment: 409 invalid_transition, nothing asked of WeChat Pay.
    await page.locator(`button[data-refund="${TX2}"]`).click();
    const resolvedMeanwhile = await call('POST', `/v1/admin/payments/${TX2}/resolve`, {
      base: wx, headers: { 'Idempotency-Key': 'console-test-resolve-tx2' }, json: { resolution: 'accepted', reason: 'kept, by agreement' },
    });
    assert.equal(resolvedMeanwhile.status, 200, JSON.stringify(resolvedMeanwhile.body));
    const stale = await doubleSubmitRefused('invalid_transition');
    assert.ok(stale.message.includes('409') && stale.message.includes('no longer waiting'), stale.message);
    assert.equal(wechatRefundRequests(`U-${TX2}`).length, 0, 'no refund of a resolved payment');
    await assertNoInjection(wx);
    covered('findings', 'refund to the buyer at WeChat Pay, double-clicked: one refund by transaction_id; in flight; FAILED and offered again (-2); SUCCESS ends the finding');
    covered('findings', 'refund refused: 404 channel_not_configured (generic, alipay) says refund by hand; 409 invalid_transition on a stale dialog');
  } finally {
    third.child.kill();
    wechatServer.close();
    wechatServer.closeAllConnections();
  }
  goneServer.close();
  goneServer.closeAllConnections();

  assert.deepEqual(pageErrors, [], 'no JavaScript error and no CSP violation');
  console.log('console: every view passed in', (await browser.version()));
  for (const view of views) console.log('  covered:', view);
} finally {
  await browser.close();
  payonce.kill();
  if (pageErrors.length) console.error(pageErrors.join('\n'));
  rmSync(work, { recursive: true, force: true });
}
