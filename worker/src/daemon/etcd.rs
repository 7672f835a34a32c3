//! etcd mode for the daemon: its etcd client (TLS with its certificate
//! when configured), the leader's address, and its lease-kept registration.

use super::DaemonConfig;
use std::time::Duration;

/// An etcd client, over TLS with this worker's etcd certificate when one is
/// configured.
pub(super) async fn client(cfg: &DaemonConfig) -> Result<etcd_client::Client, etcd_client::Error> {
    let options = match &cfg.etcd_tls {
        Some(t) => {
            accrue_proto::tls::install_crypto_provider();
            let tls = t
                .config()
                .map_err(|e| etcd_client::Error::InvalidArgs(e.to_string()))?;
            Some(etcd_client::ConnectOptions::new().with_tls(tls))
        }
        None => None,
    };
    etcd_client::Client::connect(&cfg.etcd, options).await
}

/// Where the coordinator is: the leader etcd names, else `--coordinator`.
pub(super) async fn coordinator_url(cfg: &DaemonConfig) -> String {
    if cfg.etcd.is_empty() {
        return cfg.coordinator.clone();
    }
    let key = accrue_proto::layout::etcd::leader_key(&cfg.cluster);
    let found = async {
        let mut c = client(cfg).await.ok()?;
        let r = c.get(key, None).await.ok()?;
        let kv = r.kvs().first()?;
        // HOST:PORT: the scheme follows this daemon's TLS settings.
        Some(String::from_utf8_lossy(kv.value()).into_owned())
    };
    match tokio::time::timeout(Duration::from_secs(3), found).await {
        Ok(Some(url)) => url,
        _ => cfg.coordinator.clone(),
    }
}

/// Keeps `/accrue/<cluster>/workers/<id>` alive under a lease; re-registers
/// after etcd lost the lease (e.g. it was down longer than the TTL).
pub(super) async fn register(cfg: DaemonConfig, info: String, ttl: i64) {
    let key = accrue_proto::layout::etcd::worker_key(&cfg.cluster, &cfg.worker_id);
    let every = Duration::from_millis((ttl * 1000 / 3) as u64);
    loop {
        let round = async {
            let mut c = client(&cfg).await?;
            let lease = c.lease_grant(ttl, None).await?.id();
            c.put(
                key.clone(),
                info.clone(),
                Some(etcd_client::PutOptions::new().with_lease(lease)),
            )
            .await?;
            tracing::info!(%key, lease, "registered in etcd");
            let (mut keeper, mut stream) = c.lease_keep_alive(lease).await?;
            loop {
                keeper.keep_alive().await?;
                match tokio::time::timeout(Duration::from_secs(2), stream.message()).await {
                    Ok(Ok(Some(r))) if r.ttl() > 0 => {}
                    Ok(Ok(Some(_))) => return Ok::<(), etcd_client::Error>(()),
                    Ok(Ok(None)) | Err(_) => return Ok(()),
                    Ok(Err(e)) => return Err(e),
                }
                tokio::time::sleep(every).await;
            }
        };
        if let Err(e) = round.await {
            tracing::warn!(error = %e, "etcd registration interrupted; retrying");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
