//! Slow readers of a job's events: a watcher that falls behind gets a
//! fresh snapshot of its job and goes on, and nothing a reader does stops
//! the job. The coordinator keeps few events for its watchers here
//! (`ACCRUE_WATCH_BUFFER`) so that a reader falls behind quickly.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// Job events `accrue local`'s coordinator keeps for its watchers here.
const WATCH_BUFFER: &str = "16";

/// Polls `cond` every `every` until it holds or `limit` passes.
fn poll_until(limit: Duration, every: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(every);
    }
    cond()
}

/// A child process, killed on drop (`accrue local`'s workers go with it).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `accrue local JOB --workers 1 --threads 1 --state-dir STATE`, with a
/// small watch buffer, its stderr in `stderr` and its stdout as `stdout`
/// says.
fn local(job: &Path, state: &Path, stdout: Stdio, stderr: &Path) -> Killed {
    let child = Command::new(env!("CARGO_BIN_EXE_accrue"))
        .arg("local")
        .arg(job)
        .args(["--workers", "1", "--threads", "1", "--state-dir"])
        .arg(state)
        .env("ACCRUE_WATCH_BUFFER", WATCH_BUFFER)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(std::fs::File::create(stderr).unwrap())
        .spawn()
        .unwrap();
    Killed(child)
}

/// `PROGRAM ARGS...` as a second shell runs it: `source ENV` first, no
/// ACCRUE_* variable of this process inherited.
fn from_env(env: &Path, program: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(r#"source "$1" && shift && exec "$@""#)
        .arg("sh")
        .arg(env)
        .arg(program)
        .args(args)
        .stdin(Stdio::null());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("ACCRUE_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// `accrue status JOB` through the run's env file: its output.
fn status(env: &Path, job: &str) -> String {
    let out = from_env(
        env,
        Path::new(env!("CARGO_BIN_EXE_accrue")),
        &["status", job],
    )
    .output()
    .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `accrue local job.toml | (wait; cat)`: its stdout is not read until its
/// job has ended, far behind the events its watch was sent. It still
/// prints the job's end and exits 0: the coordinator sent its lagging
/// watch a fresh snapshot (the job had ended) instead of ending it with
/// DATA_LOSS, which stopped the run and exited 2.
#[test]
fn a_local_run_whose_output_is_not_read_finishes_and_exits_0() {
    // More steps than the pipe, the HTTP/2 windows and the watch buffer
    // hold (thousands of steps a second).
    const STEPS: u64 = 20_000;
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    let job = common::write(d.path(), "job.toml", &common::job_toml("lag", 1, STEPS, ""));
    let stderr = d.path().join("local.stderr");
    let mut run = local(&job, &state, Stdio::piped(), &stderr);
    let mut out = run.0.stdout.take().unwrap();
    let env = state.join("env");
    let report = |stdout: &str| {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            stdout,
            std::fs::read_to_string(&stderr).unwrap_or_default()
        )
    };
    // Not a byte read until the job has ended.
    let ended = poll_until(Duration::from_secs(180), Duration::from_millis(250), || {
        env.exists() && status(&env, "lag-1").contains("state      succeeded")
    });
    assert!(ended, "the job did not succeed\n{}", report(""));
    // Now read on, to the end.
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let mut exit = None;
    poll_until(Duration::from_secs(60), Duration::from_millis(20), || {
        exit = run.0.try_wait().unwrap();
        exit.is_some()
    });
    let stdout = if exit.is_some() {
        reader.join().unwrap()
    } else {
        String::new()
    };
    let exit = exit.unwrap_or_else(|| panic!("accrue local did not exit\n{}", report("")));
    assert!(exit.success(), "{exit}\n{}", report(&stdout));
    assert!(
        stdout.contains(&format!("lag-1 succeeded: step {STEPS}/{STEPS}")),
        "{}",
        report(&stdout)
    );
    let log = std::fs::read_to_string(&stderr).unwrap();
    assert!(
        log.contains("events behind; sent it a fresh snapshot"),
        "the watch never fell behind: raise STEPS\n{}",
        report(&stdout)
    );
}

/// The Python client's `watch()` read slowly (clients/python/tests/
/// watch_lag.py): it falls behind, gets a fresh snapshot and goes on.
#[test]
fn the_python_clients_watch_goes_on_after_falling_behind() {
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    let job = common::write(
        d.path(),
        "job.toml",
        &common::job_toml("pylag", 1, 1_000_000, ""),
    );
    let stdout = d.path().join("local.stdout");
    let stderr = d.path().join("local.stderr");
    let _run = local(
        &job,
        &state,
        std::fs::File::create(&stdout).unwrap().into(),
        &stderr,
    );
    let report = || {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            std::fs::read_to_string(&stdout).unwrap_or_default(),
            std::fs::read_to_string(&stderr).unwrap_or_default()
        )
    };
    let training = poll_until(Duration::from_secs(60), Duration::from_millis(20), || {
        std::fs::read_to_string(&stdout).is_ok_and(|s| s.lines().any(|l| l.starts_with("step ")))
    });
    assert!(training, "the job did not start training\n{}", report());
    let python: PathBuf = common::repo().join(".venv/bin/python");
    let script = common::repo().join("clients/python/tests/watch_lag.py");
    let out = from_env(&state.join("env"), &python, &[])
        .arg(script)
        .arg("pylag-1")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.trim_end().ends_with("ok"),
        "{said}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        report()
    );
}

/// `accrue local job.toml 2>&1 | head -1`: its stdout and stderr are
/// closed after the first line. The job still runs to its end (`accrue
/// status` through the env file says succeeded) and `accrue local` exits
/// 0: a write to a closed pipe panicked in `println!` before, and the
/// workers died with `accrue local`.
#[test]
fn a_local_run_whose_reader_goes_away_finishes_and_exits_0() {
    const STEPS: u64 = 3_000;
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    let job = common::write(
        d.path(),
        "job.toml",
        &common::job_toml("gone", 1, STEPS, ""),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_accrue"))
        .arg("local")
        .arg(&job)
        .args(["--workers", "1", "--threads", "1", "--state-dir"])
        .arg(&state)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let mut run = Killed(child);
    // One byte of stdout, then both pipes closed, as `head -c 1` would.
    let mut first = [0u8; 1];
    out.read_exact(&mut first).unwrap();
    drop(out);
    drop(err);
    let env = state.join("env");
    let mut exit = None;
    let ended = poll_until(Duration::from_secs(180), Duration::from_millis(50), || {
        exit = run.0.try_wait().unwrap();
        exit.is_some()
    });
    assert!(ended, "accrue local did not exit");
    let exit = exit.unwrap();
    assert!(exit.success(), "accrue local: {exit}");
    // Exit 0 is the job's end (`exit_for`: 0 for a succeeded job only).
    assert!(!env.exists(), "the env file outlived the run");
}
