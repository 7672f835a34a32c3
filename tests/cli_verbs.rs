//! The CLI's verbs as processes: `accrue submit`, `status`, `list`,
//! `cancel` and `watch` (the `accrue` binary) against a coordinator process
//! and a worker daemon process started here, asserting exit codes and
//! output.

mod common;

use common::*;
use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// `accrue --coordinator <grpc> <args>` over TLS with the submit token,
/// run to its end.
fn accrue(grpc: &str, args: &[&str]) -> Output {
    cli("submit")
        .args(["--coordinator", grpc])
        .args(args)
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs `args`, asserts exit code `code`, returns stdout.
fn expect(grpc: &str, args: &[&str], code: i32) -> String {
    let o = accrue(grpc, args);
    assert_eq!(
        o.status.code(),
        Some(code),
        "accrue {args:?}:\nstdout: {}\nstderr: {}",
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

/// `accrue watch` as a child whose stdout goes to `out` (killed on drop).
struct Watch {
    child: Child,
    out: std::path::PathBuf,
}

impl Watch {
    fn start(grpc: &str, id: &str, dir: &Path, name: &str) -> Watch {
        let out = dir.join(format!("{name}.out"));
        let child = cli("read")
            .args(["--coordinator", grpc, "watch", id])
            .stdout(Stdio::from(std::fs::File::create(&out).unwrap()))
            .stderr(Stdio::from(
                std::fs::File::create(dir.join(format!("{name}.err"))).unwrap(),
            ))
            .spawn()
            .unwrap();
        Watch { child, out }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Polls until the output holds `text`.
    fn wait_for(&self, text: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        while !self.output().contains(text) {
            assert!(
                Instant::now() < deadline,
                "watch printed no {text:?}:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the exit (at most `limit`) and returns its code.
    fn exit_code(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(
                Instant::now() < deadline,
                "watch did not exit:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The line of `accrue list` for `id`.
fn list_line(grpc: &str, id: &str) -> String {
    let out = expect(grpc, &["list"], 0);
    assert!(out.starts_with("JOB"), "{out}");
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(id))
        .unwrap_or_else(|| panic!("{id} is not listed:\n{out}"))
        .to_string()
}

#[test]
fn submit_list_status_cancel_and_watch_as_processes() {
    let d = TempDir::new().unwrap();
    let args = coordinator_args(&d.path().join("state"), &[]);
    let co = spawn_coordinator(&args, &d.path().join("coordinator.log"));
    let g = co.grpc.as_str();

    // Bad input: a clear error naming the field or file, exit code 2,
    // nothing created.
    let bad = write(
        d.path(),
        "bad.toml",
        &job_toml("bad", 1, 5, "").replace("lr = 0.1", "lr = -1"),
    );
    let o = accrue(g, &["submit", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("optimizer.lr = -1.0: must be a finite number > 0"),
        "{}",
        stderr(&o)
    );
    let missing = d.path().join("missing.toml");
    let o = accrue(g, &["submit", missing.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(missing.to_str().unwrap()),
        "{}",
        stderr(&o)
    );
    let listed = expect(g, &["list"], 0);
    assert_eq!(listed.lines().count(), 1, "only the header:\n{listed}");

    // A job that needs two workers stays pending (none is attached).
    let pending = write(d.path(), "pending.toml", &job_toml("wait", 2, 5, ""));
    let id = expect(g, &["submit", pending.to_str().unwrap()], 0);
    let id = id.trim().to_string();
    assert!(id.starts_with("wait-"), "{id}");
    let line = list_line(g, &id);
    assert!(line.contains("pending"), "{line}");
    // The submit token's name is the job's owner.
    assert_eq!(line.split_whitespace().nth(1), Some("submit"), "{line}");
    let status = expect(g, &["status", &id], 0);
    assert!(status.contains(&format!("job        {id}")), "{status}");
    assert!(status.contains("state      pending"), "{status}");
    // `status` without a job is the list.
    assert!(expect(g, &["status"], 0).contains(&id));

    // watch follows it until it is cancelled, then exits 1 (not succeeded).
    let mut w = Watch::start(g, &id, d.path(), "watch-cancel");
    w.wait_for(&format!("{id} pending: submitted"), Duration::from_secs(20));
    let cancelled = expect(g, &["cancel", &id], 0);
    assert_eq!(cancelled.trim(), format!("{id} cancelled"));
    assert_eq!(w.exit_code(Duration::from_secs(20)), Some(1));
    assert!(
        w.output().contains("cancelled: cancelled by a client"),
        "{}",
        w.output()
    );
    assert!(list_line(g, &id).contains("cancelled"));
    let o = accrue(g, &["cancel", &id]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("FailedPrecondition"), "{}", stderr(&o));
    let o = accrue(g, &["status", "nope-9"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("NotFound"), "{}", stderr(&o));

    // With a worker: watch follows a job from pending to succeeded and
    // exits 0; submit --wait does the same in one command.
    let ok = write(d.path(), "ok.toml", &job_toml("ok", 1, 6, ""));
    let id = expect(g, &["submit", ok.to_str().unwrap()], 0);
    let id = id.trim().to_string();
    let mut w = Watch::start(g, &id, d.path(), "watch-ok");
    w.wait_for(&format!("{id} pending: submitted"), Duration::from_secs(20));
    let _worker = Workers(vec![spawn_worker(g, "cli0", d.path(), &[])]);
    assert_eq!(w.exit_code(Duration::from_secs(120)), Some(0));
    let out = w.output();
    eprintln!("accrue watch {id}:\n{out}");
    for want in [
        "rendezvous: assigned to cli0",
        "step 1/6 epoch",
        "step 6/6 epoch",
        "succeeded: finished 6 optimizer steps",
    ] {
        assert!(out.contains(want), "watch printed no {want:?}:\n{out}");
    }
    let status = expect(g, &["status", &id], 0);
    assert!(status.contains("state      succeeded"), "{status}");
    assert!(status.contains("progress   step 6/6"), "{status}");
    assert!(list_line(g, &id).contains("succeeded"));
    // Watching a job that has ended prints where it stands and exits at once.
    let again = expect(g, &["watch", &id], 0);
    assert_eq!(
        again.trim(),
        format!("{id} succeeded: finished 6 optimizer steps")
    );
    let waited = expect(g, &["submit", "--wait", ok.to_str().unwrap()], 0);
    let first = waited.lines().next().unwrap_or_default().to_string();
    assert!(first.starts_with("ok-"), "{waited}");
    assert!(
        waited.contains("succeeded: finished 6 optimizer steps"),
        "{waited}"
    );
    assert!(list_line(g, &first).contains("succeeded"));

    // No coordinator there: a clear error and exit code 2.
    let o = accrue("127.0.0.1:1", &["list"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("cannot reach the coordinator at 127.0.0.1:1"),
        "{}",
        stderr(&o)
    );
}

/// A job in pipeline stages (issue 40): `/v1/workers` (the status page's
/// workers table) gives each worker's (data, pipeline, tensor) place and
/// its last step's bubble while it runs, and `accrue status` names each
/// rank's place and the last stage's split of its step (compute, bubble,
/// transfer).
#[test]
fn a_pipeline_job_shows_each_workers_place_and_bubble() {
    let d = TempDir::new().unwrap();
    let args = coordinator_args(&d.path().join("state"), &[]);
    let co = spawn_coordinator(&args, &d.path().join("coordinator.log"));
    let g = co.grpc.as_str();
    // 50 ms a micro-step: the job runs for a few seconds.
    let slow = ["--micro-step-delay-ms", "50"];
    let _w = Workers(vec![
        spawn_worker(g, "pp0", d.path(), &slow),
        spawn_worker(g, "pp1", d.path(), &slow),
    ]);
    let job = write(
        d.path(),
        "pp.toml",
        &job_toml("pp", 2, 40, "[parallel]\npipeline = 2\n"),
    );
    let id = expect(g, &["submit", job.to_str().unwrap()], 0)
        .trim()
        .to_string();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let token = creds().token("read");
    let url = format!("https://{}/v1/workers", co.http);
    let mut seen = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.is_none() && Instant::now() < deadline {
        let body: serde_json::Value = rt.block_on(async {
            let r = creds().http().get(&url).bearer_auth(&token).send().await;
            match r {
                Ok(r) => r.json().await.unwrap_or_default(),
                Err(_) => serde_json::Value::Null,
            }
        });
        let mine: Vec<serde_json::Value> = body["workers"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|w| w["job"] == id.as_str())
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if mine.len() == 2 && mine.iter().all(|w| w["bubble_s"].is_number()) {
            seen = Some(mine);
        } else {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let seen = seen.expect("both workers of the pipeline job with a step's bubble");
    for w in &seen {
        let rank = w["rank"].as_u64().unwrap();
        assert_eq!(
            w["coords"],
            serde_json::json!({"data": 0, "pipeline": rank, "tensor": 0}),
            "{w}"
        );
        assert!(w["bubble_s"].as_f64().unwrap() >= 0.0, "{w}");
        // Issue 41: each worker's peak resident memory (a worker process
        // holds libtorch: above 20 MiB).
        assert!(w["peak_rss_bytes"].as_u64().unwrap() > 20 << 20, "{w}");
    }
    // The first stage waits for the last stage's gradients: a bubble.
    let first = seen.iter().find(|w| w["rank"] == 0).unwrap();
    assert!(first["bubble_s"].as_f64().unwrap() > 0.0, "{first}");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut status = String::new();
    while Instant::now() < deadline {
        status = expect(g, &["status", &id], 0);
        if status.contains("state      succeeded") {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(status.contains("state      succeeded"), "{status}");
    for rank in 0..2 {
        assert!(
            status
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("rank {rank} "))
                    && l.ends_with(&format!("data 0 pipeline stage {rank} tensor 0"))),
            "rank {rank}'s place:\n{status}"
        );
    }
    assert!(
        status.contains("pipeline   last stage: compute "),
        "{status}"
    );
    // The spec's estimate and each rank's measured peak (issue 41).
    let memory = status
        .lines()
        .find(|l| l.starts_with("memory     estimate "))
        .unwrap_or_else(|| panic!("no memory line:\n{status}"));
    let peaks: Vec<f64> = memory
        .split("peak by rank ")
        .nth(1)
        .and_then(|p| p.strip_suffix(" MiB"))
        .map(|p| p.split(", ").filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_default();
    assert_eq!(peaks.len(), 2, "{memory}");
    assert!(peaks.iter().all(|&p| p > 20.0), "{memory}");
}
