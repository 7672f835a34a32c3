//! The ring master secret: the one secret every data-plane key is derived
//! from (`accrue_common::ringkey`). It never leaves the coordinator; only
//! the derived key of a job's generation travels, inside that generation's
//! Assignments on the (mTLS) Attach stream.
//!
//! Where it comes from: `--ring-secret-file FILE` (32 or more bytes, used
//! as they are), else, in embedded mode, `<state-dir>/ring-master.key`,
//! created with 32 random bytes and mode 0600 on first start and reused
//! afterwards; in etcd mode without a file, a random one held in memory by
//! each replica (see docs/SECURITY.md, "Data plane").

use accrue_common::ringkey::{derive_ring_key, MIN_MASTER_LEN};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The file name of the master secret a coordinator keeps in its state dir.
pub const STATE_DIR_FILE: &str = "ring-master.key";

#[derive(Debug, thiserror::Error)]
pub enum RingKeyError {
    #[error("cannot read the ring secret file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the ring secret file {path} holds {len} bytes; it needs at least {min} random bytes \
         (e.g. `head -c 32 /dev/urandom > {path}`)"
    )]
    TooShort {
        path: PathBuf,
        len: usize,
        min: usize,
    },
    #[error("cannot create the ring secret file {path}: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The master secret. Its bytes are never printed (Debug shows its length).
#[derive(Clone)]
pub struct RingMaster(Arc<[u8]>);

impl std::fmt::Debug for RingMaster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RingMaster({} bytes, redacted)", self.0.len())
    }
}

impl RingMaster {
    /// A fresh random master (32 bytes), held in memory only.
    pub fn random() -> Self {
        Self(rand::random::<[u8; 32]>().to_vec().into())
    }

    /// The master of `bytes`: at least [`MIN_MASTER_LEN`] of them.
    pub fn from_bytes(bytes: Vec<u8>, path: &Path) -> Result<Self, RingKeyError> {
        if bytes.len() < MIN_MASTER_LEN {
            return Err(RingKeyError::TooShort {
                path: path.into(),
                len: bytes.len(),
                min: MIN_MASTER_LEN,
            });
        }
        Ok(Self(bytes.into()))
    }

    /// Reads a master secret file (its bytes, as they are). A file others
    /// may read is used, with a warning.
    pub fn from_file(path: &Path) -> Result<Self, RingKeyError> {
        let bytes = std::fs::read(path).map_err(|source| RingKeyError::Read {
            path: path.into(),
            source,
        })?;
        warn_if_readable_by_others(path);
        Self::from_bytes(bytes, path)
    }

    /// Reads `path`, or creates it (32 random bytes, mode 0600, synced)
    /// when it does not exist yet. Two processes racing here both end up
    /// with the file the first one wrote.
    pub fn load_or_create(path: &Path) -> Result<Self, RingKeyError> {
        let create = |source| RingKeyError::Create {
            path: path.into(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(create)?;
        }
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        match opts.open(path) {
            Ok(mut f) => {
                let bytes = rand::random::<[u8; 32]>();
                f.write_all(&bytes)
                    .and_then(|_| f.sync_all())
                    .map_err(create)?;
                tracing::info!(path = %path.display(), "created the ring master secret");
                Self::from_bytes(bytes.to_vec(), path)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Self::from_file(path),
            Err(e) => Err(create(e)),
        }
    }

    /// Where a coordinator takes its master from: `file` when given, else
    /// `<state_dir>/ring-master.key` (created on first start).
    pub fn resolve(file: Option<&Path>, state_dir: &Path) -> Result<Self, RingKeyError> {
        match file {
            Some(f) => Self::from_file(f),
            None => Self::load_or_create(&state_dir.join(STATE_DIR_FILE)),
        }
    }

    /// The ring key of `job`'s generation `generation`.
    pub fn derive(&self, job: &str, generation: u64) -> Vec<u8> {
        derive_ring_key(&self.0, job, generation).to_vec()
    }

    /// The derivation the scheduler is given.
    pub fn keys(&self) -> crate::domain::RingKeys {
        let m = self.clone();
        Box::new(move |job, generation| m.derive(job, generation))
    }
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(m) = std::fs::metadata(path) {
        let mode = m.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(path = %path.display(), mode = format!("{mode:o}"), "the ring secret file may be read by other users: chmod 600 it");
        }
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_: &Path) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_once_with_mode_0600_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let a = RingMaster::resolve(None, &state).unwrap();
        let path = state.join(STATE_DIR_FILE);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 32);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{mode:o}");
        }
        // A restart takes the same master: the same keys.
        let b = RingMaster::resolve(None, &state).unwrap();
        assert_eq!(a.derive("j-1", 2), b.derive("j-1", 2));
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        // Another state dir, another master.
        let c = RingMaster::resolve(None, &dir.path().join("other")).unwrap();
        assert_ne!(a.derive("j-1", 2), c.derive("j-1", 2));
    }

    #[test]
    fn a_given_file_is_used_as_it_is_and_must_be_long_enough() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("master");
        std::fs::write(&f, [5u8; 40]).unwrap();
        let m = RingMaster::resolve(Some(&f), dir.path()).unwrap();
        assert_eq!(
            m.derive("j", 1),
            accrue_common::ringkey::derive_ring_key(&[5u8; 40], "j", 1).to_vec()
        );
        assert!(!dir.path().join(STATE_DIR_FILE).exists());
        assert!(!format!("{m:?}").contains('5'), "{m:?}");

        std::fs::write(&f, b"short\n").unwrap();
        let e = RingMaster::resolve(Some(&f), dir.path()).unwrap_err();
        assert!(matches!(
            e,
            RingKeyError::TooShort {
                len: 6,
                min: 32,
                ..
            }
        ));
        let text = e.to_string();
        assert!(
            text.contains(&f.display().to_string()) && text.contains("6 bytes"),
            "{text}"
        );

        let missing = dir.path().join("nope");
        let e = RingMaster::resolve(Some(&missing), dir.path()).unwrap_err();
        assert!(matches!(e, RingKeyError::Read { .. }), "{e}");
        assert!(e.to_string().contains("nope"), "{e}");
    }

    #[test]
    fn a_short_state_dir_file_is_refused_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(STATE_DIR_FILE), b"x").unwrap();
        let e = RingMaster::resolve(None, dir.path()).unwrap_err();
        assert!(matches!(e, RingKeyError::TooShort { len: 1, .. }), "{e}");
        assert_eq!(
            std::fs::read(dir.path().join(STATE_DIR_FILE)).unwrap(),
            b"x"
        );
    }
}
