//! Issue 14, confined paths, as processes on loopback: a coordinator and a
//! worker daemon started with `--data-root`, `--model-root` and
//! `--checkpoint-root`. Paths that leave their root (`..`, an absolute path
//! elsewhere, a symlink out) are refused at submit with INVALID_ARGUMENT
//! naming the field; a symlink only the worker can see fails the job on the
//! worker, naming the field; nothing is ever written outside the roots, and
//! a job inside them runs.

mod common;

use accrue_proto::v1::{self, JobState};
use common::*;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tempfile::TempDir;

/// A tensors job (never run: refused at submit) naming these paths.
fn tensors_job(name: &str, data: &str, model_init: &str, ckpt: &str) -> String {
    format!(
        r#"
name = "{name}"
device = "cpu"
[model]
kind = "mlp"
init = {model_init:?}
[data]
kind = "tensors"
path = {data:?}
batch_size = 4
[optimizer]
kind = "sgd"
lr = 0.1
[checkpoint]
dir = {ckpt:?}
"#
    )
}

fn proto(text: &str) -> v1::JobSpec {
    let s = accrue_common::JobSpec::fields_from_toml_str(text, Path::new("t.toml")).unwrap();
    accrue_proto::spec_to_proto(&s)
}

/// Every file and folder under `dir`.
fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_outside_their_roots_are_refused_and_nothing_is_written_outside() {
    let t = TempDir::new().unwrap();
    let base = std::fs::canonicalize(t.path()).unwrap();
    let dir = |p: &str| {
        let d = base.join(p);
        std::fs::create_dir_all(&d).unwrap();
        d.display().to_string()
    };
    let (state, c_data, c_models) = (dir("state"), dir("c/data"), dir("c/models"));
    let (w_data, w_models, w_ckpt) = (dir("w/data"), dir("w/models"), dir("w/ckpt"));
    let outside = base.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    // A link out of the coordinator's data root, and one out of the
    // worker's checkpoint root that the coordinator cannot see.
    symlink(&outside, base.join("c/data/link")).unwrap();
    symlink(&outside, base.join("w/ckpt/sneaky")).unwrap();
    // A sharded model.init folder whose index names a shard linked out of
    // the model root: one the coordinator sees, one only the worker sees.
    let index = r#"{"weight_map": {"w": "model-00001-of-00001.safetensors"}}"#;
    std::fs::write(outside.join("secret.safetensors"), "x").unwrap();
    let c_shard = base.join("c/models/sharded/model-00001-of-00001.safetensors");
    let w_shard = base.join("w/models/wsharded/model-00001-of-00001.safetensors");
    for shard in [&c_shard, &w_shard] {
        let folder = shard.parent().unwrap();
        std::fs::create_dir_all(folder).unwrap();
        std::fs::write(folder.join("model.safetensors.index.json"), index).unwrap();
        symlink(outside.join("secret.safetensors"), shard).unwrap();
    }
    let logs = base.join("logs");
    std::fs::create_dir_all(&logs).unwrap();

    let co = spawn_coordinator(
        &coordinator_args(
            Path::new(&state),
            &[
                "--data-root",
                &c_data,
                "--model-root",
                &c_models,
                "--checkpoint-root",
                &state,
            ],
        ),
        &logs.join("coordinator.log"),
    );
    let mut c = client(&co.grpc).await;

    // The issue's probe, verbatim and inside this test's folder; `..`
    // relative to a root; absolute paths elsewhere; a symlink out.
    let probe = base.join("probe/outside/../escaped").display().to_string();
    let global_probe_existed = Path::new("/tmp/probe/escaped").exists();
    let elsewhere = outside.join("train.safetensors").display().to_string();
    let cases = [
        (
            tensors_job("probe", "t", "m", "/tmp/probe/outside/../escaped"),
            "checkpoint.dir",
            "/tmp/probe/outside/../escaped",
        ),
        (
            tensors_job("probe2", "t", "m", &probe),
            "checkpoint.dir",
            probe.as_str(),
        ),
        (
            tensors_job("dotdot", "t", "m", "../escaped"),
            "checkpoint.dir",
            "../escaped",
        ),
        (
            tensors_job("abs", &elsewhere, "m", "run"),
            "data.path",
            elsewhere.as_str(),
        ),
        (
            tensors_job("init", "t", "/etc/hostname", "run"),
            "model.init",
            "/etc/hostname",
        ),
        (
            tensors_job("link", "link/train.safetensors", "m", "run"),
            "data.path",
            "link/train.safetensors",
        ),
        (
            tensors_job("shard", "t", "sharded", "run"),
            "model.init",
            c_shard.to_str().unwrap(),
        ),
    ];
    for (text, field, value) in &cases {
        let e = c
            .submit_job(v1::SubmitJobRequest {
                spec: Some(proto(text)),
                ..Default::default()
            })
            .await
            .expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{field}: {e:?}");
        assert!(
            e.message()
                .contains(&format!("{field} = {value:?}: must lie under")),
            "{field}: {}",
            e.message()
        );
    }
    let listed = c
        .list_jobs(v1::ListJobsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.jobs.is_empty(), "nothing recorded: {listed:?}");

    // One worker with its own roots.
    let _w = Workers(vec![spawn_worker(
        &co.grpc,
        "paths0",
        &logs,
        &[
            "--data-root",
            &w_data,
            "--model-root",
            &w_models,
            "--checkpoint-root",
            &w_ckpt,
        ],
    )]);

    // `sneaky` does not exist under the coordinator's root, so the
    // coordinator accepts; the worker sees where it leads and refuses
    // before writing anything.
    let sneaky = job_toml("sneaky", 1, 4, "[checkpoint]\ndir = \"sneaky/run\"");
    let id = submit_ok(&mut c, &sneaky).await;
    let j = wait_state(&mut c, &id, &[JobState::Failed, JobState::Succeeded], LIMIT).await;
    assert_eq!(j.state(), JobState::Failed, "{j:?}");
    let why = j.error.clone();
    assert!(
        why.contains("checkpoint.dir = \"sneaky/run\": must lie under")
            && why.contains("refused by worker paths0"),
        "{why}"
    );

    // The worker confines the shards of a model.init folder too, after
    // following their links.
    let wshard =
        job_toml("wshard", 1, 4, "").replace("[model]\n", "[model]\ninit = \"wsharded\"\n");
    let id = submit_ok(&mut c, &wshard).await;
    let j = wait_state(&mut c, &id, &[JobState::Failed, JobState::Succeeded], LIMIT).await;
    assert_eq!(j.state(), JobState::Failed, "{j:?}");
    let why = j.error.clone();
    for part in [
        format!(
            "model.init = {:?}: must lie under the model root {w_models}",
            w_shard.display().to_string()
        ),
        format!(
            "resolves to {}",
            outside.join("secret.safetensors").display()
        ),
        "refused by worker paths0".into(),
    ] {
        assert!(why.contains(&part), "{why:?} lacks {part:?}");
    }

    // The same worker then runs a job inside its roots.
    let good = job_toml("good", 1, 4, "[checkpoint]\ndir = \"good\"");
    let id = submit_ok(&mut c, &good).await;
    let j = wait_state(&mut c, &id, &[JobState::Failed, JobState::Succeeded], LIMIT).await;
    assert_eq!(j.state(), JobState::Succeeded, "{j:?}");
    assert!(
        base.join("w/ckpt/good/LATEST").is_file(),
        "the checkpoint lies under the worker's root: {:?}",
        entries(&base.join("w/ckpt"))
    );

    // Nothing written outside the roots.
    assert_eq!(entries(&outside), vec![outside.join("secret.safetensors")]);
    assert!(!base.join("probe").exists());
    if !global_probe_existed {
        assert!(!Path::new("/tmp/probe/escaped").exists());
    }
}

/// A coordinator whose default checkpoint folder (`<state-dir>/checkpoints`)
/// lies outside `--checkpoint-root` does not start, and says why.
#[test]
fn a_default_checkpoint_folder_outside_the_root_stops_the_coordinator() {
    let t = TempDir::new().unwrap();
    let ckpt = t.path().join("ckpt").display().to_string();
    let out = Command::new(coordinator_bin())
        .args(coordinator_args(
            &t.path().join("state"),
            &["--checkpoint-root", &ckpt],
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--checkpoint-root") && err.contains("default checkpoint folder"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "it never served");
}

const LIMIT: Duration = Duration::from_secs(120);

async fn submit_ok(c: &mut accrue::Client, text: &str) -> String {
    c.submit_job(v1::SubmitJobRequest {
        // Fields only: the files are the worker's, under its roots.
        spec: Some(proto(text)),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .id
}
