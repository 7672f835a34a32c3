//! The JSON views and `/metrics` of a language-model job (issue 30) and of
//! a classification job, rendered from jobs built here.

use super::metrics::job_metrics;
use super::views::{add_perplexities, is_lm, job_view, perplexity};
use accrue_proto::v1::{Counters, EvalResult, Job, JobSpec, JobState, ModelKind, ModelSpec};
use serde_json::json;

fn job(id: &str, kind: ModelKind) -> Job {
    Job {
        id: id.into(),
        spec: Some(JobSpec {
            name: id.into(),
            model: Some(ModelSpec {
                kind: kind as i32,
                ..Default::default()
            }),
            ..Default::default()
        }),
        state: JobState::Running as i32,
        counters: Some(Counters {
            step: 7,
            total_steps: 10,
            samples_seen: 57_344,
            samples_per_sec: 12_500.5,
            loss: 2.5,
            ..Default::default()
        }),
        eval: Some(EvalResult {
            epoch: 0,
            step: 5,
            loss: 2.0,
            accuracy: 0.25,
            samples: 4096,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1.0)
}

#[test]
fn a_language_model_job_shows_tokens_and_perplexity() {
    let lm = job("lm-1", ModelKind::Llama);
    assert!(is_lm(&lm));
    let v = job_view(&lm, None, None);
    assert_eq!(v["unit"], "tokens");
    assert_eq!(v["counters"]["tokens_per_sec"], json!(12_500.5));
    assert_eq!(v["counters"]["tokens_seen"], json!(57_344));
    let p = v["eval"]["perplexity"].as_f64().unwrap();
    assert!(close(p, 2.0f64.exp()), "{p}");
    assert_eq!(v["eval"]["tokens"], json!(4096));
    // The existing fields stay as they are.
    assert_eq!(v["counters"]["samples_per_sec"], json!(12_500.5));
    assert_eq!(v["counters"]["samples_seen"], json!(57_344));
    assert_eq!(v["eval"]["loss"], json!(2.0));
    assert_eq!(v["eval"]["accuracy"], json!(0.25));

    // Before any evaluation: no eval, so no perplexity either.
    let mut fresh = lm.clone();
    fresh.eval = None;
    let v = job_view(&fresh, None, None);
    assert!(v["eval"].is_null(), "{v}");
    assert_eq!(v["counters"]["tokens_seen"], json!(57_344));
}

#[test]
fn a_classification_job_has_no_language_model_fields() {
    for kind in [ModelKind::Mlp, ModelKind::Resnet18, ModelKind::Unspecified] {
        let c = job("cls-1", kind);
        assert!(!is_lm(&c));
        let v = job_view(&c, None, None);
        assert_eq!(v["unit"], "samples");
        let counters = v["counters"].as_object().unwrap();
        assert!(!counters.contains_key("tokens_per_sec"), "{v}");
        assert!(!counters.contains_key("tokens_seen"), "{v}");
        let eval = v["eval"].as_object().unwrap();
        assert!(
            !eval.contains_key("perplexity") && !eval.contains_key("tokens"),
            "{v}"
        );
        assert_eq!(v["counters"]["samples_per_sec"], json!(12_500.5));
    }
    // A job without a spec (as stored by an old coordinator) too.
    let mut bare = job("bare", ModelKind::Mlp);
    bare.spec = None;
    assert_eq!(job_view(&bare, None, None)["unit"], "samples");
}

#[test]
fn perplexity_is_exp_of_the_loss_and_null_when_not_finite() {
    assert!(close(perplexity(2.0).unwrap(), 7.38905609893065));
    assert_eq!(perplexity(0.0), Some(1.0));
    assert_eq!(perplexity(f64::NAN), None);
    assert_eq!(perplexity(1e6), None, "overflows to infinity");
    let mut evals = json!([{"step": 5, "loss": 2.0}, {"step": 10, "loss": null}]);
    add_perplexities(&mut evals);
    assert!(close(
        evals[0]["perplexity"].as_f64().unwrap(),
        2.0f64.exp()
    ));
    assert!(evals[1]["perplexity"].is_null(), "{evals}");
}

#[test]
fn metrics_name_a_language_models_tokens_and_perplexity() {
    let lm = job("lm-1", ModelKind::Llama);
    let cls = job("cls-1", ModelKind::Mlp);
    let mut out = String::new();
    job_metrics(&mut out, &[lm.clone(), cls.clone()]);
    let line = |name: &str, job: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{name}{{job=\"{job}\",")))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
    };
    for (name, kind) in [
        ("accrue_job_tokens_per_second", "gauge"),
        ("accrue_job_tokens_seen_total", "counter"),
        ("accrue_job_eval_perplexity", "gauge"),
    ] {
        assert!(out.contains(&format!("# TYPE {name} {kind}\n")), "{out}");
        assert!(out.contains(&format!("# HELP {name} ")), "{out}");
        assert_eq!(line(name, "cls-1"), None, "{name} for a classifier");
    }
    assert_eq!(line("accrue_job_tokens_per_second", "lm-1"), Some(12_500.5));
    assert_eq!(line("accrue_job_tokens_seen_total", "lm-1"), Some(57_344.0));
    let p = line("accrue_job_eval_perplexity", "lm-1").unwrap();
    assert!(close(p, 2.0f64.exp()), "{p}");
    assert!(out.contains("accrue_job_eval_perplexity{job=\"lm-1\",state=\"running\"} "));
    // Both jobs keep the samples series.
    assert_eq!(
        line("accrue_job_samples_per_second", "lm-1"),
        Some(12_500.5)
    );
    assert_eq!(
        line("accrue_job_samples_per_second", "cls-1"),
        Some(12_500.5)
    );

    // Classifiers only: none of the language-model names at all.
    let mut only = String::new();
    job_metrics(&mut only, &[cls]);
    assert!(
        !only.contains("tokens") && !only.contains("perplexity"),
        "{only}"
    );
    assert!(
        only.contains("accrue_job_samples_seen{job=\"cls-1\""),
        "{only}"
    );

    // A language model not evaluated yet: tokens, but no perplexity line.
    let mut fresh = lm;
    fresh.eval = None;
    let mut out = String::new();
    job_metrics(&mut out, &[fresh]);
    assert!(
        out.contains("accrue_job_tokens_seen_total{job=\"lm-1\""),
        "{out}"
    );
    assert!(!out.contains("accrue_job_eval_perplexity{"), "{out}");
}

#[test]
fn a_job_shows_its_spec_as_toml_and_its_hyperparameters() {
    let tables = "[accumulation]\nsteps = 3\n[clipping]\nmax_norm = 1.0\n\
                  [optimizer]\nkind = \"adamw\"\nlr = 0.003\nweight_decay = 0.01\n";
    let spec = crate::test_specs::mlp_spec(
        "name = \"hp\"\nworkers = 4\nseed = 9\nmax_steps = 10",
        8,
        tables,
    );
    let mut j = job("hp-1", ModelKind::Mlp);
    j.spec = Some(spec);
    // The domain spec the coordinator holds beside the record.
    let held = accrue_proto::spec_from_proto(j.spec.as_ref().unwrap()).unwrap();
    let v = job_view(&j, Some(&held), None);
    // The TOML reads back as the spec the job holds.
    let back: accrue_common::JobSpec = toml::from_str(v["spec_toml"].as_str().unwrap()).unwrap();
    assert_eq!(back, held);
    assert!(
        v["spec_toml"].as_str().unwrap().contains("name = \"hp\""),
        "{v}"
    );
    let h = &v["hparams"];
    assert_eq!(h["workers"], 4);
    assert_eq!(h["accumulation_steps"], 3);
    assert_eq!(h["batch_size"], 8);
    assert_eq!(h["global_batch"], 4 * 8 * 3);
    assert_eq!(h["optimizer"], "adamw");
    assert_eq!(h["lr"], json!(0.003));
    assert_eq!(h["weight_decay"], json!(0.01));
    assert_eq!(h["precision"], "fp32");
    assert_eq!(
        h["parallel"],
        json!({"data": 4, "pipeline": 1, "tensor": 1})
    );
    assert_eq!(h["seed"], 9);
    // No spec: nulls, not a failure.
    j.spec = None;
    let v = job_view(&j, None, None);
    assert!(v["spec_toml"].is_null() && v["hparams"].is_null(), "{v}");
}
