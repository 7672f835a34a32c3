//! A state dir (or tokens file) another user owns or may write is refused
//! by `accrue local` and `accrue-coordinator`, naming the path, its mode
//! and its owner, before anything in it is written or trusted: whoever may
//! write `tls/tokens.toml` could give themselves every scope.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use tempfile::TempDir;

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// `accrue local` on a small job with `state` as its state dir: its exit
/// status and stderr (bounded to 30 s).
fn local(d: &Path, state: &Path, log: &str) -> (Option<std::process::ExitStatus>, String) {
    let job = common::write(d, "job.toml", &common::job_toml("sd", 1, 2, ""));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_accrue"));
    cmd.arg("local")
        .arg(&job)
        .arg("--state-dir")
        .arg(state)
        .current_dir(d);
    common::bounded(cmd, &d.join(log))
}

/// `accrue-coordinator` on `state`: with the test credentials, or with
/// `--tokens FILE` and `--insecure` (no TLS) when `tokens` is given.
fn coordinator(
    d: &Path,
    state: &Path,
    tokens: Option<&Path>,
    log: &str,
) -> (Option<std::process::ExitStatus>, String) {
    let mut cmd = Command::new(common::coordinator_bin());
    match tokens {
        None => cmd.args(common::coordinator_args(state, &[])),
        Some(t) => cmd
            .args([
                "--listen",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
                "--insecure",
            ])
            .arg("--state-dir")
            .arg(state)
            .arg("--tokens")
            .arg(t),
    };
    common::bounded(cmd, &d.join(log))
}

/// Asserts the run failed with one `error:` line containing every part.
fn refused(what: &str, (status, log): (Option<std::process::ExitStatus>, String), parts: &[&str]) {
    assert!(
        matches!(status, Some(s) if !s.success()),
        "{what} was not refused ({status:?}):\n{log}"
    );
    let line = log
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("{what}: no error line:\n{log}"));
    for p in parts {
        assert!(line.contains(p), "{what}: {line:?} lacks {p:?}");
    }
}

#[test]
fn a_world_writable_state_dir_is_refused_naming_path_mode_and_owner() {
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    std::fs::create_dir(&state).unwrap();
    chmod(&state, 0o777);
    let shown = state.display().to_string();
    let owner = format!("owner uid {}", uid());
    let parts = [
        shown.as_str(),
        "writable by other users",
        "mode 0777",
        &owner,
    ];
    refused("accrue local", local(d.path(), &state, "local.log"), &parts);
    // Refused before anything was written there.
    assert_eq!(std::fs::read_dir(&state).unwrap().count(), 0);
    refused(
        "accrue-coordinator",
        coordinator(d.path(), &state, None, "coord.log"),
        &parts,
    );
    assert_eq!(std::fs::read_dir(&state).unwrap().count(), 0);

    // A private state dir whose tls/ others can write: tls/ is named.
    chmod(&state, 0o755);
    let tls = state.join("tls");
    std::fs::create_dir(&tls).unwrap();
    chmod(&tls, 0o777);
    let shown = tls.display().to_string();
    refused(
        "accrue local",
        local(d.path(), &state, "local-tls.log"),
        &[shown.as_str(), "mode 0777", &owner],
    );
    assert_eq!(std::fs::read_dir(&tls).unwrap().count(), 0);

    // A tokens file others can write is refused too.
    chmod(&tls, 0o700);
    let tokens = common::write(d.path(), "tokens.toml", "");
    chmod(&tokens, 0o666);
    let shown = tokens.display().to_string();
    let fresh = d.path().join("fresh");
    refused(
        "accrue-coordinator --tokens",
        coordinator(d.path(), &fresh, Some(&tokens), "coord-tokens.log"),
        &[shown.as_str(), "mode 0666", &owner],
    );
    // A state dir the coordinator creates is 0700.
    chmod(&tokens, 0o600);
    let mode = std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
}

/// A local user made for one test, removed on drop (even when the test
/// fails).
struct TempUser {
    name: String,
    uid: u32,
}

impl TempUser {
    fn add() -> Self {
        let name = format!("accrue-t{}", std::process::id());
        // One left by a killed run with this pid.
        let _ = Command::new("userdel").arg(&name).status();
        let ok = Command::new("useradd")
            .args(["--system", "--no-create-home", "--user-group"])
            .args(["--shell", "/usr/sbin/nologin", &name])
            .status()
            .unwrap();
        assert!(ok.success(), "useradd {name} failed");
        let id = |flag: &str| -> u32 {
            let out = Command::new("id").args([flag, &name]).output().unwrap();
            String::from_utf8(out.stdout)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        let uid = id("-u");
        Self { name, uid }
    }

    fn chown(&self, p: &Path, group_only: bool) {
        let who = if group_only {
            format!("root:{}", self.name)
        } else {
            format!("{0}:{0}", self.name)
        };
        let ok = Command::new("chown").arg(who).arg(p).status().unwrap();
        assert!(ok.success(), "chown {}", p.display());
    }
}

impl Drop for TempUser {
    fn drop(&mut self) {
        let _ = Command::new("userdel").arg(&self.name).status();
    }
}

#[test]
#[ignore = "needs root"]
fn another_users_state_dir_is_refused_naming_its_owner_as_root() {
    assert_eq!(uid(), 0, "run as root (make test does, as root)");
    let user = TempUser::add();
    let d = TempDir::new().unwrap();
    // The other user owns the state dir: it could replace tokens.toml.
    let state: PathBuf = d.path().join("state");
    std::fs::create_dir(&state).unwrap();
    chmod(&state, 0o700);
    user.chown(&state, false);
    let shown = state.display().to_string();
    let owner = format!("owned by uid {} ({})", user.uid, user.name);
    let parts = [shown.as_str(), owner.as_str(), "mode 0700"];
    refused("accrue local", local(d.path(), &state, "local.log"), &parts);
    refused(
        "accrue-coordinator",
        coordinator(d.path(), &state, None, "coord.log"),
        &parts,
    );

    // Root's state dir, but the other user's group may write it.
    let state2 = d.path().join("state2");
    std::fs::create_dir(&state2).unwrap();
    user.chown(&state2, true);
    chmod(&state2, 0o770);
    let shown = state2.display().to_string();
    refused(
        "accrue local",
        local(d.path(), &state2, "local2.log"),
        &[
            shown.as_str(),
            "writable by other users",
            "mode 0770",
            "owner uid 0",
        ],
    );

    // Root's state dir, the other user's tls/ in it.
    let state3 = d.path().join("state3");
    std::fs::create_dir_all(state3.join("tls")).unwrap();
    chmod(&state3, 0o755);
    user.chown(&state3.join("tls"), false);
    let shown = state3.join("tls").display().to_string();
    refused(
        "accrue local",
        local(d.path(), &state3, "local3.log"),
        &[shown.as_str(), owner.as_str()],
    );

    // A tokens file the other user owns.
    let tokens = common::write(d.path(), "tokens.toml", "");
    chmod(&tokens, 0o600);
    user.chown(&tokens, false);
    let shown = tokens.display().to_string();
    refused(
        "accrue-coordinator --tokens",
        coordinator(
            d.path(),
            &d.path().join("state4"),
            Some(&tokens),
            "coord4.log",
        ),
        &[shown.as_str(), owner.as_str(), "mode 0600"],
    );
}
