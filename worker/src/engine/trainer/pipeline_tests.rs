use super::*;

/// A list's computations only: (forward?, micro), for the V = 1 lists.
fn computes(ops: &[PipeOp]) -> Vec<(bool, usize)> {
    ops.iter()
        .filter_map(|o| match *o {
            PipeOp::Forward { micro, .. } => Some((true, micro)),
            PipeOp::Backward { micro, .. } => Some((false, micro)),
            _ => None,
        })
        .collect()
}

const F: bool = true;
const B: bool = false;

#[test]
fn one_f_one_b_warms_up_alternates_and_cools_down() {
    let one = |r, p, k| computes(&rank_ops(PipeSchedule::OneFOneB, &Layout::new(p, 1), r, k));
    // P = 4, k = 6: stage 0 warms up with 3 forwards.
    assert_eq!(
        one(0, 4, 6),
        vec![
            (F, 0),
            (F, 1),
            (F, 2),
            (F, 3),
            (B, 0),
            (F, 4),
            (B, 1),
            (F, 5),
            (B, 2),
            (B, 3),
            (B, 4),
            (B, 5)
        ]
    );
    // The last stage alternates from the start.
    assert_eq!(one(3, 4, 2), vec![(F, 0), (B, 0), (F, 1), (B, 1)]);
    // k < P: every forward is warm-up.
    assert_eq!(one(0, 4, 2), vec![(F, 0), (F, 1), (B, 0), (B, 1)]);
}

/// The transfers around each computation, explicit: stage 1 of 2 (the
/// last) receives its input and sends its input's gradient; its backward
/// ran with its forward, so it receives no gradient.
#[test]
fn the_ops_name_their_transfers() {
    use PipeOp::*;
    let l = Layout::new(2, 1);
    assert_eq!(
        rank_ops(PipeSchedule::OneFOneB, &l, 1, 1),
        vec![
            RecvActivation { chunk: 1, micro: 0 },
            Forward { chunk: 1, micro: 0 },
            Backward { chunk: 1, micro: 0 },
            SendGradient { chunk: 1, micro: 0 },
        ]
    );
    assert_eq!(
        rank_ops(PipeSchedule::OneFOneB, &l, 0, 1),
        vec![
            Forward { chunk: 0, micro: 0 },
            SendActivation { chunk: 0, micro: 0 },
            RecvGradient { chunk: 0, micro: 0 },
            Backward { chunk: 0, micro: 0 },
        ]
    );
}

/// Megatron-core's table at P = 2, V = 2, k = 4 (groups {0, 1} and
/// {2, 3}): rank 0 warms up with (2 - 0 - 1) x 2 + (2 - 1) x 2 = 4
/// forwards, its chunks 0 and 2; the backwards in the same order, chunks
/// reversed. At k = 5 the remainder joins the last group, {2, 3, 4}, and
/// the warm-up counts it: 2 + 3.
#[test]
fn interleaved_follows_megatrons_schedule_table() {
    let l = Layout::new(2, 2);
    let chunks = |r, k| -> Vec<(bool, usize, usize)> {
        rank_ops(PipeSchedule::Interleaved1F1B, &l, r, k)
            .iter()
            .filter_map(|o| match *o {
                PipeOp::Forward { chunk, micro } => Some((F, chunk, micro)),
                PipeOp::Backward { chunk, micro } => Some((B, chunk, micro)),
                _ => None,
            })
            .collect()
    };
    assert_eq!(warmup(PipeSchedule::Interleaved1F1B, &l, 0, 4), 4);
    assert_eq!(
        chunks(0, 4),
        vec![
            (F, 0, 0),
            (F, 0, 1),
            (F, 2, 0),
            (F, 2, 1),
            (F, 0, 2),
            (B, 2, 0),
            (F, 0, 3),
            (B, 2, 1),
            (F, 2, 2),
            (B, 0, 0),
            (F, 2, 3),
            (B, 0, 1),
            (B, 2, 2),
            (B, 2, 3),
            (B, 0, 2),
            (B, 0, 3),
        ]
    );
    assert_eq!(warmup(PipeSchedule::Interleaved1F1B, &l, 0, 5), 5);
    assert_eq!(
        &chunks(0, 5)[..7],
        &[
            (F, 0, 0),
            (F, 0, 1),
            (F, 2, 0),
            (F, 2, 1),
            (F, 0, 2),
            (F, 0, 3),
            (B, 2, 0)
        ]
    );
    // Rank 1 (chunks 1 and 3) warms up with 2.
    assert_eq!(&chunks(1, 4)[..3], &[(F, 1, 0), (F, 1, 1), (F, 3, 0)]);
}

/// Every schedule, P <= 8, V <= 4 (1 for GPipe and 1F1B), k <= 17: the
/// lists of all ranks run to completion (every send received, no
/// deadlock), each micro-batch is forwarded then backwarded once per
/// chunk, a micro-batch's forwards run chunk after chunk and its
/// backwards in reverse (by the simulation's rounds), and a rank holds at
/// most its warm-up + 1 activations.
#[test]
fn every_schedule_runs_to_completion_once_per_chunk_in_chunk_order() {
    for schedule in [
        PipeSchedule::OneFOneB,
        PipeSchedule::GPipe,
        PipeSchedule::Interleaved1F1B,
    ] {
        let vs = match schedule {
            PipeSchedule::Interleaved1F1B => 2..=4,
            _ => 1..=1,
        };
        for p in 1..=8 {
            for v in vs.clone() {
                let l = Layout::new(p, v);
                for k in 1..=17 {
                    let what = format!("{schedule:?} P={p} V={v} k={k}");
                    let trace =
                        simulate(schedule, &l, k).unwrap_or_else(|e| panic!("{what}: {e:?}"));
                    // When each (forward?, chunk, micro) ran.
                    let mut when = std::collections::HashMap::new();
                    for (r, rounds) in trace.iter().enumerate() {
                        let ops = rank_ops(schedule, &l, r, k);
                        for (i, op) in ops.iter().enumerate() {
                            let key = match *op {
                                PipeOp::Forward { chunk, micro } => (F, chunk, micro),
                                PipeOp::Backward { chunk, micro } => (B, chunk, micro),
                                _ => continue,
                            };
                            assert_eq!(l.rank_of(key.1), r, "{what}: {op:?} on rank {r}");
                            let before = when.insert(key, (rounds[i], i));
                            assert!(before.is_none(), "{what}: {op:?} twice");
                        }
                        assert_eq!(
                            ops.iter()
                                .filter(|o| matches!(o, PipeOp::Forward { .. }))
                                .count(),
                            k * v
                        );
                        let w = warmup(schedule, &l, r, k);
                        let peak = if w < k * v { w + 1 } else { k * v };
                        assert_eq!(peak_in_flight(&ops), peak, "{what} rank {r}");
                        match schedule {
                            PipeSchedule::GPipe => assert_eq!(peak, k),
                            PipeSchedule::OneFOneB => assert_eq!(peak, (p - r).min(k)),
                            PipeSchedule::Interleaved1F1B => {}
                        }
                    }
                    let c = l.chunks();
                    for m in 0..k {
                        for ch in 0..c {
                            let (f, fi) = when[&(F, ch, m)];
                            let (b, bi) = when[&(B, ch, m)];
                            assert!(fi < bi && f <= b, "{what}: chunk {ch} micro {m}");
                            if ch + 1 < c {
                                assert!(f < when[&(F, ch + 1, m)].0, "{what}: forward order");
                                assert!(b > when[&(B, ch + 1, m)].0, "{what}: backward order");
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The simulator can fail: two ranks that each receive before they send
/// wait for each other.
#[test]
fn the_simulator_sees_a_deadlock() {
    use PipeOp::*;
    let l = Layout::new(2, 1);
    let first = vec![
        RecvGradient { chunk: 0, micro: 0 },
        Forward { chunk: 0, micro: 0 },
        SendActivation { chunk: 0, micro: 0 },
    ];
    let second = vec![
        RecvActivation { chunk: 1, micro: 0 },
        Forward { chunk: 1, micro: 0 },
        SendGradient { chunk: 1, micro: 0 },
    ];
    assert_eq!(
        run_programs(&l, &[first, second]),
        Err(SimError::Deadlock { at: vec![0, 0] })
    );
}

/// ... and a message nobody takes: rank 1 waits for micro-batch 1's
/// activation while rank 0 sent micro-batch 0's.
#[test]
fn the_simulator_sees_a_mismatched_message() {
    use PipeOp::*;
    let l = Layout::new(2, 1);
    let first = vec![
        Forward { chunk: 0, micro: 0 },
        SendActivation { chunk: 0, micro: 0 },
    ];
    let second = vec![RecvActivation { chunk: 1, micro: 1 }];
    let want = Msg {
        kind: MsgKind::Activation,
        chunk: 1,
        micro: 1,
    };
    let queued = vec![Msg { micro: 0, ..want }];
    assert_eq!(
        run_programs(&l, &[first, second]),
        Err(SimError::Mismatch {
            rank: 1,
            from: 0,
            want,
            queued
        })
    );
    // A message sent and never received.
    let first = vec![SendActivation { chunk: 0, micro: 0 }];
    assert!(matches!(
        run_programs(&l, &[first, vec![]]),
        Err(SimError::Undelivered { .. })
    ));
}
