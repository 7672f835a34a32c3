//! `accrue sample` / `accrue-worker sample` (issue 30): a continuation of a
//! prompt from a llama checkpoint. A step folder holds `model.safetensors`
//! (Hugging Face names), `config.json` ([`LlamaConfig::to_hf_json`]) and,
//! when the data had one, `tokenizer.json`; a checkpoint folder's `LATEST`
//! names its newest step. The prompt is encoded without special tokens,
//! run once through the model (causal attention), then every new token
//! is one step of the KV-cached forward ([`Net::forward_cached`]): the
//! last position's logits divided by the temperature, cut to the top k,
//! softmax, one draw from libtorch's generator seeded with `--seed`
//! (argmax at temperature 0). Generation stops after `--max-tokens`, at
//! the tokenizer's `<|endoftext|>` (not printed) or when the sequence
//! fills `max_position_embeddings`.

use crate::checkpoint::{LATEST, MODEL_FILE};
use crate::family::llama::{KvCache, Net};
use crate::spec::LlamaConfig;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use tch::{nn, Device, Kind, Tensor};
use tokenizers::Tokenizer;

/// The model's configuration in a step folder.
pub const CONFIG_FILE: &str = "config.json";
/// The tokenizer in a step folder (Hugging Face tokenizers' format).
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The token that ends generation when the tokenizer has it.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// Why sampling cannot start or go on; every message names the file or
/// the flag.
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    #[error(
        "{path}: not a folder (STEP_DIR is a checkpoint's step-N folder, or a checkpoint \
         folder holding LATEST)"
    )]
    NotAFolder { path: PathBuf },
    #[error(
        "{dir}: neither a step folder (no {MODEL_FILE}) nor a checkpoint folder (no {LATEST})"
    )]
    NoStep { dir: PathBuf },
    #[error("{path}: {reason}")]
    Latest { path: PathBuf, reason: String },
    #[error("model config {path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("weights {path}: {reason}")]
    Weights { path: PathBuf, reason: String },
    #[error("no {TOKENIZER_FILE} in {dir}; pass --tokenizer PATH")]
    NoTokenizer { dir: PathBuf },
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("{flag} {value}: {reason}")]
    Flag {
        flag: &'static str,
        value: String,
        reason: String,
    },
    #[error("writing the sample: {0}")]
    Output(std::io::Error),
    #[error(transparent)]
    Worker(#[from] crate::Error),
}

pub type Result<T, E = SampleError> = std::result::Result<T, E>;

/// `accrue-worker sample`'s (and `accrue sample`'s) arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct SampleArgs {
    /// A checkpoint's step-N folder, or a checkpoint folder holding LATEST
    /// (its newest step is used).
    pub step_dir: PathBuf,
    /// The text to continue (encoded without special tokens).
    #[arg(long)]
    pub prompt: String,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 100)]
    pub max_tokens: usize,
    /// Divides the logits before sampling; 0 = greedy (argmax).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Sample among the K most likely tokens only.
    #[arg(long, value_name = "K")]
    pub top_k: Option<i64>,
    /// Seed of the sampling generator (default: a random one, printed on
    /// stderr).
    #[arg(long)]
    pub seed: Option<u64>,
    /// cpu, cuda:N or auto.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The tokenizer.json to use (default: the step folder's).
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
}

/// How tokens are chosen and when generation stops.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// 0: greedy.
    pub temperature: f64,
    pub top_k: Option<i64>,
    /// Seeds libtorch's generator before the first draw (None: left as
    /// it is).
    pub seed: Option<u64>,
    /// A token that ends generation (not returned).
    pub stop: Option<i64>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 100,
            temperature: 0.0,
            top_k: None,
            seed: None,
            stop: None,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    MaxTokens,
    EndOfText,
    /// The sequence filled `max_position_embeddings`.
    Context,
}

/// The tokens generated (the prompt excluded) and the logits `[vocab]`
/// the last one was chosen from.
#[derive(Debug)]
pub struct Generated {
    pub tokens: Vec<i64>,
    pub last_logits: Option<Tensor>,
    pub stop: Stop,
}

/// The step folder `path` names: itself when it holds `model.safetensors`,
/// else the step its `LATEST` names.
pub fn resolve_step_dir(path: &Path) -> Result<PathBuf> {
    if !path.is_dir() {
        return Err(SampleError::NotAFolder {
            path: path.to_path_buf(),
        });
    }
    if path.join(MODEL_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST);
    if !latest.is_file() {
        return Err(SampleError::NoStep {
            dir: path.to_path_buf(),
        });
    }
    let err = |reason: String| SampleError::Latest {
        path: latest.clone(),
        reason,
    };
    let text = std::fs::read_to_string(&latest).map_err(|e| err(format!("cannot read it: {e}")))?;
    let name = text.trim();
    let well_formed = name
        .strip_prefix("step-")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if !well_formed {
        return Err(err(format!("names {name:?}, not a step-N folder")));
    }
    let step = path.join(name);
    if !step.join(MODEL_FILE).is_file() {
        return Err(err(format!(
            "names {name}, which has no {MODEL_FILE} ({})",
            step.display()
        )));
    }
    Ok(step)
}

/// The configuration in `step_dir`'s config.json.
pub fn load_config(step_dir: &Path) -> Result<LlamaConfig> {
    let path = step_dir.join(CONFIG_FILE);
    let err = |reason: String| SampleError::Config {
        path: path.clone(),
        reason,
    };
    let bytes = std::fs::read(&path).map_err(|e| err(format!("cannot read it: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| err(format!("not valid JSON: {e}")))?;
    LlamaConfig::from_hf_json(&json).map_err(|e| {
        let reasons: Vec<String> =
            e.0.iter()
                .map(|f| {
                    let field = f.field.strip_prefix("model.").unwrap_or(&f.field);
                    if f.value == "\"(missing)\"" || f.value == "(missing)" {
                        format!("{field} is missing")
                    } else if field == "config" {
                        f.allowed.clone()
                    } else {
                        format!("{field} = {}: {}", f.value, f.allowed)
                    }
                })
                .collect();
        err(reasons.join("; "))
    })
}

/// The tokenizer: `explicit`, else `step_dir`'s tokenizer.json.
pub fn load_tokenizer(step_dir: &Path, explicit: Option<&Path>) -> Result<Tokenizer> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => {
            let p = step_dir.join(TOKENIZER_FILE);
            if !p.is_file() {
                return Err(SampleError::NoTokenizer {
                    dir: step_dir.to_path_buf(),
                });
            }
            p
        }
    };
    if !path.is_file() {
        return Err(SampleError::Tokenizer {
            path,
            reason: "no such file (--tokenizer)".into(),
        });
    }
    Tokenizer::from_file(&path).map_err(|e| SampleError::Tokenizer {
        reason: format!("cannot load it: {e}"),
        path,
    })
}

/// A llama with the weights of a step folder, for inference.
pub struct LoadedModel {
    pub config: LlamaConfig,
    pub net: Net,
    /// Keeps the variables alive.
    _vs: nn::VarStore,
    pub device: Device,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("config", &self.config)
            .field("device", &self.device)
            .finish()
    }
}

/// `names` as `["a", "b", "c"] and 4 more`.
fn some_names(names: &[&str]) -> String {
    let shown: Vec<&str> = names.iter().take(3).copied().collect();
    match names.len().saturating_sub(3) {
        0 => format!("{shown:?}"),
        more => format!("{shown:?} and {more} more"),
    }
}

impl LoadedModel {
    /// The model `config` describes with the weights of `weights` (a
    /// safetensors file with Hugging Face names), strictly: every
    /// parameter there with its shape, nothing else.
    pub fn load(config: LlamaConfig, weights: &Path, device: Device) -> Result<Self> {
        let err = |reason: String| SampleError::Weights {
            path: weights.to_path_buf(),
            reason,
        };
        if !weights.is_file() {
            return Err(err("no such file".into()));
        }
        let vs = nn::VarStore::new(device);
        // Drawn initial weights, all overwritten below.
        let net = tch::no_grad(|| Net::new(&vs.root(), &config))?;
        let tensors = Tensor::read_safetensors(weights)
            .map_err(|e| err(crate::error::torch_text("reading the weights", &e)))?;
        let by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
        let mut ours: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        ours.sort_by(|a, b| a.0.cmp(&b.0));
        let missing: Vec<&str> = ours
            .iter()
            .filter(|(n, _)| !by_name.contains_key(n))
            .map(|(n, _)| n.as_str())
            .collect();
        let mut unexpected: Vec<&str> = by_name
            .keys()
            .filter(|k| !ours.iter().any(|(n, _)| n == *k))
            .map(String::as_str)
            .collect();
        unexpected.sort_unstable();
        if !missing.is_empty() || !unexpected.is_empty() {
            return Err(err(format!(
                "does not fit config.json's model: missing {}, unexpected {}",
                some_names(&missing),
                some_names(&unexpected)
            )));
        }
        if let Some((n, t)) = ours.iter().find(|(n, t)| by_name[n].size() != t.size()) {
            return Err(err(format!(
                "{n}: file {:?}, config.json's model {:?}",
                by_name[n].size(),
                t.size()
            )));
        }
        tch::no_grad(|| -> Result<()> {
            for (n, t) in &ours {
                let mut t = t.shallow_clone();
                let src = by_name[n]
                    .f_to_kind(t.kind())
                    .and_then(|s| s.f_to_device(device))
                    .and_then(|s| t.f_copy_(&s))
                    .map_err(|e| err(format!("{n}: {}", crate::error::torch_text("loading", &e))));
                src?;
            }
            Ok(())
        })?;
        Ok(Self {
            config,
            net,
            _vs: vs,
            device,
        })
    }

    /// The model of a step folder: its config.json and model.safetensors.
    pub fn from_step_dir(step_dir: &Path, device: Device) -> Result<Self> {
        let config = load_config(step_dir)?;
        Self::load(config, &step_dir.join(MODEL_FILE), device)
    }

    /// Generates after `prompt` with the KV cache; `on_token` sees each
    /// token as it is chosen.
    pub fn generate(
        &self,
        prompt: &[i64],
        opts: &GenerateOptions,
        on_token: impl FnMut(i64) -> Result<()>,
    ) -> Result<Generated> {
        let mut cache = KvCache::new();
        self.run(prompt, opts, on_token, |new: &[i64]| {
            let ids = self.ids(new)?;
            let logits = self.net.forward_cached(&ids, &mut cache)?;
            Ok(logits)
        })
    }

    /// Generates as [`LoadedModel::generate`] does, but with a full forward
    /// of the whole sequence for every token (no cache): the reference the
    /// cached generation is tested against.
    pub fn generate_uncached(
        &self,
        prompt: &[i64],
        opts: &GenerateOptions,
        on_token: impl FnMut(i64) -> Result<()>,
    ) -> Result<Generated> {
        let mut seq: Vec<i64> = Vec::new();
        self.run(prompt, opts, on_token, |new: &[i64]| {
            seq.extend_from_slice(new);
            Ok(self.net.forward(&self.ids(&seq)?)?)
        })
    }

    /// `[1, t]` int64 on the model's device.
    fn ids(&self, tokens: &[i64]) -> Result<Tensor> {
        Ok(Tensor::from_slice(tokens)
            .f_view([1, -1])
            .and_then(|t| t.f_to_device(self.device))
            .map_err(|e| crate::error::torch_error("moving the tokens", &e))?)
    }

    /// The generation loop; `step` takes the tokens not yet seen by the
    /// model and gives logits `[1, t, vocab]` whose last row predicts the
    /// next token.
    fn run(
        &self,
        prompt: &[i64],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(i64) -> Result<()>,
        mut step: impl FnMut(&[i64]) -> Result<Tensor>,
    ) -> Result<Generated> {
        check_prompt(&self.config, prompt)?;
        check_options(opts)?;
        if let Some(seed) = opts.seed {
            tch::manual_seed(seed as i64);
        }
        let _guard = tch::no_grad_guard();
        let positions = self.config.max_position_embeddings as usize;
        let mut out = Generated {
            tokens: Vec::new(),
            last_logits: None,
            stop: Stop::MaxTokens,
        };
        let mut new: Vec<i64> = prompt.to_vec();
        let mut len = 0usize;
        while out.tokens.len() < opts.max_tokens {
            if len + new.len() > positions {
                out.stop = Stop::Context;
                break;
            }
            let logits = step(&new)?;
            len += new.len();
            let last = logits
                .f_select(0, 0)
                .and_then(|l| l.f_select(0, -1))
                .map_err(|e| crate::error::torch_error("reading the logits", &e))?;
            let token = choose(&last, opts)?;
            out.last_logits = Some(last);
            if opts.stop == Some(token) {
                out.stop = Stop::EndOfText;
                break;
            }
            out.tokens.push(token);
            on_token(token)?;
            new = vec![token];
        }
        Ok(out)
    }
}

fn flag(flag: &'static str, value: impl ToString, reason: impl Into<String>) -> SampleError {
    SampleError::Flag {
        flag,
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn check_prompt(config: &LlamaConfig, prompt: &[i64]) -> Result<()> {
    if prompt.is_empty() {
        return Err(flag("--prompt", "\"\"", "gives no token to start from"));
    }
    if prompt.len() as i64 > config.max_position_embeddings {
        return Err(flag(
            "--prompt",
            format!("({} tokens)", prompt.len()),
            format!(
                "longer than the model's max_position_embeddings = {}",
                config.max_position_embeddings
            ),
        ));
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t < 0 || t >= config.vocab_size) {
        return Err(flag(
            "--prompt",
            format!("(token {bad})"),
            format!(
                "the tokenizer gives a token outside the model's vocab_size = {} \
                 (another tokenizer than the model's?)",
                config.vocab_size
            ),
        ));
    }
    Ok(())
}

fn check_options(opts: &GenerateOptions) -> Result<()> {
    let t = opts.temperature;
    if !(t.is_finite() && t >= 0.0) {
        return Err(flag(
            "--temperature",
            t,
            "must be a finite number >= 0 (0 = greedy)",
        ));
    }
    if let Some(k) = opts.top_k {
        if k < 1 {
            return Err(flag("--top-k", k, "must be at least 1"));
        }
    }
    Ok(())
}

/// The next token from the last position's logits `[vocab]`.
fn choose(logits: &Tensor, opts: &GenerateOptions) -> Result<i64> {
    let pick = || -> Result<i64, tch::TchError> {
        if opts.temperature == 0.0 {
            return Ok(logits.f_argmax(-1, false)?.int64_value(&[]));
        }
        let mut scaled = logits.f_div_scalar(opts.temperature)?;
        let vocab = scaled.size()[0];
        if let Some(k) = opts.top_k.filter(|&k| k < vocab) {
            let (values, _) = scaled.f_topk(k, -1, true, true)?;
            let kth = values.f_select(0, k - 1)?;
            scaled = scaled.f_masked_fill(&scaled.f_lt_tensor(&kth)?, f64::NEG_INFINITY)?;
        }
        let probs = scaled.f_softmax(-1, Kind::Float)?;
        Ok(probs.f_multinomial(1, false)?.int64_value(&[0]))
    };
    pick().map_err(|e| crate::error::torch_error("sampling the next token", &e).into())
}

/// Turns token ids into text as they come: the text of the prompt and
/// the tokens so far, less the prompt's text, less what was given
/// already; held back while it ends inside a multi-byte character.
struct Detokenizer<'a> {
    tokenizer: &'a Tokenizer,
    path: &'a Path,
    ids: Vec<u32>,
    prompt_text: String,
    prompt_len: usize,
    shown: usize,
}

impl<'a> Detokenizer<'a> {
    fn new(tokenizer: &'a Tokenizer, path: &'a Path, prompt: &[u32]) -> Result<Self> {
        let prompt_text = tokenizer
            .decode(prompt, false)
            .map_err(|e| SampleError::Tokenizer {
                path: path.to_path_buf(),
                reason: format!("cannot decode the prompt: {e}"),
            })?;
        Ok(Self {
            tokenizer,
            path,
            ids: prompt.to_vec(),
            prompt_text,
            prompt_len: prompt.len(),
            shown: 0,
        })
    }

    /// The continuation's text so far.
    fn continuation(&self) -> Result<String> {
        let decode = |ids: &[u32]| {
            self.tokenizer
                .decode(ids, false)
                .map_err(|e| SampleError::Tokenizer {
                    path: self.path.to_path_buf(),
                    reason: format!("cannot decode: {e}"),
                })
        };
        let full = decode(&self.ids)?;
        Ok(match full.strip_prefix(&self.prompt_text) {
            Some(rest) => rest.to_string(),
            // A normalizing tokenizer (the prompt does not come back as
            // it was decoded alone): the new tokens' own text.
            None => decode(&self.ids[self.prompt_len..])?,
        })
    }

    /// The new text after `token` (empty while held back).
    fn push(&mut self, token: i64) -> Result<String> {
        self.ids.push(token as u32);
        let text = self.continuation()?;
        if text.ends_with('\u{FFFD}')
            || text.len() < self.shown
            || !text.is_char_boundary(self.shown)
        {
            return Ok(String::new());
        }
        let new = text[self.shown..].to_string();
        self.shown = text.len();
        Ok(new)
    }

    /// What is left to show at the end.
    fn finish(&mut self) -> Result<String> {
        let text = self.continuation()?;
        Ok(
            if text.is_char_boundary(self.shown) && text.len() >= self.shown {
                text[self.shown..].to_string()
            } else {
                String::new()
            },
        )
    }
}

/// `accrue-worker sample`: loads the checkpoint and its tokenizer, writes
/// the prompt then the continuation to `out` as it is generated (a
/// newline at the end); notes (the seed drawn, an early stop) go to
/// stderr.
pub fn run(args: &SampleArgs, out: &mut dyn Write) -> Result<Generated> {
    check_options(&GenerateOptions {
        temperature: args.temperature,
        top_k: args.top_k,
        ..Default::default()
    })?;
    let device = crate::engine::resolve_device(&args.device).map_err(|e| match e {
        crate::Error::Device { reason, .. } => flag("--device", &args.device, reason),
        other => other.into(),
    })?;
    let step_dir = resolve_step_dir(&args.step_dir)?;
    let config = load_config(&step_dir)?;
    // The tokenizer before the weights: a missing one fails fast.
    let tokenizer = load_tokenizer(&step_dir, args.tokenizer.as_deref())?;
    let tokenizer_path = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| step_dir.join(TOKENIZER_FILE));
    let model = LoadedModel::load(config, &step_dir.join(MODEL_FILE), device)?;
    let encoding =
        tokenizer
            .encode(args.prompt.as_str(), false)
            .map_err(|e| SampleError::Tokenizer {
                path: tokenizer_path.clone(),
                reason: format!("cannot encode the prompt: {e}"),
            })?;
    let prompt_u32 = encoding.get_ids().to_vec();
    let prompt: Vec<i64> = prompt_u32.iter().map(|&t| t as i64).collect();
    let mut opts = GenerateOptions {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
        stop: tokenizer.token_to_id(END_OF_TEXT).map(i64::from),
    };
    // Refused before anything is printed.
    check_prompt(&model.config, &prompt)?;
    if opts.seed.is_none() && opts.temperature > 0.0 {
        let seed = rand::random::<u32>() as u64;
        eprintln!("seed {seed} (--seed {seed} draws this sample again)");
        opts.seed = Some(seed);
    }
    let mut detok = Detokenizer::new(&tokenizer, &tokenizer_path, &prompt_u32)?;
    let io = SampleError::Output;
    write!(out, "{}", args.prompt).map_err(io)?;
    out.flush().map_err(io)?;
    let generated = model.generate(&prompt, &opts, |token| {
        let text = detok.push(token)?;
        if !text.is_empty() {
            write!(out, "{text}").map_err(io)?;
            out.flush().map_err(io)?;
        }
        Ok(())
    })?;
    let rest = detok.finish()?;
    writeln!(out, "{rest}").map_err(io)?;
    out.flush().map_err(io)?;
    if generated.stop == Stop::Context {
        eprintln!(
            "stopped at the model's max_position_embeddings = {} positions",
            model.config.max_position_embeddings
        );
    }
    Ok(generated)
}
