//! `/v1/jobs/{id}/series`: a job's charted steps and its recoveries.

use super::coordinator;
use super::views::{add_perplexities, is_lm, job_json, unit};
use crate::error::CoordError;
use crate::gate::Gate;
use crate::series;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Arc;

#[derive(serde::Deserialize)]
pub(super) struct SeriesQuery {
    from_step: Option<u64>,
    max_points: Option<usize>,
}

/// `GET /v1/jobs/{id}/series`: see [`series::query_json`]; the job's
/// recoveries come along (the chart markers), and its `unit` (a language
/// model's: `"tokens"`, each evaluation with its `perplexity`).
pub(super) async fn series_of(
    State(g): State<Arc<Gate>>,
    Path(id): Path<String>,
    Query(q): Query<SeriesQuery>,
) -> Response {
    let c = match coordinator(&g) {
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
        // A language model's evaluations come with their perplexity, and
        // its samples columns count tokens (issue 30).
        v["unit"] = json!(unit(job));
        if is_lm(job) {
            add_perplexities(&mut v["evals"]);
        }
        Some(v)
    });
    match v {
        Some(v) => Json(v).into_response(),
        None => CoordError::JobNotFound(id).into_response(),
    }
}
