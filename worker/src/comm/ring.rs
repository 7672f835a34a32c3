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

use super::chunks::{self, chunk_range};
use super::wire::{self, Header, Hello, Kind, HEADER_LEN};
use crate::shard;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CommError {
    #[error("lost rank {rank} ({addr}) during {during}: {reason}")]
    PeerLost {
        rank: usize,
        addr: String,
        during: String,
        reason: String,
    },
    #[error("rank {rank} ({addr}) was silent for {secs:.1} s during {during} (comm timeout)")]
    Timeout {
        rank: usize,
        addr: String,
        secs: f64,
        during: String,
    },
    #[error("lost rank {lost} (reported by rank {reporter}): {reason}")]
    Aborted {
        lost: usize,
        reporter: usize,
        reason: String,
    },
    #[error("protocol error from rank {rank} ({addr}): {reason}")]
    Protocol {
        rank: usize,
        addr: String,
        reason: String,
    },
    #[error("cannot form the ring: {0}")]
    Setup(String),
    #[error("buffer of {got} elements, the ring expects {want} on every rank")]
    Size { got: usize, want: usize },
    #[error(transparent)]
    Wire(#[from] wire::WireError),
}

impl CommError {
    /// The rank this error blames, if any.
    pub fn lost_rank(&self) -> Option<usize> {
        match self {
            CommError::PeerLost { rank, .. } | CommError::Timeout { rank, .. } => Some(*rank),
            CommError::Aborted { lost, .. } => Some(*lost),
            _ => None,
        }
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

/// A formed ring; implements [`crate::Collective`].
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
    /// of `buf` ([`crate::shard::slice`]) holds the sum over all ranks;
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
    /// without copying them: every bucket is staged in (`stage_in`) and
    /// queued as soon as it is ready, so staging bucket i + 1 overlaps the
    /// reduction of bucket i, and `stage_out(i)` overlaps bucket i + 1.
    pub fn all_reduce_buckets(
        &mut self,
        buckets: &mut [&mut [f32]],
        stage_in: crate::collective::Stage<'_>,
        stage_out: crate::collective::Stage<'_>,
    ) -> crate::Result<()> {
        if self.cfg.world == 1 {
            for (i, b) in buckets.iter_mut().enumerate() {
                stage_in(i, b)?;
                stage_out(i, b)?;
            }
            return Ok(());
        }
        let tx = self
            .requests
            .clone()
            .ok_or_else(|| CommError::Setup("the ring is closed".into()))?;
        let mut posted = 0;
        let mut first_err: Option<crate::Error> = None;
        for (i, b) in buckets.iter_mut().enumerate() {
            if let Err(e) = stage_in(i, b) {
                first_err = Some(e);
                break;
            }
            let lent = Lent {
                ptr: b.as_mut_ptr(),
                len: b.len(),
            };
            if tx.send(Request::AllReduceLent(lent)).is_err() {
                first_err =
                    Some(CommError::Setup("the communication thread has stopped".into()).into());
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
                    if let Err(e) = stage_out(i, b) {
                        first_err = Some(e);
                    }
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) | Err(e) => {
                    if first_err.is_none() {
                        first_err = Some(e.into());
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

/// Accepts connections for the whole life of the ring: the first one that
/// proves it is the previous rank of this job and generation becomes the
/// ring's input; everything else is refused and logged. Each handshake runs
/// on a thread of its own, at most `max_pending_handshakes` at once (more
/// connections are closed at once) and each within `handshake_timeout`, so
/// idle or slow clients can neither exhaust threads nor hold a place for
/// long.
fn spawn_acceptor(
    listener: TcpListener,
    cfg: Arc<RingConfig>,
    prev_tx: mpsc::Sender<TcpStream>,
    closing: Arc<AtomicBool>,
) -> Result<JoinHandle<()>, CommError> {
    spawn("accrue-ring-accept", move || {
        let taken = Arc::new(AtomicBool::new(false));
        let pending = Arc::new(AtomicUsize::new(0));
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
            let Some(slot) = Slot::take(&pending, cfg.max_pending_handshakes) else {
                refused += 1;
                // Logged once per burst size, not once per connection.
                if refused.is_power_of_two() {
                    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    tracing::warn!(%peer, refused, limit = cfg.max_pending_handshakes, "refused data-plane connection: too many handshakes in progress");
                }
                let _ = s.shutdown(Shutdown::Both);
                continue;
            };
            let (cfg, tx, taken) = (cfg.clone(), prev_tx.clone(), taken.clone());
            // If the thread cannot start, the closure (and the slot and
            // socket in it) is dropped: the connection closes, the place frees.
            let _ = std::thread::Builder::new().name("accrue-ring-handshake".into()).spawn(move || {
                let _slot = slot;
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
        }
    })
}

/// A place among the handshakes in progress; freed on drop.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(pending: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        pending
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(pending.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A stream whose every read and write ends by one deadline (a per-call
/// timeout alone would let a peer that sends a byte at a time hold it
/// forever).
struct Deadline<'a> {
    s: &'a mut TcpStream,
    end: Instant,
}

impl<'a> Deadline<'a> {
    fn new(s: &'a mut TcpStream, limit: Duration) -> Self {
        Self {
            s,
            end: Instant::now() + limit,
        }
    }

    fn left(&self) -> io::Result<Duration> {
        let left = self.end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handshake's deadline passed",
            ));
        }
        Ok(left)
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.s.set_read_timeout(Some(left))?;
        self.s.read(buf).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
                io::ErrorKind::TimedOut,
                "no answer before the handshake's deadline",
            ),
            _ => e,
        })
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.s.set_write_timeout(Some(left))?;
        self.s.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.s.flush()
    }
}

/// Connects to the next rank and completes the handshake, retrying (a
/// peer may not listen yet, or still be on the previous generation) until
/// `deadline`; every attempt, connect and handshake included, ends by it.
fn connect_next(cfg: &RingConfig, deadline: Instant) -> Result<TcpStream, CommError> {
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

/// A region of the buffer for the sender thread. The communication thread
/// waits for the sender's reply before it touches or frees the region.
struct SendJob {
    /// `len` bytes, sent in frames of `piece` bytes.
    ptr: *const u8,
    len: usize,
    first_seq: u64,
    piece: usize,
    job_tag: u64,
    generation: u64,
}

// SAFETY: the pointer is only read by the sender thread while the owning
// communication thread blocks on the matching reply (see Comm::exchange).
unsafe impl Send for SendJob {}

fn frames(len: usize, piece: usize) -> usize {
    len.div_ceil(piece.max(1)).max(1)
}

fn sender_loop(
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
struct BackReader {
    cfg: Arc<RingConfig>,
    next: TcpStream,
    prev: TcpStream,
    abort: Arc<Mutex<Option<CommError>>>,
    closing: Arc<AtomicBool>,
}

impl BackReader {
    fn run(mut self) {
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

fn lost(cfg: &RingConfig, rank: usize, during: &str, e: &io::Error) -> CommError {
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

fn send_abort(s: &mut TcpStream, cfg: &RingConfig, err: &CommError) {
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

/// The communication thread's state.
struct Comm {
    cfg: Arc<RingConfig>,
    prev: TcpStream,
    next: TcpStream,
    send: mpsc::Sender<SendJob>,
    done: mpsc::Receiver<io::Result<()>>,
    send_seq: u64,
    recv_seq: u64,
    abort: Arc<Mutex<Option<CommError>>>,
    counters: Arc<Counters>,
    scratch: Vec<f32>,
    /// wire::job_tag of the job, computed once.
    tag: u64,
    failed: Option<CommError>,
}

#[derive(Clone, Copy, PartialEq)]
enum Apply {
    Add,
    Copy,
}

impl Comm {
    fn serve(&mut self, req: Request) -> Reply {
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
    /// schedule of [`crate::shard`]: rank r ends owning chunk r.
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

impl crate::collective::Collective for TcpRing {
    fn rank(&self) -> usize {
        self.cfg.rank
    }
    fn world_size(&self) -> usize {
        self.cfg.world
    }
    fn all_reduce_sum(&mut self, buf: &mut Vec<f32>) -> crate::Result<()> {
        self.all_reduce(buf).map_err(crate::Error::from)
    }
    fn broadcast(&mut self, buf: &mut Vec<f32>, root: usize) -> crate::Result<()> {
        TcpRing::broadcast(self, buf, root).map_err(crate::Error::from)
    }
    fn broadcast_bytes(&mut self, buf: &mut Vec<u8>, root: usize) -> crate::Result<()> {
        TcpRing::broadcast_bytes(self, buf, root).map_err(crate::Error::from)
    }
    fn barrier(&mut self) -> crate::Result<()> {
        let mut one = vec![0f32];
        self.all_reduce(&mut one).map_err(crate::Error::from)
    }
    fn all_reduce_buckets(
        &mut self,
        buckets: &mut [&mut [f32]],
        stage_in: crate::collective::Stage<'_>,
        stage_out: crate::collective::Stage<'_>,
    ) -> crate::Result<()> {
        TcpRing::all_reduce_buckets(self, buckets, stage_in, stage_out)
    }
    fn reduce_scatter_sum(&mut self, buf: &mut [f32]) -> crate::Result<()> {
        TcpRing::reduce_scatter(self, buf).map_err(crate::Error::from)
    }
    fn all_gather(&mut self, buf: &mut [f32]) -> crate::Result<()> {
        TcpRing::all_gather(self, buf).map_err(crate::Error::from)
    }
    fn bytes(&self) -> (u64, u64) {
        (
            self.counters.sent.load(Ordering::Relaxed),
            self.counters.received.load(Ordering::Relaxed),
        )
    }
}
