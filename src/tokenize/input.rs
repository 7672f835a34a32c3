//! The inputs: text files, folders (recursive, sorted) and JSON lines
//! (documents from a `text` field, or prompt/completion pairs).

#[allow(unused_imports)]
use super::*;

/// A row of `--format sequences`.
pub(super) enum Pair {
    /// `prompt` and `completion`: the completion and the end-of-text
    /// token predicted.
    Completion { prompt: String, completion: String },
    /// `messages` (issue 39): rendered with the tokenizer's chat template,
    /// the assistant turns predicted (src/tokenize/chat.rs).
    Chat {
        messages: serde_json::Value,
        path: PathBuf,
        line: usize,
    },
}

impl Pair {
    /// Its texts (a BPE trains on them; the progress bar counts them).
    fn texts(&self) -> Vec<&str> {
        match self {
            Pair::Completion { prompt, completion } => vec![prompt, completion],
            Pair::Chat { messages, .. } => messages
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m.get("content")?.as_str())
                .collect(),
        }
    }
}

pub(super) enum Input {
    Docs(Vec<String>),
    Pairs(Vec<Pair>),
}

impl Input {
    pub(super) fn is_empty(&self) -> bool {
        match self {
            Input::Docs(d) => d.is_empty(),
            Input::Pairs(p) => p.is_empty(),
        }
    }

    pub(super) fn bytes(&self) -> usize {
        match self {
            Input::Docs(d) => d.iter().map(String::len).sum(),
            Input::Pairs(p) => p.iter().flat_map(Pair::texts).map(str::len).sum(),
        }
    }

    /// The texts a BPE is trained on, cut where byte-level pre-tokens
    /// never cross.
    pub(super) fn texts(&self) -> Vec<&str> {
        match self {
            Input::Docs(d) => d.iter().flat_map(|d| chunks(d)).collect(),
            Input::Pairs(p) => p
                .iter()
                .flat_map(Pair::texts)
                .filter(|s| !s.is_empty())
                .collect(),
        }
    }
}

/// An input file: `named` when given on the command line (then it must be
/// usable), else found in a folder (then a non-text file is skipped).
pub(super) struct InputFile {
    pub(super) path: PathBuf,
    pub(super) named: bool,
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TokenizeError {
    let path = path.to_path_buf();
    move |source| TokenizeError::Input { path, source }
}

pub(super) fn is_jsonl(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "jsonl")
}

/// A Parquet file (what the Hub stores datasets as).
pub(super) fn is_parquet(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "parquet")
}

/// An Arrow IPC stream file (`datasets.save_to_disk`'s `data-*.arrow`).
pub(super) fn is_arrow(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "arrow")
}

/// Files that hold records (rows) rather than one text.
pub(super) fn is_records(p: &Path) -> bool {
    is_jsonl(p) || is_parquet(p) || is_arrow(p)
}

/// A folder `datasets.save_to_disk` wrote: its `state.json` and
/// `dataset_info.json` describe the `.arrow` files beside them, which are
/// the data (the JSON files are not documents).
fn is_saved_dataset(dir: &Path) -> bool {
    dir.join("state.json").is_file() && dir.join("dataset_info.json").is_file()
}

/// The string columns `names` of every row of an Arrow IPC stream file,
/// in order; as [`parquet_column`] for a missing column, a null or
/// another type.
pub(super) fn arrow_column(path: &Path, names: &[&str]) -> Result<Vec<Vec<String>>> {
    use arrow_array::{Array, LargeStringArray, StringArray};
    let bad = |what: String| TokenizeError::Parquet {
        path: path.to_path_buf(),
        what,
    };
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    let reader = arrow_ipc::reader::StreamReader::try_new(std::io::BufReader::new(file), None)
        .map_err(|e| bad(format!("not an Arrow IPC stream ({e})")))?;
    let schema = reader.schema();
    for n in names {
        if schema.column_with_name(n).is_none() {
            let have: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            return Err(bad(format!("no column `{n}` (it has {})", have.join(", "))));
        }
    }
    let mut out: Vec<Vec<String>> = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| bad(format!("unreadable record batch ({e})")))?;
        let first = out.len();
        out.extend((0..batch.num_rows()).map(|_| Vec::with_capacity(names.len())));
        for n in names {
            let col = batch
                .column_by_name(n)
                .ok_or_else(|| bad(format!("no column `{n}` in a record batch")))?;
            let value = |i: usize| -> Option<String> {
                if col.is_null(i) {
                    return None;
                }
                if let Some(s) = col.as_any().downcast_ref::<StringArray>() {
                    return Some(s.value(i).to_string());
                }
                col.as_any()
                    .downcast_ref::<LargeStringArray>()
                    .map(|s| s.value(i).to_string())
            };
            for i in 0..batch.num_rows() {
                let row = first + i + 1;
                match value(i) {
                    Some(v) => out[first + i].push(v),
                    None if col.is_null(i) => {
                        return Err(TokenizeError::ParquetRow {
                            path: path.to_path_buf(),
                            row,
                            what: format!("`{n}` is null"),
                        })
                    }
                    None => {
                        return Err(TokenizeError::ParquetRow {
                            path: path.to_path_buf(),
                            row,
                            what: format!("`{n}` is not a string ({})", col.data_type()),
                        })
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The string columns of a Parquet or Arrow file.
fn table_column(path: &Path, names: &[&str]) -> Result<Vec<Vec<String>>> {
    if is_arrow(path) {
        arrow_column(path, names)
    } else {
        parquet_column(path, names)
    }
}

/// The string column `name` of every row of a Parquet file, in order.
/// A missing column names the ones there; a null or non-string value
/// names its row (1-based, as JSON lines' lines are).
pub(super) fn parquet_column(path: &Path, names: &[&str]) -> Result<Vec<Vec<String>>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let bad = |row: usize, what: String| TokenizeError::ParquetRow {
        path: path.to_path_buf(),
        row,
        what,
    };
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    let reader = SerializedFileReader::new(file).map_err(|e| TokenizeError::Parquet {
        path: path.to_path_buf(),
        what: e.to_string(),
    })?;
    let columns: Vec<String> = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .columns()
        .iter()
        .map(|c| c.path().string())
        .collect();
    for n in names {
        if !columns.iter().any(|c| c == n) {
            return Err(TokenizeError::Parquet {
                path: path.to_path_buf(),
                what: format!("no column `{n}` (it has {})", columns.join(", ")),
            });
        }
    }
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| TokenizeError::Parquet {
            path: path.to_path_buf(),
            what: e.to_string(),
        })?;
    let mut out = Vec::new();
    for (i, row) in rows.enumerate() {
        let row = row.map_err(|e| bad(i + 1, format!("unreadable row: {e}")))?;
        let mut values = Vec::with_capacity(names.len());
        for n in names {
            let field = row.get_column_iter().find(|(c, _)| c == n).map(|(_, f)| f);
            match field {
                Some(Field::Str(s)) => values.push(s.clone()),
                Some(Field::Null) | None => return Err(bad(i + 1, format!("`{n}` is null"))),
                Some(other) => return Err(bad(i + 1, format!("`{n}` is not a string ({other})"))),
            }
        }
        out.push(values);
    }
    Ok(out)
}

/// The files to read, in order, and those left out.
#[derive(Default)]
pub(super) struct Collected {
    pub(super) files: Vec<InputFile>,
    /// Files under the given folders that are this run's outputs (a rerun
    /// on a folder that holds them).
    pub(super) outputs: Vec<PathBuf>,
    /// Files and folders reached again (a symlink, the same input twice, a
    /// folder inside another given one): read once.
    pub(super) repeated: Vec<PathBuf>,
}

/// The files to read, in order: each file once (by identity, whatever the
/// path it is reached by), each folder walked once (a symlink to a folder
/// already walked, a loop included, is not followed again), this run's
/// outputs never: an earlier run's in a folder are left out, a file named
/// on the command line that is an output is refused, and so is a text
/// file in a folder that `--out` or its split would overwrite.
pub(super) fn collect_inputs(
    inputs: &[PathBuf],
    format: Format,
    outputs: &Outputs,
) -> Result<Collected> {
    let mut walk = Walk {
        format,
        outputs,
        files: HashSet::new(),
        dirs: HashSet::new(),
        found: Collected::default(),
    };
    for input in inputs {
        let meta = std::fs::metadata(input).map_err(io_err(input))?;
        if meta.is_dir() {
            walk.dir(input, file_id(&meta))?;
            continue;
        }
        if format == Format::Sequences && !is_records(input) {
            return Err(TokenizeError::NotJsonLines {
                path: input.clone(),
            });
        }
        if let Some(output) = outputs.find(file_id(&meta)) {
            return Err(TokenizeError::InputIsOutput {
                input: input.clone(),
                output: output.to_path_buf(),
            });
        }
        walk.file(input, file_id(&meta), true);
    }
    Ok(walk.found)
}

struct Walk<'a> {
    format: Format,
    outputs: &'a Outputs,
    /// The files and the folders met so far.
    files: HashSet<FileId>,
    dirs: HashSet<FileId>,
    found: Collected,
}

impl Walk<'_> {
    fn file(&mut self, path: &Path, id: FileId, named: bool) {
        if self.files.insert(id) {
            self.found.files.push(InputFile {
                path: path.to_path_buf(),
                named,
            });
        } else {
            self.found.repeated.push(path.to_path_buf());
        }
    }

    /// Every regular file under `dir`, in sorted order, hidden entries left
    /// out.
    fn dir(&mut self, dir: &Path, id: FileId) -> Result<()> {
        if !self.dirs.insert(id) {
            self.found.repeated.push(dir.to_path_buf());
            return Ok(());
        }
        let mut entries = std::fs::read_dir(dir)
            .map_err(io_err(dir))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(io_err(dir))?;
        // Name by name at each level: the order of sorting the whole paths.
        entries.sort();
        // A saved `datasets` folder: its Arrow files are the data.
        let saved = is_saved_dataset(dir);
        for name in entries {
            if saved && !is_arrow(Path::new(&name)) {
                continue;
            }
            if name.to_string_lossy().starts_with('.') {
                continue;
            }
            let path = dir.join(name);
            let meta = std::fs::metadata(&path).map_err(io_err(&path))?;
            let id = file_id(&meta);
            if meta.is_dir() {
                self.dir(&path, id)?;
            } else if meta.is_file() && (self.format == Format::Tokens || is_records(&path)) {
                match self.outputs.find(id) {
                    // An earlier run's token file or split is binary; a
                    // text file there is an input --out would overwrite.
                    Some(output)
                        if output != self.outputs.tokenizer
                            && output != self.outputs.tokenizer_config
                            && !looks_binary(&path) =>
                    {
                        return Err(TokenizeError::InputIsOutput {
                            input: path,
                            output: output.to_path_buf(),
                        })
                    }
                    Some(_) => self.found.outputs.push(path),
                    None => self.file(&path, id, false),
                }
            }
        }
        Ok(())
    }
}

/// A file's text, or None for a folder's file that is not UTF-8 text (a
/// named one is an error).
pub(super) fn read_text(f: &InputFile) -> Result<Option<String>> {
    let bytes = std::fs::read(&f.path).map_err(io_err(&f.path))?;
    match String::from_utf8(bytes) {
        Ok(s) if !s.contains('\0') => Ok(Some(s)),
        _ if f.named => Err(TokenizeError::NotText {
            path: f.path.clone(),
        }),
        _ => Ok(None),
    }
}

/// The documents of `files`: each text file whole, and each JSON-lines
/// file (.jsonl) one document per line, the string field `field` of the
/// object on it (the `datasets` convention: `{"text": ...}`). Empty texts
/// are left out.
pub(super) fn read_docs(
    files: &[InputFile],
    field: &str,
    skipped: &mut Vec<PathBuf>,
) -> Result<Vec<String>> {
    let mut docs = Vec::new();
    for f in files {
        if is_parquet(&f.path) || is_arrow(&f.path) {
            let rows = table_column(&f.path, &[field])?;
            docs.extend(rows.into_iter().flatten().filter(|d| !d.is_empty()));
            continue;
        }
        match read_text(f)? {
            Some(text) if is_jsonl(&f.path) => json_lines(f, &text, |v, bad, _| {
                let doc = string_field(v, field, bad)?;
                if !doc.is_empty() {
                    docs.push(doc);
                }
                Ok(())
            })?,
            Some(text) if !text.is_empty() => docs.push(text),
            Some(_) => {}
            None => skipped.push(f.path.clone()),
        }
    }
    Ok(docs)
}

/// Calls `each` with every non-blank line's JSON value of `f`'s `text`
/// and a maker of errors naming the line.
fn json_lines(
    f: &InputFile,
    text: &str,
    mut each: impl FnMut(&serde_json::Value, &dyn Fn(String) -> TokenizeError, usize) -> Result<()>,
) -> Result<()> {
    // A UTF-8 byte order mark (Windows editors, Excel exports) opens the
    // file, not the first object: skipped as Python's utf-8-sig.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: String| TokenizeError::JsonLine {
            path: f.path.clone(),
            line: i + 1,
            what,
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        if !v.is_object() {
            return Err(bad("not a JSON object".into()));
        }
        each(&v, &bad, i + 1)?;
    }
    Ok(())
}

/// The string field `name` of the object `v`.
fn string_field(
    v: &serde_json::Value,
    name: &str,
    bad: &dyn Fn(String) -> TokenizeError,
) -> Result<String> {
    match v.get(name) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(bad(format!("`{name}` is not a string"))),
        None => Err(bad(format!("no `{name}` field"))),
    }
}

pub(super) fn read_pairs(files: &[InputFile], skipped: &mut Vec<PathBuf>) -> Result<Vec<Pair>> {
    let mut pairs = Vec::new();
    for f in files {
        if is_parquet(&f.path) || is_arrow(&f.path) {
            for mut row in table_column(&f.path, &["prompt", "completion"])? {
                let completion = row.pop().unwrap_or_default();
                let prompt = row.pop().unwrap_or_default();
                pairs.push(Pair::Completion { prompt, completion });
            }
            continue;
        }
        let Some(text) = read_text(f)? else {
            skipped.push(f.path.clone());
            continue;
        };
        json_lines(f, &text, |v, bad, line| {
            if let Some(messages) = v.get("messages") {
                chat::check_messages(messages).map_err(bad)?;
                pairs.push(Pair::Chat {
                    messages: messages.clone(),
                    path: f.path.clone(),
                    line,
                });
                return Ok(());
            }
            pairs.push(Pair::Completion {
                prompt: string_field(v, "prompt", bad)?,
                completion: string_field(v, "completion", bad)?,
            });
            Ok(())
        })?;
    }
    Ok(pairs)
}
