//! `schedule = "interleaved_1f1b"` and `stages_per_rank`.

use super::super::tests::invalid;
use super::*;
use std::path::Path;

/// A Llama of `layers` decoder layers in 2 stages with `extra` under
/// `[parallel]` (and `top` before the tables).
fn llama(layers: u32, extra: &str, top: &str) -> String {
    format!(
        "name = \"p\"\nworkers = 2\n{top}[model]\nkind = \"llama\"\nvocab_size = 32\nhidden_size = 8\nintermediate_size = 16\nnum_hidden_layers = {layers}\nnum_attention_heads = 2\n[data]\nkind = \"tokens\"\npath = \"x.bin\"\nseq_len = 4\nbatch_size = 2\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n[parallel]\npipeline = 2\n{extra}"
    )
}

fn ok(text: &str) -> JobSpec {
    JobSpec::fields_from_toml_str(text, Path::new("t.toml")).unwrap_or_else(|e| panic!("{e}"))
}

/// One refusal of `field` whose allowed values contain `says`.
fn refused(text: &str, field: &str, says: &str) {
    let e = invalid(text);
    assert!(
        e.iter()
            .any(|e| e.field == field && e.allowed.contains(says)),
        "{field} / {says}: {e:?}"
    );
}

#[test]
fn interleaved_takes_v_chunks_that_divide_the_layers() {
    let i = "schedule = \"interleaved_1f1b\"\n";
    let s = ok(&llama(8, &format!("{i}stages_per_rank = 2\n"), ""));
    assert_eq!(s.parallel.stages_per_rank, Some(2));
    ok(&llama(8, &format!("{i}stages_per_rank = 4\n"), ""));
    // 8 layers do not cut into 2 x 3 chunks; V = 2 and 4 do.
    refused(
        &llama(8, &format!("{i}stages_per_rank = 3\n"), ""),
        "parallel.stages_per_rank",
        "8 decoder layers must divide into parallel.pipeline x stages_per_rank = 2 x 3 = 6 chunks of equal size (or layers_per_stage list 6 entries); stages_per_rank values that divide them: [2, 4]",
    );
    // ... unless layers_per_stage lists the 6 chunks.
    ok(&llama(
        8,
        &format!("{i}stages_per_rank = 3\nlayers_per_stage = [2, 1, 1, 1, 1, 2]\n"),
        "",
    ));
    refused(
        &llama(
            8,
            &format!("{i}stages_per_rank = 2\nlayers_per_stage = [4, 4]\n"),
            "",
        ),
        "parallel.layers_per_stage",
        "2 entries for parallel.pipeline x parallel.stages_per_rank = 2 x 2 = 4 model chunks",
    );
    // V >= 2 for it, unset included; 1 (or absent) for the others.
    refused(
        &llama(8, i, ""),
        "parallel.stages_per_rank",
        "needs stages_per_rank = V >= 2",
    );
    refused(
        &llama(8, &format!("{i}stages_per_rank = 1\n"), ""),
        "parallel.stages_per_rank",
        "needs stages_per_rank = V >= 2",
    );
    refused(
        &llama(8, "stages_per_rank = 2\n", ""),
        "parallel.stages_per_rank",
        "only with parallel.schedule = \"interleaved_1f1b\" (the 1f1b schedule",
    );
    ok(&llama(8, "schedule = \"gpipe\"\nstages_per_rank = 1\n", ""));
    // Without stages.
    let one =
        llama(8, &format!("{i}stages_per_rank = 2\n"), "").replace("pipeline = 2", "pipeline = 1");
    refused(
        &one,
        "parallel.stages_per_rank",
        "only with parallel.pipeline >= 2",
    );
    refused(
        &one,
        "parallel.schedule",
        "only with parallel.pipeline >= 2",
    );
}

#[test]
fn interleaved_refuses_what_it_does_not_run_naming_the_combination() {
    let i = "schedule = \"interleaved_1f1b\"\nstages_per_rank = 2\n";
    let not_yet = "schedule = \"interleaved_1f1b\" does not run with";
    refused(
        &format!("{}[sharding]\nstage = 3\n", llama(8, i, "")),
        "sharding.stage",
        &format!("{not_yet} ZeRO-3"),
    );
    refused(
        &llama(8, &format!("{i}tensor = 2\n"), "workers = 4\n").replace("workers = 2\n", ""),
        "parallel.tensor",
        &format!("{not_yet} parallel.tensor > 1"),
    );
    refused(
        &format!("{}[accumulation]\nsync = \"every_step\"\n", llama(8, i, "")),
        "accumulation.sync",
        &format!("{not_yet} accumulation.sync = \"every_step\""),
    );
    refused(
        &llama(8, &format!("{i}balance = \"compute\"\n"), ""),
        "parallel.balance",
        "cuts the model into equal chunks",
    );
    ok(&format!("{}[sharding]\nstage = 2\n", llama(8, i, "")));
}
