//! A checkpoint is published only when every writer wrote its part: a
//! rank that fails to write leaves no step folder, no LATEST and no
//! temporary folder, and every rank fails naming why.

mod common;

use common::procs::{free_addrs, spawn_rank, spawn_rank_limited};
use common::*;
use std::time::Duration;
use tempfile::TempDir;

/// Two pipeline stages checkpointing every step, the second stage's
/// process unable to write a file above 16 KB (its model shard is about
/// 23 KB; its log stays far below): its part of step 1 fails with EFBIG,
/// the first stage (the finisher) publishes nothing, and both ranks exit
/// with the error.
#[test]
fn a_stage_that_fails_to_write_leaves_no_checkpoint() {
    let d = TempDir::new().unwrap();
    let tokens = token_file(d.path(), 4 * 4 * 2 * 8 + 1);
    let tail = "[parallel]\npipeline = 2\n[checkpoint]\nevery_steps = 1\n";
    let text = tiny_llama_job(&tokens, 2, false, tail).replace("max_steps = 4", "max_steps = 2");
    let job = d.path().join("job.toml");
    std::fs::write(&job, text).unwrap();
    let mut attempt = 0;
    let (zero, one) = loop {
        attempt += 1;
        let peers = free_addrs(2);
        let mut one = spawn_rank_limited(&job, 1, &peers, d.path(), &[], Some(16 << 10));
        let mut zero = spawn_rank(&job, 0, &peers, d.path());
        for r in [&mut zero, &mut one] {
            let status = r
                .wait(Duration::from_secs(120))
                .unwrap_or_else(|| panic!("rank {} did not finish", r.rank));
            assert!(
                !status.success(),
                "rank {} succeeded:\n{}",
                r.rank,
                r.stderr()
            );
        }
        // A peer's port taken by another test before its rank bound it.
        let taken = [&zero, &one]
            .iter()
            .any(|r| r.stderr().contains("Address already in use"));
        if !taken || attempt > 2 {
            break (zero, one);
        }
    };
    let (e0, e1) = (zero.stderr(), one.stderr());
    for (r, e) in [(0, &e0), (1, &e1)] {
        eprintln!("rank {r}: {}", e.lines().last().unwrap_or_default());
    }
    assert!(e1.contains("File too large"), "rank 1:\n{e1}");
    assert!(
        e0.contains("File too large") && e0.contains("step-1"),
        "rank 0:\n{e0}"
    );
    let ck = d.path().join("ckpt");
    let left: Vec<String> = std::fs::read_dir(&ck)
        .map(|r| {
            r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        !left
            .iter()
            .any(|n| n.starts_with("step-") || n.starts_with(".step-") || n == "LATEST"),
        "{} holds {left:?}",
        ck.display()
    );
}
