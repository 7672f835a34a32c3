//! The files a language model's step folder carries for the Hugging Face
//! ecosystem besides the weights: `config.json` with the tokenizer's
//! special-token ids, `generation_config.json` (what `generate()` and
//! `pipeline("text-generation")` stop at) and `tokenizer_config.json`
//! (what `AutoTokenizer` reads: the special tokens, the length, the chat
//! template when the source had one).
//!
//! The special tokens come from the source's `tokenizer_config.json` when
//! the data has one beside it (`bos_token`, `eos_token`, `pad_token`, as a
//! string or an added-token object), else from the tokenizer's vocabulary
//! by the names the common families use. A name the tokenizer does not
//! hold is left out, never guessed.

use serde_json::{json, Value};

/// A special token and its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Special {
    pub token: String,
    pub id: u32,
}

/// The special tokens transformers needs to know.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Specials {
    pub bos: Option<Special>,
    pub eos: Option<Special>,
    pub pad: Option<Special>,
}

/// End-of-text names, in order: GPT-2 and Qwen2, Llama 2 and Mistral,
/// Llama 3, Gemma.
pub const EOS_NAMES: [&str; 4] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"];
/// Beginning-of-text names: Llama 3, Llama 2 and Mistral, Gemma.
pub const BOS_NAMES: [&str; 3] = ["<|begin_of_text|>", "<s>", "<bos>"];
/// Padding names.
pub const PAD_NAMES: [&str; 3] = ["<pad>", "<|pad|>", "[PAD]"];

/// The special tokens of a tokenizer (`id_of` gives a token's id, if it
/// holds it), from `source` (a tokenizer_config.json) where it names them.
pub fn specials(id_of: &dyn Fn(&str) -> Option<u32>, source: Option<&Value>) -> Specials {
    let named = |key: &str| -> Option<Special> {
        let v = source?.get(key)?;
        let token = match v {
            Value::String(s) => s.clone(),
            Value::Object(o) => o.get("content")?.as_str()?.to_string(),
            _ => return None,
        };
        let id = id_of(&token)?;
        Some(Special { token, id })
    };
    let first = |names: &[&str]| {
        names.iter().find_map(|n| {
            id_of(n).map(|id| Special {
                token: n.to_string(),
                id,
            })
        })
    };
    let has_source = |key: &str| source.is_some_and(|s| s.get(key).is_some());
    // A source that names the key (null included) decides; otherwise the
    // vocabulary by name.
    let pick = |key: &str, names: &[&str]| {
        if has_source(key) {
            named(key)
        } else {
            first(names)
        }
    };
    Specials {
        bos: pick("bos_token", &BOS_NAMES),
        eos: pick("eos_token", &EOS_NAMES),
        pad: pick("pad_token", &PAD_NAMES),
    }
}

/// Adds the special-token ids to a `config.json` object.
pub fn with_token_ids(mut config: Value, s: &Specials) -> Value {
    if let Value::Object(o) = &mut config {
        for (key, t) in [
            ("bos_token_id", &s.bos),
            ("eos_token_id", &s.eos),
            ("pad_token_id", &s.pad),
        ] {
            if let Some(t) = t {
                o.insert(key.into(), t.id.into());
            }
        }
    }
    config
}

/// `generation_config.json`: the ids `generate()` starts, stops and pads
/// with (as transformers writes it from a model config).
pub fn generation_config(s: &Specials) -> Value {
    let mut v = json!({ "_from_model_config": true });
    for (key, t) in [
        ("bos_token_id", &s.bos),
        ("eos_token_id", &s.eos),
        ("pad_token_id", &s.pad),
    ] {
        if let Some(t) = t {
            v[key] = t.id.into();
        }
    }
    v
}

/// `tokenizer_config.json` for the fast tokenizer in tokenizer.json: its
/// special tokens, `model_max_length` (the model's positions), and the
/// source's chat template when it had one.
pub fn tokenizer_config(s: &Specials, max_length: i64, source: Option<&Value>) -> Value {
    let mut v = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": false,
    });
    for (key, t) in [
        ("bos_token", &s.bos),
        ("eos_token", &s.eos),
        ("pad_token", &s.pad),
    ] {
        if let Some(t) = t {
            v[key] = t.token.clone().into();
        }
    }
    // The source's own class and template (a Qwen2 or Llama tokenizer
    // brought along) win over the generic ones.
    for key in ["tokenizer_class", "chat_template"] {
        if let Some(t) = source.and_then(|s| s.get(key)) {
            v[key] = t.clone();
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab<'a>(names: &'a [(&'a str, u32)]) -> impl Fn(&str) -> Option<u32> + 'a {
        move |t| names.iter().find(|(n, _)| *n == t).map(|(_, i)| *i)
    }

    #[test]
    fn specials_come_from_the_vocabulary_by_family_names() {
        let gpt2 = vocab(&[("<|endoftext|>", 50256), ("hello", 7)]);
        let s = specials(&gpt2, None);
        assert_eq!(s.eos.as_ref().map(|t| t.id), Some(50256));
        assert_eq!((s.bos.clone(), s.pad.clone()), (None, None));
        let llama3 = vocab(&[("<|begin_of_text|>", 128000), ("<|end_of_text|>", 128001)]);
        let s = specials(&llama3, None);
        assert_eq!(s.bos.unwrap().id, 128000);
        assert_eq!(s.eos.unwrap().token, "<|end_of_text|>");
    }

    #[test]
    fn the_source_config_decides_where_it_names_a_token() {
        let v = vocab(&[("<s>", 1), ("</s>", 2), ("<|im_end|>", 9), ("<unk>", 0)]);
        let source = json!({
            "eos_token": {"content": "<|im_end|>", "special": true},
            "bos_token": null,
            "pad_token": "<unk>",
            "chat_template": "{{ messages }}",
        });
        let s = specials(&v, Some(&source));
        assert_eq!(s.eos.as_ref().unwrap().id, 9);
        assert_eq!(s.bos, None, "null in the source: no bos, not <s>");
        assert_eq!(s.pad.as_ref().unwrap().token, "<unk>");
        let cfg = with_token_ids(json!({"model_type": "llama"}), &s);
        assert_eq!(cfg["eos_token_id"], 9);
        assert_eq!(cfg["pad_token_id"], 0);
        assert!(cfg.get("bos_token_id").is_none());
        let g = generation_config(&s);
        assert_eq!(g["eos_token_id"], 9);
        let t = tokenizer_config(&s, 2048, Some(&source));
        assert_eq!(t["eos_token"], "<|im_end|>");
        assert_eq!(t["model_max_length"], 2048);
        assert_eq!(t["chat_template"], "{{ messages }}");
        assert_eq!(t["tokenizer_class"], "PreTrainedTokenizerFast");
        let own = json!({"tokenizer_class": "Qwen2Tokenizer"});
        assert_eq!(
            tokenizer_config(&s, 8, Some(&own))["tokenizer_class"],
            "Qwen2Tokenizer"
        );
        // A name the tokenizer lacks is left out.
        let s = specials(&v, Some(&json!({"eos_token": "<missing>"})));
        assert_eq!(s.eos, None);
    }
}
