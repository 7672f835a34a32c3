// accrue status page. Plain JavaScript, no dependencies. Every string that
// comes from the server is inserted as text (textContent / createTextNode /
// attribute values), never parsed as markup.
'use strict';
(() => {
  const TOKEN_KEY = 'accrue-token';
  const FINAL = new Set(['succeeded', 'failed', 'cancelled']);
  const BOUND = 1000; // points a chart holds at most (the server merges to the same)
  const RENDER_MS = 250; // at most ~4 renders a second
  const POLL_MS = 2000;
  const COLS = ['first_step', 'last_step', 'count', 'samples_seen', 'wall_ms', 'loss', 'loss_min',
    'loss_max', 'grad_norm', 'grad_norm_max', 'clip_coef', 'clip_coef_min', 'lr', 'samples_per_sec', 'skipped'];
  const DASH = '\u2013';
  const SVGNS = 'http://www.w3.org/2000/svg';
  const $ = (id) => document.getElementById(id);
  const enc = encodeURIComponent;

  let token = null;
  try { token = sessionStorage.getItem(TOKEN_KEY); } catch (_) { /* storage disabled */ }
  let who = null; // GET /v1/whoami
  let view = null; // the current view: {stop(), render?()}
  let bootTimer = null;

  // ---- formatting -------------------------------------------------------
  const fin = (v) => typeof v === 'number' && Number.isFinite(v);
  const pad2 = (n) => String(n).padStart(2, '0');
  function sig(v, n = 4) {
    if (!fin(v)) return DASH;
    if (v === 0) return '0';
    const a = Math.abs(v);
    if (a >= 1e-3 && a < 1e6) return v.toFixed(Math.max(0, n - 1 - Math.floor(Math.log10(a))));
    return v.toExponential(n - 1);
  }
  function fmtLr(v) {
    if (!fin(v)) return DASH;
    if (v === 0) return '0';
    const a = Math.abs(v);
    return a < 1e-2 || a >= 1e4 ? v.toExponential(2) : sig(v, 3);
  }
  const fmtInt = (v) => (fin(v) ? String(Math.round(v)) : DASH);
  function fmtCount(v) {
    if (!fin(v)) return DASH;
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(2) + 'G';
    if (a >= 1e6) return (v / 1e6).toFixed(2) + 'M';
    if (a >= 1e4) return (v / 1e3).toFixed(1) + 'k';
    return String(Math.round(v));
  }
  function fmtDur(s) {
    if (!fin(s) || s < 0) return DASH;
    s = Math.round(s);
    if (s < 60) return s + 's';
    if (s < 3600) return Math.floor(s / 60) + 'm ' + pad2(s % 60) + 's';
    return Math.floor(s / 3600) + 'h ' + pad2(Math.floor((s % 3600) / 60)) + 'm';
  }
  const fmtPct = (v) => (fin(v) ? (v * 100).toFixed(2) + '%' : DASH);
  function fmtClock(ms) {
    if (!fin(ms) || ms <= 0) return DASH;
    const d = new Date(ms);
    return pad2(d.getHours()) + ':' + pad2(d.getMinutes()) + ':' + pad2(d.getSeconds());
  }
  function fmtWhen(ms) {
    if (!fin(ms) || ms <= 0) return DASH;
    const d = new Date(ms);
    return d.getFullYear() + '-' + pad2(d.getMonth() + 1) + '-' + pad2(d.getDate()) + ' ' + fmtClock(ms);
  }
  const list = (a) => (Array.isArray(a) && a.length ? a.join(', ') : DASH);
  const str = (v) => (v === null || v === undefined || v === '' ? DASH : String(v));

  // ---- DOM helpers ------------------------------------------------------
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function sv(tag, attrs, text) {
    const e = document.createElementNS(SVGNS, tag);
    if (attrs) for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function setText(e, t) {
    t = String(t);
    if (e.textContent !== t) e.textContent = t;
  }
  const stateClass = (s) => 'badge state-' + String(s || 'unspecified').replace(/[^a-z]/g, '');
  function setBadge(e, s) {
    const c = stateClass(s);
    if (e.className !== c) e.className = c;
    setText(e, s || DASH);
  }
  function setProgress(p, step, total) {
    if (fin(total) && total > 0) {
      if (p.max !== total) p.max = total;
      const v = Math.min(fin(step) ? step : 0, total);
      if (!p.hasAttribute('value') || p.value !== v) p.value = v;
    } else if (p.hasAttribute('value')) {
      p.removeAttribute('value');
    }
  }
  function row(cells) {
    const tr = el('tr');
    for (const [text, cls] of cells) tr.append(el('td', cls, text));
    return tr;
  }

  const statuses = new Map();
  function note(key, msg) {
    if (msg) statuses.set(key, msg);
    else statuses.delete(key);
    const e = $('status');
    const t = [...statuses.values()].join(' \u00b7 ');
    setText(e, t);
    e.hidden = !t;
  }

  // ---- HTTP ---------------------------------------------------------------
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
  async function api(path, opts = {}) {
    const headers = new Headers(opts.headers || {});
    if (token) headers.set('Authorization', 'Bearer ' + token);
    const r = await fetch(path, { ...opts, headers, cache: 'no-store', credentials: 'same-origin' });
    if (r.status === 401) {
      const msg = await errorText(r);
      unauthorized(msg);
      throw new HttpError(401, msg);
    }
    if (!r.ok) throw new HttpError(r.status, await errorText(r));
    return r;
  }
  const getJSON = async (path, opts) => (await api(path, opts)).json();
  const quiet = (e) => e && (e.name === 'AbortError' || e.status === 401);

  // ---- sign in ------------------------------------------------------------
  function unauthorized(msg) {
    if (view) { view.stop(); view = null; }
    const had = !!token;
    token = null;
    who = null;
    try { sessionStorage.removeItem(TOKEN_KEY); } catch (_) { /* ignore */ }
    showLogin(had ? 'The token was refused (' + msg + ').' : '');
  }
  function showOnly(id) {
    for (const s of ['login', 'view-list', 'view-job']) $(s).hidden = s !== id;
  }
  function showLogin(msg) {
    statuses.clear();
    note('', '');
    showOnly('login');
    $('signout').hidden = true;
    setText($('principal'), '');
    const e = $('login-error');
    setText(e, msg || '');
    e.hidden = !msg;
    $('token').focus();
  }
  async function boot() {
    clearTimeout(bootTimer);
    try {
      who = await getJSON('/v1/whoami');
    } catch (e) {
      if (e.status === 401) return;
      if (e.status === 404) {
        who = { auth: null, principal: null, scopes: [] }; // an older coordinator: no cancel button
      } else {
        note('boot', 'Cannot reach the coordinator (' + e.message + '); retrying');
        bootTimer = setTimeout(boot, 3000);
        return;
      }
    }
    note('boot', '');
    $('login-error').hidden = true;
    const scopes = Array.isArray(who.scopes) ? who.scopes : [];
    setText($('principal'), who.auth === false ? 'no authentication'
      : who.principal ? who.principal + ' (' + (scopes.join(', ') || 'no scope') + ')' : '');
    $('signout').hidden = !token;
    route();
  }
  function canCancel(job) {
    if (!who || !job) return false;
    if (who.auth === false) return true;
    const s = Array.isArray(who.scopes) ? who.scopes : [];
    return s.includes('admin') || (s.includes('submit') && !!who.principal && who.principal === job.owner);
  }

  // ---- routing ------------------------------------------------------------
  function route() {
    if (!who) return;
    if (view) { view.stop(); view = null; }
    statuses.clear();
    note('', '');
    const m = /^#\/jobs\/(.+)$/.exec(location.hash);
    if (m) {
      let id = m[1];
      try { id = decodeURIComponent(id); } catch (_) { /* keep raw */ }
      view = jobView(id);
    } else {
      view = listView();
    }
  }

  function poller(fn, ms) {
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

  function showWorkerCount(ws) {
    const busy = ws.filter((w) => w.job).length;
    setText($('worker-count'), ws.length + (ws.length === 1 ? ' worker' : ' workers') + ' attached'
      + (ws.length ? ' (' + busy + ' busy)' : ''));
  }

  // ---- jobs list ----------------------------------------------------------
  const listRows = new Map(); // job id -> row cells, reused across refreshes and visits

  function makeRow(id) {
    const c = { tr: el('tr'), a: el('a', null, id), name: el('td', 'cell-name'), owner: el('td', 'cell-owner'),
      badge: el('span', 'badge'), prog: el('progress'), steps: el('span'), eta: el('td'),
      loss: el('td', 'num'), sps: el('td', 'num'), workers: el('td', 'num') };
    c.tr.dataset.job = id;
    c.a.href = '#/jobs/' + enc(id);
    const tdId = el('td');
    tdId.append(c.a);
    const tdState = el('td');
    tdState.append(c.badge);
    const tdProg = el('td');
    const wrap = el('div', 'progress-cell');
    wrap.append(c.prog, c.steps);
    tdProg.append(wrap);
    c.tr.append(tdId, c.name, c.owner, tdState, tdProg, c.eta, c.loss, c.sps, c.workers);
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
    setText(c.sps, fmtInt(k.samples_per_sec));
    setText(c.workers, Array.isArray(j.workers) ? j.workers.length : 0);
  }

  function listView() {
    showOnly('view-list');
    document.title = 'accrue: jobs';
    const tbody = $('jobs').tBodies[0];
    const jobs = async function jobs() {
      const d = await getJSON('/v1/jobs');
      const js = Array.isArray(d.jobs) ? d.jobs : [];
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
        if (!seen.has(id)) { c.tr.remove(); listRows.delete(id); }
      }
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

  // ---- columnar points ------------------------------------------------------
  const emptyCols = () => Object.fromEntries(COLS.map((k) => [k, []]));
  function colValue(src, k, i) {
    const a = src[k];
    const v = Array.isArray(a) ? a[i] : undefined;
    if (v !== undefined && v !== null) return v;
    if (k === 'count') return 1;
    if (k === 'skipped') return 0;
    if (k === 'last_step') return src.first_step[i];
    return null;
  }
  function fromSeries(src) {
    const p = emptyCols();
    const n = src && Array.isArray(src.first_step) ? src.first_step.length : 0;
    for (const k of COLS) for (let i = 0; i < n; i++) p[k].push(colValue(src, k, i));
    return p;
  }
  const wmean = (a, ca, b, cb) => (fin(a) && fin(b) ? (a * ca + b * cb) / (ca + cb) : fin(a) ? a : fin(b) ? b : null);
  const nmin = (a, b) => (fin(a) && fin(b) ? Math.min(a, b) : fin(a) ? a : fin(b) ? b : null);
  const nmax = (a, b) => (fin(a) && fin(b) ? Math.max(a, b) : fin(a) ? a : fin(b) ? b : null);
  const bucketAt = (src, i) => Object.fromEntries(COLS.map((k) => [k, colValue(src, k, i)]));
  // Bucket a followed by bucket b as one (the server's rule): means weighted
  // by count, extremes of extremes, last-step values of b, counts summed.
  function merge(a, b) {
    const ca = a.count || 1;
    const cb = b.count || 1;
    const m = { first_step: a.first_step, last_step: b.last_step, count: ca + cb, skipped: (a.skipped || 0) + (b.skipped || 0) };
    for (const k of ['loss', 'grad_norm', 'clip_coef', 'samples_per_sec']) m[k] = wmean(a[k], ca, b[k], cb);
    for (const k of ['loss_min', 'clip_coef_min']) m[k] = nmin(a[k], b[k]);
    for (const k of ['loss_max', 'grad_norm_max']) m[k] = nmax(a[k], b[k]);
    for (const k of ['lr', 'samples_seen', 'wall_ms']) m[k] = b[k] ?? a[k];
    return m;
  }
  function pushBucket(p, b) { for (const k of COLS) p[k].push(b[k]); }
  // Adjacent pairs merged (an odd last bucket stays alone).
  function halve(p) {
    const q = emptyCols();
    const n = p.first_step.length;
    for (let i = 0; i < n; i += 2) pushBucket(q, i + 1 < n ? merge(bucketAt(p, i), bucketAt(p, i + 1)) : bucketAt(p, i));
    return q;
  }
  function lowerBound(a, x) { // first index with a[i] >= x
    let lo = 0;
    let hi = a.length;
    while (lo < hi) {
      const m = (lo + hi) >> 1;
      if (a[m] < x) lo = m + 1; else hi = m;
    }
    return lo;
  }

  // ---- charts -----------------------------------------------------------------
  const W = 600;
  const H = 230;
  const M = { l: 64, r: 16, t: 28, b: 34 };
  const PW = W - M.l - M.r;
  const PH = H - M.t - M.b;
  const CHARTS = [
    { name: 'loss', title: 'loss', key: 'loss', band: ['loss_min', 'loss_max'], smooth: 0.6, fmt: sig },
    { name: 'grad_norm', title: 'gradient norm (before clipping)', key: 'grad_norm', threshold: true, fmt: sig },
    { name: 'clip_coef', title: 'clip coefficient', key: 'clip_coef', fmt: sig },
    { name: 'lr', title: 'learning rate', key: 'lr', fmt: fmtLr },
    { name: 'samples_per_sec', title: 'samples / s', key: 'samples_per_sec', fmt: fmtInt },
  ];
  const XAXES = {
    step: { key: 'last_step', label: 'step', fmt: fmtInt },
    samples: { key: 'samples_seen', label: 'samples', fmt: fmtCount },
    time: { key: 'wall_ms', label: 'time', fmt: fmtClock },
  };

  // TensorBoard's smoothing: an exponential moving average, debiased.
  function smooth(ys, w) {
    const out = new Array(ys.length).fill(null);
    let last = 0;
    let n = 0;
    for (let i = 0; i < ys.length; i++) {
      if (!fin(ys[i])) continue;
      last = last * w + (1 - w) * ys[i];
      n++;
      out[i] = last / (1 - Math.pow(w, n));
    }
    return out;
  }
  function extent(vals, into) {
    for (const v of vals) if (fin(v)) { if (v < into[0]) into[0] = v; if (v > into[1]) into[1] = v; }
    return into;
  }
  function linePath(xs, ys, sx, sy) {
    let d = '';
    let pen = false;
    for (let i = 0; i < ys.length; i++) {
      if (fin(xs[i]) && fin(ys[i])) {
        d += (pen ? 'L' : 'M') + sx(xs[i]).toFixed(1) + ',' + sy(ys[i]).toFixed(1);
        pen = true;
      } else {
        pen = false;
      }
    }
    return d;
  }
  function bandPath(xs, lo, hi, sx, sy) {
    let d = '';
    let run = [];
    const flush = () => {
      if (run.length > 1) {
        d += 'M' + run.map((i) => sx(xs[i]).toFixed(1) + ',' + sy(hi[i]).toFixed(1)).join('L');
        d += 'L' + run.slice().reverse().map((i) => sx(xs[i]).toFixed(1) + ',' + sy(lo[i]).toFixed(1)).join('L') + 'Z';
      }
      run = [];
    };
    for (let i = 0; i < xs.length; i++) {
      if (fin(xs[i]) && fin(lo[i]) && fin(hi[i])) run.push(i); else flush();
    }
    flush();
    return d;
  }

  // A recovery's resumed step is known once the group re-formed (0 before).
  const resumedKnown = (r) => fin(r.resumed_step) && (r.resumed_step > 0 || (fin(r.reformed_unix_ms) && r.reformed_unix_ms > 0));

  // Where a recovery goes on the x axis, or null.
  function recoveryX(r, p, xmode, xs) {
    if (xmode === 'time') {
      const t = [r.first_step_unix_ms, r.reformed_unix_ms, r.started_unix_ms].find((v) => fin(v) && v > 0);
      return t === undefined ? null : t;
    }
    const n = p.last_step.length;
    if (!n) return null;
    if (resumedKnown(r)) {
      if (xmode === 'step') return r.resumed_step;
      return xs[Math.min(lowerBound(p.last_step, r.resumed_step), n - 1)];
    }
    if (!fin(r.started_unix_ms) || r.started_unix_ms <= 0) return null;
    let i = lowerBound(p.wall_ms, r.started_unix_ms + 1) - 1; // the last bucket before it started
    if (i < 0) i = 0;
    return xs[i];
  }

  function renderChart(svg, spec, v, xmode) {
    const p = v.pts;
    const n = p.first_step.length;
    const xa = XAXES[xmode];
    const xs = p[xa.key];
    const ys = p[spec.key];
    svg.replaceChildren();
    svg.setAttribute('data-points', String(n));
    svg.append(sv('text', { x: 8, y: 17, class: 'ctitle' }, spec.title));
    const lastY = n ? ys[n - 1] : null;
    svg.append(sv('text', { x: W - M.r, y: 17, class: 'legend', 'text-anchor': 'end' },
      n ? 'last ' + spec.fmt(lastY) + ' \u00b7 ' + n + (n === 1 ? ' point' : ' points') : ''));
    svg.__chart = null;
    if (!n) {
      svg.append(sv('text', { x: W / 2, y: H / 2, class: 'empty', 'text-anchor': 'middle' }, 'no data yet'));
      return;
    }
    const job = v.job || {};
    const threshold = spec.threshold && job.clip && fin(job.clip.max_norm) ? job.clip.max_norm : null;
    const hasBand = spec.band && p.count.some((c) => c > 1);

    // domains
    const xd = extent(xs, [Infinity, -Infinity]);
    if (!fin(xd[0])) return;
    if (xd[0] === xd[1]) { xd[0] -= 1; xd[1] += 1; }
    const yd = extent(ys, [Infinity, -Infinity]);
    if (hasBand) { extent(p[spec.band[0]], yd); extent(p[spec.band[1]], yd); }
    if (threshold !== null) extent([threshold], yd);
    if (!fin(yd[0])) { yd[0] = 0; yd[1] = 1; }
    const yticks = yd[0] === yd[1] ? [yd[0]] : [yd[0], (yd[0] + yd[1]) / 2, yd[1]]; // min, middle, max
    if (yd[0] === yd[1]) { const d = Math.abs(yd[0]) * 0.1 || 1; yd[0] -= d; yd[1] += d; }
    const pad = (yd[1] - yd[0]) * 0.05;
    yd[0] -= pad; yd[1] += pad;
    if (yd[0] < 0 && extent(ys, [Infinity, -Infinity])[0] >= 0 && !(threshold < 0)) yd[0] = Math.max(yd[0], 0);
    const sx = (x) => M.l + ((x - xd[0]) / (xd[1] - xd[0])) * PW;
    const sy = (y) => M.t + PH - ((y - yd[0]) / (yd[1] - yd[0])) * PH;

    // grid, axes, ticks
    const g = sv('g');
    for (const yv of yticks) {
      const y = sy(yv);
      g.append(sv('line', { x1: M.l, x2: M.l + PW, y1: y, y2: y, class: 'grid-line' }));
      g.append(sv('text', { x: M.l - 6, y: y + 3.5, class: 'tick', 'text-anchor': 'end' }, spec.fmt(yv)));
    }
    for (let i = 0; i <= 4; i++) {
      let xv = xd[0] + ((xd[1] - xd[0]) * i) / 4;
      if (xmode === 'step') xv = Math.round(xv);
      const x = sx(xv);
      g.append(sv('line', { x1: x, x2: x, y1: M.t + PH, y2: M.t + PH + 4, class: 'axis' }));
      g.append(sv('text', { x, y: M.t + PH + 16, class: 'tick', 'text-anchor': i === 0 ? 'start' : i === 4 ? 'end' : 'middle' }, xa.fmt(xv)));
    }
    g.append(sv('text', { x: M.l + PW, y: H - 2, class: 'tick', 'text-anchor': 'end' }, xa.label));
    g.append(sv('line', { x1: M.l, x2: M.l + PW, y1: M.t + PH, y2: M.t + PH, class: 'axis' }));
    g.append(sv('line', { x1: M.l, x2: M.l, y1: M.t, y2: M.t + PH, class: 'axis' }));
    svg.append(g);

    if (hasBand) svg.append(sv('path', { class: 'band', d: bandPath(xs, p[spec.band[0]], p[spec.band[1]], sx, sy) }));
    svg.append(sv('path', { class: 'raw', d: linePath(xs, ys, sx, sy) }));
    let sm = null;
    if (spec.smooth) {
      sm = smooth(ys, spec.smooth);
      svg.append(sv('path', { class: 'smooth', d: linePath(xs, sm, sx, sy) }));
    }
    if (threshold !== null) {
      const ty = sy(threshold);
      const t = sv('line', { class: 'threshold', x1: M.l, x2: M.l + PW, y1: ty, y2: ty });
      t.append(sv('title', null, 'clip max_norm ' + sig(threshold)));
      svg.append(t, sv('text', { x: M.l + PW - 2, y: ty - 4, class: 'tick', 'text-anchor': 'end' }, 'max_norm ' + sig(threshold)));
    }

    // skipped steps: buckets holding one, and the server's ranges
    const skipped = new Map();
    for (let i = 0; i < n; i++) if (p.skipped[i] > 0) skipped.set(i, p.skipped[i] + ' skipped in steps ' + p.first_step[i] + DASH + p.last_step[i]);
    for (const r of v.skippedRanges) {
      if (!Array.isArray(r) || !fin(r[0])) continue;
      const i = lowerBound(p.last_step, r[0]);
      if (i < n && p.first_step[i] <= (fin(r[1]) ? r[1] : r[0]) && !skipped.has(i)) {
        skipped.set(i, 'skipped steps ' + r[0] + (fin(r[1]) && r[1] !== r[0] ? DASH + r[1] : ''));
      }
    }
    for (const [i, why] of skipped) {
      if (!fin(xs[i])) continue;
      const c = sv('circle', { class: 'marker-skipped', cx: sx(xs[i]).toFixed(1), cy: M.t + PH - 5, r: 3.5 });
      c.append(sv('title', null, why));
      svg.append(c);
    }

    // recoveries
    for (const r of v.recoveries()) {
      let xr = recoveryX(r, p, xmode, xs);
      if (!fin(xr)) continue;
      xr = Math.min(Math.max(xr, xd[0]), xd[1]);
      const x = sx(xr).toFixed(1);
      const label = 'recovery to generation ' + str(r.generation) + ': lost ' + list(r.lost) + '; joined ' + list(r.joined)
        + (resumedKnown(r) ? '; resumed at step ' + r.resumed_step : '; in progress') + (r.reason ? '; ' + r.reason : '');
      const line = sv('line', { class: 'marker-recovery', x1: x, x2: x, y1: M.t, y2: M.t + PH });
      line.append(sv('title', null, label));
      const hit = sv('line', { class: 'marker-recovery-hit', x1: x, x2: x, y1: M.t, y2: M.t + PH });
      hit.append(sv('title', null, label));
      const right = +x > W - M.r - 40;
      svg.append(line, hit, sv('text', { x: right ? +x - 3 : +x + 3, y: M.t + 10, class: 'tick', 'text-anchor': right ? 'end' : 'start' },
        'gen ' + str(r.generation)));
    }

    const hoverLine = sv('line', { class: 'hover-line', x1: 0, x2: 0, y1: M.t, y2: M.t + PH, visibility: 'hidden' });
    const hoverDot = sv('circle', { class: 'hover-dot', cx: 0, cy: 0, r: 3.5, visibility: 'hidden' });
    svg.append(hoverLine, hoverDot);
    svg.__chart = { spec, xs, ys, sm, sx, sy, xa, p, hoverLine, hoverDot };
  }

  function hover(svg, ev) {
    const c = svg.__chart;
    const tip = svg.parentNode.querySelector('.tip');
    if (!c) { tip.hidden = true; return; }
    const m = svg.getScreenCTM();
    if (!m) return;
    const pt = new DOMPoint(ev.clientX, ev.clientY).matrixTransform(m.inverse());
    let best = -1;
    let bd = Infinity;
    for (let i = 0; i < c.xs.length; i++) {
      if (!fin(c.xs[i])) continue;
      const d = Math.abs(c.sx(c.xs[i]) - pt.x);
      if (d < bd) { bd = d; best = i; }
    }
    if (best < 0 || pt.x < M.l - 10 || pt.x > W - M.r + 10) { leave(svg); return; }
    const p = c.p;
    const i = best;
    const x = c.sx(c.xs[i]);
    c.hoverLine.setAttribute('x1', x);
    c.hoverLine.setAttribute('x2', x);
    c.hoverLine.setAttribute('visibility', 'visible');
    if (fin(c.ys[i])) {
      c.hoverDot.setAttribute('cx', x);
      c.hoverDot.setAttribute('cy', c.sy(c.ys[i]));
      c.hoverDot.setAttribute('visibility', 'visible');
    } else {
      c.hoverDot.setAttribute('visibility', 'hidden');
    }
    const s = c.spec;
    const lines = [];
    const cnt = p.count[i] || 1;
    lines.push(cnt > 1 ? 'steps ' + p.first_step[i] + DASH + p.last_step[i] + ' (' + cnt + ')' : 'step ' + p.last_step[i]);
    let val = s.title + ' ' + s.fmt(c.ys[i]);
    if (s.band && cnt > 1) val += '  [' + s.fmt(p[s.band[0]][i]) + ' ' + DASH + ' ' + s.fmt(p[s.band[1]][i]) + ']';
    lines.push(val);
    if (c.sm) lines.push('smoothed ' + s.fmt(c.sm[i]));
    if (s.key === 'grad_norm' && cnt > 1) lines.push('max ' + sig(p.grad_norm_max[i]));
    if (s.key === 'clip_coef' && cnt > 1) lines.push('min ' + sig(p.clip_coef_min[i]));
    lines.push('samples ' + fmtInt(p.samples_seen[i]) + '  \u00b7  ' + fmtClock(p.wall_ms[i]));
    if (p.skipped[i] > 0) lines.push(p.skipped[i] + ' skipped');
    tip.textContent = lines.join('\n');
    tip.hidden = false;
    const box = svg.getBoundingClientRect();
    const fig = svg.parentNode.getBoundingClientRect();
    const px = (x / W) * box.width + (box.left - fig.left);
    const left = px + 12 + tip.offsetWidth > fig.width ? px - 12 - tip.offsetWidth : px + 12;
    tip.style.left = Math.max(0, left) + 'px';
    tip.style.top = Math.max(0, ev.clientY - fig.top - tip.offsetHeight - 8) + 'px';
  }
  function leave(svg) {
    const c = svg.__chart;
    if (c) { c.hoverLine.setAttribute('visibility', 'hidden'); c.hoverDot.setAttribute('visibility', 'hidden'); }
    svg.parentNode.querySelector('.tip').hidden = true;
  }
  for (const svg of document.querySelectorAll('svg[data-chart]')) {
    svg.addEventListener('mousemove', (ev) => hover(svg, ev));
    svg.addEventListener('mouseleave', () => leave(svg));
  }

  // ---- a job --------------------------------------------------------------------
  function jobView(id) {
    showOnly('view-job');
    document.title = 'accrue: ' + id;
    const v = {
      id, job: null, stopped: false, pts: emptyCols(), skippedRanges: [], evals: [], seriesRecoveries: [],
      loadSeq: 0, loading: false, buffer: [], gen: null, genChanged: false, lastGapResync: -Infinity,
      width: 1, snapshotAt: -Infinity,
      dirty: { head: true, charts: true, tables: true }, tablesSig: '', chartSig: '',
      renderTimer: null, lastRender: -Infinity, ctl: null, timers: new Set(), stops: [],
      recoveries() { return (this.job && Array.isArray(this.job.recoveries) ? this.job.recoveries : this.seriesRecoveries) || []; },
    };
    // reset what a previous job left
    for (const e of ['job-title', 'job-name', 'job-owner', 'job-generation', 'job-workers', 'job-accum', 'job-epoch',
      'job-loss', 'job-gradnorm', 'job-lr', 'job-sps', 'job-skipped', 'job-clip', 'job-steps', 'job-eta', 'series-info', 'eval']) setText($(e), '');
    setText($('job-title'), id);
    setBadge($('job-state'), '');
    for (const e of ['job-error', 'cancel', 'cancel-error', 'evals']) $(e).hidden = true;
    for (const t of ['workers', 'recoveries', 'evals']) $(t).tBodies[0].replaceChildren();
    $('history').replaceChildren();
    $('job-progress').removeAttribute('value');
    for (const svg of document.querySelectorAll('svg[data-chart]')) { svg.replaceChildren(); svg.setAttribute('data-points', '0'); svg.__chart = null; leave(svg); }

    const later = (fn, ms) => {
      const t = setTimeout(() => { v.timers.delete(t); if (!v.stopped) fn(); }, ms);
      v.timers.add(t);
    };
    const schedule = () => {
      if (v.renderTimer !== null || v.stopped) return;
      const wait = Math.max(0, RENDER_MS - (performance.now() - v.lastRender));
      v.renderTimer = setTimeout(() => { v.renderTimer = null; if (!v.stopped) render(); }, wait);
    };
    const render = () => {
      v.lastRender = performance.now();
      if (v.dirty.head) renderHead(v);
      if (v.dirty.charts) renderCharts(v);
      if (v.dirty.tables) renderTables(v);
      v.dirty = { head: false, charts: false, tables: false };
    };
    v.render = () => { v.dirty = { head: true, charts: true, tables: true }; render(); };
    v.schedule = schedule;

    function setJob(job) {
      if (!job || typeof job !== 'object') return;
      if (v.gen !== null && job.generation !== v.gen) v.genChanged = true;
      v.gen = job.generation;
      v.job = job;
      v.dirty.head = true;
      const cs = JSON.stringify([job.recoveries, job.clip]);
      if (cs !== v.chartSig) { v.chartSig = cs; v.dirty.charts = true; }
      v.dirty.tables = true;
      schedule();
    }
    v.setJob = setJob;

    // Streamed buckets, after what is held: one-step buckets fill the last
    // bucket up to the current width, then a new one starts; past BOUND
    // buckets adjacent pairs merge and the width doubles (as the server does).
    function append(src) {
      const n = src && Array.isArray(src.first_step) ? src.first_step.length : 0;
      if (!n) return;
      let p = v.pts;
      let added = false;
      for (let i = 0; i < n; i++) {
        const b = bucketAt(src, i);
        if (!fin(b.first_step)) continue;
        const L = p.last_step.length;
        const prev = L ? p.last_step[L - 1] : -Infinity;
        if (b.first_step <= prev) {
          // Held already: sent before the snapshot was taken (shortly after
          // one), or else the steps were done again after a recovery
          // (a rollback): the server rewrote them, so take its series.
          if (v.genChanged || performance.now() - v.snapshotAt > 2000) { resync(); return; }
          continue;
        }
        if (L && b.first_step > prev + 1 && performance.now() - v.lastGapResync > 5000) {
          v.lastGapResync = performance.now(); // steps missing: updates were lost
          later(resync, 0);
        }
        if (L && p.count[L - 1] + (b.count || 1) <= v.width) {
          const m = merge(bucketAt(p, L - 1), b);
          for (const k of COLS) p[k][L - 1] = m[k];
        } else {
          pushBucket(p, b);
        }
        if (p.first_step.length > BOUND) {
          p = v.pts = halve(p);
          v.width *= 2;
        }
        added = true;
      }
      if (added) {
        v.dirty.charts = true;
        schedule();
      }
    }

    async function loadSeries() {
      const seq = ++v.loadSeq;
      v.loading = true;
      v.genChanged = false;
      try {
        const s = await getJSON('/v1/jobs/' + enc(id) + '/series?max_points=' + BOUND);
        if (v.stopped || seq !== v.loadSeq) return;
        let p = fromSeries(s.points || {});
        while (p.first_step.length > BOUND) p = halve(p);
        v.pts = p;
        v.width = Math.max(1, ...p.count.filter(fin));
        v.snapshotAt = performance.now();
        v.skippedRanges = Array.isArray(s.skipped_steps) ? s.skipped_steps : [];
        v.evals = Array.isArray(s.evals) ? s.evals : [];
        v.seriesRecoveries = Array.isArray(s.recoveries) ? s.recoveries : [];
        note('series', '');
      } catch (e) {
        if (v.stopped || seq !== v.loadSeq || quiet(e)) return;
        note('series', 'Cannot load the series (' + e.message + ')');
        later(() => { if (!v.loading) resync(); }, 3000);
      } finally {
        if (seq === v.loadSeq && !v.stopped) {
          v.loading = false;
          const buf = v.buffer;
          v.buffer = [];
          for (const b of buf) append(b);
          v.dirty.charts = true;
          v.dirty.tables = true;
          schedule();
        }
      }
    }
    function resync() { if (!v.stopped) loadSeries(); }
    function ingest(points) {
      if (!points || !Array.isArray(points.first_step) || !points.first_step.length) return;
      if (v.loading) v.buffer.push(points); else append(points);
    }

    function onMessage(event, data) {
      if (event !== 'update' && event !== 'message') return;
      let msg;
      try { msg = JSON.parse(data); } catch (_) { return; }
      if (msg.job) setJob(msg.job);
      if (msg.resync) resync();
      else ingest(msg.points);
    }

    // Server-Sent Events over fetch (EventSource cannot send a header).
    async function readEvents(body) {
      const reader = body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buf += value;
        let keep = '';
        if (buf.endsWith('\r')) { keep = '\r'; buf = buf.slice(0, -1); }
        buf = buf.replace(/\r\n?/g, '\n');
        let at;
        while ((at = buf.indexOf('\n\n')) >= 0) {
          const block = buf.slice(0, at);
          buf = buf.slice(at + 2);
          let event = 'message';
          const data = [];
          for (const line of block.split('\n')) {
            if (!line || line[0] === ':') continue;
            const c = line.indexOf(':');
            const field = c < 0 ? line : line.slice(0, c);
            let val = c < 0 ? '' : line.slice(c + 1);
            if (val[0] === ' ') val = val.slice(1);
            if (field === 'event') event = val;
            else if (field === 'data') data.push(val);
          }
          if (data.length) onMessage(event, data.join('\n'));
          if (v.stopped) return;
        }
        buf += keep;
      }
    }

    async function follow() {
      let backoff = 1000;
      while (!v.stopped) {
        const ctl = new AbortController();
        v.ctl = ctl;
        let connected = false;
        try {
          const r = await api('/v1/jobs/' + enc(id) + '/events', { signal: ctl.signal, headers: { Accept: 'text/event-stream' } });
          connected = true;
          note('stream', '');
          loadSeries(); // subscribed first, then the snapshot: nothing falls between
          await readEvents(r.body);
          backoff = 1000;
        } catch (e) {
          if (v.stopped || (e && e.status === 401)) return;
          if (!connected && !v.loading && v.snapshotAt < 0) loadSeries(); // draw what there is meanwhile
        }
        if (v.stopped) return;
        if (v.job && FINAL.has(v.job.state)) {
          if (!connected) loadSeries();
          return;
        }
        note('stream', 'Live updates interrupted; reconnecting in ' + backoff / 1000 + ' s');
        await new Promise((res) => later(res, backoff));
        backoff = Math.min(backoff * 2, 5000);
      }
    }

    async function start() {
      try {
        setJob(await getJSON('/v1/jobs/' + enc(id)));
        note('job', '');
      } catch (e) {
        if (v.stopped || quiet(e)) return;
        note('job', 'Job ' + id + ': ' + e.message);
        later(start, 3000);
        return;
      }
      follow();
    }

    const workers = async function workers() {
      const d = await getJSON('/v1/workers');
      const all = Array.isArray(d.workers) ? d.workers : [];
      showWorkerCount(all);
      const mine = all.filter((w) => w.job === id)
        .sort((a, b) => (fin(a.rank) ? a.rank : 1e9) - (fin(b.rank) ? b.rank : 1e9) || String(a.id).localeCompare(String(b.id)));
      const tb = $('workers').tBodies[0];
      tb.replaceChildren(...mine.map((w) => row([[w.id], [str(w.rank), 'num'], [str(w.generation), 'num'], [str(w.device)],
        [str(w.data_addr)], [fin(w.last_seen_age_s) ? w.last_seen_age_s.toFixed(1) + ' s ago' : DASH],
        [str(w.step), 'num'], [fmtInt(w.samples_per_sec), 'num']])));
      $('workers-empty').hidden = mine.length > 0;
      note('workers', '');
    };
    v.stops.push(poller(workers, POLL_MS));
    start();
    schedule();

    v.stop = () => {
      v.stopped = true;
      if (v.ctl) v.ctl.abort();
      clearTimeout(v.renderTimer);
      for (const t of v.timers) clearTimeout(t);
      for (const s of v.stops) s();
    };
    return v;
  }

  function renderHead(v) {
    const j = v.job;
    if (!j) return;
    const k = j.counters || {};
    setText($('job-title'), j.id || v.id);
    setBadge($('job-state'), j.state);
    setText($('job-name'), str(j.name));
    setText($('job-owner'), str(j.owner));
    setText($('job-generation'), str(j.generation));
    setText($('job-workers'), list(j.workers));
    setText($('job-accum'), fin(j.accumulation_steps) ? j.accumulation_steps + ' micro-steps' : DASH);
    setText($('job-epoch'), str(k.epoch));
    setText($('job-loss'), sig(k.loss));
    setText($('job-gradnorm'), sig(k.grad_norm));
    setText($('job-lr'), fmtLr(k.lr));
    setText($('job-sps'), fmtInt(k.samples_per_sec));
    setText($('job-skipped'), str(k.skipped_steps));
    const c = j.clip || {};
    const clip = [];
    if (fin(c.max_norm)) clip.push('max_norm ' + sig(c.max_norm) + (fin(c.norm_type) ? ' (norm ' + sig(c.norm_type, 3) + ')' : ''));
    if (fin(c.clip_value)) clip.push('value ' + sig(c.clip_value));
    setText($('job-clip'), clip.length ? clip.join(', ') : 'off');
    setProgress($('job-progress'), k.step, k.total_steps);
    const pct = fin(k.total_steps) && k.total_steps > 0 ? ' (' + ((100 * (k.step || 0)) / k.total_steps).toFixed(1) + '%)' : '';
    setText($('job-steps'), 'step ' + (fin(k.step) ? k.step : 0) + ' / ' + (fin(k.total_steps) ? k.total_steps : '?') + pct);
    setText($('job-eta'), FINAL.has(j.state) ? DASH : fmtDur(j.eta_s));
    const err = j.error ? String(j.error) : '';
    setText($('job-error'), err);
    $('job-error').hidden = !err;
    $('cancel').hidden = FINAL.has(j.state) || !canCancel(j);
    document.title = 'accrue: ' + (j.id || v.id) + ' (' + j.state + ')';
  }

  function renderCharts(v) {
    const xmode = XAXES[$('x-axis').value] ? $('x-axis').value : 'step';
    for (const spec of CHARTS) {
      const svg = document.querySelector('svg[data-chart="' + spec.name + '"]');
      if (svg) renderChart(svg, spec, v, xmode);
    }
    const p = v.pts;
    const n = p.first_step.length;
    const steps = n ? p.last_step[n - 1] - p.first_step[0] + 1 : 0;
    setText($('series-info'), n ? n + ' points for ' + steps + ' steps' + (steps > n ? ' (merged)' : '') : '');
  }

  function renderTables(v) {
    const j = v.job || {};
    const recs = v.recoveries();
    // One row per (epoch, step), the latest (a rollback may evaluate again).
    const byKey = new Map();
    for (const e of v.evals.concat(j.eval ? [j.eval] : [])) {
      const k = e.epoch + '/' + e.step;
      if (!byKey.has(k) || e !== j.eval) byKey.set(k, e);
    }
    const evals = [...byKey.values()];
    const sig2 = JSON.stringify([recs, evals, j.history]);
    if (sig2 === v.tablesSig) return;
    v.tablesSig = sig2;

    $('recoveries').tBodies[0].replaceChildren(...recs.map((r) => {
      const resumed = resumedKnown(r) ? r.resumed_step : '\u2026';
      const tr = row([[str(r.generation), 'num'], [list(r.lost)], [list(r.joined)], [str(r.reason), 'wrap'],
        [resumed, 'num'], [str(r.world_size), 'num'], [str(r.accumulation_steps), 'num'],
        [fin(r.recovery_s) ? r.recovery_s.toFixed(1) + ' s' : 'in progress', 'num']]);
      tr.className = 'recovery';
      tr.title = 'started ' + fmtWhen(r.started_unix_ms) + ', re-formed ' + fmtWhen(r.reformed_unix_ms)
        + ', first step ' + fmtWhen(r.first_step_unix_ms);
      return tr;
    }));
    $('recoveries-empty').hidden = recs.length > 0;

    const e = j.eval || (evals.length ? evals[evals.length - 1] : null);
    setText($('eval'), e ? 'epoch ' + str(e.epoch) + ' \u00b7 step ' + str(e.step) + ' \u00b7 loss ' + sig(e.loss)
      + ' \u00b7 accuracy ' + fmtPct(e.accuracy) + (fin(e.samples) ? ' (' + e.samples + ' samples)' : '') : 'none yet');
    $('evals').tBodies[0].replaceChildren(...evals.map((x) => row([[str(x.epoch), 'num'], [str(x.step), 'num'],
      [sig(x.loss), 'num'], [fmtPct(x.accuracy), 'num'], [str(x.samples), 'num']])));
    $('evals').hidden = evals.length === 0;

    const hist = Array.isArray(j.history) ? j.history : [];
    $('history').replaceChildren(...hist.map((h) => {
      const li = el('li');
      li.append(el('span', 'when', fmtClock(h.at_unix_ms)),
        document.createTextNode(str(h.from) + ' \u2192 ' + str(h.to) + (h.reason ? ': ' + h.reason : '')));
      return li;
    }));
  }

  // ---- wiring ---------------------------------------------------------------------
  $('login-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const t = $('token').value.trim();
    if (!t) return;
    token = t;
    try { sessionStorage.setItem(TOKEN_KEY, t); } catch (_) { /* tab-only */ }
    $('token').value = '';
    boot();
  });
  $('signout').addEventListener('click', () => {
    if (view) { view.stop(); view = null; }
    token = null;
    who = null;
    try { sessionStorage.removeItem(TOKEN_KEY); } catch (_) { /* ignore */ }
    setText($('worker-count'), '');
    boot();
  });
  $('x-axis').addEventListener('change', () => {
    if (view && view.schedule) { view.dirty.charts = true; view.schedule(); }
  });
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
  window.addEventListener('hashchange', route);
  // For measurements: one full synchronous render of the current view, in ms.
  window.__accrueRender = () => {
    if (!view || !view.render) return null;
    const t0 = performance.now();
    view.render();
    return performance.now() - t0;
  };
  boot();
})();
