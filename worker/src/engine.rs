//! The training engine of one rank.
//!
//! Micro-step: forward, loss, backward; gradients add into the parameters'
//! `.grad` (the accumulation buffers) and nothing is communicated (`sync =
//! "boundary"`). Sync step (the k-th micro-step or the epoch's last): one
//! pipeline, [`Engine::sync_step`]: reduce(grads, counts) -> normalize -> clip
//! -> optimizer step -> schedule -> zero grads -> commit.

use crate::checkpoint::{self, TrainerState};
use crate::collective::Collective;
use crate::data::{self, Dataset};
use crate::error::{Error, InPlace, Result, TorchContext};
use crate::fused::GradPrep;
use crate::grads::FlatGrads;
use crate::model::Model;
use crate::optim::Optimizer;
use crate::sampler::{ShardSpec, WindowPlan};
use crate::schedule::Schedule;
use crate::spec::{JobSpec, Normalize, OnNonfinite, SyncMode};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Reduction, Tensor};

/// How a run is set up beyond the spec.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Where checkpoints go; default: spec.checkpoint.dir, else
    /// `<state_dir>/checkpoints/<name>`.
    pub checkpoint_dir: Option<PathBuf>,
    /// Used for the default checkpoint folder (default `runs`).
    pub state_dir: Option<PathBuf>,
    /// Continue from the checkpoint LATEST names.
    pub resume: bool,
    /// Continue from LATEST when there is one, else start fresh (a rank
    /// joining a job that is being recovered).
    pub resume_if_present: bool,
    /// Append every committed window's global sample indices (all ranks,
    /// JSON lines) to this file: an audit of the data accounting.
    pub sample_log: Option<PathBuf>,
    /// Sleep this long after every micro-step (fault-injection tests and
    /// demos: it makes a small job last long enough to kill a rank in the
    /// middle of a window).
    pub micro_step_delay: Option<Duration>,
    /// Stop (with a checkpoint) once this many optimizer steps are committed,
    /// as if preempted; the job can be resumed later.
    pub stop_after_steps: Option<u64>,
    /// Requests from another thread (the worker daemon), honoured at window
    /// boundaries.
    pub control: Option<std::sync::Arc<Control>>,
}

/// Flags another thread sets to steer a running engine.
#[derive(Debug, Default)]
pub struct Control {
    /// Stop at the next window boundary (with a checkpoint).
    pub stop: std::sync::atomic::AtomicBool,
    /// Write a checkpoint at the next window boundary.
    pub checkpoint_now: std::sync::atomic::AtomicBool,
    /// Drop the window in flight at the next micro-step and return
    /// [`Error::Interrupted`] (the coordinator is re-forming the ring).
    pub abort: std::sync::atomic::AtomicBool,
    /// A new generation is waiting: leave at the next window boundary
    /// with [`Error::Interrupted`] (an elastic job grows).
    pub reform: std::sync::atomic::AtomicBool,
}

impl Control {
    pub fn stopping(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Wall time of one optimizer step, split by phase.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Timing {
    pub compute_s: f64,
    pub comm_s: f64,
    pub clip_s: f64,
    pub optimizer_s: f64,
}

/// What one committed optimizer step did.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct StepReport {
    pub step: u64,
    pub total_steps: u64,
    pub epoch: u64,
    pub micro_step: u64,
    /// Mean loss over the window's samples on all ranks.
    pub loss: f64,
    /// Total gradient norm after normalization, before clipping.
    pub grad_norm: f64,
    /// Factor applied by norm clipping (1 when not clipped).
    pub clip_coef: f64,
    pub skipped: bool,
    /// Samples in this window over all ranks.
    pub samples: u64,
    pub samples_seen: u64,
    pub lr: f64,
    pub samples_per_sec: f64,
    pub timing: Timing,
    /// Data-plane bytes this rank sent and received for this step.
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// The same since this process joined the job.
    pub job_bytes_sent: u64,
    pub job_bytes_received: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct EvalReport {
    pub epoch: u64,
    pub step: u64,
    pub loss: f64,
    pub accuracy: f64,
    pub samples: u64,
}

pub enum Event<'a> {
    Step(&'a StepReport),
    Eval(&'a EvalReport),
    Checkpoint(&'a Path),
}

#[derive(Debug)]
pub struct Summary {
    pub state: TrainerState,
    pub eval: Option<EvalReport>,
    pub checkpoint: PathBuf,
    /// Whether the run reached the job's last step (false when stopped early).
    pub finished: bool,
}

/// The window in flight (not yet committed).
#[derive(Debug, Default)]
struct Window {
    /// Micro-steps run in this window (the cursor advances by this).
    micro: usize,
    /// Non-empty micro-batches among them (`mean` divides by their global sum).
    batches: usize,
    samples: u64,
    loss_sum: Option<Tensor>,
    started: Option<Instant>,
    compute: Duration,
    comm: Duration,
    /// Collective byte counters when the window started.
    bytes_at_start: (u64, u64),
}

pub struct Engine<C: Collective> {
    spec: JobSpec,
    collective: C,
    device: Device,
    model: Model,
    optimizer: Optimizer,
    schedule: Schedule,
    train: Dataset,
    eval: Option<Dataset>,
    shard: ShardSpec,
    plan: WindowPlan,
    total_steps: u64,
    normalize: Normalize,
    sync: SyncMode,
    state: TrainerState,
    epoch_indices: (u64, Vec<i64>),
    window: Window,
    /// sync = every_step: the reduced gradients of the window so far.
    acc: Option<Vec<Tensor>>,
    /// The gradient-accumulation buffer every `.grad` is a view of.
    grads: FlatGrads,
    checkpoint_dir: PathBuf,
    opts: RunOptions,
    last_checkpoint: Option<(u64, PathBuf)>,
    /// Whether this rank holds the job's committed state (it resumed or
    /// committed a step), as opposed to fresh initial weights.
    has_state: bool,
}

pub fn resolve_device(name: &str) -> Result<Device> {
    let err = |reason: String| Error::Device {
        device: name.to_string(),
        reason,
    };
    match name {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(Device::cuda_if_available()),
        _ => {
            let n: usize = match name.strip_prefix("cuda:") {
                Some(n) => n.parse().map_err(|_| err("expected cuda:N".into()))?,
                None => 0,
            };
            if !tch::Cuda::is_available() {
                return Err(err(
                    "CUDA is not available on this machine (or this build lacks libtorch_cuda)"
                        .into(),
                ));
            }
            let count = tch::Cuda::device_count() as usize;
            if n >= count {
                return Err(err(format!(
                    "only {count} CUDA devices are visible (0..{count})"
                )));
            }
            Ok(Device::Cuda(n))
        }
    }
}

impl<C: Collective> Engine<C> {
    /// Loads data, builds the model, applies `init` or the checkpoint, and
    /// checks everything before anything is written.
    pub fn new(spec: JobSpec, collective: C, opts: RunOptions) -> Result<Self> {
        spec.validate()?;
        let world = collective.world_size();
        let rank = collective.rank();
        let k = spec
            .accumulation_steps(world as u64)
            .map_err(|e| crate::spec::SpecErrors(vec![e]))? as usize;
        let device = resolve_device(&spec.device)?;
        if let Some(t) = spec.threads {
            tch::set_num_threads(t as i32);
        }
        let splits = data::load(&spec.data, spec.seed)?;
        let train = splits.train;
        if train.is_empty() {
            return Err(Error::Data {
                path: spec
                    .data
                    .path
                    .clone()
                    .unwrap_or_else(|| spec.data.kind.as_str().into()),
                reason: "the training split holds no samples".into(),
            });
        }
        let classes = match spec.model.num_classes {
            Some(n) => n,
            None => {
                let eval_classes = match &splits.eval {
                    Some(e) => e.classes()?,
                    None => 0,
                };
                train.classes()?.max(eval_classes)
            }
        };
        let mut model = Model::build(
            &spec.model,
            &train.sample_shape(),
            classes,
            device,
            spec.seed,
        )?;
        if let Some(init) = &spec.model.init {
            let tensors = Tensor::read_safetensors(init).map_err(|e| Error::Init {
                path: init.clone(),
                reason: e.to_string(),
            })?;
            model.load_named(init, tensors)?;
        }
        let train = train.to_device(device)?;
        let eval = splits.eval.map(|e| e.to_device(device)).transpose()?;
        let shard = ShardSpec {
            len: train.len(),
            world,
            seed: spec.seed,
            shuffle: spec.data.shuffle,
            drop_last: spec.data.drop_last,
            pad: spec.data.pad,
            offset: 0,
        };
        let plan = WindowPlan {
            samples: shard.rank_len(rank),
            max_samples: shard.rank_len(0),
            batch: spec.data.batch_size as usize,
            k,
        };
        if plan.samples == 0 {
            return Err(Error::Data {
                path: spec
                    .data
                    .path
                    .clone()
                    .unwrap_or_else(|| spec.data.kind.as_str().into()),
                reason: format!(
                    "{} samples cannot feed {world} ranks with drop_last",
                    train.len()
                ),
            });
        }
        let total_steps = spec
            .max_steps
            .unwrap_or(spec.epochs.unwrap_or(1) * plan.windows() as u64);
        let schedule = Schedule::from_spec(&spec, total_steps);
        let optimizer = Optimizer::new(&spec.optimizer, model.params.len());
        let cap_elems = (spec.comm.bucket_cap_mb * (1 << 20) as f64 / 4.0) as usize;
        let grads = FlatGrads::attach(&model.params, cap_elems)?;
        let checkpoint_dir = opts
            .checkpoint_dir
            .clone()
            .or_else(|| spec.checkpoint.dir.clone())
            .unwrap_or_else(|| {
                opts.state_dir
                    .clone()
                    .unwrap_or_else(|| "runs".into())
                    .join("checkpoints")
                    .join(&spec.name)
            });
        let state = TrainerState {
            job: spec.name.clone(),
            seed: spec.seed,
            lr: schedule.lr_at(0),
            world_size: world as u64,
            accumulation_steps: k as u64,
            ..Default::default()
        };
        let mut engine = Self {
            normalize: spec.accumulation.normalize,
            sync: spec.accumulation.sync,
            spec,
            collective,
            device,
            model,
            optimizer,
            schedule,
            train,
            eval,
            shard,
            plan,
            total_steps,
            state,
            epoch_indices: (u64::MAX, Vec::new()),
            window: Window::default(),
            acc: None,
            grads,
            checkpoint_dir,
            opts,
            last_checkpoint: None,
            has_state: false,
        };
        let latest_exists = engine.checkpoint_dir.join(checkpoint::LATEST).exists();
        if engine.opts.resume || (engine.opts.resume_if_present && latest_exists) {
            engine.resume()?;
        } else if engine.opts.resume_if_present {
            // Joining a recovery before any checkpoint: the state comes
            // from a surviving rank.
        } else if let Some(n) = checkpoint::list_steps(&engine.checkpoint_dir)?.last() {
            return Err(Error::Checkpoint {
                path: engine.checkpoint_dir.clone(),
                reason: format!(
                    "already holds checkpoints (newest step-{n}); resume to continue, or choose another checkpoint.dir"
                ),
            });
        }
        engine.sync_state()?;
        engine.reshard();
        tracing::info!(rank, world, k, total_steps = engine.total_steps, step = engine.state.step, device = ?device, "engine ready");
        Ok(engine)
    }

    /// Joins a new generation on `collective` (a re-formed ring) with
    /// `accumulation_steps` as k: the value the coordinator decided for the
    /// new world size, or (None) k computed from the spec for it. The rank
    /// holding the newest committed state broadcasts it to every rank, and
    /// the rest of the epoch is re-sharded when the world size or k changed.
    pub fn reconfigure(&mut self, collective: C, accumulation_steps: Option<u64>) -> Result<()> {
        self.discard_window()?;
        self.collective = collective;
        let world = self.collective.world_size();
        if let Some(k) = accumulation_steps {
            if k == 0 {
                return Err(crate::spec::SpecErrors(vec![crate::spec::FieldError {
                    field: "accumulation.steps".into(),
                    value: "0".into(),
                    allowed: "must be an integer >= 1 (k of the new generation)".into(),
                }])
                .into());
            }
            // The spec the engine keeps says the same k from now on.
            self.spec.accumulation.steps = Some(k);
            self.spec.accumulation.global_batch = None;
        }
        self.plan.k = self
            .spec
            .accumulation_steps(world as u64)
            .map_err(|e| crate::spec::SpecErrors(vec![e]))? as usize;
        self.sync_state()?;
        self.reshard();
        tracing::info!(
            rank = self.collective.rank(),
            world,
            k = self.plan.k,
            step = self.state.step,
            total_steps = self.total_steps,
            "joined a new generation"
        );
        Ok(())
    }

    /// Forgets the window in flight (its gradients and counts): the
    /// committed state stays as it is.
    pub fn discard_window(&mut self) -> Result<()> {
        let w = std::mem::take(&mut self.window);
        self.state.micro_step = self.state.micro_step.saturating_sub(w.micro as u64);
        self.acc = None;
        self.grads.zero()
    }

    /// The collective in use (for replacing it between generations).
    pub fn collective_mut(&mut self) -> &mut C {
        &mut self.collective
    }

    /// Makes every rank hold the newest committed state: the rank with the
    /// highest committed step (lowest rank on ties) broadcasts parameters,
    /// buffers, optimizer state and counters. With no committed state
    /// anywhere (a fresh start) rank 0's initial weights are broadcast.
    fn sync_state(&mut self) -> Result<()> {
        let world = self.collective.world_size();
        if world == 1 {
            return Ok(());
        }
        let rank = self.collective.rank();
        let mut steps = vec![0f32; world * 3];
        if self.has_state {
            encode_u48(self.state.step + 1, &mut steps[rank * 3..rank * 3 + 3]);
        }
        self.collective.all_reduce_sum(&mut steps)?;
        let (source, best) = steps
            .chunks(3)
            .map(decode_u48)
            .enumerate()
            .fold((0, 0), |(r, b), (i, s)| if s > b { (i, s) } else { (r, b) });
        if best == 0 {
            return self.broadcast_state(0);
        }
        let mut buf = if rank == source {
            self.pack_state()?
        } else {
            Vec::new()
        };
        let mut len = vec![0f32; 3];
        encode_u48(buf.len() as u64, &mut len);
        self.collective.broadcast(&mut len, source)?;
        buf.resize(decode_u48(&len) as usize, 0.0);
        self.collective.broadcast(&mut buf, source)?;
        if rank != source {
            self.unpack_state(&buf)?;
        }
        self.has_state = true;
        tracing::info!(
            source,
            step = self.state.step,
            "state synchronised from rank {source}"
        );
        Ok(())
    }

    /// Parameters, buffers, optimizer state and counters as one flat
    /// buffer: a 48-bit header length, the JSON header (two bytes per
    /// element, exact small integers), then the tensors' values.
    fn pack_state(&self) -> Result<Vec<f32>> {
        let model: Vec<(String, Tensor)> = self
            .model
            .state()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let opt = self.optimizer.named_state(&self.model.params);
        let shapes = |ts: &[(String, Tensor)]| -> Result<Vec<(String, Vec<i64>)>> {
            ts.iter()
                .map(|(n, t)| {
                    if t.kind() != Kind::Float {
                        return Err(Error::Model(format!(
                            "{n} is {:?}; only float32 state can be synchronised between ranks",
                            t.kind()
                        )));
                    }
                    Ok((n.clone(), t.size()))
                })
                .collect()
        };
        let header = StateHeader {
            state: self.state.clone(),
            model: shapes(&model)?,
            optimizer: shapes(&opt)?,
        };
        let json = serde_json::to_vec(&header).map_err(|e| Error::Model(e.to_string()))?;
        let mut buf = vec![0f32; 3];
        encode_u48(json.len() as u64, &mut buf);
        buf.extend(
            json.chunks(2)
                .map(|c| (c[0] as u32 | (*c.get(1).unwrap_or(&0) as u32) << 8) as f32),
        );
        let tensors: Vec<Tensor> = model
            .iter()
            .chain(opt.iter())
            .map(|(_, t)| t.shallow_clone())
            .collect();
        buf.extend(flatten(&tensors)?);
        Ok(buf)
    }

    fn unpack_state(&mut self, buf: &[f32]) -> Result<()> {
        let bad = |reason: String| Error::Model(format!("synchronised state: {reason}"));
        let json_len = decode_u48(buf.get(..3).ok_or_else(|| bad("empty".into()))?) as usize;
        let words = json_len.div_ceil(2);
        let raw = buf
            .get(3..3 + words)
            .ok_or_else(|| bad("truncated header".into()))?;
        let mut json = Vec::with_capacity(words * 2);
        for w in raw {
            let v = *w as u32;
            json.extend([(v & 0xff) as u8, (v >> 8) as u8]);
        }
        json.truncate(json_len);
        let header: StateHeader = serde_json::from_slice(&json).map_err(|e| bad(e.to_string()))?;
        let mut data = &buf[3 + words..];
        let mut take = |shape: &[i64]| -> Result<&[f32]> {
            let n = shape.iter().product::<i64>().max(0) as usize;
            if data.len() < n {
                return Err(bad("truncated tensor data".into()));
            }
            let (a, b) = data.split_at(n);
            data = b;
            Ok(a)
        };
        let mine: std::collections::HashMap<String, Tensor> = self
            .model
            .state()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let _guard = tch::no_grad_guard();
        for (name, shape) in &header.model {
            let t = mine
                .get(name)
                .ok_or_else(|| bad(format!("unknown tensor {name}")))?;
            if t.size() != *shape {
                return Err(bad(format!(
                    "{name} has shape {shape:?} at the source, {:?} here",
                    t.size()
                )));
            }
            unflatten(take(shape)?, std::slice::from_ref(t))?;
        }
        let mut opt = Vec::with_capacity(header.optimizer.len());
        for (name, shape) in &header.optimizer {
            let t = Tensor::f_from_slice(take(shape)?)
                .and_then(|t| t.f_view(shape.as_slice()))
                .ctx("rebuilding optimizer state")?;
            opt.push((name.clone(), t));
        }
        self.optimizer
            .load_state(&self.model.params, opt, header.state.optimizer_steps)?;
        self.state = header.state;
        Ok(())
    }

    /// Points the sharding and the window plan at the current world size
    /// and k; when they differ from the ones the cursor counts in, the rest
    /// of the epoch is re-sharded from the committed cursor.
    fn reshard(&mut self) {
        let world = self.collective.world_size();
        let rank = self.collective.rank();
        let k = self.plan.k;
        let b = self.spec.data.batch_size as usize;
        let s = &mut self.state;
        if s.world_size != world as u64 || s.accumulation_steps != k as u64 {
            if s.cursor > 0 {
                let old = ShardSpec {
                    world: s.world_size.max(1) as usize,
                    offset: s.epoch_offset as usize,
                    ..self.shard
                };
                s.epoch_offset = old.offset_after(s.cursor as usize * b) as u64;
                s.cursor = 0;
            }
            tracing::info!(
                from_world = s.world_size,
                from_k = s.accumulation_steps,
                world,
                k,
                epoch_offset = s.epoch_offset,
                "re-sharding the rest of the epoch"
            );
            s.world_size = world as u64;
            s.accumulation_steps = k as u64;
        }
        let offset = s.epoch_offset as usize;
        self.set_plan(world, rank, offset);
        if self.plan.micro_batches() == 0 && self.state.epoch_offset > 0 {
            // Nothing of this epoch is left for the new world (drop_last).
            self.state.epoch += 1;
            self.state.epoch_offset = 0;
            self.set_plan(world, rank, 0);
        }
        self.total_steps = self.compute_total_steps();
        self.schedule = Schedule::from_spec(&self.spec, self.total_steps);
    }

    fn set_plan(&mut self, world: usize, rank: usize, offset: usize) {
        self.shard = ShardSpec {
            world,
            offset,
            ..self.shard
        };
        self.plan = WindowPlan {
            samples: self.shard.rank_len(rank),
            max_samples: self.shard.rank_len(0),
            ..self.plan
        };
        self.epoch_indices = (u64::MAX, Vec::new());
    }

    /// `max_steps`, or the committed steps plus the windows left in this
    /// epoch and in the remaining full epochs under the current plan.
    fn compute_total_steps(&self) -> u64 {
        if let Some(m) = self.spec.max_steps {
            return m;
        }
        let epochs = self.spec.epochs.unwrap_or(1);
        let s = &self.state;
        if s.epoch >= epochs {
            return s.step;
        }
        let full = ShardSpec {
            offset: 0,
            ..self.shard
        };
        let full_windows = WindowPlan {
            samples: full.rank_len(self.collective.rank()),
            max_samples: full.rank_len(0),
            ..self.plan
        }
        .windows() as u64;
        let here =
            (self.plan.windows() as u64).saturating_sub(s.cursor / self.plan.k.max(1) as u64);
        s.step + here + (epochs - s.epoch - 1) * full_windows
    }

    fn resume(&mut self) -> Result<()> {
        let loaded =
            checkpoint::read_latest(&self.checkpoint_dir)?.ok_or_else(|| Error::Checkpoint {
                path: self.checkpoint_dir.clone(),
                reason: "no checkpoint to resume from (no LATEST file)".into(),
            })?;
        self.model.load_named(
            &loaded.path.join(checkpoint::MODEL_FILE),
            checkpoint::to_device(loaded.model, self.device)?,
        )?;
        self.optimizer.load_state(
            &self.model.params,
            loaded.optimizer,
            loaded.state.optimizer_steps,
        )?;
        self.last_checkpoint = Some((loaded.state.step, loaded.path.clone()));
        self.state = loaded.state;
        self.has_state = true;
        tracing::info!(step = self.state.step, path = %loaded.path.display(), "resumed");
        Ok(())
    }

    /// Copies parameters and buffers from `root` to every rank.
    fn broadcast_state(&mut self, root: usize) -> Result<()> {
        let tensors: Vec<Tensor> = self.model.state().map(|(_, t)| t.shallow_clone()).collect();
        let mut buf = flatten(&tensors)?;
        self.collective.broadcast(&mut buf, root)?;
        unflatten(&buf, &tensors)
    }

    pub fn parameters(&self) -> &[(String, Tensor)] {
        &self.model.params
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn state(&self) -> &TrainerState {
        &self.state
    }

    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    pub fn accumulation_steps(&self) -> usize {
        self.plan.k
    }

    pub fn checkpoint_dir(&self) -> &Path {
        &self.checkpoint_dir
    }

    pub fn is_done(&self) -> bool {
        self.state.step >= self.total_steps
    }

    fn indices_for(&mut self, epoch: u64) -> &[i64] {
        if self.epoch_indices.0 != epoch {
            let idx = self.shard.indices(self.collective.rank(), epoch);
            self.epoch_indices = (epoch, idx.into_iter().map(|i| i as i64).collect());
        }
        &self.epoch_indices.1
    }

    /// Runs the next micro-step; on the window's last one also the sync step,
    /// whose report it returns.
    pub fn micro_step(&mut self) -> Result<Option<StepReport>> {
        if let Some(c) = &self.opts.control {
            if c.abort.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(Error::Interrupted(
                    "the coordinator aborted the window".into(),
                ));
            }
        }
        let started = Instant::now();
        if self.window.started.is_none() {
            self.window.started = Some(started);
            self.window.bytes_at_start = self.collective.bytes();
        }
        let m = self.state.cursor as usize + self.window.micro;
        let (a, b) = self.plan.micro_batch_range(m);
        let n = (b - a) as u64;
        if n > 0 {
            self.forward_backward(a, b)?;
            self.window.batches += 1;
        }
        if let Some(d) = self.opts.micro_step_delay {
            std::thread::sleep(d);
        }
        self.window.samples += n;
        self.window.micro += 1;
        self.state.micro_step += 1;
        self.window.compute += started.elapsed();
        if self.sync == SyncMode::EveryStep {
            let t = Instant::now();
            self.reduce_micro_step()?;
            self.window.comm += t.elapsed();
        }
        if self.plan.is_sync(m) {
            return self.sync_step().map(Some);
        }
        Ok(None)
    }

    /// Forward, loss and backward on samples `a..b` of this rank's epoch;
    /// gradients add into `.grad`.
    fn forward_backward(&mut self, a: usize, b: usize) -> Result<()> {
        let epoch = self.state.epoch;
        let idx = Tensor::from_slice(&self.indices_for(epoch)[a..b]);
        let idx = idx.f_to_device(self.device).ctx("moving indices")?;
        let (x, y) = self.train.batch(&idx)?;
        let reduction = match self.normalize {
            Normalize::GlobalCount => Reduction::Sum,
            Normalize::Mean | Normalize::Sum => Reduction::Mean,
        };
        let logits = self.model.forward(&x, true)?;
        let loss = logits
            .f_cross_entropy_loss::<Tensor>(&y, None, reduction, -100, 0.0)
            .ctx("computing the loss")?;
        loss.f_backward().ctx("running backward")?;
        let loss_sum = match reduction {
            Reduction::Sum => loss.f_detach(),
            _ => loss.f_detach().and_then(|l| l.f_mul_scalar((b - a) as f64)),
        }
        .ctx("accumulating the loss")?;
        self.window.loss_sum = Some(match self.window.loss_sum.take() {
            None => loss_sum,
            Some(acc) => acc.f_add(&loss_sum).ctx("accumulating the loss")?,
        });
        Ok(())
    }

    /// sync = every_step: all-reduce this micro-step's gradients now and add
    /// them to the window's accumulation buffers.
    fn reduce_micro_step(&mut self) -> Result<()> {
        let grads = self.model.grads();
        self.grads.all_reduce(&mut self.collective, &mut [])?;
        let _guard = tch::no_grad_guard();
        match &mut self.acc {
            None => {
                self.acc = Some(
                    grads
                        .iter()
                        .map(|g| g.f_detach_copy())
                        .collect::<Result<_, _>>()
                        .ctx("accumulating")?,
                )
            }
            Some(acc) => {
                for (a, g) in acc.iter_mut().zip(&grads) {
                    a.f_add_(g).ctx_("accumulating")?;
                }
            }
        }
        self.grads.zero()
    }

    /// The sync-step pipeline.
    pub fn sync_step(&mut self) -> Result<StepReport> {
        let _guard = tch::no_grad_guard();
        let grads = self.model.grads();
        // 1. reduce gradients and the window's counts over all ranks.
        let t_comm = Instant::now();
        let loss_sum = match self.window.loss_sum.take() {
            Some(l) => l.f_double_value(&[]).ctx("reading the loss")?,
            None => 0.0,
        };
        let mut stats = vec![
            self.window.samples as f32,
            self.window.batches as f32,
            loss_sum as f32,
        ];
        match self.acc.take() {
            Some(acc) => {
                for (g, a) in grads.iter().zip(&acc) {
                    g.shallow_clone()
                        .f_copy_(a)
                        .ctx("restoring accumulated gradients")?;
                }
                self.collective.all_reduce_sum(&mut stats)?;
            }
            None => self.grads.all_reduce(&mut self.collective, &mut stats)?,
        }
        let comm = self.window.comm + t_comm.elapsed();
        let global_samples = stats[0].round() as u64;
        let global_micro = stats[1].round() as u64;
        let world = self.collective.world_size() as f64;
        // 2.-3. normalize and clip: one reduction over the whole buffer for
        // the norm of the summed gradients (the norm of the normalized ones
        // is that divided by the divisor), then one pass that applies
        // 1/divisor and the clip coefficient together.
        let t_clip = Instant::now();
        let divisor = match self.normalize {
            Normalize::GlobalCount => global_samples as f64,
            Normalize::Mean => global_micro as f64,
            Normalize::Sum => world,
        };
        let norm_type = self.spec.norm_type();
        let grad_norm = self
            .grads
            .norm(norm_type)?
            .f_double_value(&[])
            .ctx("reading the gradient norm")?
            / divisor;
        let step = self.state.step;
        let lr = self.schedule.lr_at(step);
        let mut clip_coef = 1.0;
        let skipped = !grad_norm.is_finite();
        // What the gradients go through before the optimizer: 1/divisor and
        // the clip, as one multiplier where possible.
        let prep = if skipped {
            match self.spec.clipping.on_nonfinite {
                OnNonfinite::Skip => {}
                OnNonfinite::Error => {
                    return Err(Error::NonFinite {
                        step: step + 1,
                        norm: grad_norm,
                    })
                }
            }
            tracing::warn!(
                step = step + 1,
                grad_norm,
                "non-finite gradient norm, step skipped"
            );
            None
        } else if let Some(max_norm) = self.spec.clipping.max_norm {
            // clip_grad_norm_: min(1, max_norm / (total_norm + 1e-6)).
            clip_coef = (max_norm / (grad_norm + 1e-6)).min(1.0);
            Some(GradPrep::Mul((clip_coef / divisor) as f32))
        } else if let Some(v) = self.spec.clipping.clip_value {
            Some(GradPrep::DivClamp(divisor as f32, v as f32))
        } else {
            Some(GradPrep::Div(divisor as f32))
        };
        let mut clip_s = t_clip.elapsed();
        let mut prep_s = Duration::ZERO;
        // 4. optimizer step, zero grads. On CPU with SGD: one fused pass per
        // parameter that also applies `prep` and zeroes the gradient
        // (crate::fused); otherwise the same as tensor ops, pass by pass.
        let t_opt = Instant::now();
        let fused = match prep {
            Some(prep) => match self.grads.cpu_mut() {
                Some(g) => self.optimizer.step_fused(&self.model.params, g, lr, prep)?,
                None => false,
            },
            None => false,
        };
        if fused {
            self.grads.zero_extra()?;
        } else {
            if let Some(prep) = prep {
                let t = Instant::now();
                self.grads.prepare(prep)?;
                prep_s = t.elapsed();
                clip_s += prep_s;
                self.optimizer.step(&self.model.params, lr)?;
            }
            self.grads.zero()?;
        }
        let optimizer_s = t_opt.elapsed().saturating_sub(prep_s);
        // 5. commit.
        if let Some(path) = self.opts.sample_log.clone() {
            self.log_window(&path)?;
        }
        self.has_state = true;
        let s = &mut self.state;
        s.step += 1;
        s.samples_seen += global_samples;
        s.skipped_steps += skipped as u64;
        s.optimizer_steps = self.optimizer.steps;
        s.lr = lr;
        s.cursor += self.window.micro as u64;
        if s.cursor as usize >= self.plan.micro_batches() {
            s.epoch += 1;
            s.cursor = 0;
            if s.epoch_offset > 0 {
                // The next epoch is sharded whole again.
                s.epoch_offset = 0;
                let (world, rank) = (self.collective.world_size(), self.collective.rank());
                self.set_plan(world, rank, 0);
            }
        }
        let s = &mut self.state;
        let wall = self.window.started.map(|t| t.elapsed()).unwrap_or_default();
        let window = std::mem::take(&mut self.window);
        let (sent, received) = self.collective.bytes();
        Ok(StepReport {
            step: s.step,
            total_steps: self.total_steps,
            epoch: s.epoch,
            micro_step: s.micro_step,
            loss: loss_sum_global(stats[2] as f64, global_samples),
            grad_norm,
            clip_coef,
            skipped,
            samples: global_samples,
            samples_seen: s.samples_seen,
            lr,
            samples_per_sec: global_samples as f64 / wall.as_secs_f64().max(1e-9),
            timing: Timing {
                compute_s: window.compute.as_secs_f64(),
                comm_s: comm.as_secs_f64(),
                clip_s: clip_s.as_secs_f64(),
                optimizer_s: optimizer_s.as_secs_f64(),
            },
            bytes_sent: sent - window.bytes_at_start.0,
            bytes_received: received - window.bytes_at_start.1,
            job_bytes_sent: sent,
            job_bytes_received: received,
        })
    }

    /// Loss and accuracy on the held-out split (None without one).
    pub fn evaluate(&mut self) -> Result<Option<EvalReport>> {
        let Some(eval) = &self.eval else {
            return Ok(None);
        };
        let _guard = tch::no_grad_guard();
        self.model.set_train(false)?;
        let n = eval.len() as i64;
        let bs = self.spec.eval.batch_size as i64;
        let (mut loss, mut correct) = (0.0, 0i64);
        let mut start = 0;
        while start < n {
            let len = bs.min(n - start);
            let x = eval.x.f_narrow(0, start, len).ctx("evaluating")?;
            let y = eval.y.f_narrow(0, start, len).ctx("evaluating")?;
            let logits = self.model.forward(&x, false)?;
            let l = logits
                .f_cross_entropy_loss::<Tensor>(&y, None, Reduction::Sum, -100, 0.0)
                .ctx("evaluating")?;
            loss += l.f_double_value(&[]).ctx("evaluating")?;
            let hits = logits
                .f_argmax(-1, false)
                .and_then(|p| p.f_eq_tensor(&y))
                .and_then(|e| e.f_sum(Kind::Int64))
                .and_then(|s| s.f_int64_value(&[]))
                .ctx("evaluating")?;
            correct += hits;
            start += len;
        }
        self.model.set_train(true)?;
        Ok(Some(EvalReport {
            epoch: self.state.epoch,
            step: self.state.step,
            loss: loss / n.max(1) as f64,
            accuracy: correct as f64 / n.max(1) as f64,
            samples: n as u64,
        }))
    }

    /// Writes a checkpoint of the committed state (rank 0 writes; the
    /// others hold identical parameters).
    pub fn checkpoint(&mut self) -> Result<PathBuf> {
        if let Some((step, path)) = &self.last_checkpoint {
            if *step == self.state.step {
                return Ok(path.clone());
            }
        }
        let path = if self.collective.rank() == 0 {
            let model: Vec<(String, Tensor)> = self
                .model
                .state()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect();
            let opt = self.optimizer.named_state(&self.model.params);
            checkpoint::write(
                &self.checkpoint_dir,
                &self.state,
                &model,
                &opt,
                self.spec.checkpoint.keep as usize,
            )?
        } else {
            self.checkpoint_dir
                .join(format!("step-{}", self.state.step))
        };
        self.last_checkpoint = Some((self.state.step, path.clone()));
        Ok(path)
    }

    /// Trains to the end (or `stop_after_steps`), checkpointing and
    /// evaluating as the spec says; always leaves a checkpoint of the last step.
    pub fn run(&mut self, mut on_event: impl FnMut(Event<'_>)) -> Result<Summary> {
        self.model.set_train(true)?;
        let every = self.spec.checkpoint.every_steps;
        let eval_every = self.spec.eval.every_epochs;
        let mut stopped = false;
        while !self.is_done() {
            let Some(report) = self.micro_step()? else {
                continue;
            };
            on_event(Event::Step(&report));
            let epoch_ended = self.state.cursor == 0;
            if eval_every > 0
                && epoch_ended
                && self.state.epoch % eval_every == 0
                && !self.is_done()
            {
                if let Some(e) = self.evaluate()? {
                    on_event(Event::Eval(&e));
                }
            }
            if every > 0 && self.state.step % every == 0 && !self.is_done() {
                let p = self.checkpoint()?;
                on_event(Event::Checkpoint(&p));
            }
            let requested = self.opts.control.clone();
            if let Some(c) = &requested {
                if c.checkpoint_now
                    .swap(false, std::sync::atomic::Ordering::SeqCst)
                    && !self.is_done()
                {
                    let p = self.checkpoint()?;
                    on_event(Event::Checkpoint(&p));
                }
            }
            if requested
                .as_ref()
                .is_some_and(|c| c.reform.load(std::sync::atomic::Ordering::SeqCst))
                && !self.is_done()
            {
                return Err(Error::Interrupted(format!(
                    "leaving at step {} for a new generation",
                    self.state.step
                )));
            }
            let stop_requested = requested.as_ref().is_some_and(|c| c.stopping());
            if (stop_requested
                || self
                    .opts
                    .stop_after_steps
                    .is_some_and(|s| self.state.step >= s))
                && !self.is_done()
            {
                stopped = true;
                break;
            }
        }
        let checkpoint = self.checkpoint()?;
        on_event(Event::Checkpoint(&checkpoint));
        let eval = if stopped { None } else { self.evaluate()? };
        if let Some(e) = &eval {
            on_event(Event::Eval(e));
        }
        Ok(Summary {
            state: self.state.clone(),
            eval,
            checkpoint,
            finished: !stopped,
        })
    }
}

impl<C: Collective> Engine<C> {
    /// Appends the global sample indices of the window being committed
    /// (every rank's share, so any rank's line describes the whole window).
    fn log_window(&mut self, path: &Path) -> Result<()> {
        use std::io::Write;
        let epoch = self.state.epoch;
        let (first, count) = (self.state.cursor as usize, self.window.micro);
        let mut indices = Vec::new();
        for r in 0..self.shard.world {
            let plan = WindowPlan {
                samples: self.shard.rank_len(r),
                ..self.plan
            };
            let idx = self.shard.indices(r, epoch);
            for m in first..first + count {
                let (a, b) = plan.micro_batch_range(m);
                indices.extend_from_slice(&idx[a..b]);
            }
        }
        let line = serde_json::json!({
            "job": self.spec.name,
            "step": self.state.step + 1,
            "epoch": epoch,
            "rank": self.collective.rank(),
            "world": self.shard.world,
            "indices": indices,
        });
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(crate::error::io_err(path))?;
        writeln!(f, "{line}").map_err(crate::error::io_err(path))
    }
}

/// What [`Engine::pack_state`] puts before the tensor values.
#[derive(serde::Serialize, serde::Deserialize)]
struct StateHeader {
    state: TrainerState,
    model: Vec<(String, Vec<i64>)>,
    optimizer: Vec<(String, Vec<i64>)>,
}

/// A value below 2^48 as three exact 16-bit integers in f32s (sums of
/// such slots across ranks stay exact as long as one rank sets each).
fn encode_u48(v: u64, out: &mut [f32]) {
    for (i, o) in out.iter_mut().take(3).enumerate() {
        *o = ((v >> (16 * i)) & 0xffff) as f32;
    }
}

fn decode_u48(v: &[f32]) -> u64 {
    v.iter()
        .take(3)
        .enumerate()
        .map(|(i, x)| (x.round().max(0.0) as u64 & 0xffff) << (16 * i))
        .sum()
}

fn loss_sum_global(sum: f64, samples: u64) -> f64 {
    sum / samples.max(1) as f64
}

/// Copies tensors into one flat f32 host buffer (in order). CUDA tensors
/// are concatenated on the device and staged through pinned host memory
/// (one DMA per bucket instead of one pageable copy per tensor).
pub fn flatten(tensors: &[Tensor]) -> Result<Vec<f32>> {
    let total: usize = tensors.iter().map(|t| t.numel()).sum();
    let mut buf = vec![0f32; total];
    if let Some(device) = cuda_device(tensors) {
        let parts: Vec<Tensor> = tensors
            .iter()
            .map(|t| {
                t.f_detach()
                    .and_then(|t| t.f_flatten(0, -1))
                    .and_then(|t| t.f_to_kind(Kind::Float))
            })
            .collect::<Result<_, _>>()
            .ctx("flattening tensors")?;
        let flat = Tensor::f_cat(&parts, 0).ctx("flattening tensors")?;
        let mut pinned = Tensor::f_empty([total as i64], (Kind::Float, Device::Cpu))
            .and_then(|h| h.f_pin_memory(device))
            .ctx("allocating pinned memory")?;
        pinned.f_copy_(&flat).ctx("staging to pinned memory")?;
        pinned
            .f_copy_data(&mut buf, total)
            .ctx("staging to pinned memory")?;
        return Ok(buf);
    }
    let mut off = 0;
    for t in tensors {
        let n = t.numel();
        let host = t
            .f_detach()
            .and_then(|t| t.f_to_kind(Kind::Float))
            .and_then(|t| t.f_contiguous())
            .ctx("flattening tensors")?;
        host.f_copy_data(&mut buf[off..off + n], n)
            .ctx("flattening tensors")?;
        off += n;
    }
    Ok(buf)
}

fn cuda_device(tensors: &[Tensor]) -> Option<Device> {
    tensors.iter().map(|t| t.device()).find(|d| d.is_cuda())
}

/// Copies a flat buffer made by [`flatten`] back into the tensors (through
/// pinned memory for CUDA tensors).
pub fn unflatten(buf: &[f32], tensors: &[Tensor]) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let staged = match cuda_device(tensors) {
        Some(device) => Some(
            Tensor::from_slice(buf)
                .f_pin_memory(device)
                .and_then(|h| h.f_to_device_(device, Kind::Float, true, false))
                .ctx("staging from pinned memory")?,
        ),
        None => None,
    };
    let mut off = 0;
    for t in tensors {
        let n = t.numel();
        let src = match &staged {
            Some(flat) => flat.f_narrow(0, off as i64, n as i64),
            None => Tensor::from_slice(&buf[off..off + n]).f_to_kind(t.kind()),
        }
        .and_then(|s| s.f_view(t.size().as_slice()))
        .ctx("unflattening tensors")?;
        t.shallow_clone()
            .f_copy_(&src)
            .ctx("unflattening tensors")?;
        off += n;
    }
    Ok(())
}
