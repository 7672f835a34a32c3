//! Forming the ring's links: the acceptor (every incoming connection
//! authenticated, a bounded number of handshakes at once), the connection
//! to the next rank; both handshakes run within one deadline
//! (`admission::Deadline`).

use super::{resolve, spawn, CommError, RingConfig, HANDSHAKE_TIMEOUT};
use crate::comm::admission::Deadline;
use crate::comm::wire::{self, Hello};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Accepts connections for the whole life of the ring: the first one that
/// proves it is the previous rank of this job and generation becomes the
/// ring's input; everything else is refused and logged. Each handshake runs
/// on a thread of its own, at most `max_pending_handshakes` at once (more
/// connections are closed at once) and each within `handshake_timeout`, so
/// idle or slow clients can neither exhaust threads nor hold a place for
/// long.
pub(super) fn spawn_acceptor(
    listener: TcpListener,
    cfg: Arc<RingConfig>,
    prev_tx: mpsc::Sender<TcpStream>,
    closing: Arc<AtomicBool>,
) -> Result<JoinHandle<()>, CommError> {
    spawn("accrue-ring-accept", move || {
        let taken = Arc::new(AtomicBool::new(false));
        // The handshake threads that may still exist: a place frees only
        // once its thread has ended and been joined, so there are never
        // more than `max_pending_handshakes` of them, even for a moment.
        let mut live: Vec<JoinHandle<()>> = Vec::new();
        let mut refused: u64 = 0;
        for conn in listener.incoming() {
            if closing.load(Ordering::SeqCst) {
                break;
            }
            let mut s = match conn {
                Ok(s) => s,
                Err(e) => {
                    // E.g. out of file descriptors: do not spin on it.
                    tracing::warn!(error = %e, "data-plane accept failed");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            live = reap(live);
            if live.len() >= cfg.max_pending_handshakes {
                refused += 1;
                // Logged once per burst size, not once per connection.
                if refused.is_power_of_two() {
                    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    tracing::warn!(%peer, refused, limit = cfg.max_pending_handshakes, "refused data-plane connection: too many handshakes in progress");
                }
                let _ = s.shutdown(Shutdown::Both);
                continue;
            }
            let (cfg, tx, taken) = (cfg.clone(), prev_tx.clone(), taken.clone());
            // If the thread cannot start, the closure (and the socket in
            // it) is dropped: the connection closes.
            let started = std::thread::Builder::new().name("accrue-ring-handshake".into()).spawn(move || {
                let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                let limit = cfg.handshake_timeout.min(cfg.timeout);
                let mut d = Deadline::new(&mut s, limit);
                let r = wire::handshake_accept(&mut d, &cfg.secret, &cfg.job, cfg.generation, cfg.prev() as u32);
                match r {
                    Ok(_) if !taken.swap(true, Ordering::SeqCst) => {
                        let _ = tx.send(s);
                    }
                    Ok(_) => tracing::warn!(%peer, "refused data-plane connection: the ring is already formed"),
                    Err(e) => tracing::warn!(%peer, reason = %e, "refused data-plane connection"),
                }
            });
            if let Ok(h) = started {
                live.push(h);
            }
        }
    })
}

/// The handshake threads still running; those whose handshake ended are
/// joined (their thread is gone once `join` returns).
fn reap(live: Vec<JoinHandle<()>>) -> Vec<JoinHandle<()>> {
    let (done, running): (Vec<_>, Vec<_>) = live.into_iter().partition(|h| h.is_finished());
    for h in done {
        // A handshake thread that panicked is already over: nothing to do.
        let _ = h.join();
    }
    running
}

/// Connects to the next rank and completes the handshake, retrying (a
/// peer may not listen yet, or still be on the previous generation) until
/// `deadline`; every attempt, connect and handshake included, ends by it.
pub(super) fn connect_next(cfg: &RingConfig, deadline: Instant) -> Result<TcpStream, CommError> {
    let next = cfg.next();
    let addr_s = cfg.addr(next);
    let mut backoff = Duration::from_millis(10);
    let mut last_err = String::from("no attempt was made");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let attempt = (|| {
            let addr = resolve(&addr_s).map_err(|e| e.to_string())?;
            let mut s = TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2)))
                .map_err(|e| format!("connecting to rank {next} at {addr_s}: {e}"))?;
            let hello = Hello {
                rank: cfg.rank as u32,
                generation: cfg.generation,
                job: cfg.job.clone(),
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let mut d = Deadline::new(&mut s, left.min(HANDSHAKE_TIMEOUT));
            // Nothing is sent on `s` unless the next rank proved it holds
            // this generation's key.
            wire::handshake_connect(&mut d, &cfg.secret, &hello)
                .map_err(|e| format!("handshake with rank {next} at {addr_s}: {e}"))?;
            Ok::<_, String>(s)
        })();
        match attempt {
            Ok(s) => return Ok(s),
            // A refusal is retried too: while a ring re-forms, the peer may
            // still be on the previous generation for a moment.
            Err(e) => last_err = e,
        }
        std::thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
    Err(CommError::Setup(format!(
        "no connection to rank {next} within {:?}: {last_err}",
        cfg.connect_timeout
    )))
}
