//! The engine's device mesh: the job's degrees ([`ParallelDims`]), this
//! rank's coordinates ([`Coords`]) and a group per named axis. The engine
//! builds it once from its collective ([`Collective::place`]) and asks it
//! every question about its place: the data degree k follows, its
//! pipeline stage, its tensor rank, whether it writes the checkpoints,
//! the axes the clip norm and the tally are combined over. Every answer
//! delegates to `ParallelDims` / `Coords`: the engine does no rank
//! arithmetic of its own.
//!
//! The groups: the data axis's is the collective itself (gradients,
//! ZeRO's slices, the tally); a split axis's (pipeline, tensor) is
//! [`Collective::group`] of the current generation.
//!
//! **A new axis** (expert parallelism, say) is one [`Axis`] variant with
//! its degree in `ParallelDims` (common/src/spec/parallel.rs) and one
//! group in the communication mesh (comm/mesh.rs); [`Mesh::has`],
//! [`Mesh::along`] and [`Mesh::group`] then serve it unchanged, and a
//! placement or the norm (engine/norm.rs) names it where it matters.

use crate::comm::collective::{Collective, MeshPlace};
use crate::comm::group::Group;
use crate::comm::tensor_ops::TensorGroup;
use crate::error::{Error, Result};
use crate::spec::{Axis, Coords, JobSpec, ParallelDims};

/// The axes over which the ranks computing parts of one loss lie: the
/// loss owner's ([`ParallelDims::loss_owner`]) data group. The tally is
/// summed over them (and over the stages, where only the last counts
/// terms: [`Mesh::tally_axes`]); tensor ranks each hold the same loss.
pub(super) const LOSS_OWNER: &[Axis] = &[Axis::Data];

/// This rank's place in the job's mesh (a copy: the groups are the
/// collective's, renewed every generation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    place: MeshPlace,
}

impl Mesh {
    pub fn new(place: MeshPlace) -> Self {
        Self { place }
    }

    /// The place `collective` reports.
    pub fn of(collective: &impl Collective) -> Self {
        Self::new(collective.place())
    }

    pub fn dims(&self) -> ParallelDims {
        self.place.dims
    }

    pub fn coords(&self) -> Coords {
        self.place.at
    }

    /// The number of ranks along `axis`.
    pub fn degree(&self, axis: Axis) -> usize {
        self.place.dims.degree(axis) as usize
    }

    /// This rank's coordinate along `axis`.
    pub fn coord(&self, axis: Axis) -> usize {
        self.place.at.on(axis) as usize
    }

    /// Whether `axis` is split over more than one rank.
    pub fn has(&self, axis: Axis) -> bool {
        self.degree(axis) > 1
    }

    /// Whether the model is split (pipeline stages or tensor shards): a
    /// replica is more than one rank.
    pub fn is_split(&self) -> bool {
        self.place.dims.replica() > 1
    }

    /// (this rank's coordinate, the degree) along `axis` when it is split;
    /// None otherwise.
    pub fn along(&self, axis: Axis) -> Option<(usize, usize)> {
        self.has(axis)
            .then(|| (self.coord(axis), self.degree(axis)))
    }

    /// (stage, stages) of a split model; None when it is whole.
    pub fn stages(&self) -> Option<(usize, usize)> {
        self.along(Axis::Pipeline)
    }

    /// (tensor rank, tensor degree) under tensor parallelism; None at T = 1.
    pub fn tensor(&self) -> Option<(usize, usize)> {
        self.along(Axis::Tensor)
    }

    /// The tensor rank (0 without tensor parallelism).
    pub fn tensor_rank(&self) -> usize {
        self.coord(Axis::Tensor)
    }

    pub fn is_first_stage(&self) -> bool {
        self.coord(Axis::Pipeline) == 0
    }

    pub fn is_last_stage(&self) -> bool {
        self.place.dims.is_last(self.place.at, Axis::Pipeline)
    }

    /// The last stage (the loss owner's, [`ParallelDims::loss_owner`]):
    /// its rank in the pipeline group.
    pub fn last_stage(&self) -> usize {
        let dims = self.place.dims;
        dims.coords(dims.loss_owner()).on(Axis::Pipeline) as usize
    }

    /// Whether this rank writes the checkpoints: the world's first rank
    /// (data rank 0 of the first stage, tensor rank 0; every other rank
    /// hands it its part).
    pub fn writes_checkpoints(&self) -> bool {
        self.place.dims.rank(self.place.at) == 0
    }

    /// k, the micro-steps per window, for the data degree: the
    /// coordinator's k for the whole mesh (its pipeline and tensor ranks
    /// share their replica's samples).
    pub fn accumulation_steps(&self, spec: &JobSpec) -> Result<usize> {
        let data = self.degree(Axis::Data) as u64;
        Ok(spec
            .accumulation_steps_for_data(data)
            .map_err(|e| crate::spec::SpecErrors(vec![e]))? as usize)
    }

    /// The axes the window's tally is summed over: the loss owner's
    /// ([`LOSS_OWNER`]), then the stages when the model is split (only
    /// the last stage counts terms; any may ask to stop or checkpoint).
    pub fn tally_axes(&self) -> Vec<Axis> {
        let mut axes = LOSS_OWNER.to_vec();
        if self.has(Axis::Pipeline) {
            axes.push(Axis::Pipeline);
        }
        axes
    }

    /// Whether `other` (a new generation's place) keeps this rank on the
    /// same model split: the same stage and tensor rank of the same
    /// degrees (its model holds that part).
    pub fn same_split(&self, other: &Mesh) -> bool {
        self.stages() == other.stages() && self.tensor() == other.tensor()
    }

    /// This rank's group along a split `axis` (the data axis's is the
    /// collective itself).
    pub fn group<'c, C: Collective>(
        &self,
        collective: &'c mut C,
        axis: Axis,
    ) -> Result<&'c mut dyn Group> {
        Ok(collective.group(axis)?)
    }

    /// The tensor group as the model's operations take it; None at T = 1.
    pub fn tensor_group<C: Collective>(&self, collective: &mut C) -> Result<Option<TensorGroup>> {
        if !self.has(Axis::Tensor) {
            return Ok(None);
        }
        let g = self.group(collective, Axis::Tensor)?;
        g.tensor_group().map(Some).ok_or_else(|| {
            Error::Schedule(format!(
                "the tensor group runs on {}, tensor parallelism needs c10d",
                g.transport()
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::collective::SingleRank;

    fn mesh(d: u32, p: u32, t: u32, rank: u32) -> Mesh {
        let dims = ParallelDims {
            data: d,
            pipeline: p,
            tensor: t,
        };
        Mesh::new(MeshPlace::of(dims, rank))
    }

    #[test]
    fn coordinates_and_degrees_are_the_dims() {
        for (d, p, t) in [
            (1, 1, 1),
            (4, 1, 1),
            (2, 2, 1),
            (1, 2, 2),
            (2, 2, 2),
            (3, 1, 2),
        ] {
            let dims = ParallelDims {
                data: d,
                pipeline: p,
                tensor: t,
            };
            for r in 0..dims.world() {
                let m = mesh(d, p, t, r);
                let at = dims.coords(r);
                for axis in Axis::ALL {
                    assert_eq!(m.degree(axis), dims.degree(axis) as usize);
                    assert_eq!(m.coord(axis), at.on(axis) as usize);
                    assert_eq!(m.has(axis), dims.degree(axis) > 1);
                }
                assert_eq!(m.stages().is_some(), p > 1);
                assert_eq!(m.tensor().is_some(), t > 1);
                assert_eq!(m.tensor_rank(), at.tensor as usize);
                assert_eq!(m.is_first_stage(), at.pipeline == 0);
                assert_eq!(m.is_last_stage(), at.pipeline == p - 1);
                assert_eq!(m.writes_checkpoints(), r == 0);
                assert_eq!(m.last_stage(), p as usize - 1);
                assert_eq!(m.is_split(), p * t > 1);
            }
        }
        // D = 2, P = 2, T = 2: rank 5 is data 1, stage 0, tensor 1.
        let m = mesh(2, 2, 2, 5);
        assert_eq!((m.stages(), m.tensor()), (Some((0, 2)), Some((1, 2))));
        assert!(m.is_first_stage() && !m.is_last_stage());
        assert_eq!(m.tally_axes(), vec![Axis::Data, Axis::Pipeline]);
        // Rank 2 (data 0, last stage, tensor 0) is the loss owner.
        let owner = mesh(2, 2, 2, 2);
        assert_eq!(owner.dims().loss_owner(), 2);
        assert!(owner.is_last_stage() && owner.tensor_rank() == 0);
    }

    #[test]
    fn a_single_group_collective_is_data_only() {
        let m = Mesh::of(&SingleRank);
        assert_eq!(m.dims(), ParallelDims::data_only(1));
        assert_eq!(m.coords(), Coords::default());
        assert!(m.writes_checkpoints() && m.is_first_stage() && m.is_last_stage());
        assert_eq!((m.stages(), m.tensor()), (None, None));
        assert_eq!(m.tally_axes(), LOSS_OWNER.to_vec());
        let m = Mesh::new(MeshPlace::data_only(4, 3));
        assert_eq!((m.degree(Axis::Data), m.coord(Axis::Data)), (4, 3));
        assert!(!m.writes_checkpoints());
        assert!(m.same_split(&Mesh::new(MeshPlace::data_only(2, 1))));
        assert!(!mesh(1, 2, 1, 0).same_split(&mesh(1, 2, 1, 1)));
        assert!(Mesh::of(&SingleRank)
            .group(&mut SingleRank, Axis::Pipeline)
            .is_err());
    }

    #[test]
    fn k_follows_the_data_degree() {
        let text = "name = \"mesh\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 2\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n[accumulation]\nglobal_batch = 32\n";
        let spec = JobSpec::from_toml_str(text, std::path::Path::new("t")).expect("a spec");
        // 4 workers as D = 2 x T = 2: k from the data degree 2, not 4.
        assert_eq!(mesh(2, 1, 2, 0).accumulation_steps(&spec).unwrap(), 8);
        assert_eq!(mesh(2, 2, 1, 3).accumulation_steps(&spec).unwrap(), 8);
        assert_eq!(mesh(4, 1, 1, 0).accumulation_steps(&spec).unwrap(), 4);
    }
}
