//! `accrue watch` and `submit --wait`: follow a job's events, print its
//! numbers and ETA, and watch again after losing the coordinator.

use crate::{event_json, state_name, status_err, Client};
use accrue_proto::v1::{self, job_event, Job, JobState};
use std::time::Duration;

/// How long `watch` keeps trying to watch again after losing the
/// coordinator: enough for a leader's lease to expire, a follower to take
/// over and a Kubernetes controller to restart a pod.
pub const REWATCH_LIMIT: Duration = Duration::from_secs(120);

/// Whether `watch` opens the job's stream again: the stream failed with
/// `code` (None: it ended cleanly) while the job was last seen in `last`,
/// `lost_for` after the first failure in a row. A coordinator that dies or
/// steps down ends the stream before the job ends; one from before
/// watchers were sent a fresh snapshot ends a watcher that fell behind
/// with DATA_LOSS; an answer about the request itself (not found, not
/// allowed) is final.
pub fn rewatch(code: Option<tonic::Code>, last: Option<JobState>, lost_for: Duration) -> bool {
    use tonic::Code;
    if lost_for > REWATCH_LIMIT {
        return false;
    }
    match code {
        None => !last.is_some_and(accrue_coordinator::state::is_final),
        Some(c) => matches!(
            c,
            Code::Unavailable
                | Code::Unknown
                | Code::Internal
                | Code::Cancelled
                | Code::Aborted
                | Code::DeadlineExceeded
                | Code::DataLoss
        ),
    }
}

/// Follows a job until it ends; returns the final job. With `json` every
/// event is printed as one JSON line (see [`event_json`]).
/// Returns early, with the job as last seen, once stdout's reader has gone
/// (`accrue watch ID | head`): the job itself goes on.
pub async fn watch(client: &mut Client, id: &str, json: bool) -> anyhow::Result<Job> {
    watch_until(client, id, json, true).await
}

/// [`watch`] to the job's end even when nobody reads stdout any more
/// (`accrue local`, whose job must not depend on its terminal).
pub async fn follow(client: &mut Client, id: &str, json: bool) -> anyhow::Result<Job> {
    watch_until(client, id, json, false).await
}

async fn watch_until(
    client: &mut Client,
    id: &str,
    json: bool,
    stop_unread: bool,
) -> anyhow::Result<Job> {
    let tty = !json && std::io::IsTerminal::is_terminal(&std::io::stdout());
    let bar = tty.then(|| {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let mut last: Option<Job> = None;
    let mut recent = Recent::default();
    // Since when the coordinator has been lost (None: watching).
    let mut lost: Option<std::time::Instant> = None;
    let mut backoff = Duration::from_millis(200);
    loop {
        let opened = client
            .watch_job(v1::WatchJobRequest { id: id.to_string() })
            .await;
        let mut stream = match opened {
            Ok(s) => s.into_inner(),
            Err(e) => {
                let since = *lost.get_or_insert_with(std::time::Instant::now);
                if !rewatch(
                    Some(e.code()),
                    last.as_ref().map(|j| j.state()),
                    since.elapsed(),
                ) {
                    return Err(status_err(e));
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        let ended = loop {
            match stream.message().await {
                Ok(Some(ev)) => {
                    lost = None;
                    backoff = Duration::from_millis(200);
                    show_event(&ev, &mut last, &mut recent, json, bar.as_ref());
                    if stop_unread && crate::out::closed() {
                        if let Some(b) = &bar {
                            b.finish_and_clear();
                        }
                        return last.ok_or_else(|| anyhow::anyhow!("stdout closed"));
                    }
                }
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        let state = last.as_ref().map(|j| j.state());
        let since = *lost.get_or_insert_with(std::time::Instant::now);
        if !rewatch(ended.as_ref().map(|e| e.code()), state, since.elapsed()) {
            if let Some(e) = ended {
                return Err(status_err(e));
            }
            break;
        }
        let text = match ended {
            Some(e) if e.code() == tonic::Code::DataLoss => format!(
                "fell behind the job's events ({}); watching {id} again",
                accrue_proto::status_chain(&e)
            ),
            Some(e) => format!(
                "lost the coordinator ({}); watching {id} again",
                accrue_proto::status_chain(&e)
            ),
            None => format!(
                "lost the coordinator (the stream ended before the job); watching {id} again"
            ),
        };
        match &bar {
            Some(b) => b.println(text),
            None => crate::errln!("{text}"),
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    last.ok_or_else(|| anyhow::anyhow!("the watch stream ended without any event"))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The last step reports `watch` saw, (step, unix ms), for the ETA.
#[derive(Default)]
struct Recent(std::collections::VecDeque<(u64, i64)>);

impl Recent {
    /// Takes a report of `step` at `now_ms`; the ETA of `total` steps
    /// (the coordinator's rule: [`accrue_coordinator::series::eta_s`]).
    fn eta_s(&mut self, step: u64, total: u64, now_ms: i64) -> Option<f64> {
        self.0.push_back((step, now_ms));
        while self.0.len() > 512 || self.0.front().is_some_and(|(_, t)| now_ms - t > 60_000) {
            self.0.pop_front();
        }
        let recent: Vec<_> = self.0.iter().copied().collect();
        accrue_coordinator::series::eta_s(&recent, total)
    }
}

/// A duration for people: `1h02m`, `3m05s`, `12s`, `-` when unknown.
pub fn fmt_eta(s: Option<f64>) -> String {
    let Some(s) = s.filter(|s| s.is_finite() && *s >= 0.0) else {
        return "-".into();
    };
    let s = s.round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// The numbers of a step `watch` shows (the status page's): loss, grad
/// norm, clip coefficient, learning rate, samples/s, samples seen, skipped
/// steps so far and the ETA.
pub fn step_line(r: &v1::StepReport, skipped: u64, eta_s: Option<f64>) -> String {
    line(r, skipped, eta_s, ("samples/s", "seen"), None)
}

/// A language model's step (issue 30) as [`step_line`] shows others': its
/// samples are target tokens, so tokens/s and tokens seen, and the
/// perplexity of its latest evaluation (exp of its loss per token; `-`
/// before the first).
pub fn lm_step_line(
    r: &v1::StepReport,
    skipped: u64,
    eta_s: Option<f64>,
    perplexity: Option<f64>,
) -> String {
    line(
        r,
        skipped,
        eta_s,
        ("tokens/s", "tokens seen"),
        Some(perplexity),
    )
}

/// A step line: the rate and the count seen under `names` (samples or
/// tokens), and a language model's perplexity.
fn line(
    r: &v1::StepReport,
    skipped: u64,
    eta_s: Option<f64>,
    (rate_name, seen_name): (&str, &str),
    perplexity: Option<Option<f64>>,
) -> String {
    let rate = format!(
        "{rate_name} {:.0} {seen_name} {}",
        r.samples_per_sec, r.samples_seen
    );
    let ppl = perplexity.map_or(String::new(), |p| format!(" ppl {}", fmt_ppl(p)));
    format!(
        "loss {:.4} grad_norm {:.4} clip {:.3} lr {:.3e} {rate}{ppl} skipped {skipped} ETA {}",
        r.loss,
        r.grad_norm,
        r.clip_coef,
        r.lr,
        fmt_eta(eta_s)
    )
}

/// A perplexity for people: four significant digits, `-` when unknown.
fn fmt_ppl(p: Option<f64>) -> String {
    match p.filter(|p| p.is_finite()) {
        Some(p) if p < 1e4 => format!(
            "{:.*}",
            3usize.saturating_sub(p.log10().floor().max(0.0) as usize),
            p
        ),
        Some(p) => format!("{p:.3e}"),
        None => "-".into(),
    }
}

/// An evaluation as `watch` prints it: accuracy and loss, or for a
/// language model (`lm`) loss per token, perplexity and next-token
/// accuracy.
pub fn eval_line(e: &v1::EvalResult, lm: bool) -> String {
    if lm {
        format!(
            "eval step {} loss {:.4} perplexity {} accuracy {:.4}",
            e.step,
            e.loss,
            fmt_ppl(accrue_coordinator::http::perplexity(e.loss)),
            e.accuracy
        )
    } else {
        format!(
            "eval step {} accuracy {:.4} loss {:.4}",
            e.step, e.accuracy, e.loss
        )
    }
}

/// Prints one event of a watched job (a progress bar on a terminal, lines
/// otherwise, JSON with `json`) and keeps the job it carries in `last`.
/// A language model's event line for `--json` (issue 30): the same keys,
/// plus its unit and the numbers under token names (a step's samples are
/// target tokens) and an evaluation's perplexity.
fn lm_json(v: &mut serde_json::Value) {
    let get = |k: &str| v.get(k).cloned().unwrap_or_default();
    let extra = match v["event"].as_str() {
        Some("step") => vec![
            ("tokens", get("samples")),
            ("tokens_per_sec", get("samples_per_sec")),
            ("tokens_seen", get("samples_seen")),
        ],
        Some("eval") => vec![(
            "perplexity",
            serde_json::json!(v["loss"]
                .as_f64()
                .and_then(accrue_coordinator::http::perplexity)),
        )],
        _ => return,
    };
    if let Some(o) = v.as_object_mut() {
        o.insert("unit".into(), "tokens".into());
        for (k, x) in extra {
            o.insert(k.into(), x);
        }
    }
}

/// Keeps in `last` the job `ev` carries: a step's carries only the job's
/// id, state and numbers (the rest is the last whole job's, see
/// `accrue_coordinator::domain::step_view`); every other event's is whole.
fn keep_job(last: &mut Option<Job>, ev: &v1::JobEvent) {
    let Some(j) = &ev.job else { return };
    match (&ev.event, last.as_mut()) {
        (Some(job_event::Event::Step(_)), Some(l)) if l.id == j.id => {
            l.state = j.state;
            l.counters = j.counters;
            l.generation = j.generation;
            l.version = j.version;
            l.accumulation_steps = j.accumulation_steps;
        }
        _ => *last = Some(j.clone()),
    }
}

fn show_event(
    ev: &v1::JobEvent,
    last: &mut Option<Job>,
    recent: &mut Recent,
    json: bool,
    bar: Option<&indicatif::ProgressBar>,
) {
    keep_job(last, ev);
    // A language model counts tokens (issue 30).
    let lm = last.as_ref().is_some_and(accrue_coordinator::http::is_lm);
    if json {
        if let Some(mut v) = event_json(ev) {
            if lm {
                lm_json(&mut v);
            }
            crate::outln!("{v}");
        }
        return;
    }
    match &ev.event {
        Some(job_event::Event::Step(r)) => {
            let eta = recent.eta_s(r.step, r.total_steps, now_ms());
            let skipped = last
                .as_ref()
                .and_then(|j| j.counters)
                .map_or(0, |c| c.skipped_steps);
            let line = if lm {
                let ppl = last
                    .as_ref()
                    .and_then(|j| j.eval.as_ref())
                    .and_then(|e| accrue_coordinator::http::perplexity(e.loss));
                lm_step_line(r, skipped, eta, ppl)
            } else {
                step_line(r, skipped, eta)
            };
            match bar {
                Some(b) => {
                    b.set_length(r.total_steps);
                    b.set_position(r.step);
                    b.set_message(line);
                }
                None => crate::outln!("step {}/{} epoch {} {line}", r.step, r.total_steps, r.epoch),
            }
        }
        Some(job_event::Event::Transition(t)) => {
            let to = JobState::try_from(t.to).unwrap_or(JobState::Unspecified);
            let text = format!("{}: {}", state_name(to), t.reason);
            match bar {
                Some(b) => b.println(text),
                None => crate::outln!("{text}"),
            }
        }
        Some(job_event::Event::Eval(e)) => {
            let text = eval_line(e, lm);
            match bar {
                Some(b) => b.println(text),
                None => crate::outln!("{text}"),
            }
        }
        // The snapshot the stream opens with: where the job stands now
        // (the only event for a job that has already ended).
        None => {
            if let Some(j) = &ev.job {
                let why = j.history.last().map_or("", |h| h.reason.as_str());
                let text = format!("{} {}: {why}", j.id, state_name(j.state()));
                match bar {
                    Some(b) => b.println(text),
                    None => crate::outln!("{text}"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        eval_line, fmt_eta, lm_json, lm_step_line, rewatch, step_line, Recent, REWATCH_LIMIT,
    };

    #[test]
    fn watch_shows_the_numbers_and_an_eta() {
        assert_eq!(fmt_eta(None), "-");
        assert_eq!(fmt_eta(Some(f64::NAN)), "-");
        assert_eq!(fmt_eta(Some(12.4)), "12s");
        assert_eq!(fmt_eta(Some(185.0)), "3m05s");
        assert_eq!(fmt_eta(Some(3720.0)), "1h02m");
        let mut recent = Recent::default();
        // Two steps a second, 100 steps to go after step 20: 50 s.
        let mut eta = None;
        for step in 0..=20u64 {
            eta = recent.eta_s(step, 120, 1_000 + 500 * step as i64);
        }
        let eta = eta.unwrap();
        assert!((eta - 50.0).abs() < 1e-9, "{eta}");
        let r = accrue_proto::v1::StepReport {
            step: 20,
            total_steps: 120,
            loss: 0.53219,
            grad_norm: 1.25,
            clip_coef: 0.8,
            lr: 0.05,
            samples_per_sec: 5100.4,
            samples_seen: 7680,
            ..Default::default()
        };
        assert_eq!(
            step_line(&r, 1, Some(eta)),
            "loss 0.5322 grad_norm 1.2500 clip 0.800 lr 5.000e-2 samples/s 5100 seen 7680 skipped 1 ETA 50s"
        );
    }

    /// A language model's steps show tokens/s, tokens seen and the latest
    /// perplexity; its evaluations perplexity instead of accuracy.
    #[test]
    fn watch_shows_a_language_models_tokens_and_perplexity() {
        let r = accrue_proto::v1::StepReport {
            step: 20,
            total_steps: 120,
            loss: 2.5,
            grad_norm: 1.25,
            clip_coef: 1.0,
            lr: 3e-4,
            samples: 8192,
            samples_per_sec: 40960.4,
            samples_seen: 163_840,
            ..Default::default()
        };
        assert_eq!(
            lm_step_line(&r, 0, Some(50.0), Some(2.0f64.exp())),
            "loss 2.5000 grad_norm 1.2500 clip 1.000 lr 3.000e-4 tokens/s 40960 tokens seen 163840 ppl 7.389 skipped 0 ETA 50s"
        );
        let before = lm_step_line(&r, 0, None, None);
        assert!(before.contains(" ppl - "), "{before}");
        assert!(!before.contains("samples"), "{before}");
        let e = accrue_proto::v1::EvalResult {
            step: 20,
            loss: 2.0,
            accuracy: 0.25,
            ..Default::default()
        };
        assert_eq!(
            eval_line(&e, true),
            "eval step 20 loss 2.0000 perplexity 7.389 accuracy 0.2500"
        );
        assert_eq!(
            eval_line(&e, false),
            "eval step 20 accuracy 0.2500 loss 2.0000"
        );
        let big = accrue_proto::v1::EvalResult { loss: 10.0, ..e };
        assert_eq!(
            eval_line(&big, true),
            "eval step 20 loss 10.0000 perplexity 2.203e4 accuracy 0.2500"
        );
        let huge = accrue_proto::v1::EvalResult { loss: 1e6, ..e };
        assert!(eval_line(&huge, true).contains("perplexity - "));
    }

    use accrue_proto::v1::JobState;
    use std::time::Duration;
    use tonic::Code;

    /// `accrue watch` and `submit --wait` outlive a coordinator failover:
    /// a lost connection or a stream that ends before the job does is
    /// watched again, for a bounded time; answers about the request are
    /// final, and so is a stream that ends with the job.
    #[test]
    fn a_lost_coordinator_is_watched_again_within_the_limit() {
        let running = Some(JobState::Running);
        let soon = Duration::from_secs(1);
        for c in [
            Code::Unavailable,
            Code::Unknown,
            Code::Internal,
            Code::Cancelled,
            // An older coordinator's answer to a watcher that fell behind.
            Code::DataLoss,
        ] {
            assert!(rewatch(Some(c), running, soon), "{c:?}");
            assert!(
                !rewatch(Some(c), running, REWATCH_LIMIT + soon),
                "{c:?} after the limit"
            );
        }
        for c in [
            Code::NotFound,
            Code::PermissionDenied,
            Code::Unauthenticated,
            Code::InvalidArgument,
        ] {
            assert!(!rewatch(Some(c), running, soon), "{c:?}");
        }
        assert!(rewatch(None, running, soon), "ended before the job");
        assert!(rewatch(None, None, soon), "ended before any event");
        for s in [JobState::Succeeded, JobState::Failed, JobState::Cancelled] {
            assert!(!rewatch(None, Some(s), soon), "{s:?}");
        }
    }

    /// A step event's job is its id, state and numbers: the watcher keeps
    /// the spec, history and evaluation of the last whole job it saw.
    #[test]
    fn a_step_updates_the_numbers_of_the_job_it_kept() {
        use accrue_proto::v1::{job_event, Counters, Job, JobEvent, StepReport};
        let whole = Job {
            id: "j-1".into(),
            spec: Some(Default::default()),
            history: vec![Default::default(); 3],
            eval: Some(Default::default()),
            ..Default::default()
        };
        let mut last = None;
        super::keep_job(
            &mut last,
            &JobEvent {
                job: Some(whole.clone()),
                event: None,
            },
        );
        let mut slim = Job {
            id: "j-1".into(),
            counters: Some(Counters {
                step: 7,
                ..Default::default()
            }),
            generation: 2,
            ..Default::default()
        };
        slim.set_state(JobState::Running);
        super::keep_job(
            &mut last,
            &JobEvent {
                job: Some(slim),
                event: Some(job_event::Event::Step(StepReport::default())),
            },
        );
        let kept = last.unwrap();
        assert_eq!(kept.counters.unwrap().step, 7);
        assert_eq!((kept.state(), kept.generation), (JobState::Running, 2));
        assert_eq!(
            (kept.spec, kept.history.len(), kept.eval.is_some()),
            (whole.spec, 3, true)
        );
    }

    #[test]
    fn a_language_model_s_json_lines_name_tokens_and_perplexity() {
        let mut step = serde_json::json!({
            "event": "step", "samples": 8192, "samples_per_sec": 5000.0, "samples_seen": 81920,
        });
        lm_json(&mut step);
        assert_eq!(step["unit"], "tokens");
        assert_eq!(
            (
                &step["tokens"],
                &step["tokens_per_sec"],
                &step["tokens_seen"]
            ),
            (
                &serde_json::json!(8192),
                &serde_json::json!(5000.0),
                &serde_json::json!(81920)
            )
        );
        assert_eq!(step["samples"], 8192, "the existing keys stay");
        let mut eval = serde_json::json!({"event": "eval", "loss": 2.0});
        lm_json(&mut eval);
        assert!((eval["perplexity"].as_f64().unwrap() - 2.0f64.exp()).abs() < 1e-12);
        let mut other = serde_json::json!({"event": "transition"});
        lm_json(&mut other);
        assert!(other.get("unit").is_none());
    }
}
