use super::*;
use crate::store::StoreError;
use accrue_proto::v1::{coordinator_message, worker_message, JobState, WorkerMessage};

/// A store that writes in the background and has not got far: jobs are
/// kept in memory, durable only as far as the test advances `progress`
/// (the etcd writer while etcd is slow or away).
#[derive(Default, Clone)]
struct Behind {
    jobs: Arc<Mutex<BTreeMap<String, Job>>>,
    series: Arc<Mutex<BTreeMap<String, v1::JobSeries>>>,
    deleted: Arc<Mutex<Vec<String>>>,
    progress: Arc<WriteProgress>,
}

impl JobStore for Behind {
    fn put(&self, job: &Job) -> Result<u64, StoreError> {
        lock(&self.jobs).insert(job.id.clone(), job.clone());
        Ok(self.progress.issue())
    }
    fn delete(&self, id: &str) -> Result<u64, StoreError> {
        lock(&self.jobs).remove(id);
        lock(&self.deleted).push(id.to_string());
        Ok(self.progress.issue())
    }
    fn list(&self) -> Result<Vec<Job>, StoreError> {
        Ok(lock(&self.jobs).values().cloned().collect())
    }
    fn put_series(&self, s: &v1::JobSeries) -> Result<u64, StoreError> {
        lock(&self.series).insert(s.job_id.clone(), s.clone());
        Ok(self.progress.issue())
    }
    fn list_series(&self) -> Result<Vec<v1::JobSeries>, StoreError> {
        Ok(lock(&self.series).values().cloned().collect())
    }
    fn progress(&self) -> Arc<WriteProgress> {
        self.progress.clone()
    }
}

fn spec() -> v1::JobSpec {
    crate::test_specs::mlp_spec(
        "name = \"held\"\nworkers = 2\nmax_steps = 6",
        4,
        crate::test_specs::SGD,
    )
}

type Inbox = mpsc::UnboundedReceiver<Result<CoordinatorMessage, Status>>;

fn attach(c: &Coordinator, id: &str) -> (Inbox, u64) {
    let (tx, rx) = mpsc::unbounded_channel();
    let hello = v1::WorkerHello {
        worker_id: id.into(),
        data_addr: format!("127.0.0.1:{}", 7000 + id.len()),
        ..Default::default()
    };
    let conn = c.attach(hello, tx).unwrap();
    (rx, conn)
}

fn assigned(rx: &mut Inbox) -> Option<v1::Assignment> {
    match rx.try_recv().ok()?.unwrap().msg {
        Some(coordinator_message::Msg::Assign(a)) => Some(a),
        other => panic!("expected an assignment, got {other:?}"),
    }
}

fn behind(
    durable_timeout: Duration,
) -> (
    Arc<Coordinator>,
    Arc<WriteProgress>,
    Arc<Mutex<Vec<String>>>,
) {
    let store = Behind::default();
    let (progress, deleted) = (store.progress.clone(), store.deleted.clone());
    let cfg = Config {
        durable_timeout,
        ..Default::default()
    };
    (
        Coordinator::new(cfg, Box::new(store)).unwrap(),
        progress,
        deleted,
    )
}

/// Submits in the background; returns once the submission's write is
/// queued.
async fn submitting(
    c: &Arc<Coordinator>,
    progress: &WriteProgress,
) -> tokio::task::JoinHandle<Result<Job, CoordError>> {
    let before = progress.issued();
    let c2 = c.clone();
    let t = tokio::spawn(async move { c2.submit(spec()).await });
    while progress.issued() == before {
        tokio::task::yield_now().await;
    }
    t
}

#[tokio::test]
async fn assignments_wait_until_their_generation_is_durable() {
    let (c, progress, _) = behind(Duration::from_secs(30));
    let ((mut rx0, _), (mut rx1, _)) = (attach(&c, "w0"), attach(&c, "w1"));
    let t = submitting(&c, &progress).await;
    // Only the submission is written; it is not scheduled before it is
    // durable.
    assert_eq!(c.jobs()[0].state(), JobState::Pending);
    progress.advance(1);
    let job = t.await.unwrap().unwrap();
    // Formed in memory (generation 1 written as ticket 2), but no
    // worker hears of it yet.
    assert_eq!((job.state(), job.generation), (JobState::Rendezvous, 1));
    assert_eq!(progress.issued(), 2);
    assert_eq!(c.held_messages(), 2);
    assert!(assigned(&mut rx0).is_none() && assigned(&mut rx1).is_none());
    // The generation is durable: both ranks get it, nothing stays held.
    progress.advance(2);
    let a0 = assigned(&mut rx0).expect("rank 0 assigned");
    let a1 = assigned(&mut rx1).expect("rank 1 assigned");
    assert_eq!((a0.generation, a0.rank, a1.rank), (1, 0, 1));
    assert_eq!(c.held_messages(), 0);
}

#[tokio::test]
async fn a_message_without_a_write_keeps_its_place_behind_held_ones() {
    let (c, progress, _) = behind(Duration::from_secs(30));
    let ((mut rx0, conn0), _w1) = (attach(&c, "w0"), attach(&c, "w1"));
    let t = submitting(&c, &progress).await;
    progress.advance(1);
    let job = t.await.unwrap().unwrap();
    // A report for a job this coordinator does not know: refused, with
    // no write of its own. It must not overtake the held assignment.
    c.on_message(
        "w0",
        conn0,
        WorkerMessage {
            msg: Some(worker_message::Msg::Step(v1::StepReport {
                job_id: "nope".into(),
                ..Default::default()
            })),
            ..Default::default()
        },
    );
    assert!(rx0.try_recv().is_err());
    progress.advance(progress.issued());
    assert_eq!(assigned(&mut rx0).unwrap().job_id, job.id);
    match rx0.try_recv().unwrap().unwrap().msg {
        Some(coordinator_message::Msg::Refused(r)) => assert_eq!(r.job_id, "nope"),
        other => panic!("expected the refusal second, got {other:?}"),
    }
}

/// Defect 6: a leader whose store does not take the write answers
/// UNAVAILABLE within the bound, naming why, and the job is gone (taken
/// back in memory and in the store).
#[tokio::test]
async fn a_submission_that_cannot_be_made_durable_is_refused_in_time() {
    let (c, progress, deleted) = behind(Duration::from_millis(300));
    let _w = (attach(&c, "w0"), attach(&c, "w1"));
    let started = std::time::Instant::now();
    let err = c.submit(spec()).await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(err.grpc_code(), tonic::Code::Unavailable);
    assert!(
        err.to_string().contains("not durable within 0.3 s"),
        "{err}"
    );
    assert!(c.jobs().is_empty());
    assert_eq!(lock(&deleted).len(), 1);
    assert_eq!(c.held_messages(), 0, "nothing was decided for it");
    // Once the store catches up, submissions are taken again.
    progress.advance(progress.issued());
    let t = submitting(&c, &progress).await;
    progress.advance(progress.issued());
    assert!(t.await.unwrap().is_ok());
}

fn msg_of(m: worker_message::Msg) -> WorkerMessage {
    WorkerMessage {
        msg: Some(m),
        ..Default::default()
    }
}

/// Issue 16: the training curve is kept per step, written beside the job
/// (not on every step: when it ends, or every few seconds), and a
/// coordinator that takes the store over shows it again; every rank's
/// report gives its worker's share of the throughput.
#[tokio::test]
async fn a_jobs_series_is_stored_with_it_and_taken_back() {
    let store = Behind::default();
    let cfg = Config {
        durable_timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let c = Coordinator::new(cfg.clone(), Box::new(store.clone())).unwrap();
    let progress = store.progress.clone();
    let ((_rx0, conn0), (_rx1, conn1)) = (attach(&c, "w0"), attach(&c, "w1"));
    let t = submitting(&c, &progress).await;
    progress.advance(progress.issued());
    let job = t.await.unwrap().unwrap();
    progress.advance(progress.issued());
    for step in 1..=6u64 {
        for (w, conn, rank) in [("w0", conn0, 0), ("w1", conn1, 1)] {
            let r = v1::StepReport {
                job_id: job.id.clone(),
                generation: 1,
                rank,
                step,
                total_steps: 6,
                loss: if step == 3 {
                    f64::NAN
                } else {
                    1.0 / step as f64
                },
                skipped: step == 3,
                grad_norm: 2.0,
                samples_per_sec: 800.0,
                ..Default::default()
            };
            c.on_message(w, conn, msg_of(worker_message::Msg::Step(r)));
        }
    }
    let (buckets, skipped, w1) = c.with_cluster(|cl| {
        let s = cl.series(&job.id).unwrap();
        (
            s.buckets.len(),
            s.skipped.clone(),
            cl.worker("w1").unwrap().step,
        )
    });
    assert_eq!(buckets, 6);
    assert_eq!(skipped, [v1::StepRange { first: 3, last: 3 }]);
    assert_eq!(
        w1,
        Some((6, 400.0)),
        "rank 1's share of 800 samples/s over 2 ranks"
    );
    assert!(lock(&store.series).is_empty(), "not written on every step");
    let done = v1::JobDone {
        job_id: job.id.clone(),
        generation: 1,
        rank: 0,
        ok: true,
        step: 6,
        total_steps: 6,
        ..Default::default()
    };
    c.on_message("w0", conn0, msg_of(worker_message::Msg::Done(done)));
    assert_eq!(c.job(&job.id).unwrap().state(), JobState::Succeeded);
    let stored = lock(&store.series)
        .get(&job.id)
        .cloned()
        .expect("written when the job ended");
    assert_eq!((stored.version, stored.buckets.len()), (6, 6));
    c.close();
    // Another coordinator over the same store.
    let c2 = Coordinator::new(cfg, Box::new(store.clone())).unwrap();
    let again = c2.with_cluster(|cl| cl.series(&job.id).cloned()).unwrap();
    assert_eq!(again, stored);
}

/// A message from a connection that was replaced is not taken.
#[tokio::test]
async fn only_the_current_connection_speaks_for_a_worker() {
    let (c, progress, _) = behind(Duration::from_secs(30));
    let ((_rx0, old), _w1) = (attach(&c, "w0"), attach(&c, "w1"));
    let t = submitting(&c, &progress).await;
    progress.advance(progress.issued());
    let job = t.await.unwrap().unwrap();
    progress.advance(progress.issued());
    let (mut rx_new, new) = attach(&c, "w0");
    assert_ne!(old, new);
    // The old stream's late "done" changes nothing.
    let done = WorkerMessage {
        msg: Some(worker_message::Msg::Done(v1::JobDone {
            job_id: job.id.clone(),
            generation: 1,
            rank: 0,
            ok: false,
            error: "late".into(),
            ..Default::default()
        })),
        ..Default::default()
    };
    c.on_message("w0", old, done);
    assert_ne!(c.job(&job.id).unwrap().state(), JobState::Failed);
    assert!(rx_new.try_recv().is_err());
}

/// Issue 14, confined paths: the coordinator does not start when its
/// default checkpoint folder (`<state-dir>/checkpoints`) lies outside
/// `--checkpoint-root`, and names both; inside it, the roots come back
/// absolute.
#[test]
fn the_default_checkpoint_folder_must_lie_under_the_checkpoint_root() {
    let t = tempfile::tempdir().unwrap();
    let cfg = |state: &str, root: &str| Config {
        state_dir: t.path().join(state),
        roots: accrue_common::spec::Roots {
            checkpoint: Some(t.path().join(root)),
            ..Default::default()
        },
        ..Default::default()
    };
    let e = cfg("state", "elsewhere").with_checked_roots().unwrap_err();
    let text = e.to_string();
    assert!(text.starts_with("--checkpoint-root "), "{text}");
    assert!(text.contains("state/checkpoints"), "{text}");
    // The state dir itself as the root, or its checkpoints folder: fine.
    for root in [
        "state",
        "state/checkpoints",
        "state/./checkpoints/../checkpoints",
    ] {
        let ok = cfg("state", root).with_checked_roots().unwrap();
        let got = ok.roots.checkpoint.unwrap();
        assert!(
            got.is_absolute() && !got.to_string_lossy().contains(".."),
            "{got:?}"
        );
    }
    // A symlinked checkpoints folder that leads out is refused too.
    std::fs::create_dir_all(t.path().join("state")).unwrap();
    std::fs::create_dir_all(t.path().join("out")).unwrap();
    std::os::unix::fs::symlink(t.path().join("out"), t.path().join("state/checkpoints")).unwrap();
    assert!(cfg("state", "state").with_checked_roots().is_err());
    // No checkpoint root: nothing to check.
    assert!(Config::default().with_checked_roots().is_ok());
}

/// Issue 43: GetJob, WatchJob and GetSeries carry what the HTTP JSON has
/// for a language model: its unit, tokens/s and tokens seen, and each
/// evaluation's perplexity (exp of its loss per token) and tokens; an MLP
/// job has its unit and none of the token fields.
#[tokio::test]
async fn a_language_models_job_reads_in_tokens_and_perplexity() {
    use tokio_stream::StreamExt;
    let text = r#"
name = "lm"
max_steps = 4
[model]
kind = "llama"
vocab_size = 64
hidden_size = 16
intermediate_size = 32
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
max_position_embeddings = 16
[data]
kind = "tokens"
path = "/nowhere/train.bin"
seq_len = 8
batch_size = 4
[optimizer]
kind = "adamw"
lr = 0.01
"#;
    let lm =
        accrue_common::JobSpec::fields_from_toml_str(text, std::path::Path::new("t.toml")).unwrap();
    let (c, progress, _) = behind(Duration::from_secs(30));
    let (_rx, conn) = attach(&c, "w0");
    let t = {
        let c2 = c.clone();
        let before = progress.issued();
        let t = tokio::spawn(async move { c2.submit(accrue_proto::spec_to_proto(&lm)).await });
        while progress.issued() == before {
            tokio::task::yield_now().await;
        }
        t
    };
    progress.advance(progress.issued());
    let job = t.await.unwrap().unwrap();
    progress.advance(progress.issued());
    let mut events = Box::pin(c.watch(&job.id).unwrap());
    let r = v1::StepReport {
        job_id: job.id.clone(),
        generation: 1,
        step: 1,
        total_steps: 4,
        loss: 3.0,
        samples: 128,
        samples_seen: 128,
        samples_per_sec: 2500.0,
        ..Default::default()
    };
    c.on_message("w0", conn, msg_of(worker_message::Msg::Step(r)));
    let e = v1::EvalResult {
        step: 1,
        loss: 2.0,
        samples: 96,
        ..Default::default()
    };
    let ev = WorkerMessage {
        job_id: job.id.clone(),
        generation: 1,
        ..msg_of(worker_message::Msg::Eval(e))
    };
    c.on_message("w0", conn, ev);
    let got = c.job(&job.id).unwrap();
    assert_eq!(got.unit, "tokens");
    let counters = got.counters.unwrap();
    assert_eq!(counters.tokens_per_sec, Some(2500.0));
    assert_eq!(counters.tokens_seen, Some(128));
    let eval = got.eval.unwrap();
    assert!((eval.perplexity.unwrap() - 2f64.exp()).abs() < 1e-12);
    assert_eq!(eval.tokens, Some(96));
    // The watch: the snapshot, then the step and the evaluation, each job
    // as a reader sees it.
    let mut seen_eval = None;
    for _ in 0..8 {
        let ev = events.next().await.unwrap().unwrap();
        assert_eq!(ev.job.as_ref().unwrap().unit, "tokens");
        if let Some(v1::job_event::Event::Eval(e)) = ev.event {
            seen_eval = Some(e);
            break;
        }
    }
    let seen_eval = seen_eval.expect("an evaluation event");
    assert_eq!(seen_eval.perplexity, eval.perplexity);
    let series = c.series(&job.id, 0, 0).unwrap();
    assert_eq!((series.unit.as_str(), series.points.len()), ("tokens", 1));
    assert_eq!(series.evals[0].eval.unwrap().perplexity, eval.perplexity);
    assert!(matches!(
        c.series(&job.id, 0, 1),
        Err(CoordError::InvalidArgument(m)) if m.contains("allowed 2..=10000")
    ));
    // Another kind of job: samples, no token field.
    let (_rx1, _c1) = attach(&c, "w1");
    let before = progress.issued();
    let c2 = c.clone();
    let t = tokio::spawn(async move { c2.submit(spec()).await });
    while progress.issued() == before {
        tokio::task::yield_now().await;
    }
    progress.advance(progress.issued());
    let mlp = c.job(&t.await.unwrap().unwrap().id).unwrap();
    assert_eq!(mlp.unit, "samples");
    assert!(mlp.counters.is_none_or(|c| c.tokens_per_sec.is_none()));
}
