//! Losing, replacing and adding workers: a recovery waits for the
//! survivors, counts the steps a rollback redoes, refuses stale members
//! and their reports (issue 12's defects), a detach, and elastic shrink,
//! grow and the stall limit.

use super::tests::*;
use super::*;

/// A recovery re-forms once every survivor confirmed, or after the
/// grace (a survivor that never answers cannot stall it).
#[test]
fn a_recovery_waits_for_the_survivors_to_leave_the_broken_ring() {
    let mut c = cluster();
    for (i, w) in ["w0", "w1", "w2", "w3"].iter().enumerate() {
        attach(&mut c, w, i as u64 + 1, 0);
    }
    let job = submit(&mut c, spec("j", 3, ""), 0);
    // Rank 1 saw rank 2 vanish, before the coordinator did.
    deliver(&mut c, "w1", interrupted(&job, 1, 1), 10);
    assert_eq!(c.job(&job).unwrap().state(), JobState::Recovering);
    assert_eq!(
        c.job(&job).unwrap().generation,
        1,
        "w0 and w2 have not confirmed"
    );
    lose(&mut c, "w2", None, 20);
    assert_eq!(c.job(&job).unwrap().generation, 1, "w0 has not confirmed");
    deliver(&mut c, "w0", interrupted(&job, 1, 0), 30);
    let j = c.job(&job).unwrap();
    assert_eq!(
        (j.generation, j.recoveries.len()),
        (2, 1),
        "one recovery, without the dead w2"
    );
    assert!(!j.workers.contains(&"w2".to_string()));
    assert_eq!(j.workers, ["w0", "w1", "w3"]);
    // A survivor that never confirms holds it only for the grace.
    deliver(&mut c, "w0", step_report(&job, 2, 0, 1), 40);
    lose(&mut c, "w3", None, 50);
    attach(&mut c, "w4", 9, 60);
    deliver(&mut c, "w0", interrupted(&job, 2, 0), 70);
    c.step(Input::Tick, 50 + ACK_GRACE_MS - 1);
    assert_eq!(c.job(&job).unwrap().generation, 2, "w1 has not confirmed");
    c.step(Input::Tick, 50 + ACK_GRACE_MS);
    let j = c.job(&job).unwrap();
    assert_eq!(
        (j.generation, j.workers.clone()),
        (3, vec!["w0".to_string(), "w1".into(), "w4".into()])
    );
}

/// The recovery record counts the reported steps a new generation does
/// again: none when it goes on from the survivors' last step, the steps
/// since the checkpoint when it rolled back (a sharded job's lost shard).
#[test]
fn a_recovery_record_counts_the_steps_a_rollback_does_again() {
    for (first, resumed, redone) in [(6, 5, 0), (3, 2, 3)] {
        let mut c = cluster();
        for (i, w) in ["w0", "w1", "w2"].iter().enumerate() {
            attach(&mut c, w, i as u64 + 1, 0);
        }
        let job = submit(&mut c, spec("j", 2, ""), 0);
        for step in 1..=5 {
            deliver(
                &mut c,
                "w0",
                step_report(&job, 1, 0, step),
                10 + step as i64,
            );
        }
        lose(&mut c, "w1", Some(2), 20);
        deliver(&mut c, "w0", interrupted(&job, 1, 0), 25);
        assert_eq!(c.job(&job).unwrap().generation, 2);
        deliver(&mut c, "w0", step_report(&job, 2, 0, first), 30);
        let j = c.job(&job).unwrap();
        assert_eq!(j.state(), JobState::Running);
        let r = &j.recoveries[0];
        assert_eq!((r.resumed_step, r.redone_steps), (resumed, redone), "{r:?}");
    }
}

/// fp16's loss scale (issue 18) rides in rank 0's step reports into the
/// job's counters (the status page, /metrics).
#[test]
fn the_loss_scale_of_rank_0_reaches_the_counters() {
    let mut c = cluster();
    for (i, w) in ["w0", "w1"].iter().enumerate() {
        attach(&mut c, w, i as u64 + 1, 0);
    }
    let job = submit(&mut c, spec("j", 2, ""), 0);
    let report = |rank: u32, loss_scale: f64| {
        m(worker_message::Msg::Step(StepReport {
            job_id: job.clone(),
            generation: 1,
            rank,
            step: 1,
            total_steps: 6,
            loss_scale,
            ..Default::default()
        }))
    };
    deliver(&mut c, "w0", report(0, 1024.0), 10);
    deliver(&mut c, "w1", report(1, 7.0), 11);
    let cnt = c.job(&job).unwrap().counters.unwrap();
    assert_eq!(cnt.loss_scale, 1024.0);
}

/// w0, w1 run job (generation 1); w1's stream breaks, w2 replaces it
/// (generation 2). Returns the job id.
fn replaced(c: &mut Cluster) -> String {
    for (i, w) in ["w0", "w1", "w2"].iter().enumerate() {
        attach(c, w, i as u64 + 1, 0);
    }
    let job = submit(c, spec("j", 2, ""), 0);
    assert_eq!(c.job(&job).unwrap().workers, ["w0", "w1"]);
    deliver(c, "w0", step_report(&job, 1, 0, 1), 10);
    c.step(
        Input::Lost {
            worker: "w1".into(),
            conn: Some(2),
            reason: "stream error: h2".into(),
        },
        20,
    );
    // Not before the survivor confirmed it left the broken ring.
    assert_eq!(c.job(&job).unwrap().generation, 1);
    deliver(c, "w0", interrupted(&job, 1, 0), 25);
    let j = c.job(&job).unwrap();
    assert_eq!(
        (j.generation, j.workers.clone()),
        (2, vec!["w0".to_string(), "w2".into()])
    );
    job
}

/// The job of [`replaced`] after its step 2, and `w` attaching on a new
/// connection (9) at t = 40 as rank 1 of `generation`: the cluster, the
/// job and the attach's effects.
fn reattach(w: &str, generation: u64) -> (Cluster, String, Vec<Effect>) {
    let mut c = cluster();
    let job = replaced(&mut c);
    deliver(&mut c, "w0", step_report(&job, 2, 0, 2), 30);
    let fx = c.step(
        Input::Attach {
            conn: 9,
            hello: v1::WorkerHello {
                job_id: job.clone(),
                generation,
                rank: 1,
                ..hello(w)
            },
        },
        40,
    );
    (c, job, fx)
}

/// Defect 1: a worker whose stream blipped re-attaches naming a job it
/// is no longer a member of. It must not abort the healthy generation,
/// must be told to stop, and must be free once it has.
#[test]
fn a_stale_member_reattaching_is_stopped_and_freed_without_a_recovery() {
    let (mut c, job, fx) = reattach("w1", 1);
    let j = c.job(&job).unwrap();
    assert_eq!(
        j.state(),
        JobState::Running,
        "the healthy generation goes on"
    );
    assert_eq!(j.generation, 2);
    assert_eq!(aborts(&fx), 0, "no rank of generation 2 is aborted");
    let to_w1 = sends(&fx);
    assert!(
        matches!(&to_w1[..], [(w, coordinator_message::Msg::Stop(s))] if w == "w1" && s.job_id == job && s.reason.contains("not a member")),
        "{to_w1:?}"
    );
    assert!(
        !c.worker("w1").unwrap().free(),
        "busy until its thread ended"
    );
    // Its thread ends: the JobDone of a non-member frees it and changes
    // nothing else.
    let fx = deliver(&mut c, "w1", done(&job, 1, 1, true), 50);
    assert!(c.worker("w1").unwrap().free());
    assert_eq!(c.job(&job).unwrap().state(), JobState::Running);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Save(_))));
    // And it can take the next job.
    let next = submit(&mut c, spec("k", 1, ""), 60);
    assert_eq!(c.job(&next).unwrap().workers, ["w1"]);
}

/// Defect 1, other half: a failed JobDone or a step report from the
/// stale member must not touch the job.
#[test]
fn reports_from_outside_the_current_generation_are_refused() {
    let mut c = cluster();
    let job = replaced(&mut c);
    attach(&mut c, "w1", 9, 30);
    // w1 claims rank 1 of generation 2 (w2's place).
    let fx = deliver(&mut c, "w1", step_report(&job, 2, 0, 5), 40);
    assert!(
        matches!(&sends(&fx)[..], [(_, coordinator_message::Msg::Refused(r))] if r.reason.contains("not rank 0"))
    );
    assert_eq!(c.job(&job).unwrap().counters.unwrap().step, 1);
    let fx = deliver(&mut c, "w1", done(&job, 2, 1, false), 50);
    assert!(matches!(
        &sends(&fx)[..],
        [(_, coordinator_message::Msg::Refused(_))]
    ));
    assert!(!state::is_final(c.job(&job).unwrap().state()));
    // The real rank 1 may.
    deliver(&mut c, "w2", done(&job, 2, 1, false), 60);
    assert_eq!(c.job(&job).unwrap().state(), JobState::Failed);
}

#[test]
fn a_member_reattaching_in_place_keeps_its_generation() {
    let (c, job, fx) = reattach("w2", 2);
    assert_eq!(aborts(&fx), 0);
    // The old connection is closed, the new one serves.
    assert!(fx.contains(&Effect::Close {
        worker: "w2".into(),
        conn: 3
    }));
    assert_eq!(conn_of(&c, "w2"), 9);
    assert_eq!(c.job(&job).unwrap().generation, 2);
    assert!(c.worker("w2").unwrap().serves(&job));
}

/// Defect 7: a planned exit is not a loss (no warning), but a job the
/// worker served still re-forms without it.
#[test]
fn a_detach_frees_the_worker_and_closes_its_stream() {
    let mut c = cluster();
    attach(&mut c, "w0", 1, 0);
    let fx = deliver(
        &mut c,
        "w0",
        m(worker_message::Msg::Detach(v1::Detach {
            reason: "SIGTERM".into(),
        })),
        5,
    );
    assert!(c.worker("w0").is_none());
    assert_eq!(
        fx,
        vec![Effect::Close {
            worker: "w0".into(),
            conn: 1
        }]
    );
    let job = replaced(&mut c);
    deliver(
        &mut c,
        "w2",
        m(worker_message::Msg::Detach(v1::Detach {
            reason: "SIGTERM".into(),
        })),
        30,
    );
    let j = c.job(&job).unwrap();
    assert_eq!(j.state(), JobState::Recovering);
    assert!(j.recoveries.last().unwrap().reason.contains("detached"));
}

fn assigned_k(fx: &[Effect]) -> Vec<(String, u32)> {
    sends(fx)
        .into_iter()
        .filter_map(|(w, m)| match m {
            coordinator_message::Msg::Assign(a) => Some((w, a.accumulation_steps)),
            _ => None,
        })
        .collect()
}

/// Shrink: no replacement within the rendezvous timeout, min_workers
/// allows fewer ranks, and k follows global_batch.
#[test]
fn a_job_shrinks_after_the_rendezvous_timeout_with_k_recomputed() {
    let mut c = cluster();
    attach_all(&mut c, &["w0", "w1", "w2"], 0);
    let job = submit(
        &mut c,
        spec("s", 3, "min_workers = 1\n[accumulation]\nglobal_batch = 24"),
        0,
    );
    assert_eq!(c.job(&job).unwrap().accumulation_steps, 2);
    deliver(&mut c, "w0", step_report(&job, 1, 0, 1), 10);
    lose(&mut c, "w2", None, 20);
    deliver(&mut c, "w0", interrupted(&job, 1, 0), 30);
    deliver(&mut c, "w1", interrupted(&job, 1, 1), 30);
    assert_eq!(
        c.job(&job).unwrap().generation,
        1,
        "waits for a replacement"
    );
    c.step(Input::Tick, 20 + 29_999);
    assert_eq!(c.job(&job).unwrap().generation, 1);
    let fx = c.step(Input::Tick, 20 + 30_000);
    let j = c.job(&job).unwrap();
    assert_eq!(
        (j.generation, j.workers.clone(), j.accumulation_steps),
        (2, vec!["w0".to_string(), "w1".into()], 3)
    );
    assert_eq!(assigned_k(&fx), [("w0".to_string(), 3), ("w1".into(), 3)]);
    let r = j.recoveries.last().unwrap();
    assert_eq!(
        (r.world_size, r.accumulation_steps, r.lost.clone()),
        (2, 3, vec!["w2".to_string()])
    );
}

/// Grow: an elastic job takes a worker that attaches, at once.
#[test]
fn an_elastic_job_grows_when_a_worker_attaches() {
    let mut c = cluster();
    attach_all(&mut c, &["w0", "w1"], 0);
    let job = submit(&mut c, spec("g", 2, "max_workers = 3"), 0);
    deliver(&mut c, "w0", step_report(&job, 1, 0, 1), 10);
    let fx = attach(&mut c, "w2", 9, 20);
    let j = c.job(&job).unwrap();
    assert_eq!((j.generation, j.workers.len()), (2, 3));
    assert_eq!(j.state(), JobState::Rendezvous);
    assert_eq!(assigned_k(&fx).len(), 3, "every rank of the new generation");
    assert_eq!(j.recoveries.last().unwrap().reason, "growing: w2 joined");
}

/// Stall: a job that keeps re-forming without committing a step fails.
#[test]
fn a_job_that_keeps_re_forming_without_a_step_fails() {
    let mut c = cluster();
    let ids = ["w0", "w1", "w2", "w3", "w4", "w5", "w6"];
    attach_all(&mut c, &ids, 0);
    let job = submit(&mut c, spec("st", 1, ""), 0);
    for t in 1..=MAX_STALLED_REFORMS as i64 + 1 {
        let member = c.job(&job).unwrap().workers[0].clone();
        lose(&mut c, &member, None, t * 100);
    }
    let j = c.job(&job).unwrap();
    assert_eq!(j.state(), JobState::Failed, "{:?}", j.history);
    assert!(
        j.error
            .contains("5 re-formations in a row without a committed step"),
        "{}",
        j.error
    );
    assert_eq!(j.generation, 1 + MAX_STALLED_REFORMS as u64);
}

/// A stalled job's failure names what the ring last broke on (the ranks'
/// error), not only the count: the cause was in the recovery records only.
#[test]
fn a_stalled_job_fails_naming_the_last_cause() {
    let mut c = cluster();
    attach_all(&mut c, &["w0", "w1"], 0);
    let job = submit(&mut c, spec("sc", 2, ""), 0);
    for g in 1..=MAX_STALLED_REFORMS as u64 + 1 {
        assert_eq!(c.job(&job).unwrap().generation, g);
        for (rank, w) in ["w0", "w1"].iter().enumerate() {
            let error = format!(
                "Gloo connectFullMesh failed: rank {rank} timed out after 3 ms (generation {g})"
            );
            let i = m(worker_message::Msg::Interrupted(v1::Interrupted {
                job_id: job.clone(),
                generation: g,
                rank: rank as u32,
                error,
                ..Default::default()
            }));
            deliver(&mut c, w, i, g as i64 * 100 + rank as i64);
        }
    }
    let j = c.job(&job).unwrap();
    assert_eq!(j.state(), JobState::Failed, "{:?}", j.history);
    assert!(
        j.error
            .contains("5 re-formations in a row without a committed step")
            && j.error.contains(
                "rank 0 on worker w0 interrupted at step 0: Gloo connectFullMesh failed: \
                 rank 0 timed out after 3 ms (generation 6)"
            ),
        "{}",
        j.error
    );
    // A cause as long as the reason allows is clipped, the count kept.
    let mut c = cluster();
    attach_all(&mut c, &["w0"], 0);
    let job = submit(&mut c, spec("long", 1, ""), 0);
    for g in 1..=MAX_STALLED_REFORMS as u64 + 1 {
        let i = m(worker_message::Msg::Interrupted(v1::Interrupted {
            job_id: job.clone(),
            generation: g,
            error: "x".repeat(2 * MAX_REASON_BYTES),
            ..Default::default()
        }));
        deliver(&mut c, "w0", i, g as i64 * 100);
    }
    let j = c.job(&job).unwrap();
    assert_eq!(j.state(), JobState::Failed, "{:?}", j.history);
    assert!(
        j.error.starts_with("5 re-formations in a row"),
        "{}",
        &j.error[..80]
    );
    assert!(j.error.len() <= MAX_REASON_BYTES, "{}", j.error.len());
}
