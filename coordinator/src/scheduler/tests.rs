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
    let fx = step_submit(&mut c, spec, String::new(), 0);
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
    lose(&mut c, "w1", Some(2), 20);
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

/// Issue 38: every rank's assignment carries its place in the mesh of its
/// generation (data parallelism: data = rank, degree = world), and a
/// re-formation hands out the new world's places.
#[test]
fn assignments_carry_each_ranks_mesh_coordinates() {
    let mut c = cluster();
    for (i, w) in ["w0", "w1", "w2"].iter().enumerate() {
        attach(&mut c, w, i as u64 + 1, 0);
    }
    let fx = step_submit(&mut c, spec("j", 2, ""), String::new(), 0);
    let job = reply(&fx).unwrap().id;
    let fx = c.step(Input::Admit { job: job.clone() }, 0);
    let coords: Vec<(u32, Option<v1::MeshCoords>)> = sends(&fx)
        .into_iter()
        .filter_map(|(_, m)| match m {
            coordinator_message::Msg::Assign(a) => Some((a.rank, a.coords)),
            _ => None,
        })
        .collect();
    let place = |data| v1::MeshCoords {
        data,
        pipeline: 0,
        tensor: 0,
        data_degree: 2,
        pipeline_degree: 1,
        tensor_degree: 1,
    };
    assert_eq!(coords, vec![(0, Some(place(0))), (1, Some(place(1)))]);
}

pub(super) fn spec(name: &str, workers: u32, extra: &str) -> v1::JobSpec {
    let text = format!(
        "name = \"{name}\"\nworkers = {workers}\nmax_steps = 6\n{extra}\n[model]\nkind = \"mlp\"\nhidden = [8]\n[data]\nkind = \"synthetic\"\nsamples = 64\nshape = [4]\nclasses = 2\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n"
    );
    let s = accrue_common::JobSpec::from_toml_str(&text, std::path::Path::new("t.toml")).unwrap();
    accrue_proto::spec_to_proto(&s)
}

/// A submission from the wire as the service makes it: the spec parsed at
/// the edge ([`parse_spec`]; a refusal is the client's reply), then
/// [`Input::Submit`].
pub(super) fn step_submit(
    c: &mut Cluster,
    spec: v1::JobSpec,
    owner: String,
    now: i64,
) -> Vec<Effect> {
    match parse_spec(&spec) {
        Ok(spec) => c.step(
            Input::Submit {
                spec: Box::new(spec),
                owner,
            },
            now,
        ),
        Err(e) => vec![Effect::Reply(Err(e))],
    }
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

pub(super) fn aborts(fx: &[Effect]) -> usize {
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
    let id = reply(&step_submit(c, s, String::new(), now)).unwrap().id;
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

pub(super) fn interrupted(job: &str, generation: u64, rank: u32) -> WorkerMessage {
    m(worker_message::Msg::Interrupted(v1::Interrupted {
        job_id: job.into(),
        generation,
        rank,
        error: "aborted".into(),
        ..Default::default()
    }))
}

#[test]
fn a_submission_waits_for_admission_and_can_be_taken_back() {
    let mut c = cluster();
    attach(&mut c, "w0", 1, 0);
    let fx = step_submit(&mut c, spec("a", 1, ""), String::new(), 1);
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
    let again = reply(&step_submit(&mut c, spec("a", 1, ""), String::new(), 4)).unwrap();
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
    let e = reply(&step_submit(&mut c, s, String::new(), 0)).unwrap_err();
    assert!(
        matches!(&e, CoordError::InvalidArgument(m) if m.contains("data.batch_size")),
        "{e}"
    );
    // Defect 4: a name with markup (it broke the dashboard's HTML).
    let mut s = spec("a", 1, "");
    s.name = r#"evil"><script>alert(1)</script>"#.into();
    let e = reply(&step_submit(&mut c, s, String::new(), 0)).unwrap_err();
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
    let fx = step_submit(&mut c, spec("a", 1, ""), String::new(), 0);
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
    let next = reply(&step_submit(&mut c, spec("new", 1, ""), String::new(), 20)).unwrap();
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
                Op::Submit(n) => Input::Submit { spec: Box::new(parse_spec(&spec("p", n, "")).unwrap()), owner: String::new() },
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

/// Worker `w` lost (its connection `conn`, or the worker whatever its
/// connection) at `now`, for the reason "gone".
pub(super) fn lose(c: &mut Cluster, w: &str, conn: Option<u64>, now: i64) -> Vec<Effect> {
    c.step(
        Input::Lost {
            worker: w.into(),
            conn,
            reason: "gone".into(),
        },
        now,
    )
}

pub(super) fn attach_all(c: &mut Cluster, ids: &[&str], now: i64) {
    for (i, w) in ids.iter().enumerate() {
        attach(c, w, 100 + i as u64, now);
    }
}

#[test]
fn the_owner_cancels_its_job_admin_any_other_principals_none() {
    let who = |name: &str, admin| Caller::Principal {
        name: name.into(),
        admin,
    };
    let mut c = cluster();
    let job = |c: &mut Cluster, owner: &str| {
        let fx = step_submit(c, spec("a", 1, ""), owner.into(), 0);
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
