//! JobSpec <-> proto JobSpec. Absent sections take the TOML defaults, so a
//! spec survives the round trip unchanged (tested below).

mod family;

use crate::v1;
use accrue_common::spec::*;
use std::path::PathBuf;

fn path(p: &Option<PathBuf>) -> Option<String> {
    p.as_ref().map(|p| p.display().to_string())
}

/// One spec kind: the domain enum and its proto enum, both ways. `None`
/// from `from_proto` is the proto's UNSPECIFIED.
trait KindMap: SpecEnum {
    type Proto: TryFrom<i32> + Into<i32>;
    fn to_proto(self) -> Self::Proto;
    fn from_proto(p: Self::Proto) -> Option<Self>;
    /// The proto value's name, e.g. MODEL_KIND_MLP.
    #[cfg(test)]
    fn proto_name(p: Self::Proto) -> &'static str;
}

macro_rules! kind_map {
    ($domain:ident, $proto:ident, { $($d:ident <=> $p:ident),+ $(,)? }) => {
        impl KindMap for $domain {
            type Proto = v1::$proto;
            fn to_proto(self) -> v1::$proto {
                match self {
                    $($domain::$d => v1::$proto::$p),+
                }
            }
            #[cfg(test)]
            fn proto_name(p: v1::$proto) -> &'static str {
                p.as_str_name()
            }
            fn from_proto(p: v1::$proto) -> Option<Self> {
                match p {
                    v1::$proto::Unspecified => None,
                    $(v1::$proto::$p => Some($domain::$d)),+
                }
            }
        }
    };
}

kind_map!(ModelKind, ModelKind, {
    Mlp <=> Mlp,
    Lenet5 <=> Lenet5,
    Resnet18 <=> Resnet18,
    Resnet34 <=> Resnet34,
    Torchscript <=> Torchscript,
    Llama <=> Llama,
    Qwen2 <=> Qwen2,
    Mistral <=> Mistral,
    Qwen3 <=> Qwen3,
});
kind_map!(DataKind, DataKind, {
    Mnist <=> Mnist,
    Cifar10 <=> Cifar10,
    Tensors <=> Tensors,
    Synthetic <=> Synthetic,
    Sequences <=> Sequences,
    Tokens <=> Tokens,
});
kind_map!(TokenDtype, TokenDtype, {
    U16 <=> U16,
    U32 <=> U32,
});
kind_map!(Normalize, Normalize, {
    GlobalCount <=> GlobalCount,
    Mean <=> Mean,
    Sum <=> Sum,
});
kind_map!(SyncMode, SyncMode, {
    Boundary <=> Boundary,
    EveryStep <=> EveryStep,
});
kind_map!(OnNonfinite, OnNonfinite, {
    Skip <=> Skip,
    Error <=> Error,
});
kind_map!(Precision, Precision, {
    Fp32 <=> Fp32,
    Bf16 <=> Bf16,
    Fp16 <=> Fp16,
});
kind_map!(CommBackend, CommBackend, {
    Auto <=> Auto,
    Ring <=> Ring,
    C10d <=> C10d,
});
kind_map!(PipelineSchedule, PipelineSchedule, {
    OneFOneB <=> OneFOneB,
    GPipe <=> Gpipe,
    Interleaved1F1B <=> Interleaved1f1b,
});
kind_map!(ActivationCheckpointing, ActivationCheckpointing, {
    None <=> None,
    Full <=> Full,
});
kind_map!(StageBalance, StageBalance, {
    Parameters <=> Parameters,
    Compute <=> Compute,
});
kind_map!(OptimizerKind, OptimizerKind, {
    Sgd <=> Sgd,
    Adam <=> Adam,
    Adamw <=> Adamw,
});
kind_map!(ScheduleKind, ScheduleKind, {
    Constant <=> Constant,
    Cosine <=> Cosine,
    Step <=> Step,
    LinearWarmup <=> LinearWarmup,
});

fn to_proto<K: KindMap>(k: K) -> i32 {
    k.to_proto().into()
}

/// What UNSPECIFIED means for a kind.
enum Unspecified<K> {
    /// The TOML default.
    Default(K),
    /// The kind is required (TOML has no default): a field error.
    Required,
}

/// The domain kind of a proto enum value; an unknown value, or UNSPECIFIED
/// where the kind is required, is a field error naming the allowed names,
/// and `placeholder` stands in so the rest of the spec is still checked.
fn from_proto<K: KindMap>(
    raw: i32,
    unspecified: Unspecified<K>,
    placeholder: K,
    errors: &mut Vec<FieldError>,
) -> K {
    let refuse = |value: String, errors: &mut Vec<FieldError>| {
        errors.push(FieldError {
            field: K::FIELD.into(),
            value,
            allowed: K::allowed(),
        });
        placeholder
    };
    match K::Proto::try_from(raw) {
        Err(_) => refuse(raw.to_string(), errors),
        Ok(p) => match (K::from_proto(p), unspecified) {
            (Some(k), _) => k,
            (None, Unspecified::Default(k)) => k,
            (None, Unspecified::Required) => refuse("(unspecified)".into(), errors),
        },
    }
}

/// `[model]`: the generic fields, then each family's own message.
fn model_to_proto(m: &ModelSpec) -> v1::ModelSpec {
    let mut p = v1::ModelSpec {
        kind: to_proto(m.kind),
        hidden: m.hidden.clone(),
        num_classes: m.num_classes,
        path: path(&m.path),
        init: path(&m.init),
        ..Default::default()
    };
    family::fields_to_proto(&m.fields, &mut p);
    p
}

pub fn spec_to_proto(s: &JobSpec) -> v1::JobSpec {
    v1::JobSpec {
        name: s.name.clone(),
        workers: Some(s.workers),
        min_workers: s.min_workers,
        max_workers: s.max_workers,
        seed: s.seed,
        epochs: s.epochs,
        max_steps: s.max_steps,
        device: s.device.clone(),
        threads: s.threads,
        max_skipped_fraction: s.max_skipped_fraction,
        parallel: Some(v1::ParallelSpec {
            data: s.parallel.data,
            pipeline: s.parallel.pipeline,
            tensor: s.parallel.tensor,
            schedule: s.parallel.schedule.map_or(0, to_proto),
            stages_per_rank: s.parallel.stages_per_rank,
            layers_per_stage: s.parallel.layers_per_stage.clone().unwrap_or_default(),
            balance: s.parallel.balance.map_or(0, to_proto),
        }),
        model: Some(model_to_proto(&s.model)),
        data: Some(v1::DataSpec {
            kind: to_proto(s.data.kind),
            path: path(&s.data.path),
            eval_path: path(&s.data.eval_path),
            batch_size: s.data.batch_size,
            shuffle: Some(s.data.shuffle),
            drop_last: s.data.drop_last,
            pad: Some(s.data.pad),
            samples: s.data.samples,
            eval_samples: s.data.eval_samples,
            shape: s.data.shape.clone().unwrap_or_default(),
            classes: s.data.classes,
            seq_len: s.data.seq_len,
            pad_id: s.data.pad_id,
            dtype: s.data.dtype.map_or(0, to_proto),
            pack: s.data.pack,
        }),
        accumulation: Some(v1::AccumulationSpec {
            steps: s.accumulation.steps,
            global_batch: s.accumulation.global_batch,
            normalize: to_proto(s.accumulation.normalize),
            sync: to_proto(s.accumulation.sync),
        }),
        clipping: Some(v1::ClippingSpec {
            max_norm: s.clipping.max_norm,
            norm_type: s.clipping.norm_type,
            clip_value: s.clipping.clip_value,
            on_nonfinite: to_proto(s.clipping.on_nonfinite),
        }),
        optimizer: Some(v1::OptimizerSpec {
            kind: to_proto(s.optimizer.kind),
            lr: s.optimizer.lr,
            momentum: s.optimizer.momentum,
            dampening: s.optimizer.dampening,
            nesterov: s.optimizer.nesterov,
            weight_decay: s.optimizer.weight_decay,
            betas: s.optimizer.betas.map(|b| b.to_vec()).unwrap_or_default(),
            eps: s.optimizer.eps,
            fused: s.optimizer.fused,
        }),
        schedule: Some(v1::ScheduleSpec {
            kind: to_proto(s.schedule.kind),
            warmup_steps: s.schedule.warmup_steps,
            step_size: s.schedule.step_size,
            gamma: s.schedule.gamma,
            min_lr: s.schedule.min_lr,
        }),
        checkpoint: Some(v1::CheckpointSpec {
            dir: path(&s.checkpoint.dir),
            every_steps: s.checkpoint.every_steps,
            keep: Some(s.checkpoint.keep),
            max_shard_size: Some(s.checkpoint.max_shard_size.clone()),
        }),
        eval: Some(v1::EvalSpec {
            every_epochs: s.eval.every_epochs,
            batch_size: Some(s.eval.batch_size),
            every_steps: s.eval.every_steps,
        }),
        comm: Some(v1::CommSpec {
            timeout_s: Some(s.comm.timeout_s),
            connect_timeout_s: Some(s.comm.connect_timeout_s),
            bucket_cap_mb: Some(s.comm.bucket_cap_mb),
            rendezvous_timeout_s: Some(s.comm.rendezvous_timeout_s),
            backend: to_proto(s.comm.backend),
        }),
        sharding: Some(v1::ShardingSpec {
            stage: s.sharding.stage,
            reshard_after_forward: s.sharding.reshard_after_forward,
            prefetch: s.sharding.prefetch,
        }),
        precision: to_proto(s.precision),
        loss_scaling: Some(v1::LossScalingSpec {
            init_scale: Some(s.loss_scaling.init_scale),
            growth_factor: Some(s.loss_scaling.growth_factor),
            backoff_factor: Some(s.loss_scaling.backoff_factor),
            growth_interval: Some(s.loss_scaling.growth_interval),
        }),
        performance: Some(v1::PerformanceSpec {
            cuda_graphs: s.performance.cuda_graphs,
            cudnn_deterministic: s.performance.cudnn_deterministic,
            activation_checkpointing: s.performance.activation_checkpointing.map_or(0, to_proto),
            checkpoint_every: s.performance.checkpoint_every,
        }),
    }
}

/// A kind whose UNSPECIFIED is the TOML default.
fn or_default<K: KindMap + Default>(raw: i32, e: &mut Vec<FieldError>) -> K {
    from_proto(raw, Unspecified::Default(K::default()), K::default(), e)
}

/// A kind that may be absent: UNSPECIFIED is None; an unknown value is a
/// field error (the first kind stands in).
fn optional<K: KindMap>(raw: i32, e: &mut Vec<FieldError>) -> Option<K> {
    (raw != 0).then(|| from_proto(raw, Unspecified::Required, K::ALL[0], e))
}

/// `[parallel]` from the wire: UNSPECIFIED and an empty list are absent.
fn parallel_from_proto(q: &v1::ParallelSpec, e: &mut Vec<FieldError>) -> ParallelSpec {
    ParallelSpec {
        data: q.data,
        pipeline: q.pipeline,
        tensor: q.tensor,
        schedule: optional(q.schedule, e),
        stages_per_rank: q.stages_per_rank,
        layers_per_stage: (!q.layers_per_stage.is_empty()).then(|| q.layers_per_stage.clone()),
        balance: optional(q.balance, e),
    }
}

/// Converts and validates; the error names every bad field. An absent
/// section, like an absent field, takes the TOML defaults; present fields
/// are kept as given (a 0 is refused by validation, never reinterpreted).
pub fn spec_from_proto(p: &v1::JobSpec) -> Result<JobSpec, SpecErrors> {
    let required = [
        ("model", p.model.is_none()),
        ("data", p.data.is_none()),
        ("optimizer", p.optimizer.is_none()),
    ];
    let missing: Vec<FieldError> = required
        .iter()
        .filter(|(_, absent)| *absent)
        .map(|(m, _)| FieldError {
            field: (*m).into(),
            value: "(missing)".into(),
            allowed: "required".into(),
        })
        .collect();
    if !missing.is_empty() {
        return Err(SpecErrors(missing));
    }
    let (model, data, opt) = (
        p.model.clone().unwrap_or_default(),
        p.data.clone().unwrap_or_default(),
        p.optimizer.clone().unwrap_or_default(),
    );
    let acc = p.accumulation.unwrap_or_default();
    let clip = p.clipping.unwrap_or_default();
    let sched = p.schedule.unwrap_or_default();
    let ck = p.checkpoint.clone().unwrap_or_default();
    let ev = p.eval.unwrap_or_default();
    let comm = p.comm.unwrap_or_default();
    let shard = p.sharding.unwrap_or_default();
    let ls = p.loss_scaling.unwrap_or_default();
    let perf = p.performance.unwrap_or_default();
    let (ck_d, ev_d, comm_d, ls_d) = (
        CheckpointSpec::default(),
        EvalSpec::default(),
        CommSpec::default(),
        LossScalingSpec::default(),
    );
    // Kind errors first (as from TOML); other errors come from validation.
    let mut kind_errors = Vec::new();
    let e = &mut kind_errors;
    let model_kind = from_proto(model.kind, Unspecified::Required, ModelKind::Mlp, e);
    let data_kind = from_proto(data.kind, Unspecified::Required, DataKind::Synthetic, e);
    let normalize = or_default(acc.normalize, e);
    let sync = or_default(acc.sync, e);
    let on_nonfinite = or_default(clip.on_nonfinite, e);
    let dtype = optional(data.dtype, e);
    let optimizer_kind = from_proto(opt.kind, Unspecified::Required, OptimizerKind::Sgd, e);
    let schedule_kind = or_default(sched.kind, e);
    let comm_backend = or_default(comm.backend, e);
    let activation_checkpointing = optional(perf.activation_checkpointing, e);
    let precision = or_default(p.precision, e);
    let mut errors = Vec::new();
    let betas = match opt.betas.as_slice() {
        [] => None,
        [a, b] => Some([*a, *b]),
        other => {
            errors.push(FieldError {
                field: "optimizer.betas".into(),
                value: shown(&format!("{other:?}")),
                allowed: "must hold exactly two values".into(),
            });
            None
        }
    };
    let spec = JobSpec {
        name: p.name.clone(),
        workers: p.workers.unwrap_or(1),
        min_workers: p.min_workers,
        max_workers: p.max_workers,
        seed: p.seed,
        epochs: p.epochs,
        max_steps: p.max_steps,
        device: if p.device.is_empty() {
            "auto".into()
        } else {
            p.device.clone()
        },
        threads: p.threads,
        max_skipped_fraction: p.max_skipped_fraction,
        parallel: p
            .parallel
            .as_ref()
            .map(|q| parallel_from_proto(q, e))
            .unwrap_or_default(),
        model: ModelSpec {
            kind: model_kind,
            fields: family::fields_from_proto(&model),
            hidden: model.hidden,
            num_classes: model.num_classes,
            path: model.path.map(PathBuf::from),
            init: model.init.map(PathBuf::from),
        },
        data: DataSpec {
            kind: data_kind,
            path: data.path.map(PathBuf::from),
            eval_path: data.eval_path.map(PathBuf::from),
            batch_size: data.batch_size,
            shuffle: data.shuffle.unwrap_or(true),
            drop_last: data.drop_last,
            pad: data.pad.unwrap_or(true),
            samples: data.samples,
            eval_samples: data.eval_samples,
            shape: (!data.shape.is_empty()).then_some(data.shape),
            classes: data.classes,
            seq_len: data.seq_len,
            pad_id: data.pad_id,
            dtype,
            pack: data.pack,
        },
        accumulation: AccumulationSpec {
            steps: acc.steps,
            global_batch: acc.global_batch,
            normalize,
            sync,
        },
        clipping: ClippingSpec {
            max_norm: clip.max_norm,
            norm_type: clip.norm_type,
            clip_value: clip.clip_value,
            on_nonfinite,
        },
        optimizer: OptimizerSpec {
            kind: optimizer_kind,
            lr: opt.lr,
            momentum: opt.momentum,
            dampening: opt.dampening,
            nesterov: opt.nesterov,
            weight_decay: opt.weight_decay,
            betas,
            eps: opt.eps,
            fused: opt.fused,
        },
        schedule: ScheduleSpec {
            kind: schedule_kind,
            warmup_steps: sched.warmup_steps,
            step_size: sched.step_size,
            gamma: sched.gamma,
            min_lr: sched.min_lr,
        },
        checkpoint: CheckpointSpec {
            dir: ck.dir.map(PathBuf::from),
            every_steps: ck.every_steps,
            keep: ck.keep.unwrap_or(ck_d.keep),
            max_shard_size: ck.max_shard_size.unwrap_or(ck_d.max_shard_size),
        },
        eval: EvalSpec {
            every_epochs: ev.every_epochs,
            batch_size: ev.batch_size.unwrap_or(ev_d.batch_size),
            every_steps: ev.every_steps,
        },
        comm: CommSpec {
            timeout_s: comm.timeout_s.unwrap_or(comm_d.timeout_s),
            connect_timeout_s: comm.connect_timeout_s.unwrap_or(comm_d.connect_timeout_s),
            bucket_cap_mb: comm.bucket_cap_mb.unwrap_or(comm_d.bucket_cap_mb),
            rendezvous_timeout_s: comm
                .rendezvous_timeout_s
                .unwrap_or(comm_d.rendezvous_timeout_s),
            backend: comm_backend,
        },
        sharding: ShardingSpec {
            stage: shard.stage,
            reshard_after_forward: shard.reshard_after_forward,
            prefetch: shard.prefetch,
        },
        precision,
        loss_scaling: LossScalingSpec {
            init_scale: ls.init_scale.unwrap_or(ls_d.init_scale),
            growth_factor: ls.growth_factor.unwrap_or(ls_d.growth_factor),
            backoff_factor: ls.backoff_factor.unwrap_or(ls_d.backoff_factor),
            growth_interval: ls.growth_interval.unwrap_or(ls_d.growth_interval),
        },
        performance: PerformanceSpec {
            cuda_graphs: perf.cuda_graphs,
            cudnn_deterministic: perf.cudnn_deterministic,
            activation_checkpointing,
            checkpoint_every: perf.checkpoint_every,
        },
    };
    let checked = merge_kind_errors(kind_errors, spec.validate_fields());
    if let Err(SpecErrors(e)) = checked {
        errors.extend(e);
    }
    if errors.is_empty() {
        Ok(spec)
    } else {
        Err(SpecErrors(errors))
    }
}

#[cfg(test)]
mod drift_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod wire_example_tests;
