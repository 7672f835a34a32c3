//! Helpers for process-level tests: an in-process coordinator on port 0,
//! worker daemons as real processes (logs to files, killed on drop), and
//! waits that poll a condition. Everything runs secure, as by default:
//! TLS, mutual TLS for workers and tokens from [`creds`].
#![allow(dead_code)]

pub mod audit;
mod creds;
pub mod etcd;
pub mod weights;
#[allow(unused_imports)] // not every test binary uses every helper
pub use creds::{creds, https_client};

use accrue::Client;
use accrue_proto::v1::{self, Job, JobState};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn worker_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_BIN_EXE_accrue")).with_file_name("accrue-worker");
    assert!(
        p.exists(),
        "{} is missing: `make test` builds the whole workspace first",
        p.display()
    );
    p
}

pub struct Workers(pub Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `n` worker daemons attached to `grpc`, logging into `dir`.
pub fn start_workers(grpc: &str, n: usize, dir: &Path, prefix: &str) -> Workers {
    Workers(
        (0..n)
            .map(|i| spawn_worker(grpc, &format!("{prefix}{i}"), dir, &[]))
            .collect(),
    )
}

/// One worker daemon `id` attached to `grpc` over mutual TLS (heartbeat
/// 0.2 s, `extra` flags after the others), logging into `dir/<id>.log`.
pub fn spawn_worker(grpc: &str, id: &str, dir: &Path, extra: &[&str]) -> Child {
    let log = std::fs::File::create(dir.join(format!("{id}.log"))).unwrap();
    Command::new(worker_bin())
        .args(["daemon", "--coordinator", grpc])
        .args(["--id", id, "--heartbeat", "0.2"])
        .args(creds().worker_args(id))
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// A JobService client over TLS with the token of `scope`.
pub async fn client_as(grpc: &str, scope: &str) -> Client {
    client_with(grpc, &creds().token(scope)).await
}

/// A JobService client over TLS with `token`.
pub async fn client_with(grpc: &str, token: &str) -> Client {
    let token = accrue::BearerToken::new(token).unwrap();
    accrue::connect_client(
        &format!("https://{grpc}"),
        Some(&creds().client_tls()),
        &token,
    )
    .await
    .unwrap()
}

/// A tokens file (`--tokens`) of (principal, token, scopes).
pub fn tokens_toml(entries: &[(&str, &str, &[&str])]) -> String {
    entries
        .iter()
        .map(|(name, token, scopes)| {
            format!(
                "[[token]]\nname = {name:?}\nsha256 = \"{}\"\nscopes = {scopes:?}\n\n",
                accrue_coordinator::auth::sha256_hex(token)
            )
        })
        .collect()
}

/// A JobService client over TLS with the admin token.
pub async fn client(grpc: &str) -> Client {
    client_as(grpc, "admin").await
}

/// The `accrue` CLI with the test credentials in its environment (the CA
/// and the token of `scope`).
pub fn cli(scope: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_accrue"));
    c.env_remove("ACCRUE_TOKEN").envs(creds().cli_env(scope));
    c
}

/// Polls until `cond` holds or `limit` passes.
pub async fn wait_until<F: FnMut() -> bool>(limit: Duration, mut cond: F) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}

pub async fn wait_state(c: &mut Client, id: &str, want: &[JobState], limit: Duration) -> Job {
    let deadline = Instant::now() + limit;
    loop {
        let j = c
            .get_job(v1::GetJobRequest { id: id.into() })
            .await
            .unwrap()
            .into_inner();
        if want.contains(&j.state()) || Instant::now() > deadline {
            return j;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Submits the TOML spec `text` (it must be accepted).
pub async fn submit_text(c: &mut Client, text: &str) -> Job {
    c.submit_job(v1::SubmitJobRequest {
        spec: Some(spec(text)),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
}

/// Polls until the job has committed at least `step` steps (at most 60 s;
/// the job as last seen either way).
pub async fn wait_step(c: &mut Client, id: &str, step: u64) -> Job {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let j = c
            .get_job(v1::GetJobRequest { id: id.into() })
            .await
            .unwrap()
            .into_inner();
        if j.counters.unwrap_or_default().step >= step || Instant::now() > deadline {
            return j;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 120 s) until the job has ended.
pub async fn ended(c: &mut Client, id: &str) -> Job {
    wait_state(
        c,
        id,
        &[JobState::Succeeded, JobState::Failed, JobState::Cancelled],
        Duration::from_secs(120),
    )
    .await
}

/// A small synthetic MLP job.
pub fn job_toml(name: &str, workers: u32, max_steps: u64, extra: &str) -> String {
    format!(
        r#"
name = "{name}"
workers = {workers}
seed = 3
max_steps = {max_steps}
device = "cpu"
threads = 1
[model]
kind = "mlp"
hidden = [32]
[data]
kind = "synthetic"
samples = 512
eval_samples = 64
shape = [16]
classes = 4
batch_size = 8
[accumulation]
steps = 2
[clipping]
max_norm = 1.0
[optimizer]
kind = "sgd"
lr = 0.1
momentum = 0.9
{extra}
"#
    )
}

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

pub fn coordinator_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_BIN_EXE_accrue")).with_file_name("accrue-coordinator");
    assert!(
        p.exists(),
        "{} is missing: `make test` builds the whole workspace first",
        p.display()
    );
    p
}

/// A coordinator process (killed on drop) and the addresses it printed.
pub struct CoordinatorProc {
    pub child: Child,
    pub grpc: String,
    pub http: String,
}

impl Drop for CoordinatorProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `accrue-coordinator` flags for a test: both ports on 127.0.0.1:0, state
/// under `state`, heartbeat TTL 3 s, the test credentials (TLS, mutual
/// TLS, tokens), then `extra`.
pub fn coordinator_args(state: &Path, extra: &[&str]) -> Vec<String> {
    coordinator_args_on("127.0.0.1:0", state, extra)
}

/// [`coordinator_args`] with gRPC on `listen`.
pub fn coordinator_args_on(listen: &str, state: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["--listen", listen, "--http", "127.0.0.1:0"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(["--state-dir".into(), state.display().to_string()]);
    a.extend(["--heartbeat-ttl".into(), "3".into()]);
    a.extend(creds().coordinator_args());
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// Starts `accrue-coordinator` with `args`, logging to `log`; returns once
/// it printed its addresses.
pub fn spawn_coordinator(args: &[String], log: &Path) -> CoordinatorProc {
    use std::io::BufRead;
    let err = std::fs::File::create(log).unwrap();
    let mut child = Command::new(coordinator_bin())
        .args(args)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(err)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(stdout).lines();
        let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
        let _ = tx.send(first);
        // Keep draining so later output never blocks the process.
        for _ in lines {}
    });
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("the coordinator printed no address; see {}", log.display()));
    let parts: Vec<&str> = line.split_whitespace().collect();
    assert!(
        parts.len() >= 4 && parts[0] == "grpc" && parts[2] == "http",
        "unexpected first line {line:?}; see {}",
        log.display()
    );
    CoordinatorProc {
        child,
        grpc: parts[1].to_string(),
        http: parts[3].to_string(),
    }
}

/// An in-process embedded coordinator on port 0 (state under `dir/state`,
/// heartbeat TTL 3 s, TLS, mutual TLS and tokens from [`creds`]).
pub async fn coordinator(dir: &Path) -> accrue_coordinator::Handle {
    let cfg = accrue_coordinator::Config {
        state_dir: dir.join("state"),
        heartbeat_ttl: Duration::from_secs(3),
        tls: Some(creds().server_tls()),
        tokens: Some(creds().tokens_file()),
        ..Default::default()
    };
    accrue_coordinator::start(cfg, "127.0.0.1:0", "127.0.0.1:0")
        .await
        .unwrap()
}

/// A TOML job spec as the proto JobSpec.
pub fn spec(text: &str) -> v1::JobSpec {
    let s = accrue_common::JobSpec::from_toml_str(text, Path::new("t.toml")).unwrap();
    accrue_proto::spec_to_proto(&s)
}

/// A WorkerService client over mutual TLS with worker `id`'s certificate.
pub async fn worker_client(
    grpc: &str,
    id: &str,
) -> v1::worker_service_client::WorkerServiceClient<tonic::transport::Channel> {
    let (cert, key) = creds().worker_files(id);
    let tls = accrue_proto::tls::ClientTls {
        ca: creds().ca(),
        identity: Some(accrue_proto::tls::KeyPairFiles { cert, key }),
    };
    let channel = accrue_proto::tls::endpoint(grpc, Some(&tls))
        .unwrap()
        .connect()
        .await
        .unwrap();
    v1::worker_service_client::WorkerServiceClient::new(channel)
}

/// A fake worker: attaches as `hello.worker_id` (with its certificate)
/// and sends `hello`; returns the sender of its further messages and the
/// coordinator's stream.
pub async fn fake_worker(
    grpc: &str,
    hello: v1::WorkerHello,
) -> (
    tokio::sync::mpsc::UnboundedSender<v1::WorkerMessage>,
    tonic::Streaming<v1::CoordinatorMessage>,
) {
    let mut w = worker_client(grpc, &hello.worker_id).await;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(v1::WorkerMessage {
        msg: Some(v1::worker_message::Msg::Hello(hello)),
        ..Default::default()
    })
    .unwrap();
    let inbound = w
        .attach(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, inbound)
}

/// Runs `cmd` with stderr to `log` and waits at most 30 s: its exit status
/// (None: still running, then killed) and what it logged.
pub fn bounded(mut cmd: Command, log: &Path) -> (Option<std::process::ExitStatus>, String) {
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let limit = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, std::fs::read_to_string(log).unwrap())
}

/// An llm.c token file (magic 20240520: u16 tokens) of `count` tokens
/// over a vocabulary of 64.
pub fn token_file(dir: &Path, count: usize) -> PathBuf {
    let mut header = [0i32; 256];
    header[0] = 20240520;
    header[1] = 1;
    header[2] = count as i32;
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut x: u32 = 11;
    for _ in 0..count {
        x = x.wrapping_mul(1103515245).wrapping_add(12345);
        bytes.extend_from_slice(&(((x >> 16) % 64) as u16).to_le_bytes());
    }
    let p = dir.join("train.bin");
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A tiny Llama (vocab 64, width 16, `layers` decoder layers, grouped-query
/// attention) on the llm.c token file `data`, T = 8, b = 4, k = 4, AdamW
/// and clipping, on `workers` ranks; `model` lines end `[model]`,
/// `tables` are appended (the recovery tests).
pub fn tiny_llama_job(
    name: &str,
    data: &Path,
    workers: u32,
    epochs: u64,
    layers: u32,
    model: &str,
    tables: &str,
) -> String {
    format!(
        r#"
name = "{name}"
workers = {workers}
seed = 11
epochs = {epochs}
device = "cpu"
threads = 1
[model]
kind = "llama"
vocab_size = 64
hidden_size = 16
intermediate_size = 32
num_hidden_layers = {layers}
num_attention_heads = 2
num_key_value_heads = 1
max_position_embeddings = 16
{model}[data]
kind = "tokens"
path = "{data}"
seq_len = 8
batch_size = 4
shuffle = true
[accumulation]
steps = 4
[clipping]
max_norm = 1.0
[optimizer]
kind = "adamw"
lr = 0.01
weight_decay = 0.1
[comm]
timeout_s = 10
connect_timeout_s = 30
rendezvous_timeout_s = 1.5
{tables}"#,
        data = data.display()
    )
}
