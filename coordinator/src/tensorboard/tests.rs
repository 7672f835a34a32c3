use super::events::*;
use super::*;
use prost::Message;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn crc32c_matches_the_check_value_and_tensorboards_mask() {
    assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    assert_eq!(crc32c(b""), 0);
    // tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c.
    assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
}

#[test]
fn a_record_is_framed_as_tensorboards_record_writer_frames_it() {
    // tensorboard.summary.writer.record_writer.RecordWriter().write(b"hello").
    let mut out = Vec::new();
    frame(b"hello", &mut out);
    assert_eq!(out, hex("0500000000000000eab2043e68656c6c6fbb1f1c19"));
    frame(b"", &mut out);
    assert_eq!(
        read_records(&out).unwrap(),
        vec![b"hello".to_vec(), Vec::new()]
    );
}

#[test]
fn a_damaged_or_torn_record_is_refused() {
    let mut out = Vec::new();
    frame(b"hello", &mut out);
    frame(b"world", &mut out);
    let mut bad = out.clone();
    bad[13] ^= 1; // the first payload
    assert!(read_records(&bad)
        .unwrap_err()
        .contains("record 0: the payload"));
    let mut bad = out.clone();
    bad[21 + 2] ^= 1; // the second record's length
    assert!(read_records(&bad)
        .unwrap_err()
        .contains("record 1: the length"));
    assert!(read_records(&out[..out.len() - 1]).is_err());
    assert!(read_records(&out[..25]).is_err());
}

#[test]
fn events_encode_as_tensorboards_protobuf_does() {
    // event_pb2.Event(...).SerializeToString() with TensorBoard 2.21.
    let v = version_event(1.5).encode_to_vec();
    assert_eq!(v, hex("09000000000000f83f1a0d627261696e2e4576656e743a32"));
    let s = scalars_event(1.5, 7, &[("train/loss", 0.25)]).encode_to_vec();
    assert_eq!(
        s,
        hex("09000000000000f83f10072a130a110a0a747261696e2f6c6f7373150000803e")
    );
    // plugins.text: metadata.create_summary_metadata and a scalar
    // DT_STRING TensorProto.
    let t = text_event(1.5, 0, "spec", "hi").encode_to_vec();
    assert_eq!(
        t,
        hex("09000000000000f83f2a1c0a1a0a0473706563420808071200420268694a080a060a0474657874")
    );
    // A scalar of 0 is still written.
    let z = Event::decode(&*scalars_event(0.0, 0, &[("a", 0.0)]).encode_to_vec()).unwrap();
    assert_eq!(z.summary.unwrap().value[0].simple_value, Some(0.0));
}

#[test]
fn file_names_are_as_tensorflow_names_them() {
    assert_eq!(
        file_name(1_700_000_000, "host-a", 42, 3),
        "events.out.tfevents.1700000000.host-a.42.3"
    );
    assert_eq!(
        file_name(5, "h", 1, 0),
        "events.out.tfevents.0000000005.h.1.0"
    );
    let h = host_name();
    assert!(!h.is_empty() && !h.contains('/'), "{h}");
}

fn report(step: u64) -> StepReport {
    StepReport {
        job_id: "j-1".into(),
        step,
        loss: 1.25,
        grad_norm: 3.0,
        clip_coef: 0.5,
        lr: 0.1,
        samples_per_sec: 1000.0,
        ..Default::default()
    }
}

#[test]
fn a_step_becomes_its_training_scalars() {
    let tags = |v: &[(&'static str, f64)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
    let v = step_scalars(&report(4), false, 2);
    assert_eq!(
        tags(&v),
        [
            "train/loss",
            "train/grad_norm",
            "train/clip_coef",
            "train/lr",
            "train/samples_per_sec",
            "train/skipped_steps"
        ]
    );
    assert_eq!(v[0].1, 1.25);
    assert_eq!(v[5].1, 2.0);
    let lm = step_scalars(
        &StepReport {
            loss_scale: 65536.0,
            ..report(4)
        },
        true,
        0,
    );
    assert!(tags(&lm).contains(&"train/tokens_per_sec"));
    assert!(!tags(&lm).contains(&"train/samples_per_sec"));
    assert_eq!(lm.last(), Some(&("train/loss_scale", 65536.0)));
}

#[test]
fn an_evaluation_becomes_loss_accuracy_and_for_a_language_model_perplexity() {
    let e = EvalResult {
        step: 9,
        loss: 2.0,
        accuracy: 0.75,
        samples: 64,
        ..Default::default()
    };
    assert_eq!(
        eval_scalars(&e, false),
        [("eval/loss", 2.0), ("eval/accuracy", 0.75)]
    );
    let lm = eval_scalars(&e, true);
    assert_eq!(lm[2], ("eval/perplexity", 2f64.exp()));
    let inf = EvalResult { loss: 1e6, ..e };
    assert_eq!(eval_scalars(&inf, true).len(), 2, "no infinite perplexity");
}

fn job(id: &str, kind: v1::ModelKind, skipped: u64, state: v1::JobState) -> v1::Job {
    let mut j = v1::Job {
        id: id.into(),
        spec: Some(v1::JobSpec {
            model: Some(v1::ModelSpec {
                kind: kind as i32,
                ..Default::default()
            }),
            ..Default::default()
        }),
        counters: Some(v1::Counters {
            skipped_steps: skipped,
            ..Default::default()
        }),
        ..Default::default()
    };
    j.set_state(state);
    j
}

#[test]
fn steps_evaluations_and_final_transitions_are_points_and_nothing_else_is() {
    let j = job("a-1", v1::ModelKind::Llama, 3, v1::JobState::Running);
    let ev = |event| JobEvent {
        job: Some(j.clone()),
        event: Some(event),
    };
    match point_of(&ev(job_event::Event::Step(report(5)))) {
        Some(Point::Scalars { job, step, values }) => {
            assert_eq!((job.as_str(), step), ("a-1", 5));
            assert!(values.contains(&("train/tokens_per_sec", 1000.0)));
            assert!(values.contains(&("train/skipped_steps", 3.0)));
        }
        p => panic!("{p:?}"),
    }
    let e = EvalResult {
        step: 6,
        loss: 1.0,
        ..Default::default()
    };
    match point_of(&ev(job_event::Event::Eval(e))) {
        Some(Point::Scalars { step, values, .. }) => {
            assert_eq!(step, 6);
            assert!(values.iter().any(|v| v.0 == "eval/perplexity"));
        }
        p => panic!("{p:?}"),
    }
    let t = |to: v1::JobState| {
        let mut t = v1::Transition::default();
        t.set_to(to);
        ev(job_event::Event::Transition(t))
    };
    assert_eq!(
        point_of(&t(v1::JobState::Succeeded)),
        Some(Point::End { job: "a-1".into() })
    );
    assert_eq!(point_of(&t(v1::JobState::Recovering)), None);
    assert_eq!(
        point_of(&JobEvent {
            job: Some(j.clone()),
            event: None
        }),
        None
    );
}

#[test]
fn only_plain_job_ids_name_a_run_folder() {
    let root = Path::new("/tb");
    assert_eq!(
        run_dir(root, "digits-3"),
        Some(PathBuf::from("/tb/digits-3"))
    );
    for bad in ["", ".", "..", "a/b", "../x", "/abs", "a\\b", "a\0b"] {
        assert_eq!(run_dir(root, bad), None, "{bad:?}");
    }
}

fn a_spec() -> v1::JobSpec {
    crate::test_specs::mlp_spec(
        "name = \"tb-spec\"\nworkers = 1\nmax_steps = 4",
        8,
        crate::test_specs::SGD,
    )
}

#[test]
fn the_spec_is_written_as_toml_in_a_code_block() {
    let text = spec_text(&a_spec()).unwrap();
    assert!(
        text.starts_with("```toml\n") && text.ends_with("\n```"),
        "{text}"
    );
    let table: toml::Table = toml::from_str(spec_toml(&text)).unwrap();
    assert_eq!(table["name"].as_str(), Some("tb-spec"));
    assert_eq!(table["max_steps"].as_integer(), Some(4));
}

/// The events of every file under `dir`, files in name order.
fn read_run(dir: &Path) -> Vec<Vec<Event>> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    names
        .iter()
        .map(|p| {
            read_records(&std::fs::read(p).unwrap())
                .unwrap()
                .iter()
                .map(|r| Event::decode(&r[..]).unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn the_writer_opens_a_file_per_run_writes_the_spec_and_scalars_and_a_new_file_after_the_end() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("tb");
    let mut w = Writers::new(root.clone());
    let scalars = |step: i64, v: f32| Msg::Scalars {
        job: "a-1".into(),
        step,
        wall: 1_700_000_000.5,
        values: vec![("train/loss", v)],
    };
    w.apply(Msg::Spec {
        job: "a-1".into(),
        spec: Box::new(a_spec()),
        wall: 1_700_000_000.0,
    });
    w.apply(scalars(1, 0.5));
    w.apply(scalars(2, 0.25));
    let first = w.file_of("a-1").unwrap().to_path_buf();
    let name = first.file_name().unwrap().to_str().unwrap().to_string();
    assert!(
        name.starts_with("events.out.tfevents.1700000000.")
            && name.ends_with(&format!(".{}.0", std::process::id())),
        "{name}"
    );
    w.flush_all();
    let run = read_run(&root.join("a-1"));
    assert_eq!(run.len(), 1);
    let evs = &run[0];
    assert_eq!(evs[0].file_version.as_deref(), Some(FILE_VERSION));
    let text = &evs[1].summary.as_ref().unwrap().value[0];
    assert_eq!(text.tag, SPEC_TAG);
    let s = String::from_utf8(text.tensor.as_ref().unwrap().string_val[0].clone()).unwrap();
    assert!(spec_toml(&s).contains("name = \"tb-spec\""), "{s}");
    let v = |e: &Event| e.summary.as_ref().unwrap().value[0].simple_value;
    assert_eq!((evs[2].step, v(&evs[2])), (1, Some(0.5)));
    assert_eq!((evs[3].step, v(&evs[3])), (2, Some(0.25)));
    // The end closes it; the next point (a resume) opens another file.
    w.apply(Msg::End { job: "a-1".into() });
    assert!(w.file_of("a-1").is_none());
    w.apply(scalars(2, 0.125));
    w.apply(Msg::End { job: "a-1".into() });
    let run = read_run(&root.join("a-1"));
    assert_eq!(run.len(), 2);
    assert_eq!(run[1].len(), 2);
    assert_eq!(run[1][1].step, 2);
}

#[test]
fn a_run_folder_that_cannot_be_made_is_given_up_without_panicking() {
    let t = tempfile::tempdir().unwrap();
    // The root is a file: no folder can be made under it.
    let root = t.path().join("file");
    std::fs::write(&root, "x").unwrap();
    let mut w = Writers::new(root);
    for step in 0..3 {
        w.apply(Msg::Scalars {
            job: "a-1".into(),
            step,
            wall: 1.0,
            values: vec![("train/loss", 1.0)],
        });
    }
    assert!(w.file_of("a-1").is_none());
    assert_eq!(w.warned.len(), 1);
    w.flush_all();
}

#[test]
fn the_sink_never_blocks_and_writes_through_its_thread() {
    let t = tempfile::tempdir().unwrap();
    let tb = TensorBoard::start(t.path().join("tb")).unwrap();
    let mut j = job("m-1", v1::ModelKind::Mlp, 0, v1::JobState::Running);
    j.spec = Some(a_spec());
    for step in 1..=QUEUE as u64 + 100 {
        tb.observe(&JobEvent {
            job: Some(j.clone()),
            event: Some(job_event::Event::Step(report(step))),
        });
    }
    tb.close(Duration::from_secs(30));
    let run = read_run(&t.path().join("tb/m-1"));
    let written: usize = run.iter().map(|f| f.len() - 1).sum();
    // Every point is either written or counted as dropped.
    assert_eq!(
        written as u64 + tb.dropped(),
        1 + QUEUE as u64 + 100,
        "the spec and every step"
    );
    assert_eq!(run[0][1].summary.as_ref().unwrap().value[0].tag, SPEC_TAG);
}

/// A step event carries no spec (domain::step_view): the spec goes out
/// with the transition to Running the steps follow, and a language
/// model's steps are told by the unit they carry.
#[test]
fn a_step_without_the_job_after_the_running_transition_writes_the_spec_first() {
    let t = tempfile::tempdir().unwrap();
    let tb = TensorBoard::start(t.path().join("tb")).unwrap();
    let mut j = job("r-1", v1::ModelKind::Mlp, 0, v1::JobState::Running);
    j.spec = Some(a_spec());
    tb.observe(&JobEvent {
        job: Some(j.clone()),
        event: Some(job_event::Event::Transition(v1::Transition {
            from: v1::JobState::Rendezvous as i32,
            to: v1::JobState::Running as i32,
            ..Default::default()
        })),
    });
    for step in 1..=3 {
        tb.observe(&JobEvent {
            job: Some(crate::domain::step_view(&j)),
            event: Some(job_event::Event::Step(report(step))),
        });
    }
    tb.close(Duration::from_secs(30));
    let run = read_run(&t.path().join("tb/r-1"));
    assert_eq!(run.len(), 1);
    assert_eq!(run[0].len(), 1 + 1 + 3, "file version, the spec, 3 steps");
    assert_eq!(run[0][1].summary.as_ref().unwrap().value[0].tag, SPEC_TAG);
    // A language model's step job says "tokens".
    let lm = job("l-1", v1::ModelKind::Llama, 0, v1::JobState::Running);
    let ev = JobEvent {
        job: Some(crate::domain::step_view(&lm)),
        event: Some(job_event::Event::Step(report(1))),
    };
    let Some(Point::Scalars { values, .. }) = point_of(&ev) else {
        panic!("a step is a point")
    };
    let with_spec = JobEvent {
        job: Some(lm),
        ..ev
    };
    let Some(Point::Scalars { values: whole, .. }) = point_of(&with_spec) else {
        panic!("a step is a point")
    };
    assert_eq!(values, whole);
}
