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
        wait_child(&mut self.child, limit)
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
    spawn_rank_with(job, rank, peers, dir, &[])
}

/// [`spawn_rank`] with more arguments for `accrue-worker train`.
pub fn spawn_rank_with(
    job: &Path,
    rank: usize,
    peers: &[String],
    dir: &Path,
    extra: &[&str],
) -> Rank {
    spawn_rank_limited(job, rank, peers, dir, extra, None)
}

/// [`spawn_rank_with`] whose files (its logs included) may grow to
/// `file_limit` bytes at most (RLIMIT_FSIZE, SIGXFSZ ignored): a longer
/// write fails with EFBIG, as a full disk would fail that rank alone.
pub fn spawn_rank_limited(
    job: &Path,
    rank: usize,
    peers: &[String],
    dir: &Path,
    extra: &[&str],
    file_limit: Option<u64>,
) -> Rank {
    let world = peers.len();
    let secret = dir.join("secret");
    if !secret.exists() {
        std::fs::write(&secret, "s3cret-for-tests\n").unwrap();
    }
    let stdout = dir.join(format!("rank{rank}.out"));
    let stderr = dir.join(format!("rank{rank}.log"));
    let mut command = Command::new(env!("CARGO_BIN_EXE_accrue-worker"));
    if let Some(limit) = file_limit {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec the closure calls only signal and
        // setrlimit, both async-signal-safe, and touches no shared state.
        unsafe {
            command.pre_exec(move || {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                let r = libc::rlimit {
                    rlim_cur: limit,
                    rlim_max: limit,
                };
                match libc::setrlimit(libc::RLIMIT_FSIZE, &r) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                }
            });
        }
    }
    let child = command
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
        .args(extra)
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

/// Writes `text` to `dir/job.toml` and runs `world` ranks of it to the
/// end: ranks 1.. first, then `before_rank0` (given the peers), then rank
/// 0. Panics, with the rank's log, when a rank fails or runs past 120 s.
/// The peers' ports were free when picked, but another test may take one
/// before its rank binds it: a launch that failed so ("Address already in
/// use") runs again on fresh ports, twice at most.
pub fn run_ranks(
    dir: &Path,
    text: &str,
    world: usize,
    before_rank0: impl FnMut(&[String]),
) -> Vec<Rank> {
    run_ranks_with(dir, text, world, &[], before_rank0)
}

/// [`run_ranks`] with more arguments for every rank's `accrue-worker train`.
pub fn run_ranks_with(
    dir: &Path,
    text: &str,
    world: usize,
    extra: &[&str],
    mut before_rank0: impl FnMut(&[String]),
) -> Vec<Rank> {
    let job = dir.join("job.toml");
    std::fs::write(&job, text).unwrap();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let peers = free_addrs(world);
        let mut ranks: Vec<Rank> = (1..world)
            .map(|r| spawn_rank_with(&job, r, &peers, dir, extra))
            .collect();
        before_rank0(&peers);
        ranks.insert(0, spawn_rank_with(&job, 0, &peers, dir, extra));
        let mut failed = None;
        for r in &mut ranks {
            let status = r
                .wait(Duration::from_secs(120))
                .unwrap_or_else(|| panic!("rank {} did not finish", r.rank));
            if !status.success() {
                failed = Some(r.rank);
                break;
            }
        }
        let Some(rank) = failed else {
            return ranks;
        };
        let taken = ranks
            .iter()
            .any(|r| r.stderr().contains("Address already in use"));
        if taken && attempt <= 2 {
            eprintln!("a peer's port was taken before its rank bound it: launching again");
            continue;
        }
        panic!("rank {rank} failed:\n{}", ranks[rank].stderr());
    }
}

/// `python -m torch.distributed.run` (torchrun) running `script` on
/// `nproc` local ranks, its rendezvous on a loopback port that was free a
/// moment ago; its own output goes to `dir/torchrun.log`. The script writes
/// its pid to `dir/*.pid` files. Dropping it stops torchrun and its
/// workers.
pub struct Torchrun {
    pub child: Child,
    pub dir: PathBuf,
    pub log: PathBuf,
}

impl Torchrun {
    pub fn start(python: &Path, script: &Path, nproc: usize, dir: &Path, args: &[&str]) -> Self {
        let port = free_addrs(1)[0].rsplit(':').next().unwrap().to_string();
        let log = dir.join("torchrun.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(python)
            .args(["-m", "torch.distributed.run", "--nproc-per-node"])
            .arg(nproc.to_string())
            .args(["--master-addr", "127.0.0.1", "--master-port", &port])
            .arg(script)
            .args(args)
            .env("GLOO_SOCKET_IFNAME", "lo")
            .env("OMP_NUM_THREADS", "1")
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap();
        Self {
            child,
            dir: dir.to_path_buf(),
            log,
        }
    }

    /// Polls until torchrun exits or `limit` passes.
    pub fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        wait_child(&mut self.child, limit)
    }

    /// torchrun's log and every rank's log (`*.log` in the folder).
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for e in std::fs::read_dir(&self.dir).unwrap().flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "log") {
                out += &format!(
                    "--- {}\n{}\n",
                    p.display(),
                    std::fs::read_to_string(&p).unwrap_or_default()
                );
            }
        }
        out
    }
}

impl Drop for Torchrun {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SIGTERM: torchrun stops its workers (each in a session of its
            // own, so not reached by a signal to torchrun's group) itself.
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            if self.wait(Duration::from_secs(10)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        // Workers torchrun could not stop: their pid files, checked
        // against /proc so that a reused pid is left alone.
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.extension().is_none_or(|x| x != "pid") {
                continue;
            }
            let Some(pid) = std::fs::read_to_string(&p)
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
            else {
                continue;
            };
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let ours = self.dir.display().to_string();
            if String::from_utf8_lossy(&cmdline).contains(&ours) {
                // SAFETY: kill(2) on a process running our script.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
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

/// Polls until `child` exits or `limit` passes.
fn wait_child(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
