//! The inputs: text files, folders (recursive, sorted) and JSON lines.

#[allow(unused_imports)]
use super::*;

pub(super) struct Pair {
    pub(super) prompt: String,
    pub(super) completion: String,
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
            Input::Pairs(p) => p.iter().map(|p| p.prompt.len() + p.completion.len()).sum(),
        }
    }

    /// The texts a BPE is trained on, cut where byte-level pre-tokens
    /// never cross.
    pub(super) fn texts(&self) -> Vec<&str> {
        match self {
            Input::Docs(d) => d.iter().flat_map(|d| chunks(d)).collect(),
            Input::Pairs(p) => p
                .iter()
                .flat_map(|p| [p.prompt.as_str(), p.completion.as_str()])
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

/// The files to read, in order.
pub(super) fn collect_inputs(inputs: &[PathBuf], format: Format) -> Result<Vec<InputFile>> {
    let mut files = Vec::new();
    for input in inputs {
        let meta = std::fs::metadata(input).map_err(io_err(input))?;
        if meta.is_dir() {
            let mut found = Vec::new();
            walk(input, &mut found)?;
            found.sort();
            files.extend(
                found
                    .into_iter()
                    .filter(|p| format == Format::Tokens || is_jsonl(p))
                    .map(|path| InputFile { path, named: false }),
            );
        } else {
            if format == Format::Sequences && !is_jsonl(input) {
                return Err(TokenizeError::NotJsonLines {
                    path: input.clone(),
                });
            }
            files.push(InputFile {
                path: input.clone(),
                named: true,
            });
        }
    }
    Ok(files)
}

/// Every regular file under `dir`, hidden entries left out.
pub(super) fn walk(dir: &Path, found: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        let meta = std::fs::metadata(&path).map_err(io_err(&path))?;
        if meta.is_dir() {
            walk(&path, found)?;
        } else if meta.is_file() {
            found.push(path);
        }
    }
    Ok(())
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

pub(super) fn read_docs(files: &[InputFile], skipped: &mut Vec<PathBuf>) -> Result<Vec<String>> {
    let mut docs = Vec::new();
    for f in files {
        match read_text(f)? {
            Some(text) if !text.is_empty() => docs.push(text),
            Some(_) => {}
            None => skipped.push(f.path.clone()),
        }
    }
    Ok(docs)
}

pub(super) fn read_pairs(files: &[InputFile], skipped: &mut Vec<PathBuf>) -> Result<Vec<Pair>> {
    let mut pairs = Vec::new();
    for f in files {
        let Some(text) = read_text(f)? else {
            skipped.push(f.path.clone());
            continue;
        };
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
            let field = |name: &str| match v.get(name) {
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                Some(_) => Err(bad(format!("`{name}` is not a string"))),
                None => Err(bad(format!("no `{name}` field"))),
            };
            pairs.push(Pair {
                prompt: field("prompt")?,
                completion: field("completion")?,
            });
        }
    }
    Ok(pairs)
}
