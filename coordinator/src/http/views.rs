//! Jobs, workers and the caller as the API shows them, and the handlers
//! that serve them (`/v1/jobs`, `/v1/jobs/{id}`, its cancel and resume
//! POSTs, `/v1/workers`, `/v1/whoami`).

use super::coordinator;
use crate::auth::{self, Principal};
use crate::domain::Caller;
pub use crate::domain::{is_lm, perplexity, unit};
use crate::domain::{state_name, JobState};
use crate::error::CoordError;
use crate::gate::Gate;
use crate::series;
use crate::service::Coordinator;
use accrue_common::JobSpec;
use accrue_proto::v1::Job;
use axum::extract::FromRequestParts;
use axum::extract::{Path, Query, State};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};
use std::sync::Arc;

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
            "timing": {"compute_s": t.compute_s, "comm_s": t.comm_s, "clip_s": t.clip_s, "optimizer_s": t.optimizer_s, "bubble_s": t.bubble_s, "transfer_s": t.transfer_s},
        },
        "eval": j.eval.as_ref().map(|e| json!({"epoch": e.epoch, "step": e.step, "loss": e.loss, "accuracy": e.accuracy, "samples": e.samples})),
        "checkpoint": j.checkpoint,
        "error": j.error,
        "created_unix_ms": j.created_unix_ms,
        "owner": j.owner,
        "history_dropped": j.history_dropped,
        "recoveries_dropped": j.recoveries_dropped,
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
pub(super) struct ListQuery {
    page_size: Option<i64>,
    page_token: Option<String>,
}

/// `GET /v1/jobs[?page_size=N&page_token=T]`: pages as ListJobs does
/// (`{"jobs": [...], "next_page_token": "..."}`, "" on the last page; see
/// [`crate::paging`]), cut by count only (a job's JSON holds no spec paths).
pub(super) async fn list(State(g): State<Arc<Gate>>, Query(q): Query<ListQuery>) -> Response {
    let c = match coordinator(&g) {
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
        // The list leaves each spec's TOML out (a job's own view has it).
        let jobs = page
            .into_iter()
            .map(|j| {
                let mut v = job_view(j, cl.spec(&j.id), cl.series(&j.id));
                if let Some(o) = v.as_object_mut() {
                    o.remove("spec_toml");
                }
                v
            })
            .collect::<Vec<_>>();
        (jobs, next)
    });
    Json(json!({ "jobs": jobs, "next_page_token": next })).into_response()
}

pub(super) async fn one(State(g): State<Arc<Gate>>, Path(id): Path<String>) -> Response {
    let c = match coordinator(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    match c.with_cluster(|cl| {
        cl.job(&id)
            .map(|j| job_view(j, cl.spec(&id), cl.series(&id)))
    }) {
        Some(v) => Json(v).into_response(),
        None => CoordError::JobNotFound(id).into_response(),
    }
}

/// What a cancel or resume POST acts on: the coordinator (or the 503 naming
/// the leader), the job's id, and who asks (the principal the guard left,
/// as a [`Caller`]).
pub(super) struct Change {
    c: Arc<Coordinator>,
    id: String,
    by: Caller,
}

impl FromRequestParts<Arc<Gate>> for Change {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, g: &Arc<Gate>) -> Result<Self, Response> {
        let Path(id) = Path::<String>::from_request_parts(parts, g)
            .await
            .map_err(IntoResponse::into_response)?;
        let by = auth::caller(parts.extensions.get::<Principal>());
        Ok(Self {
            c: coordinator(g)?,
            id,
            by,
        })
    }
}

/// `POST /v1/jobs/{id}/cancel`: the guard checked the `submit` scope; the
/// scheduler checks ownership (or `admin`).
pub(super) async fn cancel(ch: Change) -> Result<Json<Value>, Response> {
    let j = ch.c.cancel_as(&ch.id, ch.by);
    Ok(Json(job_json(&j.map_err(IntoResponse::into_response)?)))
}

/// `POST /v1/jobs/{id}/resume`: as the cancel POST (the `submit` scope,
/// then ownership or `admin`); answers once the change is durable.
pub(super) async fn resume(ch: Change) -> Result<Json<Value>, Response> {
    let j = ch.c.resume_as(&ch.id, ch.by).await;
    Ok(Json(job_json(&j.map_err(IntoResponse::into_response)?)))
}

/// `GET /v1/whoami`: who the token is and what it may do (the page shows
/// the cancel and resume buttons from it).
pub(super) async fn whoami(p: Option<Extension<Principal>>) -> Response {
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

/// The language-model names of `j`'s numbers added to its JSON `v` (a
/// [`job_json`]): `counters.tokens_per_sec`, `counters.tokens_seen`,
/// `eval.perplexity` and `eval.tokens` (the target tokens it evaluated; its
/// `accuracy` is next-token accuracy). Nothing for other jobs.
fn add_lm_fields(j: &Job, v: &mut Value) {
    if !is_lm(j) {
        return;
    }
    let c = j.counters.unwrap_or_default();
    v["counters"]["tokens_per_sec"] = json!(c.samples_per_sec);
    v["counters"]["tokens_seen"] = json!(c.samples_seen);
    if let Some(e) = &j.eval {
        v["eval"]["perplexity"] = json!(perplexity(e.loss));
        v["eval"]["tokens"] = json!(e.samples);
    }
}

/// Series evaluations (`[{"loss": ..}, ..]`) with their `perplexity`, for
/// a language model's series.
pub(super) fn add_perplexities(evals: &mut Value) {
    for e in evals.as_array_mut().into_iter().flatten() {
        let p = e["loss"].as_f64().and_then(perplexity);
        e["perplexity"] = json!(p);
    }
}

/// A job as the API shows it: [`job_json`], its ETA and its clipping, its
/// spec (`spec_toml` and `hparams` from the domain spec the coordinator
/// holds, see `add_spec`), its
/// `unit` (`"samples"`, or `"tokens"` for a language model, which also has
/// `counters.tokens_per_sec`, `counters.tokens_seen`, `eval.perplexity` and
/// `eval.tokens`).
pub fn job_view(
    j: &Job,
    spec: Option<&JobSpec>,
    series: Option<&accrue_proto::v1::JobSeries>,
) -> Value {
    let mut v = job_json(j);
    v["unit"] = json!(unit(j));
    add_lm_fields(j, &mut v);
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
    add_spec(spec, &mut v);
    v
}

/// `spec_toml`: the job's spec as TOML (as submitted, defaults filled in),
/// and `hparams`: what the status page sums up of it (k and the parallel
/// degrees as the spec resolves them for its `workers`); nulls when the
/// spec cannot be read back.
fn add_spec(spec: Option<&JobSpec>, v: &mut Value) {
    v["spec_toml"] = json!(spec.and_then(|s| toml::to_string(s).ok()));
    v["hparams"] = spec.map_or(Value::Null, |s| {
        let k = s.accumulation_steps(u64::from(s.workers)).ok();
        let dims = s.parallel_dims().ok();
        json!({
            "workers": s.workers,
            "accumulation_steps": k,
            "batch_size": s.data.batch_size,
            // Samples (sequences) per optimizer step: data ranks x b x k.
            "global_batch": k.zip(dims).map(|(k, d)| u64::from(d.data) * s.data.batch_size * k),
            "optimizer": s.optimizer.kind,
            "lr": s.optimizer.lr,
            "weight_decay": s.optimizer.weight_decay,
            "schedule": s.schedule.kind,
            "precision": s.precision,
            "parallel": dims.map(|d| json!({"data": d.data, "pipeline": d.pipeline, "tensor": d.tensor})),
            "sharding_stage": s.sharding.stage,
            "seed": s.seed,
        })
    });
}

/// `GET /v1/workers`: every attached worker, what it runs and how lately
/// it was heard from.
pub(super) async fn workers(State(g): State<Arc<Gate>>) -> Response {
    let c = match coordinator(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let now = crate::service::now_ms();
    let list = c.with_cluster(|cl| {
        cl.workers()
            .map(|(id, w)| {
                let job = w.job.as_ref().map(|(j, _)| j.as_str());
                let lm = job.and_then(|j| cl.job(j)).is_some_and(is_lm);
                // A rank's (data, pipeline, tensor) place, and how long
                // its last step waited on its pipeline neighbours.
                let coords = w.job.as_ref().and_then(|(j, r)| {
                    let c = crate::scheduler::coords_of(cl.job(j)?, *r);
                    Some(json!({"data": c.data, "pipeline": c.pipeline, "tensor": c.tensor}))
                });
                let mut v = json!({
                    "id": id,
                    "device": w.device,
                    "data_addr": w.data_addr,
                    "job": job,
                    "rank": w.job.as_ref().map(|(_, r)| r),
                    "coords": coords,
                    "bubble_s": w.timing.map(|t| t.bubble_s),
                    "peak_rss_bytes": w.job.as_ref().and_then(|(j, r)| cl.peak_of(j, *r)),
                    "transfer_s": w.timing.map(|t| t.transfer_s),
                    "generation": job.and_then(|j| cl.job(j)).map(|j| j.generation),
                    "last_seen_age_s": (now - w.last_seen_ms).max(0) as f64 / 1000.0,
                    "step": w.step.map(|(s, _)| s),
                    "samples_per_sec": w.step.map(|(_, r)| r),
                });
                // A language model's worker counts tokens (issue 30).
                if lm {
                    v["tokens_per_sec"] = json!(w.step.map(|(_, r)| r));
                }
                v
            })
            .collect::<Vec<_>>()
    });
    Json(json!({ "workers": list })).into_response()
}
