use super::*;
use proptest::prelude::*;

pub(super) const BASE: &str = "name = \"unit\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 8\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";

pub(super) fn invalid(text: &str) -> Vec<FieldError> {
    match JobSpec::fields_from_toml_str(text, Path::new("t.toml")) {
        Err(LoadError::Invalid { source, .. }) => source.0,
        other => panic!("expected LoadError::Invalid, got {other:?}"),
    }
}

/// The serde name of every value is its `as_str`, and parsing it back
/// gives the same value (the names in messages are the names TOML takes).
fn names_agree<E>()
where
    E: SpecEnum + Serialize + for<'de> Deserialize<'de> + PartialEq + fmt::Debug,
{
    for v in E::ALL {
        let json = serde_json_like(v);
        assert_eq!(json, v.as_str());
        assert_eq!(E::parse(v.as_str()), Some(*v));
        let back: E = toml::Value::String(v.as_str().into()).try_into().unwrap();
        assert_eq!(back, *v);
    }
    assert_eq!(E::parse("no-such-kind"), None);
}

/// The string serde writes for a unit variant.
fn serde_json_like<E: Serialize>(v: &E) -> String {
    match toml::Value::try_from(v).unwrap() {
        toml::Value::String(s) => s,
        other => panic!("not a string: {other:?}"),
    }
}

#[test]
fn every_kind_serializes_as_its_name() {
    names_agree::<ModelKind>();
    names_agree::<DataKind>();
    names_agree::<Normalize>();
    names_agree::<SyncMode>();
    names_agree::<OnNonfinite>();
    names_agree::<OptimizerKind>();
    names_agree::<ScheduleKind>();
    names_agree::<Precision>();
    names_agree::<CommBackend>();
    names_agree::<PipelineSchedule>();
    assert_eq!(OptimizerKind::Adamw.as_str(), "adamw");
    assert_eq!(ScheduleKind::LinearWarmup.as_str(), "linear_warmup");
    assert_eq!(
        <OnNonfinite as SpecEnum>::allowed(),
        "must be one of skip, error"
    );
}

#[test]
fn defaults_match_the_design() {
    let s = JobSpec::fields_from_toml_str(BASE, Path::new("t.toml")).unwrap();
    assert_eq!(s.accumulation.normalize, Normalize::GlobalCount);
    assert_eq!(s.accumulation.sync, SyncMode::Boundary);
    assert_eq!(s.clipping.on_nonfinite, OnNonfinite::Skip);
    assert_eq!(s.schedule.kind, ScheduleKind::Constant);
}

#[test]
fn every_unknown_kind_is_reported_with_the_other_errors() {
    let text = BASE
        .replace("kind = \"mlp\"", "kind = \"gpt\"")
        .replace("kind = \"sgd\"", "kind = \"lion\"")
        .replace("lr = 0.1", "lr = -1.0\n[schedule]\nkind = 3\n[accumulation]\nsync = \"sometimes\"\nnormalize = \"mean\"\n[clipping]\non_nonfinite = \"ignore\"");
    let errs = invalid(&text);
    let shown: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(
        shown,
        vec![
            &*format!("model.kind = \"gpt\": {}", ModelKind::allowed()),
            "accumulation.sync = \"sometimes\": must be one of boundary, every_step",
            "clipping.on_nonfinite = \"ignore\": must be one of skip, error",
            "optimizer.kind = \"lion\": must be one of sgd, adam, adamw",
            "schedule.kind = 3: must be one of constant, cosine, step, linear_warmup",
            "optimizer.lr = -1.0: must be a finite number > 0",
        ],
    );
}

#[test]
fn a_placeholder_kind_adds_no_errors_of_its_own() {
    // Refused kinds stand in as mlp, synthetic and sgd: what only
    // depends on the kind (model.path with mlp, data.path required for
    // mnist, betas with sgd) is not reported; everything else is.
    let text = BASE
        .replace("kind = \"mlp\"", "kind = \"vit\"\npath = \"m.pt\"")
        .replace(
            "kind = \"synthetic\"",
            "kind = \"imagenet\"\npath = \"/no/such/dir\"",
        )
        .replace(
            "kind = \"sgd\"",
            "kind = \"lion\"\nbetas = [0.9, 0.99]\neps = -1.0",
        );
    let errs = invalid(&text);
    let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        vec!["model.kind", "data.kind", "optimizer.kind", "optimizer.eps"],
        "{errs:?}"
    );
    // With valid kinds the dependent checks do run.
    let text = BASE
        .replace("kind = \"mlp\"", "kind = \"lenet5\"\npath = \"m.pt\"")
        .replace("kind = \"synthetic\"", "kind = \"mnist\"");
    let fields: Vec<String> = invalid(&text).into_iter().map(|e| e.field).collect();
    assert_eq!(fields, vec!["model.path", "data.path"]);
}

#[test]
fn other_parse_errors_keep_their_located_message() {
    let text = BASE.replace("lr = 0.1", "lr = 0.1\nlearning_rate = 2");
    match JobSpec::fields_from_toml_str(&text, Path::new("t.toml")) {
        Err(LoadError::Parse { message, .. }) => {
            assert!(message.contains("learning_rate"), "{message}");
            assert!(message.contains("line"), "{message}");
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
}

#[test]
fn comm_durations_and_sizes_are_bounded() {
    let base = "name = \"t\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nsamples = 8\nshape = [2]\nclasses = 2\nbatch_size = 2\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n[comm]\n";
    for (line, field) in [
        ("timeout_s = 1e300", "comm.timeout_s"),
        ("connect_timeout_s = 86401", "comm.connect_timeout_s"),
        ("rendezvous_timeout_s = 0", "comm.rendezvous_timeout_s"),
        ("bucket_cap_mb = 1e12", "comm.bucket_cap_mb"),
    ] {
        let err = JobSpec::from_toml_str(&format!("{base}{line}\n"), Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{field} = ")) && err.contains("must be a number > 0 and <= "),
            "{line}: {err}"
        );
    }
    // The bounds themselves are accepted, and every accepted timeout is
    // a usable Duration.
    let ok = JobSpec::from_toml_str(
        &format!("{base}timeout_s = 86400\nbucket_cap_mb = 4096\n"),
        Path::new("t.toml"),
    )
    .unwrap();
    assert!(std::time::Duration::try_from_secs_f64(ok.comm.timeout_s).is_ok());
}

/// Counts, sizes and indices: the largest accepted value is accepted, one
/// more is refused with the range, for every bounded integer field.
#[test]
fn counts_and_sizes_are_bounded() {
    let top = "name = \"t\"\n";
    let tail = "[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 2\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
    let with = |line: &str| {
        // A line `[table] key = v` goes into its table, others at the top.
        match line.split_once("] ") {
            Some((table, kv)) => {
                let t = &table[1..];
                if tail.contains(&format!("[{t}]\n")) {
                    format!(
                        "{top}{}",
                        tail.replace(&format!("[{t}]\n"), &format!("[{t}]\n{kv}\n"))
                    )
                } else {
                    format!("{top}{tail}[{t}]\n{kv}\n")
                }
            }
            None => format!("{top}{line}\n{tail}"),
        }
    };
    for (ok, bad, field) in [
        ("workers = 1024", "workers = 1025", "workers"),
        ("max_workers = 1024", "max_workers = 1025", "max_workers"),
        (
            "max_steps = 1000000000000",
            "max_steps = 1000000000001",
            "max_steps",
        ),
        ("epochs = 1000000", "epochs = 1000001", "epochs"),
        ("threads = 1024", "threads = 1025", "threads"),
        (
            "device = \"cuda:1023\"",
            "device = \"cuda:99999999999999999999\"",
            "device",
        ),
        (
            "[model] num_classes = 1048576",
            "[model] num_classes = 1048577",
            "model.num_classes",
        ),
        (
            "[data] samples = 2147483648",
            "[data] samples = 2147483649",
            "data.samples",
        ),
        (
            "[data] eval_samples = 0",
            "[data] eval_samples = 2147483649",
            "data.eval_samples",
        ),
        (
            "[data] classes = 1048576",
            "[data] classes = 1048577",
            "data.classes",
        ),
        (
            "[data] shape = [1, 1, 1, 1, 1, 1, 1, 2]",
            "[data] shape = [1, 1, 1, 1, 1, 1, 1, 1, 2]",
            "data.shape",
        ),
        (
            "[data] shape = [1048576]",
            "[data] shape = [1048577]",
            "data.shape",
        ),
        (
            "[accumulation] steps = 65536",
            "[accumulation] steps = 65537",
            "accumulation.steps",
        ),
        (
            "[accumulation] global_batch = 131072",
            "[accumulation] global_batch = 131074",
            "accumulation.global_batch",
        ),
        (
            "[checkpoint] keep = 1000",
            "[checkpoint] keep = 1001",
            "checkpoint.keep",
        ),
        (
            "[eval] batch_size = 1048576",
            "[eval] batch_size = 1048577",
            "eval.batch_size",
        ),
        (
            "[schedule] warmup_steps = 1000000000000",
            "[schedule] warmup_steps = 1000000000001",
            "schedule.warmup_steps",
        ),
    ] {
        let ok_text = with(ok);
        if let Err(e) = JobSpec::fields_from_toml_str(&ok_text, Path::new("t.toml")) {
            panic!("{ok} refused: {e}\n{ok_text}");
        }
        let errs = invalid(&with(bad));
        assert_eq!(errs.len(), 1, "{bad}: {errs:?}");
        assert_eq!(errs[0].field, field, "{bad}");
        assert!(errs[0].allowed.contains(".."), "{bad}: {}", errs[0]);
    }
}

#[test]
fn job_names() {
    for ok in ["a", "0", "digits-mlp", "a.b_c-d", "x1", &"a".repeat(63)] {
        assert!(is_valid_job_name(ok), "{ok:?}");
    }
    for bad in [
        "",
        "-a",
        "a-",
        ".a",
        "a_",
        "A",
        "job name",
        "jöb",
        "a/b",
        "a\n",
        &"a".repeat(64),
    ] {
        assert!(!is_valid_job_name(bad), "{bad:?}");
    }
    let errs = invalid(&BASE.replace("name = \"unit\"", "name = \"My Job\""));
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(
        errs[0].to_string(),
        format!("name = \"My Job\": {JOB_NAME_RULE}")
    );
}

fn name_regex() -> regex::Regex {
    regex::Regex::new(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$").unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Accepted exactly when the regex of the rule matches (the regex
    /// crate is the independent implementation).
    #[test]
    fn job_name_rule_is_the_regex(
        name in prop_oneof![
            "[a-z0-9._-]{0,66}",
            "[a-z0-9][a-z0-9._-]{0,63}[a-z0-9]",
            "[a-zA-Z0-9._ /-]{0,8}",
            ".{0,70}",
        ]
    ) {
        prop_assert_eq!(is_valid_job_name(&name), name_regex().is_match(&name), "{:?}", name);
    }
}

#[test]
fn sharding_stage_is_0_to_3_and_defaults_to_0() {
    let ok = |stage: u32| {
        JobSpec::fields_from_toml_str(
            &format!("{BASE}[sharding]\nstage = {stage}\n"),
            Path::new("t.toml"),
        )
        .unwrap()
        .sharding
        .stage
    };
    assert_eq!((ok(0), ok(1), ok(2), ok(3)), (0, 1, 2, 3));
    let plain = JobSpec::fields_from_toml_str(BASE, Path::new("t.toml")).unwrap();
    assert_eq!(plain.sharding.stage, 0);
    let e = invalid(&format!("{BASE}[sharding]\nstage = 4\n"));
    assert_eq!(e.len(), 1, "{e:?}");
    let text = e[0].to_string();
    assert!(
        text.starts_with("sharding.stage = 4: must be 0 (none), 1 (optimizer state sharded), 2 (optimizer state and gradients sharded) or 3"),
        "{text}"
    );
    // reshard_after_forward is stage 3's alone.
    let e = invalid(&format!(
        "{BASE}[sharding]\nstage = 2\nreshard_after_forward = false\n"
    ));
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].to_string()
            == "sharding.reshard_after_forward = false: applies to sharding.stage = 3 (the parameters sharded), not 2",
        "{}",
        e[0]
    );
    // So is prefetch.
    let e = invalid(&format!("{BASE}[sharding]\nstage = 1\nprefetch = false\n"));
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(
        e[0].to_string(),
        "sharding.prefetch = false: applies to sharding.stage = 3 (the parameters sharded), not 1"
    );
    let three = JobSpec::fields_from_toml_str(
        &format!("{BASE}[sharding]\nstage = 3\nreshard_after_forward = false\nprefetch = false\n"),
        Path::new("t.toml"),
    )
    .unwrap();
    assert_eq!(three.sharding.reshard_after_forward, Some(false));
    assert_eq!(three.sharding.prefetch, Some(false));
}

#[test]
fn precision_defaults_to_fp32_and_loss_scaling_to_grad_scalers() {
    let s = JobSpec::fields_from_toml_str(BASE, Path::new("t.toml")).unwrap();
    assert_eq!(s.precision, Precision::Fp32);
    assert_eq!(
        s.loss_scaling,
        LossScalingSpec {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    );
    let fp16 = format!(
        "precision = \"fp16\"\n{BASE}[loss_scaling]\ninit_scale = 1024.0\ngrowth_interval = 10\n"
    );
    let s = JobSpec::fields_from_toml_str(&fp16, Path::new("t.toml")).unwrap();
    assert_eq!(
        (
            s.precision,
            s.loss_scaling.init_scale,
            s.loss_scaling.growth_interval
        ),
        (Precision::Fp16, 1024.0, 10)
    );
    assert_eq!(s.loss_scaling.backoff_factor, 0.5);
}

#[test]
fn bad_precision_and_loss_scaling_name_the_field_and_the_allowed_values() {
    let e = invalid(&format!("precision = \"fp8\"\n{BASE}"));
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(
        e[0].to_string(),
        "precision = \"fp8\": must be one of fp32, bf16, fp16"
    );
    let e = invalid(&format!(
        "precision = \"fp16\"\n{BASE}[loss_scaling]\ninit_scale = 0.0\ngrowth_factor = 1.0\nbackoff_factor = 1.5\ngrowth_interval = 0\n"
    ));
    let text: Vec<String> = e.iter().map(|e| e.to_string()).collect();
    assert_eq!(text.len(), 4, "{text:?}");
    for field in [
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
    ] {
        assert!(
            text.iter()
                .any(|t| t.starts_with(&format!("loss_scaling.{field} = "))),
            "{field}: {text:?}"
        );
    }
    let e = invalid(&format!(
        "precision = \"bf16\"\n{BASE}[loss_scaling]\ninit_scale = 8.0\n"
    ));
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].to_string()
            .contains("applies with precision = \"fp16\" only (precision is \"bf16\")"),
        "{}",
        e[0]
    );
}

/// Issue 28: every path field is capped at 4096 bytes with a short field
/// error (at submit, through the proto, and when a spec file is loaded);
/// 4096 bytes pass.
#[test]
fn path_fields_are_capped_with_a_short_field_error() {
    let long = format!("/{}", "d/".repeat(2048)); // 4097 bytes
    let exact = &long[..MAX_PATH_BYTES];
    for (field, toml) in [
        ("data.path", "[data]\npath = {p}\n"),
        ("data.eval_path", "[data]\neval_path = {p}\n"),
        ("model.path", "[model]\npath = {p}\n"),
        ("model.init", "[model]\ninit = {p}\n"),
        ("checkpoint.dir", "[checkpoint]\ndir = {p}\n"),
    ] {
        // The field goes into its section of BASE (or a new one).
        let (section, line) = toml.split_once('\n').unwrap();
        // model.path is only allowed with a TorchScript model.
        let base = if field == "model.path" {
            BASE.replace("kind = \"mlp\"", "kind = \"torchscript\"")
        } else {
            BASE.to_string()
        };
        let with = |p: &str| {
            let line = line.replace("{p}", &format!("{p:?}"));
            if base.contains(section) {
                base.replace(section, &format!("{section}\n{line}"))
            } else {
                format!("{base}{section}\n{line}\n")
            }
        };
        let e = invalid(&with(&long));
        let mine: Vec<&FieldError> = e.iter().filter(|e| e.field == field).collect();
        assert_eq!(mine.len(), 1, "{field}: one error, the length: {e:?}");
        let text = mine[0].to_string();
        assert!(
            text.starts_with(&format!("{field} = \"/d/d/d/"))
                && text.ends_with("… (4097 bytes): must be at most 4096 bytes"),
            "{text}"
        );
        assert!(text.len() < 300, "{} characters: {text}", text.len());
        // At the limit it is not refused for its length.
        let ok = JobSpec::fields_from_toml_str(&with(exact), Path::new("t.toml"));
        if let Err(LoadError::Invalid { source, .. }) = &ok {
            assert!(
                source.0.iter().all(|e| !e.allowed.contains("at most")),
                "{field}: {source}"
            );
        }
    }
    // With the file checks on, an over-long path is refused for its length
    // only (not also as a missing file, quoting it whole).
    let text = BASE.replace("[data]", &format!("[data]\npath = {long:?}"));
    let text = text.replace("kind = \"synthetic\"", "kind = \"tensors\"");
    match JobSpec::from_toml_str(&text, Path::new("t.toml")) {
        Err(LoadError::Invalid { source, .. }) => {
            assert_eq!(source.0.len(), 1, "{source}");
            assert!(source.to_string().len() < 300, "{source}");
        }
        other => panic!("{other:?}"),
    }
}

/// Any refused value is shown by its start: a megabyte string never makes
/// a megabyte error.
#[test]
fn a_huge_refused_value_is_shown_by_its_start() {
    let device = "x".repeat(60_000); // a spec file holds at most 64 KiB
    let e = invalid(&BASE.replace(
        "name = \"unit\"",
        &format!("name = \"unit\"\ndevice = {device:?}"),
    ));
    let text = e[0].to_string();
    assert!(text.starts_with("device = \"xxxx"), "{text}");
    assert!(
        text.contains(&format!("… ({} bytes)", device.len())),
        "{text}"
    );
    assert!(text.len() < 300, "{} characters", text.len());
    assert_eq!(shown("short"), "short");
}

/// A spec file above 64 KiB is refused before it is parsed (`accrue
/// submit`, `accrue local`, `accrue-worker train` all load through here);
/// 64 KiB is accepted.
#[test]
fn spec_files_are_capped_at_64_kib() {
    let d = tempfile::tempdir().unwrap();
    let pad = |n: usize| format!("{BASE}#{}\n", "p".repeat(n - BASE.len() - 2));
    let at = d.path().join("at.toml");
    std::fs::write(&at, pad(MAX_SPEC_BYTES)).unwrap();
    assert_eq!(std::fs::metadata(&at).unwrap().len(), MAX_SPEC_BYTES as u64);
    JobSpec::load_fields(&at).unwrap();
    let over = d.path().join("over.toml");
    std::fs::write(&over, pad(MAX_SPEC_BYTES + 1)).unwrap();
    for r in [JobSpec::load_fields(&over), JobSpec::load(&over)] {
        let e = r.unwrap_err();
        assert!(matches!(e, LoadError::TooLarge { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!(
                "job spec {} is larger than 65536 bytes (64 KiB), the most a spec may be",
                over.display()
            )
        );
    }
    let text = pad(MAX_SPEC_BYTES + 1);
    assert!(matches!(
        JobSpec::fields_from_toml_str(&text, Path::new("t.toml")),
        Err(LoadError::TooLarge { .. })
    ));
}

/// Issue 38: `[parallel]`'s degrees multiply to `workers` (refused naming
/// all four numbers otherwise); a split model is refused until its
/// strategies exist; data defaults to the rest.
#[test]
fn parallel_degrees_multiply_to_workers_and_split_models_wait() {
    let base = BASE.replace("name = \"unit\"\n", "name = \"unit\"\nworkers = 4\n");
    let s = JobSpec::fields_from_toml_str(
        &format!("{base}[parallel]\ndata = 4\n"),
        Path::new("t.toml"),
    )
    .unwrap();
    assert_eq!(s.parallel_dims().unwrap(), ParallelDims::data_only(4));
    let plain = JobSpec::fields_from_toml_str(&base, Path::new("t.toml")).unwrap();
    assert_eq!(plain.parallel_dims().unwrap(), ParallelDims::data_only(4));
    let e = invalid(&format!("{base}[parallel]\ndata = 3\n"));
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(
        e[0].to_string(),
        "parallel = {data = 3, pipeline = 1, tensor = 1}: data x pipeline x tensor = 3 must equal workers = 4"
    );
    // An mlp of two layers (one hidden): two stages fit, and four
    // workers are two replicas of two stages.
    let two_layers = base.replace("kind = \"mlp\"\n", "kind = \"mlp\"\nhidden = [4]\n");
    let s = JobSpec::fields_from_toml_str(
        &format!("{two_layers}[parallel]\npipeline = 2\n"),
        Path::new("t.toml"),
    )
    .unwrap();
    assert_eq!(
        s.parallel_dims().unwrap(),
        ParallelDims {
            data: 2,
            pipeline: 2,
            tensor: 1
        }
    );
    // Tensor parallelism: a decoder family only, its heads divided.
    let e = invalid(&format!("{base}[parallel]\ntensor = 2\n"));
    assert_eq!(e[0].field, "parallel.tensor");
    assert!(
        e[0].allowed
            .contains("the families that do: llama, qwen2, mistral"),
        "{e:?}"
    );
    let e = invalid(&format!("{base}[parallel]\ntensor = 3\n"));
    assert_eq!(e[0].field, "parallel");
    assert!(
        e[0].allowed.contains("tensor = 3 must divide workers = 4"),
        "{e:?}"
    );
}

/// Issue 38: a global batch is split over the data ranks, not the world:
/// W = 8 as 4 data x 2 pipeline ranks with b = 2 and 32 in a step is
/// k = 32 / (4 x 2) = 4 (the world would say 2).
#[test]
fn the_global_batch_follows_the_data_degree() {
    let mut s = JobSpec::fields_from_toml_str(BASE, Path::new("t.toml")).unwrap();
    s.data.batch_size = 2;
    s.accumulation.global_batch = Some(32);
    assert_eq!(s.accumulation_steps(8).unwrap(), 2);
    s.parallel.pipeline = Some(2);
    assert_eq!(s.accumulation_steps(8).unwrap(), 4);
    let e = s.accumulation_steps(12).unwrap_err();
    assert!(
        e.allowed
            .contains("data ranks (workers / (pipeline x tensor)) * data.batch_size = 12"),
        "{e:?}"
    );
}

/// A worker knows its data degree: k from it is the coordinator's k for
/// the whole mesh, tensor ranks included (4 data x 2 pipeline x 2 tensor,
/// b = 2, 32 a step: k = 4 both ways).
#[test]
fn k_from_the_data_degree_is_the_meshs() {
    let mut s = JobSpec::fields_from_toml_str(BASE, Path::new("t.toml")).unwrap();
    s.data.batch_size = 2;
    s.accumulation.global_batch = Some(32);
    s.parallel.pipeline = Some(2);
    s.parallel.tensor = Some(2);
    assert_eq!(s.accumulation_steps(16).unwrap(), 4);
    assert_eq!(s.accumulation_steps_for_data(4).unwrap(), 4);
    s.accumulation.steps = Some(3);
    assert_eq!(s.accumulation_steps_for_data(4).unwrap(), 3);
}

/// Issue 39: `checkpoint.max_shard_size` reads as transformers'
/// `convert_file_size_to_int` (5.24) does, and what it cannot read is
/// refused by name with the allowed forms.
#[test]
fn shard_sizes_read_as_transformers_reads_them() {
    for (text, bytes) in [
        ("50GB", 50_000_000_000),
        ("5MB", 5_000_000),
        ("5mb", 625_000),
        ("5Mb", 625_000),
        ("2GiB", 2 << 30),
        ("3kib", 3 << 10),
        ("1024", 1024),
    ] {
        assert_eq!(shard_size_bytes(text), Some(bytes), "{text}");
    }
    for bad in [
        "",
        "0",
        "0GB",
        "GB",
        "5 TB",
        "-1",
        "1.5GB",
        "99999999999999999999GB",
    ] {
        assert_eq!(shard_size_bytes(bad), None, "{bad:?}");
    }
    let e = invalid(&format!("{BASE}[checkpoint]\nmax_shard_size = \"5TB\"\n"));
    assert_eq!(e[0].field, "checkpoint.max_shard_size");
    assert!(e[0].allowed.contains("GiB"), "{e:?}");
}

/// Issue 39: `data.pack` packs rows, so only sequences take it.
#[test]
fn packing_is_for_sequences_only() {
    let lm = "name = \"p\"\n[model]\nkind = \"llama\"\nvocab_size = 10\nhidden_size = 8\nintermediate_size = 16\nnum_hidden_layers = 1\nnum_attention_heads = 2\n[data]\nkind = \"KIND\"\npath = \"x\"\nseq_len = 4\nbatch_size = 2\npack = true\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
    let s = JobSpec::fields_from_toml_str(&lm.replace("KIND", "sequences"), Path::new("t.toml"))
        .unwrap();
    assert!(s.data.pack);
    assert_eq!(s.validate_fields(), Ok(()));
    let e = invalid(&lm.replace("KIND", "tokens"));
    assert_eq!(e[0].field, "data.pack", "{e:?}");
    assert!(e[0].allowed.contains("data.kind = sequences"), "{e:?}");
}

/// Issue 40: `[parallel]`'s pipeline fields: only with stages, only for
/// the families that run in stages, and counts that fit the model (each
/// refusal names the field and the numbers; pipeline itself is refused
/// until its engine exists, beside them).
#[test]
fn pipeline_fields_fit_the_model() {
    let mlp = |extra: &str| {
        format!(
            "name = \"p\"\nworkers = 2\n[model]\nkind = \"mlp\"\nhidden = [8, 8]\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n[parallel]\n{extra}"
        )
    };
    let fields = |e: &[FieldError]| e.iter().map(|e| e.field.clone()).collect::<Vec<_>>();
    // Without stages.
    let e = invalid(&mlp("schedule = \"gpipe\"\nlayers_per_stage = [1, 2]\n"));
    assert_eq!(
        fields(&e),
        ["parallel.schedule", "parallel.layers_per_stage"],
        "{e:?}"
    );
    assert!(e[0].allowed.contains("parallel.pipeline >= 2"));
    // A schedule that is not one.
    let e = invalid(&mlp("pipeline = 2\nschedule = \"zb\"\n"));
    assert!(
        e.iter()
            .any(|e| e.field == "parallel.schedule" && e.allowed.contains("1f1b")),
        "{e:?}"
    );
    // Counts: 3 layers (2 hidden + the output).
    let e = invalid(&mlp("pipeline = 2\nlayers_per_stage = [1, 1]\n"));
    let counts = e
        .iter()
        .find(|e| e.field == "parallel.layers_per_stage")
        .unwrap();
    assert!(
        counts
            .allowed
            .contains("add up to 2; the model has 3 layers"),
        "{e:?}"
    );
    let e = invalid(&mlp("pipeline = 2\nlayers_per_stage = [3]\n"));
    assert!(
        e.iter()
            .any(|e| e.allowed.contains("1 entries for parallel.pipeline = 2")),
        "{e:?}"
    );
    let e = invalid(&mlp("pipeline = 2\nlayers_per_stage = [3, 0]\n"));
    assert!(e.iter().any(|e| e.allowed.contains("at least 1")), "{e:?}");
    let ok = mlp("pipeline = 2\nlayers_per_stage = [1, 2]\n");
    let s = JobSpec::fields_from_toml_str(&ok, Path::new("t.toml")).unwrap();
    assert_eq!(s.parallel.layers_per_stage, Some(vec![1, 2]));
    // CUDA and sync = every_step run in stages.
    let ok = format!(
        "device = \"cuda:0\"\n{}",
        mlp("pipeline = 2\n").replace("[data]", "[accumulation]\nsync = \"every_step\"\n[data]")
    );
    JobSpec::fields_from_toml_str(&ok, Path::new("t.toml")).unwrap();
    // An elastic world of whole replicas re-forms (a lost stage's replica
    // shrinks away); a bound that splits a replica is refused.
    let elastic = mlp("pipeline = 2\n").replace(
        "workers = 2",
        "workers = 4\nmin_workers = 2\nmax_workers = 6",
    );
    JobSpec::fields_from_toml_str(&elastic, Path::new("t.toml")).unwrap();
    let e = invalid(&elastic.replace("min_workers = 2", "min_workers = 3"));
    assert!(
        e.iter()
            .any(|e| e.field == "min_workers"
                && e.allowed.contains("multiple of pipeline x tensor = 2")),
        "{e:?}"
    );
    // What the boundaries balance: parameters (default) or compute; not
    // with fixed counts, not without stages, only the two names.
    let c = mlp("pipeline = 2\nbalance = \"compute\"\n");
    let s = JobSpec::fields_from_toml_str(&c, Path::new("t.toml")).unwrap();
    assert_eq!(s.parallel.balance, Some(StageBalance::Compute));
    let e = invalid(&mlp(
        "pipeline = 2\nbalance = \"compute\"\nlayers_per_stage = [1, 2]\n",
    ));
    assert!(
        e.iter()
            .any(|e| e.field == "parallel.balance" && e.allowed.contains("not both")),
        "{e:?}"
    );
    let e = invalid(&mlp("balance = \"compute\"\n"));
    assert!(
        e.iter()
            .any(|e| e.field == "parallel.balance" && e.allowed.contains("parallel.pipeline >= 2")),
        "{e:?}"
    );
    let e = invalid(&mlp("pipeline = 2\nbalance = \"flops\"\n"));
    assert!(
        e.iter().any(|e| e.field == "parallel.balance"
            && e.allowed.contains("parameters")
            && e.allowed.contains("compute")),
        "{e:?}"
    );
    // Activation checkpointing (issue 41): families with blocks, in
    // stages too, checkpoint_every only with it and >= 1.
    let ac = |extra: &str| {
        mlp("").replace(
            "[parallel]\n",
            &format!("[performance]\nactivation_checkpointing = \"full\"\n{extra}[parallel]\n"),
        )
    };
    JobSpec::fields_from_toml_str(&ac("checkpoint_every = 2\n"), Path::new("t.toml")).unwrap();
    let e = invalid(&ac("checkpoint_every = 0\n"));
    assert!(
        e.iter()
            .any(|e| e.field == "performance.checkpoint_every" && e.allowed.contains(">= 1")),
        "{e:?}"
    );
    JobSpec::fields_from_toml_str(
        &ac("").replace("[parallel]\n", "[parallel]\npipeline = 2\n"),
        Path::new("t.toml"),
    )
    .unwrap();
    let e = invalid(&ac("").replace("kind = \"mlp\"\nhidden = [8, 8]", "kind = \"lenet5\""));
    assert!(
        e.iter()
            .any(|e| e.field == "performance.activation_checkpointing"
                && e.allowed.contains(&format!("{}, mlp", decoder_names(", ")))),
        "{e:?}"
    );
    let e = invalid(&mlp("").replace(
        "[parallel]\n",
        "[performance]\ncheckpoint_every = 2\n[parallel]\n",
    ));
    assert!(
        e.iter().any(|e| e.field == "performance.checkpoint_every"
            && e.allowed.contains("activation_checkpointing = \"full\"")),
        "{e:?}"
    );
    // Packed rows run in stages (issue 40).
    let packed = mlp("pipeline = 2\n").replace("[data]", "[data]\npack = true");
    if let Err(LoadError::Invalid { source, .. }) =
        JobSpec::fields_from_toml_str(&packed, Path::new("t.toml"))
    {
        assert!(
            !source
                .0
                .iter()
                .any(|e| e.allowed.contains("parallel.pipeline")),
            "{:?}",
            source.0
        );
    }
    // More stages than layers; a family that has no stages.
    let e = invalid(
        &mlp("pipeline = 2\n")
            .replace("workers = 2", "workers = 4")
            .replace("pipeline = 2", "pipeline = 4"),
    );
    assert!(
        e.iter().any(
            |e| e.allowed.contains("the model has 3 layers") && e.allowed.contains("at most 3")
        ),
        "{e:?}"
    );
    let e = invalid(
        &mlp("pipeline = 2\n").replace("kind = \"mlp\"\nhidden = [8, 8]", "kind = \"lenet5\""),
    );
    assert!(
        e.iter()
            .any(|e| e.allowed.contains("does not run in pipeline stages")
                && e.allowed.contains(&format!("{}, mlp", decoder_names(", ")))),
        "{e:?}"
    );
}

/// Every example job in jobs/ is a valid spec, its files aside (the
/// tensor-parallel one's heads, key-value heads and MLP divide by its T).
#[test]
fn the_example_jobs_are_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../jobs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            // Fields only: the data files are made by `make demo-lm`.
            JobSpec::fields_from_toml_str(&text, &path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            seen += 1;
        }
    }
    assert!(seen >= 3, "{seen} example jobs");
}

/// The decoder families' kinds, as the registry lists them, joined by `sep`.
pub(crate) fn decoder_names(sep: &str) -> String {
    let names: Vec<&str> = decoder_kinds().into_iter().map(ModelKind::as_str).collect();
    names.join(sep)
}
