//! `accrue sample` / `accrue-worker sample` (issue 30): a continuation of a
//! prompt from a llama checkpoint. A step folder holds `model.safetensors`
//! (Hugging Face names), `config.json` ([`LlamaConfig::to_hf_json`]) and,
//! when the data had one, `tokenizer.json`; a checkpoint folder's `LATEST`
//! names its newest step. A checkpoint folder is read as training recovers
//! ([`checkpoint::choose`]): LATEST's step when its files verify against
//! its manifest, else the newest step that does, looking again when
//! training pruned the step between reading LATEST and reading its files;
//! the files are read once, into memory. Token ids the tokenizer does not
//! know (a vocabulary padded past the tokenizer's) are never sampled. The
//! prompt is encoded without special tokens,
//! run once through the model (causal attention), then every new token
//! is one step of the KV-cached forward ([`Net::forward_cached`]): the
//! last position's logits divided by the temperature, cut to the top k,
//! softmax, one draw from libtorch's generator seeded with `--seed`
//! (argmax at temperature 0). Generation stops after `--max-tokens`, at
//! the tokenizer's `<|endoftext|>` (not printed) or when the sequence
//! fills `max_position_embeddings`.

use crate::checkpoint::{self, manifest, shards::INDEX_FILE, Choice, LATEST, MODEL_FILE};
use crate::family::llama::{KvCache, Net};
use crate::spec::LlamaConfig;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use tch::{nn, Device, Kind, Tensor};
use tokenizers::Tokenizer;

mod files;
pub use files::*;

/// The model's configuration in a step folder.
pub const CONFIG_FILE: &str = "config.json";
/// The tokenizer in a step folder (Hugging Face tokenizers' format).
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The token that ends generation when the tokenizer has it.
pub const END_OF_TEXT: &str = "<|endoftext|>";
/// The temperatures allowed besides 0 (greedy): from the logits divided
/// by at most 1000 (finite in f32 for any logit a model gives) up to 100
/// (nearly uniform already).
pub const MIN_TEMPERATURE: f64 = 1e-3;
pub const MAX_TEMPERATURE: f64 = 100.0;
/// How often a checkpoint folder is read again when it changed while it
/// was read (training wrote a step and pruned the one LATEST named).
const TRIES: usize = 5;

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
        "{dir}: neither a step folder (no {MODEL_FILE} or {INDEX_FILE}) nor a checkpoint folder (no {LATEST}, \
         no step-N folders)"
    )]
    NoStep { dir: PathBuf },
    #[error("{dir}: no step to sample: {reason}")]
    NoReadableStep { dir: PathBuf, reason: String },
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
    #[error(
        "every token id of the model's vocab_size = {vocab_size} is excluded: nothing to sample"
    )]
    NothingToSample { vocab_size: i64 },
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
    // The numbers take a leading '-' so that a negative one gets its
    // range in words, not the parser's "unexpected argument".
    /// Tokens to generate at most (0 or more).
    #[arg(long, default_value_t = 100, allow_negative_numbers = true)]
    pub max_tokens: i64,
    /// Divides the logits before sampling: 0 = greedy (argmax), else from
    /// 0.001 to 100.
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    pub temperature: f64,
    /// Sample among the K most likely tokens only (1 or more).
    #[arg(long, value_name = "K", allow_negative_numbers = true)]
    pub top_k: Option<i64>,
    /// Seed of the sampling generator, 0 to 2^64 - 1 (default: a random
    /// one, printed on stderr).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_seed)]
    pub seed: Option<u64>,
    /// cpu, cuda:N or auto.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The tokenizer.json to use (default: the step folder's).
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
}

/// `--seed`: a u64, its range in words otherwise.
fn parse_seed(text: &str) -> std::result::Result<u64, String> {
    text.parse()
        .map_err(|_| format!("must be a whole number from 0 to {}", u64::MAX))
}

/// How tokens are chosen and when generation stops.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// 0: greedy; else from [`MIN_TEMPERATURE`] to [`MAX_TEMPERATURE`].
    pub temperature: f64,
    pub top_k: Option<i64>,
    /// Seeds libtorch's generator before the first draw (None: left as
    /// it is).
    pub seed: Option<u64>,
    /// A token that ends generation (not returned).
    pub stop: Option<i64>,
    /// Token ids never chosen (ids outside the vocabulary are ignored):
    /// those the tokenizer has no token for.
    pub exclude: Vec<i64>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 100,
            temperature: 0.0,
            top_k: None,
            seed: None,
            stop: None,
            exclude: Vec::new(),
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
    /// safetensors file with Hugging Face names, or a folder transformers
    /// wrote: model.safetensors or shards and their index), strictly:
    /// every parameter there with its shape, nothing else.
    pub fn load(config: LlamaConfig, weights: &Path, device: Device) -> Result<Self> {
        let files = files::read_weights(weights)?;
        Self::from_weights(config, &files, device)
    }

    /// [`LoadedModel::load`] from one file's contents (`path` names them
    /// in errors).
    pub fn from_safetensors(
        config: LlamaConfig,
        bytes: &[u8],
        path: &Path,
        device: Device,
    ) -> Result<Self> {
        let one = WeightBytes {
            path: path.to_path_buf(),
            expected: None,
            bytes: bytes.to_vec(),
        };
        Self::from_weights(config, std::slice::from_ref(&one), device)
    }

    /// [`LoadedModel::load`] from the contents of its weight files (one,
    /// or the shards, each holding what its index entry names).
    pub fn from_weights(
        config: LlamaConfig,
        files: &[WeightBytes],
        device: Device,
    ) -> Result<Self> {
        let first = files.first().map(|f| f.path.clone()).unwrap_or_default();
        let err = |reason: String| SampleError::Weights {
            path: first.clone(),
            reason,
        };
        let vs = nn::VarStore::new(device);
        // Drawn initial weights, all overwritten below.
        let net = tch::no_grad(|| Net::new(&vs.root(), &config))?;
        let mut read = Vec::with_capacity(files.len());
        for f in files {
            let ferr = |reason: String| SampleError::Weights {
                path: f.path.clone(),
                reason,
            };
            // safetensors' errors print as Debug: named in words here.
            let file = safetensors::SafeTensors::deserialize(&f.bytes)
                .map_err(|e| ferr(format!("not a valid safetensors file ({e})")))?;
            let tensors = file
                .tensors()
                .into_iter()
                .map(|(n, view)| {
                    Tensor::try_from(view)
                        .map(|t| (n, t))
                        .map_err(|e| ferr(crate::error::torch_text("reading the weights", &e)))
                })
                .collect::<Result<Vec<(String, Tensor)>>>()?;
            read.push((f.path.clone(), f.expected.clone(), tensors));
        }
        let by_name: HashMap<String, Tensor> = crate::checkpoint::shards::join(read)
            .map_err(err)?
            .into_iter()
            .collect();
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

    /// The model of a step folder: its config.json and model.safetensors
    /// (or the shards its index names).
    pub fn from_step_dir(step_dir: &Path, device: Device) -> Result<Self> {
        let config = load_config(step_dir)?;
        Self::load(config, step_dir, device)
    }

    /// The model of files read from a step folder.
    pub fn from_files(files: &StepFiles, device: Device) -> Result<Self> {
        let config = parse_config(&files.config, &files.dir.join(CONFIG_FILE))?;
        Self::from_weights(config, &files.weights, device)
    }

    /// `[vocab]` true at the ids `exclude` names (None: none); an error
    /// when it names them all.
    pub fn exclusion_mask(&self, exclude: &[i64]) -> Result<Option<Tensor>> {
        let vocab = self.config.vocab_size;
        let mut mask = vec![false; vocab as usize];
        for &t in exclude.iter().filter(|&&t| (0..vocab).contains(&t)) {
            mask[t as usize] = true;
        }
        match mask.iter().filter(|&&m| m).count() {
            0 => Ok(None),
            n if n == mask.len() => Err(SampleError::NothingToSample { vocab_size: vocab }),
            _ => Ok(Some(
                Tensor::from_slice(&mask)
                    .f_to_device(self.device)
                    .map_err(|e| crate::error::torch_error("moving the token mask", &e))?,
            )),
        }
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
        let mask = self.exclusion_mask(&opts.exclude)?;
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
            let token = choose(&last, opts, mask.as_ref())?;
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

/// `x` as written on a command line: plain, or in exponent form when
/// that is long (1e-45).
fn number(x: f64) -> String {
    let plain = x.to_string();
    if plain.len() > 12 {
        format!("{x:e}")
    } else {
        plain
    }
}

fn check_options(opts: &GenerateOptions) -> Result<()> {
    let t = opts.temperature;
    if !(t == 0.0 || (MIN_TEMPERATURE..=MAX_TEMPERATURE).contains(&t)) {
        return Err(flag(
            "--temperature",
            number(t),
            format!(
                "must be 0 (greedy) or from {MIN_TEMPERATURE} to {MAX_TEMPERATURE} \
                 (the logits are divided by it)"
            ),
        ));
    }
    if let Some(k) = opts.top_k {
        if k < 1 {
            return Err(flag("--top-k", k, "must be 1 or more"));
        }
    }
    Ok(())
}

/// The next token from the last position's logits `[vocab]`, never one
/// where `mask` is true.
fn choose(logits: &Tensor, opts: &GenerateOptions, mask: Option<&Tensor>) -> Result<i64> {
    let pick = || -> Result<i64, tch::TchError> {
        let masked;
        let logits = match mask {
            Some(m) => {
                masked = logits.f_masked_fill(m, f64::NEG_INFINITY)?;
                &masked
            }
            None => logits,
        };
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
    let max_tokens = usize::try_from(args.max_tokens)
        .map_err(|_| flag("--max-tokens", args.max_tokens, "must be 0 or more"))?;
    check_options(&GenerateOptions {
        temperature: args.temperature,
        top_k: args.top_k,
        ..Default::default()
    })?;
    let device = crate::engine::resolve_device(&args.device).map_err(|e| match e {
        crate::Error::Device { reason, .. } => flag("--device", &args.device, reason),
        other => other.into(),
    })?;
    let files = read_step_files(&args.step_dir)?;
    if let Some(why) = &files.fallback {
        eprintln!("note: sampling {}: {why}", files.dir.display());
    }
    let config = parse_config(&files.config, &files.dir.join(CONFIG_FILE))?;
    // The tokenizer before the weights: a missing one fails fast.
    let (tokenizer, tokenizer_path) = load_tokenizer(&files, args.tokenizer.as_deref())?;
    let model = LoadedModel::from_weights(config, &files.weights, device)?;
    drop(files);
    let encoding =
        tokenizer
            .encode(args.prompt.as_str(), false)
            .map_err(|e| SampleError::Tokenizer {
                path: tokenizer_path.clone(),
                reason: format!("cannot encode the prompt: {e}"),
            })?;
    let prompt_u32 = encoding.get_ids().to_vec();
    let prompt: Vec<i64> = prompt_u32.iter().map(|&t| t as i64).collect();
    let vocab_size = model.config.vocab_size;
    let mut opts = GenerateOptions {
        max_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
        stop: tokenizer.token_to_id(END_OF_TEXT).map(i64::from),
        exclude: unknown_ids(&tokenizer, vocab_size),
    };
    // Refused before anything is printed.
    check_prompt(&model.config, &prompt)?;
    model.exclusion_mask(&opts.exclude)?;
    if !opts.exclude.is_empty() {
        eprintln!(
            "note: the model's vocab_size = {vocab_size}; the tokenizer {} knows {} of its ids: \
             sampling only among those",
            tokenizer_path.display(),
            vocab_size - opts.exclude.len() as i64
        );
    }
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
