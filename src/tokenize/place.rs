//! Where `accrue tokenize` writes (issue 37): `--out` is checked before
//! anything is read or written, and the outputs (the token file, the
//! held-out split, tokenizer.json) are written under temporary names beside
//! their destinations and renamed into place only once all were written. A
//! job reading the old files keeps their inodes (a rename never truncates a
//! file another process has mapped), and a failed run leaves the old
//! outputs as they were, together.

#[allow(unused_imports)]
use super::*;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;

/// A file's identity: (device, inode). Two paths to one file (a symlink, a
/// hard link, `a/../a`) have the same.
pub(super) type FileId = (u64, u64);

pub(super) fn file_id(meta: &std::fs::Metadata) -> FileId {
    (meta.dev(), meta.ino())
}

/// The files a run writes.
pub(super) struct Outputs {
    pub(super) eval: PathBuf,
    pub(super) tokenizer: PathBuf,
    /// The source model folder's tokenizer_config.json, copied beside the
    /// tokenizer (`--tokenizer MODEL_DIR`).
    pub(super) tokenizer_config: PathBuf,
    /// The identities of those that exist (an earlier run's).
    existing: Vec<(FileId, PathBuf)>,
}

impl Outputs {
    /// The outputs of `--out out`; refuses an `out` that names a folder (an
    /// existing one, or a path ending in `/`) or `tokenizer.json` (where the
    /// tokenizer goes), and a held-out split or tokenizer.json that would
    /// replace a folder.
    pub(super) fn new(out: &Path) -> Result<Outputs> {
        let bad = |why: &'static str| TokenizeError::BadOut {
            path: out.to_path_buf(),
            why,
        };
        let folder = "names a folder; name the token file to write, e.g. DIR/train.bin";
        if out.as_os_str().as_bytes().ends_with(b"/") || out.file_name().is_none() {
            return Err(bad(folder));
        }
        if out.is_dir() {
            return Err(bad(folder));
        }
        if out.file_name().is_some_and(|n| n == "tokenizer.json") {
            return Err(bad(
                "is where the tokenizer is written (tokenizer.json beside the output); name the \
                 token file, e.g. DIR/train.bin",
            ));
        }
        let (eval, tokenizer) = (eval_path(out), tokenizer_path(out));
        let tokenizer_config = out.with_file_name("tokenizer_config.json");
        // A folder in the way would fail the renames half-way.
        if let Some(p) = [&eval, &tokenizer, &tokenizer_config]
            .into_iter()
            .find(|p| p.is_dir())
        {
            return Err(TokenizeError::Output {
                path: p.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::IsADirectory, "is a folder"),
            });
        }
        let existing = [out, &eval, &tokenizer, &tokenizer_config]
            .into_iter()
            .filter_map(|p| Some((file_id(&std::fs::metadata(p).ok()?), p.to_path_buf())))
            .collect();
        Ok(Outputs {
            eval,
            tokenizer,
            tokenizer_config,
            existing,
        })
    }

    /// The output that `id` is (of those that existed at [`Outputs::new`]).
    pub(super) fn find(&self, id: FileId) -> Option<&Path> {
        self.existing
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, p)| p.as_path())
    }
}

/// Whether the file at `path` holds a NUL byte in its first KB: a token
/// file (llm.c's header, safetensors' length) does, text never does (a
/// NUL makes a file no document). Unreadable: false.
pub(super) fn looks_binary(path: &Path) -> bool {
    use std::io::Read;
    let mut head = Vec::with_capacity(1024);
    std::fs::File::open(path)
        .and_then(|f| f.take(1024).read_to_end(&mut head))
        .is_ok_and(|_| head.contains(&0))
}

/// Files written under temporary names (`.<name>.tmp-<pid>` in the
/// destination's folder), renamed into place, in the order written, by
/// [`Staged::commit`]. Dropped before that, the temporaries are removed.
#[derive(Default)]
pub(super) struct Staged {
    /// (temporary, destination), in the order written.
    files: Vec<(PathBuf, PathBuf)>,
}

impl Staged {
    /// Writes `bytes` for `dest` under a temporary name (synced to disk).
    pub(super) fn write(&mut self, dest: &Path, bytes: &[u8]) -> Result<()> {
        let err = |source| TokenizeError::Output {
            path: dest.to_path_buf(),
            source,
        };
        if let Some(dir) = dest.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let name = dest
            .file_name()
            .expect("Outputs::new refused a path without a file name");
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".tmp-{}", std::process::id()));
        let tmp = dest.with_file_name(tmp_name);
        // Recorded first: a failed write is removed too.
        self.files.push((tmp.clone(), dest.to_path_buf()));
        let mut f = std::fs::File::create(&tmp).map_err(err)?;
        f.write_all(bytes).map_err(err)?;
        f.sync_all().map_err(err)
    }

    /// Renames every temporary onto its destination, in the order written.
    /// On a failure the temporaries not yet renamed are removed.
    pub(super) fn commit(mut self) -> Result<()> {
        while !self.files.is_empty() {
            let (tmp, dest) = self.files.remove(0);
            if let Err(source) = std::fs::rename(&tmp, &dest) {
                let _ = std::fs::remove_file(&tmp);
                return Err(TokenizeError::Output { path: dest, source });
            }
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for (tmp, _) in &self.files {
            let _ = std::fs::remove_file(tmp);
        }
    }
}
