//! The status page's shell and assets, embedded in the binary.

use axum::http::header;
use axum::response::{IntoResponse, Response};

/// The page shell and its assets (`coordinator/assets/`, embedded in the
/// binary): open to all, they hold no data; the page asks for a token and
/// reads everything through the `/v1` API with it.
pub(super) const INDEX_HTML: &str = include_str!("../../assets/index.html");
const JS: &str = "text/javascript; charset=utf-8";
/// (path, content type, body): app.js, the modules it imports, the style.
pub(super) const ASSETS: [(&str, &str, &str); 8] = [
    ("/assets/app.js", JS, include_str!("../../assets/app.js")),
    ("/assets/util.js", JS, include_str!("../../assets/util.js")),
    ("/assets/api.js", JS, include_str!("../../assets/api.js")),
    (
        "/assets/series.js",
        JS,
        include_str!("../../assets/series.js"),
    ),
    (
        "/assets/charts.js",
        JS,
        include_str!("../../assets/charts.js"),
    ),
    ("/assets/job.js", JS, include_str!("../../assets/job.js")),
    (
        "/assets/compare.js",
        JS,
        include_str!("../../assets/compare.js"),
    ),
    (
        "/assets/app.css",
        "text/css; charset=utf-8",
        include_str!("../../assets/app.css"),
    ),
];

pub(super) fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}
