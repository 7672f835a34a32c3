//! Real worker processes for multi-rank tests: free loopback ports, one log
//! file per process, children killed on drop, waits that poll a condition.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Loopback addresses with ports that were free a moment ago.
pub fn free_addrs(n: usize) -> Vec<String> {
    let ls: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    ls.iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect()
}

pub struct Rank {
    pub rank: usize,
    pub child: Child,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Rank {
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
    /// Polls until the process exits or `limit` passes.
    pub fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    /// The JSON step reports printed so far (with --json).
    pub fn steps(&self) -> Vec<serde_json::Value> {
        self.stdout()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"] == "step")
            .map(|v| v["step"].clone())
            .collect()
    }
}

/// Starts rank `rank` of `world` for `job` with --json output.
pub fn spawn_rank(job: &Path, rank: usize, peers: &[String], dir: &Path) -> Rank {
    let world = peers.len();
    let secret = dir.join("secret");
    if !secret.exists() {
        std::fs::write(&secret, "s3cret-for-tests\n").unwrap();
    }
    let stdout = dir.join(format!("rank{rank}.out"));
    let stderr = dir.join(format!("rank{rank}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
        .arg("train")
        .arg(job)
        .args([
            "--json",
            "--rank",
            &rank.to_string(),
            "--world-size",
            &world.to_string(),
        ])
        .arg("--peers")
        .arg(peers.join(","))
        .arg("--secret-file")
        .arg(&secret)
        .arg("--checkpoint-dir")
        .arg(dir.join("ckpt"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::from(std::fs::File::create(&stdout).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&stderr).unwrap()))
        .spawn()
        .unwrap();
    Rank {
        rank,
        child,
        stdout,
        stderr,
    }
}

/// Polls `cond` until it holds or `limit` passes.
pub fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}
