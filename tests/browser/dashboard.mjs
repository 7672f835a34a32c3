// Drives the coordinator's status page in headless Chromium (playwright-core).
//
//   node tests/browser/dashboard.mjs <live|load> <args.json>
//
// args.json: {"base": "https://127.0.0.1:PORT", "token": "..."|null, "job": "<id>",
//   "out": "<folder for screenshots>", "expect_steps": N, "bound": 1000, ...}
//   live: "evil_job" (a job whose name/owner/error is markup), "evil_text" (that
//         markup, optional), "kill_timeout_ms" (optional), "resume_job" (a
//         cancelled job of the signed-in principal: its Resume button is
//         clicked; optional)
//   load: "jobs_expected" (rows the list must show)
//
// Stdout carries JSON lines only: in `live`, {"phase":"running",...} once the
// page follows the running job (then it waits for a line "killed" on stdin),
// and always a last line with what was measured ({"ok": false, "error": ...}
// on a failed check). Progress and reasons go to stderr; on a failed check
// <out>/failure.png is saved and the exit code is 1. Every wait polls with a
// timeout; none is a fixed sleep. Env: CHROMIUM (default /usr/bin/chromium),
// TIMEOUT_SCALE (multiplies every timeout, default 1).

import { chromium, request } from 'playwright-core';
import fs from 'node:fs';
import path from 'node:path';
import readline from 'node:readline';

const [mode, argsFile] = process.argv.slice(2);
if (!['live', 'load'].includes(mode) || !argsFile) {
  process.stderr.write('usage: node dashboard.mjs <live|load> <args.json>\n');
  process.exit(2);
}
const args = JSON.parse(fs.readFileSync(argsFile, 'utf8'));
const base = String(args.base).replace(/\/+$/, '');
const origin = new URL(base).origin;
const out = args.out || '.';
fs.mkdirSync(out, { recursive: true });
const bound = Number.isFinite(args.bound) ? args.bound : 1000;
const scale = Number(process.env.TIMEOUT_SCALE) > 0 ? Number(process.env.TIMEOUT_SCALE) : 1;
const T = (ms) => Math.round(ms * scale);
const t0 = Date.now();

const result = {};
const pageErrors = [];
const consoleErrors = [];
const foreign = [];
let browser = null;
let page = null;

class CheckFailed extends Error {}
const log = (...a) => process.stderr.write(`[dashboard ${mode} +${((Date.now() - t0) / 1000).toFixed(1)}s] ${a.join(' ')}\n`);
const emit = (obj) => process.stdout.write(JSON.stringify(obj) + '\n');
function check(cond, msg) {
  if (!cond) throw new CheckFailed(msg);
}
function noPageErrors() {
  check(pageErrors.length === 0, 'the page threw: ' + pageErrors.join(' | '));
  check(foreign.length === 0, 'the page asked another origin: ' + foreign.join(', '));
}

// Page-side probes: `pf(body)` is a page function of `arg` that can call
// points() (the loss chart's data-points) and vertices() (M/L commands in
// its path.raw).
const PROBES = `
  const points = () => { const s = document.querySelector('svg[data-chart="loss"]');
    return s ? Number(s.getAttribute('data-points')) || 0 : 0; };
  const vertices = () => { const p = document.querySelector('svg[data-chart="loss"] path.raw');
    return p ? ((p.getAttribute('d') || '').match(/[ML]/g) || []).length : 0; };
`;
const pf = (body) => new Function('arg', PROBES + body);

// A short description of what the page shows, for failure messages.
async function pageSummary() {
  try {
    return await page.evaluate(() => {
      const loss = document.querySelector('svg[data-chart="loss"]');
      const p = loss && loss.querySelector('path.raw');
      return JSON.stringify({
        hash: location.hash,
        status: document.getElementById('status')?.textContent || '',
        login: !document.getElementById('login')?.hidden,
        login_error: document.getElementById('login-error')?.textContent || '',
        state: document.getElementById('job-state')?.textContent || '',
        rows: document.querySelectorAll('#jobs tbody tr').length,
        points: loss ? loss.getAttribute('data-points') : null,
        vertices: p ? ((p.getAttribute('d') || '').match(/[ML]/g) || []).length : null,
        recoveries: document.querySelectorAll('#recoveries tr.recovery').length,
      });
    });
  } catch (e) {
    return '(page not readable: ' + e.message + ')';
  }
}

// Polls `fn(arg)` in the page until it is truthy; fails naming `what`.
async function until(what, fn, arg, timeout) {
  const started = Date.now();
  const deadline = started + timeout;
  // Poll in slices so a page error ends the wait at once.
  for (;;) {
    noPageErrors();
    const slice = Math.min(2000, deadline - Date.now());
    if (slice <= 0) {
      throw new CheckFailed(`timed out after ${(timeout / 1000).toFixed(0)} s waiting for ${what}; page: ${await pageSummary()}`);
    }
    try {
      const h = await page.waitForFunction(fn, arg, { timeout: slice, polling: 100 });
      const v = await h.jsonValue();
      noPageErrors();
      log(`${what}: ok after ${((Date.now() - started) / 1000).toFixed(1)} s`);
      return v;
    } catch (e) {
      if (e instanceof CheckFailed) throw e;
      if (e.name !== 'TimeoutError') throw e;
    }
  }
}

async function shot(name) {
  const file = path.join(out, name);
  await page.screenshot({ path: file, fullPage: true });
  log('screenshot', file);
}

// Resolves on a line `want` on stdin; fails on EOF or after `timeout`.
function stdinLine(want, timeout) {
  return new Promise((resolve, reject) => {
    const rl = readline.createInterface({ input: process.stdin });
    const done = (err) => { clearTimeout(timer); rl.removeAllListeners(); rl.close(); err ? reject(err) : resolve(); };
    const timer = setTimeout(() => done(new CheckFailed(`no "${want}" on stdin within ${timeout / 1000} s`)), timeout);
    rl.on('line', (line) => { if (line.trim() === want) done(); else log('stdin (ignored):', line); });
    rl.on('close', () => done(new CheckFailed(`stdin closed before "${want}"`)));
  });
}

let acceptDialogs = false; // confirm() answers: no, except where a check clicks an action

const rowSel = (id) => `#jobs tr[data-job=${JSON.stringify(String(id))}]`;

async function openJob(id) {
  await page.evaluate((h) => { location.hash = h; }, '#/jobs/' + encodeURIComponent(id));
  await until(`the page of job ${id}`, (id) => document.getElementById('job-title')?.textContent === id
    && !document.getElementById('view-job').hidden && document.getElementById('job-state').textContent !== '', id, T(30000));
}

// ---- live -------------------------------------------------------------------------
async function live() {
  const job = String(args.job);
  const expected = Math.min(Number(args.expect_steps), bound);
  check(Number.isFinite(expected) && expected > 0, 'args.expect_steps is missing');

  await page.goto(base + '/');
  if (args.token) {
    await until('the token form', () => {
      const t = document.getElementById('token');
      return !!t && !document.getElementById('login').hidden;
    }, null, T(30000));
    await page.fill('#token', args.token);
    await page.click('#token-submit');
    await until('the token kept in session storage', () => sessionStorage.getItem('accrue-token') !== null, null, T(10000));
  }
  await until(`the row of job ${job}`, (sel) => !!document.querySelector(sel), rowSel(job), T(60000));
  result.list_rows = await page.$$eval('#jobs tbody tr', (r) => r.length);
  await shot('jobs.png');

  await page.click(rowSel(job) + ' a');
  await until(`the page of job ${job}`, (id) => document.getElementById('job-title')?.textContent === id
    && !document.getElementById('view-job').hidden, job, T(30000));
  const a = await until('the loss chart to show 2 points', pf('return points() >= 2 && points();'), null, T(60000));
  result.first_points = a;
  const b = await until(`the loss chart to grow past ${a} points (without a reload)`,
    pf('const n = points(); return n > arg && n;'), a, T(60000));
  result.later_points = b;
  await shot('job-running.png');
  emit({ phase: 'running', points: b, first_points: a, later_points: b });

  log('waiting for "killed" on stdin');
  await stdinLine('killed', T(Number(args.kill_timeout_ms) || 600000));
  noPageErrors();

  result.recovery_rows = await until('a recovery row and a recovery marker on the loss chart', () => {
    const n = document.querySelectorAll('#recoveries tr.recovery').length;
    return n >= 1 && !!document.querySelector('svg[data-chart="loss"] line.marker-recovery') && n;
  }, null, T(180000));
  result.recovery_markers = await page.$$eval('svg[data-chart="loss"] line.marker-recovery', (l) => l.length);
  result.recovery_title = await page.$eval('svg[data-chart="loss"] line.marker-recovery title', (t) => t.textContent).catch(() => null);
  await shot('job-recovered.png');

  await until('the state badge to say succeeded', () => document.getElementById('job-state').textContent === 'succeeded',
    null, T(Number(args.job_timeout_ms) || 600000));
  const exact = pf('const n = points(), v = vertices(); return n === arg && v === arg && v;');
  result.streamed_points = await until(`${expected} vertices in the loss line, streamed`, exact, expected, T(30000))
    .catch(async (e) => {
      result.streamed_points = await page.evaluate(pf('return vertices();'));
      throw e;
    });
  result.streamed_data_points = await page.evaluate(pf('return points();'));
  const lossPath = () => page.$eval('svg[data-chart="loss"] path.raw', (p) => p.getAttribute('d'));
  const streamedPath = await lossPath();
  result.skipped_markers = await page.$$eval('svg[data-chart="loss"] .marker-skipped', (l) => l.length);
  result.precision = await page.$eval('#job-precision', (e) => e.textContent);
  await shot('job-done.png');

  await page.reload();
  await until('the job page after a reload', (id) => document.getElementById('job-title')?.textContent === id
    && document.getElementById('job-state').textContent === 'succeeded', job, T(30000));
  result.reloaded_points = await until(`${expected} vertices in the loss line after a reload`, exact, expected, T(60000))
    .catch(async (e) => {
      result.reloaded_points = await page.evaluate(pf('return vertices();'));
      throw e;
    });
  // Under the bound every step is its own point: what was streamed (and
  // rewritten after the rollback) must draw exactly what the series says.
  result.streamed_equals_reloaded = streamedPath === await lossPath();
  check(result.streamed_equals_reloaded || Number(args.expect_steps) > bound,
    'the loss line drawn from the stream differs from the one drawn from the series after a reload');
  result.charts = await page.$$eval('svg[data-chart]', (s) => Object.fromEntries(s.map((x) => [x.dataset.chart, Number(x.getAttribute('data-points'))])));
  result.threshold_line = await page.$$eval('svg[data-chart="grad_norm"] line.threshold', (l) => l.length);
  result.recovery_markers_after_reload = await page.$$eval('svg[data-chart="loss"] line.marker-recovery', (l) => l.length);
  check(result.recovery_markers_after_reload >= 1, 'no recovery marker on the loss chart after a reload');

  if (args.evil_job) {
    const evil = String(args.evil_job);
    await openJob(evil);
    let texts = args.evil_text ? [String(args.evil_text)] : [];
    if (!texts.length) {
      // What the job holds, read through the API with the same token.
      const j = await page.evaluate(async ([id, tok]) => {
        const r = await fetch('/v1/jobs/' + encodeURIComponent(id), { headers: tok ? { Authorization: 'Bearer ' + tok } : {} });
        return r.json();
      }, [evil, args.token]);
      texts = [j.name, j.owner, j.error].filter((t) => typeof t === 'string' && /[<>&]/.test(t));
      check(texts.length > 0, `job ${evil} holds no markup-like text to check`);
    }
    // The page has rendered the job (owner filled in); give any injected
    // handler the time a network round trip takes by waiting for the
    // workers poll to have answered too.
    await until(`the owner of job ${evil}`, () => document.getElementById('job-owner').textContent.length > 1, null, T(15000));
    await until('the workers table of the evil job to be filled in', () => !document.getElementById('workers-empty').hidden
      || document.querySelectorAll('#workers tbody tr').length > 0, null, T(15000));
    const r = await page.evaluate((texts) => {
      const norm = (s) => s.replace(/\s+/g, ' ');
      const body = norm(document.body.innerText);
      const onAttrs = [...document.querySelectorAll('*')].filter((e) => [...e.attributes].some((a) => /^on/i.test(a.name))).length;
      return {
        pwned: typeof window.__pwned,
        imgs: document.querySelectorAll('img').length,
        scripts: [...document.scripts].map((s) => s.getAttribute('src')),
        on_attrs: onAttrs,
        shown: texts.map((t) => body.includes(norm(t))),
      };
    }, texts);
    result.evil = r;
    check(r.pwned === 'undefined', 'window.__pwned is set: job text ran as script');
    check(r.imgs === 0, `job text became markup: ${r.imgs} <img> element(s) in the page`);
    check(r.on_attrs === 0, `job text became markup: ${r.on_attrs} element(s) with on* attributes`);
    check(r.scripts.length === 1 && r.scripts[0] === '/assets/app.js', 'unexpected scripts: ' + JSON.stringify(r.scripts));
    check(r.shown.every(Boolean), `the literal job text is not shown as text: ${JSON.stringify(texts)} -> ${JSON.stringify(r.shown)}`);
    // Cancelled, but another principal's: no Resume button for us.
    result.resume_hidden_for_others = await page.$eval('#resume', (b) => b.hidden);
    check(result.resume_hidden_for_others, `a Resume button on job ${evil}, which the signed-in principal does not own`);
    await shot('job-evil.png');
    // The jobs list shows it as text too.
    await page.evaluate(() => { location.hash = '#/'; });
    await until(`the row of job ${evil}`, (sel) => !!document.querySelector(sel), rowSel(evil), T(30000));
    const listShown = await page.evaluate(([sel, texts]) => {
      const t = document.querySelector(sel).textContent;
      return { imgs: document.querySelectorAll('img').length, any: texts.some((x) => t.includes(x)), pwned: typeof window.__pwned };
    }, [rowSel(evil), texts]);
    check(listShown.imgs === 0 && listShown.pwned === 'undefined', 'job text became markup in the jobs list');
    result.evil.list_shows_text = listShown.any;
  }

  if (args.resume_job) {
    // Our own cancelled job: a Resume button; clicked (confirmed), the job
    // is live again and the page follows it.
    const id = String(args.resume_job);
    await openJob(id);
    await until(`a Resume button on job ${id}`, () => !document.getElementById('resume').hidden
      && document.getElementById('job-state').textContent === 'cancelled', null, T(15000));
    result.cancel_hidden_when_resumable = await page.$eval('#cancel', (b) => b.hidden);
    acceptDialogs = true;
    await page.click('#resume');
    result.resumed_state = await until(`job ${id} to be live again after the Resume click`, () => {
      const s = document.getElementById('job-state').textContent;
      return ['pending', 'rendezvous', 'running', 'succeeded'].includes(s) && document.getElementById('resume').hidden && s;
    }, null, T(30000));
    acceptDialogs = false;
    await shot('job-resumed.png');
  }
}

// ---- load -----------------------------------------------------------------------------
async function load() {
  const job = String(args.job);
  const want = Number(args.jobs_expected) || 1;
  // What the series returns now (outside the page: not counted).
  const api = await request.newContext({
    ignoreHTTPSErrors: true,
    extraHTTPHeaders: args.token ? { Authorization: 'Bearer ' + args.token } : {},
  });
  const sr = await api.get(`${base}/v1/jobs/${encodeURIComponent(job)}/series?max_points=${bound}`);
  check(sr.ok(), `GET series: ${sr.status()} ${await sr.text()}`);
  const series = await sr.json();
  const seriesPoints = series.points.first_step.length;
  await api.dispose();
  result.series_points = seriesPoints;

  // Bytes on the wire, per request: what loadingFinished says, or for a
  // request still open (the event stream) what arrived so far.
  const cdp = await page.context().newCDPSession(page);
  await cdp.send('Network.enable');
  let got = new Map();
  const entry = (id) => { let e = got.get(id); if (!e) got.set(id, (e = { recv: 0, total: 0 })); return e; };
  cdp.on('Network.responseReceived', (e) => { entry(e.requestId).recv += e.response.encodedDataLength || 0; });
  cdp.on('Network.dataReceived', (e) => { entry(e.requestId).recv += e.encodedDataLength || 0; });
  cdp.on('Network.loadingFinished', (e) => { entry(e.requestId).total = e.encodedDataLength || 0; });
  const bytes = () => [...got.values()].reduce((s, e) => s + Math.max(e.total, e.recv), 0);

  await page.goto('about:blank');
  got = new Map();
  let start = Date.now();
  await page.goto(base + '/#/');
  await until(`${want} rows in the jobs list`, (n) => document.querySelectorAll('#jobs tbody tr').length >= n, want, T(60000));
  result.list_ms = Date.now() - start;
  result.list_bytes = bytes();
  result.list_rows = await page.$$eval('#jobs tbody tr', (r) => r.length);
  await shot('load-list.png');

  await page.goto('about:blank');
  got = new Map();
  start = Date.now();
  await page.goto(base + '/#/jobs/' + encodeURIComponent(job));
  // The chart holds what the series returned (or, had the server merged its
  // buckets meanwhile, at least half of it: merging halves the count).
  const n = await until(`the loss chart to hold the series' ${seriesPoints} points`, pf(
    'const n = points(); return n >= 2 && vertices() > 0 && 2 * n >= arg && n;'),
  seriesPoints, T(60000));
  result.job_ms = Date.now() - start;
  result.job_bytes = bytes();
  result.points = n;
  result.vertices = await page.evaluate(pf('return vertices();'));
  result.render_ms = await page.evaluate(() => {
    if (typeof window.__accrueRender !== 'function') return null;
    const t = [];
    for (let i = 0; i < 5; i++) t.push(window.__accrueRender());
    t.sort((x, y) => x - y);
    return Math.round(t[2] * 100) / 100;
  });
  await shot('load-job.png');
  await cdp.detach().catch(() => {});
}

// ---- main --------------------------------------------------------------------------------
let code = 0;
try {
  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--no-first-run'],
  });
  const context = await browser.newContext({ ignoreHTTPSErrors: true, viewport: { width: 1280, height: 900 } });
  if (mode === 'load' && args.token) {
    await context.addInitScript((t) => { try { sessionStorage.setItem('accrue-token', t); } catch (_) { /* about:blank */ } }, args.token);
  }
  page = await context.newPage();
  page.setDefaultTimeout(T(60000));
  page.on('pageerror', (e) => { pageErrors.push(String(e && e.stack || e)); log('page error:', e); });
  page.on('console', (m) => {
    if (m.type() !== 'error' && m.type() !== 'warning') return;
    const text = m.text();
    consoleErrors.push(text);
    log(`console ${m.type()}:`, text);
    if (/Content Security Policy|Refused to/i.test(text)) pageErrors.push('CSP: ' + text);
  });
  page.on('request', (r) => {
    const u = r.url();
    if (/^(data|about|blob):/.test(u)) return;
    if (new URL(u).origin !== origin) foreign.push(u);
  });
  page.on('dialog', (d) => (acceptDialogs ? d.accept() : d.dismiss()).catch(() => {}));
  if (mode === 'live') await live(); else await load();
  noPageErrors();
  result.console_errors = consoleErrors.length;
  result.ok = true;
  result.elapsed_s = Math.round((Date.now() - t0) / 100) / 10;
  emit(result);
} catch (e) {
  code = 1;
  const why = e instanceof CheckFailed ? e.message : (e && e.stack) || String(e);
  log('FAILED:', why);
  if (page) {
    await page.screenshot({ path: path.join(out, 'failure.png'), fullPage: true }).catch((x) => log('no failure screenshot:', x.message));
  }
  emit({ ...result, ok: false, error: why.split('\n')[0], console_errors: consoleErrors.length });
} finally {
  if (browser) await Promise.race([browser.close(), new Promise((r) => setTimeout(r, 10000))]).catch(() => {});
}
process.exit(code);
