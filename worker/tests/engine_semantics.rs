//! Accumulation semantics of the engine (docs/SEMANTICS.md), W = 1.

mod common;

use common::*;
use tempfile::TempDir;

/// The seeds' check: with k = 4, the first element of a parameter is
/// unchanged after micro-steps 1, 2, 3 and changes at micro-step 4.
#[test]
fn parameters_change_only_at_the_sync_step() {
    let dir = TempDir::new().unwrap();
    let mut e = engine(spec(&mlp_job(64, 8, 4, "global_count", "")), dir.path());
    let first =
        |e: &accrue_worker::Engine<_>| e.parameters()[0].1.flatten(0, -1).double_value(&[0]);
    let before = first(&e);
    for micro in 1..=3 {
        assert!(
            e.micro_step().unwrap().is_none(),
            "micro-step {micro} must not be a sync step"
        );
        assert_eq!(first(&e), before, "parameter changed at micro-step {micro}");
    }
    let report = e
        .micro_step()
        .unwrap()
        .expect("micro-step 4 is the sync step");
    assert_eq!(report.step, 1);
    assert_eq!(report.samples, 32);
    assert_ne!(
        first(&e),
        before,
        "parameter did not change at micro-step 4"
    );
    // And again for the next window.
    let after_one = first(&e);
    for _ in 1..=3 {
        assert!(e.micro_step().unwrap().is_none());
        assert_eq!(first(&e), after_one);
    }
    assert!(e.micro_step().unwrap().is_some());
    assert_ne!(first(&e), after_one);
}

fn equivalence(samples: u64, normalize: &str, extra: &str) -> f64 {
    let (d1, d2) = (TempDir::new().unwrap(), TempDir::new().unwrap());
    let small = train(spec(&mlp_job(samples, 8, 4, normalize, extra)), d1.path());
    let large = train(spec(&mlp_job(samples, 32, 1, normalize, extra)), d2.path());
    let rel = max_rel_diff(&small, &large);
    eprintln!("{samples} samples, normalize {normalize}: k=4,b=8 vs k=1,b=32 max relative difference {rel:e}");
    rel
}

/// k = 4, b = 8 equals k = 1, b = 32 after 10 steps (160 samples = 5 windows
/// per epoch, 2 epochs), for normalize = mean and global_count.
#[test]
fn accumulation_equals_the_large_batch() {
    for normalize in ["global_count", "mean"] {
        let rel = equivalence(160, normalize, "");
        assert!(
            rel < 1e-5,
            "normalize {normalize}: k=4,b=8 differs from k=1,b=32 by {rel:e}"
        );
    }
}

/// 108 samples: the last window of each epoch holds micro-batches of 8 and
/// 4 samples. global_count divides by the true count (12) and still equals
/// the large batch; mean averages the two micro-batch means and does not.
#[test]
fn uneven_last_window_global_count_exact_mean_not() {
    let exact = equivalence(108, "global_count", "");
    assert!(
        exact < 1e-5,
        "global_count differs from the large batch by {exact:e}"
    );
    let mean = equivalence(108, "mean", "");
    assert!(
        mean > 1e-3,
        "mean should differ from the large batch, differs by only {mean:e}"
    );
}

/// sync = every_step (reduce each micro-step into separate accumulation
/// buffers) gives the same parameters as sync = boundary.
#[test]
fn every_step_equals_boundary() {
    for normalize in ["global_count", "mean", "sum"] {
        let (d1, d2) = (TempDir::new().unwrap(), TempDir::new().unwrap());
        let every = mlp_job(108, 8, 4, normalize, "").replace(
            &format!("normalize = \"{normalize}\""),
            &format!("normalize = \"{normalize}\"\nsync = \"every_step\""),
        );
        assert!(every.contains("every_step"));
        let a = train(spec(&every), d1.path());
        let b = train(spec(&mlp_job(108, 8, 4, normalize, "")), d2.path());
        let rel = max_rel_diff(&a, &b);
        eprintln!("normalize {normalize}: every_step vs boundary {rel:e}");
        assert!(
            rel < 1e-6,
            "normalize {normalize}: every_step differs from boundary by {rel:e}"
        );
    }
}

/// normalize = sum (Paddle avg = false) is k times the mean gradient: with
/// plain SGD, sum at lr equals mean at k * lr.
#[test]
fn sum_is_k_times_mean() {
    let plain = |normalize: &str, lr: &str| {
        mlp_job(160, 8, 4, normalize, "")
            .replace("momentum = 0.9\nweight_decay = 0.001", "")
            .replace("lr = 0.1", lr)
    };
    let (d1, d2) = (TempDir::new().unwrap(), TempDir::new().unwrap());
    let sum = train(spec(&plain("sum", "lr = 0.025")), d1.path());
    let mean = train(spec(&plain("mean", "lr = 0.1")), d2.path());
    let rel = max_rel_diff(&sum, &mean);
    assert!(rel < 1e-5, "sum at lr/k differs from mean at lr by {rel:e}");
}

/// Counters: step, samples_seen, epoch and micro_step after a full run with
/// an uneven last window.
#[test]
fn counters_after_a_run() {
    let dir = TempDir::new().unwrap();
    let mut e = engine(spec(&mlp_job(108, 8, 4, "global_count", "")), dir.path());
    let mut steps = Vec::new();
    let summary = e
        .run(|ev| {
            if let accrue_worker::Event::Step(r) = ev {
                steps.push((r.step, r.samples));
            }
        })
        .unwrap();
    // 14 micro-batches per epoch -> 4 windows (32, 32, 32, 12), 2 epochs.
    let expected: Vec<(u64, u64)> = [32, 32, 32, 12, 32, 32, 32, 12]
        .iter()
        .enumerate()
        .map(|(i, &s)| (i as u64 + 1, s))
        .collect();
    assert_eq!(steps, expected);
    let s = summary.state;
    assert_eq!(
        (s.step, s.samples_seen, s.epoch, s.cursor, s.micro_step),
        (8, 216, 2, 0, 28)
    );
    assert!(summary.finished);
    assert!(summary.checkpoint.ends_with("step-8"));
}
