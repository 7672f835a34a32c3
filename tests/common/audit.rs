//! The daemons' sample logs (`--sample-log`) as audits: which samples
//! each rank read in each committed window, joined over ranks (tests/
//! recovery.rs and tests/lm_recovery.rs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;

/// One worker daemon with a sample log, slowed so a window lasts long
/// enough to be interrupted.
pub fn spawn_logged_worker(grpc: &str, id: &str, dir: &Path) -> Child {
    let samples = dir.join(format!("samples-{id}.jsonl"));
    let samples = samples.to_str().unwrap();
    super::spawn_worker(
        grpc,
        id,
        dir,
        &["--micro-step-delay-ms", "12", "--sample-log", samples],
    )
}

/// One committed window as the sample logs record it: every rank's line
/// holds the indices that rank itself read (recorded where its data reader
/// fetched them).
#[derive(Debug, Default, PartialEq)]
pub struct Window {
    pub epoch: u64,
    pub world: u64,
    /// rank -> the indices it read in this window, in reading order.
    pub reads: BTreeMap<u64, Vec<u64>>,
}

/// The committed windows of job `name` from every daemon's sample log, by
/// step. Ranks write their line before the step's reduction, so a step
/// whose window aborted (a lost rank) and was redone has lines of several
/// attempts: of the attempts (told apart by world size) the newest one
/// counts. Within an attempt the ranks must agree on the epoch, and a
/// (step, rank) logged twice (the same window read again by a replacement
/// after an abort) must hold the same reads.
pub fn committed_windows(dir: &Path, name: &str) -> BTreeMap<u64, Window> {
    // (step, world) -> (the attempt's newest line, its window).
    let mut attempts: BTreeMap<(u64, u64), (u64, Window)> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p: PathBuf = entry.unwrap().path();
        if !p
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("samples-")
        {
            continue;
        }
        for line in std::fs::read_to_string(&p).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            if v["job"] != name {
                continue;
            }
            let field = |k: &str| {
                v[k].as_u64()
                    .unwrap_or_else(|| panic!("{k} missing in {line}"))
            };
            let (step, epoch, world, rank, t) = (
                field("step"),
                field("epoch"),
                field("world"),
                field("rank"),
                field("t"),
            );
            let idx: Vec<u64> = v["indices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            let (newest, w) = attempts.entry((step, world)).or_insert_with(|| {
                (
                    0,
                    Window {
                        epoch,
                        world,
                        reads: BTreeMap::new(),
                    },
                )
            });
            *newest = (*newest).max(t);
            assert_eq!(
                (w.epoch, w.world),
                (epoch, world),
                "ranks disagree on epoch and world size of step {step} ({})",
                p.display()
            );
            match w.reads.get(&rank) {
                Some(prev) => assert_eq!(
                    prev,
                    &idx,
                    "rank {rank}'s reads of step {step} logged twice, differently ({})",
                    p.display()
                ),
                None => {
                    w.reads.insert(rank, idx);
                }
            }
        }
    }
    let mut out: BTreeMap<u64, (u64, Window)> = BTreeMap::new();
    for ((step, _), (t, w)) in attempts {
        if out.get(&step).is_none_or(|(newest, _)| t > *newest) {
            out.insert(step, (t, w));
        }
    }
    out.into_iter().map(|(step, (_, w))| (step, w)).collect()
}

/// From the ranks' own records: every step 1..=steps committed once, with
/// a record from each of its W ranks; no sample read twice in a window
/// (within a rank or across ranks); and every epoch read each of the
/// `samples` indices exactly once.
pub fn assert_exact_accounting(dir: &Path, name: &str, steps: u64, epochs: u64, samples: u64) {
    let windows = committed_windows(dir, name);
    assert_eq!(
        windows.keys().copied().collect::<Vec<_>>(),
        (1..=steps).collect::<Vec<_>>(),
        "committed steps"
    );
    for (step, w) in &windows {
        assert_eq!(
            w.reads.keys().copied().collect::<Vec<_>>(),
            (0..w.world).collect::<Vec<_>>(),
            "step {step}: a record from every rank of the window"
        );
        let mut all: Vec<u64> = w.reads.values().flatten().copied().collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "step {step}: ranks' reads overlap: {w:?}");
    }
    for e in 0..epochs {
        let mut seen: Vec<u64> = windows
            .values()
            .filter(|w| w.epoch == e)
            .flat_map(|w| w.reads.values().flatten().copied())
            .collect();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..samples).collect::<Vec<_>>(),
            "epoch {e}: every sample exactly once over all ranks' reads"
        );
    }
}

/// A job that lost `victim` (rank 1 of W = 2, k = 4) and re-formed once
/// with the spare in its place: succeeded, one recovery naming the lost
/// and the joined worker, resumed after step 3 or later. Returns that
/// recovery.
pub fn assert_spare_took_over<'a>(
    end: &'a accrue_proto::v1::Job,
    victim: &str,
    spare: &[&str],
) -> &'a accrue_proto::v1::Recovery {
    use accrue_proto::v1::JobState;
    assert_eq!(end.state(), JobState::Succeeded, "{end:?}");
    assert_eq!(end.recoveries.len(), 1, "{:?}", end.recoveries);
    let r = &end.recoveries[0];
    assert_eq!(r.lost, [victim]);
    assert_eq!(r.joined, spare);
    assert_eq!((r.world_size, r.accumulation_steps), (2, 4));
    assert_eq!(
        end.workers[1], spare[0],
        "the spare takes the lost rank's place"
    );
    assert!(r.resumed_step >= 3, "{r:?}");
    r
}
