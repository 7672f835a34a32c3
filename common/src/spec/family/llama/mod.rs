//! `llama`: a decoder-only language model in Hugging Face's
//! `LlamaForCausalLM` layout (issue 30). Its fields are named as in HF's
//! `LlamaConfig` and come from the spec, from a HF `config.json`
//! (`model.config`), or both when they agree; [`LlamaConfig::resolve`]
//! gives them all, defaults filled, and [`LlamaConfig::to_hf_json`] writes
//! the `config.json` transformers loads.
//!
//! The folder: spec.rs (its `[model]` fields, [`LlamaSpec`]), this file
//! (their checks, the resolved configuration and the size the memory
//! estimate counts), hf.rs (a `config.json` read as transformers reads
//! it), tests.rs.

use super::{ModelFamily, ModelSize};
use crate::spec::{Checker, DataKind, DataSpec, ModelKind, ModelSpec, SpecErrors, MAX_VOCAB};
use serde_json::{json, Map, Value};
pub use spec::LlamaSpec;
use std::path::Path;

mod arch;
mod hf;
mod size;
mod spec;
pub(super) use arch::LLAMA;
pub use arch::{Decoder, DecoderArch, RopeScaling, Window};
use hf::read_config;

/// The largest hidden and intermediate width and position count a spec
/// may ask for; the most layers and heads.
pub const MAX_WIDTH: i64 = 1 << 16;
pub const MAX_INTERMEDIATE: i64 = 1 << 18;
pub const MAX_POSITIONS: i64 = 1 << 24;
pub const MAX_LAYERS: i64 = 1024;
pub const MAX_HEADS: i64 = 1024;
/// The widest head a config.json may give.
pub const MAX_HEAD_DIM: i64 = 1024;

/// The defaults of Hugging Face's LlamaConfig.
pub const DEFAULT_RMS_NORM_EPS: f64 = 1e-6;
pub const DEFAULT_ROPE_THETA: f64 = 10000.0;
pub const DEFAULT_MAX_POSITION_EMBEDDINGS: i64 = 2048;
pub const DEFAULT_INITIALIZER_RANGE: f64 = 0.02;

/// A llama model's configuration with every field filled.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    /// `num_attention_heads` unless given (fewer: grouped-query attention).
    pub num_key_value_heads: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// The standard deviation of the initial weights' normal(0, std)
    /// (from a config.json only; transformers' default 0.02).
    pub initializer_range: f64,
    /// How RoPE's frequencies are scaled (from a config.json only:
    /// `rope_scaling` / `rope_parameters`).
    pub rope_scaling: RopeScaling,
    /// Llama, or a family that extends it (the spec's kind; a config.json's
    /// `model_type` must agree).
    pub arch: DecoderArch,
    /// A config.json's `head_dim` where it is not hidden_size /
    /// num_attention_heads (Mistral Nemo); None: that quotient.
    pub explicit_head_dim: Option<i64>,
    /// Mistral's attention window (from a config.json only): a query sees
    /// the keys of the last `sliding_window` positions, itself included.
    /// None: every earlier position.
    pub sliding_window: Option<i64>,
}

/// The fields as given (spec, config file or both merged).
#[derive(Clone, Debug, Default, PartialEq)]
struct Fields {
    vocab_size: Option<i64>,
    hidden_size: Option<i64>,
    intermediate_size: Option<i64>,
    num_hidden_layers: Option<i64>,
    num_attention_heads: Option<i64>,
    num_key_value_heads: Option<i64>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    max_position_embeddings: Option<i64>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    /// From a config.json only (the spec has no such fields).
    head_dim: Option<i64>,
    initializer_range: Option<f64>,
    rope_scaling: Option<RopeScaling>,
    /// The file's `model_type`, then the spec's kind.
    arch: Option<DecoderArch>,
    /// Mistral's window as the file gives it (Some(None): null, none;
    /// absent: MistralConfig's 4096), Qwen2's switch.
    sliding_window: Option<Option<i64>>,
    use_sliding_window: Option<bool>,
    /// The config.json the file-only fields came from, as errors show it.
    source: Option<String>,
}

impl Fields {
    fn from_spec(m: &LlamaSpec) -> Self {
        Self {
            vocab_size: m.vocab_size,
            hidden_size: m.hidden_size,
            intermediate_size: m.intermediate_size,
            num_hidden_layers: m.num_hidden_layers,
            num_attention_heads: m.num_attention_heads,
            num_key_value_heads: m.num_key_value_heads,
            rms_norm_eps: m.rms_norm_eps,
            rope_theta: m.rope_theta,
            max_position_embeddings: m.max_position_embeddings,
            tie_word_embeddings: m.tie_word_embeddings,
            attention_bias: m.attention_bias,
            mlp_bias: m.mlp_bias,
            head_dim: None,
            initializer_range: None,
            rope_scaling: None,
            arch: None,
            sliding_window: None,
            use_sliding_window: None,
            source: None,
        }
    }

    /// The spec's fields, completed by the file's; a field in both must
    /// agree.
    fn merge(self, file: Fields, path: &Path, c: &mut Checker) -> Fields {
        fn one<T: PartialEq + std::fmt::Debug + Copy>(
            field: &str,
            spec: Option<T>,
            file: Option<T>,
            path: &Path,
            c: &mut Checker,
        ) -> Option<T> {
            match (spec, file) {
                (Some(s), Some(f)) if s != f => {
                    c.fail(
                        field,
                        s,
                        format!(
                            "disagrees with model.config ({:?}), which gives {f:?}",
                            path.display().to_string()
                        ),
                    );
                    Some(s)
                }
                (s, f) => s.or(f),
            }
        }
        // A head_dim is checked against the width the spec and the file
        // agree on (a disagreement is reported as such).
        let agree = |s: Option<i64>, f: Option<i64>| s.is_none() || f.is_none() || s == f;
        let head_dim = file.head_dim.filter(|_| {
            agree(self.hidden_size, file.hidden_size)
                && agree(self.num_attention_heads, file.num_attention_heads)
        });
        Fields {
            vocab_size: one(
                "model.vocab_size",
                self.vocab_size,
                file.vocab_size,
                path,
                c,
            ),
            hidden_size: one(
                "model.hidden_size",
                self.hidden_size,
                file.hidden_size,
                path,
                c,
            ),
            intermediate_size: one(
                "model.intermediate_size",
                self.intermediate_size,
                file.intermediate_size,
                path,
                c,
            ),
            num_hidden_layers: one(
                "model.num_hidden_layers",
                self.num_hidden_layers,
                file.num_hidden_layers,
                path,
                c,
            ),
            num_attention_heads: one(
                "model.num_attention_heads",
                self.num_attention_heads,
                file.num_attention_heads,
                path,
                c,
            ),
            num_key_value_heads: one(
                "model.num_key_value_heads",
                self.num_key_value_heads,
                file.num_key_value_heads,
                path,
                c,
            ),
            rms_norm_eps: one(
                "model.rms_norm_eps",
                self.rms_norm_eps,
                file.rms_norm_eps,
                path,
                c,
            ),
            rope_theta: one(
                "model.rope_theta",
                self.rope_theta,
                file.rope_theta,
                path,
                c,
            ),
            max_position_embeddings: one(
                "model.max_position_embeddings",
                self.max_position_embeddings,
                file.max_position_embeddings,
                path,
                c,
            ),
            tie_word_embeddings: one(
                "model.tie_word_embeddings",
                self.tie_word_embeddings,
                file.tie_word_embeddings,
                path,
                c,
            ),
            attention_bias: one(
                "model.attention_bias",
                self.attention_bias,
                file.attention_bias,
                path,
                c,
            ),
            mlp_bias: one("model.mlp_bias", self.mlp_bias, file.mlp_bias, path, c),
            head_dim,
            initializer_range: file.initializer_range,
            rope_scaling: file.rope_scaling,
            arch: file.arch,
            sliding_window: file.sliding_window,
            use_sliding_window: file.use_sliding_window,
            source: file.source,
        }
    }

    /// Range and shape rules of the fields given; with `complete`, a
    /// required field missing is an error too. The config when every
    /// field is there and right.
    fn check(&self, complete: bool, c: &mut Checker) -> Option<LlamaConfig> {
        let int = |c: &mut Checker, field: &str, v: Option<i64>, lo: i64, hi: i64| match v {
            Some(x) if (lo..=hi).contains(&x) => Some(x),
            Some(x) => {
                c.int_in(field, x, lo.into(), hi.into());
                None
            }
            None => {
                if complete {
                    c.fail(
                        field,
                        "(missing)",
                        "required for model.kind = llama (here, or from the \
                         config.json of model.config)",
                    );
                }
                None
            }
        };
        let vocab = int(c, "model.vocab_size", self.vocab_size, 1, MAX_VOCAB);
        let hidden = int(c, "model.hidden_size", self.hidden_size, 1, MAX_WIDTH);
        let inter = int(
            c,
            "model.intermediate_size",
            self.intermediate_size,
            1,
            MAX_INTERMEDIATE,
        );
        let layers = int(
            c,
            "model.num_hidden_layers",
            self.num_hidden_layers,
            1,
            MAX_LAYERS,
        );
        let heads = int(
            c,
            "model.num_attention_heads",
            self.num_attention_heads,
            1,
            MAX_HEADS,
        );
        let arch = self.arch.unwrap_or_default();
        // Defaults of the decoder's transformers config class.
        let positions = self
            .max_position_embeddings
            .or(Some(arch.default_max_positions()));
        let positions = int(
            c,
            "model.max_position_embeddings",
            positions,
            1,
            MAX_POSITIONS,
        );
        let kv = match self.num_key_value_heads {
            // A config.json without the key: its class's default (Qwen2's
            // is 32, Mistral's 8, not the heads), as transformers reads it.
            // The spec's own fields default to the heads for every kind.
            None if self.source.is_some() && arch.file_kv_heads.is_some() => arch.file_kv_heads,
            None => heads,
            Some(kv) => int(c, "model.num_key_value_heads", Some(kv), 1, MAX_HEADS),
        };
        let mut good = vocab.is_some()
            && hidden.is_some()
            && inter.is_some()
            && layers.is_some()
            && heads.is_some()
            && kv.is_some()
            && positions.is_some();
        // The head width: a config.json's head_dim (transformers builds
        // q_proj with num_attention_heads * head_dim rows, whatever the
        // hidden size: Mistral Nemo's 128 with 5120 / 32 = 160), else
        // hidden_size / num_attention_heads, which must then divide.
        // A config.json without the key: its class's default (Qwen3's 128).
        let head_dim = self
            .head_dim
            .or(arch.file_head_dim.filter(|_| self.source.is_some()));
        let explicit = head_dim.filter(|&d| match (hidden, heads) {
            (Some(h), Some(n)) => h % n != 0 || d != h / n,
            _ => true,
        });
        if let Some(d) = explicit {
            if !(2..=MAX_HEAD_DIM).contains(&d) || d % 2 != 0 {
                c.fail(
                    "model.config",
                    self.source.as_deref().unwrap_or("config.json"),
                    format!(
                        "head_dim = {d} in the file: must be an even number in 2..={MAX_HEAD_DIM} \
                         (RoPE rotates pairs)"
                    ),
                );
                good = false;
            }
        } else if let (Some(h), Some(n)) = (hidden, heads) {
            if h % n != 0 {
                c.fail(
                    "model.hidden_size",
                    h,
                    format!("must be a multiple of model.num_attention_heads = {n}"),
                );
                good = false;
            } else if (h / n) % 2 != 0 {
                c.fail(
                    "model.hidden_size",
                    h,
                    format!(
                        "must give an even head width for RoPE (hidden_size / \
                         num_attention_heads = {})",
                        h / n
                    ),
                );
                good = false;
            }
        }
        if let (Some(n), Some(kv)) = (heads, kv) {
            if n % kv != 0 {
                c.fail(
                    "model.num_key_value_heads",
                    kv,
                    format!("must divide model.num_attention_heads = {n}"),
                );
                good = false;
            }
        }
        let eps = self.rms_norm_eps.unwrap_or(DEFAULT_RMS_NORM_EPS);
        if !(eps.is_finite() && eps > 0.0) {
            c.fail("model.rms_norm_eps", eps, "must be a finite number > 0");
            good = false;
        }
        let theta = self.rope_theta.unwrap_or(DEFAULT_ROPE_THETA);
        if !(theta.is_finite() && theta > 0.0) {
            c.fail("model.rope_theta", theta, "must be a finite number > 0");
            good = false;
        }
        good &= self.arch_rules(arch, c);
        if !good {
            return None;
        }
        Some(LlamaConfig {
            vocab_size: vocab?,
            hidden_size: hidden?,
            intermediate_size: inter?,
            num_hidden_layers: layers?,
            num_attention_heads: heads?,
            num_key_value_heads: kv?,
            rms_norm_eps: eps,
            rope_theta: theta,
            max_position_embeddings: positions?,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            attention_bias: self.attention_bias.unwrap_or(false),
            mlp_bias: self.mlp_bias.unwrap_or(false),
            // transformers' _init_weights: `initializer_range or 0.02`.
            initializer_range: self
                .initializer_range
                .filter(|&r| r != 0.0)
                .unwrap_or(DEFAULT_INITIALIZER_RANGE),
            rope_scaling: self.rope_scaling.unwrap_or_default(),
            explicit_head_dim: explicit,
            arch,
            sliding_window: match arch.window {
                Window::Sliding { default } => self.sliding_window.unwrap_or(Some(default)),
                Window::None | Window::Switch => None,
            },
        })
    }
}

/// The merged fields of `m` and, when `read` and `m.config` is set, its
/// config file (`None` when the file cannot be read).
fn gather(m: &LlamaSpec, kind: ModelKind, read: bool, c: &mut Checker) -> Option<Fields> {
    let spec = Fields::from_spec(m);
    let mut f = match (&m.config, read) {
        (Some(path), true) => {
            let map = read_config(path, c)?;
            let file = Fields::from_json(path, &map, c);
            spec.merge(file, path, c)
        }
        _ => spec,
    };
    // The kind decides the decoder; a config.json's model_type must agree.
    let want = DecoderArch::of_kind(kind).unwrap_or_default();
    if let Some(file) = f.arch.filter(|a| *a != want) {
        c.fail(
            "model.config",
            f.source.clone().unwrap_or_default(),
            format!(
                "model_type = \"{}\" in the file, but model.kind = \"{}\": they must agree",
                file.model_type(),
                want.model_type()
            ),
        );
    }
    f.arch = Some(want);
    Some(f)
}

impl LlamaConfig {
    /// The configuration of a `llama` model spec: its fields, completed by
    /// the `model.config` file's (read here; unknown keys ignored), then
    /// the defaults. A field given in both must agree; a missing required
    /// field or a refused value is an error naming `model.<field>`.
    pub fn resolve(model: &ModelSpec) -> Result<LlamaConfig, SpecErrors> {
        let mut c = Checker::default();
        let config = gather(&model.fields.llama, model.kind, true, &mut c)
            .and_then(|f| f.check(true, &mut c));
        c.finish()?;
        config.ok_or_else(|| {
            // Every path to None above reported an error; kept total.
            SpecErrors(vec![crate::spec::FieldError {
                field: "model".into(),
                value: "llama".into(),
                allowed: "an incomplete llama configuration".into(),
            }])
        })
    }

    /// The configuration a Hugging Face `config.json` gives (what
    /// [`LlamaConfig::to_hf_json`] writes, or transformers'), defaults
    /// filled, with the checks of [`LlamaConfig::resolve`]; errors name
    /// `model.config` and the fields.
    pub fn from_hf_json(json: &Value) -> Result<LlamaConfig, SpecErrors> {
        let path = Path::new("config.json");
        let mut c = Checker::default();
        let config = match json.as_object() {
            Some(map) => Fields::from_json(path, map, &mut c).check(true, &mut c),
            None => {
                c.fail(
                    "model.config",
                    "config.json",
                    "must hold a JSON object (a Hugging Face config.json)",
                );
                None
            }
        };
        c.finish()?;
        config.ok_or_else(|| {
            SpecErrors(vec![crate::spec::FieldError {
                field: "model.config".into(),
                value: "config.json".into(),
                allowed: "an incomplete llama configuration".into(),
            }])
        })
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> i64 {
        self.explicit_head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Parameters of the model, the output head included unless tied
    /// (transformers' `num_parameters()`).
    /// Whether q_proj, k_proj and v_proj have biases (Qwen2's always).
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias || self.arch.qkv_bias
    }

    /// Whether q and k have a per-head RMSNorm (Qwen3's).
    pub fn qk_norm(&self) -> bool {
        self.arch.qk_norm
    }
}

pub(super) struct Llama;

impl ModelFamily for Llama {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Llama]
    }

    fn decoder(&self) -> Option<&'static Decoder> {
        Some(&LLAMA)
    }

    fn field_sets(&self) -> &'static [&'static str] {
        &["llama"]
    }

    fn classes(&self, model: &ModelSpec) -> Option<i64> {
        model.fields.llama.vocab_size
    }

    fn check_fields(&self, model: &ModelSpec, data: &DataSpec, c: &mut Checker) {
        let m = &model.fields.llama;
        if let Some(n) = model.num_classes {
            c.fail(
                "model.num_classes",
                n,
                format!(
                    "not allowed with model.kind = {} (the classes are model.vocab_size)",
                    model.kind
                ),
            );
        }
        if let Some(p) = &m.config {
            c.file_exists("model.config", p);
        }
        // The file is read only where files are checked (the coordinator's
        // view of the workers' files may differ); without it, the fields
        // the spec gives are checked.
        let read = c.checks_files() && m.config.as_deref().is_some_and(Path::is_file);
        let complete = m.config.is_none() || read;
        let Some(fields) = gather(m, model.kind, read, c) else {
            return;
        };
        let config = fields.check(complete, c);
        let positions = config
            .as_ref()
            .map(|x| x.max_position_embeddings)
            .or(fields.max_position_embeddings)
            .or((m.config.is_none()).then_some(
                DecoderArch::of_kind(model.kind)
                    .unwrap_or_default()
                    .default_max_positions(),
            ));
        if let (Some(t), Some(p)) = (data.seq_len, positions) {
            if matches!(data.kind, DataKind::Sequences | DataKind::Tokens) && t > p.max(0) as u64 {
                c.fail(
                    "data.seq_len",
                    t,
                    format!("must be <= model.max_position_embeddings = {p}"),
                );
            }
        }
    }

    fn check_sizable(&self, model: &ModelSpec) -> Result<(), SpecErrors> {
        // A config this host cannot see is the workers' to check (the
        // coordinator's view of their files may differ); one it sees must
        // resolve, or the estimate would leave the model out.
        let Some(path) = &model.fields.llama.config else {
            return Ok(());
        };
        if std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
        {
            return Ok(());
        }
        LlamaConfig::resolve(model).map(|_| ())
    }

    fn size(&self, model: &ModelSpec, shape: &[u64], _classes: u64) -> ModelSize {
        let Ok(config) = LlamaConfig::resolve(model) else {
            return ModelSize::default();
        };
        config.model_size(shape.first().copied().unwrap_or(0))
    }
}

/// A family that extends Llama (qwen2, mistral, qwen3: their folders):
/// Llama's fields (its field set), checks and size for its decoder's kind;
/// what differs is the [`Decoder`] it declares.
pub(super) struct Extends(pub &'static Decoder);

impl ModelFamily for Extends {
    fn kinds(&self) -> &'static [ModelKind] {
        let d: &'static Decoder = self.0;
        std::slice::from_ref(&d.kind)
    }

    fn decoder(&self) -> Option<&'static Decoder> {
        Some(self.0)
    }

    fn field_sets(&self) -> &'static [&'static str] {
        Llama.field_sets()
    }

    fn classes(&self, model: &ModelSpec) -> Option<i64> {
        Llama.classes(model)
    }

    fn check_fields(&self, model: &ModelSpec, data: &DataSpec, c: &mut Checker) {
        Llama.check_fields(model, data, c)
    }

    fn check_sizable(&self, model: &ModelSpec) -> Result<(), SpecErrors> {
        Llama.check_sizable(model)
    }

    fn size(&self, model: &ModelSpec, shape: &[u64], classes: u64) -> ModelSize {
        Llama.size(model, shape, classes)
    }
}

#[cfg(test)]
mod tests;
