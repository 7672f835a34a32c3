//! A pipeline stage of the Llama forward (issue 40): a range of its
//! blocks alone.

use super::Net;
use crate::error::{Result, TorchContext};
use tch::{TchError, Tensor};

impl Net {
    /// The forward of blocks `blocks` (0 the embedding, 1 + i decoder
    /// layer i, L + 1 the final norm): token ids in when it begins at 0,
    /// else hidden states `[N, T, H]`; hidden states out, or the final
    /// norm's output when it ends with the last block. The unfused path
    /// (a stage boundary falls between the fused path's residual add and
    /// its norm); packed rows are not staged.
    pub(super) fn try_stage(
        &self,
        x: &Tensor,
        blocks: std::ops::Range<usize>,
    ) -> Result<Tensor, TchError> {
        let layers = self.layers.len();
        let mut h = if blocks.start == 0 {
            Tensor::f_embedding(&self.embed, x, -1, false, false)?
        } else {
            x.shallow_clone()
        };
        let t = h.size().get(1).copied().unwrap_or(0);
        let rope = self.rope(0, t, &h)?;
        let first = blocks.start.max(1) - 1;
        let end = blocks.end.min(layers + 1).saturating_sub(1).max(first);
        for l in &self.layers[first..end] {
            let a = self.attention(l, &l.input_norm.forward(&h)?, &rope, None)?;
            h = h.f_add(&a)?;
            h = self.mlp_block(l, &h)?;
        }
        if blocks.end == layers + 2 {
            h = self.norm.forward(&h)?;
        }
        Ok(h)
    }
}

impl crate::family::Staged for Net {
    fn stage_forward(&self, x: &Tensor, blocks: std::ops::Range<usize>) -> Result<Tensor> {
        self.try_stage(x, blocks)
            .ctx("running a pipeline stage of the llama forward")
    }
}
