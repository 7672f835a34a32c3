//! The semantic check of every overlay, its certificates, and each check failing on a broken copy.

use super::*;

#[test]
fn every_overlay_passes_the_semantic_check_and_its_certificates_name_what_is_dialed() {
    let f = fixture();
    for r in &f.renders {
        let (certs, specs) = check(f, r.name);
        assert!(
            certs.len() >= 5,
            "{}: the checker found too few certificates to check: {certs:?}",
            r.name
        );
        for c in &certs {
            cert_covers(&c.pem, &[c.name.as_str()], &c.usage).unwrap_or_else(|e| {
                panic!(
                    "{}: {} of Secret {} {e}: {}",
                    r.name, c.key, c.secret, c.why
                )
            });
        }
        // The names docs/DEPLOY.md promises for the coordinator.
        let coordinator = certs
            .iter()
            .find(|c| c.secret == "accrue-coordinator-tls" && c.key == "coordinator.pem")
            .expect("the coordinator's certificate");
        cert_covers(
            &coordinator.pem,
            &[
                "coordinator",
                "coordinator.accrue",
                "coordinator.accrue.svc",
                "coordinator.accrue.svc.cluster.local",
            ],
            "server",
        )
        .unwrap();
        // The example's job spec is one the CLI accepts.
        assert_eq!(specs.len(), 1, "{}", r.name);
        for s in &specs {
            accrue_common::JobSpec::fields_from_toml_str(s, Path::new("job.toml"))
                .unwrap_or_else(|e| panic!("the example's job spec: {e}"));
        }
    }
}

#[test]
fn a_certificate_without_the_names_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    ok(Command::new(bin_dir().join("accrue"))
        .arg("dev-certs")
        .arg(dir.path())
        .args(["--san", "coordinator"]));
    let pem = std::fs::read_to_string(dir.path().join("coordinator.pem")).unwrap();
    cert_covers(&pem, &["coordinator"], "server").unwrap();
    let err = cert_covers(&pem, &["coordinator", "coordinator.accrue"], "server").unwrap_err();
    assert!(err.contains("coordinator.accrue"), "{err}");
    let worker = std::fs::read_to_string(dir.path().join("etcd-client.pem")).unwrap();
    assert_eq!(
        cert_covers(&worker, &[], "server").unwrap_err(),
        "is not for server use"
    );
}

/// Every mutation, the variant it applies to, and what the checker must
/// say about it.
const BROKEN: &[(&str, &str, &str)] = &[
    ("latest-image", "cpu", "uses the tag latest"),
    ("untagged-image", "cpu", "is not pinned (no tag)"),
    ("service-selector", "cpu", "Service/coordinator: selector"),
    (
        "deployment-selector",
        "cpu",
        "does not match the pod template's labels",
    ),
    (
        "missing-secret",
        "cpu",
        "Secret accrue-tokens is not defined",
    ),
    (
        "missing-configmap-key",
        "cpu",
        "ConfigMap accrue-settings key ACCRUE_LEASE_TTL is not defined",
    ),
    (
        "missing-serviceaccount",
        "cpu",
        "ServiceAccount accrue-worker is not defined",
    ),
    (
        "missing-pvc",
        "cpu",
        "PersistentVolumeClaim accrue-checkpoints is not defined",
    ),
    (
        "service-target-port",
        "cpu",
        "targetPort 'https' is no port of Deployment/coordinator",
    ),
    (
        "netpol-port",
        "cpu",
        "port 'ring' is no port of StatefulSet/worker",
    ),
    (
        "netpol-range",
        "cpu",
        "port range 80-60999 is not an unprivileged numeric range",
    ),
    ("no-default-deny", "cpu", "no default-deny ingress policy"),
    ("namespace", "cpu", "namespace 'default', not 'accrue'"),
    (
        "unknown-flag",
        "cpu",
        "accrue-worker refuses its arguments: error: unexpected argument '--no-such-flag'",
    ),
    (
        "bad-flag-value",
        "cpu",
        "accrue-coordinator refuses its arguments: error: invalid value 'three' for '--lease-ttl",
    ),
    (
        "unresolved-var",
        "cpu",
        "$(ACCRUE_HEARTBEATS) in '--heartbeat=$(ACCRUE_HEARTBEATS)' is not an environment variable",
    ),
    (
        "etcd-unknown-flag",
        "cpu",
        "etcd has no flag --peer-client-cert",
    ),
    (
        "etcd-3.5-only-flag",
        "cpu",
        "etcd refuses its arguments: flag provided but not defined: -peer-client-cert-file",
    ),
    (
        "etcd-bad-url",
        "cpu",
        "etcd refuses its arguments: invalid value \"0.0.0.0:2379\" for flag -listen-client-urls",
    ),
    ("etcd-other-version", "cpu", "is not etcd 3.5.21"),
    (
        "etcd-initial-cluster",
        "cpu",
        "--initial-cluster names ['etcd-0', 'etcd-1']",
    ),
    (
        "etcd-peer-open",
        "cpu",
        "peers speak plain HTTP, but NetworkPolicy/etcd admits the peer port from others than the members",
    ),
    (
        "etcd-not-published",
        "cpu",
        "does not publish not-ready members",
    ),
    (
        "probe-path",
        "cpu",
        "readinessProbe asks for /ready, which is not one of ['/readyz']",
    ),
    (
        "probe-port",
        "cpu",
        "readinessProbe probes port 50051, but the binary serves it on 8080",
    ),
    (
        "probe-scheme",
        "cpu",
        "livenessProbe scheme HTTP, but the endpoint speaks HTTPS",
    ),
    (
        "listen-port",
        "cpu",
        "listens on 9090 (health) but declares no such containerPort",
    ),
    (
        "advertise-data",
        "cpu",
        "--advertise-data worker-0.workers:29500 does not name this pod",
    ),
    (
        "more-workers-than-certs",
        "cpu",
        "secret accrue-worker-certs mounted at /etc/accrue/worker has no key worker-worker-8.pem",
    ),
    (
        "short-grace",
        "cpu",
        "terminationGracePeriodSeconds 30 leaves no time after --stop-timeout 90",
    ),
    (
        "gpu-in-cpu",
        "cpu",
        "asks for nvidia.com/gpu (1) in the cpu overlay",
    ),
    (
        "gpu-no-limit",
        "gpu",
        "the gpu overlay's worker has no nvidia.com/gpu limit",
    ),
    (
        "gpu-no-toleration",
        "gpu",
        "does not tolerate the nvidia.com/gpu taint",
    ),
    (
        "gpu-cpu-device",
        "gpu",
        "--device is 'cpu', not cuda:N, in the gpu overlay",
    ),
    ("rolling-coordinator", "cpu", "use strategy Recreate"),
    (
        "pdb-exceeds",
        "cpu",
        "maxUnavailable 5 exceeds the 2 replicas of StatefulSet/worker",
    ),
    (
        "secret-env",
        "cpu",
        "env ACCRUE_TOKEN comes from Secret accrue-client: Secrets must be mounted files",
    ),
    (
        "secret-in-args",
        "cpu",
        "the value of Secret accrue-client/submit.token appears in its command line",
    ),
    (
        "root",
        "cpu",
        "pod securityContext.runAsUser is 0, not 65532",
    ),
    ("writable-root", "cpu", "readOnlyRootFilesystem is not true"),
    (
        "token-mounted",
        "cpu",
        "automountServiceAccountToken is not false in the pod spec",
    ),
    ("no-limits", "cpu", "has no limits.cpu"),
    (
        "job-retried",
        "cpu",
        "a Job that submits must not be retried",
    ),
    (
        "podgroup-min-member",
        "cpu-components",
        "minMember 1 is not the 2 pods that join it",
    ),
    (
        "servicemonitor-port",
        "cpu-components",
        "endpoint port 'metrics' is no port of Service coordinator",
    ),
    (
        "servicemonitor-token",
        "cpu-components",
        "token Secret accrue-metrics key token is not defined",
    ),
];

#[test]
fn every_check_fails_on_a_broken_copy() {
    let f = fixture();
    let listed = ok(Command::new(env!("ACCRUE_PYTHON"))
        .arg(f.deploy.join("tests/mutate.py"))
        .arg("--list"));
    for m in listed.lines().filter(|m| *m != "unknown-field") {
        assert!(
            BROKEN.iter().any(|(b, _, _)| b == &m),
            "mutation {m} has no expected problem here"
        );
    }
    for variant in ["cpu", "gpu", "cpu-components"] {
        let cases: Vec<_> = BROKEN.iter().filter(|(_, v, _)| *v == variant).collect();
        let names: Vec<&str> = cases.iter().map(|(m, _, _)| *m).collect();
        let dir = mutated(f, variant, &names);
        let files: Vec<PathBuf> = names
            .iter()
            .map(|m| dir.join(format!("{m}.yaml")))
            .collect();
        let out = run(f
            .checker(f.render(variant).expect)
            .arg("--each")
            .args(&files));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{variant}: no problem found at all");
        for ((m, _, want), file) in cases.iter().zip(&files) {
            let prefix = format!("{}: ", file.display());
            let said: Vec<&str> = stdout
                .lines()
                .filter_map(|l| l.strip_prefix(&prefix))
                .collect();
            assert!(
                said.iter().any(|l| l.contains(want)),
                "mutation {m}: expected a problem containing {want:?}; the checker said {said:#?}"
            );
        }
        eprintln!("{variant}: {} broken copies, each refused", cases.len());
    }
}
