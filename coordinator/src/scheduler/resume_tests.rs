//! Resuming a failed or cancelled job under its id (issue 27), and the
//! checkpoint folders a submission may not take (another job's, the
//! reserved default folders).

use super::tests::*;
use super::*;

fn resumed_from(job: &str, generation: u64, step: u64, from: &str) -> WorkerMessage {
    m(worker_message::Msg::Step(StepReport {
        job_id: job.into(),
        generation,
        rank: 0,
        step,
        total_steps: 6,
        resumed_from: from.into(),
        ..Default::default()
    }))
}

/// Issue 27: a cancelled job is resumed under its id: pending until its
/// record is durable, then gang scheduled as a new generation whose
/// assignment says to load the newest checkpoint (generation > 1,
/// resume_step = the committed step); the old ranks' late reports are
/// refused and cannot fail it; the recovery record says what was loaded.
#[test]
fn a_cancelled_job_resumes_under_its_id_as_a_new_generation() {
    let mut c = cluster();
    attach_all(&mut c, &["w0", "w1"], 0);
    let job = submit(&mut c, spec("j", 2, ""), 0);
    for step in 1..=4 {
        deliver(
            &mut c,
            "w0",
            step_report(&job, 1, 0, step),
            10 + step as i64,
        );
    }
    reply(&c.step(
        Input::Cancel {
            job: job.clone(),
            by: Caller::Anyone,
        },
        20,
    ))
    .unwrap();
    // w0 confirmed its stop; w1 has not yet.
    deliver(&mut c, "w0", done(&job, 1, 0, false), 21);
    let alice = Caller::Principal {
        name: "alice".into(),
        admin: true,
    };
    let fx = c.step(
        Input::Resume {
            job: job.clone(),
            by: alice,
        },
        30,
    );
    let j = reply(&fx).unwrap();
    assert_eq!(
        (j.id.as_str(), j.state()),
        (job.as_str(), JobState::Pending)
    );
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::Save(s) if s.state() == JobState::Pending)));
    let t = j.history.last().unwrap();
    assert_eq!(t.from, JobState::Cancelled as i32);
    assert_eq!(
        t.reason,
        "resumed by alice (admin) at step 4 after it was cancelled"
    );
    // w1, still stopping, is told again and is no member any more.
    assert!(sends(&fx)
        .iter()
        .any(|(w, m)| w == "w1" && matches!(m, coordinator_message::Msg::Stop(_))));
    assert!(
        assigned_keys(&fx).is_empty(),
        "not before its record is durable"
    );
    // Admitted: only w0 is free, so it waits (gang).
    let fx = c.step(Input::Admit { job: job.clone() }, 31);
    assert!(assigned_keys(&fx).is_empty());
    // w1's late JobDone of generation 1 frees it and does not fail the job.
    let fx = deliver(&mut c, "w1", done(&job, 1, 1, false), 32);
    let a: Vec<v1::Assignment> = sends(&fx)
        .into_iter()
        .filter_map(|(_, m)| match m {
            coordinator_message::Msg::Assign(a) => Some(a),
            _ => None,
        })
        .collect();
    assert_eq!(a.len(), 2, "{fx:?}");
    assert!(
        a.iter().all(|a| a.generation == 2 && a.resume_step == 4),
        "{a:?}"
    );
    assert_eq!(a[0].checkpoint_dir, "/state/checkpoints/j-1");
    let j = c.job(&job).unwrap();
    assert_eq!((j.state(), j.generation), (JobState::Rendezvous, 2));
    assert!(j.error.is_empty());
    // A stale report of generation 1 is refused.
    let fx = deliver(&mut c, "w0", step_report(&job, 1, 0, 9), 33);
    assert!(sends(&fx)
        .iter()
        .any(|(_, m)| matches!(m, coordinator_message::Msg::Refused(_))));
    // Rank 0's first report says what it loaded; the record keeps it.
    let fx = deliver(
        &mut c,
        "w0",
        resumed_from(&job, 2, 3, "checkpoint step-2 (LATEST)"),
        40,
    );
    let j = c.job(&job).unwrap();
    assert_eq!(j.state(), JobState::Running);
    let r = j.recoveries.last().unwrap();
    assert_eq!(r.generation, 2);
    assert_eq!(r.loaded, "checkpoint step-2 (LATEST)");
    assert_eq!((r.resumed_step, r.redone_steps), (2, 2), "{r:?}");
    assert!(r.reason.starts_with("resumed by alice"), "{r:?}");
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Save(s) if s.recoveries.last().is_some_and(|r| !r.loaded.is_empty()))),
        "the record is written at once"
    );
    // Later reports say nothing more and change nothing.
    deliver(&mut c, "w0", resumed_from(&job, 2, 4, ""), 41);
    assert_eq!(
        c.job(&job).unwrap().recoveries.last().unwrap().loaded,
        "checkpoint step-2 (LATEST)"
    );
    deliver(&mut c, "w1", done(&job, 2, 1, true), 50);
    deliver(&mut c, "w0", done(&job, 2, 0, true), 51);
    let j = c.job(&job).unwrap();
    assert_eq!(j.state(), JobState::Succeeded);
    let states: Vec<i32> = j.history.iter().map(|t| t.to).collect();
    use JobState::*;
    assert_eq!(
        states,
        [Pending, Rendezvous, Running, Cancelled, Pending, Rendezvous, Running, Succeeded]
            .map(|s| s as i32)
    );
}

/// Who may resume what, and which jobs cannot be: the cancel rule for
/// ownership; a succeeded or live job is FAILED_PRECONDITION naming its
/// state; an unknown one NOT_FOUND. Nothing changes on a refusal.
#[test]
fn resume_refusals_name_the_reason_and_change_nothing() {
    let mut c = cluster();
    attach_all(&mut c, &["w0"], 0);
    let resume = |c: &mut Cluster, id: &str, by: Caller| {
        reply(&c.step(Input::Resume { job: id.into(), by }, 5))
    };
    let e = resume(&mut c, "nope-3", Caller::Anyone).unwrap_err();
    assert_eq!(e.grpc_code(), tonic::Code::NotFound);
    let fx = step_submit(&mut c, spec("a", 1, ""), "alice".into(), 0);
    let id = reply(&fx).unwrap().id;
    c.step(Input::Admit { job: id.clone() }, 0);
    let e = resume(&mut c, &id, Caller::Anyone).unwrap_err();
    assert_eq!(e.grpc_code(), tonic::Code::FailedPrecondition);
    assert_eq!(
        e.to_string(),
        format!("job {id} is rendezvous; only a failed or cancelled job can be resumed")
    );
    deliver(&mut c, "w0", done(&id, 1, 0, true), 2);
    let before = c.job(&id).unwrap().clone();
    assert_eq!(before.state(), JobState::Succeeded);
    let e = resume(&mut c, &id, Caller::Anyone).unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("job {id} succeeded; nothing to resume")),
        "{e}"
    );
    assert_eq!(c.job(&id).unwrap(), &before);
    // Failed: not bob's, alice's (and admin's).
    let id = submit(&mut c, spec("b", 1, ""), 3);
    let fx = step_submit(&mut c, spec("c", 1, ""), "alice".into(), 3);
    let alices = reply(&fx).unwrap().id;
    c.step(
        Input::Cancel {
            job: id.clone(),
            by: Caller::Anyone,
        },
        4,
    );
    c.step(
        Input::Cancel {
            job: alices.clone(),
            by: Caller::Anyone,
        },
        4,
    );
    let bob = Caller::Principal {
        name: "bob".into(),
        admin: false,
    };
    let e = resume(&mut c, &alices, bob.clone()).unwrap_err();
    assert_eq!(e.grpc_code(), tonic::Code::PermissionDenied);
    assert_eq!(
        e.to_string(),
        format!("bob may not resume job {alices}: it is owned by alice; a principal resumes only its own jobs, the admin scope any")
    );
    assert_eq!(c.job(&alices).unwrap().state(), JobState::Cancelled);
    let alice = Caller::Principal {
        name: "alice".into(),
        admin: false,
    };
    assert_eq!(
        resume(&mut c, &alices, alice).unwrap().state(),
        JobState::Pending
    );
    // An ownerless job: admin, or anyone with authentication off.
    assert!(resume(&mut c, &id, bob).is_err());
    assert!(resume(&mut c, &id, Caller::Anyone).is_ok());
}

/// A resume whose record could not be made durable is taken back: the
/// job is as it was (its state, history and error), at a newer version,
/// and watchers see it ended again.
#[test]
fn a_resume_taken_back_leaves_the_job_as_it_was() {
    let mut c = cluster();
    let id = submit(&mut c, spec("a", 1, ""), 0);
    c.step(
        Input::Cancel {
            job: id.clone(),
            by: Caller::Anyone,
        },
        1,
    );
    let before = c.job(&id).unwrap().clone();
    reply(&c.step(
        Input::Resume {
            job: id.clone(),
            by: Caller::Anyone,
        },
        2,
    ))
    .unwrap();
    let fx = c.step(Input::Withdraw { job: id.clone() }, 3);
    let j = c.job(&id).unwrap();
    assert_eq!(j.state(), JobState::Cancelled);
    assert_eq!(j.history, before.history);
    assert!(j.version > before.version + 1, "newer than the resumed one");
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::Save(s) if s.state() == JobState::Cancelled)));
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::Delete(_))),
        "never removed"
    );
    assert!(fx.iter().any(|e| matches!(e, Effect::Event(ev) if ev.job.as_ref().is_some_and(|j| j.state() == JobState::Cancelled))));
    // It can be resumed again later.
    assert!(reply(&c.step(
        Input::Resume {
            job: id.clone(),
            by: Caller::Anyone,
        },
        4,
    ))
    .is_ok());
}

/// One owner per checkpoint folder, at submit: a folder of a known job
/// (any state), inside or around one, or under the default-folder root is
/// refused with FAILED_PRECONDITION naming checkpoint.dir, the folder and
/// the owner; nothing is recorded and no job id is used up.
#[test]
fn a_checkpoint_folder_of_another_job_is_refused_at_submit() {
    let mut c = cluster();
    let with_dir = |name: &str, dir: &str| spec(name, 1, &format!("[checkpoint]\ndir = {dir:?}"));
    let a = submit(&mut c, with_dir("a", "/ck/shared"), 0);
    c.step(
        Input::Cancel {
            job: a.clone(),
            by: Caller::Anyone,
        },
        1,
    );
    let refused = |c: &mut Cluster, s: v1::JobSpec| {
        let fx = step_submit(c, s, String::new(), 2);
        assert!(!fx.iter().any(|e| matches!(e, Effect::Save(_))), "{fx:?}");
        reply(&fx).unwrap_err()
    };
    for dir in [
        "/ck/shared",
        // A path with `.` and `..` that normalizes to /ck/shared (a test
        // input, not a reference to a document).
        "/ck/./x/../shared/",
        "/ck/shared/inner",
        "/ck",
    ] {
        let e = refused(&mut c, with_dir("b", dir));
        assert_eq!(e.grpc_code(), tonic::Code::FailedPrecondition, "{dir}");
        let text = e.to_string();
        assert!(
            text.starts_with("checkpoint.dir /ck")
                && text.contains(&format!("the checkpoint folder of job {a} (cancelled)"))
                && text.contains(&format!("`accrue resume {a}`")),
            "{dir}: {text}"
        );
    }
    // A future job's default folder, or the default root itself.
    for dir in [
        "/state/checkpoints/b-2",
        "/state/checkpoints",
        "/state",
        "checkpoints/../../state/checkpoints/x",
    ] {
        let e = refused(&mut c, with_dir("b", dir));
        assert!(
            e.to_string()
                .contains("reserved for the default checkpoint folders"),
            "{dir}: {e}"
        );
    }
    // A relative folder is judged from the coordinator's folder (/work).
    let b = submit(&mut c, with_dir("b", "runs/b"), 3);
    assert_eq!(b, "b-2", "refusals used up no id");
    let e = refused(&mut c, with_dir("c", "/work/runs/b"));
    assert!(e.to_string().contains(&format!("job {b} (pending)")), "{e}");
    // Apart: accepted; default folders of new ids too.
    submit(&mut c, with_dir("c", "/ck/shared2"), 4);
    submit(&mut c, spec("d", 1, ""), 4);
    submit(&mut c, spec("d", 1, ""), 4);
}

/// The step event of `job` among `fx`.
fn step_event(fx: &[Effect]) -> Option<&JobEvent> {
    fx.iter().find_map(|e| match e {
        Effect::Event(ev) if matches!(ev.event, Some(v1::job_event::Event::Step(_))) => {
            Some(ev.as_ref())
        }
        _ => None,
    })
}

/// The job a step event carries encodes to less than this, whatever the
/// job's history, recoveries or spec (domain::step_view: its id, state and
/// numbers).
const STEP_JOB_BOUND: usize = 512;

/// An owner's cancel/resume loop: the history keeps the newest
/// HISTORY_KEPT transitions and counts the ones it dropped, and a step
/// event's size does not grow with the history (it carries the step and
/// the job's numbers, not the job).
#[test]
fn a_cancel_resume_loop_keeps_the_history_bounded_and_step_events_small() {
    use prost::Message;
    // A step event of a job fresh from its submission, for comparison.
    let mut fresh = cluster();
    let f = submit(&mut fresh, spec("j", 1, ""), 0);
    attach_all(&mut fresh, &["w0"], 1);
    let gen = fresh.job(&f).unwrap().generation;
    let fx = deliver(&mut fresh, "w0", step_report(&f, gen, 0, 1), 2);
    let small = step_event(&fx).expect("a step event").encoded_len();

    let mut c = cluster();
    let job = submit(&mut c, spec("j", 1, ""), 0);
    let loops = 2_500i64;
    for i in 0..loops {
        let now = 10 + 2 * i;
        let cancel = Input::Cancel {
            job: job.clone(),
            by: Caller::Anyone,
        };
        reply(&c.step(cancel, now)).unwrap();
        let resume = Input::Resume {
            job: job.clone(),
            by: Caller::Anyone,
        };
        reply(&c.step(resume, now + 1)).unwrap();
        c.step(Input::Admit { job: job.clone() }, now + 1);
    }
    let j = c.job(&job).unwrap().clone();
    assert_eq!(j.history.len(), state::HISTORY_KEPT);
    // Submitted, then a cancel and a resume per loop.
    let made = 1 + 2 * loops as u64;
    assert_eq!(j.history_dropped + j.history.len() as u64, made);
    let newest = j.history.last().unwrap();
    assert_eq!(
        (newest.to, newest.at_unix_ms),
        (JobState::Pending as i32, 10 + 2 * (loops - 1) + 1),
        "the newest are kept"
    );
    // Its step events weigh what a fresh job's do.
    attach_all(&mut c, &["w0"], 20_000);
    let gen = c.job(&job).unwrap().generation;
    let fx = deliver(&mut c, "w0", step_report(&job, gen, 0, 1), 20_001);
    let ev = step_event(&fx).expect("a step event");
    let carried = ev.job.as_ref().unwrap();
    assert!(
        carried.history.is_empty() && carried.spec.is_none(),
        "{carried:?}"
    );
    assert_eq!(carried.counters.unwrap().step, 1);
    assert!(
        carried.encoded_len() < STEP_JOB_BOUND,
        "{} bytes",
        carried.encoded_len()
    );
    // A few bytes more at most: larger version and timestamps as varints.
    assert!(
        ev.encoded_len() <= small + 8,
        "{} bytes after {made} transitions, {small} bytes fresh",
        ev.encoded_len()
    );
    // The whole job the watchers keep is bounded too.
    assert!(j.encoded_len() < 64 * 1024, "{} bytes", j.encoded_len());
}
