// accrue status page: the coordinator's /v1 API, the bearer token (kept in
// this tab's session storage only) and who it is, polling.
import { note } from './util.js';

const TOKEN_KEY = 'accrue-token';
export const POLL_MS = 2000;

// token: the bearer token or null; who: GET /v1/whoami, null until known.
export const session = { token: null, who: null };
try { session.token = sessionStorage.getItem(TOKEN_KEY); } catch (_) { /* storage disabled */ }

export function saveToken(t) {
  session.token = t;
  try { sessionStorage.setItem(TOKEN_KEY, t); } catch (_) { /* tab-only */ }
}
export function forgetToken() {
  session.token = null;
  session.who = null;
  try { sessionStorage.removeItem(TOKEN_KEY); } catch (_) { /* ignore */ }
}

// Called with the error text when a request is answered 401 (app.js signs out).
let unauthorized = () => {};
export function onUnauthorized(fn) { unauthorized = fn; }

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}
async function errorText(r) {
  let t = '';
  try { t = await r.text(); } catch (_) { /* no body */ }
  try {
    const j = JSON.parse(t);
    if (j && typeof j.error === 'string') t = j.error;
  } catch (_) { /* plain text */ }
  t = t.trim();
  return r.status + (r.statusText ? ' ' + r.statusText : '') + (t ? ': ' + t : '');
}
export async function api(path, opts = {}) {
  const headers = new Headers(opts.headers || {});
  if (session.token) headers.set('Authorization', 'Bearer ' + session.token);
  const r = await fetch(path, { ...opts, headers, cache: 'no-store', credentials: 'same-origin' });
  if (r.status === 401) {
    const msg = await errorText(r);
    unauthorized(msg);
    throw new HttpError(401, msg);
  }
  if (!r.ok) throw new HttpError(r.status, await errorText(r));
  return r;
}
export const getJSON = async (path, opts) => (await api(path, opts)).json();

// A one-use sign-in code exchanged for {token, principal, scopes}: POST
// /v1/signin, without a token (a refusal here is not a refused token).
export async function redeemSignIn(code) {
  const r = await fetch('/v1/signin', { method: 'POST', cache: 'no-store', credentials: 'same-origin',
    headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ code }) });
  if (!r.ok) throw new HttpError(r.status, await errorText(r));
  return r.json();
}

// Every job, oldest first: GET /v1/jobs pages (at most 1000 jobs each),
// followed until next_page_token is empty.
export async function listJobs() {
  const all = [];
  let token = '';
  do {
    const q = '?page_size=1000' + (token ? '&page_token=' + encodeURIComponent(token) : '');
    const d = await getJSON('/v1/jobs' + q);
    if (Array.isArray(d.jobs)) all.push(...d.jobs);
    token = typeof d.next_page_token === 'string' ? d.next_page_token : '';
  } while (token);
  return all;
}
export const quiet = (e) => e && (e.name === 'AbortError' || e.status === 401);

// Whether the signed-in principal may cancel or resume `job`: its owner
// with the submit scope, or admin (the server decides again).
export function canCancel(job) {
  const who = session.who;
  if (!who || !job) return false;
  if (who.auth === false) return true;
  const s = Array.isArray(who.scopes) ? who.scopes : [];
  return s.includes('admin') || (s.includes('submit') && !!who.principal && who.principal === job.owner);
}
export const canResume = canCancel;

// fn every ms until the returned stop is called; its errors go to the status line.
export function poller(fn, ms) {
  let timer = null;
  let stopped = false;
  const tick = async () => {
    if (stopped) return;
    try { await fn(); } catch (e) { if (!stopped && !quiet(e)) note(fn.name || 'poll', e.message); }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}
