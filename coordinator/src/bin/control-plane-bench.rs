//! control-plane-bench: load on a real `accrue-coordinator` process. N
//! simulated workers attach over gRPC, take assignments and report at R Hz;
//! M clients watch jobs. Prints the coordinator's report-handling latency
//! (p50/p99, from its /metrics) and its CPU use (from /proc). docs/BENCHMARKS.md.
use accrue_proto::v1::{self, coordinator_message, worker_message, WorkerMessage};
use clap::Parser;
use std::io::BufRead;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 200)]
    workers: usize,
    #[arg(long, default_value_t = 10.0)]
    hz: f64,
    #[arg(long, default_value_t = 50)]
    watchers: usize,
    #[arg(long, default_value_t = 20)]
    seconds: u64,
}

fn spec(name: &str) -> v1::JobSpec {
    let text = format!(
        "name = \"{name}\"\nworkers = 2\nmax_steps = 1000000\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 8\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n"
    );
    let s = accrue_common::JobSpec::from_toml_str(&text, std::path::Path::new("bench.toml"))
        .expect("valid spec");
    accrue_proto::spec_to_proto(&s)
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    // After the command name: utime is field 14, stime 15 (1-based in proc(5)).
    fields
        .get(11)
        .and_then(|u| u.parse::<u64>().ok())
        .unwrap_or(0)
        + fields
            .get(12)
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0)
}

async fn metric(http: &str, name: &str) -> f64 {
    let body = reqwest_like(http, "/metrics").await;
    body.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// A minimal HTTP/1.0 GET (no extra client dependency).
async fn reqwest_like(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let _ = s
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let exe = std::env::current_exe()?.with_file_name("accrue-coordinator");
    let state = std::env::temp_dir().join(format!("accrue-cp-bench-{}", std::process::id()));
    let mut child = std::process::Command::new(&exe)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--heartbeat-ttl",
            "30",
        ])
        .arg("--state-dir")
        .arg(&state)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("piped stdout")).read_line(&mut line)?;
    let parts: Vec<&str> = line.split_whitespace().collect();
    let (grpc, http) = (parts[1].to_string(), parts[3].to_string());
    let pid = child.id();
    let url = format!("http://{grpc}");
    let channel = tonic::transport::Channel::from_shared(url.clone())?
        .connect()
        .await?;
    let mut jobs = v1::job_service_client::JobServiceClient::new(channel.clone());
    // Workers first, so every job is placed at once.
    let mut tasks = Vec::new();
    for i in 0..a.workers {
        let ch = channel.clone();
        let period = Duration::from_secs_f64(1.0 / a.hz);
        tasks.push(tokio::spawn(async move {
            let mut client = v1::worker_service_client::WorkerServiceClient::new(ch);
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let hello = v1::WorkerHello {
                worker_id: format!("sim-{i:03}"),
                data_addr: format!("127.0.0.1:{}", 20000 + i),
                ..Default::default()
            };
            let _ = tx.send(WorkerMessage {
                msg: Some(worker_message::Msg::Hello(hello)),
                ..Default::default()
            });
            let Ok(resp) = client
                .attach(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
                .await
            else {
                return;
            };
            let mut inbound = resp.into_inner();
            let Some(Ok(m)) = inbound.next().await else {
                return;
            };
            let Some(coordinator_message::Msg::Assign(asg)) = m.msg else {
                return;
            };
            let mut tick = tokio::time::interval(period);
            let mut step = 0;
            loop {
                tick.tick().await;
                step += 1;
                let r = v1::StepReport {
                    job_id: asg.job_id.clone(),
                    generation: asg.generation,
                    rank: asg.rank,
                    step,
                    total_steps: 1_000_000,
                    loss: 1.0 / step as f64,
                    samples: 64,
                    samples_seen: 64 * step,
                    ..Default::default()
                };
                if tx
                    .send(WorkerMessage {
                        msg: Some(worker_message::Msg::Step(r)),
                        ..Default::default()
                    })
                    .is_err()
                {
                    return;
                }
            }
        }));
    }
    let mut ids = Vec::new();
    for j in 0..a.workers / 2 {
        ids.push(
            jobs.submit_job(v1::SubmitJobRequest {
                spec: Some(spec(&format!("b{j}"))),
                ..Default::default()
            })
            .await?
            .into_inner()
            .id,
        );
    }
    let mut events = Vec::new();
    for w in 0..a.watchers {
        let mut c = jobs.clone();
        let id = ids[w % ids.len()].clone();
        let counter = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        events.push(counter.clone());
        tasks.push(tokio::spawn(async move {
            let Ok(s) = c.watch_job(v1::WatchJobRequest { id }).await else {
                return;
            };
            let mut s = s.into_inner();
            while let Some(Ok(_)) = s.next().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }));
    }
    // Warm up, then measure.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let n0 = metric(&http, "accrue_report_handling_seconds_count").await;
    let cpu0 = cpu_ticks(pid);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.seconds)).await;
    let cpu1 = cpu_ticks(pid);
    let dt = t0.elapsed().as_secs_f64();
    let n1 = metric(&http, "accrue_report_handling_seconds_count").await;
    let p50 = metric(&http, "accrue_report_handling_seconds{quantile=\"0.5\"}").await;
    let p99 = metric(&http, "accrue_report_handling_seconds{quantile=\"0.99\"}").await;
    // Decision only (lock + decide); absent before issue 12 (NaN then).
    let d50 = metric(&http, "accrue_report_decision_seconds{quantile=\"0.5\"}").await;
    let d99 = metric(&http, "accrue_report_decision_seconds{quantile=\"0.99\"}").await;
    let ticks_per_s = 100.0; // USER_HZ on Linux
    let cpu = (cpu1 - cpu0) as f64 / ticks_per_s / dt;
    let watched: u64 = events
        .iter()
        .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    println!("| workers | report rate | watchers | messages handled/s | p50 decision | p99 decision | p50 handling | p99 handling | coordinator CPU | watch events/s |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {} Hz | {} | {:.0} | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.0}% of one core | {:.0} |",
        a.workers,
        a.hz,
        a.watchers,
        (n1 - n0) / dt,
        d50 * 1e6,
        d99 * 1e6,
        p50 * 1e6,
        p99 * 1e6,
        cpu * 100.0,
        watched as f64 / (dt + 3.0)
    );
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&state);
    for t in tasks {
        t.abort();
    }
    Ok(())
}
