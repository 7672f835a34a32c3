//! The threads beside the communication thread: the sender (writes frames
//! to the next rank while the communication thread receives) and the
//! back-reader (the return path from the next rank: abort, goodbye, EOF).

use super::{CommError, Counters, RingConfig};
use crate::comm::wire::{self, Header, Kind, HEADER_LEN};
use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A region of the buffer for the sender thread. The communication thread
/// waits for the sender's reply before it touches or frees the region.
pub(super) struct SendJob {
    /// `len` bytes, sent in frames of `piece` bytes.
    pub(super) ptr: *const u8,
    pub(super) len: usize,
    pub(super) first_seq: u64,
    pub(super) piece: usize,
    pub(super) job_tag: u64,
    pub(super) generation: u64,
}

// SAFETY: the pointer is only read by the sender thread while the owning
// communication thread blocks on the matching reply (see Comm::exchange).
unsafe impl Send for SendJob {}

pub(super) fn frames(len: usize, piece: usize) -> usize {
    len.div_ceil(piece.max(1)).max(1)
}

pub(super) fn sender_loop(
    mut stream: TcpStream,
    jobs: mpsc::Receiver<SendJob>,
    done: mpsc::Sender<io::Result<()>>,
    counters: Arc<Counters>,
) {
    while let Ok(job) = jobs.recv() {
        // SAFETY: see SendJob; the region stays valid and unmodified until
        // this thread replies on `done`.
        let data: &[u8] = unsafe { std::slice::from_raw_parts(job.ptr, job.len) };
        let mut result = Ok(());
        let n = frames(job.len, job.piece);
        for f in 0..n {
            let bytes = &data[(f * job.piece).min(job.len)..((f + 1) * job.piece).min(job.len)];
            let header = Header {
                kind: Kind::Data,
                job_tag: job.job_tag,
                generation: job.generation,
                seq: job.first_seq + f as u64,
                len: bytes.len() as u64,
            };
            result = stream
                .write_all(&header.encode())
                .and_then(|_| stream.write_all(bytes));
            if result.is_err() {
                break;
            }
            counters
                .sent
                .fetch_add((HEADER_LEN + bytes.len()) as u64, Ordering::Relaxed);
        }
        if done.send(result).is_err() {
            break;
        }
    }
}

/// Watches the outgoing connection for an Abort sent backwards by the next
/// rank, or for the next rank vanishing; records it and wakes the
/// communication thread by shutting its input down.
pub(super) struct BackReader {
    pub(super) cfg: Arc<RingConfig>,
    pub(super) next: TcpStream,
    pub(super) prev: TcpStream,
    pub(super) abort: Arc<Mutex<Option<CommError>>>,
    pub(super) closing: Arc<AtomicBool>,
}

impl BackReader {
    pub(super) fn run(mut self) {
        self.next.set_read_timeout(None).ok();
        let next = self.cfg.next();
        let protocol = |reason| CommError::Protocol {
            rank: next,
            addr: self.cfg.addr(next),
            reason,
        };
        let err = match wire::read_frame_header(&mut self.next, 0) {
            Ok(h) if h.kind == Kind::Abort => match wire::read_abort(&mut self.next, h.len) {
                Ok((lost, reason)) => CommError::Aborted {
                    lost,
                    reporter: next,
                    reason,
                },
                Err(e) => lost(&self.cfg, next, "an abort", &e),
            },
            Ok(h) if h.kind == Kind::Goodbye => return,
            Ok(h) => protocol(format!("unexpected {:?} frame on the return path", h.kind)),
            Err(wire::FrameError::Io(e)) => lost(&self.cfg, next, "the job", &e),
            Err(e) => protocol(e.to_string()),
        };
        if self.closing.load(Ordering::SeqCst) {
            return;
        }
        tracing::warn!(rank = self.cfg.rank, error = %err, "ring broken");
        let mut slot = self.abort.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            // Tell the previous rank (it reads our return path) before waking our reader.
            send_abort(&mut self.prev, &self.cfg, &err);
            *slot = Some(err);
        }
        drop(slot);
        let _ = self.prev.shutdown(Shutdown::Read);
    }
}

pub(super) fn lost(cfg: &RingConfig, rank: usize, during: &str, e: &io::Error) -> CommError {
    let addr = cfg.addr(rank);
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CommError::Timeout {
            rank,
            addr,
            secs: cfg.timeout.as_secs_f64(),
            during: during.into(),
        },
        io::ErrorKind::UnexpectedEof => CommError::PeerLost {
            rank,
            addr,
            during: during.into(),
            reason: "connection closed".into(),
        },
        _ => CommError::PeerLost {
            rank,
            addr,
            during: during.into(),
            reason: e.to_string(),
        },
    }
}

pub(super) fn send_abort(s: &mut TcpStream, cfg: &RingConfig, err: &CommError) {
    let Some(lost) = err.lost_rank() else { return };
    let reason = err.to_string();
    let mut payload = (lost as u32).to_le_bytes().to_vec();
    payload.extend_from_slice(&reason.as_bytes()[..reason.len().min(1000)]);
    let h = Header {
        kind: Kind::Abort,
        job_tag: wire::job_tag(&cfg.job),
        generation: cfg.generation,
        seq: 0,
        len: payload.len() as u64,
    };
    s.set_write_timeout(Some(Duration::from_millis(500))).ok();
    let _ = s.write_all(&h.encode()).and_then(|_| s.write_all(&payload));
}
