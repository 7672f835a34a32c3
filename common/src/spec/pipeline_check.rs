//! `[parallel]`'s pipeline fields (issue 40): which models run in stages,
//! the stage counts against the model, and what the pipeline engine does
//! not run yet.

use super::*;

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
            return;
        }
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
        if u64::from(stages) > units {
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
            if l.len() != stages as usize {
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
