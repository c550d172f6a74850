// payonce's operator console (docs/console.md): the incident runbook
// in a browser, through the public /v1 API only.
//
// Safety rules this file keeps:
// - every value reaches the page as a text node or an attribute through h()
//   (never parsed as HTML), so nothing the API returns can become markup;
// - the token lives in this tab's sessionStorage and travels only as
//   `Authorization: Bearer` (no cookie, so no CSRF);
// - every write gets its Idempotency-Key when its dialog opens and sends
//   the same key on every submit, so a double click is one effect.
'use strict';

const TOKEN_KEY = 'payonce.console.token';
const main = document.getElementById('main');
const statusBar = document.getElementById('status');
const nav = document.getElementById('nav');
const dialog = document.getElementById('dialog');

// ---- DOM ----

/** An element with attributes and children; strings become text nodes. */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
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

function show(...nodes) {
  main.replaceChildren(...nodes.flat());
}

/** A table of `rows` with `columns` = [[heading, row => cell], ...]. */
function table(columns, rows, emptyText) {
  if (!rows.length) return h('p', { class: 'empty' }, emptyText || 'None.');
  return h('table', {},
    h('thead', {}, h('tr', {}, columns.map(([heading]) => h('th', {}, heading)))),
    h('tbody', {}, rows.map((row) => h('tr', {}, columns.map(([, cell]) => {
      const value = cell(row);
      return h('td', {}, value === null || value === undefined ? '—' : value);
    })))));
}

function json(value) {
  return h('span', { class: 'mono' }, JSON.stringify(value));
}

function orderLink(orderNo) {
  return h('a', { href: '#/order/' + encodeURIComponent(orderNo) }, orderNo);
}

function errorText(err) {
  return h('p', { class: 'error', role: 'alert' }, err.message || String(err));
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
    if (response.status === 401) showLogin('The API refused the token; type it again.');
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

// ---- the token ----

function showLogin(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  nav.hidden = true;
  const input = h('input', { type: 'password', name: 'token', autocomplete: 'off', size: 40 });
  const form = h('form', {
    class: 'inline',
    onsubmit: (event) => {
      event.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, input.value.trim());
      route();
    },
  },
  h('label', {}, 'API token (--api-token)', input),
  h('button', { type: 'submit' }, 'Open the console'));
  show(h('h1', {}, 'Sign in'),
    message ? h('p', { class: 'error', role: 'alert' }, message) : null,
    h('p', { class: 'note' }, 'The token is kept in this tab only (sessionStorage) and sent as Authorization: Bearer. ' +
      'Closing the tab forgets it. Leave it empty when payonce runs without --api-token (loopback only).'),
    form);
  input.focus();
}

// ---- the header: health, mode and the key metrics ----

/** The values of one metric family from Prometheus text, by label set. */
function metricValues(text, name) {
  const values = [];
  for (const line of text.split('\n')) {
    if (!line.startsWith(name)) continue;
    const match = /^([a-z_]+)(\{[^}]*\})?\s+(\S+)$/.exec(line);
    if (match && match[1] === name) values.push([match[2] || '', Number(match[3])]);
  }
  return values;
}

function label(labels, name) {
  const match = new RegExp(name + '="([^"]*)"').exec(labels);
  return match ? match[1] : '';
}

async function refreshStatus() {
  const badges = [];
  try {
    await api('GET', '/healthz');
    badges.push(h('span', { class: 'badge good', id: 'health' }, 'healthy'));
  } catch (err) {
    badges.push(h('span', { class: 'badge bad', id: 'health' }, 'unhealthy: ' + (err.code || err.status)));
  }
  try {
    const mode = (await api('GET', '/v1/admin/mode')).mode;
    badges.push(h('span', { class: 'badge ' + (mode === 'normal' ? 'good' : 'warn'), id: 'mode-badge' }, 'mode: ' + mode));
  } catch (err) {
    badges.push(h('span', { class: 'badge bad' }, 'mode: ?'));
  }
  try {
    const text = await api('GET', '/metrics');
    const outcomes = metricValues(text, 'payonce_callback_outcomes_total')
      .filter(([labels]) => label(labels, 'kind') === 'payment')
      .map(([labels, n]) => `${label(labels, 'outcome')} ${n}`);
    const duplicates = metricValues(text, 'payonce_duplicates_suppressed_total').reduce((sum, [, n]) => sum + n, 0);
    const waiting = metricValues(text, 'payonce_received_waiting').map(([, n]) => n)[0] || 0;
    const pending = metricValues(text, 'payonce_webhook_pending').map(([, n]) => n)[0] || 0;
    badges.push(h('span', { class: 'badge', id: 'callbacks' }, 'payments: ' + (outcomes.join(', ') || 'none yet')));
    badges.push(h('span', { class: 'badge', id: 'duplicates' }, 'duplicates suppressed: ' + duplicates));
    badges.push(h('span', { class: 'badge' + (waiting ? ' warn' : ''), id: 'waiting' }, 'records waiting: ' + waiting));
    badges.push(h('span', { class: 'badge' + (pending ? ' warn' : ''), id: 'webhooks-pending' }, 'webhooks pending: ' + pending));
  } catch (err) {
    badges.push(h('span', { class: 'badge bad' }, 'metrics unavailable'));
  }
  statusBar.replaceChildren(...badges);
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
        dialog.close();
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
    h('button', { type: 'button', class: 'secondary', onclick: () => dialog.close() }, 'Cancel'),
    h('button', { type: 'submit', class: danger ? 'danger' : null, 'data-key': key }, submitLabel)));
  dialog.replaceChildren(form);
  dialog.showModal();
}

function reasonField() {
  return h('label', {}, 'Reason (kept in the audit log)', h('textarea', { name: 'reason', required: true, maxlength: 1000 }));
}

// ---- views ----

async function ordersView(params) {
  const userId = params.get('user_id') || '';
  const status = params.get('status') || '';
  const after = params.get('after');
  const query = new URLSearchParams();
  if (userId) query.set('user_id', userId);
  if (status) query.set('status', status);
  if (after) query.set('after', after);
  query.set('limit', '50');
  const orderNo = h('input', { name: 'order_no', placeholder: 'ORD-1' });
  const user = h('input', { name: 'user_id', value: userId });
  const state = h('select', { name: 'status' },
    ['', 'PENDING', 'PAID', 'CLOSED', 'REFUNDING', 'REFUNDED'].map((s) => h('option', { value: s, selected: s === status }, s || 'any')));
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
      location.hash = '#/orders?' + next.toString();
    },
  },
  h('label', {}, 'order_no', orderNo),
  h('label', {}, 'user_id', user),
  h('label', {}, 'status', state),
  h('button', { type: 'submit' }, 'Search'));
  let page;
  try {
    page = await api('GET', '/v1/orders?' + query.toString());
  } catch (err) {
    return show(h('h1', {}, 'Orders'), search, errorText(err));
  }
  const more = page.next_after
    ? h('p', {}, h('a', { href: '#/orders?' + new URLSearchParams({ ...Object.fromEntries(query), after: page.next_after }).toString() }, 'Next page →'))
    : null;
  show(h('h1', {}, 'Orders'), search,
    table([
      ['order_no', (o) => orderLink(o.order_no)],
      ['user_id', (o) => o.user_id],
      ['amount', (o) => o.amount],
      ['status', (o) => o.status],
      ['pay_no', (o) => o.pay_no],
      ['created_at', (o) => o.created_at],
    ], page.orders, 'No orders match.'),
    more);
}

async function orderView(orderNo) {
  let order;
  try {
    order = await api('GET', '/v1/orders/' + encodeURIComponent(orderNo));
  } catch (err) {
    return show(h('h1', {}, 'Order ', orderNo), errorText(err));
  }
  const fields = ['order_no', 'user_id', 'amount', 'currency', 'status', 'pay_no', 'created_at', 'expires_at',
    'paid_at', 'closed_at', 'refund_no', 'refunded_at', 'refunded_amount', 'refunding_amount'];
  show(h('h1', {}, 'Order ', order.order_no),
    h('section', { class: 'card' }, h('dl', { class: 'fields' },
      fields.map((f) => [h('dt', {}, f), h('dd', { 'data-field': f }, order[f] === null ? '—' : order[f])]))),
    h('h2', {}, 'Payments'),
    table([
      ['pay_no', (p) => p.pay_no],
      ['channel', (p) => p.channel],
      ['amount', (p) => p.amount],
      ['outcome', (p) => p.outcome],
      ['state', (p) => p.state],
      ['source', (p) => p.source],
      ['received_at', (p) => p.received_at],
      ['resolution', (p) => p.resolution],
      ['refunds', (p) => ((p.refunds || []).length
        ? (p.refunds || []).map((r) => h('div', { class: 'mono' }, `${r.refund_no} ${r.status}`))
        : null)],
    ], order.payments, 'No payment recorded.'),
    h('h2', {}, 'Refunds'),
    table([
      ['refund_no', (r) => r.refund_no],
      ['amount', (r) => r.amount],
      ['status', (r) => r.status],
      ['reason', (r) => (r.reason === null ? '—' : r.reason)],
      ['requested_at', (r) => r.requested_at],
      ['settled_at', (r) => (r.settled_at === null ? '—' : r.settled_at)],
    ], order.refunds || [], 'No refund.'),
    order.status === 'PAID' ? refundPartAction(order) : null,
    h('h2', {}, 'Coupons'),
    table([['coupon_template_id', (c) => c.coupon_template_id], ['status', (c) => c.status], ['created_at', (c) => c.created_at]],
      order.coupons, 'No coupon.'),
    h('h2', {}, 'Points'),
    table([['point_type', (p) => p.point_type], ['points', (p) => p.points], ['created_at', (p) => p.created_at]],
      order.points, 'No points entry.'),
    h('h2', {}, 'Events'),
    table([['seq', (e) => e.seq], ['type', (e) => e.type], ['event_id', (e) => e.event_id], ['created_at', (e) => e.created_at]],
      order.events, 'No event.'),
    h('h2', {}, 'Platform calls'),
    table([
      ['channel', (c) => c.channel],
      ['kind', (c) => c.kind],
      ['status', (c) => c.status],
      ['attempts', (c) => c.attempts],
      ['http_status', (c) => (c.http_status === null ? '—' : c.http_status)],
      ['created_at', (c) => c.created_at],
    ], order.platform_calls || [], 'No call to a platform.'),
    h('h2', {}, 'Audit'),
    table([['at', (a) => a.at], ['actor', (a) => a.actor], ['action', (a) => a.action], ['detail', (a) => json(a.detail)]],
      order.audit, 'No audit row.'));
}

/** Refund part of a PAID order: its amount, at most what is left. */
function refundPartAction(order) {
  const left = order.amount - order.refunded_amount;
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-refund-part': order.order_no,
    onclick: () => writeDialog({
      title: `Refund part of ${order.order_no}`,
      explain: `${left} of ${order.amount} (minor units) is left to refund. The refund goes to the platform ` +
        'that took the payment; the order is PAID again once it succeeds, REFUNDED when nothing is left.',
      fields: [
        h('label', {}, 'Refund number', h('input', { name: 'refund_no', required: true, maxlength: 64, pattern: '[A-Za-z0-9_.\\-]+' })),
        h('label', {}, 'Amount (minor units)', h('input', { name: 'amount', type: 'number', required: true, min: 1, max: left, step: 1 })),
        h('label', {}, 'Reason (shown to the buyer)', h('input', { name: 'reason', maxlength: 80 })),
      ],
      submitLabel: 'Refund',
      danger: true,
      send: (values, key) => api('POST', `/v1/orders/${encodeURIComponent(order.order_no)}/refunds`, {
        key,
        json: {
          refund_no: values.refund_no,
          amount: Number(values.amount),
          ...(values.reason ? { reason: values.reason } : {}),
        },
      }),
      done: () => orderView(order.order_no),
    }),
  }, 'Refund part');
}

function resolveCloseAction(finding) {
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-resolve-close': finding.order_no,
    onclick: () => writeDialog({
      title: `Resolve the close of ${finding.order_no}`,
      explain: `payonce closed this order without ${finding.detail.platforms.join(' and ')} confirming it. ` +
        'Check at the platform that the buyer did not pay, then say what you found.',
      fields: [reasonField()],
      submitLabel: 'Resolve',
      send: (values, key) => api('POST', `/v1/admin/orders/${encodeURIComponent(finding.order_no)}/resolve-close`,
        { key, json: { reason: values.reason } }),
      done: () => findingsView(),
    }),
  }, 'Resolve…');
}

function resolveAction(finding) {
  if (finding.kind === 'close_unconfirmed') return resolveCloseAction(finding);
  const target = finding.kind === 'refund_required'
    ? { noun: 'payment', id: finding.detail.pay_no, path: '/v1/admin/payments/' }
    : finding.kind === 'unexpected_refund'
      ? { noun: 'refund', id: finding.detail.refund_no, path: '/v1/admin/refunds/' }
      : null;
  if (!target || !target.id) return null;
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-resolve': target.id,
    onclick: () => writeDialog({
      title: `Resolve ${target.noun} ${target.id}`,
      explain: finding.kind === 'refund_required'
        ? 'The buyer paid this order more than once, late, or a different amount. Say what was done with the money.'
        : 'The platform reported a refund payonce did not request. Say what was done about it.',
      fields: [
        h('label', {}, 'Resolution', h('select', { name: 'resolution' },
          h('option', { value: 'refunded_externally' }, 'refunded_externally: the money went back outside payonce'),
          h('option', { value: 'accepted' }, 'accepted: keep it as it is'))),
        reasonField(),
      ],
      submitLabel: 'Resolve',
      send: (values, key) => api('POST', target.path + encodeURIComponent(target.id) + '/resolve',
        { key, json: { resolution: values.resolution, reason: values.reason } }),
      done: () => findingsView(),
    }),
  }, 'Resolve…');
}

/** The refund payonce requested for a refund-required payment, if the finding carries one. */
function findingRefund(finding) {
  return finding.detail.refund || finding.refund || null;
}

/** null, or `refunding` while the payment's refund is in flight. */
function findingResolution(finding) {
  return finding.detail.resolution || finding.resolution || null;
}

/** What the buyer reads beside the money (WeChat Pay and Alipay show the reason). */
const BUYER_REASONS = {
  already_paid: 'Duplicate payment refunded',
  paid_after_close: 'Payment after the order closed refunded',
  amount_mismatch: 'Payment of the wrong amount refunded',
};

/** A refused refund, said in the operator's terms (the API's code and message first). */
function refundRefusal(err, channel) {
  if (!(err instanceof ApiError)) return err;
  if (err.code === 'channel_not_configured') {
    return new Error(`${err.message}\n${channel} has no outgoing settings in this payonce, so payonce cannot ` +
      `return this money itself: refund it by hand in ${channel}'s own console, then Resolve… it as refunded_externally.`);
  }
  if (err.code === 'invalid_transition') {
    return new Error(`${err.message}\nThis payment is no longer waiting for its money to go back ` +
      '(it was resolved, refunded, or its refund is in flight). Reload the findings.');
  }
  return err;
}

/**
 * Refund to the buyer: payonce asks the platform that took this payment to
 * return its whole amount, under a refund number of its own, once.
 */
function refundAction(finding, failed) {
  const { pay_no: payNo, channel, amount, outcome } = finding.detail;
  return h('button', {
    type: 'button',
    class: 'secondary',
    'data-refund': payNo,
    onclick: () => writeDialog({
      title: `Refund ${payNo} to the buyer`,
      explain: `payonce asks ${channel} to return this payment's whole amount to the buyer, once. The order ` +
        `${finding.order_no} is not touched. The result arrives by the platform's refund notice or payonce's query.` +
        (failed ? ` The last refund, ${failed.refund_no}, failed; this is a new attempt under a new refund number.` : ''),
      fields: [
        h('dl', { class: 'fields' },
          h('dt', {}, 'pay_no'), h('dd', { 'data-field': 'pay_no' }, payNo),
          h('dt', {}, 'channel'), h('dd', { 'data-field': 'channel' }, channel),
          h('dt', {}, 'amount'), h('dd', { 'data-field': 'amount' }, amount, ' (minor units)'),
          h('dt', {}, 'outcome'), h('dd', { 'data-field': 'outcome' }, outcome)),
        h('label', {}, 'Reason (shown to the buyer, 1–80 characters)',
          h('input', { name: 'reason', required: true, minlength: 1, maxlength: 80, size: 40,
            value: BUYER_REASONS[outcome] || 'Payment refunded' })),
      ],
      submitLabel: 'Refund',
      danger: true,
      send: (values, key) => api('POST', `/v1/admin/payments/${encodeURIComponent(payNo)}/refund`,
        { key, json: { reason: values.reason } }).catch((err) => { throw refundRefusal(err, channel); }),
      done: (answer) => findingsView().then(() => main.prepend(h('p', { class: 'note', id: 'refund-requested' },
        `Refund ${answer.refund.refund_no} of ${answer.refund.amount} requested at ${channel}: ${answer.refund.status}.`))),
    }),
  }, 'Refund to the buyer…');
}

/** A refund_required finding: refund it, or resolve it; nothing while its refund is in flight. */
function refundRequiredActions(finding) {
  const refund = findingRefund(finding);
  if (findingResolution(finding) === 'refunding') {
    return h('span', { class: 'badge warn', 'data-refund-in-flight': finding.detail.pay_no },
      `refund in flight (${refund ? refund.refund_no : '?'})`);
  }
  const failed = refund && refund.status === 'FAILED' ? refund : null;
  return h('div', { class: 'cell-actions' },
    failed ? h('p', { class: 'error', 'data-refund-failed': finding.detail.pay_no },
      `refund ${failed.refund_no} FAILED`, failed.settled_at ? ` at ${failed.settled_at}` : '') : null,
    refundAction(finding, failed),
    resolveAction(finding));
}

async function findingsView() {
  let inspection;
  try {
    inspection = await api('GET', '/v1/inspections');
  } catch (err) {
    return show(h('h1', {}, 'Findings'), errorText(err));
  }
  show(h('h1', {}, 'Findings'),
    h('p', { class: 'note' }, inspection.ok ? 'The inspection is clean.' : `${inspection.findings.length} finding(s).`),
    table([
      ['kind', (f) => f.kind],
      ['order_no', (f) => (f.order_no ? orderLink(f.order_no) : null)],
      ['detail', (f) => json(f.detail)],
      ['', (f) => (f.kind === 'refund_required' ? refundRequiredActions(f) : resolveAction(f))],
    ], inspection.findings, 'No findings.'));
}

const RECORD_ONLY_EXPLAINED =
  'In record-only mode payonce keeps answering every payment platform and records each payment callback ' +
  'exactly once, but decides nothing: no order is marked paid, no coupon or points are issued, and no ' +
  'order expires. Switching back to normal decides the kept records in arrival order (or use Drain).';

async function modeView() {
  let mode;
  let waiting = 0;
  try {
    mode = (await api('GET', '/v1/admin/mode')).mode;
    const text = await api('GET', '/metrics');
    waiting = metricValues(text, 'payonce_received_waiting').map(([, n]) => n)[0] || 0;
  } catch (err) {
    return show(h('h1', {}, 'Mode'), errorText(err));
  }
  const target = mode === 'normal' ? 'record_only' : 'normal';
  show(h('h1', {}, 'Mode'),
    h('section', { class: 'card' },
      h('p', {}, 'The mode is ', h('strong', { id: 'mode-now' }, mode), '.'),
      h('p', {}, 'Records waiting to be decided: ', h('strong', { id: 'waiting-now' }, waiting), '.'),
      h('p', { class: 'note' }, RECORD_ONLY_EXPLAINED)),
    h('p', {},
      h('button', {
        type: 'button',
        id: 'switch-mode',
        class: target === 'record_only' ? 'danger' : null,
        onclick: () => writeDialog({
          title: target === 'record_only' ? 'Switch to record-only?' : 'Switch back to normal?',
          explain: target === 'record_only'
            ? RECORD_ONLY_EXPLAINED
            : `Back to normal: the ${waiting} record(s) kept meanwhile are decided in arrival order by the sweeper.`,
          submitLabel: target === 'record_only' ? 'Switch to record-only' : 'Switch to normal',
          danger: target === 'record_only',
          send: (values, key) => api('PUT', '/v1/admin/mode', { key, json: { mode: target } }),
          done: () => modeView(),
        }),
      }, target === 'record_only' ? 'Switch to record-only…' : 'Switch to normal…'),
      ' ',
      h('button', {
        type: 'button',
        id: 'drain',
        class: 'secondary',
        onclick: () => writeDialog({
          title: 'Decide the waiting records now?',
          explain: 'Every record kept in record-only mode is decided now, in arrival order, whatever the mode.',
          submitLabel: 'Drain',
          send: (values, key) => api('POST', '/v1/admin/drain', { key, json: {} }),
          done: (answer) => modeView().then(() => main.prepend(h('p', { class: 'note', id: 'drained' }, `Decided ${answer.applied} record(s).`))),
        }),
      }, 'Drain now…')));
}

function differenceRows(result) {
  return ['missing_local', 'missing_remote', 'amount_mismatch'].flatMap((section) =>
    (result[section] || []).map((row) => ({ section, ...row })));
}

function reconciliationTable(result) {
  return [
    h('p', { id: 'recon-summary' },
      `Days ${(result.period || []).join(', ')}; compared ${(result.compared || []).join(' and ')} rows; ${result.matched} matched.`),
    table([
      ['difference', (r) => r.section],
      ['kind', (r) => r.kind],
      ['pay_no', (r) => r.pay_no],
      ['order_no', (r) => orderLink(r.order_no)],
      ['amount (platform)', (r) => r.amount_platform],
      ['amount (payonce)', (r) => r.amount_local],
    ], differenceRows(result), 'No differences.'),
  ];
}

function reconcileView() {
  const file = h('input', { type: 'file', name: 'statement', required: true });
  const format = h('select', { name: 'format' }, ['generic', 'wechatpay', 'alipay'].map((f) => h('option', { value: f }, f)));
  const date = h('input', { name: 'date', placeholder: 'YYYY-MM-DD (optional)' });
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
      result.replaceChildren(...reconciliationTable(answer),
        missing ? h('p', {}, h('button', {
          type: 'button',
          id: 'repair',
          class: 'danger',
          onclick: () => writeDialog({
            title: `Repair ${missing} payment(s)?`,
            explain: `The platform has ${missing} payment(s) payonce never recorded. Repair applies each through ` +
              'the same exactly-once path as a callback (source reconciliation), with the rewards serve runs with.',
            submitLabel: 'Repair',
            danger: true,
            send: (values, key) => api('POST', query(true), { key, body: text }),
            done: (repaired) => result.replaceChildren(...reconciliationTable(repaired),
              h('h2', {}, 'Repaired'),
              table([
                ['pay_no', (r) => r.pay_no],
                ['order_no', (r) => orderLink(r.order_no)],
                ['outcome', (r) => r.outcome || (r.error && r.error.code)],
              ], repaired.repaired || [], 'Nothing repaired.')),
          }),
        }, 'Repair…')) : null);
    } catch (err) {
      result.replaceChildren(errorText(err));
    }
  };
  show(h('h1', {}, 'Reconcile'),
    h('p', { class: 'note' }, 'Compare a platform statement with what payonce recorded. Nothing changes until you repair.'),
    h('form', { class: 'inline', onsubmit: compare },
      h('label', {}, 'Statement file', file),
      h('label', {}, 'Format', format),
      h('label', {}, 'Date', date),
      h('button', { type: 'submit', id: 'compare' }, 'Compare')),
    result);
}

async function webhooksView(params) {
  const status = params.get('status') || '';
  const after = params.get('after');
  const query = new URLSearchParams({ limit: '50' });
  if (status) query.set('status', status);
  if (after) query.set('after', after);
  const filter = h('select', {
    name: 'status',
    onchange: (event) => { location.hash = '#/webhooks' + (event.target.value ? '?status=' + event.target.value : ''); },
  }, ['', 'pending', 'delivered', 'failed', 'disabled'].map((s) => h('option', { value: s, selected: s === status }, s || 'any')));
  let page;
  try {
    page = await api('GET', '/v1/webhooks/deliveries?' + query.toString());
  } catch (err) {
    return show(h('h1', {}, 'Webhook deliveries'), errorText(err));
  }
  const retry = (d) => (d.status === 'failed' || d.status === 'disabled'
    ? h('button', {
      type: 'button',
      class: 'secondary',
      'data-retry': d.id,
      onclick: () => writeDialog({
        title: `Send delivery ${d.id} again?`,
        explain: `${d.event_id} to ${d.endpoint} goes back to pending, due now, with the whole retry schedule ` +
          'ahead and the same webhook-id.',
        submitLabel: 'Retry',
        send: (values, key) => api('POST', `/v1/webhooks/deliveries/${encodeURIComponent(d.id)}/retry`, { key, json: {} }),
        done: () => webhooksView(params),
      }),
    }, 'Retry…')
    : null);
  const more = page.next_after
    ? h('p', {}, h('a', { href: '#/webhooks?' + new URLSearchParams({ ...Object.fromEntries(query), after: page.next_after }).toString() }, 'Next page →'))
    : null;
  show(h('h1', {}, 'Webhook deliveries'),
    h('form', { class: 'inline' }, h('label', {}, 'status', filter)),
    table([
      ['id', (d) => d.id],
      ['endpoint', (d) => h('span', { class: 'mono' }, d.endpoint)],
      ['event_id', (d) => d.event_id],
      ['order_no', (d) => orderLink(d.order_no)],
      ['status', (d) => d.status],
      ['attempts', (d) => d.attempts],
      ['next_attempt_at', (d) => d.next_attempt_at],
      ['last_status', (d) => d.last_status],
      ['last_error', (d) => d.last_error],
      ['', retry],
    ], page.deliveries, 'No deliveries.'),
    more);
}

// ---- routing ----

async function route() {
  if (token() === null) return showLogin();
  nav.hidden = false;
  const [path, search] = (location.hash.slice(1) || '/orders').split('?');
  const params = new URLSearchParams(search || '');
  for (const link of nav.querySelectorAll('a')) {
    link.classList.toggle('current', path.startsWith(link.getAttribute('href').slice(1)));
  }
  refreshStatus();
  if (path.startsWith('/order/')) return orderView(decodeURIComponent(path.slice('/order/'.length)));
  switch (path) {
    case '/findings': return findingsView();
    case '/mode': return modeView();
    case '/reconcile': return reconcileView();
    case '/webhooks': return webhooksView(params);
    default: return ordersView(params);
  }
}

window.addEventListener('hashchange', route);
setInterval(() => { if (token() !== null) refreshStatus(); }, 5000);
route();
