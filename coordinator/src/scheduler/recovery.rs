//! Generations: recovery (abort, wait for the survivors, re-form, shrink,
//! fail), growth, gang placement of pending jobs, and forming a generation
//! (the one place k is decided).

use super::*;

/// Adds the workers `lost` to a recovery's lost list, each once (a worker
/// can be lost, re-attach and be lost again before the ring re-forms).
pub(super) fn add_lost(list: &mut Vec<String>, lost: Vec<String>) {
    for w in lost {
        if !list.contains(&w) {
            list.push(w);
        }
    }
}

/// A recovery's reason with one more cause (`; `-separated), at most
/// [`MAX_REASON_BYTES`] in all: past that, further causes are left out
/// (the job's history keeps each one's transition).
pub(super) fn add_reason(reason: &str, more: &str) -> String {
    if reason.len() >= MAX_REASON_BYTES {
        return reason.to_string();
    }
    clip(&format!("{reason}; {more}"))
}

impl Cluster {
    /// Sends `m()` to every worker serving `job`.
    fn tell_members(
        &self,
        job: &str,
        m: impl Fn() -> coordinator_message::Msg,
        fx: &mut Vec<Effect>,
    ) {
        for (id, w) in self.workers.iter().filter(|(_, w)| w.serves(job)) {
            fx.push(Effect::Send {
                worker: id.clone(),
                conn: w.conn,
                msg: msg(m()),
            });
        }
    }

    /// Tells every worker serving `job` to stop it (each stays busy until
    /// its JobDone arrives).
    pub(super) fn stop_members(&self, job: &str, reason: &str, fx: &mut Vec<Effect>) {
        let stop = || {
            coordinator_message::Msg::Stop(v1::Stop {
                job_id: job.into(),
                reason: reason.into(),
            })
        };
        self.tell_members(job, stop, fx);
    }

    /// Fails a job and stops its ranks.
    pub(super) fn fail(&mut self, job_id: &str, reason: String, now: i64, fx: &mut Vec<Effect>) {
        let Some(entry) = self.jobs.get_mut(job_id) else {
            return;
        };
        if state::is_final(entry.job.state()) {
            return;
        }
        entry.job.error = reason.clone();
        if let Ok(t) = state::transition(&mut entry.job, JobState::Failed, reason.clone(), now) {
            fx.push(transition_event(&entry.job, t));
        }
        save(entry, fx);
        self.stop_members(job_id, &reason, fx);
    }

    /// Starts (or extends) the recovery of a running job: the window in
    /// flight is aborted on every surviving rank, then the ring re-forms as
    /// soon as `reform_decision` allows.
    pub(super) fn begin_recovery(
        &mut self,
        job_id: &str,
        lost: Vec<String>,
        reason: String,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(entry) = self.jobs.get_mut(job_id) else {
            return;
        };
        let from = entry.job.state();
        if !matches!(
            from,
            JobState::Rendezvous | JobState::Running | JobState::Recovering
        ) {
            return;
        }
        tracing::warn!(job = job_id, generation = entry.job.generation, %reason, "recovering");
        entry.last_cause = clip(&reason);
        let open = entry
            .job
            .recoveries
            .last_mut()
            .filter(|r| r.generation == 0 && from == JobState::Recovering);
        match open {
            Some(r) => {
                add_lost(&mut r.lost, lost);
                r.reason = add_reason(&r.reason, &reason);
            }
            None => {
                let mut record = v1::Recovery {
                    reason: clip(&reason),
                    started_unix_ms: now,
                    ..Default::default()
                };
                add_lost(&mut record.lost, lost);
                state::push_recovery(&mut entry.job, record);
                if let Ok(t) = state::transition(&mut entry.job, JobState::Recovering, reason, now)
                {
                    fx.push(transition_event(&entry.job, t));
                }
                entry.recovering_since = Some(now);
            }
        }
        save(entry, fx);
        let generation = entry.job.generation;
        let abort = || {
            coordinator_message::Msg::Abort(v1::Abort {
                job_id: job_id.into(),
                generation,
                reason: "re-forming the ring".into(),
            })
        };
        self.tell_members(job_id, abort, fx);
    }

    /// Free workers (no job, nothing draining), in id order.
    pub(super) fn free_workers(&self) -> Vec<String> {
        self.workers
            .iter()
            .filter(|(_, w)| w.free())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Re-forms and grows running jobs, then places admitted pending jobs
    /// on free workers (gang, FIFO; a job wider than every attached worker
    /// waits aside without blocking the queue).
    pub(super) fn schedule(&mut self, now: i64, fx: &mut Vec<Effect>) {
        self.reform_jobs(now, fx);
        let waiting: Vec<Waiting> = self
            .order
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .filter(|e| e.admitted && e.job.state() == JobState::Pending)
            .map(|e| Waiting {
                job: e.job.id.clone(),
                world: e.spec.as_ref().map_or(1, |s| s.workers.max(1)) as usize,
            })
            .collect();
        let free = self.free_workers();
        // Every attached worker, busy or draining ones included: the most
        // any job could ever be given without another attaching.
        let capacity = self.workers.len();
        for (job_id, workers) in state::gang_schedule(&waiting, &free, capacity) {
            self.form(&job_id, workers, now, fx);
        }
    }

    /// Re-forms recovering jobs that can be, and grows elastic ones that
    /// idle workers can join (recovering jobs come before pending ones:
    /// they hold state).
    pub(super) fn reform_jobs(&mut self, now: i64, fx: &mut Vec<Effect>) {
        let ids: Vec<String> = self.order.clone();
        for id in ids {
            let Some(entry) = self.jobs.get(&id) else {
                continue;
            };
            let state_now = entry.job.state();
            if state_now != JobState::Recovering && state_now != JobState::Running {
                continue;
            }
            let domain = match entry.spec.clone() {
                Ok(d) => d,
                // A stored spec this coordinator cannot read (one written
                // before an incompatible upgrade): it can never re-form.
                Err(e) if state_now == JobState::Recovering => {
                    self.fail(&id, format!("cannot re-form: {e}"), now, fx);
                    continue;
                }
                Err(_) => continue,
            };
            // A generation is whole replicas (pipeline x tensor workers,
            // issue 38) whose data degree gives a valid k.
            let valid = |n: usize| {
                u32::try_from(n).is_ok_and(|w| domain.parallel_dims_for(w).is_ok())
                    && domain.accumulation_steps(n as u64).is_ok()
            };
            let members = entry.job.workers.clone();
            let survivors: Vec<String> = members
                .iter()
                .filter(|w| self.workers.get(*w).is_some_and(|x| x.serves(&id)))
                .cloned()
                .collect();
            let free = self.free_workers();
            let max = domain
                .max_workers
                .unwrap_or(domain.workers)
                .max(domain.workers) as usize;
            let world = if state_now == JobState::Recovering {
                if entry.stalled >= MAX_STALLED_REFORMS {
                    // The cause, not only the count: what each generation
                    // broke on (a rank's error) is what the user must fix.
                    let reason = clip(&format!(
                        "{} re-formations in a row without a committed step; the last broke on: {}",
                        entry.stalled, entry.last_cause
                    ));
                    self.fail(&id, reason, now, fx);
                    continue;
                }
                if entry.reattach_by.is_some() {
                    // Members may still come back after a restart.
                    continue;
                }
                // A survivor still in the broken ring would not hear of the
                // new one (and a peer that died but is not known lost yet
                // would be taken in again): wait until each has confirmed,
                // or the grace has passed.
                let waited = now - entry.recovering_since.unwrap_or(now);
                if waited < ACK_GRACE_MS && survivors.iter().any(|w| !entry.acked.contains(w)) {
                    continue;
                }
                let want = (domain.workers as usize).max(survivors.len()).min(max);
                let min = domain.min_workers.unwrap_or(domain.workers) as usize;
                let timeout = (domain.comm.rendezvous_timeout_s * 1000.0) as i64;
                match state::reform_decision(
                    survivors.len(),
                    free.len(),
                    want,
                    min,
                    waited,
                    timeout,
                    valid,
                ) {
                    state::Reform::Wait => continue,
                    state::Reform::Fail(reason) => {
                        let why = entry
                            .job
                            .recoveries
                            .last()
                            .map(|r| format!(" (recovering from: {})", r.reason))
                            .unwrap_or_default();
                        self.fail(&id, format!("{reason}{why}"), now, fx);
                        continue;
                    }
                    state::Reform::Form(n) => n,
                }
            } else {
                let pending = self
                    .jobs
                    .values()
                    .any(|e| e.admitted && e.job.state() == JobState::Pending);
                if pending || entry.reattach_by.is_some() || survivors.len() != members.len() {
                    continue;
                }
                match state::grow_decision(members.len(), free.len(), max, valid) {
                    Some(n) => n,
                    None => continue,
                }
            };
            let alive = |w: &str| survivors.iter().any(|s| s == w);
            let newcomers: Vec<String> = free
                .iter()
                .take(world.saturating_sub(survivors.len()))
                .cloned()
                .collect();
            let replica = domain.replica_size() as usize;
            let ranks = state::reform_ranks(&members, alive, &newcomers, world, replica);
            self.form(&id, ranks, now, fx);
        }
    }

    /// Starts a new generation of `job_id` on `workers` (by rank).
    pub(super) fn form(
        &mut self,
        job_id: &str,
        workers: Vec<String>,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(entry) = self.jobs.get_mut(job_id) else {
            return;
        };
        let domain = match entry.spec.clone() {
            Ok(d) => d,
            Err(e) => return self.fail(job_id, e, now, fx),
        };
        // The assignments carry the record's wire form.
        let spec = entry.job.spec.clone().unwrap_or_default();
        let world = workers.len();
        // The mesh of this generation: whole replicas of pipeline x tensor
        // ranks, the data axis what the world leaves.
        let dims = match u32::try_from(world)
            .map_err(|_| format!("{world} workers"))
            .and_then(|w| domain.parallel_dims_for(w).map_err(|e| e.to_string()))
        {
            Ok(d) => d,
            Err(e) => {
                return self.fail(
                    job_id,
                    format!("cannot form generation of {world} workers: {e}"),
                    now,
                    fx,
                )
            }
        };
        // k is decided here, once; the workers take the assignment's value.
        let k = match domain
            .accumulation_steps(world as u64)
            .map_err(|e| e.to_string())
            .and_then(|k| u32::try_from(k).map_err(|_| format!("k = {k} exceeds {}", u32::MAX)))
        {
            Ok(k) => k,
            Err(e) => {
                return self.fail(
                    job_id,
                    format!("cannot run on {world} workers: {e}"),
                    now,
                    fx,
                )
            }
        };
        let first = entry.job.generation == 0;
        let growing = entry.job.state() == JobState::Running;
        let previous = entry.job.workers.clone();
        entry.job.generation += 1;
        entry.job.workers = workers.clone();
        entry.job.accumulation_steps = k;
        entry.recovering_since = None;
        entry.acked.clear();
        let generation = entry.job.generation;
        let joined: Vec<String> = workers
            .iter()
            .filter(|w| !previous.contains(w))
            .cloned()
            .collect();
        let committed = entry.job.counters.as_ref().map_or(0, |c| c.step);
        let reason = if first {
            format!(
                "assigned to {} (generation {generation})",
                workers.join(", ")
            )
        } else {
            entry.stalled += 1;
            if growing {
                state::push_recovery(
                    &mut entry.job,
                    v1::Recovery {
                        reason: format!("growing: {} joined", joined.join(", ")),
                        started_unix_ms: now,
                        ..Default::default()
                    },
                );
                if let Ok(t) = state::transition(
                    &mut entry.job,
                    JobState::Recovering,
                    format!("growing to {world} workers"),
                    now,
                ) {
                    fx.push(transition_event(&entry.job, t));
                }
            }
            if let Some(r) = entry.job.recoveries.last_mut() {
                r.generation = generation;
                r.joined = joined.clone();
                r.reformed_unix_ms = now;
                r.world_size = world as u32;
                r.accumulation_steps = k;
            }
            format!(
                "re-formed on {} (generation {generation}, W = {world}, k = {k}, from step {committed})",
                workers.join(", ")
            )
        };
        if let Ok(t) = state::transition(&mut entry.job, JobState::Rendezvous, reason, now) {
            fx.push(transition_event(&entry.job, t));
        }
        let ckpt = domain.checkpoint.dir.clone().unwrap_or_else(|| {
            accrue_proto::layout::default_checkpoint_dir(&self.cfg.state_dir, job_id)
        });
        let peers: Vec<String> = workers
            .iter()
            .map(|w| {
                self.workers
                    .get(w)
                    .map(|x| x.data_addr.clone())
                    .unwrap_or_default()
            })
            .collect();
        let secret = (self.ring_keys)(job_id, generation);
        save(entry, fx);
        // Members of the previous generation left out of this one (a
        // shrink to a world that keeps k whole) stop the job and are free
        // once they have.
        for w in previous.iter().filter(|w| !workers.contains(w)) {
            if let Some(we) = self.workers.get_mut(w).filter(|x| x.serves(job_id)) {
                we.job = None;
                we.step = None;
                we.draining = Some(job_id.to_string());
                fx.push(Effect::Send {
                    worker: w.clone(),
                    conn: we.conn,
                    msg: msg(coordinator_message::Msg::Stop(v1::Stop {
                        job_id: job_id.into(),
                        reason: format!("not a member of generation {generation}"),
                    })),
                });
            }
        }
        for (rank, w) in workers.iter().enumerate() {
            let a = v1::Assignment {
                job_id: job_id.to_string(),
                spec: Some(spec.clone()),
                rank: rank as u32,
                world_size: world as u32,
                peers: peers.clone(),
                generation,
                secret: secret.clone(),
                accumulation_steps: k,
                resume_step: committed,
                checkpoint_dir: ckpt.display().to_string(),
                coords: Some({
                    let c = dims.coords(rank as u32);
                    v1::MeshCoords {
                        data: c.data,
                        pipeline: c.pipeline,
                        tensor: c.tensor,
                        data_degree: dims.data,
                        pipeline_degree: dims.pipeline,
                        tensor_degree: dims.tensor,
                    }
                }),
            };
            if let Some(we) = self.workers.get_mut(w) {
                we.job = Some((job_id.to_string(), rank as u32));
                we.step = None;
                fx.push(Effect::Send {
                    worker: w.clone(),
                    conn: we.conn,
                    msg: msg(coordinator_message::Msg::Assign(a)),
                });
            }
        }
    }
}
