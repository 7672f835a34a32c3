//! The job spec (common/src/spec, docs/SPEC.md): unknown fields are
//! refused at parse time; every bad value is reported, all at once, with its
//! field path, the value and the allowed range.

use accrue_worker::spec::{
    FieldError, LoadError, ModelKind, Normalize, OnNonfinite, SpecEnum, SpecErrors, SyncMode,
};
use accrue_worker::JobSpec;
use std::path::Path;
use tempfile::TempDir;

/// A valid minimal spec: synthetic data needs no files.
const BASE: &str = r#"name = "unit"
workers = 2

[model]
kind = "mlp"

[data]
kind = "synthetic"
batch_size = 8

[optimizer]
kind = "sgd"
lr = 0.1
"#;

const ORIGIN: &str = "/jobs/unit.toml";

/// BASE with `lines` added to `[section]` (created at the end when BASE has
/// no such section; "" is the top level). Later keys override nothing: a test
/// that changes a key BASE sets uses `replace` instead.
fn with(text: &str, section: &str, lines: &str) -> String {
    if section.is_empty() {
        return format!("{lines}\n{text}");
    }
    let header = format!("[{section}]\n");
    match text.find(&header) {
        Some(at) => {
            let at = at + header.len();
            format!("{}{lines}\n{}", &text[..at], &text[at..])
        }
        None => format!("{text}\n{header}{lines}\n"),
    }
}

fn replace(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "{from:?} is not in the spec");
    text.replacen(from, to, 1)
}

/// Loads a spec whose values (not its syntax) must be refused; the errors.
fn errors(text: &str) -> Vec<FieldError> {
    match JobSpec::from_toml_str(text, Path::new(ORIGIN)) {
        Ok(_) => panic!("spec was accepted:\n{text}"),
        Err(LoadError::Invalid {
            path,
            source: SpecErrors(errs),
        }) => {
            assert_eq!(path, Path::new(ORIGIN));
            assert!(!errs.is_empty());
            errs
        }
        Err(other) => panic!("expected refused values, got {other}\n{text}"),
    }
}

/// Exactly one error, on `field`; returns it.
fn one_error(text: &str, field: &str) -> FieldError {
    let errs = errors(text);
    assert_eq!(
        errs.len(),
        1,
        "expected one error on {field}, got {errs:#?}"
    );
    assert_eq!(errs[0].field, field, "{errs:#?}");
    errs[0].clone()
}

fn accepted(text: &str) -> JobSpec {
    JobSpec::from_toml_str(text, Path::new(ORIGIN))
        .unwrap_or_else(|e| panic!("spec refused: {e}\n{text}"))
}

#[test]
fn minimal_synthetic_spec_is_valid_with_defaults() {
    let spec = accepted(BASE);
    assert_eq!(spec.validate(), Ok(()));
    assert_eq!(spec.name, "unit");
    assert_eq!(spec.workers, 2);
    assert_eq!(spec.data.batch_size, 8);
    assert_eq!(spec.optimizer.lr, 0.1);
    assert_eq!(spec.device, "auto");
    assert_eq!(spec.accumulation.normalize, Normalize::GlobalCount);
    assert_eq!(spec.accumulation.sync, SyncMode::Boundary);
    assert_eq!(spec.norm_type(), 2.0);
    assert_eq!(spec.clipping.on_nonfinite, OnNonfinite::Skip);
    assert_eq!(spec.accumulation_steps(2), Ok(1));
}

#[test]
fn accumulation_steps_zero_is_refused() {
    let e = one_error(
        &with(BASE, "accumulation", "steps = 0"),
        "accumulation.steps",
    );
    assert_eq!(e.value, "0");
    assert_eq!(e.allowed, "must be an integer in 1..=65536");
    assert_eq!(
        e.to_string(),
        "accumulation.steps = 0: must be an integer in 1..=65536"
    );
    // 1 is fine.
    let spec = accepted(&with(BASE, "accumulation", "steps = 1"));
    assert_eq!(spec.accumulation_steps(2), Ok(1));
}

#[test]
fn data_batch_size_zero_is_refused() {
    let e = one_error(
        &replace(BASE, "batch_size = 8", "batch_size = 0"),
        "data.batch_size",
    );
    assert_eq!(e.value, "0");
    assert_eq!(e.allowed, "must be an integer in 1..=1048576");
}

#[test]
fn optimizer_lr_zero_negative_and_nan_are_refused() {
    for (lit, shown) in [
        ("0.0", "0.0"),
        ("0", "0.0"),
        ("-0.1", "-0.1"),
        ("nan", "NaN"),
        ("inf", "inf"),
    ] {
        let text = replace(BASE, "lr = 0.1", &format!("lr = {lit}"));
        let e = one_error(&text, "optimizer.lr");
        assert_eq!(e.value, shown, "lr = {lit}");
        assert_eq!(e.allowed, "must be a finite number > 0", "lr = {lit}");
        // From text, the error carries the spec's path and the field.
        let err = JobSpec::from_toml_str(&text, Path::new(ORIGIN)).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, LoadError::Invalid { .. }), "{msg}");
        assert!(msg.contains(ORIGIN), "{msg}");
        assert!(
            msg.contains(&format!(
                "optimizer.lr = {shown}: must be a finite number > 0"
            )),
            "{msg}"
        );
    }
    // A tiny positive lr is fine.
    accepted(&replace(BASE, "lr = 0.1", "lr = 1e-9"));
}

/// `fused = true` is PyTorch's fused Adam/AdamW: accepted with adam and
/// adamw, refused with sgd (naming the allowed kinds); off by default.
#[test]
fn optimizer_fused_is_for_adam_and_adamw() {
    assert!(!accepted(BASE).optimizer.fused);
    let e = one_error(&with(BASE, "optimizer", "fused = true"), "optimizer.fused");
    assert_eq!(e.value, "true");
    assert_eq!(
        e.allowed,
        "fused = true is only allowed with optimizer.kind = adam or adamw (sgd: false)"
    );
    for kind in ["adam", "adamw"] {
        let text = replace(BASE, "kind = \"sgd\"", &format!("kind = \"{kind}\""));
        assert!(
            accepted(&with(&text, "optimizer", "fused = true"))
                .optimizer
                .fused
        );
    }
}

#[test]
fn clipping_max_norm_must_be_positive() {
    for (lit, shown) in [("0.0", "0.0"), ("-1.0", "-1.0"), ("nan", "NaN")] {
        let e = one_error(
            &with(BASE, "clipping", &format!("max_norm = {lit}")),
            "clipping.max_norm",
        );
        assert_eq!(e.value, shown);
        assert_eq!(e.allowed, "must be a finite number > 0");
    }
    let spec = accepted(&with(BASE, "clipping", "max_norm = 1.0"));
    assert_eq!(spec.clipping.max_norm, Some(1.0));
}

#[test]
fn clipping_norm_type_must_be_2_or_inf() {
    for (lit, shown) in [
        ("1.0", "1.0"),
        ("3.0", "3.0"),
        ("-inf", "-inf"),
        ("0.0", "0.0"),
    ] {
        let e = one_error(
            &with(
                BASE,
                "clipping",
                &format!("max_norm = 1.0\nnorm_type = {lit}"),
            ),
            "clipping.norm_type",
        );
        assert_eq!(e.value, shown);
        assert_eq!(e.allowed, "must be 2.0 or inf");
    }
    let spec = accepted(&with(BASE, "clipping", "max_norm = 1.0\nnorm_type = inf"));
    assert_eq!(spec.norm_type(), f64::INFINITY);
    let spec = accepted(&with(BASE, "clipping", "max_norm = 1.0\nnorm_type = 2.0"));
    assert_eq!(spec.norm_type(), 2.0);
}

#[test]
fn clipping_max_norm_and_clip_value_together_are_refused() {
    let e = one_error(
        &with(BASE, "clipping", "max_norm = 1.0\nclip_value = 0.5"),
        "clipping.clip_value",
    );
    assert!(e.value.contains("0.5"), "{e}");
    assert_eq!(
        e.allowed,
        "set either clipping.max_norm or clipping.clip_value, not both"
    );
    // Either one alone is fine.
    accepted(&with(BASE, "clipping", "clip_value = 0.5"));
    accepted(&with(BASE, "clipping", "max_norm = 1.0"));
}

#[test]
fn unknown_model_kind_lists_the_allowed_kinds() {
    let e = one_error(
        &replace(BASE, r#"kind = "mlp""#, r#"kind = "transformer""#),
        "model.kind",
    );
    assert_eq!(e.value, "\"transformer\"");
    assert_eq!(e.allowed, ModelKind::allowed());
    for kind in ["lenet5", "resnet18", "resnet34"] {
        accepted(&replace(
            BASE,
            r#"kind = "mlp""#,
            &format!("kind = {kind:?}"),
        ));
    }
}

#[test]
fn unknown_data_kind_lists_the_allowed_kinds() {
    let e = one_error(
        &replace(BASE, r#"kind = "synthetic""#, r#"kind = "imagenet""#),
        "data.kind",
    );
    assert_eq!(e.value, "\"imagenet\"");
    assert_eq!(
        e.allowed,
        "must be one of mnist, cifar10, tensors, synthetic, sequences, tokens"
    );
}

fn mnist_spec(folder: &Path) -> String {
    replace(
        BASE,
        r#"kind = "synthetic""#,
        &format!(
            "kind = \"mnist\"\npath = {:?}",
            folder.display().to_string()
        ),
    )
}

#[test]
fn mnist_with_a_missing_folder_names_data_path() {
    let dir = TempDir::new().unwrap();
    let folder = dir.path().join("no-such-mnist");
    let errs = errors(&mnist_spec(&folder));
    // One error for the missing folder, naming it and the files it must hold.
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert_eq!(errs[0].field, "data.path");
    assert!(
        errs[0].value.contains(&folder.display().to_string()),
        "{errs:#?}"
    );
    assert!(
        errs[0]
            .allowed
            .starts_with("must name an existing folder holding train-images-idx3-ubyte"),
        "{errs:#?}"
    );

    // With the four files present (contents are checked by the loader), it passes.
    std::fs::create_dir(&folder).unwrap();
    for f in accrue_worker::source::data::MNIST_FILES {
        std::fs::write(folder.join(f), b"").unwrap();
    }
    accepted(&mnist_spec(&folder));

    // Only one file missing: exactly that file is reported.
    std::fs::remove_file(folder.join("t10k-labels-idx1-ubyte")).unwrap();
    let e = one_error(&mnist_spec(&folder), "data.path");
    assert!(e.value.contains("t10k-labels-idx1-ubyte"), "{e}");
}

#[test]
fn mnist_without_a_path_is_refused() {
    let e = one_error(
        &replace(BASE, r#"kind = "synthetic""#, r#"kind = "mnist""#),
        "data.path",
    );
    assert_eq!(e.allowed, "required for data.kind = mnist");
}

#[test]
fn model_init_naming_a_missing_file_is_refused() {
    let dir = TempDir::new().unwrap();
    let init = dir.path().join("weights.safetensors");
    let text = with(
        BASE,
        "model",
        &format!("init = {:?}", init.display().to_string()),
    );
    let e = one_error(&text, "model.init");
    assert!(e.value.contains("weights.safetensors"), "{e}");
    assert_eq!(e.allowed, "must name an existing file");
    // Once the file exists the spec passes.
    std::fs::write(&init, b"").unwrap();
    accepted(&text);
    // A folder is not a file.
    let text = with(
        BASE,
        "model",
        &format!("init = {:?}", dir.path().display().to_string()),
    );
    one_error(&text, "model.init");
}

#[test]
fn several_bad_values_are_all_reported_at_once() {
    let mut text = replace(BASE, "lr = 0.1", "lr = -1.0");
    text = replace(&text, "batch_size = 8", "batch_size = 0");
    text = replace(&text, r#"kind = "mlp""#, r#"kind = "gpt""#);
    text = with(&text, "accumulation", "steps = 0");
    text = with(&text, "clipping", "max_norm = 0.0\nnorm_type = 1.0");
    let errs = errors(&text);
    let mut fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        vec![
            "accumulation.steps",
            "clipping.max_norm",
            "clipping.norm_type",
            "data.batch_size",
            "model.kind",
            "optimizer.lr",
        ],
        "{errs:#?}"
    );

    // The loader returns them in one error whose message lists every one.
    let err = JobSpec::from_toml_str(&text, Path::new(ORIGIN)).unwrap_err();
    let msg = err.to_string();
    match &err {
        LoadError::Invalid { path, source } => {
            assert_eq!(path, Path::new(ORIGIN));
            assert_eq!(source.0.len(), 6);
        }
        other => panic!("expected LoadError::Invalid, got {other:?}"),
    }
    for needle in [
        "accumulation.steps = 0: must be an integer in 1..=65536",
        "data.batch_size = 0: must be an integer in 1..=1048576",
        "optimizer.lr = -1.0: must be a finite number > 0",
        "clipping.max_norm = 0.0: must be a finite number > 0",
        "clipping.norm_type = 1.0: must be 2.0 or inf",
        &*format!("model.kind = \"gpt\": {}", ModelKind::allowed()),
    ] {
        assert!(msg.contains(needle), "{needle:?} missing from:\n{msg}");
    }
}

#[test]
fn unknown_field_is_refused_at_parse_time() {
    let text = with(BASE, "accumulation", "stepz = 4");
    let err = JobSpec::from_toml_str(&text, Path::new(ORIGIN)).unwrap_err();
    let msg = err.to_string();
    match &err {
        LoadError::Parse { path, message } => {
            assert_eq!(path, Path::new(ORIGIN));
            assert!(message.contains("unknown field"), "{message}");
            assert!(message.contains("stepz"), "{message}");
        }
        other => panic!("expected LoadError::Parse, got {other:?}"),
    }
    assert!(msg.contains(ORIGIN), "{msg}");
    assert!(msg.contains("stepz"), "{msg}");

    // Top level and other sections too.
    for (section, line, name) in [
        ("", "wokers = 2", "wokers"),
        ("optimizer", "learning_rate = 0.1", "learning_rate"),
        ("data", "batchsize = 8", "batchsize"),
    ] {
        let err =
            JobSpec::from_toml_str(&with(BASE, section, line), Path::new(ORIGIN)).unwrap_err();
        match err {
            LoadError::Parse { message, .. } => {
                assert!(message.contains(name), "{message}")
            }
            other => panic!("expected LoadError::Parse for {name}, got {other:?}"),
        }
    }
}

#[test]
fn wrong_type_is_refused_at_parse_time() {
    let text = replace(BASE, "lr = 0.1", r#"lr = "fast""#);
    match JobSpec::from_toml_str(&text, Path::new(ORIGIN)).unwrap_err() {
        // One line (issue 37): where, the line itself, and what is wrong.
        LoadError::Parse { message, .. } => assert!(
            message.starts_with("line ")
                && message.contains(r#"(`lr = "fast"`): invalid type: string "fast""#)
                && !message.contains('\n'),
            "{message}"
        ),
        other => panic!("expected LoadError::Parse, got {other:?}"),
    }
}

#[test]
fn global_batch_derives_k_and_must_be_divisible() {
    // global_batch = 64, b = 8, W = 2: k = 64 / (2 * 8) = 4.
    let spec = accepted(&with(BASE, "accumulation", "global_batch = 64"));
    assert_eq!(spec.accumulation.steps, None);
    assert_eq!(spec.accumulation_steps(2), Ok(4));
    // In a world of 1 or 4 ranks the same global batch means k = 8 or 2.
    assert_eq!(spec.accumulation_steps(1), Ok(8));
    assert_eq!(spec.accumulation_steps(4), Ok(2));
    // 64 is not a multiple of 3 * 8 = 24.
    let e = spec.accumulation_steps(3).unwrap_err();
    assert_eq!(e.field, "accumulation.global_batch");
    assert_eq!(e.value, "64");
    assert_eq!(
        e.allowed,
        "must be a positive multiple of workers * data.batch_size = 24"
    );

    // validate() refuses a global batch the configured W*b does not divide.
    let e = one_error(
        &with(BASE, "accumulation", "global_batch = 60"),
        "accumulation.global_batch",
    );
    assert_eq!(e.value, "60");
    assert_eq!(
        e.allowed,
        "must be a positive multiple of workers * data.batch_size = 16"
    );
    // Smaller than one window (W*b = 16) and zero are refused as well.
    one_error(
        &with(BASE, "accumulation", "global_batch = 8"),
        "accumulation.global_batch",
    );
    one_error(
        &with(BASE, "accumulation", "global_batch = 0"),
        "accumulation.global_batch",
    );

    // Explicit steps win, and setting both is refused.
    let spec = accepted(&with(BASE, "accumulation", "steps = 3"));
    assert_eq!(spec.accumulation_steps(2), Ok(3));
    let e = one_error(
        &with(BASE, "accumulation", "steps = 4\nglobal_batch = 64"),
        "accumulation.global_batch",
    );
    assert_eq!(
        e.allowed,
        "set either accumulation.steps or accumulation.global_batch, not both"
    );
}

#[test]
fn every_kind_refuses_unknown_values_with_the_allowed_names() {
    for (section, key, allowed) in [
        ("accumulation", "normalize", "global_count, mean, sum"),
        ("accumulation", "sync", "boundary, every_step"),
        ("clipping", "on_nonfinite", "skip, error"),
        ("schedule", "kind", "constant, cosine, step, linear_warmup"),
    ] {
        let field = format!("{section}.{key}");
        let e = one_error(&with(BASE, section, &format!("{key} = \"bogus\"")), &field);
        assert_eq!(e.value, "\"bogus\"");
        assert_eq!(e.allowed, format!("must be one of {allowed}"));
        // Wrong-typed values are refused the same way.
        let e = one_error(&with(BASE, section, &format!("{key} = 7")), &field);
        assert_eq!(e.value, "7");
    }
    let e = one_error(
        &replace(BASE, r#"kind = "sgd""#, r#"kind = "SGD""#),
        "optimizer.kind",
    );
    assert_eq!(e.allowed, "must be one of sgd, adam, adamw");
}

#[test]
fn an_unknown_kind_and_a_bad_value_are_reported_together() {
    let text = replace(BASE, r#"kind = "mlp""#, r#"kind = "gpt""#);
    let text = replace(&text, "lr = 0.1", "lr = 0.0");
    let errs = errors(&text);
    let shown: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(
        shown,
        vec![
            &*format!("model.kind = \"gpt\": {}", ModelKind::allowed()),
            "optimizer.lr = 0.0: must be a finite number > 0",
        ]
    );
}

#[test]
fn job_names_are_dns_labels() {
    for bad in [
        "",
        "Unit",
        "unit test",
        "-unit",
        "unit-",
        "unit/1",
        &"u".repeat(64),
    ] {
        let e = one_error(
            &replace(BASE, "name = \"unit\"", &format!("name = {bad:?}")),
            "name",
        );
        assert_eq!(e.value, format!("{bad:?}"));
        assert_eq!(
            e.allowed,
            "must be 1 to 63 characters of a-z, 0-9, '.', '_', '-', starting and ending with a letter or digit"
        );
    }
    for good in ["u", "digits-mlp", "run_2.v1", &"u".repeat(63)] {
        accepted(&replace(
            BASE,
            "name = \"unit\"",
            &format!("name = {good:?}"),
        ));
    }
}
