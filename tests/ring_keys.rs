//! The ring master secret of a coordinator process: every Assignment
//! carries the key derived (HKDF-SHA256) from it for its job and
//! generation, from `--ring-secret-file` or from the state dir's
//! `ring-master.key` (created 0600 on first start, kept across restarts);
//! a bad file stops the coordinator with an error naming it.

mod common;

use accrue_common::ringkey::derive_ring_key;
use accrue_proto::v1;
use common::*;
use std::process::Command;
use tempfile::TempDir;
use tokio_stream::StreamExt;

/// Submits a one-worker job, attaches a fake worker and returns the job
/// id and the Assignment it receives.
async fn assignment(grpc: &str, name: &str) -> (String, v1::Assignment) {
    let job = client(grpc)
        .await
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml(name, 1, 5, ""))),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let hello = v1::WorkerHello {
        worker_id: format!("fake-{name}"),
        data_addr: "127.0.0.1:9".into(),
        ..Default::default()
    };
    let (_tx, mut inbound) = fake_worker(grpc, hello).await;
    let first = tokio::time::timeout(std::time::Duration::from_secs(20), inbound.next())
        .await
        .expect("no assignment within 20 s")
        .unwrap()
        .unwrap();
    let Some(v1::coordinator_message::Msg::Assign(a)) = first.msg else {
        panic!("expected an assignment: {first:?}")
    };
    assert_eq!(a.job_id, job.id);
    (job.id, a)
}

#[tokio::test]
async fn assignments_carry_the_key_derived_from_the_ring_secret_file() {
    let d = TempDir::new().unwrap();
    let master: Vec<u8> = (0u8..48).collect();
    let file = d.path().join("ring.secret");
    std::fs::write(&file, &master).unwrap();
    let state = d.path().join("state");
    let co = spawn_coordinator(
        &coordinator_args(&state, &["--ring-secret-file", &file.display().to_string()]),
        &d.path().join("coordinator.log"),
    );
    let (job, a) = assignment(&co.grpc, "keyed").await;
    assert_eq!(a.generation, 1);
    assert_eq!(a.secret, derive_ring_key(&master, &job, 1).to_vec());
    assert_ne!(a.secret, derive_ring_key(&master, &job, 0).to_vec());
    assert!(
        !state.join("ring-master.key").exists(),
        "with a file given, no master is created in the state dir"
    );
}

#[tokio::test]
async fn the_state_dir_master_is_created_private_and_kept_across_restarts() {
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    let key_file = state.join("ring-master.key");
    let first = {
        let co = spawn_coordinator(&coordinator_args(&state, &[]), &d.path().join("first.log"));
        let (job, a) = assignment(&co.grpc, "first").await;
        let master = std::fs::read(&key_file).unwrap();
        assert_eq!(master.len(), 32);
        assert_eq!(a.secret, derive_ring_key(&master, &job, 1).to_vec());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key_file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "mode {mode:o}");
        master
    };
    // The first process is gone (killed on drop); a restart reuses it.
    let co = spawn_coordinator(&coordinator_args(&state, &[]), &d.path().join("second.log"));
    let (job, a) = assignment(&co.grpc, "second").await;
    assert_eq!(std::fs::read(&key_file).unwrap(), first);
    assert_eq!(a.secret, derive_ring_key(&first, &job, 1).to_vec());
}

#[test]
fn a_short_or_missing_secret_file_stops_the_coordinator_naming_it() {
    let d = TempDir::new().unwrap();
    let short = d.path().join("short.secret");
    std::fs::write(&short, b"too short\n").unwrap();
    let missing = d.path().join("missing.secret");
    for (file, want) in [
        (&short, "holds 10 bytes; it needs at least 32"),
        (&missing, "cannot read the ring secret file"),
    ] {
        let log = d.path().join("refused.log");
        let mut cmd = Command::new(coordinator_bin());
        cmd.args(coordinator_args(
            &d.path().join("state"),
            &["--ring-secret-file", &file.display().to_string()],
        ));
        // Bounded: a coordinator that starts anyway is killed, not awaited.
        let (status, err) = bounded(cmd, &log);
        assert!(
            status.is_some_and(|s| !s.success()),
            "started with {}: {status:?}\n{err}",
            file.display()
        );
        assert!(
            err.contains(want) && err.contains(&file.display().to_string()),
            "{err}"
        );
    }
}
