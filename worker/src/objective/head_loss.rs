//! The language-model head and its cross-entropy in one pass, with the
//! backward done on the way.
//!
//! Autograd's path for `cross_entropy(features @ W^T, targets, sum)` keeps
//! the `[M, vocab]` logits alive until the backward, and walks them about
//! seven times: the matmul writes them, log_softmax reads and writes them,
//! the backward zero-fills a tensor of their size for nll_loss, scatters
//! into it, and log_softmax's backward reads two and writes one. With a
//! vocabulary of thousands and a hidden size of hundreds that is as much
//! time as the model's layers (on one CPU core: 37 ms of a 76 ms
//! micro-step for a 2-layer, 128-wide Llama over 4,096 tokens).
//!
//! The gradient of a summed cross-entropy with respect to the logits is
//! known in closed form, `softmax(logits) - onehot(target)` (zero for an
//! ignored target), so [`linear_cross_entropy`] computes it at once, a
//! block of rows at a time, while the block is in cache: logits (matmul),
//! log-softmax (one fused kernel), the loss terms (a gather), the gradient
//! in place (`exp`, the mask, minus one at each target), then the two
//! matmuls of the head's backward: the features' gradient for this block,
//! and the head weight's gradient added into `W.grad` in place. The full
//! logits never exist. What the caller gets back is the loss sum and the
//! features' gradient, which it sends into the rest of the graph with one
//! backward ([`backward_into`]).
//!
//! The arithmetic is the same function as autograd's, rounded differently:
//! the loss terms and gradients agree within float rounding (the tests
//! compare both paths; the LM training tests compare with PyTorch). Used
//! for `normalize = "global_count"` in fp32 only, where the backward's
//! upstream gradient is exactly 1; autocast and the per-micro-batch means
//! take autograd's path (docs/SEMANTICS.md).

use crate::error::{Result, TorchContext};
use tch::{Device, Kind, Tensor};

/// Rows per block on the CPU: about 4 MiB of fp32 logits, so a block's
/// logits stay in cache between the passes, but never fewer than 64 rows
/// (matmuls of fewer rows lose efficiency). On a GPU the block is as many
/// rows as make 256 MiB of logits: the point there is memory, not cache.
pub fn block_rows(vocab: i64, device: Device) -> i64 {
    let vocab = vocab.max(1);
    match device {
        Device::Cpu => ((4 << 20) / 4 / vocab).max(64),
        _ => ((256 << 20) / 4 / vocab).max(1024),
    }
}

/// What [`linear_cross_entropy`] computed.
#[derive(Debug)]
pub struct HeadLoss {
    /// Σ over the targets that are not -100 of -log softmax(logits)[target],
    /// fp64, 0-dim, no graph.
    pub sum: Tensor,
    /// d sum / d features, `[M, H]`, fp32.
    pub features_grad: Tensor,
}

/// The summed cross-entropy of `features @ weight^T` against `targets`
/// (-100 ignored), with its gradient: the weight's is added into
/// `weight_grad` (`[vocab, H]`, in place, as autograd's accumulation
/// would), the features' returned. `features` is `[M, H]` fp32 without a
/// graph, `targets` `[M]` i64; `all_counted` says no target is -100 (the
/// caller knows its batch's count), which saves a pass per block.
/// `rows` is the block size ([`block_rows`]).
pub fn linear_cross_entropy(
    features: &Tensor,
    weight: &Tensor,
    weight_grad: &Tensor,
    targets: &Tensor,
    all_counted: bool,
    rows: i64,
) -> Result<HeadLoss> {
    let _guard = tch::no_grad_guard();
    run(
        features,
        weight,
        weight_grad,
        targets,
        all_counted,
        rows.max(1),
    )
    .ctx("computing the loss and the head's gradient")
}

fn run(
    x: &Tensor,
    w: &Tensor,
    w_grad: &Tensor,
    targets: &Tensor,
    all_counted: bool,
    rows: i64,
) -> Result<HeadLoss, tch::TchError> {
    let (m, h) = x.size2()?;
    let (vocab, _) = w.size2()?;
    let device = x.device();
    let float = (Kind::Float, device);
    let block = rows.min(m.max(1));
    let w_t = w.f_transpose(0, 1)?;
    let logits = Tensor::f_empty([block, vocab], float)?;
    let grad = Tensor::f_empty([block, vocab], float)?;
    let features_grad = Tensor::f_empty([m, h], float)?;
    let mut sum = Tensor::f_zeros([], (Kind::Double, device))?;
    let mut w_grad = w_grad.shallow_clone();
    // Where each row's target is (an ignored one points at column 0, whose
    // term the row weight then zeroes), and what is subtracted there.
    let (at, weights) = if all_counted {
        (targets.f_unsqueeze(1)?, None)
    } else {
        let counted = targets.f_ne(-100)?;
        (
            targets.f_clamp_min(0)?.f_unsqueeze(1)?,
            Some(counted.f_to_kind(Kind::Float)?.f_unsqueeze(1)?),
        )
    };
    let minus_one = Tensor::f_full([block, 1], -1.0, float)?;
    let mut start = 0;
    while start < m {
        let n = block.min(m - start);
        let xb = x.f_narrow(0, start, n)?;
        let at_b = at.f_narrow(0, start, n)?;
        let lb = logits.f_narrow(0, 0, n)?;
        let mut gb = grad.f_narrow(0, 0, n)?;
        let _ = xb.f_mm_out(&lb, &w_t)?;
        let _ = lb.f_internal_log_softmax_out(&gb, 1, false)?;
        // The loss terms: -log_softmax at the targets (masked).
        let picked = gb.f_gather(1, &at_b, false)?;
        let picked = match &weights {
            Some(wb) => picked.f_mul(&wb.f_narrow(0, start, n)?)?,
            None => picked,
        };
        sum = sum.f_sub(&picked.f_sum(Kind::Double)?)?;
        // The gradient: softmax, zero on ignored rows, minus one at the target.
        let _ = gb.f_exp_()?;
        match &weights {
            Some(wb) => {
                let wb = wb.f_narrow(0, start, n)?;
                let _ = gb.f_mul_(&wb)?;
                let _ = gb.f_scatter_add_(1, &at_b, &wb.f_neg()?)?;
            }
            None => {
                let _ = gb.f_scatter_add_(1, &at_b, &minus_one.f_narrow(0, 0, n)?)?;
            }
        }
        let _ = gb.f_mm_out(&features_grad.f_narrow(0, start, n)?, w)?;
        let _ = w_grad.f_addmm_(&gb.f_transpose(0, 1)?, &xb)?;
        start += n;
    }
    Ok(HeadLoss { sum, features_grad })
}

/// [`linear_cross_entropy`] with the head split by vocabulary rows over a
/// tensor group (issue 42; Megatron-LM's vocabulary-parallel
/// cross-entropy): this rank holds rows `start..start + weight rows`. Per
/// block of rows: the logits of this rank's columns, the max of each row
/// over the group (all-reduce max), then the sum of exponentials and the
/// target's logit over the group (one all-reduce of both); each row's loss
/// is `log(sum) + max - target logit`, the same on every rank. The
/// gradient is local: `softmax - onehot` on this rank's columns, its
/// matmuls giving the weight's gradient (this rank's rows) and a partial
/// gradient of the features, summed over the group once at the end (the
/// head's input is replicated). The loss is counted once by the caller.
pub fn vocab_parallel_cross_entropy(
    features: &Tensor,
    weight: &Tensor,
    weight_grad: &Tensor,
    targets: &Tensor,
    start: i64,
    group: &crate::comm::tensor_ops::TensorGroup,
    rows: i64,
) -> Result<HeadLoss> {
    let _guard = tch::no_grad_guard();
    run_split(
        features,
        weight,
        weight_grad,
        targets,
        start,
        group,
        rows.max(1),
    )
    .ctx("computing the vocabulary-parallel loss and the head's gradient")
}

fn run_split(
    x: &Tensor,
    w: &Tensor,
    w_grad: &Tensor,
    targets: &Tensor,
    start: i64,
    group: &crate::comm::tensor_ops::TensorGroup,
    rows: i64,
) -> Result<HeadLoss, tch::TchError> {
    use crate::comm::tensor_ops::Reduce;
    let (m, h) = x.size2()?;
    let (width, _) = w.size2()?;
    let device = x.device();
    let features_grad = Tensor::f_zeros([m, h], (Kind::Float, device))?;
    let mut sum = Tensor::f_zeros([], (Kind::Double, device))?;
    let mut w_grad = w_grad.shallow_clone();
    let w_t = w.f_transpose(0, 1)?;
    let counted = targets.f_ne(-100)?;
    let local = targets.f_sub_scalar(start)?;
    // The target is among this rank's columns.
    let here = counted
        .f_logical_and(&local.f_ge(0)?)?
        .f_logical_and(&local.f_lt(width)?)?;
    let at = local
        .f_masked_fill(&here.f_logical_not()?, 0)?
        .f_unsqueeze(1)?;
    let here = here.f_to_kind(Kind::Float)?.f_unsqueeze(1)?;
    let counted = counted.f_to_kind(Kind::Float)?.f_unsqueeze(1)?;
    let block = rows.min(m.max(1));
    let mut first = 0;
    while first < m {
        let n = block.min(m - first);
        let xb = x.f_narrow(0, first, n)?;
        let at_b = at.f_narrow(0, first, n)?;
        let here_b = here.f_narrow(0, first, n)?;
        let counted_b = counted.f_narrow(0, first, n)?;
        let logits = xb.f_mm(&w_t)?;
        let max = logits.f_amax([1i64].as_slice(), true)?.f_contiguous()?;
        group.all_reduce_(&max, Reduce::Max)?;
        let mut e = logits.f_sub(&max)?;
        let _ = e.f_exp_()?;
        let target = logits.f_gather(1, &at_b, false)?.f_mul(&here_b)?;
        let both = Tensor::f_cat(
            &[
                e.f_sum_dim_intlist([1i64].as_slice(), true, None::<Kind>)?,
                target,
            ],
            1,
        )?
        .f_contiguous()?;
        group.all_reduce_(&both, Reduce::Sum)?;
        let total = both.f_narrow(1, 0, 1)?;
        let target = both.f_narrow(1, 1, 1)?;
        // -log softmax at the target: log(sum) + max - target logit.
        let loss = total
            .f_log()?
            .f_add(&max)?
            .f_sub(&target)?
            .f_mul(&counted_b)?;
        sum = sum.f_add(&loss.f_sum(Kind::Double)?)?;
        // softmax - onehot on this rank's columns, zero for ignored rows.
        let _ = e.f_div_(&total)?;
        let _ = e.f_mul_(&counted_b)?;
        let _ = e.f_scatter_add_(1, &at_b, &here_b.f_neg()?)?;
        let _ = e.f_mm_out(&features_grad.f_narrow(0, first, n)?, w)?;
        let _ = w_grad.f_addmm_(&e.f_transpose(0, 1)?, &xb)?;
        first += n;
    }
    group.all_reduce_(&features_grad, Reduce::Sum)?;
    Ok(HeadLoss { sum, features_grad })
}

/// Sends `grad` (d loss / d `features`) into `features`' graph: a backward
/// of `(features * grad).sum()`, whose gradient with respect to `features`
/// is `grad` exactly (1 · grad). Gradients add into the leaves' `.grad`.
pub fn backward_into(features: &Tensor, grad: &Tensor) -> Result<()> {
    grad.f_view_as(features)
        .and_then(|g| features.f_mul(&g))
        .and_then(|p| p.f_sum(Kind::Float))
        .and_then(|s| s.f_backward())
        .ctx("running backward")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Reduction;

    /// (loss sum, features' gradient, weight's gradient) through autograd.
    fn autograd(x: &Tensor, w: &Tensor, t: &Tensor) -> (f64, Tensor, Tensor) {
        let x = x.detach().set_requires_grad(true);
        let w = w.detach().set_requires_grad(true);
        let loss = x.linear(&w, None::<&Tensor>).cross_entropy_loss::<Tensor>(
            t,
            None,
            Reduction::Sum,
            -100,
            0.0,
        );
        loss.backward();
        (loss.double_value(&[]), x.grad(), w.grad())
    }

    fn fused(x: &Tensor, w: &Tensor, t: &Tensor, rows: i64) -> (f64, Tensor, Tensor) {
        let counted = t.ne(-100).sum(Kind::Int64).int64_value(&[]) == t.size()[0];
        let w_grad = w.zeros_like();
        let out = linear_cross_entropy(x, w, &w_grad, t, counted, rows).unwrap();
        (out.sum.double_value(&[]), out.features_grad, w_grad)
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        let scale = b.abs().max().double_value(&[]).max(1e-30);
        (a - b).abs().max().double_value(&[]) / scale
    }

    fn case(m: i64, h: i64, vocab: i64, ignored: &[i64], rows: i64) {
        tch::manual_seed(7);
        let x = Tensor::randn([m, h], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([vocab, h], (Kind::Float, Device::Cpu)) * 0.3;
        let t = Tensor::randint(vocab, [m], (Kind::Int64, Device::Cpu));
        for &i in ignored {
            let _ = t.get(i).fill_(-100);
        }
        let (l0, gx0, gw0) = autograd(&x, &w, &t);
        let (l1, gx1, gw1) = fused(&x, &w, &t, rows);
        assert!(
            ((l1 - l0) / l0.abs().max(1.0)).abs() < 1e-6,
            "loss {l1} against autograd's {l0}"
        );
        assert!(
            max_rel(&gx1, &gx0) < 1e-5,
            "features' gradient: {}",
            max_rel(&gx1, &gx0)
        );
        assert!(
            max_rel(&gw1, &gw0) < 1e-5,
            "weight's gradient: {}",
            max_rel(&gw1, &gw0)
        );
    }

    /// Every row counted, the rows not a multiple of the block.
    #[test]
    fn equals_autograd_all_counted() {
        case(50, 16, 97, &[], 16);
    }

    /// Ignored targets (-100), one block fully ignored, one block in all.
    #[test]
    fn equals_autograd_with_ignored_targets() {
        case(40, 8, 33, &[0, 3, 8, 9, 10, 11, 12, 13, 14, 15, 39], 8);
        case(40, 8, 33, &[1, 2, 5], 64);
    }

    /// Nothing counted: loss 0 and zero gradients (what autograd gives).
    #[test]
    fn nothing_counted_is_zero() {
        let x = Tensor::randn([12, 4], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([9, 4], (Kind::Float, Device::Cpu));
        let t = Tensor::full([12], -100, (Kind::Int64, Device::Cpu));
        let (l, gx, gw) = fused(&x, &w, &t, 5);
        assert_eq!(l, 0.0);
        assert_eq!(gx.abs().max().double_value(&[]), 0.0);
        assert_eq!(gw.abs().max().double_value(&[]), 0.0);
    }

    /// The weight's gradient is added to what `.grad` held (a tied
    /// embedding's gradient, earlier micro-steps), not written over it.
    #[test]
    fn adds_into_the_weight_gradient() {
        tch::manual_seed(3);
        let x = Tensor::randn([10, 6], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([11, 6], (Kind::Float, Device::Cpu));
        let t = Tensor::randint(11, [10], (Kind::Int64, Device::Cpu));
        let before = Tensor::randn([11, 6], (Kind::Float, Device::Cpu));
        let w_grad = before.copy();
        linear_cross_entropy(&x, &w, &w_grad, &t, true, 4).unwrap();
        let (_, _, gw) = autograd(&x, &w, &t);
        assert!(max_rel(&(w_grad - before), &gw) < 1e-5);
    }

    /// backward_into hands the graph exactly the given gradient.
    #[test]
    fn backward_into_passes_the_gradient_exactly() {
        let leaf = Tensor::randn([3, 5], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let features = &leaf * 2.0;
        let grad = Tensor::randn([3, 5], (Kind::Float, Device::Cpu));
        backward_into(&features, &grad).unwrap();
        assert_eq!(leaf.grad(), &grad * 2.0);
    }

    #[test]
    fn blocks_are_sized_by_vocab_and_device() {
        assert_eq!(block_rows(4096, Device::Cpu), 256);
        assert_eq!(block_rows(50257, Device::Cpu), 64);
        assert_eq!(block_rows(4096, Device::Cuda(0)), 16384);
    }
}
