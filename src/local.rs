//! `accrue local`: an embedded coordinator and N worker processes on
//! loopback, secured with throw-away credentials (or `--insecure`).

use crate::lifecycle::{spawn_tied, StateDirLock};
use crate::{certs, connect_client, exit_for, state_name, submit, BearerToken, Client};
use accrue_common::JobSpec;
use accrue_proto::tls::ClientTls;
use accrue_proto::v1::{self, Job};
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// How long stopping workers get to exit after SIGTERM before SIGKILL.
const WORKER_GRACE: Duration = Duration::from_secs(5);

/// Worker processes: [`Children::shutdown`] asks them to stop (SIGTERM:
/// each daemon detaches from the coordinator, a planned exit) and kills
/// any that has not exited within [`WORKER_GRACE`]; dropping kills what is
/// left.
#[derive(Default)]
struct Children(Vec<std::process::Child>);

impl Children {
    async fn shutdown(&mut self) {
        for c in &self.0 {
            if let Ok(pid) = libc::pid_t::try_from(c.id()) {
                // SAFETY: kill(2) on our own child, not yet waited for (so
                // its pid cannot have been reused), only sends a signal.
                unsafe {
                    libc::kill(pid, libc::SIGTERM);
                }
            }
        }
        let deadline = tokio::time::Instant::now() + WORKER_GRACE;
        for c in &mut self.0 {
            while tokio::time::Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `accrue local`'s flags.
pub(crate) struct LocalOptions {
    /// `--workers`: None takes the spec's `workers`.
    pub(crate) workers: Option<u32>,
    pub(crate) state_dir: PathBuf,
    pub(crate) worker_bin: Option<PathBuf>,
    pub(crate) threads: Option<u32>,
    pub(crate) json: bool,
    /// Plaintext instead of throw-away certificates.
    pub(crate) insecure: bool,
    /// Continue the newest job of the spec's name in the state dir.
    pub(crate) resume: bool,
}

/// `accrue local`'s throw-away credentials under `state_dir/tls`.
struct LocalCreds {
    server: accrue_coordinator::tls::ServerTls,
    client: ClientTls,
    tokens: PathBuf,
    /// The `submit` token the CLI side submits (and may cancel) with.
    submit: BearerToken,
    /// The same token as text: what the status page's one-use sign-in
    /// link stands for (the page may then cancel or resume this run's job).
    submit_text: String,
}

/// Throw-away credentials for `accrue local` under `state_dir/tls`: a
/// fresh CA, the coordinator's certificate, one per worker, and fresh
/// tokens, every run, so nothing issued for an earlier run is trusted.
fn local_creds(state_dir: &Path, ids: &[String]) -> anyhow::Result<LocalCreds> {
    let dir = state_dir.join("tls");
    for f in ["ca.pem", "ca.key", "tokens.toml"] {
        match std::fs::remove_file(dir.join(f)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("cannot remove {}", dir.join(f).display()))
            }
            _ => {}
        }
    }
    certs::dev_certs(
        &dir,
        &certs::DevCerts {
            sans: Vec::new(),
            workers: ids.to_vec(),
            days: 2,
        },
    )?;
    let submit = std::fs::read_to_string(dir.join("submit.token"))
        .with_context(|| format!("cannot read {}", dir.join("submit.token").display()))?;
    Ok(LocalCreds {
        server: accrue_coordinator::tls::ServerTls {
            cert: dir.join("coordinator.pem"),
            key: dir.join("coordinator.key"),
            client_ca: dir.join("ca.pem"),
        },
        client: ClientTls {
            ca: dir.join("ca.pem"),
            identity: None,
        },
        tokens: dir.join("tokens.toml"),
        submit: BearerToken::new(submit.trim())?,
        submit_text: submit.trim().to_string(),
    })
}

/// Intra-op threads per local worker: the host's cores shared evenly.
fn threads_per_worker(cores: usize, workers: u32) -> u32 {
    (cores as u32 / workers.max(1)).max(1)
}

/// The signals that stop `accrue local` the way Ctrl-C does: SIGINT,
/// SIGTERM (`timeout`, systemd, a CI job's cancel, `kill`) and SIGHUP (a
/// terminal closing). Listening replaces their default action (the
/// process dying on the spot, its workers running on).
struct StopSignals {
    int: Signal,
    term: Signal,
    hup: Signal,
}

impl StopSignals {
    fn listen() -> std::io::Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// The next stop signal's name.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            Some(()) = self.int.recv() => "SIGINT",
            Some(()) = self.term.recv() => "SIGTERM",
            Some(()) = self.hup.recv() => "SIGHUP",
            // Every stream ended (the runtime is shutting down): no signal
            // will come.
            else => std::future::pending().await,
        }
    }
}

/// What a run has started so far, stopped by [`Started::stop`] on every
/// way out.
#[derive(Default)]
struct Started {
    children: Children,
    coordinator: Option<accrue_coordinator::Handle>,
    client: Option<Client>,
    job: Option<String>,
    /// `<state-dir>/env`, removed when the run stops (its coordinator
    /// goes with it).
    env_file: Option<PathBuf>,
}

impl Started {
    /// Cancels the job first when `cancel`, then asks the workers to stop
    /// and kills those still running after the grace period (at once on
    /// another stop signal), then stops the coordinator.
    async fn stop(mut self, cancel: bool, signals: &mut StopSignals) {
        if let (true, Some(client), Some(id)) = (cancel, self.client.as_mut(), &self.job) {
            let req = v1::CancelJobRequest { id: id.clone() };
            // In-process; bounded all the same so a stop always ends.
            let _ = tokio::time::timeout(Duration::from_secs(5), client.cancel_job(req)).await;
        }
        drop(self.client);
        tokio::select! {
            () = self.children.shutdown() => {}
            s = signals.recv() => crate::errln!("{s} again: killing the workers now"),
        }
        drop(self.children);
        if let Some(h) = self.coordinator {
            h.stop().await;
        }
        if let Some(f) = self.env_file {
            let _ = std::fs::remove_file(f);
        }
    }
}

pub(crate) async fn local(job: &Path, opts: LocalOptions) -> anyhow::Result<ExitCode> {
    let state_dir = opts.state_dir.as_path();
    if opts.workers == Some(0) {
        bail!("--workers must be at least 1");
    }
    // Refuse a bad spec before starting anything, with --workers as the
    // coordinator will see it (a number it refuses must not start a
    // process).
    let mut spec = JobSpec::load(job)?;
    let name = spec.name.clone();
    let workers = opts.workers.unwrap_or(spec.workers);
    if workers != spec.workers {
        crate::errln!(
            "--workers {workers} overrides the spec's workers = {}",
            spec.workers
        );
    }
    spec.workers = workers;
    spec.validate_fields()
        .map_err(|e| anyhow::anyhow!("with --workers {workers}: {e}"))?;
    let threads = opts.threads.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        threads_per_worker(cores, workers)
    });
    let bin = match &opts.worker_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("accrue-worker"),
    };
    if !bin.exists() {
        bail!(
            "worker binary {} not found (build it with `cargo build -p accrue-worker`)",
            bin.display()
        );
    }
    // One run per state dir, before anything is written there: a second
    // run must not replace the credentials (or truncate the logs) of the
    // one in progress. Held until this function returns.
    let _lock = StateDirLock::acquire(state_dir)?;
    let mut signals =
        StopSignals::listen().context("cannot listen for SIGINT, SIGTERM and SIGHUP")?;
    let mut started = Started::default();
    let outcome = tokio::select! {
        r = start_and_watch(job, &name, &opts, workers, &bin, threads, &mut started) => Ok(r),
        s = signals.recv() => Err(s),
    };
    let end = match outcome {
        Ok(Ok(end)) => end,
        Ok(Err(e)) => {
            started.stop(false, &mut signals).await;
            return Err(e);
        }
        Err(signal) => {
            let id = started.job.clone();
            started.stop(true, &mut signals).await;
            match id {
                Some(id) => bail!(
                    "interrupted by {signal}; job {id} cancelled (continue it from its newest checkpoint with: {})",
                    resume_hint(job, &opts)
                ),
                None => bail!("interrupted by {signal} before the job was submitted"),
            }
        }
    };
    let c = end.counters.unwrap_or_default();
    let lm = accrue_coordinator::http::is_lm(&end);
    crate::outln!(
        "{} {}: step {}/{}, {} {}, loss {:.4}",
        end.id,
        state_name(end.state()),
        c.step,
        c.total_steps,
        c.samples_seen,
        if lm { "tokens" } else { "samples" },
        c.loss
    );
    // A failed or cancelled job has no final numbers, only its last eval.
    match (&end.eval, end.state() == v1::JobState::Succeeded) {
        (Some(e), true) => crate::outln!("final {}", crate::eval_words(e, lm)),
        (Some(e), false) => {
            crate::outln!("last eval (step {}): {}", e.step, crate::eval_words(e, lm))
        }
        (None, _) => {}
    }
    if !end.checkpoint.is_empty() {
        crate::outln!("checkpoint {}", end.checkpoint);
    }
    if !end.error.is_empty() {
        crate::outln!("error {}", end.error);
    }
    if matches!(end.state(), v1::JobState::Failed | v1::JobState::Cancelled) {
        crate::outln!(
            "continue it from its newest checkpoint with: {}",
            resume_hint(job, &opts)
        );
    }
    started.stop(false, &mut signals).await;
    Ok(exit_for(&end))
}

/// Writes the credentials, starts the coordinator and the workers,
/// submits the job and watches it to its end, recording in `started` what
/// is to be stopped.
async fn start_and_watch(
    job: &Path,
    name: &str,
    opts: &LocalOptions,
    workers: u32,
    bin: &Path,
    threads: u32,
    started: &mut Started,
) -> anyhow::Result<Job> {
    let state_dir = opts.state_dir.as_path();
    let ids: Vec<String> = (0..workers).map(|i| format!("local-{i}")).collect();
    // TLS, mutual TLS and tokens with throw-away credentials unless
    // --insecure.
    let creds = if opts.insecure {
        None
    } else {
        Some(local_creds(state_dir, &ids)?)
    };
    let cfg = accrue_coordinator::Config {
        state_dir: state_dir.to_path_buf(),
        tls: creds.as_ref().map(|c| c.server.clone()),
        tokens: creds.as_ref().map(|c| c.tokens.clone()),
        insecure: opts.insecure,
        tensorboard_dir: Some(state_dir.join("tensorboard")),
        watch_buffer: accrue_coordinator::watch_buffer_from_env()?,
        ..Default::default()
    };
    let handle = accrue_coordinator::start(cfg, "127.0.0.1:0", "127.0.0.1:0").await?;
    let (grpc_addr, http_addr) = (handle.grpc_addr, handle.http_addr);
    let sign_in = creds
        .as_ref()
        .and_then(|c| handle.sign_in_link(&c.submit_text));
    started.coordinator = Some(handle);
    let scheme = if creds.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{grpc_addr}");
    match &creds {
        Some(c) => crate::outln!(
            "coordinator {url} (status {scheme}://{http_addr}/ with the token in {}; CA {})",
            c.tokens.with_file_name("read.token").display(),
            c.client.ca.display()
        ),
        None => crate::outln!("coordinator {url} (status {scheme}://{http_addr}/)"),
    }
    if let Some(link) = sign_in {
        crate::outln!("status page, signed in (the link works once, within 10 minutes): {link}");
    }
    let env = write_env_file(state_dir, &url, creds.as_ref())?;
    crate::outln!(
        "env {} (in another shell: source it, then accrue list, accrue watch JOB)",
        env.display()
    );
    started.env_file = Some(env);
    crate::outln!(
        "TensorBoard: tensorboard --logdir {}",
        state_dir.join("tensorboard").display()
    );
    let logs = state_dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    for (i, id) in ids.iter().enumerate() {
        let log = std::fs::File::create(logs.join(format!("worker-{i}.log")))?;
        let mut cmd = std::process::Command::new(bin);
        cmd.args([
            "daemon",
            "--coordinator",
            &url,
            "--listen-data",
            "127.0.0.1:0",
            "--id",
            id,
            "--threads",
            &threads.to_string(),
        ]);
        match &creds {
            Some(c) => {
                let dir = c.server.client_ca.parent().unwrap_or(state_dir);
                cmd.arg("--ca")
                    .arg(&c.server.client_ca)
                    .arg("--cert")
                    .arg(dir.join(format!("worker-{id}.pem")))
                    .arg("--key")
                    .arg(dir.join(format!("worker-{id}.key")));
            }
            None => {
                cmd.arg("--insecure");
            }
        }
        cmd.env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdout(log.try_clone()?)
        .stderr(log);
        // Tied to this process: a worker dies with it even when it is
        // killed with SIGKILL (nothing is left retrying a dead
        // coordinator).
        let child = spawn_tied(cmd).with_context(|| format!("cannot start {}", bin.display()))?;
        started.children.0.push(child);
    }
    let client = match &creds {
        Some(c) => connect_client(&url, Some(&c.client), &c.submit).await?,
        None => connect_client(&url, None, &BearerToken::default()).await?,
    };
    let client = started.client.insert(client);
    let submitted = if opts.resume {
        let j = resume_newest(client, name, state_dir).await?;
        crate::outln!("job {} resumed", j.id);
        j
    } else {
        let j = submit(client, job, Some(workers)).await?;
        crate::outln!("job {}", j.id);
        j
    };
    started.job = Some(submitted.id.clone());
    crate::watch::follow(client, &submitted.id, opts.json).await
}

/// The command that continues this run's job.
fn resume_hint(job: &Path, opts: &LocalOptions) -> String {
    format!(
        "accrue local {}{} --state-dir {} --resume",
        job.display(),
        opts.workers
            .map_or(String::new(), |w| format!(" --workers {w}")),
        opts.state_dir.display()
    )
}

/// `s` as one shell word: single-quoted, each `'` as `'\''`.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The lines of `<state-dir>/env`: what a CLI in another shell needs to
/// reach this run's coordinator (its URL, the CA and the submit token's
/// file, as absolute paths; `ACCRUE_INSECURE` for a plaintext run).
/// `ACCRUE_TOKEN` is unset: it would contradict the token file.
fn env_lines(url: &str, tls: Option<(&Path, &Path)>) -> String {
    let mut out = String::from(
        "# accrue local: `source` this file to reach the run's coordinator from another shell\n",
    );
    out.push_str("unset ACCRUE_TOKEN ACCRUE_INSECURE ACCRUE_CA ACCRUE_TOKEN_FILE\n");
    out.push_str(&format!("export ACCRUE_COORDINATOR={}\n", shell_quote(url)));
    match tls {
        Some((ca, token)) => {
            for (name, p) in [("ACCRUE_CA", ca), ("ACCRUE_TOKEN_FILE", token)] {
                let p = p.to_string_lossy();
                out.push_str(&format!("export {name}={}\n", shell_quote(&p)));
            }
        }
        None => out.push_str("export ACCRUE_INSECURE=true\n"),
    }
    out
}

/// Writes `<state-dir>/env` (whole or not at all: a temporary file
/// renamed); its path.
fn write_env_file(
    state_dir: &Path,
    url: &str,
    creds: Option<&LocalCreds>,
) -> anyhow::Result<PathBuf> {
    let abs = |p: &Path| std::path::absolute(p).with_context(|| format!("{}", p.display()));
    let paths = match creds {
        Some(c) => Some((
            abs(&c.client.ca)?,
            abs(&c.tokens.with_file_name("submit.token"))?,
        )),
        None => None,
    };
    let text = env_lines(url, paths.as_ref().map(|(a, b)| (a.as_path(), b.as_path())));
    let (path, tmp) = (state_dir.join("env"), state_dir.join("env.tmp"));
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// `--resume`: the newest job named after spec `name` in the embedded
/// coordinator's store, resumed when it failed or was cancelled (its
/// workers continue from its newest verified checkpoint, sweeping what a
/// killed write left), watched as it is when it is still scheduled (the
/// run before was killed without a chance to cancel it).
async fn resume_newest(client: &mut Client, name: &str, state_dir: &Path) -> anyhow::Result<Job> {
    let mut newest: Option<Job> = None;
    let mut pages = crate::Pages::default();
    while let Some(jobs) = pages.next(client).await? {
        for j in jobs {
            let same = j.spec.as_ref().is_some_and(|s| s.name == name);
            if same
                && newest
                    .as_ref()
                    .is_none_or(|n| j.created_unix_ms >= n.created_unix_ms)
            {
                newest = Some(j);
            }
        }
    }
    let Some(j) = newest else {
        bail!(
            "--resume: state dir {} holds no job of spec {name:?}; run without --resume to start one",
            state_dir.display()
        );
    };
    match j.state() {
        v1::JobState::Failed | v1::JobState::Cancelled => Ok(client
            .resume_job(v1::ResumeJobRequest { id: j.id })
            .await
            .map_err(crate::status_err)?
            .into_inner()),
        v1::JobState::Succeeded => bail!(
            "--resume: the newest job of spec {name:?} in state dir {}, {}, already succeeded; run without --resume to start a new one",
            state_dir.display(),
            j.id
        ),
        _ => Ok(j),
    }
}

#[cfg(test)]
mod tests {
    use super::{env_lines, shell_quote, threads_per_worker};
    use std::path::Path;

    /// The env file is shell: every value one quoted word, whatever it
    /// holds, and a plaintext run says so instead of naming a CA.
    #[test]
    fn env_lines_are_shell_words() {
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        let tls = env_lines(
            "https://127.0.0.1:5",
            Some((Path::new("/s d/ca.pem"), Path::new("/s d/submit.token"))),
        );
        assert!(tls.contains("export ACCRUE_COORDINATOR='https://127.0.0.1:5'\n"));
        assert!(tls.contains("export ACCRUE_CA='/s d/ca.pem'\n"));
        assert!(tls.contains("export ACCRUE_TOKEN_FILE='/s d/submit.token'\n"));
        assert!(!tls.contains("ACCRUE_INSECURE="));
        let plain = env_lines("http://127.0.0.1:5", None);
        assert!(plain.contains("export ACCRUE_INSECURE=true\n") && !plain.contains("ACCRUE_CA="));
    }

    #[test]
    fn local_workers_share_the_cores() {
        assert_eq!(threads_per_worker(2, 2), 1);
        assert_eq!(threads_per_worker(16, 2), 8);
        assert_eq!(threads_per_worker(16, 3), 5);
        // More workers than cores: one thread each, never zero.
        assert_eq!(threads_per_worker(2, 4), 1);
        assert_eq!(threads_per_worker(1, 1), 1);
    }
}
