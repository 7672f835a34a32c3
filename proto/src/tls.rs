//! TLS for accrue's gRPC clients (the CLI and the worker daemon): the one
//! crypto provider, the cluster CA plus an optional client identity read
//! from PEM files, the choice between TLS and plaintext made from flags,
//! and the coordinator address with the scheme that choice implies.

use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// Installs rustls' `ring` provider as the process default. Idempotent: a
/// second call (or a provider the host program installed first) leaves the
/// installed one in place, so every TLS config in the process uses one.
pub fn install_crypto_provider() {
    // Err only means a provider is installed already: what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the {what} {} holds no usable {expected} ({reason})", path.display())]
    BadPem {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
        reason: String,
    },
    #[error("coordinator address {addr:?}: {reason}")]
    Address { addr: String, reason: String },
    #[error("{0}")]
    Flags(String),
    #[error("TLS set-up for {addr}: {source}")]
    Transport {
        addr: String,
        source: tonic::transport::Error,
    },
}

/// The files a client connects with: the cluster CA that signed the
/// coordinator's certificate and, for workers, their own identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientTls {
    pub ca: PathBuf,
    pub identity: Option<KeyPairFiles>,
}

/// A certificate (chain) and its private key, both PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyPairFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// TLS with its settings, or plaintext (asked for with `--insecure`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport<T> {
    Tls(T),
    Plaintext,
}

/// A client's TLS files from its flags (`names`: the CA, certificate and
/// key flags, e.g. `--ca`, `--cert`, `--key`): the CA alone or with a
/// certificate and key (`identity_required`: all three), or none of them
/// (None: whether plaintext is allowed is [`crate::secure`]'s decision).
pub fn client_files(
    names: [&'static str; 3],
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    identity_required: bool,
) -> Result<Option<ClientTls>, TlsError> {
    let [ca_flag, cert_flag, key_flag] = names;
    let flags = [
        (ca_flag, ca.is_some()),
        (cert_flag, cert.is_some()),
        (key_flag, key.is_some()),
    ];
    let named = |given: bool| -> Vec<&str> {
        flags
            .iter()
            .filter(|(_, g)| *g == given)
            .map(|(n, _)| *n)
            .collect()
    };
    let given = named(true);
    if given.is_empty() {
        return Ok(None);
    }
    let identity = match (cert, key) {
        (Some(cert), Some(key)) => Some(KeyPairFiles { cert, key }),
        (None, None) if !identity_required => None,
        _ => {
            return Err(TlsError::Flags(format!(
                "TLS needs {} as well (given: {})",
                named(false).join(" and "),
                given.join(", ")
            )));
        }
    };
    let Some(ca) = ca else {
        return Err(TlsError::Flags(format!(
            "TLS needs {ca_flag} FILE, the CA that signed the server's certificate (given: {})",
            given.join(", ")
        )));
    };
    Ok(Some(ClientTls { ca, identity }))
}

/// The CLI's transport from `--ca` (or ACCRUE_CA) and `--insecure`: one of
/// them, never both.
pub fn cli_transport(
    ca: Option<PathBuf>,
    insecure: bool,
) -> Result<Transport<ClientTls>, TlsError> {
    match (client_files(["--ca", "--cert", "--key"], ca, None, None, false)?, insecure) {
        (Some(t), false) => Ok(Transport::Tls(t)),
        (None, true) => Ok(Transport::Plaintext),
        (Some(_), true) => Err(TlsError::Flags(
            "--insecure (plaintext) contradicts --ca (or ACCRUE_CA): give either the CA or --insecure".into(),
        )),
        (None, false) => Err(TlsError::Flags(
            "no cluster CA given: the CLI talks to the coordinator over TLS, so give --ca FILE or set ACCRUE_CA (the CA that signed the coordinator's certificate; `accrue dev-certs` writes ca.pem), or pass --insecure for a plaintext coordinator".into(),
        )),
    }
}

/// The etcd TLS flags of the coordinator and the worker daemon.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct EtcdTlsFlags {
    /// The CA (PEM) that signed etcd's server certificate: reach etcd over
    /// TLS (with --etcd-cert and --etcd-key).
    #[arg(long)]
    pub etcd_ca: Option<PathBuf>,
    /// The client certificate (PEM) shown to etcd.
    #[arg(long)]
    pub etcd_cert: Option<PathBuf>,
    /// The private key of --etcd-cert (PEM).
    #[arg(long)]
    pub etcd_key: Option<PathBuf>,
}

impl EtcdTlsFlags {
    /// The client TLS these flags give for `endpoints` (see [`etcd_tls`]);
    /// the flags without endpoints are refused.
    pub fn for_endpoints(self, endpoints: &[String]) -> Result<Option<ClientTls>, TlsError> {
        let tls = etcd_tls(endpoints, self.etcd_ca, self.etcd_cert, self.etcd_key)?;
        if endpoints.is_empty() && tls.is_some() {
            return Err(TlsError::Flags(
                "--etcd-ca, --etcd-cert and --etcd-key need --etcd ENDPOINTS".into(),
            ));
        }
        Ok(tls)
    }
}

/// etcd client TLS from `--etcd-ca`, `--etcd-cert` and `--etcd-key` (all
/// three or none), checked against the endpoints' schemes: with TLS no
/// `http://` endpoint, without it no `https://` one (bare `HOST:PORT`
/// takes the scheme TLS implies).
pub fn etcd_tls(
    endpoints: &[String],
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<Option<ClientTls>, TlsError> {
    let tls = client_files(
        ["--etcd-ca", "--etcd-cert", "--etcd-key"],
        ca,
        cert,
        key,
        true,
    )?;
    let (bad, why) = if tls.is_some() {
        ("http://", "is plaintext but etcd TLS is configured (--etcd-ca): use https://HOST:PORT or HOST:PORT")
    } else {
        (
            "https://",
            "needs etcd TLS: give --etcd-ca, --etcd-cert and --etcd-key",
        )
    };
    if let Some(e) = endpoints.iter().find(|e| e.starts_with(bad)) {
        return Err(TlsError::Flags(format!("etcd endpoint {e} {why}")));
    }
    Ok(tls)
}

/// The coordinator address with its scheme: `https://` with TLS, `http://`
/// without; a bare `HOST:PORT` gets the scheme the transport implies, and a
/// scheme that contradicts it is refused.
pub fn coordinator_url(addr: &str, tls: bool) -> Result<String, TlsError> {
    let bad = |reason: &str| TlsError::Address {
        addr: addr.to_string(),
        reason: reason.to_string(),
    };
    let url = match addr.split_once("://") {
        None => format!("{}://{addr}", if tls { "https" } else { "http" }),
        Some(("https", _)) if tls => addr.to_string(),
        Some(("http", _)) if !tls => addr.to_string(),
        Some(("https", _)) => {
            return Err(bad(
                "https:// needs the cluster CA: pass --ca FILE (or set ACCRUE_CA for the CLI)",
            ))
        }
        Some(("http", _)) => {
            return Err(bad(
                "http:// is plaintext but TLS is configured: use https://HOST:PORT or HOST:PORT",
            ))
        }
        Some((scheme, _)) => {
            return Err(bad(&format!(
                "unknown scheme {scheme:?}: use HOST:PORT, https://HOST:PORT or (with --insecure) http://HOST:PORT"
            )))
        }
    };
    if url
        .split_once("://")
        .is_some_and(|(_, rest)| rest.is_empty())
    {
        return Err(bad("no host: use HOST:PORT"));
    }
    Ok(url)
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a PEM file of certificates (at least one).
pub fn read_certs(
    what: &'static str,
    path: &Path,
) -> Result<(Vec<u8>, Vec<CertificateDer<'static>>), TlsError> {
    let pem = read(what, path)?;
    let bad = |reason: String| TlsError::BadPem {
        what,
        path: path.to_path_buf(),
        expected: "PEM certificate",
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no BEGIN CERTIFICATE block".into()));
    }
    Ok((pem, certs))
}

/// Reads a PEM private key (PKCS#8, PKCS#1 or SEC1).
pub fn read_key(
    what: &'static str,
    path: &Path,
) -> Result<(Vec<u8>, PrivateKeyDer<'static>), TlsError> {
    let pem = read(what, path)?;
    let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::BadPem {
        what,
        path: path.to_path_buf(),
        expected: "PEM private key",
        reason: e.to_string(),
    })?;
    Ok((pem, key))
}

impl ClientTls {
    /// The tonic client config, files read (and checked) now: a client
    /// re-reading them on every connection picks up rotated files.
    pub fn config(&self) -> Result<ClientTlsConfig, TlsError> {
        let (ca, _) = read_certs("CA certificate", &self.ca)?;
        let mut c = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        if let Some(id) = &self.identity {
            let (cert, _) = read_certs("client certificate", &id.cert)?;
            let (key, _) = read_key("client key", &id.key)?;
            c = c.identity(Identity::from_pem(cert, key));
        }
        Ok(c)
    }
}

/// An endpoint for the coordinator at `addr` (see [`coordinator_url`]),
/// over TLS when `tls` is given.
pub fn endpoint(addr: &str, tls: Option<&ClientTls>) -> Result<Endpoint, TlsError> {
    let url = coordinator_url(addr, tls.is_some())?;
    let e = Endpoint::from_shared(url.clone()).map_err(|source| TlsError::Transport {
        addr: url.clone(),
        source,
    })?;
    match tls {
        None => Ok(e),
        Some(t) => {
            install_crypto_provider();
            e.tls_config(t.config()?)
                .map_err(|source| TlsError::Transport { addr: url, source })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Option<PathBuf> {
        Some(PathBuf::from(s))
    }

    const NAMES: [&str; 3] = ["--ca", "--cert", "--key"];

    #[test]
    fn the_flags_choose_the_transport() {
        assert_eq!(client_files(NAMES, None, None, None, true).unwrap(), None);
        assert_eq!(cli_transport(None, true).unwrap(), Transport::Plaintext);
        assert_eq!(
            cli_transport(p("ca.pem"), false).unwrap(),
            Transport::Tls(ClientTls {
                ca: "ca.pem".into(),
                identity: None
            })
        );
        assert_eq!(
            client_files(NAMES, p("ca.pem"), p("w.pem"), p("w.key"), true).unwrap(),
            Some(ClientTls {
                ca: "ca.pem".into(),
                identity: Some(KeyPairFiles {
                    cert: "w.pem".into(),
                    key: "w.key".into()
                })
            })
        );
    }

    /// Secure by default: the CLI without a CA and without --insecure is an
    /// error that names both ways out; both is a contradiction.
    #[test]
    fn the_cli_needs_a_ca_or_insecure() {
        let e = cli_transport(None, false).unwrap_err().to_string();
        for want in ["--ca", "ACCRUE_CA", "--insecure"] {
            assert!(e.contains(want), "{want} missing from {e}");
        }
        let e = cli_transport(p("ca.pem"), true).unwrap_err().to_string();
        assert!(e.contains("--insecure") && e.contains("--ca"), "{e}");
    }

    #[test]
    fn partial_flags_are_refused_by_name() {
        let e = client_files(NAMES, p("ca.pem"), None, None, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--cert and --key"), "{e}");
        let e = client_files(NAMES, p("ca.pem"), p("w.pem"), None, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs --key"), "{e}");
        let e = client_files(NAMES, None, p("w.pem"), p("w.key"), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--ca"), "{e}");
    }

    #[test]
    fn etcd_tls_agrees_with_the_endpoints() {
        let eps = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let t = etcd_tls(&eps(&["https://a:2379", "b:2379"]), p("ca"), p("c"), p("k"))
            .unwrap()
            .unwrap();
        assert!(t.identity.is_some());
        assert_eq!(
            etcd_tls(&eps(&["http://a:2379"]), None, None, None).unwrap(),
            None
        );
        let e = etcd_tls(&eps(&["b:2379", "http://a:2379"]), p("ca"), p("c"), p("k"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("http://a:2379") && e.contains("plaintext"),
            "{e}"
        );
        let e = etcd_tls(&eps(&["https://a:2379"]), None, None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("https://a:2379") && e.contains("--etcd-ca"),
            "{e}"
        );
        let e = etcd_tls(&eps(&["a:2379"]), p("ca"), None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--etcd-cert and --etcd-key"), "{e}");
        let flags = EtcdTlsFlags {
            etcd_ca: p("ca"),
            etcd_cert: p("c"),
            etcd_key: p("k"),
        };
        let e = flags.clone().for_endpoints(&[]).unwrap_err().to_string();
        assert!(e.contains("need --etcd ENDPOINTS"), "{e}");
        assert!(flags.for_endpoints(&eps(&["a:2379"])).unwrap().is_some());
        assert_eq!(EtcdTlsFlags::default().for_endpoints(&[]).unwrap(), None);
    }

    #[test]
    fn the_scheme_follows_the_transport() {
        assert_eq!(
            coordinator_url("127.0.0.1:1", true).unwrap(),
            "https://127.0.0.1:1"
        );
        assert_eq!(
            coordinator_url("127.0.0.1:1", false).unwrap(),
            "http://127.0.0.1:1"
        );
        assert_eq!(coordinator_url("https://h:1", true).unwrap(), "https://h:1");
        assert_eq!(coordinator_url("http://h:1", false).unwrap(), "http://h:1");
        let e = coordinator_url("http://h:1", true).unwrap_err().to_string();
        assert!(e.contains("plaintext") && e.contains("https://"), "{e}");
        let e = coordinator_url("https://h:1", false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--ca"), "{e}");
        let e = coordinator_url("grpc://h:1", false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"grpc\""), "{e}");
        assert!(coordinator_url("https://", true).is_err());
    }

    #[test]
    fn unreadable_or_wrong_files_name_themselves() {
        let d = std::env::temp_dir().join(format!("accrue-tls-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let junk = d.join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let t = ClientTls {
            ca: junk.clone(),
            identity: None,
        };
        let e = t.config().unwrap_err().to_string();
        assert!(
            e.contains("CA certificate") && e.contains("junk.pem"),
            "{e}"
        );
        let t = ClientTls {
            ca: d.join("absent.pem"),
            identity: None,
        };
        let e = t.config().unwrap_err().to_string();
        assert!(e.contains("cannot read") && e.contains("absent.pem"), "{e}");
        let e = read_key("client key", &junk).unwrap_err().to_string();
        assert!(e.contains("private key"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
