//! The safetensors format, written directly (each tensor copied once into
//! the output buffer) and read back into tensors.

use crate::error::{Error, Result, TorchContext};
use std::path::Path;
use tch::Tensor;

/// The safetensors name of a tensor kind (the format's `dtype`).
fn dtype_name(kind: tch::Kind) -> Option<&'static str> {
    use tch::Kind::*;
    Some(match kind {
        Bool => "BOOL",
        Uint8 => "U8",
        Int8 => "I8",
        Int16 => "I16",
        Int => "I32",
        Int64 => "I64",
        BFloat16 => "BF16",
        Half => "F16",
        Float => "F32",
        Double => "F64",
        _ => return None,
    })
}

/// `tensors` in the safetensors format: an 8-byte little-endian header
/// length, the JSON header (dtype, shape and data offsets by name, padded
/// with spaces to a multiple of 8), then every tensor's bytes in order.
/// Each tensor is copied once, from its device straight into the output
/// buffer (a zeroed allocation the kernel hands out lazily).
pub fn safetensors_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let mut header = serde_json::Map::new();
    let mut spans = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for (name, t) in tensors {
        let kind = t
            .f_kind()
            .ctx("reading a tensor's kind for the checkpoint")?;
        let dtype = dtype_name(kind).ok_or_else(|| Error::Encode {
            what: format!("checkpoint tensor {name}"),
            reason: format!("{kind:?} cannot be checkpointed"),
        })?;
        let numel = t.numel();
        let len = numel * kind.elt_size_in_bytes();
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": dtype,
                "shape": t.size(),
                "data_offsets": [offset, offset + len],
            }),
        );
        spans.push((offset, len, numel));
        offset += len;
    }
    let mut json = serde_json::to_vec(&header).map_err(|e| Error::Encode {
        what: "the checkpoint header".into(),
        reason: e.to_string(),
    })?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let start = 8 + json.len();
    let mut out = vec![0u8; start + offset];
    out[..8].copy_from_slice(&(json.len() as u64).to_le_bytes());
    out[8..start].copy_from_slice(&json);
    for ((_, t), (at, len, numel)) in tensors.iter().zip(spans) {
        // at_copy_data brings a device or strided tensor to a contiguous
        // host copy first.
        t.f_copy_data_u8(&mut out[start + at..start + at + len], numel)
            .ctx("copying a tensor for the checkpoint")?;
    }
    Ok(out)
}

/// The model files of a step folder, by name: one `model.safetensors` up
/// to `max_shard` bytes of tensors, above it shards and their index
/// ([`super::shards::plan`]), as transformers' `save_pretrained` writes
/// them, so `from_pretrained` and accrue's readers take either.
pub fn model_files(tensors: &[(String, Tensor)], max_shard: u64) -> Result<Vec<(String, Vec<u8>)>> {
    use super::shards;
    let sizes = tensor_bytes(tensors)?;
    let plan = shards::plan(&sizes, max_shard);
    if plan.len() == 1 {
        return Ok(vec![(
            super::MODEL_FILE.into(),
            safetensors_bytes(tensors)?,
        )]);
    }
    let (mut files, weight_map) =
        shard_files(tensors, &plan, |i| shards::shard_name(i, plan.len()))?;
    files.push((
        shards::INDEX_FILE.into(),
        shards::index_json(sizes.iter().sum(), &weight_map),
    ));
    Ok(files)
}

/// Each tensor's bytes (what a shard plan weighs).
pub fn tensor_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u64>> {
    tensors
        .iter()
        .map(|(_, t)| {
            let kind = t
                .f_kind()
                .ctx("reading a tensor's kind for the checkpoint")?;
            Ok((t.numel() * kind.elt_size_in_bytes()) as u64)
        })
        .collect()
}

/// The shard files of `tensors` grouped by `plan` (indices), shard `i`
/// named `name(i)`, and the weight map (tensor name -> its shard file).
pub fn shard_files(
    tensors: &[(String, Tensor)],
    plan: &[Vec<usize>],
    name: impl Fn(usize) -> String,
) -> Result<ShardFiles> {
    let mut files = Vec::with_capacity(plan.len() + 1);
    let mut weight_map = Vec::with_capacity(tensors.len());
    for (i, members) in plan.iter().enumerate() {
        let name = name(i);
        // Shallow copies: the same storage, no tensor bytes copied.
        let part: Vec<(String, Tensor)> = members
            .iter()
            .map(|&j| (tensors[j].0.clone(), tensors[j].1.shallow_clone()))
            .collect();
        weight_map.extend(part.iter().map(|(n, _)| (n.clone(), name.clone())));
        files.push((name, safetensors_bytes(&part)?));
    }
    Ok((files, weight_map))
}

/// Files by name and contents, and the weight map naming each tensor's
/// file.
pub type ShardFiles = (Vec<(String, Vec<u8>)>, Vec<(String, String)>);

/// Tensors from safetensors bytes (`path` names them in errors).
pub(super) fn tensors_from(
    bytes: &[u8],
    path: &Path,
) -> std::result::Result<Vec<(String, Tensor)>, String> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| {
        format!(
            "{}: {}",
            path.display(),
            crate::error::safetensors_words(&e)
        )
    })?;
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            Tensor::try_from(v)
                .map(|t| (n, t))
                .map_err(|e| format!("{}: {e}", path.display()))
        })
        .collect()
}
