//! `mlp`: torch.nn.Sequential(Linear, ReLU, ..., Linear) over the
//! flattened sample; parameter names as that Sequential's state_dict
//! (`0.weight`, `0.bias`, `2.weight`, ...).

use super::{check_blocks, Block, BuildTo, Built, Family, ParallelPlan, Staged};
use crate::error::{Result, TorchContext};
use crate::spec::{ModelKind, ModelSpec};
use tch::nn::{self, Module};
use tch::Tensor;

pub(super) struct Mlp;

impl Family for Mlp {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Mlp]
    }

    fn build(&self, to: &BuildTo<'_>) -> Result<Built> {
        let root = to.root;
        let mut widths = vec![to.shape.iter().product::<i64>()];
        widths.extend_from_slice(&to.spec.hidden);
        widths.push(to.classes);
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let p = root / (2 * i).to_string();
                let l = nn::linear(&p, w[0], w[1], Default::default());
                crate::family::model::made(&p.path("weight"), &l.ws)?;
                if let Some(b) = &l.bs {
                    crate::family::model::made(&p.path("bias"), b)?;
                }
                Ok(l)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Built::Staged(Box::new(Net { layers })))
    }

    fn builds_by_stage(&self) -> bool {
        true
    }

    /// One block per linear layer (`0`, `2`, ...: its weight and bias),
    /// the ReLU after it with it.
    fn blocks(&self, spec: &ModelSpec, params: &[String]) -> Result<Vec<Block>> {
        let blocks: Vec<Block> = (0..=spec.hidden.len())
            .map(|i| Block {
                name: (2 * i).to_string(),
                params: vec![format!("{}.weight", 2 * i), format!("{}.bias", 2 * i)],
            })
            .collect();
        check_blocks(&blocks, params)?;
        Ok(blocks)
    }

    /// A stage may begin at any layer; nothing splits.
    fn parallel_plan(&self, spec: &ModelSpec) -> Result<ParallelPlan> {
        Ok(ParallelPlan {
            stage_boundaries: (1..=spec.hidden.len()).collect(),
            splits: Vec::new(),
        })
    }
}

#[derive(Debug)]
struct Net {
    layers: Vec<nn::Linear>,
}

impl Module for Net {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let mut h = xs.flatten(1, -1);
        let last = self.layers.len().saturating_sub(1);
        for (i, l) in self.layers.iter().enumerate() {
            h = h.apply(l);
            if i < last {
                h = h.relu();
            }
        }
        h
    }
}

impl Staged for Net {
    /// Layers `blocks` (the sample flattened first at block 0; the ReLU
    /// after every layer but the model's last), as [`Module::forward`]
    /// computes them.
    fn stage_forward(&self, x: &Tensor, blocks: std::ops::Range<usize>) -> Result<Tensor> {
        let last = self.layers.len().saturating_sub(1);
        let mut h = if blocks.start == 0 {
            x.f_flatten(1, -1).ctx("running an mlp stage")?
        } else {
            x.shallow_clone()
        };
        for i in blocks.start..blocks.end.min(self.layers.len()) {
            let l = &self.layers[i];
            h = h
                .f_linear(&l.ws, l.bs.as_ref())
                .and_then(|y| if i < last { y.f_relu() } else { Ok(y) })
                .ctx("running an mlp stage")?;
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Issue 40: the mlp in stages computes its forward and gradients bit
    /// for bit (tch's Linear is the same `linear`).
    #[test]
    fn stages_chained_compute_the_whole_mlp() {
        let vs = nn::VarStore::new(Device::Cpu);
        let spec: ModelSpec = toml::from_str("kind = \"mlp\"\nhidden = [8, 6, 5]").unwrap();
        let Built::Staged(net) = Mlp
            .build(&BuildTo {
                spec: &spec,
                root: &vs.root(),
                shape: &[2, 3],
                classes: 4,
            })
            .unwrap()
        else {
            panic!("the mlp builds in stages")
        };
        let names: Vec<String> = vs.variables().into_keys().collect();
        assert_eq!(Mlp.blocks(&spec, &names).unwrap().len(), 4);
        assert_eq!(
            Mlp.parallel_plan(&spec).unwrap().stage_boundaries,
            vec![1, 2, 3]
        );
        let x = Tensor::arange(30, (Kind::Float, Device::Cpu)).view([5, 2, 3]) / 10.0;
        let grads = |out: Tensor| {
            for (_, v) in vs.variables() {
                let mut g = v.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            (&out * &out).sum(Kind::Float).backward();
            let mut vars: Vec<_> = vs.variables().into_iter().collect();
            vars.sort_by(|a, b| a.0.cmp(&b.0));
            let g: Vec<Tensor> = vars.iter().map(|(_, t)| t.grad().copy()).collect();
            (out.detach(), g)
        };
        let (whole, whole_g) = grads(net.forward_t(&x, true));
        let mid = net.stage_forward(&x, 0..2).unwrap();
        let (staged, staged_g) = grads(net.stage_forward(&mid, 2..4).unwrap());
        assert!(staged.equal(&whole));
        for (a, b) in staged_g.iter().zip(&whole_g) {
            assert!(a.equal(b));
        }
        // Another cut: the same output; a stage left out is not.
        let first = net.stage_forward(&x, 0..1).unwrap();
        assert!(net.stage_forward(&first, 1..4).unwrap().equal(&whole));
        let skipped = net.stage_forward(&net.stage_forward(&x, 0..2).unwrap(), 3..4);
        assert!(skipped.is_err(), "a width mismatch is an error");
    }
}
