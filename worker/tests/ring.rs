//! The TCP ring with real sockets on loopback, one thread per rank.

#[path = "common/flood.rs"]
mod flood;
use accrue_worker::comm::chunks::{ring_recv_elems, ring_send_elems};
use accrue_worker::comm::wire::{self, Hello, HEADER_LEN};
use accrue_worker::comm::{bind, CommError, RingConfig, TcpRing};
use flood::{closed_by_peer, threads_named};
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"test-secret";

/// Binds W listeners on port 0 and returns them with their addresses.
fn listeners(world: usize) -> (Vec<std::net::TcpListener>, Vec<String>) {
    let ls: Vec<_> = (0..world).map(|_| bind("127.0.0.1:0").unwrap()).collect();
    let addrs = ls
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    (ls, addrs)
}

fn config(rank: usize, world: usize, peers: &[String], max_frame: usize) -> RingConfig {
    let mut c = RingConfig::new("job-a", rank, world, peers.to_vec(), SECRET.to_vec());
    c.timeout = Duration::from_secs(10);
    c.connect_timeout = Duration::from_secs(10);
    c.max_frame_bytes = max_frame;
    c
}

/// Runs `f` on every rank of a freshly formed ring, one thread each.
fn with_ring<T: Send + 'static>(
    world: usize,
    max_frame: usize,
    f: impl Fn(usize, &mut TcpRing) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let (ls, addrs) = listeners(world);
    let handles: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let (addrs, f) = (addrs.clone(), f.clone());
            std::thread::spawn(move || {
                let mut ring =
                    TcpRing::start(Some(l), config(rank, world, &addrs, max_frame)).unwrap();
                f(rank, &mut ring)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 1000 + i) % 251) as f32 * 0.5 - 17.0)
        .collect()
}

#[test]
fn all_reduce_sums_for_w_2_3_4() {
    for world in [2, 3, 4] {
        // Lengths: empty, shorter than W, odd, and many frames of 16 elements.
        for len in [0, 1, world - 1, 7, 1001] {
            let results = with_ring(world, 64, move |rank, ring| {
                let mut buf = input(rank, len);
                ring.all_reduce(&mut buf).unwrap();
                buf
            });
            let want: Vec<f32> = (0..len)
                .map(|i| (0..world).map(|r| input(r, len)[i]).sum())
                .collect();
            for (rank, got) in results.iter().enumerate() {
                assert_eq!(got, &want, "W={world} len={len} rank {rank}");
            }
        }
    }
}

#[test]
fn broadcast_from_every_root_and_barrier() {
    for world in [2, 3, 4] {
        for root in 0..world {
            let results = with_ring(world, 64, move |rank, ring| {
                let mut buf = input(rank, 333);
                ring.broadcast(&mut buf, root).unwrap();
                for _ in 0..3 {
                    ring_barrier(ring);
                }
                buf
            });
            for got in &results {
                assert_eq!(got, &input(root, 333), "W={world} root={root}");
            }
        }
    }
}

fn ring_barrier(ring: &mut TcpRing) {
    use accrue_worker::Collective;
    ring.barrier().unwrap();
}

/// Bytes on the wire per all-reduce: 2(W-1) chunks of about len/W elements
/// each way, plus one 40-byte header per frame.
#[test]
fn byte_counters_follow_the_ring_formula() {
    for world in [2, 3, 4] {
        let len = 10_000;
        let max_frame = 1 << 20; // one frame per chunk
        let results = with_ring(world, max_frame, move |rank, ring| {
            let mut buf = input(rank, len);
            ring.all_reduce(&mut buf).unwrap();
            use accrue_worker::Collective;
            ring.bytes()
        });
        let frames = 2 * (world - 1) as u64;
        for (rank, (sent, received)) in results.into_iter().enumerate() {
            let want_sent =
                4 * ring_send_elems(len, world, rank) as u64 + frames * HEADER_LEN as u64;
            let want_recv =
                4 * ring_recv_elems(len, world, rank) as u64 + frames * HEADER_LEN as u64;
            assert_eq!(
                (sent, received),
                (want_sent, want_recv),
                "W={world} rank {rank}"
            );
            let ideal = 2.0 * (world as f64 - 1.0) / world as f64 * (4 * len) as f64;
            assert!(
                (sent as f64 - ideal).abs() / ideal < 0.01,
                "W={world}: {sent} vs {ideal}"
            );
        }
    }
}

/// Garbage bytes and a wrong secret on a rank's data port are refused; the
/// ring still forms and works.
#[test]
fn wrong_secret_and_garbage_are_refused() {
    let (mut ls, addrs) = listeners(2);
    let l1 = ls.pop().unwrap();
    let l0 = ls.pop().unwrap();
    let peers = addrs.clone();
    let rank1 = std::thread::spawn(move || {
        let mut ring = TcpRing::start(Some(l1), config(1, 2, &peers, 1 << 20)).unwrap();
        let mut buf = vec![1.0f32; 5];
        ring.all_reduce(&mut buf).unwrap();
        buf
    });
    // Rank 1 listens; poke it before rank 0 exists.
    let mut garbage = TcpStream::connect(&addrs[1]).unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut wrong = TcpStream::connect(&addrs[1]).unwrap();
    let hello = Hello {
        rank: 0,
        generation: 0,
        job: "job-a".into(),
    };
    let err = wire::handshake_connect(&mut wrong, b"wrong-secret", &hello).unwrap_err();
    assert!(err.to_string().contains("refused"), "{err}");
    let mut stale = TcpStream::connect(&addrs[1]).unwrap();
    let old = Hello {
        rank: 0,
        generation: 7,
        job: "job-a".into(),
    };
    assert!(
        wire::handshake_connect(&mut stale, SECRET, &old).is_err(),
        "another generation must be refused"
    );
    let peers = addrs.clone();
    let rank0 = std::thread::spawn(move || {
        let mut ring = TcpRing::start(Some(l0), config(0, 2, &peers, 1 << 20)).unwrap();
        let mut buf = vec![2.0f32; 5];
        ring.all_reduce(&mut buf).unwrap();
        buf
    });
    assert_eq!(rank0.join().unwrap(), vec![3.0; 5]);
    assert_eq!(rank1.join().unwrap(), vec![3.0; 5]);
}

/// A rank that stops taking part becomes a typed error naming it on its
/// neighbour within the timeout, not a hang.
#[test]
fn silent_peer_is_an_error_within_the_timeout() {
    let (ls, addrs) = listeners(2);
    let mut it = ls.into_iter();
    let (l0, l1) = (it.next().unwrap(), it.next().unwrap());
    let peers = addrs.clone();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rank1 = std::thread::spawn(move || {
        let ring = TcpRing::start(Some(l1), config(1, 2, &peers, 1 << 20)).unwrap();
        // Joins the ring, then never calls a collective until told.
        let _ = rx.recv();
        drop(ring);
    });
    let mut cfg = config(0, 2, &addrs, 1 << 20);
    cfg.timeout = Duration::from_millis(1500);
    let mut ring0 = TcpRing::start(Some(l0), cfg).unwrap();
    let started = Instant::now();
    let mut buf = vec![1.0f32; 1000];
    let err = ring0.all_reduce(&mut buf).unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(err, CommError::Timeout { rank: 1, .. }), "{err:?}");
    assert!(err.to_string().contains("rank 1"), "{err}");
    assert!(
        waited >= Duration::from_millis(1400) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    // The ring stays failed: later calls fail at once with the same cause.
    assert_eq!(ring0.all_reduce(&mut vec![0.0; 3]).unwrap_err(), err);
    tx.send(()).unwrap();
    rank1.join().unwrap();
}

/// A rank that closes its ring mid-job: the others fail naming it.
#[test]
fn vanished_peer_is_named_by_every_other_rank() {
    let results = with_ring(3, 1 << 20, |rank, ring| {
        let mut buf = input(rank, 100);
        ring.all_reduce(&mut buf).unwrap();
        if rank == 1 {
            // Leave: sockets close (as a killed process's would).
            return None;
        }
        let mut buf = input(rank, 100_000);
        let started = Instant::now();
        let err = ring.all_reduce(&mut buf).unwrap_err();
        Some((err, started.elapsed()))
    });
    for (rank, r) in results.into_iter().enumerate() {
        if let Some((err, took)) = r {
            assert_eq!(err.lost_rank(), Some(1), "rank {rank}: {err}");
            assert!(err.to_string().contains("rank 1"), "rank {rank}: {err}");
            assert!(took < Duration::from_secs(5), "rank {rank} took {took:?}");
        }
    }
}

/// The sync step's path: buckets reduced in place on the caller's memory,
/// staged in before and out after, in order, with every bucket's sum exact.
#[test]
fn bucketed_in_place_all_reduce_sums_and_stages_in_order() {
    for world in [2, 3] {
        let out = with_ring(world, 4096, move |rank, ring| {
            let mut mem = input(rank, 10_000);
            let sizes = [3usize, 4_000, 1, 5_996];
            let mut parts: Vec<&mut [f32]> = Vec::new();
            let mut rest = &mut mem[..];
            for n in sizes {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
                parts.push(head);
                rest = tail;
            }
            let mut events = Vec::new();
            let log = std::cell::RefCell::new(&mut events);
            ring.all_reduce_buckets(
                &mut parts,
                &mut |i, b: &mut [f32]| {
                    log.borrow_mut().push(format!("in {i} {}", b.len()));
                    Ok(())
                },
                &mut |i, b: &mut [f32]| {
                    log.borrow_mut().push(format!("out {i} {}", b.len()));
                    Ok(())
                },
            )
            .unwrap();
            (mem, events)
        });
        let want: Vec<f32> = (0..10_000)
            .map(|i| (0..world).map(|r| input(r, 10_000)[i]).sum())
            .collect();
        for (rank, (got, events)) in out.into_iter().enumerate() {
            assert_eq!(got, want, "W={world} rank {rank}");
            let ins: Vec<_> = events.iter().filter(|e| e.starts_with("in")).collect();
            let outs: Vec<_> = events.iter().filter(|e| e.starts_with("out")).collect();
            assert_eq!(ins, ["in 0 3", "in 1 4000", "in 2 1", "in 3 5996"]);
            assert_eq!(outs, ["out 0 3", "out 1 4000", "out 2 1", "out 3 5996"]);
        }
    }
}

/// A stage that fails stops the sync step with its error; buckets already
/// handed to the ring are collected first and the ring stays usable.
#[test]
fn failing_stage_is_reported_after_posted_buckets_return() {
    let out = with_ring(2, 4096, |rank, ring| {
        let mut a = input(rank, 100);
        let mut b = input(rank, 100);
        let err = {
            let mut parts: Vec<&mut [f32]> = vec![&mut a, &mut b];
            ring.all_reduce_buckets(
                &mut parts,
                &mut |i, _: &mut [f32]| {
                    if i == 1 {
                        Err(accrue_worker::Error::StateSync("stage 1 failed".into()))
                    } else {
                        Ok(())
                    }
                },
                &mut |_, _: &mut [f32]| Ok(()),
            )
            .unwrap_err()
        };
        // Bucket 0 went round on both ranks; the ring still works.
        let mut again = vec![1.0f32; 10];
        ring.all_reduce(&mut again).unwrap();
        (err.to_string(), a, again)
    });
    for (err, a, again) in out {
        assert!(err.contains("stage 1 failed"), "{err}");
        let want: Vec<f32> = (0..100)
            .map(|i| input(0, 100)[i] + input(1, 100)[i])
            .collect();
        assert_eq!(a, want);
        assert_eq!(again, vec![2.0f32; 10]);
    }
}

/// Root `root`'s bytes for a broadcast of `len` (distinct per root).
fn bytes_of(root: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131 + root * 17 + i / 256) % 256) as u8)
        .collect()
}

#[test]
fn broadcast_bytes_moves_any_length_from_every_root() {
    // Frames of 4 bytes split even the 8-byte length; 1_000_003 bytes is an
    // odd tail in 64 KiB frames.
    for (len, max_frame) in [(0, 64), (1, 64), (13, 4), (1_000_003, 1 << 16)] {
        let world = 3;
        let results = with_ring(world, max_frame, move |rank, ring| {
            let mut got = Vec::new();
            for root in 0..world {
                // Non-roots start with a buffer of another length and content.
                let mut buf = if rank == root {
                    bytes_of(root, len)
                } else {
                    vec![0xa5; 5]
                };
                ring.broadcast_bytes(&mut buf, root).unwrap();
                got.push(buf);
            }
            ring_barrier(ring);
            got
        });
        for (rank, got) in results.iter().enumerate() {
            for (root, buf) in got.iter().enumerate() {
                assert_eq!(buf.len(), len, "len {len} root {root} rank {rank}");
                assert!(
                    *buf == bytes_of(root, len),
                    "len {len}: rank {rank} got other bytes from root {root}"
                );
            }
        }
    }
}

#[test]
fn a_job_id_too_long_for_the_hello_is_refused_before_connecting() {
    let (mut ls, addrs) = listeners(2);
    let mut cfg = config(0, 2, &addrs, 64);
    cfg.job = "j".repeat(wire::MAX_JOB_ID + 1);
    let err = TcpRing::start(ls.pop(), cfg)
        .err()
        .expect("must be refused");
    assert_eq!(
        err,
        CommError::Wire(wire::WireError::TooLong {
            what: "job id",
            len: wire::MAX_JOB_ID + 1,
            limit: wire::MAX_JOB_ID,
        })
    );
}

/// A listener that accepts connections and never says a word (a peer whose
/// data port is open but whose process hangs, or a port something else
/// holds): the connections are kept open until the returned flag is set.
fn black_hole() -> (String, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let stop = done.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            match l.accept() {
                Ok((s, _)) => held.push(s),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    (addr, done)
}

/// A port nothing listens on (connections are refused).
fn closed_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// The rendezvous is bounded by connect_timeout whatever the other rank
/// does: a peer that accepts and never answers the hello, or a port that
/// refuses, is a setup error once the timeout has passed, not a hang (the
/// handshake's own 10 s read limit used to come on top of it).
#[test]
fn a_rendezvous_with_an_unanswering_peer_fails_within_connect_timeout() {
    let (hole, stop) = black_hole();
    for (what, peer) in [("a silent peer", hole), ("a closed port", closed_port())] {
        let l = bind("127.0.0.1:0").unwrap();
        let me = l.local_addr().unwrap().to_string();
        let mut cfg = config(0, 2, &[me, peer], 64);
        cfg.connect_timeout = Duration::from_secs(1);
        let started = Instant::now();
        let err = TcpRing::start(Some(l), cfg).err().expect("cannot form");
        let took = started.elapsed();
        eprintln!("{what}: failed after {took:?}: {err}");
        assert!(matches!(err, CommError::Setup(_)), "{what}: {err:?}");
        assert!(err.to_string().contains("rank 1"), "{what}: {err}");
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(4),
            "{what}: the rendezvous ended after {took:?} (connect_timeout 1 s)"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Many idle connections on a rank's data port (no hello ever sent): at
/// most `max_pending_handshakes` of them get a handshake thread, the rest
/// are closed at once, the ones in progress are cut at the handshake
/// deadline, and the real ring forms meanwhile with all of them still open
/// on the client side.
#[test]
fn idle_connections_are_bounded_and_the_ring_still_forms() {
    const IDLE: usize = 200;
    let (mut ls, addrs) = listeners(2);
    let (l1, l0) = (ls.pop().unwrap(), ls.pop().unwrap());
    let ring_cfg = |rank| {
        let mut c = config(rank, 2, &addrs, 1 << 20);
        c.connect_timeout = Duration::from_secs(30);
        c.handshake_timeout = Duration::from_secs(1);
        c
    };
    let cfg0 = ring_cfg(0);
    let limit = cfg0.max_pending_handshakes;
    assert_eq!(limit, accrue_worker::comm::ring::MAX_PENDING_HANDSHAKES);
    let rank0 = std::thread::spawn(move || {
        let mut ring = TcpRing::start(Some(l0), cfg0).unwrap();
        let mut buf = vec![2.0f32; 5];
        ring.all_reduce(&mut buf).unwrap();
        buf
    });
    let mut idle: Vec<TcpStream> = (0..IDLE)
        .map(|_| {
            let s = TcpStream::connect(&addrs[0]).unwrap();
            s.set_nonblocking(true).unwrap();
            s
        })
        .collect();
    // Rank 1 joins while the idle connections hold every place.
    let cfg1 = ring_cfg(1);
    let formed = Instant::now();
    let rank1 = std::thread::spawn(move || {
        let mut ring = TcpRing::start(Some(l1), cfg1).unwrap();
        let took = formed.elapsed();
        let mut buf = vec![1.0f32; 5];
        ring.all_reduce(&mut buf).unwrap();
        (buf, took)
    });
    // Until the server has closed every idle connection (refused at once,
    // or cut at the deadline), count the handshake threads.
    let mut most = 0;
    let mut refused_at_once = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        most = most.max(threads_named("accrue-ring-han"));
        let closed = idle.iter_mut().map(closed_by_peer).filter(|&c| c).count();
        if closed >= IDLE - limit && refused_at_once.is_none() {
            refused_at_once = Some(formed.elapsed());
        }
        if closed == IDLE {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{closed} of {IDLE} idle connections closed after 30 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let (sum1, took) = rank1.join().unwrap();
    assert_eq!(sum1, vec![3.0; 5]);
    assert_eq!(rank0.join().unwrap(), vec![3.0; 5]);
    eprintln!(
        "at most {most} handshake threads for {IDLE} idle connections; {} refused after {:?}; the ring formed after {took:?}",
        IDLE - limit,
        refused_at_once.unwrap()
    );
    // Other tests of this binary run meanwhile and may hold a few.
    assert!(
        most > 0 && most <= limit + 8,
        "{most} handshake threads at once (limit {limit})"
    );
    assert!(took < Duration::from_secs(15), "the ring took {took:?}");
}

/// A client that sends its hello a byte at a time (each read well within
/// any per-read timeout) is cut when the handshake's deadline passes.
#[test]
fn a_slow_handshake_is_cut_at_its_deadline() {
    use std::io::Write as _;
    let l = bind("127.0.0.1:0").unwrap();
    let me = l.local_addr().unwrap().to_string();
    let mut cfg = config(1, 2, &[closed_port(), me.clone()], 64);
    cfg.connect_timeout = Duration::from_secs(3);
    cfg.handshake_timeout = Duration::from_secs(1);
    let rank1 = std::thread::spawn(move || TcpRing::start(Some(l), cfg).err());
    let mut s = TcpStream::connect(&me).unwrap();
    s.set_nonblocking(true).unwrap();
    let hello = Hello {
        rank: 0,
        generation: 0,
        job: "job-a".into(),
    }
    .encode(&[0; wire::NONCE_LEN])
    .unwrap();
    // The hello, then a proof, a byte every 100 ms: about 6 s in all.
    let bytes: Vec<u8> = hello.into_iter().chain([0u8; 32]).collect();
    let started = Instant::now();
    let mut cut = None;
    for b in bytes {
        if closed_by_peer(&mut s) || s.write_all(&[b]).is_err() {
            cut = Some(started.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let cut = cut.expect("the slow handshake was never cut");
    eprintln!("a byte-at-a-time handshake was cut after {cut:?}");
    assert!(cut < Duration::from_secs(4), "cut after {cut:?}");
    assert!(rank1.join().unwrap().is_some());
}

// ---- Data-plane security: per-generation keys, nonces both ways --------

use accrue_common::ringkey::derive_ring_key;
use std::io::Read;

const MASTER: [u8; 32] = [0x5a; 32];
const JOB: &str = "job-s";
const GENERATION: u64 = 5;

/// A rank of generation 5 of JOB, keyed as the coordinator would key it.
fn keyed(rank: usize, peers: &[String]) -> RingConfig {
    let key = derive_ring_key(&MASTER, JOB, GENERATION).to_vec();
    let mut c = RingConfig::new(JOB, rank, 2, peers.to_vec(), key);
    c.generation = GENERATION;
    c.timeout = Duration::from_secs(10);
    c.connect_timeout = Duration::from_secs(20);
    c.handshake_timeout = Duration::from_secs(5);
    c
}

/// Reads what the peer sends until it closes (or 5 s pass: then None).
fn read_until_closed(s: &mut TcpStream) -> Option<Vec<u8>> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(got),
            Err(_) => return None,
        }
    }
}

/// Connects to `addr` and runs a client handshake with `key` and `hello`;
/// returns its error and what the acceptor sent after it (the connection
/// must then be closed).
fn forged(addr: &str, key: &[u8], hello: &Hello) -> (String, Option<Vec<u8>>) {
    let mut s = TcpStream::connect(addr).unwrap();
    let err = wire::handshake_connect(&mut s, key, hello)
        .expect_err("a forged handshake must be refused")
        .to_string();
    // Whatever we send now is never read as a frame: the acceptor closed.
    let frame = wire::Header {
        kind: wire::Kind::Data,
        job_tag: wire::job_tag(JOB),
        generation: GENERATION,
        seq: 0,
        len: 8,
    };
    let _ = s
        .write_all(&frame.encode())
        .and_then(|_| s.write_all(&[1; 8]));
    (err, read_until_closed(&mut s))
}

/// Outsiders on rank 1's data port: a wrong key, the previous
/// generation's key (with this generation's hello and with its own), a
/// hello for another job, a frame header announcing 1 TiB instead of a
/// hello, and a hello announcing a 65 535-byte job id. Each is refused and
/// its connection closed before anything past the handshake is read; the
/// real ranks then form the ring and all-reduce correctly.
#[test]
fn forged_handshakes_are_refused_and_the_ring_still_forms() {
    let (mut ls, addrs) = listeners(2);
    let (l1, l0) = (ls.pop().unwrap(), ls.pop().unwrap());
    let peers = addrs.clone();
    let rank1 = std::thread::spawn(move || {
        let mut ring = TcpRing::start(Some(l1), keyed(1, &peers)).unwrap();
        let mut buf = vec![1.0f32; 5];
        ring.all_reduce(&mut buf).unwrap();
        buf
    });
    let hello = |job: &str, generation| Hello {
        rank: 0,
        generation,
        job: job.into(),
    };
    let previous = derive_ring_key(&MASTER, JOB, GENERATION - 1);
    let other_job = derive_ring_key(&MASTER, "job-t", GENERATION);
    let cases: [(&str, &[u8], Hello, &str); 4] = [
        (
            "a wrong key",
            b"wrong-key",
            hello(JOB, GENERATION),
            "refused",
        ),
        (
            "the previous generation's key",
            &previous,
            hello(JOB, GENERATION),
            "refused",
        ),
        (
            "the previous generation's key and hello",
            &previous,
            hello(JOB, GENERATION - 1),
            "refused",
        ),
        (
            "another job's hello and key",
            &other_job,
            hello("job-t", GENERATION),
            "refused",
        ),
    ];
    for (what, key, hello, want) in cases {
        let (err, after) = forged(&addrs[1], key, &hello);
        assert!(err.contains(want), "{what}: {err}");
        // The verdict was the last byte: closed, nothing more sent.
        assert_eq!(after, Some(vec![]), "{what}: not closed after the refusal");
    }
    // A frame header where the hello belongs.
    let huge = wire::Header {
        kind: wire::Kind::Data,
        job_tag: wire::job_tag(JOB),
        generation: GENERATION,
        seq: 0,
        len: 1 << 40,
    };
    // A hello announcing a job id longer than any allowed.
    let mut long = hello(JOB, GENERATION)
        .encode(&[1; wire::NONCE_LEN])
        .unwrap();
    long.truncate(wire::HELLO_FIXED_LEN);
    long[wire::HELLO_FIXED_LEN - 2..].copy_from_slice(&u16::MAX.to_le_bytes());
    for (what, bytes) in [
        ("a 1 TiB frame header", huge.encode().to_vec()),
        ("a 65 535-byte job id", long),
    ] {
        let mut s = TcpStream::connect(&addrs[1]).unwrap();
        s.write_all(&bytes).unwrap();
        let _ = s.write_all(&[0u8; 4096]);
        // Closed without a challenge: nothing past the hello's head was
        // taken for anything.
        assert_eq!(read_until_closed(&mut s), Some(vec![]), "{what}");
    }
    let peers = addrs.clone();
    let rank0 = std::thread::spawn(move || {
        let mut ring = TcpRing::start(Some(l0), keyed(0, &peers)).unwrap();
        let mut buf = vec![2.0f32; 5];
        ring.all_reduce(&mut buf).unwrap();
        buf
    });
    assert_eq!(rank0.join().unwrap(), vec![3.0; 5]);
    assert_eq!(rank1.join().unwrap(), vec![3.0; 5]);
}

/// A TCP proxy from a port of its own to `to`, recording the bytes the
/// client sends (the wire an eavesdropper sees).
fn recording_proxy(to: String) -> (String, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    use std::sync::{Arc, Mutex};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let rec = seen.clone();
    std::thread::spawn(move || {
        let Ok((mut client, _)) = l.accept() else {
            return;
        };
        let Ok(mut server) = TcpStream::connect(&to) else {
            return;
        };
        let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut s2, &mut c2);
            let _ = c2.shutdown(std::net::Shutdown::Write);
        });
        let mut buf = [0u8; 4096];
        loop {
            match client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    rec.lock().unwrap().extend_from_slice(&buf[..n]);
                    if server.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = server.shutdown(std::net::Shutdown::Write);
    });
    (addr, seen)
}

/// Rank 0 reaches rank 1 through a proxy that records the wire. The
/// recorded handshake (hello and proof), replayed to rank 1 while the
/// ring runs, is refused (verdict 0, closed) because rank 1's challenge
/// is fresh; the ring goes on reducing.
#[test]
fn a_replayed_handshake_is_refused_while_the_ring_runs() {
    let (mut ls, addrs) = listeners(2);
    let (l1, l0) = (ls.pop().unwrap(), ls.pop().unwrap());
    let (proxy, seen) = recording_proxy(addrs[1].clone());
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let peers = addrs.clone();
    let rank1 = std::thread::spawn(move || {
        let mut ring = TcpRing::start(Some(l1), keyed(1, &peers)).unwrap();
        let mut sums = Vec::new();
        for round in 0..2 {
            let mut buf = vec![1.0f32 + round as f32; 5];
            ring.all_reduce(&mut buf).unwrap();
            sums.push(buf);
        }
        sums
    });
    let via_proxy = vec![addrs[0].clone(), proxy];
    let rank0 = std::thread::spawn(move || {
        let mut ring = TcpRing::start(Some(l0), keyed(0, &via_proxy)).unwrap();
        let mut sums = Vec::new();
        for round in 0..2 {
            if round == 1 {
                // The replay happens between the two all-reduces.
                go_rx.recv().unwrap();
            }
            let mut buf = vec![2.0f32 + round as f32; 5];
            ring.all_reduce(&mut buf).unwrap();
            sums.push(buf);
        }
        sums
    });
    let handshake_len = wire::HELLO_FIXED_LEN + JOB.len() + wire::PROOF_LEN;
    let limit = Instant::now() + Duration::from_secs(20);
    while seen.lock().unwrap().len() < handshake_len {
        assert!(
            Instant::now() < limit,
            "rank 0's handshake never crossed the proxy"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let captured = seen.lock().unwrap()[..handshake_len].to_vec();
    let (hello, proof) = captured.split_at(handshake_len - wire::PROOF_LEN);
    let mut s = TcpStream::connect(&addrs[1]).unwrap();
    s.write_all(hello).unwrap();
    let mut challenge = [0u8; wire::NONCE_LEN];
    s.read_exact(&mut challenge).unwrap();
    s.write_all(proof).unwrap();
    let _ = s.write_all(&[0u8; 64]);
    assert_eq!(
        read_until_closed(&mut s),
        Some(vec![0]),
        "the replay must get verdict 0 and a closed connection"
    );
    go_tx.send(()).unwrap();
    let want = vec![vec![3.0f32; 5], vec![5.0f32; 5]];
    assert_eq!(rank0.join().unwrap(), want);
    assert_eq!(rank1.join().unwrap(), want);
}

/// A peer that holds the key but sends a data frame announcing more than
/// `max_frame_bytes`: the receiving rank fails at the header, a protocol
/// error naming the limit, without waiting for the payload (none is sent:
/// waiting would be a 10 s timeout), and the link is closed when the ring
/// is dropped.
#[test]
fn an_oversized_frame_fails_the_link_before_its_payload() {
    let l0 = bind("127.0.0.1:0").unwrap();
    let fake_l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peers = vec![
        l0.local_addr().unwrap().to_string(),
        fake_l.local_addr().unwrap().to_string(),
    ];
    let key = derive_ring_key(&MASTER, JOB, GENERATION);
    // The fake rank 1: accepts rank 0 (its previous rank) ...
    let accepted = std::thread::spawn(move || {
        let (mut s, _) = fake_l.accept().unwrap();
        wire::handshake_accept(&mut s, &key, JOB, GENERATION, 0).unwrap();
        s
    });
    let cfg = keyed(0, &peers);
    let max = cfg.max_frame_bytes as u64;
    let rank0 = std::thread::spawn(move || {
        let mut ring = TcpRing::start(Some(l0), cfg).unwrap();
        let started = Instant::now();
        let err = ring.all_reduce(&mut vec![1.0f32; 8]).unwrap_err();
        (err, started.elapsed(), ring)
    });
    // ... and connects to rank 0 (its next), as rank 1 of generation 5.
    let mut to0 = TcpStream::connect(&peers[0]).unwrap();
    let hello = Hello {
        rank: 1,
        generation: GENERATION,
        job: JOB.into(),
    };
    wire::handshake_connect(&mut to0, &key, &hello).unwrap();
    let _from0 = accepted.join().unwrap();
    let huge = wire::Header {
        kind: wire::Kind::Data,
        job_tag: wire::job_tag(JOB),
        generation: GENERATION,
        seq: 0,
        len: max + 1,
    };
    to0.write_all(&huge.encode()).unwrap();
    let (err, took, ring) = rank0.join().unwrap();
    assert!(
        matches!(err, CommError::Protocol { rank: 1, .. }),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains(&format!("exceeds the limit of {max} bytes")),
        "{err}"
    );
    assert!(
        took < Duration::from_secs(5),
        "took {took:?}: it waited for a payload"
    );
    drop(ring);
    // Rank 0 answers with an abort naming us and closes.
    assert!(
        read_until_closed(&mut to0).is_some(),
        "the link stayed open"
    );
}

/// ZeRO (issue 17): reduce-scatter leaves rank r with slice r summed;
/// after each rank changes its slice, all-gather gives every rank every
/// slice; together they put on the wire what one all-reduce does
/// (2(W-1)/W of the buffer), as the byte counters show.
#[test]
fn reduce_scatter_then_all_gather_shard_and_cost_one_all_reduce() {
    use accrue_worker::comm::shard::{shard_send_elems, slice};
    use accrue_worker::Collective;
    const LENS: [usize; 6] = [0, 1, 2, 7, 1001, 10_000];
    for world in [2, 3, 4] {
        // One ring per W (few handshakes: another test counts them).
        let results = with_ring(world, 1 << 20, move |rank, ring| {
            LENS.map(|len| {
                let before = ring.bytes().0;
                let mut buf = input(rank, len);
                ring.reduce_scatter(&mut buf).unwrap();
                let reduced = buf[slice(len, world, rank)].to_vec();
                for v in &mut buf[slice(len, world, rank)] {
                    *v = *v * 2.0 + rank as f32;
                }
                ring.all_gather(&mut buf).unwrap();
                (reduced, buf, ring.bytes().0 - before)
            })
        });
        for (i, len) in LENS.into_iter().enumerate() {
            let sum: Vec<f32> = (0..len)
                .map(|i| (0..world).map(|r| input(r, len)[i]).sum())
                .collect();
            let mut want = sum.clone();
            for r in 0..world {
                for v in &mut want[slice(len, world, r)] {
                    *v = *v * 2.0 + r as f32;
                }
            }
            // One frame per chunk.
            let frames = 2 * (world - 1) as u64;
            for (rank, per_len) in results.iter().enumerate() {
                let (reduced, gathered, sent) = &per_len[i];
                let s = slice(len, world, rank);
                assert_eq!(reduced, &sum[s], "W={world} len={len} rank {rank}");
                assert_eq!(gathered, &want, "W={world} len={len} rank {rank}");
                let want_sent =
                    4 * shard_send_elems(len, world, rank) as u64 + frames * HEADER_LEN as u64;
                assert_eq!(*sent, want_sent, "W={world} len={len} rank {rank}");
                if len == 10_000 {
                    let ideal = 2.0 * (world as f64 - 1.0) / world as f64 * (4 * len) as f64;
                    let off = (*sent as f64 - ideal).abs() / ideal;
                    assert!(off < 0.02, "W={world}: {sent} bytes vs the optimum {ideal}");
                }
            }
        }
    }
}
