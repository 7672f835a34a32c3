/// Issue 13 (started): a panic in a job's thread is a failed JobDone
/// naming it, for the generation the thread was in; nothing is sent
/// when the job ends normally.
#[test]
fn a_panicking_job_thread_fails_the_job_instead_of_taking_the_daemon_down() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let current: Current = Arc::new(Mutex::new(Some(("j-1".into(), 3, 1))));
    guarded("j-1", (1, 0), &current, &tx, || {
        panic!("boom at step {}", 7)
    });
    let m = rx.try_recv().expect("a JobDone");
    match m.msg {
        Some(worker_message::Msg::Done(d)) => {
            assert_eq!(
                (d.job_id.as_str(), d.generation, d.rank, d.ok),
                ("j-1", 3, 1, false)
            );
            assert_eq!(d.error, "the job thread panicked: boom at step 7");
        }
        other => panic!("expected a JobDone, got {other:?}"),
    }
    assert!(current.lock().unwrap().is_none(), "no longer in the job");
    guarded("j-2", (1, 0), &current, &tx, || {});
    assert!(rx.try_recv().is_err());
}

use super::assign::{assigned_checkpoint_dir, assigned_spec};
use super::job::{guarded, step_msg};
use super::outbox::OUTBOX_CAP;
use super::*;
use crate::engine::StepReport;
use accrue_proto::v1;
use std::sync::Mutex;

fn cfg() -> DaemonConfig {
    DaemonConfig {
        coordinator: "http://127.0.0.1:1".into(),
        worker_id: "w".into(),
        listen_data: "127.0.0.1:0".into(),
        advertise_data: None,
        device: None,
        threads: None,
        data_root: None,
        model_root: None,
        checkpoint_root: None,
        heartbeat: Duration::from_secs(1),
        sample_log: None,
        micro_step_delay: None,
        etcd: Vec::new(),
        cluster: "c".into(),
        max_job_memory: 1 << 30,
        tls: None,
        etcd_tls: None,
        stop_timeout: Duration::from_secs(30),
    }
}

/// An assignment of a job that fixes global_batch = 96 with b = 8 (so
/// k = 6 at W = 2, 4 at W = 3), with the coordinator's k.
fn assignment(world: u32, k: u32) -> v1::Assignment {
    let text = "name = \"elastic\"\nworkers = 2\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 8\n[accumulation]\nglobal_batch = 96\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
    let spec = crate::spec::JobSpec::from_toml_str(text, std::path::Path::new("t")).unwrap();
    v1::Assignment {
        job_id: "j1".into(),
        generation: 2,
        world_size: world,
        accumulation_steps: k,
        spec: Some(accrue_proto::spec_to_proto(&spec)),
        ..Default::default()
    }
}

#[test]
fn k_comes_from_the_assignment() {
    // Whatever the spec would derive, the assignment's k is used.
    for (world, k) in [(2, 6), (3, 4), (2, 5)] {
        let spec = assigned_spec(&assignment(world, k), &cfg()).unwrap();
        assert_eq!(spec.accumulation.steps, Some(u64::from(k)));
        assert_eq!(spec.accumulation.global_batch, None);
        assert_eq!(spec.accumulation_steps(u64::from(world)), Ok(u64::from(k)));
    }
}

fn step(n: u64) -> WorkerMessage {
    step_msg(
        "j",
        1,
        0,
        &StepReport {
            step: n,
            total_steps: 10,
            epoch: 0,
            micro_step: n,
            loss: 0.0,
            grad_norm: 0.0,
            clip_coef: 1.0,
            skipped: false,
            skip_reason: None,
            samples: 8,
            samples_seen: 8 * n,
            lr: 0.1,
            samples_per_sec: 0.0,
            timing: Default::default(),
            bytes_sent: 0,
            bytes_received: 0,
            job_bytes_sent: 0,
            job_bytes_received: 0,
            loss_scale: 0.0,
            graph_replays: 0,
            eager_reason: None,
            sync_graph_replayed: false,
            sync_eager_reason: None,
            resumed_from: String::new(),
            peak_rss_bytes: 0,
        },
    )
}

fn done(step: u64) -> WorkerMessage {
    wrap(worker_message::Msg::Done(v1::JobDone {
        job_id: "j".into(),
        ok: true,
        step,
        ..Default::default()
    }))
}

fn drain(rx: &mut mpsc::UnboundedReceiver<WorkerMessage>) -> Vec<WorkerMessage> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

#[test]
fn a_message_a_dead_stream_refused_goes_first_on_the_next_one() {
    let mut outbox = Outbox::default();
    // The stream dies: its receiver is gone.
    let (dead, rx) = mpsc::unbounded_channel();
    drop(rx);
    assert!(!outbox.send(&dead, step(1)));
    assert!(!outbox.send(&dead, done(1)));
    assert_eq!(outbox.len(), 2);
    // The next stream: hello first, then the kept messages in order,
    // then new ones.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let hello = wrap(worker_message::Msg::Hello(v1::WorkerHello::default()));
    tx.send(hello.clone()).unwrap();
    assert!(outbox.flush(&tx));
    assert!(outbox.send(&tx, step(2)));
    assert_eq!(outbox.len(), 0);
    assert_eq!(drain(&mut rx), vec![hello, step(1), done(1), step(2)]);
}

#[test]
fn a_full_outbox_drops_step_reports_never_the_job_done() {
    let mut outbox = Outbox::default();
    let (dead, rx) = mpsc::unbounded_channel();
    drop(rx);
    assert!(!outbox.send(&dead, done(7)));
    for n in 0..OUTBOX_CAP as u64 + 5 {
        assert!(!outbox.send(&dead, step(n)));
    }
    assert_eq!(outbox.len(), OUTBOX_CAP);
    let (tx, mut rx) = mpsc::unbounded_channel();
    assert!(outbox.flush(&tx));
    let got = drain(&mut rx);
    assert_eq!(got.len(), OUTBOX_CAP);
    assert_eq!(got[0], done(7));
    // The oldest reports went: 0..=5 dropped, 6 is the first kept.
    assert_eq!(got[1], step(6));
    assert_eq!(got[OUTBOX_CAP - 1], step(OUTBOX_CAP as u64 + 4));
}

#[test]
fn an_assignment_with_k_zero_is_refused() {
    let err = assigned_spec(&assignment(2, 0), &cfg()).unwrap_err();
    assert_eq!(
        err,
        "assignment of job j1 generation 2 has accumulation_steps = 0 (k must be >= 1)"
    );
}

#[test]
fn an_assignment_above_this_workers_memory_limit_is_refused_before_it_allocates() {
    let ok = assigned_spec(&assignment(2, 6), &cfg());
    assert!(ok.is_ok(), "{ok:?}");
    let small = DaemonConfig {
        max_job_memory: 1024,
        ..cfg()
    };
    let err = assigned_spec(&assignment(2, 6), &small).unwrap_err();
    assert!(
        err.contains("data.samples = an estimated")
            && err.contains("at most 0.00 GiB")
            && err.ends_with("(this worker's limit)"),
        "{err}"
    );
}

/// Issue 14, confined paths: the daemon checks every path of an
/// assignment against its own roots before opening anything, following
/// the symlinks it sees (which the coordinator may not); relative paths
/// resolve under its roots.
#[test]
fn assignments_are_confined_under_the_daemons_roots() {
    let t = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(t.path()).unwrap();
    for d in ["data", "ckpt", "outside"] {
        std::fs::create_dir_all(base.join(d)).unwrap();
    }
    std::os::unix::fs::symlink(base.join("outside"), base.join("ckpt/sneaky")).unwrap();
    let mut c = cfg();
    c.data_root = Some(base.join("data"));
    c.checkpoint_root = Some(base.join("ckpt"));
    let tensors = |path: &str, ckpt: &str| {
        let text = format!(
            "name = \"p\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"tensors\"\npath = {path:?}\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n"
        );
        let spec =
            crate::spec::JobSpec::fields_from_toml_str(&text, std::path::Path::new("t")).unwrap();
        v1::Assignment {
            job_id: "p-1".into(),
            generation: 1,
            world_size: 1,
            accumulation_steps: 1,
            checkpoint_dir: ckpt.into(),
            spec: Some(accrue_proto::spec_to_proto(&spec)),
            ..Default::default()
        }
    };
    let ok = tensors("train.safetensors", "run");
    let spec = assigned_spec(&ok, &c).unwrap();
    assert_eq!(spec.data.path, Some(base.join("data/train.safetensors")));
    assert_eq!(
        assigned_checkpoint_dir(&ok, &c).unwrap(),
        Some(base.join("ckpt/run"))
    );
    let e = assigned_spec(&tensors("../outside/x", "run"), &c).unwrap_err();
    assert!(
        e.contains("data.path = \"../outside/x\": must lie under"),
        "{e}"
    );
    assert!(e.contains("refused by worker w"), "{e}");
    let e = assigned_checkpoint_dir(&tensors("t", "sneaky/new"), &c).unwrap_err();
    assert!(e.contains("checkpoint.dir = \"sneaky/new\""), "{e}");
    assert!(
        e.contains(&base.join("outside").display().to_string()),
        "{e}"
    );
    // Without roots: as before (relative paths kept, nothing refused).
    let plain = cfg();
    let any = tensors("../outside/x", "sneaky/new");
    assert_eq!(
        assigned_spec(&any, &plain).unwrap().data.path,
        Some("../outside/x".into())
    );
    assert_eq!(
        assigned_checkpoint_dir(&any, &plain).unwrap(),
        Some("sneaky/new".into())
    );
}

/// Issue 38: an assignment whose mesh coordinates are not where the
/// spec's `[parallel]` puts its rank is refused naming both; matching or
/// absent ones (an older coordinator) are taken.
#[test]
fn mesh_coordinates_must_match_the_spec() {
    let mut a = assignment(2, 6);
    a.rank = 1;
    assert!(assigned_spec(&a, &cfg()).is_ok());
    let at = |data| v1::MeshCoords {
        data,
        pipeline: 0,
        tensor: 0,
        data_degree: 2,
        pipeline_degree: 1,
        tensor_degree: 1,
    };
    a.coords = Some(at(1));
    assert!(assigned_spec(&a, &cfg()).is_ok());
    a.coords = Some(at(0));
    let e = assigned_spec(&a, &cfg()).unwrap_err();
    assert_eq!(
        e,
        "assignment of job j1 generation 2: rank 1 of 2 is at (data, pipeline, tensor) = (1, 0, 0) of a (2, 1, 1) mesh by the spec's [parallel], the coordinator says (0, 0, 0) of (2, 1, 1)"
    );
}

/// A `model.init` folder under `--model-root` whose index names a shard
/// that is a symlink out of the root: refused before anything is opened,
/// naming the shard, where it leads and the root; a shard linked inside
/// the root is fine.
#[test]
fn a_shard_linked_out_of_the_model_root_is_refused() {
    use std::os::unix::fs::symlink;
    let t = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(t.path()).unwrap();
    let (models, outside) = (base.join("models"), base.join("outside"));
    let folder = models.join("sharded");
    for d in [&folder, &outside, &models.join("blobs")] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(
        folder.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    std::fs::write(models.join("blobs/one"), "x").unwrap();
    symlink(
        "../blobs/one",
        folder.join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    let shard = folder.join("model-00002-of-00002.safetensors");
    std::fs::write(outside.join("two"), "x").unwrap();
    symlink(outside.join("two"), &shard).unwrap();
    let mut c = cfg();
    c.model_root = Some(models.clone());
    let text = "name = \"p\"\n[model]\nkind = \"mlp\"\ninit = \"sharded\"\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
    let spec = crate::spec::JobSpec::fields_from_toml_str(text, std::path::Path::new("t")).unwrap();
    let a = v1::Assignment {
        job_id: "p-1".into(),
        generation: 1,
        world_size: 1,
        accumulation_steps: 1,
        spec: Some(accrue_proto::spec_to_proto(&spec)),
        ..Default::default()
    };
    let e = assigned_spec(&a, &c).unwrap_err();
    for part in [
        format!(
            "model.init = {:?}: must lie under",
            shard.display().to_string()
        ),
        models.display().to_string(),
        format!("resolves to {}", outside.join("two").display()),
        "refused by worker w".into(),
    ] {
        assert!(e.contains(&part), "{e:?} lacks {part:?}");
    }
    // Linked inside the root instead: accepted, as before.
    std::fs::remove_file(&shard).unwrap();
    std::fs::write(models.join("blobs/two"), "x").unwrap();
    symlink("../blobs/two", &shard).unwrap();
    let spec = assigned_spec(&a, &c).unwrap();
    assert_eq!(spec.model.init, Some(folder));
}
