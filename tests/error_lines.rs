//! How the binaries print a failure: one line, each cause once
//! (docs/OPERATIONS.md, "Errors"); a job refused for its world size names
//! the setting that causes it; a failed job prints no final accuracy.

mod common;

use std::path::Path;
use std::process::{Command, Output};
use tempfile::TempDir;

fn accrue(args: &[&str], state: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_accrue"))
        .args(args)
        .current_dir(state)
        .env("RUST_LOG", "error")
        .output()
        .unwrap()
}

/// The single `error:` line of a failed command: exit status not 0 or 101,
/// no other line on stderr, under 300 characters.
fn error_line(out: &Output) -> String {
    let text = error_text(out);
    assert_eq!(text.lines().count(), 1, "one line expected:\n{text}");
    text
}

/// The error a failed command printed (exit status not 0 or 101): one
/// `error:` line of under 300 characters, followed only by a spec
/// refusal's list of fields (one per line, indented).
fn error_text(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    assert_ne!(out.status.code(), Some(101), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        !lines.is_empty() && lines[0].starts_with("error: "),
        "{stderr}"
    );
    for l in &lines {
        assert!(l.len() < 300, "{l}");
    }
    for l in &lines[1..] {
        assert!(
            l.starts_with("  ") && l.contains(" = "),
            "not a field line: {l:?}\n{stderr}"
        );
    }
    lines.join("\n")
}

/// A port nothing listens on (bound, then closed).
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

const BAD_K: &str = "name = \"bad-k\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\n\
                     batch_size = 4\n[accumulation]\nsteps = 0\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";

#[test]
fn spec_errors_and_missing_files_are_printed_once() {
    let d = TempDir::new().unwrap();
    std::fs::write(d.path().join("bad.toml"), BAD_K).unwrap();
    let coordinator = format!("127.0.0.1:{}", closed_port());
    for args in [
        vec!["local", "bad.toml", "--insecure", "--state-dir", "state"],
        // Refused before connecting: no coordinator is needed to say so.
        vec![
            "--insecure",
            "--coordinator",
            &coordinator,
            "submit",
            "bad.toml",
        ],
    ] {
        let line = error_text(&accrue(&args, d.path()));
        assert_eq!(
            line.matches("accumulation.steps = 0").count(),
            1,
            "{args:?}: {line}"
        );
        assert!(line.contains("must be an integer in 1..="), "{line}");
    }
    let line = error_line(&accrue(
        &[
            "local",
            "missing.toml",
            "--insecure",
            "--state-dir",
            "state",
        ],
        d.path(),
    ));
    assert!(line.contains("cannot read job spec missing.toml"), "{line}");
    assert_eq!(
        line.matches("No such file or directory").count(),
        1,
        "{line}"
    );
}

#[test]
fn a_refused_connection_is_printed_once() {
    let d = TempDir::new().unwrap();
    let coordinator = format!("127.0.0.1:{}", closed_port());
    let out = accrue(
        &[
            "--insecure",
            "--coordinator",
            &coordinator,
            "status",
            "some-job",
        ],
        d.path(),
    );
    let line = error_line(&out);
    assert!(line.contains(&coordinator), "{line}");
    assert_eq!(line.matches("tcp connect error").count(), 1, "{line}");
    assert_eq!(line.matches("Connection refused").count(), 1, "{line}");
}

/// The coordinator's own start-up errors take the same one line.
#[test]
fn the_coordinator_prints_a_busy_port_once() {
    let d = TempDir::new().unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let out = Command::new(common::coordinator_bin())
        .args(["--insecure", "--listen", &addr, "--http", "127.0.0.1:0"])
        .arg("--state-dir")
        .arg(d.path())
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let line = error_line(&out);
    assert!(line.contains(&addr), "{line}");
    assert_eq!(line.matches("Address already in use").count(), 1, "{line}");
}

/// `accrue local` on the job `toml` with `workers` workers; returns (exit
/// code, stdout).
fn local(name: &str, toml: &str, workers: &str) -> (Option<i32>, String) {
    common::worker_bin();
    let d = TempDir::new().unwrap();
    std::fs::write(d.path().join(format!("{name}.toml")), toml).unwrap();
    let job = format!("{name}.toml");
    let out = accrue(
        &[
            "local",
            &job,
            "--insecure",
            "--workers",
            workers,
            "--threads",
            "1",
            "--state-dir",
            "state",
        ],
        d.path(),
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// One sample, two ranks, `pad = false` (and no drop_last): rank 1 gets no
/// sample, and the error says that pad = false is why.
#[test]
fn too_few_samples_for_the_ranks_names_pad() {
    let toml = "name = \"pad\"\nepochs = 1\ndevice = \"cpu\"\n[model]\nkind = \"mlp\"\nnum_classes = 2\n\
                [data]\nkind = \"synthetic\"\nsamples = 1\neval_samples = 0\nshape = [3]\nclasses = 2\n\
                batch_size = 1\npad = false\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
    let (code, stdout) = local("pad", toml, "2");
    assert_eq!(code, Some(1), "{stdout}");
    let error = stdout
        .lines()
        .find_map(|l| l.strip_prefix("error "))
        .unwrap_or_else(|| panic!("no error line:\n{stdout}"));
    assert!(
        error.contains("data.pad = false: 1 samples over 2 ranks leave rank 1 with none"),
        "{error}"
    );
    assert!(!error.contains("drop_last"), "{error}");
}

/// A job that evaluates after its first epoch, then fails (the learning
/// rate blows the weights up; `on_nonfinite = "error"`): the last eval is
/// shown as such, never as a final accuracy.
#[test]
fn a_failed_job_prints_no_final_accuracy() {
    let toml = "name = \"boom\"\nepochs = 3\ndevice = \"cpu\"\n[model]\nkind = \"mlp\"\nhidden = [8]\n\
                [data]\nkind = \"synthetic\"\nsamples = 8\neval_samples = 8\nshape = [4]\nclasses = 2\n\
                batch_size = 8\n[clipping]\non_nonfinite = \"error\"\n\
                [optimizer]\nkind = \"sgd\"\nlr = 1e30\n[eval]\nevery_epochs = 1\n";
    let (code, stdout) = local("boom", toml, "1");
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.contains("boom-1 failed"), "{stdout}");
    assert!(stdout.contains("non-finite gradient norm"), "{stdout}");
    assert!(!stdout.contains("final accuracy"), "{stdout}");
    assert!(stdout.contains("last eval (step 1): accuracy"), "{stdout}");
}
