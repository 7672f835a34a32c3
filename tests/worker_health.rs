//! What the kubelet sees of a worker daemon (deploy/base/worker.yaml):
//! - the probe endpoint (`--health-listen`, plain HTTP): /healthz 200 while
//!   the daemon runs; /readyz 200 only while attached to a coordinator, 503
//!   naming why otherwise, and 200 again once a coordinator is back;
//! - SIGTERM (a pod deleted): the daemon detaches and waits, up to
//!   `--stop-timeout`, for its job's thread, so the checkpoint the stopping
//!   rank writes is complete before the process exits.

mod common;

use accrue_proto::v1::{self, JobState};
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

/// `GET path` over plain HTTP/1.0: status code and body.
fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n")?.1.trim().to_string();
    Some((code, body))
}

/// The address the daemon printed (`health ADDR`) into its log.
fn printed_addr(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("health "))
        .map(|a| a.trim().to_string())
}

async fn wait_for(addr: &str, path: &str, want: u16) -> (u16, String) {
    let mut last = None;
    let ok = wait_until(Duration::from_secs(30), || {
        last = get(addr, path);
        last.as_ref().is_some_and(|(c, _)| *c == want)
    })
    .await;
    let last = last.unwrap_or_default();
    assert!(ok, "{path} never answered {want}; last answer {last:?}");
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_attachment_and_healthz_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let coord = coordinator(dir.path()).await;
    let grpc = coord.grpc_addr.to_string();
    let _w = Workers(vec![spawn_worker(
        &grpc,
        "probe-0",
        dir.path(),
        &["--health-listen", "127.0.0.1:0"],
    )]);
    let log = dir.path().join("probe-0.log");
    let mut addr = None;
    assert!(
        wait_until(Duration::from_secs(30), || {
            addr = printed_addr(&log);
            addr.is_some()
        })
        .await,
        "the daemon printed no `health ADDR`; see {}",
        log.display()
    );
    let addr = addr.unwrap();
    assert!(!addr.ends_with(":0"), "the bound port, not 0: {addr}");

    assert_eq!(wait_for(&addr, "/healthz", 200).await.1, "ok");
    let (_, body) = wait_for(&addr, "/readyz", 200).await;
    assert_eq!(body, format!("attached to {grpc}"));
    assert_eq!(get(&addr, "/metrics").map(|(c, _)| c), Some(404));

    // The coordinator goes away: not ready (naming why), still alive.
    coord.stop().await;
    let (_, body) = wait_for(&addr, "/readyz", 503).await;
    assert!(
        body.starts_with("re-attaching: ") || body.starts_with("connecting: "),
        "{body}"
    );
    assert!(body.contains(&grpc), "names the coordinator: {body}");
    assert_eq!(get(&addr, "/healthz"), Some((200, "ok".into())));

    // A coordinator on the same address again: ready again by itself.
    let cfg = accrue_coordinator::Config {
        state_dir: dir.path().join("state"),
        heartbeat_ttl: Duration::from_secs(3),
        tls: Some(creds().server_tls()),
        tokens: Some(creds().tokens_file()),
        ..Default::default()
    };
    let again = accrue_coordinator::start(cfg, &grpc, "127.0.0.1:0")
        .await
        .unwrap();
    assert_eq!(
        wait_for(&addr, "/readyz", 200).await.1,
        format!("attached to {grpc}")
    );
    again.stop().await;
}

#[test]
fn without_the_flag_nothing_listens_and_a_busy_port_stops_the_daemon() {
    // The flag is off by default: `--help` documents it, and a daemon given
    // a port that is taken exits at once naming the flag.
    let help = std::process::Command::new(worker_bin())
        .args(["daemon", "--help"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("--health-listen <ADDR>"));
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = std::process::Command::new(worker_bin())
        .args(["daemon", "--coordinator", "127.0.0.1:1", "--id", "busy"])
        .args(creds().worker_args("busy"))
        .args(["--health-listen", &addr])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("--health-listen {addr}: cannot listen")),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_detaches_and_waits_for_the_job_thread_to_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let coord = coordinator(dir.path()).await;
    let grpc = coord.grpc_addr.to_string();
    // Slow micro-steps: the job is mid-window when SIGTERM comes.
    let mut w = Workers(vec![spawn_worker(
        &grpc,
        "term-0",
        dir.path(),
        &["--micro-step-delay-ms", "150", "--stop-timeout", "20"],
    )]);
    let mut c = client(&grpc).await;
    let ckpt = dir.path().join("ckpt");
    let job = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml(
                "term",
                1,
                10_000,
                &format!("[checkpoint]\ndir = {:?}\nevery_steps = 100000\n", ckpt),
            ))),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // Running, with a few steps done (none checkpointed: every 100000).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let j = wait_state(
            &mut c,
            &job.id,
            &[JobState::Running],
            Duration::from_secs(60),
        )
        .await;
        if j.counters.is_some_and(|n| n.step >= 3) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no progress: {j:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !ckpt.join("LATEST").exists(),
        "no checkpoint before the signal"
    );
    let child = &mut w.0[0];
    let t0 = std::time::Instant::now();
    assert_eq!(
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) },
        0
    );
    let mut status = None;
    assert!(
        wait_until(Duration::from_secs(30), || {
            status = child.try_wait().unwrap();
            status.is_some()
        })
        .await,
        "the daemon did not exit after SIGTERM"
    );
    let took = t0.elapsed();
    assert!(status.unwrap().success(), "{status:?}");
    let log = std::fs::read_to_string(dir.path().join("term-0.log")).unwrap();
    assert!(log.contains("detaching from the coordinator"), "{log}");
    assert!(
        log.contains("the job's thread ended"),
        "the daemon waited for its job's thread: {log}"
    );
    // The stopping rank finished its window and wrote its checkpoint before
    // the process exited.
    assert!(
        ckpt.join("LATEST").exists(),
        "a checkpoint at the stop: {log}"
    );
    eprintln!("SIGTERM to exit: {took:?}");
    coord.stop().await;
}
