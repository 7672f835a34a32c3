//! [`Sequences`]: rows of tokens of different lengths (`[data] kind =
//! "sequences"`), e.g. prompt + completion pairs for fine-tuning.
//!
//! A safetensors file with
//! - `tokens`: U16, U32, I32 or I64, 1-D: all rows, one after the other;
//! - `offsets`: I64, 1-D, n + 1 entries: row i is
//!   `tokens[offsets[i]..offsets[i+1]]` (`offsets[0]` = 0, non-decreasing,
//!   the last = the number of tokens; an empty row is allowed and, like a
//!   row of one token, has no target);
//! - `loss_mask` (optional): U8 or BOOL, 1-D, one per token; 0 = this token
//!   is not predicted (e.g. a prompt's).
//!
//! A row is cut to its first T + 1 tokens; inputs are `row[:-1]`, targets
//! `row[1:]`; a target whose mask is 0 becomes -100 ([`IGNORE_INDEX`]);
//! rows are right-padded to T with `pad_id` (inputs) and -100 (targets).
//!
//! Packed ([`Sequences::packed`], `data.pack`): a sample is a pack of rows
//! (source::pack), each row's pairs one after the other, then padding;
//! the inputs are `[N, 2, T]`, ids and each token's position within its
//! row (family/llama/packed.rs), and every row keeps its own targets.

use super::lm::{self, file_err};
use super::{DataSource, TokenOptions, IGNORE_INDEX};
use crate::error::{Result, TorchContext};
use crate::source::batch::Batch;
use safetensors::tensor::{Dtype, TensorInfo};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

/// Where one tensor's bytes lie in the map.
#[derive(Debug, Clone, Copy)]
struct Span {
    /// Byte offset of element 0.
    start: usize,
    /// Elements.
    len: usize,
    dtype: Dtype,
}

impl Span {
    fn bytes<'m>(&self, map: &'m [u8]) -> &'m [u8] {
        &map[self.start..self.start + self.len * self.dtype.size()]
    }

    /// Element `i` as an i64 (integer dtypes of at most 64 bits; U64 is
    /// never accepted).
    fn get(&self, map: &[u8], i: usize) -> i64 {
        let w = self.dtype.size();
        let b = &map[self.start + i * w..self.start + (i + 1) * w];
        match self.dtype {
            Dtype::BOOL | Dtype::U8 => b[0] as i64,
            Dtype::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            Dtype::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            Dtype::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            Dtype::I64 => i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            other => unreachable!("dtype {other:?} is refused at open"),
        }
    }
}

/// Rows of a safetensors file read through a read-only memory map; the
/// whole file is validated once at [`Sequences::open`], batches copy only
/// the rows they are asked for.
#[derive(Debug)]
pub struct Sequences {
    path: PathBuf,
    field: &'static str,
    map: lm::Mapped,
    tokens: Span,
    offsets: Span,
    mask: Option<Span>,
    rows: usize,
    seq_len: usize,
    pad_id: i64,
    device: Device,
    /// Packed: the rows of each sample (None: one row per sample).
    packs: Option<Vec<Vec<usize>>>,
}

impl Sequences {
    /// Maps and validates the sequences file at `path`, which the spec's
    /// `field` (`"data.path"` or `"data.eval_path"`) names in every error:
    /// missing tensors, dtypes and shapes (the allowed ones named), offsets
    /// that do not start at 0, decrease (the index named) or do not end at
    /// the number of tokens, a mask of another length, a token outside
    /// `0..opts.vocab_size` (its position and row named); `opts.pad_id`
    /// must lie in `0..vocab_size`. Batches are built on the host and moved
    /// to `opts.device`.
    pub fn open(path: &Path, field: &'static str, opts: &TokenOptions) -> Result<Sequences> {
        lm::check_options(opts, true)?;
        let map = lm::map_file(field, path)?;
        let (header, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
            file_err(
                field,
                path,
                format!(
                    "is not a readable safetensors file: {}",
                    crate::error::safetensors_words(&e)
                ),
            )
        })?;
        let base = 8 + header;
        let infos = meta.tensors();
        let names = || {
            let mut n: Vec<&str> = infos.keys().map(|s| s.as_str()).collect();
            n.sort_unstable();
            n
        };
        let span = |name: &str, info: &TensorInfo, allowed: &[Dtype]| -> Result<Span> {
            if !allowed.contains(&info.dtype) {
                return Err(file_err(
                    field,
                    path,
                    format!(
                        "tensor {name:?} has dtype {:?}; allowed: {}",
                        info.dtype,
                        allowed
                            .iter()
                            .map(|d| format!("{d:?}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
            if info.shape.len() != 1 {
                return Err(file_err(
                    field,
                    path,
                    format!("tensor {name:?} has shape {:?}; it must be 1-D", info.shape),
                ));
            }
            Ok(Span {
                start: base + info.data_offsets.0,
                len: info.shape[0],
                dtype: info.dtype,
            })
        };
        let need = |name: &str| {
            infos.get(name).copied().ok_or_else(|| {
                file_err(
                    field,
                    path,
                    format!(
                        "has no tensor {name:?} (it holds {:?}; need tokens and offsets, \
                         optionally loss_mask)",
                        names()
                    ),
                )
            })
        };
        let tokens = span(
            "tokens",
            need("tokens")?,
            &[Dtype::U16, Dtype::U32, Dtype::I32, Dtype::I64],
        )?;
        let offsets = span("offsets", need("offsets")?, &[Dtype::I64])?;
        let mask = match infos.get("loss_mask") {
            Some(info) => Some(span("loss_mask", info, &[Dtype::U8, Dtype::BOOL])?),
            None => None,
        };

        if offsets.len < 2 {
            return Err(file_err(
                field,
                path,
                format!(
                    "offsets has {} entries: it needs n + 1 for n >= 1 rows",
                    offsets.len
                ),
            ));
        }
        let first = offsets.get(&map, 0);
        if first != 0 {
            return Err(file_err(
                field,
                path,
                format!("offsets[0] = {first}, must be 0"),
            ));
        }
        let mut prev = 0;
        for i in 1..offsets.len {
            let o = offsets.get(&map, i);
            if o < prev {
                return Err(file_err(
                    field,
                    path,
                    format!(
                        "offsets decrease at index {i}: offsets[{i}] = {o} < offsets[{}] = {prev}",
                        i - 1
                    ),
                ));
            }
            prev = o;
        }
        if prev != tokens.len as i64 {
            return Err(file_err(
                field,
                path,
                format!(
                    "the last offset (offsets[{}]) is {prev}, but tokens holds {} tokens",
                    offsets.len - 1,
                    tokens.len
                ),
            ));
        }
        if let Some(m) = mask {
            if m.len != tokens.len {
                return Err(file_err(
                    field,
                    path,
                    format!(
                        "loss_mask has {} entries, tokens has {}: need one per token",
                        m.len, tokens.len
                    ),
                ));
            }
        }

        let seqs = Sequences {
            path: path.to_path_buf(),
            field,
            map,
            tokens,
            offsets,
            mask,
            rows: offsets.len - 1,
            seq_len: opts.seq_len,
            pad_id: opts.pad_id,
            device: opts.device,
            packs: None,
        };
        seqs.check_vocab(opts.vocab_size)?;
        seqs.check_targets()?;
        Ok(seqs)
    }

    /// Refuses a file no row of which has a target within its first
    /// T + 1 tokens (every loss_mask 0 there, rows of fewer than 2
    /// tokens, prompts longer than T): nothing would be trained or
    /// evaluated, and every step would be skipped (issue 37). Rows without
    /// a target, and rows longer than T + 1 (cut), are reported when they
    /// are a large share.
    fn check_targets(&self) -> Result<()> {
        let t = self.seq_len;
        let (mut without, mut cut) = (0usize, 0usize);
        for i in 0..self.rows {
            let start = self.offsets.get(&self.map, i) as usize;
            let len = self.row_len(i);
            let pairs = len.min(t + 1).saturating_sub(1);
            let has = match &self.mask {
                None => pairs > 0,
                Some(m) => (start + 1..start + 1 + pairs).any(|k| m.get(&self.map, k) != 0),
            };
            without += usize::from(!has);
            cut += usize::from(len > t + 1);
        }
        if self.rows > 0 && without == self.rows {
            return Err(file_err(
                self.field,
                &self.path,
                format!(
                    "no row has a target within its first data.seq_len + 1 = {} tokens ({} rows: every loss_mask is 0 there, or the row has fewer than 2 tokens): nothing to train or evaluate on; raise data.seq_len or put the completions first",
                    t + 1,
                    self.rows
                ),
            ));
        }
        let share = |n: usize| 100.0 * n as f64 / self.rows.max(1) as f64;
        if without > 0 {
            tracing::warn!(
                path = %self.path.display(),
                rows = self.rows,
                without_target = without,
                "{:.1}% of the rows have no target within data.seq_len + 1 = {} tokens: they add nothing",
                share(without),
                t + 1
            );
        }
        if share(cut) >= 25.0 {
            tracing::warn!(
                path = %self.path.display(),
                rows = self.rows,
                cut,
                "{:.1}% of the rows are longer than data.seq_len + 1 = {} tokens and are cut",
                share(cut),
                t + 1
            );
        }
        Ok(())
    }

    /// One sequential pass: the first token outside `0..vocab_size` is
    /// refused, with its row.
    fn check_vocab(&self, vocab_size: i64) -> Result<()> {
        lm::advise_sequential(&self.map);
        let bytes = self.tokens.bytes(&self.map);
        let ok = |t: i64| (0..vocab_size).contains(&t);
        let bad = match self.tokens.dtype {
            Dtype::U16 => bytes
                .chunks_exact(2)
                .position(|b| !ok(u16::from_le_bytes([b[0], b[1]]) as i64)),
            Dtype::U32 => bytes
                .chunks_exact(4)
                .position(|b| !ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64)),
            Dtype::I32 => bytes
                .chunks_exact(4)
                .position(|b| !ok(i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64)),
            _ => bytes.chunks_exact(8).position(|b| {
                !ok(i64::from_le_bytes([
                    b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
                ]))
            }),
        };
        lm::advise_random(&self.map);
        match bad {
            Some(position) => {
                let row = self.row_of(position);
                Err(lm::token_err(
                    self.field,
                    &self.path,
                    self.tokens.get(&self.map, position),
                    position,
                    vocab_size,
                    &format!(" (row {row})"),
                ))
            }
            None => Ok(()),
        }
    }

    /// The row holding token `position` (the last non-empty one whose
    /// start is <= position; offsets are validated).
    fn row_of(&self, position: usize) -> usize {
        let (mut lo, mut hi) = (0, self.rows);
        // Invariant: offsets[lo] <= position < offsets[hi].
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if self.offsets.get(&self.map, mid) as usize <= position {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// The same rows packed into samples of T positions (best-fit
    /// decreasing, source::pack): each row's min(len, T + 1) - 1 pairs.
    pub fn packed(mut self) -> Self {
        let t = self.seq_len;
        let pairs: Vec<usize> = (0..self.rows)
            .map(|i| self.row_len(i).min(t + 1).saturating_sub(1))
            .collect();
        let packs = super::pack::best_fit_decreasing(&pairs, t);
        tracing::info!(
            path = %self.path.display(),
            rows = self.rows,
            samples = packs.len(),
            fill = pairs.iter().sum::<usize>() as f64 / (packs.len().max(1) * t) as f64,
            "packed the rows into samples of data.seq_len positions"
        );
        self.packs = Some(packs);
        self
    }

    /// Samples: packs when packed, else rows.
    pub fn samples(&self) -> usize {
        self.packs.as_ref().map_or(self.rows, |p| p.len())
    }

    /// Row `i`'s input-target pairs into `inp`, `tgt` (and 0, 1, ... into
    /// `pos`); returns how many.
    fn row_into(
        &self,
        i: usize,
        inp: &mut [i64],
        tgt: &mut [i64],
        pos: Option<&mut [i64]>,
    ) -> usize {
        let t = self.seq_len;
        let start = self.offsets.get(&self.map, i) as usize;
        let end = self.offsets.get(&self.map, i + 1) as usize;
        // The row cut to T + 1 tokens gives min(len, T + 1) - 1 pairs
        // (inputs row[:-1], targets row[1:]): a row of 0 or 1 token is
        // all padding.
        let pairs = (end - start).min(t + 1).saturating_sub(1);
        for p in 0..pairs {
            inp[p] = self.tokens.get(&self.map, start + p);
            let k = start + p + 1;
            let predicted = self.mask.is_none_or(|m| m.get(&self.map, k) != 0);
            if predicted {
                tgt[p] = self.tokens.get(&self.map, k);
            }
        }
        if let Some(pos) = pos {
            for (p, slot) in pos[..pairs].iter_mut().enumerate() {
                *slot = p as i64;
            }
        }
        pairs
    }

    /// Batches are built on the host and then moved to `device`.
    pub fn to_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Tokens in the file (all rows).
    pub fn token_count(&self) -> usize {
        self.tokens.len
    }

    /// Whether the file has a `loss_mask`.
    pub fn has_mask(&self) -> bool {
        self.mask.is_some()
    }

    /// T: positions per sample.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Tokens of row `i` (before the cut to T + 1). Panics if `i >=
    /// len()`.
    pub fn row_len(&self, i: usize) -> usize {
        (self.offsets.get(&self.map, i + 1) - self.offsets.get(&self.map, i)) as usize
    }
}

impl DataSource for Sequences {
    fn len(&self) -> usize {
        self.samples()
    }

    fn batch(&self, indices: &Tensor) -> Result<Batch> {
        let idx = lm::host_indices(indices, self.samples(), self.field, &self.path)?;
        self.map.check_len(self.field, &self.path)?;
        let t = self.seq_len;
        let mut inputs = vec![self.pad_id; idx.len() * t];
        let mut targets = vec![IGNORE_INDEX; idx.len() * t];
        let Some(packs) = &self.packs else {
            for (r, &i) in idx.iter().enumerate() {
                self.row_into(i, &mut inputs[r * t..], &mut targets[r * t..], None);
            }
            return lm::lm_batch(&inputs, &targets, idx.len(), t, self.device);
        };
        let mut positions = vec![0i64; idx.len() * t];
        for (r, &i) in idx.iter().enumerate() {
            let mut at = r * t;
            for &row in &packs[i] {
                at += self.row_into(
                    row,
                    &mut inputs[at..],
                    &mut targets[at..],
                    Some(&mut positions[at..]),
                );
            }
            // Padding: a row of its own (positions from 0), no targets.
            for (p, slot) in positions[at..(r + 1) * t].iter_mut().enumerate() {
                *slot = p as i64;
            }
        }
        let batch = lm::lm_batch(&inputs, &targets, idx.len(), t, self.device)?;
        let positions = Tensor::f_from_slice(&positions)
            .and_then(|p| p.f_view([idx.len() as i64, t as i64]))
            .and_then(|p| p.f_to_device(self.device))
            .and_then(|p| crate::family::llama::packed::inputs(&batch.inputs, &p))
            .ctx("building a packed batch")?;
        Ok(Batch {
            inputs: positions,
            ..batch
        })
    }
}
