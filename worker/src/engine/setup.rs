//! The engine's set-up checks and names: the device, the spec's hash, the
//! splits as messages name them, and the refusals made before any step.

use crate::error::{Error, Result};
use crate::source::data::Dataset;
use crate::source::sampler::ShardSpec;
use crate::spec::JobSpec;
use std::path::Path;
use tch::{Device, Tensor};

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

/// SHA-256 (hex) of the spec as JSON: recorded in the folder's ownership
/// record and in every checkpoint.
pub(super) fn spec_hash(spec: &JobSpec) -> String {
    use sha2::Digest;
    let json = serde_json::to_vec(spec).unwrap_or_default();
    sha2::Sha256::digest(&json)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A split as messages name it: `the training split (data.path =
/// "digits")`, `the held-out split (data.eval_path = "eval.safetensors")`.
pub(super) fn split_name(spec: &JobSpec, eval: bool) -> String {
    let d = &spec.data;
    let (field, path) = match (eval, &d.eval_path) {
        (true, Some(p)) => ("data.eval_path", Some(p)),
        _ => ("data.path", d.path.as_ref()),
    };
    let split = if eval { "held-out" } else { "training" };
    match path {
        Some(p) => format!("the {split} split ({field} = \"{}\")", p.display()),
        None => format!("the {split} split (data.kind = \"{}\")", d.kind.as_str()),
    }
}

/// The held-out split's samples must have the training split's shape (the
/// model is built for it; evaluation would fail after training).
pub(super) fn check_eval_shape(spec: &JobSpec, train: &Dataset, eval: &Dataset) -> Result<()> {
    let (want, got) = (train.sample_shape(), eval.sample_shape());
    if want == got {
        return Ok(());
    }
    Err(Error::Data {
        path: spec
            .data
            .eval_path
            .clone()
            .or_else(|| spec.data.path.clone())
            .unwrap_or_else(|| spec.data.kind.as_str().into()),
        reason: format!(
            "the held-out samples have shape {got:?}, the training samples {want:?}; \
             both splits need the same sample shape"
        ),
    })
}

/// Refuses a sharding that leaves a rank without a sample in the epoch:
/// the same answer on every rank (the last rank gets the fewest), naming
/// the setting that causes it.
pub(super) fn starved(shard: &ShardSpec) -> Option<Error> {
    let (len, world) = (shard.len, shard.world);
    let last = world.checked_sub(1)?;
    if len == 0 || shard.rank_len(last) > 0 {
        return None;
    }
    let (field, value, reason) = if shard.drop_last {
        (
            "data.drop_last",
            "true",
            format!(
                "{len} samples cannot give each of {world} ranks one (drop_last drops the \
                 tail); need at least {world} samples, or drop_last = false"
            ),
        )
    } else {
        (
            "data.pad",
            "false",
            format!(
                "{len} samples over {world} ranks leave rank {last} with none; need at least \
                 {world} samples, or pad = true"
            ),
        )
    };
    Some(Error::Field {
        field,
        value: value.into(),
        reason,
    })
}

/// A data error naming the spec's data path (or its kind when it has none).
pub(super) fn data_error(spec: &JobSpec, reason: String) -> Error {
    Error::Data {
        path: spec
            .data
            .path
            .clone()
            .unwrap_or_else(|| spec.data.kind.as_str().into()),
        reason,
    }
}

/// The tensors of `model.init`: a safetensors file, or a folder
/// transformers wrote (`model.safetensors`, or the shards its
/// `model.safetensors.index.json` names, each holding what the index says).
/// Any dtype: loading converts to the parameters' (fp32 master weights).
pub fn read_init(given: &Path) -> Result<Vec<(String, Tensor)>> {
    use crate::checkpoint::shards;
    let err = |path: &Path, reason: String| Error::Init {
        path: path.to_path_buf(),
        reason,
    };
    let files = shards::weight_files(given).map_err(|r| err(given, r))?;
    let mut read = Vec::with_capacity(files.len());
    for (file, expected) in files {
        let tensors = Tensor::read_safetensors(&file)
            .map_err(|e| err(&file, crate::error::torch_text("reading model.init", &e)))?;
        read.push((file, expected, tensors));
    }
    shards::join(read).map_err(|r| err(given, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(len: usize, world: usize, drop_last: bool, pad: bool) -> ShardSpec {
        ShardSpec {
            len,
            world,
            seed: 0,
            shuffle: false,
            drop_last,
            pad,
            offset: 0,
        }
    }

    #[test]
    fn a_rank_without_samples_is_refused_naming_the_setting() {
        let msg = starved(&shard(1, 2, false, false)).unwrap().to_string();
        assert_eq!(
            msg,
            "data.pad = false: 1 samples over 2 ranks leave rank 1 with none; \
             need at least 2 samples, or pad = true"
        );
        let msg = starved(&shard(1, 2, true, true)).unwrap().to_string();
        assert!(
            msg.starts_with("data.drop_last = true: 1 samples cannot give each of 2 ranks one"),
            "{msg}"
        );
        // Padding repeats samples: every rank gets one.
        assert!(starved(&shard(1, 2, false, true)).is_none());
        assert!(starved(&shard(2, 2, false, false)).is_none());
        assert!(starved(&shard(3, 2, true, false)).is_none());
        assert!(starved(&shard(5, 1, true, false)).is_none());
    }
}
