//! Reading the small files a spec names (a Hugging Face `config.json`, a
//! `tokenizer.json`) without trusting them: regular files only, never more
//! than a cap. A spec naming `/dev/zero`, a FIFO or a 1 GB file is refused
//! before anything is read (issue 37): the coordinator reads `model.config`
//! at submit for its memory estimate and every daemon at each assignment.

use std::io::Read;
use std::path::{Path, PathBuf};

/// The most a `config.json` may hold (real ones are a few KB).
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;
/// The most a `tokenizer.json` may hold (Llama 3's is 9 MB, Gemma 3's
/// 33 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 64 << 20;

/// Why a small file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SmallFileError {
    #[error("{}: cannot read it: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: is not a regular file (it is a {kind}); name a file", path.display())]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{}: is {size} bytes, above the {cap}-byte limit for a {what}", path.display())]
    TooLarge {
        path: PathBuf,
        size: u64,
        cap: u64,
        what: &'static str,
    },
}

impl SmallFileError {
    /// The reason without the path (for errors that name the path apart).
    pub fn reason(&self) -> String {
        match self {
            Self::Io { source, .. } => format!("cannot read it: {source}"),
            Self::NotRegular { kind, .. } => {
                format!("is not a regular file (it is a {kind}); name a file")
            }
            Self::TooLarge {
                size, cap, what, ..
            } => {
                format!("is {size} bytes, above the {cap}-byte limit for a {what}")
            }
        }
    }

    /// Whether the file does not exist (a host that does not see it).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

fn kind_of(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "folder"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

/// The bytes of `path` (symlinks followed) when it is a regular file of at
/// most `cap` bytes. The type and size are those of the opened file (no
/// race with a rename), and at most `cap + 1` bytes are ever read, so a
/// file that grows after the check is refused too. A FIFO is refused
/// without blocking (opened non-blocking).
pub fn read_small(path: &Path, cap: u64, what: &'static str) -> Result<Vec<u8>, SmallFileError> {
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| SmallFileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_o_nonblock())
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.file_type().is_file() {
        return Err(SmallFileError::NotRegular {
            path: path.to_path_buf(),
            kind: kind_of(meta.file_type()),
        });
    }
    let too_large = |size| SmallFileError::TooLarge {
        path: path.to_path_buf(),
        size,
        cap,
        what,
    };
    if meta.len() > cap {
        return Err(too_large(meta.len()));
    }
    let mut out = Vec::with_capacity(meta.len() as usize);
    file.take(cap + 1).read_to_end(&mut out).map_err(io)?;
    if out.len() as u64 > cap {
        return Err(too_large(out.len() as u64));
    }
    Ok(out)
}

/// O_NONBLOCK on Linux (x86_64 and aarch64 share the value); the flag only
/// matters for FIFOs and devices, which are refused right after the open.
const fn libc_o_nonblock() -> i32 {
    0o4000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_fifos_and_folders_are_refused_without_reading() {
        let e = read_small(Path::new("/dev/zero"), 10, "config.json").unwrap_err();
        assert!(e.to_string().contains("character device"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let e = read_small(dir.path(), 10, "config.json").unwrap_err();
        assert!(e.to_string().contains("is not a regular file"), "{e}");
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // A FIFO nobody writes: a blocking open would hang here.
        assert_eq!(unsafe { mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_small(&fifo, 10, "config.json").unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
    }

    extern "C" {
        fn mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
    }

    #[test]
    fn the_cap_is_exact() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.json");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(read_small(&p, 10, "config.json").unwrap().len(), 10);
        let e = read_small(&p, 9, "config.json").unwrap_err();
        assert_eq!(
            e.reason(),
            "is 10 bytes, above the 9-byte limit for a config.json"
        );
        let e = read_small(&dir.path().join("none"), 9, "config.json").unwrap_err();
        assert!(e.is_not_found());
    }
}
