//! `[performance] cudnn_deterministic` (issue 31) reaches libtorch's global
//! context when an engine is made, and a job without it turns it back off
//! (a daemon runs jobs one after another in one process). Its own test
//! binary: the setting is process-wide.

mod common;

use accrue_worker::cuda::backends::cudnn_deterministic;
use accrue_worker::engine::{Engine, RunOptions};
use accrue_worker::SingleRank;
use common::*;

#[test]
fn cudnn_deterministic_follows_the_job() {
    assert_eq!(cudnn_deterministic(), Some(false), "libtorch's default");
    let plain = mlp_job(8, 4, 1, "mean", "");
    let on = mlp_job(
        8,
        4,
        1,
        "mean",
        "[performance]\ncudnn_deterministic = true\n",
    );
    let e = Engine::new(spec(&on), SingleRank, RunOptions::default()).unwrap();
    assert_eq!(cudnn_deterministic(), Some(true));
    // One run at a time writes the job's checkpoint folder (its lock).
    drop(e);
    let _e = Engine::new(spec(&plain), SingleRank, RunOptions::default()).unwrap();
    assert_eq!(cudnn_deterministic(), Some(false));
}
