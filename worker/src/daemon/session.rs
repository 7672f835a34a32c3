//! The link to the coordinator: connect, attach (the hello first), detach,
//! and the one pause between attempts ([`Backoff`]: doubling, capped, cut
//! short by shutdown).

use super::health::Link;
use super::{wrap, Current, DaemonConfig};
use accrue_proto::v1::{
    self, worker_message, worker_service_client::WorkerServiceClient, CoordinatorMessage,
    WorkerMessage,
};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::transport::Channel;

/// How long one connection attempt to the coordinator (TCP, TLS, HTTP/2)
/// may take before it counts as failed and is retried.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the coordinator may take to answer an Attach before the
/// attempt is retried.
pub const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);

/// The first pause between attempts (and the pause after a stream that
/// was attached ends).
pub(super) const BACKOFF_FIRST: Duration = Duration::from_millis(50);
/// The longest pause between attempts.
pub(super) const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// The pause after one of `prev`: twice as long, at most [`BACKOFF_MAX`].
pub(super) fn next_delay(prev: Duration) -> Duration {
    (prev * 2).min(BACKOFF_MAX)
}

/// The pause before the next attempt to reach the coordinator.
#[derive(Debug)]
pub(super) struct Backoff {
    delay: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            delay: BACKOFF_FIRST,
        }
    }
}

impl Backoff {
    /// Attached: the next pause is the first one again.
    pub(super) fn reset(&mut self) {
        self.delay = BACKOFF_FIRST;
    }

    /// The pause the next [`Backoff::pause`] waits.
    #[cfg(test)]
    pub(super) fn delay(&self) -> Duration {
        self.delay
    }

    /// Waits the current delay, or until `shutdown` completes (then false:
    /// the daemon stops); the next pause is [`next_delay`] of this one.
    pub(super) async fn pause<F: Future<Output = ()>>(&mut self, shutdown: Pin<&mut F>) -> bool {
        let delay = self.delay;
        self.delay = next_delay(delay);
        tokio::select! {
            _ = tokio::time::sleep(delay) => true,
            _ = shutdown => false,
        }
    }
}

/// A client of the coordinator at `url`; on failure, what the health
/// endpoint should say (the reason is logged).
pub(super) async fn connect(
    url: &str,
    tls: Option<&accrue_proto::tls::ClientTls>,
) -> Result<WorkerServiceClient<Channel>, Link> {
    let endpoint = accrue_proto::tls::endpoint(url, tls).map_err(|e| {
        // Unreadable certificate files may be being rotated: retry.
        tracing::warn!(coordinator = %url, error = %e, "cannot set up the connection; retrying");
        Link::Connecting {
            coordinator: url.to_string(),
            error: e.to_string(),
        }
    })?;
    let connected = match tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect()).await {
        Ok(r) => r.map_err(|e| accrue_proto::error_chain(&e)),
        Err(_) => Err(format!("no connection within {CONNECT_TIMEOUT:?}")),
    };
    match connected {
        Ok(channel) => Ok(WorkerServiceClient::new(channel)
            .max_decoding_message_size(accrue_proto::layout::MAX_RESPONSE_BYTES)),
        Err(e) => {
            tracing::warn!(coordinator = %url, error = %e, "cannot reach the coordinator; retrying");
            Err(Link::Connecting {
                coordinator: url.to_string(),
                error: e,
            })
        }
    }
}

/// This worker's hello: after a re-attach it names the job, generation
/// and rank it is in.
pub(super) fn hello(cfg: &DaemonConfig, data_addr: &str, current: &Current) -> v1::WorkerHello {
    let hello = v1::WorkerHello {
        worker_id: cfg.worker_id.clone(),
        data_addr: data_addr.to_string(),
        device: cfg.device.clone().unwrap_or_else(|| "auto".into()),
        capacity: 1,
        version: env!("CARGO_PKG_VERSION").into(),
        ..Default::default()
    };
    match current.lock().unwrap_or_else(|p| p.into_inner()).clone() {
        Some((job_id, generation, rank)) => v1::WorkerHello {
            job_id,
            generation,
            rank,
            ..hello
        },
        None => hello,
    }
}

/// An attach stream: what goes up (the hello already queued first) and
/// what comes down.
pub(super) struct Attached {
    pub tx: mpsc::UnboundedSender<WorkerMessage>,
    pub inbound: tonic::Streaming<CoordinatorMessage>,
}

/// Opens the attach stream with `hello` first; on failure, what the
/// health endpoint should say (the reason is logged).
pub(super) async fn attach(
    mut client: WorkerServiceClient<Channel>,
    url: &str,
    hello: v1::WorkerHello,
) -> Result<Attached, Link> {
    let (tx, rx) = mpsc::unbounded_channel::<WorkerMessage>();
    let _ = tx.send(wrap(worker_message::Msg::Hello(hello)));
    let attached = tokio::time::timeout(
        ATTACH_TIMEOUT,
        client.attach(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)),
    )
    .await;
    match attached {
        Ok(Ok(r)) => Ok(Attached {
            tx,
            inbound: r.into_inner(),
        }),
        Ok(Err(e)) => {
            tracing::warn!(error = %accrue_proto::status_chain(&e), "attach refused; retrying");
            Err(Link::Refused {
                coordinator: url.to_string(),
                reason: accrue_proto::status_chain(&e),
            })
        }
        Err(_) => {
            tracing::warn!(coordinator = %url, "no answer to the attach within {ATTACH_TIMEOUT:?}; retrying");
            Err(Link::Connecting {
                coordinator: url.to_string(),
                error: format!("no answer to the attach within {ATTACH_TIMEOUT:?}"),
            })
        }
    }
}

/// Tells the coordinator this worker leaves (a planned exit, not a lost
/// worker) and waits briefly for it to close the stream.
pub(super) async fn detach(attached: Attached) {
    let Attached { tx, mut inbound } = attached;
    let _ = tx.send(wrap(worker_message::Msg::Detach(v1::Detach {
        reason: "the daemon was told to stop".into(),
    })));
    drop(tx);
    // The coordinator closes the stream once it has let the worker go.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while let Ok(Some(_)) = inbound.message().await {}
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn the_delay_doubles_up_to_the_cap() {
        let mut d = BACKOFF_FIRST;
        let mut seen = vec![d];
        for _ in 0..8 {
            d = next_delay(d);
            seen.push(d);
        }
        let ms: Vec<u128> = seen.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [50, 100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        assert_eq!(next_delay(Duration::from_secs(60)), BACKOFF_MAX);
    }

    #[tokio::test]
    async fn every_pause_doubles_the_next_and_reset_starts_over() {
        let mut b = Backoff::default();
        let mut never = std::pin::pin!(std::future::pending::<()>());
        for want in [50, 100, 200] {
            assert_eq!(b.delay(), Duration::from_millis(want));
            let t = Instant::now();
            assert!(b.pause(never.as_mut()).await, "no shutdown: it waited");
            assert!(t.elapsed() >= Duration::from_millis(want));
        }
        assert_eq!(b.delay(), Duration::from_millis(400));
        b.reset();
        assert_eq!(b.delay(), BACKOFF_FIRST);
    }

    #[tokio::test]
    async fn shutdown_cuts_a_pause_short() {
        let mut b = Backoff {
            delay: Duration::from_secs(3600),
        };
        let t = Instant::now();
        let mut now = std::pin::pin!(std::future::ready(()));
        assert!(!b.pause(now.as_mut()).await, "shutdown wins");
        assert!(t.elapsed() < Duration::from_secs(5));
        // A shutdown that comes during the pause ends it too.
        let mut b = Backoff {
            delay: Duration::from_secs(3600),
        };
        let mut soon = std::pin::pin!(tokio::time::sleep(Duration::from_millis(20)));
        let t = Instant::now();
        assert!(!b.pause(soon.as_mut()).await);
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}
