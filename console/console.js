// payonce's operator console (docs/console.md): the incident runbook
// in a browser, through the public /v1 API only.
//
// Safety rules this file keeps:
// - every value reaches the page as a text node or an attribute through h()
//   or s() (never parsed as HTML), so nothing the API returns can become markup;
// - the token lives in this tab's sessionStorage and travels only as
//   `Authorization: Bearer` (no cookie, so no CSRF); nothing is fetched
//   (no count, no metric) before the API has accepted it;
// - every write gets its Idempotency-Key when its dialog opens and sends
//   the same key on every submit, so a double click is one effect;
// - no inline style: charts are SVG elements with classes (console.css).
'use strict';

const TOKEN_KEY = 'payonce.console.token';
const LANG_KEY = 'payonce.console.lang';
const ZONE_KEY = 'payonce.console.zone';
const main = document.getElementById('main');
const statusBar = document.getElementById('status');
const nav = document.getElementById('nav');
const switches = document.getElementById('switches');
const dialog = document.getElementById('dialog');
const STRINGS = window.PAYONCE_STRINGS;

// ---- language and display zone ----

function browserLang() {
  const wanted = (navigator.languages && navigator.languages.length ? navigator.languages : [navigator.language || 'en']);
  for (const lang of wanted) {
    if (/^zh\b/i.test(lang)) return 'zh-CN';
    if (/^en\b/i.test(lang)) return 'en';
  }
  return 'en';
}

function lang() {
  const saved = localStorage.getItem(LANG_KEY);
  return saved && STRINGS[saved] ? saved : browserLang();
}

const BROWSER_ZONE = Intl.DateTimeFormat().resolvedOptions().timeZone || 'UTC';

function zone() {
  return localStorage.getItem(ZONE_KEY) || BROWSER_ZONE;
}

/** The sentence `key` in the chosen language, `{name}` replaced by vars[name] as text. */
function t(key, vars) {
  const table = STRINGS[lang()] || STRINGS.en;
  const text = table[key] !== undefined ? table[key] : (STRINGS.en[key] !== undefined ? STRINGS.en[key] : key);
  return text.replace(/\{(\w+)\}/g, (whole, name) => {
    const value = vars ? vars[name] : undefined;
    return value === null || value === undefined ? t('dash') : String(value);
  });
}

/** t(prefix + code) when that sentence exists, else the code itself. */
function word(prefix, code) {
  if (code === null || code === undefined) return t('dash');
  const key = prefix + code;
  return STRINGS.en[key] !== undefined ? t(key) : String(code);
}

// ---- DOM ----

/** An element with attributes and children; strings become text nodes. */
function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** The same for SVG elements (the charts). */
function s(tag, attrs, ...children) {
  return build(document.createElementNS('http://www.w3.org/2000/svg', tag), attrs, children);
}

function build(el, attrs, children) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith('on')) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? '' : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** `el`'s children become `nodes`, leaving out the absent ones (replaceChildren would write "null"). */
function fill(el, ...nodes) {
  el.replaceChildren(...nodes.flat(Infinity).filter((node) => node !== null && node !== undefined && node !== false));
}

/** Bumped by each route(): a view still loading for an earlier address must not paint over the newer one. */
let viewSeq = 0;

function show(...nodes) {
  fill(main, ...nodes);
}

/** A show() for the view starting now: it paints only while no later view has started. */
function scopedShow() {
  const mine = viewSeq;
  return (...nodes) => { if (mine === viewSeq) fill(main, ...nodes); };
}

/** A table of `rows` with `columns` = [[heading, row => cell], ...]; an empty cell is a dash. */
function table(columns, rows, emptyText, attrs) {
  if (!rows.length) return h('p', { class: 'empty' }, emptyText || t('none'));
  return h('div', { class: 'scroll' }, h('table', attrs || {},
    h('thead', {}, h('tr', {}, columns.map(([heading]) => h('th', {}, heading)))),
    h('tbody', {}, rows.map((row) => h('tr', {}, columns.map(([heading, cell]) => {
      const value = cell(row);
      return h('td', { 'data-label': heading }, value === null || value === undefined || value === '' ? t('dash') : value);
    }))))));
}

/** A word with its internal code as secondary text. */
function coded(text, code) {
  return h('span', { class: 'coded' }, text, code !== null && code !== undefined && String(code) !== text
    ? h('code', { class: 'code' }, String(code)) : null);
}

/** The raw record behind a disclosure. */
function raw(value) {
  return h('details', { class: 'raw' }, h('summary', {}, t('raw')),
    h('pre', { class: 'mono' }, JSON.stringify(value, null, 2)));
}

function orderLink(orderNo) {
  if (!orderNo) return t('dash');
  return h('a', { href: '#/order/' + encodeURIComponent(orderNo) }, orderNo);
}

function errorText(err) {
  return h('p', { class: 'error', role: 'alert' }, err.message || String(err));
}

// ---- money and time ----

/**
 * Minor units as money in `currency`: payonce keeps every amount as an
 * integer of hundredths (docs/platforms.md), so 129900 CNY is ¥1,299.00.
 * Formatted from the exact decimal text, never through a float.
 */
function money(amount, currency) {
  if (amount === null || amount === undefined) return t('dash');
  const n = BigInt(amount);
  const negative = n < 0n;
  const abs = negative ? -n : n;
  const decimal = `${negative ? '-' : ''}${abs / 100n}.${String(abs % 100n).padStart(2, '0')}`;
  try {
    return new Intl.NumberFormat(lang(), {
      style: 'currency', currency: currency || 'CNY', currencyDisplay: 'narrowSymbol',
      minimumFractionDigits: 2, maximumFractionDigits: 2,
    }).format(decimal);
  } catch (err) {
    return `${decimal} ${currency || ''}`.trim();
  }
}

/** Money from a text field ("12.5", "12.50", "12") to minor units, or null. */
function parseMoney(text) {
  const match = /^\s*(\d{1,13})(?:\.(\d{1,2}))?\s*$/.exec(text || '');
  if (!match) return null;
  return Number(match[1]) * 100 + Number((match[2] || '0').padEnd(2, '0'));
}

function zoneName(id) {
  return id === BROWSER_ZONE ? t('zone.browser', { zone: id }) : id;
}

/** A timestamp as a <time> in the display zone, UTC on hover. */
function when(ts, relative) {
  if (!ts) return t('dash');
  const date = new Date(ts);
  if (Number.isNaN(date.getTime())) return String(ts);
  const text = new Intl.DateTimeFormat(lang(), {
    timeZone: zone(), year: 'numeric', month: '2-digit', day: '2-digit',
    hour: '2-digit', minute: '2-digit', second: '2-digit', hourCycle: 'h23',
  }).format(date);
  return h('time', { datetime: date.toISOString(), title: date.toISOString().replace('.000Z', 'Z') + ' UTC' },
    text, relative ? h('span', { class: 'ago' }, ' · ', ago(date)) : null);
}

/** "3 min ago", "in 5 h". */
function ago(date) {
  const seconds = Math.round((date.getTime() - Date.now()) / 1000);
  if (Math.abs(seconds) < 10) return t('ago.now');
  return relative(seconds);
}

function relative(seconds) {
  const format = new Intl.RelativeTimeFormat(lang(), { numeric: 'always', style: 'short' });
  const abs = Math.abs(seconds);
  if (abs < 60) return format.format(seconds, 'second');
  if (abs < 3600) return format.format(Math.round(seconds / 60), 'minute');
  if (abs < 86400) return format.format(Math.round(seconds / 3600), 'hour');
  return format.format(Math.round(seconds / 86400), 'day');
}

/** A duration in words ("3 min", "2 hr"). */
function duration(seconds) {
  const unit = (value, name) => new Intl.NumberFormat(lang(), { style: 'unit', unit: name, unitDisplay: 'short' }).format(value);
  if (seconds < 60) return unit(Math.round(seconds), 'second');
  if (seconds < 3600) return unit(Math.round(seconds / 60), 'minute');
  if (seconds < 86400) return unit(Math.round(seconds / 360) / 10, 'hour');
  return unit(Math.round(seconds / 8640) / 10, 'day');
}

// ---- the API ----

class ApiError extends Error {
  constructor(status, code, message) {
    super(code ? `${status} ${code}: ${message}` : `${status}: ${message}`);
    this.status = status;
    this.code = code;
  }
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

/** Calls payonce; resolves to the parsed JSON (or text), rejects with ApiError. */
async function api(method, path, options = {}) {
  const headers = {};
  const saved = token();
  if (saved) headers.Authorization = 'Bearer ' + saved;
  if (options.key) headers['Idempotency-Key'] = options.key;
  let body;
  if (options.json !== undefined) {
    headers['Content-Type'] = 'application/json';
    body = JSON.stringify(options.json);
  } else if (options.body !== undefined) {
    headers['Content-Type'] = options.contentType || 'text/csv';
    body = options.body;
  }
  const response = await fetch(path, { method, headers, body, credentials: 'omit', cache: 'no-store' });
  const text = await response.text();
  let value = text;
  if ((response.headers.get('Content-Type') || '').includes('json') && text) {
    value = JSON.parse(text);
  }
  if (!response.ok) {
    if (response.status === 401) showLogin(t('signin.refused'));
    const e = value && value.error ? value.error : {};
    throw new ApiError(response.status, e.code, e.message || text);
  }
  return value;
}

/** A fresh Idempotency-Key (getRandomValues works outside secure contexts too). */
function newKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return 'console-' + Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}

/** `items` mapped through `work`, at most `width` at a time, in order. */
async function pool(items, width, work) {
  const results = new Array(items.length);
  let next = 0;
  const lanes = Array.from({ length: Math.min(width, items.length) }, async () => {
    while (next < items.length) {
      const i = next;
      next += 1;
      results[i] = await work(items[i]);
    }
  });
  await Promise.all(lanes);
  return results;
}

// ---- the token ----

let signedIn = false;

function showLogin(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  signedIn = false;
  nav.hidden = true;
  statusBar.replaceChildren();
  const input = h('input', { type: 'password', name: 'token', autocomplete: 'off', size: 40 });
  const form = h('form', {
    class: 'inline',
    onsubmit: (event) => {
      event.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, input.value.trim());
      route();
    },
  },
  h('label', {}, t('signin.token'), input),
  h('button', { type: 'submit' }, t('signin.open')));
  show(h('h1', {}, t('signin.title')),
    message ? h('p', { class: 'error', role: 'alert' }, message) : null,
    h('p', { class: 'note' }, t('signin.note')),
    form);
  input.focus();
}

// ---- the header: language, zone, health, mode and counts from the database ----

function renderSwitches() {
  const langSelect = h('select', {
    id: 'lang', 'aria-label': t('switch.lang'),
    onchange: (event) => { localStorage.setItem(LANG_KEY, event.target.value); document.documentElement.lang = event.target.value; renderNav(); route(); },
  }, Object.keys(STRINGS).map((code) => h('option', { value: code, selected: code === lang() }, STRINGS[code]['lang.name'])));
  const zones = [...new Set([BROWSER_ZONE, 'Asia/Shanghai', 'UTC'])];
  const zoneSelect = h('select', {
    id: 'zone', 'aria-label': t('switch.zone'),
    onchange: (event) => { localStorage.setItem(ZONE_KEY, event.target.value); route(); },
  }, zones.map((id) => h('option', { value: id, selected: id === zone() }, zoneName(id))));
  switches.replaceChildren(h('label', { class: 'switch' }, t('switch.lang'), langSelect),
    h('label', { class: 'switch' }, t('switch.zone'), zoneSelect));
}

const VIEWS = ['overview', 'orders', 'findings', 'mode', 'reconcile', 'webhooks'];

function renderNav() {
  nav.replaceChildren(...VIEWS.map((view) => h('a', { href: '#/' + view, 'data-view': view }, t('nav.' + view))));
}

/** The values of one metric family from Prometheus text, by label set. */
function metricValues(text, name) {
  const values = [];
  for (const line of String(text).split('\n')) {
    if (!line.startsWith(name)) continue;
    const match = /^([a-z_]+)(\{[^}]*\})?\s+(\S+)$/.exec(line);
    if (match && match[1] === name) values.push([match[2] || '', Number(match[3])]);
  }
  return values;
}

function sum(object) {
  return Object.values(object || {}).reduce((total, n) => total + n, 0);
}

/** Outcome counts summed over every bucket of a stats answer. */
function totals(stats, part) {
  const out = {};
  for (const bucket of stats.buckets) {
    for (const [name, n] of Object.entries(bucket[part] || {})) out[name] = (out[name] || 0) + n;
  }
  return out;
}

async function refreshStatus() {
  if (!signedIn) return;
  const badges = [];
  try {
    await api('GET', '/healthz');
    badges.push(h('span', { class: 'badge good', id: 'health' }, t('hdr.healthy')));
  } catch (err) {
    badges.push(h('span', { class: 'badge bad', id: 'health' }, t('hdr.unhealthy', { code: err.code || err.status })));
  }
  try {
    const mode = (await api('GET', '/v1/admin/mode')).mode;
    badges.push(h('span', { class: 'badge ' + (mode === 'normal' ? 'good' : 'warn'), id: 'mode-badge' },
      t('hdr.mode', { mode: word('mode.', mode) })));
  } catch (err) {
    badges.push(h('span', { class: 'badge bad' }, t('hdr.mode', { mode: '?' })));
  }
  try {
    const stats = await api('GET', '/v1/admin/stats?window=24h');
    const outcomes = Object.entries(totals(stats, 'payments')).filter(([, n]) => n > 0)
      .map(([outcome, n]) => `${word('short.', outcome)} ${n}`);
    const findings = sum(stats.now.findings);
    badges.push(h('span', { class: 'badge', id: 'callbacks' }, t('hdr.payments24', { list: outcomes.join(', ') || t('hdr.nopayments') })));
    badges.push(h('span', { class: 'badge' + (findings ? ' warn' : ''), id: 'findings-count' }, t('hdr.findings', { n: findings })));
    badges.push(h('span', { class: 'badge' + (stats.now.webhook_pending ? ' warn' : ''), id: 'webhooks-pending' },
      t('hdr.pending', { n: stats.now.webhook_pending })));
  } catch (err) {
    badges.push(h('span', { class: 'badge bad', id: 'callbacks' }, t('hdr.stats.unavailable')));
  }
  try {
    const waiting = await recordsWaiting();
    badges.push(h('span', { class: 'badge' + (waiting ? ' warn' : ''), id: 'waiting' }, t('hdr.waiting', { n: waiting })));
  } catch (err) {
    // The count of waiting records is a gauge of /metrics; without it the header says nothing of them.
  }
  if (signedIn) statusBar.replaceChildren(...badges);
}

/** Records waiting in record-only mode: a gauge payonce reads from the database. */
async function recordsWaiting() {
  const text = await api('GET', '/metrics');
  return metricValues(text, 'payonce_received_waiting').map(([, n]) => n)[0] || 0;
}

// ---- dialogs for writes ----

/**
 * Opens a dialog for one write. Its Idempotency-Key is made now and sent
 * with every submit of this dialog, so a second click replays the first
 * answer instead of doing the work again.
 */
function writeDialog({ title, explain, fields = [], submitLabel, danger, send, done }) {
  const key = newKey();
  const message = h('div');
  const form = h('form', {
    method: 'dialog',
    onsubmit: async (event) => {
      event.preventDefault();
      message.replaceChildren();
      try {
        const values = Object.fromEntries(new FormData(form).entries());
        const answer = await send(values, key);
        if (dialog.open) dialog.close();
        if (done) await done(answer);
        refreshStatus();
      } catch (err) {
        message.replaceChildren(errorText(err));
      }
    },
  },
  h('h2', {}, title),
  explain ? h('p', { class: 'note' }, explain) : null,
  fields,
  message,
  h('div', { class: 'actions' },
    h('button', { type: 'button', class: 'secondary', onclick: () => dialog.close() }, t('cancel')),
    h('button', { type: 'submit', class: danger ? 'danger' : null, 'data-key': key }, submitLabel)));
  dialog.replaceChildren(form);
  dialog.showModal();
}

function reasonField() {
  return h('label', {}, t('reason.audit'), h('textarea', { name: 'reason', required: true, maxlength: 1000 }));
}

/** A note at the top of the view (after a write). */
function notice(id, text) {
  main.prepend(h('p', { class: 'note done', id, role: 'status' }, text));
}

// ---- the overview: charts from GET /v1/admin/stats ----

const OUTCOME_ORDER = ['applied', 'recorded', 'already_paid', 'paid_after_close', 'amount_mismatch', 'payment_failed'];

/** The colour of a series by what it means (console.css series-N): green is good, red is money or a message lost. */
const SERIES_COLOUR = {
  applied: 0, recorded: 4, already_paid: 1, paid_after_close: 3, amount_mismatch: 2, payment_failed: 5,
  delivered: 0, failed: 1, SUCCEEDED: 0, REQUESTED: 4, FAILED: 1,
};

function seriesClass(part, index) {
  return 'series-' + (SERIES_COLOUR[part] !== undefined ? SERIES_COLOUR[part] : index % 6);
}

function ordered(keys, order) {
  return [...new Set([...order.filter((k) => keys.includes(k)), ...keys.sort()])];
}

/**
 * Stacked bars, one per bucket: `series` names the parts, `value(bucket, part)`
 * their counts. Each bar part carries data-start, data-series and data-count,
 * the numbers it was drawn from; a <title> says them on hover.
 */
function stackedChart(id, stats, series, value, labelOf) {
  const width = 720;
  const height = 160;
  const pad = { left: 34, bottom: 22, top: 8 };
  const buckets = stats.buckets;
  const max = Math.max(1, ...buckets.map((b) => series.reduce((total, part) => total + value(b, part), 0)));
  const slot = (width - pad.left) / Math.max(1, buckets.length);
  const scale = (height - pad.bottom - pad.top) / max;
  const bars = [];
  buckets.forEach((bucket, i) => {
    let y = height - pad.bottom;
    for (const [index, part] of series.entries()) {
      const n = value(bucket, part);
      if (!n) continue;
      const barHeight = Math.max(1, n * scale);
      y -= barHeight;
      bars.push(s('rect', {
        class: `bar ${seriesClass(part, index)}`, x: (pad.left + i * slot + slot * 0.1).toFixed(2), y: y.toFixed(2),
        width: Math.max(1, slot * 0.8).toFixed(2), height: barHeight.toFixed(2),
        'data-start': bucket.start, 'data-series': part, 'data-count': n,
      }, s('title', {}, `${labelOf(part)}: ${n} — ${new Date(bucket.start).toISOString()}`)));
    }
  });
  const axis = [0, Math.ceil(max / 2), max].map((n) => s('g', {},
    s('line', { class: 'grid', x1: pad.left, x2: width, y1: height - pad.bottom - n * scale, y2: height - pad.bottom - n * scale }),
    s('text', { class: 'axis', x: pad.left - 4, y: height - pad.bottom - n * scale + 4, 'text-anchor': 'end' }, n)));
  const ticks = buckets.length
    ? [0, Math.floor(buckets.length / 2), buckets.length - 1].map((i) => s('text', {
      class: 'axis', x: pad.left + i * slot + slot / 2, y: height - 6, 'text-anchor': i === 0 ? 'start' : (i === buckets.length - 1 ? 'end' : 'middle'),
    }, clock(buckets[i].start)))
    : [];
  const legend = h('ul', { class: 'legend', 'aria-label': t('ov.legend') }, series.map((part, index) => h('li', {},
    h('span', { class: `swatch ${seriesClass(part, index)}` }), labelOf(part), ' ',
    h('strong', { 'data-total': part }, buckets.reduce((total, b) => total + value(b, part), 0)))));
  return h('figure', { class: 'chart', id },
    s('svg', { viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': id, preserveAspectRatio: 'none' }, axis, bars, ticks),
    legend);
}

/** A bucket's start as hours:minutes in the display zone. */
function clock(ts) {
  return new Intl.DateTimeFormat(lang(), { timeZone: zone(), hour: '2-digit', minute: '2-digit', hourCycle: 'h23' }).format(new Date(ts));
}

/** Horizontal bars, one per key of `counts` (findings by kind). */
function barList(id, counts, labelOf) {
  const entries = Object.entries(counts || {}).filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1]);
  if (!entries.length) return h('p', { class: 'empty', id }, t('ov.findings.none'));
  const max = Math.max(...entries.map(([, n]) => n));
  const row = 26;
  return h('figure', { class: 'chart', id },
    s('svg', { viewBox: `0 0 720 ${entries.length * row}`, role: 'img', 'aria-label': id },
      entries.map(([kind, n], i) => s('g', {},
        s('text', { class: 'label', x: 0, y: i * row + 17 }, labelOf(kind)),
        s('rect', { class: 'bar series-2', x: 300, y: i * row + 4, width: Math.max(2, (n / max) * 380).toFixed(2), height: row - 8, 'data-series': kind, 'data-count': n },
          s('title', {}, `${kind}: ${n}`)),
        s('text', { class: 'value', x: 306 + (n / max) * 380, y: i * row + 17 }, n)))));
}

async function overviewView(params) {
  const show = scopedShow();
  const windowName = params.get('window') === '1h' ? '1h' : '24h';
  const picker = h('div', { class: 'tabs', role: 'tablist' }, ['1h', '24h'].map((w) => h('a', {
    href: '#/overview?window=' + w, class: w === windowName ? 'current' : null, 'data-window': w, role: 'tab',
  }, t('ov.window.' + w))));
  let stats;
  try {
    stats = await api('GET', '/v1/admin/stats?window=' + windowName);
  } catch (err) {
    return show(h('h1', {}, t('ov.title')), picker, h('p', { class: 'error', role: 'alert' }, t('ov.unavailable', { why: err.message })));
  }
  let duplicates = null;
  try {
    duplicates = metricValues(await api('GET', '/metrics'), 'payonce_duplicates_suppressed_total').reduce((total, [, n]) => total + n, 0);
  } catch (err) {
    duplicates = null;
  }
  const outcomes = ordered(Object.keys(totals(stats, 'payments')), OUTCOME_ORDER);
  const refundStatuses = ordered(Object.keys(totals(stats, 'refunds')), ['SUCCEEDED', 'REQUESTED', 'FAILED']);
  const bucket = t(stats.bucket_s === 60 ? 'ov.bucket.min' : 'ov.bucket.15min');
  const oldest = stats.now.webhook_oldest_pending_s;
  show(h('h1', {}, t('ov.title')), picker,
    h('p', { class: 'note' }, t('ov.payments.note', { bucket })),
    h('div', { class: 'grid' },
      h('section', { class: 'card wide' }, h('h2', {}, t('ov.payments')),
        stackedChart('chart-payments', stats, outcomes, (b, part) => (b.payments || {})[part] || 0, (o) => word('short.', o))),
      h('section', { class: 'card' }, h('h2', {}, t('ov.backlog')),
        h('p', { class: 'big' }, h('strong', { id: 'backlog-pending' }, stats.now.webhook_pending), ' ', t('ov.pending')),
        h('p', { id: 'backlog-oldest' }, t('ov.oldest'), ': ', oldest === null || oldest === undefined ? t('ov.oldest.none') : duration(oldest))),
      h('section', { class: 'card' }, h('h2', {}, t('ov.duplicates')),
        h('p', { class: 'big' }, h('strong', { id: 'duplicates' }, duplicates === null ? t('dash') : duplicates)),
        h('p', { class: 'note' }, t('ov.duplicates.note'))),
      h('section', { class: 'card wide' }, h('h2', {}, t('ov.webhooks')),
        stackedChart('chart-webhooks', stats, ['delivered', 'failed'], (b, part) => (b.webhook_deliveries || {})[part] || 0, (p) => t('ov.' + p))),
      h('section', { class: 'card wide' }, h('h2', {}, t('ov.refunds')),
        stackedChart('chart-refunds', stats, refundStatuses, (b, part) => (b.refunds || {})[part] || 0, (st) => word('refund.', st))),
      h('section', { class: 'card wide' }, h('h2', {}, t('ov.findings')),
        barList('chart-findings', stats.now.findings, (kind) => `${findingTitle(kind)} (${kind})`))));
}

// ---- orders: what needs attention ----

const EXTRA_OUTCOMES = ['already_paid', 'paid_after_close', 'amount_mismatch'];

/** What the whole ledger says needs attention now: by order_no, from the inspection and the dead letters. */
async function attentionSources() {
  const [inspection, dead, refunding] = await Promise.all([
    api('GET', '/v1/inspections'),
    api('GET', '/v1/webhooks/deliveries?status=failed&limit=1000'),
    api('GET', '/v1/orders?status=REFUNDING&limit=1000'),
  ]);
  const findings = new Map();
  for (const f of inspection.findings) {
    if (!f.order_no) continue;
    if (!findings.has(f.order_no)) findings.set(f.order_no, []);
    findings.get(f.order_no).push(f);
  }
  return {
    findings,
    dead: new Set(dead.deliveries.map((d) => d.order_no)),
    refunding: new Set(refunding.orders.map((o) => o.order_no)),
  };
}

/** The marks of one order: its detail and the ledger's sources. */
function flagsOf(detail, sources) {
  const flags = [];
  if (sources.findings.has(detail.order_no)) flags.push('finding');
  if ((detail.payments || []).some((p) => p.pay_no !== detail.pay_no && EXTRA_OUTCOMES.includes(p.outcome))) flags.push('extra');
  if (detail.refunding_amount > 0 || sources.refunding.has(detail.order_no)
    || (detail.payments || []).some((p) => p.resolution === 'refunding')) flags.push('refunding');
  if (sources.dead.has(detail.order_no)) flags.push('dead');
  return flags;
}

/** The order_nos a filter lists (newest first is the list's order; here by the sources). */
function filterCandidates(filter, sources) {
  const fromFindings = (test) => [...sources.findings.entries()].filter(([, list]) => list.some(test)).map(([no]) => no);
  switch (filter) {
    case 'finding': return [...sources.findings.keys()];
    case 'extra': return fromFindings((f) => f.kind === 'refund_required');
    case 'refunding': return [...new Set([...sources.refunding, ...fromFindings((f) => f.kind === 'refund_required' && f.detail.resolution === 'refunding')])];
    case 'dead': return [...sources.dead];
    default: return [...new Set([...sources.findings.keys(), ...sources.refunding, ...sources.dead])];
  }
}

function channelsOf(detail) {
  const applied = (detail.payments || []).find((p) => p.pay_no === detail.pay_no);
  const all = [...new Set((detail.payments || []).map((p) => p.channel))];
  if (applied) return [applied.channel, ...all.filter((c) => c !== applied.channel)];
  return all;
}

function channelCell(detail) {
  const channels = channelsOf(detail);
  if (!channels.length) return null;
  return h('span', { 'data-channels': channels.join(' ') }, channels.map((c, i) => [i ? ' + ' : '', coded(word('channel.', c), c)]));
}

function statusCell(status) {
  return h('span', { class: 'status status-' + String(status).toLowerCase() }, coded(word('status.', status), status));
}

function flagBadges(flags) {
  return flags.length
    ? h('span', { class: 'flags', 'data-flags': flags.join(' ') }, flags.map((f) => h('span', { class: 'badge bad flag', 'data-flag': f }, t('flag.' + f))))
    : null;
}

async function ordersView(params) {
  const show = scopedShow();
  const userId = params.get('user_id') || '';
  const status = params.get('status') || '';
  const attention = params.get('attention') || '';
  const after = params.get('after');
  const query = new URLSearchParams();
  if (userId) query.set('user_id', userId);
  if (status) query.set('status', status);
  if (after) query.set('after', after);
  query.set('limit', '50');
  const orderNo = h('input', { name: 'order_no', placeholder: 'ORD-1' });
  const user = h('input', { name: 'user_id', value: userId });
  const state = h('select', { name: 'status' },
    ['', 'PENDING', 'PAID', 'CLOSED', 'REFUNDING', 'REFUNDED'].map((st) => h('option', { value: st, selected: st === status }, st ? word('status.', st) : t('any'))));
  const need = h('select', { name: 'attention' },
    ['', 'all', 'finding', 'extra', 'refunding', 'dead'].map((f) => h('option', { value: f, selected: f === attention }, f ? t('filter.' + f) : t('any'))));
  const search = h('form', {
    class: 'inline',
    onsubmit: (event) => {
      event.preventDefault();
      if (orderNo.value.trim()) {
        location.hash = '#/order/' + encodeURIComponent(orderNo.value.trim());
        return;
      }
      const next = new URLSearchParams();
      if (user.value.trim()) next.set('user_id', user.value.trim());
      if (state.value) next.set('status', state.value);
      if (need.value) next.set('attention', need.value);
      location.hash = '#/orders?' + next.toString();
    },
  },
  h('label', {}, t('orders.order_no'), orderNo),
  h('label', {}, t('orders.user_id'), user),
  h('label', {}, t('orders.status'), state),
  h('label', {}, t('orders.attention'), need),
  h('button', { type: 'submit' }, t('search')));
  const title = h('h1', {}, t('orders.title'));
  let sources;
  let orders;
  let nextAfter = null;
  try {
    sources = await attentionSources();
    if (attention) {
      orders = await pool(filterCandidates(attention, sources), 6, (no) => api('GET', '/v1/orders/' + encodeURIComponent(no)));
      orders = orders.filter((o) => (!userId || o.user_id === userId) && (!status || o.status === status));
      orders.sort((a, b) => (a.created_at < b.created_at ? 1 : -1));
    } else {
      const page = await api('GET', '/v1/orders?' + query.toString());
      nextAfter = page.next_after;
      // The list carries no payments: each order's detail gives its channel and marks.
      orders = await pool(page.orders, 6, (o) => api('GET', '/v1/orders/' + encodeURIComponent(o.order_no)));
    }
  } catch (err) {
    return show(title, search, errorText(err));
  }
  const more = nextAfter
    ? h('p', {}, h('a', { href: '#/orders?' + new URLSearchParams({ ...Object.fromEntries(query), after: nextAfter }).toString() }, t('next')))
    : null;
  show(title, search,
    attention ? h('p', { class: 'note' }, t('orders.filter.note')) : null,
    table([
      [t('col.order'), (o) => orderLink(o.order_no)],
      [t('col.attention'), (o) => flagBadges(flagsOf(o, sources))],
      [t('col.user'), (o) => o.user_id],
      [t('col.amount'), (o) => h('span', { class: 'money' }, money(o.amount, o.currency))],
      [t('col.status'), (o) => statusCell(o.status)],
      [t('col.channel'), (o) => channelCell(o)],
      [t('col.created'), (o) => when(o.created_at, true)],
    ], orders, t('orders.none'), { id: 'orders' }),
    more);
}

// ---- an order: its story as a timeline ----

function reasonText(reason) {
  return reason ? t('tl.reason', { reason }) : '';
}

function auditReason(detail) {
  const reason = detail && typeof detail === 'object' ? detail.reason : null;
  return reason ? t('audit.reason', { reason }) : '';
}

function auditSentence(row) {
  const key = 'audit.' + row.action;
  const reason = auditReason(row.detail);
  return STRINGS.en[key] !== undefined ? t(key, { reason }) : t('audit.other', { action: row.action, reason });
}



function paymentDecision(order, p) {
  return word('outcome.', p.outcome);
}

function paymentResolution(order, p) {
  if (p.resolution) return word('resolution.', p.resolution);
  if (EXTRA_OUTCOMES.includes(p.outcome) && p.pay_no !== order.pay_no) return t('resolution.open');
  return null;
}

/** Every dated thing of the order, in time order, each as { at, kind, code, text, extra }. */
function timelineOf(order, deliveries) {
  const items = [];
  const add = (at, kind, code, text, extra, attrs) => { if (at) items.push({ at, kind, code, text, extra, attrs }); };
  const m = (amount) => money(amount, order.currency);
  add(order.created_at, 'created', 'order.created', t('tl.created', { user: order.user_id, amount: m(order.amount), expires: timeText(order.expires_at) }));
  for (const p of order.payments || []) {
    const resolution = paymentResolution(order, p);
    add(p.received_at, 'payment', p.outcome, [
      t('tl.payment', { channel: word('channel.', p.channel), pay_no: p.pay_no, amount: m(p.amount), source: word('source.', p.source), decision: paymentDecision(order, p) }),
      resolution ? ' ' + t('tl.resolution', { resolution }) : '',
    ].join(''), paymentActions(order, p), { 'data-pay-no': p.pay_no, 'data-outcome': p.outcome });
    for (const r of p.refunds || []) {
      add(r.requested_at, 'refund', 'payment_refund.REQUESTED', t('tl.payment.refund.requested', { refund_no: r.refund_no, pay_no: p.pay_no, amount: m(r.amount) }));
      if (r.settled_at) {
        add(r.settled_at, 'refund', 'payment_refund.' + r.status,
          t('tl.payment.refund.settled', { refund_no: r.refund_no, pay_no: p.pay_no, amount: m(r.amount), status: word('refund.', r.status) }));
      }
    }
  }
  // paid_at is the platform's own payment time (often whole seconds, before payonce heard of it): the
  // applied payment's line tells the payment; only the close is a line of its own.
  if (order.closed_at) add(order.closed_at, 'closed', 'order.closed', t('tl.closed'));
  for (const r of order.refunds || []) {
    add(r.requested_at, 'refund', 'refund.REQUESTED', t('tl.order.refund.requested', { refund_no: r.refund_no, amount: m(r.amount), reason: reasonText(r.reason) }));
    if (r.settled_at) add(r.settled_at, 'refund', 'refund.' + r.status, t('tl.order.refund.settled', { refund_no: r.refund_no, amount: m(r.amount), status: word('refund.', r.status) }));
  }
  for (const c of order.coupons || []) add(c.created_at, 'reward', 'coupon', t('tl.coupon', { id: c.coupon_template_id, status: c.status }));
  for (const p of order.points || []) add(p.created_at, 'reward', 'points', t('tl.points', { points: p.points, type: p.point_type }));
  for (const e of order.events || []) add(e.created_at, 'event', e.type, t('tl.event', { what: word('event.', e.type), seq: e.seq }));
  for (const d of deliveries) {
    const answer = d.last_status !== null && d.last_status !== undefined ? `HTTP ${d.last_status}` : (d.last_error || t('tl.delivery.noanswer'));
    add(d.last_attempt_at || d.created_at || d.next_attempt_at, 'webhook', 'delivery.' + d.status, t('tl.delivery', {
      event: d.event_type || d.event_id, endpoint: d.endpoint, status: word('delivery.', d.status), attempts: d.attempts,
      last: d.last_attempt_at ? t('tl.delivery.last', { answer }) : '',
    }), retryButton(d, () => orderView(order.order_no)), { 'data-delivery': d.id });
  }
  for (const c of order.platform_calls || []) {
    add(c.created_at, 'call', [c.channel, c.kind, c.status, c.refund_no].filter(Boolean).join(' · '), t('tl.call', {
      channel: word('channel.', c.channel), kind: word('call.kind.', c.kind), status: word('call.status.', c.status), attempts: c.attempts,
      http: c.http_status !== null && c.http_status !== undefined ? t('tl.call.http', { status: c.http_status }) : '',
    }));
  }
  for (const a of order.audit || []) {
    add(a.at, 'audit', a.action, t('tl.audit', { sentence: auditSentence(a), actor: a.actor }), raw(a));
  }
  // Stable: same instant keeps the order above (creation, payment, its effects).
  return items.map((item, i) => ({ ...item, i })).sort((a, b) => (a.at < b.at ? -1 : a.at > b.at ? 1 : a.i - b.i));
}

/** A timestamp as plain text in the display zone (inside sentences). */
function timeText(ts) {
  const node = when(ts);
  return typeof node === 'string' ? node : node.textContent;
}

/** Resolve or refund an extra payment in place; nothing while its refund is in flight. */
function paymentActions(order, p) {
  if (!EXTRA_OUTCOMES.includes(p.outcome) || p.pay_no === order.pay_no || (p.resolution && p.resolution !== 'refunding')) return null;
  const refunds = p.refunds || [];
  const finding = {
    kind: 'refund_required', order_no: order.order_no,
    detail: {
      pay_no: p.pay_no, channel: p.channel, amount: p.amount, outcome: p.outcome, currency: order.currency,
      resolution: p.resolution, refund: refunds.length ? refunds[refunds.length - 1] : null,
    },
  };
  return refundRequiredActions(finding, () => orderView(order.order_no));
}

async function orderView(orderNo) {
  const show = scopedShow();
  let order;
  try {
    order = await api('GET', '/v1/orders/' + encodeURIComponent(orderNo));
  } catch (err) {
    return show(h('h1', {}, t('order.title', { no: orderNo })), errorText(err));
  }
  const left = order.amount - order.refunded_amount - order.refunding_amount;
  // Its marks as the orders list shows them: the inspection, its refunds in flight, its dead letters.
  const sources = { findings: new Map(), dead: new Set(), refunding: new Set() };
  try {
    const inspection = await api('GET', '/v1/inspections');
    for (const f of inspection.findings) if (f.order_no === order.order_no) sources.findings.set(f.order_no, [f]);
  } catch (err) {
    // Without the inspection the page still tells the order; the finding mark is left out.
  }
  for (const d of order.webhook_deliveries || []) if (d.status === 'failed') sources.dead.add(order.order_no);
  const items = timelineOf(order, order.webhook_deliveries || []);
  const summary = h('section', { class: 'card summary' },
    h('p', { class: 'headline' },
      h('strong', { class: 'money', id: 'order-amount' }, money(order.amount, order.currency)), ' ',
      statusCell(order.status), ' ', flagBadges(flagsOf(order, sources))),
    h('dl', { class: 'fields' },
      h('dt', {}, t('col.user')), h('dd', {}, order.user_id),
      h('dt', {}, t('col.channel')), h('dd', {}, channelCell(order) || t('dash')),
      h('dt', {}, t('order.created')), h('dd', {}, when(order.created_at, true)),
      h('dt', {}, t('order.expires')), h('dd', {}, when(order.expires_at, true)),
      h('dt', {}, t('order.payments')), h('dd', {}, order.pay_no ? t('order.paidby', { pay_no: order.pay_no }) : t('order.notpaid')),
      order.refunded_amount ? [h('dt', {}, word('status.', 'REFUNDED')), h('dd', {}, t('order.refunded', { amount: money(order.refunded_amount, order.currency) }))] : null),
    h('div', { class: 'cell-actions' },
      order.status === 'PAID' && left > 0 ? refundPartAction(order, left) : null,
      syncAction(order)));
  show(h('h1', {}, t('order.title', { no: order.order_no })), summary,
    h('h2', {}, t('order.timeline')),
    h('ol', { class: 'timeline', id: 'timeline' }, items.map((item) => h('li', { class: 'tl tl-' + item.kind, 'data-kind': item.kind, ...(item.attrs || {}) },
      h('div', { class: 'tl-when' }, when(item.at, true)),
      h('div', { class: 'tl-what' }, h('p', { class: 'tl-text' }, item.text), h('code', { class: 'code' }, item.code), item.extra || null)))));
}

/** Refund part of a PAID order: an amount as money, at most what is left. */
function refundPartAction(order, left) {
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-refund-part': order.order_no,
    onclick: () => writeDialog({
      title: t('part.title', { no: order.order_no }),
      explain: t('part.explain', { left: money(left, order.currency), amount: money(order.amount, order.currency) }),
      fields: [
        h('label', {}, t('part.refund_no'), h('input', { name: 'refund_no', required: true, maxlength: 64, pattern: '[A-Za-z0-9_.\\-]+' })),
        h('label', {}, t('part.amount', { currency: order.currency }), h('input', { name: 'amount', required: true, inputmode: 'decimal', pattern: '\\s*\\d+(\\.\\d{1,2})?\\s*' })),
        h('label', {}, t('part.reason'), h('input', { name: 'reason', maxlength: 80 })),
      ],
      submitLabel: t('refund.submit'),
      danger: true,
      send: (values, key) => {
        const amount = parseMoney(values.amount);
        if (amount === null || amount < 1 || amount > left) return Promise.reject(new Error(t('part.badamount', { left: money(left, order.currency) })));
        return api('POST', `/v1/orders/${encodeURIComponent(order.order_no)}/refunds`, {
          key,
          json: { refund_no: values.refund_no, amount, ...(values.reason ? { reason: values.reason } : {}) },
        });
      },
      done: () => orderView(order.order_no),
    }),
  }, t('act.refundpart'));
}

/** Ask every configured platform about the order (not keyed: a replay would repeat a stale state; asking twice is harmless). */
function syncAction(order) {
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-sync': order.order_no,
    onclick: () => writeDialog({
      title: t('order.sync.title', { no: order.order_no }),
      explain: t('order.sync.explain'),
      submitLabel: t('order.sync.submit'),
      send: () => api('POST', `/v1/orders/${encodeURIComponent(order.order_no)}/sync`, { json: {} }),
      done: (answer) => orderView(order.order_no).then(() => {
        const said = Object.entries(answer.platforms || {}).map(([channel, what]) => `${word('channel.', channel)}: ${typeof what === 'string' ? what : JSON.stringify(what)}`);
        notice('synced', t('order.synced', { list: said.join('; ') || t('order.sync.none') }));
      }),
    }),
  }, t('order.sync'));
}

// ---- findings in words ----

function findingTitle(kind) {
  const titles = {
    en: {
      duplicate_coupon: 'Coupon issued twice', duplicate_points: 'Points credited twice',
      applied_callback_order_not_paid: 'Applied payment, order not paid', refund_required: 'Money to return',
      received_not_applied: 'Payment not decided', paid_without_rewards: 'Rewards missing',
      unexpected_refund: 'Refund nobody asked for', close_unconfirmed: 'Close not confirmed',
      key_expiring: 'Certificate expiring',
    },
    'zh-CN': {
      duplicate_coupon: '优惠券重复发放', duplicate_points: '积分重复发放',
      applied_callback_order_not_paid: '支付已处理但订单未支付', refund_required: '需要退还的钱',
      received_not_applied: '支付未处理', paid_without_rewards: '缺少奖励',
      unexpected_refund: '意外退款', close_unconfirmed: '关单未确认',
      key_expiring: '证书即将到期',
    },
  };
  return (titles[lang()] || titles.en)[kind] || kind;
}

function findingSentence(f) {
  const d = f.detail || {};
  const cur = d.currency || 'CNY';
  switch (f.kind) {
    case 'duplicate_coupon': return t('finding.duplicate_coupon', { rows: d.rows, id: d.coupon_template_id });
    case 'duplicate_points': return t('finding.duplicate_points', { rows: d.rows, type: d.point_type });
    case 'applied_callback_order_not_paid':
      return t('finding.applied_callback_order_not_paid', { pay_no: d.pay_no, status: word('status.', d.order_status), order_pay_no: d.order_pay_no || t('dash') });
    case 'refund_required': {
      const vars = { amount: money(d.amount, f.currency || cur), channel: word('channel.', d.channel), pay_no: d.pay_no, outcome: word('outcome.', d.outcome) };
      return d.resolution === 'refunding'
        ? t('finding.refund_required.refunding', { ...vars, refund_no: d.refund ? d.refund.refund_no : t('dash') })
        : t('finding.refund_required', vars);
    }
    case 'received_not_applied': return t('finding.received_not_applied', { pay_no: d.pay_no, ago: d.received_at ? ago(new Date(d.received_at)) : t('dash') });
    case 'paid_without_rewards': {
      const missing = [];
      if ((d.missing_coupons || []).length) missing.push(t('finding.missing.coupons', { list: d.missing_coupons.join(', ') }));
      if (d.missing_points) missing.push(t('finding.missing.points'));
      return t('finding.paid_without_rewards', { pay_no: d.pay_no, missing: missing.join(', ') || t('dash') });
    }
    case 'unexpected_refund': return t('finding.unexpected_refund', { refund_no: d.refund_no, status: d.status || t('dash'), deliveries: d.deliveries, first: timeText(d.first_at) });
    case 'close_unconfirmed':
      return t('finding.close_unconfirmed', { platforms: (d.platforms || []).map((c) => word('channel.', c)).join(', '), when: timeText(d.given_up_at) });
    case 'key_expiring': return t('finding.key_expiring', { platform: word('channel.', d.platform), id: d.id, when: timeText(d.expires_at) });
    default: return t('finding.other', { kind: f.kind });
  }
}

function resolveCloseAction(finding, after) {
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-resolve-close': finding.order_no,
    onclick: () => writeDialog({
      title: t('resolve.close', { no: finding.order_no }),
      explain: t('resolve.close.explain', { platforms: finding.detail.platforms.map((c) => word('channel.', c)).join(', ') }),
      fields: [reasonField()],
      submitLabel: t('resolve.submit'),
      send: (values, key) => api('POST', `/v1/admin/orders/${encodeURIComponent(finding.order_no)}/resolve-close`,
        { key, json: { reason: values.reason } }),
      done: after || (() => findingsView()),
    }),
  }, t('act.resolve'));
}

function resolveAction(finding, after) {
  if (finding.kind === 'close_unconfirmed') return resolveCloseAction(finding, after);
  const target = finding.kind === 'refund_required'
    ? { title: 'resolve.payment', id: finding.detail.pay_no, path: '/v1/admin/payments/', explain: 'resolve.payment.explain' }
    : finding.kind === 'unexpected_refund'
      ? { title: 'resolve.refund', id: finding.detail.refund_no, path: '/v1/admin/refunds/', explain: 'resolve.refund.explain' }
      : null;
  if (!target || !target.id) return null;
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-resolve': target.id,
    onclick: () => writeDialog({
      title: t(target.title, { id: target.id }),
      explain: t(target.explain),
      fields: [
        h('label', {}, t('resolve.resolution'), h('select', { name: 'resolution' },
          h('option', { value: 'refunded_externally' }, `${t('resolve.refunded_externally')} (refunded_externally)`),
          h('option', { value: 'accepted' }, `${t('resolve.accepted')} (accepted)`))),
        reasonField(),
      ],
      submitLabel: t('resolve.submit'),
      send: (values, key) => api('POST', target.path + encodeURIComponent(target.id) + '/resolve',
        { key, json: { resolution: values.resolution, reason: values.reason } }),
      done: after || (() => findingsView()),
    }),
  }, t('act.resolve'));
}

/** A refused refund, said in the operator's terms (the API's code and message first). */
function refundRefusal(err, channel) {
  if (!(err instanceof ApiError)) return err;
  const name = word('channel.', channel);
  if (err.code === 'channel_not_configured') return new Error(`${err.message}\n${t('refund.nochannel', { channel: name })}`);
  if (err.code === 'invalid_transition') return new Error(`${err.message}\n${t('refund.stale')}`);
  return err;
}

/**
 * Refund to the buyer: payonce asks the platform that took this payment to
 * return its whole amount, under a refund number of its own, once.
 */
function refundAction(finding, failed, after) {
  const { pay_no: payNo, channel, amount, outcome } = finding.detail;
  const currency = finding.detail.currency || 'CNY';
  const buyerReason = STRINGS.en['buyer.' + outcome] !== undefined ? t('buyer.' + outcome) : t('buyer.other');
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-refund': payNo,
    onclick: () => writeDialog({
      title: t('refund.title', { pay_no: payNo }),
      explain: t('refund.explain', { channel: word('channel.', channel), no: finding.order_no }) + (failed ? t('refund.again', { no: failed.refund_no }) : ''),
      fields: [
        h('dl', { class: 'fields' },
          h('dt', {}, t('field.pay_no')), h('dd', { 'data-field': 'pay_no' }, payNo),
          h('dt', {}, t('field.channel')), h('dd', { 'data-field': 'channel' }, coded(word('channel.', channel), channel)),
          h('dt', {}, t('field.amount')), h('dd', { 'data-field': 'amount' }, money(amount, currency)),
          h('dt', {}, t('field.outcome')), h('dd', { 'data-field': 'outcome' }, coded(word('outcome.', outcome), outcome))),
        h('label', {}, t('refund.reason'),
          h('input', { name: 'reason', required: true, minlength: 1, maxlength: 80, size: 40, value: buyerReason })),
      ],
      submitLabel: t('refund.submit'),
      danger: true,
      send: (values, key) => api('POST', `/v1/admin/payments/${encodeURIComponent(payNo)}/refund`,
        { key, json: { reason: values.reason } }).catch((err) => { throw refundRefusal(err, channel); }),
      done: (answer) => (after || (() => findingsView()))().then(() => notice('refund-requested',
        t('refund.requested', { no: answer.refund.refund_no, amount: money(answer.refund.amount, currency), channel: word('channel.', channel), status: word('refund.', answer.refund.status) }))),
    }),
  }, t('act.refund'));
}

/** A refund_required finding: refund it, or resolve it; nothing while its refund is in flight. */
function refundRequiredActions(finding, after) {
  const refund = finding.detail.refund || null;
  if (finding.detail.resolution === 'refunding' || (refund && refund.status === 'REQUESTED')) {
    return h('span', { class: 'badge warn', 'data-refund-in-flight': finding.detail.pay_no },
      t('act.inflight', { no: refund ? refund.refund_no : '?' }));
  }
  const failed = refund && refund.status === 'FAILED' ? refund : null;
  return h('div', { class: 'cell-actions' },
    failed ? h('p', { class: 'error', 'data-refund-failed': finding.detail.pay_no },
      t('act.failed', { no: failed.refund_no, when: failed.settled_at ? ' · ' + timeText(failed.settled_at) : '' })) : null,
    refundAction(finding, failed, after),
    resolveAction(finding, after));
}

async function findingsView() {
  const show = scopedShow();
  let inspection;
  try {
    inspection = await api('GET', '/v1/inspections');
  } catch (err) {
    return show(h('h1', {}, t('findings.title')), errorText(err));
  }
  // A refund_required finding's money is in its order's currency.
  const currencies = new Map();
  await pool([...new Set(inspection.findings.filter((f) => f.kind === 'refund_required').map((f) => f.order_no))], 6, async (no) => {
    try {
      currencies.set(no, (await api('GET', '/v1/orders/' + encodeURIComponent(no))).currency);
    } catch (err) {
      currencies.set(no, null);
    }
  });
  for (const f of inspection.findings) {
    if (currencies.get(f.order_no)) f.detail.currency = currencies.get(f.order_no);
  }
  show(h('h1', {}, t('findings.title')),
    h('p', { class: 'note' }, inspection.ok ? t('findings.clean') : t('findings.count', { n: inspection.findings.length })),
    inspection.findings.length
      ? h('ul', { class: 'findings', id: 'findings' }, inspection.findings.map((f) => h('li', { class: 'card finding', 'data-kind': f.kind, 'data-order': f.order_no || '' },
        h('h3', {}, findingTitle(f.kind), ' ', h('code', { class: 'code' }, f.kind)),
        h('p', { class: 'sentence' }, findingSentence(f)),
        f.order_no ? h('p', { class: 'order-ref' }, t('col.order'), ': ', orderLink(f.order_no)) : null,
        f.kind === 'refund_required' ? refundRequiredActions(f) : resolveAction(f),
        raw(f.detail))))
      : h('p', { class: 'empty' }, t('findings.clean')));
}

// ---- mode ----

async function modeView() {
  const show = scopedShow();
  let mode;
  let waiting = 0;
  try {
    mode = (await api('GET', '/v1/admin/mode')).mode;
    waiting = await recordsWaiting();
  } catch (err) {
    return show(h('h1', {}, t('mode.title')), errorText(err));
  }
  const target = mode === 'normal' ? 'record_only' : 'normal';
  show(h('h1', {}, t('mode.title')),
    h('section', { class: 'card' },
      h('p', {}, t('mode.is', { mode: '' }).replace(/[。.]$/, ''), h('strong', { id: 'mode-now', 'data-mode': mode }, coded(word('mode.', mode), mode))),
      h('p', {}, t('mode.waiting', { n: '' }).replace(/[。.]$/, ''), h('strong', { id: 'waiting-now' }, waiting)),
      h('p', { class: 'note' }, t('mode.explain'))),
    h('p', { class: 'cell-actions' },
      h('button', {
        type: 'button',
        id: 'switch-mode',
        'data-target': target,
        class: target === 'record_only' ? 'danger' : null,
        onclick: () => writeDialog({
          title: t('mode.confirm.' + target),
          explain: target === 'record_only' ? t('mode.explain') : t('mode.back', { n: waiting }),
          submitLabel: t('mode.submit.' + target),
          danger: target === 'record_only',
          send: (values, key) => api('PUT', '/v1/admin/mode', { key, json: { mode: target } }),
          done: () => modeView(),
        }),
      }, t('mode.to.' + target)),
      h('button', {
        type: 'button',
        id: 'drain',
        class: 'secondary',
        onclick: () => writeDialog({
          title: t('mode.drain.title'),
          explain: t('mode.drain.explain'),
          submitLabel: t('mode.drain.submit'),
          send: (values, key) => api('POST', '/v1/admin/drain', { key, json: {} }),
          done: (answer) => modeView().then(() => notice('drained', t('mode.drained', { n: answer.applied }))),
        }),
      }, t('mode.drain'))));
}

// ---- reconcile ----

function differenceRows(result) {
  return ['missing_local', 'missing_remote', 'amount_mismatch'].flatMap((section) =>
    (result[section] || []).map((row) => ({ section, ...row })));
}

function reconciliationTable(result) {
  const plain = (amount) => (amount === null || amount === undefined ? null : money(amount, 'CNY'));
  return [
    h('p', { id: 'recon-summary' },
      t('recon.summary', { days: (result.period || []).join(', '), compared: (result.compared || []).join(' / '), matched: result.matched })),
    table([
      [t('col.difference'), (r) => coded(t('recon.' + r.section), r.section)],
      [t('col.kind'), (r) => r.kind],
      [t('col.payment'), (r) => r.pay_no],
      [t('col.order'), (r) => orderLink(r.order_no)],
      [t('col.platform'), (r) => plain(r.amount_platform)],
      [t('col.payonce'), (r) => plain(r.amount_local)],
    ], differenceRows(result), t('recon.none')),
  ];
}

function reconcileView() {
  const show = scopedShow();
  const file = h('input', { type: 'file', name: 'statement', required: true });
  const format = h('select', { name: 'format' }, ['generic', 'wechatpay', 'alipay'].map((f) => h('option', { value: f }, word('channel.', f))));
  const date = h('input', { name: 'date', placeholder: 'YYYY-MM-DD' });
  const result = h('div', { id: 'recon-result' });
  const query = (repair) => {
    const q = new URLSearchParams({ format: format.value });
    if (date.value.trim()) q.set('date', date.value.trim());
    if (repair) q.set('repair', 'true');
    return '/v1/reconciliations?' + q.toString();
  };
  const compare = async (event) => {
    event.preventDefault();
    result.replaceChildren();
    try {
      const text = await file.files[0].text();
      const answer = await api('POST', query(false), { body: text });
      const missing = (answer.missing_local || []).length;
      fill(result, ...reconciliationTable(answer),
        missing ? h('p', {}, h('button', {
          type: 'button',
          id: 'repair',
          class: 'danger',
          onclick: () => writeDialog({
            title: t('recon.repair.title', { n: missing }),
            explain: t('recon.repair.explain', { n: missing }),
            submitLabel: t('recon.repair.submit'),
            danger: true,
            send: (values, key) => api('POST', query(true), { key, body: text }),
            done: (repaired) => fill(result, ...reconciliationTable(repaired),
              h('h2', {}, t('recon.repaired')),
              table([
                [t('col.payment'), (r) => r.pay_no],
                [t('col.order'), (r) => orderLink(r.order_no)],
                [t('col.outcome'), (r) => (r.outcome ? coded(word('outcome.', r.outcome), r.outcome) : (r.error && r.error.code))],
              ], repaired.repaired || [], t('recon.repaired.none'))),
          }),
        }, t('recon.repair'))) : null);
    } catch (err) {
      fill(result, errorText(err));
    }
  };
  show(h('h1', {}, t('recon.title')),
    h('p', { class: 'note' }, t('recon.note')),
    h('form', { class: 'inline', onsubmit: compare },
      h('label', {}, t('recon.file'), file),
      h('label', {}, t('recon.format'), format),
      h('label', {}, t('recon.date'), date),
      h('button', { type: 'submit', id: 'compare' }, t('recon.compare'))),
    result);
}

// ---- webhooks, per endpoint ----

const SCAN_LIMIT = 20000;

/** Every delivery, newest first is not needed: ascending id, up to SCAN_LIMIT. */
async function allDeliveries() {
  const all = [];
  let after = null;
  do {
    const query = new URLSearchParams({ limit: '1000' });
    if (after) query.set('after', after);
    const page = await api('GET', '/v1/webhooks/deliveries?' + query.toString());
    all.push(...page.deliveries);
    after = page.next_after;
  } while (after && all.length < SCAN_LIMIT);
  return { deliveries: all, complete: !after };
}

function endpointSummaries(deliveries) {
  const byEndpoint = new Map();
  for (const d of deliveries) {
    if (!byEndpoint.has(d.endpoint)) {
      byEndpoint.set(d.endpoint, { endpoint: d.endpoint, delivered: 0, pending: 0, failed: 0, disabled: 0, dead: [], oldest: null, last: null });
    }
    const e = byEndpoint.get(d.endpoint);
    e[d.status] = (e[d.status] || 0) + 1;
    if (d.status === 'failed') e.dead.push(d);
    if (d.status === 'pending' && (!e.oldest || d.event_seq < e.oldest.event_seq)) e.oldest = d;
    if (d.last_attempt_at && (!e.last || d.last_attempt_at > e.last.last_attempt_at)) e.last = d;
  }
  for (const e of byEndpoint.values()) {
    e.state = e.disabled ? 'disabled' : (e.failed || (e.last && e.last.status !== 'delivered' && e.last.attempts > 0) ? 'failing' : 'healthy');
  }
  return [...byEndpoint.values()];
}

function retryButton(d, after) {
  if (!d || !d.id || (d.status !== 'failed' && d.status !== 'disabled')) return null;
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-retry': d.id,
    onclick: () => writeDialog({
      title: t('wh.retry.title', { id: d.id }),
      explain: t('wh.retry.explain', { event: d.event_id, endpoint: d.endpoint }),
      submitLabel: t('wh.retry.submit'),
      send: (values, key) => api('POST', `/v1/webhooks/deliveries/${encodeURIComponent(d.id)}/retry`, { key, json: {} }),
      done: after,
    }),
  }, t('act.retry'));
}

/**
 * Every dead letter of an endpoint sent again from one dialog: each retry
 * is its own path, so the dialog's one key makes each of them once however
 * often the dialog is submitted.
 */
function retryAllAction(e, params) {
  if (!e.dead.length) return null;
  const dead = e.dead.slice();
  return h('button', {
    type: 'button',
    class: 'danger',
    'data-retry-all': e.endpoint,
    onclick: () => writeDialog({
      title: t('wh.retryall.title', { n: dead.length, endpoint: e.endpoint }),
      explain: t('wh.retryall.explain'),
      submitLabel: t('wh.retry.submit'),
      send: async (values, key) => {
        await pool(dead, 4, (d) => api('POST', `/v1/webhooks/deliveries/${encodeURIComponent(d.id)}/retry`, { key, json: {} }));
        return dead.length;
      },
      done: (n) => webhooksView(params).then(() => notice('retried-all', t('wh.retryall.done', { n }))),
    }),
  }, t('wh.retryall', { n: dead.length }));
}

function replayAction(e, params) {
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-replay': e.endpoint,
    onclick: () => writeDialog({
      title: t('wh.replay.title', { endpoint: e.endpoint }),
      explain: t('wh.replay.explain'),
      fields: [
        h('label', {}, t('wh.replay.after'), h('input', { name: 'after_seq', type: 'number', min: 0, step: 1, required: true, value: 0 })),
        h('label', {}, t('wh.replay.until'), h('input', { name: 'until_seq', type: 'number', min: 0, step: 1 })),
      ],
      submitLabel: t('wh.replay.submit'),
      send: (values, key) => api('POST', '/v1/webhooks/replay', {
        key,
        json: { endpoint: e.endpoint, after_seq: Number(values.after_seq), ...(values.until_seq ? { until_seq: Number(values.until_seq) } : {}) },
      }),
      done: (answer) => webhooksView(params).then(() => notice('replayed',
        t('wh.replay.done', { n: answer.queued, endpoint: e.endpoint }) + (answer.next_after ? t('wh.replay.more', { seq: answer.next_after }) : ''))),
    }),
  }, t('wh.replay'));
}

function enableAction(e, params) {
  if (e.state !== 'disabled') return null;
  return h('button', {
    type: 'button',
    class: 'danger',
    'data-enable': e.endpoint,
    onclick: () => writeDialog({
      title: t('wh.enable.title', { endpoint: e.endpoint }),
      explain: t('wh.enable.explain'),
      submitLabel: t('wh.enable.submit'),
      send: (values, key) => api('POST', '/v1/webhooks/endpoints/enable', { key, json: { endpoint: e.endpoint } }),
      done: (answer) => webhooksView(params).then(() => notice('enabled', t('wh.enable.done', { endpoint: answer.endpoint, n: answer.resumed }))),
    }),
  }, t('wh.enable'));
}

async function webhooksView(params) {
  const show = scopedShow();
  const status = params.get('status') || '';
  const after = params.get('after');
  const query = new URLSearchParams({ limit: '50' });
  if (status) query.set('status', status);
  if (after) query.set('after', after);
  const filter = h('select', {
    name: 'status',
    onchange: (event) => { location.hash = '#/webhooks' + (event.target.value ? '?status=' + event.target.value : ''); },
  }, ['', 'pending', 'delivered', 'failed', 'disabled'].map((st) => h('option', { value: st, selected: st === status }, st ? word('delivery.', st) : t('any'))));
  let page;
  let scan;
  let stats = null;
  try {
    [page, scan] = await Promise.all([api('GET', '/v1/webhooks/deliveries?' + query.toString()), allDeliveries()]);
  } catch (err) {
    return show(h('h1', {}, t('wh.title')), errorText(err));
  }
  try {
    stats = await api('GET', '/v1/admin/stats?window=1h');
  } catch (err) {
    stats = null;
  }
  const endpoints = endpointSummaries(scan.deliveries);
  const oldestAll = stats ? stats.now.webhook_oldest_pending_s : null;
  const more = page.next_after
    ? h('p', {}, h('a', { href: '#/webhooks?' + new URLSearchParams({ ...Object.fromEntries(query), after: page.next_after }).toString() }, t('next')))
    : null;
  const reload = () => webhooksView(params);
  show(h('h1', {}, t('wh.title')),
    h('h2', {}, t('wh.endpoints')),
    oldestAll !== null && oldestAll !== undefined ? h('p', { class: 'note', id: 'oldest-global' }, t('wh.oldest.global', { age: duration(oldestAll) })) : null,
    scan.complete ? null : h('p', { class: 'note' }, t('wh.scanned', { n: scan.deliveries.length })),
    endpoints.length
      ? h('ul', { class: 'endpoints', id: 'endpoints' }, endpoints.map((e) => h('li', { class: 'card endpoint', 'data-endpoint': e.endpoint, 'data-state': e.state },
        h('h3', {}, h('span', { class: 'url' }, e.endpoint)),
        h('p', {}, h('span', { class: 'badge ' + (e.state === 'healthy' ? 'good' : 'bad') }, coded(t('wh.state.' + e.state), e.state))),
        h('p', { class: 'counts', 'data-delivered': e.delivered, 'data-pending': e.pending, 'data-failed': e.failed, 'data-disabled': e.disabled },
          t('wh.counts', e)),
        h('p', {}, e.oldest
          ? t('wh.oldest', { id: e.oldest.id, seq: e.oldest.event_seq, next: e.oldest.next_attempt_at ? t('wh.oldest.next', { when: timeText(e.oldest.next_attempt_at) }) : '' })
          : t('wh.oldest.none')),
        h('div', { class: 'cell-actions' }, retryAllAction(e, params), replayAction(e, params), enableAction(e, params)))))
      : h('p', { class: 'empty' }, t('wh.none')),
    h('h2', {}, t('wh.deliveries')),
    h('form', { class: 'inline' }, h('label', {}, t('col.status'), filter)),
    table([
      [t('col.id'), (d) => d.id],
      [t('col.endpoint'), (d) => h('span', { class: 'url' }, d.endpoint)],
      [t('col.event'), (d) => h('span', { class: 'mono' }, d.event_id)],
      [t('col.order'), (d) => orderLink(d.order_no)],
      [t('col.status'), (d) => coded(word('delivery.', d.status), d.status)],
      [t('col.attempts'), (d) => d.attempts],
      [t('col.next'), (d) => when(d.next_attempt_at, true)],
      [t('col.last'), (d) => [d.last_status !== null && d.last_status !== undefined ? `HTTP ${d.last_status} ` : '', d.last_error || '', d.last_attempt_at ? [' · ', when(d.last_attempt_at, true)] : ''].flat().filter(Boolean)],
      ['', (d) => retryButton(d, reload)],
    ], page.deliveries, t('wh.none'), { id: 'deliveries' }),
    more);
}

// ---- routing ----

/** The token is checked before anything else is asked or shown. */
async function signIn() {
  if (signedIn) return true;
  try {
    await api('GET', '/v1/admin/mode');
    signedIn = true;
    return true;
  } catch (err) {
    if (err.status !== 401) show(h('h1', {}, t('signin.title')), errorText(err));
    return false;
  }
}

async function route() {
  document.documentElement.lang = lang();
  renderSwitches();
  if (token() === null) return showLogin();
  if (!(await signIn())) return undefined;
  renderNav();
  nav.hidden = false;
  const [path, search] = (location.hash.slice(1) || '/overview').split('?');
  const params = new URLSearchParams(search || '');
  for (const link of nav.querySelectorAll('a')) {
    const view = link.getAttribute('data-view');
    link.classList.toggle('current', path === '/' + view || (view === 'orders' && path.startsWith('/order/')));
  }
  viewSeq += 1;
  // The last view's content goes at once: what is on the page is always what this address loaded.
  fill(main, h('p', { class: 'empty', id: 'loading', 'aria-busy': 'true' }, '…'));
  refreshStatus();
  if (path.startsWith('/order/')) return orderView(decodeURIComponent(path.slice('/order/'.length)));
  switch (path) {
    case '/orders': return ordersView(params);
    case '/findings': return findingsView();
    case '/mode': return modeView();
    case '/reconcile': return reconcileView();
    case '/webhooks': return webhooksView(params);
    default: return overviewView(params);
  }
}

window.addEventListener('hashchange', route);
setInterval(() => { if (token() !== null) refreshStatus(); }, 5000);
route();
