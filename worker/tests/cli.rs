//! The real `accrue-worker` binary as a process: the demo job on the real
//! digits data set, a refused spec, confined paths, one job per checkpoint
//! folder, and `--profile`'s trace.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use tempfile::TempDir;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The demo job reaches at least 95% on the 360 held-out digits and prints a
/// progress line per optimizer step. Needs `make test` (it writes data/digits).
#[test]
fn demo_job_trains_digits_to_95_percent() {
    let repo = repo();
    assert!(
        repo.join("data/digits/train-images-idx3-ubyte").exists(),
        "data/digits is missing: run `make test` (it writes the digits as IDX files)"
    );
    let state = TempDir::new().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
        .current_dir(&repo)
        .args(["train", "jobs/digits-mlp.toml", "--state-dir"])
        .arg(state.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 1,437 samples, b = 8, k = 4: 180 micro-batches -> 45 steps per epoch, 30 epochs.
    let steps = stdout.lines().filter(|l| l.starts_with("step ")).count();
    assert_eq!(steps, 1350);
    assert!(stdout.contains("step 1350/1350 epoch 30 loss"));
    let acc: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("final accuracy "))
        .and_then(|l| l.split('%').next())
        .and_then(|v| v.parse().ok())
        .expect("a final accuracy line");
    assert!(acc >= 95.0, "final accuracy {acc}% < 95%");
    assert!(state
        .path()
        .join("checkpoints/digits-mlp/step-1350/model.safetensors")
        .exists());
}

#[test]
fn refused_spec_names_fields_and_writes_nothing() {
    let dir = TempDir::new().unwrap();
    let job = dir.path().join("bad.toml");
    std::fs::write(
        &job,
        r#"
name = "bad"
[model]
kind = "transformer"
[data]
kind = "synthetic"
batch_size = 0
[accumulation]
steps = 0
[clipping]
max_norm = -1.0
norm_type = 1.0
[optimizer]
kind = "sgd"
lr = nan
"#,
    )
    .unwrap();
    let state = dir.path().join("state");
    let out = Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
        .args(["train"])
        .arg(&job)
        .arg("--state-dir")
        .arg(&state)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        &*format!(
            "model.kind = \"transformer\": {}",
            <accrue_worker::spec::ModelKind as accrue_worker::spec::SpecEnum>::allowed()
        ),
        "data.batch_size = 0: must be an integer in 1..=1048576",
        "accumulation.steps = 0: must be an integer in 1..=65536",
        "clipping.max_norm = -1.0: must be a finite number > 0",
        "clipping.norm_type = 1.0: must be 2.0 or inf",
        "optimizer.lr = NaN: must be a finite number > 0",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in:\n{err}");
    }
    assert!(!state.exists(), "a refused job must write nothing");
}

/// Issue 14, confined paths: `accrue-worker train` with roots refuses a
/// data path out of `--data-root` and a checkpoint folder out of
/// `--checkpoint-root` (the default one under `--state-dir` included),
/// naming the field and writing nothing; inside them it trains, relative
/// paths resolved under the roots.
#[test]
fn train_confines_paths_under_the_roots_given() {
    let dir = TempDir::new().unwrap();
    let base = std::fs::canonicalize(dir.path()).unwrap();
    let (data, ckpt, outside) = (base.join("data"), base.join("ckpt"), base.join("outside"));
    for d in [&data, &ckpt, &outside] {
        std::fs::create_dir_all(d).unwrap();
    }
    let synthetic = |extra: &str| {
        format!(
            "name = \"conf\"\nmax_steps = 2\ndevice = \"cpu\"\nthreads = 1\n[model]\nkind = \"mlp\"\nhidden = [4]\n[data]\nkind = \"synthetic\"\nsamples = 32\nshape = [4]\nclasses = 2\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n{extra}"
        )
    };
    let run = |name: &str, text: &str, state: &Path| {
        let job = base.join(name);
        std::fs::write(&job, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
            .arg("train")
            .arg(&job)
            .arg("--state-dir")
            .arg(state)
            .arg("--data-root")
            .arg(&data)
            .arg("--checkpoint-root")
            .arg(&ckpt)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), err)
    };
    let tensors = "name = \"conf\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"tensors\"\npath = \"../outside/t.safetensors\"\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
    let (ok, err) = run("escape.toml", tensors, &ckpt);
    assert!(!ok);
    assert!(
        err.contains("data.path = \"../outside/t.safetensors\": must lie under the data root"),
        "{err}"
    );
    let (ok, err) = run(
        "ckpt.toml",
        &synthetic("[checkpoint]\ndir = \"../outside/c\""),
        &ckpt,
    );
    assert!(!ok);
    assert!(
        err.contains("checkpoint.dir = \"../outside/c\": must lie under"),
        "{err}"
    );
    // The default folder, <state-dir>/checkpoints/<name>, out of the root.
    let (ok, err) = run("default.toml", &synthetic(""), &outside);
    assert!(!ok);
    assert!(err.contains("--state-dir = "), "{err}");
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "nothing written outside"
    );
    // Inside: trains, the relative checkpoint.dir under the root.
    let (ok, err) = run(
        "fine.toml",
        &synthetic("[checkpoint]\ndir = \"fine\""),
        &outside,
    );
    assert!(ok, "{err}");
    assert!(ckpt.join("fine/step-2/model.safetensors").exists());
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "nothing written outside"
    );
}

/// Issue 27: one job per checkpoint folder. `accrue-worker train` claims
/// its folder with the job's name as its id; another job, fresh or with
/// `--resume`, is refused naming both, and so is a resume of the same job
/// with another optimizer kind (its state would silently be dropped),
/// naming the field. Nothing of the folder changes.
#[test]
fn a_checkpoint_folder_serves_one_job_and_one_optimizer_kind() {
    let dir = TempDir::new().unwrap();
    let ck = dir.path().join("ck");
    let job = |name: &str, optimizer: &str, steps: u64| {
        let p = dir.path().join(format!("{name}-{optimizer}-{steps}.toml"));
        std::fs::write(
            &p,
            format!(
                "name = \"{name}\"\nmax_steps = {steps}\ndevice = \"cpu\"\nthreads = 1\n[model]\nkind = \"mlp\"\nhidden = [4]\n[data]\nkind = \"synthetic\"\nsamples = 64\nshape = [4]\nclasses = 2\nbatch_size = 4\n[optimizer]\nkind = \"{optimizer}\"\nlr = 0.1\n"
            ),
        )
        .unwrap();
        p
    };
    let run = |spec: &Path, resume: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_accrue-worker"));
        cmd.arg("train").arg(spec).arg("--checkpoint-dir").arg(&ck);
        if resume {
            cmd.arg("--resume");
        }
        let out = cmd.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = run(&job("first", "sgd", 2), false);
    assert!(ok, "{err}");
    let owner = std::fs::read_to_string(ck.join("OWNER.json")).unwrap();
    assert!(owner.contains("\"job_id\": \"first\""), "{owner}");
    // The writer lock's file names its last holder (the refused resume
    // below takes it before it reads the checkpoint): not compared.
    let snapshot = || {
        let mut v: Vec<(String, Vec<u8>)> = walk(&ck);
        v.retain(|(p, _)| !p.ends_with(".accrue-writer.lock"));
        v.sort();
        v
    };
    let before = snapshot();
    for resume in [false, true] {
        let (ok, err) = run(&job("second", "sgd", 4), resume);
        assert!(!ok);
        assert!(
            err.contains("belongs to job first") && err.contains("this is job second"),
            "resume {resume}: {err}"
        );
    }
    let (ok, err) = run(&job("first", "adam", 4), true);
    assert!(!ok);
    assert!(
        err.contains("optimizer.kind = \"sgd\", the spec says \"adam\""),
        "{err}"
    );
    assert!(snapshot() == before, "a refused run changed the folder");
    // The same job and kind resumes.
    let (ok, err) = run(&job("first", "sgd", 4), true);
    assert!(ok, "{err}");
    assert!(ck.join("step-4/MANIFEST.json").exists());
}

/// Issue 37, items 2 and 3, with the real binary: a second run of one job
/// on one folder, started while the first trains, is refused naming the
/// first (before: both ran, one result); a run another job's folder
/// refuses removes nothing there (before: it swept `.step-6.tmp-<pid>` of
/// a writer in progress, a user's `.thesis.tmp-2024/` and `.cache.tmp-1`);
/// the owner's next run sweeps accrue's own temporary names only.
#[test]
fn one_run_writes_a_folder_and_refused_runs_remove_nothing() {
    use std::time::{Duration, Instant};
    let dir = TempDir::new().unwrap();
    let ck = dir.path().join("ck");
    let job = |name: &str, steps: u64| {
        let p = dir.path().join(format!("{name}-{steps}.toml"));
        std::fs::write(
            &p,
            format!(
                "name = \"{name}\"\nmax_steps = {steps}\ndevice = \"cpu\"\nthreads = 1\n[model]\nkind = \"mlp\"\nhidden = [4]\n[data]\nkind = \"synthetic\"\nsamples = 64\nshape = [4]\nclasses = 2\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n"
            ),
        )
        .unwrap();
        p
    };
    let train = |spec: &Path, resume: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_accrue-worker"));
        cmd.arg("train").arg(spec).arg("--checkpoint-dir").arg(&ck);
        if resume {
            cmd.arg("--resume");
        }
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        cmd
    };
    // Bounded: a run that is not refused would train for minutes.
    let finish = |mut child: std::process::Child| {
        let start = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("the run was not refused within 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = child.wait_with_output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let long = job("one", 5_000_000);
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut first = KillOnDrop(train(&long, false).spawn().unwrap());
    let lock = ck.join(".accrue-writer.lock");
    let pid = format!("\"pid\":{}", first.0.id());
    let start = Instant::now();
    while !std::fs::read_to_string(&lock).is_ok_and(|t| t.contains(&pid)) {
        assert!(first.0.try_wait().unwrap().is_none(), "the first run ended");
        assert!(start.elapsed() < Duration::from_secs(60), "no lock taken");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ok, err) = finish(train(&long, false).spawn().unwrap());
    assert!(!ok, "a second run of the job on the folder was not refused");
    assert!(
        err.contains("is in use by another run: job one")
            && err.contains(&format!("pid {}", first.0.id())),
        "{err}"
    );
    first.0.kill().unwrap();
    first.0.wait().unwrap();

    // A folder job `one` owns, with a write in progress and a user's files.
    let (ok, err) = finish(train(&job("one", 2), false).spawn().unwrap());
    assert!(ok, "{err}");
    let in_progress = ck.join(format!(".step-6.tmp-{}", std::process::id()));
    std::fs::create_dir(&in_progress).unwrap();
    std::fs::write(in_progress.join("model.safetensors"), b"half").unwrap();
    let thesis = ck.join(".thesis.tmp-2024");
    std::fs::create_dir(&thesis).unwrap();
    std::fs::write(thesis.join("chapter1.tex"), b"words").unwrap();
    std::fs::write(ck.join(".cache.tmp-1"), b"c").unwrap();
    for resume in [false, true] {
        let (ok, err) = finish(train(&job("two", 4), resume).spawn().unwrap());
        assert!(!ok && err.contains("belongs to job one"), "{err}");
        assert!(in_progress.join("model.safetensors").exists());
        assert!(thesis.join("chapter1.tex").exists());
        assert!(ck.join(".cache.tmp-1").exists());
    }
    // The owner's next run holds the lock: it sweeps accrue's names only.
    let (ok, err) = finish(train(&job("one", 4), true).spawn().unwrap());
    assert!(ok, "{err}");
    assert!(!in_progress.exists());
    assert!(thesis.join("chapter1.tex").exists());
    assert!(ck.join(".cache.tmp-1").exists());
}

/// Every file under `dir` with its contents.
fn walk(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push((p.display().to_string(), std::fs::read(&p).unwrap()));
        }
    }
    out
}

/// `--profile` writes libtorch's profiler trace (a Chrome trace) covering
/// exactly the steps asked for: an MLP of two linear layers runs one
/// `aten::addmm` per layer per micro-step forward, so 2 layers x k = 2
/// micro-steps x 2 profiled steps = 8 of them, out of 12 steps run.
#[test]
fn profile_writes_a_trace_of_the_steps_asked_for() {
    let dir = TempDir::new().unwrap();
    let job = dir.path().join("job.toml");
    // 24 samples, b = 2, k = 2: 6 steps an epoch, two epochs.
    std::fs::write(&job, common::mlp_job(24, 2, 2, "mean", "")).unwrap();
    let trace = dir.path().join("trace.json");
    let out = Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
        .args(["train", job.to_str().unwrap(), "--state-dir"])
        .arg(dir.path().join("state"))
        .arg("--profile")
        .arg(&trace)
        .args(["--profile-after", "3", "--profile-steps", "2"])
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("profile written"),
        "no 'profile written' in the log: {stderr}"
    );
    let text = std::fs::read_to_string(&trace).unwrap();
    assert!(
        text.contains("\"traceEvents\""),
        "not a Chrome trace: {}",
        &text[..text.len().min(500)]
    );
    let addmm = text.matches("\"name\": \"aten::addmm\"").count()
        + text.matches("\"name\":\"aten::addmm\"").count();
    assert_eq!(addmm, 8, "aten::addmm events in the trace");
}

/// Issue 37, item 7: a language model evaluates in chunks of the training
/// micro-batch, so its evaluation stays inside the memory estimate. A
/// vocabulary of 16,384 and T = 64: 256 held-out rows at once (the
/// default `eval.batch_size`) are 1.07 GB of fp32 logits (before: the
/// process peaked above that); in chunks of `data.batch_size` = 2, 8 MB.
/// The job is admitted under `--max-job-memory-gib 1` and its peak
/// resident memory (the kernel's, from wait4) stays well under it.
#[test]
fn a_language_models_evaluation_stays_inside_its_estimate() {
    let dir = TempDir::new().unwrap();
    let tokens = |name: &str, n: usize| {
        let mut header = [0i32; 256];
        (header[0], header[1], header[2]) = (20240520, 1, n as i32);
        let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
        bytes.extend((0..n).flat_map(|i| ((i * 7919 % 16384) as u16).to_le_bytes()));
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let (train, eval) = (
        tokens("train.bin", 4 * 64 + 1),
        tokens("eval.bin", 256 * 64 + 1),
    );
    let spec = dir.path().join("lm.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"lm\"\nmax_steps = 1\ndevice = \"cpu\"\nthreads = 1\n[model]\nkind = \"llama\"\nvocab_size = 16384\nhidden_size = 16\nintermediate_size = 32\nnum_hidden_layers = 1\nnum_attention_heads = 2\nnum_key_value_heads = 1\nmax_position_embeddings = 64\n[data]\nkind = \"tokens\"\npath = \"{}\"\neval_path = \"{}\"\nseq_len = 64\nbatch_size = 2\n[optimizer]\nkind = \"adamw\"\nlr = 0.001\n",
            train.display(),
            eval.display()
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
        .arg("train")
        .arg(&spec)
        .args(["--max-job-memory-gib", "1", "--state-dir"])
        .arg(dir.path().join("runs"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    // Drained while it runs (a full pipe would block it).
    let out = std::thread::spawn(move || child.wait_with_output_streams());
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it for our child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child, writing into the two locals.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid);
    let (stdout, stderr) = out.join().unwrap();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{stdout}\n{stderr}"
    );
    // In a language model's words (issue 37, item 13): tokens, perplexity.
    assert!(
        stdout.contains("final perplexity")
            && stdout.contains(" tokens/s ")
            && stdout.contains(" tokens, 0 skipped steps")
            && !stdout.contains("samples"),
        "{stdout}"
    );
    let peak = usage.ru_maxrss as u64 * 1024;
    assert!(peak < 700 << 20, "peaked at {peak} bytes\n{stdout}");
}

trait Streams {
    fn wait_with_output_streams(self) -> (String, String);
}

impl Streams for std::process::Child {
    /// Both pipes read to their end (the process is reaped by the caller).
    fn wait_with_output_streams(mut self) -> (String, String) {
        use std::io::Read;
        let mut err_pipe = self.stderr.take().unwrap();
        let err = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err_pipe.read_to_string(&mut s);
            s
        });
        let mut out = String::new();
        let _ = self.stdout.take().unwrap().read_to_string(&mut out);
        (out, err.join().unwrap())
    }
}
