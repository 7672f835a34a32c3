//! Small, valid job specs for this crate's unit tests.

use accrue_proto::v1;

/// `[optimizer]`: SGD at lr 0.1.
pub const SGD: &str = "[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";

/// An MLP (one hidden layer of 8) on synthetic data (64 samples of 4
/// features, 2 classes, `batch_size` per rank): `top` holds the top-level
/// keys (`name` at least), `tables` the tables after `[data]` (an
/// `[optimizer]` at least, e.g. [`SGD`]). Checked as a job file is.
pub fn mlp_spec(top: &str, batch_size: u32, tables: &str) -> v1::JobSpec {
    let text = format!(
        "{top}\n[model]\nkind = \"mlp\"\nhidden = [8]\n[data]\nkind = \"synthetic\"\n\
         samples = 64\nshape = [4]\nclasses = 2\nbatch_size = {batch_size}\n{tables}"
    );
    let s = accrue_common::JobSpec::from_toml_str(&text, std::path::Path::new("t.toml"))
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    accrue_proto::spec_to_proto(&s)
}
