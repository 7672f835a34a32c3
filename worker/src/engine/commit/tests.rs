use super::plan::{
    complete, finisher, model_file, numbering, optimizer_file, place_code, plan, runs_by_size,
    Outcome, Part, Plan, Seat, NO_PLACE,
};
use crate::checkpoint::manifest::Entry;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::ops::Range;

#[test]
fn runs_cover_the_tensors_in_order_by_size() {
    assert_eq!(runs_by_size(&[10, 10, 10, 10], 2), vec![0..2, 2..4]);
    // One large tensor first: it is rank 0's; the rest follow.
    assert_eq!(runs_by_size(&[90, 5, 5], 2), vec![0..1, 1..3]);
    assert_eq!(runs_by_size(&[1, 1], 4), vec![0..1, 0..0, 1..2, 0..0]);
    assert_eq!(runs_by_size(&[], 3), vec![0..0, 0..0, 0..0]);
    for w in 1..6 {
        let sizes = [3, 7, 1, 12, 5, 5, 9];
        let runs = runs_by_size(&sizes, w);
        let covered: Vec<usize> = runs.iter().flat_map(Clone::clone).collect();
        assert_eq!(covered, (0..sizes.len()).collect::<Vec<_>>(), "w = {w}");
    }
}

/// A mesh of `stages` x `tensors` x `datas` ranks under ZeRO `zero`, the
/// model's parameters (sizes) split over the stages in `cuts`, each
/// stage's into units of `unit` parameters.
#[derive(Clone, Debug)]
struct Mesh {
    stages: usize,
    tensors: usize,
    datas: usize,
    zero: u32,
    params: Vec<usize>,
    cuts: Vec<usize>,
    unit: usize,
}

impl Mesh {
    /// Stage `s`'s parameters: their global indices.
    fn stage_params(&self, s: usize) -> Range<usize> {
        self.cuts[s]..self.cuts[s + 1]
    }

    fn units(&self, s: usize) -> Vec<Range<usize>> {
        let n = self.stage_params(s).len();
        (0..n.div_ceil(self.unit))
            .map(|u| u * self.unit..((u + 1) * self.unit).min(n))
            .collect()
    }

    fn seats(&self) -> impl Iterator<Item = Seat> + '_ {
        (0..self.stages).flat_map(move |stage| {
            (0..self.datas).flat_map(move |data| {
                (0..self.tensors).map(move |tensor| Seat {
                    stage,
                    stages: self.stages,
                    data,
                    datas: self.datas,
                    tensor,
                })
            })
        })
    }

    fn plan_of(&self, seat: Seat) -> Plan {
        let p = self.stage_params(seat.stage);
        plan(seat, self.zero, &self.params[p], &self.units(seat.stage))
    }
}

fn meshes() -> impl Strategy<Value = Mesh> {
    (1usize..=4, 1usize..=3, 1usize..=4, 0u32..=3, 1usize..=3).prop_flat_map(
        |(stages, tensors, datas, zero, unit)| {
            // At least a parameter a stage (the spec's rule), sizes 1..50.
            (
                prop::collection::vec(1usize..50, stages..stages + 12),
                Just((stages, tensors, datas, zero, unit)),
            )
                .prop_flat_map(|(params, (stages, tensors, datas, zero, unit))| {
                    let n = params.len();
                    (
                        prop::collection::btree_set(1..n.max(2), stages - 1),
                        Just(params),
                        Just((stages, tensors, datas, zero, unit)),
                    )
                })
                .prop_filter_map(
                    "a stage of its own parameters",
                    |(inner, params, (stages, tensors, datas, zero, unit))| {
                        let n = params.len();
                        let mut cuts: Vec<usize> = std::iter::once(0)
                            .chain(inner.into_iter().filter(|&c| c < n))
                            .chain(std::iter::once(n))
                            .collect();
                        cuts.dedup();
                        (cuts.len() == stages + 1).then_some(Mesh {
                            stages,
                            tensors,
                            datas,
                            zero,
                            params,
                            cuts,
                            unit,
                        })
                    },
                )
        },
    )
}

proptest! {
    /// Over data x pipeline x tensor meshes and ZeRO stages 0 to 3: every
    /// parameter's tensor and optimizer state are written exactly once, the
    /// buffers once, by tensor rank 0 only; every writer has a place of its
    /// own, the first stage's data rank 0 finishes, and the writers' files
    /// (shards and optimizer parts) are numbered without gap or repeat.
    #[test]
    fn every_parameter_is_written_exactly_once(
        mesh in meshes(),
        shards in prop::collection::vec(0u64..3, 64),
    ) {
        let n = mesh.params.len();
        let (mut tensor, mut state) = (vec![0; n], vec![0; n]);
        let mut buffers = 0;
        let (mut places, mut counts) = (Vec::new(), Vec::new());
        for (w, seat) in mesh.seats().enumerate() {
            let role = mesh.plan_of(seat).role(seat);
            let base = mesh.stage_params(seat.stage).start;
            if seat.tensor != 0 {
                prop_assert!(!role.writes && role.params.is_empty() && role.state.is_empty());
            }
            for &i in &role.params {
                tensor[base + i] += 1;
            }
            for &i in &role.state {
                state[base + i] += 1;
            }
            buffers += role.buffers as usize;
            places.push(if role.writes { place_code(seat) } else { NO_PLACE });
            // A writer without tensors writes no shard.
            counts.push(if role.params.is_empty() { 0 } else { shards[w % 64] + 1 });
        }
        prop_assert_eq!(&tensor, &vec![1; n], "{:?}", mesh);
        prop_assert_eq!(&state, &vec![1; n], "{:?}", mesh);
        prop_assert_eq!(buffers, 1);
        let writers: Vec<u64> = places.iter().copied().filter(|&p| p != NO_PLACE).collect();
        let unique: std::collections::BTreeSet<u64> = writers.iter().copied().collect();
        prop_assert_eq!(unique.len(), writers.len());
        let f = finisher(&places).expect("a finisher");
        prop_assert_eq!(f, 0, "world rank 0 is the first stage's data and tensor rank 0");
        // One writer a stage without sharding; every data rank under
        // ZeRO-3, and under ZeRO 1 and 2 without stages.
        let sharded = mesh.zero == 3 || (mesh.zero > 0 && mesh.stages == 1);
        let per_stage = if sharded { mesh.datas } else { 1 };
        prop_assert_eq!(writers.len(), mesh.stages * per_stage);
        let numbers = numbering(&places, &counts);
        let (mut shard_names, mut parts) = (Vec::new(), Vec::new());
        for (w, num) in numbers.iter().enumerate() {
            prop_assert_eq!(num.is_some(), places[w] != NO_PLACE);
            let Some(num) = num else { continue };
            for i in 0..counts[w] as usize {
                shard_names.push(model_file(num.first + i, num.total));
            }
            parts.push(optimizer_file(num.part, num.parts));
        }
        let total: u64 = counts.iter().sum();
        let mut sorted = shard_names.clone();
        sorted.sort();
        sorted.dedup();
        prop_assert_eq!(sorted.len() as u64, total, "{:?}", shard_names);
        parts.sort();
        parts.dedup();
        prop_assert_eq!(parts.len(), writers.len());
    }
}

/// Today's layouts, named: the whole model is `model.safetensors` and
/// `optimizer.safetensors` of one writer; two pipeline stages write a
/// part each; ZeRO-3 at W = 4 one part a rank, its units in runs.
#[test]
fn the_layouts_of_whole_models_stages_and_shards() {
    let seat = |stage, stages, data, datas, tensor| Seat {
        stage,
        stages,
        data,
        datas,
        tensor,
    };
    // The whole model at W = 2 (ZeRO 0): rank 0 writes everything.
    let p = plan(seat(0, 1, 1, 2, 0), 0, &[4, 4, 4], &[]);
    assert_eq!(p.writers, 1);
    assert!(!p.role(seat(0, 1, 1, 2, 0)).writes);
    let r0 = p.role(seat(0, 1, 0, 2, 0));
    assert_eq!(
        (r0.params, r0.state, r0.buffers),
        (vec![0, 1, 2], vec![0, 1, 2], true)
    );
    assert_eq!(model_file(0, 1), "model.safetensors");
    assert_eq!(optimizer_file(0, 1), "optimizer.safetensors");
    // ZeRO 1 at W = 2: rank 0 the parameters, each rank its run's state.
    let p = plan(seat(0, 1, 1, 2, 0), 1, &[10, 10, 10, 10], &[]);
    assert_eq!(p.role(seat(0, 1, 1, 2, 0)).state, vec![2, 3]);
    assert!(p.role(seat(0, 1, 1, 2, 0)).params.is_empty());
    // ZeRO 1 within two stages: the stage's data rank 0 writes it all.
    let p = plan(seat(1, 2, 0, 2, 0), 1, &[10, 10], &[]);
    assert_eq!((p.writers, p.role(seat(1, 2, 0, 2, 0)).buffers), (1, false));
    // ZeRO-3: units in contiguous runs.
    let units = [0..1, 1..3, 3..4, 4..5];
    let p = plan(seat(0, 1, 1, 2, 0), 3, &[1; 5], &units);
    assert_eq!(p.role(seat(0, 1, 1, 2, 0)).params, vec![3, 4]);
    assert_eq!(p.role(seat(0, 1, 0, 2, 0)).params, vec![0, 1, 2]);
    assert_eq!(optimizer_file(3, 4), "optimizer-00004-of-00004.safetensors");
    assert_eq!(model_file(1, 3), "model-00002-of-00003.safetensors");
    // Numbering: stage by stage, data rank by data rank, whatever the
    // world order; tensor ranks past 0 have none.
    let places = [
        place_code(seat(0, 2, 0, 2, 0)),
        NO_PLACE,
        place_code(seat(1, 2, 0, 2, 0)),
        place_code(seat(0, 2, 1, 2, 0)),
    ];
    let n = numbering(&places, &[2, 0, 1, 3]);
    let got: Vec<_> = (n.iter())
        .map(|x| x.as_ref().map(|x| (x.first, x.total, x.part, x.parts)))
        .collect();
    assert_eq!(
        got,
        vec![
            Some((0, 6, 0, 3)),
            None,
            Some((5, 6, 2, 3)),
            Some((2, 6, 1, 3))
        ]
    );
}

fn part(name: &str, tensors: &[&str]) -> Outcome {
    Ok(Part {
        entries: vec![Entry {
            name: name.into(),
            bytes: 8,
            crc32: 1,
        }],
        weight_map: tensors
            .iter()
            .map(|t| (t.to_string(), name.into()))
            .collect(),
        bytes: 8,
    })
}

/// The folder is complete only when every expected writer reported
/// success once: a failed part, a missing one or one reported twice is
/// refused naming it (the step is then abandoned, never published).
#[test]
fn a_step_is_complete_only_when_every_writer_succeeded() {
    let ok = complete(
        vec![(1 << 32, part("b", &["y"])), (0, part("a", &["x"]))],
        2,
    )
    .expect("complete");
    let names: Vec<&str> = ok.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["a", "b"], "in place order");
    assert_eq!(ok.bytes, 16);
    let failed = vec![
        (0, part("a", &["x"])),
        (1 << 32, Err("disk full".to_string())),
    ];
    let e = complete(failed, 2).unwrap_err();
    assert!(e.contains("part 1: disk full"), "{e}");
    let e = complete(vec![(0, part("a", &["x"]))], 2).unwrap_err();
    assert!(e.contains("1 of 2 writers"), "{e}");
    let e = complete(vec![(0, part("a", &[])), (0, part("a", &[]))], 2).unwrap_err();
    assert!(e.contains("twice"), "{e}");
}

proptest! {
    /// Any failed writer among any number makes the step incomplete.
    #[test]
    fn any_failed_writer_leaves_the_step_incomplete(
        outcomes in prop::collection::vec(any::<bool>(), 1..12),
    ) {
        let parts: Vec<(u64, Outcome)> = outcomes
            .iter()
            .enumerate()
            .map(|(i, &ok)| {
                let o = if ok { part(&format!("f{i}"), &[]) } else { Err(format!("w{i}")) };
                (i as u64, o)
            })
            .collect();
        let got = complete(parts, outcomes.len());
        prop_assert_eq!(got.is_ok(), outcomes.iter().all(|&o| o));
        if let Ok(p) = got {
            let m: BTreeMap<_, _> = p.entries.iter().map(|e| (e.name.clone(), ())).collect();
            prop_assert_eq!(m.len(), outcomes.len());
        }
    }
}
