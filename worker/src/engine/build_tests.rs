use super::*;

#[test]
fn a_stage_builds_its_blocks_and_zero3_its_chunks_unless_cut_over_a_tensor_axis() {
    // A pipeline stage builds its blocks whatever the ZeRO stage and
    // tensor axis.
    for zero in 0..=3 {
        for tensor in [false, true] {
            assert_eq!(
                model_build(Some((1, 4)), zero, tensor),
                ModelBuild::Stage {
                    stage: 1,
                    stages: 4
                }
            );
        }
    }
    assert_eq!(model_build(None, 3, false), ModelBuild::Zero3Chunks);
    // Tensor parallelism builds whole, cuts, then ZeRO-3 shards the slices.
    assert_eq!(model_build(None, 3, true), ModelBuild::Whole);
    for zero in 0..=2 {
        for tensor in [false, true] {
            assert_eq!(model_build(None, zero, tensor), ModelBuild::Whole);
        }
    }
}

#[test]
fn total_steps_is_max_steps_else_epochs_times_windows() {
    assert_eq!(total_steps(Some(7), Some(3), 10), 7);
    assert_eq!(total_steps(None, Some(3), 10), 30);
    // One epoch by default.
    assert_eq!(total_steps(None, None, 10), 10);
    assert_eq!(total_steps(Some(0), None, 10), 0);
}

fn spec() -> JobSpec {
    let text = "name = \"build-parts\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 2\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
    JobSpec::from_toml_str(text, std::path::Path::new("t")).expect("a minimal spec parses")
}

#[test]
fn the_checkpoint_folder_is_the_runs_else_the_specs_else_the_name_under_the_state_folder() {
    let mut spec = spec();
    let mut opts = RunOptions::default();
    assert_eq!(
        checkpoint_dir(&spec, &opts),
        PathBuf::from("runs/checkpoints/build-parts")
    );
    opts.state_dir = Some("state".into());
    assert_eq!(
        checkpoint_dir(&spec, &opts),
        PathBuf::from("state/checkpoints/build-parts")
    );
    spec.checkpoint.dir = Some("from-spec".into());
    assert_eq!(checkpoint_dir(&spec, &opts), PathBuf::from("from-spec"));
    opts.checkpoint_dir = Some("from-run".into());
    assert_eq!(checkpoint_dir(&spec, &opts), PathBuf::from("from-run"));
}

#[test]
fn the_owner_is_the_job_id_else_the_name_and_the_fresh_state_records_the_place() {
    let spec = spec();
    let mut opts = RunOptions::default();
    let owner = owner(&spec, &opts);
    assert_eq!(owner.job_id, "build-parts");
    assert_eq!(owner.spec_hash, spec_hash(&spec));
    opts.job_id = Some("job-7".into());
    let owner = super::owner(&spec, &opts);
    assert_eq!(owner.job_id, "job-7");
    let place = Place {
        world: 3,
        rank: 1,
        stages: None,
        k: 5,
    };
    let state = fresh_state(&spec, &owner, 0.25, &place);
    assert_eq!(
        (
            state.job_id.as_str(),
            state.world_size,
            state.accumulation_steps
        ),
        ("job-7", 3, 5)
    );
    assert_eq!((state.step, state.lr), (0, 0.25));
    assert!(state.loss_scale.is_none(), "fp32: no loss scale");
}

#[test]
fn the_window_plan_shards_over_the_data_axis_and_refuses_a_starved_rank() {
    let spec = spec();
    let place = Place {
        world: 2,
        rank: 1,
        stages: None,
        k: 3,
    };
    let (shard, plan) = data_plan(&spec, &place, 9).unwrap();
    assert_eq!((shard.len, shard.world), (9, 2));
    assert_eq!((plan.k, plan.batch), (3, 2));
    assert_eq!(plan.samples, shard.rank_len(1));
    assert_eq!(plan.max_samples, shard.rank_len(0));
    let mut spec = spec;
    spec.data.pad = false;
    let err = data_plan(&spec, &place, 1).unwrap_err().to_string();
    assert!(
        err.starts_with("data.pad = false: 1 samples over 2 ranks"),
        "{err}"
    );
}

#[test]
fn a_graph_runs_eagerly_for_the_first_bar_that_holds() {
    let capture = Mode::Capture { warmup: 3 };
    let none = GraphBars::default();
    assert_eq!(eager_override(capture.clone(), none), capture);
    assert_eq!(eager_override(Mode::BodyOnly, none), Mode::BodyOnly);
    let all = GraphBars {
        per_batch_count: true,
        pipeline: true,
        tensor: true,
        recompute: true,
    };
    let cases = [
        (all, EagerReason::PerBatchCount),
        (
            GraphBars {
                per_batch_count: false,
                ..all
            },
            EagerReason::PipelineStage,
        ),
        (
            GraphBars {
                tensor: true,
                recompute: true,
                ..none
            },
            EagerReason::TensorParallel,
        ),
        (
            GraphBars {
                recompute: true,
                ..none
            },
            EagerReason::ActivationCheckpointing,
        ),
    ];
    for (bars, reason) in cases {
        let off = Mode::Off(reason);
        assert_eq!(eager_override(capture.clone(), bars), off, "{bars:?}");
        assert_eq!(eager_override(Mode::BodyOnly, bars), off, "{bars:?}");
    }
    // An eager mode keeps its own reason.
    let off = Mode::Off(EagerReason::NotCuda);
    assert_eq!(eager_override(off.clone(), all), off);
}

#[test]
fn the_runs_override_decides_the_graph_mode_before_the_spec() {
    let spec = spec();
    let mut opts = RunOptions::default();
    // On the CPU the spec's setting gives the eager micro-step.
    assert_eq!(
        graph_mode(&spec, &opts, Device::Cpu, 0),
        Mode::Off(EagerReason::NotCuda)
    );
    opts.force_graph_capture = true;
    assert_eq!(
        graph_mode(&spec, &opts, Device::Cpu, 0),
        Mode::Capture {
            warmup: crate::cuda::graphs::WARMUP
        }
    );
    opts.graph_body_only = true;
    assert_eq!(graph_mode(&spec, &opts, Device::Cpu, 2), Mode::BodyOnly);
}
