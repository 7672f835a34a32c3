//! `POST /v1/signin`: a one-use sign-in code (`accrue local`'s link,
//! [`crate::auth::signin`]) exchanged for its token. Open to any caller
//! (the code is the credential), but not cross-site (the guard refuses that
//! before any rule).

use crate::auth::Tokens;
use crate::error::CoordError;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Arc;

/// `{"code": "<64 hex digits>"}` in, `{"token", "principal", "scopes"}`
/// out; 401 for a code unknown, used or expired, 400 for a body that is no
/// such object, 404 when authentication is off (no code is ever issued).
pub(super) async fn signin(tokens: Option<Arc<Tokens>>, body: Bytes) -> Response {
    let code = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("code")?.as_str().map(str::to_owned));
    let Some(code) = code else {
        return CoordError::InvalidArgument(
            "expected a JSON body {\"code\": \"<the code after #signin= in the sign-in link>\"}"
                .into(),
        )
        .into_response();
    };
    let Some(tokens) = tokens else {
        let why = "authentication is off: this coordinator needs no sign-in";
        return (StatusCode::NOT_FOUND, Json(json!({ "error": why }))).into_response();
    };
    match tokens.redeem_sign_in(&code) {
        Some((token, p)) => {
            tracing::info!(principal = %p.name, "signed in with a one-use link");
            Json(json!({
                "token": token,
                "principal": p.name,
                "scopes": p.scopes.iter().map(|s| s.name()).collect::<Vec<_>>(),
            }))
            .into_response()
        }
        None => {
            tracing::info!("sign-in code refused");
            CoordError::Unauthenticated(
                "this sign-in link is unknown, used or expired (each link signs in once, within 10 minutes)"
                    .into(),
            )
            .into_response()
        }
    }
}
