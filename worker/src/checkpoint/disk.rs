//! The file-system operations a checkpoint write is made of, behind a trait
//! so tests can count them (every file and folder fsynced, in order) and
//! cut a write short at any operation, as a crash or a full disk would.

use std::io::{self, Write};
use std::path::Path;

/// One operation of a checkpoint write, as a test sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    CreateDir(String),
    Write(String),
    SyncFile(String),
    SyncDir(String),
    Rename(String, String),
    RemoveDirAll(String),
    RemoveFile(String),
}

/// What a checkpoint write does to the file system.
pub trait Disk {
    fn create_dir_all(&mut self, path: &Path) -> io::Result<()>;
    /// Creates (or truncates) `path` and writes `bytes` into it.
    fn write(&mut self, path: &Path, bytes: &[u8]) -> io::Result<()>;
    /// fsync of a file's contents.
    fn sync_file(&mut self, path: &Path) -> io::Result<()>;
    /// fsync of a folder (its entries: a rename or a new name in it).
    fn sync_dir(&mut self, path: &Path) -> io::Result<()>;
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove_dir_all(&mut self, path: &Path) -> io::Result<()>;
    fn remove_file(&mut self, path: &Path) -> io::Result<()>;
}

/// The local file system.
#[derive(Clone, Copy, Debug, Default)]
pub struct Local;

impl Disk for Local {
    fn create_dir_all(&mut self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }
    fn write(&mut self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let mut f = std::fs::File::create(path)?;
        f.write_all(bytes)?;
        f.flush()
    }
    fn sync_file(&mut self, path: &Path) -> io::Result<()> {
        std::fs::File::open(path)?.sync_all()
    }
    fn sync_dir(&mut self, path: &Path) -> io::Result<()> {
        // A folder opened read-only can be fsynced on Linux; that makes
        // the names in it (new files, renames) durable.
        std::fs::File::open(path)?.sync_all()
    }
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn remove_dir_all(&mut self, path: &Path) -> io::Result<()> {
        std::fs::remove_dir_all(path)
    }
    fn remove_file(&mut self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
}

/// The local file system, recording every operation (tests).
#[derive(Debug, Default)]
pub struct Recording {
    pub ops: Vec<Op>,
}

fn name(p: &Path) -> String {
    p.display().to_string()
}

impl Disk for Recording {
    fn create_dir_all(&mut self, path: &Path) -> io::Result<()> {
        self.ops.push(Op::CreateDir(name(path)));
        Local.create_dir_all(path)
    }
    fn write(&mut self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        self.ops.push(Op::Write(name(path)));
        Local.write(path, bytes)
    }
    fn sync_file(&mut self, path: &Path) -> io::Result<()> {
        self.ops.push(Op::SyncFile(name(path)));
        Local.sync_file(path)
    }
    fn sync_dir(&mut self, path: &Path) -> io::Result<()> {
        self.ops.push(Op::SyncDir(name(path)));
        Local.sync_dir(path)
    }
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        self.ops.push(Op::Rename(name(from), name(to)));
        Local.rename(from, to)
    }
    fn remove_dir_all(&mut self, path: &Path) -> io::Result<()> {
        self.ops.push(Op::RemoveDirAll(name(path)));
        Local.remove_dir_all(path)
    }
    fn remove_file(&mut self, path: &Path) -> io::Result<()> {
        self.ops.push(Op::RemoveFile(name(path)));
        Local.remove_file(path)
    }
}

/// How a [`Failing`] disk stops at its chosen operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// The process dies: that operation does half its work (a write
    /// leaves the first half of its bytes) and no later one runs (no
    /// clean-up either).
    Crash,
    /// The disk is full: that operation fails with ENOSPC (a write leaves
    /// half its bytes), later ones run (clean-up does).
    Full,
}

/// The local file system, cut at operation `at` (0-based) as `cut` says
/// (tests: crash and full-disk injection).
#[derive(Debug)]
pub struct Failing {
    pub at: usize,
    pub cut: Cut,
    pub done: usize,
}

impl Failing {
    pub fn new(at: usize, cut: Cut) -> Self {
        Self { at, cut, done: 0 }
    }

    /// Whether the operation may run: Ok(true) runs it whole, Ok(false)
    /// runs half of it then fails, Err fails it without running.
    fn gate(&mut self) -> io::Result<bool> {
        let n = self.done;
        self.done += 1;
        match self.cut {
            Cut::Crash if n > self.at => Err(io::Error::other("crashed")),
            Cut::Full if n > self.at => Ok(true),
            _ if n == self.at => Ok(false),
            _ => Ok(true),
        }
    }

    fn failure(&self) -> io::Error {
        match self.cut {
            Cut::Crash => io::Error::other("crashed"),
            Cut::Full => io::Error::from_raw_os_error(libc::ENOSPC),
        }
    }

    /// Runs `whole` when the gate allows it; at the cut, `half` (or
    /// nothing) then the failure.
    fn run(
        &mut self,
        whole: impl FnOnce() -> io::Result<()>,
        half: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<()> {
        if self.gate()? {
            whole()
        } else {
            half()?;
            Err(self.failure())
        }
    }
}

impl Disk for Failing {
    fn create_dir_all(&mut self, path: &Path) -> io::Result<()> {
        self.run(|| Local.create_dir_all(path), || Ok(()))
    }
    fn write(&mut self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        self.run(
            || Local.write(path, bytes),
            || Local.write(path, &bytes[..bytes.len() / 2]),
        )
    }
    fn sync_file(&mut self, path: &Path) -> io::Result<()> {
        self.run(|| Local.sync_file(path), || Ok(()))
    }
    fn sync_dir(&mut self, path: &Path) -> io::Result<()> {
        self.run(|| Local.sync_dir(path), || Ok(()))
    }
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        self.run(|| Local.rename(from, to), || Ok(()))
    }
    fn remove_dir_all(&mut self, path: &Path) -> io::Result<()> {
        self.run(|| Local.remove_dir_all(path), || Ok(()))
    }
    fn remove_file(&mut self, path: &Path) -> io::Result<()> {
        self.run(|| Local.remove_file(path), || Ok(()))
    }
}

/// The local file system without fsync (benchmarks: what durability
/// costs).
#[derive(Clone, Copy, Debug, Default)]
pub struct Unsynced;

impl Disk for Unsynced {
    fn create_dir_all(&mut self, path: &Path) -> io::Result<()> {
        Local.create_dir_all(path)
    }
    fn write(&mut self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        Local.write(path, bytes)
    }
    fn sync_file(&mut self, _: &Path) -> io::Result<()> {
        Ok(())
    }
    fn sync_dir(&mut self, _: &Path) -> io::Result<()> {
        Ok(())
    }
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        Local.rename(from, to)
    }
    fn remove_dir_all(&mut self, path: &Path) -> io::Result<()> {
        Local.remove_dir_all(path)
    }
    fn remove_file(&mut self, path: &Path) -> io::Result<()> {
        Local.remove_file(path)
    }
}
