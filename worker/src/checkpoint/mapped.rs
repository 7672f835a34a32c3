//! Weight files read through read-only memory maps: each tensor a view of
//! its file's pages, so a reader that copies part of a tensor touches only
//! that part's pages (ZeRO-3 takes each rank's chunks of `model.init`
//! without ever holding the whole model: engine/zero3.rs).

use super::shards;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors};
use std::path::Path;
use tch::{Kind, Tensor};

/// The libtorch kind of a safetensors dtype (None: one libtorch lacks).
fn kind_of(d: Dtype) -> Option<Kind> {
    Some(match d {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        _ => return None,
    })
}

/// Runs `f` over the tensors of `given` (a safetensors file, or a folder
/// transformers wrote: `model.safetensors`, or the shards its index names,
/// checked as [`shards::join`] checks them), each a read-only view of its
/// file's mapped pages (a tensor whose bytes are not aligned for its
/// kind is copied). The maps are unmapped when `f` returns: **`f` must
/// not keep the tensors or views of them** (copies are fine), and must
/// never write into them. `f`'s second argument drops the pages read so
/// far from this process's resident memory (they are read again from the
/// file if touched again): a reader of one tensor at a time calls it
/// after each. The error is one line naming the file.
pub fn with_mapped<T, E>(
    given: &Path,
    f: impl FnOnce(Vec<(String, Tensor)>, &dyn Fn()) -> Result<T, E>,
) -> Result<Result<T, E>, String> {
    with_mapped_files(shards::weight_files(given)?, f)
}

/// [`with_mapped`] over `files` (each with the tensors it must hold, or
/// None: whatever it holds); no tensor may be in two.
pub fn with_mapped_files<T, E>(
    files: Vec<shards::WeightFile>,
    f: impl FnOnce(Vec<(String, Tensor)>, &dyn Fn()) -> Result<T, E>,
) -> Result<Result<T, E>, String> {
    let mut maps = Vec::with_capacity(files.len());
    for (file, _) in &files {
        let opened = std::fs::File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
        // SAFETY: read-only and private; nothing here writes the file, and
        // a file another process truncates meanwhile is the same hazard
        // as for every reader of memory-mapped weights (safetensors' own).
        let map = unsafe { Mmap::map(&opened) }.map_err(|e| format!("{}: {e}", file.display()))?;
        maps.push(map);
    }
    let mut read = Vec::with_capacity(files.len());
    for ((file, expected), map) in files.into_iter().zip(&maps) {
        let tensors = views(map).map_err(|e| format!("{}: {e}", file.display()))?;
        read.push((file, expected, tensors));
    }
    let tensors = shards::join(read)?;
    let forget = || {
        for map in &maps {
            // SAFETY: a read-only file mapping: its pages are dropped and
            // read again from the file when touched (nothing is lost).
            // A refusal only leaves them resident.
            let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    };
    // The views die inside `f` or here, before `maps`.
    Ok(f(tensors, &forget))
}

/// Every tensor of one mapped safetensors file, as views of `map`.
fn views(map: &Mmap) -> Result<Vec<(String, Tensor)>, String> {
    let st = SafeTensors::deserialize(&map[..])
        .map_err(|e| format!("not a readable safetensors file: {e}"))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let kind = kind_of(view.dtype())
            .ok_or_else(|| format!("{name} has dtype {:?}, which libtorch lacks", view.dtype()))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let data = view.data();
        let t = if (data.as_ptr() as usize).is_multiple_of(kind.elt_size_in_bytes())
            && !data.is_empty()
        {
            // SAFETY: `data` lies in `map`, which outlives every view
            // (with_mapped's contract), holds exactly shape x kind bytes
            // (safetensors checked the offsets) and is aligned for kind.
            unsafe { Tensor::f_from_blob(data.as_ptr(), &shape, &[], kind, tch::Device::Cpu) }
        } else {
            Tensor::f_from_data_size(data, &shape, kind)
        }
        .map_err(|e| crate::error::torch_text(&format!("mapping {name}"), &e))?;
        out.push((name, t));
    }
    Ok(out)
}
