//! TLS and mutual TLS as processes on loopback: `accrue dev-certs` output
//! checked with rustls' own verifiers; a coordinator process with
//! `--tls-cert/--tls-key/--client-ca` refusing every client WorkerService
//! must not take (plaintext, no certificate, a rogue CA's, an expired one,
//! one naming another worker) and running a job end to end for a worker
//! daemon with the right certificate, submitted by the CLI over TLS.

mod common;

use accrue::certs::{Ca, Validity};
use accrue_proto::tls::{ClientTls, KeyPairFiles};
use accrue_proto::v1::{self, worker_message, worker_service_client::WorkerServiceClient};
use rustls::pki_types::{pem::PemObject, CertificateDer, ServerName, UnixTime};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::Arc;
use std::time::Duration;
use tempfile::TempDir;

fn certs(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

fn roots(ca: &Path) -> Arc<rustls::RootCertStore> {
    let mut r = rustls::RootCertStore::empty();
    for c in certs(ca) {
        r.add(c).unwrap();
    }
    Arc::new(r)
}

fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn accrue(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_accrue"))
        .args(args)
        .env_remove("ACCRUE_CA")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn dev_certs_writes_a_ca_certificates_and_tokens_that_verify() {
    accrue_proto::tls::install_crypto_provider();
    let d = TempDir::new().unwrap();
    let dir = d.path().join("pki");
    let s = dir.to_str().unwrap();
    let o = accrue(&[
        "dev-certs",
        s,
        "--san",
        "coord.example.com,10.1.2.3",
        "--workers",
        "w-0,w_1",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    for f in [
        "ca.key",
        "coordinator.key",
        "worker-w-0.key",
        "worker-w_1.key",
        "tokens.toml",
    ] {
        assert_eq!(mode(&dir.join(f)), 0o600, "{f}");
    }
    for t in ["admin", "submit", "read", "metrics"] {
        assert_eq!(mode(&dir.join(format!("{t}.token"))), 0o600, "{t}.token");
    }

    // The coordinator's certificate: a server certificate for the given
    // names plus localhost and 127.0.0.1, chaining to the CA.
    let server = rustls::client::WebPkiServerVerifier::builder(roots(&dir.join("ca.pem")))
        .build()
        .unwrap();
    let coord = certs(&dir.join("coordinator.pem"));
    let verify_server = |c: &CertificateDer<'_>, name: &str| {
        use rustls::client::danger::ServerCertVerifier;
        server.verify_server_cert(
            c,
            &[],
            &ServerName::try_from(name.to_string()).unwrap(),
            &[],
            UnixTime::now(),
        )
    };
    for name in ["coord.example.com", "10.1.2.3", "localhost", "127.0.0.1"] {
        verify_server(&coord[0], name).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert!(verify_server(&coord[0], "other.example.com").is_err());

    // Worker certificates: client certificates chaining to the CA, naming
    // their worker (w_1 is no DNS name: by its URI SAN only); a worker's
    // cannot pass for the coordinator, nor the coordinator's for a worker.
    let client = rustls::server::WebPkiClientVerifier::builder(roots(&dir.join("ca.pem")))
        .build()
        .unwrap();
    let verify_client = |c: &CertificateDer<'_>| client.verify_client_cert(c, &[], UnixTime::now());
    for (id, names) in [("w-0", vec!["w-0", "w-0"]), ("w_1", vec!["w_1"])] {
        let w = certs(&dir.join(format!("worker-{id}.pem")));
        verify_client(&w[0]).unwrap_or_else(|e| panic!("{id}: {e}"));
        assert_eq!(accrue_coordinator::tls::worker_names(&w[0]).unwrap(), names);
        assert!(verify_server(&w[0], "w-0").is_err(), "{id} as a server");
    }
    // etcd's certificate serves its names and is server-only: its DNS
    // names could otherwise pass for worker ids at WorkerService (etcd then
    // logs a refused self-connection of its JSON gateway, which accrue does
    // not use; see docs/SECURITY.md, etcd).
    let etcd = certs(&dir.join("etcd-server.pem"));
    for name in ["coord.example.com", "localhost", "127.0.0.1"] {
        verify_server(&etcd[0], name).unwrap_or_else(|e| panic!("etcd {name}: {e}"));
    }
    assert!(
        verify_client(&etcd[0]).is_err(),
        "etcd's certificate as a client"
    );
    assert!(
        verify_client(&coord[0]).is_err(),
        "the coordinator as a worker"
    );
    assert!(accrue_coordinator::tls::authorize_worker(
        Some(&certs(&dir.join("worker-w-0.pem"))),
        "w_1"
    )
    .is_err());

    // The tokens file: the four tokens, each the SHA-256 of its .token file.
    let toml: toml::Value = std::fs::read_to_string(dir.join("tokens.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let entries = toml["token"].as_array().unwrap();
    let want = [
        ("admin", vec!["read", "submit", "admin", "metrics"]),
        ("submit", vec!["read", "submit"]),
        ("read", vec!["read"]),
        ("metrics", vec!["metrics"]),
    ];
    assert_eq!(entries.len(), want.len());
    for (e, (name, scopes)) in entries.iter().zip(want) {
        use sha2::Digest;
        assert_eq!(e["name"].as_str(), Some(name));
        let got: Vec<&str> = e["scopes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap())
            .collect();
        assert_eq!(got, scopes);
        let token = std::fs::read_to_string(dir.join(format!("{name}.token"))).unwrap();
        let hash: String = sha2::Sha256::digest(token.trim().as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(e["sha256"].as_str(), Some(hash.as_str()), "{name}");
    }

    // Run again for another worker: the CA and the tokens stay; the new
    // certificate chains to the CA already handed out.
    let (ca_before, tokens_before) = (
        std::fs::read(dir.join("ca.pem")).unwrap(),
        std::fs::read(dir.join("tokens.toml")).unwrap(),
    );
    let o = accrue(&["dev-certs", s, "--workers", "w-2"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("existing CA"),
        "{}",
        text(&o)
    );
    assert_eq!(std::fs::read(dir.join("ca.pem")).unwrap(), ca_before);
    assert_eq!(
        std::fs::read(dir.join("tokens.toml")).unwrap(),
        tokens_before
    );
    verify_client(&certs(&dir.join("worker-w-2.pem"))[0]).unwrap();

    // Bad input names what is wrong.
    let o = accrue(&["dev-certs", s, "--workers", "a/b"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("worker id \"a/b\""),
        "{}",
        text(&o)
    );
}

/// A cluster's files (dev-certs for workers w-0 and w-1, and its tokens)
/// and a coordinator process serving with them: TLS, mutual TLS for
/// workers and bearer tokens, all on.
struct Cluster {
    dir: TempDir,
    coord: common::CoordinatorProc,
}

impl Cluster {
    fn start() -> Cluster {
        let dir = TempDir::new().unwrap();
        let pki = dir.path().join("pki");
        accrue::certs::dev_certs(
            &pki,
            &accrue::certs::DevCerts {
                sans: Vec::new(),
                workers: vec!["w-0".into(), "w-1".into()],
                days: 1,
            },
        )
        .unwrap();
        let arg = |p: PathBuf| p.to_str().unwrap().to_string();
        let args: Vec<String> = [
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--heartbeat-ttl",
            "3",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([
            "--state-dir".into(),
            arg(dir.path().join("state")),
            "--tls-cert".into(),
            arg(pki.join("coordinator.pem")),
            "--tls-key".into(),
            arg(pki.join("coordinator.key")),
            "--client-ca".into(),
            arg(pki.join("ca.pem")),
            "--tokens".into(),
            arg(pki.join("tokens.toml")),
        ])
        .collect();
        let coord = common::spawn_coordinator(&args, &dir.path().join("coordinator.log"));
        Cluster { dir, coord }
    }

    fn pki(&self, f: &str) -> PathBuf {
        self.dir.path().join("pki").join(f)
    }

    /// TLS to the coordinator trusting the cluster CA, with `identity`.
    fn client(&self, identity: Option<(PathBuf, PathBuf)>) -> ClientTls {
        ClientTls {
            ca: self.pki("ca.pem"),
            identity: identity.map(|(cert, key)| KeyPairFiles { cert, key }),
        }
    }

    /// Writes a certificate and key under the test folder; their paths.
    fn write(&self, name: &str, pem: accrue::certs::Pem) -> (PathBuf, PathBuf) {
        let (c, k) = (
            self.dir.path().join(format!("{name}.pem")),
            self.dir.path().join(format!("{name}.key")),
        );
        std::fs::write(&c, pem.cert).unwrap();
        std::fs::write(&k, pem.key).unwrap();
        (c, k)
    }

    fn ca(&self) -> Ca {
        Ca::load(
            &std::fs::read_to_string(self.pki("ca.pem")).unwrap(),
            &std::fs::read_to_string(self.pki("ca.key")).unwrap(),
        )
        .unwrap()
    }
}

/// What became of an Attach: accepted (the stream is open), or refused
/// with a status code (the handler said no) or at the transport (the TLS
/// handshake or the connection failed; `why` is the whole error chain).
#[derive(Debug)]
enum Attach {
    Accepted,
    Refused { code: tonic::Code, why: String },
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(&format!(": {c}"));
        src = c.source();
    }
    s
}

/// Attaches to `grpc` as worker `id` over `tls` (None: plaintext).
async fn attach(grpc: &str, tls: Option<&ClientTls>, id: &str) -> Attach {
    let ep = accrue_proto::tls::endpoint(grpc, tls)
        .unwrap()
        .connect_timeout(Duration::from_secs(5));
    let channel = match ep.connect().await {
        Ok(c) => c,
        Err(e) => {
            return Attach::Refused {
                code: tonic::Code::Unavailable,
                why: chain(&e),
            }
        }
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(v1::WorkerMessage {
        msg: Some(worker_message::Msg::Hello(v1::WorkerHello {
            worker_id: id.into(),
            data_addr: "127.0.0.1:9".into(),
            device: "cpu".into(),
            capacity: 1,
            version: "test".into(),
            ..Default::default()
        })),
        ..Default::default()
    })
    .unwrap();
    let r = WorkerServiceClient::new(channel)
        .attach(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await;
    drop(tx);
    match r {
        Ok(_) => Attach::Accepted,
        Err(s) => Attach::Refused {
            code: s.code(),
            why: match std::error::Error::source(&s) {
                Some(src) => format!("{}: {}", s.message(), chain(src)),
                None => s.message().to_string(),
            },
        },
    }
}

#[tokio::test]
async fn worker_service_refuses_every_client_but_the_worker_itself() {
    let c = Cluster::start();
    let grpc = c.coord.grpc.clone();
    let good = Some((c.pki("worker-w-0.pem"), c.pki("worker-w-0.key")));
    let now = time::OffsetDateTime::now_utc();
    let rogue = c.write(
        "rogue-w-0",
        Ca::generate("rogue CA", Validity::days_from(now, 1))
            .unwrap()
            .worker("w-0", Validity::days_from(now, 1))
            .unwrap(),
    );
    let expired = c.write(
        "expired-w-0",
        c.ca()
            .worker(
                "w-0",
                Validity {
                    not_before: now - time::Duration::days(10),
                    not_after: now - time::Duration::days(1),
                },
            )
            .unwrap(),
    );

    // Plaintext to the TLS port: no gRPC conversation at all.
    match attach(&grpc, None, "w-0").await {
        Attach::Refused { code, .. } => assert_ne!(code, tonic::Code::Ok),
        a => panic!("plaintext: {a:?}"),
    }
    // TLS without a client certificate: JobService would take it (CLI
    // clients have none); WorkerService does not.
    match attach(&grpc, Some(&c.client(None)), "w-0").await {
        Attach::Refused { code, why } => {
            assert_eq!(code, tonic::Code::Unauthenticated, "{why}");
            assert!(why.contains("requires mutual TLS"), "{why}");
        }
        a => panic!("no certificate: {a:?}"),
    }
    // Certificates the TLS layer refuses (from another CA, or expired),
    // both naming w-0: the connection is closed before any gRPC handler
    // runs (the log below counts the handler's refusals).
    for (what, id) in [("rogue CA", rogue), ("expired", expired)] {
        match attach(&grpc, Some(&c.client(Some(id))), "w-0").await {
            Attach::Refused { why, .. } => {
                assert!(why.contains("transport error"), "{what}: {why}")
            }
            a => panic!("{what}: {a:?}"),
        }
    }
    // A valid certificate for w-1 claiming to be w-0.
    let other = Some((c.pki("worker-w-1.pem"), c.pki("worker-w-1.key")));
    match attach(&grpc, Some(&c.client(other)), "w-0").await {
        Attach::Refused { code, why } => {
            assert_eq!(code, tonic::Code::PermissionDenied, "{why}");
            assert!(
                why.contains("may only act as itself") && why.contains("w-1"),
                "{why}"
            );
        }
        a => panic!("another worker's certificate: {a:?}"),
    }
    // The worker itself.
    match attach(&grpc, Some(&c.client(good)), "w-0").await {
        Attach::Accepted => {}
        a => panic!("w-0 with its own certificate: {a:?}"),
    }
    let log = std::fs::read_to_string(c.dir.path().join("coordinator.log")).unwrap();
    assert_eq!(log.matches("attach refused").count(), 2, "{log}");
}

/// `accrue-worker daemon` over mutual TLS, logging into `dir/<name>.log`.
fn daemon(c: &Cluster, name: &str, id: &str, cert_of: &str) -> Child {
    let log = std::fs::File::create(c.dir.path().join(format!("{name}.log"))).unwrap();
    Command::new(common::worker_bin())
        .args(["daemon", "--coordinator", &c.coord.grpc, "--id", id])
        .args(["--heartbeat", "0.2", "--threads", "1"])
        .arg("--ca")
        .arg(c.pki("ca.pem"))
        .arg("--cert")
        .arg(c.pki(&format!("worker-{cert_of}.pem")))
        .arg("--key")
        .arg(c.pki(&format!("worker-{cert_of}.key")))
        .env("RUST_LOG", "info")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

#[tokio::test]
async fn a_worker_with_its_certificate_runs_a_job_submitted_over_tls() {
    accrue_proto::tls::install_crypto_provider();
    let c = Cluster::start();
    let ca = c.pki("ca.pem");

    // The status endpoint speaks TLS with the same certificate.
    let r = common::https_client(&ca)
        .get(format!("https://{}/healthz", c.coord.http))
        .send()
        .await
        .unwrap();
    let code = r.status().as_u16();
    let body = r.text().await.unwrap();
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    let plain = reqwest::get(format!("http://{}/healthz", c.coord.http)).await;
    assert!(plain.is_err(), "plaintext HTTP answered: {plain:?}");

    // A daemon holding w-1's certificate but calling itself w-0 is refused
    // (and keeps retrying); w-0 with its own is taken.
    let mut impostor = daemon(&c, "impostor", "w-0", "w-1");
    let impostor_log = c.dir.path().join("impostor.log");
    assert!(
        common::wait_until(Duration::from_secs(30), || {
            std::fs::read_to_string(&impostor_log)
                .is_ok_and(|l| l.contains("attach refused") && l.contains("may only act as itself"))
        })
        .await,
        "{}",
        std::fs::read_to_string(&impostor_log).unwrap_or_default()
    );
    let _ = impostor.kill();
    let _ = impostor.wait();
    let _workers = common::Workers(vec![daemon(&c, "w-0", "w-0", "w-0")]);

    // The CLI over TLS: --ca for submit, ACCRUE_CA for status.
    let job = common::write(
        c.dir.path(),
        "job.toml",
        &common::job_toml("tls-e2e", 1, 6, ""),
    );
    let ca_s = ca.to_str().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_accrue"))
        .args(["--coordinator", &c.coord.grpc, "--ca", ca_s, "submit"])
        .arg(&job)
        .arg("--wait")
        .env("ACCRUE_TOKEN_FILE", c.pki("submit.token"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let id = String::from_utf8_lossy(&o.stdout)
        .lines()
        .next()
        .unwrap()
        .to_string();
    let o = Command::new(env!("CARGO_BIN_EXE_accrue"))
        .args(["--coordinator", &c.coord.grpc, "status", &id])
        .env("ACCRUE_CA", &ca)
        .env("ACCRUE_TOKEN_FILE", c.pki("read.token"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let status = String::from_utf8_lossy(&o.stdout);
    assert!(status.contains("state      succeeded"), "{status}");
    assert!(status.contains("workers    w-0"), "{status}");
    assert!(status.contains("step 6/6"), "{status}");
    assert!(status.contains("owner      submit"), "{status}");

    // Plaintext to the TLS port fails, and says so.
    let o = accrue(&["--coordinator", &c.coord.grpc, "--insecure", "status", &id]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = accrue(&[
        "--coordinator",
        &format!("http://{}", c.coord.grpc),
        "--ca",
        ca_s,
        "list",
    ]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("plaintext"),
        "{}",
        text(&o)
    );
}

/// A worker's certificate is no credential for JobService: over mutual TLS
/// with w-0's certificate, a call without a token is UNAUTHENTICATED, and
/// with the `read` token a cancel is PERMISSION_DENIED; the same channel
/// with the `admin` token may cancel.
#[tokio::test]
async fn a_worker_certificate_is_no_credential_for_job_service() {
    use accrue_proto::v1::job_service_client::JobServiceClient;
    accrue_proto::tls::install_crypto_provider();
    let c = Cluster::start();
    let id = Some((c.pki("worker-w-0.pem"), c.pki("worker-w-0.key")));
    let channel = accrue_proto::tls::endpoint(&c.coord.grpc, Some(&c.client(id)))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let token = |name: &str| {
        let t = std::fs::read_to_string(c.pki(&format!("{name}.token"))).unwrap();
        accrue::BearerToken::new(t.trim()).unwrap()
    };
    let mut admin = JobServiceClient::with_interceptor(channel.clone(), token("admin"));
    let job = admin
        .submit_job(v1::SubmitJobRequest {
            spec: Some(common::spec(&common::job_toml("held", 1, 5, ""))),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let cancel = || v1::CancelJobRequest { id: job.id.clone() };
    let mut bare = JobServiceClient::new(channel.clone());
    let err = bare.cancel_job(cancel()).await.unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::Unauthenticated,
        "{}",
        err.message()
    );
    let err = bare
        .list_jobs(v1::ListJobsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::Unauthenticated,
        "{}",
        err.message()
    );
    let mut reader = JobServiceClient::with_interceptor(channel.clone(), token("read"));
    let err = reader.cancel_job(cancel()).await.unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::PermissionDenied,
        "{}",
        err.message()
    );
    let done = admin.cancel_job(cancel()).await.unwrap().into_inner();
    assert_eq!(done.state(), v1::JobState::Cancelled);
}

/// Secure by default: each binary that talks over the network refuses to
/// start without its TLS, tokens and TLS to etcd unless `--insecure` says
/// so, naming what is missing and the flags; `--insecure` with nothing to
/// waive is refused too; with `--insecure` plaintext works and warns.
#[tokio::test]
async fn plaintext_needs_insecure_on_every_binary() {
    let d = TempDir::new().unwrap();
    let creds = common::creds();
    let state = d.path().join("state");
    let base = |extra: &[String]| {
        let mut c = Command::new(common::coordinator_bin());
        c.args([
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--state-dir",
        ])
        .arg(&state)
        .args(extra);
        c
    };
    let refused = |cmd: Command, name: &str, wants: &[&str]| {
        let (status, err) = common::bounded(cmd, &d.path().join(format!("{name}.log")));
        assert!(
            status.is_some_and(|s| !s.success()),
            "{name} started: {err}"
        );
        for w in wants {
            assert!(err.contains(w), "{name}: no {w:?} in\n{err}");
        }
    };
    refused(
        base(&[]),
        "coordinator-bare",
        &[
            "lacks TLS, tokens:",
            "--tls-cert",
            "--tokens FILE",
            "--insecure",
        ],
    );
    let mut etcd_plain = creds.coordinator_args();
    etcd_plain.extend(["--etcd".into(), "http://127.0.0.1:1".into()]);
    refused(
        base(&etcd_plain),
        "coordinator-etcd",
        &["lacks TLS to etcd:", "--etcd-ca"],
    );
    let mut all = creds.coordinator_args();
    all.push("--insecure".into());
    refused(
        base(&all),
        "coordinator-all",
        &["--insecure waives nothing"],
    );
    let mut w = Command::new(common::worker_bin());
    w.args(["daemon", "--coordinator", "127.0.0.1:1", "--id", "w"]);
    refused(
        w,
        "worker",
        &[
            "lacks mutual TLS to the coordinator:",
            "--cert",
            "--insecure",
        ],
    );
    let mut cli = Command::new(env!("CARGO_BIN_EXE_accrue"));
    cli.env_remove("ACCRUE_CA")
        .args(["--coordinator", "127.0.0.1:1", "list"]);
    refused(
        cli,
        "cli",
        &["no cluster CA given", "ACCRUE_CA", "--insecure"],
    );
    assert!(!state.exists(), "a refused coordinator created nothing");

    // --insecure: it serves plaintext, says what is open, and the CLI
    // reaches it only with --insecure too.
    let log = d.path().join("insecure.log");
    let co = common::spawn_coordinator(
        &[
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--state-dir",
            state.to_str().unwrap(),
            "--insecure",
        ]
        .map(String::from),
        &log,
    );
    let warned = std::fs::read_to_string(&log).unwrap();
    assert!(
        warned.contains("--insecure: plaintext gRPC and HTTP")
            && warned.contains("--insecure: no authentication"),
        "{warned}"
    );
    let o = accrue(&["--coordinator", &co.grpc, "--insecure", "list"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = accrue(&["--coordinator", &co.grpc, "list"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}
