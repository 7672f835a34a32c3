//! The status endpoint: /healthz, /readyz, /v1/jobs, /v1/jobs/{id},
//! POST /v1/jobs/{id}/cancel, /metrics (Prometheus text) and / (a small
//! dashboard).
//!
//! With a tokens file every request but the probes needs `authorization:
//! Bearer <token>` (401 without, 403 with a token lacking the scope; see
//! [`auth::http_rule`]); the guard decides before any handler runs and
//! leaves the principal in the request's extensions. Every response carries
//! [`SECURITY_HEADERS`]; no CORS headers are ever sent, and a state change
//! (the cancel POST) from another site is refused whatever the credentials.

use crate::auth::{self, Principal, Tokens};
use crate::error::CoordError;
use crate::gate::Gate;
use crate::service::Coordinator;
use accrue_proto::v1::{Job, JobState};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use std::fmt::Write;
use std::sync::Arc;

/// Headers on every response: scripts, styles and frames only from this
/// origin (the dashboard has none), no content-type sniffing, not framed,
/// no referrer, not cached.
pub const SECURITY_HEADERS: [(&str, &str); 5] = [
    ("content-security-policy", "default-src 'self'"),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-store"),
];

/// The router; `tokens` None: no authentication (every route open).
pub fn router(g: Arc<Gate>, tokens: Option<Arc<Tokens>>) -> Router {
    Router::new()
        .route("/", get(dashboard))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/v1/jobs", get(list))
        .route("/v1/jobs/{id}", get(one))
        .route("/v1/jobs/{id}/cancel", post(cancel))
        .route("/metrics", get(metrics))
        .with_state(g)
        .layer(middleware::from_fn_with_state(tokens, guard))
}

/// Why a state-changing request looks cross-site (a form or script of
/// another origin riding on the browser's credentials), if it does: its
/// `Sec-Fetch-Site` is neither `same-origin` nor `none`, or its `Origin`
/// names another host than `Host`. Safe methods are never refused here.
pub fn cross_site(method: &Method, headers: &HeaderMap) -> Option<String> {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    let text = |n: header::HeaderName| headers.get(n).and_then(|v| v.to_str().ok());
    if let Some(site) = text(header::HeaderName::from_static("sec-fetch-site")) {
        if site != "same-origin" && site != "none" {
            return Some(format!("Sec-Fetch-Site is {site:?}"));
        }
    }
    if let Some(origin) = text(header::ORIGIN) {
        let authority = origin.split_once("://").map_or(origin, |(_, a)| a);
        if Some(authority) != text(header::HOST) {
            return Some(format!(
                "Origin {origin:?} is not this host ({:?})",
                text(header::HOST).unwrap_or("")
            ));
        }
    }
    None
}

/// Authentication and authorization of every request (see the module
/// documentation), then the security headers on whatever the answer is.
async fn guard(
    State(tokens): State<Option<Arc<Tokens>>>,
    mut req: Request,
    next: Next,
) -> Response {
    let mut resp = match admit(tokens.as_deref(), &req) {
        Ok(p) => {
            if let Some(p) = p {
                req.extensions_mut().insert(p);
            }
            next.run(req).await
        }
        Err(r) => r,
    };
    let h = resp.headers_mut();
    for (name, value) in SECURITY_HEADERS {
        h.insert(name, HeaderValue::from_static(value));
    }
    resp
}

/// The principal a request runs as (None: it needs none, or auth is off),
/// or the refusal to answer with.
#[allow(clippy::result_large_err)]
fn admit(tokens: Option<&Tokens>, req: &Request) -> Result<Option<Principal>, Response> {
    let (method, path) = (req.method(), req.uri().path());
    if let Some(why) = cross_site(method, req.headers()) {
        return Err(CoordError::PermissionDenied(format!(
            "cross-site {method} {path} refused: {why}"
        ))
        .into_response());
    }
    let table = tokens.map(|t| t.current());
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    let what = format!("{method} {path}");
    auth::decide(
        table.as_deref(),
        auth::http_rule(method, path),
        header,
        &what,
    )
    .map_err(|e| {
        tracing::info!(request = %what, error = %e, "http request refused");
        if e.unauthenticated() {
            let challenge = if matches!(e, auth::AuthError::Missing) {
                "Bearer realm=\"accrue\""
            } else {
                "Bearer realm=\"accrue\", error=\"invalid_token\""
            };
            let mut r = CoordError::Unauthenticated(e.to_string()).into_response();
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(challenge),
            );
            r
        } else {
            CoordError::PermissionDenied(e.to_string()).into_response()
        }
    })
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
        "owner": j.owner,
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

/// `POST /v1/jobs/{id}/cancel`: the guard checked the `submit` scope; the
/// scheduler checks ownership (or `admin`).
async fn cancel(
    State(g): State<Arc<Gate>>,
    Path(id): Path<String>,
    p: Option<Extension<Principal>>,
) -> Response {
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    match c.cancel_as(&id, auth::caller(p.as_ref().map(|e| &e.0))) {
        Ok(j) => Json(job_json(&j)).into_response(),
        Err(e) => e.into_response(),
    }
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
    Html(dashboard_html(&c.jobs(), c.worker_count()).into_string()).into_response()
}

/// The dashboard page. Built with maud, which escapes every value it
/// inserts: whatever a job holds (its owner, its error) is text, never
/// markup. No scripts or styles (the CSP allows none inline).
pub fn dashboard_html(jobs: &[Job], workers: usize) -> maud::Markup {
    use maud::{html, DOCTYPE};
    html! {
        (DOCTYPE)
        html {
            head {
                meta charset="utf-8";
                meta http-equiv="refresh" content="2";
                title { "accrue" }
            }
            body {
                h1 { "accrue" }
                p { (workers) " workers attached" }
                table border="1" cellpadding="4" {
                    tr {
                        th { "job" } th { "owner" } th { "state" } th { "step" } th { "loss" }
                        th { "grad norm" } th { "samples/s" } th { "error" }
                    }
                    @for j in jobs {
                        @let k = j.counters.unwrap_or_default();
                        tr {
                            td { a href=(format!("/v1/jobs/{}", j.id)) { (j.id) } }
                            td { @if j.owner.is_empty() { "-" } @else { (j.owner) } }
                            td { (state_name(j.state())) }
                            td { (k.step) "/" (k.total_steps) }
                            td { (format!("{:.4}", k.loss)) }
                            td { (format!("{:.3}", k.grad_norm)) }
                            td { (format!("{:.0}", k.samples_per_sec)) }
                            td { (j.error) }
                        }
                    }
                }
                p { a href="/metrics" { "/metrics" } " · " a href="/v1/jobs" { "/v1/jobs" } }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_text_is_rendered_as_text() {
        let evil = r#"evil"><script>alert(1)</script>'&"#;
        let job = Job {
            id: "digits-mlp-1".into(),
            owner: evil.into(),
            error: format!("<img src=x onerror=alert(2)> {evil}"),
            ..Default::default()
        };
        let page = dashboard_html(&[job], 2).into_string();
        assert!(!page.contains("<script>"), "{page}");
        assert!(!page.contains("<img"), "{page}");
        assert!(
            page.contains("evil&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;'&amp;"),
            "{page}"
        );
        assert!(
            page.contains("&lt;img src=x onerror=alert(2)&gt;"),
            "{page}"
        );
        assert!(page.contains(r#"<a href="/v1/jobs/digits-mlp-1">digits-mlp-1</a>"#));
    }

    #[test]
    fn state_changes_from_another_site_are_refused() {
        let h = |pairs: &[(&'static str, &'static str)]| {
            let mut m = HeaderMap::new();
            for (k, v) in pairs {
                m.insert(*k, HeaderValue::from_static(v));
            }
            m
        };
        let post = Method::POST;
        // curl and the CLI send neither header.
        assert_eq!(cross_site(&post, &h(&[("host", "127.0.0.1:8080")])), None);
        assert_eq!(
            cross_site(
                &post,
                &h(&[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://127.0.0.1:8080")
                ])
            ),
            None
        );
        assert_eq!(
            cross_site(&post, &h(&[("sec-fetch-site", "same-origin")])),
            None
        );
        let e = cross_site(
            &post,
            &h(&[
                ("host", "127.0.0.1:8080"),
                ("origin", "https://evil.example"),
            ]),
        )
        .unwrap();
        assert!(e.contains("evil.example"), "{e}");
        assert!(cross_site(&post, &h(&[("sec-fetch-site", "cross-site")])).is_some());
        assert!(cross_site(&post, &h(&[("sec-fetch-site", "same-site")])).is_some());
        // Reads are never refused for it.
        assert_eq!(
            cross_site(&Method::GET, &h(&[("sec-fetch-site", "cross-site")])),
            None
        );
    }
}
