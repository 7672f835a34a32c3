//! Chat rows (issue 39): JSON lines with `messages` (`role`, `content`)
//! rendered with the tokenizer's chat template, the assistant turns'
//! tokens predicted (loss mask 1) and every other token masked, as
//! transformers' `apply_chat_template(..., tokenize=True,
//! return_assistant_tokens_mask=True)` gives them.
//!
//! - The template is the model folder's (`--tokenizer MODEL_DIR`):
//!   `chat_template.jinja`, else `tokenizer_config.json`'s
//!   `chat_template` (a string, or a list of named ones: "default").
//! - It is rendered by minijinja as transformers renders it with Jinja:
//!   `trim_blocks` and `lstrip_blocks`, loop controls, Python's string
//!   methods, `raise_exception`, `strftime_now`, a `tojson` without HTML
//!   escaping, and the tokenizer's special tokens as variables.
//! - With `{% generation %}` ... `{% endgeneration %}` in the template, the
//!   assistant text is what those blocks render (each marker becomes a
//!   private-use character that is taken out after rendering, the block
//!   tags kept so that trimming is Jinja's). Without them, each assistant
//!   turn is what rendering up to it adds to rendering the turns before it
//!   with the generation prompt (the template must render turn by turn as
//!   prefixes; one that does not is refused naming the row).
//! - The rendered text is tokenized without special tokens added, and a
//!   token is predicted when it lies from the token holding a span's first
//!   character to the one holding its last (transformers' `char_to_token`
//!   rule, its end-of-text quirk included).

use super::{Result, TokenizeError};
use accrue_common::small_file::{read_small, MAX_CONFIG_BYTES};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde::Serialize;
use serde_json::Value as Json;
use std::path::Path;
use tokenizers::Tokenizer;

/// The work one rendering of a chat template may do, in minijinja's fuel
/// (one per instruction, and one per 64 bytes of data it builds or
/// writes, checked before a large allocation): about a million
/// instructions or 64 MB of strings and lists. Real templates over long
/// chats need a small part of it; one that loops for ever or builds huge
/// strings stops within about a second, naming the row.
const TEMPLATE_FUEL: u64 = 1_000_000;

/// The most text one rendering may produce.
const MAX_RENDERED_BYTES: usize = 16 << 20;

/// A rendering's output, refused past [`MAX_RENDERED_BYTES`].
struct Capped {
    bytes: Vec<u8>,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_RENDERED_BYTES {
            self.over = true;
            return Err(std::io::Error::other("the rendered text is too long"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What opens and closes a generation block once rendered.
const START: char = '\u{E000}';
const END: char = '\u{E001}';

/// A chat template, compiled, with the special tokens it may use.
pub(super) struct ChatTemplate {
    env: Environment<'static>,
    specials: Vec<(String, Json)>,
    /// Whether it marks assistant text with generation blocks.
    markers: bool,
}

/// A row's tokens and, per token, whether it is predicted.
pub(super) type Row = (Vec<u32>, Vec<u8>);

/// Checks a row's `messages`: a non-empty array of objects with string
/// `role` and `content`.
pub(super) fn check_messages(m: &Json) -> std::result::Result<(), String> {
    let list = m
        .as_array()
        .filter(|l| !l.is_empty())
        .ok_or("`messages` must be a non-empty array of {role, content} objects")?;
    for (i, msg) in list.iter().enumerate() {
        for key in ["role", "content"] {
            if !msg.get(key).is_some_and(Json::is_string) {
                return Err(format!("messages[{i}] has no string `{key}`"));
            }
        }
    }
    Ok(())
}

impl ChatTemplate {
    /// The chat template of the model folder `dir`.
    pub(super) fn load(dir: Option<&Path>) -> Result<ChatTemplate> {
        let missing = |why: String| TokenizeError::ChatTemplate { why };
        let Some(dir) = dir.filter(|d| d.is_dir()) else {
            return Err(missing(
                "chat rows (`messages`) need a chat template: pass --tokenizer MODEL_DIR, a \
                 folder with chat_template.jinja or a tokenizer_config.json with chat_template"
                    .into(),
            ));
        };
        // Both read as the workers read a model's files: regular files
        // within 4 MiB, so a FIFO or a device fails naming it at once.
        let config_path = dir.join("tokenizer_config.json");
        let config: Json = match read_small(&config_path, MAX_CONFIG_BYTES, "tokenizer_config.json")
        {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| missing(format!("{}: not JSON ({e})", config_path.display())))?,
            Err(e) if e.is_not_found() => Json::Null,
            Err(e) => return Err(missing(e.to_string())),
        };
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.exists() {
            let bytes = read_small(&jinja, MAX_CONFIG_BYTES, "chat_template.jinja")
                .map_err(|e| missing(e.to_string()))?;
            String::from_utf8(bytes)
                .map_err(|_| missing(format!("{}: is not UTF-8 text", jinja.display())))?
        } else {
            match config.get("chat_template") {
                Some(Json::String(s)) => s.clone(),
                Some(Json::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str())
                    .map(str::to_string)
                    .ok_or_else(|| {
                        missing(format!(
                            "{}: chat_template lists no template named \"default\"",
                            config_path.display()
                        ))
                    })?,
                _ => {
                    return Err(missing(format!(
                        "chat rows (`messages`) need a chat template: {} has neither \
                         chat_template.jinja nor a chat_template in tokenizer_config.json",
                        dir.display()
                    )))
                }
            }
        };
        Self::new(&source, &config)
    }

    /// Compiles `source`; `config` (a tokenizer_config.json) gives the
    /// special tokens.
    pub(super) fn new(source: &str, config: &Json) -> Result<ChatTemplate> {
        let (rewritten, markers) = rewrite_generation(source);
        let mut env = Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| TokenizeError::ChatTemplate {
                    why: format!("configuring the template engine: {e}"),
                })?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |format: String| chrono_free_date(&format));
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", rewritten)
            .map_err(|e| TokenizeError::ChatTemplate {
                why: format!("the chat template does not compile: {e}"),
            })?;
        let specials = ["bos_token", "eos_token", "pad_token", "unk_token"]
            .into_iter()
            .filter_map(|k| {
                let v = config.get(k)?;
                let s = match v {
                    Json::String(s) => s.clone(),
                    Json::Object(o) => o.get("content")?.as_str()?.to_string(),
                    _ => return None,
                };
                Some((k.to_string(), Json::String(s)))
            })
            .collect();
        Ok(ChatTemplate {
            env,
            specials,
            markers,
        })
    }

    fn render(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, String> {
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        for (k, v) in &self.specials {
            ctx.insert(k.clone(), v.clone());
        }
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        let mut out = Capped {
            bytes: Vec::new(),
            over: false,
        };
        let ctx = Value::from(minijinja::value::Serde(Json::Object(ctx)));
        match t.render_captured_to(ctx, &mut out) {
            Ok(_) => {}
            Err(_) if out.over => {
                return Err(format!(
                    "the chat template renders more than {} MiB for this row, the limit",
                    MAX_RENDERED_BYTES >> 20
                ))
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                return Err(format!(
                    "the chat template needs more than its budget of {TEMPLATE_FUEL} steps \
                     for this row (a loop too long, or strings too large)"
                ))
            }
            Err(e) => return Err(format!("the chat template fails on this row: {e}")),
        }
        // minijinja writes whole UTF-8 strings; a cut never lands inside one.
        String::from_utf8(out.bytes)
            .map_err(|_| "the chat template's output is not UTF-8 text".to_string())
    }

    /// The row's text and its assistant spans, in characters.
    fn spans(
        &self,
        messages: &[Json],
    ) -> std::result::Result<(String, Vec<(usize, usize)>), String> {
        for m in messages {
            let content = m.get("content").and_then(Json::as_str).unwrap_or("");
            if content.contains([START, END]) {
                return Err(
                    "a message holds U+E000 or U+E001, which mark generation blocks".into(),
                );
            }
        }
        if self.markers {
            let rendered = self.render(messages, false)?;
            let (mut text, mut spans, mut open) = (String::new(), Vec::new(), None);
            let mut n = 0;
            for c in rendered.chars() {
                match c {
                    START => open = Some(n),
                    END => {
                        if let Some(s) = open.take() {
                            spans.push((s, n));
                        }
                    }
                    c => {
                        text.push(c);
                        n += 1;
                    }
                }
            }
            return Ok((text, spans));
        }
        let full = self.render(messages, false)?;
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m.get("role").and_then(Json::as_str) != Some("assistant") {
                continue;
            }
            let before = self.render(&messages[..i], true)?;
            let upto = self.render(&messages[..=i], false)?;
            if !upto.starts_with(&before) || !full.starts_with(&upto) {
                return Err(format!(
                    "the chat template does not render turn by turn as prefixes (message {i}), \
                     so its assistant text cannot be found: use a template with \
                     {{% generation %}} blocks"
                ));
            }
            spans.push((before.chars().count(), upto.chars().count()));
        }
        Ok((full, spans))
    }

    /// The tokens of `messages` and which are predicted.
    pub(super) fn row(&self, tk: &Tokenizer, messages: &Json) -> std::result::Result<Row, String> {
        let list = messages.as_array().map(Vec::as_slice).unwrap_or_default();
        let (text, spans) = self.spans(list)?;
        let enc = tk
            .encode_char_offsets(text.as_str(), false)
            .map_err(|e| format!("tokenizing the rendered chat: {e}"))?;
        let ids = enc.get_ids().to_vec();
        let mut mask = vec![0u8; ids.len()];
        for (start, end) in spans {
            if end <= start {
                continue;
            }
            // transformers: char_to_token of the first and the last
            // character; a span whose start holds no token is skipped, and
            // an end token of None (or 0) reaches the row's end.
            let Some(first) = enc.char_to_token(start, 0) else {
                continue;
            };
            let last = match enc.char_to_token(end - 1, 0) {
                Some(t) if t != 0 => t + 1,
                _ => ids.len(),
            };
            for m in mask.iter_mut().take(last).skip(first) {
                *m = 1;
            }
        }
        Ok((ids, mask))
    }
}

/// `{% generation %}` and `{% endgeneration %}` (with their whitespace
/// control) as block tags that keep Jinja's trimming around a marker
/// character; whether the template had any.
fn rewrite_generation(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let Some(close) = after.find("%}") else {
            out.push_str(&rest[i..]);
            return (out, found);
        };
        let inner = &after[..close];
        let left = inner.starts_with('-');
        let right = inner.ends_with('-');
        let word = inner.trim_start_matches('-').trim_end_matches('-').trim();
        let (l, r) = (if left { "-" } else { "" }, if right { "-" } else { "" });
        match word {
            "generation" => {
                found = true;
                out.push_str(&format!(
                    "{{%{l} if true %}}{{{{ \"{START}\" }}}}{{% if true {r}%}}"
                ));
            }
            "endgeneration" => {
                found = true;
                out.push_str(&format!(
                    "{{%{l} endif %}}{{{{ \"{END}\" }}}}{{% endif {r}%}}"
                ));
            }
            _ => out.push_str(&rest[i..i + 2 + close + 2]),
        }
        rest = &after[close + 2..];
    }
    out.push_str(rest);
    (out, found)
}

/// transformers' `tojson`: JSON without HTML escaping, `indent` spaces.
fn tojson(value: Value, indent: Option<usize>) -> std::result::Result<Value, JinjaError> {
    let json: Json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let text = match indent {
        None => serde_json::to_string(&json),
        Some(n) => {
            let pad = " ".repeat(n);
            let mut buf = Vec::new();
            let fmt = serde_json::ser::PrettyFormatter::with_indent(pad.as_bytes());
            let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
            json.serialize(&mut ser)
                .map(|_| String::from_utf8_lossy(&buf).into_owned())
        }
    }
    .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(text))
}

/// `strftime_now(format)`: today's date (UTC) for the formats chat
/// templates use (`%d`, `%b`, `%B`, `%Y`, `%m`, `%-d`).
fn chrono_free_date(format: &str) -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() / 86_400)
        .unwrap_or(0) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(month - 1) as usize];
    format
        .replace("%-d", &day.to_string())
        .replace("%d", &format!("{day:02}"))
        .replace("%B", name)
        .replace("%b", &name[..3])
        .replace("%m", &format!("{month:02}"))
        .replace("%Y", &year.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_markers_inside_block_tags() {
        let (s, found) =
            rewrite_generation("a{%- generation %}b{% endgeneration -%}c{% if x %}{% endif %}");
        assert!(found);
        assert_eq!(
            s,
            "a{%- if true %}{{ \"\u{E000}\" }}{% if true %}b{% endif %}{{ \"\u{E001}\" }}{% endif -%}c{% if x %}{% endif %}"
        );
        assert!(!rewrite_generation("{% for m in messages %}{% endfor %}").1);
    }

    #[test]
    fn messages_are_checked() {
        assert!(check_messages(&serde_json::json!([{"role": "user", "content": "hi"}])).is_ok());
        assert!(check_messages(&serde_json::json!([]))
            .unwrap_err()
            .contains("non-empty"));
        assert!(check_messages(&serde_json::json!([{"role": "user"}]))
            .unwrap_err()
            .contains("messages[0] has no string `content`"));
    }

    #[test]
    fn the_date_is_a_civil_date() {
        let d = chrono_free_date("%Y-%m-%d %b");
        assert_eq!(d.len(), 14, "{d}");
        assert!(d.starts_with("20"), "{d}");
    }
}
