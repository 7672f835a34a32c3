//! The coordinator's vocabulary, at the bottom of its layers: who asks
//! ([`Caller`]), how a generation's ring key is made ([`RingKeys`]) and a
//! job state's name ([`state_name`]). It imports nothing from this crate
//! and no transport library (no gRPC, no HTTP): every layer above may use
//! it, and the adapters translate into it (auth turns a principal into a
//! [`Caller`]).

use accrue_common::spec::{ModelKind, SpecEnum};
/// A job's state; the proto's enum is the domain's (the names below are
/// how it is shown).
pub use accrue_proto::v1::JobState;
use accrue_proto::v1::{EvalResult, Job};

/// A state's name in messages, JSON and the CLI.
pub fn state_name(s: JobState) -> &'static str {
    match s {
        JobState::Unspecified => "unspecified",
        JobState::Pending => "pending",
        JobState::Rendezvous => "rendezvous",
        JobState::Running => "running",
        JobState::Recovering => "recovering",
        JobState::Succeeded => "succeeded",
        JobState::Failed => "failed",
        JobState::Cancelled => "cancelled",
    }
}

/// Who asks for a change to a job.
#[derive(Clone, Debug, PartialEq)]
pub enum Caller {
    /// Authentication is off (no tokens file): anyone may change any job.
    Anyone,
    /// An authenticated principal; `admin` when its token holds that scope.
    Principal { name: String, admin: bool },
}

impl Caller {
    /// Who asks, for a transition's reason.
    pub fn who(&self) -> String {
        match self {
            Caller::Anyone => "a client (authentication off)".into(),
            Caller::Principal { name, admin: true } => format!("{name} (admin)"),
            Caller::Principal { name, .. } => name.clone(),
        }
    }
}

/// The ring key of a job's generation: HKDF from the coordinator's master
/// secret in the service (`RingMaster::keys`, one layer up), any pure
/// function in tests. The scheduler only calls it when it forms a
/// generation and puts the key in that generation's Assignments.
pub type RingKeys = Box<dyn Fn(&str, u64) -> Vec<u8> + Send>;

/// Whether `j` trains a language model (a decoder family's kind, as the
/// family registry says):
/// its step reports count target tokens where other jobs count samples
/// (`samples` = the step's target tokens, `samples_per_sec` = tokens/s,
/// samples seen = tokens seen), and its evaluation loss is per token.
pub fn is_lm(j: &Job) -> bool {
    j.spec
        .as_ref()
        .and_then(|s| s.model.as_ref())
        .is_some_and(|m| model_kind(m.kind).is_some_and(ModelKind::is_decoder))
}

/// The spec's kind of a proto `model.kind` (its name: MODEL_KIND_QWEN2 is
/// qwen2), None for UNSPECIFIED or a value this build does not know.
fn model_kind(raw: i32) -> Option<ModelKind> {
    let name = accrue_proto::v1::ModelKind::try_from(raw)
        .ok()?
        .as_str_name();
    ModelKind::parse(&name.strip_prefix("MODEL_KIND_")?.to_lowercase())
}

/// What a job's throughput counts: `"tokens"` for a language model,
/// `"samples"` otherwise.
pub fn unit(j: &Job) -> &'static str {
    if is_lm(j) {
        "tokens"
    } else {
        "samples"
    }
}

/// The perplexity of a mean loss per token, exp(loss); None when that is
/// not a finite number.
pub fn perplexity(loss: f64) -> Option<f64> {
    Some(loss.exp()).filter(|p| p.is_finite())
}

/// `j` as a reader sees it (GetJob, ListJobs, WatchJob): its `unit`, and
/// for a language model the token names of its numbers
/// (`counters.tokens_per_sec`, `counters.tokens_seen`) and its
/// evaluation's `perplexity` and `tokens`. None of these is stored.
pub fn add_reader_fields(j: &mut Job) {
    j.unit = unit(j).to_string();
    if !is_lm(j) {
        return;
    }
    if let Some(c) = j.counters.as_mut() {
        c.tokens_per_sec = Some(c.samples_per_sec);
        c.tokens_seen = Some(c.samples_seen);
    }
    if let Some(e) = j.eval.as_mut() {
        add_lm_eval_fields(e);
    }
}

/// What a step event carries of its job: a step carries the step, not
/// the job. Its id, state, counters, generation, version, accumulation
/// steps and the reader's fields ([`add_reader_fields`]); not its spec,
/// history, recoveries, workers or evaluation, so that its size does not
/// grow with them (a watcher keeps those from the last event that
/// carried the whole job).
pub fn step_view(j: &Job) -> Job {
    let mut v = Job {
        id: j.id.clone(),
        state: j.state,
        counters: j.counters,
        generation: j.generation,
        version: j.version,
        accumulation_steps: j.accumulation_steps,
        unit: unit(j).to_string(),
        ..Default::default()
    };
    if let (true, Some(c)) = (is_lm(j), v.counters.as_mut()) {
        c.tokens_per_sec = Some(c.samples_per_sec);
        c.tokens_seen = Some(c.samples_seen);
    }
    v
}

/// A language model's evaluation with its perplexity (when finite) and
/// the target tokens it evaluated.
pub fn add_lm_eval_fields(e: &mut EvalResult) {
    e.perplexity = perplexity(e.loss);
    e.tokens = Some(e.samples);
}

#[cfg(test)]
mod kind_tests {
    use super::*;

    /// Every kind of the family registry crosses the proto (the
    /// converter's value) and is read back by its name, and a job is a
    /// language model exactly when its family is a decoder: a kind the
    /// proto or this mapping misses fails here.
    #[test]
    fn every_registry_kind_is_read_back_from_the_proto() {
        let text = "name = \"k\"\n[model]\nkind = \"mlp\"\nhidden = [8]\n[data]\n\
                    kind = \"synthetic\"\nsamples = 64\nshape = [4]\nclasses = 2\n\
                    batch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
        let mut spec = accrue_common::JobSpec::from_toml_str(text, std::path::Path::new("t.toml"))
            .unwrap_or_else(|e| panic!("{e}"));
        for &kind in ModelKind::ALL {
            spec.model.kind = kind;
            let proto = accrue_proto::spec_to_proto(&spec);
            let raw = proto.model.as_ref().map_or(0, |m| m.kind);
            assert_eq!(model_kind(raw), Some(kind), "{kind}");
            let j = Job {
                spec: Some(proto),
                ..Default::default()
            };
            assert_eq!(is_lm(&j), kind.is_decoder(), "{kind}");
        }
        assert_eq!(model_kind(0), None);
    }
}
