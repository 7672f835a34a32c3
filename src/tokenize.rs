//! `accrue tokenize` (issue 30): text files, folders or JSON lines into
//! the token files the LM data readers take.
//!
//! - `--format tokens`: llm.c's flat stream (a 256 × int32 little-endian
//!   header: magic 20240520 for u16 tokens or 20240801 for u32, version 1,
//!   the token count; then the tokens), documents joined by the
//!   tokenizer's end-of-text token.
//! - `--format sequences`: a safetensors file with `tokens` (U16 or U32),
//!   `offsets` (I64, rows + 1) and `loss_mask` (U8: 0 for a prompt's
//!   tokens, 1 for the completion's and the end-of-text token closing the
//!   row), from JSON lines with `prompt` and `completion`.
//!
//! Tokenizers come from Hugging Face's `tokenizers`: GPT-2's byte-level
//! BPE (built from the r50k ranks shipped inside `tiktoken-rs`, nothing
//! downloaded), a `tokenizer.json`, or a byte-level BPE trained on the
//! input. The tokenizer is always written as `tokenizer.json` beside the
//! output, so that transformers' `AutoTokenizer` loads it.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::{seq::SliceRandom, SeedableRng};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// GPT-2's (and a trained BPE's) end-of-text token.
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// llm.c's magic for u16 tokens.
pub const MAGIC_U16: i32 = 20240520;
/// llm.c's magic for u32 tokens.
pub const MAGIC_U32: i32 = 20240801;
/// llm.c's header: 256 little-endian int32.
pub const HEADER_INTS: usize = 256;
/// GPT-2's vocabulary: 50,000 merges over 256 bytes, and `<|endoftext|>`.
pub const GPT2_VOCAB: u32 = 50257;

/// End-of-text tokens looked for in a given `tokenizer.json`, in order.
const EOT_NAMES: [&str; 4] = [ENDOFTEXT, "</s>", "<|end_of_text|>", "<eos>"];

/// Chunks of about this many bytes are encoded as one string (byte-level
/// tokenizers only: their pre-tokens never cross the cut points).
const CHUNK_BYTES: usize = 64 * 1024;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// llm.c's flat token stream (.bin).
    Tokens,
    /// safetensors rows (tokens, offsets, loss_mask) from prompt/completion
    /// JSON lines.
    Sequences,
}

#[derive(clap::Args, Debug, Clone)]
pub struct TokenizeArgs {
    /// Text files, folders (their UTF-8 text files, recursively, in sorted
    /// order; hidden entries skipped) or, for --format sequences, JSON lines
    /// (.jsonl) with string fields `prompt` and `completion`.
    #[arg(required_unless_present = "dump_gpt2_files", value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
    /// The file to write; the tokenizer is written beside it as
    /// tokenizer.json, a held-out split as <stem>.eval.<ext>.
    #[arg(long, required_unless_present = "dump_gpt2_files", value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// tokens: llm.c's .bin stream, documents separated by the end-of-text
    /// token; sequences: a safetensors file of prompt/completion rows.
    #[arg(long, value_enum, default_value_t = Format::Tokens)]
    pub format: Format,
    /// `gpt2` (GPT-2's byte-level BPE, vocabulary 50257, no download) or a
    /// tokenizer.json file. Default: gpt2.
    #[arg(long, value_name = "gpt2|PATH", conflicts_with = "train_bpe")]
    pub tokenizer: Option<String>,
    /// Train a byte-level BPE of N tokens (256 bytes, <|endoftext|> and the
    /// merges) on the input instead.
    #[arg(long, value_name = "N")]
    pub train_bpe: Option<u64>,
    /// Hold out this fraction, in [0, 1): for tokens the last documents (the
    /// last tokens when there is one document), for sequences a seeded
    /// random choice of rows.
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub eval_fraction: f64,
    /// Seed of the held-out choice of rows (--format sequences).
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub seed: u64,
    /// Write GPT-2's vocab.json and merges.txt (as built here) into DIR
    /// and exit (for comparisons with other tokenizer libraries).
    #[arg(long, hide = true, value_name = "DIR")]
    pub dump_gpt2_files: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("input {}: {source}", path.display())]
    Input {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("input {} is not UTF-8 text", path.display())]
    NotText { path: PathBuf },
    #[error("input {}: --format sequences reads JSON lines (.jsonl) with `prompt` and `completion`", path.display())]
    NotJsonLines { path: PathBuf },
    #[error("{} line {line}: {what}", path.display())]
    JsonLine {
        path: PathBuf,
        line: usize,
        what: String,
    },
    #[error("no input: the inputs hold no {0}")]
    Empty(&'static str),
    #[error("--eval-fraction must be in [0, 1), got {0}")]
    EvalFraction(f64),
    #[error("--eval-fraction {fraction} of {n} {what} leaves nothing to train on")]
    SplitLeavesNothing {
        fraction: f64,
        n: usize,
        what: &'static str,
    },
    #[error("--train-bpe {0}: a byte-level BPE needs at least 257 tokens (the 256 bytes and <|endoftext|>)")]
    TrainBpeTooSmall(u64),
    #[error("--train-bpe {0}: more tokens than u32 ids can hold")]
    TrainBpeTooLarge(u64),
    #[error("the tokenizer's vocabulary has {0} ids, more than u32 tokens can hold")]
    VocabTooLarge(u64),
    #[error("{0} tokens do not fit llm.c's int32 token count")]
    TooManyTokens(usize),
    #[error("--tokenizer {}: {source}", path.display())]
    TokenizerFile {
        path: PathBuf,
        source: tokenizers::Error,
    },
    #[error("GPT-2's vocabulary from tiktoken-rs: {0}")]
    Gpt2(String),
    #[error("{what}: {source}")]
    Tokenizer {
        what: &'static str,
        source: tokenizers::Error,
    },
    #[error("cannot write {}: {source}", path.display())]
    Output {
        path: PathBuf,
        source: std::io::Error,
    },
}

type Result<T, E = TokenizeError> = std::result::Result<T, E>;

/// One file written.
#[derive(Debug, Clone, PartialEq)]
pub struct Written {
    pub path: PathBuf,
    /// Tokens in the file.
    pub tokens: usize,
    /// Documents (tokens) or rows (sequences) in the file.
    pub items: usize,
}

/// What `tokenize` wrote.
#[derive(Debug, Clone)]
pub struct Summary {
    pub format: Format,
    pub train: Written,
    pub eval: Option<Written>,
    pub tokenizer_json: PathBuf,
    /// The largest id + 1.
    pub vocab_size: u64,
    pub eot: Option<u32>,
    /// Files under the given folders skipped as not UTF-8 text.
    pub skipped: Vec<PathBuf>,
}

impl Summary {
    /// Lines for the terminal.
    pub fn lines(&self) -> Vec<String> {
        let unit = match self.format {
            Format::Tokens => "documents",
            Format::Sequences => "rows",
        };
        let mut v = Vec::new();
        if !self.skipped.is_empty() {
            v.push(format!(
                "skipped {} files that are not UTF-8 text (first: {})",
                self.skipped.len(),
                self.skipped[0].display()
            ));
        }
        let eot = match self.eot {
            Some(id) => format!("end-of-text id {id}"),
            None => "no end-of-text token".to_string(),
        };
        v.push(format!(
            "wrote {} (vocabulary {}, {eot})",
            self.tokenizer_json.display(),
            self.vocab_size
        ));
        for (name, w) in
            std::iter::once(("train", &self.train)).chain(self.eval.iter().map(|e| ("eval", e)))
        {
            v.push(format!(
                "wrote {name} {}: {} tokens, {} {unit}",
                w.path.display(),
                w.tokens,
                w.items
            ));
        }
        v
    }
}

/// The held-out file's name: `train.bin` → `train.eval.bin`.
pub fn eval_path(out: &Path) -> PathBuf {
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match out.extension() {
        Some(ext) => format!("{stem}.eval.{}", ext.to_string_lossy()),
        None => format!("{stem}.eval"),
    };
    out.with_file_name(name)
}

/// The `tokenizer.json` written beside `out`.
pub fn tokenizer_path(out: &Path) -> PathBuf {
    out.with_file_name("tokenizer.json")
}

/// Runs `accrue tokenize`.
pub fn tokenize(args: &TokenizeArgs) -> Result<Summary> {
    if !(0.0..1.0).contains(&args.eval_fraction) {
        return Err(TokenizeError::EvalFraction(args.eval_fraction));
    }
    if let Some(n) = args.train_bpe {
        if n < 257 {
            return Err(TokenizeError::TrainBpeTooSmall(n));
        }
        if n > u64::from(u32::MAX) + 1 {
            return Err(TokenizeError::TrainBpeTooLarge(n));
        }
    }
    let out = args
        .out
        .clone()
        .expect("clap requires --out unless --dump-gpt2-files");
    // Inputs first: a missing file fails before any work.
    let files = collect_inputs(&args.inputs, args.format)?;
    let mut skipped = Vec::new();
    let docs = match args.format {
        Format::Tokens => Input::Docs(read_docs(&files, &mut skipped)?),
        Format::Sequences => Input::Pairs(read_pairs(&files, &mut skipped)?),
    };
    if docs.is_empty() {
        return Err(TokenizeError::Empty(match args.format {
            Format::Tokens => "text",
            Format::Sequences => "JSON lines",
        }));
    }
    let tok = match (&args.tokenizer, args.train_bpe) {
        (_, Some(n)) => Tok::trained(n as usize, &docs)?,
        (None, None) => Tok::gpt2()?,
        (Some(name), None) if name == "gpt2" => Tok::gpt2()?,
        (Some(path), None) => Tok::file(Path::new(path))?,
    };
    let vocab_size = tok.vocab_size()?;
    let wide = vocab_size > 65536;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| TokenizeError::Output {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let tokenizer_json = tokenizer_path(&out);
    tok.write(&tokenizer_json)?;

    let bar = progress(docs.bytes() as u64);
    let (train, eval) = match &docs {
        Input::Docs(docs) => {
            let encoded = docs
                .iter()
                .map(|d| tok.encode(d, &bar))
                .collect::<Result<Vec<_>>>()?;
            bar.finish_and_clear();
            write_tokens_split(&out, encoded, tok.eot, wide, args.eval_fraction)?
        }
        Input::Pairs(pairs) => {
            let texts: Vec<&str> = pairs
                .iter()
                .flat_map(|p| [p.prompt.as_str(), p.completion.as_str()])
                .collect();
            let mut ids = tok.encode_many(&texts, &bar)?.into_iter();
            let mut rows = Vec::with_capacity(pairs.len());
            while let (Some(prompt), Some(completion)) = (ids.next(), ids.next()) {
                rows.push((prompt, completion));
            }
            bar.finish_and_clear();
            write_sequences_split(&out, rows, &tok, vocab_size, args.eval_fraction, args.seed)?
        }
    };
    Ok(Summary {
        format: args.format,
        train,
        eval,
        tokenizer_json,
        vocab_size,
        eot: tok.eot,
        skipped,
    })
}

/// Writes GPT-2's `vocab.json` and `merges.txt`, as built here from the
/// r50k ranks, into `dir`; returns their paths.
pub fn dump_gpt2_files(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let (vocab, merges) = gpt2_vocab_and_merges()?;
    let out_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TokenizeError::Output { path, source }
    };
    std::fs::create_dir_all(dir).map_err(out_err(dir))?;
    let vocab_path = dir.join("vocab.json");
    // Keys sorted (serde_json's map): the same bytes every time.
    let map: serde_json::Map<String, serde_json::Value> = vocab
        .into_iter()
        .map(|(t, id)| (t, serde_json::Value::from(id)))
        .collect();
    let text = serde_json::to_string(&map).expect("a map of strings serializes");
    std::fs::write(&vocab_path, text).map_err(out_err(&vocab_path))?;
    let merges_path = dir.join("merges.txt");
    let mut text = String::from("#version: 0.2\n");
    for (a, b) in &merges {
        text.push_str(a);
        text.push(' ');
        text.push_str(b);
        text.push('\n');
    }
    std::fs::write(&merges_path, text).map_err(out_err(&merges_path))?;
    Ok((vocab_path, merges_path))
}

// ---------------------------------------------------------------- inputs

struct Pair {
    prompt: String,
    completion: String,
}

enum Input {
    Docs(Vec<String>),
    Pairs(Vec<Pair>),
}

impl Input {
    fn is_empty(&self) -> bool {
        match self {
            Input::Docs(d) => d.is_empty(),
            Input::Pairs(p) => p.is_empty(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Input::Docs(d) => d.iter().map(String::len).sum(),
            Input::Pairs(p) => p.iter().map(|p| p.prompt.len() + p.completion.len()).sum(),
        }
    }

    /// The texts a BPE is trained on, cut where byte-level pre-tokens
    /// never cross.
    fn texts(&self) -> Vec<&str> {
        match self {
            Input::Docs(d) => d.iter().flat_map(|d| chunks(d)).collect(),
            Input::Pairs(p) => p
                .iter()
                .flat_map(|p| [p.prompt.as_str(), p.completion.as_str()])
                .filter(|s| !s.is_empty())
                .collect(),
        }
    }
}

/// An input file: `named` when given on the command line (then it must be
/// usable), else found in a folder (then a non-text file is skipped).
struct InputFile {
    path: PathBuf,
    named: bool,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TokenizeError {
    let path = path.to_path_buf();
    move |source| TokenizeError::Input { path, source }
}

fn is_jsonl(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "jsonl")
}

/// The files to read, in order.
fn collect_inputs(inputs: &[PathBuf], format: Format) -> Result<Vec<InputFile>> {
    let mut files = Vec::new();
    for input in inputs {
        let meta = std::fs::metadata(input).map_err(io_err(input))?;
        if meta.is_dir() {
            let mut found = Vec::new();
            walk(input, &mut found)?;
            found.sort();
            files.extend(
                found
                    .into_iter()
                    .filter(|p| format == Format::Tokens || is_jsonl(p))
                    .map(|path| InputFile { path, named: false }),
            );
        } else {
            if format == Format::Sequences && !is_jsonl(input) {
                return Err(TokenizeError::NotJsonLines {
                    path: input.clone(),
                });
            }
            files.push(InputFile {
                path: input.clone(),
                named: true,
            });
        }
    }
    Ok(files)
}

/// Every regular file under `dir`, hidden entries left out.
fn walk(dir: &Path, found: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        let meta = std::fs::metadata(&path).map_err(io_err(&path))?;
        if meta.is_dir() {
            walk(&path, found)?;
        } else if meta.is_file() {
            found.push(path);
        }
    }
    Ok(())
}

/// A file's text, or None for a folder's file that is not UTF-8 text (a
/// named one is an error).
fn read_text(f: &InputFile) -> Result<Option<String>> {
    let bytes = std::fs::read(&f.path).map_err(io_err(&f.path))?;
    match String::from_utf8(bytes) {
        Ok(s) if !s.contains('\0') => Ok(Some(s)),
        _ if f.named => Err(TokenizeError::NotText {
            path: f.path.clone(),
        }),
        _ => Ok(None),
    }
}

fn read_docs(files: &[InputFile], skipped: &mut Vec<PathBuf>) -> Result<Vec<String>> {
    let mut docs = Vec::new();
    for f in files {
        match read_text(f)? {
            Some(text) if !text.is_empty() => docs.push(text),
            Some(_) => {}
            None => skipped.push(f.path.clone()),
        }
    }
    Ok(docs)
}

fn read_pairs(files: &[InputFile], skipped: &mut Vec<PathBuf>) -> Result<Vec<Pair>> {
    let mut pairs = Vec::new();
    for f in files {
        let Some(text) = read_text(f)? else {
            skipped.push(f.path.clone());
            continue;
        };
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |what: String| TokenizeError::JsonLine {
                path: f.path.clone(),
                line: i + 1,
                what,
            };
            let v: serde_json::Value =
                serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
            let field = |name: &str| match v.get(name) {
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                Some(_) => Err(bad(format!("`{name}` is not a string"))),
                None => Err(bad(format!("no `{name}` field"))),
            };
            pairs.push(Pair {
                prompt: field("prompt")?,
                completion: field("completion")?,
            });
        }
    }
    Ok(pairs)
}

// ------------------------------------------------------------ tokenizers

struct Tok {
    tk: Tokenizer,
    /// The file to copy as tokenizer.json (a given one), else `tk` is saved.
    source: Option<PathBuf>,
    eot: Option<u32>,
    /// A byte-level tokenizer with GPT-2's pre-tokenizer regex: texts may
    /// be cut into chunks (see `chunks`).
    chunkable: bool,
}

fn tk_err(what: &'static str) -> impl FnOnce(tokenizers::Error) -> TokenizeError {
    move |source| TokenizeError::Tokenizer { what, source }
}

/// GPT-2's layout: byte-level pre-tokenizer (no prefix space), post-processor
/// and decoder, as in Hugging Face's `gpt2/tokenizer.json`.
fn byte_level(model: BPE) -> Tokenizer {
    let mut tk = Tokenizer::new(model);
    tk.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tk.with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
    tk.with_decoder(Some(ByteLevelDecoder::default()));
    tk
}

impl Tok {
    fn gpt2() -> Result<Tok> {
        let (vocab, merges) = gpt2_vocab_and_merges()?;
        let bpe = BPE::builder()
            .vocab_and_merges(
                vocab
                    .into_iter()
                    .collect::<tokenizers::models::bpe::Vocab>(),
                merges,
            )
            .build()
            .map_err(tk_err("building GPT-2's BPE"))?;
        let mut tk = byte_level(bpe);
        tk.add_special_tokens([AddedToken::from(ENDOFTEXT, true)])
            .map_err(tk_err("adding <|endoftext|>"))?;
        let eot = tk.token_to_id(ENDOFTEXT);
        debug_assert_eq!(eot, Some(GPT2_VOCAB - 1));
        Ok(Tok {
            tk,
            source: None,
            eot,
            chunkable: true,
        })
    }

    fn file(path: &Path) -> Result<Tok> {
        let tk = Tokenizer::from_file(path).map_err(|source| {
            // A missing file reads better as such than as a JSON error.
            match std::fs::metadata(path) {
                Err(e) => TokenizeError::TokenizerFile {
                    path: path.to_path_buf(),
                    source: Box::new(e),
                },
                Ok(_) => TokenizeError::TokenizerFile {
                    path: path.to_path_buf(),
                    source,
                },
            }
        })?;
        let eot = EOT_NAMES.iter().find_map(|n| tk.token_to_id(n));
        Ok(Tok {
            tk,
            source: Some(path.to_path_buf()),
            eot,
            chunkable: false,
        })
    }

    fn trained(n: usize, input: &Input) -> Result<Tok> {
        let spinner =
            ProgressBar::new_spinner().with_message(format!("training a BPE of {n} tokens"));
        spinner.set_draw_target(ProgressDrawTarget::stderr());
        spinner.enable_steady_tick(std::time::Duration::from_millis(200));
        let trainer = BpeTrainer::builder()
            .vocab_size(n)
            .min_frequency(0)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(vec![AddedToken::from(ENDOFTEXT, true)])
            .build();
        let mut trainer = TrainerWrapper::from(trainer);
        let mut tk = byte_level(BPE::default());
        let texts = input.texts();
        tk.train(&mut trainer, texts.into_iter())
            .map_err(tk_err("training the BPE"))?;
        spinner.finish_and_clear();
        let eot = tk.token_to_id(ENDOFTEXT);
        Ok(Tok {
            tk,
            source: None,
            eot,
            chunkable: true,
        })
    }

    /// The largest id + 1 (added tokens included).
    fn vocab_size(&self) -> Result<u64> {
        let n = self
            .tk
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |m| u64::from(*m) + 1);
        if n > u64::from(u32::MAX) + 1 {
            return Err(TokenizeError::VocabTooLarge(n));
        }
        Ok(n)
    }

    fn write(&self, dest: &Path) -> Result<()> {
        let out = |source| TokenizeError::Output {
            path: dest.to_path_buf(),
            source,
        };
        match &self.source {
            Some(src) => {
                let same = match (src.canonicalize(), dest.canonicalize()) {
                    (Ok(a), Ok(b)) => a == b,
                    _ => false,
                };
                if !same {
                    std::fs::copy(src, dest).map_err(out)?;
                }
                Ok(())
            }
            None => {
                let text = self
                    .tk
                    .to_string(true)
                    .map_err(tk_err("serializing the tokenizer"))?;
                std::fs::write(dest, text).map_err(out)
            }
        }
    }

    /// The ids of `text` (no special tokens added), advancing `bar` by its
    /// bytes.
    fn encode(&self, text: &str, bar: &ProgressBar) -> Result<Vec<u32>> {
        let pieces: Vec<&str> = if self.chunkable {
            chunks(text)
        } else {
            vec![text]
        };
        let mut ids = Vec::new();
        // A few MB at a time through the (parallel) batch encoder.
        for group in pieces.chunks(32) {
            let encs = self
                .tk
                .encode_batch(group.to_vec(), false)
                .map_err(tk_err("encoding"))?;
            for e in &encs {
                ids.extend_from_slice(e.get_ids());
            }
            bar.inc(group.iter().map(|s| s.len() as u64).sum());
        }
        Ok(ids)
    }

    /// The ids of each of many short texts (prompts, completions), a few
    /// hundred at a time through the batch encoder.
    fn encode_many(&self, texts: &[&str], bar: &ProgressBar) -> Result<Vec<Vec<u32>>> {
        let mut out = Vec::with_capacity(texts.len());
        for group in texts.chunks(256) {
            let encs = self
                .tk
                .encode_batch(group.to_vec(), false)
                .map_err(tk_err("encoding"))?;
            out.extend(encs.iter().map(|e| e.get_ids().to_vec()));
            bar.inc(group.iter().map(|s| s.len() as u64).sum());
        }
        Ok(out)
    }
}

/// `text` cut into pieces of about `CHUNK_BYTES`, each cut right after a
/// lone '\n' between two letters, digits or ASCII punctuation: GPT-2's
/// pre-tokenizer regex makes such a newline a pre-token of its own both in
/// the whole text and at a piece's end (a newline after or before other
/// whitespace is not: `\s+(?!\S)` would join them at a piece's end), so
/// the pieces encode to the ids of the whole text.
fn chunks(text: &str) -> Vec<&str> {
    let solid =
        |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c.is_ascii_punctuation());
    let mut out = Vec::new();
    let mut rest = text;
    'pieces: while rest.len() > CHUNK_BYTES {
        let mut from = CHUNK_BYTES;
        // '\n' is one byte and never inside a multi-byte character.
        while let Some(i) = rest.as_bytes()[from..].iter().position(|&b| b == b'\n') {
            let nl = from + i;
            if solid(rest[..nl].chars().next_back()) && solid(rest[nl + 1..].chars().next()) {
                out.push(&rest[..=nl]);
                rest = &rest[nl + 1..];
                continue 'pieces;
            }
            from = nl + 1;
        }
        break;
    }
    if !rest.is_empty() {
        out.push(rest);
    }
    out
}

fn progress(total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} tokenizing [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar
}

// ---------------------------------------------------------------- GPT-2

/// GPT-2's byte → printable character table (`bytes_to_unicode`).
fn bytes_to_unicode() -> [char; 256] {
    let mut bs: Vec<u32> = (u32::from(b'!')..=u32::from(b'~'))
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = ['\0'; 256];
    for (b, c) in bs.into_iter().zip(cs) {
        table[b as usize] = char::from_u32(c).expect("below 512");
    }
    table
}

/// The two tokens whose merge makes `token`: BPE over its bytes with only
/// the ranks below its own (what Hugging Face's tiktoken converter does).
fn merge_of(token: &[u8], ranks: &HashMap<Vec<u8>, u32>, rank: u32) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut parts: Vec<Vec<u8>> = token.iter().map(|b| vec![*b]).collect();
    loop {
        let mut best: Option<(usize, u32)> = None;
        for i in 0..parts.len().saturating_sub(1) {
            let joined = [parts[i].as_slice(), parts[i + 1].as_slice()].concat();
            if let Some(&r) = ranks.get(&joined) {
                if r < rank && best.is_none_or(|(_, b)| r < b) {
                    best = Some((i, r));
                }
            }
        }
        let Some((i, _)) = best else { break };
        let right = parts.remove(i + 1);
        parts[i].extend(right);
    }
    (parts.len() == 2).then(|| (parts[0].clone(), parts[1].clone()))
}

/// GPT-2's vocabulary (encoder.json) and merges (vocab.bpe), rebuilt from
/// the r50k ranks that `tiktoken-rs` ships (ranks are GPT-2's ids; the
/// merge making rank r is the last step of BPE over its bytes with ranks
/// below r).
/// A vocabulary (token → id) and its merges, in rank order.
type VocabAndMerges = (HashMap<String, u32>, Vec<(String, String)>);

fn gpt2_vocab_and_merges() -> Result<VocabAndMerges> {
    let bpe = tiktoken_rs::r50k_base().map_err(|e| TokenizeError::Gpt2(e.to_string()))?;
    let eot = GPT2_VOCAB - 1;
    let mut by_rank = Vec::with_capacity(eot as usize);
    for r in 0..eot {
        let bytes = bpe
            .decode_bytes(&[r])
            .map_err(|e| TokenizeError::Gpt2(format!("rank {r}: {e:?}")))?;
        by_rank.push(bytes);
    }
    let table = bytes_to_unicode();
    let show = |b: &[u8]| -> String { b.iter().map(|&x| table[x as usize]).collect() };
    let ranks: HashMap<Vec<u8>, u32> = by_rank
        .iter()
        .enumerate()
        .map(|(r, b)| (b.clone(), r as u32))
        .collect();
    if ranks.len() != by_rank.len() {
        return Err(TokenizeError::Gpt2("two ranks share a token".into()));
    }
    let mut vocab = HashMap::with_capacity(GPT2_VOCAB as usize);
    let mut merges = Vec::with_capacity(by_rank.len() - 256);
    for (r, bytes) in by_rank.iter().enumerate() {
        let r = r as u32;
        if r < 256 {
            if bytes.len() != 1 {
                return Err(TokenizeError::Gpt2(format!(
                    "rank {r} is not a single byte"
                )));
            }
        } else {
            let (a, b) = merge_of(bytes, &ranks, r).ok_or_else(|| {
                TokenizeError::Gpt2(format!("rank {r} is no merge of lower ranks"))
            })?;
            merges.push((show(&a), show(&b)));
        }
        vocab.insert(show(bytes), r);
    }
    vocab.insert(ENDOFTEXT.to_string(), eot);
    Ok((vocab, merges))
}

// --------------------------------------------------------------- writers

/// How many of `n` items a fraction holds out: at least one when the
/// fraction is above 0, never all.
fn held_out(fraction: f64, n: usize, what: &'static str) -> Result<usize> {
    if fraction == 0.0 {
        return Ok(0);
    }
    let k = ((fraction * n as f64).round() as usize).max(1);
    if k >= n {
        return Err(TokenizeError::SplitLeavesNothing { fraction, n, what });
    }
    Ok(k)
}

fn join(docs: &[Vec<u32>], eot: Option<u32>) -> Vec<u32> {
    let mut out = Vec::with_capacity(docs.iter().map(Vec::len).sum::<usize>() + docs.len());
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            out.extend(eot);
        }
        out.extend_from_slice(d);
    }
    out
}

fn write_tokens_split(
    out: &Path,
    docs: Vec<Vec<u32>>,
    eot: Option<u32>,
    wide: bool,
    fraction: f64,
) -> Result<(Written, Option<Written>)> {
    let n = docs.len();
    if n == 1 {
        let all = &docs[0];
        let k = held_out(fraction, all.len(), "tokens")?;
        let cut = all.len() - k;
        let train = write_llmc(out, &all[..cut], wide, 1)?;
        let eval = (k > 0)
            .then(|| write_llmc(&eval_path(out), &all[cut..], wide, 1))
            .transpose()?;
        return Ok((train, eval));
    }
    let k = held_out(fraction, n, "documents")?;
    let train = write_llmc(out, &join(&docs[..n - k], eot), wide, n - k)?;
    let eval = (k > 0)
        .then(|| write_llmc(&eval_path(out), &join(&docs[n - k..], eot), wide, k))
        .transpose()?;
    Ok((train, eval))
}

/// llm.c's `.bin`: the header, then the tokens, little-endian.
fn write_llmc(path: &Path, tokens: &[u32], wide: bool, items: usize) -> Result<Written> {
    let count =
        i32::try_from(tokens.len()).map_err(|_| TokenizeError::TooManyTokens(tokens.len()))?;
    let mut header = [0i32; HEADER_INTS];
    header[0] = if wide { MAGIC_U32 } else { MAGIC_U16 };
    header[1] = 1;
    header[2] = count;
    let width = if wide { 4 } else { 2 };
    let mut buf = Vec::with_capacity(HEADER_INTS * 4 + tokens.len() * width);
    for h in header {
        buf.extend_from_slice(&h.to_le_bytes());
    }
    push_tokens(&mut buf, tokens, wide);
    write_file(path, &buf)?;
    Ok(Written {
        path: path.to_path_buf(),
        tokens: tokens.len(),
        items,
    })
}

fn push_tokens(buf: &mut Vec<u8>, tokens: &[u32], wide: bool) {
    if wide {
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
    } else {
        for t in tokens {
            // vocab <= 65536: every id fits.
            buf.extend_from_slice(&(*t as u16).to_le_bytes());
        }
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let err = |source| TokenizeError::Output {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(err)?);
    f.write_all(bytes).map_err(err)?;
    f.flush().map_err(err)
}

fn write_sequences_split(
    out: &Path,
    rows: Vec<(Vec<u32>, Vec<u32>)>,
    tok: &Tok,
    vocab_size: u64,
    fraction: f64,
    seed: u64,
) -> Result<(Written, Option<Written>)> {
    let n = rows.len();
    let k = held_out(fraction, n, "rows")?;
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let mut is_eval = vec![false; n];
    for &i in &order[..k] {
        is_eval[i] = true;
    }
    // Both sides keep the input's order.
    let (mut train, mut eval) = (Vec::with_capacity(n - k), Vec::with_capacity(k));
    for (i, r) in rows.iter().enumerate() {
        if is_eval[i] {
            eval.push(r);
        } else {
            train.push(r);
        }
    }
    let wide = vocab_size > 65536;
    let t = write_sequences(out, &train, tok.eot, wide, vocab_size)?;
    let e = (k > 0)
        .then(|| write_sequences(&eval_path(out), &eval, tok.eot, wide, vocab_size))
        .transpose()?;
    Ok((t, e))
}

/// The sequences file: row = prompt + completion + end-of-text, the
/// prompt's tokens masked.
fn write_sequences(
    path: &Path,
    rows: &[&(Vec<u32>, Vec<u32>)],
    eot: Option<u32>,
    wide: bool,
    vocab_size: u64,
) -> Result<Written> {
    let mut tokens = Vec::new();
    let mut mask = Vec::new();
    let mut offsets: Vec<i64> = vec![0];
    for (prompt, completion) in rows {
        tokens.extend_from_slice(prompt);
        mask.extend(std::iter::repeat_n(0u8, prompt.len()));
        tokens.extend_from_slice(completion);
        tokens.extend(eot);
        mask.extend(std::iter::repeat_n(
            1u8,
            completion.len() + usize::from(eot.is_some()),
        ));
        offsets.push(tokens.len() as i64);
    }
    let mut token_bytes = Vec::with_capacity(tokens.len() * 4);
    push_tokens(&mut token_bytes, &tokens, wide);
    let offset_bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "accrue-sequences".into());
    meta.insert("vocab_size".into(), vocab_size.to_string().into());
    if let Some(e) = eot {
        meta.insert("eot_id".into(), e.to_string().into());
    }
    let tokens_dtype = if wide { "U32" } else { "U16" };
    write_safetensors(
        path,
        &[
            ("offsets", "I64", offsets.len(), &offset_bytes),
            ("tokens", tokens_dtype, tokens.len(), &token_bytes),
            ("loss_mask", "U8", mask.len(), &mask),
        ],
        meta,
    )?;
    Ok(Written {
        path: path.to_path_buf(),
        tokens: tokens.len(),
        items: rows.len(),
    })
}

/// A safetensors file of 1-D tensors, in the given order (8-byte ones
/// first keeps them aligned), header keys sorted: the same input gives the
/// same bytes.
fn write_safetensors(
    path: &Path,
    tensors: &[(&str, &str, usize, &[u8])],
    metadata: serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), metadata.into());
    let mut at = 0usize;
    for (name, dtype, len, data) in tensors {
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": dtype, "shape": [len], "data_offsets": [at, at + data.len()]}),
        );
        at += data.len();
    }
    let mut json = serde_json::to_vec(&header).expect("a JSON map serializes");
    // The data starts 8-byte aligned.
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut buf = Vec::with_capacity(8 + json.len() + at);
    buf.extend_from_slice(&(json.len() as u64).to_le_bytes());
    buf.extend_from_slice(&json);
    for (_, _, _, data) in tensors {
        buf.extend_from_slice(data);
    }
    write_file(path, &buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eval_names() {
        assert_eq!(
            eval_path(Path::new("d/train.bin")),
            Path::new("d/train.eval.bin")
        );
        assert_eq!(eval_path(Path::new("train")), Path::new("train.eval"));
        assert_eq!(
            eval_path(Path::new("a/s.safetensors")),
            Path::new("a/s.eval.safetensors")
        );
    }

    #[test]
    fn chunks_cut_at_a_lone_newline_between_text() {
        // Multi-byte characters across CHUNK_BYTES; newlines next to
        // whitespace are no cut points.
        let text = format!(
            "{}\n\nx  \ny\n z\t\nw{}\nv\n",
            "é".repeat(CHUNK_BYTES / 2 + 1),
            "b".repeat(10)
        );
        let c = chunks(&text);
        assert_eq!(c.concat(), text);
        assert_eq!(
            c.len(),
            2,
            "{:?}",
            c.iter().map(|p| p.len()).collect::<Vec<_>>()
        );
        assert!(c[1].starts_with('v'), "{:?}", &c[1][..3]);
        let short = "a\nb";
        assert_eq!(chunks(short), vec![short]);
    }

    #[test]
    fn split_sizes() {
        assert_eq!(held_out(0.0, 10, "rows").unwrap(), 0);
        assert_eq!(held_out(0.2, 10, "rows").unwrap(), 2);
        assert_eq!(held_out(0.01, 10, "rows").unwrap(), 1);
        assert!(held_out(0.5, 1, "rows").is_err());
    }
}
