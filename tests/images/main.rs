//! deploy/images: the runtime tree the images ship, made by
//! deploy/images/assemble-runtime.sh from this build's binaries, runs them
//! with nothing but its own libraries. No container engine runs here, so the
//! tree is what is tested: started through its own loader with only its own
//! folders and an empty environment (any user), and, as root, chrooted into
//! as the image's file system with /proc and a minimal /dev, as user 65532.
//! A library missing from the tree makes these fail; the Dockerfiles are
//! checked as text (pinned bases, non-root user, the same script).
use std::ffi::OsStr;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

mod chroot;
mod cuda;
mod dockerfiles;
mod runtime;

const BINS: [&str; 3] = ["accrue", "accrue-coordinator", "accrue-worker"];

/// A tiny job: an MLP on synthetic data, 4 optimizer steps, one thread.
const JOB: &str = r#"
name = "image-smoke"
seed = 7
epochs = 1
device = "cpu"
threads = 1
[model]
kind = "mlp"
hidden = [16]
[data]
kind = "synthetic"
samples = 64
eval_samples = 16
shape = [8]
classes = 3
batch_size = 8
[accumulation]
steps = 2
[optimizer]
kind = "sgd"
lr = 0.1
"#;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn built(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_BIN_EXE_accrue")).with_file_name(name);
    assert!(
        p.exists(),
        "{} is missing: `make test` builds the whole workspace first",
        p.display()
    );
    p
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn show(o: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        text(&o.stdout),
        text(&o.stderr)
    )
}

/// `p` with `.` and `..` resolved lexically (the loader prints
/// `<tree>/usr/local/bin/../lib/accrue/...`; some paths it tries do not exist).
fn lexical(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// The loader as the binaries name it, relative to a tree's root.
fn loader_in_tree() -> &'static str {
    if cfg!(target_arch = "x86_64") {
        "lib64/ld-linux-x86-64.so.2"
    } else if cfg!(target_arch = "aarch64") {
        "lib/ld-linux-aarch64.so.1"
    } else {
        panic!("no loader path known for {}", std::env::consts::ARCH)
    }
}

/// Runs assemble-runtime.sh into `out` (hard links, debug info stripped).
fn assemble(out: &Path, flags: &[&str]) -> Output {
    let t = Instant::now();
    let o = Command::new(repo().join("deploy/images/assemble-runtime.sh"))
        .args(flags)
        .args(["--link", "--strip"])
        .arg(out)
        .args(BINS.map(built))
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    eprintln!(
        "assemble-runtime.sh {flags:?}: {:.1} s\n{}",
        t.elapsed().as_secs_f64(),
        text(&o.stderr)
    );
    o
}

struct Tree {
    root: PathBuf,
}

impl Tree {
    fn syslib(&self) -> PathBuf {
        self.root
            .join(format!("usr/lib/{}-linux-gnu", std::env::consts::ARCH))
    }

    fn acclib(&self) -> PathBuf {
        self.root.join("usr/local/lib/accrue")
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.root.join("usr/local/bin").join(name)
    }

    /// `name` started by the tree's own loader, which searches the tree's
    /// system folder (the image's default search path) and the binary's own
    /// RPATH, nothing else: no cache, no LD_LIBRARY_PATH, empty environment
    /// but for `env`.
    fn command(&self, name: &str, env: &[(&str, &str)]) -> Command {
        let mut c = Command::new(self.root.join(loader_in_tree()));
        c.arg("--inhibit-cache")
            .arg("--library-path")
            .arg(self.syslib())
            .arg(self.bin(name))
            .env_clear()
            .envs(env.iter().copied());
        c
    }

    /// What the tree's loader resolves for `file` (as ldd does):
    /// (name, path) pairs, path None when not found.
    fn resolve(&self, file: &Path, library_path: &[PathBuf]) -> Vec<(String, Option<PathBuf>)> {
        let o = Command::new(self.root.join(loader_in_tree()))
            .arg("--inhibit-cache")
            .arg("--library-path")
            .arg(std::env::join_paths(library_path).unwrap())
            .arg(file)
            .env_clear()
            .env("LD_TRACE_LOADED_OBJECTS", "1")
            .output()
            .unwrap();
        let mut out = Vec::new();
        for line in text(&o.stdout).lines().map(str::trim) {
            if let Some((name, rest)) = line.split_once(" => ") {
                let path = rest.split(" (0x").next().unwrap();
                let path = (path != "not found").then(|| PathBuf::from(path));
                out.push((name.to_string(), path));
            }
        }
        assert!(
            !out.is_empty(),
            "cannot list the libraries of {}:\n{}",
            file.display(),
            show(&o)
        );
        out
    }
}

/// The step, eval and summary lines of a train run without the speed.
fn progress(stdout: &[u8]) -> Vec<String> {
    text(stdout)
        .lines()
        .map(|l| l.split(" samples/s ").next().unwrap().to_string())
        .collect()
}

/// The RPATH or RUNPATH entries of `file` (readelf).
fn rpath(file: &Path) -> Vec<String> {
    let o = Command::new("readelf")
        .args(["-dW"])
        .arg(file)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "readelf {}: {}",
        file.display(),
        show(&o)
    );
    text(&o.stdout)
        .lines()
        .filter(|l| l.contains("(RPATH)") || l.contains("(RUNPATH)"))
        .filter_map(|l| Some(l.split_once('[')?.1.trim_end_matches(']').to_string()))
        .flat_map(|r| r.split(':').map(str::to_string).collect::<Vec<_>>())
        .collect()
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() && !p.is_symlink() {
            out.push(p);
        }
    }
    out.sort();
    out
}
