//! The communication thread and the algorithms it runs on the ring:
//! all-reduce, reduce-scatter, all-gather, broadcast (f32 and bytes).

use super::threads::{frames, lost, send_abort, SendJob};
use super::{CommError, Counters, Reply, Request, Returned, RingConfig, MAX_BROADCAST_BYTES};
use crate::comm::chunks::{self, chunk_range};
use crate::comm::shard;
use crate::comm::wire::{self, Kind, HEADER_LEN};
use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// The communication thread's state.
pub(super) struct Comm {
    pub(super) cfg: Arc<RingConfig>,
    pub(super) prev: TcpStream,
    pub(super) next: TcpStream,
    pub(super) send: mpsc::Sender<SendJob>,
    pub(super) done: mpsc::Receiver<io::Result<()>>,
    pub(super) send_seq: u64,
    pub(super) recv_seq: u64,
    pub(super) abort: Arc<Mutex<Option<CommError>>>,
    pub(super) counters: Arc<Counters>,
    pub(super) scratch: Vec<f32>,
    /// wire::job_tag of the job, computed once.
    pub(super) tag: u64,
    pub(super) failed: Option<CommError>,
}

#[derive(Clone, Copy, PartialEq)]
pub(super) enum Apply {
    Add,
    Copy,
}

impl Comm {
    pub(super) fn serve(&mut self, req: Request) -> Reply {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if let Some(e) = self.abort.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            self.failed = Some(e.clone());
            return Err(e);
        }
        let floats = |floats| Returned {
            floats,
            ..Default::default()
        };
        let result = match req {
            Request::AllReduce(mut buf) => self.all_reduce(&mut buf).map(|_| floats(buf)),
            Request::AllReduceLent(lent) => {
                // SAFETY: see `Lent`: the memory is valid and ours until we reply.
                let buf = unsafe { std::slice::from_raw_parts_mut(lent.ptr, lent.len) };
                self.all_reduce(buf).map(|_| Returned::default())
            }
            Request::ReduceScatterLent(lent) => {
                // SAFETY: see `Lent`: the memory is valid and ours until we reply.
                let buf = unsafe { std::slice::from_raw_parts_mut(lent.ptr, lent.len) };
                self.reduce_scatter(buf).map(|_| Returned::default())
            }
            Request::AllGatherLent(lent) => {
                // SAFETY: as above.
                let buf = unsafe { std::slice::from_raw_parts_mut(lent.ptr, lent.len) };
                self.all_gather(buf).map(|_| Returned::default())
            }
            Request::Broadcast(mut buf, root) => {
                self.broadcast(&mut buf, root).map(|_| floats(buf))
            }
            Request::BroadcastBytes(mut bytes, root) => {
                self.broadcast_bytes(&mut bytes, root).map(|_| Returned {
                    bytes,
                    ..Default::default()
                })
            }
        };
        if let Err(e) = &result {
            // Prefer the cause the return path recorded (it names the lost rank).
            let recorded = self.abort.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let e = match recorded {
                Some(r) if !matches!(e, CommError::Aborted { .. }) => r,
                _ => e.clone(),
            };
            tracing::warn!(rank = self.cfg.rank, error = %e, "collective failed");
            send_abort(&mut self.next, &self.cfg, &e);
            send_abort(&mut self.prev, &self.cfg, &e);
            self.failed = Some(e.clone());
            return Err(e);
        }
        result
    }

    fn piece(&self) -> usize {
        (self.cfg.max_frame_bytes / 4).max(1)
    }

    fn all_reduce(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let sched = |r, w, s| (chunks::rs_send(r, w, s), chunks::rs_recv(r, w, s));
        self.phase(buf, sched, Apply::Add, "all-reduce (reduce-scatter)")?;
        let sched = |r, w, s| (chunks::ag_send(r, w, s), chunks::ag_recv(r, w, s));
        self.phase(buf, sched, Apply::Copy, "all-reduce (all-gather)")
    }

    /// The reduce-scatter half of [`Self::all_reduce`] on the relabelled
    /// schedule of [`crate::comm::shard`]: rank r ends owning chunk r.
    fn reduce_scatter(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let sched = |r, w, s| (shard::rs_send(r, w, s), shard::rs_recv(r, w, s));
        self.phase(buf, sched, Apply::Add, "reduce-scatter")
    }

    /// The all-gather half, from every rank owning chunk r.
    fn all_gather(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let sched = |r, w, s| (shard::ag_send(r, w, s), shard::ag_recv(r, w, s));
        self.phase(buf, sched, Apply::Copy, "all-gather")
    }

    /// W - 1 ring steps over `buf`: at step s this rank sends chunk
    /// `sched(rank, world, s).0` and receives (adds or copies into) chunk
    /// `.1`.
    fn phase(
        &mut self,
        buf: &mut [f32],
        sched: impl Fn(usize, usize, usize) -> (usize, usize),
        apply: Apply,
        during: &str,
    ) -> Result<(), CommError> {
        let (w, r, len) = (self.cfg.world, self.cfg.rank, buf.len());
        let base = buf.as_mut_ptr();
        for s in 0..w - 1 {
            let (send, recv) = sched(r, w, s);
            let (send, recv) = (chunk_range(len, w, send), chunk_range(len, w, recv));
            self.exchange(base, send, recv, apply, during)?;
        }
        Ok(())
    }

    /// Sends `send` to the next rank while receiving `recv` from the previous
    /// one. The two ranges are distinct chunks of the same buffer.
    fn exchange(
        &mut self,
        base: *mut f32,
        send: std::ops::Range<usize>,
        recv: std::ops::Range<usize>,
        apply: Apply,
        during: &str,
    ) -> Result<(), CommError> {
        debug_assert!(
            send.end <= recv.start || recv.end <= send.start || send.is_empty() || recv.is_empty()
        );
        self.post_send(base, send)?;
        // SAFETY: `recv` lies inside the buffer and does not overlap `send`,
        // the only region another thread reads meanwhile.
        let target = unsafe { std::slice::from_raw_parts_mut(base.add(recv.start), recv.len()) };
        let received = self.receive(target, apply, during);
        // Always collect the sender's reply before returning: the buffer must
        // not be touched while it is still being read.
        let sent = self
            .done
            .recv()
            .map_err(|_| CommError::Setup("the sender thread has stopped".into()))?
            .map_err(|e| lost(&self.cfg, self.cfg.next(), during, &e));
        received?;
        sent
    }

    /// Hands `range` of the f32 buffer at `base` to the sender thread, in
    /// frames of `piece()` elements. The caller must not write that range
    /// until it has collected the sender's reply.
    fn post_send(
        &mut self,
        base: *mut f32,
        range: std::ops::Range<usize>,
    ) -> Result<(), CommError> {
        // SAFETY: callers pass a range inside the buffer `base` points to.
        let start = unsafe { base.add(range.start) } as *const u8;
        self.post_send_bytes(start, range.len() * 4, self.piece() * 4)
    }

    /// Hands `len` bytes at `ptr` to the sender thread, in frames of
    /// `piece` bytes (one empty frame for `len` 0). The caller must not
    /// write them until it has collected the sender's reply.
    fn post_send_bytes(
        &mut self,
        ptr: *const u8,
        len: usize,
        piece: usize,
    ) -> Result<(), CommError> {
        let job = SendJob {
            ptr,
            len,
            first_seq: self.send_seq,
            piece,
            job_tag: self.tag,
            generation: self.cfg.generation,
        };
        self.send_seq += frames(len, piece) as u64;
        self.send
            .send(job)
            .map_err(|_| CommError::Setup("the sender thread has stopped".into()))
    }

    /// Receives the frames the previous rank sends for `target`.
    fn receive(&mut self, target: &mut [f32], apply: Apply, during: &str) -> Result<(), CommError> {
        let prev = self.cfg.prev();
        let piece = self.piece();
        let total = target.len();
        let n = frames(total, piece);
        for f in 0..n {
            let part = &mut target[(f * piece).min(total)..((f + 1) * piece).min(total)];
            let want_bytes = part.len() * 4;
            self.next_frame(want_bytes, during)?;
            match apply {
                Apply::Copy => {
                    let bytes: &mut [u8] = bytemuck::cast_slice_mut(part);
                    self.prev
                        .read_exact(bytes)
                        .map_err(|e| lost(&self.cfg, prev, during, &e))?;
                }
                Apply::Add => {
                    self.scratch.resize(part.len(), 0.0);
                    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch[..]);
                    self.prev
                        .read_exact(bytes)
                        .map_err(|e| lost(&self.cfg, prev, during, &e))?;
                    for (dst, src) in part.iter_mut().zip(&self.scratch) {
                        *dst += *src;
                    }
                }
            }
            self.counters
                .received
                .fetch_add((HEADER_LEN + want_bytes) as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Receives the frames (of `piece` bytes) the previous rank sends for
    /// `target`, copying them in.
    fn receive_bytes(
        &mut self,
        target: &mut [u8],
        piece: usize,
        during: &str,
    ) -> Result<(), CommError> {
        let prev = self.cfg.prev();
        let total = target.len();
        for f in 0..frames(total, piece) {
            let part = &mut target[(f * piece).min(total)..((f + 1) * piece).min(total)];
            self.next_frame(part.len(), during)?;
            self.prev
                .read_exact(part)
                .map_err(|e| lost(&self.cfg, prev, during, &e))?;
            self.counters
                .received
                .fetch_add((HEADER_LEN + part.len()) as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Reads the next frame header from the previous rank and checks that
    /// it is the data frame of this job, generation and sequence number,
    /// of `want_bytes`; an Abort or Goodbye there is the matching error.
    fn next_frame(&mut self, want_bytes: usize, during: &str) -> Result<(), CommError> {
        let prev = self.cfg.prev();
        // An oversized header is refused here, before any payload byte.
        let h = wire::read_frame_header(&mut self.prev, self.cfg.max_frame_bytes as u64).map_err(
            |e| match e {
                wire::FrameError::Io(e) => lost(&self.cfg, prev, during, &e),
                e => self.protocol(e.to_string()),
            },
        )?;
        match h.kind {
            Kind::Abort => {
                let (lost_rank, reason) = wire::read_abort(&mut self.prev, h.len)
                    .map_err(|e| lost(&self.cfg, prev, during, &e))?;
                return Err(CommError::Aborted {
                    lost: lost_rank,
                    reporter: prev,
                    reason,
                });
            }
            Kind::Goodbye => {
                return Err(CommError::PeerLost {
                    rank: prev,
                    addr: self.cfg.addr(prev),
                    during: during.into(),
                    reason: "the peer closed its ring".into(),
                })
            }
            Kind::Data => {}
        }
        if h.job_tag != self.tag || h.generation != self.cfg.generation {
            return Err(self.protocol(format!(
                "frame for another job or generation (generation {}, expected {})",
                h.generation, self.cfg.generation
            )));
        }
        if h.seq != self.recv_seq {
            return Err(self.protocol(format!(
                "frame sequence {} , expected {}",
                h.seq, self.recv_seq
            )));
        }
        if h.len as usize != want_bytes || h.len as usize > self.cfg.max_frame_bytes {
            return Err(self.protocol(format!(
                "frame of {} bytes, expected {want_bytes} (limit {})",
                h.len, self.cfg.max_frame_bytes
            )));
        }
        self.recv_seq += 1;
        Ok(())
    }

    fn protocol(&self, reason: String) -> CommError {
        let prev = self.cfg.prev();
        CommError::Protocol {
            rank: prev,
            addr: self.cfg.addr(prev),
            reason,
        }
    }

    /// Broadcast of f32s: the bytes of the buffer, in frames of `piece()`
    /// elements.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        self.broadcast_raw(bytes, self.piece() * 4, root, "broadcast")
    }

    /// The length (u64, little endian), then the bytes; receivers resize
    /// `buf` to the length.
    fn broadcast_bytes(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        let piece = self.cfg.max_frame_bytes.max(1);
        let mut len = (buf.len() as u64).to_le_bytes();
        self.broadcast_raw(&mut len, piece, root, "broadcast (length)")?;
        if self.cfg.rank != root {
            let n = u64::from_le_bytes(len);
            let n = usize::try_from(n)
                .ok()
                .filter(|_| n <= MAX_BROADCAST_BYTES)
                .ok_or_else(|| {
                    self.protocol(format!(
                        "byte broadcast of {n} bytes exceeds the limit of {MAX_BROADCAST_BYTES}"
                    ))
                })?;
            buf.clear();
            buf.resize(n, 0);
        }
        self.broadcast_raw(buf, piece, root, "broadcast (bytes)")
    }

    /// Pipelined ring broadcast of `buf` in frames of `piece` bytes: the
    /// root sends frame by frame; every other rank receives each frame and
    /// forwards it unless its next is the root.
    fn broadcast_raw(
        &mut self,
        buf: &mut [u8],
        piece: usize,
        root: usize,
        during: &str,
    ) -> Result<(), CommError> {
        let (w, r) = (self.cfg.world, self.cfg.rank);
        let len = buf.len();
        let base = buf.as_mut_ptr();
        let forwards = (r + 1) % w != root;
        let mut pending = 0;
        let mut result = Ok(());
        for p in chunks::pieces(0..len.max(1), piece) {
            let p = p.start.min(len)..p.end.min(len);
            // SAFETY (both blocks): `p` lies inside `buf`; piece `p` is not
            // being sent while it is received (only earlier pieces are).
            if r != root {
                let target = unsafe { std::slice::from_raw_parts_mut(base.add(p.start), p.len()) };
                if let Err(e) = self.receive_bytes(target, piece, during) {
                    result = Err(e);
                    break;
                }
            }
            if r == root || forwards {
                // Piece `p` is complete here and not written again in this call.
                let start = unsafe { base.add(p.start) } as *const u8;
                if let Err(e) = self.post_send_bytes(start, p.len(), piece) {
                    result = Err(e);
                    break;
                }
                pending += 1;
            }
        }
        for _ in 0..pending {
            let sent = self
                .done
                .recv()
                .map_err(|_| CommError::Setup("the sender thread has stopped".into()))?;
            if let (Ok(()), Err(e)) = (&result, sent) {
                result = Err(lost(&self.cfg, self.cfg.next(), during, &e));
            }
        }
        result
    }
}
