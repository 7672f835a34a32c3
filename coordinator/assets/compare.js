// accrue status page: two or more jobs' loss curves on one chart, by step
// (`#/compare/<id>,<id>,...`, chosen in the jobs list). Each job's series
// is read again every POLL_MS while one of them is live. Every string that
// comes from the server is inserted as text (textContent / attribute
// values), never parsed as markup.
import { $, FINAL, enc, fin, sig, fmtLr, str, el, setText, setBadge, showOnly, note } from './util.js';
import { getJSON, poller, quiet, POLL_MS } from './api.js';
import { BOUND, snapshot } from './series.js';
import { renderCompare, lossOptions } from './charts.js';

// The ids in a `#/compare/...` hash.
export function compareIds(rest) {
  return rest.split(',').filter(Boolean).map((s) => { try { return decodeURIComponent(s); } catch (_) { return s; } });
}
export const compareHash = (ids) => '#/compare/' + ids.map(enc).join(',');

export function compareView(ids) {
  showOnly('view-compare');
  document.title = 'accrue: compare ' + ids.join(', ');
  const v = { ids, runs: [], stopped: false };
  setText($('compare-title'), 'Comparing ' + ids.length + ' jobs');
  $('compare-legend').replaceChildren();
  const render = () => {
    renderCompare($('compare-chart'), v.runs, lossOptions($('cmp-log'), $('cmp-smoothing')));
    renderLegend(v.runs);
  };
  v.render = render;
  let stop = () => {};
  const load = async function compare() {
    const got = await Promise.all(ids.map(async (id) => {
      try {
        const [job, s] = await Promise.all([getJSON('/v1/jobs/' + enc(id)),
          getJSON('/v1/jobs/' + enc(id) + '/series?max_points=' + BOUND)]);
        return { id, job, pts: snapshot(s.points || {}) };
      } catch (e) {
        if (quiet(e)) throw e;
        return { id, job: null, pts: snapshot({}), error: e.message };
      }
    }));
    if (v.stopped) return;
    v.runs = got;
    render();
    const bad = got.filter((r) => r.error);
    note('compare', bad.map((r) => 'Job ' + r.id + ': ' + r.error).join(' \u00b7 '));
    if (got.every((r) => r.error || FINAL.has(r.job.state))) stop(); // nothing moves any more
  };
  stop = poller(load, POLL_MS);
  v.stop = () => { v.stopped = true; stop(); };
  return v;
}

// One entry a job: its colour, id (a link to its page), name, state, and
// what tells runs apart (lr, k, batch, workers), its last loss.
function renderLegend(runs) {
  $('compare-legend').replaceChildren(...runs.map((r, i) => {
    const li = el('li');
    li.dataset.job = r.id;
    const a = el('a', null, r.id);
    a.href = '#/jobs/' + enc(r.id);
    li.append(el('span', 'swatch s' + (i % 8)), a);
    if (!r.job) { li.append(el('span', 'error', ' ' + r.error)); return li; }
    const j = r.job;
    const h = j.hparams || {};
    const badge = el('span');
    setBadge(badge, j.state);
    const n = r.pts.loss.length;
    const bits = [str(j.name), fin(h.lr) ? 'lr ' + fmtLr(h.lr) : '', fin(h.accumulation_steps) ? 'k ' + h.accumulation_steps : '',
      fin(h.batch_size) ? 'batch ' + h.batch_size : '', fin(h.workers) ? h.workers + (h.workers === 1 ? ' worker' : ' workers') : '',
      n ? 'last loss ' + sig(r.pts.loss[n - 1]) : 'no steps yet'].filter(Boolean);
    li.append(' ', el('span', 'muted', bits.join(' \u00b7 ')), ' ', badge);
    return li;
  }));
}
