//! Issue 27 end to end, as processes: one owner per checkpoint folder at
//! submit (a real `accrue-coordinator`, the `accrue` CLI), and the resume
//! of a cancelled job through `accrue resume --wait` with real worker
//! daemons: same id, history showing the resume, counters and weights from
//! the checkpoint it loaded. In etcd mode the resume is recorded in etcd
//! before it is answered.

mod common;

use accrue_proto::v1::{self, JobState};
use common::etcd::{etcd_coordinator_args, job_in_etcd, Etcd};
use common::*;
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};
use tempfile::TempDir;

const LIMIT: Duration = Duration::from_secs(120);

/// `accrue --coordinator <grpc> <args>` with the token of `scope`.
fn accrue(grpc: &str, scope: &str, args: &[&str]) -> Output {
    cli(scope)
        .args(["--coordinator", grpc])
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn with_dir(name: &str, dir: &Path) -> String {
    job_toml(name, 1, 4, &format!("[checkpoint]\ndir = {dir:?}\n"))
}

async fn submit(c: &mut accrue::Client, toml: &str) -> Result<v1::Job, tonic::Status> {
    c.submit_job(v1::SubmitJobRequest {
        spec: Some(spec(toml)),
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner())
}

/// Two jobs naming one folder: the second is refused (FAILED_PRECONDITION
/// naming checkpoint.dir, the folder and the owner), whatever the first
/// job's state; so is a folder inside it, a folder under the default-folder
/// root (a future job's default folder) and a folder whose OWNER.json
/// names another job. Nothing is recorded for a refusal. No worker is
/// needed: the coordinator decides at submit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_folder_has_one_owner_from_submit_on() {
    let d = TempDir::new().unwrap();
    let state = d.path().join("state");
    let co = spawn_coordinator(
        &coordinator_args(&state, &[]),
        &d.path().join("coordinator.log"),
    );
    let mut c = client(&co.grpc).await;
    let shared = d.path().join("ck/shared");
    let a = submit(&mut c, &with_dir("a", &shared)).await.unwrap();
    // Pending (no workers), then cancelled: the folder is still a's.
    c.cancel_job(v1::CancelJobRequest { id: a.id.clone() })
        .await
        .unwrap();

    // Through the CLI, as a user meets it.
    let b = write(d.path(), "b.toml", &with_dir("b", &shared));
    let o = accrue(&co.grpc, "submit", &["submit", b.to_str().unwrap()]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    for part in [
        "FailedPrecondition",
        "checkpoint.dir",
        shared.to_str().unwrap(),
        &format!("job {} (cancelled)", a.id),
        &format!("accrue resume {}", a.id),
    ] {
        assert!(out.contains(part), "{part:?} missing: {out}");
    }

    let inside = shared.join("sub");
    let e = submit(&mut c, &with_dir("b", &inside)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("lies inside") && e.message().contains(&a.id),
        "{}",
        e.message()
    );

    // The default folder of a future job id (the next is c-2 or so).
    let squat = state.join("checkpoints").join("victim-9");
    let e = submit(&mut c, &with_dir("b", &squat)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains(&format!(
            "lies under {}, reserved for the default checkpoint folders",
            state.join("checkpoints").display()
        )),
        "{}",
        e.message()
    );

    // A folder a job of another coordinator owns (its record).
    let owned = d.path().join("ck/owned");
    std::fs::create_dir_all(&owned).unwrap();
    std::fs::write(
        owned.join("OWNER.json"),
        r#"{"job_id": "ghost-4", "cluster": "", "spec_hash": "00", "created_unix_ms": 1}"#,
    )
    .unwrap();
    let e = submit(&mut c, &with_dir("b", &owned)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("OWNER.json of job ghost-4"),
        "{}",
        e.message()
    );

    // A folder of its own: taken.
    let ok = submit(&mut c, &with_dir("b", &d.path().join("ck/b")))
        .await
        .unwrap();
    let ids: Vec<String> = c
        .list_jobs(v1::ListJobsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .jobs
        .into_iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(ids, [a.id.clone(), ok.id], "nothing recorded for a refusal");

    // The status page's POST /v1/jobs/{id}/resume: the cancel POST's rules
    // (the submit scope, then the owner or admin; never cross-site).
    let post = |scope: &str, origin: Option<&str>| {
        let mut r = creds()
            .http()
            .post(format!("https://{}/v1/jobs/{}/resume", co.http, a.id))
            .bearer_auth(creds().token(scope));
        if let Some(o) = origin {
            r = r.header("origin", o);
        }
        r.send()
    };
    assert_eq!(post("read", None).await.unwrap().status(), 403);
    let r = post("submit", None).await.unwrap();
    assert_eq!(r.status(), 403);
    let why = r.text().await.unwrap();
    assert!(why.contains("submit may not resume job"), "{why}");
    let r = post("admin", Some("https://evil.example")).await.unwrap();
    assert_eq!(r.status(), 403);
    let r = post("admin", None).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["state"], "pending", "{v}");
    let r = post("admin", None).await.unwrap();
    assert_eq!(r.status(), 409, "pending: nothing to resume");
    assert!(r.text().await.unwrap().contains("is pending"));
}

/// A job cancelled after a checkpoint is resumed with `accrue resume
/// --wait` by its owner: it keeps its id and history (which shows the
/// resume), goes on from the checkpoint it loaded (the recovery record
/// says which), and ends at its last step with exact counters. A
/// succeeded job cannot be resumed; a token without `submit` may not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_is_resumed_and_finishes_under_its_id() {
    let d = TempDir::new().unwrap();
    let co = spawn_coordinator(
        &coordinator_args(&d.path().join("state"), &[]),
        &d.path().join("coordinator.log"),
    );
    let _w = Workers(
        ["r0", "r1"]
            .iter()
            .map(|id| spawn_worker(&co.grpc, id, d.path(), &["--micro-step-delay-ms", "40"]))
            .collect(),
    );
    // W = 2, k = 2, b = 8: 32 samples a step; a checkpoint every 4 steps.
    let toml = job_toml("res", 2, 24, "[checkpoint]\nevery_steps = 4\n");
    let file = write(d.path(), "res.toml", &toml);
    let o = accrue(&co.grpc, "submit", &["submit", file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let id = String::from_utf8_lossy(&o.stdout).trim().to_string();
    let mut c = client_as(&co.grpc, "submit").await;
    let deadline = Instant::now() + LIMIT;
    loop {
        let j = c
            .get_job(v1::GetJobRequest { id: id.clone() })
            .await
            .unwrap()
            .into_inner();
        let step = j.counters.map_or(0, |c| c.step);
        if step >= 9 {
            break;
        }
        assert!(
            !accrue_coordinator::state::is_final(j.state()) && Instant::now() < deadline,
            "{j:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let o = accrue(&co.grpc, "submit", &["cancel", &id]);
    assert!(o.status.success(), "{}", text(&o));
    let cancelled = wait_state(&mut c, &id, &[JobState::Cancelled], LIMIT).await;
    assert_eq!(cancelled.state(), JobState::Cancelled);
    let at_cancel = cancelled.counters.unwrap().step;
    assert!(at_cancel < 24, "cancelled before the end: {at_cancel}");

    // Only a token with `submit` (the owner's, or admin) resumes it.
    let e = client_as(&co.grpc, "read")
        .await
        .resume_job(v1::ResumeJobRequest { id: id.clone() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");

    let started = Instant::now();
    let o = accrue(&co.grpc, "submit", &["resume", &id, "--wait"]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(
        out.contains(&format!(
            "{id}: resumed by submit at step {at_cancel} after it was cancelled"
        )),
        "{out}"
    );
    eprintln!("resumed and finished in {:?}", started.elapsed());

    let j = c
        .get_job(v1::GetJobRequest { id: id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(j.state(), JobState::Succeeded, "{j:?}");
    let cnt = j.counters.unwrap();
    assert_eq!((cnt.step, cnt.total_steps), (24, 24));
    assert_eq!(
        cnt.samples_seen,
        24 * 32,
        "the data cursor came back with the weights"
    );
    let states: Vec<(JobState, JobState)> = j.history.iter().map(|t| (t.from(), t.to())).collect();
    use JobState::*;
    assert_eq!(
        states,
        [
            (Unspecified, Pending),
            (Pending, Rendezvous),
            (Rendezvous, Running),
            (Running, Cancelled),
            (Cancelled, Pending),
            (Pending, Rendezvous),
            (Rendezvous, Running),
            (Running, Succeeded),
        ],
        "{:?}",
        j.history
    );
    let r = j.recoveries.last().unwrap();
    assert!(r.reason.starts_with("resumed by submit"), "{r:?}");
    assert_eq!(r.generation, j.generation);
    assert!(j.generation >= 2, "a new generation: {}", j.generation);
    // It went on from a checkpoint (every 4 steps, or the one written
    // when it stopped), not from step 0, and its counters came from the
    // checkpoint its weights came from.
    assert!(
        r.resumed_step >= at_cancel / 4 * 4 && r.resumed_step >= 4,
        "{r:?}"
    );
    assert!(
        r.loaded.starts_with("checkpoint")
            && r.loaded.contains(&format!("step-{}", r.resumed_step)),
        "{r:?}"
    );
    // `accrue status` shows what was loaded.
    let o = accrue(&co.grpc, "read", &["status", &id]);
    let out = text(&o);
    assert!(out.contains(&format!("loaded {}", r.loaded)), "{out}");

    // Succeeded: nothing to resume.
    let o = accrue(&co.grpc, "submit", &["resume", &id]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(
        out.contains(&format!(
            "FailedPrecondition: job {id} succeeded; nothing to resume"
        )),
        "{out}"
    );
    let e = c
        .resume_job(v1::ResumeJobRequest {
            id: "nope-1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
}

/// etcd mode: the resume is in etcd (pending, its history extended) when
/// the answer comes, and the resumed job still owns its folder there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_etcd_mode_a_resume_is_durable_before_it_is_answered() {
    let d = TempDir::new().unwrap();
    let etcd = Etcd::start(d.path()).await;
    let co = spawn_coordinator(
        &etcd_coordinator_args(&etcd, "rz", d.path(), 2),
        &d.path().join("coordinator.log"),
    );
    let mut c = client(&co.grpc).await;
    let dir = d.path().join("ck/e");
    // The replica serves at once and leads soon: retry until it does.
    let deadline = Instant::now() + Duration::from_secs(30);
    let job = loop {
        match submit(&mut c, &with_dir("e", &dir)).await {
            Ok(j) => break j,
            Err(e) if e.code() == tonic::Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    c.cancel_job(v1::CancelJobRequest { id: job.id.clone() })
        .await
        .unwrap();
    let resumed = c
        .resume_job(v1::ResumeJobRequest { id: job.id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resumed.state(), JobState::Pending);
    let stored = job_in_etcd(&etcd, "rz", &job.id).await;
    assert_eq!(stored.state(), JobState::Pending, "{stored:?}");
    let last = stored.history.last().unwrap();
    assert_eq!(last.from(), JobState::Cancelled);
    assert!(last.reason.starts_with("resumed by admin"), "{last:?}");
    let e = submit(&mut c, &with_dir("f", &dir)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains(&format!("job {} (pending)", job.id)),
        "{}",
        e.message()
    );
}
