//! `flock(2)`'s exclusive, non-blocking form: the one lock primitive of
//! `accrue local`'s state dir and of a checkpoint folder's writer lock.
//! Released by the kernel when the file is closed, so also when its holder
//! dies, however it dies.

use std::fs::File;
use std::os::fd::AsRawFd;

/// `flock(fd, LOCK_EX | LOCK_NB)`: Ok(false) when another open file
/// description holds a lock on the file.
pub fn try_lock_exclusive(file: &File) -> std::io::Result<bool> {
    loop {
        // SAFETY: flock(2) on a descriptor `file` owns and keeps open for
        // the duration of the call; it touches no memory.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
}
