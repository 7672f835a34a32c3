//! What workers report: steps, evaluations, completions, interruptions, and
//! whether a report counts at all (generation, rank, membership).

use super::*;

impl Cluster {
    /// Whether `worker` holds `rank` in the current generation of `job`.
    pub(super) fn member(&self, job: &str, generation: u64, rank: u32, worker: &str) -> bool {
        self.jobs.get(job).is_some_and(|e| {
            e.job.generation == generation
                && e.job
                    .workers
                    .get(rank as usize)
                    .is_some_and(|w| w == worker)
        })
    }

    /// Answers a refused message with Refused (every time: the worker
    /// acts on it); the first of each (job, generation) is logged as a
    /// warning, later ones at debug level (see [`RefusalLog`]).
    pub(super) fn refuse(
        &mut self,
        worker: &str,
        conn: u64,
        job: &str,
        generation: u64,
        reason: String,
        fx: &mut Vec<Effect>,
    ) {
        let n = self.refusals.note(job, generation);
        let shown = accrue_common::spec::shown(job);
        if n == 1 {
            tracing::warn!(worker, job = %shown, generation, %reason, "message refused (more for this job and generation are logged at debug level)");
        } else {
            tracing::debug!(worker, job = %shown, generation, refused = n, %reason, "message refused");
        }
        fx.push(Effect::Send {
            worker: worker.into(),
            conn,
            msg: msg(coordinator_message::Msg::Refused(v1::Refused {
                job_id: job.into(),
                generation,
                reason,
            })),
        });
    }

    /// Why a message about (`job`, `generation`, `rank`) from `worker` is
    /// not taken (None: it is): the job must exist, be live and be at that
    /// generation, and the worker must hold that rank in it.
    pub(super) fn refusal(
        &self,
        worker: &str,
        job: &str,
        generation: u64,
        rank: u32,
    ) -> Option<String> {
        let Some(e) = self.jobs.get(job) else {
            return Some("unknown job".into());
        };
        if generation != e.job.generation || state::is_final(e.job.state()) {
            return Some(format!(
                "report of generation {generation} ignored: job {job} is at generation {} ({})",
                e.job.generation,
                state_name(e.job.state())
            ));
        }
        if !self.member(job, generation, rank, worker) {
            return Some(format!(
                "worker {worker} is not rank {rank} of job {job} generation {generation}"
            ));
        }
        None
    }

    pub(super) fn message(
        &mut self,
        worker: &str,
        conn: u64,
        m: WorkerMessage,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(w) = self.workers.get_mut(worker).filter(|w| w.conn == conn) else {
            // A connection that has been replaced or removed.
            return;
        };
        w.last_seen_ms = now;
        match m.msg {
            Some(worker_message::Msg::Step(r)) => self.on_step(worker, conn, r, now, fx),
            Some(worker_message::Msg::Eval(e)) => {
                // The rank that owns the loss evaluates for the job (the
                // last pipeline stage's tensor rank 0 of replica 0).
                let owner = self.jobs.get(&m.job_id).is_some_and(|e| {
                    self.member(&m.job_id, m.generation, loss_owner(&e.job), worker)
                });
                if let Some(entry) = self.jobs.get_mut(&m.job_id).filter(|_| owner) {
                    entry.job.eval = Some(e);
                    crate::series::push_eval(&mut entry.series, e, now);
                    fx.push(Effect::Event(Box::new(JobEvent {
                        job: Some(entry.job.clone()),
                        event: Some(v1::job_event::Event::Eval(e)),
                    })));
                }
            }
            Some(worker_message::Msg::Done(d)) => self.on_done(worker, conn, d, now, fx),
            Some(worker_message::Msg::Interrupted(i)) => {
                if self
                    .refusal(worker, &i.job_id, i.generation, i.rank)
                    .is_some()
                {
                    return;
                }
                let Some(e) = self.jobs.get_mut(&i.job_id) else {
                    return;
                };
                e.acked.insert(worker.to_string());
                if matches!(e.job.state(), JobState::Rendezvous | JobState::Running) {
                    let reason = format!(
                        "rank {} on worker {worker} interrupted at step {}: {}",
                        i.rank,
                        i.step,
                        clip(&i.error)
                    );
                    self.begin_recovery(&i.job_id, Vec::new(), reason, now, fx);
                }
                self.schedule(now, fx);
            }
            Some(worker_message::Msg::Detach(d)) => {
                self.remove_worker(worker, Some(conn), &clip(&d.reason), true, now, fx);
                self.schedule(now, fx);
            }
            Some(worker_message::Msg::Hello(_))
            | Some(worker_message::Msg::Heartbeat(_))
            | None => {}
        }
    }

    pub(super) fn on_step(
        &mut self,
        worker: &str,
        conn: u64,
        r: StepReport,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        if let Some(reason) = self.refusal(worker, &r.job_id, r.generation, r.rank) {
            return self.refuse(worker, conn, &r.job_id, r.generation, reason, fx);
        }
        let world = self
            .jobs
            .get(&r.job_id)
            .map_or(1, |e| e.job.workers.len().max(1));
        if let Some(w) = self.workers.get_mut(worker) {
            w.step = Some((r.step, r.samples_per_sec / world as f64));
            w.timing = r.timing;
        }
        let Some(entry) = self.jobs.get_mut(&r.job_id) else {
            return;
        };
        // Each rank's peak memory (issue 41), for readers of the job.
        if r.generation == entry.job.generation {
            if entry.peaks.0 != r.generation {
                entry.peaks = (r.generation, vec![0; entry.job.workers.len()]);
            }
            if let Some(p) = entry.peaks.1.get_mut(r.rank as usize) {
                *p = (*p).max(r.peak_rss_bytes);
            }
        }
        // The loss and the reports belong to the rank that computes the loss.
        if r.rank != loss_owner(&entry.job) {
            return;
        }
        crate::series::push_step(&mut entry.series, &r, now);
        let c = entry.job.counters.get_or_insert_with(Default::default);
        let reported = c.step;
        c.step = r.step;
        c.total_steps = r.total_steps;
        c.micro_step = r.micro_step;
        c.window = r.step;
        c.epoch = r.epoch;
        c.samples_seen = r.samples_seen;
        c.skipped_steps += r.skipped as u64;
        c.loss = r.loss;
        c.grad_norm = r.grad_norm;
        c.clip_coef = r.clip_coef;
        c.lr = r.lr;
        c.samples_per_sec = r.samples_per_sec;
        c.timing = r.timing;
        c.bytes_sent = r.bytes_sent;
        c.loss_scale = r.loss_scale;
        entry.stalled = 0;
        let mut dirty = false;
        if !r.resumed_from.is_empty() {
            // Rank 0's first report of a generation says where its state
            // came from: the generation's recovery record keeps it.
            if let Some(rec) = entry
                .job
                .recoveries
                .iter_mut()
                .rev()
                .find(|x| x.generation == r.generation && x.loaded.is_empty())
            {
                rec.loaded = clip(&r.resumed_from);
                dirty = true;
            }
        }
        if entry.job.state() == JobState::Rendezvous {
            if let Some(rec) = entry
                .job
                .recoveries
                .last_mut()
                .filter(|x| x.generation == r.generation && x.first_step_unix_ms == 0)
            {
                rec.first_step_unix_ms = now;
                rec.resumed_step = r.step.saturating_sub(1);
                rec.redone_steps = reported.saturating_sub(rec.resumed_step);
            }
            let reason = format!(
                "the ring of generation {} formed and step {} committed",
                r.generation, r.step
            );
            if let Ok(t) = state::transition(&mut entry.job, JobState::Running, reason, now) {
                fx.push(transition_event(&entry.job, t));
                entry.saved_ms = now;
                save(entry, fx);
                dirty = false;
            }
        }
        fx.push(Effect::Event(Box::new(JobEvent {
            job: Some(crate::domain::step_view(&entry.job)),
            event: Some(v1::job_event::Event::Step(r)),
        })));
        if dirty || now - entry.saved_ms >= 1000 {
            entry.saved_ms = now;
            save(entry, fx);
        }
        if now - entry.series_saved_ms >= SERIES_SAVE_MS {
            save_series(entry, now, fx);
        }
    }

    pub(super) fn on_done(
        &mut self,
        worker: &str,
        conn: u64,
        d: v1::JobDone,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        // The worker is free again once its thread for the job has ended,
        // whatever the job's state.
        if let Some(w) = self.workers.get_mut(worker) {
            if w.serves(&d.job_id) {
                w.job = None;
                w.step = None;
            }
            if w.draining.as_deref() == Some(d.job_id.as_str()) {
                w.draining = None;
            }
        }
        let live = self
            .jobs
            .get(&d.job_id)
            .is_some_and(|e| !state::is_final(e.job.state()));
        match self.refusal(worker, &d.job_id, d.generation, d.rank) {
            Some(reason) if live => self.refuse(worker, conn, &d.job_id, d.generation, reason, fx),
            Some(_) => {}
            None if !d.ok => {
                let reason = format!(
                    "rank {} on worker {worker} failed: {}",
                    d.rank,
                    clip(&d.error)
                );
                self.fail(&d.job_id, reason, now, fx);
            }
            None if self
                .jobs
                .get(&d.job_id)
                .is_some_and(|e| d.rank == loss_owner(&e.job)) =>
            {
                if let Some(entry) = self.jobs.get_mut(&d.job_id) {
                    entry.job.checkpoint = d.checkpoint.clone();
                    if d.eval.is_some() {
                        entry.job.eval = d.eval;
                    }
                    let c = entry.job.counters.get_or_insert_with(Default::default);
                    if d.total_steps > 0 && d.step >= c.step {
                        // Reports made while no coordinator listened can be
                        // lost with it; the rank's own end state is exact.
                        c.step = d.step;
                        c.window = d.step;
                        c.samples_seen = d.samples_seen;
                        c.total_steps = d.total_steps;
                        c.epoch = d.epoch;
                    }
                    let steps = entry.job.counters.as_ref().map_or(0, |c| c.step);
                    if let Ok(t) = state::transition(
                        &mut entry.job,
                        JobState::Succeeded,
                        format!("finished {steps} optimizer steps"),
                        now,
                    ) {
                        fx.push(transition_event(&entry.job, t));
                    }
                    save(entry, fx);
                }
            }
            None => {}
        }
        self.schedule(now, fx);
    }
}

/// The rank whose reports (loss, counters, eval, its end) speak for `job`:
/// the last pipeline stage's tensor rank 0 of data replica 0
/// (`ParallelDims::loss_owner`; rank 0 while the model is not split). It
/// depends on the pipeline and tensor degrees only, which a job keeps for
/// its whole life.
pub(crate) fn loss_owner(job: &Job) -> u32 {
    model_dims(job).loss_owner()
}

/// `job`'s pipeline and tensor degrees (data left at 1: neither the loss
/// owner nor a rank's coordinates depend on it).
pub fn model_dims(job: &Job) -> accrue_common::spec::ParallelDims {
    let p = job.spec.as_ref().and_then(|s| s.parallel.as_ref());
    accrue_common::spec::ParallelDims {
        data: 1,
        pipeline: p.and_then(|p| p.pipeline).unwrap_or(1).max(1),
        tensor: p.and_then(|p| p.tensor).unwrap_or(1).max(1),
    }
}

/// Where `rank` of `job` sits: its data replica, pipeline stage and
/// tensor rank (stages of a replica in consecutive ranks).
pub fn coords_of(job: &Job, rank: u32) -> accrue_common::spec::Coords {
    model_dims(job).coords(rank)
}

impl Cluster {
    /// Rank `rank`'s peak resident memory in job `id`'s current generation.
    pub fn peak_of(&self, id: &str, rank: u32) -> Option<u64> {
        let e = self.jobs.get(id)?;
        (e.peaks.0 == e.job.generation)
            .then(|| e.peaks.1.get(rank as usize).copied())
            .flatten()
            .filter(|&p| p > 0)
    }

    /// The job as a reader sees it: with each rank's peak memory so far and
    /// the spec's memory estimate per worker (neither stored).
    pub fn job_view(&self, id: &str) -> Option<Job> {
        let e = self.jobs.get(id)?;
        let mut job = e.job.clone();
        if e.peaks.0 == job.generation {
            job.peak_rss_bytes = e.peaks.1.clone();
        }
        job.memory_estimate_bytes = e.spec.as_ref().map_or(0, |s| s.memory_estimate().total());
        Some(job)
    }
}

#[cfg(test)]
mod loss_owner_tests {
    use super::*;

    #[test]
    fn the_loss_owner_is_the_last_stage_of_the_first_replica() {
        let job = |pipeline, tensor| Job {
            spec: Some(v1::JobSpec {
                parallel: Some(v1::ParallelSpec {
                    data: None,
                    pipeline,
                    tensor,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(loss_owner(&Job::default()), 0);
        assert_eq!(loss_owner(&job(None, None)), 0);
        assert_eq!(loss_owner(&job(Some(2), Some(2))), 2);
        assert_eq!(loss_owner(&job(Some(4), None)), 3);
        assert_eq!(loss_owner(&job(None, Some(4))), 0);
        // Stages of a replica in consecutive ranks, tensor ranks inside.
        let c = coords_of(&job(Some(2), None), 3);
        assert_eq!((c.data, c.pipeline, c.tensor), (1, 1, 0));
        let c = coords_of(&job(Some(2), Some(2)), 5);
        assert_eq!((c.data, c.pipeline, c.tensor), (1, 0, 1));
        let c = coords_of(&Job::default(), 3);
        assert_eq!((c.data, c.pipeline, c.tensor), (3, 0, 0));
    }
}
