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

mod chat;
mod gpt2;
mod input;
mod place;
mod tok;
mod write;

use gpt2::*;
use input::*;
use place::*;
use tok::*;
use write::*;

use accrue_common::small_file::{read_small, MAX_CONFIG_BYTES};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::{seq::SliceRandom, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::fixed_length::FixedLength;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
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

/// A BPE is trained on pre-tokens cut to at most this many bytes (see
/// `Tok::trained`); text's words and runs of spaces are far shorter.
const MAX_TRAIN_PRE_TOKEN: usize = 256;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// llm.c's flat token stream (.bin).
    Tokens,
    /// safetensors rows (tokens, offsets, loss_mask) from prompt/completion
    /// JSON lines.
    Sequences,
}

/// Which items `--eval-fraction` holds out.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Whole documents (rows) chosen at random with --seed.
    Random,
    /// The last documents (rows) in input order.
    Last,
}

#[derive(clap::Args, Debug, Clone)]
pub struct TokenizeArgs {
    /// Text files, folders (their UTF-8 text files, recursively, in sorted
    /// order; hidden entries skipped), JSON lines (.jsonl) and Parquet
    /// files (.parquet, what the Hub stores): for --format tokens one
    /// document per line or row from its `text` field or column (--field),
    /// for --format sequences string fields `prompt` and `completion`.
    #[arg(required_unless_present = "dump_gpt2_files", value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
    /// The file to write; the tokenizer is written beside it as
    /// tokenizer.json, a held-out split as <stem>.eval.<ext>. All are
    /// written under temporary names and renamed into place together (a
    /// job reading the old files keeps them); they are never read as
    /// inputs.
    #[arg(long, required_unless_present = "dump_gpt2_files", value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// tokens: llm.c's .bin stream, documents separated by the end-of-text
    /// token; sequences: a safetensors file of prompt/completion rows.
    #[arg(long, value_enum, default_value_t = Format::Tokens)]
    pub format: Format,
    /// `gpt2` (GPT-2's byte-level BPE, vocabulary 50257, no download), a
    /// tokenizer.json file, or a model folder (its tokenizer.json, and its
    /// tokenizer_config.json copied beside the output). Default: gpt2.
    #[arg(long, value_name = "gpt2|PATH", conflicts_with = "train_bpe")]
    pub tokenizer: Option<String>,
    /// Train a byte-level BPE of N tokens (256 bytes, <|endoftext|> and the
    /// merges) on the input instead.
    #[arg(long, value_name = "N")]
    pub train_bpe: Option<u64>,
    /// Hold out this fraction, in [0, 1), of the documents (tokens) or rows
    /// (sequences), chosen by --split; one document is cut at its last
    /// tokens.
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub eval_fraction: f64,
    /// Which documents or rows are held out: `random` (whole ones, chosen
    /// with --seed, reproducibly) or `last` (in input order: with a sorted
    /// folder, its last files).
    #[arg(long, value_enum, default_value_t = Split::Random)]
    pub split: Split,
    /// The string field holding each document of a JSON-lines input
    /// (--format tokens): a line that is not an object with it is an error
    /// naming the line.
    #[arg(long, default_value = "text", value_name = "NAME")]
    pub field: String,
    /// Seed of the random held-out choice (--split random).
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
    #[error("--out {}: {why}", path.display())]
    BadOut { path: PathBuf, why: &'static str },
    #[error(
        "input {} is an output of this run ({}): it would be overwritten; write --out elsewhere",
        input.display(),
        output.display()
    )]
    InputIsOutput { input: PathBuf, output: PathBuf },
    #[error("input {} is not UTF-8 text", path.display())]
    NotText { path: PathBuf },
    #[error("input {}: --format sequences reads JSON lines (.jsonl) or Parquet (.parquet) with `prompt` and `completion`", path.display())]
    NotJsonLines { path: PathBuf },
    #[error("{}: {what}", path.display())]
    Parquet { path: PathBuf, what: String },
    #[error("{why}")]
    ChatTemplate { why: String },
    #[error("{} row {row}: {what}", path.display())]
    ParquetRow {
        path: PathBuf,
        row: usize,
        what: String,
    },
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
    /// A tokenizer.json or tokenizer_config.json that is not a regular
    /// file within its cap (the file names itself).
    #[error("--tokenizer {0}")]
    TokenizerRead(accrue_common::small_file::SmallFileError),
    #[error("--tokenizer: {} is not a JSON object (a model folder's tokenizer_config.json)", path.display())]
    TokenizerConfig { path: PathBuf },
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
    /// Files under the given folders left out as this run's outputs.
    pub outputs_left_out: Vec<PathBuf>,
    /// Files and folders reached again by another path, read once.
    pub repeated: Vec<PathBuf>,
    /// An earlier run's held-out split, removed (this run holds none out).
    pub removed_eval: Option<PathBuf>,
    /// An earlier run's tokenizer_config.json, removed (this run's
    /// tokenizer came with none).
    pub removed_config: Option<PathBuf>,
    /// The documents or rows the split chose from, and how it chose.
    pub held_out_of: usize,
    pub held_out_how: String,
}

impl Summary {
    /// Lines for the terminal.
    pub fn lines(&self) -> Vec<String> {
        let unit = match self.format {
            Format::Tokens => "documents",
            Format::Sequences => "rows",
        };
        let mut v = Vec::new();
        for (paths, what) in [
            (&self.skipped, "files that are not UTF-8 text"),
            (&self.outputs_left_out, "files that this run writes"),
            (
                &self.repeated,
                "files or folders reached again by another path (read once)",
            ),
        ] {
            if let Some(first) = paths.first() {
                v.push(format!(
                    "skipped {} {what} (first: {})",
                    paths.len(),
                    first.display()
                ));
            }
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
        if let Some(e) = &self.eval {
            let share = 100.0 * e.tokens as f64 / (self.train.tokens + e.tokens).max(1) as f64;
            v.push(match self.held_out_of {
                1 => format!("held out the last {share:.1}% of the one document's tokens"),
                n => format!(
                    "held out {} of {n} {unit} ({}): {share:.1}% of the tokens",
                    e.items, self.held_out_how
                ),
            });
        }
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
        if let Some(p) = &self.removed_eval {
            v.push(format!(
                "removed {}, an earlier run's held-out split",
                p.display()
            ));
        }
        if let Some(p) = &self.removed_config {
            v.push(format!(
                "removed {}, an earlier run's tokenizer_config.json (this tokenizer came \
                 without one)",
                p.display()
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
/// The tokenizer.json `--tokenizer` names: the file, or a folder's.
fn tokenizer_file(given: &Path) -> PathBuf {
    if given.is_dir() {
        given.join("tokenizer.json")
    } else {
        given.to_path_buf()
    }
}

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
    // Every refusal before anything is written; inputs before any work.
    let outputs = Outputs::new(&out)?;
    let found = collect_inputs(&args.inputs, args.format, &outputs)?;
    let files = &found.files;
    let mut skipped = Vec::new();
    let docs = match args.format {
        Format::Tokens => Input::Docs(read_docs(files, &args.field, &mut skipped)?),
        Format::Sequences => Input::Pairs(read_pairs(files, &mut skipped)?),
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
        (Some(path), None) => Tok::file(&tokenizer_file(Path::new(path)))?,
    };
    // A model folder's tokenizer_config.json (special tokens, the chat
    // template) goes beside tokenizer.json; training's checkpoints carry
    // what it says.
    let source_config = match args.tokenizer.as_deref().map(Path::new) {
        // exists(), not is_file(): a FIFO or a device there is refused by
        // name rather than passed over (and then read by the chat template).
        Some(dir) if dir.is_dir() && dir.join("tokenizer_config.json").exists() => {
            let p = dir.join("tokenizer_config.json");
            let bytes = read_small(&p, MAX_CONFIG_BYTES, "tokenizer_config.json")
                .map_err(TokenizeError::TokenizerRead)?;
            match serde_json::from_slice::<serde_json::Value>(&bytes) {
                Ok(v) if v.is_object() => Some(bytes),
                _ => return Err(TokenizeError::TokenizerConfig { path: p }),
            }
        }
        _ => None,
    };
    let vocab_size = tok.vocab_size()?;
    let wide = vocab_size > 65536;
    // Nothing replaced until all were written: the tokenizer last.
    let mut stage = Staged::default();
    let bar = progress(docs.bytes() as u64);
    let held = Held {
        fraction: args.eval_fraction,
        split: args.split,
        seed: args.seed,
    };
    let (train, eval) = match &docs {
        Input::Docs(docs) => {
            let encoded = docs
                .iter()
                .map(|d| tok.encode(d, &bar))
                .collect::<Result<Vec<_>>>()?;
            bar.finish_and_clear();
            write_tokens_split(&mut stage, &out, encoded, tok.eot, wide, held)?
        }
        Input::Pairs(pairs) => {
            let texts: Vec<&str> = pairs
                .iter()
                .flat_map(|p| match p {
                    Pair::Completion { prompt, completion } => vec![prompt.as_str(), completion],
                    Pair::Chat { .. } => vec![],
                })
                .collect();
            let mut ids = tok.encode_many(&texts, &bar)?.into_iter();
            // Chat rows: the model folder's template (--tokenizer).
            let template = if pairs.iter().any(|p| matches!(p, Pair::Chat { .. })) {
                Some(chat::ChatTemplate::load(
                    args.tokenizer.as_deref().map(Path::new),
                )?)
            } else {
                None
            };
            let mut rows = Vec::with_capacity(pairs.len());
            for p in pairs {
                match p {
                    Pair::Completion { .. } => {
                        let (Some(prompt), Some(completion)) = (ids.next(), ids.next()) else {
                            unreachable!("two encodings per completion row");
                        };
                        rows.push(completion_row(prompt, completion, tok.eot));
                    }
                    Pair::Chat {
                        messages,
                        path,
                        line,
                    } => {
                        // `template` is Some when a chat row exists (above).
                        let t = template.as_ref().expect("loaded for chat rows");
                        let row =
                            t.row(&tok.tk, messages)
                                .map_err(|what| TokenizeError::JsonLine {
                                    path: path.clone(),
                                    line: *line,
                                    what,
                                })?;
                        rows.push(row);
                    }
                }
            }
            bar.finish_and_clear();
            write_sequences_split(&mut stage, &out, rows, &tok, vocab_size, held)?
        }
    };
    stage.write(&outputs.tokenizer, &tok.json()?)?;
    if let Some(bytes) = &source_config {
        stage.write(&outputs.tokenizer_config, bytes)?;
    }
    stage.commit()?;
    // An earlier run's tokenizer_config.json would describe another
    // tokenizer's special tokens.
    let removed_config = match source_config {
        None if outputs.tokenizer_config.is_file() => {
            std::fs::remove_file(&outputs.tokenizer_config).map_err(|source| {
                TokenizeError::Output {
                    path: outputs.tokenizer_config.clone(),
                    source,
                }
            })?;
            Some(outputs.tokenizer_config.clone())
        }
        _ => None,
    };
    // An earlier run's split beside the new files would hold another
    // tokenizer's ids.
    let removed_eval = match eval {
        None if outputs.eval.is_file() && looks_binary(&outputs.eval) => {
            std::fs::remove_file(&outputs.eval).map_err(|source| TokenizeError::Output {
                path: outputs.eval.clone(),
                source,
            })?;
            Some(outputs.eval.clone())
        }
        _ => None,
    };
    Ok(Summary {
        format: args.format,
        train,
        eval,
        tokenizer_json: outputs.tokenizer,
        vocab_size,
        eot: tok.eot,
        skipped,
        outputs_left_out: found.outputs,
        repeated: found.repeated,
        removed_eval,
        removed_config,
        held_out_of: match &docs {
            Input::Docs(d) => d.len(),
            Input::Pairs(p) => p.len(),
        },
        held_out_how: match args.split {
            Split::Random => format!("at random, seed {}", args.seed),
            Split::Last => "the last ones".into(),
        },
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
