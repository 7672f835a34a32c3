//! etcd mode (DESIGN section 7): jobs live under `/accrue/<cluster>/jobs/`,
//! workers register under `/accrue/<cluster>/workers/<id>` with a lease
//! they keep alive, and coordinator replicas elect a leader on
//! `/accrue/<cluster>/leader` (its value: the leader's gRPC address).

use crate::gate::Gate;
use crate::service::{Config, Coordinator};
use crate::store::{JobStore, StoreError, WriteProgress};
use accrue_proto::v1::Job;
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use prost::Message;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub cluster: String,
    /// Leader lease TTL, seconds.
    pub lease_ttl_s: i64,
}

pub fn jobs_prefix(cluster: &str) -> String {
    format!("/accrue/{cluster}/jobs/")
}
pub fn workers_prefix(cluster: &str) -> String {
    format!("/accrue/{cluster}/workers/")
}
pub fn leader_key(cluster: &str) -> String {
    format!("/accrue/{cluster}/leader")
}

fn backend(endpoints: &[String], reason: impl std::fmt::Display) -> StoreError {
    StoreError::Backend {
        path: format!("etcd {}", endpoints.join(",")).into(),
        reason: reason.to_string(),
    }
}

/// The job store on etcd. Writes go to a thread of their own: the newest
/// version of each job is written, in order, and retried until etcd takes
/// it, so a handler never waits on etcd and nothing is lost while etcd is
/// away (`health` says so meanwhile). `progress` tells how far the writes
/// have reached etcd.
pub struct EtcdStore {
    tx: std::sync::Mutex<mpsc::Sender<(u64, Job)>>,
    ok: Arc<AtomicBool>,
    progress: Arc<WriteProgress>,
    at_open: Vec<Job>,
}

impl EtcdStore {
    pub async fn open(client: Client, cfg: &EtcdConfig) -> Result<Self, StoreError> {
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
        let (tx, rx) = mpsc::channel::<(u64, Job)>();
        let ok = Arc::new(AtomicBool::new(true));
        let progress = Arc::new(WriteProgress::default());
        let (ok2, progress2) = (ok.clone(), progress.clone());
        std::thread::Builder::new()
            .name("accrue-etcd-writer".into())
            .spawn(move || writer(client, prefix, rx, ok2, &progress2))
            .map_err(|e| backend(&cfg.endpoints, e))?;
        Ok(Self {
            tx: std::sync::Mutex::new(tx),
            ok,
            progress,
            at_open,
        })
    }
}

fn writer(
    client: Client,
    prefix: String,
    rx: mpsc::Receiver<(u64, Job)>,
    ok: Arc<AtomicBool>,
    progress: &WriteProgress,
) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        tracing::error!("cannot start the etcd writer runtime");
        return;
    };
    let mut pending: BTreeMap<String, Job> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    // The newest ticket received: once nothing is pending, every write up
    // to it is in etcd (an older version of a job is covered by its newest).
    let mut received = 0u64;
    loop {
        let wait = if pending.is_empty() {
            Duration::from_secs(3600)
        } else {
            Duration::from_millis(200)
        };
        match rx.recv_timeout(wait) {
            Ok(first) => {
                for (ticket, j) in std::iter::once(first).chain(rx.try_iter()) {
                    received = received.max(ticket);
                    if !pending.contains_key(&j.id) {
                        order.push(j.id.clone());
                    }
                    pending.insert(j.id.clone(), j);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) if pending.is_empty() => return,
            Err(mpsc::RecvTimeoutError::Disconnected) => {}
        }
        let mut c = client.clone();
        while let Some(id) = order.first().cloned() {
            let Some(job) = pending.get(&id) else {
                order.remove(0);
                continue;
            };
            let put = rt.block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(2),
                    c.put(format!("{prefix}{id}"), job.encode_to_vec(), None),
                )
                .await
            });
            match put {
                Ok(Ok(_)) => {
                    pending.remove(&id);
                    order.remove(0);
                    if !ok.swap(true, Ordering::SeqCst) {
                        tracing::info!("etcd reachable again; job writes caught up");
                    }
                }
                Ok(Err(e)) => {
                    if ok.swap(false, Ordering::SeqCst) {
                        tracing::error!(error = %e, job = %id, "cannot write to etcd; retrying");
                    }
                    break;
                }
                Err(_) => {
                    if ok.swap(false, Ordering::SeqCst) {
                        tracing::error!(job = %id, "etcd write timed out; retrying");
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

impl JobStore for EtcdStore {
    fn put(&self, job: &Job) -> Result<(), StoreError> {
        // The ticket is taken under the lock, so tickets reach the writer
        // in the order they were issued.
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        tx.send((self.progress.issue(), job.clone()))
            .map_err(|_| StoreError::Backend {
                path: "etcd".into(),
                reason: "the writer thread stopped".into(),
            })
    }
    fn list(&self) -> Result<Vec<Job>, StoreError> {
        Ok(self.at_open.clone())
    }
    fn health(&self) -> Result<(), String> {
        if self.ok.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("etcd is unreachable; job writes are queued".into())
        }
    }
    fn progress(&self) -> Option<Arc<WriteProgress>> {
        Some(self.progress.clone())
    }
}

/// Campaigns for leadership until it wins, then serves as the coordinator:
/// loads the jobs from etcd, watches worker leases, and keeps its own lease
/// alive. A replica that loses its lease exits (a supervisor restarts it as
/// a follower), so two leaders never act at once for longer than the TTL.
pub async fn lead(cfg: Config, etcd: EtcdConfig, advertise: String, gate: Arc<Gate>) {
    let leader = leader_key(&etcd.cluster);
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            let mut client = Client::connect(&etcd.endpoints, None).await?;
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
            Ok::<_, etcd_client::Error>((client, lease, won))
        };
        let (mut client, lease, won) = match attempt.await {
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
        tracing::info!(%advertise, "elected leader");
        gate.set_leader_addr(&advertise);
        let store = match EtcdStore::open(client.clone(), &etcd).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot load jobs from etcd");
                let _ = client.lease_revoke(lease).await;
                continue;
            }
        };
        let coordinator = match Coordinator::new(cfg.clone(), Box::new(store)) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "cannot start the coordinator");
                let _ = client.lease_revoke(lease).await;
                continue;
            }
        };
        gate.lead(coordinator.clone());
        tokio::spawn(watch_workers(client.clone(), etcd.clone(), coordinator));
        keep_leading(client, lease, etcd.lease_ttl_s, gate).await;
        tracing::error!("lost the leader lease; exiting so a supervisor restarts this replica");
        std::process::exit(3);
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

/// Keeps the leader lease alive; returns once etcd says it expired.
async fn keep_leading(mut client: Client, lease: i64, ttl_s: i64, gate: Arc<Gate>) {
    let every = Duration::from_millis((ttl_s.max(1) * 1000 / 3) as u64);
    loop {
        let round = async {
            let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
            loop {
                keeper.keep_alive().await?;
                match tokio::time::timeout(Duration::from_secs(2), stream.message()).await {
                    Ok(Ok(Some(r))) if r.ttl() <= 0 => {
                        return Ok::<bool, etcd_client::Error>(false)
                    }
                    Ok(Ok(Some(_))) => gate.set_backend_ok(true),
                    Ok(Ok(None)) => return Ok(true),
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Ok(true),
                }
                tokio::time::sleep(every).await;
            }
        };
        match round.await {
            Ok(false) => return,
            Ok(true) => {}
            Err(e) => {
                gate.set_backend_ok(false);
                tracing::warn!(error = %e, "cannot renew the leader lease; retrying");
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
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
