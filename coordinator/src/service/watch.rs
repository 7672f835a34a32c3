//! WatchJob's stream: a job's events as a reader sees them.

use super::Coordinator;
use crate::error::CoordError;
use accrue_proto::v1::{self, JobEvent};
use std::sync::Arc;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::Stream;
use tonic::Status;

impl Coordinator {
    /// Events of one job: a snapshot first, then every change, ending after
    /// a final state. A watcher that falls behind (it reads more slowly
    /// than the job makes events, [`super::Config::watch_buffer`] of them)
    /// gets a fresh snapshot, event unset, and goes on from there: the
    /// events it missed are not sent, and nothing a reader does ends its
    /// stream or the job.
    pub fn watch(
        self: &Arc<Self>,
        id: &str,
    ) -> Result<impl Stream<Item = Result<JobEvent, Status>> + Send + 'static, CoordError> {
        let mut rx = self.events.subscribe();
        let snapshot = self.job(id)?;
        let id = id.to_string();
        // Not the coordinator itself: a stream must not keep a
        // stepped-down one alive.
        let c = Arc::downgrade(self);
        Ok(async_stream(move |tx| async move {
            let mut snapshot = Some(snapshot);
            loop {
                if let Some(job) = snapshot.take() {
                    let done = crate::state::is_final(job.state());
                    let first = JobEvent {
                        job: Some(job),
                        event: None,
                    };
                    if tx.send(Ok(first)).await.is_err() || done {
                        return;
                    }
                }
                match rx.recv().await {
                    Ok(mut ev) => {
                        let Some(job) = ev.job.as_mut() else { continue };
                        if job.id != id {
                            continue;
                        }
                        // A step's job already carries the reader's fields
                        // (crate::domain::step_view); it has no spec to
                        // tell a language model by.
                        let step = matches!(ev.event, Some(v1::job_event::Event::Step(_)));
                        if !step {
                            crate::domain::add_reader_fields(job);
                        }
                        let lm = crate::domain::is_lm(job);
                        if let (true, Some(v1::job_event::Event::Eval(e))) = (lm, ev.event.as_mut())
                        {
                            crate::domain::add_lm_eval_fields(e);
                        }
                        let Some(job) = &ev.job else { continue };
                        let last = crate::state::is_final(job.state());
                        if tx.send(Ok(ev)).await.is_err() || last {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        // Subscribed again before the snapshot, as when
                        // the stream opened: nothing after it is missed.
                        let Some(c) = c.upgrade().filter(|c| !c.is_closed()) else {
                            return;
                        };
                        rx = c.events.subscribe();
                        match c.job(&id) {
                            Ok(job) => snapshot = Some(job),
                            Err(e) => {
                                let _ = tx.send(Err(Status::from(e))).await;
                                return;
                            }
                        }
                        tracing::info!(
                            job = %id,
                            missed = n,
                            "a watcher fell {n} events behind; sent it a fresh snapshot"
                        );
                    }
                    Err(_) => return,
                }
            }
        }))
    }
}

/// A stream fed by a spawned task.
fn async_stream<T, F, Fut>(f: F) -> impl Stream<Item = T> + Send + 'static
where
    T: Send + 'static,
    F: FnOnce(mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
