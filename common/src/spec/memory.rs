//! What a spec asks of a worker's memory, estimated from the spec alone so
//! that a job too big for its workers is refused before anything allocates.
//!
//! The estimate counts the data a worker holds (synthetic samples as built,
//! MNIST and CIFAR-10 at their known sizes), the model state (parameters,
//! gradients, the flat accumulation buffer and the optimizer's per-parameter
//! state) and one training plus one evaluation input batch (for an MLP also
//! its activations; for a language model its logits). It does not count
//! convolution activations, libtorch's allocator slack or files whose size
//! the spec does not say (`tensors`, `sequences` and `tokens` data,
//! TorchScript models): those are checked by their loaders.

use super::family::{family, numel, ModelSize};
use super::{DataKind, FieldError, JobSpec, OptimizerKind, SpecErrors};

/// Bytes per GiB.
pub const GIB: u64 = 1 << 30;

/// The parts of a job's estimated memory on one worker, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Training and held-out samples as the worker holds them.
    pub data: u64,
    /// Parameters, gradients, the accumulation buffer, optimizer state.
    pub model: u64,
    /// One training and one evaluation input batch (and MLP activations).
    pub batch: u64,
}

impl MemoryEstimate {
    pub fn total(&self) -> u64 {
        self.data
            .saturating_add(self.model)
            .saturating_add(self.batch)
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / GIB as f64)
}

impl JobSpec {
    /// Per-sample shape and class count of the data as the spec says them
    /// (`None` for `tensors`, whose shape is in the file).
    fn sample_dims(&self) -> Option<(Vec<u64>, u64, u64)> {
        let d = &self.data;
        let pos = |v: i64| v.max(0) as u64;
        match d.kind {
            DataKind::Synthetic => Some((
                d.shape
                    .clone()
                    .unwrap_or_else(|| vec![32])
                    .into_iter()
                    .map(pos)
                    .collect(),
                pos(d.classes.unwrap_or(10)),
                d.samples
                    .unwrap_or(1024)
                    .saturating_add(d.eval_samples.unwrap_or(256)),
            )),
            DataKind::Mnist => Some((vec![1, 28, 28], 10, 70_000)),
            DataKind::Cifar10 => Some((vec![3, 32, 32], 10, 60_000)),
            DataKind::Tensors => None,
            // Token files are read through a memory map (not counted);
            // a sample is T token ids, the classes are the vocabulary.
            DataKind::Sequences | DataKind::Tokens => Some((
                vec![d.seq_len.unwrap_or(0)],
                family(self.model.kind).classes(&self.model).map_or(0, pos),
                0,
            )),
        }
    }

    /// The estimate of what this job needs on each worker.
    pub fn memory_estimate(&self) -> MemoryEstimate {
        let Some((shape, data_classes, samples)) = self.sample_dims() else {
            return MemoryEstimate::default();
        };
        let numel = numel(&shape);
        let classes = self
            .model
            .num_classes
            .map_or(data_classes, |n| n.max(0) as u64);
        let f32s = |n: u64| n.saturating_mul(4);
        // Synthetic samples are drawn into a vector, then copied into a
        // tensor: twice the bytes at the peak. Files are decoded once.
        let copies = if self.data.kind == DataKind::Synthetic {
            2
        } else {
            1
        };
        let data = samples
            .saturating_mul(f32s(numel).saturating_add(8))
            .saturating_mul(copies);
        let size = family(self.model.kind).size(&self.model, &shape, classes);
        let ModelSize {
            parameters: params,
            largest_unit,
            ..
        } = size;
        let activations = self.activations_per_sample(&size);
        let o = &self.optimizer;
        let states = match o.kind {
            OptimizerKind::Sgd => u64::from(o.momentum > 0.0),
            OptimizerKind::Adam | OptimizerKind::Adamw => 2,
        };
        let model = self.model_state_bytes(params, largest_unit, states);
        let b = self.data.batch_size;
        let batch = f32s(numel)
            .saturating_mul(b.saturating_add(self.eval.batch_size))
            .saturating_add(f32s(activations).saturating_mul(b).saturating_mul(2));
        MemoryEstimate { data, model, batch }
    }

    /// Activations a sample's micro-step holds, f32 elements: the
    /// family's (a language model's logits) and its blocks', which follow
    /// the precision (bf16 and fp16 autocast save about half the bytes)
    /// and activation checkpointing (`"full"` every N: N blocks at a time
    /// recomputed, plus each segment's input). A pipeline stage holds its
    /// share of the blocks.
    fn activations_per_sample(&self, size: &ModelSize) -> u64 {
        let pipeline = self
            .parallel_dims()
            .ok()
            .map_or(1, |d| u64::from(d.pipeline.max(1)));
        let layers = size.layers.div_ceil(pipeline);
        let full =
            self.performance.activation_checkpointing == Some(super::ActivationCheckpointing::Full);
        let every = u64::from(self.performance.checkpoint_every.unwrap_or(1).max(1));
        let (kept, inputs) = if full && layers > 0 {
            let every = every.min(layers);
            (
                every,
                layers.div_ceil(every).saturating_mul(size.layer_input),
            )
        } else {
            (layers, 0)
        };
        let mut blocks = kept.saturating_mul(size.layer_activations);
        if matches!(
            self.precision,
            super::Precision::Bf16 | super::Precision::Fp16
        ) {
            blocks /= 2;
        }
        size.activations
            .saturating_add(blocks)
            .saturating_add(inputs)
    }

    /// The model state one worker holds, bytes: the parameters of its
    /// pipeline stage (with P stages at most total / P plus the largest
    /// unit, what a split that minimises the largest stage can leave on
    /// one), each with its gradient, its share of the flat accumulation
    /// buffer and `states` optimizer tensors, in fp32 (master weights
    /// under bf16 and fp16 too). ZeRO (issue 17) over the data degree D:
    /// stage 1 keeps 1/D of the optimizer state; stage 2 also 1/D of the
    /// gradients under `sync = "every_step"` (under `"boundary"` the
    /// window's whole sum is held until the sync step, as stage 1's).
    /// Stage 3 (issue 41) keeps 1/D of the parameters plus two gathered
    /// units (the last block's and a tied embedding's); its gradients are
    /// the flat buffer alone under `"boundary"` (the `.grad`s are its
    /// views), and under `"every_step"` 1/D of them plus one unit's by
    /// unit. Precision changes none of it (fp32 master weights); what
    /// activation checkpointing saves is activations, counted apart.
    /// Tensor parallelism divides the stage's parameters by T; the
    /// activations stay counted whole (an upper bound: the residual
    /// stream and the gathered logits are whole on every tensor rank).
    pub fn model_state_bytes(&self, params: u64, largest_unit: u64, states: u64) -> u64 {
        let f32s = |n: u64| n.saturating_mul(4);
        let dims = self.parallel_dims().ok();
        let pipeline = dims.map_or(1, |d| u64::from(d.pipeline.max(1)));
        let data = dims.map_or(1, |d| u64::from(d.data.max(1)));
        let stage = if pipeline > 1 {
            params.min((params / pipeline).saturating_add(largest_unit))
        } else {
            params
        };
        // Tensor parallelism (issue 42): each rank holds 1/T of its
        // stage's weights (the replicated norms are a few H each: left
        // out of the arithmetic).
        let tensor = dims.map_or(1, |d| u64::from(d.tensor.max(1)));
        let stage = stage.div_ceil(tensor);
        let zero = self.sharding.stage;
        let every = self.accumulation.sync == super::SyncMode::EveryStep;
        let shard = |n: u64, sharded: bool| if sharded { n.div_ceil(data) } else { n };
        let unit = f32s(largest_unit.min(stage));
        let (weights, grads) = if zero >= 3 {
            let grads = if every {
                shard(f32s(stage), true).saturating_add(unit)
            } else {
                f32s(stage)
            };
            (
                shard(f32s(stage), true).saturating_add(unit.saturating_mul(2)),
                grads,
            )
        } else {
            (
                f32s(stage),
                shard(f32s(stage).saturating_mul(2), zero >= 2 && every),
            )
        };
        let optimizer = shard(f32s(stage).saturating_mul(states), zero >= 1);
        weights.saturating_add(grads).saturating_add(optimizer)
    }

    /// Refuses a job whose estimate is above `limit` bytes, naming the field
    /// that asks for the most.
    pub fn check_memory(&self, limit: u64) -> Result<(), SpecErrors> {
        family(self.model.kind).check_sizable(&self.model)?;
        let e = self.memory_estimate();
        if e.total() <= limit {
            return Ok(());
        }
        let field = if e.data >= e.model && e.data >= e.batch {
            if self.data.kind == DataKind::Synthetic {
                "data.samples"
            } else {
                "data.kind"
            }
        } else if e.model >= e.batch {
            "model"
        } else {
            "data.batch_size"
        };
        Err(SpecErrors(vec![FieldError {
            field: field.into(),
            value: format!(
                "an estimated {} per worker (data {}, model state {}, batches {})",
                gib(e.total()),
                gib(e.data),
                gib(e.model),
                gib(e.batch)
            ),
            allowed: format!(
                "a job may ask for at most {} per worker (--max-job-memory-gib)",
                gib(limit)
            ),
        }]))
    }
}

/// The host's physical memory (Linux `/proc/meminfo` MemTotal), bytes.
pub fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ModelKind;

    fn spec(extra: &str) -> JobSpec {
        JobSpec::fields_from_toml_str(
            &format!(
                "name = \"m\"\n[model]\nkind = \"mlp\"\nhidden = [64]\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\nmomentum = 0.9\n{extra}"
            ),
            std::path::Path::new("m.toml"),
        )
        .unwrap()
    }

    #[test]
    fn the_estimate_counts_data_model_and_batches() {
        let s = spec("[data]\nkind = \"synthetic\"\nbatch_size = 8\nsamples = 100\neval_samples = 20\nshape = [16]\nclasses = 4\n");
        let e = s.memory_estimate();
        // 120 samples of 16 floats and a label, built twice.
        assert_eq!(e.data, 120 * (16 * 4 + 8) * 2);
        // 16*64+64 + 64*4+4 parameters; param, grad, buffer, momentum.
        let params = 16 * 64 + 64 + 64 * 4 + 4;
        assert_eq!(e.model, params * 4 * 4);
        // (8 + 256) inputs of 16 floats; activations 8 * (64 + 4) twice.
        assert_eq!(e.batch, (8 + 256) * 16 * 4 + 8 * (64 + 4) * 4 * 2);
    }

    #[test]
    fn resnet_counts_match_torchvision() {
        let s = spec("[data]\nkind = \"cifar10\"\npath = \"c\"\nbatch_size = 1\n")
            .with_model(ModelKind::Resnet18, 1000);
        let params = s.memory_estimate().model / 4 / 4;
        assert_eq!(params, 11_689_512);
        let s = s.with_model(ModelKind::Resnet34, 1000);
        assert_eq!(s.memory_estimate().model / 4 / 4, 21_797_672);
    }

    impl JobSpec {
        fn with_model(mut self, kind: ModelKind, classes: i64) -> Self {
            self.model.kind = kind;
            self.model.hidden.clear();
            self.model.num_classes = Some(classes);
            self
        }
    }

    #[test]
    fn above_the_limit_names_the_biggest_part() {
        let s = spec(
            "[data]\nkind = \"synthetic\"\nbatch_size = 8\nsamples = 100000000\nshape = [1000]\n",
        );
        let err = s.check_memory(64 * GIB).unwrap_err();
        let e = &err.0[0];
        assert_eq!(e.field, "data.samples");
        assert!(e.value.contains("746.55 GiB"), "{}", e.value);
        assert!(e.allowed.contains("at most 64.00 GiB"), "{}", e.allowed);
        assert!(s.check_memory(u64::MAX).is_ok());
        let small = spec("[data]\nkind = \"synthetic\"\nbatch_size = 8\n");
        assert!(small.check_memory(GIB).is_ok());
        // Saturating, never overflowing, whatever the numbers.
        let mut huge = small.clone();
        huge.data.samples = Some(u64::MAX);
        huge.data.shape = Some(vec![i64::MAX, i64::MAX]);
        assert_eq!(huge.memory_estimate().total(), u64::MAX);
    }

    #[test]
    fn host_memory_is_read() {
        let m = host_memory_bytes().expect("/proc/meminfo");
        assert!(m > 256 << 20, "{m}");
    }

    /// Issue 41: the model state follows the mesh and ZeRO. A Llama of 4
    /// layers, H = 128, vocab 4,096, untied, AdamW (parameters, gradients,
    /// buffer and two moments: 5 f32s each).
    #[test]
    fn the_model_state_follows_stages_and_sharding() {
        let llama = |extra: &str| {
            JobSpec::fields_from_toml_str(
                &format!(
                    "name = \"m\"\nworkers = 4\n[model]\nkind = \"llama\"\nvocab_size = 4096\nhidden_size = 128\nintermediate_size = 384\nnum_hidden_layers = 4\nnum_attention_heads = 2\nmax_position_embeddings = 64\n[data]\nkind = \"tokens\"\npath = \"x.bin\"\nseq_len = 64\nbatch_size = 4\n[optimizer]\nkind = \"adamw\"\nlr = 0.001\n{extra}"
                ),
                std::path::Path::new("m.toml"),
            )
            .unwrap()
        };
        let (v, h, i) = (4096u64, 128u64, 384u64);
        let layer = 4 * h * h + 3 * h * i + 2 * h;
        let params = 2 * v * h + 4 * layer + h;
        let whole = llama("").memory_estimate().model;
        assert_eq!(whole, params * 4 * 5);
        // 2 stages of 2 data ranks: total / 2 plus the largest unit (the
        // last layer with the norm and the head).
        // 2 tensor ranks of 2 data ranks: half of everything.
        let split = llama("[parallel]\ntensor = 2\n").memory_estimate().model;
        assert_eq!(split, params.div_ceil(2) * 4 * 5);
        let staged = llama("[parallel]\npipeline = 2\n").memory_estimate().model;
        let stage = params / 2 + layer + v * h + h;
        assert_eq!(staged, stage * 4 * 5);
        assert!(staged < whole);
        // ZeRO over 4 data ranks: stage 1 a quarter of the two moments;
        // stage 2 a quarter of the gradients too, under every_step only.
        let z1 = llama("[sharding]\nstage = 1\n").memory_estimate().model;
        assert_eq!(z1, params * 4 * 3 + params * 4 * 2 / 4);
        let z2 = llama("[sharding]\nstage = 2\n").memory_estimate().model;
        assert_eq!(z2, z1, "boundary: the window's whole sum is held");
        let z2e = llama("[sharding]\nstage = 2\n[accumulation]\nsync = \"every_step\"\n")
            .memory_estimate()
            .model;
        assert_eq!(z2e, params * 4 + (params * 4 * 2) / 4 + params * 4 * 2 / 4);
        // Stage 3: a quarter of the parameters plus two gathered units
        // (the largest: the last layer with the norm and the head); the
        // flat gradient buffer under boundary, a quarter plus one unit's
        // gradients by unit under every_step.
        let unit = layer + v * h + h;
        let z3 = llama("[sharding]\nstage = 3\n").memory_estimate().model;
        assert_eq!(
            z3,
            params * 4 / 4 + 2 * unit * 4 + params * 4 + params * 4 * 2 / 4
        );
        let z3e = llama("[sharding]\nstage = 3\n[accumulation]\nsync = \"every_step\"\n")
            .memory_estimate()
            .model;
        assert_eq!(
            z3e,
            params * 4 / 4 + 2 * unit * 4 + params * 4 / 4 + unit * 4 + params * 4 * 2 / 4
        );
        // (Above stage 2's here: this model's head is as large as a
        // quarter of it, and two units are counted whole.)
        assert!(z3 < whole && z3e < whole, "{z3} {z3e} {whole}");
        // Both: the stage's parameters, sharded over its 2 data ranks.
        let both = llama("[parallel]\npipeline = 2\n[sharding]\nstage = 1\n")
            .memory_estimate()
            .model;
        assert_eq!(both, stage * 4 * 3 + (stage * 4 * 2).div_ceil(2));
        // The activations follow the precision, activation checkpointing
        // and the stages (T = 64, b = 4: the batch term counts each
        // sample's activations twice, for their gradients).
        let t = 64u64;
        let one_layer = t * (10 * h + 4 * i + 2 * t);
        // Each sample's activations (f32) count 4 bytes x b = 4 x 2.
        let batch = |extra: &str| llama(extra).memory_estimate().batch;
        let base = batch("");
        let fewer = |extra: &str| (base - batch(extra)) / (4 * 4 * 2);
        assert!(base > 4 * 4 * 2 * (t * v + 4 * one_layer), "{base}");
        let mut bf16 = llama("");
        bf16.precision = crate::spec::Precision::Bf16;
        assert_eq!(
            (base - bf16.memory_estimate().batch) / (4 * 4 * 2),
            4 * one_layer / 2
        );
        assert_eq!(
            fewer("[performance]\nactivation_checkpointing = \"full\"\n"),
            4 * one_layer - (one_layer + 4 * t * h)
        );
        assert_eq!(
            fewer("[performance]\nactivation_checkpointing = \"full\"\ncheckpoint_every = 2\n"),
            4 * one_layer - (2 * one_layer + 2 * t * h)
        );
        assert_eq!(fewer("[parallel]\npipeline = 2\n"), 2 * one_layer);
    }
}
