//! The scheduler's cases (every defect of issue 12 among them) and its
//! invariants over random histories.

use super::*;
use proptest::prelude::*;

const TTL: i64 = 60_000;

pub(super) fn cluster() -> Cluster {
    Cluster::new(
        Policy {
            heartbeat_ttl_ms: TTL,
            state_dir: "/state".into(),
            max_job_memory: 8 << 30,
            roots: Default::default(),
            cwd: "/work".into(),
        },
        Box::new(test_key),
    )
}

/// The tests' ring key derivation: names its inputs, so a test can see
/// which job and generation a key was made for.
fn test_key(job: &str, generation: u64) -> Vec<u8> {
    format!("key of {job} generation {generation}").into_bytes()
}

/// The (worker, generation, key) of every Assignment among `fx`.
pub(super) fn assigned_keys(fx: &[Effect]) -> Vec<(String, u64, Vec<u8>)> {
    sends(fx)
        .into_iter()
        .filter_map(|(w, m)| match m {
            coordinator_message::Msg::Assign(a) => Some((w, a.generation, a.secret)),
            _ => None,
        })
        .collect()
}

/// Every rank of a generation gets the key derived for that job and
/// generation; a re-formation gets the next generation's key.
#[test]
fn each_generation_gets_its_own_derived_key() {
    let mut c = cluster();
    for (i, w) in ["w0", "w1", "w2"].iter().enumerate() {
        attach(&mut c, w, i as u64 + 1, 0);
    }
    let spec = spec("j", 2, "");
    let fx = c.step(
        Input::Submit {
            spec,
            owner: String::new(),
        },
        0,
    );
    let job = reply(&fx).unwrap().id;
    let mut fx2 = c.step(Input::Admit { job: job.clone() }, 0);
    fx2.extend(fx);
    let k1 = test_key(&job, 1);
    assert_eq!(
        assigned_keys(&fx2),
        vec![
            ("w0".to_string(), 1, k1.clone()),
            ("w1".to_string(), 1, k1.clone())
        ]
    );
    c.step(
        Input::Lost {
            worker: "w1".into(),
            conn: Some(2),
            reason: "gone".into(),
        },
        20,
    );
    let fx = deliver(&mut c, "w0", interrupted(&job, 1, 0), 25);
    let k2 = test_key(&job, 2);
    assert_ne!(k1, k2);
    assert_eq!(
        assigned_keys(&fx),
        vec![
            ("w0".to_string(), 2, k2.clone()),
            ("w2".to_string(), 2, k2.clone())
        ]
    );
}

pub(super) fn spec(name: &str, workers: u32, extra: &str) -> v1::JobSpec {
    let text = format!(
        "name = \"{name}\"\nworkers = {workers}\nmax_steps = 6\n{extra}\n[model]\nkind = \"mlp\"\nhidden = [8]\n[data]\nkind = \"synthetic\"\nsamples = 64\nshape = [4]\nclasses = 2\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n"
    );
    let s = accrue_common::JobSpec::from_toml_str(&text, std::path::Path::new("t.toml")).unwrap();
    accrue_proto::spec_to_proto(&s)
}

pub(super) fn hello(id: &str) -> v1::WorkerHello {
    v1::WorkerHello {
        worker_id: id.into(),
        data_addr: format!("{id}:7000"),
        ..Default::default()
    }
}

pub(super) fn sends(fx: &[Effect]) -> Vec<(String, coordinator_message::Msg)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Send { worker, msg, .. } => Some((worker.clone(), msg.msg.clone()?)),
            _ => None,
        })
        .collect()
}

fn aborts(fx: &[Effect]) -> usize {
    sends(fx)
        .iter()
        .filter(|(_, m)| matches!(m, coordinator_message::Msg::Abort(_)))
        .count()
}

pub(super) fn reply(fx: &[Effect]) -> Result<Job, CoordError> {
    fx.iter()
        .find_map(|e| match e {
            Effect::Reply(r) => Some(r.clone()),
            _ => None,
        })
        .expect("a reply")
}

/// Submits and admits a job; returns its id.
pub(super) fn submit(c: &mut Cluster, s: v1::JobSpec, now: i64) -> String {
    let id = reply(&c.step(
        Input::Submit {
            spec: s,
            owner: String::new(),
        },
        now,
    ))
    .unwrap()
    .id;
    c.step(Input::Admit { job: id.clone() }, now);
    id
}

pub(super) fn m(msg: worker_message::Msg) -> WorkerMessage {
    WorkerMessage {
        msg: Some(msg),
        ..Default::default()
    }
}

pub(super) fn step_report(job: &str, generation: u64, rank: u32, step: u64) -> WorkerMessage {
    m(worker_message::Msg::Step(StepReport {
        job_id: job.into(),
        generation,
        rank,
        step,
        total_steps: 6,
        ..Default::default()
    }))
}

pub(super) fn done(job: &str, generation: u64, rank: u32, ok: bool) -> WorkerMessage {
    m(worker_message::Msg::Done(v1::JobDone {
        job_id: job.into(),
        generation,
        rank,
        ok,
        stopped: true,
        ..Default::default()
    }))
}

fn interrupted(job: &str, generation: u64, rank: u32) -> WorkerMessage {
    m(worker_message::Msg::Interrupted(v1::Interrupted {
        job_id: job.into(),
        generation,
        rank,
        error: "aborted".into(),
        ..Default::default()
    }))
}

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
    c.step(
        Input::Lost {
            worker: "w2".into(),
            conn: None,
            reason: "gone".into(),
        },
        20,
    );
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
    c.step(
        Input::Lost {
            worker: "w3".into(),
            conn: None,
            reason: "gone".into(),
        },
        50,
    );
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
        c.step(
            Input::Lost {
                worker: "w1".into(),
                conn: Some(2),
                reason: "gone".into(),
            },
            20,
        );
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

pub(super) fn conn_of(c: &Cluster, w: &str) -> u64 {
    c.worker(w).unwrap().conn
}

pub(super) fn deliver(c: &mut Cluster, w: &str, msg: WorkerMessage, now: i64) -> Vec<Effect> {
    let conn = conn_of(c, w);
    c.step(
        Input::Message {
            worker: w.into(),
            conn,
            msg,
        },
        now,
    )
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

/// Defect 1: a worker whose stream blipped re-attaches naming a job it
/// is no longer a member of. It must not abort the healthy generation,
/// must be told to stop, and must be free once it has.
#[test]
fn a_stale_member_reattaching_is_stopped_and_freed_without_a_recovery() {
    let mut c = cluster();
    let job = replaced(&mut c);
    deliver(&mut c, "w0", step_report(&job, 2, 0, 2), 30);
    let fx = c.step(
        Input::Attach {
            conn: 9,
            hello: v1::WorkerHello {
                job_id: job.clone(),
                generation: 1,
                rank: 1,
                ..hello("w1")
            },
        },
        40,
    );
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
    let mut c = cluster();
    let job = replaced(&mut c);
    deliver(&mut c, "w0", step_report(&job, 2, 0, 2), 30);
    let fx = c.step(
        Input::Attach {
            conn: 9,
            hello: v1::WorkerHello {
                job_id: job.clone(),
                generation: 2,
                rank: 1,
                ..hello("w2")
            },
        },
        40,
    );
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

#[test]
fn a_submission_waits_for_admission_and_can_be_taken_back() {
    let mut c = cluster();
    attach(&mut c, "w0", 1, 0);
    let fx = c.step(
        Input::Submit {
            spec: spec("a", 1, ""),
            owner: String::new(),
        },
        1,
    );
    let job = reply(&fx).unwrap();
    assert_eq!(job.state(), JobState::Pending);
    assert!(sends(&fx).is_empty(), "not scheduled before it is durable");
    c.step(Input::Tick, 2);
    assert_eq!(c.job(&job.id).unwrap().state(), JobState::Pending);
    let fx = c.step(
        Input::Withdraw {
            job: job.id.clone(),
        },
        3,
    );
    assert_eq!(fx, vec![Effect::Delete(job.id.clone())]);
    assert!(c.job(&job.id).is_none());
    // Ids are never reused.
    let again = reply(&c.step(
        Input::Submit {
            spec: spec("a", 1, ""),
            owner: String::new(),
        },
        4,
    ))
    .unwrap();
    assert_ne!(again.id, job.id);
    let fx = c.step(
        Input::Admit {
            job: again.id.clone(),
        },
        5,
    );
    assert!(
        matches!(&sends(&fx)[..], [(w, coordinator_message::Msg::Assign(a))] if w == "w0" && a.accumulation_steps == 1)
    );
    // Withdrawing an admitted job does nothing.
    assert!(c
        .step(
            Input::Withdraw {
                job: again.id.clone()
            },
            6
        )
        .is_empty());
}

#[test]
fn bad_specs_and_worker_ids_are_refused_with_their_field() {
    let mut c = cluster();
    let mut s = spec("a", 1, "");
    s.data.as_mut().unwrap().batch_size = 0;
    let e = reply(&c.step(
        Input::Submit {
            spec: s,
            owner: String::new(),
        },
        0,
    ))
    .unwrap_err();
    assert!(
        matches!(&e, CoordError::InvalidArgument(m) if m.contains("data.batch_size")),
        "{e}"
    );
    // Defect 4: a name with markup (it broke the dashboard's HTML).
    let mut s = spec("a", 1, "");
    s.name = r#"evil"><script>alert(1)</script>"#.into();
    let e = reply(&c.step(
        Input::Submit {
            spec: s,
            owner: String::new(),
        },
        0,
    ))
    .unwrap_err();
    assert!(
        matches!(&e, CoordError::InvalidArgument(m) if m.contains("name = ")),
        "{e}"
    );
    assert_eq!(c.jobs().count(), 0);
    let e = reply(&c.step(
        Input::Attach {
            conn: 1,
            hello: hello(""),
        },
        0,
    ))
    .unwrap_err();
    assert!(e.to_string().contains("worker_id"));
    assert_eq!(c.worker_count(), 0);
}

#[test]
fn every_write_carries_a_newer_version_and_only_the_newest_is_kept() {
    let mut c = cluster();
    attach(&mut c, "w0", 1, 0);
    let fx = c.step(
        Input::Submit {
            spec: spec("a", 1, ""),
            owner: String::new(),
        },
        0,
    );
    let id = reply(&fx).unwrap().id;
    // Admission forms the job: one Save (the newest of the step).
    let fx = c.step(Input::Admit { job: id.clone() }, 1);
    let saves: Vec<u64> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Save(j) => Some(j.version),
            _ => None,
        })
        .collect();
    assert_eq!(saves, [2]);
    let fx = c.step(
        Input::Cancel {
            job: id.clone(),
            by: Caller::Anyone,
        },
        2,
    );
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::Save(j) if j.version == 3)));
    assert_eq!(reply(&fx).unwrap().state(), JobState::Cancelled);
    let e = reply(&c.step(
        Input::Cancel {
            job: id.clone(),
            by: Caller::Anyone,
        },
        3,
    ))
    .unwrap_err();
    assert_eq!(e.grpc_code(), tonic::Code::FailedPrecondition);
}

#[test]
fn restored_jobs_keep_their_place_and_ids_continue() {
    let mut c = cluster();
    let job = Job {
        id: "old-7".into(),
        state: JobState::Running as i32,
        generation: 3,
        workers: vec!["w0".into()],
        spec: Some(spec("old", 1, "")),
        version: 40,
        ..Default::default()
    };
    c.restore(vec![job], 0);
    // The member re-attaches in place: no recovery.
    let fx = c.step(
        Input::Attach {
            conn: 1,
            hello: v1::WorkerHello {
                job_id: "old-7".into(),
                generation: 3,
                rank: 0,
                ..hello("w0")
            },
        },
        10,
    );
    assert_eq!(aborts(&fx), 0);
    c.step(Input::Tick, TTL + 1);
    assert_eq!(c.job("old-7").unwrap().state(), JobState::Running);
    let next = reply(&c.step(
        Input::Submit {
            spec: spec("new", 1, ""),
            owner: String::new(),
        },
        20,
    ))
    .unwrap();
    assert_eq!(next.id, "new-8");
}

#[test]
fn silent_workers_expire_after_the_ttl() {
    let mut c = cluster();
    attach(&mut c, "w0", 1, 0);
    c.step(Input::Tick, TTL);
    assert!(c.worker("w0").is_some());
    let fx = c.step(Input::Tick, TTL + 1);
    assert!(c.worker("w0").is_none());
    assert!(fx.contains(&Effect::Close {
        worker: "w0".into(),
        conn: 1
    }));
}

/// Random histories: every invariant of the cluster holds after every
/// input, and every job's versions only grow.
#[derive(Clone, Debug)]
enum Op {
    Attach(usize, bool),
    Lost(usize),
    Detach(usize),
    Submit(u32),
    Admit,
    Cancel(usize),
    /// Resume job i, then admit it (true) or take it back (false).
    Resume(usize, bool),
    Step(usize),
    Done(usize, bool),
    Interrupt(usize),
    Tick(i64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..4, any::<bool>()).prop_map(|(w, c)| Op::Attach(w, c)),
        (0usize..4).prop_map(Op::Lost),
        (0usize..4).prop_map(Op::Detach),
        (1u32..4).prop_map(Op::Submit),
        Just(Op::Admit),
        (0usize..4).prop_map(Op::Cancel),
        (0usize..4, any::<bool>()).prop_map(|(i, keep)| Op::Resume(i, keep)),
        (0usize..4).prop_map(Op::Step),
        (0usize..4, any::<bool>()).prop_map(|(w, ok)| Op::Done(w, ok)),
        (0usize..4).prop_map(Op::Interrupt),
        (0i64..100_000).prop_map(Op::Tick),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn invariants_hold_over_random_histories(ops in proptest::collection::vec(op(), 1..60)) {
        let mut c = cluster();
        let mut now = 0i64;
        let mut conn = 0u64;
        let mut versions: BTreeMap<String, u64> = BTreeMap::new();
        let w = |i: usize| format!("w{i}");
        for o in ops {
            now += 100;
            let jobs: Vec<String> = c.jobs().map(|j| j.id.clone()).collect();
            let pick = |i: usize| jobs.get(i % jobs.len().max(1)).cloned().unwrap_or_default();
            let mut first = Vec::new();
            let input = match o {
                Op::Resume(i, keep) => {
                    let job = pick(i);
                    first = c.step(Input::Resume { job: job.clone(), by: Caller::Anyone }, now);
                    if keep { Input::Admit { job } } else { Input::Withdraw { job } }
                }
                Op::Attach(i, claim) => {
                    conn += 1;
                    let served = c.worker(&w(i)).and_then(|x| x.job.clone());
                    let mut h = hello(&w(i));
                    if let (true, Some((j, r))) = (claim, served) {
                        h.job_id = j.clone();
                        h.rank = r;
                        h.generation = c.job(&j).map_or(0, |x| x.generation);
                    }
                    Input::Attach { conn, hello: h }
                }
                Op::Lost(i) => Input::Lost { worker: w(i), conn: None, reason: "gone".into() },
                Op::Detach(i) | Op::Step(i) | Op::Done(i, _) | Op::Interrupt(i) if c.worker(&w(i)).is_none() => Input::Tick,
                Op::Detach(i) => Input::Message { worker: w(i), conn: conn_of(&c, &w(i)), msg: m(worker_message::Msg::Detach(v1::Detach { reason: "bye".into() })) },
                Op::Submit(n) => Input::Submit { spec: spec("p", n, ""), owner: String::new() },
                Op::Admit => Input::Admit { job: pick(jobs.len().saturating_sub(1)) },
                Op::Cancel(i) => Input::Cancel { job: pick(i), by: Caller::Anyone },
                Op::Step(i) | Op::Done(i, _) | Op::Interrupt(i) => {
                    let x = c.worker(&w(i)).unwrap();
                    let Some((j, rank)) = x.job.clone() else { continue };
                    let g = c.job(&j).map_or(0, |x| x.generation);
                    let msg = match o {
                        Op::Step(_) => step_report(&j, g, rank, 1),
                        Op::Done(_, ok) => done(&j, g, rank, ok),
                        _ => m(worker_message::Msg::Interrupted(v1::Interrupted { job_id: j, generation: g, rank, ..Default::default() })),
                    };
                    Input::Message { worker: w(i), conn: x.conn, msg }
                }
                Op::Tick(dt) => { now += dt; Input::Tick }
            };
            let fx = c.step(input, now);
            for e in first.iter().chain(&fx) {
                match e {
                    Effect::Save(j) => {
                        let v = versions.entry(j.id.clone()).or_default();
                        prop_assert!(j.version > *v, "job {} went from version {} to {}", j.id, v, j.version);
                        *v = j.version;
                    }
                    Effect::Send { worker, conn, msg } => {
                        // To the worker's current connection (or to one
                        // removed later in the same step: dropped).
                        prop_assert!(c.worker(worker).is_none_or(|x| x.conn == *conn));
                        // An assignment carries its generation's key.
                        if let Some(coordinator_message::Msg::Assign(a)) = &msg.msg {
                            prop_assert_eq!(&a.secret, &test_key(&a.job_id, a.generation));
                        }
                    }
                    _ => {}
                }
            }
            // Recovery records (issue 28): each names a lost worker once;
            // only the last may be open (generation 0), and only while the
            // job waits to re-form.
            for j in c.jobs() {
                for (i, r) in j.recoveries.iter().enumerate() {
                    let lost: std::collections::BTreeSet<&String> = r.lost.iter().collect();
                    prop_assert_eq!(lost.len(), r.lost.len(), "{:?}", r.lost);
                    if r.generation == 0 {
                        prop_assert_eq!(i + 1, j.recoveries.len(), "{:?}", j.recoveries);
                        prop_assert!(
                            matches!(j.state(), JobState::Recovering | JobState::Pending),
                            "an open record in a {:?} job: {:?}", j.state(), j.recoveries
                        );
                    }
                }
            }
            // Every job's history is a chain of allowed transitions ending
            // in its state (a resume and its withdrawal included).
            for j in c.jobs() {
                let mut at = JobState::Unspecified as i32;
                for t in &j.history {
                    prop_assert_eq!(t.from, at, "{:?}", j.history);
                    prop_assert!(state::allowed(JobState::try_from(t.from).unwrap(), JobState::try_from(t.to).unwrap()));
                    at = t.to;
                }
                prop_assert_eq!(at, j.state);
            }
            // No worker serves two ranks; every live member serves its job.
            let mut seen = BTreeMap::new();
            for j in c.jobs() {
                if state::is_final(j.state()) || j.state() == JobState::Pending {
                    continue;
                }
                for (rank, m) in j.workers.iter().enumerate() {
                    if let Some(x) = c.worker(m) {
                        if x.serves(&j.id) {
                            prop_assert_eq!(x.job.as_ref().map(|(_, r)| *r as usize), Some(rank));
                            prop_assert!(seen.insert(m.clone(), j.id.clone()).is_none());
                        }
                    }
                }
            }
            for id in ["w0", "w1", "w2", "w3"] {
                if let Some(x) = c.worker(id) {
                    if let Some((j, _)) = &x.job {
                        let job = c.job(j).unwrap();
                        prop_assert!(job.workers.iter().any(|m| m == id), "{} serves {} without being a member", id, j);
                    }
                }
            }
        }
    }
}

/// A recovering job whose stored spec cannot be read fails (naming the
/// field) instead of waiting for ever.
#[test]
fn a_recovering_job_with_an_unreadable_spec_fails() {
    let mut c = cluster();
    let mut bad = spec("old", 1, "");
    bad.model.as_mut().unwrap().kind = 0;
    let job = Job {
        id: "old-1".into(),
        state: JobState::Recovering as i32,
        generation: 2,
        workers: vec!["w0".into()],
        spec: Some(bad),
        ..Default::default()
    };
    c.restore(vec![job], 0);
    attach(&mut c, "w0", 1, 1);
    c.step(Input::Tick, TTL + 1);
    let j = c.job("old-1").unwrap();
    assert_eq!(j.state(), JobState::Failed);
    assert!(j.error.contains("model.kind"), "{}", j.error);
}

/// Attaches worker `w` on connection `conn` (no job claimed).
pub(super) fn attach(c: &mut Cluster, w: &str, conn: u64, now: i64) -> Vec<Effect> {
    c.step(
        Input::Attach {
            conn,
            hello: hello(w),
        },
        now,
    )
}

pub(super) fn attach_all(c: &mut Cluster, ids: &[&str], now: i64) {
    for (i, w) in ids.iter().enumerate() {
        attach(c, w, 100 + i as u64, now);
    }
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
    c.step(
        Input::Lost {
            worker: "w2".into(),
            conn: None,
            reason: "gone".into(),
        },
        20,
    );
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
        c.step(
            Input::Lost {
                worker: member,
                conn: None,
                reason: "gone".into(),
            },
            t * 100,
        );
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

#[test]
fn the_owner_cancels_its_job_admin_any_other_principals_none() {
    let who = |name: &str, admin| Caller::Principal {
        name: name.into(),
        admin,
    };
    let mut c = cluster();
    let job = |c: &mut Cluster, owner: &str| {
        let fx = c.step(
            Input::Submit {
                spec: spec("a", 1, ""),
                owner: owner.into(),
            },
            0,
        );
        let j = reply(&fx).unwrap();
        assert_eq!(j.owner, owner);
        j.id
    };
    let alices = job(&mut c, "alice");
    let cancel = |c: &mut Cluster, id: &str, by: Caller| {
        reply(&c.step(Input::Cancel { job: id.into(), by }, 1))
    };
    // Another principal is refused and nothing changes.
    let e = cancel(&mut c, &alices, who("bob", false)).unwrap_err();
    assert_eq!(e.grpc_code(), tonic::Code::PermissionDenied);
    assert_eq!(
        e.to_string(),
        format!("bob may not cancel job {alices}: it is owned by alice; a principal cancels only its own jobs, the admin scope any")
    );
    assert_eq!(c.job(&alices).unwrap().state(), JobState::Pending);
    // An unknown job is NOT_FOUND whoever asks.
    let e = cancel(&mut c, "nope-9", who("bob", false)).unwrap_err();
    assert_eq!(e.grpc_code(), tonic::Code::NotFound);
    // The owner may.
    let j = cancel(&mut c, &alices, who("alice", false)).unwrap();
    assert_eq!(j.state(), JobState::Cancelled);
    // admin may cancel anyone's; an ownerless job only admin (or anyone
    // with authentication off).
    let alices = job(&mut c, "alice");
    assert!(cancel(&mut c, &alices, who("ops", true)).is_ok());
    let nobodys = job(&mut c, "");
    let e = cancel(&mut c, &nobodys, who("alice", false)).unwrap_err();
    assert!(e.to_string().contains("owned by no one"), "{e}");
    let e = cancel(&mut c, &nobodys, who("", false)).unwrap_err();
    assert_eq!(e.grpc_code(), tonic::Code::PermissionDenied);
    assert!(cancel(&mut c, &nobodys, Caller::Anyone).is_ok());
}

proptest! {
    #[test]
    fn may_cancel_is_owner_or_admin(owner in "[a-c]{0,2}", name in "[a-c]{0,2}", admin in any::<bool>()) {
        let by = Caller::Principal { name: name.clone(), admin };
        let ok = may_cancel("j-1", &owner, &by).is_ok();
        prop_assert_eq!(ok, admin || (!owner.is_empty() && owner == name));
        prop_assert!(may_cancel("j-1", &owner, &Caller::Anyone).is_ok());
    }
}

/// Issue 28: a recovery that never re-forms leaves no record once the job
/// has ended (no `generation 0 ... W = 0, k = 0`); why it ended stays in
/// the history and the error.
#[test]
fn a_failed_recovery_leaves_no_record_of_a_re_formation() {
    let mut c = cluster();
    attach_all(&mut c, &["w0", "w1"], 0);
    let job = submit(&mut c, spec("j", 2, ""), 0);
    deliver(&mut c, "w0", step_report(&job, 1, 0, 1), 10);
    c.step(
        Input::Lost {
            worker: "w1".into(),
            conn: None,
            reason: "gone".into(),
        },
        20,
    );
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
    c.step(
        Input::Lost {
            worker: "w1".into(),
            conn: None,
            reason: "gone".into(),
        },
        20,
    );
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
    let lose = |c: &mut Cluster, now| {
        c.step(
            Input::Lost {
                worker: "w1".into(),
                conn: None,
                reason: "gone".into(),
            },
            now,
        )
    };
    lose(&mut c, 20);
    // It comes back naming its place, and is lost again.
    let mut h = hello("w1");
    (h.job_id, h.generation, h.rank) = (job.clone(), 1, 1);
    c.step(Input::Attach { conn: 50, hello: h }, 30);
    lose(&mut c, 40);
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
