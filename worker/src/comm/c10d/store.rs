//! The rendezvous store of the c10d groups: a key-value server that world
//! rank 0 hosts for one generation, reached only through the ring's
//! authenticated handshake (`wire::handshake_connect`, HMAC proofs with the
//! generation's key), so a process without the key can neither read nor
//! write the addresses gloo's ranks exchange. libtorch's own TCPStore has no
//! authentication at all (docs/SECURITY.md). Its port is bounded as the
//! ring's is ([`StoreLimits`]): so many handshakes at once, each within a
//! deadline, one connection per rank.
//!
//! Protocol, after the handshake (little endian):
//! ```text
//! request:  kind u8 | key len u32 | key | value len u32 | value | arg i64 | timeout_ms i64
//! response: status u8 (0 ok, 1 error) | len u32 | bytes (value or message) | number i64
//! ```
//! kinds: 0 set, 1 get (waits for the key, at most timeout_ms), 2 add (arg;
//! the value is the decimal text c10d keeps), 3 check, 4 delete, 5 count.

use crate::comm::admission::{admit, Deadline};
use crate::comm::wire::{self, Hello};
use crate::comm::CommError;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest key and value a request may carry, and the most keys the
/// server holds: gloo's rendezvous writes one address list per rank.
pub const MAX_KEY: usize = 4096;
pub const MAX_VALUE: usize = 1 << 20;
pub const MAX_KEYS: usize = 1 << 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Set = 0,
    Get = 1,
    Add = 2,
    Check = 3,
    Delete = 4,
    Count = 5,
}

impl Op {
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Op::Set,
            1 => Op::Get,
            2 => Op::Add,
            3 => Op::Check,
            4 => Op::Delete,
            5 => Op::Count,
            _ => return None,
        })
    }
}

/// What one request asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub arg: i64,
    pub timeout_ms: i64,
}

/// The scope the store's handshake names: the job and this store's role,
/// so a ring key proves nothing to it that a ring link would accept.
fn scope(job: &str) -> String {
    format!("{job}#c10d-store")
}

#[derive(Default)]
struct Table {
    entries: HashMap<Vec<u8>, Vec<u8>>,
}

/// Applies one request to the table; `Get` is answered by the caller's
/// wait. Pure: unit-tested below.
fn apply(t: &mut Table, r: &Request) -> Result<(Vec<u8>, i64), String> {
    let room = |t: &Table| {
        if t.entries.len() >= MAX_KEYS && !t.entries.contains_key(&r.key) {
            Err(format!("the store holds {MAX_KEYS} keys already"))
        } else {
            Ok(())
        }
    };
    match r.op {
        Op::Set => {
            room(t)?;
            t.entries.insert(r.key.clone(), r.value.clone());
            Ok((Vec::new(), 0))
        }
        Op::Get => t
            .entries
            .get(&r.key)
            .map(|v| (v.clone(), 0))
            .ok_or_else(|| "no such key".to_string()),
        Op::Add => {
            room(t)?;
            let now = match t.entries.get(&r.key) {
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| "add on a key that does not hold a number".to_string())?,
                None => 0,
            };
            let sum = now
                .checked_add(r.arg)
                .ok_or_else(|| format!("add overflows: {now} + {}", r.arg))?;
            t.entries
                .insert(r.key.clone(), sum.to_string().into_bytes());
            Ok((Vec::new(), sum))
        }
        Op::Check => Ok((Vec::new(), i64::from(t.entries.contains_key(&r.key)))),
        Op::Delete => Ok((Vec::new(), i64::from(t.entries.remove(&r.key).is_some()))),
        // The table is bounded by MAX_KEYS, far below i64::MAX.
        Op::Count => Ok((Vec::new(), t.entries.len() as i64)),
    }
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_i64(r: &mut impl Read) -> std::io::Result<i64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(i64::from_le_bytes(b))
}

fn read_bytes(r: &mut impl Read, limit: usize, what: &str) -> std::io::Result<Vec<u8>> {
    let len = read_u32(r)? as usize;
    if len > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a {what} of {len} bytes is over the store's limit of {limit}"),
        ));
    }
    let mut v = vec![0u8; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(25 + self.key.len() + self.value.len());
        b.push(self.op as u8);
        // Lengths are checked against MAX_KEY/MAX_VALUE by the client first.
        b.extend_from_slice(&(self.key.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.key);
        b.extend_from_slice(&(self.value.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.value);
        b.extend_from_slice(&self.arg.to_le_bytes());
        b.extend_from_slice(&self.timeout_ms.to_le_bytes());
        b
    }

    pub fn read(r: &mut impl Read) -> std::io::Result<Self> {
        let mut code = [0u8; 1];
        r.read_exact(&mut code)?;
        let op = Op::from_code(code[0]).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("unknown store request kind {}", code[0]),
            )
        })?;
        let key = read_bytes(r, MAX_KEY, "key")?;
        let value = read_bytes(r, MAX_VALUE, "value")?;
        Ok(Self {
            op,
            key,
            value,
            arg: read_i64(r)?,
            timeout_ms: read_i64(r)?,
        })
    }
}

fn respond(w: &mut impl Write, answer: &Result<(Vec<u8>, i64), String>) -> std::io::Result<()> {
    let (status, bytes, number) = match answer {
        Ok((v, n)) => (0u8, v.as_slice(), *n),
        Err(m) => (1u8, m.as_bytes(), 0),
    };
    let mut b = Vec::with_capacity(13 + bytes.len());
    b.push(status);
    // Values are at most MAX_VALUE, messages short.
    b.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    b.extend_from_slice(bytes);
    b.extend_from_slice(&number.to_le_bytes());
    w.write_all(&b)
}

type Shared = Arc<(Mutex<Table>, Condvar)>;

/// What a store's port lets in: at most `max_pending_handshakes`
/// connections that have not proved the key yet (more are closed at once),
/// each handshake within `handshake_timeout` (a slow or silent client is
/// dropped, freeing its place), and one connection per rank of the job:
/// once every rank is connected, any further connection is closed at once
/// (`admission::admit`), and a second one of a connected rank is closed
/// after its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    pub max_pending_handshakes: usize,
    pub handshake_timeout: Duration,
}

impl Default for StoreLimits {
    /// The ring's defaults (64 handshakes, 10 s each).
    fn default() -> Self {
        Self {
            max_pending_handshakes: crate::comm::ring::MAX_PENDING_HANDSHAKES,
            handshake_timeout: crate::comm::ring::HANDSHAKE_TIMEOUT,
        }
    }
}

/// World rank 0's store for one generation; stops (and drops every
/// connection) when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    shared: Shared,
    acceptor: Option<JoinHandle<()>>,
}

/// What the acceptor and every connection's thread share.
struct Port {
    key: Vec<u8>,
    /// The handshake's scope ([`scope`]).
    job: String,
    generation: u64,
    world: u32,
    limits: StoreLimits,
    stop: Arc<AtomicBool>,
    shared: Shared,
    /// Which ranks hold a connection now.
    ranks: Mutex<Vec<bool>>,
}

impl StoreServer {
    /// Listens on `host`:0 for ranks below `world` proving `key` for
    /// `job` and `generation`, with the default [`StoreLimits`].
    pub fn start(
        host: &str,
        key: Vec<u8>,
        job: &str,
        generation: u64,
        world: u32,
    ) -> Result<Self, CommError> {
        Self::start_with(host, key, job, generation, world, StoreLimits::default())
    }

    /// [`StoreServer::start`] within `limits`.
    pub fn start_with(
        host: &str,
        key: Vec<u8>,
        job: &str,
        generation: u64,
        world: u32,
        limits: StoreLimits,
    ) -> Result<Self, CommError> {
        let listener = TcpListener::bind((host, 0)).map_err(|e| {
            CommError::Setup(format!("the c10d store cannot listen on {host}: {e}"))
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| CommError::Setup(format!("the c10d store's address: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::Setup(format!("the c10d store's listener: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared: Shared = Arc::default();
        let port = Arc::new(Port {
            key,
            job: scope(job),
            generation,
            world,
            limits,
            stop: stop.clone(),
            shared: shared.clone(),
            ranks: Mutex::new(vec![false; world as usize]),
        });
        let acceptor = std::thread::Builder::new()
            .name("accrue-c10d-store".into())
            .spawn(move || accept_loop(listener, port))
            .map_err(|e| CommError::Setup(format!("cannot start the c10d store: {e}")))?;
        Ok(Self {
            addr,
            stop,
            shared,
            acceptor: Some(acceptor),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.shared.1.notify_all();
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

/// One connection's thread: a handshake, then (once `authenticated`) a
/// rank's requests.
struct Conn {
    /// A clone of the socket, shut down when the store stops.
    stream: TcpStream,
    thread: JoinHandle<()>,
    authenticated: Arc<AtomicBool>,
}

/// The connections whose thread still runs; those that ended are joined,
/// so a place frees only once its thread is gone.
fn reap(conns: Vec<Conn>) -> Vec<Conn> {
    let (done, running): (Vec<_>, Vec<_>) = conns.into_iter().partition(|c| c.thread.is_finished());
    for c in done {
        // A connection's thread that panicked is over already.
        let _ = c.thread.join();
    }
    running
}

fn accept_loop(listener: TcpListener, port: Arc<Port>) {
    let mut conns: Vec<Conn> = Vec::new();
    let mut refused: u64 = 0;
    while !port.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, peer)) => {
                conns = reap(conns);
                let connected = conns
                    .iter()
                    .filter(|c| c.authenticated.load(Ordering::SeqCst))
                    .count();
                let pending = conns.len() - connected;
                let max = port.limits.max_pending_handshakes;
                if let Err(why) = admit(pending, connected, max, port.world as usize) {
                    refused += 1;
                    // Logged once per burst size, not once per connection.
                    if refused.is_power_of_two() {
                        tracing::warn!(%peer, refused, reason = %why, "c10d store: refused a connection");
                    }
                    let _ = s.shutdown(std::net::Shutdown::Both);
                    continue;
                }
                let Ok(clone) = s.try_clone() else { continue };
                let authenticated = Arc::new(AtomicBool::new(false));
                let (port2, auth2) = (port.clone(), authenticated.clone());
                // If the thread cannot start, the closure (and the socket
                // in it) is dropped: the connection closes.
                let t = std::thread::Builder::new()
                    .name("accrue-c10d-conn".into())
                    .spawn(move || {
                        if let Err(e) = serve(s, &port2, &auth2) {
                            tracing::debug!(%peer, error = %e, "c10d store connection ended");
                        }
                    });
                match t {
                    Ok(thread) => conns.push(Conn {
                        stream: clone,
                        thread,
                        authenticated,
                    }),
                    Err(e) => tracing::warn!(error = %e, "cannot serve a c10d store connection"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Ended connections release their socket clone and thread.
                conns = reap(conns);
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                // E.g. out of file descriptors: do not spin on it.
                tracing::warn!(error = %e, "the c10d store's accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    for c in conns {
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
        let _ = c.thread.join();
    }
}

/// Frees a rank's place when its connection ends.
struct RankHeld<'a> {
    ranks: &'a Mutex<Vec<bool>>,
    rank: usize,
}

impl Drop for RankHeld<'_> {
    fn drop(&mut self) {
        let mut r = self.ranks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(held) = r.get_mut(self.rank) {
            *held = false;
        }
    }
}

/// Serves one connection, and closes it when done (the acceptor's clone
/// of the socket would keep it open otherwise).
fn serve(mut s: TcpStream, port: &Port, authenticated: &AtomicBool) -> Result<(), String> {
    let r = serve_open(&mut s, port, authenticated);
    let _ = s.shutdown(std::net::Shutdown::Both);
    r
}

fn serve_open(s: &mut TcpStream, port: &Port, authenticated: &AtomicBool) -> Result<(), String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    // The whole handshake, not each read, ends by the deadline.
    let hello = {
        let mut d = Deadline::new(s, port.limits.handshake_timeout);
        wire::handshake_accept_any(&mut d, &port.key, &port.job, port.generation, port.world)
            .map_err(|e| format!("refused: {e}"))?
    };
    // handshake_accept_any accepts ranks below `world` only.
    let rank = hello.rank as usize;
    let _held = {
        let mut r = port.ranks.lock().unwrap_or_else(|p| p.into_inner());
        match r.get_mut(rank) {
            Some(held) if !*held => *held = true,
            _ => return Err(format!("refused: rank {rank} is connected already")),
        }
        RankHeld {
            ranks: &port.ranks,
            rank,
        }
    };
    authenticated.store(true, Ordering::SeqCst);
    tracing::debug!(rank, "c10d store: rank connected");
    // Authenticated: requests may be far apart (gloo asks once per group).
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    s.set_write_timeout(None).map_err(|e| e.to_string())?;
    let _ = s.set_nodelay(true);
    let (stop, shared) = (&*port.stop, &port.shared);
    loop {
        let r = match Request::read(s) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        let answer = if r.op == Op::Get {
            wait_for(shared, &r, stop)
        } else {
            let (table, cv) = &**shared;
            let mut t = table.lock().unwrap_or_else(|p| p.into_inner());
            let a = apply(&mut t, &r);
            cv.notify_all();
            a
        };
        respond(s, &answer).map_err(|e| e.to_string())?;
    }
}

fn wait_for(shared: &Shared, r: &Request, stop: &AtomicBool) -> Result<(Vec<u8>, i64), String> {
    let deadline = Instant::now() + Duration::from_millis(r.timeout_ms.max(0) as u64);
    let (table, cv) = &**shared;
    let mut t = table.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if let Some(v) = t.entries.get(&r.key) {
            return Ok((v.clone(), 0));
        }
        let now = Instant::now();
        if now >= deadline || stop.load(Ordering::SeqCst) {
            return Err(format!(
                "timed out after {} ms waiting for key {:?}",
                r.timeout_ms,
                String::from_utf8_lossy(&r.key)
            ));
        }
        // Wake at least every 100 ms to see `stop`.
        let step = (deadline - now).min(Duration::from_millis(100));
        t = cv
            .wait_timeout(t, step)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// One rank's authenticated connection to the store.
pub struct StoreClient {
    stream: TcpStream,
}

impl StoreClient {
    /// Connects to `addr` and proves `key` as `rank` of `job`'s
    /// `generation`, within `timeout`.
    pub fn connect(
        addr: SocketAddr,
        key: &[u8],
        job: &str,
        generation: u64,
        rank: u32,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let mut stream = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| CommError::Setup(format!("cannot reach the c10d store at {addr}: {e}")))?;
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| CommError::Setup(e.to_string()))?;
        let hello = Hello {
            rank,
            generation,
            job: scope(job),
        };
        wire::handshake_connect(&mut stream, key, &hello).map_err(|e| {
            CommError::Setup(format!("the c10d store at {addr} refused this rank: {e}"))
        })?;
        let _ = stream.set_nodelay(true);
        Ok(Self { stream })
    }

    /// Sends one request and reads its answer (Err: the server's message
    /// or the connection's failure).
    pub fn call(&mut self, r: &Request) -> Result<(Vec<u8>, i64), String> {
        if r.key.len() > MAX_KEY || r.value.len() > MAX_VALUE {
            return Err(format!(
                "a key of {} or value of {} bytes is over the store's limits ({MAX_KEY}, {MAX_VALUE})",
                r.key.len(),
                r.value.len()
            ));
        }
        // A get may wait for its whole timeout on the server: read a while longer.
        let wait = Duration::from_millis(r.timeout_ms.max(0) as u64) + Duration::from_secs(10);
        let io = |e: std::io::Error| format!("the c10d store connection failed: {e}");
        self.stream.set_read_timeout(Some(wait)).map_err(io)?;
        self.stream.write_all(&r.encode()).map_err(io)?;
        let mut status = [0u8; 1];
        self.stream.read_exact(&mut status).map_err(io)?;
        let bytes = read_bytes(&mut self.stream, MAX_VALUE, "value").map_err(io)?;
        let number = read_i64(&mut self.stream).map_err(io)?;
        if status[0] == 0 {
            Ok((bytes, number))
        } else {
            Err(String::from_utf8_lossy(&bytes).into_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(op: Op, key: &str, value: &str, arg: i64) -> Request {
        Request {
            op,
            key: key.as_bytes().to_vec(),
            value: value.as_bytes().to_vec(),
            arg,
            timeout_ms: 100,
        }
    }

    #[test]
    fn the_table_sets_adds_checks_and_deletes() {
        let mut t = Table::default();
        apply(&mut t, &req(Op::Set, "a", "x", 0)).unwrap();
        assert_eq!(apply(&mut t, &req(Op::Get, "a", "", 0)).unwrap().0, b"x");
        assert_eq!(apply(&mut t, &req(Op::Add, "n", "", 5)).unwrap().1, 5);
        assert_eq!(apply(&mut t, &req(Op::Add, "n", "", -2)).unwrap().1, 3);
        assert!(apply(&mut t, &req(Op::Add, "a", "", 1))
            .unwrap_err()
            .contains("does not hold a number"));
        assert_eq!(apply(&mut t, &req(Op::Check, "a", "", 0)).unwrap().1, 1);
        assert_eq!(apply(&mut t, &req(Op::Count, "", "", 0)).unwrap().1, 2);
        assert_eq!(apply(&mut t, &req(Op::Delete, "a", "", 0)).unwrap().1, 1);
        assert_eq!(apply(&mut t, &req(Op::Check, "a", "", 0)).unwrap().1, 0);
        t.entries
            .insert(b"m".to_vec(), i64::MAX.to_string().into_bytes());
        assert!(apply(&mut t, &req(Op::Add, "m", "", 1))
            .unwrap_err()
            .contains("overflows"));
    }

    #[test]
    fn requests_round_trip_and_oversized_keys_are_refused_before_allocation() {
        let r = req(Op::Set, "k", "v", 7);
        assert_eq!(Request::read(&mut r.encode().as_slice()).unwrap(), r);
        let mut b = vec![0u8];
        b.extend_from_slice(&(MAX_KEY as u32 + 1).to_le_bytes());
        let e = Request::read(&mut b.as_slice()).unwrap_err();
        assert!(e.to_string().contains("over the store's limit"), "{e}");
    }

    #[test]
    fn only_a_client_with_the_key_is_served() {
        let key = b"generation key".to_vec();
        let server = StoreServer::start("127.0.0.1", key.clone(), "j", 3, 2).unwrap();
        let t = Duration::from_secs(5);
        let mut a = StoreClient::connect(server.addr(), &key, "j", 3, 0, t).unwrap();
        a.call(&req(Op::Set, "rank_0", "addr", 0)).unwrap();
        let mut b = StoreClient::connect(server.addr(), &key, "j", 3, 1, t).unwrap();
        assert_eq!(b.call(&req(Op::Get, "rank_0", "", 0)).unwrap().0, b"addr");
        let e = b.call(&req(Op::Get, "missing", "", 0)).unwrap_err();
        assert!(e.contains("timed out after 100 ms"), "{e}");
        for (k, gen, rank) in [(&b"wrong"[..], 3, 0), (&key[..], 2, 0), (&key[..], 3, 2)] {
            let e = StoreClient::connect(server.addr(), k, "j", gen, rank, t)
                .err()
                .unwrap();
            assert!(e.to_string().contains("refused"), "{e}");
        }
    }
}
