//! The Llama family's layers: a linear layer as torch.nn.Linear stores
//! it, Hugging Face's LlamaRMSNorm, and a decoder layer's parts.

use crate::error::{Result, TorchContext};
use crate::family::model::made;
use tch::nn::{self, Init};
use tch::{Kind, TchError, Tensor};

/// A linear layer as torch.nn.Linear stores it: weight `[out, in]`.
#[derive(Debug)]
pub(super) struct Linear {
    pub(super) weight: Tensor,
    pub(super) bias: Option<Tensor>,
    /// Tensor parallelism: rows several ranks hold (tensor.rs).
    pub(super) shared: Option<super::tensor::SharedRows>,
}

impl Linear {
    /// Weight drawn from `init`, zero bias.
    pub(super) fn new(
        p: nn::Path<'_>,
        input: i64,
        output: i64,
        bias: bool,
        init: Init,
    ) -> Result<Self> {
        let weight = p
            .f_var("weight", &[output, input], init)
            .ctx("creating the llama parameters")?;
        made(&p.path("weight"), &weight)?;
        let bias = bias
            .then(|| p.f_var("bias", &[output], Init::Const(0.0)))
            .transpose()
            .ctx("creating the llama parameters")?;
        if let Some(b) = &bias {
            made(&p.path("bias"), b)?;
        }
        Ok(Self {
            weight,
            bias,
            shared: None,
        })
    }

    /// The weight and bias as the forward uses them: through
    /// [`super::tensor::SharedRows`] when several tensor ranks hold them.
    fn params(&self) -> Result<(Tensor, Option<Tensor>), TchError> {
        match &self.shared {
            None => Ok((
                self.weight.shallow_clone(),
                self.bias.as_ref().map(|b| b.shallow_clone()),
            )),
            Some(s) => Ok((
                s.of(&self.weight)?,
                self.bias.as_ref().map(|b| s.of(b)).transpose()?,
            )),
        }
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let (w, b) = self.params()?;
        x.f_linear(&w, b.as_ref())
    }

    /// The outputs in the order `rows` gives (a permutation of the rows).
    pub(super) fn forward_rows(&self, x: &Tensor, rows: &Tensor) -> Result<Tensor, TchError> {
        let (w, b) = self.params()?;
        let bias = b.map(|b| b.f_index_select(0, rows)).transpose()?;
        x.f_linear(&w.f_index_select(0, rows)?, bias.as_ref())
    }
}

/// Hugging Face's LlamaRMSNorm.
#[derive(Debug)]
pub(super) struct RmsNorm {
    pub(super) weight: Tensor,
    pub(super) eps: f64,
    /// Tensor parallelism: a norm over each rank's own heads (Qwen3's q
    /// and k norms), whose weight is replicated and its gradient summed
    /// over the group (`f` on the weight; tensor.rs).
    pub(super) partial: Option<crate::comm::tensor_ops::TensorGroupCell>,
}

impl RmsNorm {
    pub(super) fn new(p: nn::Path<'_>, width: i64, eps: f64) -> Result<Self> {
        let weight = p
            .f_var("weight", &[width], Init::Const(1.0))
            .ctx("creating the llama parameters")?;
        made(&p.path("weight"), &weight)?;
        Ok(Self {
            weight,
            eps,
            partial: None,
        })
    }

    /// `weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`.
    ///
    /// A float32 `x` (the residual stream, also under autocast: the
    /// embedding's output plus the projections') goes through libtorch's
    /// `_fused_rms_norm`: on the CPU that is the same composite of ops as
    /// below (the same numbers to the bit, forward and backward), on CUDA
    /// one kernel forward and one backward instead of about six and ten
    /// (docs/SEMANTICS.md). Another type keeps transformers' ops, whose
    /// result is float32 where the fused op's would be `x`'s type.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let kind = x.kind();
        let weight = match &self.partial {
            Some(g) => g.get()?.copy(&self.weight)?,
            None => self.weight.shallow_clone(),
        };
        if kind == Kind::Float && weight.kind() == Kind::Float {
            let width = weight.size();
            return Ok(x
                .f_internal_fused_rms_norm(width.as_slice(), Some(&weight), self.eps)?
                .0);
        }
        let x32 = x.f_to_kind(Kind::Float)?;
        let variance =
            x32.f_pow_tensor_scalar(2)?
                .f_mean_dim(Some([-1i64].as_slice()), true, None::<Kind>)?;
        let normed = x32.f_mul(&variance.f_add_scalar(self.eps)?.f_rsqrt()?)?;
        weight.f_mul(&normed.f_to_kind(kind)?)
    }
}

#[derive(Debug)]
pub(super) struct Layer {
    pub(super) q: Linear,
    pub(super) k: Linear,
    pub(super) v: Linear,
    pub(super) o: Linear,
    /// Qwen3's RMSNorms over each head of q and of k (None: Llama's).
    pub(super) q_norm: Option<RmsNorm>,
    pub(super) k_norm: Option<RmsNorm>,
    pub(super) gate: Linear,
    pub(super) up: Linear,
    pub(super) down: Linear,
    pub(super) input_norm: RmsNorm,
    pub(super) post_norm: RmsNorm,
}
