//! mesh-check: one rank of a device mesh that runs every group operation
//! against the arithmetic (worker/tests/groups.rs starts four of them as a
//! 2 x 2 mesh), then all-reduces until a peer is lost, then forms the next
//! generation with the survivors. Also `--bench`: all-reduce throughput of
//! the data group (docs/BENCHMARKS.md).
//!
//! Protocol with the parent, one line each:
//!   stdout `LISTEN <addr>`      this rank's ring listener (generation 1)
//!   stdin  `<addr>,<addr>,...`  every rank's listener, in rank order
//!   stdout `OPS OK` | `FAIL ...`, then `LOOPING`
//!   stdout `LOST <ms> <error>`  a loop operation failed, ms after the last success
//!   stdout `LISTEN2 <addr>`, stdin `<rank> <addr>,...` (the next generation)
//!   stdout `REFORMED <sum>`
use accrue_worker::comm::group::{Group, ReduceOp, KINDS};
use accrue_worker::comm::mesh::{Mesh, MeshConfig};
use accrue_worker::comm::mesh_collective::MeshCollective;
use accrue_worker::comm::{RingConfig, TcpRing};
use accrue_worker::spec::{Axis, CommBackend, ParallelDims};
use accrue_worker::Collective;
use anyhow::{bail, Context};
use clap::Parser;
use std::io::BufRead;
use std::net::TcpListener;
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};

#[derive(Parser)]
#[command(name = "mesh-check")]
struct Cli {
    #[arg(long)]
    rank: usize,
    #[arg(long)]
    data: u32,
    #[arg(long, default_value_t = 1)]
    pipeline: u32,
    #[arg(long, default_value_t = 1)]
    tensor: u32,
    /// ring | c10d | auto
    #[arg(long, default_value = "c10d")]
    backend: String,
    #[arg(long, default_value = "mesh-check")]
    job: String,
    /// The generation's key (hex or any text; tests pass a fixed one).
    #[arg(long, default_value = "mesh-check key")]
    secret: String,
    #[arg(long, default_value_t = 5.0)]
    timeout_s: f64,
    /// Run the throughput benchmark of the data group instead.
    #[arg(long)]
    bench: bool,
    #[arg(long, value_delimiter = ',', default_value = "1M,4M,16M,64M,256M")]
    sizes: Vec<String>,
    #[arg(long, default_value_t = 10)]
    iters: usize,
}

fn line() -> anyhow::Result<String> {
    let mut s = String::new();
    std::io::stdin().lock().read_line(&mut s)?;
    if s.is_empty() {
        bail!("the parent closed stdin");
    }
    Ok(s.trim().to_string())
}

fn form(
    cli: &Cli,
    listener: TcpListener,
    generation: u64,
    rank: usize,
    peers: Vec<String>,
    dims: ParallelDims,
) -> anyhow::Result<Mesh> {
    let mut cfg = RingConfig::new(
        cli.job.clone(),
        rank,
        peers.len(),
        peers,
        cli.secret.as_bytes().to_vec(),
    );
    cfg.generation = generation;
    cfg.timeout = Duration::from_secs_f64(cli.timeout_s);
    cfg.connect_timeout = Duration::from_secs(30);
    let ring = TcpRing::start(Some(listener), cfg).context("the world ring")?;
    let backend: CommBackend = cli
        .backend
        .parse()
        .map_err(|e| anyhow::anyhow!("--backend: {e}"))?;
    let mesh_cfg = MeshConfig {
        dims,
        backend,
        cuda: None,
        shared_gpu: false,
        host: "127.0.0.1".into(),
    };
    Ok(Mesh::form(ring, &mesh_cfg)?)
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let dims = ParallelDims {
        data: cli.data,
        pipeline: cli.pipeline,
        tensor: cli.tensor,
    };
    let l1 = TcpListener::bind("127.0.0.1:0")?;
    println!("LISTEN {}", l1.local_addr()?);
    let peers: Vec<String> = line()?.split(',').map(str::to_string).collect();
    let mut mesh = form(&cli, l1, 1, cli.rank, peers, dims)?;
    if cli.bench {
        return bench(&cli, mesh);
    }
    match check_all(&mut mesh, &dims) {
        Ok(()) => println!("OPS OK"),
        Err(e) => {
            println!("FAIL {e:#}");
            bail!("{e:#}");
        }
    }
    println!("LOOPING");
    let big = Tensor::ones([1 << 20], (Kind::Float, tch::Device::Cpu));
    let mut last = Instant::now();
    let err = loop {
        let r = mesh
            .axis(Axis::Data)
            .all_reduce(&big, ReduceOp::Sum)
            .and_then(|p| p.wait())
            .and_then(|_| mesh.world().all_reduce(&big, ReduceOp::Sum))
            .and_then(|p| p.wait());
        match r {
            Ok(()) => last = Instant::now(),
            Err(e) => break e,
        }
    };
    println!("LOST {} {err}", last.elapsed().as_millis());
    mesh.world().abort();
    drop(mesh);
    let l2 = TcpListener::bind("127.0.0.1:0")?;
    println!("LISTEN2 {}", l2.local_addr()?);
    let next = line()?;
    let (rank, peers) = next.split_once(' ').context("`<rank> <peers>`")?;
    let peers: Vec<String> = peers.split(',').map(str::to_string).collect();
    let world = peers.len() as u32;
    let mut mesh = form(
        &cli,
        l2,
        2,
        rank.parse()?,
        peers,
        ParallelDims::data_only(world),
    )?;
    let t = Tensor::from_slice(&[1.0f32]);
    mesh.axis(Axis::Data)
        .all_reduce(&t, ReduceOp::Sum)?
        .wait()?;
    println!("REFORMED {}", t.double_value(&[0]));
    Ok(())
}

/// The value rank `r` (world rank) holds at element `i`: small integers, so
/// every dtype carries and sums them exactly.
fn value(r: u32, i: i64) -> f64 {
    (r as f64 + 1.0) * 3.0 + i as f64
}

fn filled(r: u32, n: i64, kind: Kind) -> Tensor {
    let v: Vec<f64> = (0..n).map(|i| value(r, i)).collect();
    Tensor::from_slice(&v).to_kind(kind)
}

fn expect(what: &str, got: &Tensor, want: &[f64]) -> anyhow::Result<()> {
    let got: Vec<f64> = Vec::try_from(&got.to_kind(Kind::Double).flatten(0, -1))?;
    if got != want {
        bail!("{what}: got {got:?}, want {want:?}");
    }
    Ok(())
}

/// Every operation on every axis group of size > 1, in every dtype.
fn check_all(mesh: &mut Mesh, dims: &ParallelDims) -> anyhow::Result<()> {
    let me = mesh.rank();
    let mut groups: Vec<(String, Option<Axis>)> = vec![("world".into(), None)];
    for a in Axis::ALL {
        if dims.degree(a) > 1 {
            groups.push((a.name().into(), Some(a)));
        }
    }
    for (name, axis) in groups {
        let members: Vec<u32> = match axis {
            Some(a) => dims.group(me, a),
            None => (0..dims.world()).collect(),
        };
        let g: &mut dyn Group = match axis {
            Some(a) => mesh.axis(a),
            None => mesh.world(),
        };
        let (gr, gs, transport) = (g.rank(), g.size(), g.transport());
        let n = 4i64;
        for kind in KINDS {
            let w = |s: &str| format!("{name} {transport} {kind:?} {s}");
            // all-reduce sum and max, the handle waited on after other work
            let t = filled(me, n, kind);
            let pending = g.all_reduce(&t, ReduceOp::Sum)?;
            let _busy = Tensor::ones([64, 64], (Kind::Float, tch::Device::Cpu)).sum(Kind::Float);
            pending.wait()?;
            let want: Vec<f64> = (0..n)
                .map(|i| members.iter().map(|&r| value(r, i)).sum())
                .collect();
            expect(&w("all-reduce sum"), &t, &want)?;
            let t = filled(me, n, kind);
            g.all_reduce(&t, ReduceOp::Max)?.wait()?;
            let want: Vec<f64> = (0..n)
                .map(|i| {
                    members
                        .iter()
                        .map(|&r| value(r, i))
                        .fold(f64::MIN, f64::max)
                })
                .collect();
            expect(&w("all-reduce max"), &t, &want)?;
            // reduce-scatter: slice gr of the sum
            let input = filled(me, n * gs as i64, kind);
            let out = Tensor::zeros([n], (kind, tch::Device::Cpu));
            g.reduce_scatter(&out, &input, ReduceOp::Sum)?.wait()?;
            let want: Vec<f64> = (0..n)
                .map(|i| members.iter().map(|&r| value(r, gr as i64 * n + i)).sum())
                .collect();
            expect(&w("reduce-scatter"), &out, &want)?;
            // all-gather: every member's tensor in group order
            let input = filled(me, n, kind);
            let out = Tensor::zeros([n * gs as i64], (kind, tch::Device::Cpu));
            g.all_gather(&out, &input)?.wait()?;
            let want: Vec<f64> = members
                .iter()
                .flat_map(|&r| (0..n).map(move |i| value(r, i)))
                .collect();
            expect(&w("all-gather"), &out, &want)?;
            // broadcast from the last member
            let root = gs - 1;
            let t = filled(me, n, kind);
            g.broadcast(&t, root)?.wait()?;
            let want: Vec<f64> = (0..n).map(|i| value(members[root], i)).collect();
            expect(&w("broadcast"), &t, &want)?;
            // send and receive both ways between group ranks 0 and 1
            if transport == "c10d" && gr < 2 {
                let peer = 1 - gr;
                let mine = filled(me, n, kind);
                let theirs = Tensor::zeros([n], (kind, tch::Device::Cpu));
                let (r, s) = if gr == 0 {
                    let s = g.send(&mine, peer)?;
                    (g.recv(&theirs, peer)?, s)
                } else {
                    let r = g.recv(&theirs, peer)?;
                    (r, g.send(&mine, peer)?)
                };
                s.wait()?;
                r.wait()?;
                let want: Vec<f64> = (0..n).map(|i| value(members[peer], i)).collect();
                expect(&w("send/receive"), &theirs, &want)?;
            }
        }
    }
    Ok(())
}

fn parse_size(s: &str) -> anyhow::Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K') => (&s[..s.len() - 1], 1 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    Ok(num.parse::<usize>()? * mult)
}

/// All-reduce throughput of the data group the engine's way (the sync
/// step's `Collective::all_reduce_sum` on a flat f32 buffer, through
/// [`MeshCollective`]): one CSV line per size from rank 0.
fn bench(cli: &Cli, mesh: Mesh) -> anyhow::Result<()> {
    let transport = if mesh.on_control(Axis::Data) {
        "ring"
    } else {
        "c10d"
    };
    let mut c = MeshCollective::new(mesh);
    let (rank, w) = (c.rank(), c.world_size());
    if rank == 0 {
        println!("transport,world,bytes,iters,latency_us,busbw_GBps");
    }
    for s in &cli.sizes {
        let bytes = parse_size(s)?;
        let mut buf: Vec<f32> = (0..bytes / 4).map(|i| (i % 7) as f32).collect();
        for _ in 0..2 {
            c.all_reduce_sum(&mut buf)?;
        }
        let iters = if bytes >= 64 << 20 {
            cli.iters.min(5)
        } else {
            cli.iters
        };
        let start = Instant::now();
        for _ in 0..iters {
            c.all_reduce_sum(&mut buf)?;
        }
        let per = start.elapsed().as_secs_f64() / iters as f64;
        let busbw = bytes as f64 * 2.0 * (w as f64 - 1.0) / w as f64 / per / 1e9;
        if rank == 0 {
            println!(
                "{transport},{w},{bytes},{iters},{:.1},{busbw:.3}",
                per * 1e6
            );
        }
    }
    Ok(())
}
