//! The writers: llm.c token files, sequences safetensors, held-out splits
//! (staged: see place.rs).

#[allow(unused_imports)]
use super::*;

/// How many of `n` items a fraction holds out: at least one when the
/// fraction is above 0, never all.
pub(super) fn held_out(fraction: f64, n: usize, what: &'static str) -> Result<usize> {
    if fraction == 0.0 {
        return Ok(0);
    }
    let k = ((fraction * n as f64).round() as usize).max(1);
    if k >= n {
        return Err(TokenizeError::SplitLeavesNothing { fraction, n, what });
    }
    Ok(k)
}

/// What `--eval-fraction`, `--split` and `--seed` ask to hold out.
#[derive(Clone, Copy, Debug)]
pub(super) struct Held {
    pub(super) fraction: f64,
    pub(super) split: Split,
    pub(super) seed: u64,
}

/// Which of `n` items (documents, rows) are held out, `k` of them: a
/// seeded random choice of whole items, or the last `k`.
pub(super) fn eval_choice(n: usize, k: usize, split: Split, seed: u64) -> Vec<bool> {
    let mut is_eval = vec![false; n];
    match split {
        Split::Random => {
            let mut order: Vec<usize> = (0..n).collect();
            order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
            for &i in &order[..k] {
                is_eval[i] = true;
            }
        }
        Split::Last => is_eval[n - k..].iter_mut().for_each(|e| *e = true),
    }
    is_eval
}

/// `items` apart by `is_eval`, each side in the input's order.
fn part<'a, T>(items: &'a [T], is_eval: &[bool]) -> (Vec<&'a T>, Vec<&'a T>) {
    let (mut train, mut eval) = (Vec::new(), Vec::new());
    for (x, &e) in items.iter().zip(is_eval) {
        if e {
            eval.push(x);
        } else {
            train.push(x);
        }
    }
    (train, eval)
}

pub(super) fn join(docs: &[&Vec<u32>], eot: Option<u32>) -> Vec<u32> {
    let mut out = Vec::with_capacity(docs.iter().map(|d| d.len()).sum::<usize>() + docs.len());
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            out.extend(eot);
        }
        out.extend_from_slice(d);
    }
    out
}

pub(super) fn write_tokens_split(
    stage: &mut Staged,
    out: &Path,
    docs: Vec<Vec<u32>>,
    eot: Option<u32>,
    wide: bool,
    held: Held,
) -> Result<(Written, Option<Written>)> {
    let n = docs.len();
    if n == 1 {
        let all = &docs[0];
        let k = held_out(held.fraction, all.len(), "tokens")?;
        let cut = all.len() - k;
        let train = write_llmc(stage, out, &all[..cut], wide, 1)?;
        let eval = (k > 0)
            .then(|| write_llmc(stage, &eval_path(out), &all[cut..], wide, 1))
            .transpose()?;
        return Ok((train, eval));
    }
    let k = held_out(held.fraction, n, "documents")?;
    let (train, eval) = part(&docs, &eval_choice(n, k, held.split, held.seed));
    let train = write_llmc(stage, out, &join(&train, eot), wide, n - k)?;
    let eval = (k > 0)
        .then(|| write_llmc(stage, &eval_path(out), &join(&eval, eot), wide, k))
        .transpose()?;
    Ok((train, eval))
}

/// llm.c's `.bin`: the header, then the tokens, little-endian.
pub(super) fn write_llmc(
    stage: &mut Staged,
    path: &Path,
    tokens: &[u32],
    wide: bool,
    items: usize,
) -> Result<Written> {
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
    stage.write(path, &buf)?;
    Ok(Written {
        path: path.to_path_buf(),
        tokens: tokens.len(),
        items,
    })
}

pub(super) fn push_tokens(buf: &mut Vec<u8>, tokens: &[u32], wide: bool) {
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

pub(super) fn write_sequences_split(
    stage: &mut Staged,
    out: &Path,
    rows: Vec<chat::Row>,
    tok: &Tok,
    vocab_size: u64,
    held: Held,
) -> Result<(Written, Option<Written>)> {
    let n = rows.len();
    let k = held_out(held.fraction, n, "rows")?;
    // Both sides keep the input's order.
    let (train, eval) = part(&rows, &eval_choice(n, k, held.split, held.seed));
    let wide = vocab_size > 65536;
    let t = write_sequences(stage, out, &train, tok.eot, wide, vocab_size)?;
    let e = (k > 0)
        .then(|| write_sequences(stage, &eval_path(out), &eval, tok.eot, wide, vocab_size))
        .transpose()?;
    Ok((t, e))
}

/// A prompt/completion row: prompt + completion + end-of-text, the
/// prompt's tokens masked.
pub(super) fn completion_row(
    prompt: Vec<u32>,
    completion: Vec<u32>,
    eot: Option<u32>,
) -> chat::Row {
    let mut mask = vec![0u8; prompt.len()];
    mask.extend(std::iter::repeat_n(
        1u8,
        completion.len() + usize::from(eot.is_some()),
    ));
    let mut tokens = prompt;
    tokens.extend(completion);
    tokens.extend(eot);
    (tokens, mask)
}

/// The sequences file: each row's tokens and loss mask (prompt/completion
/// rows: [`completion_row`]; chat rows: src/tokenize/chat.rs).
pub(super) fn write_sequences(
    stage: &mut Staged,
    path: &Path,
    rows: &[&chat::Row],
    eot: Option<u32>,
    wide: bool,
    vocab_size: u64,
) -> Result<Written> {
    let mut tokens = Vec::new();
    let mut mask = Vec::new();
    let mut offsets: Vec<i64> = vec![0];
    for (row, predicted) in rows {
        tokens.extend_from_slice(row);
        mask.extend_from_slice(predicted);
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
        stage,
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
pub(super) fn write_safetensors(
    stage: &mut Staged,
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
    stage.write(path, &buf)
}
