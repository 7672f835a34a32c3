//! A job from submission to its end: watching, gang scheduling, cancel, a coordinator restart.

use super::*;

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
            ..Default::default()
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
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let b = c
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec(&job_toml("gb", 2, 5, ""))),
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(next.id, waiting.id);
    h2.stop().await;
}
