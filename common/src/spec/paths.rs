//! Confined paths (docs/SECURITY.md): every path field of a spec must lie,
//! after `..` and symlinks, under the root configured for its kind.
//!
//! Two parts:
//! - [`confine_lexically`] is pure: it joins a relative path to its root,
//!   removes `.` and `..` the way a string would (never reading the file
//!   system) and refuses a result outside the root.
//! - a [`View`] then says where that path really lands: [`Lexical`] reads
//!   nothing (the coordinator's view of the workers' files may differ),
//!   [`LocalFs`] canonicalizes the longest prefix that exists here, so a
//!   folder that does not exist yet under a symlinked parent is judged by
//!   where it would really be created.
//!
//! The lexical result is the path to open: `a/link/../b` means `a/b` here,
//! whatever `link` points to, so callers that confine must use the returned
//! path, never the one they were given.

use super::{FieldError, JobSpec, SpecErrors};
use std::path::{Component, Path, PathBuf};

/// The folders spec paths must lie under, one per kind of path. A kind
/// without a root is not confined (today's behaviour).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Roots {
    /// `data.path`, `data.eval_path`.
    pub data: Option<PathBuf>,
    /// `model.path` (TorchScript), `model.init` (initial weights),
    /// `model.config` (a Hugging Face config.json).
    pub model: Option<PathBuf>,
    /// `checkpoint.dir` (and the default checkpoint folder).
    pub checkpoint: Option<PathBuf>,
}

/// The kind of a path field, naming its root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Area {
    Data,
    Model,
    Checkpoint,
}

impl Area {
    /// The flag that sets this kind's root.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Data => "--data-root",
            Self::Model => "--model-root",
            Self::Checkpoint => "--checkpoint-root",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Data => "data",
            Self::Model => "model",
            Self::Checkpoint => "checkpoint",
        }
    }
}

/// A root that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{flag} {}: {reason}", .root.display())]
pub struct RootError {
    pub flag: &'static str,
    pub root: PathBuf,
    pub reason: String,
}

impl Roots {
    pub fn is_empty(&self) -> bool {
        self.data.is_none() && self.model.is_none() && self.checkpoint.is_none()
    }

    pub fn get(&self, area: Area) -> Option<&Path> {
        match area {
            Area::Data => self.data.as_deref(),
            Area::Model => self.model.as_deref(),
            Area::Checkpoint => self.checkpoint.as_deref(),
        }
    }

    /// Every root made absolute (against the current folder) and
    /// lexically normal: what [`confine_lexically`] expects. Roots need not
    /// exist (the coordinator may not see the workers' files).
    pub fn absolute(self) -> Result<Self, RootError> {
        let fix = |area: Area, root: Option<PathBuf>| -> Result<Option<PathBuf>, RootError> {
            let Some(root) = root else { return Ok(None) };
            if root.as_os_str().is_empty() {
                return Err(RootError {
                    flag: area.flag(),
                    root,
                    reason: "must name a folder (it is empty)".into(),
                });
            }
            let abs = std::path::absolute(&root).map_err(|e| RootError {
                flag: area.flag(),
                root: root.clone(),
                reason: format!("cannot make it absolute: {e}"),
            })?;
            Ok(Some(normalize(&abs)))
        };
        Ok(Self {
            data: fix(Area::Data, self.data)?,
            model: fix(Area::Model, self.model)?,
            checkpoint: fix(Area::Checkpoint, self.checkpoint)?,
        })
    }
}

/// `path` with `.` removed and each `..` taking away the component before
/// it (`/..` is `/`), without reading the file system. Pure.
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Prefix(_) | Component::RootDir | Component::Normal(_) => {
                out.push(c.as_os_str())
            }
            Component::CurDir => {}
            Component::ParentDir => {
                // Never pops the root itself (`/..` is `/`); a relative path
                // keeps leading `..` (there is nothing to take away).
                let last = out.components().next_back();
                match last {
                    Some(Component::Normal(_)) => {
                        out.pop();
                    }
                    Some(Component::RootDir | Component::Prefix(_)) => {}
                    _ => out.push(".."),
                }
            }
        }
    }
    out
}

/// Where `path` lands under `root` (absolute and lexically normal, see
/// [`Roots::absolute`]): a relative path is taken under the root, then
/// `.` and `..` are resolved lexically. `Err` carries where it lands when
/// that is outside the root. Pure.
pub fn confine_lexically(root: &Path, path: &Path) -> Result<PathBuf, PathBuf> {
    let lands = normalize(&root.join(path));
    if lands.starts_with(root) {
        Ok(lands)
    } else {
        Err(lands)
    }
}

/// How much of the file system a check may see.
pub trait View {
    /// Where the (absolute, lexically normal) `path` really is, symlinks
    /// followed as far as they can be seen.
    fn resolve(&self, path: &Path) -> Result<PathBuf, String>;

    /// The symlinks directly in `path` when it is a folder: what a reader
    /// opening files of the folder by name (a shard of `model.init`, a
    /// file of an MNIST folder) would follow. None for a file, a path
    /// that does not exist, or a view that cannot see.
    fn links_in(&self, _path: &Path) -> Result<Vec<PathBuf>, String> {
        Ok(Vec::new())
    }
}

/// Sees nothing: paths are where they say (pure).
pub struct Lexical;

impl View for Lexical {
    fn resolve(&self, path: &Path) -> Result<PathBuf, String> {
        Ok(path.to_path_buf())
    }
}

/// This host's file system: the longest prefix of the path that exists is
/// canonicalized (symlinks followed) and the rest appended, so a folder
/// that does not exist yet is judged by where it would be created.
pub struct LocalFs;

impl View for LocalFs {
    fn resolve(&self, path: &Path) -> Result<PathBuf, String> {
        let path = &std::path::absolute(path)
            .map_err(|e| format!("cannot make {} absolute: {e}", path.display()))?;
        // The deepest ancestor that exists, a symlink counting as existing
        // even when it dangles (creating under it would follow it).
        let existing = path
            .ancestors()
            .find(|a| std::fs::symlink_metadata(a).is_ok())
            .unwrap_or(Path::new("/"));
        let real = std::fs::canonicalize(existing).map_err(|e| {
            format!(
                "cannot resolve {} (a dangling or looping symlink?): {e}",
                existing.display()
            )
        })?;
        // `path` is lexically normal, so the rest holds only names.
        let rest = path.strip_prefix(existing).unwrap_or(Path::new(""));
        Ok(if rest.as_os_str().is_empty() {
            real
        } else {
            real.join(rest)
        })
    }

    fn links_in(&self, path: &Path) -> Result<Vec<PathBuf>, String> {
        if !path.is_dir() {
            return Ok(Vec::new());
        }
        let list = |e: std::io::Error| format!("cannot list {}: {e}", path.display());
        let mut links = Vec::new();
        for entry in std::fs::read_dir(path).map_err(list)? {
            let entry = entry.map_err(list)?;
            if entry.file_type().map_err(list)?.is_symlink() {
                links.push(entry.path());
            }
        }
        links.sort();
        Ok(links)
    }
}

/// Confines one path of `area`: `Ok(None)` when that area has no root
/// (unconfined), `Ok(Some(p))` with the path to use instead (see the module
/// notes), or the refusal naming `field`, the value and the root.
pub fn confine_field(
    roots: &Roots,
    area: Area,
    field: &str,
    path: &Path,
    view: &dyn View,
) -> Result<Option<PathBuf>, FieldError> {
    let Some(root) = roots.get(area) else {
        return Ok(None);
    };
    let refuse = |why: String| refusal(area, root, field, path, why);
    let lexical = confine_lexically(root, path)
        .map_err(|lands| refuse(format!("it resolves to {}", lands.display())))?;
    let real_root = view
        .resolve(root)
        .map_err(|e| refuse(format!("the root: {e}")))?;
    let real = view.resolve(&lexical).map_err(refuse)?;
    if real.starts_with(&real_root) {
        Ok(Some(real))
    } else {
        Err(refuse(format!(
            "it resolves to {} (root {})",
            real.display(),
            real_root.display()
        )))
    }
}

/// The refusal of `path` for `field`: it must lie under `root`; `why` not.
fn refusal(area: Area, root: &Path, field: &str, path: &Path, why: String) -> FieldError {
    FieldError {
        field: field.to_string(),
        value: format!("{:?}", path.display().to_string()),
        allowed: format!(
            "must lie under the {} root {} ({}) after resolving '..' and symlinks; {why}",
            area.name(),
            root.display(),
            area.flag()
        ),
    }
}

/// Confines what the worker opens inside the folder `dir` (a confined
/// path of `field`, where it really lies): every symlink directly in it
/// must resolve under the root of `area` too, or a shard or data file
/// named by a plain file name could lead anywhere. The refusal names the
/// link, where it leads and the root.
pub fn confine_links(
    roots: &Roots,
    area: Area,
    field: &str,
    dir: &Path,
    view: &dyn View,
) -> Result<(), FieldError> {
    let Some(root) = roots.get(area) else {
        return Ok(());
    };
    let links = view
        .links_in(dir)
        .map_err(|e| refusal(area, root, field, dir, e))?;
    if links.is_empty() {
        return Ok(());
    }
    let real_root = view
        .resolve(root)
        .map_err(|e| refusal(area, root, field, dir, format!("the root: {e}")))?;
    for link in links {
        let refuse = |why: String| {
            refusal(
                area,
                root,
                field,
                &link,
                format!("a symlink in {}: {why}", dir.display()),
            )
        };
        let real = view.resolve(&link).map_err(refuse)?;
        if !real.starts_with(&real_root) {
            return Err(refuse(format!(
                "it resolves to {} (root {})",
                real.display(),
                real_root.display()
            )));
        }
    }
    Ok(())
}

impl JobSpec {
    /// The spec with every path field confined under its root (see
    /// [`confine_field`]): with [`LocalFs`] each path is replaced by where
    /// it really lies; every refused field is reported at once.
    pub fn confined(&self, roots: &Roots, view: &dyn View) -> Result<JobSpec, SpecErrors> {
        let mut spec = self.clone();
        let mut errors = Vec::new();
        let mut fields = vec![
            (Area::Data, "data.path", &mut spec.data.path),
            (Area::Data, "data.eval_path", &mut spec.data.eval_path),
        ];
        fields.extend(
            spec.model
                .paths_mut()
                .into_iter()
                .map(|(field, value)| (Area::Model, field, value)),
        );
        fields.push((Area::Checkpoint, "checkpoint.dir", &mut spec.checkpoint.dir));
        for (area, field, value) in fields {
            let Some(p) = value.as_mut() else { continue };
            match confine_field(roots, area, field, p, view) {
                // A folder of data or weights: the files opened in it too
                // (a checkpoint folder holds only what workers wrote).
                Ok(Some(real)) if area != Area::Checkpoint => {
                    if let Err(e) = confine_links(roots, area, field, &real, view) {
                        errors.push(e);
                    }
                    *p = real;
                }
                Ok(Some(real)) => *p = real,
                Ok(None) => {}
                Err(e) => errors.push(e),
            }
        }
        if errors.is_empty() {
            Ok(spec)
        } else {
            Err(SpecErrors(errors))
        }
    }
}

#[cfg(test)]
#[path = "paths_tests.rs"]
mod tests;
