//! `llama`: a decoder-only language model with Hugging Face
//! `LlamaForCausalLM`'s parameter names and computation (issue 30):
//! `model.embed_tokens.weight`, per layer
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight` (and `.bias` with
//! `attention_bias`), `model.layers.{i}.mlp.{gate,up,down}_proj.weight`
//! (and `.bias` with `mlp_bias`), `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.post_attention_layernorm.weight`, then
//! `model.norm.weight` and `lm_head.weight` (absent when the embeddings are
//! tied: the head multiplies by the embedding). Linear weights are
//! `[out, in]`.
//!
//! The forward takes int64 token ids `[N, T]` and gives fp32 logits
//! `[N, T, vocab]`, computed as transformers computes them: RMSNorm in
//! fp32 (cast back, then times the weight), RoPE with `rotate_half` and
//! `inv_freq = 1 / theta^(2i/d)` (cos and sin in fp32, positions 0..T),
//! causal attention through libtorch's `scaled_dot_product_attention`
//! (grouped-query through its `enable_gqa`, as transformers' SDPA path
//! does), MLP `down(silu(gate(x)) * up(x))`, no dropout. Initial weights:
//! normal(0, initializer_range) (0.02 unless the config.json says
//! otherwise) for linear and embedding weights, zero biases, unit norms
//! (transformers' `_init_weights`).
//!
//! Generation (`accrue sample`, the sample module) builds the same
//! [`Net`] and runs [`Net::forward_cached`]: new tokens at positions
//! after those in a [`KvCache`] (RoPE offset), attending to the cached
//! keys and values (per layer, appended each call); the training forward
//! is untouched by it.
//!
//! The folder: this file (the family and the model), layers.rs (linear,
//! RMSNorm, a decoder layer), cached.rs (generation's forward with a KV
//! cache), plan.rs (parameter names, blocks and their parallel plan),
//! tensor.rs (tensor parallelism), fused.rs (the fused projections),
//! stage.rs (a pipeline stage), tests.rs.

use super::tensor::{TensorPlace, TpSlice};
use super::{check_blocks, Block, BuildTo, Built, Family, Headed, ParallelPlan};
use crate::error::{Error, Result, TorchContext};
use crate::family::model::made;
use crate::spec::{LlamaConfig, ModelKind, ModelSpec};
use std::collections::HashMap;
use tch::nn::{self, Init, ModuleT};
use tch::{Device, Kind, TchError, Tensor};

mod cached;
mod fused;
mod layers;
pub mod packed;
pub mod plan;
mod rope;
mod stage;
mod tensor;

pub use cached::KvCache;

use layers::{Layer, Linear, RmsNorm};

pub(crate) use rope::scaled_inv_freq;
use rope::{paired_rows, rotate, Rope};

pub(in crate::family) struct Llama;

impl Family for Llama {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Llama]
    }

    fn builds_by_stage(&self) -> bool {
        true
    }

    fn build(&self, to: &BuildTo<'_>) -> Result<Built> {
        let config = LlamaConfig::resolve(to.spec)?;
        let t = match to.shape {
            [t] if *t >= 1 => *t,
            other => {
                return Err(Error::ModelInput {
                    model: "llama".into(),
                    reason: format!(
                        "needs token rows of shape [T] (data.seq_len), the data has shape {other:?}"
                    ),
                })
            }
        };
        if t > config.max_position_embeddings {
            return Err(Error::ModelInput {
                model: "llama".into(),
                reason: format!(
                    "takes at most max_position_embeddings = {} positions, the data has rows of {t}",
                    config.max_position_embeddings
                ),
            });
        }
        if to.classes != config.vocab_size {
            return Err(Error::ModelInput {
                model: "llama".into(),
                reason: format!(
                    "has vocab_size = {} logits per position, the job asks for {} classes",
                    config.vocab_size, to.classes
                ),
            });
        }
        Ok(Built::Headed(Box::new(Net::new(to.root, &config)?)))
    }

    fn probe_input(&self, shape: &[i64], device: Device) -> Result<Tensor> {
        let mut dims = vec![2];
        dims.extend_from_slice(shape);
        Tensor::f_zeros(dims.as_slice(), (Kind::Int64, device)).ctx("probing the model")
    }

    fn blocks(&self, spec: &ModelSpec, params: &[String]) -> Result<Vec<Block>> {
        let blocks = plan::blocks(&LlamaConfig::resolve(spec)?);
        check_blocks(&blocks, params)?;
        Ok(blocks)
    }

    fn parallel_plan(&self, spec: &ModelSpec) -> Result<ParallelPlan> {
        Ok(plan::parallel_plan(&LlamaConfig::resolve(spec)?))
    }

    fn tensor_layout(&self, spec: &ModelSpec, t: usize) -> Result<Vec<(String, TpSlice)>> {
        tensor::layout(&LlamaConfig::resolve(spec)?, t as i64).map_err(|reason| Error::ModelInput {
            model: spec.kind.to_string(),
            reason,
        })
    }

    /// As transformers loads a folder: RoPE's `inv_freq` buffers (which
    /// older versions saved, `model.rotary_emb.inv_freq` and per layer
    /// `model.layers.{i}.self_attn.rotary_emb.inv_freq`) are computed from
    /// the config, not loaded; a tied model's `lm_head.weight` (a
    /// `state_dict()` holds it) is the embedding, so it must equal it.
    fn fit_init(
        &self,
        has: &dyn Fn(&str) -> bool,
        tensors: &mut HashMap<String, Tensor>,
    ) -> std::result::Result<(), String> {
        tensors.retain(|name, _| has(name) || !is_rope_buffer(name));
        const HEAD: &str = "lm_head.weight";
        const EMBED: &str = "model.embed_tokens.weight";
        if has(HEAD) {
            return Ok(());
        }
        let (Some(head), Some(embed)) = (tensors.get(HEAD), tensors.get(EMBED)) else {
            // Without the embedding the strict load names both.
            return Ok(());
        };
        let same = head.size() == embed.size()
            && head.kind() == embed.kind()
            && head.f_equal(embed).map_err(|e| {
                crate::error::torch_text("comparing lm_head with the embedding", &e)
            })?;
        if !same {
            return Err(format!(
                "{HEAD} ({:?} {:?}) differs from {EMBED} ({:?} {:?}), which the model \
                 ties it to (tie_word_embeddings = true): {HEAD} must be absent or equal \
                 {EMBED} (weights with their own head need tie_word_embeddings = false)",
                head.kind(),
                head.size(),
                embed.kind(),
                embed.size()
            ));
        }
        tensors.remove(HEAD);
        Ok(())
    }

    /// Logits per position and token: `[2, T, vocab]`.
    fn check_output(
        &self,
        kind: ModelKind,
        shape: &[i64],
        got: &[i64],
        classes: i64,
    ) -> Result<()> {
        let mut want = vec![2];
        want.extend_from_slice(shape);
        want.push(classes);
        if got != want.as_slice() {
            return Err(Error::ModelOutputShape {
                model: kind,
                got: got.to_vec(),
                want,
                what: "logits per position and token",
            });
        }
        Ok(())
    }
}

/// A family that extends Llama (qwen2, mistral: their folders): Llama's
/// network, names, blocks and plan for its `kinds`, the differences in the
/// config's `DecoderArch`.
pub(in crate::family) struct Extends(pub &'static [ModelKind]);

impl Family for Extends {
    fn kinds(&self) -> &'static [ModelKind] {
        self.0
    }

    fn build(&self, to: &BuildTo<'_>) -> Result<Built> {
        Llama.build(to)
    }

    fn builds_by_stage(&self) -> bool {
        true
    }

    fn probe_input(&self, shape: &[i64], device: Device) -> Result<Tensor> {
        Llama.probe_input(shape, device)
    }

    fn fit_init(
        &self,
        has: &dyn Fn(&str) -> bool,
        tensors: &mut HashMap<String, Tensor>,
    ) -> std::result::Result<(), String> {
        Llama.fit_init(has, tensors)
    }

    fn blocks(&self, spec: &ModelSpec, params: &[String]) -> Result<Vec<Block>> {
        Llama.blocks(spec, params)
    }

    fn parallel_plan(&self, spec: &ModelSpec) -> Result<ParallelPlan> {
        Llama.parallel_plan(spec)
    }

    fn tensor_layout(&self, spec: &ModelSpec, t: usize) -> Result<Vec<(String, TpSlice)>> {
        Llama.tensor_layout(spec, t)
    }

    fn check_output(
        &self,
        kind: ModelKind,
        shape: &[i64],
        got: &[i64],
        classes: i64,
    ) -> Result<()> {
        Llama.check_output(kind, shape, got, classes)
    }
}

/// The model itself: built by the family for training, and by
/// the sample module for generation (with [`Net::forward_cached`]).
#[derive(Debug)]
pub struct Net {
    embed: Tensor,
    layers: Vec<Layer>,
    norm: RmsNorm,
    /// None when tied to the embedding.
    head: Option<Tensor>,
    /// RoPE's inverse frequencies `[head_dim / 2]`, fp32 (computed on the
    /// CPU as transformers does at construction, then moved).
    inv_freq: Tensor,
    /// The rows of q_proj and k_proj in the order that makes each head's
    /// (x[i], x[i + d/2]) pairs adjacent (see [`Rope`]).
    q_rows: Tensor,
    k_rows: Tensor,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    scale: f64,
    /// Mistral's attention window (None: every earlier position).
    sliding_window: Option<i64>,
    /// Qwen3's per-head norms on q and k: RoPE then takes its real form
    /// (the norm reads each head's width in transformers' order) and the
    /// fused CUDA operations stay off (their q/k/v kernel has no norm).
    qk_norm: bool,
    /// One matrix product for q, k and v and one for gate and up (their
    /// weights concatenated each forward) instead of five: on CUDA, where
    /// under autocast it also casts each norm's output to bf16 once
    /// instead of three and two times, and sums the input's gradient
    /// inside one product (docs/SEMANTICS.md). Off on the CPU, where the
    /// separate products keep transformers' roundings.
    fuse_projections: bool,
    /// The whole vocabulary (the embedding holds a shard of it under
    /// tensor parallelism).
    vocab: i64,
    /// Tensor parallelism (tensor.rs): None at T = 1.
    tp: Option<tensor::Tp>,
    /// Under autocast, the norms, RoPE and SwiGLU of the training forward
    /// through crate::cuda::fused_ops (with the fused projections), and with
    /// `kernels` their CUDA kernels: on CUDA in a build that has them,
    /// unless `ACCRUE_FUSED_KERNELS=0` (docs/OPERATIONS.md).
    fused_ops: bool,
    kernels: bool,
}

impl Net {
    /// Creates the variables in transformers' state_dict order.
    pub fn new(root: &nn::Path<'_>, c: &LlamaConfig) -> Result<Self> {
        let (h, d) = (c.hidden_size, c.head_dim());
        let kv = c.num_key_value_heads * d;
        let model = root / "model";
        let normal = Init::Randn {
            mean: 0.0,
            stdev: c.initializer_range,
        };
        let embed = (&model / "embed_tokens")
            .f_var("weight", &[c.vocab_size, h], normal)
            .ctx("creating the llama parameters")?;
        made(&(&model / "embed_tokens").path("weight"), &embed)?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let l = &model / "layers" / i;
                let attn = &l / "self_attn";
                let mlp = &l / "mlp";
                // Qwen2: biases on q, k and v, none on o.
                let (qkv_b, o_b) = (c.qkv_bias(), c.attention_bias);
                Ok(Layer {
                    q: Linear::new(
                        &attn / "q_proj",
                        h,
                        c.num_attention_heads * d,
                        qkv_b,
                        normal,
                    )?,
                    k: Linear::new(&attn / "k_proj", h, kv, qkv_b, normal)?,
                    v: Linear::new(&attn / "v_proj", h, kv, qkv_b, normal)?,
                    o: Linear::new(&attn / "o_proj", c.num_attention_heads * d, h, o_b, normal)?,
                    // Qwen3: an RMSNorm over each head's width on q and k.
                    q_norm: c
                        .qk_norm()
                        .then(|| RmsNorm::new(&attn / "q_norm", d, c.rms_norm_eps))
                        .transpose()?,
                    k_norm: c
                        .qk_norm()
                        .then(|| RmsNorm::new(&attn / "k_norm", d, c.rms_norm_eps))
                        .transpose()?,
                    gate: Linear::new(
                        &mlp / "gate_proj",
                        h,
                        c.intermediate_size,
                        c.mlp_bias,
                        normal,
                    )?,
                    up: Linear::new(&mlp / "up_proj", h, c.intermediate_size, c.mlp_bias, normal)?,
                    down: Linear::new(
                        &mlp / "down_proj",
                        c.intermediate_size,
                        h,
                        c.mlp_bias,
                        normal,
                    )?,
                    input_norm: RmsNorm::new(&l / "input_layernorm", h, c.rms_norm_eps)?,
                    post_norm: RmsNorm::new(&l / "post_attention_layernorm", h, c.rms_norm_eps)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(&model / "norm", h, c.rms_norm_eps)?;
        let head = (!c.tie_word_embeddings)
            .then(|| (root / "lm_head").f_var("weight", &[c.vocab_size, h], normal))
            .transpose()
            .ctx("creating the llama parameters")?;
        if let Some(w) = &head {
            made(&(root / "lm_head").path("weight"), w)?;
        }
        let inv_freq = scaled_inv_freq(d, c.rope_theta, &c.rope_scaling)
            .and_then(|f| f.f_to_device(root.device()))
            .ctx("computing RoPE's frequencies")?;
        let q_rows = paired_rows(c.num_attention_heads, d, root.device())
            .ctx("computing RoPE's row order")?;
        let k_rows = paired_rows(c.num_key_value_heads, d, root.device())
            .ctx("computing RoPE's row order")?;
        Ok(Self {
            embed,
            layers,
            norm,
            head,
            inv_freq,
            q_rows,
            k_rows,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: d,
            scale: (d as f64).powf(-0.5),
            sliding_window: c.sliding_window,
            qk_norm: c.qk_norm(),
            fuse_projections: root.device().is_cuda(),
            vocab: c.vocab_size,
            tp: None,
            fused_ops: root.device().is_cuda() && d % 2 == 0 && !c.qk_norm(),
            kernels: crate::cuda::fused_ops::use_kernels(root.device()),
        })
    }

    /// Queries and keys `[N, heads, T, D]` with RoPE applied, values
    /// `[N, kv_heads, T, D]`, of the normed hidden states `x`.
    fn qkv(&self, l: &Layer, x: &Tensor, rope: &Rope) -> Result<[Tensor; 3], TchError> {
        let (n, t, _) = x.size3()?;
        let d = self.head_dim;
        // Into heads `[N, heads, T, D]`, through the head's norm first
        // when it has one (Qwen3's, on `[N, T, heads, D]` as transformers).
        let split = |y: Tensor, norm: Option<&RmsNorm>| -> Result<Tensor, TchError> {
            let y = y.f_view([n, t, -1, d])?;
            match norm {
                Some(norm) => norm.forward(&y)?.f_transpose(1, 2),
                None => y.f_transpose(1, 2),
            }
        };
        match rope {
            Rope::Real { cos, sin } => {
                let [q, k, v] = self.project_qkv(l, x, None)?;
                let q = rotate(&split(q, l.q_norm.as_ref())?, cos, sin)?;
                let k = rotate(&split(k, l.k_norm.as_ref())?, cos, sin)?;
                Ok([q, k, split(v, None)?])
            }
            Rope::Complex { rotation } => {
                let turn = |y: Tensor| -> Result<Tensor, TchError> {
                    let pairs = y.f_view([n, t, -1, d / 2, 2])?.f_view_as_complex()?;
                    pairs
                        .f_mul(rotation)?
                        .f_view_as_real()?
                        .f_reshape([n, t, -1, d])?
                        .f_transpose(1, 2)
                };
                let [q, k, v] = self.project_qkv(l, x, Some((&self.q_rows, &self.k_rows)))?;
                Ok([turn(q)?, turn(k)?, split(v, None)?])
            }
        }
    }

    fn attention(
        &self,
        l: &Layer,
        x: &Tensor,
        rope: &Rope,
        mask: Option<&Tensor>,
    ) -> Result<Tensor, TchError> {
        let (n, t, _) = x.size3()?;
        let x = self.to_region(x)?;
        self.attend(l, &self.qkv(l, &x, rope)?, n, t, mask)
    }

    /// `[N, kv_heads, S, D]` with each key-value head repeated for the
    /// query heads of its group (transformers' `repeat_kv`).
    fn repeat_kv(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let rep = self.heads / self.kv_heads;
        if rep == 1 {
            return Ok(x.shallow_clone());
        }
        let (n, kv, s, d) = x.size4()?;
        x.f_unsqueeze(2)?
            .f_expand([n, kv, rep, s, d], false)?
            .f_reshape([n, kv * rep, s, d])
    }

    /// Causal attention of q, k, v (`[N, heads, T, D]`, k and v with
    /// kv_heads) through libtorch's SDPA, then the output projection.
    /// `packed`: packed rows' block-diagonal mask (packed.rs).
    fn attend(
        &self,
        l: &Layer,
        [q, k, v]: &[Tensor; 3],
        n: i64,
        t: i64,
        packed: Option<&Tensor>,
    ) -> Result<Tensor, TchError> {
        // Mistral's window, where it is shorter than the rows: an explicit
        // mask (transformers' sliding-window causal mask), else causal.
        let window = match packed {
            Some(m) => Some(m.shallow_clone()),
            None => window_mask(0, t, self.sliding_window, q.device())?,
        };
        let out = match &window {
            None => Tensor::f_scaled_dot_product_attention(
                q,
                k,
                v,
                None::<&Tensor>,
                0.0,
                true,
                Some(self.scale),
                self.kv_heads < self.heads,
            )?,
            // With a mask transformers repeats the key-value heads and
            // calls SDPA without its grouped-query path (use_gqa_in_sdpa):
            // so does this, for the same kernel and roundings.
            Some(mask) => Tensor::f_scaled_dot_product_attention(
                q,
                &self.repeat_kv(k)?,
                &self.repeat_kv(v)?,
                Some(mask),
                0.0,
                false,
                Some(self.scale),
                false,
            )?,
        };
        self.row_out(
            &l.o,
            &out.f_transpose(1, 2)?
                .f_contiguous()?
                .f_reshape([n, t, -1])?,
        )
    }

    /// Logits: fp32, or under autocast with the fused operations in the
    /// autocast type (the loss widens them, objective/: transformers'
    /// `logits.float()`).
    fn try_forward(&self, ids: &Tensor) -> Result<Tensor, TchError> {
        if ids.dim() == 3 {
            // Packed rows (packed.rs): the unfused path.
            return self.head(&self.try_features(ids)?);
        }
        if let Some(kind) = self.fused_kind(ids.device()) {
            let features = self.try_features_fused(ids, kind)?;
            return features.f_linear(self.head_weight(), None::<&Tensor>);
        }
        self.head(&self.try_features(ids)?)
    }

    /// The final norm's output `[N, T, H]`: the forward without the head.
    /// `inputs`: token ids `[N, T]`, or packed rows `[N, 2, T]` (packed.rs).
    fn try_features(&self, inputs: &Tensor) -> Result<Tensor, TchError> {
        let packed = packed::split(inputs)?;
        let ids = packed.as_ref().map_or(inputs, |p| &p.ids);
        if let (Some(kind), None) = (self.fused_kind(ids.device()), &packed) {
            return self.try_features_fused(ids, kind);
        }
        let (_, t) = ids.size2()?;
        let mut h = self.embed_ids(ids)?;
        let (rope, mask) = match &packed {
            None => (self.rope(0, t, &h)?, None),
            Some(p) => (
                self.rope_at(&p.positions, &h)?,
                Some(p.mask(self.sliding_window)?),
            ),
        };
        for l in &self.layers {
            let a = self.attention(l, &l.input_norm.forward(&h)?, &rope, mask.as_ref())?;
            h = h.f_add(&a)?;
            h = self.mlp_block(l, &h)?;
        }
        self.norm.forward(&h)
    }

    /// The residual MLP block: h + down(silu(gate(x)) * up(x)), x the
    /// post-attention norm of h.
    fn mlp_block(&self, l: &Layer, h: &Tensor) -> Result<Tensor, TchError> {
        let x = self.to_region(&l.post_norm.forward(h)?)?;
        h.f_add(&self.row_out(&l.down, &self.swiglu(l, &x)?)?)
    }

    /// The head's weight: lm_head's, or the embedding's when tied.
    fn head_weight(&self) -> &Tensor {
        self.head.as_ref().unwrap_or(&self.embed)
    }

    /// The final norm and the head: fp32 logits whatever the autocast type
    /// (transformers' loss upcasts them the same way).
    fn logits(&self, h: &Tensor) -> Result<Tensor, TchError> {
        self.head(&self.norm.forward(h)?)
    }

    /// The head over the final norm's output `h`: fp32 logits.
    fn head(&self, h: &Tensor) -> Result<Tensor, TchError> {
        let logits = self.head_logits(h)?;
        if logits.kind() == Kind::Float {
            Ok(logits)
        } else {
            logits.f_to_kind(Kind::Float)
        }
    }
}

impl Net {
    /// Logits `[N, T, vocab]` (fp32) of token ids `[N, T]`: the training
    /// forward, with errors instead of panics.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.try_forward(ids).ctx("running the llama forward")
    }
}

/// A RoPE buffer transformers saved with older versions' state_dicts
/// (`model.rotary_emb.inv_freq`, `model.layers.{i}.self_attn.rotary_emb.inv_freq`).
fn is_rope_buffer(name: &str) -> bool {
    name == "model.rotary_emb.inv_freq"
        || name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split_once('.'))
            .is_some_and(|(i, rest)| {
                i.parse::<u64>().is_ok() && rest == "self_attn.rotary_emb.inv_freq"
            })
}

/// Mistral's sliding-window causal mask for `t` queries at positions
/// `past..past + t` over keys `0..past + t`: key j is seen by query i when
/// `j <= i` and `i - j < window` (transformers' `sliding_window_causal_mask`).
/// None where the window reaches every earlier key (the plain causal
/// attention then).
fn window_mask(
    past: i64,
    t: i64,
    window: Option<i64>,
    device: Device,
) -> Result<Option<Tensor>, TchError> {
    let Some(w) = window.filter(|&w| w < past + t) else {
        return Ok(None);
    };
    let keys = Tensor::f_arange(past + t, (Kind::Int64, device))?.f_unsqueeze(0)?;
    let queries = Tensor::f_arange(t, (Kind::Int64, device))?
        .f_add_scalar(past)?
        .f_unsqueeze(-1)?;
    let seen = keys.f_le_tensor(&queries)?;
    let near = keys.f_gt_tensor(&queries.f_sub_scalar(w)?)?;
    Ok(Some(seen.f_logical_and(&near)?))
}

impl Headed for Net {
    fn features(&self, xs: &Tensor) -> Result<Tensor> {
        self.try_features(xs).ctx("running the llama forward")
    }

    fn head_weight(&self) -> &Tensor {
        Net::head_weight(self)
    }

    fn split_tensor(&mut self, place: &TensorPlace) -> Result<()> {
        Net::split_tensor(self, place)
    }

    fn vocab_shard(&self) -> Option<crate::family::VocabShard> {
        Net::vocab_shard(self)
    }

    fn logits(&self, features: &Tensor) -> Result<Tensor> {
        self.head(features).ctx("running the head")
    }
}

impl ModuleT for Net {
    /// tch's module trait has no error path: a libtorch failure panics
    /// here with libtorch's text, and `Model::forward` (which catches the
    /// panics of built-in models) turns it into an error of the job.
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        match self.try_forward(xs) {
            Ok(t) => t,
            Err(e) => panic!("called `Result::unwrap()` on an `Err` value: {e:?}"),
        }
    }
}

#[cfg(test)]
mod tests;
