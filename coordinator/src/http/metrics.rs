//! `/metrics`: the coordinator in Prometheus text format.

use super::coordinator;
use super::views::{is_lm, perplexity};
use crate::domain::{state_name, JobState};
use crate::gate::Gate;
use crate::service::Coordinator;
use accrue_proto::v1::Job;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::fmt::Write;
use std::sync::Arc;

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Prometheus text format.
pub fn metrics_text(c: &Coordinator) -> String {
    let jobs = c.jobs();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP accrue_workers_attached Worker daemons attached to this coordinator."
    );
    let _ = writeln!(out, "# TYPE accrue_workers_attached gauge");
    let _ = writeln!(out, "accrue_workers_attached {}", c.worker_count());
    let _ = writeln!(
        out,
        "# HELP accrue_held_messages Messages to workers waiting for job writes to reach etcd."
    );
    let _ = writeln!(out, "# TYPE accrue_held_messages gauge");
    let _ = writeln!(out, "accrue_held_messages {}", c.held_messages());
    let [decided, handled] = c.report_latency();
    for (name, help, (p50, p99, n)) in [
        (
            "accrue_report_decision_seconds",
            "Time to lock and decide one worker message (recent window).",
            decided,
        ),
        (
            "accrue_report_handling_seconds",
            "Time to lock, decide and execute the effects of one worker message (recent window).",
            handled,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} summary");
        let _ = writeln!(out, "{name}{{quantile=\"0.5\"}} {}", p50 as f64 / 1e6);
        let _ = writeln!(out, "{name}{{quantile=\"0.99\"}} {}", p99 as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {n}");
    }
    let _ = writeln!(
        out,
        "# HELP accrue_tensorboard_points_dropped_total TensorBoard points dropped because the event-file writer fell behind."
    );
    let _ = writeln!(
        out,
        "# TYPE accrue_tensorboard_points_dropped_total counter"
    );
    let _ = writeln!(
        out,
        "accrue_tensorboard_points_dropped_total {}",
        c.tensorboard_dropped()
    );
    job_metrics(&mut out, &jobs);
    out
}

/// The per-job part of [`metrics_text`]: jobs by state, every job's
/// counters, and a language model's (issue 30) throughput in tokens, tokens
/// seen and evaluation perplexity; those three families appear only while
/// some job is a language model.
pub(super) fn job_metrics(out: &mut String, jobs: &[Job]) {
    let _ = writeln!(out, "# HELP accrue_jobs Jobs by state.");
    let _ = writeln!(out, "# TYPE accrue_jobs gauge");
    for s in [
        JobState::Pending,
        JobState::Rendezvous,
        JobState::Running,
        JobState::Recovering,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ] {
        let n = jobs.iter().filter(|j| j.state() == s).count();
        let _ = writeln!(out, "accrue_jobs{{state=\"{}\"}} {n}", state_name(s));
    }
    type Series = (
        &'static str,
        &'static str,
        &'static str,
        fn(&accrue_proto::v1::Counters) -> f64,
    );
    let series: [Series; 8] = [
        (
            "accrue_job_step",
            "counter",
            "Optimizer steps committed.",
            |c| c.step as f64,
        ),
        (
            "accrue_job_samples_seen",
            "counter",
            "Samples consumed by committed steps, all ranks.",
            |c| c.samples_seen as f64,
        ),
        (
            "accrue_job_loss",
            "gauge",
            "Mean loss of the last step.",
            |c| c.loss,
        ),
        (
            "accrue_job_grad_norm",
            "gauge",
            "Total gradient norm before clipping, last step.",
            |c| c.grad_norm,
        ),
        (
            "accrue_job_clip_coef",
            "gauge",
            "Clip coefficient of the last step.",
            |c| c.clip_coef,
        ),
        (
            "accrue_job_loss_scale",
            "gauge",
            "fp16's loss scale at the last step (0 when the job is not fp16).",
            |c| c.loss_scale,
        ),
        (
            "accrue_job_skipped_steps",
            "counter",
            "Steps skipped for a non-finite gradient.",
            |c| c.skipped_steps as f64,
        ),
        (
            "accrue_job_samples_per_second",
            "gauge",
            "Throughput of the last step.",
            |c| c.samples_per_sec,
        ),
    ];
    for (name, kind, help, f) in series {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for j in jobs {
            let c = j.counters.unwrap_or_default();
            let _ = writeln!(
                out,
                "{name}{{job=\"{}\",state=\"{}\"}} {}",
                escape(&j.id),
                state_name(j.state()),
                f(&c)
            );
        }
    }
    // Language models: the same step numbers, counted in target tokens,
    // and exp(eval loss per token).
    let lm: Vec<&Job> = jobs.iter().filter(|j| is_lm(j)).collect();
    if lm.is_empty() {
        return;
    }
    type LmSeries = (
        &'static str,
        &'static str,
        &'static str,
        fn(&Job) -> Option<f64>,
    );
    let series: [LmSeries; 3] = [
        (
            "accrue_job_tokens_per_second",
            "gauge",
            "Language models: target tokens per second of the last step.",
            |j| Some(j.counters.unwrap_or_default().samples_per_sec),
        ),
        (
            "accrue_job_tokens_seen_total",
            "counter",
            "Language models: target tokens consumed by committed steps, all ranks.",
            |j| Some(j.counters.unwrap_or_default().samples_seen as f64),
        ),
        (
            "accrue_job_eval_perplexity",
            "gauge",
            "Language models: perplexity of the last evaluation, exp(mean loss per token).",
            |j| j.eval.as_ref().and_then(|e| perplexity(e.loss)),
        ),
    ];
    for (name, kind, help, f) in series {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for j in &lm {
            if let Some(x) = f(j) {
                let _ = writeln!(
                    out,
                    "{name}{{job=\"{}\",state=\"{}\"}} {x}",
                    escape(&j.id),
                    state_name(j.state()),
                );
            }
        }
    }
}

pub(super) async fn metrics(State(g): State<Arc<Gate>>) -> Response {
    let c = match coordinator(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        metrics_text(&c),
    )
        .into_response()
}
