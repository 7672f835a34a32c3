// accrue status page, the entry module: sign in, routing, the jobs list and
// the page's controls. Plain JavaScript modules, no dependencies: util.js
// (formatting, DOM), api.js (token, requests), series.js (the curve's
// buckets), charts.js (SVG charts), job.js (a job's page), compare.js
// (jobs' losses on one chart). Every string that
// comes from the server is inserted as text (textContent / createTextNode /
// attribute values), never parsed as markup.
import { $, DASH, FINAL, enc, fin, sig, fmtInt, fmtDur, str, el, setText, setBadge, setProgress, showOnly,
  showWorkerCount, note, clearNotes } from './util.js';
import { session, saveToken, forgetToken, onUnauthorized, getJSON, listJobs, poller, POLL_MS, redeemSignIn } from './api.js';
import { bindCharts } from './charts.js';
import { jobView } from './job.js';
import { compareView, compareIds, compareHash } from './compare.js';

let view = null; // the current view: {stop(), render?()}
let bootTimer = null;

// ---- sign in ------------------------------------------------------------
function unauthorized(msg) {
  if (view) { view.stop(); view = null; }
  const had = !!session.token;
  forgetToken();
  showLogin(had ? 'The token was refused (' + msg + ').' : '');
}
function showLogin(msg) {
  clearNotes();
  showOnly('login');
  $('signout').hidden = true;
  setText($('principal'), '');
  const e = $('login-error');
  setText(e, msg || '');
  e.hidden = !msg;
  $('token').focus();
}
// A one-use sign-in link (`accrue local` prints one): #signin=CODE. The
// code leaves the address bar (and the history) at once, then is
// exchanged for a token, kept as a typed one is.
const SIGNIN = /^#signin=(.*)$/;
function signInFromLink() {
  const m = SIGNIN.exec(location.hash);
  if (!m) return false;
  history.replaceState(null, '', location.pathname + location.search);
  (async () => {
    try {
      saveToken((await redeemSignIn(m[1])).token);
      boot();
    } catch (e) {
      const msg = 'This sign-in link was refused (' + e.message + '). Ask for a new one, or paste a token.';
      if (session.token) { await boot(); note('signin', msg); } else showLogin(msg);
    }
  })();
  return true;
}
async function boot() {
  clearTimeout(bootTimer);
  try {
    session.who = await getJSON('/v1/whoami');
  } catch (e) {
    if (e.status === 401) return;
    if (e.status === 404) {
      session.who = { auth: null, principal: null, scopes: [] }; // an older coordinator: no cancel button
    } else {
      note('boot', 'Cannot reach the coordinator (' + e.message + '); retrying');
      bootTimer = setTimeout(boot, 3000);
      return;
    }
  }
  note('boot', '');
  $('login-error').hidden = true;
  const who = session.who;
  const scopes = Array.isArray(who.scopes) ? who.scopes : [];
  setText($('principal'), who.auth === false ? 'no authentication'
    : who.principal ? who.principal + ' (' + (scopes.join(', ') || 'no scope') + ')' : '');
  $('signout').hidden = !session.token;
  route();
}

// ---- routing ------------------------------------------------------------
function route() {
  if (!session.who) return;
  if (view) { view.stop(); view = null; }
  clearNotes();
  const m = /^#\/jobs\/(.+)$/.exec(location.hash);
  const cmp = /^#\/compare\/(.+)$/.exec(location.hash);
  if (m) {
    let id = m[1];
    try { id = decodeURIComponent(id); } catch (_) { /* keep raw */ }
    view = jobView(id);
  } else if (cmp) {
    view = compareView(compareIds(cmp[1]));
  } else {
    view = listView();
  }
}

// ---- jobs list ----------------------------------------------------------
const listRows = new Map(); // job id -> row cells, reused across refreshes and visits
const picked = new Set(); // ids ticked for comparing

function showPicked() {
  const b = $('compare');
  b.disabled = picked.size < 2;
  setText(b, picked.size ? 'Compare ' + picked.size : 'Compare');
}
function makeRow(id) {
  const c = { tr: el('tr'), pick: el('input', 'pick'), a: el('a', null, id), name: el('td', 'cell-name'), owner: el('td', 'cell-owner'),
    badge: el('span', 'badge'), prog: el('progress'), steps: el('span'), eta: el('td'),
    loss: el('td', 'num'), sps: el('td', 'num'), workers: el('td', 'num') };
  c.tr.dataset.job = id;
  c.a.href = '#/jobs/' + enc(id);
  c.pick.type = 'checkbox';
  c.pick.setAttribute('aria-label', 'compare ' + id);
  c.pick.checked = picked.has(id);
  c.pick.addEventListener('change', () => {
    if (c.pick.checked) picked.add(id); else picked.delete(id);
    showPicked();
  });
  const tdPick = el('td', 'pick');
  tdPick.append(c.pick);
  const tdId = el('td');
  tdId.append(c.a);
  const tdState = el('td');
  tdState.append(c.badge);
  const tdProg = el('td');
  const wrap = el('div', 'progress-cell');
  wrap.append(c.prog, c.steps);
  tdProg.append(wrap);
  c.tr.append(tdPick, tdId, c.name, c.owner, tdState, tdProg, c.eta, c.loss, c.sps, c.workers);
  return c;
}
function updateRow(c, j) {
  const k = j.counters || {};
  setText(c.name, str(j.name));
  setText(c.owner, str(j.owner));
  setBadge(c.badge, j.state);
  setProgress(c.prog, k.step, k.total_steps);
  setText(c.steps, (fin(k.step) ? k.step : 0) + '/' + (fin(k.total_steps) ? k.total_steps : '?'));
  setText(c.eta, FINAL.has(j.state) ? DASH : fmtDur(j.eta_s));
  setText(c.loss, sig(k.loss));
  // A language model (issue 30) counts tokens: its samples/s are tokens/s.
  setText(c.sps, fmtInt(k.samples_per_sec) + (j.unit === 'tokens' && fin(k.samples_per_sec) ? ' tokens/s' : ''));
  setText(c.workers, Array.isArray(j.workers) ? j.workers.length : 0);
}

function listView() {
  showOnly('view-list');
  document.title = 'accrue: jobs';
  const tbody = $('jobs').tBodies[0];
  const jobs = async function jobs() {
    const js = await listJobs();
    const seen = new Set();
    let i = 0;
    for (const j of js) {
      const id = String(j.id);
      if (seen.has(id)) continue;
      seen.add(id);
      let c = listRows.get(id);
      if (!c) { c = makeRow(id); listRows.set(id, c); }
      updateRow(c, j);
      const at = tbody.children[i];
      if (at !== c.tr) tbody.insertBefore(c.tr, at || null);
      i++;
    }
    for (const [id, c] of listRows) {
      if (!seen.has(id)) { c.tr.remove(); listRows.delete(id); picked.delete(id); }
    }
    showPicked();
    const counts = {};
    for (const j of js) counts[j.state] = (counts[j.state] || 0) + 1;
    setText($('jobs-summary'), js.length + (js.length === 1 ? ' job' : ' jobs')
      + Object.keys(counts).sort().map((s) => ' \u00b7 ' + counts[s] + ' ' + s).join(''));
    $('jobs-empty').hidden = js.length > 0;
    note('jobs', '');
  };
  const workers = async function workers() {
    const d = await getJSON('/v1/workers');
    showWorkerCount(Array.isArray(d.workers) ? d.workers : []);
    note('workers', '');
  };
  const stops = [poller(jobs, POLL_MS), poller(workers, POLL_MS)];
  return { stop() { for (const s of stops) s(); } };
}

// ---- wiring ---------------------------------------------------------------------
onUnauthorized(unauthorized);
bindCharts();
$('login-form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  const t = $('token').value.trim();
  if (!t) return;
  saveToken(t);
  $('token').value = '';
  boot();
});
$('signout').addEventListener('click', () => {
  if (view) { view.stop(); view = null; }
  forgetToken();
  setText($('worker-count'), '');
  boot();
});
const redraw = () => {
  if (view && view.schedule) { view.dirty.charts = true; view.schedule(); } else if (view && view.render) view.render();
};
$('x-axis').addEventListener('change', redraw);
for (const [box, range, out] of [['log-y', 'smoothing', 'smoothing-value'], ['cmp-log', 'cmp-smoothing', 'cmp-smoothing-value']]) {
  $(box).addEventListener('change', redraw);
  $(range).addEventListener('input', () => { setText($(out), Number($(range).value).toFixed(2)); redraw(); });
}
for (const fmt of ['csv', 'json']) $('export-' + fmt).addEventListener('click', () => { if (view && view.exportSeries) view.exportSeries(fmt); });
$('compare').addEventListener('click', () => { if (picked.size >= 2) location.hash = compareHash([...picked]); });
$('cancel').addEventListener('click', async () => {
  const v = view;
  if (!v || !v.job || !v.setJob) return;
  if (!window.confirm('Cancel job ' + v.id + '?')) return;
  const b = $('cancel');
  const e = $('cancel-error');
  b.disabled = true;
  try {
    const j = await getJSON('/v1/jobs/' + enc(v.id) + '/cancel', { method: 'POST' });
    e.hidden = true;
    if (!v.stopped) v.setJob(j);
  } catch (err) {
    if (err.status !== 401) { setText(e, 'Cancel refused: ' + err.message); e.hidden = false; }
  } finally {
    b.disabled = false;
  }
});
$('resume').addEventListener('click', async () => {
  const v = view;
  if (!v || !v.job || !v.setJob) return;
  if (!window.confirm('Resume job ' + v.id + ' from its newest checkpoint?')) return;
  const b = $('resume');
  const e = $('resume-error');
  b.disabled = true;
  try {
    await getJSON('/v1/jobs/' + enc(v.id) + '/resume', { method: 'POST' });
    e.hidden = true;
    // Live again: follow it afresh (its stream had ended with the job).
    if (view === v) route();
  } catch (err) {
    if (err.status !== 401) { setText(e, 'Resume refused: ' + err.message); e.hidden = false; }
  } finally {
    b.disabled = false;
  }
});
window.addEventListener('hashchange', () => { if (!signInFromLink()) route(); });
// For measurements: one full synchronous render of the current view, in ms.
window.__accrueRender = () => {
  if (!view || !view.render) return null;
  const t0 = performance.now();
  view.render();
  return performance.now() - t0;
};
if (!signInFromLink()) boot();
