// accrue status page: a job's training curve as columnar bucket arrays (one
// array per column, one entry per bucket of steps), with the server's rules
// for merging, appending streamed buckets and rolling back, and smoothing.
import { fin } from './util.js';

export const BOUND = 1000; // points a chart holds at most (the server merges to the same)
const COLS = ['first_step', 'last_step', 'count', 'samples_seen', 'wall_ms', 'loss', 'loss_min',
  'loss_max', 'grad_norm', 'grad_norm_max', 'clip_coef', 'clip_coef_min', 'lr', 'samples_per_sec', 'skipped'];

export const emptyCols = () => Object.fromEntries(COLS.map((k) => [k, []]));
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
export function lowerBound(a, x) { // first index with a[i] >= x
  let lo = 0;
  let hi = a.length;
  while (lo < hi) {
    const m = (lo + hi) >> 1;
    if (a[m] < x) lo = m + 1; else hi = m;
  }
  return lo;
}

// The server's series (its `points`) as held: halved down to BOUND buckets.
export function snapshot(src) {
  let p = fromSeries(src);
  while (p.first_step.length > BOUND) p = halve(p);
  return p;
}

// Streamed buckets src after what s holds (s: {pts, width, genChanged,
// snapshotAt, lastGapResync}): one-step buckets fill the last bucket up to
// the current width, then a new one starts; past BOUND buckets adjacent
// pairs merge and the width doubles (as the server does). A bucket held
// already calls rollback() and stops there when it is not a leftover of the
// snapshot; steps missing call gap() (at most every 5 s). True: added some.
export function appendBuckets(s, src, rollback, gap) {
  const n = src && Array.isArray(src.first_step) ? src.first_step.length : 0;
  if (!n) return false;
  let p = s.pts;
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
      if (s.genChanged || performance.now() - s.snapshotAt > 2000) { rollback(); return false; }
      continue;
    }
    if (L && b.first_step > prev + 1 && performance.now() - s.lastGapResync > 5000) {
      s.lastGapResync = performance.now(); // steps missing: updates were lost
      gap();
    }
    if (L && p.count[L - 1] + (b.count || 1) <= s.width) {
      const m = merge(bucketAt(p, L - 1), b);
      for (const k of COLS) p[k][L - 1] = m[k];
    } else {
      pushBucket(p, b);
    }
    if (p.first_step.length > BOUND) {
      p = s.pts = halve(p);
      s.width *= 2;
    }
    added = true;
  }
  return added;
}

// A job's evaluations, one per (epoch, step) (a rollback may evaluate again):
// the series' and the job's latest, in that order.
export function evalPoints(evals, last) {
  const byKey = new Map();
  for (const e of evals.concat(last ? [last] : [])) {
    const k = e.epoch + '/' + e.step;
    if (!byKey.has(k) || e !== last) byKey.set(k, e);
  }
  return [...byKey.values()];
}

// A language model's perplexity, exp(eval loss per token): the server's,
// else from the loss; null when not a finite number.
export function perplexityOf(e) {
  if (fin(e.perplexity)) return e.perplexity;
  const p = fin(e.loss) ? Math.exp(e.loss) : null;
  return fin(p) ? p : null;
}

// TensorBoard's smoothing: an exponential moving average, debiased.
export function smooth(ys, w) {
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

// Values on a log10 scale: a value <= 0 (or not a number) has no place
// there and becomes a gap (null).
export const logY = (ys) => ys.map((y) => (fin(y) && y > 0 ? Math.log10(y) : null));

// The held columns as exported (CSV, JSON): a language model's samples
// columns count tokens and are named so.
const EXPORT = ['first_step', 'last_step', 'count', 'samples_seen', 'wall_ms', 'loss', 'loss_min', 'loss_max',
  'grad_norm', 'clip_coef', 'lr', 'samples_per_sec'];
const exportName = (k, lm) => (lm ? k.replace('samples', 'tokens') : k);
const cell = (x) => (fin(x) ? x : null);
export function seriesCSV(p, lm) {
  const n = p.first_step.length;
  const lines = [EXPORT.map((k) => exportName(k, lm)).join(',')];
  for (let i = 0; i < n; i++) lines.push(EXPORT.map((k) => (fin(p[k][i]) ? String(p[k][i]) : '')).join(','));
  return lines.join('\n') + '\n';
}
export function seriesJSON(p, lm, job) {
  const n = p.first_step.length;
  const points = [];
  for (let i = 0; i < n; i++) points.push(Object.fromEntries(EXPORT.map((k) => [exportName(k, lm), cell(p[k][i])])));
  return JSON.stringify({ job, unit: lm ? 'tokens' : 'samples', points }, null, 1) + '\n';
}
