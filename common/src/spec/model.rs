//! `[model]`: the fields every family reads and, flat beside them in the
//! TOML, each family's own typed fields ([`FamilyFields`]). It is read as
//! `deny_unknown_fields` reads a struct (serde's `flatten` would drop
//! that): an unknown key is refused where it stands, with serde's
//! "unknown field `x`, expected one of ..." naming every key.

use super::family::FamilyFields;
use super::ModelKind;
use serde::de::{self, DeserializeSeed, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ModelSpec {
    pub kind: ModelKind,
    /// mlp hidden layer widths.
    pub hidden: Vec<i64>,
    /// Output classes; inferred from the labels when absent.
    pub num_classes: Option<i64>,
    /// torchscript: the module file (torch.jit.save).
    pub path: Option<PathBuf>,
    /// Initial weights by name (strict), a safetensors file.
    pub init: Option<PathBuf>,
    /// Each family's own fields (`fields.llama.vocab_size` is
    /// `model.vocab_size`), checked by the family of `kind`.
    #[serde(flatten)]
    pub fields: FamilyFields,
}

/// The keys of the fields every family reads, in declaration order.
pub(super) const GENERIC_FIELDS: [&str; 5] = ["kind", "hidden", "num_classes", "path", "init"];

/// Every key `[model]` takes: the generic ones, then each family's.
static FIELDS: LazyLock<Vec<&'static str>> = LazyLock::new(|| {
    GENERIC_FIELDS
        .iter()
        .copied()
        .chain(FamilyFields::names())
        .collect()
});

impl ModelSpec {
    /// The path fields (`model.path`, `model.init`, then the families'),
    /// by name.
    pub fn paths(&self) -> Vec<(&'static str, Option<&Path>)> {
        let mut paths = vec![
            ("model.path", self.path.as_deref()),
            ("model.init", self.init.as_deref()),
        ];
        paths.extend(self.fields.paths());
        paths
    }

    /// [`ModelSpec::paths`], to replace them.
    pub fn paths_mut(&mut self) -> Vec<(&'static str, &mut Option<PathBuf>)> {
        let mut paths = vec![
            ("model.path", &mut self.path),
            ("model.init", &mut self.init),
        ];
        paths.extend(self.fields.paths_mut());
        paths
    }
}

/// A `[model]` key: a generic field or a family's.
enum Key {
    Kind,
    Hidden,
    NumClasses,
    Path,
    Init,
    Family(&'static str),
}

/// Reads a key, refusing an unknown one where it stands (the key's span).
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Key, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl Visitor<'_> for KeySeed {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("field identifier")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
        Ok(match v {
            "kind" => Key::Kind,
            "hidden" => Key::Hidden,
            "num_classes" => Key::NumClasses,
            "path" => Key::Path,
            "init" => Key::Init,
            _ => match FIELDS[GENERIC_FIELDS.len()..].iter().find(|k| **k == v) {
                Some(k) => Key::Family(k),
                None => return Err(E::unknown_field(v, &FIELDS)),
            },
        })
    }
}

struct ModelVisitor;

/// `slot`, set once (serde's `duplicate field` otherwise).
fn once<'de, T: Deserialize<'de>, A: MapAccess<'de>>(
    slot: &mut Option<T>,
    key: &'static str,
    map: &mut A,
) -> Result<(), A::Error> {
    if slot.is_some() {
        return Err(de::Error::duplicate_field(key));
    }
    *slot = Some(map.next_value()?);
    Ok(())
}

impl<'de> Visitor<'de> for ModelVisitor {
    type Value = ModelSpec;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("struct ModelSpec")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ModelSpec, A::Error> {
        let mut kind = None;
        let mut hidden = None;
        let mut num_classes: Option<Option<i64>> = None;
        let mut path: Option<Option<PathBuf>> = None;
        let mut init: Option<Option<PathBuf>> = None;
        let mut fields = FamilyFields::default();
        while let Some(key) = map.next_key_seed(KeySeed)? {
            match key {
                Key::Kind => once(&mut kind, "kind", &mut map)?,
                Key::Hidden => once(&mut hidden, "hidden", &mut map)?,
                Key::NumClasses => once(&mut num_classes, "num_classes", &mut map)?,
                Key::Path => once(&mut path, "path", &mut map)?,
                Key::Init => once(&mut init, "init", &mut map)?,
                Key::Family(k) => {
                    // Every family key has a set (FIELDS is their union).
                    if !fields.take(k, &mut map)? {
                        return Err(de::Error::unknown_field(k, &FIELDS));
                    }
                }
            }
        }
        Ok(ModelSpec {
            kind: kind.ok_or_else(|| de::Error::missing_field("kind"))?,
            hidden: hidden.unwrap_or_default(),
            num_classes: num_classes.flatten(),
            path: path.flatten(),
            init: init.flatten(),
            fields,
        })
    }
}

impl<'de> Deserialize<'de> for ModelSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_struct("ModelSpec", &FIELDS, ModelVisitor)
    }
}

#[cfg(test)]
mod tests {
    use crate::spec::{JobSpec, LoadError};
    use std::path::Path;

    const LLAMA: &str = "name = \"m\"\n[model]\nkind = \"llama\"\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 4\nrope_theta = 500.0\ntie_word_embeddings = true\n[data]\nkind = \"tokens\"\npath = \"t.bin\"\nseq_len = 16\nbatch_size = 2\n[optimizer]\nkind = \"adamw\"\nlr = 0.001\n";

    /// Every key, as the unknown-field message lists them.
    const EXPECTED: &str = "expected one of `kind`, `hidden`, `num_classes`, `path`, `init`, `vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `rms_norm_eps`, `rope_theta`, `max_position_embeddings`, `tie_word_embeddings`, `attention_bias`, `mlp_bias`, `config`";

    fn parse_error(text: &str) -> String {
        match JobSpec::fields_from_toml_str(text, Path::new("m.toml")) {
            Err(LoadError::Parse { message, .. }) => message,
            other => panic!("expected LoadError::Parse, got {other:?}"),
        }
    }

    /// The JSON a job's spec hash is taken of is the flat `[model]` it was
    /// before the families' fields moved into their own structs (a
    /// checkpoint written before resumes).
    #[test]
    fn a_spec_serializes_as_before_the_family_structs() {
        let s = JobSpec::fields_from_toml_str(LLAMA, Path::new("m.toml")).unwrap();
        assert_eq!(s.model.fields.llama.vocab_size, Some(64));
        assert_eq!(
            serde_json::to_string(&s.model).unwrap(),
            r#"{"kind":"llama","hidden":[],"num_classes":null,"path":null,"init":null,"vocab_size":64,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,"num_attention_heads":4,"rope_theta":500.0,"tie_word_embeddings":true}"#
        );
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<JobSpec>(&json).unwrap(), s);
        let toml_text = toml::to_string(&s).unwrap();
        assert!(
            toml_text.contains("[model]\nkind = \"llama\"\nhidden = []\nvocab_size = 64\n"),
            "{toml_text}"
        );
        assert_eq!(
            JobSpec::fields_from_toml_str(&toml_text, Path::new("m.toml")).unwrap(),
            s
        );
    }

    /// An unknown `[model]` key is refused where it stands, naming every
    /// key; a wrong type in a family's field points at its value.
    #[test]
    fn model_keys_are_refused_as_deny_unknown_fields_refuses_them() {
        assert_eq!(
            parse_error(&LLAMA.replace("rope_theta = 500.0", "rope_thet = 500.0")),
            format!(
                "line 9, column 1 (`rope_thet = 500.0`): unknown field `rope_thet`, {EXPECTED}"
            )
        );
        assert_eq!(
            parse_error(&LLAMA.replace("vocab_size = 64", "vocab_size = 64\nfoo = 1")),
            format!("line 5, column 1 (`foo = 1`): unknown field `foo`, {EXPECTED}")
        );
        assert_eq!(
            parse_error(&LLAMA.replace("vocab_size = 64", "vocab_size = \"x\"")),
            "line 4, column 14 (`vocab_size = \"x\"`): invalid type: string \"x\", expected i64"
        );
        assert_eq!(
            parse_error(&LLAMA.replace("kind = \"llama\"\n", "")),
            "line 2, column 1 (`[model]`): missing field `kind`"
        );
        assert_eq!(
            parse_error(&LLAMA.replace("[model]", "model = 3\n[modelx]")),
            "line 2, column 9 (`model = 3`): invalid type: integer `3`, expected struct ModelSpec"
        );
        // JSON (a spec read back) the same way.
        let s = JobSpec::fields_from_toml_str(LLAMA, Path::new("m.toml")).unwrap();
        let mut j = serde_json::to_value(&s).unwrap();
        j["model"]["oops"] = 1.into();
        assert_eq!(
            serde_json::from_value::<JobSpec>(j.clone())
                .unwrap_err()
                .to_string(),
            format!("unknown field `oops`, {EXPECTED}")
        );
        let model = j["model"].as_object_mut().unwrap();
        model.remove("oops");
        model.insert("vocab_size".into(), serde_json::Value::Null);
        let back = serde_json::from_value::<JobSpec>(j).unwrap();
        assert_eq!(back.model.fields.llama.vocab_size, None);
        assert_eq!(back.model.fields.llama.hidden_size, Some(32));
    }
}
