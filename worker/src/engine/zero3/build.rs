//! ZeRO-3's set-up: the refusals, the units (the family's blocks, or a
//! pipeline stage's), the sharded build and this rank's chunks of weights
//! on disk (`model.init`, a checkpoint) read through memory maps.

use crate::engine::placement::{ParamShards, ShardTaker};
use crate::error::{Error, Result};
use crate::family::model::{Model, WeightsFrom};
use crate::spec::JobSpec;
use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;
use tch::{Device, Tensor};

/// Refuses what stage 3 does not run yet, naming it (nothing below
/// stage 3).
pub(in crate::engine) fn check(spec: &JobSpec, device: Device) -> Result<()> {
    if spec.sharding.stage != 3 {
        return Ok(());
    }
    let refuse = |what: String| Err(Error::Sharding(format!("sharding.stage = 3 {what}")));
    if device != Device::Cpu {
        return refuse(format!(
            "runs on the CPU so far; device {device:?} takes stages 0 to 2"
        ));
    }
    let family = crate::family::family(spec.model.kind);
    if !family.builds_by_stage() {
        return refuse(format!(
            "shards a model by its blocks: model.kind = {} has none (the mlp and the Llama family have)",
            spec.model.kind
        ));
    }
    Ok(())
}

/// Whether stage 3 gradients are kept by unit (`sync = "every_step"`).
pub(in crate::engine) fn by_unit(spec: &JobSpec) -> bool {
    spec.sharding.stage == 3 && spec.accumulation.sync == crate::spec::SyncMode::EveryStep
}

/// Stage 3's units over parameters `names` (the model's order): the
/// family's blocks, as ranges of parameter indices.
pub(in crate::engine) fn units(spec: &JobSpec, names: &[String]) -> Result<Vec<Range<usize>>> {
    let blocks = crate::family::family(spec.model.kind).blocks(&spec.model, names)?;
    units_over(&blocks, names)
}

/// A pipeline stage's units: the family's blocks `stage` (of the whole
/// model's parameters `all`) over the stage's parameters `here`.
pub(in crate::engine) fn stage_units(
    spec: &JobSpec,
    all: &[String],
    stage: Range<usize>,
    here: &[String],
) -> Result<Vec<Range<usize>>> {
    let blocks = crate::family::family(spec.model.kind).blocks(&spec.model, all)?;
    let mine = blocks.get(stage.clone()).ok_or_else(|| {
        Error::Sharding(format!(
            "the stage's blocks {stage:?} are beyond the model's {}",
            blocks.len()
        ))
    })?;
    units_over(mine, here)
}

/// `blocks` as ranges of indices into `names`, which they must cover in
/// order.
fn units_over(blocks: &[crate::family::Block], names: &[String]) -> Result<Vec<Range<usize>>> {
    let mut units = Vec::with_capacity(blocks.len());
    let mut at = 0;
    for b in blocks {
        let start = at;
        for name in &b.params {
            if names.get(at) != Some(name) {
                return Err(Error::Sharding(format!(
                    "sharding.stage = 3 needs each block's parameters in the model's order; block {} holds {name}, the model has {:?} at {at}",
                    b.name,
                    names.get(at)
                )));
            }
            at += 1;
        }
        units.push(start..at);
    }
    if at != names.len() {
        return Err(Error::Sharding(format!(
            "sharding.stage = 3: the blocks cover {at} of the {} parameters ({:?} left)",
            names.len(),
            &names[at..]
        )));
    }
    Ok(units)
}

/// Stage 3's build: a first build that keeps nothing gives every
/// parameter's name and shape, then the real one hands each parameter's
/// values to a [`ShardTaker`] as it is made and releases them (the same
/// draws from the seed: the values are one process's). With `model.init`
/// the chunks are taken from the file instead, through a memory map, so
/// only this rank's parts of each tensor are read
/// ([`crate::checkpoint::mapped`]). Returns the model and this rank's
/// chunks at `layout`.
pub(in crate::engine) fn build(
    spec: &JobSpec,
    shape: &[i64],
    classes: i64,
    device: Device,
    layout: (usize, usize),
) -> Result<(Model, Tensor)> {
    let all = Model::build_stage(
        &spec.model,
        shape,
        classes,
        device,
        spec.seed,
        Box::new(|_| false),
    )?
    .frozen;
    let names: Vec<String> = all.iter().map(|(n, _)| n.clone()).collect();
    let numels: Vec<usize> = all
        .iter()
        .map(|(_, s)| s.iter().product::<i64>().max(0) as usize)
        .collect();
    let units = units(spec, &names)?;
    let taker = Rc::new(RefCell::new(ShardTaker::new(
        &names, &numels, &units, layout,
    )));
    let took = taker.clone();
    let model = Model::build_sharded(
        &spec.model,
        shape,
        classes,
        device,
        spec.seed,
        Box::new(move |n, t| took.borrow_mut().take(n, t)),
    )?;
    let built: Vec<&String> = model.params.iter().map(|(n, _)| n).collect();
    if built != names.iter().collect::<Vec<_>>() {
        return Err(Error::Sharding(format!(
            "the sharded build made the parameters {built:?}, its first build {names:?}"
        )));
    }
    let taker = Rc::try_unwrap(taker)
        .map_err(|_| Error::Sharding("the build kept its parameter taker".into()))?
        .into_inner();
    let Some(given) = &spec.model.init else {
        return Ok((model, taker.finish()?));
    };
    drop(taker);
    let mut model = model;
    let owned = chunks_of(&mut model, WeightsFrom::Init(given), &units, layout)?;
    Ok((model, owned))
}

/// This rank's chunks at `layout` (over `units`) of the weights `from`
/// names (`model.init`, or a checkpoint's step folder), checked as
/// [`Model::load_named`] checks them and read through a memory map, only
/// this rank's parts of each tensor; the buffers and a tied head's copy
/// are loaded whole.
pub(super) fn chunks_of(
    model: &mut Model,
    from: WeightsFrom<'_>,
    units: &[Range<usize>],
    layout: (usize, usize),
) -> Result<Tensor> {
    let names: Vec<String> = model.params.iter().map(|(n, _)| n.clone()).collect();
    let numels: Vec<usize> = model.params.iter().map(|(_, t)| t.numel()).collect();
    let given = match from {
        WeightsFrom::Init(p) | WeightsFrom::Checkpoint(p) => p,
    };
    crate::checkpoint::mapped::with_mapped(given, |tensors, forget| {
        let mut by_name = model.fit_named(from, tensors)?;
        let mut taker = ShardTaker::new(&names, &numels, units, layout);
        for name in &names {
            let t = by_name
                .get(name)
                .ok_or_else(|| Error::Sharding(format!("model.init lost {name}")))?;
            taker.take(name, t)?;
            // Only this rank's chunks stay: the file's pages go.
            forget();
        }
        model.copy_named(from, &mut by_name, false)?;
        taker.finish()
    })
    .map_err(|reason| from.error(reason))?
}

/// Stage 3's parameters over `model` (None below stage 3): from the
/// sharded build's chunks (`built`), or, the model built whole (with
/// `model.init`), copied into the units.
/// A pipeline stage's parameters are its blocks' (`stage`: the whole
/// model's parameter names and the stage's blocks).
pub(in crate::engine) fn shards(
    spec: &JobSpec,
    model: &Model,
    built: Option<(Tensor, (usize, usize))>,
    stage: Option<(&[String], Range<usize>)>,
) -> Result<Option<ParamShards>> {
    if spec.sharding.stage != 3 {
        return Ok(None);
    }
    let names: Vec<String> = model.params.iter().map(|(n, _)| n.clone()).collect();
    let units = match stage {
        Some((all, blocks)) => stage_units(spec, all, blocks, &names)?,
        None => units(spec, &names)?,
    };
    match built {
        Some((owned, layout)) => {
            ParamShards::from_built(&model.params, &units, by_unit(spec), owned, layout).map(Some)
        }
        None => ParamShards::new(&model.params, &units, by_unit(spec)).map(Some),
    }
}
