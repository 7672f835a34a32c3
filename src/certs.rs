//! `accrue dev-certs`: a cluster CA, the coordinator's server certificate,
//! worker client certificates and a tokens file, made with rcgen. Also the
//! building blocks tests use to make rogue, expired or mismatched ones.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use std::io::Write;
use std::path::{Path, PathBuf};
use time::{Duration, OffsetDateTime};

pub use accrue_coordinator::tls::WORKER_URI_PREFIX;

/// The tokens `dev-certs` writes: name and scopes.
pub const DEV_TOKENS: [(&str, &[&str]); 4] = [
    ("admin", &["read", "submit", "admin", "metrics"]),
    ("submit", &["read", "submit"]),
    ("read", &["read"]),
    ("metrics", &["metrics"]),
];

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} / {}: not a CA certificate and key this tool can use: {reason}", cert.display(), key.display())]
    BadCa {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
    #[error("worker id {id:?}: {reason} (allowed: 1 to 63 ASCII letters, digits, '-', '.' and '_', starting with a letter or digit)")]
    BadWorkerId { id: String, reason: &'static str },
    #[error("SAN {name:?}: {reason}")]
    BadSan { name: String, reason: String },
    #[error("--days {0}: must be between 1 and 3650")]
    BadDays(u32),
}

/// When a certificate is valid.
#[derive(Clone, Copy, Debug)]
pub struct Validity {
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl Validity {
    /// From an hour before `now` (clock skew) for `days` days.
    pub fn days_from(now: OffsetDateTime, days: u32) -> Self {
        Self {
            not_before: now - Duration::hours(1),
            not_after: now + Duration::days(i64::from(days)),
        }
    }
}

/// A certificate and its private key, PEM.
#[derive(Clone, Debug)]
pub struct Pem {
    pub cert: String,
    pub key: String,
}

/// A certificate authority that signs the cluster's certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pub pem: Pem,
}

fn named(cn: &str) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name
        .push(DnType::OrganizationName, "accrue");
    p.distinguished_name.push(DnType::CommonName, cn);
    p
}

/// Checks a worker id can be named by a certificate (and a file name).
pub fn check_worker_id(id: &str) -> Result<(), CertError> {
    let bad = |reason| CertError::BadWorkerId {
        id: id.to_string(),
        reason,
    };
    if id.is_empty() || id.len() > 63 {
        return Err(bad("length out of range"));
    }
    if !id.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(bad("must start with a letter or digit"));
    }
    if !id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
    {
        return Err(bad("contains a character that is not allowed"));
    }
    Ok(())
}

impl Ca {
    /// A new CA (ECDSA P-256), `cn` its common name.
    pub fn generate(cn: &str, validity: Validity) -> Result<Self, CertError> {
        let key = KeyPair::generate()?;
        let mut p = named(cn);
        p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        p.not_before = validity.not_before;
        p.not_after = validity.not_after;
        let cert = p.self_signed(&key)?;
        let pem = Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        };
        Ok(Self {
            issuer: Issuer::new(p, key),
            pem,
        })
    }

    /// An existing CA from its PEM certificate and key.
    pub fn load(cert_pem: &str, key_pem: &str) -> Result<Self, rcgen::Error> {
        let key = KeyPair::from_pem(key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
        Ok(Self {
            pem: Pem {
                cert: cert_pem.to_string(),
                key: key_pem.to_string(),
            },
            issuer,
        })
    }

    fn sign(&self, mut p: CertificateParams, validity: Validity) -> Result<Pem, CertError> {
        let key = KeyPair::generate()?;
        p.not_before = validity.not_before;
        p.not_after = validity.not_after;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.use_authority_key_identifier_extension = true;
        let cert = p.signed_by(&key, &self.issuer)?;
        Ok(Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// The coordinator's server certificate: `sans` (DNS names or IP
    /// addresses) plus localhost and 127.0.0.1; server use only.
    pub fn server(&self, sans: &[String], validity: Validity) -> Result<Pem, CertError> {
        let mut names: Vec<String> = sans.to_vec();
        for default in ["localhost", "127.0.0.1"] {
            if !names.iter().any(|n| n == default) {
                names.push(default.to_string());
            }
        }
        let mut p = named("accrue coordinator");
        p.subject_alt_names = names.iter().map(|n| san(n)).collect::<Result<_, _>>()?;
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(p, validity)
    }

    /// A client certificate for etcd (no worker name, so WorkerService
    /// takes it for nobody): what coordinators show an etcd that requires
    /// client certificates.
    pub fn etcd_client(&self, validity: Validity) -> Result<Pem, CertError> {
        let mut p = named("accrue etcd client");
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(p, validity)
    }

    /// A worker's client certificate: DNS SAN `id` and URI SAN
    /// `urn:accrue:worker:<id>`; client use only, so it cannot pass for the
    /// coordinator.
    pub fn worker(&self, id: &str, validity: Validity) -> Result<Pem, CertError> {
        check_worker_id(id)?;
        self.client(id, &[id.to_string()], validity)
    }

    /// A client certificate with exactly these worker names (tests make
    /// ones that name nothing, or another worker).
    pub fn client(&self, cn: &str, names: &[String], validity: Validity) -> Result<Pem, CertError> {
        let mut p = named(&format!("accrue worker {cn}"));
        let mut sans = Vec::new();
        for n in names {
            if !n.contains('_') {
                sans.push(san(n)?);
            }
            sans.push(SanType::URI(
                format!("{WORKER_URI_PREFIX}{n}")
                    .try_into()
                    .map_err(|e: rcgen::Error| CertError::BadSan {
                        name: n.clone(),
                        reason: e.to_string(),
                    })?,
            ));
        }
        p.subject_alt_names = sans;
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(p, validity)
    }
}

fn san(name: &str) -> Result<SanType, CertError> {
    if let Ok(ip) = name.parse::<std::net::IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        });
    if !ok {
        return Err(CertError::BadSan {
            name: name.to_string(),
            reason: "not a DNS name or IP address (DNS labels: letters, digits and '-', separated by '.')".into(),
        });
    }
    Ok(SanType::DnsName(name.try_into()?))
}

/// Writes `contents` to `path`; `secret` files are created with mode 0600.
pub fn write_file(path: &Path, contents: &str, secret: bool) -> Result<(), CertError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let err = |source| CertError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mode = if secret { 0o600 } else { 0o644 };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(err)?;
    // mode() applies only to new files: an existing one is narrowed too.
    f.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(err)?;
    f.write_all(contents.as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh random token (256 bits) and the SHA-256 hex of it, as the
/// tokens file stores it.
pub fn new_token() -> (String, String) {
    use rand::RngCore;
    use sha2::Digest;
    let mut raw = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut raw);
    let token = format!("accrue_{}", hex(&raw));
    let hash = hex(&sha2::Sha256::digest(token.as_bytes()));
    (token, hash)
}

/// `accrue dev-certs`' options.
#[derive(Clone, Debug)]
pub struct DevCerts {
    /// Extra SANs of the coordinator's certificate.
    pub sans: Vec<String>,
    pub workers: Vec<String>,
    /// Validity of the leaf certificates (the CA: ten times as long).
    pub days: u32,
}

/// What `dev-certs` did.
#[derive(Debug)]
pub struct Written {
    pub files: Vec<PathBuf>,
    /// The CA already in the folder signed the new certificates.
    pub reused_ca: bool,
    /// tokens.toml was written (it is left alone when present).
    pub tokens: bool,
}

/// Writes into `dir`: `ca.pem` and `ca.key` (kept when both exist, so new
/// certificates chain to the CA already distributed), `coordinator.pem` and
/// `.key`, `etcd-server` and `etcd-client` pairs (for an etcd that requires
/// client certificates), `worker-<id>.pem` and `.key` per worker, and, unless present,
/// `tokens.toml` with a `<name>.token` file per token. Keys and tokens are
/// mode 0600.
pub fn dev_certs(dir: &Path, opts: &DevCerts) -> Result<Written, CertError> {
    if !(1..=3650).contains(&opts.days) {
        return Err(CertError::BadDays(opts.days));
    }
    for w in &opts.workers {
        check_worker_id(w)?;
    }
    for s in &opts.sans {
        san(s)?;
    }
    // Keys and tokens live here: a folder only its owner can enter.
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(dir)
        .map_err(|source| CertError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
    let now = OffsetDateTime::now_utc();
    let leaf = Validity::days_from(now, opts.days);
    let (ca_pem, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
    let mut files = Vec::new();
    let reused_ca = ca_pem.exists() && ca_key.exists();
    let ca = if reused_ca {
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|source| CertError::Read {
                path: p.to_path_buf(),
                source,
            })
        };
        Ca::load(&read(&ca_pem)?, &read(&ca_key)?).map_err(|e| CertError::BadCa {
            cert: ca_pem.clone(),
            key: ca_key.clone(),
            reason: e.to_string(),
        })?
    } else {
        let ca = Ca::generate(
            "accrue cluster CA",
            Validity::days_from(now, opts.days.saturating_mul(10)),
        )?;
        write_file(&ca_key, &ca.pem.key, true)?;
        write_file(&ca_pem, &ca.pem.cert, false)?;
        files.extend([ca_pem.clone(), ca_key.clone()]);
        ca
    };
    let mut pair = |name: &str, pem: Pem| -> Result<(), CertError> {
        let (c, k) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        write_file(&k, &pem.key, true)?;
        write_file(&c, &pem.cert, false)?;
        files.extend([c, k]);
        Ok(())
    };
    pair("coordinator", ca.server(&opts.sans, leaf)?)?;
    // etcd's own server certificate (the same names) and the client
    // certificate coordinators show it (workers show their own).
    pair("etcd-server", ca.server(&opts.sans, leaf)?)?;
    pair("etcd-client", ca.etcd_client(leaf)?)?;
    for w in &opts.workers {
        pair(&format!("worker-{w}"), ca.worker(w, leaf)?)?;
    }
    let tokens_path = dir.join("tokens.toml");
    let tokens = !tokens_path.exists();
    if tokens {
        let mut toml = String::from(
            "# accrue tokens: SHA-256 of each token, its name (recorded as the owner of\n# the jobs it submits) and scopes. The tokens themselves are in <name>.token.\n",
        );
        for (name, scopes) in DEV_TOKENS {
            let (token, hash) = new_token();
            let p = dir.join(format!("{name}.token"));
            write_file(&p, &format!("{token}\n"), true)?;
            files.push(p);
            let scopes: Vec<String> = scopes.iter().map(|s| format!("{s:?}")).collect();
            toml.push_str(&format!(
                "\n[[token]]\nname = {name:?}\nsha256 = {hash:?}\nscopes = [{}]\n",
                scopes.join(", ")
            ));
        }
        write_file(&tokens_path, &toml, true)?;
        files.push(tokens_path);
    }
    Ok(Written {
        files,
        reused_ca,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_ids_and_sans_are_checked() {
        assert!(check_worker_id("local-0").is_ok());
        assert!(check_worker_id("w_1.a").is_ok());
        for bad in ["", "-w", "w/1", "w 1", &"x".repeat(64)] {
            let e = check_worker_id(bad).unwrap_err().to_string();
            assert!(e.contains("allowed:"), "{e}");
        }
        assert!(san("coord.example.com").is_ok());
        assert!(san("10.0.0.7").is_ok());
        assert!(san("::1").is_ok());
        let e = san("bad name").unwrap_err().to_string();
        assert!(e.contains("\"bad name\""), "{e}");
    }

    #[test]
    fn tokens_are_random_and_hashed() {
        use sha2::Digest;
        let (a, ha) = new_token();
        let (b, _) = new_token();
        assert_ne!(a, b);
        assert_eq!(ha.len(), 64);
        assert_eq!(ha, hex(&sha2::Sha256::digest(a.as_bytes())));
        assert!(ha
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)));
    }

    #[test]
    fn a_loaded_ca_signs_like_the_original() {
        let v = Validity::days_from(OffsetDateTime::now_utc(), 1);
        let ca = Ca::generate("t", v).unwrap();
        let again = Ca::load(&ca.pem.cert, &ca.pem.key).unwrap();
        let w = again.worker("w-0", v).unwrap();
        // Issued by the same subject with the same key: the chain check
        // itself is in tests/tls.rs (rustls' verifier).
        let (_, leaf) = x509_parser::pem::parse_x509_pem(w.cert.as_bytes()).unwrap();
        let leaf = leaf.parse_x509().unwrap();
        let (_, root) = x509_parser::pem::parse_x509_pem(ca.pem.cert.as_bytes()).unwrap();
        let root = root.parse_x509().unwrap();
        assert_eq!(leaf.issuer(), root.subject());
        leaf.verify_signature(Some(root.public_key())).unwrap();
    }
}
