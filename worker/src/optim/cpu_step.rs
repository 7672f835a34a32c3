//! The CPU loop's driver: checks, state and threads for the one-pass step of every parameter.

use super::cpu_loop::{self, GradPrep};
use super::rule::Coefs;
use super::Optimizer;
use crate::error::{Result, TorchContext};
use tch::{Device, Kind, Tensor};

/// Below this many elements the fused step stays on one thread (spawning
/// costs more than it saves).
pub(super) const PARALLEL_MIN: usize = 1 << 18;

impl Optimizer {
    /// The fused CPU step ([`cpu_loop::sgd`], [`cpu_loop::adam`]):
    /// prepares each gradient (`prep`: normalization and clip), applies SGD
    /// or Adam/AdamW and zeroes the gradient, in one pass over memory per
    /// parameter. `grads` is every parameter's gradient, in order, as one
    /// slice (the flat gradient buffer's CPU slice, grads/). The arithmetic and the
    /// state it leaves (`momentum_buffer`, or `exp_avg` and `exp_avg_sq`,
    /// and [`Optimizer::steps`]) are those of [`Optimizer::step`] after the
    /// same preparation, up to float rounding, so checkpoints save the same
    /// state either way. Returns `Ok(false)`, having touched nothing, where
    /// it does not apply (a parameter or state tensor that is not a
    /// contiguous float32 CPU tensor of the parameter's length, or state
    /// missing after the first step); the caller then runs the tensor-op
    /// pipeline. With more than one intra-op thread the elements are split
    /// across that many threads.
    pub fn step_fused(
        &mut self,
        params: &[(String, Tensor)],
        grads: &mut [f32],
        lr: f64,
        prep: GradPrep,
    ) -> Result<bool> {
        let flat_f32 = |t: &Tensor| {
            t.defined() && t.kind() == Kind::Float && t.device() == Device::Cpu && t.is_contiguous()
        };
        let total: usize = params.iter().map(|(_, p)| p.numel()).sum();
        // `fused = true` asks for PyTorch's fused kernel, not this one.
        if self.is_aten_fused()
            || total != grads.len()
            || self.state.len() < params.len()
            || !params.iter().all(|(_, p)| flat_f32(p))
        {
            return Ok(false);
        }
        let keys = self.rule.state_keys();
        let first = self.steps == 0;
        // Everything is checked before anything is touched.
        for ((_, p), state) in params.iter().zip(&self.state) {
            for k in keys {
                match state.get(k) {
                    // Missing after step 1 (a checkpoint without it): left
                    // to the op-by-op path's rules.
                    None if !first => return Ok(false),
                    None => {}
                    Some(t) if !flat_f32(t) || t.numel() != p.numel() => return Ok(false),
                    Some(_) => {}
                }
            }
        }
        for ((_, p), state) in params.iter().zip(self.state.iter_mut()) {
            for &k in keys {
                if !state.contains_key(k) {
                    state.insert(k, p.f_zeros_like().ctx("optimizer state")?);
                }
            }
        }
        self.steps += 1;
        // SAFETY (parameters and state): each tensor was checked above to
        // be a contiguous float32 CPU tensor of numel elements (the state
        // made above is zeros_like such a parameter); parameters, state and
        // the gradient buffer are distinct storages, and nothing else runs
        // on them while the engine thread is here. The tensor handles
        // (`params`, `self.state`) outlive the slices.
        let raw = |t: &Tensor| unsafe {
            std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, t.numel())
        };
        let mut rest = grads;
        let mut pieces = Vec::with_capacity(params.len());
        for ((_, p), state) in params.iter().zip(&self.state) {
            let (g, tail) = std::mem::take(&mut rest).split_at_mut(p.numel());
            rest = tail;
            // Indexing cannot panic: every key was inserted just above.
            let mut s = keys.iter().map(|k| raw(&state[k]));
            pieces.push(Piece {
                p: raw(p),
                g,
                a: s.next().unwrap_or_default(),
                b: s.next().unwrap_or_default(),
            });
        }
        // The rule's numbers of this step, rounded once to f32.
        match self.rule.coefs(self.steps, lr) {
            Coefs::Sgd(rule, c) => {
                let h = cpu_loop::Sgd::from_rule(&rule, &c, first);
                on_threads(pieces, total, |x| cpu_loop::sgd(x.p, x.g, x.a, prep, h));
            }
            Coefs::Adam(rule, c) => {
                let h = cpu_loop::Adam::from_rule(&rule, &c);
                on_threads(pieces, total, |x| {
                    cpu_loop::adam(x.p, x.g, x.a, x.b, prep, h, &aten_sqrt)
                });
            }
        }
        Ok(true)
    }
}

/// One parameter's (or a part of it) memory as the fused step walks it:
/// parameter, gradient and up to two state buffers (SGD's momentum buffer;
/// Adam's `exp_avg` and `exp_avg_sq`), each either empty (unused) or of the
/// parameter's length.
struct Piece<'a> {
    p: &'a mut [f32],
    g: &'a mut [f32],
    a: &'a mut [f32],
    b: &'a mut [f32],
}

impl<'a> Piece<'a> {
    fn len(&self) -> usize {
        self.p.len()
    }

    /// The first `n` elements and the rest.
    fn split_at(self, n: usize) -> (Piece<'a>, Piece<'a>) {
        fn cut(s: &mut [f32], n: usize) -> (&mut [f32], &mut [f32]) {
            if s.is_empty() {
                (&mut [], &mut [])
            } else {
                s.split_at_mut(n)
            }
        }
        let (p1, p2) = self.p.split_at_mut(n);
        let (g1, g2) = self.g.split_at_mut(n);
        let (a1, a2) = cut(self.a, n);
        let (b1, b2) = cut(self.b, n);
        (
            Piece {
                p: p1,
                g: g1,
                a: a1,
                b: b1,
            },
            Piece {
                p: p2,
                g: g2,
                a: a2,
                b: b2,
            },
        )
    }
}

/// ATen's float sqrt (what `exp_avg_sq.sqrt()` runs in the tensor-op step
/// and in PyTorch's Adam) over `src` into `dst`, so the fused step's
/// denominators are the tensor ops' bit for bit (cpu_loop.rs). Should
/// ATen refuse, the correctly rounded root is taken instead, with a
/// warning: at most an ulp from ATen's.
fn aten_sqrt(src: &[f32], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let size = [n as i64];
    // SAFETY: each tensor views n contiguous f32 of a live slice (src read
    // only, dst written by sqrt_out alone), without copying or taking
    // ownership, and both are dropped before this function returns, while
    // the borrows still hold.
    let done = unsafe {
        match (
            Tensor::f_from_blob(
                src.as_ptr() as *const u8,
                &size,
                &[1],
                Kind::Float,
                Device::Cpu,
            ),
            Tensor::f_from_blob(
                dst.as_mut_ptr() as *const u8,
                &size,
                &[1],
                Kind::Float,
                Device::Cpu,
            ),
        ) {
            (Ok(s), Ok(d)) => s.f_sqrt_out(&d).map(drop),
            (Err(e), _) | (_, Err(e)) => Err(e),
        }
    };
    if let Err(e) = done {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| tracing::warn!(error = %e, "ATen's sqrt failed; the fused Adam step takes f32::sqrt"));
        cpu_loop::exact_sqrt(&src[..n], &mut dst[..n]);
    }
}

/// Runs `f` (an elementwise step) over every piece: on this thread, or with
/// more than one intra-op thread and at least [`PARALLEL_MIN`] elements in
/// all, over that many threads (64 at most), each taking a contiguous run
/// of `total / threads` elements (pieces split where a run ends).
fn on_threads(pieces: Vec<Piece>, total: usize, f: impl Fn(Piece) + Sync) {
    let threads = (tch::get_num_threads().max(1) as usize).min(64);
    if threads == 1 || total < PARALLEL_MIN {
        pieces.into_iter().for_each(f);
        return;
    }
    let per = total.div_ceil(threads);
    let mut shares: Vec<Vec<Piece>> = (0..threads).map(|_| Vec::new()).collect();
    let (mut t, mut room) = (0, per);
    for mut piece in pieces {
        while !piece.p.is_empty() {
            let n = piece.len().min(room);
            let (head, tail) = piece.split_at(n);
            shares[t].push(head);
            piece = tail;
            room -= n;
            if room == 0 {
                if t + 1 < threads {
                    t += 1;
                    room = per;
                } else {
                    room = usize::MAX; // the last share takes the rest
                }
            }
        }
    }
    let f = &f;
    std::thread::scope(|s| {
        for share in shares {
            s.spawn(move || share.into_iter().for_each(f));
        }
    });
}
