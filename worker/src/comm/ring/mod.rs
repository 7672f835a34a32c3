//! The TCP ring: reduce-scatter then all-gather over a ring of ranks
//! (rank r sends to r+1 and receives from r-1), broadcast along the ring, and
//! a barrier. One communication thread per ring owns the buffer during an
//! operation and receives (reducing piece by piece as the bytes arrive) while
//! a sender thread writes, so both directions of every link are busy at once.
//!
//! Failure handling: every read and write has the ring's timeout; a rank that
//! sees a peer vanish (end of stream, reset, timeout) tells its neighbours
//! with an Abort frame naming the lost rank, forwards along the ring and
//! backwards over the same connections, so every rank fails with an error
//! naming the lost peer instead of waiting on a broken ring.
//!
//! Here: the handle ([`TcpRing`]), its config and the
//! [`Collective`] impl. `connect`: the acceptor, the handshakes and their
//! deadline; `threads`: the sender and the back-reader; `algo`: the
//! communication thread's algorithms; `error`: [`CommError`].

mod algo;
mod connect;
mod error;
mod threads;

pub use error::CommError;

use crate::comm::collective::{BucketCopy, Collective, CollectiveError};
use crate::comm::wire::{self, Header, Kind};
use algo::Comm;
use connect::{connect_next, spawn_acceptor};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use threads::{sender_loop, BackReader, SendJob};

/// Everything a rank needs to join a ring.
#[derive(Clone, Debug)]
pub struct RingConfig {
    pub job: String,
    pub generation: u64,
    pub rank: usize,
    pub world: usize,
    /// host:port of every rank, in rank order (this rank listens on its own).
    pub peers: Vec<String>,
    pub secret: Vec<u8>,
    /// A peer silent for this long during an operation is lost.
    pub timeout: Duration,
    /// How long to wait for the ring to form: one deadline for connecting
    /// to the next rank (handshake included) and being joined by the
    /// previous one.
    pub connect_timeout: Duration,
    /// Largest frame payload accepted (and sent), in bytes.
    pub max_frame_bytes: usize,
    /// Incoming data-plane connections that have not completed the
    /// handshake, at most; more are closed at once (and logged).
    pub max_pending_handshakes: usize,
    /// The whole handshake of an incoming connection must end within this
    /// (a slow or silent client is dropped, freeing its place).
    pub handshake_timeout: Duration,
}

/// Default of [`RingConfig::max_pending_handshakes`].
pub const MAX_PENDING_HANDSHAKES: usize = 64;

/// Default of [`RingConfig::handshake_timeout`].
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl RingConfig {
    pub fn new(
        job: impl Into<String>,
        rank: usize,
        world: usize,
        peers: Vec<String>,
        secret: Vec<u8>,
    ) -> Self {
        Self {
            job: job.into(),
            generation: 0,
            rank,
            world,
            peers,
            secret,
            timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(60),
            max_frame_bytes: 1 << 20,
            max_pending_handshakes: MAX_PENDING_HANDSHAKES,
            handshake_timeout: HANDSHAKE_TIMEOUT,
        }
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn addr(&self, rank: usize) -> String {
        self.peers.get(rank).cloned().unwrap_or_default()
    }
}

/// Bytes on the wire, headers included.
#[derive(Debug, Default)]
pub struct Counters {
    pub sent: AtomicU64,
    pub received: AtomicU64,
}

enum Request {
    AllReduce(Vec<f32>),
    /// A caller's buffer, reduced in place (see [`Lent`]).
    AllReduceLent(Lent),
    /// A caller's buffer: slice `rank` summed over all ranks, in place.
    ReduceScatterLent(Lent),
    /// A caller's buffer: every rank's slice copied to every rank.
    AllGatherLent(Lent),
    Broadcast(Vec<f32>, usize),
    /// Length first, then the bytes (see [`TcpRing::broadcast_bytes`]).
    BroadcastBytes(Vec<u8>, usize),
}

/// A buffer the caller lends to the communication thread without copying
/// it. The caller keeps its `&mut` borrow alive and does not touch the
/// memory until it has received the matching reply (`all_reduce_buckets`
/// always collects every reply it is owed before it returns).
struct Lent {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: only the communication thread (and the sender thread it hands
// ranges to) use the pointer, while the lending caller waits for the reply.
unsafe impl Send for Lent {}

/// The buffer an operation hands back: `floats` for the f32 operations,
/// `bytes` for the byte broadcast (the other one is empty).
#[derive(Default)]
struct Returned {
    floats: Vec<f32>,
    bytes: Vec<u8>,
}

type Reply = Result<Returned, CommError>;

/// The most bytes [`TcpRing::broadcast_bytes`] accepts from a peer: a
/// length beyond it is a protocol error, not an allocation.
pub const MAX_BROADCAST_BYTES: u64 = 1 << 40;

/// A formed ring; implements [`Collective`].
pub struct TcpRing {
    cfg: Arc<RingConfig>,
    requests: Option<mpsc::Sender<Request>>,
    replies: mpsc::Receiver<Reply>,
    counters: Arc<Counters>,
    closing: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// Clones of the two links, for the goodbye on drop.
    next_stream: Option<TcpStream>,
    prev_stream: Option<TcpStream>,
    listen_addr: Option<SocketAddr>,
}

/// Binds this rank's data-plane listener (before the ring forms, so tests
/// can use port 0 and hand the real address to the other ranks).
pub fn bind(addr: &str) -> Result<TcpListener, CommError> {
    TcpListener::bind(addr).map_err(|e| CommError::Setup(format!("cannot listen on {addr}: {e}")))
}

fn resolve(addr: &str) -> Result<SocketAddr, CommError> {
    addr.to_socket_addrs()
        .map_err(|e| CommError::Setup(format!("cannot resolve {addr}: {e}")))?
        .next()
        .ok_or_else(|| CommError::Setup(format!("{addr} resolves to no address")))
}

impl TcpRing {
    /// Forms the ring: accepts the previous rank on `listener` (refusing and
    /// logging anything else), connects to the next rank, and starts the
    /// communication threads. W = 1 needs no sockets.
    pub fn start(listener: Option<TcpListener>, cfg: RingConfig) -> Result<Self, CommError> {
        if cfg.world == 0 || cfg.rank >= cfg.world {
            return Err(CommError::Setup(format!(
                "rank {} is outside world size {}",
                cfg.rank, cfg.world
            )));
        }
        // Ranks go on the wire as u32 and the job id as a length-prefixed
        // string: refuse what would not fit rather than truncate it.
        if u32::try_from(cfg.world).is_err() {
            return Err(CommError::Setup(format!(
                "world size {} does not fit the wire's u32 ranks",
                cfg.world
            )));
        }
        wire::job_id_len(&cfg.job)?;
        if cfg.world > 1 && cfg.secret.is_empty() {
            return Err(CommError::Setup(
                "no ring key: a ring of more than one rank needs its generation's key (the coordinator's Assignment, or --secret-file)".into(),
            ));
        }
        if cfg.world > 1 && cfg.peers.len() != cfg.world {
            return Err(CommError::Setup(format!(
                "{} peer addresses for world size {}: need one per rank, in rank order",
                cfg.peers.len(),
                cfg.world
            )));
        }
        // Forming the ring (both links) ends by this deadline, whatever the
        // peers do: a peer that never answers is an error, never a hang.
        let deadline = Instant::now() + cfg.connect_timeout;
        let cfg = Arc::new(cfg);
        let counters = Arc::new(Counters::default());
        let closing = Arc::new(AtomicBool::new(false));
        let (req_tx, req_rx) = mpsc::channel::<Request>();
        let (rep_tx, rep_rx) = mpsc::channel::<Reply>();
        let mut ring = Self {
            cfg: cfg.clone(),
            requests: Some(req_tx),
            replies: rep_rx,
            counters: counters.clone(),
            closing: closing.clone(),
            threads: Vec::new(),
            next_stream: None,
            prev_stream: None,
            listen_addr: None,
        };
        if cfg.world == 1 {
            return Ok(ring);
        }
        let listener = match listener {
            Some(l) => l,
            None => bind(&cfg.addr(cfg.rank))?,
        };
        ring.listen_addr = listener.local_addr().ok();
        let (prev_tx, prev_rx) = mpsc::channel::<TcpStream>();
        ring.threads.push(spawn_acceptor(
            listener,
            cfg.clone(),
            prev_tx,
            closing.clone(),
        )?);
        let next = connect_next(&cfg, deadline)?;
        let left = deadline.saturating_duration_since(Instant::now());
        let prev = prev_rx.recv_timeout(left).map_err(|_| {
            CommError::Setup(format!(
                "rank {} ({}) did not connect within {:?}",
                cfg.prev(),
                cfg.addr(cfg.prev()),
                cfg.connect_timeout
            ))
        })?;
        for s in [&next, &prev] {
            s.set_nodelay(true).ok();

            s.set_read_timeout(Some(cfg.timeout)).ok();
            s.set_write_timeout(Some(cfg.timeout)).ok();
        }
        let abort: Arc<Mutex<Option<CommError>>> = Arc::new(Mutex::new(None));
        let io = |r: io::Result<TcpStream>| {
            r.map_err(|e| CommError::Setup(format!("cloning a socket: {e}")))
        };
        let back_reader = BackReader {
            cfg: cfg.clone(),
            next: io(next.try_clone())?,
            prev: io(prev.try_clone())?,
            abort: abort.clone(),
            closing: closing.clone(),
        };
        ring.threads
            .push(spawn("accrue-ring-back", move || back_reader.run())?);
        let (send_tx, send_rx) = mpsc::channel::<SendJob>();
        let (done_tx, done_rx) = mpsc::channel::<io::Result<()>>();
        let sender_stream = io(next.try_clone())?;
        let sender_counters = counters.clone();
        ring.threads.push(spawn("accrue-ring-send", move || {
            sender_loop(sender_stream, send_rx, done_tx, sender_counters)
        })?);
        ring.next_stream = Some(io(next.try_clone())?);
        ring.prev_stream = Some(io(prev.try_clone())?);
        let mut comm = Comm {
            cfg: cfg.clone(),
            prev,
            next,
            send: send_tx,
            done: done_rx,
            send_seq: 0,
            recv_seq: 0,
            abort,
            counters,
            scratch: Vec::new(),
            tag: wire::job_tag(&cfg.job),
            failed: None,
        };
        ring.threads.push(spawn("accrue-ring-comm", move || {
            while let Ok(req) = req_rx.recv() {
                let reply = comm.serve(req);
                if rep_tx.send(reply).is_err() {
                    break;
                }
            }
        })?);
        tracing::info!(rank = cfg.rank, world = cfg.world, "ring formed");
        Ok(ring)
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn config(&self) -> &RingConfig {
        &self.cfg
    }

    fn call(&mut self, req: Request) -> Result<Returned, CommError> {
        let tx = self
            .requests
            .as_ref()
            .ok_or_else(|| CommError::Setup("the ring is closed".into()))?;
        tx.send(req)
            .map_err(|_| CommError::Setup("the communication thread has stopped".into()))?;
        self.replies
            .recv()
            .map_err(|_| CommError::Setup("the communication thread has stopped".into()))?
    }

    pub fn all_reduce(&mut self, buf: &mut Vec<f32>) -> Result<(), CommError> {
        if self.cfg.world == 1 {
            return Ok(());
        }
        *buf = self.call(Request::AllReduce(std::mem::take(buf)))?.floats;
        Ok(())
    }

    /// ZeRO's reduce-scatter (issue 17), in place: afterwards slice `rank`
    /// of `buf` ([`crate::comm::shard::slice`]) holds the sum over all ranks;
    /// the rest of `buf` is scratch. Sends (W-1)/W of the buffer.
    pub fn reduce_scatter(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        self.lend(buf, Request::ReduceScatterLent)
    }

    /// ZeRO's all-gather, in place: every rank's slice `rank` of `buf` is
    /// copied into every rank's `buf`. Sends (W-1)/W of the buffer.
    pub fn all_gather(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        self.lend(buf, Request::AllGatherLent)
    }

    /// Lends `buf` to the communication thread for `op` and waits for it.
    fn lend(&mut self, buf: &mut [f32], op: fn(Lent) -> Request) -> Result<(), CommError> {
        if self.cfg.world == 1 {
            return Ok(());
        }
        let lent = Lent {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        };
        // `buf` stays borrowed until the reply: the thread owns it meanwhile.
        self.call(op(lent)).map(|_| ())
    }

    /// Reduces `buckets` in place, in order, on the communication thread,
    /// without copying them: every bucket is staged in (`copy_in`) and
    /// queued as soon as it is ready, so staging bucket i + 1 overlaps the
    /// reduction of bucket i, and `copy_out(i)` overlaps bucket i + 1. The
    /// ring's failures become the stages' error `E` through `lift` (the
    /// worker's form: `TcpRing::all_reduce_buckets`, in `ring_buckets`).
    pub(crate) fn buckets_with<E>(
        &mut self,
        buckets: &mut [&mut [f32]],
        copy_in: BucketCopy<'_, E>,
        copy_out: BucketCopy<'_, E>,
        lift: impl Fn(CommError) -> E,
    ) -> Result<(), E> {
        if self.cfg.world == 1 {
            for (i, b) in buckets.iter_mut().enumerate() {
                copy_in(i, b)?;
                copy_out(i, b)?;
            }
            return Ok(());
        }
        let tx = self
            .requests
            .clone()
            .ok_or_else(|| lift(CommError::Setup("the ring is closed".into())))?;
        let mut posted = 0;
        let mut first_err: Option<E> = None;
        for (i, b) in buckets.iter_mut().enumerate() {
            if let Err(e) = copy_in(i, b) {
                first_err = Some(e);
                break;
            }
            let lent = Lent {
                ptr: b.as_mut_ptr(),
                len: b.len(),
            };
            if tx.send(Request::AllReduceLent(lent)).is_err() {
                first_err = Some(lift(CommError::Setup(
                    "the communication thread has stopped".into(),
                )));
                break;
            }
            posted += 1;
        }
        // Collect every reply owed before touching (or returning) any bucket.
        for (i, b) in buckets.iter_mut().enumerate().take(posted) {
            let reply = self
                .replies
                .recv()
                .map_err(|_| CommError::Setup("the communication thread has stopped".into()));
            match reply {
                Ok(Ok(_)) if first_err.is_none() => {
                    if let Err(e) = copy_out(i, b) {
                        first_err = Some(e);
                    }
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) | Err(e) => {
                    if first_err.is_none() {
                        first_err = Some(lift(e));
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn check_root(&self, root: usize) -> Result<(), CommError> {
        if root >= self.cfg.world {
            return Err(CommError::Setup(format!(
                "broadcast root {root} outside world size {}",
                self.cfg.world
            )));
        }
        Ok(())
    }

    pub fn broadcast(&mut self, buf: &mut Vec<f32>, root: usize) -> Result<(), CommError> {
        if self.cfg.world == 1 {
            return Ok(());
        }
        self.check_root(root)?;
        *buf = self
            .call(Request::Broadcast(std::mem::take(buf), root))?
            .floats;
        Ok(())
    }

    /// Copies `root`'s bytes into every rank's `buf` (resized to them): the
    /// root sends the length (u64, little endian), then the bytes, both
    /// pipelined along the ring in tagged frames of at most
    /// `max_frame_bytes`. Any length, 0 included.
    pub fn broadcast_bytes(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        if self.cfg.world == 1 {
            return Ok(());
        }
        self.check_root(root)?;
        *buf = self
            .call(Request::BroadcastBytes(std::mem::take(buf), root))?
            .bytes;
        Ok(())
    }
}

impl TcpRing {
    /// Cuts both links without a goodbye: the operation in flight (here
    /// and at the neighbours) fails as for a lost peer, and so does every
    /// later one.
    pub fn abort(&mut self) {
        for s in [self.prev_stream.as_ref(), self.next_stream.as_ref()]
            .into_iter()
            .flatten()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TcpRing {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::SeqCst);
        self.requests.take();
        // Goodbye on both links: forward (the next rank's data stream) and
        // backward (the previous rank's return path), so neither neighbour
        // mistakes this clean close for a lost peer.
        let goodbye = Header {
            kind: Kind::Goodbye,
            job_tag: 0,
            generation: self.cfg.generation,
            seq: 0,
            len: 0,
        };
        for mut s in [self.prev_stream.take(), self.next_stream.take()]
            .into_iter()
            .flatten()
        {
            s.set_write_timeout(Some(Duration::from_millis(500))).ok();
            let _ = s.write_all(&goodbye.encode());
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(addr) = self.listen_addr {
            // Wakes the acceptor's blocking accept so it sees `closing`.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, CommError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| CommError::Setup(format!("cannot start thread {name}: {e}")))
}

impl Collective for TcpRing {
    fn rank(&self) -> usize {
        self.cfg.rank
    }
    fn world_size(&self) -> usize {
        self.cfg.world
    }
    fn all_reduce_sum(&mut self, buf: &mut Vec<f32>) -> Result<(), CollectiveError> {
        Ok(self.all_reduce(buf)?)
    }
    fn broadcast(&mut self, buf: &mut Vec<f32>, root: usize) -> Result<(), CollectiveError> {
        Ok(TcpRing::broadcast(self, buf, root)?)
    }
    fn broadcast_bytes(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError> {
        Ok(TcpRing::broadcast_bytes(self, buf, root)?)
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let mut one = vec![0f32];
        Ok(self.all_reduce(&mut one)?)
    }
    fn all_reduce_buckets<E>(
        &mut self,
        buckets: &mut [&mut [f32]],
        copy_in: BucketCopy<'_, E>,
        copy_out: BucketCopy<'_, E>,
    ) -> Result<(), E>
    where
        E: From<CollectiveError>,
    {
        self.buckets_with(buckets, copy_in, copy_out, |e| {
            E::from(CollectiveError::from(e))
        })
    }
    fn reduce_scatter_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(TcpRing::reduce_scatter(self, buf)?)
    }
    fn all_gather(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(TcpRing::all_gather(self, buf)?)
    }
    fn bytes(&self) -> (u64, u64) {
        (
            self.counters.sent.load(Ordering::Relaxed),
            self.counters.received.load(Ordering::Relaxed),
        )
    }
}
