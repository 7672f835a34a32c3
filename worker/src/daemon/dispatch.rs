//! What a coordinator message does, decided without touching anything:
//! [`on_message`] reads what the daemon's job slot holds and returns the
//! actions; the shell (`super::Daemon::apply`) carries them out (a thread
//! started, a flag raised, a line logged).

use accrue_proto::v1::{self, coordinator_message::Msg};

/// What this daemon's one job slot holds, as the dispatch sees it.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) enum JobSlot {
    /// No job's thread here: the next assignment starts one.
    #[default]
    Free,
    Busy {
        job: String,
        /// The job's thread has ended (its JobDone not yet taken).
        ended: bool,
        /// The generation the job's thread is in (None before it recorded
        /// one, or between jobs).
        generation: Option<u64>,
    },
}

/// What the shell does about one coordinator message.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Action {
    /// Start a thread for this job (the slot was free).
    Start(v1::Assignment),
    /// A new generation of the running job: hand it to the job's thread
    /// and end the window in flight.
    NewGeneration(v1::Assignment),
    /// An assignment while another job (or this job's ended thread) holds
    /// the slot: ignored, with a warning.
    Busy { job: String, busy: String },
    /// Stop the running job at its next window boundary.
    Stop { job: String, reason: String },
    /// Drop the window in flight of the running job's current generation.
    Abort {
        job: String,
        generation: u64,
        reason: String,
    },
    /// Write a checkpoint at the next step boundary.
    CheckpointNow,
    /// The coordinator refused one of this worker's reports: warn.
    Refused(v1::Refused),
}

/// The actions `msg` calls for, given what `slot` holds.
pub(super) fn on_message(slot: &JobSlot, msg: Msg) -> Vec<Action> {
    let running = match slot {
        JobSlot::Free => None,
        JobSlot::Busy { job, .. } => Some(job.as_str()),
    };
    match msg {
        Msg::Assign(a) => match slot {
            JobSlot::Free => vec![Action::Start(a)],
            JobSlot::Busy { job, ended, .. } if *job == a.job_id && !ended => {
                vec![Action::NewGeneration(a)]
            }
            JobSlot::Busy { job, .. } => vec![Action::Busy {
                job: a.job_id,
                busy: job.clone(),
            }],
        },
        Msg::Stop(s) if running == Some(s.job_id.as_str()) => vec![Action::Stop {
            job: s.job_id,
            reason: s.reason,
        }],
        Msg::Abort(a) => match slot {
            JobSlot::Busy {
                job,
                generation: Some(g),
                ..
            } if *job == a.job_id && *g == a.generation => vec![Action::Abort {
                job: a.job_id,
                generation: a.generation,
                reason: a.reason,
            }],
            _ => Vec::new(),
        },
        Msg::CheckpointNow(c) if running == Some(c.job_id.as_str()) => {
            vec![Action::CheckpointNow]
        }
        Msg::Refused(r) => vec![Action::Refused(r)],
        Msg::Stop(_) | Msg::CheckpointNow(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assign(job: &str, generation: u64) -> Msg {
        Msg::Assign(v1::Assignment {
            job_id: job.into(),
            generation,
            ..Default::default()
        })
    }

    fn busy(job: &str, ended: bool, generation: Option<u64>) -> JobSlot {
        JobSlot::Busy {
            job: job.into(),
            ended,
            generation,
        }
    }

    fn assignment(actions: &[Action]) -> Option<(&'static str, &str, u64)> {
        match actions {
            [Action::Start(a)] => Some(("start", a.job_id.as_str(), a.generation)),
            [Action::NewGeneration(a)] => Some(("new", a.job_id.as_str(), a.generation)),
            _ => None,
        }
    }

    #[test]
    fn an_assignment_to_a_free_slot_starts_the_job() {
        let got = on_message(&JobSlot::Free, assign("j", 1));
        assert_eq!(assignment(&got), Some(("start", "j", 1)));
    }

    #[test]
    fn an_assignment_of_the_running_job_is_its_next_generation() {
        let got = on_message(&busy("j", false, Some(1)), assign("j", 2));
        assert_eq!(assignment(&got), Some(("new", "j", 2)));
        // Also before the thread recorded its first generation.
        let got = on_message(&busy("j", false, None), assign("j", 2));
        assert_eq!(assignment(&got), Some(("new", "j", 2)));
    }

    #[test]
    fn an_assignment_while_busy_is_ignored() {
        let got = on_message(&busy("j", false, Some(1)), assign("other", 1));
        assert_eq!(
            got,
            [Action::Busy {
                job: "other".into(),
                busy: "j".into()
            }]
        );
    }

    #[test]
    fn an_assignment_of_a_job_whose_thread_ended_waits_for_its_job_done() {
        let got = on_message(&busy("j", true, Some(1)), assign("j", 2));
        assert_eq!(
            got,
            [Action::Busy {
                job: "j".into(),
                busy: "j".into()
            }]
        );
    }

    #[test]
    fn stop_stops_only_the_running_job() {
        let stop = |job: &str| {
            Msg::Stop(v1::Stop {
                job_id: job.into(),
                reason: "cancelled".into(),
            })
        };
        assert_eq!(
            on_message(&busy("j", false, Some(3)), stop("j")),
            [Action::Stop {
                job: "j".into(),
                reason: "cancelled".into()
            }]
        );
        assert_eq!(on_message(&busy("j", false, Some(3)), stop("k")), []);
        assert_eq!(on_message(&JobSlot::Free, stop("j")), []);
    }

    #[test]
    fn abort_drops_the_window_of_the_current_generation_only() {
        let abort = |job: &str, generation| {
            Msg::Abort(v1::Abort {
                job_id: job.into(),
                generation,
                reason: "lost rank 1".into(),
            })
        };
        assert_eq!(
            on_message(&busy("j", false, Some(2)), abort("j", 2)),
            [Action::Abort {
                job: "j".into(),
                generation: 2,
                reason: "lost rank 1".into()
            }]
        );
        // Another generation, another job, no generation yet, no job.
        assert_eq!(on_message(&busy("j", false, Some(3)), abort("j", 2)), []);
        assert_eq!(on_message(&busy("j", false, Some(2)), abort("k", 2)), []);
        assert_eq!(on_message(&busy("j", false, None), abort("j", 2)), []);
        assert_eq!(on_message(&JobSlot::Free, abort("j", 2)), []);
    }

    #[test]
    fn checkpoint_now_reaches_only_the_running_job() {
        let now = |job: &str| {
            Msg::CheckpointNow(v1::CheckpointNow {
                job_id: job.into(),
                generation: 1,
            })
        };
        assert_eq!(
            on_message(&busy("j", false, Some(1)), now("j")),
            [Action::CheckpointNow]
        );
        assert_eq!(on_message(&busy("j", false, Some(1)), now("k")), []);
        assert_eq!(on_message(&JobSlot::Free, now("j")), []);
    }

    #[test]
    fn a_refused_report_is_only_logged() {
        let r = v1::Refused {
            job_id: "j".into(),
            generation: 1,
            reason: "stale generation".into(),
        };
        assert_eq!(
            on_message(&JobSlot::Free, Msg::Refused(r.clone())),
            [Action::Refused(r)]
        );
    }
}
