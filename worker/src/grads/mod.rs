//! The gradient-accumulation buffer: every parameter's `.grad` is a view
//! into one flat f32 tensor (DDP's `gradient_as_bucket_view`). Backward
//! adds into it in place on every micro-step; at the sync step the ring
//! reduces its buckets where they lie (on CPU no flatten, no unflatten, no
//! allocation), and normalization, the clipping norm and the clip itself
//! are one operation each over the whole buffer.
//!
//! Layout: the gradients in parameter order, then [`EXTRA`] slots for the
//! window's counts (loss terms, micro-batches, loss sum) and the requests
//! the ranks agree on (stop, checkpoint), encoded by [`tally`], which
//! ride in the last bucket. On CUDA the buffer lives on the device and a pinned host
//! mirror (allocated once) stages each bucket: the device-to-host copy of
//! bucket i + 1 runs while bucket i is on the wire.

pub mod tally;

use crate::comm::collective::Collective;
use crate::error::{Error, InPlace, Result, TorchContext};
use crate::optim::GradPrep;
use std::ops::Range;
use tch::{Device, Kind, Tensor};

/// Slots after the gradients for the window's counts (loss terms,
/// micro-batches, loss sum) and the requests every rank must honour at the
/// same step (stop, checkpoint): [`tally::WindowTally`]'s encoding.
pub const EXTRA: usize = tally::SLOTS;

/// Gradients per chunk of [`FlatGrads::norm`]'s first reduction. libtorch's
/// CPU norm accumulates a float32 tensor in float32 along its length, so
/// its relative error grows with it: -4.0e-4 over ResNet-18's 11.2M
/// gradients in one reduction (clip_grad_norm_, which takes one norm per
/// parameter tensor, was within 4e-6 of the exact norm), 1.8e-7 over
/// chunks of 64 Ki whose norms are combined in float64.
pub const NORM_CHUNK: i64 = 1 << 16;

pub struct FlatGrads {
    /// Gradients then EXTRA slots, on the parameters' device.
    flat: Tensor,
    /// Number of gradient elements (the EXTRA slots follow).
    len: usize,
    /// Stage 2 between uses: `flat` holds the EXTRA slots only and every
    /// `.grad` is empty ([`FlatGrads::release`]).
    released: bool,
    /// Element ranges of `flat`, aligned to parameter boundaries; the last
    /// one includes the EXTRA slots.
    buckets: Vec<Range<usize>>,
    /// CUDA: pinned host mirror of `flat`.
    host: Option<Tensor>,
}

impl FlatGrads {
    /// Allocates the buffer and makes every parameter's gradient a view of
    /// it (current gradient values are kept). `bucket_cap` is in elements.
    pub fn attach(params: &[(String, Tensor)], bucket_cap: usize) -> Result<Self> {
        Self::attach_via_host(params, bucket_cap, false)
    }

    /// [`FlatGrads::attach`]; with `via_host` the collectives go through a
    /// separate host buffer also on the CPU, as they do on CUDA (so the CPU
    /// tests run the staging path: every copy but the device transfer).
    pub fn attach_via_host(
        params: &[(String, Tensor)],
        bucket_cap: usize,
        via_host: bool,
    ) -> Result<Self> {
        let _guard = tch::no_grad_guard();
        let device = params
            .first()
            .map(|(_, p)| p.device())
            .unwrap_or(Device::Cpu);
        if let Some((name, p)) = params
            .iter()
            .find(|(_, p)| p.kind() != Kind::Float || p.device() != device)
        {
            return Err(Error::GradBuffer(format!(
                "parameter {name} is {:?} on {:?}; the gradient buffer holds float32 on one device ({device:?})",
                p.kind(),
                p.device()
            )));
        }
        let sizes: Vec<usize> = params.iter().map(|(_, p)| p.numel()).collect();
        let len: usize = sizes.iter().sum();
        let flat = Tensor::f_zeros([(len + EXTRA) as i64], (Kind::Float, device))
            .ctx("allocating the gradient buffer")?;
        point(&flat, params, true)?;
        let mut buckets: Vec<Range<usize>> = crate::comm::chunks::buckets(&sizes, bucket_cap)
            .into_iter()
            .map(|r| {
                let start: usize = sizes[..r.start].iter().sum();
                let end: usize = start + sizes[r].iter().sum::<usize>();
                start..end
            })
            .collect();
        match buckets.last_mut() {
            Some(last) => last.end += EXTRA,
            None => buckets.push(0..EXTRA),
        }
        let host = if device.is_cuda() {
            Some(
                Tensor::f_zeros([(len + EXTRA) as i64], (Kind::Float, Device::Cpu))
                    .and_then(|h| h.f_pin_memory(device))
                    .ctx("allocating pinned memory")?,
            )
        } else if via_host {
            Some(
                Tensor::f_zeros([(len + EXTRA) as i64], (Kind::Float, Device::Cpu))
                    .ctx("allocating the host buffer")?,
            )
        } else {
            None
        };
        Ok(Self {
            flat,
            len,
            buckets,
            host,
            released: false,
        })
    }

    /// ZeRO-3 with gradients by unit: a buffer that is never allocated
    /// (the EXTRA slots only, released for good; the gradients live by
    /// unit, engine/placement/params.rs). Nothing is attached.
    pub fn unallocated(params: &[(String, Tensor)]) -> Result<Self> {
        let len = params.iter().map(|(_, p)| p.numel()).sum();
        Ok(Self {
            flat: Tensor::f_zeros([EXTRA as i64], (Kind::Float, Device::Cpu))
                .ctx("allocating the count slots")?,
            len,
            released: true,
            buckets: std::iter::once(0..EXTRA).collect(),
            host: None,
        })
    }

    /// ZeRO stage 2: frees the buffer (every `.grad` becomes an empty
    /// tensor of the same kind; only the EXTRA slots stay) until
    /// [`FlatGrads::restore`]. Backward must not run meanwhile.
    pub fn release(&mut self, params: &[(String, Tensor)]) -> Result<()> {
        if self.released {
            return Ok(());
        }
        let _guard = tch::no_grad_guard();
        let opts = (Kind::Float, self.flat.device());
        let empty = Tensor::f_empty([0], opts).ctx("releasing the gradient buffer")?;
        for (_, p) in params {
            p.grad()
                .f_set_data(&empty)
                .ctx("releasing the gradient buffer")?;
        }
        self.flat = Tensor::f_zeros([EXTRA as i64], opts).ctx("releasing the gradient buffer")?;
        self.released = true;
        Ok(())
    }

    /// Whether [`FlatGrads::release`] freed the buffer.
    pub fn is_released(&self) -> bool {
        self.released
    }

    /// After [`FlatGrads::release`]: a zeroed buffer again, with every
    /// `.grad` a view of it (a no-op when it is not released).
    pub fn restore(&mut self, params: &[(String, Tensor)]) -> Result<()> {
        if !self.released {
            return Ok(());
        }
        let _guard = tch::no_grad_guard();
        let flat = Tensor::f_zeros(
            [(self.len + EXTRA) as i64],
            (Kind::Float, self.flat.device()),
        )
        .ctx("allocating the gradient buffer")?;
        point(&flat, params, false)?;
        self.flat = flat;
        self.released = false;
        Ok(())
    }

    /// Whether collectives go through the host mirror (CUDA, or asked for).
    pub fn via_host(&self) -> bool {
        self.host.is_some()
    }

    /// The host mirror's gradient part (no EXTRA slots) when there is one.
    pub fn host_mut(&mut self) -> Option<&mut [f32]> {
        let h = self.host.as_ref()?;
        // SAFETY: the mirror is a contiguous float32 CPU tensor of len +
        // EXTRA elements owned by self; the slice borrows self mutably and
        // nothing else uses the mirror meanwhile (the engine thread).
        Some(unsafe { std::slice::from_raw_parts_mut(h.data_ptr() as *mut f32, self.len) })
    }

    /// Copies elements `r` of the gradients to the host mirror.
    pub fn to_host(&self, r: Range<usize>) -> Result<()> {
        self.copy_between(r, true)
    }

    /// Copies elements `r` of the host mirror into the gradients.
    pub fn from_host(&self, r: Range<usize>) -> Result<()> {
        self.copy_between(r, false)
    }

    /// Elements `r` of the host mirror (via_host), as a tensor view.
    pub fn host_view(&self, r: Range<usize>) -> Result<Tensor> {
        let h = self
            .host
            .as_ref()
            .ok_or_else(|| Error::GradBuffer("the gradient buffer has no host mirror".into()))?;
        h.f_narrow(0, r.start as i64, r.len() as i64)
            .ctx("viewing the host mirror")
    }

    fn copy_between(&self, r: Range<usize>, to_host: bool) -> Result<()> {
        let host = self.host_view(r.clone())?;
        let dev = self.view()?.f_narrow(0, r.start as i64, r.len() as i64);
        let (mut dst, src) = if to_host {
            (host, dev.ctx("viewing the gradient buffer")?)
        } else {
            (dev.ctx("viewing the gradient buffer")?, host)
        };
        dst.f_copy_(&src).ctx("staging gradients")
    }

    /// Bytes the buffer holds now (the EXTRA slots only while released).
    pub fn bytes(&self) -> usize {
        self.flat.numel() * 4
    }

    /// All gradients as one 1-D view (no EXTRA slots).
    pub fn view(&self) -> Result<Tensor> {
        if self.released {
            return Err(Error::GradBuffer(
                "the gradient buffer is released (ZeRO stage 2) and was not restored".into(),
            ));
        }
        self.flat
            .f_narrow(0, 0, self.len as i64)
            .ctx("viewing the gradient buffer")
    }

    /// The gradients (no EXTRA slots) as one slice in parameter order,
    /// where they live in host memory (None on CUDA).
    pub fn cpu_mut(&mut self) -> Option<&mut [f32]> {
        if self.flat.device() != Device::Cpu || self.released {
            return None;
        }
        // SAFETY: `flat` is a contiguous float32 CPU tensor of len + EXTRA
        // elements owned by self; the slice borrows self mutably, and the
        // parameters' .grad views of it are not used while it lives (the
        // engine thread is the only one that runs backward or steps).
        Some(unsafe { std::slice::from_raw_parts_mut(self.flat.data_ptr() as *mut f32, self.len) })
    }

    pub fn buckets(&self) -> &[Range<usize>] {
        &self.buckets
    }

    /// Zeroes every gradient and the EXTRA slots (one operation).
    pub fn zero(&self) -> Result<()> {
        self.flat
            .shallow_clone()
            .f_zero_()
            .ctx_("zeroing gradients")
    }

    /// Zeroes only the EXTRA slots (after a fused optimizer step that
    /// zeroed the gradients itself).
    pub fn zero_extra(&self) -> Result<()> {
        let at = if self.released { 0 } else { self.len as i64 };
        self.flat
            .f_narrow(0, at, EXTRA as i64)
            .and_then(|mut t| t.f_zero_())
            .ctx_("zeroing the count slots")
    }

    /// Normalization and clipping as tensor ops over the whole buffer (the
    /// path for optimizers and devices without a fused step).
    pub fn prepare(&self, prep: GradPrep) -> Result<()> {
        match prep {
            GradPrep::Mul(s) => self.scale(s as f64),
            GradPrep::Div(d) => self.div(d as f64),
            GradPrep::DivClamp(d, v) => {
                self.div(d as f64)?;
                self.clip_by_value(v as f64)
            }
        }
    }

    /// Divides every gradient by `divisor` (one operation).
    pub fn div(&self, divisor: f64) -> Result<()> {
        self.view()?
            .f_div_scalar_(divisor)
            .ctx_("normalizing gradients")
    }

    /// The `norm_type` norm (2.0 or inf) of all gradients together, as
    /// clip_grad_norm_ defines it: one reduction over the buffer (float32)
    /// up to [`NORM_CHUNK`] gradients; above, the 2-norms of chunks of that
    /// many (float32), combined in float64 (a 0-dim float64 tensor).
    pub fn norm(&self, norm_type: f64) -> Result<Tensor> {
        let view = self.view()?;
        let n = self.len as i64;
        let whole = |t: &Tensor| t.f_linalg_norm(norm_type, None::<&[i64]>, false, None::<Kind>);
        if norm_type.is_infinite() || n <= NORM_CHUNK {
            return whole(&view).ctx("computing the gradient norm");
        }
        let rows = n / NORM_CHUNK;
        let chunks = view
            .f_narrow(0, 0, rows * NORM_CHUNK)
            .and_then(|t| t.f_view([rows, NORM_CHUNK]))
            .and_then(|t| t.f_linalg_norm(norm_type, [1i64].as_slice(), false, None::<Kind>));
        let tail = view
            .f_narrow(0, rows * NORM_CHUNK, n - rows * NORM_CHUNK)
            .and_then(|t| whole(&t))
            .and_then(|t| t.f_reshape([1]));
        chunks
            .and_then(|c| Tensor::f_cat(&[c, tail?], 0))
            .and_then(|c| c.f_to_kind(Kind::Double))
            .and_then(|c| whole(&c))
            .ctx("computing the gradient norm")
    }

    /// Multiplies every gradient by `factor` (one operation).
    pub fn scale(&self, factor: f64) -> Result<()> {
        self.view()?.f_mul_scalar_(factor).ctx_("scaling gradients")
    }

    /// Clamps every gradient element to [-value, value].
    pub fn clip_by_value(&self, value: f64) -> Result<()> {
        self.view()?
            .f_clamp_(-value, value)
            .ctx_("clipping gradients by value")
    }

    /// Sums the gradients and `extra` (at most EXTRA values) over all ranks,
    /// bucket by bucket, in place. W = 1: only `extra` goes through the
    /// collective (the identity).
    pub fn all_reduce<C: Collective>(
        &mut self,
        collective: &mut C,
        extra: &mut [f32],
    ) -> Result<()> {
        assert!(extra.len() <= EXTRA, "at most {EXTRA} extra values");
        if self.released {
            return Err(Error::GradBuffer(
                "the gradient buffer is released (ZeRO stage 2) and was not restored".into(),
            ));
        }
        if collective.world_size() == 1 {
            let mut v = extra.to_vec();
            collective.all_reduce_sum(&mut v)?;
            extra.copy_from_slice(&v);
            return Ok(());
        }
        let len = self.len;
        let flat = self.flat.shallow_clone();
        let host = match &self.host {
            Some(h) => h.shallow_clone(),
            None => self.flat.shallow_clone(),
        };
        // SAFETY: `host` is a contiguous float32 CPU tensor of len + EXTRA
        // elements that outlives this call; the slices below are disjoint and
        // nothing else reads or writes it meanwhile (the engine thread is in
        // this call and the gradients are views that nobody touches now).
        let mem: &mut [f32] =
            unsafe { std::slice::from_raw_parts_mut(host.data_ptr() as *mut f32, len + EXTRA) };
        mem[len..len + extra.len()].copy_from_slice(extra);
        let mut parts: Vec<&mut [f32]> = Vec::with_capacity(self.buckets.len());
        let mut rest = &mut mem[..];
        let mut at = 0;
        for r in &self.buckets {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(r.end - at);
            parts.push(&mut head[r.start - at..]);
            rest = tail;
            at = r.end;
        }
        let ranges = self.buckets.clone();
        let via_host = self.host.is_some();
        let mut copy_in = |i: usize, _: &mut [f32]| -> Result<()> {
            if via_host {
                let r = &ranges[i];
                let n = (r.end - r.start) as i64;
                let is_last = i + 1 == ranges.len();
                // The EXTRA slots of the last bucket are already on the host.
                let dev_n = if is_last { n - EXTRA as i64 } else { n };
                host.f_narrow(0, r.start as i64, dev_n)
                    .and_then(|mut h| h.f_copy_(&flat.f_narrow(0, r.start as i64, dev_n)?))
                    .ctx("staging gradients to pinned memory")?;
            }
            Ok(())
        };
        let mut copy_out = |i: usize, _: &mut [f32]| -> Result<()> {
            if via_host {
                let r = &ranges[i];
                let n = (r.end - r.start) as i64;
                let dev_n = if i + 1 == ranges.len() {
                    n - EXTRA as i64
                } else {
                    n
                };
                flat.f_narrow(0, r.start as i64, dev_n)
                    .and_then(|mut d| d.f_copy_(&host.f_narrow(0, r.start as i64, dev_n)?))
                    .ctx("staging gradients from pinned memory")?;
            }
            Ok(())
        };
        collective.all_reduce_buckets(&mut parts, &mut copy_in, &mut copy_out)?;
        extra.copy_from_slice(&mem[len..len + extra.len()]);
        Ok(())
    }
}

/// Makes every parameter's `.grad` a view of its place in `flat` (in
/// parameter order), first copying the current gradient there when `keep`.
fn point(flat: &Tensor, params: &[(String, Tensor)], keep: bool) -> Result<()> {
    let mut off = 0;
    for (name, p) in params {
        let n = p.numel();
        let mut g = p.grad();
        let view = flat
            .f_narrow(0, off as i64, n as i64)
            .and_then(|v| v.f_view(p.size().as_slice()))
            .ctx("viewing the gradient buffer")?;
        if !g.defined() {
            if !p.requires_grad() {
                return Err(Error::GradBuffer(format!(
                    "parameter {name} has no gradient (does it require grad?)"
                )));
            }
            // No gradient yet: the view becomes it (nothing to keep, and
            // no backward to define one; the values are never read). A
            // detached alias, not the view itself: a view holds its base,
            // and a released buffer would stay alive through it.
            let alias = view.f_detach().ctx("moving a gradient into the buffer")?;
            crate::storage::set_grad(p, &alias).ctx("moving a gradient into the buffer")?;
        } else if keep {
            view.shallow_clone()
                .f_copy_(&g)
                .ctx("moving a gradient into the buffer")?;
        }
        if p.grad().data_ptr() != view.data_ptr() {
            g.f_set_data(&view)
                .ctx("moving a gradient into the buffer")?;
        }
        // The view must be what backward accumulates into from now on.
        let want = flat.data_ptr() as usize + off * 4;
        if p.grad().data_ptr() as usize != want {
            return Err(Error::GradBuffer(format!(
                "the gradient of {name} did not move into the flat buffer"
            )));
        }
        off += n;
    }
    Ok(())
}

/// Gives every parameter a defined (zero) gradient, so it can be re-pointed
/// into the buffer before the first backward: one backward of
/// `0 * sum(p.sum())`.
pub fn define_grads(params: &[(String, Tensor)]) -> Result<()> {
    if params.iter().all(|(_, p)| p.grad().defined()) {
        return Ok(());
    }
    let _grad = tch::with_grad(|| -> Result<()> {
        let sums: Vec<Tensor> = params
            .iter()
            .filter(|(_, p)| p.requires_grad())
            .map(|(_, p)| p.f_sum(None::<Kind>))
            .collect::<Result<_, _>>()
            .ctx("defining gradients")?;
        if sums.is_empty() {
            return Ok(());
        }
        Tensor::f_stack(&sums, 0)
            .and_then(|s| s.f_sum(None::<Kind>))
            .and_then(|s| s.f_mul_scalar(0.0))
            .and_then(|s| s.f_backward())
            .ctx("defining gradients")
    });
    _grad?;
    if let Some((name, _)) = params.iter().find(|(_, p)| !p.grad().defined()) {
        return Err(Error::GradBuffer(format!(
            "parameter {name} has no gradient (does it require grad?)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::collective::SingleRank;

    fn params() -> Vec<(String, Tensor)> {
        tch::manual_seed(0);
        ["w", "b", "v"]
            .iter()
            .zip([&[4i64, 3][..], &[4], &[2, 2]])
            .map(|(n, s)| {
                (
                    n.to_string(),
                    Tensor::randn(s, (Kind::Float, Device::Cpu)).set_requires_grad(true),
                )
            })
            .collect()
    }

    /// The norm of 4.2M gradients (well above [`NORM_CHUNK`]; ResNet-18
    /// has 11.2M) against the exact one in float64: within 1e-6 relative
    /// for norm 2 (a single float32 reduction over the buffer is off by
    /// more than 2e-5), exact for inf; a NaN or an infinity anywhere makes
    /// the norm non-finite.
    #[test]
    fn the_norm_of_a_large_buffer_is_accurate() {
        let sizes = [2_359_296i64, 1_179_648, 589_824, 65_536, 7, 1];
        let params: Vec<(String, Tensor)> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let t = Tensor::zeros([n], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                (format!("p{i}"), t)
            })
            .collect();
        let g = FlatGrads::attach(&params, 1 << 20).unwrap();
        tch::manual_seed(3);
        let _guard = tch::no_grad_guard();
        let values = Tensor::randn([g.len as i64], (Kind::Float, Device::Cpu)) * 0.01;
        let mut view = g.view().unwrap();
        view.copy_(&values);
        let exact = values
            .to_kind(Kind::Double)
            .square()
            .sum(Kind::Double)
            .sqrt()
            .double_value(&[]);
        let got = g.norm(2.0).unwrap().double_value(&[]);
        let rel = |x: f64| (x - exact).abs() / exact;
        let single = view
            .linalg_norm(2.0, None::<&[i64]>, false, None::<Kind>)
            .double_value(&[]);
        assert!(rel(got) <= 1e-6, "{:e}", rel(got));
        assert!(
            rel(single) > 2e-5,
            "one float32 reduction: {:e}",
            rel(single)
        );
        let max = values.abs().max().double_value(&[]);
        assert_eq!(g.norm(f64::INFINITY).unwrap().double_value(&[]), max);
        for bad in [f64::NAN, f64::INFINITY] {
            let _ = view.get(3_000_000).fill_(bad);
            assert!(!g.norm(2.0).unwrap().double_value(&[]).is_finite());
            assert!(!g.norm(f64::INFINITY).unwrap().double_value(&[]).is_finite());
        }
    }

    fn loss(p: &[(String, Tensor)], x: &Tensor) -> Tensor {
        let y = x.matmul(&p[0].1.tr()) + &p[1].1;
        (y.pow_tensor_scalar(2).sum(Kind::Float) + p[2].1.sin().sum(Kind::Float)) * 0.5
    }

    #[test]
    fn backward_accumulates_into_the_flat_buffer() {
        let p = params();
        let mut g = FlatGrads::attach(&p, 13).unwrap();
        // Buckets tile the buffer on parameter boundaries, extras last.
        assert_eq!(g.buckets(), &[0..12, 12..20 + EXTRA]);
        let x1 = Tensor::randn([5, 3], (Kind::Float, Device::Cpu));
        let x2 = Tensor::randn([5, 3], (Kind::Float, Device::Cpu));
        loss(&p, &x1).backward();
        loss(&p, &x2).backward();
        // The same sums computed independently on fresh leaves.
        let fresh: Vec<Tensor> = p
            .iter()
            .map(|(_, t)| t.detach().set_requires_grad(true))
            .collect();
        let named: Vec<(String, Tensor)> = fresh
            .iter()
            .map(|t| (String::new(), t.shallow_clone()))
            .collect();
        (loss(&named, &x1) + loss(&named, &x2)).backward();
        let want = Tensor::cat(
            &fresh
                .iter()
                .map(|t| t.grad().flatten(0, -1))
                .collect::<Vec<_>>(),
            0,
        );
        let got = g.view().unwrap();
        assert!(got.allclose(&want, 1e-6, 1e-6, false));
        // Every .grad is a view of the buffer (no copy in between).
        let mut off = 0;
        for (_, t) in &p {
            assert_eq!(
                t.grad().data_ptr() as usize,
                got.data_ptr() as usize + 4 * off
            );
            off += t.numel();
        }
        // Norm, scale, zero: one operation each over every gradient.
        let norm = g.norm(2.0).unwrap().double_value(&[]);
        let want_norm = want.norm().double_value(&[]);
        assert!((norm - want_norm).abs() <= 1e-5 * want_norm);
        g.scale(0.5).unwrap();
        assert!(g
            .view()
            .unwrap()
            .allclose(&(&want * 0.5), 1e-6, 1e-6, false));
        let mut extra = [3.0f32, 2.0, 1.0];
        g.all_reduce(&mut SingleRank, &mut extra).unwrap();
        assert_eq!(extra, [3.0, 2.0, 1.0]);
        g.zero().unwrap();
        assert_eq!(p[0].1.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
        // Still attached after zeroing: the next backward lands in the buffer.
        loss(&p, &x1).backward();
        assert!(g.view().unwrap().abs().sum(Kind::Float).double_value(&[]) > 0.0);
    }

    /// Stage 2's release frees the buffer (only the EXTRA slots stay),
    /// refuses use until restored, and a restored buffer is zero and is
    /// again what backward accumulates into.
    #[test]
    fn a_released_buffer_is_freed_and_restores_to_zero_views() {
        let p = params();
        let mut g = FlatGrads::attach(&p, 13).unwrap();
        let x = Tensor::randn([5, 3], (Kind::Float, Device::Cpu));
        loss(&p, &x).backward();
        let once = g.view().unwrap().copy();
        assert_eq!(g.bytes(), 4 * (20 + EXTRA));
        g.release(&p).unwrap();
        assert!(g.is_released());
        assert_eq!(g.bytes(), 4 * EXTRA);
        assert!(p.iter().all(|(_, t)| t.grad().numel() == 0));
        assert!(g.view().is_err());
        assert!(g.cpu_mut().is_none());
        assert!(g.all_reduce(&mut SingleRank, &mut []).is_err());
        g.zero().unwrap();
        g.zero_extra().unwrap();
        g.restore(&p).unwrap();
        assert!(!g.is_released());
        assert_eq!(
            g.view().unwrap().abs().sum(Kind::Float).double_value(&[]),
            0.0
        );
        loss(&p, &x).backward();
        let got = g.view().unwrap();
        assert!(
            got.equal(&once),
            "the same backward lands in the new buffer"
        );
        let mut off = 0;
        for (_, t) in &p {
            assert_eq!(
                t.grad().data_ptr() as usize,
                got.data_ptr() as usize + 4 * off
            );
            off += t.numel();
        }
    }
}
