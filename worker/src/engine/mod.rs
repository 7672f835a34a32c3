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
//! flat host buffers). This file holds the engine; [`build`] has the
//! parts `Engine::new` is built of.

mod build;
mod commit;
mod flat;
mod grad_prep;
mod graph;
mod mesh;
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
pub use mesh::Mesh;
use options::Agreed;
pub use options::{Control, RunOptions};
pub use report::{EvalReport, Event, StepReport, Summary, Timing};
pub use setup::{read_init, resolve_device};
/// Pipeline schedules (issue 40): what each stage runs in which order.
pub use trainer::pipeline;

use crate::checkpoint::{self, TrainerState};
use crate::comm::collective::Collective;
use crate::error::{Error, Result};
use crate::family::model::{Model, WeightsFrom};
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
    /// The job's mesh and this rank's place in it (engine/mesh.rs): every
    /// question about stages, tensor ranks and degrees goes there.
    mesh: Mesh,
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
        let mesh = Mesh::of(&collective);
        let place = build::place(&spec, &mesh)?;
        let build::Place { world, rank, k, .. } = place;
        let device = build::device(&spec)?;
        let workload = workload::load(&spec, device)?;
        build::prepare_zero3(&spec, device)?;
        let mut collective = collective;
        let build::Built {
            model,
            pipe,
            tensor,
            all_names,
            chunks,
        } = build::model(&spec, &place, &workload, device, &mut collective)?;
        let build_shape = (workload.sample_shape.clone(), workload.classes);
        let workload::Workload {
            train,
            eval,
            objective,
            extra_files,
            ..
        } = workload;
        let (shard, plan) = build::data_plan(&spec, &place, train.len())?;
        let total_steps = build::total_steps(spec.max_steps, spec.epochs, plan.windows());
        let schedule = Schedule::from_spec(&spec, total_steps);
        let stage = pipe.as_ref().map(|p| (all_names.as_slice(), p));
        let (placement, zero3_by_unit) = build::placement(&spec, &opts, &model, chunks, stage)?;
        let checkpoint_dir = build::checkpoint_dir(&spec, &opts);
        let owner = build::owner(&spec, &opts);
        let state = build::fresh_state(&spec, &owner, schedule.lr_at(0), &place);
        // Process-wide, as torch.backends.cudnn.deterministic: set for
        // every job (absent: libtorch's default, off), so a daemon's next
        // job does not inherit the last one's.
        crate::cuda::backends::set_cudnn_deterministic(
            spec.performance.cudnn_deterministic.unwrap_or(false),
        )?;
        let staged = train.resident().is_empty();
        let recompute = recompute::plan(&spec, &model, place.stages.is_some())?;
        let bars = build::GraphBars {
            per_batch_count: staged
                && spec.accumulation.normalize != crate::spec::Normalize::GlobalCount,
            pipeline: place.stages.is_some(),
            tensor: tensor.is_some(),
            recompute: recompute.is_some(),
        };
        let mode = build::graph_mode(&spec, &opts, device, placement.strategy.stage());
        let graph = graph::MicroGraph::new(build::eager_override(mode, bars), staged);
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
            mesh,
        };
        engine.open_checkpoints()?;
        // The initial broadcast: every rank takes the newest committed
        // state (a resumed rank's, else rank 0's initial weights).
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
        let next = Mesh::of(&collective);
        if !self.mesh.same_split(&next) {
            return Err(Error::Schedule(format!(
                "this rank's pipeline stage (stage, stages) was {:?} and is {:?}, its tensor place (rank, degree) {:?} and {:?}, in the new generation; a rank that changes stage or tensor place needs a new engine",
                self.mesh.stages(),
                next.stages(),
                self.mesh.tensor(),
                next.tensor()
            )));
        }
        self.discard_window()?;
        self.resumed_from = Some(format!("its own state (step {})", self.state.step));
        self.graph.holder.reset();
        self.sync_graph.holder.reset();
        self.collective = collective;
        self.mesh = next;
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
        self.plan.k = self.mesh.accumulation_steps(&self.spec)?;
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
        self.mesh.writes_checkpoints()
    }

    /// This rank's pipeline stage and the number of stages (None: the
    /// model is whole).
    pub fn stage(&self) -> Option<(usize, usize)> {
        self.mesh.stages()
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
