//! One writer per checkpoint folder (issue 37): the run whose rank 0 writes
//! a folder holds an exclusive lock on `<dir>/.accrue-writer.lock` for as
//! long as it may write there. A second run on the same folder (two
//! `accrue-worker train` of one job started together, a job resumed twice)
//! is refused naming the holder, and the holder alone may sweep the
//! temporary files dead writers left: holding the lock proves every other
//! writer of the folder is gone, whichever host it ran on.
//!
//! flock(2): released by the kernel when the holder's file is closed, so
//! also when it dies (SIGKILL included). On NFS, Linux emulates it with
//! POSIX byte-range locks, which the server arbitrates between hosts.
//! The file is never removed (removing a lock file races with the next run
//! opening it); it holds the holder's pid, host, job and start time, for
//! the refusal's words only.

use super::owner::Owner;
use crate::error::{Error, Result};
use accrue_common::flock::try_lock_exclusive as try_lock;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The lock file's name (hidden; no step folder or temporary name).
pub const LOCK_FILE: &str = ".accrue-writer.lock";

/// Who holds a folder's lock, as the holder wrote it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Holder {
    pub pid: u32,
    pub host: String,
    pub job_id: String,
    pub since_unix_ms: i64,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "job {} (pid {} on host {}, since unix ms {})",
            self.job_id,
            self.pid,
            if self.host.is_empty() {
                "?"
            } else {
                &self.host
            },
            self.since_unix_ms
        )
    }
}

/// The exclusive writer lock of one checkpoint folder, held while it lives.
/// A folder it created and nothing was written into (a run that failed
/// before its first checkpoint) is removed again when it is dropped, so a
/// failed run leaves nothing behind.
#[derive(Debug)]
pub struct FolderLock {
    _file: File,
    dir: PathBuf,
    /// The folders acquire created, innermost first (the folder and any
    /// missing parents).
    created: Vec<PathBuf>,
}

impl Drop for FolderLock {
    fn drop(&mut self) {
        if self.created.is_empty() {
            return;
        }
        let only_the_lock = std::fs::read_dir(&self.dir).is_ok_and(|entries| {
            let names: Vec<_> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name())
                .collect();
            names.len() == 1 && names[0] == LOCK_FILE
        });
        if only_the_lock {
            // Unlinked while still held: a waiter that then takes the lock
            // sees its file is no longer the folder's and opens anew
            // (acquire's identity check), so no two runs ever hold it.
            let _ = std::fs::remove_file(self.dir.join(LOCK_FILE));
            // Innermost first; a parent something else was put into stays.
            for d in &self.created {
                if std::fs::remove_dir(d).is_err() {
                    break;
                }
            }
        }
    }
}

impl FolderLock {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Takes `dir`'s writer lock (creating the folder and the lock file
    /// when missing), waiting up to `wait` for a holder to let go (a
    /// previous generation's rank 0 being torn down). Refused, naming the
    /// holder, when another run keeps it. The caller checks the folder's
    /// ownership record first: a folder another job owns is never
    /// touched.
    pub fn acquire(dir: &Path, me: &Owner, wait: Duration) -> Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let err = |reason: String| Error::Checkpoint {
            path: dir.to_path_buf(),
            reason,
        };
        let created: Vec<PathBuf> = dir
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .map(Path::to_path_buf)
            .collect();
        let path = dir.join(LOCK_FILE);
        let open = || -> Result<File> {
            std::fs::create_dir_all(dir).map_err(|e| err(format!("creating the folder: {e}")))?;
            // Not truncated: the holder's words must survive a refused run.
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o644)
                .open(&path)
                .map_err(|e| err(format!("opening {LOCK_FILE}: {e}")))
        };
        let mut file = open()?;
        let deadline = Instant::now() + wait;
        loop {
            if try_lock(&file).map_err(|e| err(format!("locking {LOCK_FILE}: {e}")))? {
                // The file locked must still be the folder's (a holder that
                // gave up an empty folder it made unlinks it).
                use std::os::unix::fs::MetadataExt;
                let ours = file.metadata().map(|m| (m.dev(), m.ino())).ok();
                let now = std::fs::metadata(&path).map(|m| (m.dev(), m.ino())).ok();
                if ours.is_some() && ours == now {
                    break;
                }
                file = open()?;
                continue;
            }
            if Instant::now() >= deadline {
                let mut text = String::new();
                let holder = file
                    .read_to_string(&mut text)
                    .ok()
                    .and_then(|_| serde_json::from_str::<Holder>(&text).ok())
                    .map_or_else(|| "another process".to_string(), |h| h.to_string());
                return Err(err(format!(
                    "is in use by another run: {holder} holds its writer lock ({LOCK_FILE}){}; one run writes a checkpoint folder at a time: wait for it to end, or choose another checkpoint.dir",
                    if wait.is_zero() {
                        String::new()
                    } else {
                        format!(" and kept it for {:.1} s", wait.as_secs_f64())
                    }
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let me = Holder {
            pid: std::process::id(),
            host: hostname(),
            job_id: me.job_id.clone(),
            since_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64),
        };
        // The words are a courtesy (the lock is the flock): a failed write
        // leaves an older holder's words, never a wrong lock.
        let words = serde_json::to_vec(&me).unwrap_or_default();
        let _ = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(&words));
        Ok(Self {
            _file: file,
            dir: dir.to_path_buf(),
            created,
        })
    }
}

/// This host's name (gethostname(2)); empty when it cannot be read.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Whether `name` is one of the temporary names accrue's writers use in a
/// checkpoint folder: `.step-<N>.tmp-<pid>`, `.LATEST.tmp-<pid>`,
/// `.OWNER.json.tmp-<pid>`, all digits where digits are due. Anything
/// else (a user's `.thesis.tmp-2024/`, `.cache.tmp-1`) is not ours.
pub fn is_our_temporary(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let Some((stem, pid)) = name.rsplit_once(".tmp-") else {
        return false;
    };
    if !digits(pid) {
        return false;
    }
    match stem {
        ".LATEST" | ".OWNER.json" => true,
        s => s.strip_prefix(".step-").is_some_and(digits),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(job: &str) -> Owner {
        Owner {
            job_id: job.into(),
            cluster: String::new(),
            spec_hash: String::new(),
            created_unix_ms: 0,
        }
    }

    #[test]
    fn only_accrues_own_temporary_names_are_ours() {
        for n in [".step-6.tmp-4242", ".LATEST.tmp-1", ".OWNER.json.tmp-77"] {
            assert!(is_our_temporary(n), "{n}");
        }
        for n in [
            ".thesis.tmp-2024",
            ".cache.tmp-1",
            ".step-x.tmp-1",
            ".step-6.tmp-",
            ".step-6.tmp-12a",
            "step-6.tmp-1",
            ".LATEST.tmp-1.bak",
            ".step-.tmp-3",
            ".accrue-writer.lock",
        ] {
            assert!(!is_our_temporary(n), "{n}");
        }
    }

    #[test]
    fn a_second_holder_is_refused_naming_the_first_then_takes_it_after() {
        let dir = tempfile::tempdir().unwrap();
        let a = FolderLock::acquire(dir.path(), &owner("job-a"), Duration::ZERO).unwrap();
        let e = FolderLock::acquire(dir.path(), &owner("job-b"), Duration::from_millis(120))
            .unwrap_err()
            .to_string();
        assert!(e.contains("job job-a"), "{e}");
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        assert!(e.contains("choose another checkpoint.dir"), "{e}");
        drop(a);
        let b = FolderLock::acquire(dir.path(), &owner("job-b"), Duration::ZERO).unwrap();
        assert_eq!(b.dir(), dir.path());
    }

    #[test]
    fn a_folder_the_lock_made_and_nothing_used_is_removed_with_it() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("ck");
        let deep = d.path().join("a/b/ck");
        let held = FolderLock::acquire(&deep, &owner("j"), Duration::ZERO).unwrap();
        assert!(deep.join(LOCK_FILE).is_file());
        drop(held);
        assert!(
            !d.path().join("a").exists(),
            "unused folders the lock made stay"
        );
        let held = FolderLock::acquire(&dir, &owner("j"), Duration::ZERO).unwrap();
        std::fs::write(dir.join("OWNER.json"), b"{}").unwrap();
        drop(held);
        assert!(dir.join("OWNER.json").exists() && dir.join(LOCK_FILE).exists());
    }
}
