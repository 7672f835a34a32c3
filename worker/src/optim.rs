//! SGD (momentum, dampening, nesterov, weight decay), Adam and AdamW, written
//! as PyTorch's single-tensor (for-loop) implementations so the numbers match,
//! with state that checkpoints can save by parameter name.

mod aten_fused;
mod masked;

pub use masked::MaskedCoefs;

use crate::error::{Error, InPlace, Result, TorchContext};
use crate::fused::{self, GradPrep};
use crate::spec::{OptimizerKind, OptimizerSpec};
use std::collections::HashMap;
use tch::{Device, Kind, Tensor};

/// Below this many elements the fused step stays on one thread (spawning
/// costs more than it saves).
const PARALLEL_MIN: usize = 1 << 18;

#[derive(Clone, Debug, PartialEq)]
pub enum Rule {
    Sgd {
        momentum: f64,
        dampening: f64,
        nesterov: bool,
        weight_decay: f64,
    },
    Adam {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled: bool,
    },
}

#[derive(Debug)]
pub struct Optimizer {
    pub rule: Rule,
    /// Optimizer steps taken (Adam's bias correction uses it).
    pub steps: u64,
    /// Per parameter: named state tensors (momentum_buffer, exp_avg, exp_avg_sq).
    state: Vec<HashMap<&'static str, Tensor>>,
    /// Per parameter: scratch tensors of its shape (two for Adam), made on
    /// the first step and reused; not part of the state.
    scratch: Vec<Option<(Tensor, Option<Tensor>)>>,
    /// `[optimizer] fused = true` (Adam and AdamW: PyTorch's fused kernel,
    /// optim/aten_fused.rs).
    fused: bool,
    /// The fused kernel's float32 step count on the parameters' device,
    /// made by its first eager step.
    aten_step: Option<Tensor>,
}

impl Optimizer {
    pub fn new(spec: &OptimizerSpec, num_params: usize) -> Self {
        let [beta1, beta2] = spec.betas.unwrap_or([0.9, 0.999]);
        let rule = match spec.kind {
            OptimizerKind::Adam | OptimizerKind::Adamw => Rule::Adam {
                beta1,
                beta2,
                eps: spec.eps.unwrap_or(1e-8),
                decoupled: spec.kind == OptimizerKind::Adamw,
                weight_decay: spec
                    .weight_decay
                    .unwrap_or(if spec.kind == OptimizerKind::Adamw {
                        0.01
                    } else {
                        0.0
                    }),
            },
            OptimizerKind::Sgd => Rule::Sgd {
                momentum: spec.momentum,
                dampening: spec.dampening,
                nesterov: spec.nesterov,
                weight_decay: spec.weight_decay.unwrap_or(0.0),
            },
        };
        Self {
            rule,
            steps: 0,
            state: (0..num_params).map(|_| HashMap::new()).collect(),
            scratch: Vec::new(),
            fused: spec.fused,
            aten_step: None,
        }
    }

    /// One update of every parameter from its (normalized, clipped)
    /// gradient. The arithmetic is PyTorch's single-tensor SGD/Adam, op for
    /// op; intermediate results go to per-parameter scratch tensors made on
    /// the first step (and into the gradient itself, which the engine zeroes
    /// right after), so a step allocates nothing.
    pub fn step(&mut self, params: &[(String, Tensor)], lr: f64) -> Result<()> {
        self.step_pairs(&with_grads(params), lr)
    }

    /// [`Optimizer::step`] of (parameter, gradient) pairs: the parameter
    /// tensors may be views (a ZeRO slice of the flat parameters), updated
    /// in place; state i belongs to pair i.
    pub fn step_pairs(&mut self, pairs: &[(Tensor, Tensor)], lr: f64) -> Result<()> {
        if self.is_aten_fused() {
            return self.step_aten(pairs, lr);
        }
        let _guard = tch::no_grad_guard();
        self.steps += 1;
        let step = self.steps as i32;
        self.make_scratch(pairs)?;
        for (((p, grad), state), scratch) in pairs
            .iter()
            .zip(self.state.iter_mut())
            .zip(self.scratch.iter())
        {
            // No scratch: a pair without a gradient.
            let Some((tmp, tmp2)) = scratch else {
                continue;
            };
            let mut grad = grad.shallow_clone();
            let mut p = p.shallow_clone();
            match self.rule {
                Rule::Sgd {
                    momentum,
                    dampening,
                    nesterov,
                    weight_decay,
                } => {
                    // d_p = grad + weight_decay * p, in the gradient, in one
                    // pass (torch: grad.add(p, alpha=weight_decay)).
                    if weight_decay != 0.0 {
                        let wd = scalar(weight_decay, &p)?;
                        grad.f_addcmul_(&p, &wd).ctx_("sgd weight decay")?;
                    }
                    let mut d_p = grad.shallow_clone();
                    if momentum != 0.0 {
                        let buf = match state.get_mut("momentum_buffer") {
                            None => {
                                let b = d_p.f_detach_copy().ctx("sgd momentum")?;
                                state.insert("momentum_buffer", b.shallow_clone());
                                b
                            }
                            Some(buf) => {
                                buf.f_mul_scalar_(momentum).ctx_("sgd momentum")?;
                                if dampening != 0.0 {
                                    d_p.f_mul_scalar_out(tmp, 1.0 - dampening)
                                        .ctx_("sgd momentum")?;
                                    buf.f_add_(tmp).ctx_("sgd momentum")?;
                                } else {
                                    buf.f_add_(&d_p).ctx_("sgd momentum")?;
                                }
                                buf.shallow_clone()
                            }
                        };
                        d_p = if nesterov {
                            buf.f_mul_scalar_out(tmp, momentum).ctx_("sgd nesterov")?;
                            grad.f_add_(tmp).ctx_("sgd nesterov")?;
                            grad.shallow_clone()
                        } else {
                            buf
                        };
                    }
                    // p += (-lr) * d_p in one pass (torch: p.add_(d_p, alpha=-lr)).
                    let neg_lr = scalar(-lr, &p)?;
                    p.f_addcmul_(&d_p, &neg_lr).ctx_("sgd update")?;
                }
                Rule::Adam {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    decoupled,
                } => {
                    if decoupled {
                        if weight_decay != 0.0 {
                            p.f_mul_scalar_(1.0 - lr * weight_decay)
                                .ctx_("adamw decay")?;
                        }
                    } else if weight_decay != 0.0 {
                        p.f_mul_scalar_out(tmp, weight_decay).ctx_("adam decay")?;
                        grad.f_add_(tmp).ctx_("adam decay")?;
                    }
                    if !state.contains_key("exp_avg") {
                        state.insert("exp_avg", p.f_zeros_like().ctx("adam state")?);
                        state.insert("exp_avg_sq", p.f_zeros_like().ctx("adam state")?);
                    }
                    let mut m = state["exp_avg"].shallow_clone();
                    let mut v = state["exp_avg_sq"].shallow_clone();
                    m.f_lerp_(&grad, 1.0 - beta1).ctx_("adam moments")?;
                    v.f_mul_scalar_(beta2).ctx_("adam moments")?;
                    // v += (grad * grad) * (1 - beta2)
                    grad.f_mul_out(tmp, &grad).ctx_("adam moments")?;
                    tmp.shallow_clone()
                        .f_mul_scalar_(1.0 - beta2)
                        .ctx_("adam moments")?;
                    v.f_add_(tmp).ctx_("adam moments")?;
                    let bc1 = 1.0 - beta1.powi(step);
                    let bc2_sqrt = (1.0 - beta2.powi(step)).sqrt();
                    // denom = sqrt(v) / bc2_sqrt + eps
                    let denom = tmp2.as_ref().unwrap_or(tmp);
                    v.f_sqrt_out(denom).ctx_("adam update")?;
                    let mut d = denom.shallow_clone();
                    d.f_div_scalar_(bc2_sqrt).ctx_("adam update")?;
                    d.f_add_scalar_(eps).ctx_("adam update")?;
                    // p -= (m / denom) * (lr / bc1)
                    m.f_div_out(tmp, denom).ctx_("adam update")?;
                    tmp.shallow_clone()
                        .f_mul_scalar_(lr / bc1)
                        .ctx_("adam update")?;
                    p.f_sub_(tmp).ctx_("adam update")?;
                }
            }
        }
        Ok(())
    }

    /// Makes the scratch tensors of every pair with a gradient (the first
    /// step; they are reused after): one of the parameter's shape, two
    /// for Adam.
    fn make_scratch(&mut self, pairs: &[(Tensor, Tensor)]) -> Result<()> {
        if self.scratch.len() != pairs.len() {
            self.scratch = (0..pairs.len()).map(|_| None).collect();
        }
        let adam = matches!(self.rule, Rule::Adam { .. });
        for ((p, grad), scratch) in pairs.iter().zip(self.scratch.iter_mut()) {
            if grad.defined() && scratch.is_none() {
                let one = p.f_empty_like().ctx("optimizer scratch")?;
                let two = if adam {
                    Some(p.f_empty_like().ctx("optimizer scratch")?)
                } else {
                    None
                };
                *scratch = Some((one, two));
            }
        }
        Ok(())
    }

    /// The fused CPU step ([`crate::fused::sgd`], [`crate::fused::adam`]):
    /// prepares each gradient (`prep`: normalization and clip), applies SGD
    /// or Adam/AdamW and zeroes the gradient, in one pass over memory per
    /// parameter. `grads` is every parameter's gradient, in order, as one
    /// slice ([`crate::grads::FlatGrads::cpu_mut`]). The arithmetic and the
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
        let keys: &[&'static str] = match self.rule {
            Rule::Sgd { momentum, .. } => {
                if momentum == 0.0 {
                    &[]
                } else {
                    &["momentum_buffer"]
                }
            }
            Rule::Adam { .. } => &["exp_avg", "exp_avg_sq"],
        };
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
        match self.rule {
            Rule::Sgd {
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => {
                let h = fused::Sgd {
                    lr: lr as f32,
                    momentum: momentum as f32,
                    one_minus_dampening: (1.0 - dampening) as f32,
                    nesterov,
                    weight_decay: weight_decay as f32,
                    first: momentum != 0.0 && first,
                };
                on_threads(pieces, total, |x| fused::sgd(x.p, x.g, x.a, prep, h));
            }
            Rule::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
            } => {
                // The scalars of Optimizer::step's ops, in f64, rounded once.
                let step = self.steps as i32;
                let bc1 = 1.0 - beta1.powi(step);
                let h = fused::Adam {
                    lerp_weight: (1.0 - beta1) as f32,
                    beta2: beta2 as f32,
                    one_minus_beta2: (1.0 - beta2) as f32,
                    bias_correction2_sqrt: (1.0 - beta2.powi(step)).sqrt() as f32,
                    eps: eps as f32,
                    step_size: (lr / bc1) as f32,
                    weight_decay: if decoupled { 0.0 } else { weight_decay as f32 },
                    decay: (decoupled && weight_decay != 0.0)
                        .then_some((1.0 - lr * weight_decay) as f32),
                };
                on_threads(pieces, total, |x| {
                    fused::adam(x.p, x.g, x.a, x.b, prep, h, &aten_sqrt)
                });
            }
        }
        Ok(true)
    }

    /// The first parameter's state by kind, sorted (under ZeRO the one
    /// "parameter" is the rank's flat slice).
    pub fn first_state(&self) -> Vec<(&'static str, Tensor)> {
        let Some(state) = self.state.first() else {
            return Vec::new();
        };
        let mut out: Vec<_> = state.iter().map(|(k, t)| (*k, t.shallow_clone())).collect();
        out.sort_unstable_by_key(|(k, _)| *k);
        out
    }

    /// Replaces the first parameter's state (see [`Optimizer::first_state`])
    /// and the step count.
    pub fn set_first_state(&mut self, state: Vec<(&'static str, Tensor)>, steps: u64) {
        if let Some(first) = self.state.first_mut() {
            *first = state.into_iter().collect();
        }
        // The slice may have another length now: fresh scratch tensors.
        self.scratch.clear();
        self.steps = steps;
    }

    /// State tensors named `<param>.<state>` (for optimizer.safetensors).
    pub fn named_state(&self, params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for ((name, _), state) in params.iter().zip(&self.state) {
            let mut keys: Vec<_> = state.keys().copied().collect();
            keys.sort_unstable();
            for k in keys {
                out.push((format!("{name}.{k}"), state[k].shallow_clone()));
            }
        }
        out
    }

    /// Restores state saved by [`Optimizer::named_state`].
    pub fn load_state(
        &mut self,
        params: &[(String, Tensor)],
        saved: Vec<(String, Tensor)>,
        steps: u64,
    ) -> Result<()> {
        const KEYS: [&str; 3] = ["momentum_buffer", "exp_avg", "exp_avg_sq"];
        let mut saved: HashMap<String, Tensor> = saved.into_iter().collect();
        for ((name, p), state) in params.iter().zip(self.state.iter_mut()) {
            state.clear();
            for k in KEYS {
                if let Some(t) = saved.remove(&format!("{name}.{k}")) {
                    if t.size() != p.size() {
                        return Err(Error::OptimizerStateShape {
                            name: format!("{name}.{k}"),
                            got: t.size(),
                            want: p.size(),
                        });
                    }
                    state.insert(k, t.f_to_device(p.device()).ctx("loading optimizer state")?);
                }
            }
        }
        if let Some(extra) = saved.keys().next() {
            return Err(Error::OptimizerStateUnknown {
                name: extra.clone(),
            });
        }
        self.steps = steps;
        Ok(())
    }
}

/// Each parameter with its gradient (shallow), as the steps take them.
pub fn with_grads(params: &[(String, Tensor)]) -> Vec<(Tensor, Tensor)> {
    params
        .iter()
        .map(|(_, p)| (p.shallow_clone(), p.grad()))
        .collect()
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

/// Runs `f` (an elementwise step) over every piece: on this thread, or with
/// more than one intra-op thread and at least [`PARALLEL_MIN`] elements in
/// all, over that many threads (64 at most), each taking a contiguous run
/// of `total / threads` elements (pieces split where a run ends).
/// ATen's float sqrt (what `exp_avg_sq.sqrt()` runs in the tensor-op step
/// and in PyTorch's Adam) over `src` into `dst`, so the fused step's
/// denominators are the tensor ops' bit for bit (crate::fused). Should
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
        fused::exact_sqrt(&src[..n], &mut dst[..n]);
    }
}

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

/// A 0-dim tensor holding `v` with `like`'s kind and device (the multiplier
/// of a one-pass addcmul_).
fn scalar(v: f64, like: &Tensor) -> Result<Tensor> {
    Tensor::f_scalar_tensor(v, (like.kind(), like.device())).ctx("optimizer scalar")
}

#[cfg(test)]
mod tests;
