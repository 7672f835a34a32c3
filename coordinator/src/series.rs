//! A job's training curve (docs/OPERATIONS.md, "The status page"), as pure functions over
//! [`JobSeries`].
//!
//! **Bounded whatever the job's length.** Steps go into buckets of
//! consecutive optimizer steps. Every bucket keeps the sums, extremes and
//! counts of what it holds (loss mean, min and max; grad norm mean and max;
//! clip coefficient mean and min; samples/s mean; skipped steps) and the
//! values at its last step (lr, samples seen, wall time), so merging two
//! buckets loses no extreme. A series starts with one step per bucket; when
//! it would hold more than [`MAX_BUCKETS`], adjacent pairs merge and the
//! width (steps per full bucket) doubles: memory stays under
//! [`MAX_BUCKETS`] buckets, every step stays in exactly one bucket, and a
//! job of up to [`MAX_BUCKETS`] steps keeps every step apart.
//!
//! **Markers are kept exactly.** Skipped steps are also kept as exact step
//! ranges (consecutive skips are one range; past [`MAX_SKIPPED_RANGES`]
//! ranges the two oldest join, the only loss of precision, and only for a
//! job that skipped thousands of separate steps). Recoveries live on the
//! job itself (`Job.recoveries`). Evaluations are kept up to [`MAX_EVALS`],
//! then every other one of the older half goes.
//!
//! **A rollback rewrites the tail.** A recovery may resume from a step
//! before the last one reported; the steps after it are done again, so
//! buckets that start after the resumed step are dropped when its
//! replacement arrives (the recovery marker shows where).

use accrue_proto::v1::{EvalPoint, EvalResult, JobSeries, SeriesBucket, StepRange, StepReport};
use serde_json::{json, Value};

/// Buckets kept per job.
pub const MAX_BUCKETS: usize = 1024;
/// Exact skipped-step ranges kept per job.
pub const MAX_SKIPPED_RANGES: usize = 4096;
/// Evaluations kept per job.
pub const MAX_EVALS: usize = 1024;
/// Points a series request returns when it names no `max_points`.
pub const DEFAULT_POINTS: usize = 1000;
/// The `max_points` a request may ask for.
pub const POINTS_RANGE: std::ops::RangeInclusive<usize> = 2..=10_000;

/// An empty series of `job`.
pub fn new(job: &str) -> JobSeries {
    JobSeries {
        job_id: job.to_string(),
        width: 1,
        ..Default::default()
    }
}

/// The one-step bucket of a step report, reported at `now_ms`.
pub fn bucket_of(r: &StepReport, now_ms: i64) -> SeriesBucket {
    let loss_ok = r.loss.is_finite();
    let grad_ok = r.grad_norm.is_finite() && r.clip_coef.is_finite();
    let or = |ok: bool, v: f64, none: f64| if ok { v } else { none };
    SeriesBucket {
        first_step: r.step,
        last_step: r.step,
        count: 1,
        finite: loss_ok as u64,
        samples_seen: r.samples_seen,
        wall_unix_ms: now_ms,
        loss_sum: or(loss_ok, r.loss, 0.0),
        loss_min: or(loss_ok, r.loss, f64::INFINITY),
        loss_max: or(loss_ok, r.loss, f64::NEG_INFINITY),
        grad_norm_sum: or(grad_ok, r.grad_norm, 0.0),
        grad_finite: grad_ok as u64,
        grad_norm_max: or(grad_ok, r.grad_norm, f64::NEG_INFINITY),
        clip_coef_sum: or(grad_ok, r.clip_coef, 0.0),
        clip_coef_min: or(grad_ok, r.clip_coef, f64::INFINITY),
        lr: r.lr,
        samples_per_sec_sum: or(r.samples_per_sec.is_finite(), r.samples_per_sec, 0.0),
        skipped: r.skipped as u64,
    }
}

/// `a` followed by `b` as one bucket.
pub fn merge(a: &SeriesBucket, b: &SeriesBucket) -> SeriesBucket {
    SeriesBucket {
        first_step: a.first_step,
        last_step: b.last_step,
        count: a.count + b.count,
        finite: a.finite + b.finite,
        samples_seen: b.samples_seen,
        wall_unix_ms: b.wall_unix_ms,
        loss_sum: a.loss_sum + b.loss_sum,
        loss_min: a.loss_min.min(b.loss_min),
        loss_max: a.loss_max.max(b.loss_max),
        grad_norm_sum: a.grad_norm_sum + b.grad_norm_sum,
        grad_finite: a.grad_finite + b.grad_finite,
        grad_norm_max: a.grad_norm_max.max(b.grad_norm_max),
        clip_coef_sum: a.clip_coef_sum + b.clip_coef_sum,
        clip_coef_min: a.clip_coef_min.min(b.clip_coef_min),
        lr: b.lr,
        samples_per_sec_sum: a.samples_per_sec_sum + b.samples_per_sec_sum,
        skipped: a.skipped + b.skipped,
    }
}

/// Adjacent pairs merged (an odd last bucket stays alone).
fn halve(buckets: &[SeriesBucket]) -> Vec<SeriesBucket> {
    buckets
        .chunks(2)
        .map(|c| match c {
            [a, b] => merge(a, b),
            [a] => *a,
            _ => unreachable!("chunks(2) yields one or two"),
        })
        .collect()
}

/// `buckets` merged pairwise until at most `max_points` remain (at least
/// half of them, when merging was needed).
pub fn downsample(buckets: &[SeriesBucket], max_points: usize) -> Vec<SeriesBucket> {
    let max_points = max_points.max(1);
    let mut out = buckets.to_vec();
    while out.len() > max_points {
        out = halve(&out);
    }
    out
}

/// Takes a step report (rank 0's, the job's) made at `now_ms`.
pub fn push_step(s: &mut JobSeries, r: &StepReport, now_ms: i64) {
    s.version += 1;
    s.width = s.width.max(1);
    // A rollback: the steps from r.step on are done again.
    if s.buckets.last().is_some_and(|b| b.last_step >= r.step) {
        // A bucket that straddles the resumed step goes too (its later
        // steps are done again): a short gap, never a step counted twice.
        s.buckets.retain(|b| b.last_step < r.step);
        s.skipped.retain(|x| x.first < r.step);
        if let Some(x) = s.skipped.last_mut() {
            x.last = x.last.min(r.step.saturating_sub(1));
        }
    }
    if r.skipped {
        match s.skipped.last_mut() {
            Some(x) if x.last + 1 == r.step => x.last = r.step,
            _ => s.skipped.push(StepRange {
                first: r.step,
                last: r.step,
            }),
        }
        if s.skipped.len() > MAX_SKIPPED_RANGES {
            let second = s.skipped.remove(1);
            s.skipped[0].last = second.last;
        }
    }
    let b = bucket_of(r, now_ms);
    match s.buckets.last_mut() {
        Some(last) if last.count < s.width && last.last_step < r.step => *last = merge(last, &b),
        _ => s.buckets.push(b),
    }
    if s.buckets.len() > MAX_BUCKETS {
        s.buckets = halve(&s.buckets);
        s.width *= 2;
    }
}

/// Takes an evaluation reported at `now_ms`.
pub fn push_eval(s: &mut JobSeries, e: EvalResult, now_ms: i64) {
    if s.evals.len() >= MAX_EVALS {
        let half = s.evals.len() / 2;
        let mut i = 0;
        s.evals.retain(|_| {
            i += 1;
            i > half || i % 2 == 1
        });
    }
    s.evals.push(EvalPoint {
        eval: Some(e),
        wall_unix_ms: now_ms,
    });
}

/// Seconds left for `total_steps`, from how fast the recent steps went:
/// `recent` holds (step, unix ms) in report order. The rate is taken over
/// the last 30 s (at least two points), after the last rollback. None while
/// that says nothing (one point, no progress, or done).
pub fn eta_s(recent: &[(u64, i64)], total_steps: u64) -> Option<f64> {
    let &(step, at) = recent.last()?;
    if step >= total_steps {
        return Some(0.0);
    }
    let mut from = None;
    for &(s, t) in recent.iter().rev().skip(1) {
        if s >= step {
            break; // before a rollback
        }
        from = Some((s, t));
        if at - t >= 30_000 {
            break;
        }
    }
    let (s0, t0) = from?;
    let dt = (at - t0) as f64 / 1000.0;
    if dt <= 0.0 {
        return None;
    }
    let rate = (step - s0) as f64 / dt;
    Some((total_steps - step) as f64 / rate)
}

/// [`eta_s`] of a series: over the last (up to) 256 buckets.
pub fn series_eta_s(s: &JobSeries, total_steps: u64) -> Option<f64> {
    let tail = &s.buckets[s.buckets.len().saturating_sub(256)..];
    let recent: Vec<(u64, i64)> = tail.iter().map(|b| (b.last_step, b.wall_unix_ms)).collect();
    eta_s(&recent, total_steps)
}

/// A number for JSON: `null` when not finite.
fn num(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}

/// Buckets as columns (index i of every array is bucket i): means, the
/// extremes, last-step values; non-finite values (and means of nothing)
/// are `null`.
pub fn columns_json(buckets: &[SeriesBucket]) -> Value {
    let col = |f: &dyn Fn(&SeriesBucket) -> Value| buckets.iter().map(f).collect::<Vec<_>>();
    let mean = |sum: f64, n: u64| {
        if n > 0 {
            num(sum / n as f64)
        } else {
            Value::Null
        }
    };
    json!({
        "first_step": col(&|b| json!(b.first_step)),
        "last_step": col(&|b| json!(b.last_step)),
        "count": col(&|b| json!(b.count)),
        "samples_seen": col(&|b| json!(b.samples_seen)),
        "wall_ms": col(&|b| json!(b.wall_unix_ms)),
        "loss": col(&|b| mean(b.loss_sum, b.finite)),
        "loss_min": col(&|b| num(b.loss_min)),
        "loss_max": col(&|b| num(b.loss_max)),
        "grad_norm": col(&|b| mean(b.grad_norm_sum, b.grad_finite)),
        "grad_norm_max": col(&|b| num(b.grad_norm_max)),
        "clip_coef": col(&|b| mean(b.clip_coef_sum, b.grad_finite)),
        "clip_coef_min": col(&|b| num(b.clip_coef_min)),
        "lr": col(&|b| num(b.lr)),
        "samples_per_sec": col(&|b| mean(b.samples_per_sec_sum, b.count)),
        "skipped": col(&|b| json!(b.skipped)),
    })
}

/// The answer to `GET /v1/jobs/{id}/series`: the buckets whose last step
/// is at or after `from_step`, merged down to `max_points`.
pub fn query_json(s: &JobSeries, from_step: u64, max_points: usize) -> Value {
    let start = s.buckets.partition_point(|b| b.last_step < from_step);
    let points = downsample(&s.buckets[start..], max_points);
    json!({
        "job": s.job_id,
        "version": s.version,
        "width": s.width,
        "max_points": max_points,
        "points": columns_json(&points),
        "skipped_steps": s.skipped.iter().filter(|x| x.last >= from_step).map(|x| [x.first, x.last]).collect::<Vec<_>>(),
        "evals": s.evals.iter().filter_map(|p| p.eval.map(|e| json!({
            "epoch": e.epoch, "step": e.step, "loss": num(e.loss), "accuracy": num(e.accuracy),
            "samples": e.samples, "wall_ms": p.wall_unix_ms,
        }))).collect::<Vec<_>>(),
    })
}

/// The answer to GetSeries: as [`query_json`], the buckets themselves
/// (sums and counts, so a client takes means where it needs them), with
/// the job's unit and recoveries, and a language model's evaluations with
/// their perplexity.
pub fn query(
    s: &JobSeries,
    job: &accrue_proto::v1::Job,
    from_step: u64,
    max_points: usize,
) -> accrue_proto::v1::GetSeriesResponse {
    let start = s.buckets.partition_point(|b| b.last_step < from_step);
    let lm = crate::domain::is_lm(job);
    let evals = s
        .evals
        .iter()
        .map(|p| {
            let mut p = *p;
            if let (true, Some(e)) = (lm, p.eval.as_mut()) {
                crate::domain::add_lm_eval_fields(e);
            }
            p
        })
        .collect();
    accrue_proto::v1::GetSeriesResponse {
        job_id: s.job_id.clone(),
        unit: crate::domain::unit(job).to_string(),
        width: s.width,
        points: downsample(&s.buckets[start..], max_points),
        skipped: s
            .skipped
            .iter()
            .filter(|x| x.last >= from_step)
            .copied()
            .collect(),
        evals,
        recoveries: job.recoveries.clone(),
    }
}

/// Why a series request is refused (None: it is fine).
pub fn check_points(max_points: usize) -> Option<String> {
    (!POINTS_RANGE.contains(&max_points)).then(|| {
        format!(
            "max_points = {max_points} is out of range: allowed {}..={}",
            POINTS_RANGE.start(),
            POINTS_RANGE.end()
        )
    })
}

#[cfg(test)]
mod tests;
