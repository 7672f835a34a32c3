//! Issue 15: a cluster run driven by the manifests. deploy/tests/cluster_run.py
//! renders the cpu overlay with generated Secrets and runs every pod's own
//! command, args, env and volumes as local processes of this build's
//! binaries (chrooted into the image's runtime tree, one network namespace
//! per pod, Service names resolving, probes polled, Services routing to
//! ready pods only); the example submit Job trains the digits job through
//! the coordinator Service while the leader coordinator pod and a worker
//! pod are killed and replaced; then the CLI on this host submits a small
//! job from outside through a forwarded port (as `kubectl port-forward`). It needs root (namespaces, mounts, chroot):
//! `#[ignore = "needs root"]`, and `make test` runs it (with `--ignored`)
//! when it runs as root (docs/DEVELOPING.md, "Tests that need root or CUDA").

use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
#[ignore = "needs root"]
// It was ignored for a while as flaky (3 failures in about 11 runs): the
// harness's bridge took the lowest MAC of its ports, so the pod and veth
// churn of the kills changed the gateway's MAC under the pods' ARP caches
// and worker-0's connections to the Service were dropped for 10 to 50 s.
// The bridge's MAC is now pinned and each pod's follows its IP.
fn the_cpu_overlay_trains_through_a_leader_and_worker_kill_as_root() {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "needs root (network namespaces, mounts, chroot): run it as root, as `make test` does"
    );
    assert!(
        repo().join("data/digits/train-images-idx3-ubyte").exists(),
        "run `make test` (it writes data/digits)"
    );
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_accrue"))
        .parent()
        .unwrap()
        .to_path_buf();
    for b in ["accrue-coordinator", "accrue-worker"] {
        assert!(
            bin_dir.join(b).exists(),
            "{b} is missing: `make test` builds the whole workspace first"
        );
    }
    let work = tempfile::Builder::new()
        .prefix("cluster-run")
        .tempdir()
        .unwrap();
    let started = std::time::Instant::now();
    let out = Command::new(env!("ACCRUE_PYTHON"))
        .arg(repo().join("deploy/tests/cluster_run.py"))
        .arg("run")
        .arg(repo())
        .arg(&bin_dir)
        .arg(work.path().join("run"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!(
        "{stdout}(cluster run: {:.0} s)",
        started.elapsed().as_secs_f64()
    );
    if !out.status.success() {
        // Keep the pods' logs for a person to read.
        let kept = work.keep();
        panic!(
            "the cluster run failed ({:?}); pod logs under {}\n{}",
            out.status.code(),
            kept.join("run").display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let result: serde_json::Value = stdout
        .lines()
        .find_map(|l| l.strip_prefix("result: "))
        .and_then(|j| serde_json::from_str(j).ok())
        .expect("a result line");
    assert_eq!(result["submit_exit"], 0, "{result}");
    assert_eq!(
        result["killed"].as_array().map(Vec::len),
        Some(2),
        "{result}"
    );
    assert_eq!(
        result["cluster_latest"], result["reference_latest"],
        "{result}"
    );
    assert_eq!(result["max_abs_diff"], 0.0, "{result}");
    // From outside: the CLI on this host through a forwarded port (as
    // `kubectl port-forward svc/coordinator`), CA and submit token.
    assert_eq!(result["outside_exit"], 0, "{result}");
    assert!(
        result["outside_last"]
            .as_str()
            .is_some_and(|l| l.ends_with("succeeded: finished 4 optimizer steps")),
        "{result}"
    );
}
