// accrue status page: a job's page. Its head, the charts and the tables
// render at most every RENDER_MS from what is held; the curve comes as a
// snapshot (GET /v1/jobs/{id}/series) and then live over Server-Sent Events.
// Every string that comes from the server is inserted as text (textContent /
// createTextNode / attribute values), never parsed as markup.
import { $, DASH, FINAL, enc, fin, sig, fmtLr, fmtInt, fmtCount, fmtDur, fmtPct, fmtClock, fmtWhen, list, str, el, row,
  setText, setBadge, setProgress, showOnly, showWorkerCount, note, download } from './util.js';
import { api, getJSON, quiet, canCancel, canResume, poller, POLL_MS } from './api.js';
import { BOUND, emptyCols, snapshot, appendBuckets, evalPoints, perplexityOf, seriesCSV, seriesJSON } from './series.js';
import { renderCharts, clearCharts, resumedKnown } from './charts.js';

const RENDER_MS = 250; // at most ~4 renders a second
const RESUMABLE = new Set(['failed', 'cancelled']);

// ---- a job --------------------------------------------------------------------
export function jobView(id) {
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
    'job-loss', 'job-gradnorm', 'job-lr', 'job-sps', 'job-seen', 'job-skipped', 'job-clip', 'job-steps', 'job-eta', 'series-info', 'eval',
    'job-spec', ...HPARAMS]) setText($(e), '');
  setText($('job-title'), id);
  setBadge($('job-state'), '');
  for (const e of ['job-error', 'cancel', 'cancel-error', 'resume', 'resume-error', 'evals', 'job-seen-fact']) $(e).hidden = true;
  setUnit(false);
  for (const t of ['workers', 'recoveries', 'evals']) $(t).tBodies[0].replaceChildren();
  $('history').replaceChildren();
  $('job-progress').removeAttribute('value');
  clearCharts();

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
  // The curve as held (what the charts draw), saved as a file.
  v.exportSeries = (fmt) => {
    const lm = (v.job || {}).unit === 'tokens';
    if (fmt === 'csv') download(id + '-series.csv', 'text/csv', seriesCSV(v.pts, lm));
    else download(id + '-series.json', 'application/json', seriesJSON(v.pts, lm, id));
  };

  function setJob(job) {
    if (!job || typeof job !== 'object') return;
    if (v.gen !== null && job.generation !== v.gen) v.genChanged = true;
    v.gen = job.generation;
    v.job = job;
    v.dirty.head = true;
    // A language model charts its evaluations' perplexity (issue 30).
    const cs = JSON.stringify([job.recoveries, job.clip, job.unit, job.unit === 'tokens' ? job.eval : null]);
    if (cs !== v.chartSig) { v.chartSig = cs; v.dirty.charts = true; }
    v.dirty.tables = true;
    schedule();
  }
  v.setJob = setJob;

  // Streamed buckets, after what is held (series.js has the rules): a
  // rollback takes the server's series now, a gap soon.
  function append(src) {
    if (appendBuckets(v, src, resync, () => later(resync, 0))) {
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
      const p = snapshot(s.points || {});
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
    const place = (c) => (c ? `${c.data}, ${c.pipeline}, ${c.tensor}` : DASH);
    const secs = (x) => (fin(x) ? x.toFixed(3) + ' s' : DASH);
    const mib = (b) => (fin(b) ? Math.round(b / 1048576) + ' MiB' : DASH);
    tb.replaceChildren(...mine.map((w) => row([[w.id], [str(w.rank), 'num'], [place(w.coords)], [secs(w.bubble_s), 'num'],
      [str(w.generation), 'num'], [str(w.device)],
      [str(w.data_addr)], [fin(w.last_seen_age_s) ? w.last_seen_age_s.toFixed(1) + ' s ago' : DASH],
      [str(w.step), 'num'], [fmtInt(w.samples_per_sec), 'num'], [mib(w.peak_rss_bytes), 'num']])));
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

// The labels of what a job counts: tokens for a language model (issue 30),
// samples otherwise.
function setUnit(lm) {
  setText($('job-sps-label'), lm ? 'tokens/s' : 'samples/s');
  setText($('workers-rate'), lm ? 'tokens/s' : 'samples/s');
  $('evals-ppl').hidden = !lm;
  setText($('evals-count'), lm ? 'tokens' : 'samples');
  setText($('x-samples'), lm ? 'tokens' : 'samples');
}

// The spec as submitted (TOML, as text) and its hyperparameters in short.
const HPARAMS = ['hp-workers', 'hp-accum', 'hp-batch', 'hp-optimizer', 'hp-lr', 'hp-clip', 'hp-precision', 'hp-parallel'];
function renderSpec(j) {
  setText($('job-spec'), typeof j.spec_toml === 'string' ? j.spec_toml : 'not available');
  const h = j.hparams || {};
  const c = j.clip || {};
  const p = h.parallel;
  const num = (x) => (fin(x) ? String(x) : DASH);
  setText($('hp-workers'), num(h.workers));
  setText($('hp-accum'), num(h.accumulation_steps));
  setText($('hp-batch'), fin(h.batch_size) ? h.batch_size + ' per rank' + (fin(h.global_batch) ? ', ' + h.global_batch + ' a step' : '') : DASH);
  setText($('hp-optimizer'), str(h.optimizer) + (fin(h.weight_decay) ? ', weight decay ' + sig(h.weight_decay, 3) : '')
    + (h.schedule && h.schedule !== 'constant' ? ', ' + h.schedule : ''));
  setText($('hp-lr'), fmtLr(h.lr));
  setText($('hp-clip'), fin(c.max_norm) ? 'max_norm ' + sig(c.max_norm) : fin(c.clip_value) ? 'value ' + sig(c.clip_value) : 'off');
  setText($('hp-precision'), str(h.precision || j.precision));
  setText($('hp-parallel'), p ? p.data + ' × ' + p.pipeline + ' × ' + p.tensor
    + (fin(h.sharding_stage) && h.sharding_stage > 0 ? ', ZeRO ' + h.sharding_stage : '') : DASH);
}

function renderHead(v) {
  const j = v.job;
  if (!j) return;
  renderSpec(j);
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
  // A language model (issue 30) counts target tokens where others count samples.
  const lm = j.unit === 'tokens';
  setUnit(lm);
  setText($('job-sps'), fmtInt(k.samples_per_sec));
  setText($('job-seen'), lm ? fmtCount(k.samples_seen) : '');
  $('job-seen-fact').hidden = !lm;
  setText($('job-skipped'), str(k.skipped_steps));
  const c = j.clip || {};
  const clip = [];
  if (fin(c.max_norm)) clip.push('max_norm ' + sig(c.max_norm) + (fin(c.norm_type) ? ' (norm ' + sig(c.norm_type, 3) + ')' : ''));
  if (fin(c.clip_value)) clip.push('value ' + sig(c.clip_value));
  setText($('job-clip'), clip.length ? clip.join(', ') : 'off');
  // fp16 shows its loss scale (the last step's).
  setText($('job-precision'), str(j.precision) + (fin(k.loss_scale) && k.loss_scale > 0 ? ', loss scale ' + sig(k.loss_scale) : ''));
  setProgress($('job-progress'), k.step, k.total_steps);
  const pct = fin(k.total_steps) && k.total_steps > 0 ? ' (' + ((100 * (k.step || 0)) / k.total_steps).toFixed(1) + '%)' : '';
  setText($('job-steps'), 'step ' + (fin(k.step) ? k.step : 0) + ' / ' + (fin(k.total_steps) ? k.total_steps : '?') + pct);
  setText($('job-eta'), FINAL.has(j.state) ? DASH : fmtDur(j.eta_s));
  const err = j.error ? String(j.error) : '';
  setText($('job-error'), err);
  $('job-error').hidden = !err;
  $('cancel').hidden = FINAL.has(j.state) || !canCancel(j);
  // A failed or cancelled job goes on from its checkpoints under its id.
  $('resume').hidden = !RESUMABLE.has(j.state) || !canResume(j);
  document.title = 'accrue: ' + (j.id || v.id) + ' (' + j.state + ')';
}

function renderTables(v) {
  const j = v.job || {};
  const recs = v.recoveries();
  // One row per (epoch, step), the latest (a rollback may evaluate again).
  const evals = evalPoints(v.evals, j.eval);
  // A language model's evaluation has a perplexity too, and counts target
  // tokens (its accuracy is next-token accuracy).
  const lm = j.unit === 'tokens';
  const sig2 = JSON.stringify([recs, evals, j.history, lm]);
  if (sig2 === v.tablesSig) return;
  v.tablesSig = sig2;

  $('recoveries').tBodies[0].replaceChildren(...recs.map((r) => {
    const resumed = !resumedKnown(r) ? '\u2026'
      : r.redone_steps > 0 ? r.resumed_step + ' (rolled back ' + r.redone_steps + ')' : r.resumed_step;
    const reason = r.loaded ? str(r.reason) + '; loaded ' + str(r.loaded) : str(r.reason);
    const tr = row([[str(r.generation), 'num'], [list(r.lost)], [list(r.joined)], [reason, 'wrap'],
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
    + (lm ? ' \u00b7 perplexity ' + sig(perplexityOf(e)) : '') + ' \u00b7 accuracy ' + fmtPct(e.accuracy)
    + (fin(e.samples) ? ' (' + e.samples + (lm ? ' tokens)' : ' samples)') : '') : 'none yet');
  $('evals').tBodies[0].replaceChildren(...evals.map((x) => row([[str(x.epoch), 'num'], [str(x.step), 'num'],
    [sig(x.loss), 'num'], ...(lm ? [[sig(perplexityOf(x)), 'num']] : []), [fmtPct(x.accuracy), 'num'], [str(x.samples), 'num']])));
  $('evals').hidden = evals.length === 0;

  const hist = Array.isArray(j.history) ? j.history : [];
  const dropped = fin(j.history_dropped) && j.history_dropped > 0
    ? [el('li', 'when', j.history_dropped + ' earlier transitions not kept')] : [];
  $('history').replaceChildren(...dropped, ...hist.map((h) => {
    const li = el('li');
    li.append(el('span', 'when', fmtClock(h.at_unix_ms)),
      document.createTextNode(str(h.from) + ' \u2192 ' + str(h.to) + (h.reason ? ': ' + h.reason : '')));
    return li;
  }));
}
