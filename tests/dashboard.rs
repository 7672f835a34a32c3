//! The status page in a real browser (issue 16): Debian's chromium,
//! headless, driven by `tests/browser/dashboard.mjs` (playwright-core),
//! against a real coordinator with real worker daemons training a real
//! job. The page must show the job's curve point by point while it runs,
//! a worker killed with SIGKILL in its recovery log and as a chart marker,
//! and stored text as text; it compares runs, shows a job's spec, draws
//! the loss on a log scale, smoothed, with its evaluations, exports the
//! curve, and signs in with `accrue local`'s one-use link. Screenshots go
//! to `runs/tests/dashboard/`.

mod common;

use accrue_proto::v1;
use common::*;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tempfile::TempDir;

const ALICE: &str = "alice-dash-1f2e3d4c";
const EVIL: &str = "evil-dash-5a6b7c8d";
/// A principal whose name is markup that runs script if inserted as HTML.
const EVIL_NAME: &str = r#"<img src=x onerror="window.__pwned=1">&'"#;

/// Node and the driver script, or a panic naming how to get them.
fn driver() -> (PathBuf, PathBuf) {
    let script = repo().join("tests/browser/dashboard.mjs");
    let module = repo().join("tests/browser/node_modules/playwright-core");
    assert!(
        module.exists() && Path::new("/usr/bin/chromium").exists(),
        "{} or /usr/bin/chromium is missing: `make setup` installs chromium and playwright-core",
        module.display()
    );
    let node = common::etcd::which("node").expect("node is missing: `make setup` installs it");
    (node, script)
}

/// Kills the browser driver (and so its chromium) on drop.
struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the driver in `mode` with `args` (written to a file), logging
/// its stderr to `log`.
fn run_driver(mode: &str, args: &serde_json::Value, dir: &Path, log: &Path) -> Driver {
    let (node, script) = driver();
    let file = write(dir, &format!("{mode}-args.json"), &args.to_string());
    let child = Command::new(node)
        .arg(script)
        .arg(mode)
        .arg(file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    Driver(child)
}

/// The driver's stdout, line by line as JSON, with a bound on each wait.
fn lines(d: &mut Driver) -> std::sync::mpsc::Receiver<serde_json::Value> {
    let out = d.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str(&line) {
                let _ = tx.send(v);
            }
        }
    });
    rx
}

/// Waits for the driver to exit and asserts it passed its checks (`done`:
/// its last line).
fn driver_succeeded(drv: &mut Driver, done: &serde_json::Value, log: &Path, out: &Path) {
    let status = drv.0.wait().unwrap();
    assert!(
        status.success(),
        "the browser checks failed ({status}): {done}; see {} and {}/failure.png",
        log.display(),
        out.display()
    );
}

/// The driver's next line, waiting at most `secs` (the panic names what
/// it was doing and its log).
fn next_line(
    rx: &std::sync::mpsc::Receiver<serde_json::Value>,
    secs: u64,
    log: &Path,
    what: &str,
) -> serde_json::Value {
    rx.recv_timeout(Duration::from_secs(secs))
        .unwrap_or_else(|_| {
            panic!(
                "the browser driver said nothing while {what}; see {}",
                log.display()
            )
        })
}

/// A coordinator whose one token is alice's (read and submit), two
/// workers (ids `<prefix>-N`) and alice's client.
async fn alice_and_two_workers(
    dir: &Path,
    prefix: &str,
) -> (accrue_coordinator::Handle, Workers, accrue::Client) {
    let tokens = write(
        dir,
        "tokens.toml",
        &tokens_toml(&[("alice", ALICE, &["read", "submit"])]),
    );
    let h = coordinator_with(dir, &tokens).await;
    let grpc = h.grpc_addr.to_string();
    let w = start_workers(&grpc, 2, dir, prefix);
    let alice = client_with(&grpc, ALICE).await;
    (h, w, alice)
}

fn shots() -> PathBuf {
    let p = repo().join("runs/tests/dashboard");
    std::fs::create_dir_all(&p).unwrap();
    p
}

async fn coordinator_with(dir: &Path, tokens: &Path) -> accrue_coordinator::Handle {
    let cfg = accrue_coordinator::Config {
        state_dir: dir.join("state"),
        heartbeat_ttl: Duration::from_secs(3),
        tls: Some(creds().server_tls()),
        tokens: Some(tokens.to_path_buf()),
        ..Default::default()
    };
    accrue_coordinator::start(cfg, "127.0.0.1:0", "127.0.0.1:0")
        .await
        .unwrap()
}

const STEPS: u64 = 240;

/// One browser test at a time: each trains real jobs on this machine's
/// cores, and the live one times what its job does.
static ONE_BROWSER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_follows_a_job_through_a_recovery_and_shows_text_as_text() {
    let _one = ONE_BROWSER.lock().await;
    let d = TempDir::new().unwrap();
    let tokens = write(
        d.path(),
        "tokens.toml",
        &tokens_toml(&[
            ("alice", ALICE, &["read", "submit"]),
            (EVIL_NAME, EVIL, &["read", "submit"]),
        ]),
    );
    let h = coordinator_with(d.path(), &tokens).await;
    let grpc = h.grpc_addr.to_string();
    let ids = ["p0", "p1", "p2"];
    // Slowed (20 ms a micro-step, k = 2) so the job runs ~10 s: long
    // enough to watch it and kill a rank while it runs.
    let mut w = Workers(
        ids.iter()
            .map(|id| spawn_worker(&grpc, id, d.path(), &["--micro-step-delay-ms", "20"]))
            .collect(),
    );
    let extra = "[eval]\nevery_epochs = 1\n[comm]\ntimeout_s = 10\nconnect_timeout_s = 30\nrendezvous_timeout_s = 1.5\n";
    let mut alice = client_with(&grpc, ALICE).await;
    let job = alice
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("live", 2, STEPS, extra))),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // A job of the markup principal, cancelled at once: its owner and the
    // cancel reason are text the page must not interpret.
    let mut evil = client_with(&grpc, EVIL).await;
    let evil_job = evil
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("evil", 2, 10, ""))),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    evil.cancel_job(v1::CancelJobRequest {
        id: evil_job.id.clone(),
    })
    .await
    .unwrap();
    // One of alice's, cancelled at once: the page offers her its Resume
    // button (issue 27), and clicks it once the live job is done.
    let mine = alice
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("mine", 2, 4, ""))),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    alice
        .cancel_job(v1::CancelJobRequest {
            id: mine.id.clone(),
        })
        .await
        .unwrap();

    let out = shots();
    let args = serde_json::json!({
        "base": format!("https://{}", h.http_addr),
        "token": ALICE,
        "job": job.id,
        "evil_job": evil_job.id,
        "evil_text": EVIL_NAME,
        "resume_job": mine.id,
        "out": out,
        "expect_steps": STEPS,
        "bound": 1000,
    });
    let log = out.join("driver.log");
    let mut drv = run_driver("live", &args, d.path(), &log);
    let rx = lines(&mut drv);
    let next = |what: &str| next_line(&rx, 180, &log, what);
    let running = next("waiting for the page to follow the running job");
    assert_eq!(running["phase"], "running", "{running}");
    let coord = h.coordinator().unwrap();
    let now = coord.job(&job.id).unwrap();
    let step = now.counters.map_or(0, |c| c.step);
    assert!(
        step + 40 < STEPS,
        "the job ran too far ({step} of {STEPS} steps) before the page showed it running"
    );
    let victim = now.workers[1].clone();
    let at = ids.iter().position(|i| *i == victim).unwrap();
    w.0[at].kill().unwrap();
    eprintln!("killed {victim} (rank 1) at step {step}");
    let stdin = drv.0.stdin.as_mut().unwrap();
    writeln!(stdin, "killed").unwrap();
    stdin.flush().unwrap();
    let done = next("waiting for the recovery, the end of the job and the checks");
    driver_succeeded(&mut drv, &done, &log, &out);
    let end = coord.job(&job.id).unwrap();
    assert_eq!(end.state(), v1::JobState::Succeeded, "{end:?}");
    assert_eq!(end.recoveries.len(), 1, "{:?}", end.recoveries);
    // What the page drew, from the driver's report.
    assert!(
        done["first_points"].as_u64().unwrap() < done["later_points"].as_u64().unwrap(),
        "{done}"
    );
    assert_eq!(done["streamed_points"], STEPS, "{done}");
    assert_eq!(done["reloaded_points"], STEPS, "{done}");
    assert!(done["recovery_rows"].as_u64().unwrap() >= 1, "{done}");
    assert_eq!(done["precision"], "fp32", "{done}");
    assert_eq!(done["resume_hidden_for_others"], true, "{done}");
    assert_eq!(done["cancel_hidden_when_resumable"], true, "{done}");
    assert!(done["resumed_state"].is_string(), "{done}");
    let resumed = coord.job(&mine.id).unwrap();
    let t = resumed
        .history
        .iter()
        .find(|t| t.from == v1::JobState::Cancelled as i32)
        .unwrap_or_else(|| panic!("no resume in {:?}", resumed.history));
    assert!(t.reason.starts_with("resumed by alice"), "{t:?}");
    eprintln!("browser: {done}; screenshots in {}", out.display());

    // The series API itself: every step while under the bound, merged to
    // max_points on request, a bad bound refused naming the allowed range.
    let http = https_client(&creds().ca());
    let get = |q: &str| {
        http.get(format!(
            "https://{}/v1/jobs/{}/series{q}",
            h.http_addr, job.id
        ))
        .bearer_auth(ALICE)
        .send()
    };
    let all: serde_json::Value = get("").await.unwrap().json().await.unwrap();
    let steps: Vec<u64> = serde_json::from_value(all["points"]["last_step"].clone()).unwrap();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>());
    assert_eq!(all["recoveries"].as_array().unwrap().len(), 1);
    let few: serde_json::Value = get("?max_points=10&from_step=100")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let firsts = few["points"]["first_step"].as_array().unwrap();
    assert!(firsts.len() <= 10 && firsts.len() > 5, "{few}");
    assert_eq!(firsts[0], 100);
    let bad = get("?max_points=1").await.unwrap();
    assert_eq!(bad.status(), 400);
    let text = bad.text().await.unwrap();
    assert!(
        text.contains("max_points = 1") && text.contains("2..=10000"),
        "{text}"
    );
    drop(w);
}

/// An `accrue local` run (killed on drop, its workers with it) and the
/// lines of its stdout.
struct LocalRun {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Drop for LocalRun {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl LocalRun {
    /// `accrue local` on a long synthetic job (one worker) in `dir`.
    fn start(dir: &Path) -> LocalRun {
        common::worker_bin();
        let job = write(dir, "local.toml", &job_toml("local", 1, 1_000_000, ""));
        let mut child = Command::new(env!("CARGO_BIN_EXE_accrue"))
            .args([
                "local",
                job.to_str().unwrap(),
                "--workers",
                "1",
                "--state-dir",
            ])
            .arg(dir.join("local"))
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("local.log")).unwrap())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        LocalRun { child, lines }
    }

    /// The one-use sign-in link its banner prints.
    fn sign_in_link(&self) -> String {
        let mut seen = Vec::new();
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| {
                    panic!("no sign-in link from accrue local; it printed {seen:?}")
                });
            if let Some(link) = line.split_whitespace().find(|w| w.contains("#signin=")) {
                return link.to_string();
            }
            seen.push(line);
        }
    }

    /// Stops it as Ctrl-C would (SIGTERM: the job is cancelled, the
    /// workers asked to stop), within 30 s.
    fn stop(&mut self) {
        // SAFETY: kill(2) on our own child, not yet waited for.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        for _ in 0..300 {
            if self.child.try_wait().unwrap().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("accrue local did not stop within 30 s of SIGTERM");
    }
}

/// The status page compares runs: two finished jobs (with evaluations,
/// different learning rates) ticked in the jobs list and drawn on one
/// chart; the first one's spec as TOML and its hyperparameters, its loss
/// on a log scale, smoothed, with its evaluations as points, and its
/// curve exported as CSV and JSON (read back from the downloads against
/// the series API). First, an `accrue local` run's printed one-use link
/// opens the page signed in, and the same link is refused the second
/// time. One browser session; screenshots in `runs/tests/dashboard/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_compares_runs_and_signs_in_with_a_one_use_link() {
    let _one = ONE_BROWSER.lock().await;
    let d = TempDir::new().unwrap();
    let (h, _w, mut alice) = alice_and_two_workers(d.path(), "c").await;
    // 512 samples, b = 8, k = 2, one rank: 32 steps an epoch, evaluated
    // after each of the two.
    let extra = "[eval]\nevery_epochs = 1\n";
    let mut ids = Vec::new();
    for (name, lr) in [("cmp-a", "0.1"), ("cmp-b", "0.03")] {
        let text = job_toml(name, 1, 64, extra).replace("lr = 0.1", &format!("lr = {lr}"));
        ids.push(submit_text(&mut alice, &text).await.id);
    }
    for id in &ids {
        let j = wait_state(
            &mut alice,
            id,
            &[v1::JobState::Succeeded],
            Duration::from_secs(120),
        )
        .await;
        assert_eq!(j.state(), v1::JobState::Succeeded, "{j:?}");
    }
    // The sign-in link comes from a real `accrue local` run (its own
    // coordinator, CA and tokens), stopped once the link is checked.
    let mut local = LocalRun::start(d.path());
    let link = local.sign_in_link();
    let code = link.rsplit_once("#signin=").unwrap().1;
    assert!(
        link.starts_with("https://127.0.0.1:")
            && code.len() == 64
            && code.bytes().all(|b| b.is_ascii_hexdigit()),
        "{link}"
    );
    let submit_token = std::fs::read_to_string(d.path().join("local/tls/submit.token")).unwrap();

    let out = shots();
    let args = serde_json::json!({
        "base": format!("https://{}", h.http_addr),
        "token": ALICE,
        "jobs": ids,
        "signin_link": link,
        "signin_principal": "submit",
        "signin_token": submit_token.trim(),
        "out": out,
        "bound": 1000,
    });
    let log = out.join("driver-compare.log");
    let started = std::time::Instant::now();
    let mut drv = run_driver("compare", &args, d.path(), &log);
    let rx = lines(&mut drv);
    let next = |what: &str| next_line(&rx, 120, &log, what);
    let signed = next("opening the sign-in link");
    assert_eq!(
        signed["phase"],
        "signed_in",
        "{signed}; see {}",
        log.display()
    );
    tokio::task::block_in_place(|| local.stop());
    let done = next("comparing, exporting and the job's page");
    driver_succeeded(&mut drv, &done, &log, &out);
    eprintln!(
        "browser ({:.1} s): {done}; screenshots in {}",
        started.elapsed().as_secs_f64(),
        out.display()
    );
    assert_eq!(done["ok"], true, "{done}");
    assert_eq!(
        done["signin_reuse"]["stored"],
        serde_json::Value::Null,
        "{done}"
    );
    assert!(done["eval_points"].as_u64().unwrap() >= 2, "{done}");
    assert_eq!(done["export_rows"]["csv"], 64, "{done}");
    assert_eq!(done["export_rows"]["json"], 64, "{done}");

    // The sign-in POST over HTTP: open without a token, a code works once,
    // and a cross-site POST is refused before any code is looked at.
    let http = https_client(&creds().ca());
    let url = format!("https://{}/v1/signin", h.http_addr);
    let code = |link: String| link.rsplit_once("#signin=").unwrap().1.to_string();
    let alice_code = code(h.sign_in_link(ALICE).unwrap());
    let post = |code: &str, origin: Option<&str>| {
        let mut r = http.post(&url).json(&serde_json::json!({ "code": code }));
        if let Some(o) = origin {
            r = r.header("origin", o);
        }
        r.send()
    };
    let cross = post(&alice_code, Some("https://evil.example"))
        .await
        .unwrap();
    assert_eq!(cross.status(), 403);
    let ok = post(&alice_code, None).await.unwrap();
    assert_eq!(ok.status(), 200);
    let ok: serde_json::Value = ok.json().await.unwrap();
    assert_eq!(
        (ok["token"].as_str(), ok["principal"].as_str()),
        (Some(ALICE), Some("alice")),
        "{ok}"
    );
    assert_eq!(post(&alice_code, None).await.unwrap().status(), 401);
    assert_eq!(post(&"0".repeat(64), None).await.unwrap().status(), 401);
    assert_eq!(h.sign_in_link("not-a-token"), None);
}

/// docs/BENCHMARKS.md section 6 (run by hand: `cargo test --release --test
/// dashboard -- --ignored`): the page's load time and bytes at 100 jobs
/// and with a 100,000-step job, measured in Chromium against a real
/// coordinator and a real (tiny, one-rank) job of that length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: about two minutes"]
async fn status_page_load_at_100_jobs_and_a_100k_step_job() {
    const LONG: u64 = 100_000;
    let d = TempDir::new().unwrap();
    let (h, _w, mut alice) = alice_and_two_workers(d.path(), "b").await;
    let submit = |name: &str, steps: u64| spec(&job_toml(name, 1, steps, ""));
    let long = alice
        .submit_job(v1::SubmitJobRequest {
            spec: Some(submit("long", LONG)),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    for i in 0..99 {
        alice
            .submit_job(v1::SubmitJobRequest {
                spec: Some(submit(&format!("short-{i}"), 20)),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let started = std::time::Instant::now();
    let coord = h.coordinator().unwrap();
    while coord.job(&long.id).unwrap().state() != v1::JobState::Succeeded {
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "the long job is too slow"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("{LONG} steps in {:.1} s", started.elapsed().as_secs_f64());
    let out = shots();
    let args = serde_json::json!({
        "base": format!("https://{}", h.http_addr),
        "token": ALICE,
        "job": long.id,
        "jobs_expected": 100,
        "out": out,
        "expect_steps": LONG,
        "bound": 1000,
    });
    let log = out.join("driver-load.log");
    let mut drv = run_driver("load", &args, d.path(), &log);
    let rx = lines(&mut drv);
    let m = rx
        .recv_timeout(Duration::from_secs(180))
        .unwrap_or_else(|_| panic!("no measurement; see {}", log.display()));
    assert!(
        drv.0.wait().unwrap().success(),
        "{m}; see {}",
        log.display()
    );
    println!("status page load: {m}");
}
