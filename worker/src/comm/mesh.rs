//! Forms a generation's process groups, one per mesh axis and one for the
//! world, on the transport `[comm] backend` picks for each
//! ([`Transport::for_axis`]). The world ring (authenticated, formed first)
//! is the bootstrap: it carries the c10d store's address and each ring
//! group's listening address, so nothing unauthenticated decides who joins.

use crate::comm::c10d::store::{StoreClient, StoreLimits, StoreServer};
use crate::comm::c10d::C10dGroup;
use crate::comm::collective::Collective;
use crate::comm::group::{Group, GroupError, RingGroup};
use crate::comm::{RingConfig, TcpRing};
use crate::spec::{Axis, CommBackend, ParallelDims};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

/// `[comm] backend` as resolved for one axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Ring,
    C10d,
}

impl Transport {
    /// The transport of `axis` (None: the world group) under `backend`.
    /// The ring has no point-to-point, so pipeline and tensor groups are
    /// c10d whatever the backend says.
    pub fn for_axis(backend: CommBackend, axis: Option<Axis>, cuda: bool) -> Self {
        match (backend, axis) {
            (_, Some(Axis::Pipeline | Axis::Tensor)) => Transport::C10d,
            (CommBackend::Ring, _) => Transport::Ring,
            (CommBackend::C10d, _) => Transport::C10d,
            (CommBackend::Auto, _) if cuda => Transport::C10d,
            (CommBackend::Auto, _) => Transport::Ring,
        }
    }
}

/// What forming a mesh needs beyond the world ring.
#[derive(Clone, Debug)]
pub struct MeshConfig {
    pub dims: ParallelDims,
    pub backend: CommBackend,
    /// The CUDA device the model lives on (None: the CPU): auto picks
    /// c10d then, and c10d is NCCL on this device.
    pub cuda: Option<usize>,
    /// Whether two ranks of the world share a GPU (a CUDA job with two
    /// ranks on one host: the device a spec names is the same one there).
    /// NCCL refuses that, so auto keeps the data axis on the ring.
    pub shared_gpu: bool,
    /// This rank's interface: ring groups listen and gloo binds here.
    pub host: String,
}

/// The host part of a ring address (`host:port`, `[v6]:port`).
fn host_of(peer: &str) -> &str {
    peer.rsplit_once(':')
        .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
        .unwrap_or(peer)
}

/// Whether two of `peers` (ring addresses) are on one host.
pub fn shares_host(peers: &[String]) -> bool {
    let mut hosts: Vec<&str> = peers.iter().map(|p| host_of(p)).collect();
    hosts.sort_unstable();
    hosts.windows(2).any(|w| w[0] == w[1])
}

impl MeshConfig {
    /// The mesh of a job of `world` ranks: the spec's degrees, its
    /// backend, and this rank's interface (the host of its ring address,
    /// `peers[rank]`); `cuda`: the job's CUDA device, if it runs on one.
    pub fn for_job(
        spec: &crate::JobSpec,
        world: u32,
        peers: &[String],
        rank: usize,
        cuda: Option<usize>,
    ) -> Result<Self, String> {
        let dims = spec.parallel_dims_for(world).map_err(|e| e.to_string())?;
        let backend = spec.comm.backend;
        let host = peers
            .get(rank)
            .map(|p| host_of(p).to_string())
            .unwrap_or_else(|| "127.0.0.1".into());
        Ok(Self {
            dims,
            backend,
            cuda,
            shared_gpu: cuda.is_some() && shares_host(peers),
            host,
        })
    }

    /// The transport of `axis`'s groups (None: the world's). A group of one
    /// rank is a ring of one, which needs no sockets and no store, except
    /// in a one-rank job that asked for c10d: there its groups are c10d
    /// groups of one, so it runs the path a larger job takes (NCCL on one
    /// GPU). On CUDA with two ranks on one GPU, auto keeps the world and
    /// the data axis on the ring (NCCL cannot run them).
    pub fn transport(&self, axis: Option<Axis>) -> Transport {
        let size = match axis {
            Some(a) => self.dims.degree(a),
            None => self.dims.world(),
        };
        let one_rank_c10d = self.backend == CommBackend::C10d && self.dims.world() == 1;
        if size == 1 && !one_rank_c10d {
            return Transport::Ring;
        }
        let data_or_world = matches!(axis, None | Some(Axis::Data));
        if self.backend == CommBackend::Auto && self.shared_gpu && data_or_world {
            return Transport::Ring;
        }
        Transport::for_axis(self.backend, axis, self.cuda.is_some())
    }

    /// The CUDA device whose NCCL carries this job's c10d groups: none on
    /// the CPU, and none where ranks share a GPU (NCCL cannot run two
    /// ranks on one GPU): there the c10d groups that must be c10d (the
    /// pipeline and tensor axes, point to point) are gloo through the host.
    pub fn nccl_device(&self) -> Option<usize> {
        self.cuda.filter(|_| !self.shared_gpu)
    }

    /// Refuses c10d for the data axis or the world where two ranks share
    /// a GPU (asked for as `backend = "c10d"`), naming the way out.
    fn check_nccl(&self) -> Result<(), GroupError> {
        let c10d = [None, Some(Axis::Data)]
            .into_iter()
            .any(|a| self.transport(a) == Transport::C10d);
        match self.cuda {
            Some(d) if self.shared_gpu && c10d => Err(setup(format!(
                "c10d on CUDA is NCCL, which cannot run two ranks on one GPU, and ranks of \
                 this job share cuda:{d} on one host: give each worker its own GPU, or set \
                 [comm] backend = \"ring\" (or \"auto\") to keep the data axis on the ring"
            ))),
            _ => Ok(()),
        }
    }
}

/// One generation's groups. The world ring formed first stays as the
/// control ring (byte broadcasts, barriers, the bootstrap of the rest); a
/// group that spans the world on the ring is that ring itself.
pub struct Mesh {
    dims: ParallelDims,
    rank: u32,
    control: RingGroup,
    /// The world's group when it is not the control ring (c10d).
    world: Option<Box<dyn Group>>,
    /// Per axis in Axis::ALL order; None: the world's group.
    axes: Vec<Option<Box<dyn Group>>>,
    // Kept for the groups' lifetime: world rank 0 serves the store.
    _store: Option<StoreServer>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("dims", &self.dims)
            .field("rank", &self.rank)
            .finish()
    }
}

/// The name of `rank`'s group on `axis`: the axis and its first member
/// (unique in the generation).
pub fn group_name(dims: &ParallelDims, rank: u32, axis: Option<Axis>) -> String {
    match axis {
        None => "world".into(),
        Some(a) => format!("{}@{}", a.name(), dims.group(rank, a)[0]),
    }
}

fn setup(m: impl Into<String>) -> GroupError {
    GroupError::Setup(m.into())
}

impl Mesh {
    /// Forms every group of `ring`'s generation: `ring` is the formed world
    /// ring (its config names the job, generation, key and timeouts).
    pub fn form(ring: TcpRing, cfg: &MeshConfig) -> Result<Self, GroupError> {
        let world_cfg = ring.config().clone();
        let (rank, world) = (world_cfg.rank as u32, world_cfg.world as u32);
        if cfg.dims.world() != world {
            return Err(setup(format!(
                "the mesh {:?} has {} ranks but the ring has {world}",
                cfg.dims,
                cfg.dims.world()
            )));
        }
        cfg.check_nccl()?;
        let mut control = RingGroup::new(ring);
        let wants_c10d = std::iter::once(None)
            .chain(Axis::ALL.map(Some))
            .any(|a| cfg.transport(a) == Transport::C10d);
        // The c10d store: rank 0 serves, its address goes over the ring.
        let (store, client) = if wants_c10d {
            let server = if rank == 0 {
                Some(
                    StoreServer::start_with(
                        &cfg.host,
                        world_cfg.secret.clone(),
                        &world_cfg.job,
                        world_cfg.generation,
                        world,
                        StoreLimits {
                            max_pending_handshakes: world_cfg.max_pending_handshakes,
                            handshake_timeout: world_cfg.handshake_timeout,
                        },
                    )
                    .map_err(|e| setup(e.to_string()))?,
                )
            } else {
                None
            };
            let mut addr = server
                .as_ref()
                .map(|s| s.addr().to_string().into_bytes())
                .unwrap_or_default();
            control.ring().broadcast_bytes(&mut addr, 0)?;
            let addr = String::from_utf8_lossy(&addr)
                .parse()
                .map_err(|e| setup(format!("the c10d store's address: {e}")))?;
            let client = StoreClient::connect(
                addr,
                &world_cfg.secret,
                &world_cfg.job,
                world_cfg.generation,
                rank,
                world_cfg.connect_timeout,
            )
            .map_err(|e| setup(e.to_string()))?;
            (server, Some(Arc::new(Mutex::new(client))))
        } else {
            (None, None)
        };
        let world_group = match cfg.transport(None) {
            Transport::Ring => None,
            Transport::C10d => Some(Self::group(
                &mut control,
                client.as_ref(),
                cfg,
                &world_cfg,
                None,
                Transport::C10d,
            )?),
        };
        let mut axes = Vec::new();
        for axis in Axis::ALL {
            let t = cfg.transport(Some(axis));
            let spans_world = cfg.dims.degree(axis) == world && world > 1;
            let same_as_world = spans_world && t == cfg.transport(None);
            axes.push(if same_as_world {
                None
            } else {
                Some(Self::group(
                    &mut control,
                    client.as_ref(),
                    cfg,
                    &world_cfg,
                    Some(axis),
                    t,
                )?)
            });
        }
        let name = |a: Option<Axis>| match (cfg.transport(a), cfg.nccl_device()) {
            (Transport::Ring, _) => "ring",
            (Transport::C10d, None) => "c10d",
            (Transport::C10d, Some(_)) => "nccl",
        };
        tracing::info!(
            world = name(None),
            data = name(Some(Axis::Data)),
            pipeline = name(Some(Axis::Pipeline)),
            tensor = name(Some(Axis::Tensor)),
            dims = ?cfg.dims,
            "process groups formed"
        );
        Ok(Self {
            dims: cfg.dims,
            rank,
            control,
            world: world_group,
            axes,
            _store: store,
        })
    }

    /// Forms this rank's group on `axis` (None: the world) over `t`.
    fn group(
        control: &mut RingGroup,
        client: Option<&Arc<Mutex<StoreClient>>>,
        cfg: &MeshConfig,
        world_cfg: &RingConfig,
        axis: Option<Axis>,
        t: Transport,
    ) -> Result<Box<dyn Group>, GroupError> {
        let rank = world_cfg.rank as u32;
        let members: Vec<u32> = match axis {
            Some(a) => cfg.dims.group(rank, a),
            None => (0..cfg.dims.world()).collect(),
        };
        let me = members.iter().position(|&r| r == rank).unwrap_or(0);
        let name = group_name(&cfg.dims, rank, axis);
        match t {
            Transport::C10d => {
                let client = client.ok_or_else(|| setup("no c10d store in this generation"))?;
                let (size, timeout) = (members.len(), world_cfg.timeout);
                let g = match cfg.nccl_device() {
                    Some(d) => C10dGroup::nccl(client.clone(), &name, me, size, timeout, d)?,
                    None => C10dGroup::gloo(client.clone(), &name, &cfg.host, me, size, timeout)?,
                };
                Ok(Box::new(g))
            }
            Transport::Ring if members.len() == 1 => {
                let mut rc = world_cfg.clone();
                rc.job = format!("{}#{name}", world_cfg.job);
                (rc.rank, rc.world, rc.peers) = (0, 1, Vec::new());
                Ok(Box::new(RingGroup::new(TcpRing::start(None, rc)?)))
            }
            Transport::Ring => {
                // Every rank binds a listener and learns every other's
                // address over the control ring (the group's members among them).
                let listener = TcpListener::bind((cfg.host.as_str(), 0))
                    .map_err(|e| setup(format!("ring group {name} cannot listen: {e}")))?;
                let mine = listener
                    .local_addr()
                    .map_err(|e| setup(e.to_string()))?
                    .to_string();
                let all = all_gather_strings(control.ring(), &mine)?;
                let peers = members
                    .iter()
                    .map(|&r| all[r as usize].clone())
                    .collect::<Vec<_>>();
                let mut rc = world_cfg.clone();
                rc.job = format!("{}#{name}", world_cfg.job);
                rc.rank = me;
                rc.world = members.len();
                rc.peers = peers;
                let ring = TcpRing::start(Some(listener), rc)?;
                Ok(Box::new(RingGroup::new(ring)))
            }
        }
    }

    pub fn dims(&self) -> &ParallelDims {
        &self.dims
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The world ring: byte broadcasts, barriers, agreement.
    pub fn control(&mut self) -> &mut TcpRing {
        self.control.ring()
    }

    /// Bytes (sent, received) on the control ring (c10d's own traffic is
    /// not counted).
    pub fn control_bytes(&self) -> (u64, u64) {
        Collective::bytes(self.control.ring_ref())
    }

    /// The whole world's group.
    pub fn world(&mut self) -> &mut dyn Group {
        match self.world.as_mut() {
            Some(g) => g.as_mut(),
            None => &mut self.control,
        }
    }

    /// Whether `axis`'s group is the control ring itself.
    pub fn on_control(&self, axis: Axis) -> bool {
        self.world.is_none() && self.axes[axis_index(axis)].is_none()
    }

    /// This rank's group along `axis`.
    pub fn axis(&mut self, axis: Axis) -> &mut dyn Group {
        if self.axes[axis_index(axis)].is_none() {
            return self.world();
        }
        match self.axes[axis_index(axis)].as_mut() {
            Some(g) => g.as_mut(),
            // Checked just above.
            None => unreachable!(),
        }
    }

    /// Fails every group's pending and later operations.
    pub fn abort(&mut self) {
        for g in self.axes.iter_mut().flatten() {
            g.abort();
        }
        if let Some(g) = self.world.as_mut() {
            g.abort();
        }
        self.control.abort();
    }
}

fn axis_index(axis: Axis) -> usize {
    match axis {
        Axis::Data => 0,
        Axis::Pipeline => 1,
        Axis::Tensor => 2,
    }
}

/// Every rank's string over the ring, in rank order (one byte broadcast
/// per rank).
fn all_gather_strings(ring: &mut TcpRing, mine: &str) -> Result<Vec<String>, GroupError> {
    let world = ring.world_size();
    let me = ring.rank();
    let mut out = Vec::with_capacity(world);
    for root in 0..world {
        let mut b = if root == me {
            mine.as_bytes().to_vec()
        } else {
            Vec::new()
        };
        ring.broadcast_bytes(&mut b, root)?;
        out.push(String::from_utf8_lossy(&b).into_owned());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_keeps_the_ring_for_the_cpu_data_axis_only() {
        use Transport::*;
        let t = |b, a, cuda| Transport::for_axis(b, a, cuda);
        assert_eq!(t(CommBackend::Auto, Some(Axis::Data), false), Ring);
        assert_eq!(t(CommBackend::Auto, None, false), Ring);
        assert_eq!(t(CommBackend::Auto, Some(Axis::Data), true), C10d);
        assert_eq!(t(CommBackend::Auto, Some(Axis::Tensor), false), C10d);
        assert_eq!(t(CommBackend::Ring, Some(Axis::Pipeline), false), C10d);
        assert_eq!(t(CommBackend::Ring, Some(Axis::Data), true), Ring);
        assert_eq!(t(CommBackend::C10d, Some(Axis::Data), false), C10d);
        assert!("nccl".parse::<CommBackend>().is_err());
    }

    #[test]
    fn group_names_are_unique_per_group() {
        let d = ParallelDims {
            data: 2,
            pipeline: 2,
            tensor: 1,
        };
        assert_eq!(group_name(&d, 3, Some(Axis::Data)), "data@1");
        assert_eq!(group_name(&d, 1, Some(Axis::Data)), "data@1");
        assert_eq!(group_name(&d, 3, Some(Axis::Pipeline)), "pipeline@2");
        assert_eq!(group_name(&d, 0, None), "world");
    }

    fn cfg(data: u32, backend: CommBackend, cuda: Option<usize>, peers: &[&str]) -> MeshConfig {
        let peers: Vec<String> = peers.iter().map(|p| p.to_string()).collect();
        MeshConfig {
            dims: ParallelDims {
                data,
                pipeline: 1,
                tensor: 1,
            },
            backend,
            cuda,
            shared_gpu: cuda.is_some() && shares_host(&peers),
            host: "127.0.0.1".into(),
        }
    }

    #[test]
    fn two_ranks_on_one_gpu_stay_on_the_ring_and_nccl_is_refused_there() {
        use Transport::*;
        assert!(shares_host(&["10.0.0.1:5".into(), "10.0.0.1:6".into()]));
        assert!(!shares_host(&["10.0.0.1:5".into(), "10.0.0.2:5".into()]));
        assert!(shares_host(&["[::1]:5".into(), "[::1]:6".into()]));
        // Two local workers on cuda:0: auto keeps data and world on the ring.
        let local = cfg(
            2,
            CommBackend::Auto,
            Some(0),
            &["127.0.0.1:1", "127.0.0.1:2"],
        );
        assert!(local.shared_gpu);
        assert_eq!(local.transport(Some(Axis::Data)), Ring);
        assert_eq!(local.transport(None), Ring);
        assert!(local.check_nccl().is_ok());
        // One GPU per host: auto on CUDA is c10d (NCCL).
        let pods = cfg(2, CommBackend::Auto, Some(0), &["10.0.0.1:1", "10.0.0.2:1"]);
        assert_eq!(pods.transport(Some(Axis::Data)), C10d);
        assert!(pods.check_nccl().is_ok());
        // c10d asked for on a shared GPU: refused, naming the way out.
        let asked = cfg(
            2,
            CommBackend::C10d,
            Some(0),
            &["127.0.0.1:1", "127.0.0.1:2"],
        );
        let e = asked.check_nccl().unwrap_err().to_string();
        assert!(
            e.contains("cuda:0") && e.contains("backend = \"ring\""),
            "{e}"
        );
        // The CPU has no such limit.
        let cpu = cfg(2, CommBackend::C10d, None, &["127.0.0.1:1", "127.0.0.1:2"]);
        assert!(!cpu.shared_gpu && cpu.check_nccl().is_ok());
        assert_eq!(cpu.nccl_device(), None);
        // Two pipeline stages sharing cuda:0: their axis is c10d (point to
        // point) on gloo, not NCCL, and not refused.
        let mut stages = cfg(
            1,
            CommBackend::Auto,
            Some(0),
            &["127.0.0.1:1", "127.0.0.1:2"],
        );
        stages.dims.pipeline = 2;
        assert_eq!(stages.transport(Some(Axis::Pipeline)), C10d);
        assert_eq!(stages.nccl_device(), None);
        assert!(stages.check_nccl().is_ok());
        // A stage per host: NCCL on the job's GPU.
        let mut apart = cfg(1, CommBackend::Auto, Some(0), &["10.0.0.1:1", "10.0.0.2:1"]);
        apart.dims.pipeline = 2;
        assert_eq!(apart.nccl_device(), Some(0));
    }

    #[test]
    fn a_one_rank_job_that_asks_for_c10d_gets_c10d_groups() {
        use Transport::*;
        let one = cfg(1, CommBackend::C10d, Some(0), &["127.0.0.1:1"]);
        assert_eq!(one.transport(None), C10d);
        assert_eq!(one.transport(Some(Axis::Data)), C10d);
        // Otherwise a group of one is a ring of one.
        assert_eq!(
            cfg(1, CommBackend::Auto, Some(0), &["h:1"]).transport(None),
            Ring
        );
        let two = cfg(2, CommBackend::C10d, None, &["a:1", "b:1"]);
        assert_eq!(two.transport(Some(Axis::Tensor)), Ring);
        assert_eq!(two.transport(Some(Axis::Data)), C10d);
    }
}
