//! Bearer tokens with scopes (docs/SECURITY.md "Tokens
//! and scopes").
//!
//! The tokens file holds SHA-256 digests of tokens, never tokens:
//!
//! ```toml
//! [[token]]
//! name = "alice"                 # the principal; recorded as the job's owner
//! sha256 = "<64 hex digits: SHA-256 of the token string>"
//! scopes = ["read", "submit"]    # any of read, submit, admin, metrics
//! ```
//!
//! Pure parts (parsing, matching a presented token, what each gRPC method
//! and HTTP route needs, whether a principal has it) are plain functions;
//! [`Tokens`] re-reads the file when it changes (looked at no more than once
//! a second), and [`GrpcAuthLayer`] applies the rules once per gRPC request
//! by method path, before any handler runs.

use sha2::{Digest, Sha256};
use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};
use subtle::ConstantTimeEq;

/// What a token allows. **Decision:** `admin` implies `submit` and `read`,
/// `submit` implies `read`; `metrics` is separate (a Prometheus scraper gets
/// `/metrics` and nothing else, and no other scope reads `/metrics`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// Get, list, watch jobs; the dashboard and the JSON endpoints.
    Read,
    /// Submit jobs, cancel and resume the jobs it owns.
    Submit,
    /// Cancel or resume any job.
    Admin,
    /// `GET /metrics` only.
    Metrics,
}

impl Scope {
    pub const ALL: [Scope; 4] = [Scope::Read, Scope::Submit, Scope::Admin, Scope::Metrics];

    pub fn name(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Submit => "submit",
            Scope::Admin => "admin",
            Scope::Metrics => "metrics",
        }
    }

    pub fn parse(s: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|x| x.name() == s)
    }

    /// Whether holding `self` grants `need`.
    pub fn grants(self, need: Scope) -> bool {
        use Scope::*;
        self == need || matches!((self, need), (Admin, Submit | Read) | (Submit, Read))
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Who presented a known token, and what its entry allows. Handlers find it
/// in the request's extensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub scopes: Vec<Scope>,
}

impl Principal {
    pub fn has(&self, need: Scope) -> bool {
        self.scopes.iter().any(|s| s.grants(need))
    }

    /// Itself when it holds `need`, else the refusal naming what it has
    /// and what `what` needs.
    pub fn needing(self, need: Scope, what: &str) -> Result<Self, AuthError> {
        if self.has(need) {
            return Ok(self);
        }
        Err(AuthError::Forbidden {
            have: self
                .scopes
                .iter()
                .map(|s| s.name())
                .collect::<Vec<_>>()
                .join(", "),
            principal: self.name,
            need,
            what: what.to_string(),
        })
    }
}

/// The scheduler's view of who asks (auth off: anyone).
pub fn caller(p: Option<&Principal>) -> crate::domain::Caller {
    match p {
        None => crate::domain::Caller::Anyone,
        Some(p) => crate::domain::Caller::Principal {
            name: p.name.clone(),
            admin: p.has(Scope::Admin),
        },
    }
}

/// A tokens file that cannot be taken.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TokensError {
    #[error("tokens file {path}: cannot read it: {reason}")]
    Read { path: String, reason: String },
    #[error("tokens file {path}: {reason}")]
    Parse { path: String, reason: String },
    /// Another user owns it or may write it (or its folder).
    #[error("tokens file {path} refused: {reason}")]
    NotPrivate { path: String, reason: String },
}

/// The longest token name (the principal; shown as a job's owner).
pub const MAX_NAME: usize = 64;
/// The longest token accepted in a request, bytes.
pub const MAX_TOKEN: usize = 4096;

#[derive(Clone)]
struct Entry {
    digest: [u8; 32],
    principal: Principal,
}

/// A parsed tokens file: (SHA-256 digest, principal) pairs.
#[derive(Clone, Default)]
pub struct TokenTable {
    entries: Vec<Entry>,
}

impl fmt::Debug for TokenTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Names only: digests stay out of logs.
        f.debug_list()
            .entries(self.entries.iter().map(|e| &e.principal.name))
            .finish()
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileToml {
    #[serde(default)]
    token: Vec<EntryToml>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryToml {
    name: String,
    sha256: String,
    scopes: Vec<String>,
}

/// SHA-256 of `token`, as 64 lowercase hex digits (what the tokens file
/// holds).
pub fn sha256_hex(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl TokenTable {
    /// Parses a tokens file's text; every problem names the entry (its
    /// position, and its name when it has one), the field and what is
    /// allowed.
    pub fn parse(text: &str) -> Result<TokenTable, String> {
        let file: FileToml = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut entries: Vec<Entry> = Vec::with_capacity(file.token.len());
        for (i, t) in file.token.into_iter().enumerate() {
            let at = format!("token[{i}] (name {:?})", t.name);
            if t.name.is_empty()
                || t.name.chars().count() > MAX_NAME
                || t.name.chars().any(char::is_control)
            {
                return Err(format!(
                    "{at}: name must be 1 to {MAX_NAME} characters without control characters"
                ));
            }
            let digest = parse_hex32(&t.sha256).ok_or_else(|| {
                format!(
                    "{at}: sha256 = {:?} must be 64 hex digits (the SHA-256 of the token, e.g. `printf %s TOKEN | sha256sum`)",
                    t.sha256
                )
            })?;
            if t.scopes.is_empty() {
                return Err(format!(
                    "{at}: scopes is empty; allowed: read, submit, admin, metrics"
                ));
            }
            let mut scopes = Vec::new();
            for s in &t.scopes {
                let scope = Scope::parse(s).ok_or_else(|| {
                    format!("{at}: unknown scope {s:?}; allowed: read, submit, admin, metrics")
                })?;
                if !scopes.contains(&scope) {
                    scopes.push(scope);
                }
            }
            if let Some(j) = entries.iter().position(|e| e.digest == digest) {
                return Err(format!(
                    "{at}: the same sha256 as token[{j}] (name {:?}); each token must be distinct",
                    entries[j].principal.name
                ));
            }
            entries.push(Entry {
                digest,
                principal: Principal {
                    name: t.name,
                    scopes,
                },
            });
        }
        Ok(TokenTable { entries })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The principal whose entry holds the SHA-256 of `token`. Every entry
    /// is compared, each in constant time, whether or not an earlier one
    /// matched.
    pub fn lookup(&self, token: &str) -> Option<&Principal> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for e in &self.entries {
            let same: bool = e.digest.ct_eq(&digest).into();
            if same && found.is_none() {
                found = Some(&e.principal);
            }
        }
        found
    }

    /// Who presents the `authorization` header value `header` (None: no
    /// header).
    pub fn authenticate(&self, header: Option<&[u8]>) -> Result<Principal, AuthError> {
        let token = bearer(header)?;
        self.lookup(token).cloned().ok_or(AuthError::UnknownToken)
    }
}

/// Why a request is refused.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum AuthError {
    #[error("no credentials: send `authorization: Bearer <token>`")]
    Missing,
    #[error("malformed authorization header: {0}; expected `Bearer <token>`")]
    Malformed(&'static str),
    #[error("unknown token (not in the coordinator's tokens file)")]
    UnknownToken,
    #[error("{principal} lacks the {need} scope (has: {have}) needed for {what}")]
    Forbidden {
        principal: String,
        need: Scope,
        have: String,
        what: String,
    },
}

impl AuthError {
    /// UNAUTHENTICATED / 401 (else PERMISSION_DENIED / 403).
    pub fn unauthenticated(&self) -> bool {
        !matches!(self, AuthError::Forbidden { .. })
    }
}

impl From<AuthError> for tonic::Status {
    fn from(e: AuthError) -> Self {
        if e.unauthenticated() {
            tonic::Status::unauthenticated(e.to_string())
        } else {
            tonic::Status::permission_denied(e.to_string())
        }
    }
}

/// The token of an `authorization: Bearer <token>` header value.
pub fn bearer(header: Option<&[u8]>) -> Result<&str, AuthError> {
    let h = header.ok_or(AuthError::Missing)?;
    let h = std::str::from_utf8(h).map_err(|_| AuthError::Malformed("not UTF-8"))?;
    let (scheme, token) = h.split_once(' ').ok_or(AuthError::Malformed("no scheme"))?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::Malformed("the scheme is not Bearer"));
    }
    let token = token.trim_matches(' ');
    if token.is_empty() {
        return Err(AuthError::Malformed("empty token"));
    }
    if token.len() > MAX_TOKEN {
        return Err(AuthError::Malformed("token longer than 4096 bytes"));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(AuthError::Malformed(
            "the token has characters other than visible ASCII",
        ));
    }
    Ok(token)
}

/// What a request needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Nothing (probes; WorkerService, which mutual TLS protects).
    Open,
    /// A known token holding this scope.
    Need(Scope),
}

/// JobService's methods and the scope each needs. CancelJob and ResumeJob
/// also need the caller to own the job unless it holds `admin` (the
/// scheduler decides).
pub const JOB_SERVICE: &str = "/accrue.v1.JobService/";
pub const WORKER_SERVICE: &str = "/accrue.v1.WorkerService/";

/// The rule for a gRPC method path. Anything that is neither a known
/// JobService method nor WorkerService needs `admin` (new methods are
/// closed until given a rule).
pub fn grpc_rule(path: &str) -> Rule {
    if path.starts_with(WORKER_SERVICE) {
        return Rule::Open;
    }
    match path.strip_prefix(JOB_SERVICE) {
        Some("GetJob" | "ListJobs" | "WatchJob" | "GetSeries") => Rule::Need(Scope::Read),
        Some("SubmitJob" | "CancelJob" | "ResumeJob") => Rule::Need(Scope::Submit),
        _ => Rule::Need(Scope::Admin),
    }
}

/// The rule for an HTTP request: probes are open, `/metrics` needs
/// `metrics`, the cancel and resume POSTs need `submit` (and ownership, or
/// admin), the sign-in POST is open (its one-use code is the credential;
/// the cross-site refusal still applies),
/// everything else (dashboard, JSON, unknown paths) needs `read`.
pub fn http_rule(method: &axum::http::Method, path: &str) -> Rule {
    match path {
        // The page shell and its assets hold no data.
        "/healthz" | "/readyz" | "/" | "/favicon.ico" => Rule::Open,
        _ if path.starts_with("/assets/") && method == axum::http::Method::GET => Rule::Open,
        SIGN_IN_PATH if method == axum::http::Method::POST => Rule::Open,
        "/metrics" => Rule::Need(Scope::Metrics),
        _ if method == axum::http::Method::POST => Rule::Need(Scope::Submit),
        _ => Rule::Need(Scope::Read),
    }
}

/// Decides a request: None when it needs nothing (or no tokens file is
/// configured: auth off), the principal when it may go on, the refusal
/// otherwise.
pub fn decide(
    table: Option<&TokenTable>,
    rule: Rule,
    header: Option<&[u8]>,
    what: &str,
) -> Result<Option<Principal>, AuthError> {
    let (Some(table), Rule::Need(need)) = (table, rule) else {
        return Ok(None);
    };
    Ok(Some(table.authenticate(header)?.needing(need, what)?))
}

/// How often the tokens file is looked at, at most.
pub const RELOAD_EVERY: Duration = Duration::from_secs(1);

/// What tells two versions of the file apart without reading it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    inode: u64,
}

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    let m = std::fs::metadata(path)?;
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let inode = 0;
    Ok(Stamp {
        len: m.len(),
        modified: m.modified().ok(),
        inode,
    })
}

struct Loaded {
    table: Arc<TokenTable>,
    stamp: Option<Stamp>,
    checked: Instant,
}

/// The tokens file, re-read when it changes: looked at (a `stat`) no more
/// than once per [`RELOAD_EVERY`], on the request path. A new version that
/// cannot be read or parsed is logged and the previous table stays.
pub struct Tokens {
    path: PathBuf,
    loaded: Mutex<Loaded>,
    /// One-use sign-in codes for the status page, each for a token of
    /// this file.
    signins: signin::SignIns,
}

fn read_table(path: &Path) -> Result<TokenTable, TokensError> {
    // Whoever may write the file (or replace it in its folder) could give
    // themselves any scope: refused before it is read, at start and at
    // every reload.
    accrue_common::strict_modes::check_private_file(path).map_err(|e| TokensError::NotPrivate {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let text = std::fs::read_to_string(path).map_err(|e| TokensError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    TokenTable::parse(&text).map_err(|reason| TokensError::Parse {
        path: path.display().to_string(),
        reason,
    })
}

impl Tokens {
    /// Reads the file now; a file that cannot be read or parsed is an error
    /// (the coordinator does not start without its tokens).
    pub fn load(path: &Path) -> Result<Tokens, TokensError> {
        let st = stamp(path).map_err(|e| TokensError::Read {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let table = read_table(path)?;
        if table.is_empty() {
            tracing::warn!(path = %path.display(), "the tokens file holds no token: every authenticated request is refused");
        }
        tracing::info!(path = %path.display(), tokens = table.len(), "tokens loaded");
        Ok(Tokens {
            path: path.to_path_buf(),
            loaded: Mutex::new(Loaded {
                table: Arc::new(table),
                stamp: Some(st),
                checked: Instant::now(),
            }),
            signins: signin::SignIns::default(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The table as of `now`: re-read first if the last look is at least
    /// [`RELOAD_EVERY`] old and the file changed since.
    pub fn current_at(&self, now: Instant) -> Arc<TokenTable> {
        // A poisoned lock still holds a whole table: take it.
        let mut l = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if now.saturating_duration_since(l.checked) < RELOAD_EVERY {
            return l.table.clone();
        }
        l.checked = now;
        let st = match stamp(&self.path) {
            Ok(s) => Some(s),
            Err(e) => {
                if l.stamp.is_some() {
                    tracing::error!(path = %self.path.display(), error = %e, "cannot read the tokens file; keeping the previous tokens");
                }
                None
            }
        };
        if st.is_none() || st == l.stamp {
            l.stamp = st;
            return l.table.clone();
        }
        l.stamp = st;
        match read_table(&self.path) {
            Ok(t) => {
                tracing::info!(path = %self.path.display(), tokens = t.len(), "tokens reloaded");
                l.table = Arc::new(t);
            }
            Err(e) => {
                tracing::error!(error = %e, "the tokens file changed but cannot be taken; keeping the previous tokens")
            }
        }
        l.table.clone()
    }

    pub fn current(&self) -> Arc<TokenTable> {
        self.current_at(Instant::now())
    }

    /// A one-use sign-in code ([`signin`]) standing for `token`, which must
    /// be in the file now with the `read` scope.
    pub fn sign_in_code(&self, token: &str) -> Result<String, AuthError> {
        let p = self.current().lookup(token).cloned();
        p.ok_or(AuthError::UnknownToken)?
            .needing(Scope::Read, "a sign-in link")?;
        Ok(self.signins.issue_at(token, Instant::now()))
    }

    /// The token a sign-in code stands for and its principal, once: None
    /// when the code is unknown, used or expired, or its token has left
    /// the file (or lost `read`) since.
    pub fn redeem_sign_in(&self, code: &str) -> Option<(String, Principal)> {
        let token = self.signins.redeem_at(code, Instant::now())?;
        let p = self.current().lookup(&token).cloned()?;
        p.has(Scope::Read).then_some((token, p))
    }
}

/// The tower layer deciding every gRPC request by its method path (tonic's
/// interceptors do not see the path): refused requests are answered here
/// with UNAUTHENTICATED or PERMISSION_DENIED; allowed ones carry their
/// [`Principal`] in the request's extensions. Without tokens (None) every
/// request passes, as before.
#[derive(Clone)]
pub struct GrpcAuthLayer {
    tokens: Option<Arc<Tokens>>,
}

impl GrpcAuthLayer {
    pub fn new(tokens: Option<Arc<Tokens>>) -> Self {
        Self { tokens }
    }
}

impl<S> tower::Layer<S> for GrpcAuthLayer {
    type Service = GrpcAuth<S>;
    fn layer(&self, inner: S) -> GrpcAuth<S> {
        GrpcAuth {
            inner,
            tokens: self.tokens.clone(),
        }
    }
}

#[derive(Clone)]
pub struct GrpcAuth<S> {
    inner: S,
    tokens: Option<Arc<Tokens>>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, RB> tower::Service<axum::http::Request<B>> for GrpcAuth<S>
where
    S: tower::Service<axum::http::Request<B>, Response = axum::http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: axum::http::Request<B>) -> Self::Future {
        let path = req.uri().path().to_string();
        let table = self.tokens.as_ref().map(|t| t.current());
        let header = req
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        match decide(table.as_deref(), grpc_rule(&path), header, &path) {
            Ok(p) => {
                if let Some(p) = p {
                    req.extensions_mut().insert(p);
                }
                Box::pin(self.inner.call(req))
            }
            Err(e) => {
                tracing::info!(method = %path, error = %e, "grpc request refused");
                let status: tonic::Status = e.into();
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

pub mod signin;

/// Where the status page exchanges a sign-in code for its token.
pub const SIGN_IN_PATH: &str = "/v1/signin";

#[cfg(test)]
mod tests;
