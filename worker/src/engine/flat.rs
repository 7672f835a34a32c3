//! Tensors to and from one flat f32 host buffer (the form collectives and
//! the state broadcast move them in).

use crate::error::{Result, TorchContext};
use tch::{Device, Kind, Tensor};

/// Copies tensors into one flat f32 host buffer (in order). CUDA tensors
/// are concatenated on the device and staged through pinned host memory
/// (one DMA per bucket instead of one pageable copy per tensor).
pub fn flatten(tensors: &[Tensor]) -> Result<Vec<f32>> {
    match cuda_device(tensors) {
        Some(device) => flatten_concatenated(tensors, Some(device)),
        None => flatten_each(tensors),
    }
}

/// Copies a flat buffer made by [`flatten`] back into the tensors (through
/// pinned memory for CUDA tensors).
pub fn unflatten(buf: &[f32], tensors: &[Tensor]) -> Result<()> {
    match cuda_device(tensors) {
        Some(device) => unflatten_narrowed(buf, tensors, device, true),
        None => unflatten_each(buf, tensors),
    }
}

fn cuda_device(tensors: &[Tensor]) -> Option<Device> {
    tensors.iter().map(|t| t.device()).find(|d| d.is_cuda())
}

/// The CUDA path of [`flatten`]: the tensors concatenated as f32 on their
/// device, then one copy into a host tensor, pinned for `pin`'s device
/// (None: pageable, which any device allows: the CPU tests run this path).
fn flatten_concatenated(tensors: &[Tensor], pin: Option<Device>) -> Result<Vec<f32>> {
    let total: usize = tensors.iter().map(|t| t.numel()).sum();
    let mut buf = vec![0f32; total];
    if tensors.is_empty() {
        return Ok(buf);
    }
    let parts: Vec<Tensor> = tensors
        .iter()
        .map(|t| {
            t.f_detach()
                .and_then(|t| t.f_flatten(0, -1))
                .and_then(|t| t.f_to_kind(Kind::Float))
        })
        .collect::<Result<_, _>>()
        .ctx("flattening tensors")?;
    let flat = Tensor::f_cat(&parts, 0).ctx("flattening tensors")?;
    let host = Tensor::f_empty([total as i64], (Kind::Float, Device::Cpu));
    let mut host = match pin {
        Some(device) => host
            .and_then(|h| h.f_pin_memory(device))
            .ctx("allocating pinned memory")?,
        None => host.ctx("allocating the host buffer")?,
    };
    host.f_copy_(&flat).ctx("staging to host memory")?;
    host.f_copy_data(&mut buf, total)
        .ctx("staging to host memory")?;
    Ok(buf)
}

/// The host path of [`flatten`]: one copy per tensor.
fn flatten_each(tensors: &[Tensor]) -> Result<Vec<f32>> {
    let total: usize = tensors.iter().map(|t| t.numel()).sum();
    let mut buf = vec![0f32; total];
    let mut off = 0;
    for t in tensors {
        let n = t.numel();
        let host = t
            .f_detach()
            .and_then(|t| t.f_to_kind(Kind::Float))
            .and_then(|t| t.f_contiguous())
            .ctx("flattening tensors")?;
        host.f_copy_data(&mut buf[off..off + n], n)
            .ctx("flattening tensors")?;
        off += n;
    }
    Ok(buf)
}

/// The CUDA path of [`unflatten`]: the buffer moved to `device` in one
/// copy (from pinned memory when `pin`; the CPU tests run it without),
/// then each tensor copied from its slice of it.
fn unflatten_narrowed(buf: &[f32], tensors: &[Tensor], device: Device, pin: bool) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let host = Tensor::from_slice(buf);
    let host = if pin {
        host.f_pin_memory(device)
            .ctx("staging from pinned memory")?
    } else {
        host
    };
    let flat = host
        .f_to_device_(device, Kind::Float, true, false)
        .ctx("staging from host memory")?;
    let mut off = 0;
    for t in tensors {
        let n = t.numel();
        let src = flat
            .f_narrow(0, off as i64, n as i64)
            .and_then(|s| s.f_view(t.size().as_slice()))
            .ctx("unflattening tensors")?;
        t.shallow_clone()
            .f_copy_(&src)
            .ctx("unflattening tensors")?;
        off += n;
    }
    Ok(())
}

/// The host path of [`unflatten`]: one copy per tensor.
fn unflatten_each(buf: &[f32], tensors: &[Tensor]) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let mut off = 0;
    for t in tensors {
        let n = t.numel();
        let src = Tensor::from_slice(&buf[off..off + n])
            .f_to_kind(t.kind())
            .and_then(|s| s.f_view(t.size().as_slice()))
            .ctx("unflattening tensors")?;
        t.shallow_clone()
            .f_copy_(&src)
            .ctx("unflattening tensors")?;
        off += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tensors of several kinds and shapes (a scalar, an empty one, a
    /// non-contiguous view), seeded.
    fn tensors() -> Vec<Tensor> {
        let o = |k| (k, Device::Cpu);
        tch::manual_seed(4);
        vec![
            Tensor::randn([3, 5], o(Kind::Float)),
            Tensor::randn([], o(Kind::Float)),
            Tensor::randn([0, 4], o(Kind::Float)),
            Tensor::randn([4, 6], o(Kind::Float)).transpose(0, 1),
            Tensor::randn([7], o(Kind::Double)),
            Tensor::randn([2, 3, 2], o(Kind::BFloat16)),
            Tensor::arange(9, o(Kind::Int64)).view([3, 3]),
        ]
    }

    fn bits(t: &Tensor) -> Vec<u64> {
        let t = t.to_kind(Kind::Double).flatten(0, -1);
        Vec::<f64>::try_from(t)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// CUDA's path of flatten and unflatten (one concatenation on the
    /// device, one staged copy each way; pinning aside) equals the host
    /// path value for value, for every kind and shape, on the CPU.
    #[test]
    fn the_concatenated_path_equals_the_host_path() {
        let ts = tensors();
        let host = flatten_each(&ts).unwrap();
        let staged = flatten_concatenated(&ts, None).unwrap();
        assert_eq!(host.len(), 15 + 1 + 24 + 7 + 12 + 9);
        let as_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(as_bits(&staged), as_bits(&host));
        // Back: new values into copies of the tensors, by both paths.
        let buf: Vec<f32> = (0..host.len()).map(|i| i as f32 * 0.37 - 5.0).collect();
        let (a, b): (Vec<Tensor>, Vec<Tensor>) = ts.iter().map(|t| (t.copy(), t.copy())).unzip();
        unflatten_each(&buf, &a).unwrap();
        unflatten_narrowed(&buf, &b, Device::Cpu, false).unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.size(), y.size());
            assert_eq!(x.kind(), y.kind());
            assert_eq!(bits(x), bits(y));
        }
        // And the round trip of f32 tensors is exact.
        assert_eq!(
            as_bits(&flatten_concatenated(&a[..4], None).unwrap()),
            as_bits(&buf[..40])
        );
        assert!(flatten_concatenated(&[], None).unwrap().is_empty());
    }
}
