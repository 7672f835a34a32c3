//! TensorBoard event files (docs/OPERATIONS.md, "TensorBoard"): a real
//! coordinator with `tensorboard_dir`, a real worker daemon training a
//! tiny MLP with evaluations, and the job's run folder read back by
//! TensorBoard's own reader (`EventAccumulator`, through
//! tests/reference/read_tensorboard.py): every committed step's scalars
//! as the coordinator published them, the evaluations at their steps and
//! the spec as TOML text.

mod common;

use accrue_proto::v1::{job_event, JobState};
use common::*;
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tempfile::TempDir;

const STEPS: u64 = 12;

/// read_tensorboard.py's JSON for `run`.
fn read_back(run: &Path) -> Value {
    let out = Command::new(env!("ACCRUE_PYTHON"))
        .arg(repo().join("tests/reference/read_tensorboard.py"))
        .arg(run)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "read_tensorboard.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// (step, value) of scalar `tag`.
fn points(tb: &Value, tag: &str) -> Vec<(u64, f64)> {
    tb["scalars"][tag]
        .as_array()
        .unwrap_or_else(|| panic!("no scalar {tag}: {}", tb["scalars"]))
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_run_folder_reads_back_in_tensorboard_as_the_coordinator_saw_it() {
    let d = TempDir::new().unwrap();
    let tb_dir = d.path().join("tb");
    let cfg = accrue_coordinator::Config {
        state_dir: d.path().join("state"),
        heartbeat_ttl: Duration::from_secs(3),
        tls: Some(creds().server_tls()),
        tokens: Some(creds().tokens_file()),
        tensorboard_dir: Some(tb_dir.clone()),
        ..Default::default()
    };
    let h = accrue_coordinator::start(cfg, "127.0.0.1:0", "127.0.0.1:0")
        .await
        .unwrap();
    let grpc = h.grpc_addr.to_string();
    // Every event the coordinator publishes, from before the job exists.
    let mut events = h.coordinator().unwrap().subscribe();
    let _w = start_workers(&grpc, 1, d.path(), "tb");
    let mut c = client(&grpc).await;
    let job = submit_text(
        &mut c,
        &job_toml("tb", 1, STEPS, "[eval]\nevery_steps = 4\nbatch_size = 32\n"),
    )
    .await;
    let end = ended(&mut c, &job.id).await;
    assert_eq!(end.state(), JobState::Succeeded, "{:?}", end.error);
    // Nothing was dropped, and /metrics says so.
    let metrics = accrue_coordinator::http::metrics_text(&h.coordinator().unwrap());
    assert!(
        metrics.contains("\naccrue_tensorboard_points_dropped_total 0\n"),
        "{metrics}"
    );
    // Stopping the coordinator flushes and closes the writer.
    h.stop().await;
    let (mut steps, mut evals) = (Vec::new(), Vec::new());
    while let Ok(ev) = events.try_recv() {
        if ev.job.as_ref().is_none_or(|j| j.id != job.id) {
            continue;
        }
        match ev.event {
            Some(job_event::Event::Step(r)) => steps.push(r),
            Some(job_event::Event::Eval(e)) => evals.push(e),
            _ => {}
        }
    }
    assert_eq!(steps.len() as u64, STEPS, "one report per committed step");
    let run = tb_dir.join(&job.id);
    let tb = read_back(&run);
    let files = tb["files"].as_array().unwrap();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].as_str().unwrap();
    assert!(
        name.starts_with("events.out.tfevents.")
            && name.ends_with(&format!(".{}.0", std::process::id())),
        "{name}"
    );

    // Every step's scalars, as the coordinator published them (TensorBoard
    // keeps float32; serde_json may read Python's shortest repr of a double
    // one ulp off, never a float32 off).
    let same = |tag: &str, want: Vec<(u64, f64)>| {
        let f32s = |v: Vec<(u64, f64)>| -> Vec<(u64, f32)> {
            v.into_iter().map(|(s, v)| (s, v as f32)).collect()
        };
        assert_eq!(f32s(points(&tb, tag)), f32s(want), "{tag}");
    };
    same(
        "train/loss",
        steps.iter().map(|r| (r.step, r.loss)).collect(),
    );
    same(
        "train/grad_norm",
        steps.iter().map(|r| (r.step, r.grad_norm)).collect(),
    );
    same(
        "train/clip_coef",
        steps.iter().map(|r| (r.step, r.clip_coef)).collect(),
    );
    same("train/lr", steps.iter().map(|r| (r.step, r.lr)).collect());
    same(
        "train/samples_per_sec",
        steps.iter().map(|r| (r.step, r.samples_per_sec)).collect(),
    );
    same(
        "train/skipped_steps",
        steps.iter().map(|r| (r.step, 0.0)).collect(),
    );
    let loss_steps: Vec<u64> = points(&tb, "train/loss").iter().map(|p| p.0).collect();
    assert_eq!(loss_steps, (1..=STEPS).collect::<Vec<_>>());
    assert!(
        tb["scalars"]["train/tokens_per_sec"].is_null(),
        "an MLP counts samples"
    );

    // The evaluations at their steps: every 4 steps and the final one.
    let eval_steps: Vec<u64> = evals.iter().map(|e| e.step).collect();
    assert_eq!(eval_steps, [4, 8, 12]);
    same(
        "eval/loss",
        evals.iter().map(|e| (e.step, e.loss)).collect(),
    );
    same(
        "eval/accuracy",
        evals.iter().map(|e| (e.step, e.accuracy)).collect(),
    );
    assert!(
        tb["scalars"]["eval/perplexity"].is_null(),
        "not a language model"
    );

    // The spec, as TOML naming the job.
    let texts = tb["texts"]["spec"].as_array().expect("a spec text");
    assert_eq!(texts.len(), 1);
    assert_eq!(texts[0][0].as_u64(), Some(0));
    let text = texts[0][1].as_str().unwrap();
    let toml_text = accrue_coordinator::tensorboard::spec_toml(text);
    let table: toml::Table = toml::from_str(toml_text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(table["name"].as_str(), Some("tb"), "{text}");
    assert_eq!(table["max_steps"].as_integer(), Some(STEPS as i64));
}
