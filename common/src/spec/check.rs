//! Validation: every field checked, every refused value reported at once
//! with its field path, the value and the allowed range.

use super::family::{family, refuse_foreign_fields};
use super::*;

/// Collects field errors during validation.
#[derive(Default)]
pub struct Checker {
    errors: Vec<FieldError>,
    /// Whether file and folder checks run.
    files: bool,
}

/// The most characters of a refused value an error shows: a megabyte
/// string is named by its start (and its size), not repeated.
pub const MAX_SHOWN_CHARS: usize = 256;

/// `text` (a value as `{:?}` writes it) as a field error shows it: whole
/// up to [`MAX_SHOWN_CHARS`], else its first 64 characters, `…` and its
/// size in bytes (a quoted string's, without the quotes).
pub fn shown(text: &str) -> String {
    if text.chars().count() <= MAX_SHOWN_CHARS {
        return text.to_string();
    }
    let head: String = text.chars().take(64).collect();
    let quoted = text.len() >= 2 && text.starts_with('"') && text.ends_with('"');
    let bytes = if quoted { text.len() - 2 } else { text.len() };
    format!("{head}… ({bytes} bytes)")
}

impl Checker {
    pub fn fail(&mut self, field: &str, value: impl fmt::Debug, allowed: impl Into<String>) {
        self.errors.push(FieldError {
            field: field.to_string(),
            value: shown(&format!("{value:?}")),
            allowed: allowed.into(),
        });
    }

    /// A path of at most `max` bytes (the refusal shows its start).
    pub fn path_at_most(&mut self, field: &str, path: &Path, max: usize) {
        let len = path.as_os_str().len();
        if len > max {
            let head: String = path.to_string_lossy().chars().take(64).collect();
            self.errors.push(FieldError {
                field: field.to_string(),
                value: format!("{head:?}… ({len} bytes)"),
                allowed: format!("must be at most {max} bytes"),
            });
        }
    }

    pub fn positive_finite(&mut self, field: &str, value: f64) {
        if !(value.is_finite() && value > 0.0) {
            self.fail(field, value, "must be a finite number > 0");
        }
    }

    /// A value in (0, max] (`unit` names what it counts).
    pub fn positive_at_most(&mut self, field: &str, value: f64, max: f64, unit: &str) {
        if !(value.is_finite() && value > 0.0 && value <= max) {
            self.fail(
                field,
                value,
                format!("must be a number > 0 and <= {max} ({unit})"),
            );
        }
    }

    /// An integer in `lo..=hi`.
    pub fn int_in(&mut self, field: &str, value: impl Into<i128>, lo: i128, hi: i128) {
        let v = value.into();
        if !(lo..=hi).contains(&v) {
            self.fail(field, v, format!("must be an integer in {lo}..={hi}"));
        }
    }

    pub fn in_range(&mut self, field: &str, value: f64, lo: f64, hi: f64, what: &str) {
        if !(value.is_finite() && value >= lo && value < hi) {
            self.fail(field, value, format!("must be {what}"));
        }
    }

    /// (A path over [`MAX_PATH_BYTES`] is refused for its length alone.)
    pub fn file_exists(&mut self, field: &str, path: &Path) {
        if self.files && path.as_os_str().len() <= MAX_PATH_BYTES && !path.is_file() {
            self.fail(
                field,
                path.display().to_string(),
                "must name an existing file",
            );
        }
    }

    /// A folder that must hold `files`: one error for a missing folder,
    /// else one per missing file.
    pub fn files_in(&mut self, field: &str, dir: &Path, files: &[&str]) {
        if !self.files || dir.as_os_str().len() > MAX_PATH_BYTES {
            return;
        }
        if !dir.is_dir() {
            self.fail(
                field,
                dir.display().to_string(),
                format!("must name an existing folder holding {}", files.join(", ")),
            );
            return;
        }
        for f in files {
            self.file_exists(field, &dir.join(f));
        }
    }

    /// A folder that must hold at least one of `files`.
    pub fn folder_holds_any(&mut self, field: &str, dir: &Path, files: &[&str]) {
        if !self.files || dir.as_os_str().len() > MAX_PATH_BYTES {
            return;
        }
        if !files.iter().any(|f| dir.join(f).is_file()) {
            self.fail(
                field,
                dir.display().to_string(),
                format!("must name a folder holding {}", files.join(" or ")),
            );
        }
    }

    /// Whether file and folder checks run (not for the coordinator's view).
    pub fn checks_files(&self) -> bool {
        self.files
    }

    pub fn finish(self) -> Result<(), SpecErrors> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(SpecErrors(self.errors))
        }
    }
}

impl JobSpec {
    pub(super) fn check(&self, files: bool) -> Result<(), SpecErrors> {
        let mut c = Checker {
            files,
            ..Default::default()
        };
        if !is_valid_job_name(&self.name) {
            c.fail("name", &self.name, JOB_NAME_RULE);
        }
        let mut paths = self.model.paths();
        paths.extend([
            ("data.path", self.data.path.as_deref()),
            ("data.eval_path", self.data.eval_path.as_deref()),
            ("checkpoint.dir", self.checkpoint.dir.as_deref()),
        ]);
        for (field, path) in paths {
            if let Some(p) = path {
                c.path_at_most(field, p, MAX_PATH_BYTES);
            }
        }
        let max_w = i128::from(MAX_WORKERS);
        c.int_in("workers", self.workers, 1, max_w);
        if let Some(m) = self.min_workers {
            if m == 0 || m > self.workers {
                c.fail("min_workers", m, format!("must be in 1..={}", self.workers));
            }
        }
        if let Some(m) = self.max_workers {
            if m < self.workers || m > MAX_WORKERS {
                c.fail(
                    "max_workers",
                    m,
                    format!("must be in {}..={MAX_WORKERS}", self.workers),
                );
            }
        }
        if let Some(e) = self.epochs {
            c.int_in("epochs", e, 1, MAX_EPOCHS.into());
        }
        if let Some(m) = self.max_steps {
            c.int_in("max_steps", m, 1, MAX_STEPS.into());
        }
        self.validate_parallel(&mut c);
        self.validate_activation_checkpointing(&mut c);
        if let Some(f) = self.max_skipped_fraction {
            if !(f.is_finite() && (0.0..=1.0).contains(&f)) {
                c.fail("max_skipped_fraction", f, "must be a number in [0, 1]");
            }
        }
        let d = self.device.as_str();
        let cuda_ok = d.strip_prefix("cuda:").is_some_and(|n| {
            n.chars().all(|ch| ch.is_ascii_digit())
                && n.parse::<u32>().is_ok_and(|i| i <= MAX_CUDA_INDEX)
        });
        if !(d == "auto" || d == "cpu" || d == "cuda" || cuda_ok) {
            c.fail(
                "device",
                d,
                format!("must be auto, cpu, cuda or cuda:N with N in 0..={MAX_CUDA_INDEX}"),
            );
        }
        if let Some(t) = self.threads {
            c.int_in("threads", t, 1, MAX_THREADS.into());
        }
        if self.sharding.stage > 3 {
            c.fail(
                "sharding.stage",
                self.sharding.stage,
                format!("must be {SHARDING_STAGES}"),
            );
        }
        for (field, value) in [
            (
                "sharding.reshard_after_forward",
                self.sharding.reshard_after_forward,
            ),
            ("sharding.prefetch", self.sharding.prefetch),
        ] {
            if let (Some(r), true) = (value, self.sharding.stage < 3) {
                c.fail(
                    field,
                    r,
                    format!(
                        "applies to sharding.stage = 3 (the parameters sharded), not {}",
                        self.sharding.stage
                    ),
                );
            }
        }
        self.validate_precision(&mut c);
        self.validate_model(&mut c);
        self.validate_data(&mut c);
        self.validate_accumulation(&mut c);
        self.validate_clipping(&mut c);
        self.validate_optimizer(&mut c);
        self.validate_schedule(&mut c);
        c.int_in("checkpoint.keep", self.checkpoint.keep, 1, MAX_KEEP.into());
        if super::shard_size_bytes(&self.checkpoint.max_shard_size).is_none() {
            c.fail(
                "checkpoint.max_shard_size",
                &self.checkpoint.max_shard_size,
                "must be a positive size as transformers' max_shard_size takes it: \
                 digits and GB, MB, KB, GiB, MiB or KiB (\"5GB\", \"500MB\", \"2GiB\"), \
                 or a byte count",
            );
        }
        c.int_in(
            "checkpoint.every_steps",
            self.checkpoint.every_steps,
            0,
            MAX_STEPS.into(),
        );
        // Durations the workers turn into timers, and a size they allocate:
        // bounded so that every accepted value is usable downstream.
        for (field, v) in [
            ("comm.timeout_s", self.comm.timeout_s),
            ("comm.connect_timeout_s", self.comm.connect_timeout_s),
            ("comm.rendezvous_timeout_s", self.comm.rendezvous_timeout_s),
        ] {
            c.positive_at_most(field, v, MAX_TIMEOUT_S, "seconds, one day");
        }
        c.positive_at_most(
            "comm.bucket_cap_mb",
            self.comm.bucket_cap_mb,
            MAX_BUCKET_CAP_MB,
            "MiB",
        );
        c.int_in("eval.batch_size", self.eval.batch_size, 1, MAX_BATCH.into());
        c.finish()
    }

    /// The model fields; those whose rule depends on the kind, its family's.
    fn validate_model(&self, c: &mut Checker) {
        let m = &self.model;
        let family = family(m.kind);
        if let Some(bad) = m.hidden.iter().find(|&&h| !(1..=1 << 20).contains(&h)) {
            c.fail(
                "model.hidden",
                bad,
                "every width must be an integer in 1..=1048576",
            );
        }
        if m.hidden.len() > 64 {
            c.fail(
                "model.hidden",
                format!("{} layers", m.hidden.len()),
                "at most 64 hidden layers",
            );
        }
        family.check_hidden(&m.hidden, c);
        if let Some(n) = m.num_classes {
            c.int_in("model.num_classes", n, 1, MAX_CLASSES.into());
        }
        family.check_path(m.path.as_deref(), c);
        refuse_foreign_fields(m, c);
        family.check_fields(m, &self.data, c);
        if let Some(p) = &m.init {
            // A folder (transformers' save_pretrained) holds
            // model.safetensors, or shards and the index naming them (the
            // worker checks the shards).
            if p.is_dir() {
                c.folder_holds_any(
                    "model.init",
                    p,
                    &["model.safetensors", "model.safetensors.index.json"],
                );
            } else {
                c.file_exists("model.init", p);
            }
        }
    }

    fn validate_data(&self, c: &mut Checker) {
        let d = &self.data;
        c.int_in("data.batch_size", d.batch_size, 1, MAX_BATCH.into());
        match d.kind {
            DataKind::Mnist => match &d.path {
                None => c.fail("data.path", "(missing)", "required for data.kind = mnist"),
                Some(p) => c.files_in("data.path", p, &MNIST_FILES),
            },
            DataKind::Cifar10 => match &d.path {
                None => c.fail("data.path", "(missing)", "required for data.kind = cifar10"),
                Some(p) => c.files_in("data.path", p, &CIFAR_FILES),
            },
            DataKind::Tensors => {
                match &d.path {
                    None => c.fail("data.path", "(missing)", "required for data.kind = tensors"),
                    Some(p) => c.file_exists("data.path", p),
                }
                if let Some(p) = &d.eval_path {
                    c.file_exists("data.eval_path", p);
                }
            }
            DataKind::Sequences | DataKind::Tokens => {
                match &d.path {
                    None => c.fail(
                        "data.path",
                        "(missing)",
                        format!("required for data.kind = {}", d.kind),
                    ),
                    Some(p) => c.file_exists("data.path", p),
                }
                if let Some(p) = &d.eval_path {
                    c.file_exists("data.eval_path", p);
                }
                match d.seq_len {
                    None => c.fail(
                        "data.seq_len",
                        "(missing)",
                        format!(
                            "required for data.kind = {} (an integer in 1..={MAX_SEQ_LEN})",
                            d.kind
                        ),
                    ),
                    Some(t) => c.int_in("data.seq_len", t, 1, MAX_SEQ_LEN.into()),
                }
            }
            DataKind::Synthetic => {
                if let Some(n) = d.samples {
                    c.int_in("data.samples", n, 1, MAX_SAMPLES.into());
                }
                if let Some(n) = d.eval_samples {
                    c.int_in("data.eval_samples", n, 0, MAX_SAMPLES.into());
                }
                if let Some(s) = &d.shape {
                    if s.is_empty()
                        || s.len() > MAX_SHAPE_DIMS
                        || s.iter().any(|&x| !(1..=MAX_DIM).contains(&x))
                    {
                        c.fail(
                            "data.shape",
                            s,
                            format!(
                                "must be a list of 1 to {MAX_SHAPE_DIMS} integers in 1..={MAX_DIM}"
                            ),
                        );
                    }
                }
                if let Some(k) = d.classes {
                    c.int_in("data.classes", k, 2, MAX_CLASSES.into());
                }
            }
        }
        let lm_data = matches!(d.kind, DataKind::Sequences | DataKind::Tokens);
        if let (false, Some(t)) = (lm_data, d.seq_len) {
            c.fail(
                "data.seq_len",
                t,
                "only allowed with data.kind = sequences or tokens",
            );
        }
        match (d.kind, d.pad_id) {
            (DataKind::Sequences, Some(p)) => c.int_in("data.pad_id", p, 0, (MAX_VOCAB - 1).into()),
            (_, Some(p)) => c.fail("data.pad_id", p, "only allowed with data.kind = sequences"),
            _ => {}
        }
        if d.pack && d.kind != DataKind::Sequences {
            c.fail(
                "data.pack",
                d.pack,
                "only allowed with data.kind = sequences (rows to pack; a token stream \
                 is already packed)",
            );
        }
        if d.kind != DataKind::Tokens {
            if let Some(t) = d.dtype {
                c.fail(
                    "data.dtype",
                    t.as_str(),
                    "only allowed with data.kind = tokens (for a file without llm.c's header)",
                );
            }
        }
        // A language model reads token rows, and token rows need one.
        let llama = self.model.kind.is_decoder();
        if llama && !lm_data {
            c.fail(
                "data.kind",
                d.kind.as_str(),
                format!(
                    "model.kind = {} needs data.kind = sequences or tokens",
                    self.model.kind
                ),
            );
        } else if lm_data && !llama {
            c.fail(
                "model.kind",
                self.model.kind.as_str(),
                format!(
                    "data.kind = {} needs model.kind = {}",
                    d.kind,
                    super::family::any_decoder()
                ),
            );
        }
        if d.kind != DataKind::Synthetic {
            for (field, set) in [
                ("data.samples", d.samples.is_some()),
                ("data.eval_samples", d.eval_samples.is_some()),
                ("data.shape", d.shape.is_some()),
                ("data.classes", d.classes.is_some()),
            ] {
                if set {
                    c.fail(field, "(set)", "only allowed with data.kind = synthetic");
                }
            }
        }
    }

    /// `[performance]`'s activation checkpointing (issue 41): the
    /// families with blocks, and `checkpoint_every` only with it.
    fn validate_activation_checkpointing(&self, c: &mut Checker) {
        let p = &self.performance;
        let full = p.activation_checkpointing == Some(ActivationCheckpointing::Full);
        if let Some(n) = p.checkpoint_every {
            if !full {
                c.fail(
                    "performance.checkpoint_every",
                    n,
                    "only with performance.activation_checkpointing = \"full\"",
                );
            } else if n == 0 {
                c.fail(
                    "performance.checkpoint_every",
                    n,
                    "must be an integer >= 1 (blocks per recomputed segment)",
                );
            }
        }
        if !full {
            return;
        }
        let kind = self.model.kind;
        if !(kind.is_decoder() || kind == ModelKind::Mlp) {
            c.fail(
                "performance.activation_checkpointing",
                "full",
                format!(
                    "model.kind = {kind} has no blocks to recompute; the families that do: {}",
                    super::family::decoders_and(&[ModelKind::Mlp])
                ),
            );
        }
    }

    /// `[parallel]`: degrees whose product is `workers`, and (until the
    /// strategies exist) no split model; an elastic job's bounds in whole
    /// replicas.
    fn validate_parallel(&self, c: &mut Checker) {
        let dims = match self.parallel_dims() {
            Ok(d) => d,
            Err(e) => {
                c.errors.push(e);
                return;
            }
        };
        self.validate_pipeline(c, dims.pipeline);
        self.validate_tensor(c, dims.tensor);
        let replica = dims.replica();
        for (field, bound) in [
            ("min_workers", self.min_workers),
            ("max_workers", self.max_workers),
        ] {
            if let Some(n) = bound.filter(|n| n % replica != 0) {
                c.fail(
                    field,
                    n,
                    format!("must be a multiple of pipeline x tensor = {replica} (whole replicas)"),
                );
            }
        }
    }

    fn validate_accumulation(&self, c: &mut Checker) {
        let a = &self.accumulation;
        match (a.steps, a.global_batch) {
            (Some(_), Some(g)) => c.fail(
                "accumulation.global_batch",
                g,
                "set either accumulation.steps or accumulation.global_batch, not both",
            ),
            (Some(k), None) => c.int_in("accumulation.steps", k, 1, MAX_ACCUMULATION.into()),
            (None, Some(g)) if self.data.batch_size > 0 => {
                match self.accumulation_steps(self.workers as u64) {
                    Err(e) => c.errors.push(e),
                    Ok(k) if k > MAX_ACCUMULATION => c.fail(
                        "accumulation.global_batch",
                        g,
                        format!(
                            "must give 1..={MAX_ACCUMULATION} micro-steps per step \
                             (global_batch / (workers * data.batch_size) = {k})"
                        ),
                    ),
                    Ok(_) => {}
                }
            }
            _ => {}
        }
    }

    fn validate_precision(&self, c: &mut Checker) {
        let l = &self.loss_scaling;
        c.positive_finite("loss_scaling.init_scale", l.init_scale);
        if !(l.growth_factor.is_finite() && l.growth_factor > 1.0) {
            c.fail(
                "loss_scaling.growth_factor",
                l.growth_factor,
                "must be a finite number > 1",
            );
        }
        if !(l.backoff_factor > 0.0 && l.backoff_factor < 1.0) {
            c.fail(
                "loss_scaling.backoff_factor",
                l.backoff_factor,
                "must be in (0, 1)",
            );
        }
        c.int_in(
            "loss_scaling.growth_interval",
            l.growth_interval,
            1,
            u32::MAX.into(),
        );
        if self.precision != Precision::Fp16 && *l != LossScalingSpec::default() {
            c.fail(
                "loss_scaling",
                &self.loss_scaling,
                format!(
                    "applies with precision = \"fp16\" only (precision is \"{}\")",
                    self.precision
                ),
            );
        }
    }

    fn validate_clipping(&self, c: &mut Checker) {
        let k = &self.clipping;
        if let Some(m) = k.max_norm {
            c.positive_finite("clipping.max_norm", m);
        }
        if let Some(v) = k.clip_value {
            c.positive_finite("clipping.clip_value", v);
        }
        if let (Some(_), Some(v)) = (k.max_norm, k.clip_value) {
            c.fail(
                "clipping.clip_value",
                v,
                "set either clipping.max_norm or clipping.clip_value, not both",
            );
        }
        if let Some(n) = k.norm_type {
            if !(n == 2.0 || n == f64::INFINITY) {
                c.fail("clipping.norm_type", n, "must be 2.0 or inf");
            }
        }
    }

    fn validate_optimizer(&self, c: &mut Checker) {
        let o = &self.optimizer;
        c.positive_finite("optimizer.lr", o.lr);
        c.in_range("optimizer.momentum", o.momentum, 0.0, 1.0, "in [0, 1)");
        c.in_range(
            "optimizer.dampening",
            o.dampening,
            0.0,
            1.0 + f64::EPSILON,
            "in [0, 1]",
        );
        if let Some(w) = o.weight_decay {
            c.in_range(
                "optimizer.weight_decay",
                w,
                0.0,
                f64::MAX,
                "a finite number >= 0",
            );
        }
        if o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0) {
            c.fail(
                "optimizer.nesterov",
                true,
                "requires optimizer.momentum > 0 and optimizer.dampening = 0",
            );
        }
        if o.kind != OptimizerKind::Sgd && (o.momentum != 0.0 || o.nesterov || o.dampening != 0.0) {
            c.fail(
                "optimizer.momentum",
                o.momentum,
                "momentum, dampening and nesterov are only allowed with optimizer.kind = sgd",
            );
        }
        if let Some([b1, b2]) = o.betas {
            c.in_range("optimizer.betas[0]", b1, 0.0, 1.0, "in [0, 1)");
            c.in_range("optimizer.betas[1]", b2, 0.0, 1.0, "in [0, 1)");
        }
        if let Some(e) = o.eps {
            c.positive_finite("optimizer.eps", e);
        }
        if o.kind == OptimizerKind::Sgd && o.fused {
            c.fail(
                "optimizer.fused",
                true,
                "fused = true is only allowed with optimizer.kind = adam or adamw (sgd: false)",
            );
        }
        if o.kind == OptimizerKind::Sgd && (o.betas.is_some() || o.eps.is_some()) {
            c.fail(
                "optimizer.betas",
                o.betas,
                "betas and eps are only allowed with optimizer.kind = adam or adamw",
            );
        }
    }

    fn validate_schedule(&self, c: &mut Checker) {
        let s = &self.schedule;
        match (s.kind, s.step_size) {
            (ScheduleKind::Step, None) => c.fail(
                "schedule.step_size",
                s.step_size,
                format!("must be an integer in 1..={MAX_STEPS} for schedule.kind = step"),
            ),
            (_, Some(n)) => c.int_in("schedule.step_size", n, 1, MAX_STEPS.into()),
            _ => {}
        }
        c.int_in("schedule.warmup_steps", s.warmup_steps, 0, MAX_STEPS.into());
        if let Some(g) = s.gamma {
            c.in_range(
                "schedule.gamma",
                g,
                f64::MIN_POSITIVE,
                1.0 + f64::EPSILON,
                "in (0, 1]",
            );
        }
        if let Some(m) = s.min_lr {
            if !(m.is_finite() && m >= 0.0 && m < self.optimizer.lr) {
                c.fail("schedule.min_lr", m, "must be >= 0 and below optimizer.lr");
            }
        }
        if s.kind == ScheduleKind::LinearWarmup && s.warmup_steps == 0 {
            c.fail(
                "schedule.warmup_steps",
                0,
                "must be >= 1 for schedule.kind = linear_warmup",
            );
        }
    }
}
