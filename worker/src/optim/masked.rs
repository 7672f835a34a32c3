//! The masked step (CUDA graphs): the rule's numbers as device tensors, neutral if skipped.
//!
//! Issue 19: the sync step as a CUDA graph cannot read the gradient norm
//! back to decide whether to step, so every per-step number (the learning
//! rate, Adam's bias corrections, the momentum and decay factors: the
//! rule's [`Coefs`]) comes from a device tensor that the graph reads, and a
//! non-finite step turns each of them into its *neutral* value
//! ([`Coefs::skipped`]): the one that leaves the parameters and the
//! optimizer state exactly as they were (a factor 1, an addend 0).
//!
//! The step itself is the tensor-op back-end's (tensor.rs) with those
//! numbers as 0-dim float32 device tensors instead of host scalars. ATen
//! computes both the same way (the scalar is rounded to float32 first),
//! except one division: on CUDA a tensor divided by a host scalar is
//! multiplied by the scalar's float32 reciprocal, so there `reciprocal`
//! makes this step do the same.

use super::rule::{AdamCoefs, Coefs, SgdCoefs};
use super::tensor::Num;
use super::{Optimizer, Rule};
use crate::error::{Error, Result, TorchContext};
use tch::{TchError, Tensor};

/// The per-step numbers of a masked step and what each becomes when the
/// step is skipped.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskedCoefs {
    pub values: Vec<f64>,
    pub neutral: Vec<f64>,
}

/// A per-step number as a 0-dim float32 tensor on the device (a view of
/// the coefficient vector).
struct Dev {
    t: Tensor,
    /// `t` holds the number's reciprocal, and dividing by the number
    /// multiplies by it (ATen's division by a host scalar on CUDA).
    reciprocal: bool,
}

impl Num for Dev {
    fn tensor(&self, _like: &Tensor) -> Result<Tensor> {
        Ok(self.t.shallow_clone())
    }

    fn mul_(&self, t: &mut Tensor) -> Result<Tensor, TchError> {
        t.f_mul_(&self.t)
    }

    fn mul_out(&self, out: &Tensor, t: &Tensor) -> Result<Tensor, TchError> {
        t.f_mul_out(out, &self.t)
    }

    fn lerp_(&self, t: &mut Tensor, end: &Tensor) -> Result<Tensor, TchError> {
        t.f_lerp_tensor_(end, &self.t)
    }

    fn div_(&self, t: &mut Tensor) -> Result<Tensor, TchError> {
        if self.reciprocal {
            t.f_mul_(&self.t)
        } else {
            t.f_div_(&self.t)
        }
    }
}

/// The `K` elements of the coefficient vector `coefs`, as views.
fn views<const K: usize>(coefs: &Tensor) -> Result<[Dev; K]> {
    let mut out: [Dev; K] = std::array::from_fn(|_| Dev {
        t: Tensor::new(),
        reciprocal: false,
    });
    for (i, d) in out.iter_mut().enumerate() {
        d.t = coefs
            .f_select(0, i as i64)
            .ctx("an optimizer coefficient")?;
    }
    Ok(out)
}

impl Optimizer {
    /// Whether every parameter has its state, which the masked step needs
    /// (SGD's first step copies the gradient into a new momentum buffer;
    /// a graph cannot allocate state it then keeps).
    pub fn has_state(&self) -> bool {
        let keys = self.rule.state_keys();
        !self.state.is_empty()
            && self
                .state
                .iter()
                .all(|s| keys.iter().all(|k| s.contains_key(k)))
    }

    /// The state and scratch tensors the masked step reads and writes
    /// (`optimizer.<i>.<state>`, `optimizer.<i>.scratch`, `.scratch2`):
    /// a captured sync graph holds their addresses.
    pub fn graph_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, state) in self.state.iter().enumerate() {
            for (k, t) in super::sorted(state) {
                out.push((format!("optimizer.{i}.{k}"), t));
            }
        }
        for (i, scratch) in self.scratch.iter().enumerate() {
            if let Some((a, b)) = scratch {
                out.push((format!("optimizer.{i}.scratch"), a.shallow_clone()));
                if let Some(b) = b {
                    out.push((format!("optimizer.{i}.scratch2"), b.shallow_clone()));
                }
            }
        }
        out
    }

    /// The numbers of step `self.steps + 1` at `lr` in the layout
    /// [`Optimizer::step_masked`] reads: the rule's
    /// ([`Coefs::to_vec`]), and those of a skipped step.
    pub fn masked_coefs(&self, lr: f64) -> MaskedCoefs {
        if self.is_aten_fused() {
            return self.aten_coefs(lr);
        }
        let c = self.rule.coefs(self.steps + 1, lr);
        MaskedCoefs {
            values: c.to_vec(),
            neutral: c.skipped().to_vec(),
        }
    }

    /// One step of every (parameter, gradient) pair with its numbers read
    /// from `coefs` (float32 on the parameters' device, the layout of
    /// [`Optimizer::masked_coefs`], already neutral if the step is
    /// skipped); the gradients must be finite (a skipped step's are
    /// zeroed). Reads nothing back to the host and allocates nothing after
    /// the first step. Does not count the step: the caller does once it
    /// knows the step was not skipped.
    pub fn step_masked(
        &mut self,
        pairs: &[(Tensor, Tensor)],
        coefs: &Tensor,
        reciprocal: bool,
    ) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let want = if self.is_aten_fused() {
            super::aten_fused::AtenCoefs::<f64>::LEN
        } else {
            self.rule.coef_count()
        };
        if coefs.numel() != want || !self.has_state() || self.state.len() != pairs.len() {
            return Err(Error::Graph {
                what: "the masked optimizer step",
                reason: format!(
                    "needs {want} coefficients and the state of {} parameters (got {} and {})",
                    pairs.len(),
                    coefs.numel(),
                    self.state.len()
                ),
            });
        }
        if self.is_aten_fused() {
            return self.step_aten_masked(pairs, coefs);
        }
        let on_device = match self.rule {
            Rule::Sgd(rule) => Coefs::Sgd(rule, SgdCoefs::from_array(views(coefs)?)),
            Rule::Adam(rule) => {
                let mut c = AdamCoefs::from_array(views(coefs)?);
                // sqrt(v) / bc2_sqrt, as ATen divides by a host scalar on
                // this device.
                if reciprocal {
                    c.bc2_sqrt = Dev {
                        t: c.bc2_sqrt.t.f_reciprocal().ctx("adam bias correction")?,
                        reciprocal: true,
                    };
                }
                Coefs::Adam(rule, c)
            }
        };
        self.tensor_ops(pairs, &on_device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{OptimizerKind, OptimizerSpec};
    use tch::{Device, Kind};

    fn spec(kind: OptimizerKind, f: impl FnOnce(&mut OptimizerSpec)) -> OptimizerSpec {
        let mut s: OptimizerSpec = toml::from_str("kind = \"sgd\"\nlr = 0.1").unwrap();
        s.kind = kind;
        f(&mut s);
        s
    }

    /// Parameters and gradients of three shapes, `seed`ed.
    fn pairs(seed: i64) -> Vec<(Tensor, Tensor)> {
        tch::manual_seed(seed);
        [vec![7], vec![30, 11], vec![5, 3, 2]]
            .into_iter()
            .map(|s| {
                let o = (Kind::Float, Device::Cpu);
                (
                    Tensor::randn(s.as_slice(), o),
                    Tensor::randn(s.as_slice(), o),
                )
            })
            .collect()
    }

    fn deep(ps: &[(Tensor, Tensor)]) -> Vec<(Tensor, Tensor)> {
        ps.iter().map(|(p, g)| (p.copy(), g.copy())).collect()
    }

    fn coefs(c: &MaskedCoefs, skip: bool) -> Tensor {
        let v = if skip { &c.neutral } else { &c.values };
        let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
        Tensor::from_slice(&v)
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = Vec::try_from(t.flatten(0, -1)).unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn every_spec() -> Vec<OptimizerSpec> {
        use OptimizerKind::*;
        vec![
            spec(Sgd, |_| {}),
            spec(Sgd, |s| {
                s.momentum = 0.9;
                s.weight_decay = Some(0.01);
            }),
            spec(Sgd, |s| {
                s.momentum = 0.9;
                s.nesterov = true;
            }),
            spec(Sgd, |s| {
                s.momentum = 0.8;
                s.dampening = 0.25;
                s.weight_decay = Some(0.1);
            }),
            spec(Adam, |_| {}),
            spec(Adam, |s| s.weight_decay = Some(0.05)),
            spec(Adamw, |_| {}),
            spec(Adamw, |s| s.weight_decay = Some(0.1)),
            spec(Adam, |s| {
                s.weight_decay = Some(0.05);
                s.fused = true;
            }),
            spec(Adamw, |s| {
                s.weight_decay = Some(0.1);
                s.fused = true;
            }),
        ]
    }

    /// Four steps at changing learning rates: the masked step ends at the
    /// tensor-op step's parameters and state bit for bit (on the CPU both
    /// divide truly; with `fused`, both are PyTorch's fused kernel, one
    /// with the learning rate and step as tensors), and a step with the
    /// neutral numbers and zeroed gradients changes nothing at all.
    #[test]
    fn equals_the_tensor_op_step_and_a_skipped_step_changes_nothing() {
        for s in every_spec() {
            let plain_p = pairs(1);
            let masked_p = deep(&plain_p);
            let mut plain = Optimizer::new(&s, 3);
            let mut masked = Optimizer::new(&s, 3);
            for step in 0..4 {
                let lr = 0.1 / (1.0 + step as f64);
                let fresh = pairs(10 + step);
                for (((_, pg), (_, mg)), (_, f)) in plain_p.iter().zip(&masked_p).zip(&fresh) {
                    pg.shallow_clone().copy_(f);
                    mg.shallow_clone().copy_(f);
                }
                if step == 0 {
                    // The masked step needs the state the first step makes.
                    assert!(
                        !masked.has_state() || s.momentum == 0.0 && s.kind == OptimizerKind::Sgd
                    );
                    masked.step_pairs(&masked_p, lr).unwrap();
                } else {
                    assert!(masked.has_state(), "{s:?}");
                    let c = masked.masked_coefs(lr);
                    masked
                        .step_masked(&masked_p, &coefs(&c, false), false)
                        .unwrap();
                    masked.steps += 1;
                }
                plain.step_pairs(&plain_p, lr).unwrap();
            }
            for ((a, _), (b, _)) in plain_p.iter().zip(&masked_p) {
                assert_eq!(bits(a), bits(b), "{s:?}: parameters");
            }
            let (sa, sb) = (plain.first_state(), masked.first_state());
            assert_eq!(sa.len(), sb.len());
            for ((ka, a), (_, b)) in sa.iter().zip(&sb) {
                assert_eq!(bits(a), bits(b), "{s:?}: {ka}");
            }
            // A skipped step: zeroed gradients, neutral numbers.
            let before: Vec<_> = masked_p.iter().map(|(p, _)| bits(p)).collect();
            let state: Vec<_> = masked.first_state().iter().map(|(_, t)| bits(t)).collect();
            for (_, g) in &masked_p {
                let _ = g.shallow_clone().zero_();
            }
            let c = masked.masked_coefs(0.5);
            masked
                .step_masked(&masked_p, &coefs(&c, true), false)
                .unwrap();
            let after: Vec<_> = masked_p.iter().map(|(p, _)| bits(p)).collect();
            assert_eq!(before, after, "{s:?}: a skipped step moved parameters");
            let now: Vec<_> = masked.first_state().iter().map(|(_, t)| bits(t)).collect();
            assert_eq!(state, now, "{s:?}: a skipped step moved the state");
        }
    }

    /// Adam's tensor-op step ([`Optimizer::step_pairs`], op for op) of
    /// parameter `p` with gradient `g` and moments `m`, `v` (all updated in
    /// place); with `cuda_division` its one division by a host scalar,
    /// sqrt(v) / bc2_sqrt, is done as ATen does it on CUDA: times the
    /// scalar's float32 reciprocal.
    fn adam_step(
        rule: &Rule,
        (p, g): &(Tensor, Tensor),
        (m, v): &(Tensor, Tensor),
        step: i32,
        lr: f64,
        cuda_division: bool,
    ) {
        let Rule::Adam(crate::optim::rule::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
        }) = *rule
        else {
            panic!("not adam: {rule:?}");
        };
        let _guard = tch::no_grad_guard();
        let (mut p, mut g) = (p.shallow_clone(), g.shallow_clone());
        let (mut m, mut v) = (m.shallow_clone(), v.shallow_clone());
        if decoupled {
            if weight_decay != 0.0 {
                let _ = p.f_mul_scalar_(1.0 - lr * weight_decay).unwrap();
            }
        } else if weight_decay != 0.0 {
            let _ = g.f_add_(&p.f_mul_scalar(weight_decay).unwrap()).unwrap();
        }
        let _ = m.f_lerp_(&g, 1.0 - beta1).unwrap();
        let _ = v.f_mul_scalar_(beta2).unwrap();
        let sq = g.f_mul(&g).and_then(|t| t.f_mul_scalar(1.0 - beta2));
        let _ = v.f_add_(&sq.unwrap()).unwrap();
        let bc1 = 1.0 - beta1.powi(step);
        let bc2_sqrt = (1.0 - beta2.powi(step)).sqrt();
        let mut d = v.f_sqrt().unwrap();
        if cuda_division {
            let _ = d
                .f_mul_scalar_(f64::from(1.0f32 / bc2_sqrt as f32))
                .unwrap();
        } else {
            let _ = d.f_div_scalar_(bc2_sqrt).unwrap();
        }
        let _ = d.f_add_scalar_(eps).unwrap();
        let update = m.f_div(&d).and_then(|u| u.f_mul_scalar(lr / bc1));
        let _ = p.f_sub_(&update.unwrap()).unwrap();
    }

    /// `reciprocal = true` (CUDA's rounding of a division by a host
    /// scalar) on the CPU, against the tensor-op step: SGD divides by no
    /// scalar, so its masked step equals `step_pairs` bit for bit. Adam's
    /// and AdamW's equal, parameters and moments bit for bit, the
    /// tensor-op step with that one division done as on CUDA
    /// ([`adam_step`], itself checked bit for bit against `step_pairs`
    /// with the CPU's division), and stay within 1e-6 (relative) of the
    /// CPU's tensor-op step while differing from it in some bits (so the
    /// data exercise the rounding). (The fused kernel divides inside
    /// itself: `reciprocal` does not apply to it.)
    #[test]
    fn the_reciprocal_step_equals_the_tensor_op_step_with_cudas_division() {
        let mut rounding_differs = false;
        for s in every_spec().into_iter().filter(|s| !s.fused) {
            let plain_p = pairs(1);
            let masked_p = deep(&plain_p);
            let mut plain = Optimizer::new(&s, 3);
            let mut masked = Optimizer::new(&s, 3);
            let rule = plain.rule;
            let adam = matches!(rule, Rule::Adam(_));
            // The references: the CPU's division throughout, and CUDA's
            // from the second step on (the masked run's first step is the
            // tensor-op step, which makes the state).
            let (cpu_p, cuda_p) = (deep(&plain_p), deep(&plain_p));
            let moments = |ps: &[(Tensor, Tensor)]| -> Vec<(Tensor, Tensor)> {
                ps.iter()
                    .map(|(p, _)| (p.zeros_like(), p.zeros_like()))
                    .collect()
            };
            let (cpu_m, cuda_m) = (moments(&cpu_p), moments(&cuda_p));
            for step in 0..4 {
                let lr = 0.1 / (1.0 + step as f64);
                let fresh = pairs(10 + step);
                for group in [&plain_p, &masked_p, &cpu_p, &cuda_p] {
                    for ((_, g), (_, f)) in group.iter().zip(&fresh) {
                        g.shallow_clone().copy_(f);
                    }
                }
                if step == 0 {
                    masked.step_pairs(&masked_p, lr).unwrap();
                } else {
                    let c = masked.masked_coefs(lr);
                    masked
                        .step_masked(&masked_p, &coefs(&c, false), true)
                        .unwrap();
                    masked.steps += 1;
                }
                plain.step_pairs(&plain_p, lr).unwrap();
                if adam {
                    let n = step as i32 + 1;
                    for (pg, mv) in cpu_p.iter().zip(&cpu_m) {
                        adam_step(&rule, pg, mv, n, lr, false);
                    }
                    for (pg, mv) in cuda_p.iter().zip(&cuda_m) {
                        adam_step(&rule, pg, mv, n, lr, step > 0);
                    }
                }
            }
            let params = |ps: &[(Tensor, Tensor)]| -> Vec<Vec<u32>> {
                ps.iter().map(|(p, _)| bits(p)).collect()
            };
            let state = |o: &Optimizer| -> Vec<Vec<u32>> {
                o.first_state().iter().map(|(_, t)| bits(t)).collect()
            };
            // Bit for bit, or how many values differ.
            let same = |a: Vec<Vec<u32>>, b: Vec<Vec<u32>>, what: &str| {
                let differ = a
                    .iter()
                    .flatten()
                    .zip(b.iter().flatten())
                    .filter(|(x, y)| x != y)
                    .count();
                assert_eq!(a.len(), b.len(), "{s:?}: {what}");
                assert_eq!(differ, 0, "{s:?}: {what}: {differ} values differ");
            };
            if !adam {
                same(params(&masked_p), params(&plain_p), "parameters");
                same(state(&masked), state(&plain), "state");
                continue;
            }
            // The references are the tensor-op step, op for op.
            let first = |m: &[(Tensor, Tensor)]| vec![bits(&m[0].0), bits(&m[0].1)];
            same(params(&cpu_p), params(&plain_p), "the reference");
            same(first(&cpu_m), state(&plain), "the reference's moments");
            // With CUDA's division: bit for bit.
            same(params(&cuda_p), params(&masked_p), "parameters");
            same(first(&cuda_m), state(&masked), "moments");
            // Against the CPU's division: rounding only.
            for ((a, _), (b, _)) in masked_p.iter().zip(&plain_p) {
                let d = (a - b).abs().max().double_value(&[]);
                let rel = d / b.abs().max().double_value(&[]);
                assert!(rel <= 1e-6, "{s:?}: {rel:e}");
                rounding_differs |= d > 0.0;
            }
        }
        assert!(
            rounding_differs,
            "the reciprocal never changed a rounding: the test does not tell the branches apart"
        );
    }

    #[test]
    fn refuses_without_state_or_with_the_wrong_numbers() {
        let s = spec(OptimizerKind::Adam, |_| {});
        let ps = pairs(2);
        let mut o = Optimizer::new(&s, 3);
        let c = o.masked_coefs(0.1);
        let e = o.step_masked(&ps, &coefs(&c, false), false).unwrap_err();
        assert!(e.to_string().contains("needs 6 coefficients"), "{e}");
        o.step_pairs(&ps, 0.1).unwrap();
        let e = o
            .step_masked(&ps, &Tensor::from_slice(&[1f32, 2.0]), false)
            .unwrap_err();
        assert!(e.to_string().contains("got 2"), "{e}");
    }

    /// Adam's numbers follow PyTorch's bias corrections for the next step.
    #[test]
    fn adam_numbers_are_the_next_steps() {
        let s = spec(OptimizerKind::Adamw, |s| s.weight_decay = Some(0.1));
        let mut o = Optimizer::new(&s, 1);
        o.steps = 2;
        let c = o.masked_coefs(0.01);
        let (b1, b2) = (0.9f64, 0.999f64);
        assert_eq!(c.values[0], 1.0 - 0.01 * 0.1);
        assert_eq!(c.values[4], (1.0 - b2.powi(3)).sqrt());
        assert_eq!(c.values[5], 0.01 / (1.0 - b1.powi(3)));
        assert_eq!(c.neutral, vec![1.0, 0.0, 1.0, 0.0, c.values[4], 0.0]);
    }
}
