//! The device mesh's arithmetic (issue 38): the degrees of the data,
//! pipeline and tensor axes, their checks, and where each rank sits. One
//! value ([`ParallelDims`]) owns it, as torchtitan's `ParallelDims` does;
//! nothing else does rank arithmetic.
//!
//! Rank layout: tensor innermost, then pipeline, then data:
//!
//! ```text
//! rank = (data * pipeline_degree + pipeline) * tensor_degree + tensor
//!
//! D = 2, P = 2, T = 2 (8 ranks):
//!              tensor 0  tensor 1
//! data 0  pp 0    0         1
//!         pp 1    2         3
//! data 1  pp 0    4         5
//!         pp 1    6         7
//! ```
//!
//! Tensor-parallel ranks are neighbours (on one host, the fastest links);
//! a replica (one copy of the model: P x T ranks) is a contiguous block, so
//! the coordinator forms, shrinks and grows a job in whole replicas.

use super::FieldError;

/// One axis of the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    Data,
    Pipeline,
    Tensor,
}

impl Axis {
    pub const ALL: [Axis; 3] = [Axis::Data, Axis::Pipeline, Axis::Tensor];

    pub fn name(self) -> &'static str {
        match self {
            Axis::Data => "data",
            Axis::Pipeline => "pipeline",
            Axis::Tensor => "tensor",
        }
    }
}

/// Where a rank sits on each axis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Coords {
    pub data: u32,
    pub pipeline: u32,
    pub tensor: u32,
}

impl Coords {
    pub fn on(&self, axis: Axis) -> u32 {
        match axis {
            Axis::Data => self.data,
            Axis::Pipeline => self.pipeline,
            Axis::Tensor => self.tensor,
        }
    }
}

/// The degrees of the three axes; their product is the world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParallelDims {
    pub data: u32,
    pub pipeline: u32,
    pub tensor: u32,
}

impl ParallelDims {
    /// Data parallelism alone over `world` ranks.
    pub fn data_only(world: u32) -> Self {
        Self {
            data: world,
            pipeline: 1,
            tensor: 1,
        }
    }

    /// The degrees for `workers` ranks from `[parallel]`'s fields: pipeline
    /// and tensor default to 1, data to workers / (pipeline x tensor). A
    /// degree of 0, or a product that is not `workers`, is refused naming
    /// all four numbers.
    pub fn resolve(
        workers: u32,
        data: Option<u32>,
        pipeline: Option<u32>,
        tensor: Option<u32>,
    ) -> Result<Self, FieldError> {
        let (p, t) = (pipeline.unwrap_or(1), tensor.unwrap_or(1));
        let shown = |d: Option<u32>| d.map_or_else(|| "unset".to_string(), |d| d.to_string());
        let refuse = |field: &str, value: String, why: String| FieldError {
            field: field.into(),
            value,
            allowed: why,
        };
        for (field, v) in [
            ("parallel.data", data),
            ("parallel.pipeline", pipeline),
            ("parallel.tensor", tensor),
        ] {
            if v == Some(0) {
                return Err(refuse(field, "0".into(), "must be an integer >= 1".into()));
            }
        }
        let replica = u64::from(p) * u64::from(t);
        let d = match data {
            Some(d) => d,
            None if replica > 0 && u64::from(workers) % replica == 0 => {
                (u64::from(workers) / replica) as u32
            }
            None => {
                return Err(refuse(
                    "parallel",
                    format!("{{pipeline = {p}, tensor = {t}}}"),
                    format!(
                        "pipeline x tensor = {replica} must divide workers = {workers} (data = workers / (pipeline x tensor))"
                    ),
                ))
            }
        };
        if u64::from(d) * replica != u64::from(workers) {
            return Err(refuse(
                "parallel",
                format!("{{data = {}, pipeline = {p}, tensor = {t}}}", shown(data)),
                format!(
                    "data x pipeline x tensor = {} must equal workers = {workers}",
                    u64::from(d) * replica
                ),
            ));
        }
        Ok(Self {
            data: d,
            pipeline: p,
            tensor: t,
        })
    }

    pub fn world(&self) -> u32 {
        self.data * self.pipeline * self.tensor
    }

    /// Ranks of one model replica (pipeline x tensor).
    pub fn replica(&self) -> u32 {
        self.pipeline * self.tensor
    }

    pub fn degree(&self, axis: Axis) -> u32 {
        match axis {
            Axis::Data => self.data,
            Axis::Pipeline => self.pipeline,
            Axis::Tensor => self.tensor,
        }
    }

    /// Where `rank` (< world) sits.
    pub fn coords(&self, rank: u32) -> Coords {
        Coords {
            tensor: rank % self.tensor,
            pipeline: (rank / self.tensor) % self.pipeline,
            data: rank / (self.tensor * self.pipeline),
        }
    }

    /// The rank at `c`.
    pub fn rank(&self, c: Coords) -> u32 {
        (c.data * self.pipeline + c.pipeline) * self.tensor + c.tensor
    }

    /// The ranks of `rank`'s group along `axis`, in axis order: those that
    /// differ from it on that axis alone.
    pub fn group(&self, rank: u32, axis: Axis) -> Vec<u32> {
        let at = self.coords(rank);
        (0..self.degree(axis))
            .map(|i| {
                let mut c = at;
                match axis {
                    Axis::Data => c.data = i,
                    Axis::Pipeline => c.pipeline = i,
                    Axis::Tensor => c.tensor = i,
                }
                self.rank(c)
            })
            .collect()
    }

    /// Whether `at` is the last place along `axis` (the last pipeline
    /// stage, say).
    pub fn is_last(&self, at: Coords, axis: Axis) -> bool {
        at.on(axis) + 1 == self.degree(axis)
    }

    /// The rank that computes the loss and owns the reports: the last
    /// pipeline stage, tensor rank 0, data rank 0 (rank 0 when the model
    /// is not split).
    pub fn loss_owner(&self) -> u32 {
        self.rank(Coords {
            data: 0,
            pipeline: self.pipeline - 1,
            tensor: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn degrees_default_and_every_refusal_names_the_numbers() {
        assert_eq!(
            ParallelDims::resolve(8, None, Some(2), None).unwrap(),
            ParallelDims {
                data: 4,
                pipeline: 2,
                tensor: 1
            }
        );
        assert_eq!(
            ParallelDims::resolve(3, None, None, None).unwrap(),
            ParallelDims::data_only(3)
        );
        let e = ParallelDims::resolve(8, Some(3), Some(2), None).unwrap_err();
        assert_eq!(e.field, "parallel");
        assert_eq!(e.value, "{data = 3, pipeline = 2, tensor = 1}");
        assert_eq!(
            e.allowed,
            "data x pipeline x tensor = 6 must equal workers = 8"
        );
        let e = ParallelDims::resolve(6, None, Some(4), None).unwrap_err();
        assert!(e.allowed.contains("= 4 must divide workers = 6"), "{e:?}");
        let e = ParallelDims::resolve(6, None, None, Some(0)).unwrap_err();
        assert_eq!(e.field, "parallel.tensor");
    }

    #[test]
    fn the_layout_is_tensor_then_pipeline_then_data() {
        let d = ParallelDims::resolve(8, Some(2), Some(2), Some(2)).unwrap();
        assert_eq!(
            d.coords(5),
            Coords {
                data: 1,
                pipeline: 0,
                tensor: 1
            }
        );
        assert_eq!(d.group(5, Axis::Tensor), vec![4, 5]);
        assert_eq!(d.group(5, Axis::Pipeline), vec![5, 7]);
        assert_eq!(d.group(5, Axis::Data), vec![1, 5]);
        assert_eq!(d.loss_owner(), 2);
        assert_eq!(ParallelDims::data_only(4).loss_owner(), 0);
    }

    proptest! {
        /// Every rank has one place and back; each axis's groups partition
        /// the world into groups of its degree.
        #[test]
        fn coordinates_round_trip_and_groups_partition(
            d in 1u32..5, p in 1u32..5, t in 1u32..5,
        ) {
            let dims = ParallelDims { data: d, pipeline: p, tensor: t };
            for r in 0..dims.world() {
                prop_assert_eq!(dims.rank(dims.coords(r)), r);
            }
            for axis in Axis::ALL {
                let mut seen = vec![0u32; dims.world() as usize];
                for r in 0..dims.world() {
                    let g = dims.group(r, axis);
                    prop_assert_eq!(g.len() as u32, dims.degree(axis));
                    prop_assert!(g.contains(&r));
                    for &m in &g {
                        prop_assert_eq!(dims.group(m, axis), g.clone());
                    }
                    seen[r as usize] += 1;
                }
                prop_assert!(seen.iter().all(|&n| n == 1));
            }
        }
    }
}
