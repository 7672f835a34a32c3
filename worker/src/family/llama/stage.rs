//! A pipeline stage of the Llama forward (issue 40): a range of its
//! blocks alone.

use super::{packed, Net};
use crate::error::{Result, TorchContext};
use tch::{TchError, Tensor};

impl Net {
    /// The forward of blocks `blocks` (0 the embedding, 1 + i decoder
    /// layer i, L + 1 the final norm): token ids in when it begins at 0,
    /// else hidden states `[N, T, H]`; hidden states out, or the final
    /// norm's output when it ends with the last block. The unfused path
    /// (a stage boundary falls between the fused path's residual add and
    /// its norm). Packed rows (packed.rs): the first stage's `x` is the
    /// packed inputs `[N, 2, T]`; a later stage is given them as `inputs`
    /// for the rows' positions and block-diagonal attention.
    pub(super) fn try_stage(
        &self,
        x: &Tensor,
        blocks: std::ops::Range<usize>,
        inputs: Option<&Tensor>,
    ) -> Result<Tensor, TchError> {
        let layers = self.layers.len();
        let source = inputs.or((blocks.start == 0).then_some(x));
        let packed = match source {
            Some(i) => packed::split(i)?,
            None => None,
        };
        let mut h = if blocks.start == 0 {
            let ids = packed.as_ref().map_or(x, |p| &p.ids);
            self.embed_ids(ids)?
        } else {
            x.shallow_clone()
        };
        let t = h.size().get(1).copied().unwrap_or(0);
        let (rope, mask) = match &packed {
            None => (self.rope(0, t, &h)?, None),
            Some(p) => (
                self.rope_at(&p.positions, &h)?,
                Some(p.mask(self.sliding_window)?),
            ),
        };
        let first = blocks.start.max(1) - 1;
        let end = blocks.end.min(layers + 1).saturating_sub(1).max(first);
        for l in &self.layers[first..end] {
            let a = self.attention(l, &l.input_norm.forward(&h)?, &rope, mask.as_ref())?;
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
        self.stage_forward_with(x, blocks, None)
    }

    fn stage_forward_with(
        &self,
        x: &Tensor,
        blocks: std::ops::Range<usize>,
        inputs: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.try_stage(x, blocks, inputs)
            .ctx("running a pipeline stage of the llama forward")
    }
}
