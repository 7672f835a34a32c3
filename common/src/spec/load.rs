//! Reading a job spec: its file (bounded), TOML in one-line errors, the
//! kinds, then every field checked.

use super::kinds::{check_kinds, merge_kind_errors};
use super::{JobSpec, SpecErrors, MAX_SPEC_BYTES};
use std::path::{Path, PathBuf};

/// Parse errors that are not about one value (syntax, unknown field, type).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read job spec {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "job spec {path} is larger than {MAX_SPEC_BYTES} bytes (64 KiB), the most a spec may be"
    )]
    TooLarge { path: PathBuf },
    #[error("job spec {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("job spec {path}: {source}")]
    Invalid { path: PathBuf, source: SpecErrors },
}

/// A TOML error in one line: "line L, column C: what" (toml's own
/// message spans several lines with the source and a caret).
fn toml_error_line(e: &toml::de::Error, text: &str) -> String {
    let what = e.message().split_whitespace().collect::<Vec<_>>().join(" ");
    match e.span() {
        Some(span) => {
            let at = span.start.min(text.len());
            let before = text.get(..at).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let start = before.rfind('\n').map_or(0, |i| i + 1);
            let column = before.len() - start + 1;
            let source: String = text[start..]
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .chars()
                .take(80)
                .collect();
            format!("line {line}, column {column} (`{source}`): {what}")
        }
        None => what,
    }
}

/// A spec file's text; at most [`MAX_SPEC_BYTES`] are read (a bigger
/// file, or an endless one such as a device, is [`LoadError::TooLarge`]).
fn read_spec(path: &Path) -> Result<String, LoadError> {
    use std::io::Read;
    let read = |source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(read)?
        .take(MAX_SPEC_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    if bytes.len() > MAX_SPEC_BYTES {
        return Err(LoadError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    String::from_utf8(bytes)
        .map_err(|e| read(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
}

/// Fills `[model] kind` from the `model_type` of the config.json that
/// `[model] config` names, when the kind is left out (issue 39: a
/// transformers folder says what it is). Whether it filled one; an
/// unreadable file or one without a model_type leaves the kind missing
/// (then the parse error says so), a model_type accrue does not build is
/// filled as is (then refused with the kinds allowed).
fn kind_from_config(doc: &mut toml::Table) -> bool {
    use crate::small_file::{read_small, MAX_CONFIG_BYTES};
    let Some(toml::Value::Table(model)) = doc.get_mut("model") else {
        return false;
    };
    if model.contains_key("kind") {
        return false;
    }
    let Some(toml::Value::String(config)) = model.get("config") else {
        return false;
    };
    let Ok(bytes) = read_small(Path::new(config), MAX_CONFIG_BYTES, "config.json") else {
        return false;
    };
    let model_type = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("model_type")?.as_str().map(str::to_string));
    match model_type {
        Some(t) => {
            model.insert("kind".into(), toml::Value::String(t));
            true
        }
        None => false,
    }
}

impl JobSpec {
    /// Parses a spec: syntax, unknown fields and wrong types are a
    /// [`LoadError::Parse`]; every refused value (unknown kinds included) is
    /// reported at once in [`LoadError::Invalid`]. `files`: whether the
    /// named files and folders must exist.
    fn parse(text: &str, origin: &Path, files: bool) -> Result<Self, LoadError> {
        if text.len() > MAX_SPEC_BYTES {
            return Err(LoadError::TooLarge {
                path: origin.to_path_buf(),
            });
        }
        let parse_err = |e: toml::de::Error| LoadError::Parse {
            path: origin.to_path_buf(),
            message: toml_error_line(&e, text),
        };
        let (spec, kind_errors) = match toml::from_str::<JobSpec>(text) {
            Ok(spec) => (spec, Vec::new()),
            Err(first) => {
                // Maybe only kinds are refused: check them all, put valid
                // placeholders in their place and try again. Anything else
                // is reported with the original (located) message.
                let mut doc: toml::Table = toml::from_str(text).map_err(parse_err)?;
                // A model with a config.json and no kind takes its
                // model_type (where the file can be read: files checked).
                let filled = files && kind_from_config(&mut doc);
                let errors = check_kinds(&mut doc);
                if errors.is_empty() && !filled {
                    return Err(parse_err(first));
                }
                let spec = toml::Value::Table(doc)
                    .try_into::<JobSpec>()
                    .map_err(|_| parse_err(first))?;
                (spec, errors)
            }
        };
        merge_kind_errors(kind_errors, spec.check(files)).map_err(|source| LoadError::Invalid {
            path: origin.to_path_buf(),
            source,
        })?;
        Ok(spec)
    }

    pub fn from_toml_str(text: &str, origin: &Path) -> Result<Self, LoadError> {
        Self::parse(text, origin, true)
    }

    /// Parses and checks the fields only (not the file system).
    pub fn fields_from_toml_str(text: &str, origin: &Path) -> Result<Self, LoadError> {
        Self::parse(text, origin, false)
    }

    /// Reads and checks the fields only (not the file system): for clients
    /// that submit a job whose files live on the workers.
    pub fn load_fields(path: &Path) -> Result<Self, LoadError> {
        Self::fields_from_toml_str(&read_spec(path)?, path)
    }

    pub fn load(path: &Path) -> Result<Self, LoadError> {
        Self::from_toml_str(&read_spec(path)?, path)
    }
}
