//! allreduce-bench: latency and bus bandwidth of the TCP ring all-reduce,
//! and the raw TCP stream limit of the machine (docs/BENCHMARKS.md).
//!
//!   allreduce-bench ring --world W [--sizes 4K,1M,...] [--iters N]
//!       starts W processes of itself on loopback and prints one line per size
//!   allreduce-bench raw [--sizes ...]
//!       one process streams to another over loopback TCP
use accrue_worker::comm::{bind, RingConfig, TcpRing};
use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(name = "allreduce-bench")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Ring all-reduce with W processes.
    Ring {
        #[arg(long, default_value_t = 2)]
        world: usize,
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
        )]
        sizes: Vec<String>,
        /// Timed iterations per size (after 2 warm-up ones); large sizes use fewer.
        #[arg(long, default_value_t = 20)]
        iters: usize,
        /// Frame (piece) size in KiB; default: the ring's default.
        #[arg(long)]
        piece_kb: Option<usize>,
        /// Internal: run as this rank with these peers.
        #[arg(long, hide = true)]
        rank: Option<usize>,
        #[arg(long, hide = true, value_delimiter = ',')]
        peers: Vec<String>,
    },
    /// Raw TCP stream between two processes.
    Raw {
        #[arg(long, value_delimiter = ',', default_value = "1M,16M,64M,256M")]
        sizes: Vec<String>,
        /// Stream both ways at once (what every ring link does).
        #[arg(long)]
        bidir: bool,
        #[arg(long, hide = true)]
        sink: Option<String>,
    },
}

fn parse_size(s: &str) -> anyhow::Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K') | Some('k') => (&s[..s.len() - 1], 1 << 10),
        Some('M') | Some('m') => (&s[..s.len() - 1], 1 << 20),
        Some('G') | Some('g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(num
        .parse::<usize>()
        .with_context(|| format!("bad size {s:?}"))?
        * mult)
}

fn iters_for(bytes: usize, iters: usize) -> usize {
    // Keep each size near a second: at least 3 timed iterations.
    (iters * (4 << 20) / bytes.max(1)).clamp(3, iters.max(3) * 50)
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Ring {
            world,
            sizes,
            iters,
            piece_kb,
            rank: Some(rank),
            peers,
        } => ring_rank(rank, world, &peers, &sizes, iters, piece_kb),
        Cmd::Ring {
            world,
            sizes,
            iters,
            piece_kb,
            rank: None,
            ..
        } => {
            if world < 2 {
                bail!("--world must be at least 2");
            }
            let addrs: Vec<String> = (0..world)
                .map(|_| Ok(bind("127.0.0.1:0")?.local_addr()?.to_string()))
                .collect::<anyhow::Result<_>>()?;
            let exe = std::env::current_exe()?;
            let mut children = Vec::new();
            for r in 0..world {
                children.push(
                    Command::new(&exe)
                        .args([
                            "ring",
                            "--world",
                            &world.to_string(),
                            "--rank",
                            &r.to_string(),
                        ])
                        .args(["--sizes", &sizes.join(","), "--iters", &iters.to_string()])
                        .args(["--peers", &addrs.join(",")])
                        .args(piece_kb.map(|p| format!("--piece-kb={p}")))
                        .stdout(if r == 0 {
                            Stdio::inherit()
                        } else {
                            Stdio::null()
                        })
                        .spawn()?,
                );
            }
            for mut c in children {
                if !c.wait()?.success() {
                    bail!("a rank failed");
                }
            }
            Ok(())
        }
        Cmd::Raw {
            sizes,
            bidir,
            sink: Some(addr),
        } => raw_sink(&addr, &sizes, bidir),
        Cmd::Raw {
            sizes,
            bidir,
            sink: None,
        } => raw_source(&sizes, bidir),
    }
}

fn ring_rank(
    rank: usize,
    world: usize,
    peers: &[String],
    sizes: &[String],
    iters: usize,
    piece_kb: Option<usize>,
) -> anyhow::Result<()> {
    let mut cfg = RingConfig::new(
        "allreduce-bench",
        rank,
        world,
        peers.to_vec(),
        b"bench".to_vec(),
    );
    if let Some(p) = piece_kb {
        cfg.max_frame_bytes = p << 10;
    }
    cfg.timeout = Duration::from_secs(120);
    let mut ring = TcpRing::start(None, cfg)?;
    if rank == 0 {
        println!("impl,world,bytes,iters,latency_us,algbw_GBps,busbw_GBps,wire_bytes_per_op");
    }
    for s in sizes {
        let bytes = parse_size(s)?;
        let n = bytes / 4;
        let mut buf: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
        for _ in 0..2 {
            ring.all_reduce(&mut buf)?;
        }
        let iters = iters_for(bytes, iters);
        let sent_before = ring
            .counters()
            .sent
            .load(std::sync::atomic::Ordering::Relaxed);
        let t = Instant::now();
        for _ in 0..iters {
            ring.all_reduce(&mut buf)?;
        }
        let dt = t.elapsed().as_secs_f64() / iters as f64;
        let sent = ring
            .counters()
            .sent
            .load(std::sync::atomic::Ordering::Relaxed)
            - sent_before;
        if rank == 0 {
            let algbw = bytes as f64 / dt / 1e9;
            let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
            println!(
                "accrue-ring,{world},{bytes},{iters},{:.1},{algbw:.3},{busbw:.3},{}",
                dt * 1e6,
                sent / iters as u64
            );
        }
    }
    Ok(())
}

fn raw_source(sizes: &[String], bidir: bool) -> anyhow::Result<()> {
    let listener = bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let mut args = vec![
        "raw".to_string(),
        "--sizes".into(),
        sizes.join(","),
        "--sink".into(),
        addr,
    ];
    if bidir {
        args.push("--bidir".into());
    }
    let mut child = Command::new(std::env::current_exe()?).args(&args).spawn()?;
    let (s, _) = listener.accept()?;
    s.set_nodelay(true).ok();
    println!("impl,bytes,iters,seconds_per_transfer,GBps_per_direction");
    for size in sizes {
        let bytes = parse_size(size)?;
        let iters = iters_for(bytes, 20);
        let t = Instant::now();
        for _ in 0..iters {
            transfer(&s, bytes, true, bidir)?;
        }
        let dt = t.elapsed().as_secs_f64() / iters as f64;
        let name = if bidir {
            "raw-tcp-both-ways"
        } else {
            "raw-tcp"
        };
        println!(
            "{name},{bytes},{iters},{dt:.6},{:.3}",
            bytes as f64 / dt / 1e9
        );
    }
    drop(s);
    child.wait()?;
    Ok(())
}

/// Moves `bytes` from the source to the sink (and, with `bidir`, the same
/// amount the other way at the same time), then exchanges a one-byte ack.
fn transfer(
    s: &std::net::TcpStream,
    bytes: usize,
    source: bool,
    bidir: bool,
) -> anyhow::Result<()> {
    let send = |mut w: &std::net::TcpStream| -> std::io::Result<()> {
        let chunk = vec![7u8; 4 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len());
            w.write_all(&chunk[..n])?;
            left -= n;
        }
        Ok(())
    };
    let recv = |mut r: &std::net::TcpStream| -> anyhow::Result<()> {
        let mut buf = vec![0u8; 4 << 20];
        let mut left = bytes;
        while left > 0 {
            let want = left.min(buf.len());
            let n = r.read(&mut buf[..want])?;
            if n == 0 {
                bail!("peer closed early");
            }
            left -= n;
        }
        Ok(())
    };
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let sender = (source || bidir).then(|| scope.spawn(|| send(s)));
        if !source || bidir {
            recv(s)?;
        }
        if let Some(h) = sender {
            h.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;
        }
        Ok(())
    })?;
    let mut ack = [0u8; 1];
    let mut w = s;
    if source {
        w.read_exact(&mut ack)?;
    } else {
        w.write_all(&[1])?;
    }
    Ok(())
}

fn raw_sink(addr: &str, sizes: &[String], bidir: bool) -> anyhow::Result<()> {
    let s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true).ok();
    for size in sizes {
        let bytes = parse_size(size)?;
        for _ in 0..iters_for(bytes, 20) {
            transfer(&s, bytes, false, bidir)?;
        }
    }
    Ok(())
}
