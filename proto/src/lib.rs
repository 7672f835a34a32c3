//! accrue's gRPC API (generated from proto/accrue/v1/accrue.proto) and the
//! conversions between its JobSpec and the domain job spec.

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("accrue.v1");
}

pub mod codec;
mod convert;
pub mod layout;
pub mod secure;
pub mod tls;

pub use convert::{spec_from_proto, spec_to_proto};

/// A gRPC status as one line: its message, then each underlying error's
/// text that the line does not hold yet (transport errors repeat their
/// source's text, and a bare "transport error" says nothing about a
/// refused certificate).
pub fn status_chain(s: &tonic::Status) -> String {
    with_sources(s.message().to_string(), std::error::Error::source(s))
}

/// `e` and its sources as one line, `: `-separated, each text once.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    with_sources(e.to_string(), e.source())
}

fn with_sources(mut out: String, mut next: Option<&dyn std::error::Error>) -> String {
    while let Some(e) = next {
        let t = e.to_string();
        if !out.contains(&t) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&t);
        }
        next = e.source();
    }
    out
}

#[cfg(test)]
mod chain_tests {
    #[derive(Debug)]
    struct E(&'static str, Option<Box<E>>);
    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for E {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn the_chain_names_the_cause_once() {
        let cause = E(
            "invalid peer certificate: UnknownIssuer",
            Some(Box::new(E("UnknownIssuer", None))),
        );
        let s = tonic::Status::from_error(Box::new(E("transport error", Some(Box::new(cause)))));
        let line = super::status_chain(&s);
        assert!(
            line.ends_with("invalid peer certificate: UnknownIssuer"),
            "{line}"
        );
        assert_eq!(line.matches("UnknownIssuer").count(), 1, "{line}");
        let outer = E("cannot connect", Some(Box::new(E("refused", None))));
        assert_eq!(super::error_chain(&outer), "cannot connect: refused");
        let plain = tonic::Status::unavailable("not the leader");
        assert_eq!(super::status_chain(&plain), "not the leader");
    }
}
