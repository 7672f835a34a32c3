// accrue status page: formatting, DOM helpers and the status line. Every
// string that comes from the server is inserted as text (textContent /
// createTextNode / attribute values), never parsed as markup.
export const FINAL = new Set(['succeeded', 'failed', 'cancelled']);
export const DASH = '\u2013';
const SVGNS = 'http://www.w3.org/2000/svg';
export const $ = (id) => document.getElementById(id);
export const enc = encodeURIComponent;

// ---- formatting -------------------------------------------------------
export const fin = (v) => typeof v === 'number' && Number.isFinite(v);
const pad2 = (n) => String(n).padStart(2, '0');
export function sig(v, n = 4) {
  if (!fin(v)) return DASH;
  if (v === 0) return '0';
  const a = Math.abs(v);
  if (a >= 1e-3 && a < 1e6) return v.toFixed(Math.max(0, n - 1 - Math.floor(Math.log10(a))));
  return v.toExponential(n - 1);
}
export function fmtLr(v) {
  if (!fin(v)) return DASH;
  if (v === 0) return '0';
  const a = Math.abs(v);
  return a < 1e-2 || a >= 1e4 ? v.toExponential(2) : sig(v, 3);
}
export const fmtInt = (v) => (fin(v) ? String(Math.round(v)) : DASH);
export function fmtCount(v) {
  if (!fin(v)) return DASH;
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(2) + 'G';
  if (a >= 1e6) return (v / 1e6).toFixed(2) + 'M';
  if (a >= 1e4) return (v / 1e3).toFixed(1) + 'k';
  return String(Math.round(v));
}
export function fmtDur(s) {
  if (!fin(s) || s < 0) return DASH;
  s = Math.round(s);
  if (s < 60) return s + 's';
  if (s < 3600) return Math.floor(s / 60) + 'm ' + pad2(s % 60) + 's';
  return Math.floor(s / 3600) + 'h ' + pad2(Math.floor((s % 3600) / 60)) + 'm';
}
export const fmtPct = (v) => (fin(v) ? (v * 100).toFixed(2) + '%' : DASH);
export function fmtClock(ms) {
  if (!fin(ms) || ms <= 0) return DASH;
  const d = new Date(ms);
  return pad2(d.getHours()) + ':' + pad2(d.getMinutes()) + ':' + pad2(d.getSeconds());
}
export function fmtWhen(ms) {
  if (!fin(ms) || ms <= 0) return DASH;
  const d = new Date(ms);
  return d.getFullYear() + '-' + pad2(d.getMonth() + 1) + '-' + pad2(d.getDate()) + ' ' + fmtClock(ms);
}
export const list = (a) => (Array.isArray(a) && a.length ? a.join(', ') : DASH);
export const str = (v) => (v === null || v === undefined || v === '' ? DASH : String(v));

// ---- DOM helpers ------------------------------------------------------
export function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
export function sv(tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  if (attrs) for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
export function setText(e, t) {
  t = String(t);
  if (e.textContent !== t) e.textContent = t;
}
const stateClass = (s) => 'badge state-' + String(s || 'unspecified').replace(/[^a-z]/g, '');
export function setBadge(e, s) {
  const c = stateClass(s);
  if (e.className !== c) e.className = c;
  setText(e, s || DASH);
}
export function setProgress(p, step, total) {
  if (fin(total) && total > 0) {
    if (p.max !== total) p.max = total;
    const v = Math.min(fin(step) ? step : 0, total);
    if (!p.hasAttribute('value') || p.value !== v) p.value = v;
  } else if (p.hasAttribute('value')) {
    p.removeAttribute('value');
  }
}
// `text` saved as file `name` (a Blob behind an object URL and a click on
// an <a download>).
export function download(name, type, text) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = el('a');
  a.href = url;
  a.download = name;
  a.hidden = true;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}
export function row(cells) {
  const tr = el('tr');
  for (const [text, cls] of cells) tr.append(el('td', cls, text));
  return tr;
}
export function showOnly(id) {
  for (const s of ['login', 'view-list', 'view-job', 'view-compare']) $(s).hidden = s !== id;
}
export function showWorkerCount(ws) {
  const busy = ws.filter((w) => w.job).length;
  setText($('worker-count'), ws.length + (ws.length === 1 ? ' worker' : ' workers') + ' attached'
    + (ws.length ? ' (' + busy + ' busy)' : ''));
}

// ---- the status line: one message per key ---------------------------------
const statuses = new Map();
export function note(key, msg) {
  if (msg) statuses.set(key, msg);
  else statuses.delete(key);
  const e = $('status');
  const t = [...statuses.values()].join(' \u00b7 ');
  setText(e, t);
  e.hidden = !t;
}
export function clearNotes() {
  statuses.clear();
  note('', '');
}
