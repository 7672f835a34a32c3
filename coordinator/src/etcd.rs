//! etcd mode (docs/OPERATIONS.md, "etcd mode"): jobs live under `/accrue/<cluster>/jobs/`,
//! workers register under `/accrue/<cluster>/workers/<id>` with a lease
//! they keep alive, and coordinator replicas elect a leader on
//! `/accrue/<cluster>/leader` (its value: the leader's gRPC address; the
//! key layout is `accrue_proto::layout::etcd`, shared with the daemon).
//!
//! Leadership is fenced: every job write is a transaction that succeeds
//! only while the leader key is still held under this replica's lease. A
//! deposed leader's queued writes therefore fail instead of landing after a
//! partition heals, and the first failed one makes it step down. A leader
//! that cannot renew its lease within the TTL steps down on its own
//! deadline. Stepping down goes through the gate (readiness 503, the
//! follower's answers) and the replica campaigns again; the process never
//! exits from here.

use crate::gate::Gate;
use crate::service::{Config, Coordinator};
use crate::store::{supersedes, JobStore, StoreError, Write, WriteProgress, WriteQueue};
use accrue_proto::layout::etcd::{
    job_key, jobs_prefix, leader_key, series_key, series_prefix, workers_prefix,
};
use accrue_proto::v1::{Job, JobSeries};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use prost::Message;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

#[derive(Clone, Debug)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub cluster: String,
    /// Leader lease TTL, seconds.
    pub lease_ttl_s: i64,
    /// TLS to etcd with this client certificate (None: plaintext etcd,
    /// only with `--insecure`).
    pub tls: Option<accrue_proto::tls::ClientTls>,
}

impl EtcdConfig {
    /// Whether etcd is reached over TLS with a client certificate.
    pub fn tls_configured(&self) -> bool {
        self.tls.is_some()
    }

    /// The connect options: TLS with the client certificate when given
    /// (its files were checked at start; read again on every connection).
    fn options(&self) -> Result<Option<ConnectOptions>, etcd_client::Error> {
        match &self.tls {
            Some(t) => {
                accrue_proto::tls::install_crypto_provider();
                let tls = t
                    .config()
                    .map_err(|e| etcd_client::Error::InvalidArgs(e.to_string()))?;
                Ok(Some(ConnectOptions::new().with_tls(tls)))
            }
            None => Ok(None),
        }
    }
}

fn backend(endpoints: &[String], reason: impl std::fmt::Display) -> StoreError {
    StoreError::Backend {
        path: format!("etcd {}", endpoints.join(",")).into(),
        reason: reason.to_string(),
    }
}

/// Whether a leader whose lease was last renewed at `renewed_ms` must step
/// down at `now_ms`: once a full TTL has passed without a renewal, etcd may
/// already have let the lease go and another replica may lead.
pub fn must_step_down(renewed_ms: i64, now_ms: i64, ttl_ms: i64) -> bool {
    now_ms - renewed_ms >= ttl_ms
}

/// The job store on etcd. Writes go to a thread of their own: the newest
/// version of each job is written, in order, and retried until etcd takes
/// it, so a handler never waits on etcd and nothing is lost while etcd is
/// away (`health` says so meanwhile). Each write is fenced by the leader
/// lease; a refused one sets `fenced` and stops the writer.
pub struct EtcdStore {
    queue: WriteQueue,
    ok: Arc<AtomicBool>,
    at_open: Vec<Job>,
    series_at_open: Vec<JobSeries>,
}

/// Who writes: the leader key and lease that fence the writes, and the
/// replica's address recorded in each job version (`written_by`).
#[derive(Clone)]
pub struct Fence {
    pub leader_key: String,
    pub lease: i64,
    pub writer: String,
    /// Notified once when a write is refused: this replica no longer leads.
    pub fenced: Arc<Notify>,
}

impl EtcdStore {
    pub async fn open(client: Client, cfg: &EtcdConfig, fence: Fence) -> Result<Self, StoreError> {
        let mut c = client.clone();
        let prefix = jobs_prefix(&cfg.cluster);
        let resp = c
            .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| backend(&cfg.endpoints, e))?;
        let mut at_open = Vec::new();
        for kv in resp.kvs() {
            let job = Job::decode(kv.value()).map_err(|e| {
                backend(
                    &cfg.endpoints,
                    format!("{}: {e}", String::from_utf8_lossy(kv.key())),
                )
            })?;
            at_open.push(job);
        }
        // Submission order: ids end in their sequence number.
        at_open.sort_by_key(|j: &Job| {
            j.id.rsplit('-')
                .next()
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(u64::MAX)
        });
        let resp = c
            .get(
                series_prefix(&cfg.cluster),
                Some(GetOptions::new().with_prefix()),
            )
            .await
            .map_err(|e| backend(&cfg.endpoints, e))?;
        let mut series_at_open = Vec::new();
        for kv in resp.kvs() {
            series_at_open.push(JobSeries::decode(kv.value()).map_err(|e| {
                backend(
                    &cfg.endpoints,
                    format!("{}: {e}", String::from_utf8_lossy(kv.key())),
                )
            })?);
        }
        let (queue, rx) = WriteQueue::new(format!("etcd {}", cfg.endpoints.join(",")).into());
        let ok = Arc::new(AtomicBool::new(true));
        let (ok2, progress) = (ok.clone(), queue.progress());
        let written: BTreeMap<String, u64> = at_open
            .iter()
            .map(|j| (format!("job/{}", j.id), j.version))
            .chain(
                series_at_open
                    .iter()
                    .map(|s| (format!("series/{}", s.job_id), s.version)),
            )
            .collect();
        let cluster = cfg.cluster.clone();
        let thread = std::thread::Builder::new()
            .name("accrue-etcd-writer".into())
            .spawn(move || {
                Writer {
                    client,
                    cluster,
                    fence,
                    ok: ok2,
                    written,
                }
                .run(rx, &progress)
            })
            .map_err(|e| backend(&cfg.endpoints, e))?;
        queue.set_writer(thread);
        Ok(Self {
            queue,
            ok,
            at_open,
            series_at_open,
        })
    }
}

struct Writer {
    client: Client,
    cluster: String,
    fence: Fence,
    ok: Arc<AtomicBool>,
    /// The newest version written of each job and series (by
    /// [`Write::key`]).
    written: BTreeMap<String, u64>,
}

/// What one write attempt came to.
enum Attempt {
    Done,
    /// etcd refused it: the lease no longer holds the leader key.
    Fenced,
    /// etcd did not answer; retry.
    Retry(String),
}

impl Writer {
    fn attempt(&mut self, rt: &tokio::runtime::Runtime, w: &Write) -> Attempt {
        let key = job_key(&self.cluster, w.id());
        let wkey = w.key();
        let (ops, version) = match w {
            Write::Put(job) => {
                if !supersedes(self.written.get(&wkey).copied(), job.version) {
                    return Attempt::Done;
                }
                let mut job = (**job).clone();
                job.written_by = self.fence.writer.clone();
                (
                    vec![TxnOp::put(key, job.encode_to_vec(), None)],
                    Some(job.version),
                )
            }
            Write::Series(s) => {
                if !supersedes(self.written.get(&wkey).copied(), s.version) {
                    return Attempt::Done;
                }
                let key = series_key(&self.cluster, &s.job_id);
                (
                    vec![TxnOp::put(key, s.encode_to_vec(), None)],
                    Some(s.version),
                )
            }
            Write::Delete(id) => (
                vec![
                    TxnOp::delete(key, None),
                    TxnOp::delete(series_key(&self.cluster, id), None),
                ],
                None,
            ),
        };
        let txn = Txn::new()
            .when([Compare::lease(
                self.fence.leader_key.clone(),
                CompareOp::Equal,
                self.fence.lease,
            )])
            .and_then(ops);
        let mut c = self.client.clone();
        let r =
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(2), c.txn(txn)).await });
        match r {
            Ok(Ok(resp)) if resp.succeeded() => {
                if let Some(v) = version {
                    self.written.insert(wkey, v);
                }
                Attempt::Done
            }
            Ok(Ok(_)) => Attempt::Fenced,
            Ok(Err(e)) => Attempt::Retry(e.to_string()),
            Err(_) => Attempt::Retry("timed out after 2 s".into()),
        }
    }

    fn run(mut self, rx: mpsc::Receiver<(u64, Write)>, progress: &WriteProgress) {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            tracing::error!("cannot start the etcd writer runtime");
            return;
        };
        // The newest write of each job, in first-queued order.
        let mut pending: BTreeMap<String, Write> = BTreeMap::new();
        let mut order: Vec<String> = Vec::new();
        // The newest ticket received: once nothing is pending, every write
        // up to it is in etcd (an older version is covered by its newest).
        let mut received = 0u64;
        let mut closed = false;
        loop {
            let wait = if pending.is_empty() {
                Duration::from_secs(3600)
            } else {
                Duration::from_millis(200)
            };
            if !closed {
                match rx.recv_timeout(wait) {
                    Ok(first) => {
                        for (ticket, w) in std::iter::once(first).chain(rx.try_iter()) {
                            received = received.max(ticket);
                            let id = w.key();
                            if let Write::Delete(job) = &w {
                                // The record and its series go together.
                                pending.remove(&format!("series/{job}"));
                            }
                            if !pending.contains_key(&id) {
                                order.push(id.clone());
                            }
                            pending.insert(id, w);
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => closed = true,
                }
            }
            if closed && pending.is_empty() {
                return;
            }
            while let Some(id) = order.first().cloned() {
                let Some(w) = pending.get(&id) else {
                    order.remove(0);
                    continue;
                };
                match self.attempt(&rt, w) {
                    Attempt::Done => {
                        pending.remove(&id);
                        order.remove(0);
                        if !self.ok.swap(true, Ordering::SeqCst) {
                            tracing::info!("etcd reachable again; job writes caught up");
                        }
                    }
                    Attempt::Fenced => {
                        tracing::error!(job = %id, lease = self.fence.lease, "job write fenced: this replica no longer holds the leader key; dropping {} queued write(s)", pending.len());
                        self.fence.fenced.notify_one();
                        return;
                    }
                    Attempt::Retry(e) => {
                        if self.ok.swap(false, Ordering::SeqCst) {
                            tracing::error!(error = %e, job = %id, "cannot write to etcd; retrying");
                        }
                        if closed {
                            // Stopping: what etcd does not take now is for
                            // the next leader to decide again.
                            return;
                        }
                        break;
                    }
                }
            }
            if pending.is_empty() {
                progress.advance(received);
            }
        }
    }
}

impl JobStore for EtcdStore {
    fn put(&self, job: &Job) -> Result<u64, StoreError> {
        self.queue.push(Write::Put(Box::new(job.clone())))
    }
    fn delete(&self, id: &str) -> Result<u64, StoreError> {
        self.queue.push(Write::Delete(id.to_string()))
    }
    fn list(&self) -> Result<Vec<Job>, StoreError> {
        Ok(self.at_open.clone())
    }
    fn put_series(&self, series: &JobSeries) -> Result<u64, StoreError> {
        self.queue.push(Write::Series(Box::new(series.clone())))
    }
    fn list_series(&self) -> Result<Vec<JobSeries>, StoreError> {
        Ok(self.series_at_open.clone())
    }
    fn health(&self) -> Result<(), String> {
        if self.ok.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("etcd is unreachable; job writes are queued".into())
        }
    }
    fn progress(&self) -> Arc<WriteProgress> {
        self.queue.progress()
    }
    fn close(&self) {
        self.queue.close();
    }
}

/// Campaigns for leadership until it wins, then serves as the coordinator:
/// loads the jobs from etcd, watches worker leases, and keeps its own lease
/// alive. It steps down when the lease is lost, cannot be renewed within
/// the TTL, or a job write is fenced, then campaigns again.
pub async fn lead(
    cfg: Config,
    etcd: EtcdConfig,
    advertise: String,
    gate: Arc<Gate>,
    master: crate::ringkey::RingMaster,
) {
    let leader = leader_key(&etcd.cluster);
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            let mut client = Client::connect(&etcd.endpoints, etcd.options()?).await?;
            let lease = client.lease_grant(etcd.lease_ttl_s, None).await?.id();
            let txn = Txn::new()
                .when([Compare::create_revision(
                    leader.clone(),
                    CompareOp::Equal,
                    0,
                )])
                .and_then([TxnOp::put(
                    leader.clone(),
                    advertise.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            let won = client.txn(txn).await?.succeeded();
            Ok::<_, etcd_client::Error>((client, lease, won, Instant::now()))
        };
        let (mut client, lease, won, granted) = match attempt.await {
            Ok(x) => {
                gate.set_backend_ok(true);
                backoff = Duration::from_millis(100);
                x
            }
            Err(e) => {
                gate.set_backend_ok(false);
                tracing::warn!(error = %e, "etcd unreachable; retrying the election");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        if !won {
            let _ = client.lease_revoke(lease).await;
            follow(&mut client, &leader, &gate).await;
            continue;
        }
        tracing::info!(%advertise, lease, "elected leader");
        gate.set_leader_addr(&advertise);
        let fenced = Arc::new(Notify::new());
        let fence = Fence {
            leader_key: leader.clone(),
            lease,
            writer: advertise.clone(),
            fenced: fenced.clone(),
        };
        let store = match EtcdStore::open(client.clone(), &etcd, fence).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot load jobs from etcd");
                let _ = client.lease_revoke(lease).await;
                gate.set_leader_addr("");
                continue;
            }
        };
        let coordinator =
            match Coordinator::with_ring_master(cfg.clone(), Box::new(store), master.clone()) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the coordinator");
                    let _ = client.lease_revoke(lease).await;
                    gate.set_leader_addr("");
                    continue;
                }
            };
        gate.lead(coordinator.clone());
        let watcher = tokio::spawn(watch_workers(client.clone(), etcd.clone(), coordinator));
        let why = tokio::select! {
            why = keep_leading(client.clone(), lease, etcd.lease_ttl_s, granted, &gate) => why,
            _ = fenced.notified() => "a job write was fenced (another replica holds the leader key)".to_string(),
        };
        tracing::error!(reason = %why, "stepping down as leader");
        watcher.abort();
        if let Some(c) = gate.step_down() {
            let _ = tokio::task::spawn_blocking(move || c.close()).await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), client.lease_revoke(lease)).await;
    }
}

/// Follows the current leader until its key goes away.
async fn follow(client: &mut Client, leader: &str, gate: &Gate) {
    let addr = match client.get(leader, None).await {
        Ok(r) => r
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
        Err(_) => return,
    };
    let Some(addr) = addr else { return };
    tracing::info!(leader = %addr, "following");
    gate.set_leader_addr(&addr);
    let Ok(mut stream) = client.watch(leader, None).await else {
        return;
    };
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.message()).await {
            Ok(Ok(Some(resp))) => {
                if resp
                    .events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete)
                {
                    tracing::info!("the leader is gone; campaigning");
                    return;
                }
            }
            Ok(_) => return,
            Err(_) => {
                // Quiet: check the key still exists (the watch may be stale
                // after etcd restarted).
                match client.get(leader, None).await {
                    Ok(r) if r.kvs().is_empty() => return,
                    Ok(_) => gate.set_backend_ok(true),
                    Err(_) => {
                        gate.set_backend_ok(false);
                        return;
                    }
                }
            }
        }
    }
}

/// Keeps the leader lease alive; returns (why) once etcd says it expired or
/// a full TTL passed without a renewal ([`must_step_down`]).
async fn keep_leading(
    mut client: Client,
    lease: i64,
    ttl_s: i64,
    granted: Instant,
    gate: &Gate,
) -> String {
    let ttl = Duration::from_secs(ttl_s.max(1) as u64);
    let every = ttl / 3;
    let mut renewed = granted;
    let since = |t: Instant| t.elapsed().as_millis() as i64;
    loop {
        if must_step_down(0, since(renewed), ttl.as_millis() as i64) {
            return format!(
                "the leader lease was not renewed within its TTL of {} s",
                ttl.as_secs()
            );
        }
        // Every attempt ends by the deadline, so the check above runs in
        // time even while etcd does not answer.
        let left = ttl.saturating_sub(renewed.elapsed());
        let round = async {
            let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
            loop {
                keeper.keep_alive().await?;
                match stream.message().await? {
                    Some(r) if r.ttl() <= 0 => return Ok::<bool, etcd_client::Error>(false),
                    Some(_) => {
                        renewed = Instant::now();
                        gate.set_backend_ok(true);
                    }
                    None => return Ok(true),
                }
                tokio::time::sleep(every).await;
            }
        };
        match tokio::time::timeout(left, round).await {
            Ok(Ok(false)) => return "etcd says the leader lease expired".into(),
            Ok(Ok(true)) | Err(_) => {}
            Ok(Err(e)) => {
                gate.set_backend_ok(false);
                tracing::warn!(error = %e, "cannot renew the leader lease; retrying");
            }
        }
        tokio::time::sleep(Duration::from_millis(200).min(every)).await;
    }
}

/// Worker leases: a deleted key (lease expired, or the worker left) is a
/// lost worker.
async fn watch_workers(mut client: Client, etcd: EtcdConfig, c: Arc<Coordinator>) {
    let prefix = workers_prefix(&etcd.cluster);
    loop {
        let Ok(mut stream) = client
            .watch(prefix.clone(), Some(WatchOptions::new().with_prefix()))
            .await
        else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        };
        while let Ok(Some(resp)) = stream.message().await {
            for e in resp.events() {
                if e.event_type() != EventType::Delete {
                    continue;
                }
                if let Some(id) = e
                    .kv()
                    .and_then(|kv| kv.key_str().ok())
                    .and_then(|k| k.strip_prefix(&prefix))
                {
                    c.lost(id, None, "its etcd lease expired");
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leader_steps_down_a_ttl_after_its_last_renewal() {
        assert!(!must_step_down(1_000, 3_999, 3_000));
        assert!(must_step_down(1_000, 4_000, 3_000));
        assert!(must_step_down(1_000, 60_000, 3_000));
    }
}
