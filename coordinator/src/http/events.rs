//! `/v1/jobs/{id}/events`: a job's updates as Server-Sent Events.

use super::coordinator;
use super::views::job_view;
use crate::error::CoordError;
use crate::gate::Gate;
use crate::series;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde_json::{json, Value};
use std::sync::Arc;

/// How often the event stream of a job sends an update, at most.
const UPDATE_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// The server's stop signal (see `lib.rs`): open event streams end on it,
/// so an open status page never holds a shutdown up.
#[derive(Clone)]
pub struct Stopping(pub tokio::sync::broadcast::Sender<()>);

/// `GET /v1/jobs/{id}/events`: Server-Sent Events, `event: update` with
/// `{"job": <job>, "points": <the new steps as one-step buckets, columns
/// like the series'> | null, "resync": bool}`, at most every 250 ms while
/// something happens; `resync` says updates were lost (refetch the
/// series). It ends once the job has ended.
pub(super) async fn events(
    State(g): State<Arc<Gate>>,
    Path(id): Path<String>,
    stopping: Option<Extension<Stopping>>,
) -> Response {
    use axum::response::sse::{Event, KeepAlive, Sse};
    use tokio::sync::broadcast::error::RecvError;
    let c = match coordinator(&g) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let mut rx = c.subscribe();
    let first = c.with_cluster(|cl| {
        cl.job(&id)
            .map(|j| job_view(j, cl.spec(&id), cl.series(&id)))
    });
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
                        // A step's job is only its numbers
                        // (crate::domain::step_view): the whole job is the
                        // scheduler's.
                        let step = matches!(ev.event, Some(accrue_proto::v1::job_event::Event::Step(_)));
                        let Some(view) = c.with_cluster(|cl| {
                            let whole = if step { cl.job(&id) } else { Some(j) };
                            whole.map(|w| job_view(w, cl.spec(&id), cl.series(&id)))
                        }) else {
                            return;
                        };
                        job = view;
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
