//! etcd mode end to end (docs/OPERATIONS.md, "etcd mode" and "Recovery"): a real etcd process on
//! free ports, coordinator replicas and worker daemons as real processes.
//! Coordinators are killed with SIGKILL; etcd is stopped and restarted.
//! Secure as by default (docs/SECURITY.md): etcd serves TLS and requires
//! client certificates from the test CA, which every process shows.

mod common;

use accrue_proto::v1::{self, Job, JobState};
use common::etcd::*;
use common::*;
use prost::Message;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tempfile::TempDir;

async fn ready(http: &str) -> bool {
    match creds()
        .http()
        .get(format!("https://{http}/readyz"))
        .send()
        .await
    {
        Ok(r) => r.status().is_success(),
        Err(_) => false,
    }
}

/// Whether /metrics has `line` within 30 s.
async fn metric_reads(http: &str, line: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(r) = creds().get(http, "/metrics", "metrics").await {
            if r.text().await.is_ok_and(|t| t.lines().any(|l| l == line)) {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

async fn wait_ready(http: &str, want: bool, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if ready(http).await == want {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

fn spec(name: &str, epochs: u64) -> v1::JobSpec {
    let text = format!(
        r#"
name = "{name}"
workers = 2
seed = 5
epochs = {epochs}
device = "cpu"
threads = 1
[model]
kind = "mlp"
hidden = [32]
[data]
kind = "synthetic"
samples = 384
eval_samples = 64
shape = [16]
classes = 4
batch_size = 8
[accumulation]
steps = 4
[optimizer]
kind = "sgd"
lr = 0.05
[comm]
timeout_s = 10
connect_timeout_s = 10
rendezvous_timeout_s = 20
"#
    );
    let s = accrue_common::JobSpec::from_toml_str(&text, Path::new("t.toml")).unwrap();
    accrue_proto::spec_to_proto(&s)
}

async fn submit(grpc: &str, spec: v1::JobSpec) -> Job {
    client(grpc)
        .await
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

async fn list_jobs(grpc: &str) -> Vec<Job> {
    client(grpc)
        .await
        .list_jobs(v1::ListJobsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .jobs
}

async fn wait_steps(grpc: &str, id: &str, step: u64) {
    let mut c = client(grpc).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let j = c
            .get_job(v1::GetJobRequest { id: id.into() })
            .await
            .unwrap()
            .into_inner();
        if j.counters.unwrap_or_default().step >= step {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("job {id} did not reach step {step}");
}

async fn finish(grpc: &str, id: &str) -> Job {
    let mut c = client(grpc).await;
    wait_state(
        &mut c,
        id,
        &[JobState::Succeeded, JobState::Failed, JobState::Cancelled],
        Duration::from_secs(120),
    )
    .await
}

/// Two coordinator replicas: the follower names the leader; kill -9 of the
/// leader hands over to the follower, and the running job finishes without
/// a restart of its workers (and without a re-formation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_takes_over_when_the_leader_dies() {
    let d = TempDir::new().unwrap();
    let etcd = Etcd::start(d.path()).await;
    let a = spawn_coordinator(
        &etcd_coordinator_args(&etcd, "ha", d.path(), 2),
        &d.path().join("coord-a.log"),
    );
    assert!(
        wait_ready(&a.http, true, Duration::from_secs(20)).await,
        "the first replica leads"
    );
    let b = spawn_coordinator(
        &etcd_coordinator_args(&etcd, "ha", d.path(), 2),
        &d.path().join("coord-b.log"),
    );
    // The follower answers with the leader's address once it has lost its
    // campaign (it read the leader key, naming A): from then on it could
    // have been elected and was not, so it is not ready.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let err = client(&b.grpc)
            .await
            .list_jobs(v1::ListJobsRequest::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        if err.message().contains(&a.grpc) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the follower never named the leader: {}",
            err.message()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!ready(&b.http).await);
    let mut w = Workers(vec![
        spawn_etcd_worker(&etcd, "ha", "h0", d.path()),
        spawn_etcd_worker(&etcd, "ha", "h1", d.path()),
    ]);
    let job = submit(&a.grpc, spec("ha", 4)).await;
    wait_steps(&a.grpc, &job.id, 3).await;
    drop(a); // SIGKILL of the leader
    let killed = Instant::now();
    assert!(
        wait_ready(&b.http, true, Duration::from_secs(30)).await,
        "the follower takes over"
    );
    eprintln!(
        "takeover: the follower was ready {:?} after the leader's kill",
        killed.elapsed()
    );
    let end = finish(&b.grpc, &job.id).await;
    assert_eq!(end.state(), JobState::Succeeded, "{end:?}");
    assert!(end.recoveries.is_empty(), "{:?}", end.recoveries);
    assert_eq!(end.generation, 1);
    let cnt = end.counters.unwrap();
    assert_eq!((cnt.step, cnt.samples_seen), (cnt.total_steps, 4 * 384));
    for c in &mut w.0 {
        assert!(
            c.try_wait().unwrap().is_none(),
            "the workers were not restarted"
        );
    }
    job_in_etcd_when(&etcd, "ha", &job.id, JobState::Succeeded).await;
}

/// A coordinator restart in etcd mode (on another port: workers find it
/// through etcd): every job is still there and the running one finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_restart_in_etcd_mode_keeps_every_job() {
    let d = TempDir::new().unwrap();
    let etcd = Etcd::start(d.path()).await;
    let first = spawn_coordinator(
        &etcd_coordinator_args(&etcd, "rs", d.path(), 2),
        &d.path().join("coord-1.log"),
    );
    assert!(wait_ready(&first.http, true, Duration::from_secs(20)).await);
    let _w = Workers(vec![
        spawn_etcd_worker(&etcd, "rs", "e0", d.path()),
        spawn_etcd_worker(&etcd, "rs", "e1", d.path()),
    ]);
    let short = submit(&first.grpc, spec("short", 1)).await;
    assert_eq!(
        finish(&first.grpc, &short.id).await.state(),
        JobState::Succeeded
    );
    let long = submit(&first.grpc, spec("long", 4)).await;
    wait_steps(&first.grpc, &long.id, 3).await;
    drop(first);
    let second = spawn_coordinator(
        &etcd_coordinator_args(&etcd, "rs", d.path(), 2),
        &d.path().join("coord-2.log"),
    );
    assert!(wait_ready(&second.http, true, Duration::from_secs(30)).await);
    let jobs = list_jobs(&second.grpc).await;
    let ids: Vec<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
    assert_eq!(ids, [short.id.as_str(), long.id.as_str()]);
    assert_eq!(jobs[0].state(), JobState::Succeeded);
    // The finished job's training curve came back from etcd with it
    // (issue 16): a point per step.
    let series: serde_json::Value = creds()
        .http()
        .get(format!(
            "https://{}/v1/jobs/{}/series",
            second.http, short.id
        ))
        .bearer_auth(creds().token("read"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let steps = jobs[0].counters.unwrap().step;
    assert!(steps > 0);
    assert_eq!(
        series["points"]["last_step"],
        serde_json::json!((1..=steps).collect::<Vec<_>>()),
        "{series}"
    );
    let end = finish(&second.grpc, &long.id).await;
    assert_eq!(end.state(), JobState::Succeeded, "{end:?}");
    let cnt = end.counters.unwrap();
    assert_eq!((cnt.step, cnt.samples_seen), (cnt.total_steps, 4 * 384));
}

/// A job formed while etcd is away: no worker trains under a generation
/// etcd has not recorded. The coordinator dies meanwhile (its queued writes
/// with it); the next one finds the job as etcd holds it (pending), forms
/// it, and it finishes once, with exact counters. Before assignments waited
/// for etcd, the workers trained generation 1 unrecorded, the next
/// coordinator handed out generation 1 again, and the old run's messages
/// passed for the new one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_worker_trains_under_a_generation_etcd_has_not_recorded() {
    let d = TempDir::new().unwrap();
    let mut etcd = Etcd::start(d.path()).await;
    let first = spawn_coordinator(
        &etcd_coordinator_args(&etcd, "gen", d.path(), 2),
        &d.path().join("coord-1.log"),
    );
    assert!(wait_ready(&first.http, true, Duration::from_secs(20)).await);
    let mut w = Workers(vec![spawn_etcd_worker(&etcd, "gen", "g0", d.path())]);
    assert!(metric_reads(&first.http, "accrue_workers_attached 1").await);
    // Needs two workers: pending, and recorded so.
    let job = submit(&first.grpc, spec("gen", 2)).await;
    job_in_etcd_when(&etcd, "gen", &job.id, JobState::Pending).await;
    etcd.stop();
    // The second worker reaches the coordinator by its fallback address.
    w.0.push(spawn_etcd_worker_at(
        &etcd,
        "gen",
        "g1",
        d.path(),
        &first.grpc,
    ));
    let mut c = client(&first.grpc).await;
    let formed = wait_state(
        &mut c,
        &job.id,
        &[JobState::Rendezvous],
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(formed.state(), JobState::Rendezvous, "{formed:?}");
    assert!(metric_reads(&first.http, "accrue_held_messages 2").await);
    // Evidence instead of a clock: with etcd away the replica cannot renew
    // its lease (TTL 2 s), steps down and closes its worker streams. A
    // stream delivers in order, so a worker that saw its stream end after
    // the assignments were held would have logged an assignment first had
    // one been sent: neither did, and neither formed a ring.
    let logs = [d.path().join("g0.log"), d.path().join("g1.log")];
    let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();
    let held_at: Vec<usize> = logs.iter().map(|p| read(p).len()).collect();
    let ended = |text: &str| {
        text.contains("the coordinator closed the stream") || text.contains("attach stream failed")
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !logs
        .iter()
        .zip(&held_at)
        .all(|(p, &at)| ended(&read(p)[at..]))
    {
        assert!(
            Instant::now() < deadline,
            "the replica did not close the worker streams after losing etcd; see {}",
            d.path().display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for p in &logs {
        let text = read(p);
        assert!(
            !text.contains("assignment job=") && !text.contains("ring formed"),
            "a worker was assigned a generation etcd does not hold:\n{text}"
        );
    }
    // The replica decides nothing more (stepped down), or still reports
    // the job unformed.
    match c.get_job(v1::GetJobRequest { id: job.id.clone() }).await {
        Ok(j) => {
            let j = j.into_inner();
            assert_eq!(
                (j.state(), j.counters.unwrap_or_default().step),
                (JobState::Rendezvous, 0),
                "trained under a generation etcd does not hold"
            );
        }
        Err(e) => assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}"),
    }
    drop(first); // SIGKILL
    etcd.spawn().await;
    let second = spawn_coordinator(
        &etcd_coordinator_args(&etcd, "gen", d.path(), 2),
        &d.path().join("coord-2.log"),
    );
    assert!(wait_ready(&second.http, true, Duration::from_secs(30)).await);
    let end = finish(&second.grpc, &job.id).await;
    assert_eq!(end.state(), JobState::Succeeded, "{end:?}");
    assert_eq!(end.generation, 1, "formed once, by the second coordinator");
    let cnt = end.counters.unwrap();
    assert!(cnt.total_steps > 0);
    assert_eq!((cnt.step, cnt.samples_seen), (cnt.total_steps, 2 * 384));
    job_in_etcd_when(&etcd, "gen", &job.id, JobState::Succeeded).await;
    // The log lines looked for above are the ones a real assignment writes.
    for p in &logs {
        let text = read(p);
        assert!(
            text.contains("assignment job=") && text.contains("ring formed"),
            "{text}"
        );
    }
}

/// etcd stopped for a few seconds and started again: the coordinator says
/// not ready meanwhile, recovers by itself, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_outage_loses_nothing() {
    let d = TempDir::new().unwrap();
    let mut etcd = Etcd::start(d.path()).await;
    let co = spawn_coordinator(
        &etcd_coordinator_args(&etcd, "out", d.path(), 5),
        &d.path().join("coord.log"),
    );
    assert!(wait_ready(&co.http, true, Duration::from_secs(20)).await);
    let _w = Workers(vec![
        spawn_etcd_worker(&etcd, "out", "o0", d.path()),
        spawn_etcd_worker(&etcd, "out", "o1", d.path()),
    ]);
    let job = submit(&co.grpc, spec("outage", 4)).await;
    wait_steps(&co.grpc, &job.id, 3).await;
    etcd.stop();
    assert!(
        wait_ready(&co.http, false, Duration::from_secs(15)).await,
        "not ready while etcd is away"
    );
    // A submission meanwhile is refused within a bounded time, naming the
    // store (UNAVAILABLE: the replica cannot make it durable, or no longer
    // leads), and nothing of it remains.
    let asked = Instant::now();
    let refused = tokio::time::timeout(
        Duration::from_secs(15),
        client(&co.grpc).await.submit_job(v1::SubmitJobRequest {
            spec: Some(spec("during", 1)),
            ..Default::default()
        }),
    )
    .await
    .expect("answered within 15 s")
    .expect_err("a submission was acknowledged while etcd was away");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    let said = refused.message();
    assert!(
        said.contains("etcd") || said.contains("leader") || said.contains("durable"),
        "{said}"
    );
    eprintln!("refused after {:?}: {said}", asked.elapsed());
    etcd.spawn().await;
    assert!(
        wait_ready(&co.http, true, Duration::from_secs(30)).await,
        "ready again by itself"
    );
    // Once etcd is back a submission is taken. It is acknowledged only
    // once every write queued before it is in etcd (the store writes in
    // order), so whatever the refused submission left queued (its record,
    // its removal) has landed by now: neither etcd nor the coordinator
    // holds any other job of that name.
    let during = submit(&co.grpc, spec("during", 1)).await;
    let named = |ids: Vec<String>| -> Vec<String> {
        ids.into_iter()
            .filter(|id| id.starts_with("during"))
            .collect()
    };
    let listed = named(
        list_jobs(&co.grpc)
            .await
            .into_iter()
            .map(|j| j.id)
            .collect(),
    );
    assert_eq!(
        listed,
        [during.id.as_str()],
        "a refused submission was created"
    );
    let stored = named(
        jobs_in_etcd(&etcd, "out")
            .await
            .into_iter()
            .map(|j| j.id)
            .collect(),
    );
    assert_eq!(
        stored,
        [during.id.as_str()],
        "a refused submission reached etcd"
    );
    let end = finish(&co.grpc, &job.id).await;
    assert_eq!(end.state(), JobState::Succeeded, "{end:?}");
    let cnt = end.counters.unwrap();
    assert_eq!((cnt.step, cnt.samples_seen), (cnt.total_steps, 4 * 384));
    assert_eq!(
        finish(&co.grpc, &during.id).await.state(),
        JobState::Succeeded
    );
    // Everything reached etcd.
    let a = job_in_etcd_when(&etcd, "out", &job.id, JobState::Succeeded).await;
    job_in_etcd_when(&etcd, "out", &during.id, JobState::Succeeded).await;
    assert_eq!(a.counters.unwrap().step, cnt.step);
}

/// Every write of a job key in etcd's history, oldest first: (revision,
/// the replica that wrote it, the job's version, its id).
async fn job_history(etcd: &Etcd, cluster: &str) -> Vec<(i64, String, u64, String)> {
    use etcd_client::GetOptions;
    let mut c = connect(etcd).await.unwrap();
    let prefix = accrue_proto::layout::etcd::jobs_prefix(cluster);
    let now = c
        .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    let mut out = Vec::new();
    for rev in 1..=now {
        let r = c
            .get(
                prefix.clone(),
                Some(GetOptions::new().with_prefix().with_revision(rev)),
            )
            .await
            .unwrap();
        for kv in r.kvs().iter().filter(|kv| kv.mod_revision() == rev) {
            let j = Job::decode(kv.value()).unwrap();
            out.push((rev, j.written_by, j.version, j.id));
        }
    }
    out
}

/// No write by `old` after the first write by `new`.
fn assert_fenced(history: &[(i64, String, u64, String)], old: &str, new: &str) {
    let first_new = history
        .iter()
        .find(|(_, w, _, _)| w == new)
        .unwrap_or_else(|| panic!("no write by the new leader {new}: {history:?}"))
        .0;
    let late: Vec<_> = history
        .iter()
        .filter(|(rev, w, _, _)| w == old && *rev > first_new)
        .collect();
    assert!(
        late.is_empty(),
        "the old leader {old} wrote after the new leader's first write (revision {first_new}): {late:?}"
    );
}

/// Fencing at the store: once the leader key is held under another lease,
/// the old leader's queued writes (even a newer version) do not land, and
/// the old leader learns it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_store_writes_nothing_after_the_new_leader() {
    use accrue_coordinator::etcd::{EtcdConfig, EtcdStore, Fence};
    use accrue_coordinator::store::JobStore;
    use etcd_client::PutOptions;
    use std::sync::Arc;
    let d = TempDir::new().unwrap();
    let etcd = Etcd::start(d.path()).await;
    let cfg = EtcdConfig {
        endpoints: vec![etcd.url.clone()],
        cluster: "fs".into(),
        lease_ttl_s: 2,
        tls: Some(etcd_tls()),
    };
    // etcd takes only clients showing a certificate from the test CA.
    let anonymous = async {
        let tls = accrue_proto::tls::ClientTls {
            ca: creds().ca(),
            identity: None,
        };
        let opts = etcd_client::ConnectOptions::new().with_tls(tls.config().unwrap());
        etcd_client::Client::connect([etcd.url.as_str()], Some(opts))
            .await?
            .get("/probe", None)
            .await
    };
    let r = tokio::time::timeout(Duration::from_secs(20), anonymous).await;
    assert!(
        matches!(r, Ok(Err(_))),
        "etcd answered a client without a certificate: {r:?}"
    );
    let mut c = connect(&etcd).await.unwrap();
    let leader = accrue_proto::layout::etcd::leader_key("fs");
    let job = |v: u64| Job {
        id: "fenced-1".into(),
        version: v,
        generation: v,
        ..Default::default()
    };
    async fn durable(s: &EtcdStore, t: u64) {
        let mut rx = s.progress().subscribe();
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|d| *d >= t))
            .await
            .expect("durable within 10 s")
            .unwrap();
    }
    let la = c.lease_grant(30, None).await.unwrap().id();
    c.put(leader.clone(), "a", Some(PutOptions::new().with_lease(la)))
        .await
        .unwrap();
    let fenced_a = Arc::new(tokio::sync::Notify::new());
    let a = EtcdStore::open(
        c.clone(),
        &cfg,
        Fence {
            leader_key: leader.clone(),
            lease: la,
            writer: "a".into(),
            fenced: fenced_a.clone(),
        },
    )
    .await
    .unwrap();
    durable(&a, a.put(&job(1)).unwrap()).await;
    // A is cut off: its lease ends, B takes the leader key and writes.
    c.lease_revoke(la).await.unwrap();
    let lb = c.lease_grant(30, None).await.unwrap().id();
    c.put(leader.clone(), "b", Some(PutOptions::new().with_lease(lb)))
        .await
        .unwrap();
    let b = EtcdStore::open(
        c.clone(),
        &cfg,
        Fence {
            leader_key: leader.clone(),
            lease: lb,
            writer: "b".into(),
            fenced: Arc::new(tokio::sync::Notify::new()),
        },
    )
    .await
    .unwrap();
    assert_eq!(b.list().unwrap()[0].version, 1);
    durable(&b, b.put(&job(2)).unwrap()).await;
    // A comes back with a newer version queued: refused, and A learns it.
    a.put(&job(3)).unwrap();
    tokio::time::timeout(Duration::from_secs(10), fenced_a.notified())
        .await
        .expect("the old leader learns its writes are fenced");
    let history = job_history(&etcd, "fs").await;
    assert_fenced(&history, "a", "b");
    let writes: Vec<(&str, u64)> = history
        .iter()
        .map(|(_, w, v, _)| (w.as_str(), *v))
        .collect();
    assert_eq!(writes, [("a", 1), ("b", 2)]);
    a.close();
    b.close();
}

fn signal(p: &CoordinatorProc, sig: i32) {
    // SAFETY: kill(2) on our own child process only sends a signal.
    let rc = unsafe { libc::kill(p.child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({}, {sig})", p.child.id());
}

/// A leader cut off from etcd (stopped for longer than its lease) is
/// replaced. When it runs again it steps down by itself through the gate
/// (it answers as a follower naming the new leader, and its process does
/// not exit), refuses submissions, and etcd's history holds no write of
/// it after the new leader's first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_leader_steps_down_and_never_writes_after_the_new_leader() {
    let d = TempDir::new().unwrap();
    let etcd = Etcd::start(d.path()).await;
    let mut a = spawn_coordinator(
        &etcd_coordinator_args(&etcd, "part", d.path(), 2),
        &d.path().join("coord-a.log"),
    );
    assert!(wait_ready(&a.http, true, Duration::from_secs(20)).await);
    let b = spawn_coordinator(
        &etcd_coordinator_args(&etcd, "part", d.path(), 2),
        &d.path().join("coord-b.log"),
    );
    // Needs two workers, none attached: it stays pending, written by A.
    submit(&a.grpc, spec("before", 1)).await;
    signal(&a, libc::SIGSTOP);
    assert!(
        wait_ready(&b.http, true, Duration::from_secs(30)).await,
        "the follower takes over from the stopped leader"
    );
    submit(&b.grpc, spec("after", 1)).await;
    signal(&a, libc::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = client(&a.grpc)
            .await
            .list_jobs(v1::ListJobsRequest::default())
            .await;
        match r {
            Err(e) if e.code() == tonic::Code::Unavailable && e.message().contains(&b.grpc) => {
                break
            }
            other => assert!(
                Instant::now() < deadline,
                "the old leader still serves: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "the old leader exited instead of stepping down"
    );
    assert!(!ready(&a.http).await);
    let refused = client(&a.grpc)
        .await
        .submit_job(v1::SubmitJobRequest {
            spec: Some(spec("stale", 1)),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    let history = job_history(&etcd, "part").await;
    assert_fenced(&history, &a.grpc, &b.grpc);
    assert!(history
        .iter()
        .any(|(_, w, _, id)| w == &a.grpc && id.starts_with("before")));
    assert!(history.iter().all(|(_, _, _, id)| !id.starts_with("stale")));
}
