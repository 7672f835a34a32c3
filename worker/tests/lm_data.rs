//! The language-model readers (worker/src/source/tokens.rs and
//! sequences.rs) on small files written here in the real formats: llm.c
//! token files (u16 and u32 headers), headerless token files, and
//! safetensors sequence files with and without a loss mask. Batches are
//! checked against hand-computed inputs, targets and counts; every refused
//! file must name the spec field, the file and the position or value.

mod common;

use accrue_worker::source::tokens::{HEADER_BYTES, MAGIC_U16, MAGIC_U32};
use accrue_worker::source::{
    DataSource, Sequences, TokenDtype, TokenOptions, TokenStream, IGNORE_INDEX,
};
use accrue_worker::Error;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};
use tempfile::TempDir;

const X: i64 = IGNORE_INDEX;

// ---------------------------------------------------------------- helpers

fn opts(seq_len: usize, vocab_size: i64) -> TokenOptions {
    TokenOptions {
        seq_len,
        pad_id: 0,
        vocab_size,
        dtype: None,
        device: Device::Cpu,
    }
}

/// An llm.c file: 256 int32 header (magic, version, count), then tokens.
fn llmc(magic: i32, version: i32, count: i32, token_bytes: &[u8]) -> Vec<u8> {
    let mut header = [0i32; 256];
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    let mut out: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(out.len(), HEADER_BYTES);
    out.extend_from_slice(token_bytes);
    out
}

fn u16s(tokens: &[u16]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn u32s(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn write(dir: &TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// One tensor of a safetensors file: name, dtype, shape, raw bytes.
type Entry<'a> = (&'a str, Dtype, Vec<usize>, Vec<u8>);

fn safetensors_file(dir: &TempDir, name: &str, entries: &[Entry]) -> PathBuf {
    let views: Vec<(&str, TensorView)> = entries
        .iter()
        .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let bytes = safetensors::serialize(views, &None).unwrap();
    write(dir, name, &bytes)
}

fn i64s(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn i32s(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// The rows used by the sequences tests (T = 4, pad_id = 99):
/// [5 6 7], [1], [2 3 4 5 6 7 8] (cut to 5 tokens), [] and [9 10].
const ROWS: [&[i64]; 5] = [&[5, 6, 7], &[1], &[2, 3, 4, 5, 6, 7, 8], &[], &[9, 10]];

fn flat_rows() -> (Vec<i64>, Vec<i64>) {
    let mut tokens = Vec::new();
    let mut offsets = vec![0i64];
    for r in ROWS {
        tokens.extend_from_slice(r);
        offsets.push(tokens.len() as i64);
    }
    (tokens, offsets)
}

fn tokens_entry(tokens: &[i64], dtype: Dtype) -> Entry<'static> {
    let bytes = match dtype {
        Dtype::U16 => tokens
            .iter()
            .flat_map(|&t| (t as u16).to_le_bytes())
            .collect(),
        Dtype::U32 => tokens
            .iter()
            .flat_map(|&t| (t as u32).to_le_bytes())
            .collect(),
        Dtype::I32 => tokens
            .iter()
            .flat_map(|&t| (t as i32).to_le_bytes())
            .collect(),
        Dtype::I64 => i64s(tokens),
        Dtype::F32 => tokens
            .iter()
            .flat_map(|&t| (t as f32).to_le_bytes())
            .collect(),
        other => panic!("{other:?}"),
    };
    ("tokens", dtype, vec![tokens.len()], bytes)
}

fn seq_opts() -> TokenOptions {
    TokenOptions {
        seq_len: 4,
        pad_id: 99,
        vocab_size: 100,
        dtype: None,
        device: Device::Cpu,
    }
}

fn idx(v: &[i64]) -> Tensor {
    Tensor::from_slice(v)
}

fn rows_of(t: &Tensor) -> Vec<Vec<i64>> {
    assert_eq!(t.kind(), Kind::Int64);
    Vec::<Vec<i64>>::try_from(t).unwrap()
}

/// The error's message, checked to name `field` and the file.
fn message(err: Error, field: &str, path: &Path) -> String {
    let msg = err.to_string();
    let head = format!("{field} = {:?}: ", path.display().to_string());
    assert!(
        msg.starts_with(&head),
        "message should start with {head:?}: {msg}"
    );
    msg
}

/// A sequences file of `entries` is refused at open, the message naming
/// `field`, the file and `parts`.
fn assert_sequences_refused(
    dir: &TempDir,
    name: &str,
    entries: &[Entry],
    field: &'static str,
    parts: &[&str],
) {
    let p = safetensors_file(dir, name, entries);
    let err = Sequences::open(&p, field, &seq_opts()).unwrap_err();
    assert_has(&message(err, field, &p), parts);
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message lacks {p:?}: {msg}");
    }
}

// ------------------------------------------------------- token streams

#[test]
fn llmc_u16_samples_are_shifted_windows_of_t_plus_1_tokens() {
    let dir = TempDir::new().unwrap();
    let toks: Vec<u16> = (0..14).map(|k| 1000 + k).collect();
    let p = write(&dir, "train.bin", &llmc(MAGIC_U16, 1, 14, &u16s(&toks)));
    let s = TokenStream::open(&p, "data.path", &opts(4, 50257)).unwrap();
    // n = (14 - 1) div 4 = 3.
    assert_eq!(s.len(), 3);
    assert_eq!(s.token_count(), 14);
    assert_eq!(s.dtype(), TokenDtype::U16);
    assert_eq!(s.version(), Some(1));
    assert!(s.resident().is_empty());
    let b = s.batch(&idx(&[2, 0])).unwrap();
    assert_eq!(
        rows_of(&b.inputs),
        [[1008, 1009, 1010, 1011], [1000, 1001, 1002, 1003]]
    );
    assert_eq!(
        rows_of(&b.targets),
        [[1009, 1010, 1011, 1012], [1001, 1002, 1003, 1004]]
    );
    assert_eq!(b.count, 8);
    assert_eq!(b.inputs.device(), Device::Cpu);
    // The last sample ends at token 12 + 1; token 13 is never a target.
    let last = s.range(2, 1, Device::Cpu).unwrap();
    assert_eq!(rows_of(&last.targets), [[1009, 1010, 1011, 1012]]);
}

#[test]
fn llmc_u32_tokens_above_u16() {
    let dir = TempDir::new().unwrap();
    let toks: Vec<u32> = (0..10).map(|k| 100_000 + k).collect();
    let p = write(&dir, "train.bin", &llmc(MAGIC_U32, 7, 10, &u32s(&toks)));
    let s = TokenStream::open(&p, "data.path", &opts(3, 128_256)).unwrap();
    assert_eq!(s.len(), 3); // (10 - 1) div 3
    assert_eq!(s.dtype(), TokenDtype::U32);
    assert_eq!(s.version(), Some(7));
    let b = s.batch(&idx(&[1])).unwrap();
    assert_eq!(rows_of(&b.inputs), [[100_003, 100_004, 100_005]]);
    assert_eq!(rows_of(&b.targets), [[100_004, 100_005, 100_006]]);
    assert_eq!(b.count, 3);
}

#[test]
fn headerless_u16_and_u32_with_dtype() {
    let dir = TempDir::new().unwrap();
    let toks: Vec<u16> = (0..9).collect();
    let p = write(&dir, "raw16.bin", &u16s(&toks));
    let o = TokenOptions {
        dtype: Some(TokenDtype::U16),
        ..opts(4, 10)
    };
    let s = TokenStream::open(&p, "data.path", &o).unwrap();
    assert_eq!((s.len(), s.version()), (2, None));
    let b = s.batch(&idx(&[1, 0, 1])).unwrap();
    assert_eq!(
        rows_of(&b.inputs),
        [[4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    );
    assert_eq!(
        rows_of(&b.targets),
        [[5, 6, 7, 8], [1, 2, 3, 4], [5, 6, 7, 8]]
    );
    assert_eq!(b.count, 12);

    let toks: Vec<u32> = (0..7).map(|k| 70_000 + k).collect();
    let p = write(&dir, "raw32.bin", &u32s(&toks));
    let o = TokenOptions {
        dtype: Some(TokenDtype::U32),
        ..opts(2, 80_000)
    };
    let s = TokenStream::open(&p, "data.eval_path", &o).unwrap();
    assert_eq!(s.len(), 3);
    let b = s.batch(&idx(&[2])).unwrap();
    assert_eq!(rows_of(&b.inputs), [[70_004, 70_005]]);
    assert_eq!(rows_of(&b.targets), [[70_005, 70_006]]);
}

/// A token file truncated under an open reader (an in-place rewrite): the
/// next batch is an error naming the file and both sizes, not SIGBUS on
/// the pages past the new end (issue 37).
#[test]
fn a_file_that_shrinks_under_the_reader_is_an_error_not_a_signal() {
    let dir = TempDir::new().unwrap();
    let toks: Vec<u16> = (0..20_000).map(|k| (k % 50) as u16).collect();
    let bytes = llmc(MAGIC_U16, 1, 20_000, &u16s(&toks));
    let p = write(&dir, "train.bin", &bytes);
    let s = TokenStream::open(&p, "data.path", &opts(8, 50)).unwrap();
    let last = s.len() as i64 - 1;
    s.batch(&idx(&[last])).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(2048)
        .unwrap();
    let err = s.batch(&idx(&[last])).unwrap_err();
    assert_has(
        &message(err, "data.path", &p),
        &[
            &format!(
                "shrank from {} to 2048 bytes while the job read it",
                bytes.len()
            ),
            "renaming it (accrue tokenize does)",
        ],
    );
}

#[test]
fn bad_magic_names_the_value_the_magics_and_dtype() {
    let dir = TempDir::new().unwrap();
    let p = write(&dir, "x.bin", &llmc(12345, 1, 4, &u16s(&[1, 2, 3, 4])));
    let err = TokenStream::open(&p, "data.path", &opts(2, 10)).unwrap_err();
    let msg = message(err, "data.path", &p);
    assert_has(
        &msg,
        &["bad magic 12345", "20240520", "20240801", "data.dtype"],
    );
}

#[test]
fn truncated_file_names_the_count_and_the_size() {
    let dir = TempDir::new().unwrap();
    let toks: Vec<u16> = (0..50).collect();
    let p = write(&dir, "x.bin", &llmc(MAGIC_U16, 1, 100, &u16s(&toks)));
    let err = TokenStream::open(&p, "data.path", &opts(4, 100)).unwrap_err();
    let msg = message(err, "data.path", &p);
    let want = format!(
        "truncated: the header says 100 u16 tokens ({} bytes with the header), the file holds {} bytes",
        HEADER_BYTES + 200,
        HEADER_BYTES + 100
    );
    assert!(msg.ends_with(&want), "{msg}");

    // Bytes past the declared count are refused too.
    let p = write(&dir, "y.bin", &llmc(MAGIC_U16, 1, 10, &u16s(&toks)));
    let err = TokenStream::open(&p, "data.path", &opts(4, 100)).unwrap_err();
    assert_has(
        &message(err, "data.path", &p),
        &["longer than its header says", "10 u16 tokens"],
    );
}

#[test]
fn headerless_without_dtype_and_header_with_dtype_are_refused() {
    let dir = TempDir::new().unwrap();
    // Shorter than a header.
    let p = write(&dir, "small.bin", &u16s(&[1, 2, 3, 4, 5]));
    let err = TokenStream::open(&p, "data.path", &opts(2, 10)).unwrap_err();
    assert_has(
        &message(err, "data.path", &p),
        &[
            "holds 10 bytes",
            "1024-byte header",
            "data.dtype = \"u16\" or \"u32\"",
        ],
    );
    // Long enough for a header, but none there: the magic is the first
    // two tokens (7, 0) read as an int32.
    let toks: Vec<u16> = (0..1000).map(|k| if k % 2 == 0 { 7 } else { 0 }).collect();
    let p = write(&dir, "big.bin", &u16s(&toks));
    let err = TokenStream::open(&p, "data.eval_path", &opts(2, 10)).unwrap_err();
    assert_has(
        &message(err, "data.eval_path", &p),
        &["bad magic 7", "data.dtype"],
    );
    // A header file given a dtype.
    let p = write(&dir, "h.bin", &llmc(MAGIC_U16, 1, 3, &u16s(&[1, 2, 3])));
    let o = TokenOptions {
        dtype: Some(TokenDtype::U16),
        ..opts(2, 10)
    };
    let err = TokenStream::open(&p, "data.path", &o).unwrap_err();
    assert_has(
        &message(err, "data.path", &p),
        &["20240520", "leave data.dtype out"],
    );
    // A headerless file that is not a whole number of tokens.
    let p = write(&dir, "odd.bin", &[1, 0, 2, 0, 3]);
    let err = TokenStream::open(&p, "data.path", &o).unwrap_err();
    assert_has(
        &message(err, "data.path", &p),
        &["holds 5 bytes", "not a whole number of u16 tokens"],
    );
}

#[test]
fn too_few_tokens_for_one_sample() {
    let dir = TempDir::new().unwrap();
    let p = write(&dir, "x.bin", &llmc(MAGIC_U16, 1, 4, &u16s(&[1, 2, 3, 4])));
    let err = TokenStream::open(&p, "data.path", &opts(4, 10)).unwrap_err();
    assert_has(
        &message(err, "data.path", &p),
        &["holds 4 tokens", "data.seq_len = 4", "5 tokens"],
    );
    let p = write(&dir, "empty.bin", &[]);
    let err = TokenStream::open(&p, "data.path", &opts(4, 10)).unwrap_err();
    assert_has(&message(err, "data.path", &p), &["empty"]);
}

#[test]
fn token_out_of_vocab_is_refused_with_its_position() {
    let dir = TempDir::new().unwrap();
    let mut toks: Vec<u16> = (0..3000).map(|k| k % 50).collect();
    toks[1234] = 70;
    let count = toks.len() as i32;
    let p = write(&dir, "x.bin", &llmc(MAGIC_U16, 1, count, &u16s(&toks)));
    let err = TokenStream::open(&p, "data.path", &opts(8, 50)).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "data.path = {:?}: token 70 at position 1234 is >= model.vocab_size = 50",
            p.display().to_string()
        )
    );
    // u32, headerless: the last token.
    let mut toks: Vec<u32> = vec![1; 20];
    toks[19] = 50257;
    let p = write(&dir, "y.bin", &u32s(&toks));
    let o = TokenOptions {
        dtype: Some(TokenDtype::U32),
        ..opts(4, 50257)
    };
    let err = TokenStream::open(&p, "data.eval_path", &o).unwrap_err();
    assert_has(
        &message(err, "data.eval_path", &p),
        &["token 50257 at position 19 is >= model.vocab_size = 50257"],
    );
}

#[test]
fn sample_index_out_of_range_is_an_error() {
    let dir = TempDir::new().unwrap();
    let p = write(&dir, "x.bin", &llmc(MAGIC_U16, 1, 9, &u16s(&[1; 9])));
    let s = TokenStream::open(&p, "data.path", &opts(4, 10)).unwrap();
    let err = s.batch(&idx(&[0, 2])).unwrap_err();
    assert_has(&message(err, "data.path", &p), &["sample 2 is out of 0..2"]);
    let err = s.batch(&idx(&[-1])).unwrap_err();
    assert_has(&err.to_string(), &["sample -1 is out of 0..2"]);
}

// ------------------------------------------------------------ sequences

/// The expected batch of all five [`ROWS`] at T = 4, pad 99, no mask.
const ALL_INPUTS: [[i64; 4]; 5] = [
    [5, 6, 99, 99],
    [99, 99, 99, 99],
    [2, 3, 4, 5],
    [99, 99, 99, 99],
    [9, 99, 99, 99],
];
const ALL_TARGETS: [[i64; 4]; 5] = [
    [6, 7, X, X],
    [X, X, X, X],
    [3, 4, 5, 6],
    [X, X, X, X],
    [10, X, X, X],
];

#[test]
fn sequences_are_cut_shifted_and_padded() {
    let dir = TempDir::new().unwrap();
    let (tokens, offsets) = flat_rows();
    for dtype in [Dtype::U16, Dtype::U32, Dtype::I32, Dtype::I64] {
        let p = safetensors_file(
            &dir,
            &format!("rows-{dtype:?}.safetensors"),
            &[
                tokens_entry(&tokens, dtype),
                ("offsets", Dtype::I64, vec![offsets.len()], i64s(&offsets)),
            ],
        );
        let s = Sequences::open(&p, "data.path", &seq_opts()).unwrap();
        assert_eq!(s.len(), 5, "{dtype:?}");
        assert_eq!(s.token_count(), 13);
        assert!(!s.has_mask());
        assert!(s.resident().is_empty());
        assert_eq!(s.row_len(2), 7);
        let b = s.batch(&idx(&[0, 1, 2, 3, 4])).unwrap();
        assert_eq!(rows_of(&b.inputs), ALL_INPUTS, "{dtype:?}");
        assert_eq!(rows_of(&b.targets), ALL_TARGETS, "{dtype:?}");
        assert_eq!(b.count, 2 + 4 + 1);
        let b = s.batch(&idx(&[2, 0])).unwrap();
        assert_eq!(rows_of(&b.inputs), [ALL_INPUTS[2], ALL_INPUTS[0]]);
        assert_eq!(rows_of(&b.targets), [ALL_TARGETS[2], ALL_TARGETS[0]]);
        assert_eq!(b.count, 6);
        // Rows without a target give a batch with count 0.
        let b = s.range(1, 1, Device::Cpu).unwrap();
        assert_eq!(b.count, 0);
        assert_eq!(rows_of(&b.targets), [[X; 4]]);
    }
}

/// The five [`ROWS`] as an I64 sequences file without a mask.
fn rows_file(dir: &TempDir) -> PathBuf {
    let (tokens, offsets) = flat_rows();
    safetensors_file(
        dir,
        "rows.safetensors",
        &[
            tokens_entry(&tokens, Dtype::I64),
            ("offsets", Dtype::I64, vec![offsets.len()], i64s(&offsets)),
        ],
    )
}

/// Issue 39, `data.pack`: the five rows packed best-fit decreasing into
/// T = 4 (pairs 2, 0, 4, 0, 1: row 2 alone, rows 0 and 4 together; rows
/// without a pair left out), each row its own pairs and positions from 0,
/// padding a row of its own; the same targets, so the same count.
#[test]
fn packed_sequences_keep_each_rows_pairs_and_positions() {
    let dir = TempDir::new().unwrap();
    let p = rows_file(&dir);
    let s = Sequences::open(&p, "data.path", &seq_opts())
        .unwrap()
        .packed();
    assert_eq!(s.len(), 2);
    let b = s.batch(&idx(&[0, 1])).unwrap();
    assert_eq!(b.inputs.size(), [2, 2, 4]);
    assert_eq!(
        rows_of(&b.inputs.select(1, 0)),
        [[5, 6, 9, 99], [2, 3, 4, 5]]
    );
    assert_eq!(
        rows_of(&b.inputs.select(1, 1)),
        [[0, 1, 0, 0], [0, 1, 2, 3]]
    );
    assert_eq!(rows_of(&b.targets), [[6, 7, 10, X], [3, 4, 5, 6]]);
    assert_eq!(b.count, 2 + 1 + 4);
    let unpacked = Sequences::open(&p, "data.path", &seq_opts()).unwrap();
    assert_eq!(
        unpacked.batch(&idx(&[0, 1, 2, 3, 4])).unwrap().count,
        b.count
    );
    let err = s.batch(&idx(&[2])).unwrap_err();
    assert_has(&err.to_string(), &["sample 2 is out of 0..2"]);
}

#[test]
fn sequences_at_t_1_keep_the_first_pair() {
    let dir = TempDir::new().unwrap();
    let p = rows_file(&dir);
    let o = TokenOptions {
        seq_len: 1,
        ..seq_opts()
    };
    let s = Sequences::open(&p, "data.path", &o).unwrap();
    let b = s.batch(&idx(&[0, 1, 2, 3, 4])).unwrap();
    assert_eq!(rows_of(&b.inputs), [[5], [99], [2], [99], [9]]);
    assert_eq!(rows_of(&b.targets), [[6], [X], [3], [X], [10]]);
    assert_eq!(b.count, 3);
}

#[test]
fn loss_mask_turns_unpredicted_targets_into_ignore() {
    let dir = TempDir::new().unwrap();
    let (tokens, offsets) = flat_rows();
    // Per token, rows as in ROWS: [1 0 1] [1] [0 0 1 1 1 0 1] [] [1 0].
    let mask: Vec<u8> = vec![1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0];
    assert_eq!(mask.len(), tokens.len());
    for dtype in [Dtype::U8, Dtype::BOOL] {
        let p = safetensors_file(
            &dir,
            &format!("masked-{dtype:?}.safetensors"),
            &[
                tokens_entry(&tokens, Dtype::U16),
                ("offsets", Dtype::I64, vec![offsets.len()], i64s(&offsets)),
                ("loss_mask", dtype, vec![mask.len()], mask.clone()),
            ],
        );
        let s = Sequences::open(&p, "data.path", &seq_opts()).unwrap();
        assert!(s.has_mask());
        let b = s.batch(&idx(&[0, 1, 2, 3, 4])).unwrap();
        // Inputs are never masked.
        assert_eq!(rows_of(&b.inputs), ALL_INPUTS, "{dtype:?}");
        assert_eq!(
            rows_of(&b.targets),
            [
                [X, 7, X, X],
                [X, X, X, X],
                [X, 4, 5, 6],
                [X, X, X, X],
                [X, X, X, X],
            ],
            "{dtype:?}"
        );
        assert_eq!(b.count, 1 + 3);
    }
}

fn offsets_entry(offsets: &[i64]) -> Entry<'static> {
    ("offsets", Dtype::I64, vec![offsets.len()], i64s(offsets))
}

#[test]
fn decreasing_offsets_name_the_index() {
    let dir = TempDir::new().unwrap();
    assert_sequences_refused(
        &dir,
        "x.safetensors",
        &[
            tokens_entry(&[1, 2, 3, 4, 5], Dtype::I64),
            offsets_entry(&[0, 3, 2, 5]),
        ],
        "data.path",
        &["offsets decrease at index 2: offsets[2] = 2 < offsets[1] = 3"],
    );
    // offsets[0] != 0 and a last offset that is not the token count.
    assert_sequences_refused(
        &dir,
        "y.safetensors",
        &[
            tokens_entry(&[1, 2, 3, 4, 5], Dtype::I64),
            offsets_entry(&[1, 3, 5]),
        ],
        "data.path",
        &["offsets[0] = 1, must be 0"],
    );
    assert_sequences_refused(
        &dir,
        "z.safetensors",
        &[
            tokens_entry(&[1, 2, 3, 4, 5], Dtype::I64),
            offsets_entry(&[0, 3, 4]),
        ],
        "data.eval_path",
        &["the last offset (offsets[2]) is 4, but tokens holds 5 tokens"],
    );
    // No row at all.
    assert_sequences_refused(
        &dir,
        "w.safetensors",
        &[tokens_entry(&[], Dtype::I64), offsets_entry(&[0])],
        "data.path",
        &["offsets has 1 entries"],
    );
}

#[test]
fn mask_of_another_length_is_refused() {
    let dir = TempDir::new().unwrap();
    assert_sequences_refused(
        &dir,
        "x.safetensors",
        &[
            tokens_entry(&[1, 2, 3, 4, 5], Dtype::U16),
            offsets_entry(&[0, 2, 5]),
            ("loss_mask", Dtype::U8, vec![4], vec![1, 1, 0, 1]),
        ],
        "data.path",
        &["loss_mask has 4 entries, tokens has 5"],
    );
}

#[test]
fn wrong_dtypes_name_the_allowed_ones() {
    let dir = TempDir::new().unwrap();
    let cases: [(&str, Vec<Entry>, &[&str]); 3] = [
        (
            "tokens.safetensors",
            vec![tokens_entry(&[1, 2, 3], Dtype::F32), offsets_entry(&[0, 3])],
            &["tensor \"tokens\" has dtype F32; allowed: U16, U32, I32, I64"],
        ),
        (
            "offsets.safetensors",
            vec![
                tokens_entry(&[1, 2, 3], Dtype::U16),
                ("offsets", Dtype::I32, vec![2], i32s(&[0, 3])),
            ],
            &["tensor \"offsets\" has dtype I32; allowed: I64"],
        ),
        (
            "mask.safetensors",
            vec![
                tokens_entry(&[1, 2, 3], Dtype::U16),
                offsets_entry(&[0, 3]),
                ("loss_mask", Dtype::I64, vec![3], i64s(&[1, 1, 1])),
            ],
            &["tensor \"loss_mask\" has dtype I64; allowed: U8, BOOL"],
        ),
    ];
    for (name, entries, parts) in cases {
        assert_sequences_refused(&dir, name, &entries, "data.path", parts);
    }
    // A 2-D tokens tensor, a missing offsets tensor, not a safetensors file.
    assert_sequences_refused(
        &dir,
        "2d.safetensors",
        &[
            ("tokens", Dtype::I64, vec![1, 3], i64s(&[1, 2, 3])),
            offsets_entry(&[0, 3]),
        ],
        "data.path",
        &["shape [1, 3]; it must be 1-D"],
    );
    assert_sequences_refused(
        &dir,
        "no-offsets.safetensors",
        &[tokens_entry(&[1], Dtype::I64)],
        "data.path",
        &["has no tensor \"offsets\"", "[\"tokens\"]"],
    );
    let p = write(&dir, "junk.safetensors", b"not a safetensors file at all");
    let err = Sequences::open(&p, "data.path", &seq_opts()).unwrap_err();
    assert_has(
        &message(err, "data.path", &p),
        &["not a readable safetensors file"],
    );
    // In words, not the crate's Debug names (issue 37, item 13): a header
    // whose tensor lies past the end of the file.
    let header = br#"{"tokens":{"dtype":"I64","shape":[4],"data_offsets":[0,32]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 8]);
    let p = write(&dir, "short.safetensors", &bytes);
    let msg = Sequences::open(&p, "data.path", &seq_opts())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("not a readable safetensors file: its tensors do not cover")
            && !msg.contains("Metadata")
            && !msg.contains("Invalid"),
        "{msg}"
    );
}

#[test]
fn sequence_token_out_of_vocab_names_position_and_row() {
    let dir = TempDir::new().unwrap();
    let (mut tokens, offsets) = flat_rows();
    tokens[9] = 100; // row 4 starts at 11: position 9 is in row 2
    let p = safetensors_file(
        &dir,
        "x.safetensors",
        &[tokens_entry(&tokens, Dtype::U16), offsets_entry(&offsets)],
    );
    let err = Sequences::open(&p, "data.path", &seq_opts()).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "data.path = {:?}: token 100 at position 9 (row 2) is >= model.vocab_size = 100",
            p.display().to_string()
        )
    );
    // A negative token in an I32 file, in the last row (after an empty row).
    let (mut tokens, offsets) = flat_rows();
    tokens[11] = -3;
    assert_sequences_refused(
        &dir,
        "y.safetensors",
        &[tokens_entry(&tokens, Dtype::I32), offsets_entry(&offsets)],
        "data.eval_path",
        &["token -3 at position 11 (row 4) is negative"],
    );
}

#[test]
fn pad_id_must_be_a_token() {
    let dir = TempDir::new().unwrap();
    let (tokens, offsets) = flat_rows();
    let p = safetensors_file(
        &dir,
        "x.safetensors",
        &[tokens_entry(&tokens, Dtype::U16), offsets_entry(&offsets)],
    );
    let o = TokenOptions {
        pad_id: 100,
        ..seq_opts()
    };
    let err = Sequences::open(&p, "data.path", &o).unwrap_err();
    assert_has(&err.to_string(), &["data.pad_id = 100", "0..100"]);
}

#[test]
#[ignore = "needs CUDA"]
fn cuda_indices_and_device_batches() {
    if !common::cuda_or_skip("cuda_indices_and_device_batches") {
        return;
    }
    let dir = TempDir::new().unwrap();
    let (tokens, offsets) = flat_rows();
    let p = safetensors_file(
        &dir,
        "x.safetensors",
        &[tokens_entry(&tokens, Dtype::U16), offsets_entry(&offsets)],
    );
    let cuda = Device::Cuda(0);
    let s = Sequences::open(&p, "data.path", &seq_opts())
        .unwrap()
        .to_device(cuda);
    let b = s.batch(&idx(&[2, 0]).to_device(cuda)).unwrap();
    assert_eq!(b.inputs.device(), cuda);
    assert_eq!(b.targets.device(), cuda);
    assert_eq!(b.count, 6);
    assert_eq!(
        rows_of(&b.targets.to_device(Device::Cpu)),
        [ALL_TARGETS[2], ALL_TARGETS[0]]
    );
}

/// Issue 37, item 6: a file no row of which has a target within its first
/// T + 1 tokens is refused at open (before: every step was skipped and
/// the job "finished"): all rows masked, and prompts longer than T whose
/// completions are all cut off. One row with a target is enough.
#[test]
fn sequences_without_a_target_within_t_plus_1_are_refused() {
    let dir = TempDir::new().unwrap();
    let (tokens, offsets) = flat_rows();
    let masked = vec![0u8; tokens.len()];
    assert_sequences_refused(
        &dir,
        "masked.safetensors",
        &[
            tokens_entry(&tokens, Dtype::U16),
            offsets_entry(&offsets),
            ("loss_mask", Dtype::U8, vec![masked.len()], masked.clone()),
        ],
        "data.eval_path",
        &["no row has a target within its first data.seq_len + 1 = 5 tokens (5 rows"],
    );
    // Prompt (mask 0) of 6 tokens, completion after it: cut off at T = 4.
    let long: Vec<i64> = (1..=8).collect();
    let mask: Vec<u8> = (0..8).map(|i| u8::from(i >= 6)).collect();
    assert_sequences_refused(
        &dir,
        "cut.safetensors",
        &[
            tokens_entry(&long, Dtype::U16),
            offsets_entry(&[0, 8]),
            ("loss_mask", Dtype::U8, vec![8], mask.clone()),
        ],
        "data.path",
        &["no row has a target", "raise data.seq_len"],
    );
    // The same row at T = 6 has its first completion token as a target.
    let p = safetensors_file(
        &dir,
        "ok.safetensors",
        &[
            tokens_entry(&long, Dtype::U16),
            offsets_entry(&[0, 8]),
            ("loss_mask", Dtype::U8, vec![8], mask),
        ],
    );
    let o = TokenOptions {
        seq_len: 6,
        ..seq_opts()
    };
    let s = Sequences::open(&p, "data.path", &o).unwrap();
    assert_eq!(s.batch(&idx(&[0])).unwrap().count, 1);
}
