//! What the coordinator takes from workers' reports, and from which rank.

use super::tests::*;
use super::*;

/// A pipeline job's evaluations come from the rank that owns the loss
/// (its last stage), not rank 0: the coordinator keeps and publishes
/// those, and drops the same message from any other rank.
#[test]
fn evaluations_are_taken_from_the_loss_owner() {
    let mut c = cluster();
    for (i, w) in ["w0", "w1"].iter().enumerate() {
        attach(&mut c, w, i as u64 + 1, 0);
    }
    let id = reply(&step_submit(
        &mut c,
        spec("pp", 2, "[parallel]\npipeline = 2"),
        String::new(),
        0,
    ))
    .unwrap()
    .id;
    let fx = c.step(Input::Admit { job: id.clone() }, 0);
    let rank_of: std::collections::HashMap<u32, String> = sends(&fx)
        .into_iter()
        .filter_map(|(w, m)| match m {
            coordinator_message::Msg::Assign(a) => Some((a.rank, w)),
            _ => None,
        })
        .collect();
    assert_eq!(rank_of.len(), 2, "both ranks assigned");
    let generation = c.jobs[&id].job.generation;
    let eval = |loss: f64| WorkerMessage {
        msg: Some(worker_message::Msg::Eval(v1::EvalResult {
            step: 2,
            loss,
            ..Default::default()
        })),
        job_id: id.clone(),
        generation,
    };
    let published = |fx: &[Effect]| -> Vec<f64> {
        fx.iter()
            .filter_map(|e| match e {
                Effect::Event(ev) => match &ev.event {
                    Some(v1::job_event::Event::Eval(e)) => Some(e.loss),
                    _ => None,
                },
                _ => None,
            })
            .collect()
    };
    let send = |c: &mut Cluster, rank: u32, loss: f64| {
        let worker = rank_of[&rank].clone();
        let conn = c.workers[&worker].conn;
        c.step(
            Input::Message {
                worker,
                conn,
                msg: eval(loss),
            },
            1,
        )
    };
    // Rank 0 holds the first stage: not the loss.
    let fx = send(&mut c, 0, 1.5);
    assert!(published(&fx).is_empty(), "rank 0's evaluation was taken");
    assert_eq!(c.jobs[&id].job.eval, None);
    let fx = send(&mut c, 1, 2.5);
    assert_eq!(published(&fx), vec![2.5]);
    assert_eq!(c.jobs[&id].job.eval.map(|e| e.loss), Some(2.5));
}
