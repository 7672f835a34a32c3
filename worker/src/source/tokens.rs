//! [`TokenStream`]: one flat stream of tokens for pre-training (`[data]
//! kind = "tokens"`).
//!
//! The file is llm.c's `.bin` format (karpathy/llm.c,
//! `dev/data/data_common.py`): a header of 256 little-endian int32,
//! `header[0]` the magic ([`MAGIC_U16`]: u16 tokens, [`MAGIC_U32`]: u32
//! tokens), `header[1]` the version, `header[2]` the token count, then the
//! tokens, little-endian. Or, with `data.dtype = "u16" | "u32"`, the same
//! tokens without a header (nanoGPT's `.bin`).
//!
//! Sample j is `tokens[j*T .. j*T + T + 1]`: inputs its first T tokens,
//! targets its last T (every target counts); n = (count - 1) div T.

use super::lm::{self, file_err};
use super::{DataSource, TokenDtype, TokenOptions};
use crate::error::Result;
use crate::source::batch::Batch;
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

/// llm.c's magic for u16 tokens (GPT-2's vocabulary fits).
pub const MAGIC_U16: i32 = 20240520;
/// llm.c's magic for u32 tokens (Llama 3's vocabulary).
pub const MAGIC_U32: i32 = 20240801;
/// The llm.c header: 256 int32.
pub const HEADER_BYTES: usize = 256 * 4;

/// A token file read through a read-only memory map.
///
/// The file is never loaded whole: [`TokenStream::open`] maps it and makes
/// one sequential pass over the map to check every token against
/// `vocab_size` (the kernel pages it in and may drop the pages again), and
/// [`DataSource::batch`] copies only the T + 1 tokens of each sample it is
/// asked for. Resident memory is thus bounded by the page cache, not by the
/// file's size.
#[derive(Debug)]
pub struct TokenStream {
    path: PathBuf,
    field: &'static str,
    map: lm::Mapped,
    /// Byte offset of token 0 (the header's size, or 0).
    start: usize,
    dtype: TokenDtype,
    /// The llm.c header's version, `None` for a headerless file.
    version: Option<i32>,
    count: usize,
    seq_len: usize,
    samples: usize,
    device: Device,
}

impl TokenStream {
    /// Maps and validates the token file at `path`, which the spec's
    /// `field` (`"data.path"` or `"data.eval_path"`) names in every error:
    /// a bad magic (or a header given with `opts.dtype`), a header whose
    /// count disagrees with the file's size, a headerless file that is not
    /// a whole number of tokens, too few tokens for one sample, and a token
    /// `>= opts.vocab_size` (its position named). Batches are built on the
    /// host and moved to `opts.device`.
    pub fn open(path: &Path, field: &'static str, opts: &TokenOptions) -> Result<TokenStream> {
        lm::check_options(opts, false)?;
        let map = lm::map_file(field, path)?;
        let len = map.len();
        let magic = (len >= 4).then(|| i32::from_le_bytes([map[0], map[1], map[2], map[3]]));
        let is_magic = matches!(magic, Some(MAGIC_U16 | MAGIC_U32));
        let (start, dtype, version, count) = match opts.dtype {
            Some(dtype) => {
                if is_magic && len >= HEADER_BYTES {
                    return Err(file_err(
                        field,
                        path,
                        format!(
                            "starts with llm.c's magic {} (a header): leave data.dtype out for a \
                             file with a header (data.dtype = {:?} is for headerless files)",
                            // is_magic: there is a magic.
                            magic.unwrap_or_default(),
                            dtype.name()
                        ),
                    ));
                }
                let width = dtype.width();
                if len % width != 0 {
                    return Err(file_err(
                        field,
                        path,
                        format!(
                            "holds {len} bytes, not a whole number of {} tokens ({width} bytes \
                             each; data.dtype = {:?})",
                            dtype.name(),
                            dtype.name()
                        ),
                    ));
                }
                (0, dtype, None, len / width)
            }
            None => {
                if len < HEADER_BYTES {
                    return Err(file_err(
                        field,
                        path,
                        format!(
                            "holds {len} bytes, less than llm.c's {HEADER_BYTES}-byte header; a \
                             file of tokens without a header needs data.dtype = \"u16\" or \"u32\""
                        ),
                    ));
                }
                let header = |i: usize| {
                    i32::from_le_bytes([map[4 * i], map[4 * i + 1], map[4 * i + 2], map[4 * i + 3]])
                };
                let dtype = match header(0) {
                    MAGIC_U16 => TokenDtype::U16,
                    MAGIC_U32 => TokenDtype::U32,
                    other => {
                        return Err(file_err(
                            field,
                            path,
                            format!(
                                "bad magic {other} in header[0]: expected {MAGIC_U16} (llm.c, u16 \
                                 tokens) or {MAGIC_U32} (u32 tokens); a file of tokens without a \
                                 header needs data.dtype = \"u16\" or \"u32\""
                            ),
                        ))
                    }
                };
                let declared = header(2);
                let count = usize::try_from(declared).map_err(|_| {
                    file_err(
                        field,
                        path,
                        format!("header[2] (the token count) is negative: {declared}"),
                    )
                })?;
                let want = HEADER_BYTES as u128 + count as u128 * dtype.width() as u128;
                if len as u128 != want {
                    let what = if (len as u128) < want {
                        "truncated"
                    } else {
                        "longer than its header says"
                    };
                    return Err(file_err(
                        field,
                        path,
                        format!(
                            "{what}: the header says {count} {} tokens ({want} bytes with the \
                             header), the file holds {len} bytes",
                            dtype.name()
                        ),
                    ));
                }
                (HEADER_BYTES, dtype, Some(header(1)), count)
            }
        };
        let samples = count.saturating_sub(1) / opts.seq_len;
        if samples == 0 {
            return Err(file_err(
                field,
                path,
                format!(
                    "holds {count} tokens, too few for one sample of data.seq_len = {} (it takes \
                     {} tokens)",
                    opts.seq_len,
                    opts.seq_len + 1
                ),
            ));
        }
        let stream = TokenStream {
            path: path.to_path_buf(),
            field,
            map,
            start,
            dtype,
            version,
            count,
            seq_len: opts.seq_len,
            samples,
            device: opts.device,
        };
        stream.check_vocab(opts.vocab_size)?;
        Ok(stream)
    }

    /// One sequential pass: the first token `>= vocab_size` is refused.
    fn check_vocab(&self, vocab_size: i64) -> Result<()> {
        lm::advise_sequential(&self.map);
        let bytes = &self.map[self.start..];
        let bad = match self.dtype {
            TokenDtype::U16 => bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]) as i64)
                .position(|t| t >= vocab_size),
            TokenDtype::U32 => bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64)
                .position(|t| t >= vocab_size),
        };
        lm::advise_random(&self.map);
        match bad {
            Some(position) => Err(lm::token_err(
                self.field,
                &self.path,
                self.token(position),
                position,
                vocab_size,
                "",
            )),
            None => Ok(()),
        }
    }

    /// Token `k` of the stream.
    fn token(&self, k: usize) -> i64 {
        let at = self.start + k * self.dtype.width();
        let b = &self.map[at..at + self.dtype.width()];
        match self.dtype {
            TokenDtype::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            TokenDtype::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
        }
    }

    /// Batches are built on the host and then moved to `device`.
    pub fn to_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Tokens in the file.
    pub fn token_count(&self) -> usize {
        self.count
    }

    /// The token width (from the header, or `data.dtype`).
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// The llm.c header's version (`header[1]`), `None` without a header.
    pub fn version(&self) -> Option<i32> {
        self.version
    }

    /// T: positions per sample.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }
}

impl DataSource for TokenStream {
    fn len(&self) -> usize {
        self.samples
    }

    fn batch(&self, indices: &Tensor) -> Result<Batch> {
        let idx = lm::host_indices(indices, self.samples, self.field, &self.path)?;
        self.map.check_len(self.field, &self.path)?;
        let t = self.seq_len;
        let mut inputs = Vec::with_capacity(idx.len() * t);
        let mut targets = Vec::with_capacity(idx.len() * t);
        for &j in &idx {
            let first = j * t;
            inputs.extend((first..first + t).map(|k| self.token(k)));
            targets.extend((first + 1..first + t + 1).map(|k| self.token(k)));
        }
        lm::lm_batch(&inputs, &targets, idx.len(), t, self.device)
    }
}
