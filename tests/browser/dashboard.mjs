// Drives the coordinator's status page in headless Chromium (playwright-core).
//
//   node tests/browser/dashboard.mjs <live|load|compare> <args.json>
//
// args.json: {"base": "https://127.0.0.1:PORT", "token": "..."|null, "job": "<id>",
//   "out": "<folder for screenshots>", "expect_steps": N, "bound": 1000, ...}
//   live: "evil_job" (a job whose name/owner/error is markup), "evil_text" (that
//         markup, optional), "kill_timeout_ms" (optional), "resume_job" (a
//         cancelled job of the signed-in principal: its Resume button is
//         clicked; optional)
//   load: "jobs_expected" (rows the list must show)
//   compare: "jobs" (two or more finished jobs with evaluations: compared,
//         the first one's spec, log scale, smoothing, evaluation points and
//         export checked), "signin_link" (an `accrue local` run's one-use
//         link, on its own origin; optional), "signin_principal" and
//         "signin_token" (who and what it must sign in as)
//
// Stdout carries JSON lines only: in `live`, {"phase":"running",...} once the
// page follows the running job (then it waits for a line "killed" on stdin),
// and always a last line with what was measured ({"ok": false, "error": ...}
// on a failed check; in `compare`, {"phase":"signed_in"} once the sign-in
// link is checked). Progress and reasons go to stderr; on a failed check
// <out>/failure.png is saved and the exit code is 1. Every wait polls with a
// timeout; none is a fixed sleep. Env: CHROMIUM (default /usr/bin/chromium),
// TIMEOUT_SCALE (multiplies every timeout, default 1).

import { chromium, request } from 'playwright-core';
import fs from 'node:fs';
import path from 'node:path';
import readline from 'node:readline';

const [mode, argsFile] = process.argv.slice(2);
if (!['live', 'load', 'compare'].includes(mode) || !argsFile) {
  process.stderr.write('usage: node dashboard.mjs <live|load|compare> <args.json>\n');
  process.exit(2);
}
const args = JSON.parse(fs.readFileSync(argsFile, 'utf8'));
const base = String(args.base).replace(/\/+$/, '');
const origin = new URL(base).origin;
// Origins the page may ask: the coordinator's (and a sign-in link's).
const origins = new Set([origin, ...(args.signin_link ? [new URL(args.signin_link).origin] : [])]);
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

// The page at base, signed in with args.token when there is one.
async function signIn() {
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
}

// ---- live -------------------------------------------------------------------------
async function live() {
  const job = String(args.job);
  const expected = Math.min(Number(args.expect_steps), bound);
  check(Number.isFinite(expected) && expected > 0, 'args.expect_steps is missing');

  await signIn();
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

// ---- compare ------------------------------------------------------------------------
// The vertices (x, y) of an SVG path's M/L commands.
const verts = (d) => [...String(d || '').matchAll(/[ML](-?[\d.]+),(-?[\d.]+)/g)].map((m) => [Number(m[1]), Number(m[2])]);
// Least squares y = a + b*x over pairs, and the largest residual.
function fit(pairs) {
  const n = pairs.length;
  const mx = pairs.reduce((s, [x]) => s + x, 0) / n;
  const my = pairs.reduce((s, [, y]) => s + y, 0) / n;
  let sxy = 0;
  let sxx = 0;
  for (const [x, y] of pairs) { sxy += (x - mx) * (y - my); sxx += (x - mx) ** 2; }
  const b = sxx > 0 ? sxy / sxx : 0;
  const a = my - b * mx;
  const err = Math.max(...pairs.map(([x, y]) => Math.abs(a + b * x - y)));
  return { a, b, err, at: (x) => a + b * x };
}
// TensorBoard's debiased exponential moving average (series.js's smooth).
function ema(ys, w) {
  let last = 0;
  return ys.map((y, i) => { last = last * w + (1 - w) * y; return last / (1 - w ** (i + 1)); });
}
const round3 = (x) => Math.round(x * 1000) / 1000;

// GET path on the page's origin with its token, as JSON.
const apiGet = (p) => page.evaluate(async (p) => {
  const t = sessionStorage.getItem('accrue-token');
  const r = await fetch(p, { headers: t ? { Authorization: 'Bearer ' + t } : {} });
  return r.json();
}, p);

// An `accrue local` run's one-use link: it opens the page signed in, the
// code leaves the address bar, and a second use is refused.
async function signInLink() {
  const link = String(args.signin_link);
  await page.goto(link);
  await until('the page signed in by the link', (who) => !document.getElementById('view-list').hidden
    && document.getElementById('principal').textContent.startsWith(who + ' (') && sessionStorage.getItem('accrue-token') !== null
    && /^\d+ jobs?/.test(document.getElementById('jobs-summary').textContent),
  String(args.signin_principal), T(30000));
  const s = await page.evaluate(() => ({ href: location.href, principal: document.getElementById('principal').textContent,
    token: sessionStorage.getItem('accrue-token') }));
  check(!s.href.includes('signin') && !s.href.includes('#'), `the code stays in the address: ${s.href}`);
  check(s.token === args.signin_token, 'the page holds another token than the run\'s submit token');
  result.signin = { principal: s.principal, address: s.href };
  await shot('signin.png');
  // The same link in a fresh session (a new tab's storage): refused.
  const ctx = await browser.newContext({ ignoreHTTPSErrors: true, viewport: { width: 1280, height: 700 } });
  try {
    const p2 = await ctx.newPage();
    p2.on('pageerror', (e) => pageErrors.push('second tab: ' + String(e && e.stack || e)));
    await p2.goto(link);
    await p2.waitForFunction(() => !document.getElementById('login').hidden
      && /sign-in link was refused/.test(document.getElementById('login-error').textContent), null, { timeout: T(30000), polling: 100 });
    result.signin_reuse = await p2.evaluate(() => ({ error: document.getElementById('login-error').textContent,
      stored: sessionStorage.getItem('accrue-token'), address: location.href }));
    check(result.signin_reuse.stored === null, 'a refused link left a token in the second tab');
    check(/401/.test(result.signin_reuse.error), 'the second use was not refused with 401: ' + result.signin_reuse.error);
    check(!result.signin_reuse.address.includes('signin'), 'the refused code stays in the address');
    await p2.screenshot({ path: path.join(out, 'signin-refused.png') });
  } finally {
    await ctx.close();
  }
  noPageErrors();
  emit({ phase: 'signed_in' });
}

async function compare() {
  const jobs = (args.jobs || []).map(String);
  check(jobs.length >= 2, 'args.jobs needs two jobs or more');
  if (args.signin_link) await signInLink();
  await signIn();

  // 6. Jobs ticked in the list, compared on one chart with a legend.
  for (const id of jobs) {
    await until(`the row of job ${id}`, (sel) => !!document.querySelector(sel), rowSel(id), T(30000));
    await page.check(rowSel(id) + ' input.pick');
  }
  check(await page.$eval('#compare', (b) => !b.disabled), 'the compare button is disabled with two jobs ticked');
  await page.click('#compare');
  const series = {};
  for (const id of jobs) series[id] = await apiGet(`/v1/jobs/${encodeURIComponent(id)}/series?max_points=${bound}`);
  const want = Object.fromEntries(jobs.map((id) => [id, series[id].points.last_step.length]));
  result.compare = await until('one smoothed loss line a job on the compare chart, each with a point a step', (want) => {
    const lines = [...document.querySelectorAll('#compare-chart path.smooth')];
    const n = (p) => ((p.getAttribute('d') || '').match(/[ML]/g) || []).length;
    return lines.length === Object.keys(want).length && lines.every((p) => n(p) === want[p.dataset.job])
      && document.querySelectorAll('#compare-legend li').length === lines.length
      && Object.fromEntries(lines.map((p) => [p.dataset.job, n(p)]));
  }, want, T(30000));
  const cmp = await page.evaluate(() => ({
    hash: location.hash,
    classes: [...document.querySelectorAll('#compare-chart path.smooth')].map((p) => p.getAttribute('class')),
    raws: Object.fromEntries([...document.querySelectorAll('#compare-chart path.raw')].map((p) => [p.dataset.job, p.getAttribute('d')])),
    legend: [...document.querySelectorAll('#compare-legend li')].map((li) => [li.dataset.job, li.textContent]),
  }));
  check(new Set(cmp.classes).size === jobs.length, 'the compared lines share a colour: ' + cmp.classes.join(' | '));
  const names = {};
  for (const id of jobs) names[id] = (await apiGet(`/v1/jobs/${encodeURIComponent(id)}`)).name;
  for (const [id, text] of cmp.legend) check(text.includes(id) && text.includes(names[id]), `the legend of ${id} does not name it: ${text}`);
  // One x axis in steps for all: the same step, the same x.
  const xs = jobs.map((id) => verts(cmp.raws[id]).map(([x], i) => [series[id].points.last_step[i], x])).flat();
  const xf = fit(xs);
  result.compare_x_error_px = round3(xf.err);
  check(xf.err < 0.5 && xf.b > 0, `the compared lines do not share a step axis (off by ${xf.err} px)`);
  await shot('compare.png');

  // The first job's page.
  const id = jobs[0];
  await openJob(id);
  const job = await apiGet(`/v1/jobs/${encodeURIComponent(id)}`);
  const s = series[id];
  const losses = s.points.loss;
  const steps = s.points.last_step;
  const evals = new Map();
  for (const e of [...(s.evals || []), ...(job.eval ? [job.eval] : [])]) evals.set(e.epoch + '/' + e.step, e);
  check(evals.size >= 1, `job ${id} has no evaluation to draw`);
  await until(`the loss chart of ${id} with every step`, pf('return points() === arg && vertices() === arg;'), losses.length, T(30000));

  // 1. The spec as TOML text, and its hyperparameters.
  check(typeof job.spec_toml === 'string' && job.spec_toml.includes(`name = "${job.name}"`), 'the job JSON has no spec_toml');
  await until('the spec as TOML', (t) => document.getElementById('job-spec').textContent === t, job.spec_toml, T(15000));
  const hp = await page.evaluate(() => Object.fromEntries([...document.querySelectorAll('#hparams dd')].map((d) => [d.id, d.textContent])));
  result.hparams = hp;
  check(await page.$eval('#job-spec', (e) => e.children.length === 0), 'the spec became markup');
  const h = job.hparams;
  check(hp['hp-workers'] === String(h.workers) && hp['hp-accum'] === String(h.accumulation_steps), 'workers or k: ' + JSON.stringify(hp));
  check(hp['hp-batch'].startsWith(h.batch_size + ' per rank'), 'batch: ' + hp['hp-batch']);
  check(hp['hp-optimizer'].startsWith(h.optimizer) && Number(hp['hp-lr']) === h.lr, 'optimizer or lr: ' + JSON.stringify(hp));
  check(hp['hp-clip'].startsWith('max_norm') && hp['hp-precision'] === h.precision, 'clipping or precision: ' + JSON.stringify(hp));
  check(hp['hp-parallel'].startsWith(`${h.parallel.data} \u00d7 ${h.parallel.pipeline} \u00d7 ${h.parallel.tensor}`), 'parallel: ' + hp['hp-parallel']);
  await page.click('#spec-details summary');

  // 3. Evaluations as points over the loss, in the key.
  const marks = await until('an evaluation point on the loss chart for each evaluation', (n) => {
    const c = [...document.querySelectorAll('svg[data-chart="loss"] circle.marker-eval[data-step]')];
    return c.length === n && c.map((e) => ({ step: Number(e.dataset.step), cx: Number(e.getAttribute('cx')), cy: Number(e.getAttribute('cy')) }));
  }, evals.size, T(15000));
  const keyText = await page.$$eval('svg[data-chart="loss"] g.key text', (t) => t.map((x) => x.textContent));
  check(keyText.includes('eval loss'), 'no "eval loss" in the loss chart\'s key: ' + keyText.join(', '));
  result.eval_points = marks.length;
  await shot('job-spec.png');

  const lossD = () => page.evaluate(() => ({
    raw: document.querySelector('svg[data-chart="loss"] path.raw').getAttribute('d'),
    smooth: document.querySelector('svg[data-chart="loss"] path.smooth').getAttribute('d'),
    scale: document.querySelector('svg[data-chart="loss"]').getAttribute('data-scale'),
  }));
  const setSmoothing = async (w) => {
    await page.fill('#smoothing', String(w));
    await until(`smoothing ${w}`, (w) => document.getElementById('smoothing-value').textContent === w.toFixed(2), w, T(5000));
    await page.waitForTimeout(400); // one render (at most every 250 ms)
    return lossD();
  };

  // 4. Smoothing: 0 draws the raw values; 0.9 their moving average, the raw
  // line staying, faint.
  let d = await setSmoothing(0);
  check(d.smooth === d.raw, 'smoothing 0 does not draw the raw values');
  d = await setSmoothing(0.9);
  const raw = verts(d.raw);
  check(raw.length === losses.length, `the raw line has ${raw.length} vertices for ${losses.length} steps`);
  const yl = fit(raw.map(([, y], i) => [losses[i], y]));
  const want9 = ema(losses, 0.9);
  const sm = verts(d.smooth);
  const smoothErr = Math.max(...sm.map(([, y], i) => Math.abs(yl.at(want9[i]) - y)));
  result.smooth_error_px = round3(smoothErr);
  check(sm.length === losses.length && smoothErr < 0.5, `the smoothed line is not the 0.9 moving average (off by ${smoothErr} px)`);
  const faint = await page.$eval('svg[data-chart="loss"] path.raw', (p) => getComputedStyle(p).stroke);
  const alpha = Number((/rgba\([^)]*,\s*([\d.]+)\)/.exec(faint) || [0, 1])[1]);
  check(alpha < 0.6, 'the raw line is not faint: ' + faint);
  const xl = fit(raw.map(([x], i) => [steps[i], x]));
  for (const m of marks) {
    const e = [...evals.values()].find((x) => x.step === m.step);
    check(Math.abs(xl.at(m.step) - m.cx) < 0.5 && Math.abs(yl.at(e.loss) - m.cy) < 0.5, `eval point at step ${m.step} is not at its loss ${e.loss}`);
  }

  // 2. Log scale: y follows log10(loss); values <= 0 have no place (gaps).
  await page.check('#log-y');
  await until('the loss chart on a log scale', () => document.querySelector('svg[data-chart="loss"]').getAttribute('data-scale') === 'log', null, T(5000));
  await page.waitForTimeout(400);
  d = await lossD();
  const rawLog = verts(d.raw);
  const fl = fit(rawLog.map(([, y], i) => [Math.log10(losses[i]), y]));
  const flin = fit(rawLog.map(([, y], i) => [losses[i], y]));
  result.log_error_px = round3(fl.err);
  result.log_as_linear_error_px = round3(flin.err);
  check(rawLog.length === losses.length && fl.err < 0.5, `the log-scale line does not follow log10(loss) (off by ${fl.err} px)`);
  const range = Math.max(...losses) / Math.min(...losses);
  check(range < 1.5 || flin.err > 1, 'the log-scale line is linear in the loss');
  const marksLog = await page.$$eval('svg[data-chart="loss"] circle.marker-eval[data-step]', (c) => c.map((e) => [Number(e.dataset.step), Number(e.getAttribute('cy'))]));
  for (const [st, cy] of marksLog) {
    const e = [...evals.values()].find((x) => x.step === st);
    check(Math.abs(fl.at(Math.log10(e.loss)) - cy) < 0.5, `eval point at step ${st} is not at log10 of its loss`);
  }
  result.log_of_nonpositive = await page.evaluate(async () => (await import('/assets/series.js')).logY([100, 0, -1, 0.01, null]));
  check(JSON.stringify(result.log_of_nonpositive) === '[2,null,null,-2,null]', 'log of values <= 0: ' + JSON.stringify(result.log_of_nonpositive));
  await shot('job-log.png');
  await page.uncheck('#log-y');

  // 5. CSV and JSON of the curve as the page holds it, as downloads.
  const fetchDownload = async (button) => {
    const [dl] = await Promise.all([page.waitForEvent('download', { timeout: T(15000) }), page.click(button)]);
    return { name: dl.suggestedFilename(), text: fs.readFileSync(await dl.path(), 'utf8') };
  };
  const cols = ['last_step', 'loss', 'grad_norm', 'lr', 'samples_per_sec'];
  const same = (got, k, i) => (s.points[k][i] === null || s.points[k][i] === undefined ? got === null : got === s.points[k][i]);
  const csv = await fetchDownload('#export-csv');
  check(csv.name === `${id}-series.csv`, 'CSV file name ' + csv.name);
  const lines = csv.text.trim().split('\n');
  const head = lines[0].split(',');
  check(cols.every((c) => head.includes(c)), 'CSV header: ' + lines[0]);
  check(lines.length - 1 === losses.length, `CSV rows ${lines.length - 1}, series points ${losses.length}`);
  lines.slice(1).forEach((l, i) => {
    const cells = l.split(',');
    for (const k of cols) {
      const c = cells[head.indexOf(k)];
      check(same(c === '' ? null : Number(c), k, i), `CSV row ${i + 1} ${k} = ${c}, the series says ${s.points[k][i]}`);
    }
  });
  const js = await fetchDownload('#export-json');
  check(js.name === `${id}-series.json`, 'JSON file name ' + js.name);
  const doc = JSON.parse(js.text);
  check(doc.job === id && Array.isArray(doc.points) && doc.points.length === losses.length, 'JSON: ' + js.text.slice(0, 200));
  doc.points.forEach((p, i) => { for (const k of cols) check(same(p[k], k, i), `JSON point ${i} ${k} = ${p[k]}, the series says ${s.points[k][i]}`); });
  result.export_rows = { csv: lines.length - 1, json: doc.points.length };
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
    if (!origins.has(new URL(u).origin)) foreign.push(u);
  });
  page.on('dialog', (d) => (acceptDialogs ? d.accept() : d.dismiss()).catch(() => {}));
  if (mode === 'live') await live(); else if (mode === 'compare') await compare(); else await load();
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
