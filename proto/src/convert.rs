//! JobSpec <-> proto JobSpec. Absent sections take the TOML defaults, so a
//! spec survives the round trip unchanged (tested below).

use crate::v1;
use accrue_common::spec::*;
use std::path::PathBuf;

fn path(p: &Option<PathBuf>) -> Option<String> {
    p.as_ref().map(|p| p.display().to_string())
}

pub fn spec_to_proto(s: &JobSpec) -> v1::JobSpec {
    v1::JobSpec {
        name: s.name.clone(),
        workers: s.workers,
        min_workers: s.min_workers,
        max_workers: s.max_workers,
        seed: s.seed,
        epochs: s.epochs,
        max_steps: s.max_steps,
        device: s.device.clone(),
        threads: s.threads,
        model: Some(v1::ModelSpec {
            kind: s.model.kind.clone(),
            hidden: s.model.hidden.clone(),
            num_classes: s.model.num_classes,
            path: path(&s.model.path),
            init: path(&s.model.init),
        }),
        data: Some(v1::DataSpec {
            kind: s.data.kind.clone(),
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
        }),
        accumulation: Some(v1::AccumulationSpec {
            steps: s.accumulation.steps,
            global_batch: s.accumulation.global_batch,
            normalize: s.accumulation.normalize.clone(),
            sync: s.accumulation.sync.clone(),
        }),
        clipping: Some(v1::ClippingSpec {
            max_norm: s.clipping.max_norm,
            norm_type: s.clipping.norm_type,
            clip_value: s.clipping.clip_value,
            on_nonfinite: s.clipping.on_nonfinite.clone(),
        }),
        optimizer: Some(v1::OptimizerSpec {
            kind: s.optimizer.kind.clone(),
            lr: s.optimizer.lr,
            momentum: s.optimizer.momentum,
            dampening: s.optimizer.dampening,
            nesterov: s.optimizer.nesterov,
            weight_decay: s.optimizer.weight_decay,
            betas: s.optimizer.betas.map(|b| b.to_vec()).unwrap_or_default(),
            eps: s.optimizer.eps,
        }),
        schedule: Some(v1::ScheduleSpec {
            kind: s.schedule.kind.clone(),
            warmup_steps: s.schedule.warmup_steps,
            step_size: s.schedule.step_size,
            gamma: s.schedule.gamma,
            min_lr: s.schedule.min_lr,
        }),
        checkpoint: Some(v1::CheckpointSpec {
            dir: path(&s.checkpoint.dir),
            every_steps: s.checkpoint.every_steps,
            keep: s.checkpoint.keep,
        }),
        eval: Some(v1::EvalSpec {
            every_epochs: s.eval.every_epochs,
            batch_size: s.eval.batch_size,
        }),
        comm: Some(v1::CommSpec {
            timeout_s: s.comm.timeout_s,
            connect_timeout_s: s.comm.connect_timeout_s,
            bucket_cap_mb: s.comm.bucket_cap_mb,
            rendezvous_timeout_s: s.comm.rendezvous_timeout_s,
        }),
    }
}

/// Converts and validates; the error names every bad field.
pub fn spec_from_proto(p: &v1::JobSpec) -> Result<JobSpec, SpecErrors> {
    let mut missing = Vec::new();
    let model = p.model.clone().unwrap_or_else(|| {
        missing.push("model");
        Default::default()
    });
    let data = p.data.clone().unwrap_or_else(|| {
        missing.push("data");
        Default::default()
    });
    let opt = p.optimizer.clone().unwrap_or_else(|| {
        missing.push("optimizer");
        Default::default()
    });
    if !missing.is_empty() {
        return Err(SpecErrors(
            missing
                .into_iter()
                .map(|m| FieldError {
                    field: m.into(),
                    value: "(missing)".into(),
                    allowed: "required".into(),
                })
                .collect(),
        ));
    }
    let acc_default = AccumulationSpec::default();
    let acc = p.accumulation.clone().unwrap_or_default();
    let clip = p.clipping.clone().unwrap_or_default();
    let sched = p.schedule.clone().unwrap_or_default();
    let ck_default = CheckpointSpec::default();
    let ev_default = EvalSpec::default();
    let comm_default = CommSpec::default();
    let non_empty = |s: &str, d: &str| {
        if s.is_empty() {
            d.to_string()
        } else {
            s.to_string()
        }
    };
    let mut errors = Vec::new();
    let betas = match opt.betas.as_slice() {
        [] => None,
        [a, b] => Some([*a, *b]),
        other => {
            errors.push(FieldError {
                field: "optimizer.betas".into(),
                value: format!("{other:?}"),
                allowed: "must hold exactly two values".into(),
            });
            None
        }
    };
    let spec = JobSpec {
        name: p.name.clone(),
        workers: if p.workers == 0 { 1 } else { p.workers },
        min_workers: p.min_workers,
        max_workers: p.max_workers,
        seed: p.seed,
        epochs: p.epochs,
        max_steps: p.max_steps,
        device: non_empty(&p.device, "auto"),
        threads: p.threads,
        model: ModelSpec {
            kind: model.kind,
            hidden: model.hidden,
            num_classes: model.num_classes,
            path: model.path.map(PathBuf::from),
            init: model.init.map(PathBuf::from),
        },
        data: DataSpec {
            kind: data.kind,
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
        },
        accumulation: AccumulationSpec {
            steps: acc.steps,
            global_batch: acc.global_batch,
            normalize: non_empty(&acc.normalize, &acc_default.normalize),
            sync: non_empty(&acc.sync, &acc_default.sync),
        },
        clipping: ClippingSpec {
            max_norm: clip.max_norm,
            norm_type: clip.norm_type,
            clip_value: clip.clip_value,
            on_nonfinite: clip.on_nonfinite,
        },
        optimizer: OptimizerSpec {
            kind: opt.kind,
            lr: opt.lr,
            momentum: opt.momentum,
            dampening: opt.dampening,
            nesterov: opt.nesterov,
            weight_decay: opt.weight_decay,
            betas,
            eps: opt.eps,
        },
        schedule: ScheduleSpec {
            kind: non_empty(&sched.kind, "constant"),
            warmup_steps: sched.warmup_steps,
            step_size: sched.step_size,
            gamma: sched.gamma,
            min_lr: sched.min_lr,
        },
        checkpoint: match &p.checkpoint {
            Some(c) => CheckpointSpec {
                dir: c.dir.clone().map(PathBuf::from),
                every_steps: c.every_steps,
                keep: if c.keep == 0 { ck_default.keep } else { c.keep },
            },
            None => ck_default,
        },
        eval: match &p.eval {
            Some(e) => EvalSpec {
                every_epochs: e.every_epochs,
                batch_size: if e.batch_size == 0 {
                    ev_default.batch_size
                } else {
                    e.batch_size
                },
            },
            None => ev_default,
        },
        comm: match &p.comm {
            Some(c) => CommSpec {
                timeout_s: if c.timeout_s == 0.0 {
                    comm_default.timeout_s
                } else {
                    c.timeout_s
                },
                connect_timeout_s: if c.connect_timeout_s == 0.0 {
                    comm_default.connect_timeout_s
                } else {
                    c.connect_timeout_s
                },
                bucket_cap_mb: if c.bucket_cap_mb == 0.0 {
                    comm_default.bucket_cap_mb
                } else {
                    c.bucket_cap_mb
                },
                rendezvous_timeout_s: if c.rendezvous_timeout_s == 0.0 {
                    comm_default.rendezvous_timeout_s
                } else {
                    c.rendezvous_timeout_s
                },
            },
            None => comm_default,
        },
    };
    let fields = match spec.validate_fields() {
        Ok(()) => Vec::new(),
        Err(e) => e.0,
    };
    errors.extend(fields);
    if errors.is_empty() {
        Ok(spec)
    } else {
        Err(SpecErrors(errors))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_every_field() {
        let text = r#"
name = "rt"
workers = 2
seed = 9
epochs = 3
[model]
kind = "mlp"
hidden = [8, 4]
[data]
kind = "synthetic"
samples = 64
shape = [3, 4]
batch_size = 8
shuffle = false
pad = false
[accumulation]
steps = 4
normalize = "mean"
sync = "every_step"
[clipping]
max_norm = 0.5
norm_type = inf
[optimizer]
kind = "adamw"
lr = 0.001
betas = [0.8, 0.9]
[schedule]
kind = "cosine"
warmup_steps = 5
[checkpoint]
every_steps = 7
keep = 2
[comm]
timeout_s = 5
"#;
        let spec = JobSpec::from_toml_str(text, std::path::Path::new("rt.toml")).unwrap();
        let back = spec_from_proto(&spec_to_proto(&spec)).unwrap();
        assert_eq!(back, spec);
    }

    #[test]
    fn bad_proto_spec_names_fields() {
        let mut p = spec_to_proto(
            &JobSpec::from_toml_str(
                "name = \"x\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n",
                std::path::Path::new("x"),
            )
            .unwrap(),
        );
        p.optimizer.as_mut().unwrap().lr = -1.0;
        p.optimizer.as_mut().unwrap().betas = vec![0.9];
        let err = spec_from_proto(&p).unwrap_err().to_string();
        assert!(
            err.contains("optimizer.lr = -1.0") && err.contains("optimizer.betas"),
            "{err}"
        );
    }
}
