//! Job state machine and gang scheduling, as pure functions with time passed
//! in (DESIGN section 6).

use accrue_proto::v1::{Job, JobState, Transition};

/// Whether `from -> to` is a legal transition.
pub fn allowed(from: JobState, to: JobState) -> bool {
    use JobState::*;
    matches!(
        (from, to),
        (Unspecified, Pending)
            | (Pending, Rendezvous)
            | (Pending, Cancelled)
            | (Pending, Failed)
            | (Rendezvous, Running)
            | (Rendezvous, Failed)
            | (Rendezvous, Cancelled)
            | (Rendezvous, Succeeded)
            | (Running, Succeeded)
            | (Running, Failed)
            | (Running, Cancelled)
            | (Running, Recovering)
            | (Recovering, Rendezvous)
            | (Recovering, Running)
            | (Recovering, Failed)
            | (Recovering, Cancelled)
    )
}

pub fn is_final(s: JobState) -> bool {
    matches!(
        s,
        JobState::Succeeded | JobState::Failed | JobState::Cancelled
    )
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("job {job} cannot go from {from:?} to {to:?}")]
pub struct TransitionError {
    pub job: String,
    pub from: JobState,
    pub to: JobState,
}

/// Moves `job` to `to`, recording the reason and the time.
pub fn transition(
    job: &mut Job,
    to: JobState,
    reason: impl Into<String>,
    now_ms: i64,
) -> Result<Transition, TransitionError> {
    let from = job.state();
    if !allowed(from, to) {
        return Err(TransitionError {
            job: job.id.clone(),
            from,
            to,
        });
    }
    let t = Transition {
        from: from as i32,
        to: to as i32,
        reason: reason.into(),
        at_unix_ms: now_ms,
    };
    job.set_state(to);
    job.history.push(t.clone());
    Ok(t)
}

/// A job waiting for workers.
#[derive(Clone, Debug, PartialEq)]
pub struct Waiting {
    pub job: String,
    pub world: usize,
}

/// Gang scheduling: jobs in submission order take `world` free workers each,
/// all or nothing; a job that does not fit blocks the ones behind it (no
/// backfill, so a large job is never starved). Returns (job, workers by rank).
pub fn gang_schedule(waiting: &[Waiting], free: &[String]) -> Vec<(String, Vec<String>)> {
    let mut free: Vec<String> = free.to_vec();
    free.sort();
    let mut out = Vec::new();
    for w in waiting {
        if w.world == 0 || w.world > free.len() {
            break;
        }
        let taken: Vec<String> = free.drain(..w.world).collect();
        out.push((w.job.clone(), taken));
    }
    out
}

/// Workers whose last sign of life is older than `ttl_ms`.
pub fn expired(now_ms: i64, last_seen: &[(String, i64)], ttl_ms: i64) -> Vec<String> {
    last_seen
        .iter()
        .filter(|(_, t)| now_ms - t > ttl_ms)
        .map(|(id, _)| id.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lifecycle_and_refusals() {
        let mut job = Job {
            id: "j".into(),
            ..Default::default()
        };
        transition(&mut job, JobState::Pending, "submitted", 1).unwrap();
        transition(&mut job, JobState::Rendezvous, "assigned", 2).unwrap();
        transition(&mut job, JobState::Running, "first step", 3).unwrap();
        transition(&mut job, JobState::Succeeded, "done", 4).unwrap();
        let err = transition(&mut job, JobState::Cancelled, "late", 5).unwrap_err();
        assert_eq!(
            err.to_string(),
            "job j cannot go from Succeeded to Cancelled"
        );
        assert_eq!(job.history.len(), 4);
        assert_eq!(job.history[2].reason, "first step");
        assert_eq!(job.history[3].at_unix_ms, 4);
    }

    #[test]
    fn gang_waits_for_all_workers() {
        let free = vec!["w3".to_string(), "w1".into(), "w2".into()];
        let waiting = vec![
            Waiting {
                job: "a".into(),
                world: 2,
            },
            Waiting {
                job: "b".into(),
                world: 2,
            },
        ];
        let placed = gang_schedule(&waiting, &free);
        assert_eq!(
            placed,
            vec![("a".to_string(), vec!["w1".to_string(), "w2".into()])]
        );
        // A job larger than the cluster blocks the queue (no backfill).
        let waiting = vec![
            Waiting {
                job: "big".into(),
                world: 4,
            },
            Waiting {
                job: "small".into(),
                world: 1,
            },
        ];
        assert!(gang_schedule(&waiting, &free).is_empty());
    }

    #[test]
    fn expiry_uses_the_ttl() {
        let seen = vec![("a".to_string(), 1000), ("b".into(), 4000)];
        assert_eq!(expired(5000, &seen, 3000), vec!["a".to_string()]);
        assert!(expired(4000, &seen, 3000).is_empty());
    }

    proptest! {
        #[test]
        fn placements_never_share_a_worker(worlds in proptest::collection::vec(1usize..4, 0..6), n in 0usize..10) {
            let free: Vec<String> = (0..n).map(|i| format!("w{i:02}")).collect();
            let waiting: Vec<Waiting> = worlds.iter().enumerate().map(|(i, &w)| Waiting { job: format!("j{i}"), world: w }).collect();
            let placed = gang_schedule(&waiting, &free);
            let mut used: Vec<&String> = placed.iter().flat_map(|(_, ws)| ws).collect();
            let total = used.len();
            used.sort();
            used.dedup();
            prop_assert_eq!(used.len(), total);
            for (job, ws) in &placed {
                let w = waiting.iter().find(|x| &x.job == job).unwrap().world;
                prop_assert_eq!(ws.len(), w);
            }
            // Placed jobs are a prefix of the queue.
            for (i, (job, _)) in placed.iter().enumerate() {
                prop_assert_eq!(job, &waiting[i].job);
            }
        }

        #[test]
        fn final_states_have_no_exit(to in 0i32..8) {
            let to = JobState::try_from(to).unwrap();
            for from in [JobState::Succeeded, JobState::Failed, JobState::Cancelled] {
                prop_assert!(!allowed(from, to));
            }
        }
    }
}
