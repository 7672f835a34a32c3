//! Who may ask what: authentication and authorization of every request,
//! the cross-site refusal of state changes, and the security headers on
//! every answer.

use crate::auth::{self, Principal, Tokens};
use crate::error::CoordError;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
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
pub(super) async fn guard(
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
