//! Example specs (a llama job on token data, pipeline and interleaved
//! stages, activation checkpointing) across the wire and back.

use super::*;

/// A llama job on token data survives the proto trip with every llama
/// and token field; an unknown token dtype is refused by name.
#[test]
fn llama_and_token_fields_round_trip() {
    let text = r#"
name = "lm"
[model]
kind = "llama"
vocab_size = 97
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
rms_norm_eps = 1e-5
rope_theta = 500000.0
max_position_embeddings = 128
tie_word_embeddings = true
attention_bias = true
mlp_bias = false
config = "hf/config.json"
[data]
kind = "tokens"
path = "train.bin"
seq_len = 64
dtype = "u32"
batch_size = 8
[optimizer]
kind = "adamw"
lr = 0.001
"#;
    let spec = JobSpec::fields_from_toml_str(text, std::path::Path::new("lm.toml")).unwrap();
    let p = spec_to_proto(&spec);
    let m = p.model.as_ref().unwrap();
    assert_eq!(m.kind, v1::ModelKind::Llama as i32);
    // llama's fields travel in its own message (issue 38).
    let m = m.llama.as_ref().unwrap();
    assert_eq!(
        (m.vocab_size, m.rope_theta, m.config.as_deref()),
        (Some(97), Some(500000.0), Some("hf/config.json"))
    );
    let d = p.data.as_ref().unwrap();
    assert_eq!(
        (d.kind, d.seq_len, d.dtype),
        (
            v1::DataKind::Tokens as i32,
            Some(64),
            v1::TokenDtype::U32 as i32
        )
    );
    assert_eq!(spec_from_proto(&p).unwrap(), spec);
    let mut bad = p.clone();
    bad.data.as_mut().unwrap().dtype = 9;
    let shown: Vec<String> = spec_from_proto(&bad)
        .unwrap_err()
        .0
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(shown, ["data.dtype = 9: must be one of u16, u32"]);
}

/// Issue 40: the pipeline fields cross the wire (the round trip's
/// generator keeps to one stage): set, left out, and an unknown schedule
/// refused.
#[test]
fn pipeline_fields_cross_the_wire() {
    let toml = "name = \"p\"\nworkers = 2\n[model]\nkind = \"mlp\"\nhidden = [8, 8]\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
    let mut s = JobSpec::fields_from_toml_str(toml, std::path::Path::new("t.toml")).unwrap();
    s.parallel = ParallelSpec {
        pipeline: Some(2),
        schedule: Some(PipelineSchedule::GPipe),
        layers_per_stage: Some(vec![1, 2]),
        ..Default::default()
    };
    let p = spec_to_proto(&s).parallel.unwrap();
    assert_eq!(p.layers_per_stage, vec![1, 2]);
    let mut errors = Vec::new();
    assert_eq!(super::parallel_from_proto(&p, &mut errors), s.parallel);
    // balance (not with layers_per_stage in a valid spec; the wire
    // carries it either way).
    let balanced = ParallelSpec {
        balance: Some(StageBalance::Compute),
        ..s.parallel.clone()
    };
    let mut b = s.clone();
    b.parallel = balanced.clone();
    let p2 = spec_to_proto(&b).parallel.unwrap();
    assert_eq!(p2.balance, v1::StageBalance::Compute as i32);
    assert_eq!(super::parallel_from_proto(&p2, &mut errors), balanced);
    let none = ParallelSpec {
        schedule: None,
        layers_per_stage: None,
        ..s.parallel.clone()
    };
    let mut other = s.clone();
    other.parallel = none.clone();
    let p = spec_to_proto(&other).parallel.unwrap();
    assert_eq!(super::parallel_from_proto(&p, &mut errors), none);
    assert!(errors.is_empty(), "{errors:?}");
    let bad = v1::ParallelSpec {
        schedule: 9,
        ..p.clone()
    };
    super::parallel_from_proto(&bad, &mut errors);
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].field, "parallel.schedule", "{errors:?}");
    let bad = v1::ParallelSpec { balance: 7, ..p };
    super::parallel_from_proto(&bad, &mut errors);
    assert_eq!(errors.len(), 2);
    assert_eq!(errors[1].field, "parallel.balance", "{errors:?}");
}

/// `schedule = "interleaved_1f1b"` and its `stages_per_rank` cross the
/// wire (absent stays absent).
#[test]
fn interleaved_schedule_crosses_the_wire() {
    let toml = "name = \"p\"\nworkers = 2\n[model]\nkind = \"mlp\"\nhidden = [8, 8, 8]\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n[parallel]\npipeline = 2\nschedule = \"interleaved_1f1b\"\nstages_per_rank = 2\n";
    let s = JobSpec::fields_from_toml_str(toml, std::path::Path::new("t.toml")).unwrap();
    assert_eq!(s.parallel.stages_per_rank, Some(2));
    let p = spec_to_proto(&s).parallel.unwrap();
    assert_eq!(p.schedule, v1::PipelineSchedule::Interleaved1f1b as i32);
    assert_eq!(p.stages_per_rank, Some(2));
    let mut errors = Vec::new();
    assert_eq!(super::parallel_from_proto(&p, &mut errors), s.parallel);
    let unset = v1::ParallelSpec {
        stages_per_rank: None,
        ..p
    };
    assert_eq!(
        super::parallel_from_proto(&unset, &mut errors).stages_per_rank,
        None
    );
    assert!(errors.is_empty(), "{errors:?}");
}

/// Issue 41: `[performance] activation_checkpointing` and
/// `checkpoint_every` cross the wire; an unknown value is refused naming
/// the field.
#[test]
fn activation_checkpointing_crosses_the_wire() {
    let toml = "name = \"p\"\n[model]\nkind = \"mlp\"\nhidden = [8, 8]\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n[performance]\nactivation_checkpointing = \"full\"\ncheckpoint_every = 2\n";
    let s = JobSpec::fields_from_toml_str(toml, std::path::Path::new("t.toml")).unwrap();
    assert_eq!(
        s.performance.activation_checkpointing,
        Some(ActivationCheckpointing::Full)
    );
    let p = spec_to_proto(&s);
    let back = spec_from_proto(&p).unwrap();
    assert_eq!(back.performance, s.performance);
    let mut bad = p.clone();
    if let Some(perf) = bad.performance.as_mut() {
        perf.activation_checkpointing = 9;
    }
    let e = spec_from_proto(&bad).unwrap_err();
    assert!(
        e.0.iter()
            .any(|e| e.field == "performance.activation_checkpointing"),
        "{e:?}"
    );
}
