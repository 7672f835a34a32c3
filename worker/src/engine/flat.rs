//! Tensors to and from one flat f32 host buffer (the form collectives and
//! the state broadcast move them in).

use crate::error::{Result, TorchContext};
use tch::{Device, Kind, Tensor};

/// Copies tensors into one flat f32 host buffer (in order). CUDA tensors
/// are concatenated on the device and staged through pinned host memory
/// (one DMA per bucket instead of one pageable copy per tensor).
pub fn flatten(tensors: &[Tensor]) -> Result<Vec<f32>> {
    let total: usize = tensors.iter().map(|t| t.numel()).sum();
    let mut buf = vec![0f32; total];
    if let Some(device) = cuda_device(tensors) {
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
        let mut pinned = Tensor::f_empty([total as i64], (Kind::Float, Device::Cpu))
            .and_then(|h| h.f_pin_memory(device))
            .ctx("allocating pinned memory")?;
        pinned.f_copy_(&flat).ctx("staging to pinned memory")?;
        pinned
            .f_copy_data(&mut buf, total)
            .ctx("staging to pinned memory")?;
        return Ok(buf);
    }
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

fn cuda_device(tensors: &[Tensor]) -> Option<Device> {
    tensors.iter().map(|t| t.device()).find(|d| d.is_cuda())
}

/// Copies a flat buffer made by [`flatten`] back into the tensors (through
/// pinned memory for CUDA tensors).
pub fn unflatten(buf: &[f32], tensors: &[Tensor]) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let staged = match cuda_device(tensors) {
        Some(device) => Some(
            Tensor::from_slice(buf)
                .f_pin_memory(device)
                .and_then(|h| h.f_to_device_(device, Kind::Float, true, false))
                .ctx("staging from pinned memory")?,
        ),
        None => None,
    };
    let mut off = 0;
    for t in tensors {
        let n = t.numel();
        let src = match &staged {
            Some(flat) => flat.f_narrow(0, off as i64, n as i64),
            None => Tensor::from_slice(&buf[off..off + n]).f_to_kind(t.kind()),
        }
        .and_then(|s| s.f_view(t.size().as_slice()))
        .ctx("unflattening tensors")?;
        t.shallow_clone()
            .f_copy_(&src)
            .ctx("unflattening tensors")?;
        off += n;
    }
    Ok(())
}
