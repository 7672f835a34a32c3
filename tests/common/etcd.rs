//! A real etcd for process tests, as the tests' cluster runs it: TLS with
//! client certificates from the test CA ([`super::creds`]), on free ports,
//! killed on drop; and reads of what accrue keeps in it.

use super::creds;
use accrue_proto::v1::{Job, JobState};
use prost::Message;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An etcd server with its own data dir (killed on drop).
pub struct Etcd {
    child: Option<Child>,
    pub url: String,
    peer: u16,
    data: PathBuf,
    log: PathBuf,
}

impl Etcd {
    pub async fn start(dir: &Path) -> Etcd {
        let mut e = Etcd {
            child: None,
            url: format!("https://127.0.0.1:{}", free_port()),
            peer: free_port(),
            data: dir.join("etcd-data"),
            log: dir.join("etcd.log"),
        };
        e.spawn().await;
        e
    }

    pub async fn spawn(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(
            which("etcd").expect("etcd is not installed: `make test` installs etcd-server"),
        )
        .args(["--name", "t", "--data-dir"])
        .arg(&self.data)
        .args([
            "--listen-client-urls",
            &self.url,
            "--advertise-client-urls",
            &self.url,
        ])
        .args([
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
        ])
        .args(["--initial-cluster", &format!("t={peer}"), "--logger=zap"])
        .args(etcd_server_tls())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let ok = match connect(self).await {
                Ok(mut c) => c.get("/health-probe", None).await.is_ok(),
                Err(_) => false,
            };
            if ok {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("etcd did not become healthy; see {}", self.log.display());
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// etcd's TLS flags: its server certificate, and client certificates
/// required and checked against the test CA.
pub fn etcd_server_tls() -> Vec<String> {
    let c = creds();
    let mut a = super::creds::flags([
        ("--cert-file", c.path("etcd-server.pem")),
        ("--key-file", c.path("etcd-server.key")),
        ("--trusted-ca-file", c.ca()),
    ]);
    a.push("--client-cert-auth".into());
    a
}

/// `--etcd-ca`, `--etcd-cert`, `--etcd-key` with `cert`'s pair.
pub fn etcd_client_args(cert: &Path, key: &Path) -> Vec<String> {
    super::creds::flags([
        ("--etcd-ca", creds().ca()),
        ("--etcd-cert", cert.to_path_buf()),
        ("--etcd-key", key.to_path_buf()),
    ])
}

/// The coordinators' etcd client TLS.
pub fn etcd_tls() -> accrue_proto::tls::ClientTls {
    accrue_proto::tls::ClientTls {
        ca: creds().ca(),
        identity: Some(accrue_proto::tls::KeyPairFiles {
            cert: creds().path("etcd-client.pem"),
            key: creds().path("etcd-client.key"),
        }),
    }
}

/// A client of `etcd` over TLS with the coordinators' certificate.
pub async fn connect(etcd: &Etcd) -> Result<etcd_client::Client, etcd_client::Error> {
    accrue_proto::tls::install_crypto_provider();
    let opts = etcd_client::ConnectOptions::new().with_tls(etcd_tls().config().unwrap());
    etcd_client::Client::connect([etcd.url.as_str()], Some(opts)).await
}

pub fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(bin))
            .find(|f| f.exists())
    })
}

/// The job as etcd holds it.
pub async fn job_in_etcd(etcd: &Etcd, cluster: &str, id: &str) -> Job {
    let mut c = connect(etcd).await.unwrap();
    let r = c
        .get(accrue_proto::layout::etcd::job_key(cluster, id), None)
        .await
        .unwrap();
    Job::decode(r.kvs()[0].value()).unwrap()
}

/// Every job etcd holds for `cluster`.
pub async fn jobs_in_etcd(etcd: &Etcd, cluster: &str) -> Vec<Job> {
    let mut c = connect(etcd).await.unwrap();
    let r = c
        .get(
            accrue_proto::layout::etcd::jobs_prefix(cluster),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    r.kvs()
        .iter()
        .map(|kv| Job::decode(kv.value()).unwrap())
        .collect()
}

/// The job as etcd holds it once it is in `want` (the store writes to etcd
/// from a thread of its own); fails after 10 s naming what etcd holds.
pub async fn job_in_etcd_when(etcd: &Etcd, cluster: &str, id: &str, want: JobState) -> Job {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let job = job_in_etcd(etcd, cluster, id).await;
        if job.state() == want {
            return job;
        }
        assert!(
            Instant::now() < deadline,
            "etcd holds {:?} for {id}, expected {want:?}",
            job.state()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A coordinator replica's flags: the test credentials, etcd at `etcd`
/// over TLS with the coordinators' etcd certificate.
pub fn etcd_coordinator_args(etcd: &Etcd, cluster: &str, dir: &Path, ttl: u32) -> Vec<String> {
    let ttl = ttl.to_string();
    let mut a = super::coordinator_args(
        &dir.join("state"),
        &[
            "--etcd",
            &etcd.url,
            "--cluster",
            cluster,
            "--lease-ttl",
            &ttl,
        ],
    );
    a.extend(etcd_client_args(
        &creds().path("etcd-client.pem"),
        &creds().path("etcd-client.key"),
    ));
    a
}

pub fn spawn_etcd_worker(etcd: &Etcd, cluster: &str, id: &str, dir: &Path) -> Child {
    spawn_etcd_worker_at(etcd, cluster, id, dir, "127.0.0.1:9")
}

/// A worker in etcd mode whose fallback coordinator address (used while
/// etcd cannot be reached) is `coordinator`.
pub fn spawn_etcd_worker_at(
    etcd: &Etcd,
    cluster: &str,
    id: &str,
    dir: &Path,
    coordinator: &str,
) -> Child {
    let log = std::fs::File::create(dir.join(format!("{id}.log"))).unwrap();
    let (cert, key) = creds().worker_files(id);
    Command::new(super::worker_bin())
        .args(["daemon", "--coordinator", coordinator])
        .args(["--etcd", &etcd.url, "--cluster", cluster])
        .args(creds().worker_args(id))
        .args(etcd_client_args(&cert, &key))
        .args([
            "--id",
            id,
            "--heartbeat",
            "0.2",
            "--micro-step-delay-ms",
            "10",
        ])
        .env("RUST_LOG", "info")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}
