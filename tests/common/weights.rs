//! Final parameters compared between two runs' checkpoints (the
//! recovery tests: a disturbed run against the undisturbed one).

use std::path::Path;

/// The F32 tensors of a safetensors file by name, or of a step folder's
/// model: `model.safetensors`, or the shards a pipeline job's stages
/// write (`model-0000i-of-0000n.safetensors`), joined.
pub fn read_f32(path: &Path) -> Vec<(String, Vec<f32>)> {
    if path.is_dir() {
        let one = path.join("model.safetensors");
        if one.exists() {
            return read_f32(&one);
        }
        let mut files: Vec<_> = std::fs::read_dir(path)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let n = p.file_name().unwrap().to_string_lossy();
                n.starts_with("model-") && n.ends_with(".safetensors")
            })
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{}: no model files", path.display());
        let mut out: Vec<_> = files.iter().flat_map(|f| read_f32(f)).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        return out;
    }
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let v = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Max over tensors of max|a - b| / max|b| between two safetensors files
/// (the same names).
pub fn relative_difference(a: &Path, b: &Path) -> f64 {
    let (a, b) = (read_f32(a), read_f32(b));
    assert_eq!(
        a.iter().map(|x| &x.0).collect::<Vec<_>>(),
        b.iter().map(|x| &x.0).collect::<Vec<_>>()
    );
    a.iter()
        .zip(&b)
        .map(|((_, x), (_, y))| {
            let diff = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs() as f64)
                .fold(0.0, f64::max);
            let scale = y.iter().map(|q| q.abs() as f64).fold(0.0, f64::max);
            diff / scale.max(1e-12)
        })
        .fold(0.0, f64::max)
}
