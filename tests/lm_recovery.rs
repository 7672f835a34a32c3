//! Fault tolerance of a causal language model (issue 30), as
//! tests/recovery.rs does it for the MLP: a worker daemon training a tiny
//! Llama on an llm.c token file is killed with SIGKILL mid-run with a spare
//! attached; the spare takes its place and the job ends at the parameters
//! of the same job run without the kill, with every sample read exactly
//! once per epoch (the daemons' sample logs, joined over ranks).

mod common;

use accrue_proto::v1::JobState;
use common::weights::relative_difference;
use common::*;
use std::path::Path;
use tempfile::TempDir;

/// The tiny Llama with one layer, W = 2.
fn job(name: &str, data: &Path, epochs: u64) -> String {
    tiny_llama_job(name, data, 2, epochs, 1, "", "")
}

/// kill -9 of a rank mid-window with a spare attached: the spare takes the
/// lost rank's place and the Llama ends at the parameters of the same job
/// run without the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lm_kill_9_mid_run_ends_at_the_undisturbed_parameters() {
    let d = TempDir::new().unwrap();
    // (1537 - 1) / 8 = 192 samples; W k b = 32: 6 windows per epoch, 18
    // steps in 3 epochs.
    let data = token_file(d.path(), 1537);
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let ids = ["l0", "l1", "l2"];
    let mut w = Workers(
        ids.iter()
            .map(|id| audit::spawn_logged_worker(&grpc, id, d.path()))
            .collect(),
    );
    let mut c = client(&grpc).await;
    let hurt = submit_text(&mut c, &job("lmhurt", &data, 3)).await;
    let running = wait_step(&mut c, &hurt.id, 4).await;
    assert_eq!(running.state(), JobState::Running, "{running:?}");
    let seen = running.counters.unwrap().step;
    let victim = running.workers[1].clone();
    let at = ids.iter().position(|x| *x == victim).unwrap();
    w.0[at].kill().unwrap();
    let spare: Vec<&str> = ids
        .iter()
        .copied()
        .filter(|x| !running.workers.iter().any(|r| r == x))
        .collect();
    let end = ended(&mut c, &hurt.id).await;
    let r = audit::assert_spare_took_over(&end, &victim, &spare);
    eprintln!(
        "lm recovery: killed after step {seen} was seen, resumed after step {}",
        r.resumed_step
    );
    let counters = end.counters.unwrap();
    assert_eq!((counters.step, counters.total_steps), (18, 18));
    // An LM job counts targets (the tokens seen): every sample's 8, once.
    assert_eq!(counters.samples_seen, 3 * 192 * 8);
    audit::assert_exact_accounting(d.path(), "lmhurt", 18, 3, 192);

    // The same job without the kill, on the two daemons left.
    let calm = submit_text(&mut c, &job("lmcalm", &data, 3)).await;
    let calm_end = ended(&mut c, &calm.id).await;
    assert_eq!(calm_end.state(), JobState::Succeeded, "{calm_end:?}");
    assert!(calm_end.recoveries.is_empty());
    let model = |j: &accrue_proto::v1::Job| Path::new(&j.checkpoint).join("model.safetensors");
    let diff = relative_difference(&model(&end), &model(&calm_end));
    eprintln!("final parameters, interrupted vs uninterrupted: max relative difference {diff:e}");
    assert!(diff <= 1e-5, "relative difference {diff}");

    // The comparison can tell runs apart: one epoch fewer ends elsewhere.
    let short = submit_text(&mut c, &job("lmshort", &data, 2)).await;
    let short_end = ended(&mut c, &short.id).await;
    assert_eq!(short_end.state(), JobState::Succeeded, "{short_end:?}");
    let moved = relative_difference(&model(&short_end), &model(&calm_end));
    eprintln!("2 epochs vs 3: {moved:e}");
    assert!(moved > 1e-3, "{moved}");
    h.stop().await;
}
