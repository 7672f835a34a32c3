//! TLS for the coordinator's two ports, and who a worker's client
//! certificate says it is.
//!
//! gRPC (JobService and WorkerService share the port): TLS with the
//! coordinator's certificate; client certificates are optional at the TLS
//! layer (CLI clients have none) and, when presented, must chain to the
//! cluster CA (`--client-ca`) or the handshake fails. WorkerService then
//! requires one: [`authorize_worker`] refuses an Attach without a verified
//! client certificate, or whose hello names a worker the certificate does
//! not. HTTP: TLS with the same certificate, no client certificates.

use accrue_proto::tls::{read_certs, read_key, TlsError};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// A URI SAN of this form names worker `<id>` too (for ids that are not
/// DNS names); a DNS SAN names the worker whose id it equals.
pub const WORKER_URI_PREFIX: &str = "urn:accrue:worker:";

/// How long a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The coordinator's TLS files (`--tls-cert`, `--tls-key`, `--client-ca`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The cluster CA worker certificates must chain to.
    pub client_ca: PathBuf,
}

/// The coordinator's TLS files from its flags: all three, or none (then
/// the coordinator needs `--insecure`, see `accrue_proto::secure`).
pub fn server_transport(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
) -> Result<Option<ServerTls>, TlsError> {
    let flags = [
        ("--tls-cert", cert.is_some()),
        ("--tls-key", key.is_some()),
        ("--client-ca", client_ca.is_some()),
    ];
    match (cert, key, client_ca) {
        (None, None, None) => Ok(None),
        (Some(cert), Some(key), Some(client_ca)) => Ok(Some(ServerTls {
            cert,
            key,
            client_ca,
        })),
        _ => Err(TlsError::Flags(format!(
            "TLS needs --tls-cert, --tls-key and --client-ca together (the coordinator's certificate and key, and the CA worker certificates chain to); missing: {}",
            flags
                .iter()
                .filter(|(_, g)| !*g)
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// The files read and checked once, at start.
pub struct Loaded {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca_pem: Vec<u8>,
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl ServerTls {
    pub fn load(&self) -> Result<Loaded, TlsError> {
        let (cert_pem, certs) = read_certs("TLS certificate", &self.cert)?;
        let (key_pem, key) = read_key("TLS key", &self.key)?;
        let (ca_pem, _) = read_certs("client CA", &self.client_ca)?;
        Ok(Loaded {
            cert_pem,
            key_pem,
            ca_pem,
            certs,
            key,
        })
    }
}

impl Loaded {
    /// gRPC: client certificates optional, verified against the client CA.
    pub fn grpc(&self) -> tonic::transport::ServerTlsConfig {
        use tonic::transport::{Certificate, Identity};
        tonic::transport::ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
            .client_auth_optional(true)
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// HTTP: the same certificate, no client certificates, HTTP/1.1.
    pub fn http(&self) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
        let mut c = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(self.certs.clone(), self.key.clone_key())?;
        c.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(c))
    }
}

/// Why WorkerService refused a connection.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PeerError {
    #[error("WorkerService requires mutual TLS: connect with a client certificate signed by the cluster CA whose SAN names this worker id (accrue-worker daemon --ca --cert --key)")]
    NoClientCert,
    #[error("the client certificate cannot be read: {0}")]
    Unreadable(String),
    #[error("the client certificate names {names:?}, not worker {claimed:?}: a worker may only act as itself")]
    NotThisWorker { claimed: String, names: Vec<String> },
}

impl From<PeerError> for tonic::Status {
    fn from(e: PeerError) -> Self {
        match e {
            PeerError::NoClientCert | PeerError::Unreadable(_) => {
                tonic::Status::unauthenticated(e.to_string())
            }
            PeerError::NotThisWorker { .. } => tonic::Status::permission_denied(e.to_string()),
        }
    }
}

/// The worker ids a (DER) certificate names: its DNS SANs and the ids of
/// its `urn:accrue:worker:<id>` URI SANs, in order.
pub fn worker_names(der: &[u8]) -> Result<Vec<String>, PeerError> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| PeerError::Unreadable(e.to_string()))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| PeerError::Unreadable(format!("subjectAltName: {e}")))?;
    Ok(san
        .map(|s| s.value.general_names.iter())
        .into_iter()
        .flatten()
        .filter_map(|n| match n {
            GeneralName::DNSName(d) => Some(d.to_string()),
            GeneralName::URI(u) => u.strip_prefix(WORKER_URI_PREFIX).map(str::to_string),
            _ => None,
        })
        .collect())
}

/// Whether the peer (its verified chain, leaf first, as the TLS layer gives
/// it) may attach as worker `claimed`.
pub fn authorize_worker(
    peer: Option<&[CertificateDer<'_>]>,
    claimed: &str,
) -> Result<(), PeerError> {
    let leaf = peer
        .and_then(|c| c.first())
        .ok_or(PeerError::NoClientCert)?;
    let names = worker_names(leaf)?;
    if names.iter().any(|n| n == claimed) {
        Ok(())
    } else {
        Err(PeerError::NotThisWorker {
            claimed: claimed.to_string(),
            names,
        })
    }
}

/// A TCP listener whose connections have completed a TLS handshake: each
/// handshake runs in a task of its own (bounded by [`HANDSHAKE_TIMEOUT`]),
/// so a slow client never holds up the others. For `axum::serve`.
pub struct TlsListener {
    ready: mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accept_loop: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub fn new(l: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let local = l.local_addr()?;
        let (tx, ready) = mpsc::channel(64);
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let accept_loop = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match l.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // EMFILE and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "http accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "http TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, "http TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self {
            ready,
            local,
            accept_loop,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accept loop only ends when aborted, i.e. with the
            // listener: nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, KeyPair, SanType};

    fn cert_with(sans: Vec<SanType>) -> CertificateDer<'static> {
        let mut p = CertificateParams::default();
        p.subject_alt_names = sans;
        let key = KeyPair::generate().unwrap();
        p.self_signed(&key).unwrap().der().clone()
    }

    fn dns(s: &str) -> SanType {
        SanType::DnsName(s.try_into().unwrap())
    }

    fn uri(s: &str) -> SanType {
        SanType::URI(s.try_into().unwrap())
    }

    #[test]
    fn a_certificate_names_its_dns_and_worker_uri_sans() {
        let c = cert_with(vec![
            dns("w-0"),
            uri("urn:accrue:worker:w_1"),
            uri("https://example.com/w-2"),
            SanType::IpAddress("127.0.0.1".parse().unwrap()),
        ]);
        assert_eq!(worker_names(&c).unwrap(), vec!["w-0", "w_1"]);
        assert_eq!(
            worker_names(&cert_with(vec![])).unwrap(),
            Vec::<String>::new()
        );
        assert!(matches!(
            worker_names(b"junk"),
            Err(PeerError::Unreadable(_))
        ));
    }

    #[test]
    fn a_worker_may_only_act_as_itself() {
        let c = cert_with(vec![dns("w-0"), uri("urn:accrue:worker:w_1")]);
        let chain = [c];
        assert_eq!(authorize_worker(Some(&chain), "w-0"), Ok(()));
        assert_eq!(authorize_worker(Some(&chain), "w_1"), Ok(()));
        let e = authorize_worker(Some(&chain), "w-2").unwrap_err();
        assert_eq!(
            e,
            PeerError::NotThisWorker {
                claimed: "w-2".into(),
                names: vec!["w-0".into(), "w_1".into()]
            }
        );
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::PermissionDenied);
        // A prefix or a URI of another form is not the worker's name.
        assert!(authorize_worker(Some(&chain), "w").is_err());
        assert!(authorize_worker(Some(&chain), "urn:accrue:worker:w_1").is_err());
        let none = authorize_worker(None, "w-0").unwrap_err();
        assert_eq!(none, PeerError::NoClientCert);
        assert_eq!(
            tonic::Status::from(none).code(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            authorize_worker(Some(&[]), "w-0"),
            Err(PeerError::NoClientCert)
        );
    }

    #[test]
    fn the_flags_choose_the_servers_transport() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert_eq!(server_transport(None, None, None).unwrap(), None);
        assert_eq!(
            server_transport(p("c.pem"), p("c.key"), p("ca.pem")).unwrap(),
            Some(ServerTls {
                cert: "c.pem".into(),
                key: "c.key".into(),
                client_ca: "ca.pem".into()
            })
        );
        let e = server_transport(p("c.pem"), p("c.key"), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing: --client-ca"), "{e}");
        let e = server_transport(None, None, p("ca.pem"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing: --tls-cert, --tls-key"), "{e}");
    }
}
