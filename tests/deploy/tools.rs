//! The containers' flags against the real binaries, and deploy/make-secrets.sh.

use super::*;

/// The flag check rests on clap parsing every flag and value before an
/// appended `--help`: a wrong flag or value is refused, not hidden.
#[test]
fn help_after_the_flags_refuses_what_the_binary_would() {
    let worker = bin_dir().join("accrue-worker");
    let coordinator = bin_dir().join("accrue-coordinator");
    let accrue = bin_dir().join("accrue");
    let good: &[(&PathBuf, &[&str])] = &[
        (
            &worker,
            &[
                "daemon",
                "--id=worker-0",
                "--health-listen=0.0.0.0:8081",
                "--threads=2",
            ],
        ),
        (
            &coordinator,
            &["--etcd=https://etcd-client:2379", "--lease-ttl=3"],
        ),
        (
            &accrue,
            &[
                "--coordinator=coordinator:50051",
                "submit",
                "job.toml",
                "--wait",
            ],
        ),
    ];
    for (bin, args) in good {
        let out = run(Command::new(bin).args(*args).arg("--help"));
        assert!(out.status.success(), "{bin:?} {args:?}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("Usage:"));
    }
    let bad: &[(&PathBuf, &[&str], &str)] = &[
        (
            &worker,
            &["daemon", "--no-such-flag"],
            "unexpected argument",
        ),
        (&worker, &["daemon", "--threads=0"], "invalid value '0'"),
        (
            &worker,
            &["daemon", "--heartbeat", "soon"],
            "invalid value 'soon'",
        ),
        (
            &coordinator,
            &["--lease-ttl=three"],
            "invalid value 'three'",
        ),
        (&coordinator, &["--listen"], "a value is required"),
        (
            &accrue,
            &["submit", "job.toml", "--wiat"],
            "unexpected argument",
        ),
    ];
    for (bin, args, want) in bad {
        let out = run(Command::new(bin).args(*args).arg("--help"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{bin:?} {args:?} --help: {} {err}",
            out.status
        );
    }
}

#[test]
fn make_secrets_keeps_the_ca_tokens_and_ring_secret_and_issues_what_is_asked() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("s");
    let make = |workers: &str, extra_sans: &str| {
        ok(Command::new("sh")
            .arg(repo().join("deploy/make-secrets.sh"))
            .arg(&out)
            .env("ACCRUE_BIN", bin_dir().join("accrue"))
            .env("ACCRUE_WORKERS", workers)
            .env("ACCRUE_EXTRA_SANS", extra_sans))
    };
    make("3", "");
    let read = |f: &str| std::fs::read_to_string(out.join(f)).unwrap();
    let ring_key = || std::fs::read(out.join("ring-master.key")).unwrap();
    let (ca, tokens, ring) = (read("ca.pem"), read("tokens.toml"), ring_key());
    assert_eq!(ring.len(), 32);
    let k = read("kustomization.yaml");
    assert!(k.contains("worker-worker-2.pem") && !k.contains("worker-worker-3.pem"));
    make("5", "accrue.example.com");
    assert_eq!(read("ca.pem"), ca, "the CA is kept");
    // A name users reach the coordinator at from outside.
    cert_covers(
        &read("coordinator.pem"),
        &["coordinator", "accrue.example.com"],
        "server",
    )
    .unwrap();
    assert_eq!(read("tokens.toml"), tokens, "the tokens are kept");
    assert_eq!(ring_key(), ring, "the ring secret is kept");
    assert!(read("kustomization.yaml").contains("worker-worker-4.key"));
    // Issued by that CA, naming the pod.
    cert_covers(&read("worker-worker-4.pem"), &["worker-4"], "client").unwrap();
    let mode = |f: &str| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(out.join(f)).unwrap().permissions().mode() & 0o777
    };
    for secret in [
        "ca.key",
        "etcd-server.key",
        "ring-master.key",
        "submit.token",
    ] {
        assert_eq!(mode(secret), 0o600, "{secret}");
    }
    // The CA key never goes into a Secret.
    assert!(!read("kustomization.yaml").contains("ca.key"));
}
