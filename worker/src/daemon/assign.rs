//! What a daemon makes of an assignment: the spec with this worker's
//! overrides and k fixed to the coordinator's, and the checkpoint folder,
//! both confined under this worker's roots.

use super::DaemonConfig;
use accrue_proto::v1;
use std::path::PathBuf;

/// The job spec of an assignment with this daemon's overrides applied, and
/// k fixed to the assignment's: the coordinator decides k (from the spec and
/// the world size of this generation), so the worker never recomputes it.
pub(super) fn assigned_spec(
    a: &v1::Assignment,
    cfg: &DaemonConfig,
) -> Result<crate::spec::JobSpec, String> {
    let proto = a.spec.clone().ok_or("the assignment has no spec")?;
    let mut spec = accrue_proto::spec_from_proto(&proto).map_err(|e| e.to_string())?;
    if a.accumulation_steps == 0 {
        return Err(format!(
            "assignment of job {} generation {} has accumulation_steps = 0 (k must be >= 1)",
            a.job_id, a.generation
        ));
    }
    check_coords(a, &spec)?;
    spec.accumulation.steps = Some(u64::from(a.accumulation_steps));
    spec.accumulation.global_batch = None;
    if let Some(d) = &cfg.device {
        spec.device = d.clone();
    }
    if spec.threads.is_none() {
        spec.threads = cfg.threads;
    }
    // Checked again here, before anything is opened: the coordinator may
    // not see what this host sees (a symlink, another mount).
    let roots = cfg.roots();
    let mut spec = spec
        .confined(&roots, &crate::spec::LocalFs)
        .map_err(|e| format!("refused by worker {}: {e}", cfg.worker_id))?;
    if let (Some(root), None) = (&cfg.data_root, &cfg.model_root) {
        for (_, p) in spec.model.paths_mut() {
            let Some(p) = p.as_mut() else { continue };
            if p.is_relative() {
                *p = root.join(&*p);
            }
        }
    }
    // The estimate reads `model.config`: only once the paths are confined
    // (a file outside --model-root is never opened).
    spec.check_memory(cfg.max_job_memory)
        .map_err(|e| format!("{e} (this worker's limit)"))?;
    Ok(spec)
}

/// The assignment's mesh coordinates (issue 38) must be where the spec's
/// `[parallel]` puts this rank in a world of this size: a coordinator and
/// a worker that disagree on the layout would exchange the wrong tensors.
/// An assignment without them (an older coordinator) is data parallel.
pub(super) fn check_coords(a: &v1::Assignment, spec: &crate::spec::JobSpec) -> Result<(), String> {
    let Some(c) = &a.coords else {
        return Ok(());
    };
    let dims = spec.parallel_dims_for(a.world_size).map_err(|e| {
        format!(
            "assignment of job {} generation {}: {e}",
            a.job_id, a.generation
        )
    })?;
    let ours = dims.coords(a.rank);
    let theirs = (
        (c.data, c.pipeline, c.tensor),
        (c.data_degree, c.pipeline_degree, c.tensor_degree),
    );
    let expected = (
        (ours.data, ours.pipeline, ours.tensor),
        (dims.data, dims.pipeline, dims.tensor),
    );
    if theirs != expected {
        return Err(format!(
            "assignment of job {} generation {}: rank {} of {} is at (data, pipeline, tensor) = {:?} of a {:?} mesh by the spec's [parallel], the coordinator says {:?} of {:?}",
            a.job_id, a.generation, a.rank, a.world_size, expected.0, expected.1, theirs.0, theirs.1
        ));
    }
    Ok(())
}

/// Where this generation checkpoints: the assignment's folder (the spec's
/// `checkpoint.dir` or the coordinator's default), confined under
/// `--checkpoint-root` when one is set.
pub(super) fn assigned_checkpoint_dir(
    a: &v1::Assignment,
    cfg: &DaemonConfig,
) -> Result<Option<PathBuf>, String> {
    if a.checkpoint_dir.is_empty() {
        return Ok(None);
    }
    let dir = PathBuf::from(&a.checkpoint_dir);
    match crate::spec::confine_field(
        &cfg.roots(),
        crate::spec::Area::Checkpoint,
        "checkpoint.dir",
        &dir,
        &crate::spec::LocalFs,
    ) {
        Ok(confined) => Ok(Some(confined.unwrap_or(dir))),
        Err(e) => Err(format!(
            "refused by worker {}: invalid job spec:\n  {e}",
            cfg.worker_id
        )),
    }
}
