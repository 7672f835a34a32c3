//! What keeps `accrue local` to one run per state dir and leaves nothing
//! behind when it ends: an exclusive lock on `<state-dir>/local.lock`,
//! taken before anything is written there, and child processes tied to
//! this process's life (`PR_SET_PDEATHSIG`), so they die with it even when
//! it is killed with SIGKILL.

use accrue_common::flock::try_lock_exclusive;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{mpsc, Mutex};

/// The lock file in the state dir; it holds the pid of the run holding it.
pub(crate) const LOCK_FILE: &str = "local.lock";

/// The embedded coordinator's job store (redb locks it with flock while
/// the database is open; `accrue_coordinator::store` names it).
const STORE_FILE: &str = "coordinator.redb";

#[derive(Debug, thiserror::Error)]
pub enum StateDirError {
    #[error(
        "state dir {} is in use by another `accrue local`{} (it holds {}); wait for it to end or pass another --state-dir",
        dir.display(),
        pid.map_or_else(String::new, |p| format!(" (pid {p})")),
        lock.display()
    )]
    Busy {
        dir: PathBuf,
        lock: PathBuf,
        pid: Option<u32>,
    },
    #[error(
        "state dir {} is in use: its job store {} is open in another process (an accrue-coordinator with this --state-dir?); stop it or pass another --state-dir",
        dir.display(),
        store.display()
    )]
    StoreOpen { dir: PathBuf, store: PathBuf },
    #[error("state dir {}: {source}", dir.display())]
    NotPrivate {
        dir: PathBuf,
        source: accrue_common::strict_modes::StrictModesError,
    },
    #[error("cannot lock the state dir: {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// An exclusive lock on `<state-dir>/local.lock` for as long as it lives
/// (flock: released when the file is closed, so also when the process dies,
/// however it dies). The file itself stays; it is never removed, as
/// removing a lock file races with the next run opening it.
#[derive(Debug)]
pub(crate) struct StateDirLock {
    _file: File,
}

impl StateDirLock {
    /// Creates the state dir if needed and takes its lock; a state dir
    /// another run holds, or whose job store another process has open, is
    /// refused before anything in it is written (the lock file's content,
    /// the holder's pid, is written only once the lock is ours).
    pub(crate) fn acquire(dir: &Path) -> Result<Self, StateDirError> {
        use std::os::unix::fs::OpenOptionsExt;
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StateDirError::Io { path, source }
        };
        // Created 0700; one another user owns or may write (or anything
        // in it) is refused before anything in it is written or trusted.
        accrue_common::strict_modes::create_private_dir(dir).map_err(|source| {
            StateDirError::NotPrivate {
                dir: dir.to_path_buf(),
                source,
            }
        })?;
        let lock = dir.join(LOCK_FILE);
        // Opened without truncating: the holder's pid must survive a
        // refused run. std opens with O_CLOEXEC, so workers never inherit
        // the lock.
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock)
            .map_err(io(&lock))?;
        if !try_lock_exclusive(&file).map_err(io(&lock))? {
            let mut text = String::new();
            // The pid is a courtesy: a holder that has not written it yet
            // (or an unreadable file) leaves it out of the message.
            let pid = file
                .read_to_string(&mut text)
                .ok()
                .and_then(|_| text.trim().parse().ok());
            return Err(StateDirError::Busy {
                dir: dir.to_path_buf(),
                lock,
                pid,
            });
        }
        probe_store(dir)?;
        file.set_len(0).map_err(io(&lock))?;
        file.rewind().map_err(io(&lock))?;
        writeln!(file, "{}", std::process::id()).map_err(io(&lock))?;
        Ok(Self { _file: file })
    }
}

/// Refuses a state dir whose job store another process has open (redb
/// holds an exclusive flock on it while open): checked before the
/// credentials are written, not when the coordinator opens the store.
fn probe_store(dir: &Path) -> Result<(), StateDirError> {
    let store = dir.join(STORE_FILE);
    let file = match File::open(&store) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(StateDirError::Io {
                path: store,
                source,
            })
        }
    };
    // Closing `file` at the end releases the probe's lock at once.
    match try_lock_exclusive(&file) {
        Ok(true) => Ok(()),
        Ok(false) => Err(StateDirError::StoreOpen {
            dir: dir.to_path_buf(),
            store,
        }),
        Err(source) => Err(StateDirError::Io {
            path: store,
            source,
        }),
    }
}

type SpawnRequest = (Command, mpsc::SyncSender<std::io::Result<Child>>);

/// The sender to the spawner thread, started on first use and never
/// stopped (a static is never dropped, so the channel never closes).
static SPAWNER: Mutex<Option<mpsc::Sender<SpawnRequest>>> = Mutex::new(None);

/// Starts `cmd` tied to this process: the child gets SIGKILL when this
/// process dies, however it dies (`PR_SET_PDEATHSIG`), and a child whose
/// parent died between fork and exec fails to start instead of running on.
///
/// The kernel sends the death signal when the *thread* that forked the
/// child exits, not the process. So every such child is forked by one
/// thread that lives as long as the process (the spawner thread below),
/// never by the caller: a tokio runtime thread, a `spawn_blocking` thread
/// (ended after 10 s idle) or a thread handed off by `block_in_place` may
/// exit while the child should live on (`tests::the_death_signal_*`).
///
/// SIGKILL, not SIGTERM: once this process is gone (and with it
/// `accrue local`'s embedded coordinator) there is nothing to detach
/// from, and a daemon's SIGTERM handling waits up to `--stop-timeout` for
/// its job; a checkpoint cut short is written to a temporary folder that
/// is never named by LATEST. The graceful stop (SIGTERM, then SIGKILL
/// after a grace period) is what `accrue local` does itself on Ctrl-C,
/// SIGTERM and SIGHUP.
///
/// Outside Linux there is no such signal: children are then stopped only
/// by `accrue local`'s own stop.
pub(crate) fn spawn_tied(cmd: Command) -> std::io::Result<Child> {
    #[cfg(target_os = "linux")]
    let cmd = {
        use std::os::unix::process::CommandExt;
        let mut cmd = cmd;
        // The pid of this process as the child will see it from getppid(2)
        // (the same pid namespace).
        let parent = libc::pid_t::try_from(std::process::id())
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // SAFETY: the closure runs in the forked child before exec and
        // only calls arm_death_signal, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || arm_death_signal(parent));
        }
        cmd
    };
    spawn_on_spawner(cmd)
}

/// In a forked child before exec: asks for SIGKILL when the thread that
/// forked it ends, then checks that `parent` has not already died (the
/// child would have been re-parented and never get the signal). Calls
/// only prctl(2) and getppid(2) and allocates nothing (errors are raw OS
/// errors), so it is safe between fork and exec.
#[cfg(target_os = "linux")]
fn arm_death_signal(parent: libc::pid_t) -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes plain integers and changes only
    // this process's death signal.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: getppid(2) cannot fail and touches no memory.
    if unsafe { libc::getppid() } != parent {
        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
}

/// Runs `cmd.spawn()` on the spawner thread.
fn spawn_on_spawner(cmd: Command) -> std::io::Result<Child> {
    let gone = || std::io::Error::other("the process spawner thread is gone");
    let (reply, answer) = mpsc::sync_channel(1);
    {
        let mut spawner = SPAWNER.lock().unwrap_or_else(|p| p.into_inner());
        if spawner.is_none() {
            let (tx, rx) = mpsc::channel::<SpawnRequest>();
            std::thread::Builder::new()
                .name("accrue-spawner".into())
                .spawn(move || {
                    for (mut cmd, reply) in rx {
                        let _ = reply.send(cmd.spawn());
                    }
                    // Not reached (the sender lives in a static); should the
                    // channel close all the same, this thread must still not
                    // exit: its exit would kill every child it forked.
                    loop {
                        std::thread::park();
                    }
                })?;
            *spawner = Some(tx);
        }
        spawner
            .as_ref()
            .ok_or_else(gone)?
            .send((cmd, reply))
            .map_err(|_| gone())?;
    }
    answer.recv().map_err(|_| gone())?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Held by every test here: a child forked by one test holds copies of
    /// the other tests' descriptors (their flock locks included) until it
    /// execs, so a lock dropped while another test forks can look held.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn sleeper() -> Command {
        let mut c = Command::new("sleep");
        c.arg("600");
        c
    }

    /// Polls `child` until it has exited or `limit` passes.
    fn exits_within(child: &mut Child, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if child.try_wait().unwrap().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        child.try_wait().unwrap().is_some()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_death_signal_follows_the_forking_thread_so_children_outlive_their_caller() {
        let _serial = serial();
        // Both forked at the caller's request from a short-lived thread:
        // one by that thread itself (with the same pre_exec hook), one
        // through spawn_tied.
        let (mut naive, mut tied) = std::thread::spawn(|| {
            use std::os::unix::process::CommandExt;
            let parent = libc::pid_t::try_from(std::process::id()).unwrap();
            let mut naive = sleeper();
            // SAFETY: arm_death_signal is async-signal-safe.
            unsafe {
                naive.pre_exec(move || arm_death_signal(parent));
            }
            (naive.spawn().unwrap(), spawn_tied(sleeper()).unwrap())
        })
        .join()
        .unwrap();
        // The thread's exit kills what it forked itself: the hazard is real.
        assert!(
            exits_within(&mut naive, Duration::from_secs(10)),
            "PR_SET_PDEATHSIG did not fire when the forking thread exited"
        );
        // The tied child was signalled by nobody (had it been tied to that
        // thread, both signals would have been queued in the same exit and
        // it would be dead by now; 200 ms more as a margin).
        assert!(
            !exits_within(&mut tied, Duration::from_millis(200)),
            "a tied child died with the thread that asked for it"
        );
        tied.kill().unwrap();
        tied.wait().unwrap();
    }

    #[test]
    fn a_tied_child_runs_and_reports_its_exit() {
        let _serial = serial();
        let mut c = Command::new("sh");
        c.args(["-c", "exit 3"]);
        let status = spawn_tied(c).unwrap().wait().unwrap();
        assert_eq!(status.code(), Some(3));
        let e = spawn_tied(Command::new("/nonexistent/accrue-test-binary")).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
    }

    #[test]
    fn a_second_lock_on_one_state_dir_is_refused_naming_the_holder() {
        let _serial = serial();
        let d = tempfile::TempDir::new().unwrap();
        let state = d.path().join("state");
        let held = StateDirLock::acquire(&state).unwrap();
        let text = std::fs::read_to_string(state.join(LOCK_FILE)).unwrap();
        assert_eq!(text, format!("{}\n", std::process::id()));
        // flock locks belong to open file descriptions: a second open in
        // this process conflicts as another process's would.
        let e = StateDirLock::acquire(&state).unwrap_err().to_string();
        assert!(e.contains(&state.display().to_string()), "{e}");
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        assert!(e.contains(LOCK_FILE), "{e}");
        assert_eq!(
            std::fs::read_to_string(state.join(LOCK_FILE)).unwrap(),
            text,
            "a refused run changed the lock file"
        );
        drop(held);
        let again = StateDirLock::acquire(&state).unwrap();
        drop(again);
        // A job store another process has open (held here the way redb
        // holds it) is refused too.
        let store = File::create(state.join(STORE_FILE)).unwrap();
        assert!(try_lock_exclusive(&store).unwrap());
        let e = StateDirLock::acquire(&state).unwrap_err().to_string();
        assert!(e.contains(STORE_FILE), "{e}");
        drop(store);
        StateDirLock::acquire(&state).unwrap();
    }
}
