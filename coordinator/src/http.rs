//! The status endpoint: /healthz, /readyz, /v1/whoami, /v1/jobs,
//! /v1/jobs/{id}, /v1/jobs/{id}/series, /v1/jobs/{id}/events (SSE),
//! /v1/workers, POST /v1/jobs/{id}/cancel, POST /v1/jobs/{id}/resume,
//! /metrics (Prometheus text) and
//! / (the status page: `coordinator/assets/`, embedded).
//!
//! With a tokens file every request but the probes needs `authorization:
//! Bearer <token>` (401 without, 403 with a token lacking the scope; see
//! [`auth::http_rule`]); the guard decides before any handler runs and
//! leaves the principal in the request's extensions. Every response carries
//! [`SECURITY_HEADERS`]; no CORS headers are ever sent, and a state change
//! (the cancel and resume POSTs) from another site is refused whatever the credentials.

use crate::auth::{self, Principal, Tokens};
use crate::error::CoordError;
use crate::gate::Gate;
use crate::series;
use crate::service::Coordinator;
use accrue_proto::v1::{Job, JobState};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use std::fmt::Write;
use std::sync::Arc;

/// Headers on every response: scripts, styles and frames only from this
/// origin (the page's own assets; nothing inline), no content-type
/// sniffing, not framed, no referrer, not cached.
pub const SECURITY_HEADERS: [(&str, &str); 5] = [
    ("content-security-policy", "default-src 'self'"),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-store"),
];

/// The router; `tokens` None: no authentication (every route open).
pub fn router(g: Arc<Gate>, tokens: Option<Arc<Tokens>>) -> Router {
    ASSETS
        .iter()
        .fold(Router::new(), |r, &(path, content_type, body)| {
            r.route(path, get(move || async move { asset(content_type, body) }))
        })
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }),
        )
        // Browsers ask for it; there is none (204, not a 401 in the console).
        .route("/favicon.ico", get(|| async { StatusCode::NO_CONTENT }))
        .route("/v1/whoami", get(whoami))
        .route("/v1/workers", get(workers))
        .route("/v1/jobs/{id}/series", get(series_of))
        .route("/v1/jobs/{id}/events", get(events))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/v1/jobs", get(list))
        .route("/v1/jobs/{id}", get(one))
        .route("/v1/jobs/{id}/cancel", post(cancel))
        .route("/v1/jobs/{id}/resume", post(resume))
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

pub use crate::state::state_name;

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
            "samples_per_sec": c.samples_per_sec, "bytes_sent": c.bytes_sent, "loss_scale": c.loss_scale,
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
            "redone_steps": r.redone_steps, "loaded": r.loaded,
            "world_size": r.world_size, "accumulation_steps": r.accumulation_steps,
            "recovery_s": (r.first_step_unix_ms > 0).then(|| (r.first_step_unix_ms - r.started_unix_ms) as f64 / 1000.0),
        })).collect::<Vec<_>>(),
    })
}

#[derive(serde::Deserialize)]
struct ListQuery {
    page_size: Option<i64>,
    page_token: Option<String>,
}

/// `GET /v1/jobs[?page_size=N&page_token=T]`: pages as ListJobs does
/// (`{"jobs": [...], "next_page_token": "..."}`, "" on the last page; see
/// [`crate::paging`]), cut by count only (a job's JSON holds no spec paths).
async fn list(State(g): State<Arc<Gate>>, Query(q): Query<ListQuery>) -> Response {
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let req = match crate::paging::request(
        q.page_size.unwrap_or(0),
        q.page_token.as_deref().unwrap_or(""),
    ) {
        Ok(r) => r,
        Err(e) => return CoordError::InvalidArgument(e.to_string()).into_response(),
    };
    let (jobs, next) = c.with_cluster(|cl| {
        let (page, next) = cl.jobs_page(&req, |_| 0, usize::MAX);
        let jobs = page
            .into_iter()
            .map(|j| job_view(j, cl.series(&j.id)))
            .collect::<Vec<_>>();
        (jobs, next)
    });
    Json(json!({ "jobs": jobs, "next_page_token": next })).into_response()
}

async fn one(State(g): State<Arc<Gate>>, Path(id): Path<String>) -> Response {
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    match c.with_cluster(|cl| cl.job(&id).map(|j| job_view(j, cl.series(&id)))) {
        Some(v) => Json(v).into_response(),
        None => CoordError::JobNotFound(id).into_response(),
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

/// `POST /v1/jobs/{id}/resume`: as the cancel POST (the `submit` scope,
/// then ownership or `admin`); answers once the change is durable.
async fn resume(
    State(g): State<Arc<Gate>>,
    Path(id): Path<String>,
    p: Option<Extension<Principal>>,
) -> Response {
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    match c
        .resume_as(&id, auth::caller(p.as_ref().map(|e| &e.0)))
        .await
    {
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

/// The page shell and its assets (`coordinator/assets/`, embedded in the
/// binary): open to all, they hold no data; the page asks for a token and
/// reads everything through the `/v1` API with it.
const INDEX_HTML: &str = include_str!("../assets/index.html");
const JS: &str = "text/javascript; charset=utf-8";
/// (path, content type, body): app.js, the modules it imports, the style.
const ASSETS: [(&str, &str, &str); 7] = [
    ("/assets/app.js", JS, include_str!("../assets/app.js")),
    ("/assets/util.js", JS, include_str!("../assets/util.js")),
    ("/assets/api.js", JS, include_str!("../assets/api.js")),
    ("/assets/series.js", JS, include_str!("../assets/series.js")),
    ("/assets/charts.js", JS, include_str!("../assets/charts.js")),
    ("/assets/job.js", JS, include_str!("../assets/job.js")),
    (
        "/assets/app.css",
        "text/css; charset=utf-8",
        include_str!("../assets/app.css"),
    ),
];

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

/// `GET /v1/whoami`: who the token is and what it may do (the page shows
/// the cancel and resume buttons from it).
async fn whoami(p: Option<Extension<Principal>>) -> Response {
    let v = match p {
        Some(Extension(p)) => json!({
            "auth": true,
            "principal": p.name,
            "scopes": p.scopes.iter().map(|s| s.name()).collect::<Vec<_>>(),
        }),
        None => json!({
            "auth": false,
            "principal": null,
            "scopes": auth::Scope::ALL.iter().map(|s| s.name()).collect::<Vec<_>>(),
        }),
    };
    Json(v).into_response()
}

/// A job as the API shows it: [`job_json`], its ETA and its clipping.
pub fn job_view(j: &Job, series: Option<&accrue_proto::v1::JobSeries>) -> Value {
    let mut v = job_json(j);
    let total = j.counters.map_or(0, |c| c.total_steps);
    let live = !crate::state::is_final(j.state());
    v["eta_s"] = json!(series
        .filter(|_| live && total > 0)
        .and_then(|s| series::series_eta_s(s, total)));
    let clip = j.spec.as_ref().and_then(|s| s.clipping.as_ref()).map(
        |c| json!({"max_norm": c.max_norm, "norm_type": c.norm_type, "clip_value": c.clip_value}),
    );
    v["clip"] =
        clip.unwrap_or_else(|| json!({"max_norm": null, "norm_type": null, "clip_value": null}));
    // fp32 | bf16 | fp16 (issue 18).
    let precision = j.spec.as_ref().map_or(0, |s| s.precision);
    v["precision"] = json!(match accrue_proto::v1::Precision::try_from(precision) {
        Ok(accrue_proto::v1::Precision::Bf16) => "bf16",
        Ok(accrue_proto::v1::Precision::Fp16) => "fp16",
        _ => "fp32",
    });
    v
}

#[derive(serde::Deserialize)]
struct SeriesQuery {
    from_step: Option<u64>,
    max_points: Option<usize>,
}

/// `GET /v1/jobs/{id}/series`: see [`series::query_json`]; the job's
/// recoveries come along (the chart markers).
async fn series_of(
    State(g): State<Arc<Gate>>,
    Path(id): Path<String>,
    Query(q): Query<SeriesQuery>,
) -> Response {
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let max_points = q.max_points.unwrap_or(series::DEFAULT_POINTS);
    if let Some(why) = series::check_points(max_points) {
        return CoordError::InvalidArgument(why).into_response();
    }
    let v = c.with_cluster(|cl| {
        let (Some(job), Some(s)) = (cl.job(&id), cl.series(&id)) else {
            return None;
        };
        let mut v = series::query_json(s, q.from_step.unwrap_or(0), max_points);
        v["recoveries"] = job_json(job)["recoveries"].take();
        Some(v)
    });
    match v {
        Some(v) => Json(v).into_response(),
        None => CoordError::JobNotFound(id).into_response(),
    }
}

/// `GET /v1/workers`: every attached worker, what it runs and how lately
/// it was heard from.
async fn workers(State(g): State<Arc<Gate>>) -> Response {
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let now = crate::service::now_ms();
    let list = c.with_cluster(|cl| {
        cl.workers()
            .map(|(id, w)| {
                let job = w.job.as_ref().map(|(j, _)| j.as_str());
                json!({
                    "id": id,
                    "device": w.device,
                    "data_addr": w.data_addr,
                    "job": job,
                    "rank": w.job.as_ref().map(|(_, r)| r),
                    "generation": job.and_then(|j| cl.job(j)).map(|j| j.generation),
                    "last_seen_age_s": (now - w.last_seen_ms).max(0) as f64 / 1000.0,
                    "step": w.step.map(|(s, _)| s),
                    "samples_per_sec": w.step.map(|(_, r)| r),
                })
            })
            .collect::<Vec<_>>()
    });
    Json(json!({ "workers": list })).into_response()
}

/// How often the event stream of a job sends an update, at most.
const UPDATE_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// `GET /v1/jobs/{id}/events`: Server-Sent Events, `event: update` with
/// `{"job": <job>, "points": <the new steps as one-step buckets, columns
/// like the series'> | null, "resync": bool}`, at most every 250 ms while
/// something happens; `resync` says updates were lost (refetch the
/// series). It ends once the job has ended.
/// The server's stop signal (see `lib.rs`): open event streams end on it,
/// so an open status page never holds a shutdown up.
#[derive(Clone)]
pub struct Stopping(pub tokio::sync::broadcast::Sender<()>);

async fn events(
    State(g): State<Arc<Gate>>,
    Path(id): Path<String>,
    stopping: Option<Extension<Stopping>>,
) -> Response {
    use axum::response::sse::{Event, KeepAlive, Sse};
    use tokio::sync::broadcast::error::RecvError;
    let c = match leader(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let mut rx = c.subscribe();
    let first = c.with_cluster(|cl| cl.job(&id).map(|j| job_view(j, cl.series(&id))));
    let Some(first) = first else {
        return CoordError::JobNotFound(id).into_response();
    };
    let (tx, out) = tokio::sync::mpsc::channel::<Result<Event, std::convert::Infallible>>(8);
    let update = |job: &Value, points: &[accrue_proto::v1::SeriesBucket], resync: bool| {
        let points = (!points.is_empty())
            .then(|| series::columns_json(&series::downsample(points, series::DEFAULT_POINTS)));
        Ok(Event::default()
            .event("update")
            .data(json!({"job": job, "points": points, "resync": resync}).to_string()))
    };
    let mut stop = stopping.map(|Extension(Stopping(tx))| tx.subscribe());
    // Not the coordinator itself: a stream must not keep a stepped-down
    // one (and its every series) alive.
    let c = Arc::downgrade(&c);
    tokio::spawn(async move {
        let ended = |v: &Value| {
            matches!(
                v["state"].as_str(),
                Some("succeeded" | "failed" | "cancelled")
            )
        };
        if tx.send(update(&first, &[], false)).await.is_err() || ended(&first) {
            return;
        }
        let (mut job, mut points, mut resync, mut dirty) = (first, Vec::new(), false, false);
        let mut tick = tokio::time::interval(UPDATE_EVERY);
        loop {
            tokio::select! {
                r = rx.recv() => match r {
                    Ok(ev) => {
                        let Some(j) = ev.job.as_ref().filter(|j| j.id == id) else { continue };
                        if let Some(accrue_proto::v1::job_event::Event::Step(r)) = &ev.event {
                            points.push(series::bucket_of(r, crate::service::now_ms()));
                        }
                        let Some(c) = c.upgrade().filter(|c| !c.is_closed()) else {
                            return;
                        };
                        job = c.with_cluster(|cl| job_view(j, cl.series(&id)));
                        dirty = true;
                    }
                    Err(RecvError::Lagged(_)) => {
                        points.clear();
                        (resync, dirty) = (true, true);
                    }
                    Err(RecvError::Closed) => return,
                },
                _ = async {
                    match stop.as_mut() {
                        Some(s) => {
                            let _ = s.recv().await;
                        }
                        None => std::future::pending().await,
                    }
                } => return,
                _ = tx.closed() => return,
                _ = tick.tick(), if dirty => {
                    if tx.send(update(&job, &points, resync)).await.is_err() || ended(&job) {
                        return;
                    }
                    points.clear();
                    (resync, dirty) = (false, false);
                }
            }
        }
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out))
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

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
