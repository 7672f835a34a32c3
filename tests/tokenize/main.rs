//! `accrue tokenize` as a process (issue 30): round trips of GPT-2's and a
//! trained byte-level BPE on a real corpus, GPT-2's ids against tiktoken's
//! r50k and transformers' GPT2TokenizerFast, the llm.c header, the
//! sequences file's tensors, the held-out splits and the errors; in
//! `safety`, what a rerun, a bad placement or odd input must not do
//! (issue 37).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;
use tokenizers::Tokenizer;

const EOT: u32 = 50256;
const EOT_TEXT: &str = "<|endoftext|>";

fn accrue(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_accrue"))
        .arg("tokenize")
        .args(args)
        .output()
        .unwrap()
}

/// Runs `accrue tokenize args`, asserts success, returns stdout.
fn ok(args: &[&str]) -> String {
    let o = accrue(args);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(
        o.status.success(),
        "accrue tokenize {args:?}:\n{out}\n{err}"
    );
    out
}

/// Runs `accrue tokenize args`, asserts exit code 2, returns stderr.
fn fails(args: &[&str]) -> String {
    let o = accrue(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "accrue tokenize {args:?}: {err}");
    err
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A text corpus of about `bytes` as documents: the King James Bible
/// (Debian's bible-kjv) when its `bible` command is installed, else
/// CPython's standard library sources. Says which on stderr.
fn corpus(bytes: usize) -> Vec<String> {
    let kjv = Command::new("bible")
        .arg("gen1:1-rev22:21")
        .output()
        .ok()
        .filter(|o| o.status.success() && o.stdout.len() > 1_000_000);
    if let Some(o) = kjv {
        eprintln!("corpus: bible-kjv");
        let text = String::from_utf8(o.stdout).unwrap();
        // Three documents of whole lines.
        let mut docs = Vec::new();
        let mut rest = &text[..];
        for _ in 0..3 {
            let cut = rest[..bytes / 3].rfind('\n').unwrap() + 1;
            docs.push(rest[..cut].to_string());
            rest = &rest[cut..];
        }
        return docs;
    }
    eprintln!("corpus: CPython's standard library (bible-kjv is not installed)");
    python_sources(bytes)
}

/// CPython's standard library sources, file by file, about `bytes` in all.
fn python_sources(bytes: usize) -> Vec<String> {
    let lib = std::fs::read_dir("/usr/lib")
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("python3.")
        })
        .max()
        .expect("a /usr/lib/python3.* folder");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&lib)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "py"))
        .collect();
    files.sort();
    let mut docs = Vec::new();
    let mut total = 0;
    for f in files {
        if total >= bytes {
            break;
        }
        if let Ok(t) = std::fs::read_to_string(&f) {
            total += t.len();
            docs.push(t);
        }
    }
    docs
}

/// Writes `docs` as 00.txt, 01.txt, … into `dir` (a folder input), with a
/// binary file and a hidden file that must be left out.
fn write_docs(dir: &Path, docs: &[String]) {
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    for (i, d) in docs.iter().enumerate() {
        // The last one in a subfolder: the walk is recursive and sorted.
        let p = if i + 1 == docs.len() {
            dir.join(format!("sub/{i:02}.txt"))
        } else {
            dir.join(format!("{i:02}.txt"))
        };
        std::fs::write(p, d).unwrap();
    }
    std::fs::write(dir.join("blob.bin"), [0u8, 159, 146, 150, 0, 1]).unwrap();
    std::fs::write(dir.join(".hidden.txt"), "not a document").unwrap();
}

/// An llm.c file's header and tokens.
fn read_llmc(p: &Path) -> ([i32; 256], Vec<u32>) {
    let b = std::fs::read(p).unwrap();
    let mut h = [0i32; 256];
    for (i, v) in h.iter_mut().enumerate() {
        *v = i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    }
    let body = &b[1024..];
    let tokens: Vec<u32> = match h[0] {
        20240520 => body
            .chunks_exact(2)
            .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        20240801 => body
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        m => panic!("bad magic {m}"),
    };
    assert_eq!(h[1], 1, "version");
    assert_eq!(h[2] as usize, tokens.len(), "header count vs file length");
    (h, tokens)
}

/// tests/reference/tokenize_ref.py with `args` (the transformers and
/// pyarrow side of these tests), which must succeed.
fn tokenize_ref(args: &[&str]) -> Output {
    let py = Command::new(env!("ACCRUE_PYTHON"))
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/tokenize_ref.py"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        py.status.success(),
        "tokenize_ref.py {args:?}: {}",
        String::from_utf8_lossy(&py.stderr)
    );
    py
}

fn r50k(text: &str) -> Vec<u32> {
    tiktoken_rs::r50k_base_singleton().encode_ordinary(text)
}

fn decode(tokenizer_json: &Path, ids: &[u32]) -> String {
    Tokenizer::from_file(tokenizer_json)
        .unwrap()
        .decode(ids, false)
        .unwrap()
}

#[test]
fn gpt2_round_trip_and_r50k_ids() {
    let t = TempDir::new().unwrap();
    let docs = corpus(300_000);
    let input = t.path().join("corpus");
    write_docs(&input, &docs);
    let out = t.path().join("data/train.bin");
    let stdout = ok(&[s(&input), "--out", s(&out), "--tokenizer", "gpt2"]);
    assert!(stdout.contains("skipped 1 files"), "{stdout}");
    assert!(
        stdout.contains(&format!("{}: ", out.display()))
            && stdout.contains(&format!("{} documents", docs.len())),
        "{stdout}"
    );
    let (h, ids) = read_llmc(&out);
    assert_eq!(h[0], 20240520, "u16 magic for GPT-2");
    // Round trip: the documents joined by <|endoftext|>.
    let tj = t.path().join("data/tokenizer.json");
    assert_eq!(decode(&tj, &ids), docs.join(EOT_TEXT));
    // tiktoken's r50k ids, document by document, joined by its id.
    let mut want = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            want.push(EOT);
        }
        want.extend(r50k(d));
    }
    assert_eq!(ids.len(), want.len());
    assert!(ids == want, "ids differ from r50k");
    assert_eq!(ids.iter().filter(|&&i| i == EOT).count(), docs.len() - 1);
}

/// JSON lines of `{"text": ...}` (the `datasets` convention, issue 39): one
/// document per line, the field's text (JSON escapes decoded), joined by
/// the end-of-text token: tiktoken's r50k ids of each text.
#[test]
fn json_lines_text_fields_are_documents() {
    let t = TempDir::new().unwrap();
    let docs: Vec<String> = corpus(20_000).into_iter().take(6).collect();
    assert!(
        docs.iter().any(|d| d.contains('\n')),
        "a text with a newline"
    );
    let lines: Vec<String> = docs
        .iter()
        .map(|d| serde_json::json!({"text": d, "id": 7}).to_string())
        .collect();
    let input = t.path().join("docs.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = t.path().join("jl/train.bin");
    ok(&[s(&input), "--out", s(&out)]);
    let (_, ids) = read_llmc(&out);
    let mut want = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            want.push(EOT);
        }
        want.extend(r50k(d));
    }
    assert!(
        ids == want,
        "JSON lines' ids differ from the texts' r50k ids"
    );
    // Another field by name gives the same stream.
    let renamed = t.path().join("body.jsonl");
    let body: Vec<String> = docs
        .iter()
        .map(|d| serde_json::json!({"body": d}).to_string())
        .collect();
    std::fs::write(&renamed, body.join("\n")).unwrap();
    let out2 = t.path().join("jl2/train.bin");
    ok(&[s(&renamed), "--out", s(&out2), "--field", "body"]);
    assert!(read_llmc(&out2).1 == want);
    // A line without the field, or not an object, is named.
    let e = fails(&[s(&renamed), "--out", s(&out2)]);
    assert!(e.contains("line 1") && e.contains("no `text` field"), "{e}");
    let bad = t.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"a\"}\n[1, 2]\n").unwrap();
    let e = fails(&[s(&bad), "--out", s(&out2)]);
    assert!(
        e.contains("line 2") && e.contains("not a JSON object"),
        "{e}"
    );
}

#[test]
fn gpt2_ids_equal_r50k_on_python_sources_in_one_document() {
    // Code: runs of spaces, tabs and blank lines around the newlines where
    // long documents are cut into pieces for the encoder.
    let t = TempDir::new().unwrap();
    let text = python_sources(500_000).concat();
    let input = t.path().join("code.py.txt");
    std::fs::write(&input, &text).unwrap();
    let out = t.path().join("code.bin");
    ok(&[s(&input), "--out", s(&out)]);
    let (_, ids) = read_llmc(&out);
    assert_eq!(decode(&t.path().join("tokenizer.json"), &ids), text);
    let want = r50k(&text);
    assert_eq!(ids.len(), want.len());
    assert!(ids == want, "ids differ from r50k");
}

#[test]
fn gpt2_ids_equal_transformers_on_the_same_files() {
    let t = TempDir::new().unwrap();
    let gpt2 = t.path().join("gpt2");
    ok(&["--dump-gpt2-files", s(&gpt2)]);
    // A few KB: the corpus' start and the byte-level BPE's corners.
    let mut sample: String = corpus(30_000).concat().chars().take(6000).collect();
    sample.push_str(
        "\n\nIt's they'll we've I'M don't  two  spaces\t\ttabs\r\nCRLF 3.14159 12345678 \
         naïve café Ünïcödé 日本語のテキスト 🦀🚀 emoji\u{200d}joined  \n\n\n   trailing   ",
    );
    let text_file = t.path().join("sample.txt");
    std::fs::write(&text_file, &sample).unwrap();
    let out = t.path().join("out/sample.bin");
    ok(&[s(&text_file), "--out", s(&out)]);
    let (_, ids) = read_llmc(&out);
    assert_eq!(ids, r50k(&sample), "r50k");

    let py = tokenize_ref(&["gpt2-ids", s(&gpt2), s(&text_file)]);
    let hf: Vec<u32> = serde_json::from_slice(&py.stdout).unwrap();
    assert_eq!(
        ids, hf,
        "transformers' GPT2TokenizerFast on the dumped files"
    );

    // The written tokenizer.json loads in transformers and decodes back.
    let ids_file = t.path().join("ids.json");
    std::fs::write(&ids_file, serde_json::to_string(&ids).unwrap()).unwrap();
    let (auto, fast) = (t.path().join("auto.txt"), t.path().join("fast.txt"));
    tokenize_ref(&[
        "decode",
        s(&t.path().join("out")),
        s(&ids_file),
        s(&auto),
        s(&fast),
    ]);
    assert_eq!(
        std::fs::read_to_string(&auto).unwrap(),
        sample,
        "AutoTokenizer"
    );
    assert_eq!(
        std::fs::read_to_string(&fast).unwrap(),
        sample,
        "PreTrainedTokenizerFast"
    );
}

#[test]
fn dumped_gpt2_files_equal_the_crate_assets_when_found() {
    // tiktoken-rs ships encoder.json and vocab.bpe next to the r50k ranks
    // the vocabulary is rebuilt from; compare when its source is at hand.
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cargo"));
    let assets = std::fs::read_dir(home.join("registry/src"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .flat_map(|e| std::fs::read_dir(e.path()).into_iter().flatten())
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("tiktoken-rs-")
        })
        .map(|p| p.join("assets"))
        .find(|a| a.join("vocab.bpe").exists());
    let Some(assets) = assets else {
        eprintln!("tiktoken-rs' source is not in the cargo registry: nothing compared");
        return;
    };
    let t = TempDir::new().unwrap();
    ok(&["--dump-gpt2-files", s(t.path())]);
    let ours: serde_json::Value =
        serde_json::from_slice(&std::fs::read(t.path().join("vocab.json")).unwrap()).unwrap();
    let theirs: serde_json::Value =
        serde_json::from_slice(&std::fs::read(assets.join("encoder.json")).unwrap()).unwrap();
    assert_eq!(ours, theirs, "vocab.json vs encoder.json");
    let merges = |p: PathBuf| {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .skip(1)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let (ours, theirs) = (
        merges(t.path().join("merges.txt")),
        merges(assets.join("vocab.bpe")),
    );
    assert_eq!(ours.len(), 50_000);
    assert!(ours == theirs, "merges.txt vs vocab.bpe");
}

#[test]
fn trained_bpe_round_trip() {
    let t = TempDir::new().unwrap();
    let docs = corpus(150_000);
    let input = t.path().join("corpus");
    write_docs(&input, &docs);
    let out = t.path().join("bpe/train.bin");
    ok(&[
        s(&input),
        "--out",
        s(&out),
        "--train-bpe",
        "600",
        "--eval-fraction",
        "0.3",
        "--split",
        "last",
    ]);
    let tj = t.path().join("bpe/tokenizer.json");
    let tk = Tokenizer::from_file(&tj).unwrap();
    assert_eq!(tk.get_vocab_size(true), 600);
    let eot = tk.token_to_id(EOT_TEXT).expect("a trained <|endoftext|>");
    let (h, train) = read_llmc(&out);
    assert_eq!(h[0], 20240520);
    let (_, eval) = read_llmc(&t.path().join("bpe/train.eval.bin"));
    // 0.3 of the documents held out (at least one): the last ones.
    let n = docs.len();
    let k = ((n as f64 * 0.3).round() as usize).max(1);
    let held = docs[n - k..].join(EOT_TEXT);
    assert_eq!(decode(&tj, &train), docs[..n - k].join(EOT_TEXT));
    assert_eq!(decode(&tj, &eval), held);
    assert_eq!(train.iter().filter(|&&i| i == eot).count(), n - k - 1);
    assert!(train.iter().chain(&eval).all(|&i| i < 600));
    // Far fewer tokens than bytes: merges were learned.
    assert!(train.len() * 2 < docs[..n - k].iter().map(String::len).sum::<usize>());

    // transformers loads the trained tokenizer.json and decodes the same.
    let ids_file = t.path().join("ids.json");
    std::fs::write(&ids_file, serde_json::to_string(&eval).unwrap()).unwrap();
    let (auto, fast) = (t.path().join("auto.txt"), t.path().join("fast.txt"));
    tokenize_ref(&[
        "decode",
        s(&t.path().join("bpe")),
        s(&ids_file),
        s(&auto),
        s(&fast),
    ]);
    assert_eq!(std::fs::read_to_string(&auto).unwrap(), held);
    assert_eq!(std::fs::read_to_string(&fast).unwrap(), held);
}

#[test]
fn tokens_eval_split_by_documents_and_by_tokens() {
    let t = TempDir::new().unwrap();
    let docs: Vec<String> = (0..5)
        .map(|i| format!("Document number {i}.\nIt has a few words, and line two.\n"))
        .collect();
    let files: Vec<PathBuf> = docs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let p = t.path().join(format!("d{i}.txt"));
            std::fs::write(&p, d).unwrap();
            p
        })
        .collect();
    let out = t.path().join("split/all.bin");
    let mut args: Vec<&str> = files.iter().map(|p| s(p)).collect();
    args.extend([
        "--out",
        s(&out),
        "--eval-fraction",
        "0.2",
        "--split",
        "last",
    ]);
    let stdout = ok(&args);
    let eval_out = t.path().join("split/all.eval.bin");
    let (_, train) = read_llmc(&out);
    let (_, eval) = read_llmc(&eval_out);
    let joined = |d: &[String]| {
        let mut v = Vec::new();
        for (i, x) in d.iter().enumerate() {
            if i > 0 {
                v.push(EOT);
            }
            v.extend(r50k(x));
        }
        v
    };
    assert_eq!(train, joined(&docs[..4]));
    assert_eq!(eval, joined(&docs[4..]));
    assert!(
        stdout.contains(&format!(
            "{}: {} tokens, 4 documents",
            out.display(),
            train.len()
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "{}: {} tokens, 1 documents",
            eval_out.display(),
            eval.len()
        )),
        "{stdout}"
    );

    // One document: the last tenth of its tokens.
    let one = t.path().join("one/one.bin");
    ok(&[s(&files[0]), s(&files[1]), "--out", s(&one)]);
    let all = read_llmc(&one).1;
    let text = t.path().join("long.txt");
    std::fs::write(&text, docs.concat().repeat(20)).unwrap();
    ok(&[s(&text), "--out", s(&one), "--eval-fraction", "0.1"]);
    let (_, a) = read_llmc(&one);
    let (_, b) = read_llmc(&t.path().join("one/one.eval.bin"));
    let whole = r50k(&docs.concat().repeat(20));
    assert_eq!(b.len(), (whole.len() as f64 * 0.1).round() as usize);
    assert_eq!([a, b].concat(), whole);
    assert_eq!(all, joined(&docs[..2]));
}

/// pyarrow's Parquet (snappy and zstd pages, several row groups) as
/// `datasets` and the Hub store it (issue 39): the `text` column's rows are
/// the same documents as the same texts in JSON lines; prompt/completion
/// columns the same rows; a null or a missing column is named.
#[test]
fn parquet_columns_read_as_json_lines_do() {
    let t = TempDir::new().unwrap();
    let docs: Vec<String> = corpus(20_000).into_iter().take(7).collect();
    let parquet = |rows: &serde_json::Value, name: &str, compression: &str| {
        let json = t.path().join(format!("{name}.json"));
        std::fs::write(&json, rows.to_string()).unwrap();
        let out = t.path().join(format!("{name}.parquet"));
        tokenize_ref(&["parquet", s(&json), s(&out), compression]);
        out
    };
    let rows: Vec<serde_json::Value> = docs
        .iter()
        .map(|d| serde_json::json!({"text": d, "n": 1}))
        .collect();
    let jsonl = t.path().join("docs.jsonl");
    let lines: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    std::fs::write(&jsonl, lines.join("\n")).unwrap();
    let want = {
        let out = t.path().join("j/x.bin");
        ok(&[s(&jsonl), "--out", s(&out)]);
        read_llmc(&out).1
    };
    for compression in ["snappy", "zstd"] {
        let file = parquet(
            &serde_json::Value::from(rows.clone()),
            compression,
            compression,
        );
        let out = t.path().join(format!("p-{compression}/x.bin"));
        ok(&[s(&file), "--out", s(&out)]);
        assert!(
            read_llmc(&out).1 == want,
            "{compression}: ids differ from JSON lines'"
        );
    }
    // Sequences from prompt/completion columns.
    let pairs = serde_json::json!([
        {"prompt": "Q: 2 + 2?", "completion": " 4"},
        {"prompt": "Q: the capital of France?", "completion": " Paris"},
    ]);
    let seq = |input: &Path, dir: &str| {
        let out = t.path().join(dir).join("s.safetensors");
        ok(&[s(input), "--out", s(&out), "--format", "sequences"]);
        std::fs::read(&out).unwrap()
    };
    let pq_pairs = parquet(&pairs, "pairs", "snappy");
    let jl_pairs = t.path().join("pairs.jsonl");
    let lines: Vec<String> = pairs
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.to_string())
        .collect();
    std::fs::write(&jl_pairs, lines.join("\n")).unwrap();
    assert_eq!(seq(&pq_pairs, "sp"), seq(&jl_pairs, "sj"));
    // A null text and a missing column are named.
    let with_null = parquet(
        &serde_json::json!([{"text": "a"}, {"text": null}]),
        "null",
        "snappy",
    );
    let e = fails(&[s(&with_null), "--out", s(&t.path().join("n/x.bin"))]);
    assert!(e.contains("row 2") && e.contains("`text` is null"), "{e}");
    let e = fails(&[
        s(&with_null),
        "--out",
        s(&t.path().join("n/x.bin")),
        "--field",
        "body",
    ]);
    assert!(e.contains("no column `body` (it has text)"), "{e}");
    // A folder datasets.save_to_disk wrote (Arrow stream files beside its
    // state.json and dataset_info.json, which are not documents).
    let texts: Vec<serde_json::Value> = docs
        .iter()
        .map(|d| serde_json::json!({ "text": d }))
        .collect();
    let rows_json = t.path().join("saved.json");
    std::fs::write(&rows_json, serde_json::Value::from(texts).to_string()).unwrap();
    let saved = t.path().join("saved");
    tokenize_ref(&["saved-dataset", s(&rows_json), s(&saved)]);
    let out = t.path().join("arrow/x.bin");
    ok(&[s(&saved), "--out", s(&out)]);
    assert!(
        read_llmc(&out).1 == want,
        "a saved dataset's ids differ from JSON lines'"
    );
}

/// `--split random` (the default, issue 39): whole documents held out, the
/// same ones for the same seed, the rest in input order; the share printed.
#[test]
fn the_random_split_holds_out_whole_documents_reproducibly() {
    let t = TempDir::new().unwrap();
    let docs: Vec<String> = (0..20).map(|i| format!("Document {i} says {i}.")).collect();
    let input = t.path().join("docs.jsonl");
    let lines: Vec<String> = docs
        .iter()
        .map(|d| serde_json::json!({ "text": d }).to_string())
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let split = |seed: &str, dir: &str| {
        let out = t.path().join(dir).join("x.bin");
        let stdout = ok(&[
            s(&input),
            "--out",
            s(&out),
            "--eval-fraction",
            "0.25",
            "--seed",
            seed,
        ]);
        let train = read_llmc(&out).1;
        let eval = read_llmc(&out.with_file_name("x.eval.bin")).1;
        (stdout, train, eval)
    };
    let (stdout, train, eval) = split("3", "a");
    assert!(
        stdout.contains("held out 5 of 20 documents (at random, seed 3)"),
        "{stdout}"
    );
    // Documents back from the ids: each whole, on one side only.
    let tj = t.path().join("a/tokenizer.json");
    let back = |ids: &[u32]| -> Vec<String> {
        decode(&tj, ids)
            .split(EOT_TEXT)
            .map(str::to_string)
            .collect()
    };
    let (tr, ev) = (back(&train), back(&eval));
    assert_eq!((tr.len(), ev.len()), (15, 5));
    let mut all: Vec<&String> = tr.iter().chain(&ev).collect();
    all.sort_by_key(|d| docs.iter().position(|x| x == *d).expect("a whole document"));
    assert!(
        all.iter().zip(&docs).all(|(a, b)| *a == b),
        "every document once"
    );
    let order = |side: &[String]| {
        side.iter()
            .map(|d| docs.iter().position(|x| x == d).unwrap())
            .collect::<Vec<_>>()
    };
    let ev_idx = order(&ev);
    assert!(ev_idx.windows(2).all(|w| w[0] < w[1]), "input order kept");
    assert_ne!(ev_idx, (15..20).collect::<Vec<_>>(), "not the last five");
    // The same seed, the same split; another seed, another one.
    let (_, train2, eval2) = split("3", "b");
    assert_eq!((train2, eval2.clone()), (train, eval));
    let (_, _, eval3) = split("4", "c");
    assert_ne!(eval3, eval2);
}

/// `--tokenizer MODEL_DIR` (issue 39): the folder's tokenizer.json
/// encodes, and its tokenizer_config.json (special tokens, chat template)
/// is copied beside the output for training's checkpoints; a later run
/// with another tokenizer removes the stale copy and says so.
#[test]
fn a_model_folders_tokenizer_and_its_config_come_along() {
    let t = TempDir::new().unwrap();
    let text = t.path().join("t.txt");
    std::fs::write(&text, "A model folder's tokenizer, brought along.").unwrap();
    let plain = t.path().join("plain/x.bin");
    ok(&[s(&text), "--out", s(&plain)]);
    let model = t.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        plain.with_file_name("tokenizer.json"),
        model.join("tokenizer.json"),
    )
    .unwrap();
    let config = serde_json::json!({
        "eos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    })
    .to_string();
    std::fs::write(model.join("tokenizer_config.json"), &config).unwrap();
    let out = t.path().join("from-model/x.bin");
    ok(&[s(&text), "--out", s(&out), "--tokenizer", s(&model)]);
    assert_eq!(read_llmc(&out).1, read_llmc(&plain).1);
    let copied = out.with_file_name("tokenizer_config.json");
    assert_eq!(std::fs::read_to_string(&copied).unwrap(), config);
    let stdout = ok(&[s(&text), "--out", s(&out), "--tokenizer", "gpt2"]);
    assert!(!copied.exists(), "a stale tokenizer_config.json stayed");
    assert!(
        stdout.contains("an earlier run's tokenizer_config.json"),
        "{stdout}"
    );
}

#[test]
fn u32_tokens_for_a_vocabulary_over_65536() {
    let t = TempDir::new().unwrap();
    let g = t.path().join("g/x.bin");
    let text = t.path().join("t.txt");
    std::fs::write(&text, "A short text, tokenized twice.").unwrap();
    ok(&[s(&text), "--out", s(&g)]);
    // GPT-2's tokenizer.json with one more token at id 70000.
    let mut tj: serde_json::Value =
        serde_json::from_slice(&std::fs::read(t.path().join("g/tokenizer.json")).unwrap()).unwrap();
    tj["model"]["vocab"]["zzzzzzzzzzzzzzzz"] = 70000.into();
    let big = t.path().join("big.json");
    std::fs::write(&big, serde_json::to_vec(&tj).unwrap()).unwrap();
    let w = t.path().join("w/x.bin");
    let stdout = ok(&[s(&text), "--out", s(&w), "--tokenizer", s(&big)]);
    assert!(stdout.contains("vocabulary 70001"), "{stdout}");
    let (h16, a) = read_llmc(&g);
    let (h32, b) = read_llmc(&w);
    assert_eq!((h16[0], h32[0]), (20240520, 20240801));
    assert_eq!(a, b);
    // The given file is copied beside the output.
    assert_eq!(
        std::fs::read(t.path().join("w/tokenizer.json")).unwrap(),
        std::fs::read(&big).unwrap()
    );
}

#[test]
fn errors_name_the_input_and_the_flag() {
    let t = TempDir::new().unwrap();
    let missing = t.path().join("nope.txt");
    let out = t.path().join("o.bin");
    let err = fails(&[s(&missing), "--out", s(&out)]);
    assert!(
        err.contains(&format!("input {}", missing.display())),
        "{err}"
    );

    let jsonl = t.path().join("bad.jsonl");
    std::fs::write(
        &jsonl,
        "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"a\"}\n",
    )
    .unwrap();
    let err = fails(&[s(&jsonl), "--out", s(&out), "--format", "sequences"]);
    assert!(
        err.contains(&format!(
            "{} line 2: no `completion` field",
            jsonl.display()
        )),
        "{err}"
    );

    let text = t.path().join("t.txt");
    std::fs::write(&text, "text").unwrap();
    let err = fails(&[s(&text), "--out", s(&out), "--eval-fraction", "1"]);
    assert!(
        err.contains("--eval-fraction must be in [0, 1), got 1"),
        "{err}"
    );
    let err = fails(&[s(&text), "--out", s(&out), "--train-bpe", "100"]);
    assert!(
        err.contains("--train-bpe 100: a byte-level BPE needs at least 257"),
        "{err}"
    );
    let err = fails(&[s(&text), "--out", s(&out), "--format", "sequences"]);
    assert!(err.contains("reads JSON lines (.jsonl)"), "{err}");
    let err = fails(&[s(&text), "--out", s(&out), "--tokenizer", s(&missing)]);
    assert!(
        err.contains(&format!("--tokenizer {}", missing.display())),
        "{err}"
    );
}

/// `accrue sample` is `accrue-worker sample` (the CLI links no libtorch):
/// its help and its errors are the worker's.
#[test]
fn sample_is_forwarded_to_the_worker() {
    let dir = TempDir::new().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_accrue"))
        .args(["sample", dir.path().to_str().unwrap(), "--prompt", "In the"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("neither a step folder (no model.safetensors or model.safetensors.index.json) nor a checkpoint folder"),
        "{err}"
    );
    let help = Command::new(env!("CARGO_BIN_EXE_accrue"))
        .args(["sample", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("accrue-worker sample") && text.contains("--temperature"),
        "{text}"
    );
}

mod safety;
mod sequences;
