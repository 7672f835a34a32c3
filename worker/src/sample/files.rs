//! Reading a step folder for sampling: its files read once into memory
//! (training may prune the folder right after), a checkpoint folder read
//! as training recovers ([`checkpoint::choose`]), the config and the
//! tokenizer parsed.

#[allow(unused_imports)]
use super::*;

/// What sampling reads from a step folder, read once into memory:
/// training may prune the folder right after.
#[derive(Clone, Debug)]
pub struct StepFiles {
    /// The step folder they come from.
    pub dir: PathBuf,
    pub config: Vec<u8>,
    /// model.safetensors, or the shards a transformers folder's index
    /// names.
    pub weights: Vec<WeightBytes>,
    /// None: the folder has no tokenizer.json.
    pub tokenizer: Option<Vec<u8>>,
    /// Set when a checkpoint folder's LATEST step was not taken: why.
    pub fallback: Option<String>,
}

/// One weight file's contents.
#[derive(Clone, Debug)]
pub struct WeightBytes {
    pub path: PathBuf,
    /// The tensors a shard's index maps to it (None: whatever it holds).
    pub expected: Option<Vec<String>>,
    pub bytes: Vec<u8>,
}

/// The weight files of `path` (a file, or a folder: model.safetensors or
/// the shards its index names), read.
pub fn read_weights(path: &Path) -> Result<Vec<WeightBytes>> {
    let files = checkpoint::shards::weight_files(path).map_err(|reason| SampleError::Weights {
        path: path.to_path_buf(),
        reason,
    })?;
    files
        .into_iter()
        .map(|(file, expected)| {
            let bytes = std::fs::read(&file).map_err(|e| SampleError::Weights {
                path: file.clone(),
                reason: if e.kind() == std::io::ErrorKind::NotFound {
                    "no such file".into()
                } else {
                    format!("cannot read it: {e}")
                },
            })?;
            Ok(WeightBytes {
                path: file,
                expected,
                bytes,
            })
        })
        .collect()
}

/// The files of the step folder `path` names: itself when it holds
/// `model.safetensors` (or a transformers index and its shards), else (a checkpoint folder) the step training would
/// recover from, verified against its manifest (see the module
/// documentation).
pub fn read_step_files(path: &Path) -> Result<StepFiles> {
    if !path.is_dir() {
        return Err(SampleError::NotAFolder {
            path: path.to_path_buf(),
        });
    }
    if checkpoint::shards::is_weights_folder(path) {
        return read_plain(path);
    }
    read_newest(path)
}

/// The files of a step folder named directly (a manifest is not needed:
/// transformers' `save_pretrained` writes none).
fn read_plain(dir: &Path) -> Result<StepFiles> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|e| (path, e))
    };
    let config = read(CONFIG_FILE).map_err(|(path, e)| SampleError::Config {
        path,
        reason: format!("cannot read it: {e}"),
    })?;
    let weights = read_weights(dir)?;
    let tokenizer = match read(TOKENIZER_FILE) {
        Ok(bytes) => Some(bytes),
        Err((_, e)) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err((path, e)) => {
            return Err(SampleError::Tokenizer {
                path,
                reason: format!("cannot read it: {e}"),
            })
        }
    };
    Ok(StepFiles {
        dir: dir.to_path_buf(),
        config,
        weights,
        tokenizer,
        fallback: None,
    })
}

/// The files of step `step` of checkpoint folder `dir` that sampling
/// uses, each checked against the step's manifest. The error is one line.
fn read_verified(dir: &Path, step: u64) -> std::result::Result<StepFiles, String> {
    let folder = dir.join(checkpoint::step_name(step));
    if !folder.is_dir() {
        return Err("no such folder".into());
    }
    let mut files = manifest::read_verified_only(&folder, step, |name| {
        [CONFIG_FILE, TOKENIZER_FILE].contains(&name) || checkpoint::shards::is_model_file(name)
    })?;
    let weights = checkpoint::shards::take_model_files(&mut files)?
        .into_iter()
        .map(|(name, expected, bytes)| WeightBytes {
            path: folder.join(name),
            expected,
            bytes,
        })
        .collect();
    let mut take = |name: &str| {
        files
            .remove(name)
            .ok_or_else(|| format!("{} lists no {name}", manifest::MANIFEST_FILE))
    };
    Ok(StepFiles {
        config: take(CONFIG_FILE)?,
        weights,
        tokenizer: take(TOKENIZER_FILE).ok(),
        dir: folder,
        fallback: None,
    })
}

/// The step of checkpoint folder `dir` that training would recover from
/// ([`checkpoint::choose`]), its files read and verified. When LATEST's
/// step does not read and the folder changed meanwhile (LATEST or the step
/// folders: training wrote a step and pruned the one LATEST named), it is
/// read again, up to [`TRIES`] times.
fn read_newest(dir: &Path) -> Result<StepFiles> {
    let mut tries = 0;
    loop {
        tries += 1;
        let latest = checkpoint::latest_name(dir);
        let steps = checkpoint::list_steps(dir)?;
        let mut read: Option<(u64, StepFiles)> = None;
        let choice = checkpoint::choose(&latest, &steps, |s| {
            read = Some((s, read_verified(dir, s)?));
            Ok(())
        });
        // Anything but LATEST's step: look again if the folder changed.
        let fell_back = !matches!(
            choice,
            Choice::Take {
                fell_back: false,
                ..
            }
        );
        if fell_back && tries < TRIES {
            let changed =
                checkpoint::latest_name(dir) != latest || checkpoint::list_steps(dir)? != steps;
            if changed {
                continue;
            }
        }
        return match choice {
            Choice::Take {
                step,
                skipped,
                fell_back,
            } => {
                let mut files = match read {
                    Some((s, files)) if s == step => files,
                    // choose() stops at the first step that verifies,
                    // the last one read; read again only if that changes.
                    _ => {
                        read_verified(dir, step).map_err(|reason| SampleError::NoReadableStep {
                            dir: dir.to_path_buf(),
                            reason: format!("step-{step}: {reason}"),
                        })?
                    }
                };
                if fell_back {
                    let latest_text = match &latest {
                        Ok(Some(n)) => format!("LATEST names step-{n}, which does not verify"),
                        Ok(None) => format!("no {LATEST}"),
                        Err(e) => format!("{LATEST} unreadable ({e})"),
                    };
                    let skipped = if skipped.is_empty() {
                        String::new()
                    } else {
                        format!(" (skipped {})", checkpoint::list_skipped(&skipped))
                    };
                    files.fallback = Some(format!(
                        "{latest_text}; the newest step that verifies{skipped}"
                    ));
                }
                Ok(files)
            }
            Choice::NoneReadable { latest, skipped } => Err(SampleError::NoReadableStep {
                dir: dir.to_path_buf(),
                reason: format!(
                    "{latest}; {}",
                    if skipped.is_empty() {
                        "no step folders".to_string()
                    } else {
                        checkpoint::list_skipped(&skipped)
                    }
                ),
            }),
            Choice::Nothing => Err(SampleError::NoStep {
                dir: dir.to_path_buf(),
            }),
        };
    }
}

/// The configuration in `step_dir`'s config.json.
pub fn load_config(step_dir: &Path) -> Result<LlamaConfig> {
    let path = step_dir.join(CONFIG_FILE);
    let bytes = std::fs::read(&path).map_err(|e| SampleError::Config {
        path: path.clone(),
        reason: format!("cannot read it: {e}"),
    })?;
    parse_config(&bytes, &path)
}

/// The configuration in the config.json `bytes` (`path` names them in
/// errors).
pub fn parse_config(bytes: &[u8], path: &Path) -> Result<LlamaConfig> {
    let err = |reason: String| SampleError::Config {
        path: path.to_path_buf(),
        reason,
    };
    let json: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| err(format!("not valid JSON: {e}")))?;
    LlamaConfig::from_hf_json(&json).map_err(|e| {
        let reasons: Vec<String> =
            e.0.iter()
                .map(|f| {
                    let field = f.field.strip_prefix("model.").unwrap_or(&f.field);
                    if f.value == "\"(missing)\"" || f.value == "(missing)" {
                        format!("{field} is missing")
                    } else if field == "config" {
                        f.allowed.clone()
                    } else {
                        format!("{field} = {}: {}", f.value, f.allowed)
                    }
                })
                .collect();
        err(reasons.join("; "))
    })
}

/// The tokenizer and its path: `explicit`, else the step folder's
/// tokenizer.json.
pub fn load_tokenizer(files: &StepFiles, explicit: Option<&Path>) -> Result<(Tokenizer, PathBuf)> {
    let Some(path) = explicit else {
        let path = files.dir.join(TOKENIZER_FILE);
        let Some(bytes) = &files.tokenizer else {
            return Err(SampleError::NoTokenizer {
                dir: files.dir.clone(),
            });
        };
        return match Tokenizer::from_bytes(bytes) {
            Ok(t) => Ok((t, path)),
            Err(e) => Err(SampleError::Tokenizer {
                reason: format!("cannot load it: {e}"),
                path,
            }),
        };
    };
    let path = path.to_path_buf();
    if !path.is_file() {
        return Err(SampleError::Tokenizer {
            path,
            reason: "no such file (--tokenizer)".into(),
        });
    }
    match Tokenizer::from_file(&path) {
        Ok(t) => Ok((t, path)),
        Err(e) => Err(SampleError::Tokenizer {
            reason: format!("cannot load it: {e}"),
            path,
        }),
    }
}

/// The token ids in `0..vocab_size` that `tokenizer` has no token for.
pub fn unknown_ids(tokenizer: &Tokenizer, vocab_size: i64) -> Vec<i64> {
    (0..vocab_size)
        .filter(|&id| {
            u32::try_from(id)
                .ok()
                .and_then(|id| tokenizer.id_to_token(id))
                .is_none()
        })
        .collect()
}
