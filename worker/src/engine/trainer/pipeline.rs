//! Pipeline schedules (issue 40): the order in which one stage runs the
//! forwards and backwards of a window's k micro-batches, and the
//! transfers each implies. A pure function of (schedule, stage, P, k):
//! every rank computes its own list, and the lists of all stages together
//! are deadlock-free when sends are posted without waiting and receives
//! wait ([`simulate`] runs them; the tests prove it for every P <= 8 and
//! k <= 17).
//!
//! - **GPipe**: every forward, then every backward (in micro-batch
//!   order); activations of all k micro-batches live at once.
//! - **1F1B** (Megatron's `forward_backward_pipelining_without_interleaving`):
//!   stage s runs min(P - s - 1, k) warm-up forwards, then alternates one
//!   forward and one backward, then the remaining backwards; stage 0 holds
//!   at most P micro-batches' activations.
//!
//! Transfers: a forward on stage s > 0 first receives its input from
//! s - 1; one on s < P - 1 ends by sending its output to s + 1. A backward
//! on s < P - 1 first receives its output's gradient from s + 1; one on
//! s > 0 ends by sending its input's gradient to s - 1. Each direction
//! between two stages carries one kind of tensor in micro-batch order, so
//! first-in-first-out matching pairs them right even when next and previous
//! are the same peer (P = 2).

/// Which schedule a pipeline job runs (`[parallel] schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipeSchedule {
    OneFOneB,
    GPipe,
}

/// One operation of a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipeOp {
    /// The forward of micro-batch `micro` (0-based within the window).
    Forward { micro: usize },
    /// Its backward.
    Backward { micro: usize },
}

/// The operations stage `stage` of `stages` runs for a window of `k`
/// micro-batches, in order.
pub fn stage_ops(schedule: PipeSchedule, stage: usize, stages: usize, k: usize) -> Vec<PipeOp> {
    let fwd = |micro| PipeOp::Forward { micro };
    let bwd = |micro| PipeOp::Backward { micro };
    match schedule {
        PipeSchedule::GPipe => (0..k).map(fwd).chain((0..k).map(bwd)).collect(),
        PipeSchedule::OneFOneB => {
            let warmup = (stages - stage - 1).min(k);
            let mut ops: Vec<PipeOp> = (0..warmup).map(fwd).collect();
            for i in 0..k - warmup {
                ops.push(fwd(warmup + i));
                ops.push(bwd(i));
            }
            ops.extend((k - warmup..k).map(bwd));
            ops
        }
    }
}

/// The most micro-batches whose activations a stage holds at once under
/// `ops` (forwards run, backwards not yet).
pub fn peak_in_flight(ops: &[PipeOp]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for op in ops {
        match op {
            PipeOp::Forward { .. } => {
                live += 1;
                peak = peak.max(live);
            }
            PipeOp::Backward { .. } => live -= 1,
        }
    }
    peak
}

/// A transfer between stages, as the simulator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Recv { from: usize },
    Compute,
    Send { to: usize },
}

/// The primitive steps of one stage's ops.
fn steps(ops: &[PipeOp], stage: usize, stages: usize) -> Vec<Step> {
    let last = stage + 1 == stages;
    let mut out = Vec::new();
    for op in ops {
        match op {
            PipeOp::Forward { .. } => {
                if stage > 0 {
                    out.push(Step::Recv { from: stage - 1 });
                }
                out.push(Step::Compute);
                if !last {
                    out.push(Step::Send { to: stage + 1 });
                }
            }
            PipeOp::Backward { .. } => {
                if !last {
                    out.push(Step::Recv { from: stage + 1 });
                }
                out.push(Step::Compute);
                if stage > 0 {
                    out.push(Step::Send { to: stage - 1 });
                }
            }
        }
    }
    out
}

/// Runs every stage's ops as the engine transfers: a send is posted and
/// not waited for (the stage goes on; the send completes when its peer
/// receives it, and the window waits for its sends before the sync step),
/// a receive waits for its message. Ok(rounds) when every stage finishes
/// with every message received, Err(each stage's position) at a deadlock.
/// With sends that waited for their receive, 1F1B would deadlock at P = 2,
/// k = 2 (both stages sending at once): Megatron posts the pair together
/// for the same reason (`send_forward_recv_backward`).
pub fn simulate(schedule: PipeSchedule, stages: usize, k: usize) -> Result<usize, Vec<usize>> {
    let programs: Vec<Vec<Step>> = (0..stages)
        .map(|s| steps(&stage_ops(schedule, s, stages, k), s, stages))
        .collect();
    run_programs(&programs)
}

/// [`simulate`] over given step programs, one per stage.
fn run_programs(programs: &[Vec<Step>]) -> Result<usize, Vec<usize>> {
    let stages = programs.len();
    // Messages posted and not yet received, by (from, to).
    let mut queued = vec![vec![0usize; stages]; stages];
    let mut at = vec![0usize; stages];
    let mut rounds = 0;
    loop {
        if (0..stages).all(|s| at[s] == programs[s].len()) {
            let undelivered = queued.iter().flatten().any(|&n| n > 0);
            return if undelivered { Err(at) } else { Ok(rounds) };
        }
        rounds += 1;
        let mut moved = false;
        for s in 0..stages {
            match programs[s].get(at[s]) {
                Some(Step::Compute) => {
                    at[s] += 1;
                    moved = true;
                }
                Some(&Step::Send { to }) => {
                    queued[s][to] += 1;
                    at[s] += 1;
                    moved = true;
                }
                Some(&Step::Recv { from }) if queued[from][s] > 0 => {
                    queued[from][s] -= 1;
                    at[s] += 1;
                    moved = true;
                }
                _ => {}
            }
        }
        if !moved {
            return Err(at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_warms_up_alternates_and_cools_down() {
        use PipeOp::{Backward as B, Forward as F};
        // P = 4, k = 6: stage 0 warms up with 3 forwards.
        assert_eq!(
            stage_ops(PipeSchedule::OneFOneB, 0, 4, 6),
            vec![
                F { micro: 0 },
                F { micro: 1 },
                F { micro: 2 },
                F { micro: 3 },
                B { micro: 0 },
                F { micro: 4 },
                B { micro: 1 },
                F { micro: 5 },
                B { micro: 2 },
                B { micro: 3 },
                B { micro: 4 },
                B { micro: 5 },
            ]
        );
        // The last stage alternates from the start.
        assert_eq!(
            stage_ops(PipeSchedule::OneFOneB, 3, 4, 2),
            vec![
                F { micro: 0 },
                B { micro: 0 },
                F { micro: 1 },
                B { micro: 1 }
            ]
        );
        // k < P: every forward is warm-up.
        assert_eq!(
            stage_ops(PipeSchedule::OneFOneB, 0, 4, 2),
            vec![
                F { micro: 0 },
                F { micro: 1 },
                B { micro: 0 },
                B { micro: 1 }
            ]
        );
    }

    #[test]
    fn every_schedule_is_deadlock_free_and_runs_each_micro_batch_once() {
        for schedule in [PipeSchedule::OneFOneB, PipeSchedule::GPipe] {
            for stages in 1..=8 {
                for k in 1..=17 {
                    for s in 0..stages {
                        let ops = stage_ops(schedule, s, stages, k);
                        // Each forward once, its backward once and after it.
                        for m in 0..k {
                            let f = ops.iter().position(|o| *o == PipeOp::Forward { micro: m });
                            let b = ops.iter().position(|o| *o == PipeOp::Backward { micro: m });
                            assert!(
                                f.is_some() && b.is_some() && f < b,
                                "{schedule:?} {s}/{stages} k={k}"
                            );
                        }
                        assert_eq!(ops.len(), 2 * k);
                        // Forwards and backwards each in micro-batch order
                        // (what FIFO matching between stages needs).
                        let order = |back: bool| -> Vec<usize> {
                            ops.iter()
                                .filter_map(|o| match *o {
                                    PipeOp::Forward { micro } if !back => Some(micro),
                                    PipeOp::Backward { micro } if back => Some(micro),
                                    _ => None,
                                })
                                .collect()
                        };
                        assert_eq!(order(false), (0..k).collect::<Vec<_>>());
                        assert_eq!(order(true), (0..k).collect::<Vec<_>>());
                        let peak = peak_in_flight(&ops);
                        match schedule {
                            PipeSchedule::GPipe => assert_eq!(peak, k),
                            PipeSchedule::OneFOneB => assert_eq!(peak, (stages - s).min(k)),
                        }
                    }
                    let r = simulate(schedule, stages, k);
                    assert!(
                        r.is_ok(),
                        "{schedule:?} P={stages} k={k} deadlocks at {r:?}"
                    );
                }
            }
        }
    }

    /// The simulator can fail: two stages that each receive before they
    /// send wait for each other.
    #[test]
    fn the_simulator_sees_a_deadlock() {
        let broken = vec![Step::Recv { from: 1 }, Step::Compute, Step::Send { to: 1 }];
        let peer = vec![Step::Recv { from: 0 }, Step::Compute, Step::Send { to: 0 }];
        assert_eq!(run_programs(&[broken, peer]), Err(vec![0, 0]));
    }
}
