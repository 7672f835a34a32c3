//! `[parallel]`'s pipeline fields (issue 40): which models run in stages,
//! the stage counts against the model, and what the pipeline engine does
//! not run yet.

use super::*;

#[cfg(test)]
#[path = "pipeline_check_tests.rs"]
mod tests;

impl JobSpec {
    /// `parallel.pipeline`'s companions (issue 40): which families run in
    /// stages, `schedule` and `layers_per_stage` only with stages, and the
    /// stage counts against the model's pipeline units.
    pub(super) fn validate_pipeline(&self, c: &mut Checker, stages: u32) {
        let p = &self.parallel;
        if stages <= 1 {
            if let Some(s) = p.schedule {
                c.fail(
                    "parallel.schedule",
                    s.as_str(),
                    "only with parallel.pipeline >= 2",
                );
            }
            if let Some(l) = &p.layers_per_stage {
                c.fail(
                    "parallel.layers_per_stage",
                    l,
                    "only with parallel.pipeline >= 2",
                );
            }
            if let Some(b) = p.balance {
                c.fail(
                    "parallel.balance",
                    b.as_str(),
                    "only with parallel.pipeline >= 2",
                );
            }
            if let Some(v) = p.stages_per_rank {
                c.fail(
                    "parallel.stages_per_rank",
                    v,
                    "only with parallel.pipeline >= 2 and schedule = \"interleaved_1f1b\"",
                );
            }
            return;
        }
        // Model chunks per rank: V >= 2 with interleaved 1F1B, 1 otherwise.
        let per_rank = self.validate_interleaved(c, stages);
        if let (Some(b), Some(_)) = (p.balance, &p.layers_per_stage) {
            c.fail(
                "parallel.balance",
                b.as_str(),
                "set either parallel.balance or parallel.layers_per_stage (which fixes the boundaries), not both",
            );
        }
        let kind = self.model.kind;
        // The units a stage is made of: decoder layers, or the mlp's layers.
        let units = if kind.is_decoder() {
            super::LlamaConfig::resolve(&self.model)
                .ok()
                .map(|cfg| (cfg.num_hidden_layers as u64, "decoder layers"))
        } else if kind == ModelKind::Mlp {
            Some((self.model.hidden.len() as u64 + 1, "layers"))
        } else {
            c.fail(
                "parallel.pipeline",
                stages,
                format!(
                    "model.kind = {kind} does not run in pipeline stages; the families that do: \
                     {}",
                    super::family::decoders_and(&[ModelKind::Mlp])
                ),
            );
            None
        };
        let Some((units, what)) = units else {
            return;
        };
        if per_rank > 1 {
            self.check_chunks(c, stages, per_rank, units, what);
        } else if u64::from(stages) > units {
            c.fail(
                "parallel.pipeline",
                stages,
                format!(
                    "the model has {units} {what}, and a stage holds at least one: at most {units}"
                ),
            );
        }
        if let Some(l) = &p.layers_per_stage {
            let total: u64 = l.iter().sum();
            let chunks = stages as usize * per_rank as usize;
            if l.len() != chunks && per_rank > 1 {
                c.fail(
                    "parallel.layers_per_stage",
                    l,
                    format!(
                        "{} entries for parallel.pipeline x parallel.stages_per_rank = \
                         {stages} x {per_rank} = {chunks} model chunks (one per chunk, first to last)",
                        l.len()
                    ),
                );
            } else if l.len() != chunks {
                c.fail(
                    "parallel.layers_per_stage",
                    l,
                    format!(
                        "{} entries for parallel.pipeline = {stages} (one per stage)",
                        l.len()
                    ),
                );
            } else if l.contains(&0) {
                c.fail(
                    "parallel.layers_per_stage",
                    l,
                    "every stage needs at least 1",
                );
            } else if total != units {
                c.fail(
                    "parallel.layers_per_stage",
                    l,
                    format!("they add up to {total}; the model has {units} {what}"),
                );
            }
        }
    }

    /// `schedule = "interleaved_1f1b"` and `stages_per_rank` (pipeline >=
    /// 2): V >= 2 for it, 1 or absent for the other schedules; what the
    /// interleaved engine does not run yet refused naming the combination.
    /// The model chunks per rank (1 where refused).
    fn validate_interleaved(&self, c: &mut Checker, stages: u32) -> u32 {
        let p = &self.parallel;
        let schedule = p.schedule.unwrap_or_default();
        let v = p.stages_per_rank;
        if schedule != PipelineSchedule::Interleaved1F1B {
            if let Some(v) = v.filter(|&v| v != 1) {
                c.fail(
                    "parallel.stages_per_rank",
                    v,
                    format!(
                        "only with parallel.schedule = \"interleaved_1f1b\" (the {} schedule \
                         holds 1 model chunk per rank): 1 or absent",
                        schedule.as_str()
                    ),
                );
            }
            return 1;
        }
        let Some(v) = v.filter(|&v| v >= 2) else {
            c.fail(
                "parallel.stages_per_rank",
                v.map_or_else(|| "unset".to_string(), |v| v.to_string()),
                format!(
                    "schedule = \"interleaved_1f1b\" needs stages_per_rank = V >= 2 model chunks \
                     per pipeline rank (the model cut into pipeline x V = {stages} x V chunks)"
                ),
            );
            return 1;
        };
        let not_yet = |what: &str| {
            format!(
                "schedule = \"interleaved_1f1b\" does not run with {what} yet; \
                 schedule = \"1f1b\" or \"gpipe\" does"
            )
        };
        if self.sharding.stage == 3 {
            c.fail(
                "sharding.stage",
                3,
                not_yet("ZeRO-3 (sharding.stage 0 to 2 do)"),
            );
        }
        if let Some(t) = p.tensor.filter(|&t| t > 1) {
            c.fail("parallel.tensor", t, not_yet("parallel.tensor > 1"));
        }
        if self.accumulation.sync == SyncMode::EveryStep {
            c.fail(
                "accumulation.sync",
                "every_step",
                not_yet("accumulation.sync = \"every_step\" (\"boundary\" does)"),
            );
        }
        if let Some(b) = p.balance {
            c.fail(
                "parallel.balance",
                b.as_str(),
                "schedule = \"interleaved_1f1b\" cuts the model into equal chunks (or by \
                 layers_per_stage); balance is for 1f1b and gpipe",
            );
        }
        v
    }

    /// Interleaved 1F1B's chunks against the model's `units`: without
    /// `layers_per_stage`, P x V chunks of equal size.
    fn check_chunks(&self, c: &mut Checker, stages: u32, v: u32, units: u64, what: &str) {
        if self.parallel.layers_per_stage.is_some() {
            return;
        }
        let (p, chunks) = (u64::from(stages), u64::from(stages) * u64::from(v));
        if !units.is_multiple_of(chunks) {
            let fits: Vec<u64> = (2..=units / p)
                .filter(|w| units.is_multiple_of(p * w))
                .collect();
            let allowed = if fits.is_empty() {
                format!("none at pipeline = {stages}")
            } else {
                format!("{fits:?}")
            };
            c.fail(
                "parallel.stages_per_rank",
                v,
                format!(
                    "the model's {units} {what} must divide into parallel.pipeline x \
                     stages_per_rank = {stages} x {v} = {chunks} chunks of equal size (or \
                     layers_per_stage list {chunks} entries); stages_per_rank values that \
                     divide them: {allowed}"
                ),
            );
        }
    }

    /// `parallel.tensor = T >= 2` (issue 42): the Llama-like families,
    /// their heads, key-value heads and MLP width split T ways (ZeRO stages
    /// 0 to 3 on the data axis).
    pub(super) fn validate_tensor(&self, c: &mut Checker, t: u32) {
        if t <= 1 {
            return;
        }
        let kind = self.model.kind;
        if !kind.is_decoder() {
            c.fail(
                "parallel.tensor",
                t,
                format!(
                    "model.kind = {kind} has no tensor-parallel forward; the families that do: \
                     {}",
                    super::family::decoders_and(&[])
                ),
            );
            return;
        }
        if let Ok(cfg) = super::LlamaConfig::resolve(&self.model) {
            let t = i64::from(t);
            let (heads, kv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
            if heads % t != 0 {
                c.fail(
                    "parallel.tensor",
                    t,
                    format!("must divide model.num_attention_heads = {heads}"),
                );
            }
            if kv > 0 && kv % t != 0 && t % kv != 0 {
                c.fail(
                    "parallel.tensor",
                    t,
                    format!(
                        "must divide model.num_key_value_heads = {kv} or be a multiple of it \
                         (each kv head then serves T / kv ranks)"
                    ),
                );
            }
            if cfg.intermediate_size % t != 0 {
                c.fail(
                    "parallel.tensor",
                    t,
                    format!(
                        "must divide model.intermediate_size = {}",
                        cfg.intermediate_size
                    ),
                );
            }
        }
    }
}
