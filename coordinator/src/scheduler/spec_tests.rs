//! Submissions of any spec, within and outside every range: refused with a
//! field error, or run to a final state with every worker free afterwards;
//! and a job wider than the cluster never blocks the queue.

use super::tests::{attach_all, cluster, deliver, done, reply, spec, step_submit, submit};
use super::*;
use proptest::prelude::*;

const WORKERS: [&str; 3] = ["w0", "w1", "w2"];

/// A job wider than every attached worker waits aside; smaller jobs behind
/// it run. One the attached workers could hold keeps its place (no
/// backfill past it, so it is never starved).
#[test]
fn a_job_wider_than_the_cluster_does_not_block_the_queue() {
    let mut c = cluster();
    attach_all(&mut c, &WORKERS[..2], 0);
    let big = submit(&mut c, spec("big", 3, ""), 1);
    let small = submit(&mut c, spec("small", 1, ""), 2);
    assert_eq!(c.job(&big).unwrap().state(), JobState::Pending);
    assert_eq!(c.job(&small).unwrap().state(), JobState::Rendezvous);
    // A third worker attaches: the big job can now be held, so it waits
    // for its gang at the head of the queue and a later small job waits
    // behind it.
    c.step(
        Input::Attach {
            conn: 9,
            hello: v1::WorkerHello {
                worker_id: "w2".into(),
                data_addr: "w2:7000".into(),
                ..Default::default()
            },
        },
        3,
    );
    let later = submit(&mut c, spec("later", 1, ""), 4);
    assert_eq!(c.job(&big).unwrap().state(), JobState::Pending);
    assert_eq!(c.job(&later).unwrap().state(), JobState::Pending);
    // The small job ends: the big one takes all three, the later one waits.
    let member = c.job(&small).unwrap().workers[0].clone();
    deliver(&mut c, &member, done(&small, 1, 0, true), 5);
    assert_eq!(c.job(&big).unwrap().state(), JobState::Rendezvous);
    assert_eq!(c.job(&big).unwrap().workers.len(), 3);
    assert_eq!(c.job(&later).unwrap().state(), JobState::Pending);
}

/// One numeric field of the wire spec set to an interesting value.
#[derive(Clone, Debug)]
enum Change {
    Workers(u32),
    MinWorkers(u32),
    MaxWorkers(u32),
    Epochs(u64),
    MaxSteps(u64),
    Device(String),
    Threads(u32),
    Hidden(Vec<i64>),
    NumClasses(i64),
    Batch(u64),
    Samples(u64),
    EvalSamples(u64),
    Shape(Vec<i64>),
    Classes(i64),
    Steps(u64),
    GlobalBatch(u64),
    MaxNorm(f64),
    NormType(f64),
    Lr(f64),
    Momentum(f64),
    Keep(u64),
    EveryStepsCk(u64),
    EvalBatch(u64),
    Timeout(f64),
    ConnectTimeout(f64),
    BucketCap(f64),
    RendezvousTimeout(f64),
    StepSize(u64),
    Warmup(u64),
}

fn counts() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        1u64..5,
        Just(1 << 16),
        Just((1 << 16) + 1),
        Just(1 << 20),
        Just((1 << 20) + 1),
        Just(1 << 31),
        Just(1_000_000_000_000),
        Just(1_000_000_000_001),
        Just(u64::MAX),
    ]
}

fn small_i64() -> impl Strategy<Value = i64> {
    prop_oneof![
        Just(-1i64),
        Just(0),
        1i64..5,
        Just(1 << 20),
        Just((1 << 20) + 1),
        Just(i64::MAX),
    ]
}

fn reals() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(-1.0),
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(1e300),
        Just(0.5),
        Just(5.0),
        Just(86_400.0),
        Just(86_401.0),
        Just(4096.0),
        Just(4097.0),
    ]
}

fn workers() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0u32), 1u32..5, Just(1024), Just(1025), Just(u32::MAX)]
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        workers().prop_map(Change::Workers),
        workers().prop_map(Change::MinWorkers),
        workers().prop_map(Change::MaxWorkers),
        counts().prop_map(Change::Epochs),
        counts().prop_map(Change::MaxSteps),
        prop_oneof![
            Just("cpu".to_string()),
            Just("cuda:1023".into()),
            Just("cuda:1024".into()),
            Just("cuda:99999999999999999999".into()),
            Just("tpu".into()),
        ]
        .prop_map(Change::Device),
        workers().prop_map(Change::Threads),
        proptest::collection::vec(small_i64(), 0..3).prop_map(Change::Hidden),
        small_i64().prop_map(Change::NumClasses),
        counts().prop_map(Change::Batch),
        counts().prop_map(Change::Samples),
        counts().prop_map(Change::EvalSamples),
        proptest::collection::vec(small_i64(), 0..10).prop_map(Change::Shape),
        small_i64().prop_map(Change::Classes),
        counts().prop_map(Change::Steps),
        counts().prop_map(Change::GlobalBatch),
        reals().prop_map(Change::MaxNorm),
        reals().prop_map(Change::NormType),
        reals().prop_map(Change::Lr),
        reals().prop_map(Change::Momentum),
        counts().prop_map(Change::Keep),
        counts().prop_map(Change::EveryStepsCk),
        counts().prop_map(Change::EvalBatch),
        reals().prop_map(Change::Timeout),
        reals().prop_map(Change::ConnectTimeout),
        reals().prop_map(Change::BucketCap),
        reals().prop_map(Change::RendezvousTimeout),
        counts().prop_map(Change::StepSize),
        counts().prop_map(Change::Warmup),
    ]
}

fn apply(p: &mut v1::JobSpec, c: Change) {
    let data = p.data.get_or_insert_with(Default::default);
    match c {
        Change::Workers(n) => p.workers = Some(n),
        Change::MinWorkers(n) => p.min_workers = Some(n),
        Change::MaxWorkers(n) => p.max_workers = Some(n),
        Change::Epochs(n) => p.epochs = Some(n),
        Change::MaxSteps(n) => p.max_steps = Some(n),
        Change::Device(d) => p.device = d,
        Change::Threads(n) => p.threads = Some(n),
        Change::Hidden(h) => p.model.get_or_insert_with(Default::default).hidden = h,
        Change::NumClasses(n) => p.model.get_or_insert_with(Default::default).num_classes = Some(n),
        Change::Batch(n) => data.batch_size = n,
        Change::Samples(n) => data.samples = Some(n),
        Change::EvalSamples(n) => data.eval_samples = Some(n),
        Change::Shape(s) => data.shape = s,
        Change::Classes(n) => data.classes = Some(n),
        Change::Steps(n) => p.accumulation.get_or_insert_with(Default::default).steps = Some(n),
        Change::GlobalBatch(n) => {
            let a = p.accumulation.get_or_insert_with(Default::default);
            a.steps = None;
            a.global_batch = Some(n);
        }
        Change::MaxNorm(v) => p.clipping.get_or_insert_with(Default::default).max_norm = Some(v),
        Change::NormType(v) => p.clipping.get_or_insert_with(Default::default).norm_type = Some(v),
        Change::Lr(v) => p.optimizer.get_or_insert_with(Default::default).lr = v,
        Change::Momentum(v) => p.optimizer.get_or_insert_with(Default::default).momentum = v,
        Change::Keep(n) => p.checkpoint.get_or_insert_with(Default::default).keep = Some(n),
        Change::EveryStepsCk(n) => {
            p.checkpoint
                .get_or_insert_with(Default::default)
                .every_steps = n
        }
        Change::EvalBatch(n) => p.eval.get_or_insert_with(Default::default).batch_size = Some(n),
        Change::Timeout(v) => p.comm.get_or_insert_with(Default::default).timeout_s = Some(v),
        Change::ConnectTimeout(v) => {
            p.comm
                .get_or_insert_with(Default::default)
                .connect_timeout_s = Some(v)
        }
        Change::BucketCap(v) => p.comm.get_or_insert_with(Default::default).bucket_cap_mb = Some(v),
        Change::RendezvousTimeout(v) => {
            p.comm
                .get_or_insert_with(Default::default)
                .rendezvous_timeout_s = Some(v)
        }
        Change::StepSize(n) => p.schedule.get_or_insert_with(Default::default).step_size = Some(n),
        Change::Warmup(n) => p.schedule.get_or_insert_with(Default::default).warmup_steps = n,
    }
}

/// Every line of a refusal names a field, its value and what is allowed.
fn assert_field_errors(message: &str) -> Result<(), TestCaseError> {
    let mut lines = message.lines();
    prop_assert_eq!(lines.next(), Some("invalid job spec:"), "{}", message);
    let mut n = 0;
    for line in lines {
        let (field, rest) = line.trim().split_once(" = ").unwrap_or(("", ""));
        prop_assert!(
            !field.is_empty()
                && field
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || "._[]0123456789".contains(c)),
            "no field in {:?}",
            line
        );
        prop_assert!(rest.contains(": "), "no allowed range in {:?}", line);
        n += 1;
    }
    prop_assert!(n >= 1, "{}", message);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random specs through submit: a refusal names each bad field; an
    /// accepted job reaches a final state (its ranks finish, or it is
    /// cancelled while it waits for workers the cluster does not have) and
    /// every worker is free afterwards.
    #[test]
    fn any_spec_is_refused_by_field_or_runs_to_the_end(changes in proptest::collection::vec(change(), 0..4)) {
        let mut c = cluster();
        attach_all(&mut c, &WORKERS, 0);
        let mut p = spec("p", 1, "");
        for ch in changes {
            apply(&mut p, ch);
        }
        let now = 10;
        let job = match reply(&step_submit(&mut c, p, String::new(), now)) {
            Err(CoordError::InvalidArgument(msg)) => return assert_field_errors(&msg),
            Err(other) => return Err(TestCaseError::fail(format!("refused without a field: {other}"))),
            Ok(job) => job.id,
        };
        c.step(Input::Admit { job: job.clone() }, now);
        let j = c.job(&job).unwrap();
        match j.state() {
            JobState::Rendezvous => {
                // Every rank ends its thread and reports.
                let members = j.workers.clone();
                let generation = j.generation;
                for (rank, w) in members.iter().enumerate() {
                    deliver(&mut c, w, done(&job, generation, rank as u32, true), now + 1);
                }
            }
            JobState::Pending => {
                let wanted = j.spec.as_ref().and_then(|s| s.workers).unwrap_or(1) as usize;
                prop_assert!(wanted > WORKERS.len(), "a job of {} ranks waits with {} free workers", wanted, WORKERS.len());
                c.step(Input::Cancel { job: job.clone(), by: Caller::Anyone }, now + 1);
            }
            other => prop_assert!(false, "job in {:?} after submit", other),
        }
        prop_assert!(state::is_final(c.job(&job).unwrap().state()), "{:?}", c.job(&job).unwrap().state());
        for w in WORKERS {
            let x = c.worker(w).unwrap();
            prop_assert!(x.free(), "{} is not free: {:?}", w, x);
        }
        // The cluster still runs a next job.
        let next = submit(&mut c, spec("next", 3, ""), now + 2);
        prop_assert_eq!(c.job(&next).unwrap().state(), JobState::Rendezvous);
    }
}

/// Issue 14, confined paths: with roots configured, a path field that
/// leaves its root (`..`, an absolute path elsewhere) is refused at submit
/// with INVALID_ARGUMENT naming the field, the value and the root; nothing
/// is recorded. An accepted spec keeps its paths as submitted (each daemon
/// resolves relative ones under its own roots).
#[test]
fn paths_outside_their_roots_are_refused_at_submit() {
    let roots = accrue_common::spec::Roots {
        data: Some("/data".into()),
        model: Some("/models".into()),
        // The state dir, whose `checkpoints` folder holds the default
        // folders (reserved: a spec's folder may not lie there).
        checkpoint: Some("/state".into()),
    };
    let mut c = Cluster::new(
        Policy {
            heartbeat_ttl_ms: 60_000,
            state_dir: "/state".into(),
            max_job_memory: 8 << 30,
            roots,
            cwd: "/work".into(),
        },
        Box::new(|_: &str, _: u64| vec![7; 32]),
    );
    let with = |data: &str, ckpt: &str| {
        let text = format!(
            "name = \"p\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"tensors\"\npath = {data:?}\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n[checkpoint]\ndir = {ckpt:?}\n"
        );
        let s =
            accrue_common::JobSpec::fields_from_toml_str(&text, std::path::Path::new("t")).unwrap();
        accrue_proto::spec_to_proto(&s)
    };
    for (s, field, value) in [
        (
            with("train.safetensors", "/tmp/probe/outside/../escaped"),
            "checkpoint.dir",
            "/tmp/probe/outside/../escaped",
        ),
        (with("train.safetensors", "../x"), "checkpoint.dir", "../x"),
        (with("/etc/passwd", "run"), "data.path", "/etc/passwd"),
        (
            with("a/../../data2/t", "run"),
            "data.path",
            "a/../../data2/t",
        ),
    ] {
        let fx = step_submit(&mut c, s, String::new(), 1);
        let Err(CoordError::InvalidArgument(msg)) = reply(&fx) else {
            panic!("{field} = {value}: expected INVALID_ARGUMENT, got {fx:?}");
        };
        assert!(
            msg.contains(&format!("{field} = \"{value}\": must lie under")),
            "{msg}"
        );
        assert!(msg.contains("root"), "{msg}");
        assert!(!fx.iter().any(|e| matches!(e, Effect::Save(_))), "{fx:?}");
    }
    assert!(c.jobs().next().is_none(), "nothing recorded");
    // Inside: accepted, the paths kept as submitted.
    let id = submit(&mut c, with("train.safetensors", "run/../run2"), 2);
    let job = c.job(&id).unwrap();
    let s = job.spec.as_ref().unwrap();
    assert_eq!(
        s.data.as_ref().unwrap().path.as_deref(),
        Some("train.safetensors")
    );
    assert_eq!(
        s.checkpoint.as_ref().unwrap().dir.as_deref(),
        Some("run/../run2")
    );
}
