//! The tokenizers: GPT-2, a tokenizer.json, or a BPE trained on the input;
//! encoding in pieces with a progress bar.

#[allow(unused_imports)]
use super::*;
use accrue_common::small_file::{read_small, MAX_TOKENIZER_BYTES};

pub(super) struct Tok {
    pub(super) tk: Tokenizer,
    /// The bytes to write as tokenizer.json (a given file's), else `tk` is
    /// saved.
    pub(super) source: Option<Vec<u8>>,
    pub(super) eot: Option<u32>,
    /// A byte-level tokenizer with GPT-2's pre-tokenizer regex: texts may
    /// be cut into chunks (see `chunks`).
    pub(super) chunkable: bool,
}

pub(super) fn tk_err(what: &'static str) -> impl FnOnce(tokenizers::Error) -> TokenizeError {
    move |source| TokenizeError::Tokenizer { what, source }
}

/// GPT-2's layout: byte-level pre-tokenizer (no prefix space), post-processor
/// and decoder, as in Hugging Face's `gpt2/tokenizer.json`.
pub(super) fn byte_level(model: BPE) -> Tokenizer {
    let mut tk = Tokenizer::new(model);
    tk.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tk.with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
    tk.with_decoder(Some(ByteLevelDecoder::default()));
    tk
}

impl Tok {
    pub(super) fn gpt2() -> Result<Tok> {
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

    pub(super) fn file(path: &Path) -> Result<Tok> {
        // A regular file of at most 64 MiB, as the workers read it (a
        // device, a FIFO or a huge file is refused before it is read).
        let bytes = read_small(path, MAX_TOKENIZER_BYTES, "tokenizer.json")
            .map_err(TokenizeError::TokenizerRead)?;
        let tk = Tokenizer::from_bytes(&bytes).map_err(|source| TokenizeError::TokenizerFile {
            path: path.to_path_buf(),
            source,
        })?;
        let eot = EOT_NAMES.iter().find_map(|n| tk.token_to_id(n));
        Ok(Tok {
            tk,
            source: Some(bytes),
            eot,
            chunkable: false,
        })
    }

    pub(super) fn trained(n: usize, input: &Input) -> Result<Tok> {
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
        // Trained on pre-tokens of at most MAX_TRAIN_PRE_TOKEN bytes: the
        // trainer's merges cost the square of a word's length (400 KB of
        // letters without a space is one pre-token, and took minutes).
        // Text whose pre-tokens are all shorter trains as before; encoding
        // uses the byte-level pre-tokenizer alone.
        tk.with_pre_tokenizer(Some(PreTokenizerSequence::new(vec![
            ByteLevel::default().add_prefix_space(false).into(),
            FixedLength::new(MAX_TRAIN_PRE_TOKEN).into(),
        ])));
        let texts = input.texts();
        tk.train(&mut trainer, texts.into_iter())
            .map_err(tk_err("training the BPE"))?;
        tk.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
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
    pub(super) fn vocab_size(&self) -> Result<u64> {
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

    /// The bytes of tokenizer.json: a given file's own, else `tk` saved.
    pub(super) fn json(&self) -> Result<Vec<u8>> {
        match &self.source {
            Some(bytes) => Ok(bytes.clone()),
            None => Ok(self
                .tk
                .to_string(true)
                .map_err(tk_err("serializing the tokenizer"))?
                .into_bytes()),
        }
    }

    /// The ids of `text` (no special tokens added), advancing `bar` by its
    /// bytes.
    pub(super) fn encode(&self, text: &str, bar: &ProgressBar) -> Result<Vec<u32>> {
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
    pub(super) fn encode_many(&self, texts: &[&str], bar: &ProgressBar) -> Result<Vec<Vec<u32>>> {
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
pub(super) fn chunks(text: &str) -> Vec<&str> {
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

pub(super) fn progress(total: u64) -> ProgressBar {
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
