//! Workers coming and going: attach, re-attach (who takes its place back,
//! who is told to stop), loss, detach, heartbeat expiry.

use super::*;

impl Cluster {
    pub(super) fn attach(
        &mut self,
        conn: u64,
        hello: v1::WorkerHello,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        let id = hello.worker_id.clone();
        if id.is_empty() || id.len() > MAX_WORKER_ID {
            return fx.push(Effect::Reply(Err(CoordError::InvalidArgument(format!(
                "worker_id = {:?}: must be 1..={MAX_WORKER_ID} bytes",
                id.chars().take(16).collect::<String>()
            )))));
        }
        let claimed = (!hello.job_id.is_empty())
            .then(|| (hello.job_id.clone(), hello.generation, hello.rank));
        if let Some(old) = self.workers.remove(&id) {
            fx.push(Effect::Close {
                worker: id.clone(),
                conn: old.conn,
            });
            if let Some((job, rank)) = old.job {
                if claimed.as_ref().is_none_or(|(j, _, _)| *j != job) {
                    // The daemon restarted: whatever it held is gone.
                    self.begin_recovery(
                        &job,
                        vec![id.clone()],
                        format!("worker {id} (rank {rank}) re-attached without the job"),
                        now,
                        fx,
                    );
                }
            }
        }
        tracing::info!(worker = %id, data = %hello.data_addr, job = ?claimed, "worker attached");
        self.workers.insert(
            id.clone(),
            WorkerEntry {
                data_addr: hello.data_addr.clone(),
                conn,
                last_seen_ms: now,
                job: None,
                draining: None,
                device: hello.device.clone(),
                step: None,
                timing: None,
            },
        );
        if let Some((job, generation, rank)) = claimed {
            self.rejoin(&id, conn, &job, generation, rank, now, fx);
        }
        self.schedule(now, fx);
    }

    /// A worker attached while running `job` at `generation` (the
    /// coordinator restarted, or the stream broke and came back). Only a
    /// member of the job's current ring takes its place back; any other
    /// worker is told to stop the job and stays busy until it has.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rejoin(
        &mut self,
        worker: &str,
        conn: u64,
        job: &str,
        generation: u64,
        rank: u32,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        let live = self
            .jobs
            .get(job)
            .filter(|e| !state::is_final(e.job.state()))
            .map(|e| {
                (
                    e.job.generation,
                    e.job.workers.iter().position(|w| w == worker),
                    e.job.state(),
                )
            });
        let refuse = |reason: String, fx: &mut Vec<Effect>| {
            fx.push(Effect::Send {
                worker: worker.into(),
                conn,
                msg: msg(coordinator_message::Msg::Stop(v1::Stop {
                    job_id: job.into(),
                    reason,
                })),
            });
        };
        let (current, place, job_state) = match live {
            Some((g, Some(p), s)) => (g, p as u32, s),
            Some((g, None, _)) => {
                tracing::info!(
                    worker,
                    job,
                    generation,
                    "re-attached naming a job it is not a member of; stopping it there"
                );
                refuse(
                    format!("worker {worker} is not a member of generation {g} of job {job}"),
                    fx,
                );
                if let Some(w) = self.workers.get_mut(worker) {
                    w.draining = Some(job.into());
                }
                return;
            }
            None => {
                refuse("the job is no longer running".into(), fx);
                if let Some(w) = self.workers.get_mut(worker) {
                    w.draining = Some(job.into());
                }
                return;
            }
        };
        if let Some(w) = self.workers.get_mut(worker) {
            w.job = Some((job.to_string(), place));
            w.step = None;
        }
        if generation != current {
            // It is in no ring of the current generation.
            if let Some(e) = self.jobs.get_mut(job) {
                e.acked.insert(worker.to_string());
            }
        }
        if generation == current && place == rank && job_state != JobState::Recovering {
            tracing::info!(worker, job, generation, rank, "worker rejoined its job");
            return;
        }
        self.begin_recovery(
            job,
            Vec::new(),
            format!(
                "worker {worker} rejoined from generation {generation} (the job is at {current})"
            ),
            now,
            fx,
        );
    }

    /// A worker is gone (stream ended, lease expired, heartbeat TTL passed,
    /// or it detached): its job recovers without it.
    pub(super) fn lost(
        &mut self,
        worker: &str,
        conn: Option<u64>,
        reason: &str,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        self.remove_worker(worker, conn, reason, false, now, fx);
        self.schedule(now, fx);
    }

    pub(super) fn remove_worker(
        &mut self,
        worker: &str,
        conn: Option<u64>,
        reason: &str,
        planned: bool,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        let matches = self
            .workers
            .get(worker)
            .is_some_and(|w| conn.is_none_or(|c| c == w.conn));
        if !matches {
            return;
        }
        let Some(w) = self.workers.remove(worker) else {
            return;
        };
        if planned {
            tracing::info!(worker, reason, "worker detached");
        } else {
            tracing::warn!(worker, reason, "worker lost");
        }
        fx.push(Effect::Close {
            worker: worker.into(),
            conn: w.conn,
        });
        if let Some((job, rank)) = w.job {
            let what = if planned { "detached" } else { "lost worker" };
            let reason = if planned {
                format!("worker {worker} (rank {rank}) {what}: {reason}")
            } else {
                format!("{what} {worker} (rank {rank}): {reason}")
            };
            self.begin_recovery(&job, vec![worker.to_string()], reason, now, fx);
        }
    }

    pub(super) fn tick(&mut self, now: i64, fx: &mut Vec<Effect>) {
        let ttl = self.cfg.heartbeat_ttl_ms;
        let seen: Vec<(String, i64)> = self
            .workers
            .iter()
            .map(|(id, w)| (id.clone(), w.last_seen_ms))
            .collect();
        for id in state::expired(now, &seen, ttl) {
            self.remove_worker(&id, None, "no heartbeat within the TTL", false, now, fx);
        }
        let overdue: Vec<(String, Vec<String>)> = self
            .jobs
            .values()
            .filter(|e| e.reattach_by.is_some_and(|t| now >= t))
            .map(|e| {
                let missing = e
                    .job
                    .workers
                    .iter()
                    .filter(|w| self.workers.get(*w).is_none_or(|x| !x.serves(&e.job.id)))
                    .cloned()
                    .collect();
                (e.job.id.clone(), missing)
            })
            .collect();
        for (job, missing) in overdue {
            if let Some(e) = self.jobs.get_mut(&job) {
                e.reattach_by = None;
            }
            if !missing.is_empty() {
                let reason = format!(
                    "{} did not re-attach after the coordinator restarted",
                    missing.join(", ")
                );
                self.begin_recovery(&job, missing, reason, now, fx);
            }
        }
        self.schedule(now, fx);
    }
}
