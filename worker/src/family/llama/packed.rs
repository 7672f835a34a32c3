//! Packed rows (`data.pack`): several rows of a sequences file share one
//! sample of T positions, each with its own positions and its own
//! attention, so each row's logits are those it has alone.
//!
//! A packed batch's inputs are i64 `[N, 2, T]`: `[:, 0]` the token ids,
//! `[:, 1]` each token's position within its own row (what transformers'
//! `DataCollatorWithFlattening` passes as `position_ids`). A row begins
//! where the position is 0 (padding after the last row is a row of its
//! own, whose targets are all ignored). The attention is the block-diagonal
//! causal mask: query i sees key j when both lie in the same row and
//! `j <= i` (and, under Mistral's window, `i - j < window`).

use tch::{Kind, TchError, Tensor};

/// A packed batch's ids and positions.
#[derive(Debug)]
pub struct Packed {
    /// `[N, T]` token ids.
    pub ids: Tensor,
    /// `[N, T]` each token's position within its row.
    pub positions: Tensor,
}

/// The ids and positions of packed inputs `[N, 2, T]`; None for plain ids
/// `[N, T]`.
pub fn split(inputs: &Tensor) -> Result<Option<Packed>, TchError> {
    if inputs.dim() != 3 {
        return Ok(None);
    }
    Ok(Some(Packed {
        ids: inputs.f_select(1, 0)?,
        positions: inputs.f_select(1, 1)?,
    }))
}

impl Packed {
    /// The attention mask `[N, 1, T, T]` (true: attend): same row, causal,
    /// within `window` where one is set.
    pub fn mask(&self, window: Option<i64>) -> Result<Tensor, TchError> {
        let t = self.positions.size().last().copied().unwrap_or(0);
        // Row ids: a row begins at each position 0.
        let rows = self.positions.f_eq(0)?.f_cumsum(-1, Kind::Int64)?;
        let same = rows.f_unsqueeze(-1)?.f_eq_tensor(&rows.f_unsqueeze(-2)?)?;
        let device = self.positions.device();
        let keys = Tensor::f_arange(t, (Kind::Int64, device))?.f_unsqueeze(0)?;
        let queries = keys.f_view([t, 1])?;
        let mut seen = keys.f_le_tensor(&queries)?;
        if let Some(w) = window {
            seen = seen.f_logical_and(&keys.f_gt_tensor(&queries.f_sub_scalar(w)?)?)?;
        }
        same.f_logical_and(&seen)?.f_unsqueeze(1)
    }
}

/// Packed inputs `[N, 2, T]` of `ids` and `positions` (each `[N, T]`).
pub fn inputs(ids: &Tensor, positions: &Tensor) -> Result<Tensor, TchError> {
    Tensor::f_stack(&[ids, positions], 1)
}
