//! WatchJob's stream: a job's events as a reader sees them.

use super::Coordinator;
use crate::error::CoordError;
use accrue_proto::v1::{self, JobEvent};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::Stream;
use tonic::Status;

impl Coordinator {
    /// Events of one job: a snapshot first, then every change, ending after
    /// a final state.
    pub fn watch(
        &self,
        id: &str,
    ) -> Result<impl Stream<Item = Result<JobEvent, Status>> + Send + 'static, CoordError> {
        let mut rx = self.events.subscribe();
        let snapshot = self.job(id)?;
        let id = id.to_string();
        let done = crate::state::is_final(snapshot.state());
        Ok(async_stream(move |tx| async move {
            let _ = tx
                .send(Ok(JobEvent {
                    job: Some(snapshot),
                    event: None,
                }))
                .await;
            if done {
                return;
            }
            loop {
                match rx.recv().await {
                    Ok(mut ev) => {
                        let Some(job) = ev.job.as_mut() else { continue };
                        if job.id != id {
                            continue;
                        }
                        crate::domain::add_reader_fields(job);
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
                        let _ = tx
                            .send(Err(Status::data_loss(format!(
                                "watcher fell {n} events behind"
                            ))))
                            .await;
                        return;
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
