//! The coordinator's settings: what the flags give, its security check and
//! its checkpoint roots made absolute.

use accrue_common::spec::{confine_field, Area, LocalFs, RootError, Roots};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Config {
    pub state_dir: PathBuf,
    /// A worker silent this long is gone.
    pub heartbeat_ttl: Duration,
    /// How long a submission waits for its record to be durable before it
    /// is taken back and refused with UNAVAILABLE.
    pub durable_timeout: Duration,
    /// Jobs estimated to need more memory per worker are refused (bytes).
    pub max_job_memory: u64,
    /// The tokens file (`--tokens`): bearer tokens with scopes for
    /// JobService and HTTP. None: authentication off (every request is
    /// allowed and jobs have no owner).
    pub tokens: Option<PathBuf>,
    /// Spec paths must lie under these roots (none: not confined). Made
    /// absolute by [`Config::with_checked_roots`], which `start` calls.
    pub roots: Roots,
    /// TLS on both ports and mutual TLS for WorkerService (None: plaintext,
    /// as before issue 14).
    pub tls: Option<crate::tls::ServerTls>,
    /// The ring master secret (`--ring-secret-file`): every data-plane key
    /// is derived from it. None: `<state_dir>/ring-master.key` in embedded
    /// mode (created on first start), a random in-memory one per replica
    /// in etcd mode (see `crate::ringkey`).
    pub ring_secret_file: Option<PathBuf>,
    /// Run without what is not configured (TLS, tokens, TLS to etcd);
    /// without it, `start` refuses an incomplete set-up (see
    /// `accrue_proto::secure`).
    pub insecure: bool,
    /// TensorBoard event files, one run folder per job under it
    /// (`crate::tensorboard`). None: none written (the binary's default
    /// is `<state-dir>/tensorboard`).
    pub tensorboard_dir: Option<PathBuf>,
    /// Job events kept for watchers (WatchJob, the status page): a watcher
    /// that falls further behind gets a fresh snapshot of its job
    /// (`--watch-buffer`, default [`DEFAULT_WATCH_BUFFER`]).
    pub watch_buffer: usize,
}

impl Config {
    /// Checks the security set-up (`etcd_tls`: in etcd mode, whether etcd
    /// is reached over TLS) and logs a warning per waiver in force.
    pub fn check_security(
        &self,
        etcd_tls: Option<bool>,
    ) -> Result<(), accrue_proto::secure::SecurityError> {
        use accrue_proto::secure::{decide, Waiver};
        let mut pieces = vec![
            (Waiver::ServerTls, self.tls.is_some()),
            (Waiver::Tokens, self.tokens.is_some()),
        ];
        if let Some(e) = etcd_tls {
            pieces.push((Waiver::EtcdTls, e));
        }
        for w in decide("the coordinator", &pieces, self.insecure)? {
            tracing::warn!(waived = ?w, "--insecure: {}; give {} to close it", w.risk(), w.flags());
        }
        Ok(())
    }

    /// This config with its roots absolute and lexically normal, once the
    /// default checkpoint folder (`<state-dir>/checkpoints`) is known to
    /// lie under the checkpoint root: jobs whose spec names no folder
    /// checkpoint there.
    pub fn with_checked_roots(mut self) -> Result<Self, RootError> {
        self.roots = self.roots.absolute()?;
        if let Some(root) = &self.roots.checkpoint {
            let default = accrue_proto::layout::default_checkpoint_dir(&self.state_dir, "");
            let default = std::path::absolute(&default).unwrap_or(default);
            confine_field(
                &self.roots,
                Area::Checkpoint,
                "--state-dir",
                &default,
                &LocalFs,
            )
            .map_err(|e| RootError {
                flag: Area::Checkpoint.flag(),
                root: root.clone(),
                reason: format!(
                    "the default checkpoint folder {} (under --state-dir) must lie under it: {}",
                    default.display(),
                    e.allowed
                ),
            })?;
        }
        Ok(self)
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            state_dir: "runs".into(),
            heartbeat_ttl: Duration::from_secs(10),
            durable_timeout: Duration::from_secs(5),
            max_job_memory: DEFAULT_MAX_JOB_MEMORY_GIB * accrue_common::spec::GIB,
            tokens: None,
            roots: Roots::default(),
            tls: None,
            ring_secret_file: None,
            insecure: false,
            tensorboard_dir: None,
            watch_buffer: DEFAULT_WATCH_BUFFER,
        }
    }
}

/// The default of `--watch-buffer`: job events kept for watchers.
pub const DEFAULT_WATCH_BUFFER: usize = 16384;

/// The allowed values of `--watch-buffer` (and `ACCRUE_WATCH_BUFFER`).
pub const WATCH_BUFFER_RANGE: std::ops::RangeInclusive<usize> = 1..=1 << 20;

/// A `--watch-buffer` value that is not a whole number in
/// [`WATCH_BUFFER_RANGE`].
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{name}={value:?}: the watch buffer must be a whole number of events from {} to {}", WATCH_BUFFER_RANGE.start(), WATCH_BUFFER_RANGE.end())]
pub struct WatchBufferError {
    pub name: &'static str,
    pub value: String,
}

/// The watch buffer `value` names (`name`: where it came from, for the
/// error).
pub fn parse_watch_buffer(name: &'static str, value: &str) -> Result<usize, WatchBufferError> {
    value
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|n| WATCH_BUFFER_RANGE.contains(n))
        .ok_or_else(|| WatchBufferError {
            name,
            value: value.to_string(),
        })
}

/// `ACCRUE_WATCH_BUFFER` when it is set (`accrue local`'s embedded
/// coordinator), else [`DEFAULT_WATCH_BUFFER`].
pub fn watch_buffer_from_env() -> Result<usize, WatchBufferError> {
    match std::env::var("ACCRUE_WATCH_BUFFER") {
        Ok(v) => parse_watch_buffer("ACCRUE_WATCH_BUFFER", &v),
        Err(std::env::VarError::NotPresent) => Ok(DEFAULT_WATCH_BUFFER),
        Err(std::env::VarError::NotUnicode(v)) => Err(WatchBufferError {
            name: "ACCRUE_WATCH_BUFFER",
            value: v.to_string_lossy().into_owned(),
        }),
    }
}

/// The default of `--max-job-memory-gib`.
pub const DEFAULT_MAX_JOB_MEMORY_GIB: u64 = 64;
