// accrue status page: the SVG charts of a job's curve (axes, raw, smoothed
// and min-max band lines, the clip threshold, skipped and recovery markers)
// and their hover tooltip. Every string that comes from the server is
// inserted as text (textContent / attribute values), never parsed as markup.
import { $, DASH, fin, sig, fmtLr, fmtInt, fmtCount, fmtClock, fmtPct, list, str, sv, setText } from './util.js';
import { lowerBound, smooth, evalPoints, perplexityOf, logY } from './series.js';

const W = 600;
const H = 230;
const M = { l: 64, r: 16, t: 28, b: 34 };
const PW = W - M.l - M.r;
const PH = H - M.t - M.b;
const CHARTS = [
  // The loss: log scale and smoothing as the toolbar says, evaluations drawn over it.
  { name: 'loss', title: 'loss', key: 'loss', band: ['loss_min', 'loss_max'], smooth: 0.6, evals: true, fmt: sig },
  { name: 'grad_norm', title: 'gradient norm (before clipping)', key: 'grad_norm', threshold: true, fmt: sig },
  { name: 'clip_coef', title: 'clip coefficient', key: 'clip_coef', fmt: sig },
  { name: 'lr', title: 'learning rate', key: 'lr', fmt: fmtLr },
  { name: 'samples_per_sec', title: 'samples / s', lmTitle: 'tokens / s', key: 'samples_per_sec', fmt: fmtInt },
];
// A language model's (issue 30): its evaluations' perplexity, exp(loss per token).
const PERPLEXITY = { name: 'perplexity', title: 'eval perplexity', key: 'perplexity', fmt: sig, empty: 'no evaluation yet' };
const XAXES = {
  step: { key: 'last_step', label: 'step', fmt: fmtInt },
  samples: { key: 'samples_seen', label: 'samples', fmt: fmtCount },
  time: { key: 'wall_ms', label: 'time', fmt: fmtClock },
};

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
export const resumedKnown = (r) => fin(r.resumed_step) && (r.resumed_step > 0 || (fin(r.reformed_unix_ms) && r.reformed_unix_ms > 0));

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

// The y domain of some value arrays (and extra values), padded 5%, with
// its ticks (min, middle, max); a linear one starts at 0 when the values do.
function yDomain(arrays, extra, log) {
  const yd = [Infinity, -Infinity];
  for (const a of arrays) extent(a, yd);
  extent(extra, yd);
  if (!fin(yd[0])) { yd[0] = 0; yd[1] = 1; }
  const lo = yd[0];
  const ticks = yd[0] === yd[1] ? [yd[0]] : [yd[0], (yd[0] + yd[1]) / 2, yd[1]];
  if (yd[0] === yd[1]) { const d = Math.abs(yd[0]) * 0.1 || 1; yd[0] -= d; yd[1] += d; }
  const pad = (yd[1] - yd[0]) * 0.05;
  yd[0] -= pad; yd[1] += pad;
  if (!log && yd[0] < 0 && lo >= 0) yd[0] = 0;
  return { yd, ticks };
}

// Grid, axes and ticks; returns the scales.
function frame(svg, xd, yd, yticks, fmtY, xa, wholeX) {
  const sx = (x) => M.l + ((x - xd[0]) / (xd[1] - xd[0])) * PW;
  const sy = (y) => M.t + PH - ((y - yd[0]) / (yd[1] - yd[0])) * PH;
  const g = sv('g');
  for (const yv of yticks) {
    const y = sy(yv);
    g.append(sv('line', { x1: M.l, x2: M.l + PW, y1: y, y2: y, class: 'grid-line' }));
    g.append(sv('text', { x: M.l - 6, y: y + 3.5, class: 'tick', 'text-anchor': 'end' }, fmtY(yv)));
  }
  for (let i = 0; i <= 4; i++) {
    let xv = xd[0] + ((xd[1] - xd[0]) * i) / 4;
    if (wholeX) xv = Math.round(xv);
    const x = sx(xv);
    g.append(sv('line', { x1: x, x2: x, y1: M.t + PH, y2: M.t + PH + 4, class: 'axis' }));
    g.append(sv('text', { x, y: M.t + PH + 16, class: 'tick', 'text-anchor': i === 0 ? 'start' : i === 4 ? 'end' : 'middle' }, xa.fmt(xv)));
  }
  g.append(sv('text', { x: M.l + PW, y: H - 2, class: 'tick', 'text-anchor': 'end' }, xa.label));
  g.append(sv('line', { x1: M.l, x2: M.l + PW, y1: M.t + PH, y2: M.t + PH, class: 'axis' }));
  g.append(sv('line', { x1: M.l, x2: M.l, y1: M.t, y2: M.t + PH, class: 'axis' }));
  svg.append(g);
  return { sx, sy };
}

// A key under the title: [kind ('smooth' | 'raw' | 'eval'), label] each.
function key(svg, items) {
  let x = 64;
  for (const [kind, label] of items) {
    const g = sv('g', { class: 'key' });
    g.append(kind === 'eval' ? sv('circle', { class: 'marker-eval', cx: x + 7, cy: 13, r: 3.5 })
      : sv('line', { class: 'key-' + kind, x1: x, x2: x + 14, y1: 13, y2: 13 }));
    g.append(sv('text', { x: x + 18, y: 17, class: 'legend' }, label));
    svg.append(g);
    x += 30 + label.length * 5.6;
  }
}

// The loss chart's evaluations: where each goes on the x axis and its loss.
function evalMarks(v, xmode, xs) {
  const p = v.pts;
  const n = p.last_step.length;
  const out = [];
  for (const e of evalPoints(v.evals, (v.job || {}).eval)) {
    if (!fin(e.step) || !fin(e.loss) || !n) continue;
    const i = Math.min(lowerBound(p.last_step, e.step), n - 1);
    const x = xmode === 'step' ? e.step : xmode === 'time' && fin(e.wall_ms) ? e.wall_ms : xs[i];
    out.push({ x, y: e.loss, e });
  }
  return out;
}

function renderChart(svg, spec, v, xmode) {
  const p = v.pts;
  const n = p.first_step.length;
  const lm = (v.job || {}).unit === 'tokens';
  const unit = lm ? 'tokens' : 'samples';
  const xa = xmode === 'samples' ? { ...XAXES.samples, label: unit } : XAXES[xmode];
  const xs = p[xa.key];
  const ys = p[spec.key];
  const log = !!spec.log;
  const T = log ? logY : (a) => a;
  svg.replaceChildren();
  svg.setAttribute('data-points', String(n));
  svg.setAttribute('data-scale', log ? 'log' : 'linear');
  svg.append(sv('text', { x: 8, y: 17, class: 'ctitle' }, spec.title));
  const lastY = n ? ys[n - 1] : null;
  const dropped = log ? ys.filter((y) => fin(y) && y <= 0).length : 0;
  svg.append(sv('text', { x: W - M.r, y: 17, class: 'legend', 'text-anchor': 'end' },
    n ? 'last ' + spec.fmt(lastY) + ' \u00b7 ' + n + (n === 1 ? ' point' : ' points')
      + (dropped ? ' \u00b7 ' + dropped + ' \u2264 0 not drawn' : '') : ''));
  svg.__chart = null;
  if (!n) {
    svg.append(sv('text', { x: W / 2, y: H / 2, class: 'empty', 'text-anchor': 'middle' }, spec.empty || 'no data yet'));
    return;
  }
  const job = v.job || {};
  const threshold = spec.threshold && job.clip && fin(job.clip.max_norm) ? job.clip.max_norm : null;
  const hasBand = spec.band && p.count.some((c) => c > 1);
  const smoothing = fin(spec.smooth) ? spec.smooth : null;
  const sm = smoothing !== null ? smooth(ys, smoothing) : null;
  const marks = spec.evals ? evalMarks(v, xmode, xs) : [];
  const yt = T(ys);
  const band = hasBand ? [T(p[spec.band[0]]), T(p[spec.band[1]])] : null;
  const smt = sm && T(sm);
  const mt = T(marks.map((m) => m.y));
  const tt = threshold !== null ? T([threshold])[0] : null;
  if (spec.evals) key(svg, [['smooth', smoothing ? 'smoothed' : 'train'], ...(smoothing ? [['raw', 'raw']] : []), ...(marks.length ? [['eval', 'eval loss']] : [])]);

  // domains
  const xd = extent(xs, [Infinity, -Infinity]);
  if (!fin(xd[0])) return;
  if (xd[0] === xd[1]) { xd[0] -= 1; xd[1] += 1; }
  const { yd, ticks } = yDomain([yt, ...(band || [])], [...mt, ...(fin(tt) ? [tt] : [])], log);
  const { sx, sy } = frame(svg, xd, yd, ticks, (t) => spec.fmt(log ? 10 ** t : t), xa, xmode === 'step');

  if (band) svg.append(sv('path', { class: 'band', d: bandPath(xs, band[0], band[1], sx, sy) }));
  svg.append(sv('path', { class: 'raw', d: linePath(xs, yt, sx, sy) }));
  if (smt) svg.append(sv('path', { class: 'smooth', d: linePath(xs, smt, sx, sy) }));
  if (fin(tt)) {
    const ty = sy(tt);
    const t = sv('line', { class: 'threshold', x1: M.l, x2: M.l + PW, y1: ty, y2: ty });
    t.append(sv('title', null, 'clip max_norm ' + sig(threshold)));
    svg.append(t, sv('text', { x: M.l + PW - 2, y: ty - 4, class: 'tick', 'text-anchor': 'end' }, 'max_norm ' + sig(threshold)));
  }
  marks.forEach((m, i) => {
    if (!fin(m.x) || !fin(mt[i])) return;
    const c = sv('circle', { class: 'marker-eval', cx: sx(m.x).toFixed(1), cy: sy(mt[i]).toFixed(1), r: 4, 'data-step': m.e.step });
    c.append(sv('title', null, 'eval at step ' + m.e.step + ': loss ' + sig(m.e.loss)
      + (fin(m.e.accuracy) ? ', accuracy ' + fmtPct(m.e.accuracy) : '')));
    svg.append(c);
  });

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
      + (resumedKnown(r) ? '; resumed at step ' + r.resumed_step : '; in progress') + (r.reason ? '; ' + r.reason : '')
      + (r.loaded ? '; loaded ' + r.loaded : '');
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
  svg.__chart = { spec, xs, ys, yt, sm, sx, sy, xa, p, unit, hoverLine, hoverDot };
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
  if (fin(c.yt[i])) {
    c.hoverDot.setAttribute('cx', x);
    c.hoverDot.setAttribute('cy', c.sy(c.yt[i]));
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
  lines.push(c.unit + ' ' + fmtInt(p.samples_seen[i]) + '  \u00b7  ' + fmtClock(p.wall_ms[i]));
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

// A language model's evaluations as one-step points (their step's samples
// seen and time from the curve where they carry none), by step.
function evalCols(v) {
  const p = v.pts;
  const n = p.last_step.length;
  const q = { first_step: [], last_step: [], count: [], samples_seen: [], wall_ms: [], skipped: [], perplexity: [] };
  const evals = evalPoints(v.evals, (v.job || {}).eval).filter((e) => fin(e.step)).sort((a, b) => a.step - b.step);
  for (const e of evals) {
    const i = n ? Math.min(lowerBound(p.last_step, e.step), n - 1) : -1;
    q.first_step.push(e.step);
    q.last_step.push(e.step);
    q.count.push(1);
    q.skipped.push(0);
    q.samples_seen.push(i >= 0 ? p.samples_seen[i] : null);
    q.wall_ms.push(fin(e.wall_ms) ? e.wall_ms : i >= 0 ? p.wall_ms[i] : null);
    q.perplexity.push(perplexityOf(e));
  }
  return q;
}

// The loss chart's options from a toolbar: {log, smooth} (the smoothing
// weight, 0 to 0.99).
export function lossOptions(logBox, range) {
  const w = Number(range.value);
  return { log: logBox.checked, smooth: fin(w) ? Math.min(Math.max(w, 0), 0.99) : 0.6 };
}

export function renderCharts(v) {
  const xmode = XAXES[$('x-axis').value] ? $('x-axis').value : 'step';
  const lm = (v.job || {}).unit === 'tokens';
  const opts = lossOptions($('log-y'), $('smoothing'));
  for (const spec of CHARTS) {
    const svg = document.querySelector('svg[data-chart="' + spec.name + '"]');
    let s = lm && spec.lmTitle ? { ...spec, title: spec.lmTitle } : spec;
    if (spec.evals) s = { ...s, ...opts };
    if (spec.lmTitle && svg) svg.setAttribute('aria-label', lm ? 'tokens per second' : 'samples per second');
    if (svg) renderChart(svg, s, v, xmode);
  }
  // The perplexity chart: a language model's only.
  const fig = $('chart-perplexity');
  const ppl = document.querySelector('svg[data-chart="perplexity"]');
  if (fig) fig.hidden = !lm;
  if (lm && ppl) {
    renderChart(ppl, PERPLEXITY, { pts: evalCols(v), job: v.job, skippedRanges: [], recoveries: () => v.recoveries() }, xmode);
  }
  const p = v.pts;
  const n = p.first_step.length;
  const steps = n ? p.last_step[n - 1] - p.first_step[0] + 1 : 0;
  setText($('series-info'), n ? n + ' points for ' + steps + ' steps' + (steps > n ? ' (merged)' : '') : '');
}

// Jobs' losses by step on one chart (the compare view): each job's
// smoothed line in its colour (class s0..s7, its place in `runs`) over its
// raw line, faint.
export function renderCompare(svg, runs, opts) {
  const T = opts.log ? logY : (a) => a;
  svg.replaceChildren();
  svg.setAttribute('data-scale', opts.log ? 'log' : 'linear');
  svg.append(sv('text', { x: 8, y: 17, class: 'ctitle' }, 'loss'));
  const drawn = runs.map((r, i) => ({ r, i, ys: T(r.pts.loss), sm: T(smooth(r.pts.loss, opts.smooth)) }))
    .filter((d) => d.r.pts.last_step.length);
  svg.setAttribute('data-lines', String(drawn.length));
  if (!drawn.length) {
    svg.append(sv('text', { x: W / 2, y: H / 2, class: 'empty', 'text-anchor': 'middle' }, 'no data yet'));
    return;
  }
  const xd = [Infinity, -Infinity];
  for (const d of drawn) extent(d.r.pts.last_step, xd);
  if (xd[0] === xd[1]) { xd[0] -= 1; xd[1] += 1; }
  const { yd, ticks } = yDomain(drawn.flatMap((d) => [d.ys, d.sm]), [], opts.log);
  const { sx, sy } = frame(svg, xd, yd, ticks, (t) => sig(opts.log ? 10 ** t : t), XAXES.step, true);
  for (const d of drawn) {
    const xs = d.r.pts.last_step;
    svg.append(sv('path', { class: 'raw s' + (d.i % 8), 'data-job': d.r.id, d: linePath(xs, d.ys, sx, sy) }));
  }
  for (const d of drawn) {
    const line = sv('path', { class: 'smooth s' + (d.i % 8), 'data-job': d.r.id, d: linePath(d.r.pts.last_step, d.sm, sx, sy) });
    line.append(sv('title', null, d.r.id + (d.r.job && d.r.job.name ? ' (' + d.r.job.name + ')' : '')));
    svg.append(line);
  }
}

// Every chart empty (a new job page).
export function clearCharts() {
  if ($('chart-perplexity')) $('chart-perplexity').hidden = true;
  for (const svg of document.querySelectorAll('svg[data-chart]')) { svg.replaceChildren(); svg.setAttribute('data-points', '0'); svg.__chart = null; leave(svg); }
}

// The tooltip follows the pointer on every chart.
export function bindCharts() {
  for (const svg of document.querySelectorAll('svg[data-chart]')) {
    svg.addEventListener('mousemove', (ev) => hover(svg, ev));
    svg.addEventListener('mouseleave', () => leave(svg));
  }
}
