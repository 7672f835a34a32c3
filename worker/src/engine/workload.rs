//! What a job trains on and for, chosen by its spec: the data sources, the
//! sample shape and output count the model is built for, the objective,
//! and the files its checkpoints carry for other tools.
//!
//! - Classification (mlp, lenet5, resnet, torchscript on mnist, cifar10,
//!   tensors, synthetic): splits held in memory on the device, classes
//!   from the labels or `model.num_classes`, cross-entropy per sample.
//! - Causal language modelling (llama on sequences or tokens): sources
//!   read lazily from the host (a memory map), samples of `seq_len`
//!   tokens, the vocabulary as outputs, cross-entropy per target token;
//!   checkpoints carry `config.json` (and the data's `tokenizer.json` with
//!   `tokenizer_config.json` and `generation_config.json`, the special
//!   tokens in all three) so transformers' `from_pretrained`,
//!   `AutoTokenizer`, `generate()` and `pipeline()` read the step folder.

use super::setup::{check_eval_shape, data_error, split_name};
use crate::error::{Error, Result};
use crate::objective::{CausalLm, Classification, Objective};
use crate::source::data;
use crate::source::DataSource;
use crate::spec::{DataKind, JobSpec, LlamaConfig};
use tch::Device;

pub(super) struct Workload {
    pub train: Box<dyn DataSource>,
    pub eval: Option<Box<dyn DataSource>>,
    /// A sample's shape without the batch dimension ([T] for a language
    /// model).
    pub sample_shape: Vec<i64>,
    /// The model's outputs per position (classes, or the vocabulary).
    pub classes: i64,
    pub objective: Box<dyn Objective>,
    /// Files every checkpoint carries besides the weights and the state.
    pub extra_files: Vec<(String, Vec<u8>)>,
}

/// The workload `spec` describes, its data on `device`.
pub(super) fn load(spec: &JobSpec, device: Device) -> Result<Workload> {
    match spec.data.kind {
        DataKind::Sequences | DataKind::Tokens => causal_lm(spec, device),
        _ => classification(spec, device),
    }
}

fn classification(spec: &JobSpec, device: Device) -> Result<Workload> {
    let splits = data::load(&spec.data, spec.seed)?;
    let train = splits.train;
    if train.is_empty() {
        return Err(data_error(
            spec,
            "the training split holds no samples".into(),
        ));
    }
    if let Some(eval) = &splits.eval {
        check_eval_shape(spec, &train, eval)?;
    }
    let mut labels = vec![(split_name(spec, false), train.max_label()?)];
    if let Some(eval) = &splits.eval {
        labels.push((split_name(spec, true), eval.max_label()?));
    }
    let classes = data::class_count(spec.model.num_classes, &labels)?;
    let sample_shape = train.sample_shape();
    Ok(Workload {
        train: Box::new(train.to_device(device)?),
        eval: match splits.eval {
            Some(e) => Some(Box::new(e.to_device(device)?)),
            None => None,
        },
        sample_shape,
        classes,
        objective: Box::new(Classification),
        extra_files: Vec::new(),
    })
}

fn causal_lm(spec: &JobSpec, device: Device) -> Result<Workload> {
    use crate::source::{sequences::Sequences, tokens::TokenStream, TokenDtype, TokenOptions};
    let config = LlamaConfig::resolve(&spec.model)?;
    let d = &spec.data;
    // validate() refused a missing seq_len for these kinds.
    let seq_len = d.seq_len.unwrap_or(1) as usize;
    let opts = TokenOptions {
        seq_len,
        pad_id: d.pad_id.unwrap_or(0),
        vocab_size: config.vocab_size,
        dtype: d.dtype.map(|t| match t {
            crate::spec::TokenDtype::U16 => TokenDtype::U16,
            crate::spec::TokenDtype::U32 => TokenDtype::U32,
        }),
        device,
    };
    let open = |path: &std::path::Path, field: &'static str| -> Result<Box<dyn DataSource>> {
        Ok(match d.kind {
            DataKind::Tokens => Box::new(TokenStream::open(path, field, &opts)?),
            _ if d.pack => Box::new(Sequences::open(path, field, &opts)?.packed()),
            _ => Box::new(Sequences::open(path, field, &opts)?),
        })
    };
    let path = d.path.clone().unwrap_or_default();
    let train = open(&path, "data.path")?;
    if train.is_empty() {
        return Err(data_error(
            spec,
            "the training split holds no samples".into(),
        ));
    }
    let eval = match &d.eval_path {
        Some(p) => Some(open(p, "data.eval_path")?),
        None => None,
    };
    // `accrue tokenize` writes the tokenizer beside the data; checked
    // before every checkpoint carries it, with the files that tell
    // transformers its special tokens (checkpoint::hub).
    let tokenizer = path.with_file_name("tokenizer.json");
    let mut extra_files = Vec::new();
    let mut config_json = config.to_hf_json();
    if tokenizer.is_file() {
        use crate::checkpoint::hub;
        let (bytes, tk) = checked_tokenizer(&tokenizer, config.vocab_size)?;
        let source = source_tokenizer_config(&path.with_file_name("tokenizer_config.json"))?;
        let specials = hub::specials(&|t| tk.token_to_id(t), source.as_ref());
        config_json = hub::with_token_ids(config_json, &specials);
        let pretty = |v: &serde_json::Value| serde_json::to_vec_pretty(v).unwrap_or_default();
        extra_files.push(("tokenizer.json".to_string(), bytes));
        extra_files.push((
            "tokenizer_config.json".to_string(),
            pretty(&hub::tokenizer_config(
                &specials,
                config.max_position_embeddings,
                source.as_ref(),
            )),
        ));
        extra_files.push((
            "generation_config.json".to_string(),
            pretty(&hub::generation_config(&specials)),
        ));
    }
    extra_files.insert(
        0,
        (
            "config.json".to_string(),
            serde_json::to_vec_pretty(&config_json).unwrap_or_default(),
        ),
    );
    Ok(Workload {
        train,
        eval,
        sample_shape: vec![seq_len as i64],
        classes: config.vocab_size,
        objective: Box::new(CausalLm),
        extra_files,
    })
}

/// The bytes of the `tokenizer.json` at `path` (read with a cap) when
/// Hugging Face's tokenizers loads it and its ids (added tokens included)
/// all lie in `0..vocab_size`: another tokenizer than the data's (a failed
/// `accrue tokenize` rerun left one, issue 37) would make every checkpoint
/// decode garbage.
fn checked_tokenizer(
    path: &std::path::Path,
    vocab_size: i64,
) -> Result<(Vec<u8>, tokenizers::Tokenizer)> {
    use accrue_common::small_file::{read_small, MAX_TOKENIZER_BYTES};
    let refuse = |reason: String| Error::Data {
        path: path.to_path_buf(),
        reason,
    };
    let bytes =
        read_small(path, MAX_TOKENIZER_BYTES, "tokenizer.json").map_err(|e| refuse(e.reason()))?;
    let tk = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
        refuse(format!(
            "is not a tokenizer Hugging Face's tokenizers loads: {e}; the checkpoints would carry \
             it (rewrite it with accrue tokenize, or remove it)"
        ))
    })?;
    let size = tk
        .get_vocab(true)
        .values()
        .max()
        .map_or(0, |m| i64::from(*m) + 1);
    if size > vocab_size {
        return Err(refuse(format!(
            "its vocabulary has {size} ids (the largest is {}), more than model.vocab_size = \
             {vocab_size}: it is not the tokenizer the data was written with, or \
             model.vocab_size is too small",
            size - 1
        )));
    }
    Ok((bytes, tk))
}

/// The source's `tokenizer_config.json` beside the data (a model folder's
/// tokenizer brought along), if there is one: a JSON object.
fn source_tokenizer_config(path: &std::path::Path) -> Result<Option<serde_json::Value>> {
    use accrue_common::small_file::{read_small, MAX_CONFIG_BYTES};
    if !path.is_file() {
        return Ok(None);
    }
    let refuse = |reason: String| Error::Data {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = read_small(path, MAX_CONFIG_BYTES, "tokenizer_config.json")
        .map_err(|e| refuse(e.reason()))?;
    match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(v) if v.is_object() => Ok(Some(v)),
        Ok(_) => Err(refuse("is not a JSON object".into())),
        Err(e) => Err(refuse(format!("is not JSON: {e}"))),
    }
}
