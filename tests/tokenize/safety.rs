//! Issue 37: a rerun while a job trains, a failed rerun, inputs reached
//! twice or equal to outputs, refused placements, long pre-tokens, the
//! help and a byte order mark.

use super::*;

/// `accrue tokenize args` run in `dir` (relative paths resolve there).
fn accrue_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_accrue"))
        .current_dir(dir)
        .arg("tokenize")
        .args(args)
        .output()
        .unwrap()
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Waits for `child` up to `limit`; None if it still runs.
fn wait_for(child: &mut std::process::Child, limit: Duration) -> Option<ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// A rerun onto the token file a job is training on (issue 37): the job
/// keeps the file it mapped (the outputs are replaced by a rename) and goes
/// on training; before, the file was rewritten in place and the job died
/// of SIGBUS without a word.
#[test]
fn a_rerun_while_a_job_trains_leaves_the_job_its_file() {
    let worker = PathBuf::from(env!("CARGO_BIN_EXE_accrue")).with_file_name("accrue-worker");
    assert!(
        worker.exists(),
        "{} is missing: `make test` builds the whole workspace first",
        worker.display()
    );
    let t = TempDir::new().unwrap();
    let text = corpus(150_000).concat();
    let (big, small) = (t.path().join("big.txt"), t.path().join("small.txt"));
    std::fs::write(&big, &text).unwrap();
    std::fs::write(&small, text.chars().take(3000).collect::<String>()).unwrap();
    let out = t.path().join("data/train.bin");
    ok(&[s(&big), "--out", s(&out), "--train-bpe", "512"]);
    let job = t.path().join("job.toml");
    std::fs::write(
        &job,
        format!(
            "name = \"rerun\"\nmax_steps = 1000000\ndevice = \"cpu\"\nthreads = 1\n\
             [model]\nkind = \"llama\"\nvocab_size = 512\nhidden_size = 16\n\
             intermediate_size = 32\nnum_hidden_layers = 1\nnum_attention_heads = 2\n\
             num_key_value_heads = 1\nmax_position_embeddings = 16\n\
             [data]\nkind = \"tokens\"\npath = \"{}\"\nseq_len = 16\nbatch_size = 4\n\
             shuffle = true\n[optimizer]\nkind = \"sgd\"\nlr = 0.01\n",
            out.display()
        ),
    )
    .unwrap();
    let (log, err) = (t.path().join("job.out"), t.path().join("job.err"));
    let mut child = Command::new(&worker)
        .arg("train")
        .arg(&job)
        .arg("--json")
        .arg("--state-dir")
        .arg(t.path().join("state"))
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let steps = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"event\":\"step\""))
            .count()
    };
    // Steps until `n` were reported or the job ended.
    let mut until = |n: usize| {
        let t0 = Instant::now();
        while steps() < n && t0.elapsed() < Duration::from_secs(120) {
            if let Some(status) = child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        child.try_wait().unwrap()
    };
    let ended = until(2);
    assert!(
        ended.is_none(),
        "the job ended before the rerun: {ended:?}\n{}",
        std::fs::read_to_string(&err).unwrap()
    );
    // A smaller file (an in-place rewrite would cut the mapped one short).
    ok(&[s(&small), "--out", s(&out), "--train-bpe", "512"]);
    let ended = until(steps() + 20);
    let _ = child.kill();
    let _ = child.wait();
    if let Some(status) = ended {
        use std::os::unix::process::ExitStatusExt;
        let stderr = std::fs::read_to_string(&err).unwrap();
        assert_eq!(status.signal(), None, "the job died of a signal:\n{stderr}");
        assert!(
            status.success() || stderr.contains("error"),
            "{status}: {stderr}"
        );
    }
}

/// A rerun that fails (issue 37: here, a split that leaves nothing) leaves
/// the earlier outputs as they were, together, and no temporaries; a
/// rerun without a split removes the earlier one.
#[test]
fn a_failed_rerun_leaves_the_earlier_outputs_together() {
    let t = TempDir::new().unwrap();
    let docs = ["The first document.\n", "The second document.\n"];
    let files: Vec<PathBuf> = docs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let p = t.path().join(format!("d{i}.txt"));
            std::fs::write(&p, d).unwrap();
            p
        })
        .collect();
    let out = t.path().join("data/train.bin");
    let (d0, d1) = (s(&files[0]), s(&files[1]));
    ok(&[d0, d1, "--out", s(&out), "--eval-fraction", "0.5"]);
    let data = t.path().join("data");
    let before: Vec<Vec<u8>> = names(&data)
        .iter()
        .map(|n| std::fs::read(data.join(n)).unwrap())
        .collect();
    let err = fails(&[
        d0,
        d1,
        "--out",
        s(&out),
        "--train-bpe",
        "300",
        "--eval-fraction",
        "0.9",
    ]);
    assert!(err.contains("leaves nothing to train on"), "{err}");
    assert_eq!(
        names(&data),
        ["tokenizer.json", "train.bin", "train.eval.bin"]
    );
    let after: Vec<Vec<u8>> = names(&data)
        .iter()
        .map(|n| std::fs::read(data.join(n)).unwrap())
        .collect();
    assert!(before == after, "a failed rerun changed the outputs");

    let stdout = ok(&[d0, d1, "--out", s(&out)]);
    assert!(stdout.contains("removed "), "{stdout}");
    assert_eq!(names(&data), ["tokenizer.json", "train.bin"]);
}

/// Folders holding the outputs, symlinked folders (Debian's `.u8` links), a
/// symlink loop and a file named twice (issue 37): each file is read once,
/// the outputs never, and the terminal says what was left out.
#[test]
fn each_input_is_read_once_and_outputs_never() {
    let t = TempDir::new().unwrap();
    let c = t.path().join("corpus");
    std::fs::create_dir_all(c.join("sub")).unwrap();
    let (a, b) = ("Alpha is the first text.\n", "Beta is the second.\n");
    std::fs::write(c.join("a.txt"), a).unwrap();
    std::fs::write(c.join("sub/b.txt"), b).unwrap();
    std::os::unix::fs::symlink("sub", c.join("sub.u8")).unwrap();
    std::os::unix::fs::symlink("..", c.join("sub/loop")).unwrap();
    let out = c.join("train.bin");
    let want = [r50k(a), vec![EOT], r50k(b)].concat();
    for run in 0..2 {
        let stdout = ok(&[s(&c), s(&c.join("a.txt")), "--out", s(&out)]);
        assert_eq!(read_llmc(&out).1, want, "run {run}: {stdout}");
        assert!(
            stdout.contains("skipped 3 files or folders reached again"),
            "{stdout}"
        );
        // The rerun leaves out train.bin and tokenizer.json.
        let left_out = "skipped 2 files that this run writes";
        assert_eq!(stdout.contains(left_out), run == 1, "{stdout}");
    }
}

/// `--out` naming a folder, tokenizer.json or an input is refused before
/// anything is written (issue 37).
#[test]
fn out_naming_a_folder_the_tokenizer_or_an_input_is_refused() {
    let t = TempDir::new().unwrap();
    std::fs::write(t.path().join("in.txt"), "Some text.\n").unwrap();
    std::fs::write(t.path().join("tokenizer.json"), "Text named so.\n").unwrap();
    std::fs::create_dir(t.path().join("d")).unwrap();
    let cases: [(&[&str], &str); 6] = [
        (&["in.txt", "--out", "d/"], "--out d/: names a folder"),
        (&["in.txt", "--out", "d"], "--out d: names a folder"),
        (
            &["in.txt", "--out", "d/tokenizer.json"],
            "--out d/tokenizer.json: is where the tokenizer is written",
        ),
        (
            &["in.txt", "--out", "in.txt"],
            "input in.txt is an output of this run (in.txt)",
        ),
        // A text file in a folder given: an input too.
        (
            &[".", "--out", "in.txt"],
            "input ./in.txt is an output of this run (in.txt)",
        ),
        (
            &["tokenizer.json", "--out", "x.bin"],
            "input tokenizer.json is an output of this run (tokenizer.json)",
        ),
    ];
    for (args, want) in cases {
        let o = accrue_in(t.path(), args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(
            names(t.path()),
            ["d", "in.txt", "tokenizer.json"],
            "{args:?}"
        );
        assert!(names(&t.path().join("d")).is_empty(), "{args:?}");
    }
    assert_eq!(
        std::fs::read_to_string(t.path().join("in.txt")).unwrap(),
        "Some text.\n"
    );
}

/// 400 KB of letters without a space or a newline is one pre-token: a BPE
/// trained on it in whole took minutes (issue 37); trained on pieces it
/// takes a moment, and the text still round-trips.
#[test]
fn a_bpe_trains_quickly_on_text_without_spaces() {
    let t = TempDir::new().unwrap();
    let text: String = corpus(900_000)
        .concat()
        .chars()
        .filter(char::is_ascii_alphabetic)
        .take(400_000)
        .collect();
    assert_eq!(text.len(), 400_000);
    let input = t.path().join("letters.txt");
    std::fs::write(&input, &text).unwrap();
    let out = t.path().join("x.bin");
    let mut child = Command::new(env!("CARGO_BIN_EXE_accrue"))
        .arg("tokenize")
        .args([s(&input), "--out", s(&out), "--train-bpe", "300"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let status = wait_for(&mut child, Duration::from_secs(20));
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("--train-bpe 300 on 400 KB without spaces ran past 20 s");
    }
    assert!(status.unwrap().success());
    let ids = read_llmc(&out).1;
    assert_eq!(decode(&t.path().join("tokenizer.json"), &ids), text);
}

/// Issue 37, item 13: `accrue tokenize --help` lists its own options, not
/// the coordinator's connection flags (it talks to no coordinator); a verb
/// that does keeps them.
#[test]
fn tokenize_help_shows_no_coordinator_flags() {
    let help = |verb: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_accrue"))
            .args([verb, "--help"])
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let t = help("tokenize");
    assert!(t.contains("--train-bpe"), "{t}");
    for flag in [
        "--coordinator",
        "--token <",
        "--token-file",
        "--ca <",
        "--insecure",
    ] {
        assert!(!t.contains(flag), "{flag} in\n{t}");
    }
    let s = help("status");
    assert!(s.contains("--coordinator") && s.contains("--ca"), "{s}");
}

/// Issue 37, item 13: JSON lines opened by a UTF-8 byte order mark (as
/// Windows editors write them) tokenize as the same rows without it
/// (before: "line 1: not JSON").
#[test]
fn json_lines_with_a_byte_order_mark_read_as_without() {
    let t = tempfile::TempDir::new().unwrap();
    let line = "{\"prompt\": \"Q: 2 + 2?\", \"completion\": \" 4\"}\n";
    let tokens = |name: &str, text: String| {
        let jsonl = t.path().join(format!("{name}.jsonl"));
        std::fs::write(&jsonl, text).unwrap();
        let out = t.path().join(name).join("train.safetensors");
        ok(&[s(&jsonl), "--out", s(&out), "--format", "sequences"]);
        let bytes = std::fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensor("tokens").unwrap().data().to_vec()
    };
    let plain = tokens("plain", line.repeat(2));
    let bom = tokens("bom", format!("\u{feff}{}", line.repeat(2)));
    assert!(!plain.is_empty());
    assert_eq!(plain, bom);
}

/// `accrue tokenize args` with stderr to a file, killed after `limit`:
/// its exit code (None: killed), its stderr, how long it ran and its peak
/// resident memory in MiB.
fn bounded_run(dir: &Path, args: &[&str], limit: Duration) -> (Option<i32>, String, Duration, u64) {
    let err_path = dir.join("stderr.txt");
    // Reaped by wait4 below (for its peak memory), not by Child::wait.
    #[allow(clippy::zombie_processes)]
    let mut child = Command::new(env!("CARGO_BIN_EXE_accrue"))
        .arg("tokenize")
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let t0 = Instant::now();
    let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
    let code = loop {
        // SAFETY: waits for our own child; `status` and `usage` are ours.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t0.elapsed();
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    (code, err, took, usage.ru_maxrss as u64 / 1024)
}

/// A model folder cannot make `accrue tokenize` hang, exhaust memory or
/// abort: a chat template that loops (nested `range(100000)`), one that
/// builds a 100 MB string or renders 100 MB, a FIFO or `/dev/zero` as
/// `tokenizer_config.json` and `/dev/zero` as `tokenizer.json` each fail
/// within seconds with one line naming the row or the file (they ran for
/// ever, allocated gigabytes or ended in "out of memory").
#[test]
fn a_model_folder_cannot_exhaust_tokenize() {
    let t = TempDir::new().unwrap();
    let text = t.path().join("t.txt");
    std::fs::write(&text, "a tokenizer for chats").unwrap();
    ok(&[s(&text), "--out", s(&t.path().join("g/t.bin"))]);
    let chats = t.path().join("chats.jsonl");
    let row = serde_json::json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}]});
    std::fs::write(&chats, format!("{row}\n{row}\n")).unwrap();
    // A model folder: the tokenizer, and a config with `template`.
    let model = |name: &str, template: &str| {
        let dir = t.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            t.path().join("g/tokenizer.json"),
            dir.join("tokenizer.json"),
        )
        .unwrap();
        let config = serde_json::json!({"eos_token": "<|endoftext|>", "chat_template": template});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        dir
    };
    let plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}";
    let zero = |dir: &Path, file: &str| {
        std::fs::remove_file(dir.join(file)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join(file)).unwrap();
    };
    let fifo_dir = model("fifo", plain);
    std::fs::remove_file(fifo_dir.join("tokenizer_config.json")).unwrap();
    let made = Command::new("mkfifo")
        .arg(fifo_dir.join("tokenizer_config.json"))
        .status()
        .unwrap();
    assert!(made.success());
    let zero_config = model("zero-config", plain);
    zero(&zero_config, "tokenizer_config.json");
    let zero_tokenizer = model("zero-tokenizer", plain);
    zero(&zero_tokenizer, "tokenizer.json");
    let cases = [
        (
            model(
                "loops",
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            ),
            "chats.jsonl line 1: the chat template needs more than its budget",
        ),
        (
            model("string", "{% set s = 'x' * 100000000 %}{{ s | length }}"),
            "chats.jsonl line 1: the chat template needs more than its budget",
        ),
        (
            model(
                "output",
                "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
            ),
            "chats.jsonl line 1: the chat template renders more than 16 MiB",
        ),
        (
            fifo_dir,
            "fifo/tokenizer_config.json: is not a regular file (it is a FIFO)",
        ),
        (
            zero_config,
            "zero-config/tokenizer_config.json: is not a regular file (it is a character device)",
        ),
        (
            zero_tokenizer,
            "zero-tokenizer/tokenizer.json: is not a regular file (it is a character device)",
        ),
    ];
    for (dir, want) in cases {
        let out = t.path().join("out/sft.safetensors");
        let args = [
            s(&chats),
            "--out",
            s(&out),
            "--format",
            "sequences",
            "--tokenizer",
            s(&dir),
        ];
        let (code, err, took, peak_mib) = bounded_run(t.path(), &args, Duration::from_secs(30));
        eprintln!(
            "{}: exit {code:?} after {took:?}, peak {peak_mib} MiB: {}",
            dir.display(),
            err.trim()
        );
        assert_eq!(code, Some(2), "{}: {err}", dir.display());
        assert!(
            err.contains(want),
            "{}: wanted {want:?} in {err:?}",
            dir.display()
        );
        assert_eq!(err.trim().lines().count(), 1, "{}: {err}", dir.display());
        assert!(
            took < Duration::from_secs(15),
            "{}: took {took:?}",
            dir.display()
        );
        assert!(
            peak_mib < 1024,
            "{}: peak memory {peak_mib} MiB",
            dir.display()
        );
        assert!(!out.exists(), "{}: wrote {}", dir.display(), out.display());
    }
}
