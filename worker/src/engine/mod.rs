//! The training engine of one rank.
//!
//! Micro-step: forward, loss, backward; gradients add into the parameters'
//! `.grad` (the accumulation buffers) and nothing is communicated (`sync =
//! "boundary"`). Sync step (the schedule's, after k micro-steps or the
//! epoch's last): one pipeline, [`Engine::sync_step`]: reduce(grads, tally)
//! -> normalize -> clip -> optimizer step -> schedule -> zero grads ->
//! commit.
//!
//! One concern per module: [`window`] (micro-steps and the sync step),
//! [`placement`] (who owns which parameters, gradients and optimizer
//! state: ZeRO stages 0, 1, 2 as strategies behind one trait),
//! [`trainer`] (the step schedule, the run loop, accounting, events,
//! evaluation and checkpoints), [`plan`] (sharding the data and the window
//! plan for the current world size and k), [`state_sync`] (bringing every
//! rank to the newest committed state) and [`flat`] (tensors to and from
//! flat host buffers). This file holds the engine and its set-up.

mod commit;
mod flat;
mod graph;
mod norm;
mod options;
mod pipe;
mod placement;
mod plan;
mod recompute;
mod report;
mod resume;
mod setup;
mod state_sync;
mod sync_graph;
mod tensor;
mod trainer;
mod verdict;
mod window;
mod workload;
mod zero3;

pub use flat::{flatten, unflatten};
use options::Agreed;
pub use options::{Control, RunOptions};
pub use report::{EvalReport, Event, StepReport, Summary, Timing};
pub use setup::{read_init, resolve_device};
use setup::{spec_hash, starved};
/// Pipeline schedules (issue 40): what each stage runs in which order.
pub use trainer::pipeline;

use crate::checkpoint::{self, TrainerState};
use crate::comm::collective::Collective;
use crate::error::{Error, Result};
use crate::family::model::{Model, WeightsFrom};
use crate::grads::FlatGrads;
use crate::objective::Objective;
use crate::optim::schedule::Schedule;
use crate::source::sampler::{ShardSpec, WindowPlan};
use crate::source::DataSource;
use crate::spec::JobSpec;
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};
use window::Window;

pub struct Engine<C: Collective> {
    spec: JobSpec,
    collective: C,
    device: Device,
    model: Model,
    schedule: Schedule,
    /// The training split.
    train: Box<dyn DataSource>,
    /// The held-out split.
    eval: Option<Box<dyn DataSource>>,
    /// The loss the window trains with and the evaluation reports.
    objective: Box<dyn Objective>,
    /// Files every checkpoint carries for other tools (a language model's
    /// config.json and tokenizer.json).
    extra_files: Vec<(String, Vec<u8>)>,
    shard: ShardSpec,
    plan: WindowPlan,
    total_steps: u64,
    state: TrainerState,
    epoch_indices: Option<window::EpochIndices>,
    /// The micro-step's CUDA graph and the window's loss accumulator.
    graph: graph::MicroGraph,
    /// The sync step's CUDA graph.
    sync_graph: sync_graph::SyncGraph,
    window: Window,
    /// The gradient-accumulation buffer and the optimizer state, owned
    /// by placement (engine/placement/): ZeRO stage 0 to 3.
    placement: placement::Placed<C>,
    /// The micro-step / sync-step sequence of a window (engine/trainer/).
    step_schedule: Box<dyn trainer::StepSchedule>,
    /// The most gradient bytes held after a micro-step that was not a
    /// sync step ([`Engine::gradient_bytes`]; for the logs and benchmarks).
    most_grad_between: usize,
    /// What every rank agreed at the last sync step (any rank asking is
    /// enough): honoured after that step.
    agreed: Agreed,
    checkpoint_dir: PathBuf,
    /// This job as the checkpoint folder's owner.
    owner: checkpoint::owner::Owner,
    /// Recovery fell back past an unreadable checkpoint to this step:
    /// pruning never deletes it or an older one.
    protect_upto: Option<u64>,
    /// Where this rank's state came from, for the first step report of a
    /// generation (taken then).
    resumed_from: Option<String>,
    opts: RunOptions,
    last_checkpoint: Option<(u64, PathBuf)>,
    /// Whether this rank holds the job's committed state (it resumed or
    /// committed a step), as opposed to fresh initial weights.
    holds_committed: bool,
    /// Rank 0's writer lock on the checkpoint folder (None on other ranks).
    folder_lock: Option<checkpoint::lock::FolderLock>,
    /// This rank's pipeline stage (issue 40; None: the model is whole).
    pipe: Option<pipe::Pipe>,
    /// `activation_checkpointing = "full"` (issue 41): the block ranges
    /// whose activations are recomputed in the backward.
    recompute: Option<recompute::Recompute>,
    /// ZeRO-3 under `sync = "every_step"`: gradients kept and reduced by
    /// unit (engine/zero3.rs).
    zero3_by_unit: bool,
    /// The sample shape and class count the model was built for (ZeRO-3
    /// builds the initial weights again after a loss before any step).
    build_shape: (Vec<i64>, i64),
    /// This rank's place on the tensor axis (issue 42; None: T = 1).
    tensor: Option<tensor::TensorAxis>,
}

impl<C: Collective> Engine<C> {
    /// The model's parameters and buffers by name (shallow: no copy).
    fn model_state(&self) -> Vec<(String, Tensor)> {
        self.model
            .state()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    /// Loads data, builds the model, applies `init` or the checkpoint, and
    /// checks everything before anything is written.
    pub fn new(spec: JobSpec, collective: C, opts: RunOptions) -> Result<Self> {
        spec.validate()?;
        // The data axis: the engine shards samples and reduces gradients
        // over it (the world when the model is not split).
        let world = collective.world_size();
        let rank = collective.rank();
        let stages = collective.stages();
        // k follows the data degree (the coordinator's k for the whole
        // mesh, tensor ranks included).
        let k = spec
            .accumulation_steps_for_data(world as u64)
            .map_err(|e| crate::spec::SpecErrors(vec![e]))? as usize;
        let device = resolve_device(&spec.device)?;
        if let Some(t) = spec.threads {
            tch::set_num_threads(t as i32);
        }
        let workload = workload::load(&spec, device)?;
        zero3::check(&spec, device)?;
        if spec.sharding.stage == 3 {
            // Each gathered unit is freed after use: give the memory back.
            crate::storage::return_freed_memory();
        }
        // ZeRO-3 builds each rank's chunks only (of `model.init` too).
        let mut built = None;
        let mut all_names: Vec<String> = Vec::new();
        // A pipeline stage trains its blocks' parameters: a first build
        // holding none gives every parameter's name and shape (the plan's
        // input), the second holds the stage's only; both draw the whole
        // model's initial values from the job's seed, so the stage's are
        // P = 1's. The rest stays frozen by name.
        let (mut model, stage_plan) = match stages {
            Some((stage, n)) => {
                let build = |keep: Box<dyn Fn(&str) -> bool>| {
                    Model::build_stage(
                        &spec.model,
                        &workload.sample_shape,
                        workload.classes,
                        device,
                        spec.seed,
                        keep,
                    )
                };
                let all = build(Box::new(|_| false))?.frozen;
                let (p, names) = pipe::plan(&spec, &all, stage, n)?;
                // ZeRO-3 in stages: the stage's blocks are its units.
                all_names = all.into_iter().map(|(n, _)| n).collect();
                let shared = p.tied.clone().filter(|_| p.is_last());
                let mut keep = names.clone();
                keep.extend(shared.clone());
                let model = build(Box::new(move |n| keep.contains(n)))?;
                (model, Some((p, names, shared)))
            }
            // (Under tensor parallelism the model is built whole, cut, then
            // sharded over the data axis by the first micro-step.)
            None if spec.sharding.stage == 3 && collective.tensor().is_none() => {
                let layout = (world, rank);
                let (model, owned) = zero3::build(
                    &spec,
                    &workload.sample_shape,
                    workload.classes,
                    device,
                    layout,
                )?;
                built = Some((owned, layout));
                (model, None)
            }
            None => (
                Model::build(
                    &spec.model,
                    &workload.sample_shape,
                    workload.classes,
                    device,
                    spec.seed,
                )?,
                None,
            ),
        };
        let pipe = match stage_plan {
            Some((p, names, shared)) => {
                let (stage, n) = (p.stage, p.stages);
                model.restrict(&names, shared.as_deref())?;
                // The last stage's copy of a tied embedding gathers its
                // gradient apart (engine/pipe/ sends it to the first).
                crate::grads::define_grads(&model.shared)?;
                tracing::info!(stage, stages = n, chunks = ?p.chunks, params = model.params.len(), "pipeline stage");
                if k < n {
                    // (P - 1) / (k + P - 1) of each window is the bubble.
                    let bubble = (n - 1) as f64 / (k + n - 1) as f64;
                    tracing::warn!(
                        k,
                        stages = n,
                        "accumulation.steps = {k} is below parallel.pipeline = {n}: about {:.0}% of each step is the pipeline's bubble (more accumulation steps shrink it)",
                        bubble * 100.0
                    );
                }
                Some(p)
            }
            None => None,
        };
        // Tensor parallelism: the whole model drawn from the seed, cut to
        // this rank's slices (`init` and checkpoints are cut as they load).
        let mut collective = collective;
        let tensor = tensor::split(&spec, &mut model, &mut collective)?;
        // (ZeRO-3 took its chunks of `init` in its build.)
        if let Some(given) = spec.model.init.as_ref().filter(|_| built.is_none()) {
            // A file, or a folder transformers wrote (save_pretrained):
            // model.safetensors, or shards and their index (a stage takes
            // its own tensors, as from a checkpoint).
            let tensors = setup::read_init(given)?;
            model.load_named(WeightsFrom::Init(given), tensors)?;
        }
        let build_shape = (workload.sample_shape.clone(), workload.classes);
        let workload::Workload {
            train,
            eval,
            objective,
            extra_files,
            ..
        } = workload;
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
        if let Some(e) = starved(&shard) {
            return Err(e);
        }
        let total_steps = spec
            .max_steps
            .unwrap_or(spec.epochs.unwrap_or(1) * plan.windows() as u64);
        let schedule = Schedule::from_spec(&spec, total_steps);
        // The placement decides the optimizer state's shape (ZeRO stages 1
        // and 2 step one flat slice: one parameter's worth of state).
        let cap_elems = (spec.comm.bucket_cap_mb * (1 << 20) as f64 / 4.0) as usize;
        // ZeRO-3 with gradients by unit never allocates the whole buffer.
        let zero3_by_unit = zero3::by_unit(&spec);
        let grads = if zero3_by_unit {
            FlatGrads::unallocated(&model.params)?
        } else {
            FlatGrads::attach_via_host(&model.params, cap_elems, opts.copy_through_host)?
        };
        let stage_blocks = pipe
            .as_ref()
            .map(|p| (all_names.as_slice(), p.blocks()));
        let shards = zero3::shards(&spec, &model, built, stage_blocks)?;
        let placement = placement::Placed::new(
            spec.sharding.stage,
            &spec.optimizer,
            model.params.len(),
            grads,
            shards,
        );
        let checkpoint_dir = opts
            .checkpoint_dir
            .clone()
            .or_else(|| spec.checkpoint.dir.clone())
            .unwrap_or_else(|| {
                // Without a coordinator there is no job id: the name stands
                // in (the same layout as the coordinator's default).
                let state_dir = opts.state_dir.clone().unwrap_or_else(|| "runs".into());
                accrue_proto::layout::default_checkpoint_dir(&state_dir, &spec.name)
            });
        let owner = checkpoint::owner::Owner {
            job_id: opts.job_id.clone().unwrap_or_else(|| spec.name.clone()),
            cluster: opts.cluster.clone(),
            spec_hash: spec_hash(&spec),
            created_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64),
        };
        let state = TrainerState {
            loss_scale: (spec.precision == crate::spec::Precision::Fp16)
                .then(|| crate::cuda::amp::LossScale::new(&spec.loss_scaling)),
            job: spec.name.clone(),
            job_id: owner.job_id.clone(),
            spec_hash: owner.spec_hash.clone(),
            model_kind: spec.model.kind.as_str().to_string(),
            optimizer_kind: spec.optimizer.kind.as_str().to_string(),
            seed: spec.seed,
            lr: schedule.lr_at(0),
            world_size: world as u64,
            accumulation_steps: k as u64,
            ..Default::default()
        };
        // Process-wide, as torch.backends.cudnn.deterministic: set for
        // every job (absent: libtorch's default, off), so a daemon's next
        // job does not inherit the last one's.
        crate::cuda::backends::set_cudnn_deterministic(
            spec.performance.cudnn_deterministic.unwrap_or(false),
        )?;
        let graph_mode = if opts.graph_body_only {
            crate::cuda::graphs::Mode::BodyOnly
        } else if opts.force_graph_capture {
            crate::cuda::graphs::Mode::Capture {
                warmup: crate::cuda::graphs::WARMUP,
            }
        } else {
            crate::cuda::graphs::mode(
                spec.performance.cuda_graphs,
                device.is_cuda(),
                cfg!(accrue_cuda),
                placement.strategy.stage(),
            )
        };
        // A source read on the host is staged: each micro-batch is copied
        // into the graph's input buffers before the replay (engine/graph.rs).
        // Per-micro-batch means divide by the batch's own count, which a
        // replay cannot see.
        let staged = train.resident().is_empty();
        let recompute = recompute::plan(&spec, &model, stages.is_some())?;
        let graph_mode = match graph_mode {
            crate::cuda::graphs::Mode::Capture { .. } | crate::cuda::graphs::Mode::BodyOnly
                if staged && spec.accumulation.normalize != crate::spec::Normalize::GlobalCount =>
            {
                crate::cuda::graphs::Mode::Off(crate::cuda::graphs::EagerReason::PerBatchCount)
            }
            // A stage waits on its neighbours inside a micro-step and sums
            // the norm over the stages inside the sync step.
            crate::cuda::graphs::Mode::Capture { .. } | crate::cuda::graphs::Mode::BodyOnly
                if stages.is_some() =>
            {
                crate::cuda::graphs::Mode::Off(crate::cuda::graphs::EagerReason::PipelineStage)
            }
            crate::cuda::graphs::Mode::Capture { .. } | crate::cuda::graphs::Mode::BodyOnly
                if tensor.is_some() =>
            {
                crate::cuda::graphs::Mode::Off(crate::cuda::graphs::EagerReason::TensorParallel)
            }
            crate::cuda::graphs::Mode::Capture { .. } | crate::cuda::graphs::Mode::BodyOnly
                if recompute.is_some() =>
            {
                crate::cuda::graphs::Mode::Off(
                    crate::cuda::graphs::EagerReason::ActivationCheckpointing,
                )
            }
            m => m,
        };
        let graph = graph::MicroGraph::new(graph_mode, staged);
        let mut engine = Self {
            spec,
            collective,
            device,
            model,
            schedule,
            train,
            eval,
            objective,
            extra_files,
            shard,
            plan,
            total_steps,
            state,
            epoch_indices: None,
            graph,
            sync_graph: sync_graph::SyncGraph::default(),
            window: Window::default(),
            placement,
            step_schedule: Box::new(trainer::AccumulateThenSync),
            most_grad_between: 0,
            agreed: Agreed::default(),
            checkpoint_dir,
            owner,
            protect_upto: None,
            resumed_from: None,
            opts,
            last_checkpoint: None,
            holds_committed: false,
            folder_lock: None,
            pipe,
            recompute,
            zero3_by_unit,
            build_shape,
            tensor,
        };
        engine.check_sharding()?;
        if engine.writes_checkpoints() {
            engine.take_folder_lock()?;
        }
        if engine.opts.resume || engine.opts.resume_if_present {
            // Reads only after the owner check inside load_newest. Without
            // a checkpoint, a rank joining a recovery takes the state from
            // a surviving rank (or this is a fresh start); --resume fails.
            if !engine.resume()? && engine.opts.resume {
                return Err(Error::Checkpoint {
                    path: engine.checkpoint_dir.clone(),
                    reason: "no checkpoint to resume from (no step folder and no LATEST)".into(),
                });
            }
        } else {
            engine.check_owner()?;
            if let Some(n) = checkpoint::list_steps(&engine.checkpoint_dir)?.last() {
                return Err(Error::Checkpoint {
                    path: engine.checkpoint_dir.clone(),
                    reason: format!(
                        "already holds checkpoints (newest step-{n}); resume to continue, or choose another checkpoint.dir"
                    ),
                });
            }
        }
        if engine.resumed_from.is_none() {
            engine.resumed_from = Some("fresh start".into());
        }
        // The folder is claimed by the first checkpoint write (and checked
        // at every one): a run that fails before writes nothing.
        engine.sync_state()?;
        engine.reshard();
        // The peak so far is the build's (the model, `init`, a resume).
        let peak_rss_mib = report::peak_rss_bytes().map(|b| b >> 20);
        tracing::info!(rank, world, k, total_steps = engine.total_steps, step = engine.state.step, device = ?device, cuda_graphs = ?engine.graph.mode(), peak_rss_mib, "engine ready");
        Ok(engine)
    }

    /// Joins a new generation on `collective` (a re-formed ring) with
    /// `accumulation_steps` as k: the value the coordinator decided for the
    /// new world size, or (None) k computed from the spec for it. The rank
    /// holding the newest committed state broadcasts it to every rank, and
    /// the rest of the epoch is re-sharded when the world size or k changed.
    pub fn reconfigure(&mut self, collective: C, accumulation_steps: Option<u64>) -> Result<()> {
        // A rank keeps its pipeline stage across generations (the
        // coordinator re-forms survivors at their place; the daemon builds
        // a new engine for one that moves): its model holds that stage.
        let was = self.stage();
        if collective.stages() != was {
            return Err(Error::Schedule(format!(
                "this rank's pipeline stage (stage, stages) was {was:?} and is {:?} in the new generation; a rank that changes stage needs a new engine",
                collective.stages()
            )));
        }
        self.discard_window()?;
        self.resumed_from = Some(format!("its own state (step {})", self.state.step));
        self.graph.holder.reset();
        self.sync_graph.holder.reset();
        self.collective = collective;
        self.renew_tensor_group()?;
        // Rank 0 of the new generation (the first stage's, with stages)
        // writes the folder: it holds the lock; one that no longer does
        // lets go.
        if self.writes_checkpoints() {
            if self.folder_lock.is_none() {
                self.take_folder_lock()?;
            }
        } else {
            self.folder_lock = None;
        }
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
        // k follows the data degree.
        self.plan.k = self
            .spec
            .accumulation_steps_for_data(world as u64)
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

    /// Whether this rank writes the checkpoints: data rank 0 of the first
    /// stage (every stage sends it its part).
    pub(super) fn writes_checkpoints(&self) -> bool {
        self.collective.rank() == 0
            && self.pipe.as_ref().is_none_or(|p| p.is_first())
            && self.tensor_rank() == 0
    }

    /// This rank's pipeline stage and the number of stages (None: the
    /// model is whole).
    pub fn stage(&self) -> Option<(usize, usize)> {
        self.pipe.as_ref().map(|p| (p.stage, p.stages))
    }

    /// The collective in use (for replacing it between generations).
    pub fn collective_mut(&mut self) -> &mut C {
        &mut self.collective
    }
    /// The parameters as the model holds them. Under ZeRO-3 their storage
    /// is released between uses: read them through
    /// [`Engine::whole_parameters`] there.
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
}
