use super::*;
use proptest::prelude::*;
use proptest::sample::select;

/// A hand-written TOML spec (kinds by their TOML names) survives the proto
/// trip; `round_trip_keeps_every_field` below covers every field.
#[test]
fn toml_example_round_trips() {
    let text = r#"
name = "rt"
workers = 2
seed = 9
epochs = 3
[model]
kind = "mlp"
hidden = [8, 4]
[data]
kind = "synthetic"
samples = 64
shape = [3, 4]
batch_size = 8
shuffle = false
pad = false
[accumulation]
steps = 4
normalize = "mean"
sync = "every_step"
[clipping]
max_norm = 0.5
norm_type = inf
on_nonfinite = "error"
[optimizer]
kind = "adamw"
lr = 0.001
betas = [0.8, 0.9]
[schedule]
kind = "cosine"
warmup_steps = 5
[checkpoint]
every_steps = 7
keep = 2
[comm]
timeout_s = 5
"#;
    let spec = JobSpec::from_toml_str(text, std::path::Path::new("rt.toml")).unwrap();
    assert_eq!(spec.accumulation.normalize, Normalize::Mean);
    assert_eq!(spec.accumulation.sync, SyncMode::EveryStep);
    assert_eq!(spec.clipping.on_nonfinite, OnNonfinite::Error);
    assert_eq!(spec.optimizer.kind, OptimizerKind::Adamw);
    assert_eq!(spec.schedule.kind, ScheduleKind::Cosine);
    let p = spec_to_proto(&spec);
    assert_eq!(
        p.accumulation.as_ref().unwrap().sync,
        v1::SyncMode::EveryStep as i32
    );
    let back = spec_from_proto(&p).unwrap();
    assert_eq!(back, spec);
}

fn base() -> v1::JobSpec {
    spec_to_proto(
        &JobSpec::from_toml_str(
            "name = \"x\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n",
            std::path::Path::new("x"),
        )
        .unwrap(),
    )
}

#[test]
fn bad_proto_spec_names_fields() {
    let mut p = base();
    p.optimizer.as_mut().unwrap().lr = -1.0;
    p.optimizer.as_mut().unwrap().betas = vec![0.9];
    let err = spec_from_proto(&p).unwrap_err().to_string();
    assert!(
        err.contains("optimizer.lr = -1.0") && err.contains("optimizer.betas"),
        "{err}"
    );
}

#[test]
fn unknown_and_unspecified_kinds() {
    // Unknown values of every kind are field errors naming the allowed
    // names, reported together with the other errors.
    let mut p = base();
    p.name = "Bad Name".into();
    p.model.as_mut().unwrap().kind = 99;
    p.data.as_mut().unwrap().kind = -1;
    p.accumulation = Some(v1::AccumulationSpec {
        normalize: 7,
        sync: 8,
        ..Default::default()
    });
    p.clipping = Some(v1::ClippingSpec {
        on_nonfinite: 9,
        ..Default::default()
    });
    p.optimizer.as_mut().unwrap().kind = 10;
    p.optimizer.as_mut().unwrap().lr = 0.0;
    p.schedule = Some(v1::ScheduleSpec {
        kind: 11,
        ..Default::default()
    });
    let errs = spec_from_proto(&p).unwrap_err().0;
    let shown: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(
        shown,
        vec![
            &*format!("model.kind = 99: {}", ModelKind::allowed()),
            "data.kind = -1: must be one of mnist, cifar10, tensors, synthetic, sequences, tokens",
            "accumulation.normalize = 7: must be one of global_count, mean, sum",
            "accumulation.sync = 8: must be one of boundary, every_step",
            "clipping.on_nonfinite = 9: must be one of skip, error",
            "optimizer.kind = 10: must be one of sgd, adam, adamw",
            "schedule.kind = 11: must be one of constant, cosine, step, linear_warmup",
            &format!("name = \"Bad Name\": {JOB_NAME_RULE}"),
            "optimizer.lr = 0.0: must be a finite number > 0",
        ]
    );

    // UNSPECIFIED: the TOML default where TOML has one...
    let mut p = base();
    p.accumulation = Some(v1::AccumulationSpec::default());
    p.clipping = Some(v1::ClippingSpec::default());
    p.schedule = Some(v1::ScheduleSpec::default());
    let s = spec_from_proto(&p).unwrap();
    assert_eq!(s.accumulation.normalize, Normalize::GlobalCount);
    assert_eq!(s.accumulation.sync, SyncMode::Boundary);
    assert_eq!(s.clipping.on_nonfinite, OnNonfinite::Skip);
    assert_eq!(s.schedule.kind, ScheduleKind::Constant);
    // ... and an error where the kind is required.
    let mut p = base();
    p.model.as_mut().unwrap().kind = 0;
    p.data.as_mut().unwrap().kind = 0;
    p.optimizer.as_mut().unwrap().kind = 0;
    let shown: Vec<String> = spec_from_proto(&p)
        .unwrap_err()
        .0
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        shown,
        vec![
            &*format!("model.kind = (unspecified): {}", ModelKind::allowed()),
            "data.kind = (unspecified): must be one of mnist, cifar10, tensors, synthetic, sequences, tokens",
            "optimizer.kind = (unspecified): must be one of sgd, adam, adamw",
        ]
    );
}

#[test]
fn every_kind_maps_both_ways() {
    fn check<K: KindMap + PartialEq + std::fmt::Debug>() {
        let mut seen = std::collections::HashSet::new();
        for &k in K::ALL {
            let raw = to_proto(k);
            assert_ne!(raw, 0, "{k:?} maps to UNSPECIFIED");
            // By name: mlp is MODEL_KIND_MLP, global_count is
            // NORMALIZE_GLOBAL_COUNT (catches two swapped values).
            let name = K::proto_name(k.to_proto());
            let want = format!("_{}", k.as_str().to_uppercase());
            assert!(name.ends_with(&want), "{k:?} maps to {name}");
            assert!(seen.insert(raw), "{k:?} shares proto value {raw}");
            let mut errors = Vec::new();
            let back = from_proto(raw, Unspecified::Required, K::ALL[0], &mut errors);
            assert_eq!((back, errors.len()), (k, 0));
        }
    }
    check::<ModelKind>();
    check::<DataKind>();
    check::<Normalize>();
    check::<SyncMode>();
    check::<OnNonfinite>();
    check::<OptimizerKind>();
    check::<ScheduleKind>();
    check::<Precision>();
    check::<TokenDtype>();
}

fn kind<K: SpecEnum + std::fmt::Debug>() -> impl Strategy<Value = K> {
    select(K::ALL)
}

fn file() -> impl Strategy<Value = PathBuf> {
    "[a-z]{1,6}(/[a-z0-9_.]{1,8}){0,2}".prop_map(PathBuf::from)
}

/// The llama fields: valid shapes (heads divide the width, kv heads the
/// heads, even head width); with a `config` file (not read by
/// `validate_fields`) the required ones may be absent.
#[derive(Clone, Debug)]
struct LlamaDraw {
    sizes: (i64, i64, i64, i64, i64, i64),
    floats: (Option<f64>, Option<f64>),
    positions: Option<i64>,
    flags: (Option<bool>, Option<bool>, Option<bool>),
    gqa: bool,
    config: Option<PathBuf>,
    absent: u8,
}

fn llama_draw() -> impl Strategy<Value = LlamaDraw> {
    (
        (1i64..1000, 1i64..8, 1i64..4, 1i64..256, 1i64..4, 1i64..3),
        (
            prop::option::of(1e-8f64..1e-3),
            prop::option::of(100.0f64..1e6),
        ),
        prop::option::of(64i64..4096),
        (
            prop::option::of(any::<bool>()),
            prop::option::of(any::<bool>()),
            prop::option::of(any::<bool>()),
        ),
        any::<bool>(),
        prop::option::of(file()),
        0u8..6,
    )
        .prop_map(
            |(sizes, floats, positions, flags, gqa, config, absent)| LlamaDraw {
                sizes,
                floats,
                positions,
                flags,
                gqa,
                config,
                absent,
            },
        )
}

fn model() -> impl Strategy<Value = ModelSpec> {
    (
        kind::<ModelKind>(),
        prop::collection::vec(1i64..512, 0..3),
        prop::option::of(1i64..1000),
        file(),
        prop::option::of(file()),
        llama_draw(),
    )
        .prop_map(|(kind, hidden, num_classes, path, init, l)| {
            let llama = kind.is_decoder();
            // Qwen2's and Mistral's biases are not theirs to set.
            let biases = kind == ModelKind::Llama;
            let (vocab, kv, group, half_dim, layers, inter) = l.sizes;
            let heads = kv * group;
            // With a config file, one required field may come from it.
            let on = |i: u8| llama && (l.config.is_none() || l.absent != i);
            ModelSpec {
                kind,
                hidden: if kind == ModelKind::Mlp {
                    hidden
                } else {
                    Vec::new()
                },
                num_classes: num_classes.filter(|_| !llama),
                path: (kind == ModelKind::Torchscript).then_some(path),
                init,
                fields: FamilyFields {
                    llama: LlamaSpec {
                        vocab_size: on(0).then_some(vocab),
                        hidden_size: on(1).then_some(heads * half_dim * 2),
                        intermediate_size: on(2).then_some(inter * 16),
                        num_hidden_layers: on(3).then_some(layers),
                        num_attention_heads: on(4).then_some(heads),
                        num_key_value_heads: (llama && l.gqa).then_some(kv),
                        rms_norm_eps: l.floats.0.filter(|_| llama),
                        rope_theta: l.floats.1.filter(|_| llama),
                        max_position_embeddings: l.positions.filter(|_| llama),
                        tie_word_embeddings: l.flags.0.filter(|_| llama),
                        attention_bias: l.flags.1.filter(|_| biases),
                        mlp_bias: l.flags.2.filter(|_| biases),
                        config: l.config.filter(|_| llama),
                    },
                },
            }
        })
}

/// Data for a model: token rows (sequences, tokens) for a language model,
/// the other kinds otherwise.
fn data(lm: bool) -> impl Strategy<Value = DataSpec> {
    let kinds: Vec<DataKind> = DataKind::ALL
        .iter()
        .copied()
        .filter(|k| matches!(k, DataKind::Sequences | DataKind::Tokens) == lm)
        .collect();
    (
        select(kinds),
        prop::option::of(file()),
        prop::option::of(file()),
        1u64..64,
        any::<(bool, bool, bool)>(),
        (
            prop::option::of(1u64..10_000),
            prop::option::of(0u64..10_000),
            prop::option::of(prop::collection::vec(1i64..32, 1..4)),
            prop::option::of(2i64..100),
        ),
        (
            1u64..64,
            prop::option::of(0i64..1000),
            prop::option::of(kind::<TokenDtype>()),
        ),
    )
        .prop_map(
            move |(kind, path, eval_path, batch_size, (shuffle, drop_last, pad), synth, tokens)| {
                let synthetic = kind == DataKind::Synthetic;
                let path = match kind {
                    DataKind::Synthetic => path,
                    DataKind::Mnist
                    | DataKind::Cifar10
                    | DataKind::Tensors
                    | DataKind::Sequences
                    | DataKind::Tokens => Some(path.unwrap_or_else(|| "data".into())),
                };
                DataSpec {
                    kind,
                    path,
                    eval_path,
                    batch_size,
                    shuffle,
                    drop_last,
                    pad,
                    samples: synth.0.filter(|_| synthetic),
                    eval_samples: synth.1.filter(|_| synthetic),
                    shape: synth.2.filter(|_| synthetic),
                    classes: synth.3.filter(|_| synthetic),
                    seq_len: lm.then_some(tokens.0),
                    pad_id: tokens.1.filter(|_| kind == DataKind::Sequences),
                    dtype: tokens.2.filter(|_| kind == DataKind::Tokens),
                    pack: kind == DataKind::Sequences && batch_size % 2 == 0,
                }
            },
        )
}

/// A model and data that go together.
fn model_and_data() -> impl Strategy<Value = (ModelSpec, DataSpec)> {
    model().prop_flat_map(|m| {
        let lm = m.kind.is_decoder();
        (Just(m), data(lm))
    })
}

/// A valid spec, every field and kind drawn.
pub(super) fn spec() -> impl Strategy<Value = JobSpec> {
    let top = (
        "[a-z0-9]([a-z0-9._-]{0,20}[a-z0-9])?",
        1u32..8,
        any::<(bool, bool)>(),
        0u32..4,
        any::<u64>(),
        prop::option::of(1u64..100),
        prop::option::of(1u64..10_000),
        select(vec!["auto", "cpu", "cuda", "cuda:0", "cuda:3"]),
        prop::option::of(1u32..16),
    );
    let acc = (0u8..3, 1u64..16, kind::<Normalize>(), kind::<SyncMode>());
    let clip = (
        0u8..3,
        0.01f64..10.0,
        prop::option::of(select(vec![2.0, f64::INFINITY])),
        kind::<OnNonfinite>(),
    );
    let opt = (
        kind::<OptimizerKind>(),
        1e-6f64..1.0,
        (0.0f64..0.99, prop::option::of(0.0f64..1.0)),
        any::<(bool, bool)>(),
        prop::option::of(0.0f64..0.1),
        prop::option::of((0.0f64..0.999, 0.0f64..0.999)),
        prop::option::of(1e-12f64..1e-3),
    );
    let sched = (
        kind::<ScheduleKind>(),
        0u64..20,
        prop::option::of(1u64..100),
        prop::option::of(0.01f64..1.0),
        prop::option::of(0.0f64..0.99),
    );
    let rest = (
        prop::option::of(file()),
        0u64..100,
        1u64..10,
        0u64..5,
        1u64..1024,
        (0.1f64..100.0, 0.1f64..100.0, 0.1f64..100.0, 0.1f64..100.0),
        kind::<CommBackend>(),
    );
    (top, model_and_data(), acc, clip, opt, sched, rest).prop_map(
        |(top, (model, data), acc, clip, opt, sched, rest)| {
            let (name, workers, (min, max), extra, seed, epochs, max_steps, device, threads) = top;
            // Neither (k = 1), steps, or global_batch.
            let accumulation = AccumulationSpec {
                steps: (acc.0 == 1).then_some(acc.1),
                global_batch: (acc.0 == 2).then_some(acc.1 * workers as u64 * data.batch_size),
                normalize: acc.2,
                sync: acc.3,
            };
            let clipping = ClippingSpec {
                max_norm: (clip.0 == 1).then_some(clip.1),
                clip_value: (clip.0 == 2).then_some(clip.1),
                norm_type: clip.2,
                on_nonfinite: clip.3,
            };
            let sgd = opt.0 == OptimizerKind::Sgd;
            let (momentum_on, nesterov) = opt.3;
            let momentum = if sgd && momentum_on { opt.2 .0 } else { 0.0 };
            let nesterov = sgd && nesterov && momentum > 0.0;
            // Dampening: sgd only, and 0 with nesterov.
            let dampening = match opt.2 .1 {
                Some(d) if sgd && !nesterov => d,
                _ => 0.0,
            };
            let optimizer = OptimizerSpec {
                kind: opt.0,
                lr: opt.1,
                momentum,
                dampening,
                nesterov,
                weight_decay: opt.4,
                betas: opt.5.filter(|_| !sgd).map(|(a, b)| [a, b]),
                eps: opt.6.filter(|_| !sgd),
                fused: !sgd && opt.6.is_some(),
            };
            let schedule = ScheduleSpec {
                kind: sched.0,
                warmup_steps: sched.1 + u64::from(sched.0 == ScheduleKind::LinearWarmup),
                // Required by step, allowed (and kept) with the others.
                step_size: match sched.0 {
                    ScheduleKind::Step => Some(sched.2.unwrap_or(1)),
                    _ => sched.2,
                },
                gamma: sched.3,
                min_lr: sched.4.map(|f| f * optimizer.lr),
            };
            let (dir, every_steps, keep, every_epochs, eval_batch, comm, backend) = rest;
            JobSpec {
                name,
                workers,
                min_workers: min.then_some(1 + (extra % workers)),
                max_workers: max.then_some(workers + extra),
                seed,
                epochs,
                max_steps,
                device: device.to_string(),
                threads,
                model,
                data,
                accumulation,
                clipping,
                optimizer,
                schedule,
                sharding: ShardingSpec {
                    stage: (seed % 4) as u32,
                    reshard_after_forward: (seed % 4 == 3).then_some(seed / 4 % 2 == 0),
                    prefetch: (seed % 4 == 3).then_some(seed / 8 % 2 == 0),
                },
                precision: Precision::ALL[(seed / 3 % 3) as usize],
                loss_scaling: if Precision::ALL[(seed / 3 % 3) as usize] == Precision::Fp16 {
                    LossScalingSpec {
                        init_scale: 2f64.powi((seed % 20) as i32),
                        growth_factor: 1.5 + (seed % 4) as f64,
                        backoff_factor: 0.25,
                        growth_interval: 1 + seed % 5000,
                    }
                } else {
                    LossScalingSpec::default()
                },
                max_skipped_fraction: [None, Some(0.0), Some(0.25), Some(1.0)]
                    [(seed / 81 % 4) as usize],
                // Data parallelism only (split models are refused for now):
                // the degree given or left to its default.
                parallel: ParallelSpec {
                    data: (seed % 2 == 1).then_some(workers),
                    pipeline: (seed % 3 == 1).then_some(1),
                    tensor: (seed % 5 == 1).then_some(1),
                    schedule: None,
                    stages_per_rank: None,
                    layers_per_stage: None,
                    balance: None,
                },
                performance: PerformanceSpec {
                    cuda_graphs: [None, Some(true), Some(false)][(seed / 9 % 3) as usize],
                    cudnn_deterministic: [None, Some(true), Some(false)][(seed / 27 % 3) as usize],
                    // Checked in activation_checkpointing_crosses_the_wire
                    // (it needs a family with blocks).
                    activation_checkpointing: None,
                    checkpoint_every: None,
                },
                checkpoint: CheckpointSpec {
                    dir,
                    every_steps,
                    keep,
                    max_shard_size: ["50GB", "5MB", "1024", "2GiB"][(seed % 4) as usize].into(),
                },
                eval: EvalSpec {
                    every_epochs,
                    batch_size: eval_batch,
                    every_steps: seed % 4,
                },
                comm: CommSpec {
                    timeout_s: comm.0,
                    connect_timeout_s: comm.1,
                    bucket_cap_mb: comm.2,
                    rendezvous_timeout_s: comm.3,
                    backend,
                },
            }
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// spec -> proto -> spec is the identity on valid specs, for every
    /// field and every value of every kind. The generator builds JobSpec and
    /// its sections with struct literals, so a new field does not compile
    /// until it is generated; `generator_varies_every_field` checks that
    /// each one is drawn with more than one value, so a conversion that drops
    /// or defaults a field fails here.
    #[test]
    fn round_trip_keeps_every_field(s in spec()) {
        prop_assert_eq!(s.validate_fields(), Ok(()), "generator made an invalid spec");
        let back = spec_from_proto(&spec_to_proto(&s));
        prop_assert_eq!(back, Ok(s));
    }
}

#[test]
fn zeros_on_the_wire_are_refused_and_absent_fields_take_defaults() {
    // A client that sends 0 asked for 0: refused by name, never read as
    // "the default".
    let mut p = base();
    p.workers = Some(0);
    p.checkpoint = Some(v1::CheckpointSpec {
        keep: Some(0),
        ..Default::default()
    });
    p.eval = Some(v1::EvalSpec {
        batch_size: Some(0),
        ..Default::default()
    });
    p.comm = Some(v1::CommSpec {
        timeout_s: Some(0.0),
        connect_timeout_s: Some(0.0),
        bucket_cap_mb: Some(0.0),
        rendezvous_timeout_s: Some(0.0),
        ..Default::default()
    });
    let errs = spec_from_proto(&p).unwrap_err().0;
    let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "workers",
            "checkpoint.keep",
            "comm.timeout_s",
            "comm.connect_timeout_s",
            "comm.rendezvous_timeout_s",
            "comm.bucket_cap_mb",
            "eval.batch_size",
        ],
        "{errs:?}"
    );
    // Absent: the same defaults as an absent TOML key.
    let mut p = base();
    p.workers = None;
    p.checkpoint = Some(v1::CheckpointSpec::default());
    p.eval = Some(v1::EvalSpec::default());
    p.comm = Some(v1::CommSpec::default());
    let s = spec_from_proto(&p).unwrap();
    let toml_defaults = spec_from_proto(&base()).unwrap();
    assert_eq!(s, toml_defaults);
    assert_eq!(
        (s.workers, s.checkpoint.keep, s.eval.batch_size),
        (1, 3, 256)
    );
}

/// Every leaf of the serialized spec (`schedule.step_size`, `comm.timeout_s`,
/// ...) as text.
fn leaves(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(&path, v, out);
            }
        }
        leaf => out.push((prefix.to_string(), leaf.to_string())),
    }
}

/// The property test can only see a dropped field if the generator varies
/// it: over 500 drawn specs, every field of JobSpec (found through serde,
/// so a new field is included without editing this test) takes at least
/// two values, and every optional field is both set and unset.
#[test]
fn generator_varies_every_field() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::deterministic_rng(Config::default().rng_algorithm),
    );
    let strategy = spec();
    let mut seen: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        Default::default();
    for _ in 0..500 {
        let s = strategy.new_tree(&mut runner).unwrap().current();
        let mut out = Vec::new();
        leaves("", &serde_json::to_value(&s).unwrap(), &mut out);
        for (path, value) in out {
            seen.entry(path).or_default().insert(value);
        }
    }
    assert!(
        seen.len() >= 45,
        "only {} fields seen: {:?}",
        seen.len(),
        seen.keys()
    );
    let dull: Vec<_> = seen
        .iter()
        .filter(|(_, values)| values.len() < 2)
        .map(|(path, values)| format!("{path} = {values:?}"))
        .collect();
    assert!(dull.is_empty(), "the generator never varies {dull:?}");
    for (path, values) in &seen {
        if values.contains("null") {
            assert!(values.len() > 1, "{path} is never set");
        }
    }
}
