//! `Engine::new`'s parts, in the order it calls them: the rank's place on
//! the mesh and k ([`place`]), the device ([`device`]), ZeRO-3's checks
//! ([`prepare_zero3`]), the model as this rank holds it ([`model`]: its
//! pipeline stage, ZeRO-3 chunks or the whole model, then its tensor
//! slices and `model.init`), the data's sharding and window plan
//! ([`data_plan`], [`total_steps`]), the placement ([`placement`]: the
//! gradient buffer and ZeRO's shards), the checkpoint folder and its owner
//! ([`checkpoint_dir`], [`owner`]) and the fresh trainer state
//! ([`fresh_state`]), the micro-step's CUDA graph ([`graph_mode`],
//! [`eager_override`]), and the checkpoint folder's claim or resume
//! ([`Engine::open_checkpoints`]). The decisions among them are pure and
//! tested in build_tests.rs.

use super::pipe::{self, Pipe};
use super::setup::{self, spec_hash};
use super::tensor::{self, TensorAxis};
use super::workload::Workload;
use super::{placement, zero3, Engine, Mesh, RunOptions};
use crate::checkpoint::{self, TrainerState};
use crate::comm::collective::Collective;
use crate::cuda::graphs::{EagerReason, Mode};
use crate::error::{Error, Result};
use crate::family::model::{Model, WeightsFrom};
use crate::grads::FlatGrads;
use crate::source::sampler::{ShardSpec, WindowPlan};
use crate::spec::{Axis, JobSpec};
use std::collections::HashSet;
use std::path::PathBuf;
use tch::{Device, Tensor};

/// This rank's place on the mesh as the engine reads it, and k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    /// The data axis's size: the engine shards samples and reduces
    /// gradients over it (the world when the model is not split).
    pub world: usize,
    /// This rank's place on the data axis.
    pub rank: usize,
    /// This rank's pipeline stage and the stage count (None: the model is
    /// whole).
    pub stages: Option<(usize, usize)>,
    /// Micro-steps per window.
    pub k: usize,
}

/// The rank's place on the mesh as the build reads it, and k: k follows
/// the data degree (the coordinator's k for the whole mesh, tensor ranks
/// included).
pub(super) fn place(spec: &JobSpec, mesh: &Mesh) -> Result<Place> {
    Ok(Place {
        world: mesh.degree(Axis::Data),
        rank: mesh.coord(Axis::Data),
        stages: mesh.stages(),
        k: mesh.accumulation_steps(spec)?,
    })
}

/// The job's device, and libtorch's thread count where the spec sets one.
pub(super) fn device(spec: &JobSpec) -> Result<Device> {
    let device = setup::resolve_device(&spec.device)?;
    if let Some(t) = spec.threads {
        tch::set_num_threads(t as i32);
    }
    Ok(device)
}

/// ZeRO-3's refusals before anything is built; under it, freed memory goes
/// back to the system (each gathered unit is freed after use).
pub(super) fn prepare_zero3(spec: &JobSpec, device: Device) -> Result<()> {
    zero3::check(spec, device)?;
    if spec.sharding.stage == 3 {
        // Each gathered unit is freed after use: give the memory back.
        crate::storage::return_freed_memory();
    }
    Ok(())
}

/// Which model a rank builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ModelBuild {
    /// A pipeline stage: its blocks' parameters (and a tied embedding's
    /// copy on the last stage); the rest frozen by name.
    Stage { stage: usize, stages: usize },
    /// ZeRO-3 without tensor parallelism: this rank's chunks only (of
    /// `model.init` too).
    Zero3Chunks,
    /// The whole model. (Under tensor parallelism the model is built
    /// whole, cut, then sharded over the data axis by the first
    /// micro-step.)
    Whole,
}

/// The build a rank makes from its pipeline stage (None: the model is
/// whole), the ZeRO stage and whether it has a tensor axis: a stage
/// builds its blocks whatever the ZeRO stage; ZeRO-3 builds its chunks
/// unless the model is cut over a tensor axis first.
pub(super) fn model_build(
    stages: Option<(usize, usize)>,
    zero_stage: u32,
    tensor: bool,
) -> ModelBuild {
    match stages {
        Some((stage, stages)) => ModelBuild::Stage { stage, stages },
        None if zero_stage == 3 && !tensor => ModelBuild::Zero3Chunks,
        None => ModelBuild::Whole,
    }
}

/// The model as this rank holds it.
pub(super) struct Built {
    pub model: Model,
    /// This rank's pipeline stage (None: the model is whole).
    pub pipe: Option<Pipe>,
    /// This rank's place on the tensor axis (None: T = 1).
    pub tensor: Option<TensorAxis>,
    /// Every parameter's name in a pipeline stage's build (ZeRO-3 in
    /// stages: the stage's blocks are its units); empty otherwise.
    pub all_names: Vec<String>,
    /// ZeRO-3's chunks from its build and the (world, rank) layout they
    /// were cut at.
    pub chunks: Option<(Tensor, (usize, usize))>,
}

/// A stage's plan: its place, the parameter names it trains, and the
/// tied embedding it holds a copy of (the last stage's).
type StagePlan = (Pipe, HashSet<String>, Option<String>);

/// Builds the model for this rank ([`model_build`]): its pipeline stage,
/// its ZeRO-3 chunks or the whole model; then cuts it to this rank's
/// tensor slices and applies `model.init` (ZeRO-3 took its chunks of
/// `init` in its build).
pub(super) fn model<C: Collective>(
    spec: &JobSpec,
    place: &Place,
    workload: &Workload,
    device: Device,
    collective: &mut C,
) -> Result<Built> {
    // ZeRO-3 builds each rank's chunks only (of `model.init` too).
    let mut built = None;
    let mut all_names: Vec<String> = Vec::new();
    let mesh = Mesh::of(collective);
    let build = model_build(place.stages, spec.sharding.stage, mesh.has(Axis::Tensor));
    let (mut model, stage_plan) = match build {
        ModelBuild::Stage { stage, stages: n } => {
            let last = mesh.is_last_stage();
            let (model, plan, names) = build_stage(spec, workload, device, (stage, n), last)?;
            all_names = names;
            (model, Some(plan))
        }
        ModelBuild::Zero3Chunks => {
            let layout = (place.world, place.rank);
            let (model, owned) = zero3::build(
                spec,
                &workload.sample_shape,
                workload.classes,
                device,
                layout,
            )?;
            built = Some((owned, layout));
            (model, None)
        }
        ModelBuild::Whole => (
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
        Some(plan) => Some(enter_stage(&mut model, plan, place.k)?),
        None => None,
    };
    // Tensor parallelism: the whole model drawn from the seed, cut to
    // this rank's slices (`init` and checkpoints are cut as they load).
    let tensor = tensor::split(spec, &mut model, collective)?;
    // (ZeRO-3 took its chunks of `init` in its build.)
    if let Some(given) = spec.model.init.as_ref().filter(|_| built.is_none()) {
        // A file, or a folder transformers wrote (save_pretrained):
        // model.safetensors, or shards and their index (a stage takes
        // its own tensors, as from a checkpoint).
        let tensors = setup::read_init(given)?;
        model.load_named(WeightsFrom::Init(given), tensors)?;
    }
    Ok(Built {
        model,
        pipe,
        tensor,
        all_names,
        chunks: built,
    })
}

/// A pipeline stage's build, and every parameter's name.
///
/// A pipeline stage trains its blocks' parameters: a first build
/// holding none gives every parameter's name and shape (the plan's
/// input), the second holds the stage's only; both draw the whole
/// model's initial values from the job's seed, so the stage's are
/// P = 1's. The rest stays frozen by name; the last stage (`last`, the
/// mesh's) also keeps a tied embedding's copy as its head.
fn build_stage(
    spec: &JobSpec,
    workload: &Workload,
    device: Device,
    (stage, n): (usize, usize),
    last: bool,
) -> Result<(Model, StagePlan, Vec<String>)> {
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
    let (p, names) = pipe::plan(spec, &all, stage, n)?;
    // ZeRO-3 in stages: the stage's blocks are its units.
    let all_names = all.into_iter().map(|(n, _)| n).collect();
    let shared = p.tied.clone().filter(|_| last);
    let mut keep = names.clone();
    keep.extend(shared.clone());
    let model = build(Box::new(move |n| keep.contains(n)))?;
    Ok((model, (p, names, shared), all_names))
}

/// Restricts the stage's model to the parameters it trains (a tied
/// embedding's copy kept apart), and warns when k leaves a large bubble.
fn enter_stage(model: &mut Model, (p, names, shared): StagePlan, k: usize) -> Result<Pipe> {
    let (stage, n) = (p.stage, p.stages);
    model.restrict(&names, shared.as_deref())?;
    // The last stage's copy of a tied embedding gathers its
    // gradient apart (engine/pipe/ sends it to the first).
    crate::grads::define_grads(&model.shared)?;
    tracing::info!(stage, stages = n, chunks = ?p.chunks, params = model.params.len(), "pipeline stage");
    if k < n {
        // (P - 1) / (V k + P - 1) of each window is the bubble (V chunks
        // a rank: 1 but for interleaved 1F1B).
        let bubble = (n - 1) as f64 / (p.chunks.len() * k + n - 1) as f64;
        tracing::warn!(
            k,
            stages = n,
            "accumulation.steps = {k} is below parallel.pipeline = {n}: about {:.0}% of each step is the pipeline's bubble (more accumulation steps shrink it)",
            bubble * 100.0
        );
    }
    Ok(p)
}

/// The training split of `len` samples sharded over the data axis, and
/// the window plan (k micro-batches of the batch size); refuses a
/// sharding that leaves a rank without a sample.
pub(super) fn data_plan(
    spec: &JobSpec,
    place: &Place,
    len: usize,
) -> Result<(ShardSpec, WindowPlan)> {
    let shard = ShardSpec {
        len,
        world: place.world,
        seed: spec.seed,
        shuffle: spec.data.shuffle,
        drop_last: spec.data.drop_last,
        pad: spec.data.pad,
        offset: 0,
    };
    let plan = WindowPlan {
        samples: shard.rank_len(place.rank),
        max_samples: shard.rank_len(0),
        batch: spec.data.batch_size as usize,
        k: place.k,
    };
    if let Some(e) = setup::starved(&shard) {
        return Err(e);
    }
    Ok((shard, plan))
}

/// The run's optimizer steps: `max_steps`, else `epochs` (default 1)
/// times an epoch's windows.
pub(super) fn total_steps(max_steps: Option<u64>, epochs: Option<u64>, windows: usize) -> u64 {
    max_steps.unwrap_or(epochs.unwrap_or(1) * windows as u64)
}

/// The placement of the gradient-accumulation buffer and the optimizer
/// state under the spec's ZeRO stage (stages 1 and 2 step one flat slice:
/// one parameter's worth of state), and whether ZeRO-3 keeps gradients by
/// unit (then the whole buffer is never allocated).
pub(super) fn placement<C: Collective>(
    spec: &JobSpec,
    opts: &RunOptions,
    model: &Model,
    chunks: Option<(Tensor, (usize, usize))>,
    stage: Option<(&[String], &Pipe)>,
) -> Result<(placement::Placed<C>, bool)> {
    let cap_elems = (spec.comm.bucket_cap_mb * (1 << 20) as f64 / 4.0) as usize;
    // ZeRO-3 with gradients by unit never allocates the whole buffer.
    let zero3_by_unit = zero3::by_unit(spec);
    let grads = if zero3_by_unit {
        FlatGrads::unallocated(&model.params)?
    } else {
        FlatGrads::attach_via_host(&model.params, cap_elems, opts.copy_through_host)?
    };
    let stage_blocks = stage.map(|(all_names, p)| (all_names, p.blocks()));
    let shards = zero3::shards(spec, model, chunks, stage_blocks)?;
    let placement = placement::Placed::new(
        spec.sharding.stage,
        &spec.optimizer,
        model.params.len(),
        grads,
        shards,
    );
    Ok((placement, zero3_by_unit))
}

/// The checkpoint folder: the run's, else the spec's `checkpoint.dir`,
/// else the job's under the state folder (`runs` by default). Without a
/// coordinator there is no job id: the name stands in (the same layout as
/// the coordinator's default).
pub(super) fn checkpoint_dir(spec: &JobSpec, opts: &RunOptions) -> PathBuf {
    opts.checkpoint_dir
        .clone()
        .or_else(|| spec.checkpoint.dir.clone())
        .unwrap_or_else(|| {
            // Without a coordinator there is no job id: the name stands
            // in (the same layout as the coordinator's default).
            let state_dir = opts.state_dir.clone().unwrap_or_else(|| "runs".into());
            accrue_proto::layout::default_checkpoint_dir(&state_dir, &spec.name)
        })
}

/// This job as the checkpoint folder's owner (the job's name stands in
/// for the id without a coordinator), created now.
pub(super) fn owner(spec: &JobSpec, opts: &RunOptions) -> checkpoint::owner::Owner {
    checkpoint::owner::Owner {
        job_id: opts.job_id.clone().unwrap_or_else(|| spec.name.clone()),
        cluster: opts.cluster.clone(),
        spec_hash: spec_hash(spec),
        created_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64),
    }
}

/// A fresh start's trainer state at step 0 with the schedule's first
/// learning rate `lr` (a resume or the initial broadcast replaces it).
pub(super) fn fresh_state(
    spec: &JobSpec,
    owner: &checkpoint::owner::Owner,
    lr: f64,
    place: &Place,
) -> TrainerState {
    TrainerState {
        loss_scale: (spec.precision == crate::spec::Precision::Fp16)
            .then(|| crate::cuda::amp::LossScale::new(&spec.loss_scaling)),
        job: spec.name.clone(),
        job_id: owner.job_id.clone(),
        spec_hash: owner.spec_hash.clone(),
        model_kind: spec.model.kind.as_str().to_string(),
        optimizer_kind: spec.optimizer.kind.as_str().to_string(),
        seed: spec.seed,
        lr,
        world_size: place.world as u64,
        accumulation_steps: place.k as u64,
        ..Default::default()
    }
}

/// The micro-step's CUDA graph mode before the job's own bars: the run's
/// override (the graph body only, or a forced capture), else the spec's
/// setting on this device, build and ZeRO stage.
pub(super) fn graph_mode(
    spec: &JobSpec,
    opts: &RunOptions,
    device: Device,
    zero_stage: u32,
) -> Mode {
    if opts.graph_body_only {
        Mode::BodyOnly
    } else if opts.force_graph_capture {
        Mode::Capture {
            warmup: crate::cuda::graphs::WARMUP,
        }
    } else {
        crate::cuda::graphs::mode(
            spec.performance.cuda_graphs,
            device.is_cuda(),
            cfg!(accrue_cuda),
            zero_stage,
        )
    }
}

/// What in the job rules a micro-step graph out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct GraphBars {
    /// A source read on the host is staged: each micro-batch is copied
    /// into the graph's input buffers before the replay (engine/graph.rs).
    /// Per-micro-batch means divide by the batch's own count, which a
    /// replay cannot see: staged and not `normalize = "global_count"`.
    pub per_batch_count: bool,
    /// A stage waits on its neighbours inside a micro-step and sums the
    /// norm over the stages inside the sync step.
    pub pipeline: bool,
    pub tensor: bool,
    pub recompute: bool,
}

/// `mode` with the job's bars applied: a graph (captured or its body)
/// runs eagerly for the first bar that holds, in the order of
/// [`GraphBars`]' fields, naming it.
pub(super) fn eager_override(mode: Mode, bars: GraphBars) -> Mode {
    match mode {
        Mode::Capture { .. } | Mode::BodyOnly if bars.per_batch_count => {
            Mode::Off(EagerReason::PerBatchCount)
        }
        Mode::Capture { .. } | Mode::BodyOnly if bars.pipeline => {
            Mode::Off(EagerReason::PipelineStage)
        }
        Mode::Capture { .. } | Mode::BodyOnly if bars.tensor => {
            Mode::Off(EagerReason::TensorParallel)
        }
        Mode::Capture { .. } | Mode::BodyOnly if bars.recompute => {
            Mode::Off(EagerReason::ActivationCheckpointing)
        }
        m => m,
    }
}

impl<C: Collective> Engine<C> {
    /// The checkpoint folder before any step: the sharding checked, the
    /// writer's lock taken, then a resume (`--resume` fails without a
    /// checkpoint) or the check that the folder is this job's and holds no
    /// checkpoint. The folder is claimed by the first checkpoint write
    /// (and checked at every one): a run that fails before writes nothing.
    pub(super) fn open_checkpoints(&mut self) -> Result<()> {
        self.check_sharding()?;
        if self.writes_checkpoints() {
            self.take_folder_lock()?;
        }
        if self.opts.resume || self.opts.resume_if_present {
            // Reads only after the owner check inside load_newest. Without
            // a checkpoint, a rank joining a recovery takes the state from
            // a surviving rank (or this is a fresh start); --resume fails.
            if !self.resume()? && self.opts.resume {
                return Err(Error::Checkpoint {
                    path: self.checkpoint_dir.clone(),
                    reason: "no checkpoint to resume from (no step folder and no LATEST)".into(),
                });
            }
        } else {
            self.check_owner()?;
            if let Some(n) = checkpoint::list_steps(&self.checkpoint_dir)?.last() {
                return Err(Error::Checkpoint {
                    path: self.checkpoint_dir.clone(),
                    reason: format!(
                        "already holds checkpoints (newest step-{n}); resume to continue, or choose another checkpoint.dir"
                    ),
                });
            }
        }
        if self.resumed_from.is_none() {
            self.resumed_from = Some("fresh start".into());
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "build_tests.rs"]
mod tests;
