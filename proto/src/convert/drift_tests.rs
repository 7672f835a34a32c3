//! The field lists of the serde spec, the proto spec and the converter
//! cannot drift apart: every field of the domain `JobSpec` (found through
//! its `Debug`, so every nested table and every `Option`, whether serde
//! writes it or not) takes two values over the specs below and comes back
//! from the wire; every field of every proto spec message (found in the
//! descriptor set the build emits) is written by `spec_to_proto` and read
//! by `spec_from_proto` (dropping it from the wire changes the spec).
//! Adding a field to one side only fails here.

use super::*;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, TestRng, TestRunner};
use prost::Message;
use prost_types::field_descriptor_proto::Type;
use prost_types::{DescriptorProto, FieldDescriptorProto, FileDescriptorSet};
use std::collections::{BTreeMap, BTreeSet};

/// Specs that set what the round trip's generator leaves out (it keeps to
/// one stage and no activation checkpointing); one line each, so a new
/// field the generator cannot draw gets its spec here.
const EXTRA: &[&str] = &[
    "workers = 2\n[parallel]\npipeline = 2\nschedule = \"gpipe\"\nlayers_per_stage = [1, 3]",
    "workers = 2\n[parallel]\npipeline = 2\nschedule = \"interleaved_1f1b\"\nstages_per_rank = 2",
    "workers = 2\n[parallel]\npipeline = 2\nbalance = \"compute\"\n[performance]\nactivation_checkpointing = \"full\"\ncheckpoint_every = 2",
];

/// A llama job on tokens with `top` (top-level keys, then tables).
fn extra(top: &str) -> JobSpec {
    let text = format!(
        "name = \"drift\"\n{top}\n[model]\nkind = \"llama\"\nvocab_size = 97\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 4\nnum_attention_heads = 4\n[data]\nkind = \"tokens\"\npath = \"train.bin\"\nseq_len = 16\nbatch_size = 4\n[optimizer]\nkind = \"adamw\"\nlr = 0.001\n"
    );
    // Tables after the top-level keys may repeat none of the ones above.
    JobSpec::fields_from_toml_str(&text, std::path::Path::new("drift.toml"))
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// The generator's specs and [`EXTRA`]'s.
fn specs() -> Vec<JobSpec> {
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::deterministic_rng(Config::default().rng_algorithm),
    );
    let strategy = super::tests::spec();
    let mut out: Vec<JobSpec> = (0..300)
        .map(|_| strategy.new_tree(&mut runner).unwrap().current())
        .collect();
    out.extend(EXTRA.iter().map(|t| extra(t)));
    out
}

/// Splits `a: X, b: Y` at the commas outside brackets and strings.
fn split_top(body: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut quoted, mut escaped, mut start) =
        (Vec::new(), 0, false, false, 0);
    for (i, c) in body.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '(' | '[' | '{' if !quoted => depth += 1,
            ')' | ']' | '}' if !quoted => depth -= 1,
            ',' if !quoted && depth == 0 => {
                parts.push(body[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(body[start..].trim());
    parts.retain(|p| !p.is_empty());
    parts
}

/// Every leaf field of a `Debug`-printed struct (`model.fields.llama.
/// vocab_size`, ...) and its value as printed (`None` included).
fn debug_leaves(prefix: &str, text: &str, out: &mut Vec<(String, String)>) {
    let body = match (text.find('{'), text.ends_with('}')) {
        (Some(open), true) => &text[open + 1..text.len() - 1],
        _ => panic!("not a struct: {text}"),
    };
    for part in split_top(body) {
        let (field, value) = part.split_once(": ").expect("a field: value pair");
        let path = format!("{prefix}{field}");
        let is_struct = value.ends_with('}')
            && value.starts_with(|c: char| c.is_ascii_uppercase())
            && value
                .find('{')
                .is_some_and(|i| !value[..i].contains(['(', '[', '"']));
        if is_struct {
            debug_leaves(&format!("{path}."), value, out);
        } else {
            out.push((path, value.to_string()));
        }
    }
}

#[test]
fn every_domain_field_varies_and_crosses_the_wire() {
    let mut seen: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in specs() {
        let mut leaves = Vec::new();
        debug_leaves("", &format!("{s:?}"), &mut leaves);
        for (path, value) in leaves {
            seen.entry(path).or_default().insert(value);
        }
        let back = spec_from_proto(&spec_to_proto(&s));
        assert_eq!(back, Ok(s), "the spec changed on the wire");
    }
    assert!(
        seen.len() >= 80,
        "only {} fields: {:?}",
        seen.len(),
        seen.keys()
    );
    let dull: Vec<String> = seen
        .iter()
        .filter(|(_, v)| v.len() < 2)
        .map(|(p, v)| format!("{p} = {v:?}"))
        .collect();
    assert!(
        dull.is_empty(),
        "these domain fields never vary over the specs (draw them in tests.rs's generator or add a spec to EXTRA): {dull:?}"
    );
}

/// The proto's message types by full name (`.accrue.v1.JobSpec`).
fn messages() -> BTreeMap<String, DescriptorProto> {
    let bytes = include_bytes!(concat!(env!("OUT_DIR"), "/accrue_descriptor.bin"));
    let set = FileDescriptorSet::decode(bytes.as_slice()).expect("the build's descriptor set");
    let mut out = BTreeMap::new();
    for file in set.file {
        let package = file.package().to_string();
        for m in file.message_type {
            out.insert(format!(".{package}.{}", m.name()), m);
        }
    }
    out
}

/// Fields stored by an earlier coordinator, read and never written: llama's
/// fields flat in `ModelSpec` before they had their own message (read
/// back in `family/llama.rs`'s test).
fn legacy(path: &str, f: &FieldDescriptorProto) -> bool {
    path.starts_with("model.") && !path[6..].contains('.') && (7..=19).contains(&f.number())
}

/// A message on the wire: each field's number and either its encoded
/// bytes (tag included) or, for a message-typed field, its fields.
#[derive(Clone)]
enum Node {
    Raw(Vec<u8>),
    Msg(Vec<(u32, Node)>),
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            break;
        }
    }
    v
}

fn parse(
    b: &[u8],
    ty: &DescriptorProto,
    all: &BTreeMap<String, DescriptorProto>,
) -> Vec<(u32, Node)> {
    let (mut at, mut out) = (0, Vec::new());
    while at < b.len() {
        let start = at;
        let tag = varint(b, &mut at);
        let (num, wire) = ((tag >> 3) as u32, tag & 7);
        let len = match wire {
            0 => {
                varint(b, &mut at);
                0
            }
            1 => 8,
            2 => varint(b, &mut at) as usize,
            5 => 4,
            w => panic!("wire type {w}"),
        };
        let payload = &b[at..at + len];
        at += len;
        let field = ty.field.iter().find(|f| f.number() == num as i32);
        let node = match field.filter(|f| f.r#type() == Type::Message) {
            Some(f) => Node::Msg(parse(payload, &all[f.type_name()], all)),
            None => Node::Raw(b[start..at].to_vec()),
        };
        out.push((num, node));
    }
    out
}

fn encode(fields: &[(u32, Node)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (num, node) in fields {
        match node {
            Node::Raw(b) => out.extend_from_slice(b),
            Node::Msg(m) => {
                let inner = encode(m);
                prost::encoding::encode_key(
                    *num,
                    prost::encoding::WireType::LengthDelimited,
                    &mut out,
                );
                prost::encoding::encode_varint(inner.len() as u64, &mut out);
                out.extend(inner);
            }
        }
    }
    out
}

/// The message without the field at `path` (field numbers).
fn without(fields: &[(u32, Node)], path: &[u32]) -> Vec<(u32, Node)> {
    fields
        .iter()
        .filter(|(n, _)| path.len() > 1 || *n != path[0])
        .map(|(n, node)| match node {
            Node::Msg(m) if *n == path[0] && path.len() > 1 => {
                (*n, Node::Msg(without(m, &path[1..])))
            }
            other => (*n, other.clone()),
        })
        .collect()
}

/// Whether the field at `path` is on the wire.
fn has(fields: &[(u32, Node)], path: &[u32]) -> bool {
    fields.iter().any(|(n, node)| {
        *n == path[0] && (path.len() == 1 || matches!(node, Node::Msg(m) if has(m, &path[1..])))
    })
}

/// Every field of `ty` and of the messages below it: its dotted name and
/// its path of field numbers.
fn proto_fields(
    prefix: &str,
    numbers: &[u32],
    ty: &DescriptorProto,
    all: &BTreeMap<String, DescriptorProto>,
    out: &mut Vec<(String, Vec<u32>)>,
) {
    for f in &ty.field {
        let name = format!("{prefix}{}", f.name());
        if legacy(&name, f) {
            continue;
        }
        let path: Vec<u32> = numbers.iter().copied().chain([f.number() as u32]).collect();
        if f.r#type() == Type::Message {
            proto_fields(&format!("{name}."), &path, &all[f.type_name()], all, out);
        }
        out.push((name, path));
    }
}

#[test]
fn every_proto_spec_field_is_written_and_read() {
    let all = messages();
    let root = &all[".accrue.v1.JobSpec"];
    let mut fields = Vec::new();
    proto_fields("", &[], root, &all, &mut fields);
    assert!(fields.len() >= 100, "only {} proto fields", fields.len());
    let wires: Vec<(JobSpec, Vec<(u32, Node)>)> = specs()
        .into_iter()
        .map(|s| {
            let bytes = spec_to_proto(&s).encode_to_vec();
            (s, parse(&bytes, root, &all))
        })
        .collect();
    let mut unwritten = Vec::new();
    let mut unread = Vec::new();
    for (name, path) in &fields {
        let on_wire: Vec<_> = wires.iter().filter(|(_, w)| has(w, path)).collect();
        if on_wire.is_empty() {
            unwritten.push(name.clone());
            continue;
        }
        // Read: some spec converts otherwise (or is refused) without it.
        let read = on_wire.iter().any(|(_, w)| {
            let convert = |w: &[(u32, Node)]| {
                spec_from_proto(&v1::JobSpec::decode(encode(w).as_slice()).unwrap())
            };
            convert(w) != convert(&without(w, path))
        });
        if !read {
            unread.push(name.clone());
        }
    }
    assert!(
        unwritten.is_empty() && unread.is_empty(),
        "spec_to_proto never writes these proto fields (convert them, or add a spec setting them to EXTRA): {unwritten:?}; spec_from_proto ignores these: {unread:?}"
    );
}

/// The wire helpers above: the parse re-encodes to the same bytes, and
/// dropping a field drops it alone.
#[test]
fn the_wire_walk_is_faithful() {
    let all = messages();
    let root = &all[".accrue.v1.JobSpec"];
    let s = extra(EXTRA[0]);
    let p = spec_to_proto(&s);
    let w = parse(&p.encode_to_vec(), root, &all);
    assert_eq!(v1::JobSpec::decode(encode(&w).as_slice()).unwrap(), p);
    // model (10) . llama (20) . vocab_size (1)
    let mut q = p.clone();
    q.model.as_mut().unwrap().llama.as_mut().unwrap().vocab_size = None;
    let dropped = encode(&without(&w, &[10, 20, 1]));
    assert_eq!(v1::JobSpec::decode(dropped.as_slice()).unwrap(), q);
    assert!(has(&w, &[10, 20, 1]) && !has(&without(&w, &[10, 20, 1]), &[10, 20, 1]));
}
