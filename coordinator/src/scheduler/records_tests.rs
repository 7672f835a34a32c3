//! What a job's record keeps (issue 28): no re-formation record for a
//! recovery that never re-formed, each lost worker once, one warning per
//! refused generation, clipped worker texts, creation order after a
//! restore.

use super::tests::*;
use super::*;

/// Issue 28: a recovery that never re-forms leaves no record once the job
/// has ended (no `generation 0 ... W = 0, k = 0`); why it ended stays in
/// the history and the error.
#[test]
fn a_failed_recovery_leaves_no_record_of_a_re_formation() {
    let mut c = cluster();
    attach_all(&mut c, &["w0", "w1"], 0);
    let job = submit(&mut c, spec("j", 2, ""), 0);
    deliver(&mut c, "w0", step_report(&job, 1, 0, 1), 10);
    lose(&mut c, "w1", None, 20);
    let open = c.job(&job).unwrap().recoveries.clone();
    assert_eq!(open.len(), 1, "open while it waits");
    assert_eq!(
        (open[0].generation, open[0].lost.clone()),
        (0, vec!["w1".to_string()])
    );
    // No replacement within the rendezvous timeout (30 s), W = 2 = min.
    deliver(&mut c, "w0", interrupted(&job, 1, 0), 30);
    c.step(Input::Tick, 20 + 30_001);
    let j = c.job(&job).unwrap();
    assert_eq!(j.state(), JobState::Failed, "{:?}", j.history);
    assert!(j.recoveries.is_empty(), "{:?}", j.recoveries);
    assert!(
        j.error.contains("recovering from: lost worker w1"),
        "{}",
        j.error
    );
    assert!(j
        .history
        .iter()
        .any(|t| t.to == JobState::Recovering as i32 && t.reason.contains("lost worker w1")));
    // A cancel while re-forming: the same.
    let mut c = cluster();
    attach_all(&mut c, &["w0", "w1"], 0);
    let job = submit(&mut c, spec("j", 2, ""), 0);
    lose(&mut c, "w1", None, 20);
    c.step(
        Input::Cancel {
            job: job.clone(),
            by: Caller::Anyone,
        },
        30,
    );
    let j = c.job(&job).unwrap();
    assert_eq!(j.state(), JobState::Cancelled);
    assert!(j.recoveries.is_empty(), "{:?}", j.recoveries);
}

/// Issue 28: a worker lost, back and lost again before the ring re-forms
/// is named once among the lost.
#[test]
fn a_worker_lost_twice_is_recorded_once() {
    let mut c = cluster();
    attach_all(&mut c, &["w0", "w1"], 0);
    let job = submit(&mut c, spec("j", 2, ""), 0);
    deliver(&mut c, "w0", step_report(&job, 1, 0, 1), 10);
    lose(&mut c, "w1", None, 20);
    // It comes back naming its place, and is lost again.
    let mut h = hello("w1");
    (h.job_id, h.generation, h.rank) = (job.clone(), 1, 1);
    c.step(Input::Attach { conn: 50, hello: h }, 30);
    lose(&mut c, "w1", None, 40);
    assert_eq!(c.job(&job).unwrap().recoveries[0].lost, ["w1"]);
    attach(&mut c, "w2", 60, 50);
    deliver(&mut c, "w0", interrupted(&job, 1, 0), 60);
    let j = c.job(&job).unwrap();
    assert_eq!(j.generation, 2);
    let r = &j.recoveries[0];
    assert_eq!(
        (
            r.generation,
            r.lost.clone(),
            r.joined.clone(),
            r.world_size,
            r.accumulation_steps
        ),
        (2, vec!["w1".to_string()], vec!["w2".to_string()], 2, 1)
    );
    // Many causes: the reason stays bounded.
    let mut reason = "lost w1".to_string();
    for _ in 0..1000 {
        reason = recovery::add_reason(&reason, &"x".repeat(100));
    }
    assert!(reason.len() <= MAX_REASON_BYTES, "{}", reason.len());
    let mut lost = vec!["a".to_string()];
    recovery::add_lost(&mut lost, vec!["b".into(), "a".into(), "b".into()]);
    assert_eq!(lost, ["a", "b"]);
}

/// Issue 28: reports refused for a job that ended are answered every time
/// but warned about once per job and generation.
#[test]
fn refused_messages_warn_once_per_job_and_generation() {
    let mut log = RefusalLog::default();
    assert_eq!(log.note("j-1", 1), 1);
    assert_eq!(log.note("j-1", 1), 2);
    assert_eq!(log.note("j-1", 2), 1, "a new generation warns again");
    assert_eq!(log.note("j-2", 1), 1);
    assert_eq!(log.note("j-1", 1), 3);
    // Bounded: ids cut, and forgotten all at once past the limit.
    let long = "x".repeat(10_000);
    assert_eq!(log.note(&long, 1), 1);
    assert_eq!(log.note(&format!("{long}y"), 1), 2, "cut to the same key");
    for i in 0..MAX_REFUSAL_KEYS as u64 {
        log.note("k", i + 10);
    }
    assert!(log.seen.len() <= MAX_REFUSAL_KEYS);

    let mut c = cluster();
    attach_all(&mut c, &["w0"], 0);
    let job = submit(&mut c, spec("j", 1, ""), 0);
    deliver(&mut c, "w0", done(&job, 1, 0, true), 10);
    assert_eq!(c.job(&job).unwrap().state(), JobState::Succeeded);
    for step in 1..=20 {
        let fx = deliver(
            &mut c,
            "w0",
            step_report(&job, 1, 0, step),
            20 + step as i64,
        );
        assert!(matches!(
            &sends(&fx)[..],
            [(_, coordinator_message::Msg::Refused(r))] if r.job_id == job && r.generation == 1
        ));
    }
    assert_eq!(c.refusals.seen.get(&(job.clone(), 1)), Some(&20));
    assert_eq!(c.refusals.note(&job, 1), 21, "the 21st is not the first");
}

/// Issue 28: a worker's text is kept to MAX_REASON_BYTES in the job.
#[test]
fn worker_texts_are_clipped_in_the_job_record() {
    assert_eq!(clip("short"), "short");
    let long = "é".repeat(10_000);
    let c = clip(&long);
    assert!(
        c.len() <= MAX_REASON_BYTES && c.ends_with("… (20000 bytes)"),
        "{}",
        c.len()
    );
    let mut cl = cluster();
    attach_all(&mut cl, &["w0"], 0);
    let job = submit(&mut cl, spec("j", 1, ""), 0);
    let mut d = done(&job, 1, 0, false);
    if let Some(worker_message::Msg::Done(x)) = &mut d.msg {
        x.error = "e".repeat(1 << 20);
    }
    deliver(&mut cl, "w0", d, 10);
    let j = cl.job(&job).unwrap();
    assert_eq!(j.state(), JobState::Failed);
    assert!(j.error.len() < MAX_REASON_BYTES + 100, "{}", j.error.len());
    assert!(j
        .history
        .iter()
        .all(|t| t.reason.len() < MAX_REASON_BYTES + 100));
}

/// Issue 28: a restored job list is listed (and scheduled) in creation
/// order whatever order the store gave it in, and pages over it follow
/// that order.
#[test]
fn restored_jobs_list_in_creation_order() {
    let mut c = cluster();
    let job = |id: &str| Job {
        id: id.into(),
        spec: Some(spec("a", 1, "")),
        ..Default::default()
    };
    // A store lists by key: a-10 before a-9.
    c.restore(vec![job("a-10"), job("a-2"), job("a-9"), job("b-1")], 0);
    let ids: Vec<&str> = c.jobs().map(|j| j.id.as_str()).collect();
    assert_eq!(ids, ["b-1", "a-2", "a-9", "a-10"]);
    let req = crate::paging::request(3, "").unwrap();
    let (p, next) = c.jobs_page(&req, |_| 1, usize::MAX);
    assert_eq!(
        p.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
        ["b-1", "a-2", "a-9"]
    );
    let id = submit(&mut c, spec("z", 1, ""), 0);
    assert_eq!(id, "z-11");
    let (p, next) = c.jobs_page(
        &crate::paging::request(3, &next).unwrap(),
        |_| 1,
        usize::MAX,
    );
    assert_eq!(
        p.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
        ["a-10", "z-11"]
    );
    assert_eq!(next, "");
}

/// A record as today's coordinator stores it (the proto `Job` with its spec
/// in the wire form, prost-encoded) restores with its domain spec parsed
/// once: the spec the scheduler decides with is the submitted one, the job
/// forms from it (k from it; the assignments carry the stored wire spec),
/// and a record whose spec does not read back fails when it would form,
/// naming why.
#[test]
fn a_stored_record_restores_with_its_domain_spec() {
    use prost::Message;
    let wire = spec("old", 2, "[accumulation]\nsteps = 3");
    let domain = parse_spec(&wire).unwrap();
    let stored = |id: &str, spec: Option<v1::JobSpec>| {
        Job {
            id: id.into(),
            state: JobState::Pending as i32,
            spec,
            version: 2,
            ..Default::default()
        }
        .encode_to_vec()
    };
    let records = [
        stored("old-4", Some(accrue_proto::spec_to_proto(&domain))),
        stored("bad-5", None),
    ];
    let mut c = cluster();
    c.restore(
        records
            .iter()
            .map(|b| Job::decode(b.as_slice()).unwrap())
            .collect(),
        0,
    );
    assert_eq!(c.spec("old-4"), Some(&domain));
    assert_eq!(c.spec("bad-5"), None);
    let mut fx = Vec::new();
    for (i, w) in ["w0", "w1", "w2"].iter().enumerate() {
        fx.extend(attach(&mut c, w, i as u64 + 1, 1));
    }
    let assigned: Vec<v1::Assignment> = sends(&fx)
        .into_iter()
        .filter_map(|(_, m)| match m {
            coordinator_message::Msg::Assign(a) => Some(a),
            _ => None,
        })
        .collect();
    assert_eq!(assigned.len(), 2, "{fx:?}");
    for a in &assigned {
        assert_eq!((a.job_id.as_str(), a.accumulation_steps), ("old-4", 3));
        assert_eq!(a.spec.as_ref(), c.job("old-4").unwrap().spec.as_ref());
    }
    let bad = c.job("bad-5").unwrap();
    assert_eq!(bad.state(), JobState::Failed, "{:?}", bad.history);
    assert!(bad.error.contains("model = (missing)"), "{}", bad.error);
}
