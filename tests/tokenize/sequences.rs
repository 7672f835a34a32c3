//! Sequences files (`--format sequences`): prompt and completion rows with
//! their loss mask and seeded split, and chat rows masked as transformers
//! masks them.

use super::*;

#[test]
fn sequences_file_and_its_seeded_split() {
    let t = TempDir::new().unwrap();
    let rows = [
        ("Translate to French: cheese", " fromage"),
        ("Q: What is 2 + 2?\nA:", " 4"),
        ("", "A completion without a prompt."),
        ("Name a crab.", " 🦀 Ferris"),
        ("Say nothing.", ""),
    ];
    let jsonl = t.path().join("pairs.jsonl");
    let text: String = rows
        .iter()
        .map(|(p, c)| {
            serde_json::json!({"prompt": p, "completion": c, "extra": 1}).to_string() + "\n"
        })
        .collect();
    std::fs::write(&jsonl, format!("{text}\n")).unwrap();
    let out = t.path().join("seq/train.safetensors");
    ok(&[s(&jsonl), "--out", s(&out), "--format", "sequences"]);
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tokens = st.tensor("tokens").unwrap();
    let offsets = st.tensor("offsets").unwrap();
    let mask = st.tensor("loss_mask").unwrap();
    assert_eq!(tokens.dtype(), safetensors::Dtype::U16);
    assert_eq!(offsets.dtype(), safetensors::Dtype::I64);
    assert_eq!(mask.dtype(), safetensors::Dtype::U8);
    let tok: Vec<u32> = tokens
        .data()
        .chunks_exact(2)
        .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    let off: Vec<i64> = offsets
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let m = mask.data().to_vec();
    assert_eq!(off.len(), rows.len() + 1);
    assert_eq!(tokens.shape(), &[tok.len()]);
    assert_eq!((off[0], *off.last().unwrap() as usize), (0, tok.len()));
    assert_eq!(m.len(), tok.len());
    let row = |i: usize| (off[i] as usize, off[i + 1] as usize);
    for (i, (p, c)) in rows.iter().enumerate() {
        let (a, b) = row(i);
        let (pt, ct) = (r50k(p), r50k(c));
        assert_eq!(
            tok[a..b],
            [pt.clone(), ct.clone(), vec![EOT]].concat(),
            "row {i}"
        );
        let want_mask: Vec<u8> = [vec![0u8; pt.len()], vec![1u8; ct.len() + 1]].concat();
        assert_eq!(m[a..b], want_mask, "row {i}");
    }

    // The `safetensors` package (what transformers and torch use) reads it.
    let py = tokenize_ref(&["safetensors", s(&out)]);
    let v: serde_json::Value = serde_json::from_slice(&py.stdout).unwrap();
    assert_eq!(v["tokens"]["dtype"], "uint16");
    assert_eq!(v["offsets"]["dtype"], "int64");
    assert_eq!(v["loss_mask"]["dtype"], "uint8");
    assert_eq!(v["offsets"]["values"], serde_json::json!(off));
    assert_eq!(v["tokens"]["values"], serde_json::json!(tok));
    assert_eq!(v["loss_mask"]["values"], serde_json::json!(m));
    assert_eq!(v["__metadata__"]["eot_id"], "50256");
    assert_eq!(v["__metadata__"]["vocab_size"], "50257");

    // A seeded 0.4 of the rows held out: 2 of 5, the same for the same seed.
    let split = |seed: &str, dir: &str| {
        let out = t.path().join(dir).join("s.safetensors");
        let stdout = ok(&[
            s(&jsonl),
            "--out",
            s(&out),
            "--format",
            "sequences",
            "--eval-fraction",
            "0.4",
            "--seed",
            seed,
        ]);
        let eval = t.path().join(dir).join("s.eval.safetensors");
        assert!(
            stdout.contains(&format!("{}: ", eval.display())) && stdout.contains("2 rows"),
            "{stdout}"
        );
        assert!(stdout.contains("3 rows"), "{stdout}");
        (std::fs::read(out).unwrap(), std::fs::read(eval).unwrap())
    };
    let rows_of = |bytes: &[u8]| -> Vec<Vec<u8>> {
        let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
        let off = offsets_of(&st);
        let data = st.tensor("tokens").unwrap().data().to_vec();
        off.windows(2)
            .map(|w| data[2 * w[0]..2 * w[1]].to_vec())
            .collect()
    };
    let (a_train, a_eval) = split("7", "s7");
    let (b_train, b_eval) = split("7", "s7b");
    assert_eq!(
        (&a_train, &a_eval),
        (&b_train, &b_eval),
        "same seed, same split"
    );
    let mut all = rows_of(&a_train);
    let held = rows_of(&a_eval);
    assert_eq!((all.len(), held.len()), (3, 2));
    all.extend(held);
    let mut want = rows_of(&bytes);
    all.sort();
    want.sort();
    assert_eq!(all, want, "train + eval = all rows");
}

/// A sequences file's `offsets` (I64) as row boundaries.
fn offsets_of(st: &safetensors::SafeTensors) -> Vec<usize> {
    st.tensor("offsets")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as usize)
        .collect()
}

/// A sequences file's rows: (tokens, loss mask) each.
fn sequence_rows(path: &Path) -> Vec<(Vec<u32>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tok: Vec<u32> = st
        .tensor("tokens")
        .unwrap()
        .data()
        .chunks_exact(2)
        .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    let off = offsets_of(&st);
    let mask = st.tensor("loss_mask").unwrap().data().to_vec();
    off.windows(2)
        .map(|w| (tok[w[0]..w[1]].to_vec(), mask[w[0]..w[1]].to_vec()))
        .collect()
}

/// Chat rows (issue 39): `messages` rendered with a model folder's chat
/// template, the assistant turns' tokens predicted, equal token for token
/// and mask for mask to transformers' `apply_chat_template(...,
/// return_assistant_tokens_mask=True)` on a template with `{% generation %}`
/// blocks (trimmed lines, Python string methods), and to the turn-by-turn
/// rendering on one without.
#[test]
fn chat_rows_mask_what_transformers_masks() {
    let t = TempDir::new().unwrap();
    let text = t.path().join("t.txt");
    std::fs::write(&text, "a tokenizer for chats").unwrap();
    ok(&[s(&text), "--out", s(&t.path().join("g/t.bin"))]);
    let rows = serde_json::json!([
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": " What is 2 + 2? "},
         {"role": "assistant", "content": "  4.  "}],
        [{"role": "user", "content": "Name a crab."},
         {"role": "assistant", "content": "Ferris 🦀"},
         {"role": "user", "content": "Another?"},
         {"role": "assistant", "content": "None.\nReally."}],
    ]);
    let with_markers = "{% for message in messages %}\n\
        {% if message['role'] == 'assistant' %}\n\
        {{ '<|im_start|>assistant\\n' }}\n\
        {%- generation %}{{ message['content'].strip() + '<|endoftext|>' }}{% endgeneration %}\n\
        {{ '\\n' }}\n\
        {% else %}\n\
        {{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|endoftext|>\\n' }}\n\
        {% endif %}\n\
        {% endfor %}\n\
        {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    let without = with_markers
        .replace("{%- generation %}", "")
        .replace("{% endgeneration %}", "");
    let lines: String = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|m| serde_json::json!({ "messages": m }).to_string() + "\n")
        .collect();
    let jsonl = t.path().join("chats.jsonl");
    std::fs::write(&jsonl, lines).unwrap();
    let rows_json = t.path().join("rows.json");
    std::fs::write(&rows_json, rows.to_string()).unwrap();
    for (name, template) in [("markers", with_markers.to_string()), ("turns", without)] {
        let model = t.path().join(name);
        std::fs::create_dir_all(&model).unwrap();
        std::fs::copy(
            t.path().join("g/tokenizer.json"),
            model.join("tokenizer.json"),
        )
        .unwrap();
        let config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|endoftext|>",
            "chat_template": template,
        });
        std::fs::write(model.join("tokenizer_config.json"), config.to_string()).unwrap();
        let out = t.path().join(format!("{name}-out/sft.safetensors"));
        ok(&[
            s(&jsonl),
            "--out",
            s(&out),
            "--format",
            "sequences",
            "--tokenizer",
            s(&model),
        ]);
        let ours = sequence_rows(&out);
        let py = tokenize_ref(&["chat", s(&model), s(&rows_json)]);
        let theirs: Vec<serde_json::Value> = serde_json::from_slice(&py.stdout).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{name}");
        for (i, ((ids, mask), want)) in ours.iter().zip(&theirs).enumerate() {
            let want_ids: Vec<u32> = serde_json::from_value(want["ids"].clone()).unwrap();
            let want_mask: Vec<u8> = serde_json::from_value(want["mask"].clone()).unwrap();
            assert_eq!(ids, &want_ids, "{name}, row {i}: tokens");
            assert_eq!(mask, &want_mask, "{name}, row {i}: assistant mask");
            assert!(
                mask.contains(&1) && mask.contains(&0),
                "{name}, row {i}: {mask:?}"
            );
        }
    }
    // Without a template: refused, naming the way.
    let e = fails(&[
        s(&jsonl),
        "--out",
        s(&t.path().join("x/s.safetensors")),
        "--format",
        "sequences",
    ]);
    assert!(e.contains("need a chat template"), "{e}");
}
