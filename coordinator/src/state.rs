//! Job state machine and gang scheduling, as pure functions with time passed
//! in (docs/ARCHITECTURE.md, "The coordinator core").

pub use crate::domain::state_name;
pub use crate::error::NotResumable;
use accrue_proto::v1::{Job, JobState, Transition};

/// Whether `from -> to` is a legal transition.
pub fn allowed(from: JobState, to: JobState) -> bool {
    use JobState::*;
    matches!(
        (from, to),
        (Unspecified, Pending)
            | (Pending, Rendezvous)
            | (Pending, Cancelled)
            | (Pending, Failed)
            | (Rendezvous, Running)
            | (Rendezvous, Failed)
            | (Rendezvous, Cancelled)
            | (Rendezvous, Succeeded)
            | (Running, Succeeded)
            | (Running, Failed)
            | (Running, Cancelled)
            | (Running, Recovering)
            | (Rendezvous, Recovering)
            | (Recovering, Rendezvous)
            | (Recovering, Running)
            | (Recovering, Failed)
            | (Recovering, Cancelled)
            // A resume (issue 27): the job is scheduled again under its id.
            | (Failed, Pending)
            | (Cancelled, Pending)
    )
}

pub fn is_final(s: JobState) -> bool {
    matches!(
        s,
        JobState::Succeeded | JobState::Failed | JobState::Cancelled
    )
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("job {job} cannot go from {from:?} to {to:?}")]
pub struct TransitionError {
    pub job: String,
    pub from: JobState,
    pub to: JobState,
}

/// Moves `job` to `to`, recording the reason and the time. A job that
/// ends drops a recovery record still open (generation 0: a re-formation
/// that never happened; see [`drop_unformed`]).
pub fn transition(
    job: &mut Job,
    to: JobState,
    reason: impl Into<String>,
    now_ms: i64,
) -> Result<Transition, TransitionError> {
    let from = job.state();
    if !allowed(from, to) {
        return Err(TransitionError {
            job: job.id.clone(),
            from,
            to,
        });
    }
    let t = Transition {
        from: from as i32,
        to: to as i32,
        reason: reason.into(),
        at_unix_ms: now_ms,
    };
    job.set_state(to);
    push_history(job, t.clone());
    if is_final(to) {
        drop_unformed(job);
    }
    Ok(t)
}

/// How many transitions a job's history keeps: the newest; older ones
/// are dropped and counted in `history_dropped` (docs/OPERATIONS.md,
/// "Watching a job"). A job cancelled and resumed in a loop would
/// otherwise grow without bound, and with it every read of it.
pub const HISTORY_KEPT: usize = 100;

/// Appends `t` to `job`'s history, dropping (and counting) the oldest
/// entries beyond [`HISTORY_KEPT`].
pub fn push_history(job: &mut Job, t: Transition) {
    job.history.push(t);
    let over = job.history.len().saturating_sub(HISTORY_KEPT);
    if over > 0 {
        job.history.drain(..over);
        job.history_dropped += over as u64;
    }
}

/// How many recovery records a job keeps: the newest; older ones are
/// dropped and counted in `recoveries_dropped`, as the history's are (a
/// job that re-forms again and again, or is resumed in a loop, would
/// otherwise grow without bound).
pub const RECOVERIES_KEPT: usize = 100;

/// Appends `r` to `job`'s recoveries, dropping (and counting) the oldest
/// beyond [`RECOVERIES_KEPT`]. The open record, when there is one, is
/// always the last and so always kept.
pub fn push_recovery(job: &mut Job, r: accrue_proto::v1::Recovery) {
    job.recoveries.push(r);
    let over = job.recoveries.len().saturating_sub(RECOVERIES_KEPT);
    if over > 0 {
        job.recoveries.drain(..over);
        job.recoveries_dropped += over as u64;
    }
}

/// **Decision (issue 28):** `recoveries` holds the re-formations that
/// happened, each with the generation it formed, W and k; while a job
/// waits to re-form (Recovering, or Pending after a resume) its last
/// record is open (generation 0). A job that ends before it re-forms
/// (it failed waiting for workers, was cancelled, a rank failed) drops
/// that open record: no `generation 0 ... W = 0, k = 0` is ever shown for
/// a re-formation that did not happen. What it was recovering from stays
/// in the history (the Recovering transition's reason) and in the job's
/// error (`... (recovering from: ...)`).
pub fn drop_unformed(job: &mut Job) {
    if job.recoveries.last().is_some_and(|r| r.generation == 0) {
        job.recoveries.pop();
    }
}

/// Resumes a failed or cancelled `job` (pure; issue 27): it goes back to
/// Pending with a transition naming `by` (who asked) and what it ended
/// with, its error is cleared, its workers are forgotten (so late reports
/// of the old generation are refused) and a recovery record is opened for
/// the generation that will form, when one formed before (it tells which
/// step was loaded and from where). Its id, history, counters, recoveries and generation
/// number are kept: the next generation is numbered above every earlier
/// one, so workers load the newest checkpoint rather than start afresh.
/// **Decision:** a succeeded job is never resumed (its checkpoint is its
/// result), nor is a live one (it has not stopped).
pub fn resume(job: &mut Job, by: &str, now_ms: i64) -> Result<Transition, NotResumable> {
    let from = job.state();
    if !matches!(from, JobState::Failed | JobState::Cancelled) {
        return Err(NotResumable {
            job: job.id.clone(),
            state: from,
        });
    }
    let ended = match (from, job.error.as_str()) {
        (JobState::Failed, "") => "it failed".to_string(),
        (JobState::Failed, e) => format!("it failed: {e}"),
        _ => "it was cancelled".to_string(),
    };
    let committed = job.counters.as_ref().map_or(0, |c| c.step);
    let reason = format!("resumed by {by} at step {committed} after {ended}");
    let t =
        transition(job, JobState::Pending, reason.clone(), now_ms).map_err(|_| NotResumable {
            job: job.id.clone(),
            state: from,
        })?;
    job.error.clear();
    job.workers.clear();
    if job.generation > 0 {
        // It ran: its next generation goes on from its state (one that
        // never formed simply starts, as any pending job).
        push_recovery(
            job,
            accrue_proto::v1::Recovery {
                reason,
                started_unix_ms: now_ms,
                ..Default::default()
            },
        );
    }
    Ok(t)
}

/// What to do with a job that lost (or may gain) workers.
#[derive(Clone, Debug, PartialEq)]
pub enum Reform {
    /// Keep waiting for workers to attach.
    Wait,
    /// Re-form the ring with this many ranks now.
    Form(usize),
    /// Give up, for this reason.
    Fail(String),
}

/// The recovery decision (docs/OPERATIONS.md, "Recovery"), pure: `survivors` ranks still
/// hold the job's state, `free` idle workers could join. The job wants
/// `want` ranks and accepts down to `min`; after `timeout_ms` of waiting it
/// shrinks to what is there, or fails below `min`. `valid(n)` says whether
/// a world of n ranks can run the job (k must come out whole under
/// `global_batch`).
pub fn reform_decision(
    survivors: usize,
    free: usize,
    want: usize,
    min: usize,
    waited_ms: i64,
    timeout_ms: i64,
    valid: impl Fn(usize) -> bool,
) -> Reform {
    let available = survivors + free;
    let want = want.max(1);
    let min = min.clamp(1, want);
    if available >= want && valid(want) {
        return Reform::Form(want);
    }
    if waited_ms < timeout_ms {
        return Reform::Wait;
    }
    match (min..=available.min(want)).rev().find(|&n| valid(n)) {
        Some(n) => Reform::Form(n),
        None => Reform::Fail(format!(
            "{available} worker(s) available after waiting {:.1} s for a replacement; the job needs at least min_workers = {min}",
            timeout_ms as f64 / 1000.0
        )),
    }
}

/// Growth of a running elastic job: a new world size when idle workers can
/// take it toward `max` (None: stay).
pub fn grow_decision(
    world: usize,
    free: usize,
    max: usize,
    valid: impl Fn(usize) -> bool,
) -> Option<usize> {
    (world + 1..=max.min(world + free))
        .rev()
        .find(|&n| valid(n))
}

/// Ranks of a re-formed ring: survivors keep their old rank when it still
/// exists (so a replacement takes exactly the lost rank's place and its
/// share of the data); the empty places are filled first by the other
/// survivors whose place in a replica matches (`rank % replica`: a
/// pipeline stage and tensor rank, issue 40, so a survivor keeps the
/// stage whose state it holds), then by the remaining survivors in order,
/// then by newcomers. `old` is the previous generation's workers by rank,
/// `alive` says which are still there; `world` must not exceed the
/// survivors plus the newcomers; `replica` is the ranks of one model
/// replica (pipeline x tensor; 1 when the model is whole).
pub fn reform_ranks(
    old: &[String],
    alive: impl Fn(&str) -> bool,
    newcomers: &[String],
    world: usize,
    replica: usize,
) -> Vec<String> {
    let replica = replica.max(1);
    let mut slots: Vec<Option<String>> = vec![None; world];
    let mut displaced: Vec<Option<(usize, String)>> = Vec::new();
    for (rank, w) in old.iter().enumerate() {
        if !alive(w) {
            continue;
        }
        if rank < world {
            slots[rank] = Some(w.clone());
        } else {
            displaced.push(Some((rank, w.clone())));
        }
    }
    // A survivor into a hole at its own place in a replica.
    for (hole, s) in slots.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
        let same = displaced.iter_mut().find(|d| {
            d.as_ref()
                .is_some_and(|(r, _)| r % replica == hole % replica)
        });
        if let Some(d) = same {
            *s = d.take().map(|(_, w)| w);
        }
    }
    let mut fill = displaced
        .into_iter()
        .flatten()
        .map(|(_, w)| w)
        .chain(newcomers.iter().cloned());
    for s in slots.iter_mut().filter(|s| s.is_none()) {
        *s = fill.next();
    }
    slots.into_iter().flatten().collect()
}

/// A job waiting for workers.
#[derive(Clone, Debug, PartialEq)]
pub struct Waiting {
    pub job: String,
    pub world: usize,
}

/// Gang scheduling: jobs in submission order take `world` free workers each,
/// all or nothing. A job that the attached workers could hold (`world <=
/// capacity`) but the free ones cannot yet blocks the ones behind it (no
/// backfill, so a large job is never starved); a job larger than every
/// attached worker together waits aside, blocking nobody, until enough
/// workers attach. Returns (job, workers by rank).
pub fn gang_schedule(
    waiting: &[Waiting],
    free: &[String],
    capacity: usize,
) -> Vec<(String, Vec<String>)> {
    let mut free: Vec<String> = free.to_vec();
    free.sort();
    let mut out = Vec::new();
    for w in waiting {
        if w.world == 0 || w.world > capacity {
            continue;
        }
        if w.world > free.len() {
            break;
        }
        let taken: Vec<String> = free.drain(..w.world).collect();
        out.push((w.job.clone(), taken));
    }
    out
}

/// Workers whose last sign of life is older than `ttl_ms`.
pub fn expired(now_ms: i64, last_seen: &[(String, i64)], ttl_ms: i64) -> Vec<String> {
    last_seen
        .iter()
        .filter(|(_, t)| now_ms - t > ttl_ms)
        .map(|(id, _)| id.clone())
        .collect()
}

#[cfg(test)]
mod tests {

    /// A job resumed (or re-formed) again and again keeps the newest
    /// RECOVERIES_KEPT records and counts the rest; the open record, the
    /// newest, is among those kept.
    #[test]
    fn recoveries_keep_the_newest_and_count_the_rest() {
        let mut job = Job::default();
        for i in 0..250u64 {
            push_recovery(
                &mut job,
                accrue_proto::v1::Recovery {
                    generation: i + 1,
                    ..Default::default()
                },
            );
        }
        assert_eq!(job.recoveries.len(), RECOVERIES_KEPT);
        assert_eq!(job.recoveries_dropped, 250 - RECOVERIES_KEPT as u64);
        assert_eq!(job.recoveries.first().map(|r| r.generation), Some(151));
        assert_eq!(job.recoveries.last().map(|r| r.generation), Some(250));
        // The open record (generation 0) pushed last is kept.
        push_recovery(&mut job, accrue_proto::v1::Recovery::default());
        assert_eq!(job.recoveries.last().map(|r| r.generation), Some(0));
        assert_eq!(job.recoveries.len(), RECOVERIES_KEPT);
    }
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lifecycle_and_refusals() {
        let mut job = Job {
            id: "j".into(),
            ..Default::default()
        };
        transition(&mut job, JobState::Pending, "submitted", 1).unwrap();
        transition(&mut job, JobState::Rendezvous, "assigned", 2).unwrap();
        transition(&mut job, JobState::Running, "first step", 3).unwrap();
        transition(&mut job, JobState::Succeeded, "done", 4).unwrap();
        let err = transition(&mut job, JobState::Cancelled, "late", 5).unwrap_err();
        assert_eq!(
            err.to_string(),
            "job j cannot go from Succeeded to Cancelled"
        );
        assert_eq!(job.history.len(), 4);
        assert_eq!(job.history[2].reason, "first step");
        assert_eq!(job.history[3].at_unix_ms, 4);
    }

    #[test]
    fn a_resume_names_who_and_why_and_keeps_the_record() {
        let mut job = Job {
            id: "j-4".into(),
            owner: "alice".into(),
            generation: 2,
            workers: vec!["w0".into(), "w1".into()],
            counters: Some(accrue_proto::v1::Counters {
                step: 40,
                ..Default::default()
            }),
            ..Default::default()
        };
        transition(&mut job, JobState::Pending, "submitted", 1).unwrap();
        transition(&mut job, JobState::Rendezvous, "assigned", 2).unwrap();
        transition(&mut job, JobState::Running, "first step", 3).unwrap();
        job.error = "rank 1 on worker w1 failed: No space left on device".into();
        let why = job.error.clone();
        transition(&mut job, JobState::Failed, why, 4).unwrap();
        let t = resume(&mut job, "alice", 10).unwrap();
        assert_eq!(job.state(), JobState::Pending);
        assert_eq!(
            t.reason,
            "resumed by alice at step 40 after it failed: rank 1 on worker w1 failed: No space left on device"
        );
        assert_eq!((t.from, t.at_unix_ms), (JobState::Failed as i32, 10));
        assert_eq!(job.history.len(), 5, "the history is kept and extended");
        assert!(job.error.is_empty());
        assert!(
            job.workers.is_empty(),
            "the old generation's ranks are gone"
        );
        assert_eq!(job.generation, 2, "the next formation numbers it 3");
        let r = job.recoveries.last().unwrap();
        assert_eq!((r.started_unix_ms, r.generation), (10, 0));
        assert_eq!(r.reason, t.reason);
        // Not again while it is pending; never once it succeeded.
        let e = resume(&mut job, "alice", 11).unwrap_err();
        assert_eq!(
            e.to_string(),
            "job j-4 is pending; only a failed or cancelled job can be resumed"
        );
        let mut done = Job {
            id: "j-5".into(),
            ..Default::default()
        };
        done.set_state(JobState::Succeeded);
        let e = resume(&mut done, "bob", 1).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("job j-5 succeeded; nothing to resume"),
            "{e}"
        );
        let mut cancelled = Job {
            id: "j-6".into(),
            ..Default::default()
        };
        cancelled.set_state(JobState::Cancelled);
        let t = resume(&mut cancelled, "a client", 1).unwrap();
        assert_eq!(
            t.reason,
            "resumed by a client at step 0 after it was cancelled"
        );
        // It never formed: it simply starts (no recovery record).
        assert!(cancelled.recoveries.is_empty());
    }

    #[test]
    fn gang_waits_for_all_workers() {
        let free = vec!["w3".to_string(), "w1".into(), "w2".into()];
        let waiting = vec![
            Waiting {
                job: "a".into(),
                world: 2,
            },
            Waiting {
                job: "b".into(),
                world: 2,
            },
        ];
        let placed = gang_schedule(&waiting, &free, 3);
        assert_eq!(
            placed,
            vec![("a".to_string(), vec!["w1".to_string(), "w2".into()])]
        );
        let waiting = vec![
            Waiting {
                job: "big".into(),
                world: 4,
            },
            Waiting {
                job: "small".into(),
                world: 1,
            },
        ];
        // A job the attached workers could hold but the free ones cannot
        // yet blocks the queue (no backfill: it is never starved)...
        assert!(gang_schedule(&waiting, &free, 5).is_empty());
        // ...one larger than every attached worker blocks nobody.
        assert_eq!(
            gang_schedule(&waiting, &free, 3),
            vec![("small".to_string(), vec!["w1".to_string()])]
        );
    }

    #[test]
    fn expiry_uses_the_ttl() {
        let seen = vec![("a".to_string(), 1000), ("b".into(), 4000)];
        assert_eq!(expired(5000, &seen, 3000), vec!["a".to_string()]);
        assert!(expired(4000, &seen, 3000).is_empty());
    }

    proptest! {
        #[test]
        fn placements_never_share_a_worker(worlds in proptest::collection::vec(1usize..6, 0..6), n in 0usize..10, busy in 0usize..3) {
            let free: Vec<String> = (0..n).map(|i| format!("w{i:02}")).collect();
            let capacity = n + busy;
            let waiting: Vec<Waiting> = worlds.iter().enumerate().map(|(i, &w)| Waiting { job: format!("j{i}"), world: w }).collect();
            let placed = gang_schedule(&waiting, &free, capacity);
            let mut used: Vec<&String> = placed.iter().flat_map(|(_, ws)| ws).collect();
            let total = used.len();
            used.sort();
            used.dedup();
            prop_assert_eq!(used.len(), total);
            for (job, ws) in &placed {
                let w = waiting.iter().find(|x| &x.job == job).unwrap().world;
                prop_assert_eq!(ws.len(), w);
            }
            // Placed jobs are a prefix of the queue without the jobs no
            // attached set of workers could hold; those are never placed.
            let holdable: Vec<&Waiting> = waiting.iter().filter(|w| w.world <= capacity).collect();
            for (i, (job, _)) in placed.iter().enumerate() {
                prop_assert_eq!(job, &holdable[i].job);
            }
            // The first holdable job not placed did not fit in what was left.
            if let Some(next) = holdable.get(placed.len()) {
                prop_assert!(next.world > n - total);
            }
        }

        #[test]
        fn final_states_exit_only_by_a_resume(to in 0i32..8) {
            let to = JobState::try_from(to).unwrap();
            // A succeeded job has no exit; a failed or cancelled one only
            // back to Pending (a resume).
            prop_assert!(!allowed(JobState::Succeeded, to));
            for from in [JobState::Failed, JobState::Cancelled] {
                prop_assert_eq!(allowed(from, to), to == JobState::Pending);
            }
        }

        #[test]
        fn only_failed_and_cancelled_jobs_resume(from in 0i32..8, step in 0u64..100) {
            let from = JobState::try_from(from).unwrap();
            let mut job = Job { id: "j-1".into(), generation: 3, counters: Some(accrue_proto::v1::Counters { step, ..Default::default() }), ..Default::default() };
            job.set_state(from);
            let before = job.clone();
            match resume(&mut job, "alice", 7) {
                Ok(t) => {
                    prop_assert!(matches!(from, JobState::Failed | JobState::Cancelled));
                    prop_assert_eq!(job.state(), JobState::Pending);
                    prop_assert_eq!(t.from, from as i32);
                    prop_assert_eq!(job.generation, 3);
                    prop_assert_eq!(job.recoveries.len(), 1);
                    prop_assert_eq!(job.history.len(), 1);
                }
                Err(e) => {
                    prop_assert!(!matches!(from, JobState::Failed | JobState::Cancelled));
                    prop_assert_eq!(job, before);
                    prop_assert_eq!(e.state, from);
                }
            }
        }
    }

    #[test]
    fn reform_waits_then_shrinks_then_fails() {
        let any = |_: usize| true;
        assert_eq!(reform_decision(1, 1, 2, 1, 0, 5000, any), Reform::Form(2));
        assert_eq!(reform_decision(1, 0, 2, 1, 100, 5000, any), Reform::Wait);
        assert_eq!(
            reform_decision(1, 0, 2, 1, 5000, 5000, any),
            Reform::Form(1)
        );
        assert!(
            matches!(reform_decision(1, 0, 3, 2, 5000, 5000, any), Reform::Fail(m) if m.contains("min_workers = 2"))
        );
        // global_batch = 48, b = 8: W = 4 gives no whole k; shrink to 3.
        let whole = |n: usize| 48 % (n * 8) == 0;
        assert_eq!(
            reform_decision(4, 0, 5, 2, 9999, 10, whole),
            Reform::Form(3)
        );
        assert_eq!(grow_decision(2, 1, 3, any), Some(3));
        assert_eq!(grow_decision(3, 4, 3, any), None);
        assert_eq!(grow_decision(2, 2, 4, whole), Some(3));
    }

    #[test]
    fn replacement_takes_the_lost_rank() {
        let old: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let ranks = reform_ranks(&old, |w| w != "b", &["z".into()], 3, 1);
        assert_eq!(ranks, ["a", "z", "c"]);
        let shrunk = reform_ranks(&old, |w| w != "a", &[], 2, 1);
        assert_eq!(shrunk, ["c", "b"]);
    }

    /// Pipeline stages (issue 40): 2 data x 2 stages, ranks (data, stage)
    /// = (0,0) (0,1) (1,0) (1,1). A lost last stage of replica 0 is
    /// replaced in place; without a spare the job shrinks to one replica
    /// made of survivors that each keep their stage.
    #[test]
    fn survivors_keep_their_stage_when_a_pipeline_job_shrinks() {
        let old: Vec<String> = ["s0", "s1", "t0", "t1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let spare = reform_ranks(&old, |w| w != "s1", &["z".into()], 4, 2);
        assert_eq!(spare, ["s0", "z", "t0", "t1"]);
        let shrunk = reform_ranks(&old, |w| w != "s1", &[], 2, 2);
        assert_eq!(shrunk, ["s0", "t1"]);
        // Whole replicas only counted by place: t0 would have taken stage
        // 1 without the replica (its old rank 2 is stage 0).
        assert_eq!(reform_ranks(&old, |w| w != "s1", &[], 2, 1), ["s0", "t0"]);
        // Three stages, the middle one lost, shrinking is impossible: the
        // spare takes the middle.
        let three: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        assert_eq!(
            reform_ranks(&three, |w| w != "b", &["z".into()], 3, 3),
            ["a", "z", "c"]
        );
    }

    proptest! {
        #[test]
        fn reform_decision_is_sound(
            survivors in 0usize..6, free in 0usize..6, want in 1usize..6, min in 1usize..6,
            waited in 0i64..10_000, timeout in 0i64..10_000, step in 1usize..4,
        ) {
            let valid = |n: usize| n.is_multiple_of(step);
            match reform_decision(survivors, free, want, min, waited, timeout, valid) {
                Reform::Form(n) => {
                    prop_assert!(n <= survivors + free && n <= want && n >= min.min(want) && valid(n));
                    if n < want { prop_assert!(waited >= timeout); }
                }
                Reform::Wait => prop_assert!(waited < timeout),
                Reform::Fail(_) => prop_assert!(waited >= timeout),
            }
        }

        #[test]
        fn reform_ranks_keeps_everyone_once(
            alive_mask in proptest::collection::vec(any::<bool>(), 1..9),
            newcomers in 0usize..4, world in 1usize..10, replica in 1usize..4,
        ) {
            let old: Vec<String> = (0..alive_mask.len()).map(|i| format!("w{i}")).collect();
            let new: Vec<String> = (0..newcomers).map(|i| format!("n{i}")).collect();
            let alive = |w: &str| old.iter().position(|o| o == w).is_some_and(|i| alive_mask[i]);
            let survivors = alive_mask.iter().filter(|&&a| a).count();
            // The coordinator never asks for more ranks than it has workers.
            let world = world.min(survivors + newcomers).max(1);
            let ranks = reform_ranks(&old, alive, &new, world, replica);
            prop_assert_eq!(ranks.len(), world.min(survivors + newcomers));
            let mut seen = ranks.clone();
            seen.sort();
            seen.dedup();
            prop_assert_eq!(seen.len(), ranks.len());
            for (r, w) in ranks.iter().enumerate() {
                if let Some(i) = old.iter().position(|o| o == w) {
                    if i < world { prop_assert_eq!(i, r); }
                }
            }
            // Each place in a replica holds as many survivors of that
            // place as it can: min(its slots, its survivors).
            if ranks.len() == world {
                for p in 0..replica {
                    let slots = (0..world).filter(|r| r % replica == p).count();
                    let theirs = (0..alive_mask.len()).filter(|&i| alive_mask[i] && i % replica == p).count();
                    let kept = ranks.iter().enumerate().filter(|(r, w)| {
                        r % replica == p
                            && old.iter().position(|o| o == *w).is_some_and(|i| i % replica == p)
                    }).count();
                    prop_assert_eq!(kept, slots.min(theirs), "place {}: {:?}", p, &ranks);
                }
            }
        }
    }
}
