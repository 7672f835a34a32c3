//! `accrue status JOB`: one job, in words.

use crate::{eval_words, state_name};
use accrue_proto::v1::{Job, JobState};

pub(crate) fn print_job(j: &Job) {
    let c = j.counters.unwrap_or_default();
    println!("job        {}", j.id);
    println!("state      {}", state_name(j.state()));
    println!(
        "owner      {}",
        if j.owner.is_empty() { "-" } else { &j.owner }
    );
    println!(
        "workers    {} (generation {}, k = {})",
        j.workers.join(", "),
        j.generation,
        j.accumulation_steps
    );
    // A job cut into stages (or tensor ranks): each worker's place.
    let dims = accrue_coordinator::scheduler::model_dims(j);
    if dims.pipeline * dims.tensor > 1 {
        for (rank, w) in j.workers.iter().enumerate() {
            let c = accrue_coordinator::scheduler::coords_of(j, rank as u32);
            println!(
                "  rank {rank:<3} {w}: data {} pipeline stage {} tensor {}",
                c.data, c.pipeline, c.tensor
            );
        }
    }
    // A language model counts target tokens where others count samples.
    let lm = accrue_coordinator::http::is_lm(j);
    let unit = if lm { "tokens" } else { "samples" };
    println!(
        "progress   step {}/{} epoch {} {unit} {} skipped {}",
        c.step, c.total_steps, c.epoch, c.samples_seen, c.skipped_steps
    );
    println!(
        "last step  loss {:.4} grad_norm {:.4} clip {:.3} lr {:.5} {unit}/s {:.0}",
        c.loss, c.grad_norm, c.clip_coef, c.lr, c.samples_per_sec
    );
    if j.memory_estimate_bytes > 0 || j.peak_rss_bytes.iter().any(|&p| p > 0) {
        // Issue 41: what the spec was estimated to need per worker, and
        // what each rank's process has needed at most so far.
        let mib = |b: u64| format!("{:.0}", b as f64 / (1u64 << 20) as f64);
        let peaks: Vec<String> = j.peak_rss_bytes.iter().map(|&p| mib(p)).collect();
        println!(
            "memory     estimate {} MiB per worker; peak by rank {} MiB",
            mib(j.memory_estimate_bytes),
            if peaks.is_empty() {
                "-".to_string()
            } else {
                peaks.join(", ")
            }
        );
    }
    if let Some(t) = c.timing.filter(|_| dims.pipeline > 1) {
        // The last stage's (the loss owner's) split of its step.
        println!(
            "pipeline   last stage: compute {:.3} s, bubble {:.3} s, transfer {:.3} s",
            t.compute_s, t.bubble_s, t.transfer_s
        );
    }
    if let Some(e) = &j.eval {
        println!("eval       {} (step {})", eval_words(e, lm), e.step);
    }
    if !j.checkpoint.is_empty() {
        println!("checkpoint {}", j.checkpoint);
    }
    if !j.error.is_empty() {
        println!("error      {}", j.error);
    }
    println!("history");
    if j.history_dropped > 0 {
        println!("  ({} earlier transitions not kept)", j.history_dropped);
    }
    for h in &j.history {
        let from = JobState::try_from(h.from).unwrap_or(JobState::Unspecified);
        let to = JobState::try_from(h.to).unwrap_or(JobState::Unspecified);
        println!("  {} -> {}: {}", state_name(from), state_name(to), h.reason);
    }
    if !j.recoveries.is_empty() {
        println!("recoveries");
    }
    if j.recoveries_dropped > 0 {
        println!("  ({} earlier recoveries not kept)", j.recoveries_dropped);
    }
    for r in &j.recoveries {
        let took = if r.first_step_unix_ms > 0 {
            format!(
                "{:.2} s to the first step",
                (r.first_step_unix_ms - r.started_unix_ms) as f64 / 1000.0
            )
        } else {
            "not re-formed yet".into()
        };
        println!(
            "  generation {}: lost [{}] joined [{}]; resumed after step {}{} with W = {}, k = {}; {took}; {}",
            r.generation,
            r.lost.join(", "),
            r.joined.join(", "),
            r.resumed_step,
            if r.redone_steps > 0 {
                format!(" (rolled back: {} steps done again)", r.redone_steps)
            } else {
                String::new()
            },
            r.world_size,
            r.accumulation_steps,
            r.reason
        );
        if !r.loaded.is_empty() {
            println!("    loaded {}", r.loaded);
        }
    }
}

/// `accrue list`'s header; [`list_row`] fills its columns.
pub(crate) fn list_header() -> String {
    format!(
        "{:<28} {:<16} {:<11} {:>12} {:>11} {:>16}  {}",
        "JOB", "OWNER", "STATE", "STEP", "LOSS", "THROUGHPUT", "EVAL"
    )
}

/// One job of `accrue list`: its throughput in its unit (a language
/// model's tokens/s, others' samples/s) and its last evaluation (a
/// language model's perplexity, others' accuracy; `-` before the first).
pub(crate) fn list_row(j: &Job) -> String {
    let c = j.counters.unwrap_or_default();
    let lm = accrue_coordinator::domain::is_lm(j);
    let rate = format!(
        "{:.0} {}",
        c.samples_per_sec,
        if lm { "tok/s" } else { "samples/s" }
    );
    let eval = match (&j.eval, lm) {
        (None, _) => "-".to_string(),
        (Some(e), true) => match accrue_coordinator::domain::perplexity(e.loss) {
            Some(p) => format!("ppl {p:.2}"),
            None => "ppl -".to_string(),
        },
        (Some(e), false) => format!("acc {:.2}%", 100.0 * e.accuracy),
    };
    format!(
        "{:<28} {:<16} {:<11} {:>12} {:>11.4} {:>16}  {}",
        j.id,
        if j.owner.is_empty() { "-" } else { &j.owner },
        state_name(j.state()),
        format!("{}/{}", c.step, c.total_steps),
        c.loss,
        rate,
        eval
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use accrue_proto::v1::{Counters, EvalResult, JobSpec, ModelKind, ModelSpec};

    fn job(kind: ModelKind, eval: Option<EvalResult>) -> Job {
        Job {
            id: "j-1".into(),
            spec: Some(JobSpec {
                model: Some(ModelSpec {
                    kind: kind as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            counters: Some(Counters {
                step: 3,
                total_steps: 9,
                loss: 2.5,
                samples_per_sec: 15300.4,
                ..Default::default()
            }),
            eval,
            ..Default::default()
        }
    }

    /// A language model's row speaks of tokens and perplexity, another
    /// job's of samples and accuracy; the columns line up with the header.
    #[test]
    fn list_rows_speak_each_jobs_units() {
        let e = EvalResult {
            loss: 2.0,
            accuracy: 0.5,
            ..Default::default()
        };
        let lm = list_row(&job(ModelKind::Llama, Some(e)));
        assert!(
            lm.contains("15300 tok/s") && lm.ends_with("ppl 7.39"),
            "{lm}"
        );
        let mlp = list_row(&job(ModelKind::Mlp, Some(e)));
        assert!(
            mlp.contains("15300 samples/s") && mlp.ends_with("acc 50.00%"),
            "{mlp}"
        );
        assert!(list_row(&job(ModelKind::Mlp, None)).ends_with("  -"));
        let (h, r) = (list_header(), &lm);
        assert_eq!(
            h.find("THROUGHPUT").map(|i| i + 10),
            r.find(" tok/s").map(|i| i + 6)
        );
        assert_eq!(h.find("EVAL"), r.find("ppl"));
    }
}
