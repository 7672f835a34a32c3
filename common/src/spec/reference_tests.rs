//! docs/SPEC.md, the job-spec reference, against the spec types: every
//! key the types accept has its row, every row names a key they accept,
//! every name of an enum-like key is listed, and the TOML examples parse
//! and validate.
//!
//! The keys come from the types themselves, through serde: [`Probe`] is a
//! deserializer that answers every `deserialize_struct` by handing the
//! visitor each of the `fields` serde passes it (every field, `Option`s,
//! defaults and `[model]`'s family fields included) and records what each
//! value asks for. A field added to a spec struct without its row fails
//! `every_spec_key_has_its_row_in_spec_md`.
//!
//! SPEC.md's convention, which the parser below reads:
//!
//! - a section per TOML table: a level-2 heading `## [table]` (e.g.
//!   `## [clipping]`), and `## Top-level keys` for the keys outside any
//!   table; the section runs to the next level-1 or level-2 heading
//!   (level-3 headings inside it, such as `[model]`'s per-family parts,
//!   stay in it);
//! - a key table: a markdown table whose header row is exactly
//!   `| key | type | default | allowed | meaning | peers |`; each of its
//!   rows has six cells, the first the key in backticks (`` | `max_norm` | ``);
//! - an enum-like key lists each name it takes in its `allowed` cell as
//!   `` `"name"` ``;
//! - every ```` ```toml ```` block is a complete spec; the first names no
//!   file, so it validates with the file checks too.

use super::JobSpec;
use serde::de::value::{Error, StrDeserializer};
use serde::de::{self, DeserializeSeed, Deserializer, IntoDeserializer, Visitor};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What the types make of one leaf key.
#[derive(Clone, Debug, PartialEq)]
enum Kind {
    Bool,
    Integer,
    Float,
    String,
    /// An enum-like key and the names it takes.
    Enum(Vec<&'static str>),
    /// A list of any length.
    List,
    /// A fixed-length array (`betas`).
    Array(usize),
}

/// The keys the types accept: tables (dotted paths, the root left out)
/// and leaves (dotted paths).
#[derive(Debug, Default)]
struct Keys {
    tables: BTreeSet<String>,
    leaves: BTreeMap<String, Kind>,
}

/// A deserializer that walks the spec types, recording each key at
/// `path` (dotted; empty for the root).
struct Probe<'a> {
    path: String,
    keys: &'a mut Keys,
}

impl Probe<'_> {
    fn leaf(&mut self, kind: Kind) {
        self.keys.leaves.insert(self.path.clone(), kind);
    }
}

fn unsupported(path: &str, what: &str) -> Error {
    de::Error::custom(format!(
        "{path}: the spec types ask for {what}, which this probe cannot walk; teach \
         common/src/spec/reference_tests.rs's Probe about it"
    ))
}

macro_rules! leaves {
    ($($method:ident => $kind:ident, $visit:ident($value:expr);)+) => {
        $(
            fn $method<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, Error> {
                self.leaf(Kind::$kind);
                v.$visit($value)
            }
        )+
    };
}

impl<'de> Deserializer<'de> for Probe<'_> {
    type Error = Error;

    leaves! {
        deserialize_bool => Bool, visit_bool(false);
        deserialize_i8 => Integer, visit_i64(1);
        deserialize_i16 => Integer, visit_i64(1);
        deserialize_i32 => Integer, visit_i64(1);
        deserialize_i64 => Integer, visit_i64(1);
        deserialize_i128 => Integer, visit_i64(1);
        deserialize_u8 => Integer, visit_u64(1);
        deserialize_u16 => Integer, visit_u64(1);
        deserialize_u32 => Integer, visit_u64(1);
        deserialize_u64 => Integer, visit_u64(1);
        deserialize_u128 => Integer, visit_u64(1);
        deserialize_f32 => Float, visit_f64(1.0);
        deserialize_f64 => Float, visit_f64(1.0);
        deserialize_char => String, visit_char('x');
        deserialize_str => String, visit_str("x");
        deserialize_string => String, visit_str("x");
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Error> {
        if !self.path.is_empty() {
            self.keys.tables.insert(self.path.clone());
        }
        v.visit_map(Fields {
            prefix: self.path,
            fields: fields.iter(),
            keys: self.keys,
            next: None,
        })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        mut self,
        _name: &'static str,
        variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Error> {
        self.leaf(Kind::Enum(variants.to_vec()));
        let first: StrDeserializer<'_, Error> = variants[0].into_deserializer();
        v.visit_enum(first)
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        v: V,
    ) -> Result<V::Value, Error> {
        v.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, Error> {
        self.leaf(Kind::List);
        v.visit_seq(de::value::SeqDeserializer::new(std::iter::empty::<u8>()))
    }

    fn deserialize_tuple<V: Visitor<'de>>(mut self, len: usize, v: V) -> Result<V::Value, Error> {
        self.leaf(Kind::Array(len));
        v.visit_seq(Elements {
            path: self.path,
            left: len,
        })
    }

    fn deserialize_any<V: Visitor<'de>>(self, _v: V) -> Result<V::Value, Error> {
        Err(unsupported(
            &self.path,
            "any value (an untagged or flattened type)",
        ))
    }

    fn deserialize_bytes<V: Visitor<'de>>(self, _v: V) -> Result<V::Value, Error> {
        Err(unsupported(&self.path, "bytes"))
    }

    fn deserialize_byte_buf<V: Visitor<'de>>(self, _v: V) -> Result<V::Value, Error> {
        Err(unsupported(&self.path, "bytes"))
    }

    fn deserialize_unit<V: Visitor<'de>>(self, _v: V) -> Result<V::Value, Error> {
        Err(unsupported(&self.path, "a unit"))
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _v: V,
    ) -> Result<V::Value, Error> {
        Err(unsupported(&self.path, "a unit struct"))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        _v: V,
    ) -> Result<V::Value, Error> {
        Err(unsupported(&self.path, "a tuple struct"))
    }

    fn deserialize_map<V: Visitor<'de>>(self, _v: V) -> Result<V::Value, Error> {
        Err(unsupported(&self.path, "a map with free-form keys"))
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, _v: V) -> Result<V::Value, Error> {
        Err(unsupported(&self.path, "an identifier"))
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Error> {
        v.visit_unit()
    }
}

/// A struct's fields, each key followed by a [`Probe`] for its value.
struct Fields<'a> {
    prefix: String,
    fields: std::slice::Iter<'static, &'static str>,
    keys: &'a mut Keys,
    next: Option<&'static str>,
}

impl<'de> de::MapAccess<'de> for Fields<'_> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        let Some(&field) = self.fields.next() else {
            return Ok(None);
        };
        self.next = Some(field);
        let key: StrDeserializer<'_, Error> = field.into_deserializer();
        seed.deserialize(key).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let field = self.next.take().expect("a key before its value");
        let path = if self.prefix.is_empty() {
            field.to_string()
        } else {
            format!("{}.{field}", self.prefix)
        };
        seed.deserialize(Probe {
            path,
            keys: &mut *self.keys,
        })
    }
}

/// The elements of a fixed-length array, each probed at the array's path.
struct Elements {
    path: String,
    left: usize,
}

impl<'de> de::SeqAccess<'de> for Elements {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        // The element's own kind is the array's business, not a key.
        let mut scratch = Keys::default();
        seed.deserialize(Probe {
            path: self.path.clone(),
            keys: &mut scratch,
        })
        .map(Some)
    }
}

/// Every key of [`JobSpec`], from its types.
fn spec_keys() -> Keys {
    let mut keys = Keys::default();
    if let Err(e) = JobSpec::deserialize(Probe {
        path: String::new(),
        keys: &mut keys,
    }) {
        panic!("probing the spec types failed: {e}");
    }
    keys
}

/// The header of a key table.
const HEADER: [&str; 6] = ["key", "type", "default", "allowed", "meaning", "peers"];
/// The heading of the top-level keys' section.
const ROOT_HEADING: &str = "Top-level keys";

/// One key row of SPEC.md.
#[derive(Debug)]
struct Row {
    /// 1-based, for messages.
    line: usize,
    cells: Vec<String>,
}

/// SPEC.md as the convention reads it.
#[derive(Debug, Default)]
struct Doc {
    /// `## [table]` headings (dotted path) by line.
    tables: BTreeMap<String, usize>,
    /// Key rows by (table, key); the table is "" for the top level.
    rows: BTreeMap<(String, String), Row>,
    /// TOML examples: (first line, text).
    examples: Vec<(usize, String)>,
    /// Everything that breaks the convention.
    problems: Vec<String>,
}

fn spec_md_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/SPEC.md")
}

/// A markdown table row's cells (a `\|` stays inside its cell).
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|');
    let inner = inner.strip_suffix('|').unwrap_or(inner);
    let mut out = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                out.last_mut().unwrap().push('|');
                chars.next();
            }
            '|' => out.push(String::new()),
            c => out.last_mut().unwrap().push(c),
        }
    }
    out.iter().map(|c| c.trim().to_string()).collect()
}

fn is_separator(cells: &[String]) -> bool {
    cells
        .iter()
        .all(|c| !c.is_empty() && c.chars().all(|ch| matches!(ch, '-' | ':')))
}

fn parse_doc(text: &str) -> Doc {
    let mut doc = Doc::default();
    // The section: Some("") top level, Some("data") `[data]`, None other.
    let mut section: Option<String> = None;
    let mut in_key_table = false;
    let mut fence: Option<(usize, bool, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if let Some((start, toml, body)) = &mut fence {
            if line.trim_start().starts_with("```") {
                if *toml {
                    doc.examples.push((*start, std::mem::take(body)));
                }
                fence = None;
            } else {
                body.push_str(line);
                body.push('\n');
            }
            continue;
        }
        if let Some(info) = line.trim_start().strip_prefix("```") {
            fence = Some((n, info.trim() == "toml", String::new()));
            in_key_table = false;
            continue;
        }
        let level = line.chars().take_while(|&c| c == '#').count();
        if level > 0 && line[level..].starts_with(' ') {
            in_key_table = false;
            let title = line[level..].trim();
            if level <= 2 {
                section = None;
            }
            if level == 2 {
                if title == ROOT_HEADING {
                    section = Some(String::new());
                } else if let Some(name) = title.strip_prefix('[').and_then(|t| t.strip_suffix(']'))
                {
                    section = Some(name.to_string());
                    if doc.tables.insert(name.to_string(), n).is_some() {
                        doc.problems
                            .push(format!("line {n}: a second `## [{name}]` section"));
                    }
                }
            }
            continue;
        }
        if !line.trim_start().starts_with('|') {
            in_key_table = false;
            continue;
        }
        let row = cells(line);
        if row == HEADER {
            in_key_table = true;
            if section.is_none() {
                doc.problems.push(format!(
                    "line {n}: a key table outside any `## [table]` or `## {ROOT_HEADING}` section"
                ));
            }
            continue;
        }
        if !in_key_table || is_separator(&row) {
            continue;
        }
        if row.len() != HEADER.len() {
            doc.problems.push(format!(
                "line {n}: {} cells, a key row has {} ({})",
                row.len(),
                HEADER.len(),
                HEADER.join(" | ")
            ));
            continue;
        }
        let key = row[0]
            .strip_prefix('`')
            .and_then(|k| k.strip_suffix('`'))
            .filter(|k| {
                !k.is_empty()
                    && k.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            });
        let (Some(key), Some(table)) = (key, &section) else {
            doc.problems.push(format!(
                "line {n}: the first cell {:?} is not a key in backticks",
                row[0]
            ));
            continue;
        };
        for (cell, name) in row.iter().zip(HEADER).skip(1) {
            if cell.is_empty() {
                doc.problems
                    .push(format!("line {n}: `{key}`'s {name} cell is empty"));
            }
        }
        let at = (table.clone(), key.to_string());
        if let Some(first) = doc.rows.get(&at) {
            doc.problems.push(format!(
                "line {n}: `{key}` is documented twice in its section (first at line {})",
                first.line
            ));
            continue;
        }
        doc.rows.insert(
            at,
            Row {
                line: n,
                cells: row,
            },
        );
    }
    if let Some((start, _, _)) = fence {
        doc.problems
            .push(format!("line {start}: a code block that is never closed"));
    }
    doc
}

fn spec_md() -> Doc {
    let path = spec_md_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let doc = parse_doc(&text);
    assert!(
        doc.problems.is_empty(),
        "docs/SPEC.md breaks its convention (see common/src/spec/reference_tests.rs):\n  {}",
        doc.problems.join("\n  ")
    );
    doc
}

/// `a.b.c` as (its table `a.b`, its key `c`).
fn split(path: &str) -> (String, String) {
    match path.rsplit_once('.') {
        Some((table, key)) => (table.to_string(), key.to_string()),
        None => (String::new(), path.to_string()),
    }
}

fn heading(table: &str) -> String {
    if table.is_empty() {
        format!("## {ROOT_HEADING}")
    } else {
        format!("## [{table}]")
    }
}

/// Whether a type cell says what the types take.
fn type_agrees(kind: &Kind, cell: &str) -> bool {
    match kind {
        Kind::Bool => cell == "bool",
        Kind::Integer => cell.starts_with("integer"),
        Kind::Float => cell.starts_with("float"),
        Kind::String | Kind::Enum(_) => cell.starts_with("string"),
        Kind::List => cell.starts_with("list"),
        Kind::Array(n) => cell.starts_with('[') && cell.matches(',').count() + 1 == *n,
    }
}

#[test]
fn the_probe_sees_the_spec_types() {
    let keys = spec_keys();
    for table in [
        "model",
        "data",
        "accumulation",
        "clipping",
        "optimizer",
        "schedule",
        "checkpoint",
        "eval",
        "comm",
        "sharding",
        "loss_scaling",
        "performance",
        "parallel",
    ] {
        assert!(keys.tables.contains(table), "{table}: {:?}", keys.tables);
    }
    // An Option that is None by default, a family's field, a defaulted
    // field and an enum all seen.
    assert_eq!(keys.leaves["parallel.tensor"], Kind::Integer);
    assert_eq!(keys.leaves["model.num_key_value_heads"], Kind::Integer);
    assert_eq!(keys.leaves["model.config"], Kind::String);
    assert_eq!(keys.leaves["loss_scaling.init_scale"], Kind::Float);
    assert_eq!(keys.leaves["optimizer.betas"], Kind::Array(2));
    assert_eq!(keys.leaves["model.hidden"], Kind::List);
    assert_eq!(
        keys.leaves["parallel.schedule"],
        Kind::Enum(vec!["1f1b", "gpipe", "interleaved_1f1b"])
    );
    assert!(!keys.leaves.contains_key("model"));
}

/// The probe sees at least what a spec serializes: every key of every
/// example in SPEC.md, serialized back to TOML, is one it found.
#[test]
fn the_probe_sees_every_key_a_spec_serializes() {
    fn walk(prefix: &str, table: &toml::Table, keys: &Keys, missed: &mut Vec<String>) {
        for (k, v) in table {
            let path = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Table(t) => {
                    if !keys.tables.contains(&path) {
                        missed.push(path.clone());
                    }
                    walk(&path, t, keys, missed);
                }
                _ if !keys.leaves.contains_key(&path) => missed.push(path),
                _ => {}
            }
        }
    }
    let keys = spec_keys();
    let doc = spec_md();
    let mut missed = Vec::new();
    for (line, text) in &doc.examples {
        let spec = JobSpec::fields_from_toml_str(text, Path::new("SPEC.md"))
            .unwrap_or_else(|e| panic!("the example at docs/SPEC.md line {line}: {e}"));
        let table: toml::Table = toml::from_str(&toml::to_string(&spec).unwrap()).unwrap();
        walk("", &table, &keys, &mut missed);
    }
    assert!(missed.is_empty(), "keys the probe missed: {missed:?}");
}

#[test]
fn every_spec_key_has_its_row_in_spec_md() {
    let keys = spec_keys();
    let doc = spec_md();
    let mut missing = Vec::new();
    for table in &keys.tables {
        if !doc.tables.contains_key(table) {
            missing.push(format!("no `{}` section", heading(table)));
        }
    }
    for (path, kind) in &keys.leaves {
        let (table, key) = split(path);
        let Some(row) = doc.rows.get(&(table.clone(), key.clone())) else {
            missing.push(format!(
                "{path}: no row `| \\`{key}\\` | ...` under `{}`",
                heading(&table)
            ));
            continue;
        };
        if !type_agrees(kind, &row.cells[1]) {
            missing.push(format!(
                "{path} (line {}): type {:?} does not say {kind:?}",
                row.line, row.cells[1]
            ));
        }
        if let Kind::Enum(names) = kind {
            for name in names {
                if !row.cells[3].contains(&format!("`\"{name}\"`")) {
                    missing.push(format!(
                        "{path} (line {}): its allowed cell does not list `\"{name}\"`",
                        row.line
                    ));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/SPEC.md does not document every key of the spec types ({} keys):\n  {}",
        keys.leaves.len(),
        missing.join("\n  ")
    );
}

#[test]
fn every_key_in_spec_md_is_one_the_spec_takes() {
    let keys = spec_keys();
    let doc = spec_md();
    let mut unknown = Vec::new();
    for (table, line) in &doc.tables {
        if !keys.tables.contains(table) {
            unknown.push(format!(
                "line {line}: `## [{table}]` is not a table of the spec"
            ));
        }
    }
    for ((table, key), row) in &doc.rows {
        let path = if table.is_empty() {
            key.clone()
        } else {
            format!("{table}.{key}")
        };
        if !keys.leaves.contains_key(&path) {
            unknown.push(format!(
                "line {}: `{path}` is not a key the spec takes",
                row.line
            ));
        }
    }
    assert!(
        unknown.is_empty(),
        "docs/SPEC.md names keys the spec refuses:\n  {}",
        unknown.join("\n  ")
    );
}

#[test]
fn the_examples_in_spec_md_parse_and_validate() {
    let doc = spec_md();
    assert!(
        !doc.examples.is_empty(),
        "docs/SPEC.md has no ```toml example"
    );
    for (line, text) in &doc.examples {
        if let Err(e) = JobSpec::fields_from_toml_str(text, Path::new("SPEC.md")) {
            panic!("the example at docs/SPEC.md line {line}: {e}");
        }
    }
    // The first, the minimal one, names no file: it validates as a worker
    // reads it, files checked.
    let (line, first) = &doc.examples[0];
    if let Err(e) = JobSpec::from_toml_str(first, Path::new("SPEC.md")) {
        panic!("the first example (docs/SPEC.md line {line}), files checked: {e}");
    }
}

#[test]
fn the_convention_parser_reads_rows_sections_and_examples() {
    let text = "# T\n## Top-level keys\n\n| key | type | default | allowed | meaning | peers |\n|---|---|---|---|---|---|\n| `seed` | integer | `0` | a \\| b | m | p |\n## [data]\n### kinds\n| key | type | default | allowed | meaning | peers |\n|---|---|---|---|---|---|\n| `kind` | string | required | `\"mnist\"` | m | p |\n\n| kind | what |\n|---|---|\n| `mnist` | not a key table |\n## Other\n```toml\nname = \"x\"\n```\n";
    let doc = parse_doc(text);
    assert!(doc.problems.is_empty(), "{:?}", doc.problems);
    let keys: Vec<_> = doc.rows.keys().cloned().collect();
    assert_eq!(
        keys,
        [("".into(), "seed".into()), ("data".into(), "kind".into())]
    );
    assert_eq!(doc.rows[&("".into(), "seed".into())].cells[3], "a | b");
    assert_eq!(doc.tables.keys().collect::<Vec<_>>(), ["data"]);
    assert_eq!(doc.examples, [(17, "name = \"x\"\n".to_string())]);
    let bad = parse_doc("## Other\n| key | type | default | allowed | meaning | peers |\n|---|---|---|---|---|---|\n| seed | integer | 0 | a | m | p |\n");
    assert_eq!(bad.problems.len(), 2, "{:?}", bad.problems);
}
