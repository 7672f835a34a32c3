//! Process groups per mesh axis on both transports (issue 38): four
//! mesh-check processes as a 2 x 2 mesh (data x pipeline) run every group
//! operation against the arithmetic in f32, bf16, f16 and i64, send and
//! receive both ways and wait on asynchronous handles; then one is killed
//! mid-operation, every survivor must fail within the timeout, and the three
//! form the next generation. And a process without the generation's key
//! cannot join a c10d group, and the store's port is bounded against floods.

#[path = "common/flood.rs"]
mod flood;
use accrue_worker::comm::c10d::store::{StoreClient, StoreLimits, StoreServer};
use accrue_worker::comm::c10d::C10dGroup;
use accrue_worker::comm::group::{Group, ReduceOp};
use flood::{closed_by_peer, threads_named};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tch::Tensor;

const TIMEOUT_S: f64 = 4.0;

struct Proc {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    log: std::path::PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn start(rank: usize, backend: &str, dir: &std::path::Path) -> Self {
        let log = dir.join(format!("rank{rank}.log"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_mesh-check"))
            .args([
                "--rank",
                &rank.to_string(),
                "--data",
                "2",
                "--pipeline",
                "2",
            ])
            .args(["--backend", backend, "--timeout-s", &TIMEOUT_S.to_string()])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let stdin = child.stdin.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
            log,
        }
    }

    /// The next line starting with `prefix` (the rest of it), within `limit`.
    fn expect(&mut self, prefix: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l[prefix.len()..].trim().to_string(),
                Ok(l) if l.starts_with("FAIL") => panic!(
                    "{l}\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                ),
                Ok(_) => {}
                Err(_) => panic!(
                    "no `{prefix}` line within {limit:?}; log:\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                ),
            }
        }
    }

    fn say(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }
}

fn mesh_of_four(backend: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut procs: Vec<Proc> = (0..4)
        .map(|r| Proc::start(r, backend, dir.path()))
        .collect();
    let addrs: Vec<String> = procs
        .iter_mut()
        .map(|p| p.expect("LISTEN ", Duration::from_secs(30)))
        .collect();
    for p in procs.iter_mut() {
        p.say(&addrs.join(","));
    }
    for p in procs.iter_mut() {
        p.expect("OPS OK", Duration::from_secs(120));
    }
    for p in procs.iter_mut() {
        p.expect("LOOPING", Duration::from_secs(10));
    }
    // Let the loop run, then kill rank 3 in the middle of an operation.
    std::thread::sleep(Duration::from_millis(300));
    let mut dead = procs.pop().unwrap();
    let killed = Instant::now();
    dead.child.kill().unwrap();
    for (r, p) in procs.iter_mut().enumerate() {
        let lost = p.expect("LOST ", Duration::from_secs_f64(TIMEOUT_S * 3.0 + 10.0));
        let after = killed.elapsed();
        assert!(
            after <= Duration::from_secs_f64(TIMEOUT_S * 2.0 + 5.0),
            "rank {r} noticed the lost peer {after:?} after the kill: {lost}"
        );
    }
    let next: Vec<String> = procs
        .iter_mut()
        .map(|p| p.expect("LISTEN2 ", Duration::from_secs(30)))
        .collect();
    for (r, p) in procs.iter_mut().enumerate() {
        p.say(&format!("{r} {}", next.join(",")));
    }
    for p in procs.iter_mut() {
        assert_eq!(p.expect("REFORMED ", Duration::from_secs(60)), "3");
    }
}

#[test]
fn every_group_operation_on_c10d_and_a_lost_peer() {
    mesh_of_four("c10d");
}

#[test]
fn every_group_operation_on_the_ring_and_a_lost_peer() {
    // The data axis and the world on the ring; the pipeline axis (which
    // needs point-to-point) on c10d.
    mesh_of_four("ring");
}

#[test]
fn a_process_without_the_generation_key_cannot_join_a_c10d_group() {
    let key = b"the generation's key".to_vec();
    let t = Duration::from_secs(5);
    let join = move |addr, k: Vec<u8>, rank: u32, timeout: Duration| {
        std::thread::spawn(move || {
            let client =
                StoreClient::connect(addr, &k, "job", 1, rank, t).map_err(|e| e.to_string())?;
            let g = C10dGroup::gloo(
                Arc::new(Mutex::new(client)),
                "data@0",
                "127.0.0.1",
                rank as usize,
                2,
                timeout,
            )
            .map_err(|e| e.to_string())?;
            let x = Tensor::from_slice(&[rank as f32 + 1.0]);
            let mut g = g;
            g.all_reduce(&x, ReduceOp::Sum)
                .and_then(|p| p.wait())
                .map_err(|e| e.to_string())?;
            Ok::<f64, String>(x.double_value(&[0]))
        })
    };
    // Rank 0 with the key, and a rank 1 with another key: the intruder is
    // refused by the store, so rank 0 never sees a rank 1 and gives up.
    let server = StoreServer::start("127.0.0.1", key.clone(), "job", 1, 2).unwrap();
    let short = Duration::from_secs(3);
    let honest = join(server.addr(), key.clone(), 0, short);
    let intruder = join(server.addr(), b"guessed".to_vec(), 1, short);
    let e = intruder.join().unwrap().unwrap_err();
    assert!(e.contains("refused"), "{e}");
    let e = honest.join().unwrap().unwrap_err();
    assert!(e.contains("c10d group data@0"), "{e}");
    // With the key, two ranks form the group and reduce (a fresh store:
    // the failed attempt's keys stay in the first).
    let server = StoreServer::start("127.0.0.1", key.clone(), "job", 1, 2).unwrap();
    let (a, b) = (
        join(server.addr(), key.clone(), 0, t),
        join(server.addr(), key, 1, t),
    );
    assert_eq!(a.join().unwrap().unwrap(), 3.0);
    assert_eq!(b.join().unwrap().unwrap(), 3.0);
}

/// The c10d store's port under a flood (it used to spawn a thread per
/// connection without limit, each handshake read had its own 10 s
/// timeout): a client dripping its hello a byte at a time is cut at the
/// whole handshake's deadline; 200 idle connections get at most 64
/// handshake threads, the rest closed at once; the job's two ranks still
/// rendezvous, and connections beyond them are refused.
#[test]
fn the_c10d_store_bounds_slow_idle_and_extra_connections() {
    use accrue_worker::comm::c10d::store::{Op, Request};
    use accrue_worker::comm::wire::{Hello, NONCE_LEN};
    use std::net::TcpStream;
    const IDLE: usize = 200;
    let deadline = Duration::from_secs(2);
    let limits = StoreLimits {
        handshake_timeout: deadline,
        ..StoreLimits::default()
    };
    let limit = limits.max_pending_handshakes;
    assert_eq!(limit, 64);
    let key = b"the generation's key".to_vec();
    let server = StoreServer::start_with("127.0.0.1", key.clone(), "job", 1, 2, limits).unwrap();
    let addr = server.addr();

    // A byte every 100 ms: each read is quick, the whole handshake is not.
    let mut slow = TcpStream::connect(addr).unwrap();
    slow.set_nonblocking(true).unwrap();
    let hello = Hello {
        rank: 0,
        generation: 1,
        job: "job#c10d-store".into(),
    }
    .encode(&[0; NONCE_LEN])
    .unwrap();
    let mut drip = hello.into_iter().chain(std::iter::repeat(0u8));
    let started = Instant::now();
    let mut sent = 0;
    let cut = loop {
        if closed_by_peer(&mut slow) {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "a client dripping a byte every 100 ms still held its connection after 8 s"
        );
        if slow.write_all(&[drip.next().unwrap_or(0)]).is_ok() {
            sent += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        cut >= deadline - Duration::from_millis(200) && cut < deadline * 3,
        "the slow client was cut after {cut:?} ({sent} bytes; deadline {deadline:?})"
    );

    // Idle connections: count the store's threads until all are closed.
    let mut idle: Vec<TcpStream> = (0..IDLE)
        .map(|_| {
            let s = TcpStream::connect(addr).unwrap();
            s.set_nonblocking(true).unwrap();
            s
        })
        .collect();
    let flooded = Instant::now();
    let mut most = 0;
    loop {
        most = most.max(threads_named("accrue-c10d-"));
        let closed = idle.iter_mut().map(closed_by_peer).filter(|&c| c).count();
        if closed == IDLE {
            break;
        }
        assert!(
            flooded.elapsed() < Duration::from_secs(20),
            "{closed} of {IDLE} idle connections closed after 20 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let drained = flooded.elapsed();
    eprintln!(
        "slow client cut after {cut:?} ({sent} bytes); at most {most} store threads for {IDLE} \
         idle connections, all closed after {drained:?}"
    );
    // The acceptor and, from other tests of this binary, a few more.
    assert!(
        most > limit / 2 && most <= limit + 8,
        "{most} store threads at once for {IDLE} idle connections (limit {limit})"
    );

    // The job's ranks rendezvous afterwards.
    let t = Duration::from_secs(5);
    let req = |op, key: &str, value: &str| Request {
        op,
        key: key.into(),
        value: value.into(),
        arg: 0,
        timeout_ms: 1000,
    };
    let mut a = StoreClient::connect(addr, &key, "job", 1, 0, t).unwrap();
    a.call(&req(Op::Set, "rank_0", "addr")).unwrap();
    // A second connection of a connected rank is closed after its handshake.
    let dup = StoreClient::connect(addr, &key, "job", 1, 0, t)
        .map_err(|e| e.to_string())
        .and_then(|mut c| c.call(&req(Op::Get, "rank_0", "")));
    assert!(dup.is_err(), "a second rank 0 was served: {dup:?}");
    let mut b = StoreClient::connect(addr, &key, "job", 1, 1, t).unwrap();
    assert_eq!(b.call(&req(Op::Get, "rank_0", "")).unwrap().0, b"addr");
    // Every rank connected: anything more is closed at once, key or not.
    let e = StoreClient::connect(addr, &key, "job", 1, 1, t)
        .err()
        .unwrap();
    assert!(e.to_string().contains("refused"), "{e}");
    let mut extra = TcpStream::connect(addr).unwrap();
    extra.set_nonblocking(true).unwrap();
    let since = Instant::now();
    while !closed_by_peer(&mut extra) {
        assert!(
            since.elapsed() < deadline / 2,
            "a connection beyond the job's ranks was still open after {:?}",
            since.elapsed()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The ranks' connections still work.
    assert_eq!(a.call(&req(Op::Get, "rank_0", "")).unwrap().0, b"addr");
}
