//! GPT-2's vocabulary and merges, rebuilt from tiktoken-rs's r50k ranks.

#[allow(unused_imports)]
use super::*;

/// GPT-2's byte → printable character table (`bytes_to_unicode`).
pub(super) fn bytes_to_unicode() -> [char; 256] {
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
pub(super) fn merge_of(
    token: &[u8],
    ranks: &HashMap<Vec<u8>, u32>,
    rank: u32,
) -> Option<(Vec<u8>, Vec<u8>)> {
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
pub(super) type VocabAndMerges = (HashMap<String, u32>, Vec<(String, String)>);

pub(super) fn gpt2_vocab_and_merges() -> Result<VocabAndMerges> {
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
