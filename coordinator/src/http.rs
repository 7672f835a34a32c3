//! The status endpoint: /healthz, /readyz, /v1/jobs, /v1/jobs/{id},
//! /metrics (Prometheus text) and / (a small dashboard).

use crate::gate::Gate;
use crate::service::Coordinator;
use accrue_proto::v1::{Job, JobState};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use std::fmt::Write;
use std::sync::Arc;

pub fn router(g: Arc<Gate>) -> Router {
    Router::new()
        .route("/", get(dashboard))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/v1/jobs", get(list))
        .route("/v1/jobs/{id}", get(one))
        .route("/metrics", get(metrics))
        .with_state(g)
}

async fn readyz(State(g): State<Arc<Gate>>) -> Response {
    match g.not_ready() {
        None => "ready\n".into_response(),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

/// The coordinator, or 503 naming the leader.
#[allow(clippy::result_large_err)]
fn leader(g: &Gate) -> Result<Arc<Coordinator>, Response> {
    g.get().map_err(IntoResponse::into_response)
}

pub fn state_name(s: JobState) -> &'static str {
    match s {
        JobState::Unspecified => "unspecified",
        JobState::Pending => "pending",
        JobState::Rendezvous => "rendezvous",
        JobState::Running => "running",
        JobState::Recovering => "recovering",
        JobState::Succeeded => "succeeded",
        JobState::Failed => "failed",
        JobState::Cancelled => "cancelled",
    }
}

fn state_of(i: i32) -> &'static str {
    state_name(JobState::try_from(i).unwrap_or(JobState::Unspecified))
}

/// A job as JSON (the proto fields, states by name).
pub fn job_json(j: &Job) -> Value {
    let c = j.counters.unwrap_or_default();
    let t = c.timing.unwrap_or_default();
    json!({
        "id": j.id,
        "name": j.spec.as_ref().map(|s| s.name.clone()),
        "state": state_name(j.state()),
        "workers": j.workers,
        "generation": j.generation,
        "accumulation_steps": j.accumulation_steps,
        "counters": {
            "step": c.step, "total_steps": c.total_steps, "micro_step": c.micro_step, "window": c.window,
            "epoch": c.epoch, "samples_seen": c.samples_seen, "skipped_steps": c.skipped_steps,
            "loss": c.loss, "grad_norm": c.grad_norm, "clip_coef": c.clip_coef, "lr": c.lr,
            "samples_per_sec": c.samples_per_sec, "bytes_sent": c.bytes_sent,
            "timing": {"compute_s": t.compute_s, "comm_s": t.comm_s, "clip_s": t.clip_s, "optimizer_s": t.optimizer_s},
        },
        "eval": j.eval.as_ref().map(|e| json!({"epoch": e.epoch, "step": e.step, "loss": e.loss, "accuracy": e.accuracy, "samples": e.samples})),
        "checkpoint": j.checkpoint,
        "error": j.error,
        "created_unix_ms": j.created_unix_ms,
        "history": j.history.iter().map(|h| json!({
            "from": state_of(h.from), "to": state_of(h.to), "reason": h.reason, "at_unix_ms": h.at_unix_ms,
        })).collect::<Vec<_>>(),
        "recoveries": j.recoveries.iter().map(|r| json!({
            "generation": r.generation, "lost": r.lost, "joined": r.joined, "reason": r.reason,
            "started_unix_ms": r.started_unix_ms, "reformed_unix_ms": r.reformed_unix_ms,
            "first_step_unix_ms": r.first_step_unix_ms, "resumed_step": r.resumed_step,
            "world_size": r.world_size, "accumulation_steps": r.accumulation_steps,
            "recovery_s": (r.first_step_unix_ms > 0).then(|| (r.first_step_unix_ms - r.started_unix_ms) as f64 / 1000.0),
        })).collect::<Vec<_>>(),
    })
}

async fn list(State(g): State<Arc<Gate>>) -> Response {
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    Json(json!({ "jobs": c.jobs().iter().map(job_json).collect::<Vec<_>>() })).into_response()
}

async fn one(State(g): State<Arc<Gate>>, Path(id): Path<String>) -> Response {
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    match c.job(&id) {
        Ok(j) => Json(job_json(&j)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Text made safe inside HTML (element content and quoted attributes).
pub fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

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
    let series: [Series; 7] = [
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
        for j in &jobs {
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
    out
}

async fn metrics(State(g): State<Arc<Gate>>) -> Response {
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        metrics_text(&c),
    )
        .into_response()
}

async fn dashboard(State(g): State<Arc<Gate>>) -> Response {
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let mut rows = String::new();
    for j in c.jobs() {
        let k = j.counters.unwrap_or_default();
        let _ = write!(
            rows,
            "<tr><td><a href=\"/v1/jobs/{id}\">{id}</a></td><td>{}</td><td>{}/{}</td><td>{:.4}</td><td>{:.3}</td><td>{:.0}</td></tr>",
            state_name(j.state()),
            k.step,
            k.total_steps,
            k.loss,
            k.grad_norm,
            k.samples_per_sec,
            id = html_escape(&j.id)
        );
    }
    Html(format!(
        "<!doctype html><html><head><meta http-equiv=\"refresh\" content=\"2\"><title>accrue</title></head><body>\
         <h1>accrue</h1><p>{} workers attached</p><table border=\"1\" cellpadding=\"4\">\
         <tr><th>job</th><th>state</th><th>step</th><th>loss</th><th>grad norm</th><th>samples/s</th></tr>{rows}</table>\
         <p><a href=\"/metrics\">/metrics</a> · <a href=\"/v1/jobs\">/v1/jobs</a></p></body></html>",
        c.worker_count()
    ))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::html_escape;

    #[test]
    fn nothing_a_name_holds_escapes_its_attribute() {
        let evil = r#"evil"><script>alert(1)</script>'&"#;
        let safe = html_escape(evil);
        assert_eq!(
            safe,
            "evil&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;&#39;&amp;"
        );
        assert!(!safe.contains(['<', '>', '"', '\'']));
        assert_eq!(html_escape("digits-mlp-1"), "digits-mlp-1");
    }
}
