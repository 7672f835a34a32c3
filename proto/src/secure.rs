//! Secure by default (docs/SECURITY.md): a binary runs without TLS,
//! tokens or TLS to etcd only when `--insecure` says so. The decision is
//! one pure function of what is missing; each binary says what that is.

/// What a binary may run without, each only with `--insecure`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiver {
    /// The coordinator serving plaintext gRPC and HTTP.
    ServerTls,
    /// The coordinator without a tokens file.
    Tokens,
    /// A worker talking to the coordinator without mutual TLS.
    WorkerTls,
    /// etcd reached in plaintext without a client certificate.
    EtcdTls,
}

impl Waiver {
    /// Its name in an error.
    pub fn name(self) -> &'static str {
        match self {
            Waiver::ServerTls => "TLS",
            Waiver::Tokens => "tokens",
            Waiver::WorkerTls => "mutual TLS to the coordinator",
            Waiver::EtcdTls => "TLS to etcd",
        }
    }

    /// The flags that would make the waiver unneeded.
    pub fn flags(self) -> &'static str {
        match self {
            Waiver::ServerTls => "--tls-cert, --tls-key and --client-ca",
            Waiver::Tokens => "--tokens FILE",
            Waiver::WorkerTls => {
                "--ca, --cert and --key (a client certificate whose SAN names --id)"
            }
            Waiver::EtcdTls => {
                "--etcd-ca, --etcd-cert and --etcd-key (with https:// or bare HOST:PORT endpoints)"
            }
        }
    }

    /// What is lost, for the warning logged at start.
    pub fn risk(self) -> &'static str {
        match self {
            Waiver::ServerTls => "plaintext gRPC and HTTP: anyone who can reach these ports can attach as a worker and read every job's spec and ring key",
            Waiver::Tokens => "no authentication: anyone who can reach the ports can submit, cancel and read every job",
            Waiver::WorkerTls => "plaintext to the coordinator: anyone on the network path can read job specs and ring keys",
            Waiver::EtcdTls => "plaintext etcd: anyone who can reach etcd can move the leader key and rewrite jobs",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecurityError {
    #[error("{who} is secure by default and lacks {}: give {} (`accrue dev-certs DIR` writes a CA, certificates and tokens), or pass --insecure to run without them on a network you trust", join(.missing, Waiver::name, ", "), join(.missing, Waiver::flags, "; "))]
    Missing {
        who: &'static str,
        missing: Vec<Waiver>,
    },
    #[error("--insecure waives nothing: {who} has all of {} configured; drop --insecure", join(.configured, Waiver::name, ", "))]
    NothingToWaive {
        who: &'static str,
        configured: Vec<Waiver>,
    },
}

fn join(w: &[Waiver], f: fn(Waiver) -> &'static str, sep: &str) -> String {
    w.iter().map(|w| f(*w)).collect::<Vec<_>>().join(sep)
}

/// The waivers in force for `who` (a binary's name in errors), given each
/// security piece that applies to it and whether it is configured: anything
/// missing without `insecure` is refused (naming all of it at once), and
/// `insecure` with nothing missing is a contradiction.
pub fn decide(
    who: &'static str,
    pieces: &[(Waiver, bool)],
    insecure: bool,
) -> Result<Vec<Waiver>, SecurityError> {
    let missing: Vec<Waiver> = pieces.iter().filter(|(_, c)| !c).map(|(w, _)| *w).collect();
    match (missing.is_empty(), insecure) {
        (true, false) | (false, true) => Ok(missing),
        (true, true) => Err(SecurityError::NothingToWaive {
            who,
            configured: pieces.iter().map(|(w, _)| *w).collect(),
        }),
        (false, false) => Err(SecurityError::Missing { who, missing }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use Waiver::*;

    #[test]
    fn everything_configured_needs_no_waiver() {
        let all = [(ServerTls, true), (Tokens, true), (EtcdTls, true)];
        assert_eq!(decide("the coordinator", &all, false), Ok(vec![]));
        let e = decide("the coordinator", &all, true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("has all of TLS, tokens, TLS to etcd configured; drop --insecure"),
            "{e}"
        );
    }

    #[test]
    fn anything_missing_is_refused_naming_all_of_it() {
        let e = decide(
            "the coordinator",
            &[(ServerTls, false), (Tokens, false), (EtcdTls, false)],
            false,
        )
        .unwrap_err()
        .to_string();
        for want in [
            "the coordinator is secure by default and lacks TLS, tokens, TLS to etcd",
            "--tls-cert",
            "--client-ca",
            "--tokens FILE",
            "--etcd-ca",
            "--insecure",
            "accrue dev-certs",
        ] {
            assert!(e.contains(want), "{want:?} missing from {e}");
        }
        let e = decide(
            "the coordinator",
            &[(ServerTls, true), (Tokens, false)],
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("lacks tokens:") && !e.contains("--tls-cert"),
            "{e}"
        );
        let e = decide("the worker", &[(WorkerTls, true), (EtcdTls, false)], false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the worker is secure by default and lacks TLS to etcd:"),
            "{e}"
        );
    }

    #[test]
    fn insecure_waives_exactly_what_is_missing() {
        assert_eq!(
            decide("c", &[(ServerTls, false), (Tokens, false)], true),
            Ok(vec![ServerTls, Tokens])
        );
        assert_eq!(
            decide("w", &[(WorkerTls, true), (EtcdTls, false)], true),
            Ok(vec![EtcdTls])
        );
    }

    proptest! {
        /// Whatever is configured: without --insecure a binary starts only
        /// fully secured; with it, only when something is missing, and the
        /// waivers are exactly the missing pieces.
        #[test]
        fn decide_is_all_or_explicit(tls: bool, tokens: bool, etcd: Option<bool>, insecure: bool) {
            let mut pieces = vec![(ServerTls, tls), (Tokens, tokens)];
            if let Some(e) = etcd {
                pieces.push((EtcdTls, e));
            }
            let complete = pieces.iter().all(|(_, c)| *c);
            let missing: Vec<Waiver> = pieces.iter().filter(|(_, c)| !c).map(|(w, _)| *w).collect();
            match decide("c", &pieces, insecure) {
                Ok(w) => {
                    prop_assert_eq!(insecure, !complete);
                    prop_assert_eq!(w, missing);
                }
                Err(SecurityError::Missing { missing: m, .. }) => {
                    prop_assert!(!insecure && !complete);
                    prop_assert_eq!(m, missing);
                }
                Err(SecurityError::NothingToWaive { .. }) => prop_assert!(insecure && complete),
            }
        }
    }
}
