//! `accrue local`'s lifecycle (issue 27, cases 6 and 7), with the real
//! binaries: one run per state dir (a second run is refused before it
//! changes a byte of the first's), and nothing left running when it is
//! stopped by SIGTERM or SIGHUP, or killed with SIGKILL.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// Polls `cond` every 20 ms until it holds or `limit` passes.
fn poll_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// Live processes (not zombies) whose command line mentions `needle`,
/// as (pid, command line), this test process excluded.
fn processes_mentioning(needle: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        // A zombie (dead, not yet reaped by its new parent) has an empty
        // command line; so has a process gone since read_dir.
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push((pid, cmdline));
        }
    }
    found
}

/// Kills (SIGKILL) every process still mentioning the state dir when the
/// test ends, passed or failed, so a failing run leaves nothing behind.
struct Reaper(String);

impl Drop for Reaper {
    fn drop(&mut self) {
        for (pid, _) in processes_mentioning(&self.0) {
            if let Ok(pid) = libc::pid_t::try_from(pid) {
                // SAFETY: kill(2) only sends a signal.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }
}

/// An `accrue local` process, its stdout and stderr in files, killed on
/// drop.
struct Local {
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Local {
    fn start(dir: &Path, name: &str, job: &Path, state: &Path, extra: &[&Path]) -> Self {
        let mut args = vec![job.as_os_str(), "--workers".as_ref(), "2".as_ref()];
        args.extend(extra.iter().map(|p| p.as_os_str()));
        Self::with_args(dir, name, state, &args)
    }

    /// `accrue local ARGS --threads 1 --state-dir STATE`.
    fn with_args(dir: &Path, name: &str, state: &Path, args: &[&std::ffi::OsStr]) -> Self {
        let (stdout, stderr) = (
            dir.join(format!("{name}.stdout")),
            dir.join(format!("{name}.stderr")),
        );
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_accrue"));
        cmd.arg("local")
            .args(args)
            .args(["--threads", "1", "--state-dir"])
            .arg(state)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap());
        Self {
            child: cmd.spawn().unwrap(),
            stdout,
            stderr,
        }
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Its output and its workers' logs, for an assertion's message.
    fn report(&self, state: &Path) -> String {
        let mut r = format!("stdout:\n{}\nstderr:\n{}", self.stdout(), self.stderr());
        for i in 0..2 {
            let log = state.join(format!("logs/worker-{i}.log"));
            r.push_str(&format!(
                "\n{}:\n{}",
                log.display(),
                std::fs::read_to_string(&log).unwrap_or_default()
            ));
        }
        r
    }

    /// Returns once it prints its first step (at most a minute).
    fn until_training(&self, state: &Path) {
        assert!(
            poll_until(Duration::from_secs(60), || self
                .stdout()
                .lines()
                .any(|l| l.starts_with("step "))),
            "the job did not start training\n{}",
            self.report(state)
        );
    }

    /// Its exit status once it has exited within `limit`.
    fn exit_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let mut status = None;
        poll_until(limit, || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        });
        status
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every file under `dir` and its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect()
}

#[test]
fn a_second_local_on_a_busy_state_dir_is_refused_and_changes_nothing() {
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    let _reaper = Reaper(state.display().to_string());
    let job = common::write(d.path(), "job.toml", &common::job_toml("busy", 2, 8, ""));
    // The first run's workers wait for `go` before they start, so the first
    // run is still in progress, deterministically, when the second starts.
    let go = d.path().join("go");
    let gated = common::write(
        d.path(),
        "gated-worker.sh",
        &format!(
            "#!/bin/sh\nwhile [ ! -e '{}' ]; do sleep 0.02; done\nexec '{}' \"$@\"\n",
            go.display(),
            common::worker_bin().display()
        ),
    );
    std::fs::set_permissions(&gated, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let worker_bin = ["--worker-bin".as_ref(), gated.as_path()];
    let mut first = Local::start(d.path(), "first", &job, &state, &worker_bin);
    assert!(
        poll_until(Duration::from_secs(60), || first
            .stdout()
            .contains("job busy-1")),
        "the first run did not submit its job\n{}",
        first.report(&state)
    );
    let tls = state.join("tls");
    let before = snapshot(&tls);
    for f in [
        "ca.pem",
        "ca.key",
        "coordinator.pem",
        "worker-local-0.pem",
        "tokens.toml",
        "submit.token",
        "read.token",
    ] {
        assert!(before.contains_key(&tls.join(f)), "no {f} in {tls:?}");
    }
    let lock_before = std::fs::read(state.join("local.lock")).ok();

    let mut second = Command::new(env!("CARGO_BIN_EXE_accrue"));
    second
        .arg("local")
        .arg(&job)
        .args(["--workers", "2", "--state-dir"])
        .arg(&state)
        .args(worker_bin);
    let started = Instant::now();
    let (status, err) = common::bounded(second, &d.path().join("second.stderr"));
    let status = status.expect("the second run did not end");
    assert!(!status.success(), "the second run succeeded:\n{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the second run took {:?} to give up",
        started.elapsed()
    );
    // Not a byte of the first run's credentials or lock changed.
    assert!(
        snapshot(&tls) == before,
        "the second run changed the first run's credentials in {tls:?}"
    );
    assert_eq!(std::fs::read(state.join("local.lock")).ok(), lock_before);

    // One line naming the state dir, the lock and its holder.
    let line = err.trim();
    assert!(!line.contains('\n'), "more than one line:\n{err}");
    assert!(line.contains("in use"), "{err}");
    assert!(line.contains(&state.display().to_string()), "{err}");
    assert!(line.contains("local.lock"), "{err}");
    assert!(line.contains(&format!("pid {}", first.child.id())), "{err}");

    // The first run goes on with its credentials and finishes.
    std::fs::write(&go, "").unwrap();
    let status = first.exit_within(Duration::from_secs(120));
    assert!(
        status.is_some_and(|s| s.success()),
        "the first run did not succeed ({status:?})\n{}",
        first.report(&state)
    );
    assert!(
        first.stdout().contains("busy-1 succeeded: step 8/8"),
        "{}",
        first.report(&state)
    );
}

/// `accrue local` on a job of a million steps (`long`, W = 2) written into
/// `dir`, once it prints its first step: the job file and the process.
fn start_long_job(dir: &Path, name: &str, state: &Path) -> (PathBuf, Local) {
    let job = common::write(dir, "job.toml", &common::job_toml("long", 2, 1_000_000, ""));
    let local = Local::start(dir, name, &job, state, &[]);
    local.until_training(state);
    (job, local)
}

/// Starts `accrue local` on a job far longer than the test, waits until
/// its workers are training, sends it `sig` and checks that, within 10 s,
/// no process it started is left.
fn stopped_local_leaves_nothing_behind(sig: libc::c_int, name: &str) {
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    let needle = state.display().to_string();
    let _reaper = Reaper(needle.clone());
    let (_job, mut local) = start_long_job(d.path(), "local", &state);
    // Its two workers are running (the processes that mention the state
    // dir, besides `accrue local` itself).
    let pid = local.child.id();
    let workers: Vec<_> = processes_mentioning(&needle)
        .into_iter()
        .filter(|(p, _)| *p != pid)
        .collect();
    assert_eq!(workers.len(), 2, "{workers:?}");
    assert!(
        workers.iter().all(|(_, c)| c.contains("daemon")),
        "{workers:?}"
    );

    let signalled = Instant::now();
    // SAFETY: kill(2) on our own child, not yet waited for.
    assert_eq!(
        unsafe { libc::kill(libc::pid_t::try_from(pid).unwrap(), sig) },
        0
    );
    let status = local.exit_within(Duration::from_secs(10));
    let status = status.unwrap_or_else(|| {
        panic!(
            "accrue local still runs 10 s after {name}\n{}",
            local.report(&state)
        )
    });
    let left_after = |limit| {
        let mut left = Vec::new();
        poll_until(limit, || {
            left = processes_mentioning(&needle);
            left.is_empty()
        });
        left
    };
    let left = left_after(Duration::from_secs(10).saturating_sub(signalled.elapsed()));
    assert!(
        left.is_empty(),
        "processes left {:?} after {name} of accrue local: {left:?}\n{}",
        signalled.elapsed(),
        local.report(&state)
    );
    if sig == libc::SIGKILL {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    } else {
        // Stopped like Ctrl-C: the job cancelled, the workers asked to
        // stop (each detached: a planned exit), not just killed.
        assert_eq!(status.code(), Some(2), "{}", local.report(&state));
        assert!(
            local
                .stderr()
                .contains(&format!("interrupted by {name}; job long-1 cancelled")),
            "{}",
            local.report(&state)
        );
        for i in 0..2 {
            let log = std::fs::read_to_string(state.join(format!("logs/worker-{i}.log")))
                .unwrap_or_default();
            assert!(
                log.contains("detaching from the coordinator"),
                "worker {i} was not asked to stop:\n{log}"
            );
        }
    }
}

#[test]
fn sigterm_stops_local_and_its_workers() {
    stopped_local_leaves_nothing_behind(libc::SIGTERM, "SIGTERM");
}

#[test]
fn sighup_stops_local_and_its_workers() {
    stopped_local_leaves_nothing_behind(libc::SIGHUP, "SIGHUP");
}

#[test]
fn sigkill_of_local_takes_its_workers_with_it() {
    stopped_local_leaves_nothing_behind(libc::SIGKILL, "SIGKILL");
}

/// The folder under `dir` holding a `LATEST` (a job's checkpoints).
fn checkpoint_folder(dir: &Path) -> Option<PathBuf> {
    for e in std::fs::read_dir(dir).ok()? {
        let p = e.ok()?.path();
        if p.join("LATEST").is_file() {
            return Some(p);
        }
        if p.is_dir() {
            if let Some(f) = checkpoint_folder(&p) {
                return Some(f);
            }
        }
    }
    None
}

/// Issue 37, item 12: an interrupted `accrue local` says how to continue,
/// and `--resume` continues the same job from its newest checkpoint
/// (before: a rerun started a new job from step 1), sweeping what a
/// killed write left in its folder (before: never swept).
#[test]
fn an_interrupted_local_resumes_its_job() {
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    let _reaper = Reaper(state.display().to_string());
    let (job, mut local) = start_long_job(d.path(), "first", &state);
    // SAFETY: kill(2) on our own child, not yet waited for.
    let pid = libc::pid_t::try_from(local.child.id()).unwrap();
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    assert_eq!(
        local
            .exit_within(Duration::from_secs(20))
            .and_then(|s| s.code()),
        Some(2),
        "{}",
        local.report(&state)
    );
    let hint = format!(
        "continue it from its newest checkpoint with: accrue local {} --workers 2 --state-dir {} --resume",
        job.display(),
        state.display()
    );
    assert!(local.stderr().contains(&hint), "{}", local.report(&state));
    let folder = checkpoint_folder(&state).expect("the cancelled job left a checkpoint");
    let left = folder.join(".step-999.tmp-4242");
    std::fs::create_dir(&left).unwrap();
    std::fs::write(left.join("model.safetensors"), b"half").unwrap();

    let mut again = Local::start(d.path(), "again", &job, &state, &[Path::new("--resume")]);
    let resumed = |l: &Local| {
        (0..2).any(|i| {
            std::fs::read_to_string(state.join(format!("logs/worker-{i}.log")))
                .is_ok_and(|t| t.contains(" resumed"))
        }) && l.stdout().lines().any(|l| l.starts_with("step "))
    };
    assert!(
        poll_until(Duration::from_secs(60), || resumed(&again)),
        "the job did not resume\n{}",
        again.report(&state)
    );
    assert!(
        again.stdout().contains("job long-1 resumed"),
        "{}",
        again.report(&state)
    );
    assert!(!left.exists(), "the killed write's folder was not swept");
    let pid = libc::pid_t::try_from(again.child.id()).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert!(again.exit_within(Duration::from_secs(20)).is_some());
}

/// `accrue ARGS...` as a second shell runs it: `source ENV` first, no
/// ACCRUE_* variable of this process inherited, in another directory.
/// With no ARGS, the program and its arguments are the caller's to add.
fn cli_from_env(env: &Path, cwd: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(r#"source "$1" && shift && exec "$@""#)
        .arg("sh")
        .arg(env);
    if !args.is_empty() {
        cmd.arg(env!("CARGO_BIN_EXE_accrue")).args(args);
    }
    cmd.current_dir(cwd).stdin(Stdio::null());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("ACCRUE_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// Issue 43: `accrue local` without `--workers` runs the spec's W, and
/// writes `<state-dir>/env`, named in its banner; a second CLI process
/// that sources it (no flag) lists the job, shows it, follows it with
/// `watch --json` and cancels it. The file goes when the run ends.
#[test]
fn a_second_shell_follows_local_through_its_env_file() {
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    let _reaper = Reaper(state.display().to_string());
    let job = common::write(
        d.path(),
        "job.toml",
        &common::job_toml("envjob", 1, 1_000_000, ""),
    );
    let mut local = Local::with_args(d.path(), "local", &state, &[job.as_os_str()]);
    local.until_training(&state);
    let env = state.join("env");
    assert!(
        local.stdout().contains(&format!("env {}", env.display())),
        "{}",
        local.report(&state)
    );
    assert!(!local.stderr().contains("overrides"), "{}", local.stderr());
    let elsewhere = d.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let run = |args: &[&str]| {
        let out = cli_from_env(&env, &elsewhere, args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "accrue {args:?}: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let list = run(&["list"]);
    assert!(
        list.lines()
            .any(|l| l.starts_with("envjob-1") && l.contains("running")),
        "{list}"
    );
    // The spec says workers = 1 and no --workers was given: one worker.
    let status = run(&["status", "envjob-1"]);
    assert!(
        status.contains("workers    local-0 (generation"),
        "{status}"
    );
    let watch_out = d.path().join("watch.jsonl");
    let mut watch = cli_from_env(&env, &elsewhere, &["watch", "--json", "envjob-1"])
        .stdout(std::fs::File::create(&watch_out).unwrap())
        .stderr(std::fs::File::create(d.path().join("watch.stderr")).unwrap())
        .spawn()
        .unwrap();
    let text = || std::fs::read_to_string(&watch_out).unwrap_or_default();
    assert!(
        poll_until(Duration::from_secs(30), || text()
            .contains(r#""event":"step""#)),
        "watch --json printed no step: {}",
        text()
    );
    assert!(run(&["cancel", "envjob-1"]).contains("envjob-1 cancelled"));
    let mut ended = None;
    poll_until(Duration::from_secs(30), || {
        ended = watch.try_wait().unwrap();
        ended.is_some()
    });
    let _ = watch.kill();
    assert_eq!(
        ended.and_then(|s| s.code()),
        Some(1),
        "a cancelled job's watch exits 1"
    );
    let lines: Vec<serde_json::Value> = text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    let last = lines.last().unwrap();
    assert_eq!(last["event"], "transition", "{last}");
    assert_eq!(last["to"], "cancelled", "{last}");
    assert!(local.exit_within(Duration::from_secs(20)).is_some());
    assert!(!env.exists(), "the env file outlived its coordinator");
}

/// The Python client's dict-to-TOML writer: any Unicode string (outside
/// the Basic Multilingual Plane, control characters, quotes, backslashes),
/// nested tables and arrays parse back equal with TOML's own parser
/// (clients/python/tests/toml_roundtrip.py, run with the venv's Python).
#[test]
fn the_python_clients_toml_round_trips() {
    let python = common::repo().join(".venv/bin/python");
    let script = common::repo().join("clients/python/tests/toml_roundtrip.py");
    let out = Command::new(&python).arg(&script).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("ok"),
        "{} {}: {stdout}\n{}",
        python.display(),
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 43: the Python client (clients/python, installed in the venv by
/// `make setup`) drives a real `accrue local` run (TLS, tokens, real
/// workers) from the environment its env file sets: list, get, watch,
/// series (pandas and plain), submit (a dict and a path, checked as a
/// file is), cancel, resume, and the server's refusals as exceptions
/// (clients/python/tests/drive_local.py says what it checks).
#[test]
fn the_python_client_drives_a_local_run() {
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    let _reaper = Reaper(state.display().to_string());
    // Few enough evaluations that none is thinned while the script runs
    // (thousands of steps a second).
    let text = common::job_toml("pyjob", 1, 1_000_000, "[eval]\nevery_steps = 200");
    let job = common::write(d.path(), "job.toml", &text);
    let mut local = Local::with_args(d.path(), "local", &state, &[job.as_os_str()]);
    let env = state.join("env");
    local.until_training(&state);
    let python = common::repo().join(".venv/bin/python");
    let script = common::repo().join("clients/python/tests/drive_local.py");
    let out = cli_from_env(&env, d.path(), &[])
        .arg(python)
        .arg(script)
        .arg("pyjob-1")
        .arg(&job)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("ok"),
        "{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        local.report(&state)
    );
    assert!(local.exit_within(Duration::from_secs(20)).is_some());
}
