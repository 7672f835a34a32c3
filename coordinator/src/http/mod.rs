//! The status endpoint: /healthz, /readyz, /v1/whoami, /v1/jobs,
//! /v1/jobs/{id}, /v1/jobs/{id}/series, /v1/jobs/{id}/events (SSE),
//! /v1/workers, POST /v1/jobs/{id}/cancel, POST /v1/jobs/{id}/resume,
//! POST /v1/signin (a one-use sign-in code for its token), /metrics
//! (Prometheus text) and
//! / (the status page: `coordinator/assets/`, embedded).
//!
//! With a tokens file every request but the probes needs `authorization:
//! Bearer <token>` (401 without, 403 with a token lacking the scope; see
//! [`crate::auth::http_rule`]); the guard decides before any handler runs and
//! leaves the principal in the request's extensions. Every response carries
//! [`SECURITY_HEADERS`]; no CORS headers are ever sent, and a state change
//! (the cancel, resume and sign-in POSTs) from another site is refused whatever the credentials.
//!
//! One file per concern: `guard` (authentication, the cross-site check,
//! the security headers), `views` (jobs, workers and the caller as JSON),
//! `series` (a job's charted steps), `events` (the SSE stream),
//! `metrics` (Prometheus text), `assets` (the embedded page). This
//! module holds the router and how a [`CoordError`] answers over HTTP.

use crate::auth::Tokens;
use crate::error::{CoordError, ErrorCode};
use crate::gate::Gate;
use crate::service::Coordinator;
use axum::extract::State;
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::sync::Arc;

mod assets;
mod events;
mod guard;
mod metrics;
mod series;
mod signin;
#[cfg(test)]
mod tests;
mod views;

pub use events::Stopping;
pub use guard::{cross_site, SECURITY_HEADERS};
pub use metrics::metrics_text;
pub use views::{is_lm, job_json, job_view, perplexity, unit};

use assets::{asset, ASSETS, INDEX_HTML};
use events::events;
use guard::guard;
use metrics::metrics;
use series::series_of;
use views::{cancel, list, one, resume, whoami, workers};

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
        .route(crate::auth::SIGN_IN_PATH, {
            let tokens = tokens.clone();
            post(move |body| signin::signin(tokens, body))
        })
        .route("/metrics", get(metrics))
        .with_state(g)
        .layer(middleware::from_fn_with_state(tokens, guard))
}

/// A [`CoordError`]'s HTTP status (the gRPC code is `grpc`'s).
impl CoordError {
    pub fn http_status(&self) -> StatusCode {
        match self.code() {
            ErrorCode::InvalidArgument => StatusCode::BAD_REQUEST,
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::FailedPrecondition => StatusCode::CONFLICT,
            ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
            ErrorCode::PermissionDenied => StatusCode::FORBIDDEN,
        }
    }
}

/// A failure as JSON, `{"error": ...}` (and `"leader"` from a follower).
impl IntoResponse for CoordError {
    fn into_response(self) -> Response {
        let mut body = serde_json::json!({ "error": self.to_string() });
        if let CoordError::NotLeader { leader } = &self {
            body["leader"] = serde_json::json!(leader.clone().unwrap_or_default());
        }
        (self.http_status(), axum::Json(body)).into_response()
    }
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

/// The coordinator, when this replica leads; otherwise the 503 naming the
/// leader (`leader` always means the leader's address).
#[allow(clippy::result_large_err)]
pub(super) fn coordinator(g: &Gate) -> Result<Arc<Coordinator>, Response> {
    g.get().map_err(IntoResponse::into_response)
}
