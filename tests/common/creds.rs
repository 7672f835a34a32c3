//! The test binary's cluster credentials, so that every process test runs
//! with security on, as a user's cluster does (issue 14): one CA, the
//! coordinator's certificate for localhost and 127.0.0.1, worker client
//! certificates made on first use per id, and the four tokens of
//! `accrue dev-certs`. Written once per test process under the target's
//! test folder.

use accrue::certs::{self, Ca, Validity};
use accrue_proto::tls::ClientTls;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

pub struct Creds {
    pub dir: PathBuf,
    /// The CA (and the worker ids issued so far): behind a lock so tests
    /// running side by side never write the same file at once.
    issuer: Mutex<(Ca, HashSet<String>)>,
}

/// This test process's credentials (made on first use).
pub fn creds() -> &'static Creds {
    static CREDS: OnceLock<Creds> = OnceLock::new();
    CREDS.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("creds-{}", std::process::id()));
        // A folder left by an earlier process with this pid: start afresh.
        let _ = std::fs::remove_dir_all(&dir);
        certs::dev_certs(
            &dir,
            &certs::DevCerts {
                sans: Vec::new(),
                workers: Vec::new(),
                days: 2,
            },
        )
        .unwrap();
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        let ca = Ca::load(&read("ca.pem"), &read("ca.key")).unwrap();
        Creds {
            dir,
            issuer: Mutex::new((ca, HashSet::new())),
        }
    })
}

impl Creds {
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    pub fn ca(&self) -> PathBuf {
        self.path("ca.pem")
    }

    pub fn tokens_file(&self) -> PathBuf {
        self.path("tokens.toml")
    }

    /// The token with this scope (admin, submit, read or metrics).
    pub fn token(&self, scope: &str) -> String {
        std::fs::read_to_string(self.path(&format!("{scope}.token")))
            .unwrap()
            .trim()
            .to_string()
    }

    /// The coordinator's TLS files (as in-process `Config.tls`).
    pub fn server_tls(&self) -> accrue_coordinator::tls::ServerTls {
        accrue_coordinator::tls::ServerTls {
            cert: self.path("coordinator.pem"),
            key: self.path("coordinator.key"),
            client_ca: self.ca(),
        }
    }

    /// `accrue-coordinator` TLS flags: TLS on both ports, mutual TLS for
    /// workers.
    pub fn tls_args(&self) -> Vec<String> {
        let t = self.server_tls();
        flags([
            ("--tls-cert", t.cert),
            ("--tls-key", t.key),
            ("--client-ca", t.client_ca),
        ])
    }

    /// `accrue-coordinator` security flags: [`Creds::tls_args`] and the
    /// tokens file.
    pub fn coordinator_args(&self) -> Vec<String> {
        let mut a = self.tls_args();
        a.extend([
            "--tokens".to_string(),
            self.tokens_file().display().to_string(),
        ]);
        a
    }

    /// Worker `id`'s certificate and key (issued on first use).
    pub fn worker_files(&self, id: &str) -> (PathBuf, PathBuf) {
        let (cert, key) = (
            self.path(&format!("worker-{id}.pem")),
            self.path(&format!("worker-{id}.key")),
        );
        let mut g = self.issuer.lock().unwrap();
        if g.1.insert(id.to_string()) {
            let pem =
                g.0.worker(id, Validity::days_from(time::OffsetDateTime::now_utc(), 2))
                    .unwrap();
            certs::write_file(&key, &pem.key, true).unwrap();
            certs::write_file(&cert, &pem.cert, false).unwrap();
        }
        (cert, key)
    }

    /// `accrue-worker daemon` flags for worker `id`: mutual TLS.
    pub fn worker_args(&self, id: &str) -> Vec<String> {
        let (cert, key) = self.worker_files(id);
        flags([("--ca", self.ca()), ("--cert", cert), ("--key", key)])
    }

    /// What the CLI needs in its environment: the CA and a token.
    pub fn cli_env(&self, scope: &str) -> [(&'static str, PathBuf); 2] {
        [
            ("ACCRUE_CA", self.ca()),
            ("ACCRUE_TOKEN_FILE", self.path(&format!("{scope}.token"))),
        ]
    }

    pub fn client_tls(&self) -> ClientTls {
        ClientTls {
            ca: self.ca(),
            identity: None,
        }
    }

    /// An HTTPS client trusting the cluster CA.
    pub fn http(&self) -> reqwest::Client {
        https_client(&self.ca())
    }

    /// GET `https://{http}{path}` with the token of `scope`.
    pub async fn get(
        &self,
        http: &str,
        path: &str,
        scope: &str,
    ) -> reqwest::Result<reqwest::Response> {
        self.http()
            .get(format!("https://{http}{path}"))
            .bearer_auth(self.token(scope))
            .send()
            .await
    }
}

/// An HTTPS client trusting only the CA in `ca` (PEM).
pub fn https_client(ca: &std::path::Path) -> reqwest::Client {
    let ca = reqwest::Certificate::from_pem(&std::fs::read(ca).unwrap()).unwrap();
    reqwest::Client::builder()
        .add_root_certificate(ca)
        .tls_built_in_root_certs(false)
        .build()
        .unwrap()
}

/// `--flag PATH` pairs as arguments.
pub fn flags<const N: usize>(pairs: [(&str, PathBuf); N]) -> Vec<String> {
    pairs
        .into_iter()
        .flat_map(|(f, p)| [f.to_string(), p.display().to_string()])
        .collect()
}
