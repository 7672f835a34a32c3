//! A pipeline job's evaluations reach the coordinator and its watchers:
//! a real coordinator, real worker daemons, an mlp cut into two stages
//! evaluating every 2 steps, beside the same job in one stage. The
//! evaluation is sent by the rank that owns the loss (the last stage), and
//! its numbers are those of the job without stages.

mod common;

use accrue_proto::v1::{job_event, EvalResult, JobState};
use common::*;
use tempfile::TempDir;

const STEPS: u64 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_jobs_evaluations_reach_the_watchers_as_one_stages() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let mut events = h.coordinator().unwrap().subscribe();
    let _w = start_workers(&grpc, 3, d.path(), "pe");
    let mut c = client(&grpc).await;
    let eval = "[eval]\nevery_steps = 2\n";
    let staged = submit_text(
        &mut c,
        &job_toml(
            "staged",
            2,
            STEPS,
            &format!("{eval}[parallel]\npipeline = 2\n"),
        ),
    )
    .await;
    let whole = submit_text(&mut c, &job_toml("whole", 1, STEPS, eval)).await;
    for j in [&staged, &whole] {
        let end = ended(&mut c, &j.id).await;
        assert_eq!(
            end.state(),
            JobState::Succeeded,
            "{}: {:?}",
            j.id,
            end.error
        );
    }
    h.stop().await;
    let mut evals: std::collections::HashMap<String, Vec<EvalResult>> = Default::default();
    while let Ok(ev) = events.try_recv() {
        if let (Some(job), Some(job_event::Event::Eval(e))) = (&ev.job, ev.event) {
            evals.entry(job.id.clone()).or_default().push(e);
        }
    }
    let (got, want) = (&evals[&staged.id], &evals[&whole.id]);
    eprintln!("two stages: {got:?}\none stage: {want:?}");
    assert_eq!(
        got.iter().map(|e| e.step).collect::<Vec<_>>(),
        vec![2, 4],
        "the staged job's evaluations"
    );
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        // 64 held-out samples (job_toml's eval_samples), every one counted.
        assert_eq!((g.step, g.samples), (w.step, 64), "step {}", g.step);
        assert_eq!(g.samples, w.samples);
        for (what, a, b) in [
            ("loss", g.loss, w.loss),
            ("accuracy", g.accuracy, w.accuracy),
        ] {
            let rel = (a - b).abs() / b.abs().max(1.0);
            // The stages sum the same products in the same order as one
            // process up to the norm's reduction: a missing or partial
            // evaluation is off by far more (or NaN).
            assert!(rel <= 1e-4, "step {}: {what} {a} vs {b} ({rel:e})", g.step);
        }
    }
}
