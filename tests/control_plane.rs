//! The control plane end to end: an in-process coordinator on port 0, real
//! worker daemon processes, real gRPC and HTTP over sockets.

mod common;

use accrue_proto::v1::{self, job_event, JobState};
use common::*;
use std::time::Duration;
use tempfile::TempDir;

/// Submit, watch every step in order to Succeeded, final checkpoint present,
/// counters consistent; /v1/jobs JSON and /metrics show it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_watch_succeed_and_status_endpoint() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let _w = start_workers(&grpc, 2, d.path(), "w");
    let mut c = client(&grpc).await;
    let job = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("wj", 2, 12, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    let mut stream = c
        .watch_job(v1::WatchJobRequest { id: job.id.clone() })
        .await
        .unwrap()
        .into_inner();
    let mut steps = Vec::new();
    let mut states = Vec::new();
    let mut last = None;
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(120), stream.message())
        .await
        .unwrap()
        .unwrap()
    {
        match ev.event {
            Some(job_event::Event::Step(r)) => steps.push(r.step),
            Some(job_event::Event::Transition(t)) => states.push(JobState::try_from(t.to).unwrap()),
            _ => {}
        }
        last = ev.job;
    }
    eprintln!("watch ended");
    let end = last.unwrap();
    assert_eq!(end.state(), JobState::Succeeded, "{end:?}");
    assert_eq!(
        steps,
        (1..=12).collect::<Vec<u64>>(),
        "every optimizer step, in order"
    );
    assert_eq!(
        states,
        [JobState::Rendezvous, JobState::Running, JobState::Succeeded]
    );
    let cnt = end.counters.unwrap();
    // W = 2, k = 2, b = 8: 32 samples per step.
    assert_eq!(cnt.samples_seen, cnt.step * 32);
    assert_eq!((cnt.step, cnt.total_steps), (12, 12));
    assert!(
        std::path::Path::new(&end.checkpoint)
            .join("model.safetensors")
            .exists(),
        "{}",
        end.checkpoint
    );
    assert!(end.eval.is_some());

    let http = h.http_addr.to_string();
    let get = |path: String, scope: &'static str| {
        let http = http.clone();
        async move { creds().get(&http, &path, scope).await.unwrap() }
    };
    let jobs: serde_json::Value = get("/v1/jobs".into(), "read").await.json().await.unwrap();
    assert_eq!(jobs["jobs"][0]["id"], job.id);
    assert_eq!(jobs["jobs"][0]["state"], "succeeded");
    assert_eq!(jobs["jobs"][0]["counters"]["step"], 12);
    assert_eq!(jobs["jobs"][0]["counters"]["samples_seen"], 384);
    let one: serde_json::Value = get(format!("/v1/jobs/{}", job.id), "read")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(one["history"][1]["to"], "rendezvous");
    let missing = get("/v1/jobs/nope".into(), "read").await;
    assert_eq!(missing.status(), 404);
    let metrics = get("/metrics".into(), "metrics")
        .await
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("accrue_workers_attached 2"), "{metrics}");
    assert!(
        metrics.contains("accrue_jobs{state=\"succeeded\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "accrue_job_step{{job=\"{}\",state=\"succeeded\"}} 12",
            job.id
        )),
        "{metrics}"
    );
    assert!(metrics.contains("accrue_job_samples_seen{"), "{metrics}");
    assert!(
        metrics.contains(&format!(
            "accrue_job_loss_scale{{job=\"{}\",state=\"succeeded\"}} 0",
            job.id
        )),
        "an fp32 job has no loss scale: {metrics}"
    );
    for path in ["/healthz", "/readyz", "/"] {
        assert_eq!(get(path.into(), "read").await.status(), 200, "{path}");
    }
    eprintln!("http checked");
    h.stop().await;
}

/// The first gang's length: long enough (about 1.5 s here) that it still
/// runs while the second submission waits for its record to be durable,
/// even on a loaded CI machine (40 steps finished first there once).
const GA_STEPS: u64 = 400;

/// Three workers, two jobs of two workers each: the second waits (gang),
/// then runs when workers free up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gang_scheduling_waits_for_a_whole_gang() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let _w = start_workers(&grpc, 3, d.path(), "g");
    let coord = h.coordinator().unwrap();
    assert!(wait_until(Duration::from_secs(60), || coord.worker_count() == 3).await);
    let mut c = client(&grpc).await;
    let a = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("ga", 2, GA_STEPS, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    let b = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("gb", 2, 5, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.state(), JobState::Rendezvous);
    assert_eq!(
        b.state(),
        JobState::Pending,
        "one worker is free, the gang needs two"
    );
    let a_end = wait_state(
        &mut c,
        &a.id,
        &[JobState::Succeeded, JobState::Failed],
        Duration::from_secs(120),
    )
    .await;
    let b_end = wait_state(
        &mut c,
        &b.id,
        &[JobState::Succeeded, JobState::Failed],
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(
        (a_end.state(), b_end.state()),
        (JobState::Succeeded, JobState::Succeeded),
        "{a_end:?}\n{b_end:?}"
    );
    // Only three workers: the second gang needed at least one of the first's.
    assert!(
        b_end.workers.iter().any(|w| a_end.workers.contains(w)),
        "{:?} {:?}",
        a_end.workers,
        b_end.workers
    );
    let a_assigned = a_end
        .history
        .iter()
        .find(|t| t.to == JobState::Rendezvous as i32)
        .unwrap()
        .at_unix_ms;
    let b_assigned = b_end
        .history
        .iter()
        .find(|t| t.to == JobState::Rendezvous as i32)
        .unwrap()
        .at_unix_ms;
    let a_steps = a_end.counters.unwrap().step;
    assert_eq!(a_steps, GA_STEPS);
    assert!(b_assigned > a_assigned);
    h.stop().await;
}

/// Cancel during a run: the workers stop within seconds and take the next job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_workers_and_they_take_the_next_job() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let _w = start_workers(&grpc, 2, d.path(), "c");
    let mut c = client(&grpc).await;
    let long = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("long", 2, 1_000_000, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    let running = wait_state(
        &mut c,
        &long.id,
        &[JobState::Running],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(running.state(), JobState::Running);
    let cancelled = c
        .cancel_job(v1::CancelJobRequest {
            id: long.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cancelled.state(), JobState::Cancelled);
    let started = std::time::Instant::now();
    let next = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("next", 2, 4, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    let end = wait_state(
        &mut c,
        &next.id,
        &[JobState::Succeeded, JobState::Failed],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(end.state(), JobState::Succeeded, "{end:?}");
    let assigned = end
        .history
        .iter()
        .find(|t| t.to == JobState::Rendezvous as i32)
        .unwrap()
        .at_unix_ms;
    let cancel_at = cancelled.history.last().unwrap().at_unix_ms;
    assert!(
        assigned - cancel_at < 10_000,
        "workers took {} ms to free up",
        assigned - cancel_at
    );
    eprintln!("next job finished {:?} after the cancel", started.elapsed());
    // Cancelling a finished job is refused.
    let err = c
        .cancel_job(v1::CancelJobRequest {
            id: next.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.message().contains("already ended"), "{}", err.message());
    h.stop().await;
}

/// Bad input: invalid spec (nothing created), unknown id, oversized message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_the_right_codes() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let mut c = client(&grpc).await;
    let mut bad = spec(&job_toml("bad", 2, 5, ""));
    bad.optimizer.as_mut().unwrap().lr = 0.0;
    bad.accumulation.as_mut().unwrap().steps = Some(0);
    bad.model.as_mut().unwrap().kind = 99;
    let err = c
        .submit_job(v1::SubmitJobRequest { spec: Some(bad) })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    for needle in [
        "optimizer.lr = 0.0: must be a finite number > 0",
        "accumulation.steps = 0",
        "model.kind = 99: must be one of",
    ] {
        assert!(
            err.message().contains(needle),
            "{needle} missing in {}",
            err.message()
        );
    }
    // Job names are DNS labels (issue 12, defect 4): markup that broke the
    // dashboard's HTML and names too long for the ring handshake are refused.
    for name in [
        r#"evil"><script>alert(1)</script>"#.to_string(),
        "a".repeat(300),
        "Upper".into(),
    ] {
        let mut s = spec(&job_toml("ok", 1, 5, ""));
        s.name = name.clone();
        let err = c
            .submit_job(v1::SubmitJobRequest { spec: Some(s) })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{name}");
        assert!(err.message().contains("name = "), "{}", err.message());
    }
    let none = c
        .submit_job(v1::SubmitJobRequest { spec: None })
        .await
        .unwrap_err();
    assert_eq!(none.code(), tonic::Code::InvalidArgument);
    assert!(
        c.list_jobs(v1::ListJobsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .jobs
            .is_empty(),
        "nothing half-created"
    );
    let nf = c
        .get_job(v1::GetJobRequest {
            id: "nope-1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(nf.code(), tonic::Code::NotFound);
    assert_eq!(
        c.cancel_job(v1::CancelJobRequest {
            id: "nope-1".into()
        })
        .await
        .unwrap_err()
        .code(),
        tonic::Code::NotFound
    );
    assert_eq!(
        c.watch_job(v1::WatchJobRequest {
            id: "nope-1".into()
        })
        .await
        .unwrap_err()
        .code(),
        tonic::Code::NotFound
    );
    let mut huge = spec(&job_toml("huge", 1, 5, ""));
    huge.model.as_mut().unwrap().hidden = vec![1; 2_000_000];
    let err = c
        .submit_job(v1::SubmitJobRequest { spec: Some(huge) })
        .await
        .map(|r| r.into_inner().id)
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::OutOfRange, "{}", err.message());
    assert!(c
        .list_jobs(v1::ListJobsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .jobs
        .is_empty());
    h.stop().await;
}

/// A worker whose report names a stale generation is ignored and told so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_generation_reports_are_refused() {
    use tokio_stream::StreamExt;
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let mut c = client(&grpc).await;
    let job = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml(
                "stale",
                1,
                5,
                "[comm]\nrendezvous_timeout_s = 0.5",
            ))),
        })
        .await
        .unwrap()
        .into_inner();
    let hello = v1::WorkerHello {
        worker_id: "fake".into(),
        data_addr: "127.0.0.1:9".into(),
        ..Default::default()
    };
    let (tx, mut inbound) = fake_worker(&grpc, hello).await;
    let first = inbound.next().await.unwrap().unwrap();
    let Some(v1::coordinator_message::Msg::Assign(a)) = first.msg else {
        panic!("expected an assignment: {first:?}")
    };
    assert_eq!(
        (a.job_id.as_str(), a.generation, a.world_size),
        (job.id.as_str(), 1, 1)
    );
    assert_eq!(a.secret.len(), 32);
    let stale = v1::StepReport {
        job_id: job.id.clone(),
        generation: 0,
        rank: 0,
        step: 1,
        ..Default::default()
    };
    tx.send(v1::WorkerMessage {
        msg: Some(v1::worker_message::Msg::Step(stale)),
        ..Default::default()
    })
    .unwrap();
    let reply = inbound.next().await.unwrap().unwrap();
    let Some(v1::coordinator_message::Msg::Refused(r)) = reply.msg else {
        panic!("expected a refusal: {reply:?}")
    };
    assert!(
        r.reason.contains("generation 0 ignored") && r.reason.contains("generation 1"),
        "{}",
        r.reason
    );
    let j = c
        .get_job(v1::GetJobRequest { id: job.id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        j.counters.unwrap().step,
        0,
        "a stale report must not move the counters"
    );
    // The fake worker disappears and no replacement comes within the
    // rendezvous timeout: the job fails naming it.
    drop(tx);
    drop(inbound);
    let end = wait_state(
        &mut c,
        &job.id,
        &[JobState::Failed],
        Duration::from_secs(10),
    )
    .await;
    assert!(
        end.error.contains("lost worker fake") && end.error.contains("min_workers = 1"),
        "{}",
        end.error
    );
    // It never re-formed: no recovery record (issue 28); the history
    // keeps what it was recovering from.
    assert!(end.recoveries.is_empty(), "{:?}", end.recoveries);
    assert!(
        end.history
            .iter()
            .any(|t| t.to() == JobState::Recovering && t.reason.contains("lost worker fake")),
        "{:?}",
        end.history
    );
    h.stop().await;
}

/// Stop the coordinator, start it on the same state dir: every job and its
/// final state is listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_on_the_same_state_dir_lists_every_job() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let workers = start_workers(&grpc, 1, d.path(), "r");
    let mut c = client(&grpc).await;
    let done = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("done", 1, 3, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    wait_state(
        &mut c,
        &done.id,
        &[JobState::Succeeded],
        Duration::from_secs(60),
    )
    .await;
    let cancelled = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("gone", 2, 3, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    c.cancel_job(v1::CancelJobRequest {
        id: cancelled.id.clone(),
    })
    .await
    .unwrap();
    let waiting = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("later", 2, 3, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    drop(workers);
    h.stop().await;
    let h2 = coordinator(d.path()).await;
    let mut c2 = client(&h2.grpc_addr.to_string()).await;
    let jobs = c2
        .list_jobs(v1::ListJobsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .jobs;
    let got: Vec<(String, JobState)> = jobs.iter().map(|j| (j.id.clone(), j.state())).collect();
    assert_eq!(
        got,
        [
            (done.id, JobState::Succeeded),
            (cancelled.id, JobState::Cancelled),
            (waiting.id.clone(), JobState::Pending)
        ]
    );
    assert_eq!(jobs[0].counters.unwrap().step, 3);
    assert!(jobs[0].history.len() >= 4);
    // New ids continue after the old ones.
    let next = c2
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("later", 1, 3, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(next.id, waiting.id);
    h2.stop().await;
}

/// Bad input never takes a worker out of service (issue 13): specs that
/// once panicked a worker, blocked the queue or exhausted memory are
/// refused by field at submit; a job wider than the cluster waits aside
/// while a small one runs; a job that fails on the worker frees it; and
/// after all of it the one worker still runs a next job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_specs_never_take_a_worker_out_of_service() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let _w = start_workers(&grpc, 1, d.path(), "bad");
    let mut c = client(&grpc).await;
    let base = || spec(&job_toml("b", 1, 4, ""));
    let mut refused = Vec::new();
    let mut timeout = base();
    timeout.comm.get_or_insert_with(Default::default).timeout_s = Some(1e300);
    refused.push((timeout, "comm.timeout_s = 1e300"));
    let mut wide = base();
    wide.workers = Some(1_000_000_000);
    refused.push((wide, "workers = 1000000000: must be an integer in 1..=1024"));
    let mut huge = base();
    let data = huge.data.as_mut().unwrap();
    data.samples = Some(1 << 31);
    data.shape = vec![1024];
    refused.push((huge, "data.samples = an estimated 1641"));
    let mut zero = base();
    zero.workers = Some(0);
    refused.push((zero, "workers = 0"));
    for (s, needle) in refused {
        let err = c
            .submit_job(v1::SubmitJobRequest { spec: Some(s) })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{needle}");
        assert!(
            err.message().contains(needle),
            "{needle}: {}",
            err.message()
        );
    }
    // Two ranks with one worker attached: it waits aside; the small job
    // behind it runs.
    let two = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("two", 2, 4, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    // A job that fails on the worker (its data folder does not exist
    // there): it fails with the reason and frees the worker.
    let mut missing = base();
    missing.name = "missing".into();
    let data = missing.data.as_mut().unwrap();
    data.kind = v1::DataKind::Mnist as i32;
    (data.samples, data.eval_samples, data.classes) = (None, None, None);
    data.shape = Vec::new();
    data.path = Some(d.path().join("no-such-folder").display().to_string());
    let missing = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(missing),
        })
        .await
        .unwrap()
        .into_inner();
    let failed = wait_state(
        &mut c,
        &missing.id,
        &[JobState::Failed, JobState::Succeeded],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(failed.state(), JobState::Failed, "{failed:?}");
    assert!(failed.error.contains("no-such-folder"), "{}", failed.error);
    let small = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("small", 1, 4, ""))),
        })
        .await
        .unwrap()
        .into_inner();
    let end = wait_state(
        &mut c,
        &small.id,
        &[JobState::Succeeded, JobState::Failed],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(end.state(), JobState::Succeeded, "{end:?}");
    let two_now = c
        .get_job(v1::GetJobRequest { id: two.id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(two_now.state(), JobState::Pending);
    c.cancel_job(v1::CancelJobRequest { id: two.id.clone() })
        .await
        .unwrap();
    h.stop().await;
}

/// A rendezvous that cannot complete ends within `comm.connect_timeout_s`
/// on every rank, never hangs: one member advertises a data address that
/// accepts connections and never answers (a hung or misconfigured host),
/// so neither rank can form the ring. Each generation is left within the
/// bound, the job re-forms, fails after MAX_STALLED_REFORMS re-formations
/// without a step, and both workers are free again and run the next jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rendezvous_that_cannot_complete_ends_within_connect_timeout() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hole_addr = hole.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        // Accept and hold every connection, never saying a word.
        let held: Vec<_> = hole.incoming().collect();
        drop(held);
    });
    let _w = Workers(vec![
        spawn_worker(&grpc, "rv0", d.path(), &[]),
        spawn_worker(&grpc, "rv1", d.path(), &["--advertise-data", &hole_addr]),
    ]);
    let mut c = client(&grpc).await;
    let comm = "[comm]\nconnect_timeout_s = 1\nrendezvous_timeout_s = 1";
    let job = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("rv", 2, 5, comm))),
        })
        .await
        .unwrap()
        .into_inner();
    let end = wait_state(
        &mut c,
        &job.id,
        &[JobState::Failed, JobState::Succeeded, JobState::Cancelled],
        Duration::from_secs(90),
    )
    .await;
    assert_eq!(end.state(), JobState::Failed, "{end:?}");
    assert!(
        end.error
            .contains("re-formations in a row without a committed step"),
        "{}",
        end.error
    );
    // Every generation left the rendezvous within the bound: connect_timeout
    // (1 s) plus a margin for a loaded machine (before, the handshake's own
    // 10 s read limit came on top).
    let bound_ms = 4_000;
    let h = &end.history;
    let mut generations = 0;
    for (i, t) in h.iter().enumerate() {
        if t.to() != JobState::Rendezvous {
            continue;
        }
        generations += 1;
        let left = h.get(i + 1).expect("every rendezvous ends");
        let took = left.at_unix_ms - t.at_unix_ms;
        eprintln!(
            "generation {generations}: left the rendezvous after {took} ms ({:?}: {})",
            left.to(),
            left.reason
        );
        assert!(took < bound_ms, "a rendezvous lasted {took} ms: {h:?}");
    }
    let reforms = accrue_coordinator::scheduler::MAX_STALLED_REFORMS as usize;
    assert_eq!(generations, 1 + reforms, "{h:?}");
    let first = h.iter().find(|t| t.to() == JobState::Rendezvous).unwrap();
    let total = h.last().unwrap().at_unix_ms - first.at_unix_ms;
    eprintln!("from the first rendezvous to failed: {total} ms");
    // Nor did any re-formation wait on a rank stuck in the old rendezvous.
    assert!(
        total < generations as i64 * bound_ms,
        "{generations} rendezvous took {total} ms: {h:?}"
    );
    // Both workers are free again (the one still connecting to the black
    // hole when the job failed within connect_timeout of it): a long W = 1
    // job runs on one, and meanwhile a short one on the other.
    let submitter = c.clone();
    let submit = |name: &str, steps: u64| {
        let mut c = submitter.clone();
        let text = job_toml(name, 1, steps, "");
        async move {
            c.submit_job(v1::SubmitJobRequest {
                spec: Some(spec(&text)),
            })
            .await
            .unwrap()
            .into_inner()
            .id
        }
    };
    let long = submit("after-long", 1_000_000).await;
    let running = wait_state(&mut c, &long, &[JobState::Running], Duration::from_secs(60)).await;
    assert_eq!(running.state(), JobState::Running, "{running:?}");
    let short = submit("after-short", 3).await;
    let done = wait_state(
        &mut c,
        &short,
        &[JobState::Failed, JobState::Succeeded, JobState::Cancelled],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(done.state(), JobState::Succeeded, "{done:?}");
    let mut ran_on = [running.workers, done.workers].concat();
    ran_on.sort();
    assert_eq!(ran_on, ["rv0", "rv1"]);
    c.cancel_job(v1::CancelJobRequest { id: long })
        .await
        .unwrap();
}

/// A spec at every size limit (issue 28): each path field 4096 bytes (a
/// TorchScript model, so `model.path` is allowed), a checkpoint folder of
/// its own (`i`).
fn maximal_spec(i: usize) -> v1::JobSpec {
    let path = |tag: &str| {
        let head = format!("/tmp/accrue-maximal/{tag}-{i}/");
        format!(
            "{head}{}",
            "p".repeat(accrue_common::spec::MAX_PATH_BYTES - head.len())
        )
    };
    let mut s = spec(&job_toml("max", 1, 4, ""));
    let model = s.model.as_mut().unwrap();
    model.kind = v1::ModelKind::Torchscript as i32;
    model.hidden.clear();
    model.path = Some(path("model"));
    model.init = Some(path("init"));
    let data = s.data.as_mut().unwrap();
    data.path = Some(path("data"));
    data.eval_path = Some(path("eval"));
    s.checkpoint.get_or_insert_with(Default::default).dir = Some(path("ckpt"));
    s
}

/// Issue 28: ListJobs pages as AIP-158 says, through the real gRPC API.
/// 230 jobs at every size limit (about 21 KiB each, 4.8 MB together: one
/// answer with all of them is RESOURCE_EXHAUSTED for every standard
/// client): a page of 1000 asked for is cut to what a client with the
/// default 4 MiB limit accepts; the default pages (100) go through every
/// job once, in creation order, while jobs are added between pages;
/// `accrue list` follows the pages; bad sizes and tokens are
/// INVALID_ARGUMENT; `GET /v1/jobs` pages the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_jobs_pages_and_a_page_of_maximal_jobs_fits_a_standard_client() {
    const N: usize = 230;
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let mut c = client(&grpc).await;
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..4)
        .map(|t| {
            let mut c = c.clone();
            tokio::spawn(async move {
                for i in (t..N).step_by(4) {
                    c.submit_job(v1::SubmitJobRequest {
                        spec: Some(maximal_spec(i)),
                    })
                    .await
                    .unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    eprintln!("{N} maximal jobs submitted in {:.1?}", started.elapsed());
    // A standard client: tonic's default limits (4 MiB, as grpcio's).
    let channel =
        accrue_proto::tls::endpoint(&format!("https://{grpc}"), Some(&creds().client_tls()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let token = accrue::BearerToken::new(&creds().token("read")).unwrap();
    let mut standard = v1::job_service_client::JobServiceClient::with_interceptor(channel, token);
    let list = |page_size: i32, page_token: &str| v1::ListJobsRequest {
        page_size,
        page_token: page_token.into(),
    };
    let full = standard
        .list_jobs(list(1000, ""))
        .await
        .expect("a page within the standard limit")
        .into_inner();
    let bytes = prost::Message::encoded_len(&full);
    eprintln!("page_size 1000: {} jobs, {bytes} bytes", full.jobs.len());
    assert!(bytes <= 4 << 20, "{bytes}");
    assert!(
        (150..N).contains(&full.jobs.len()),
        "cut by bytes, not to nothing: {}",
        full.jobs.len()
    );
    assert!(!full.next_page_token.is_empty());
    // The default pages, a job added after each: none skipped or repeated.
    let mut ids = Vec::new();
    let mut added = Vec::new();
    let mut token = String::new();
    let mut sizes = Vec::new();
    loop {
        let p = standard
            .list_jobs(list(0, &token))
            .await
            .unwrap()
            .into_inner();
        sizes.push(p.jobs.len());
        ids.extend(p.jobs.into_iter().map(|j| j.id));
        if p.next_page_token.is_empty() {
            break;
        }
        token = p.next_page_token;
        added.push(submit_text(&mut c, &job_toml("late", 1, 4, "")).await.id);
    }
    let expected: Vec<String> = (1..=N)
        .map(|s| format!("max-{s}"))
        .chain(added.iter().cloned())
        .collect();
    assert_eq!(sizes, [100, 100, 32]);
    assert_eq!(ids, expected, "every job once, in creation order");
    // `accrue list` follows the pages (1000 asked, cut by bytes).
    let out = tokio::task::spawn_blocking({
        let grpc = grpc.clone();
        move || {
            cli("read")
                .args(["--coordinator", &grpc, "list"])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Vec<&str> = text
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(listed, expected);
    // Refused: a negative size, a token this coordinator did not issue.
    let e = standard.list_jobs(list(-1, "")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().starts_with("page_size = -1: must be >= 0"),
        "{}",
        e.message()
    );
    let e = standard
        .list_jobs(list(0, "bm90IGEgdG9rZW4"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message()
            .contains("not a page token this coordinator issued"),
        "{}",
        e.message()
    );
    // Clamped: 5000 is 1000 (then cut by bytes as above).
    let p = standard
        .list_jobs(list(5000, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.jobs.len(), full.jobs.len());
    // HTTP pages the same way.
    let http = h.http_addr.to_string();
    let page: serde_json::Value = creds()
        .get(&http, "/v1/jobs?page_size=50", "read")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["jobs"].as_array().unwrap().len(), 50);
    let next = page["next_page_token"].as_str().unwrap();
    let page: serde_json::Value = creds()
        .get(
            &http,
            &format!("/v1/jobs?page_size=50&page_token={next}"),
            "read",
        )
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["jobs"][0]["id"], "max-51");
    let bad = creds()
        .get(&http, "/v1/jobs?page_token=zz", "read")
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    h.stop().await;
}

/// Issue 28: an oversized path field (1 MB, unused by synthetic data) is
/// refused at submit with INVALID_ARGUMENT naming the field, in a short
/// message, and nothing is created; a spec file above 64 KiB is refused
/// by `accrue submit` before it sends anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_spec_is_refused_at_submit_naming_the_field() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let mut c = client(&grpc).await;
    let mut s = spec(&job_toml("big", 1, 4, ""));
    s.data.as_mut().unwrap().path = Some("x".repeat(1_000_000));
    let e = c
        .submit_job(v1::SubmitJobRequest { spec: Some(s) })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let m = e.message();
    assert!(
        m.contains("data.path = \"xxxx")
            && m.contains("… (1000000 bytes): must be at most 4096 bytes"),
        "{m}"
    );
    assert!(m.len() < 300, "{} characters", m.len());
    let listed = c
        .list_jobs(v1::ListJobsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.jobs.is_empty(), "nothing half-created: {listed:?}");
    // A spec file of 70 KiB (a long comment): refused by the CLI.
    let text = format!("{}#{}\n", job_toml("big", 1, 4, ""), "p".repeat(70 << 10));
    let file = write(d.path(), "big.toml", &text);
    let out = tokio::task::spawn_blocking(move || {
        cli("submit")
            .args(["--coordinator", &grpc, "submit"])
            .arg(&file)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("is larger than 65536 bytes (64 KiB)"), "{err}");
    h.stop().await;
}

/// Bytes sent as they are in gRPC's framing (a message that is not
/// protobuf), and the answer's bytes as they came.
#[derive(Clone, Copy, Default)]
struct Raw;

impl tonic::codec::Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        buf: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        prost::bytes::BufMut::put_slice(buf, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        buf: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use prost::bytes::Buf;
        Ok(Some(buf.copy_to_bytes(buf.remaining()).to_vec()))
    }
}

/// Issue 28: a request body that is not protobuf (raw bytes in gRPC's
/// framing over HTTP/2, to the real server) is INVALID_ARGUMENT naming the
/// message, not INTERNAL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_protobuf_body_is_invalid_argument() {
    let d = TempDir::new().unwrap();
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let channel =
        accrue_proto::tls::endpoint(&format!("https://{grpc}"), Some(&creds().client_tls()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    for (method, name) in [
        ("/accrue.v1.JobService/SubmitJob", "SubmitJobRequest"),
        ("/accrue.v1.JobService/ListJobs", "ListJobsRequest"),
        ("/accrue.v1.JobService/GetJob", "GetJobRequest"),
    ] {
        let mut g = tonic::client::Grpc::new(channel.clone());
        g.ready().await.unwrap();
        let mut req = tonic::Request::new(b"\xff\xff\xff\xff not protobuf".to_vec());
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {}", creds().token("admin"))
                .parse()
                .unwrap(),
        );
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(method);
        let e = g.unary(req, path, Raw).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{method}: {e:?}");
        assert!(
            e.message()
                .starts_with(&format!("the {name} message does not decode as protobuf: ")),
            "{method}: {}",
            e.message()
        );
    }
    h.stop().await;
}
