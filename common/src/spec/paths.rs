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
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    #[test]
    fn normalize_removes_dots_lexically() {
        for (input, want) in [
            ("/a/./b/../c", "/a/c"),
            ("/..", "/"),
            ("/a/../../b", "/b"),
            ("a/../..", ".."),
            ("./a/b/", "a/b"),
            ("/a//b", "/a/b"),
        ] {
            assert_eq!(normalize(Path::new(input)), p(want), "{input}");
        }
    }

    #[test]
    fn lexical_confinement_refuses_escapes() {
        let root = p("/srv/ckpt");
        assert_eq!(confine_lexically(&root, &p("run")), Ok(p("/srv/ckpt/run")));
        assert_eq!(
            confine_lexically(&root, &p("./a/../b")),
            Ok(p("/srv/ckpt/b"))
        );
        assert_eq!(confine_lexically(&root, &p("")), Ok(p("/srv/ckpt")));
        assert_eq!(
            confine_lexically(&root, &p("/srv/ckpt/x")),
            Ok(p("/srv/ckpt/x"))
        );
        // Back in through the root's own name is still inside.
        assert_eq!(
            confine_lexically(&root, &p("../ckpt/x")),
            Ok(p("/srv/ckpt/x"))
        );
        for (bad, lands) in [
            ("..", "/srv"),
            ("a/../../x", "/srv/x"),
            ("/srv/ckpt/../other", "/srv/other"),
            ("/srv/ckptx", "/srv/ckptx"),
            ("/tmp/probe/outside/../escaped", "/tmp/probe/escaped"),
            ("../../../../../etc/passwd", "/etc/passwd"),
        ] {
            assert_eq!(confine_lexically(&root, &p(bad)), Err(p(lands)), "{bad}");
        }
    }

    #[test]
    fn the_refusal_names_field_value_root_and_flag() {
        let roots = Roots {
            checkpoint: Some(p("/srv/ckpt")),
            ..Default::default()
        };
        let e = confine_field(
            &roots,
            Area::Checkpoint,
            "checkpoint.dir",
            Path::new("/tmp/probe/outside/../escaped"),
            &Lexical,
        )
        .unwrap_err();
        assert_eq!(e.field, "checkpoint.dir");
        assert_eq!(e.value, "\"/tmp/probe/outside/../escaped\"");
        let text = e.to_string();
        for part in [
            "/srv/ckpt",
            "--checkpoint-root",
            "resolves to /tmp/probe/escaped",
        ] {
            assert!(text.contains(part), "{text:?} lacks {part:?}");
        }
        // No root for the area: not confined.
        assert_eq!(
            confine_field(&roots, Area::Data, "data.path", Path::new("/x"), &Lexical),
            Ok(None)
        );
    }

    #[test]
    fn a_spec_is_refused_for_every_escaping_field_at_once() {
        let text = r#"
name = "j"
[model]
kind = "torchscript"
path = "m/../../elsewhere.pt"
init = "/models/ok.safetensors"
[data]
kind = "tensors"
path = "/etc/shadow"
eval_path = "eval.safetensors"
batch_size = 4
[optimizer]
kind = "sgd"
lr = 0.1
[checkpoint]
dir = "/tmp/probe/outside/../escaped"
"#;
        let spec = JobSpec::fields_from_toml_str(text, Path::new("t.toml")).unwrap();
        let roots = Roots {
            data: Some(p("/data")),
            model: Some(p("/models")),
            checkpoint: Some(p("/ckpt")),
        };
        let SpecErrors(errors) = spec.confined(&roots, &Lexical).unwrap_err();
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["data.path", "model.path", "checkpoint.dir"]);
        // Without roots, nothing changes.
        assert_eq!(spec.confined(&Roots::default(), &Lexical), Ok(spec.clone()));
        // Relative paths land under their roots.
        let ok = Roots {
            data: Some(p("/")),
            model: Some(p("/")),
            checkpoint: Some(p("/")),
        };
        let c = spec.confined(&ok, &Lexical).unwrap();
        assert_eq!(c.data.eval_path, Some(p("/eval.safetensors")));
        assert_eq!(c.model.path, Some(p("/elsewhere.pt")));
    }

    #[test]
    fn roots_must_name_a_folder() {
        let e = Roots {
            model: Some(p("")),
            ..Default::default()
        }
        .absolute()
        .unwrap_err();
        assert_eq!(e.flag, "--model-root");
        let r = Roots {
            data: Some(p("/a/./b/..")),
            ..Default::default()
        }
        .absolute()
        .unwrap();
        assert_eq!(r.data, Some(p("/a")));
    }

    #[cfg(unix)]
    #[test]
    fn symlinks_are_judged_by_where_they_lead() {
        use std::os::unix::fs::symlink;
        let t = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(t.path()).unwrap();
        let root = base.join("root");
        let outside = base.join("outside");
        std::fs::create_dir_all(root.join("inner")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        symlink(&outside, root.join("out")).unwrap();
        symlink(root.join("inner"), root.join("in")).unwrap();
        symlink(base.join("nowhere"), root.join("dangling")).unwrap();
        let roots = Roots {
            checkpoint: Some(root.clone()),
            ..Default::default()
        };
        let check = |path: &str| {
            confine_field(
                &roots,
                Area::Checkpoint,
                "checkpoint.dir",
                Path::new(path),
                &LocalFs,
            )
        };
        // A link inside the root that stays inside: the real path is used.
        assert_eq!(
            check("in/new/deeper"),
            Ok(Some(root.join("inner/new/deeper")))
        );
        // Not yet existing, under a parent that leads out.
        let e = check("out/new").unwrap_err();
        assert!(e.allowed.contains(&outside.display().to_string()), "{e}");
        assert!(check("out").is_err());
        assert!(check("dangling/x").is_err(), "a dangling link is refused");
        // `..` after a link is lexical: `out/..` is the root itself.
        assert_eq!(check("out/../fine"), Ok(Some(root.join("fine"))));
        // The lexical view cannot see the links.
        assert_eq!(
            confine_field(
                &roots,
                Area::Checkpoint,
                "checkpoint.dir",
                Path::new("out/new"),
                &Lexical
            ),
            Ok(Some(root.join("out/new")))
        );
        // A root that is itself a link is followed, and paths through it
        // are inside.
        let link_root = base.join("link-root");
        symlink(&root, &link_root).unwrap();
        let via = Roots {
            checkpoint: Some(link_root.clone()),
            ..Default::default()
        };
        assert_eq!(
            confine_field(
                &via,
                Area::Checkpoint,
                "checkpoint.dir",
                Path::new("x"),
                &LocalFs
            ),
            Ok(Some(root.join("x")))
        );
    }

    /// A shard of a `model.init` folder (or a file of a data folder) that
    /// is a symlink must lead under the root too: the folder is confined,
    /// so must be what the worker opens in it by name.
    #[cfg(unix)]
    #[test]
    fn links_in_a_confined_folder_must_stay_under_the_root() {
        use std::os::unix::fs::symlink;
        let t = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(t.path()).unwrap();
        let (root, outside) = (base.join("models"), base.join("outside"));
        let folder = root.join("sharded");
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::create_dir_all(root.join("blobs")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("secret.safetensors"), "x").unwrap();
        std::fs::write(root.join("blobs/b1"), "x").unwrap();
        std::fs::write(folder.join("model.safetensors.index.json"), "{}").unwrap();
        // Inside the root (as a Hugging Face cache links its blobs): fine.
        symlink(
            "../blobs/b1",
            folder.join("model-00001-of-00002.safetensors"),
        )
        .unwrap();
        let roots = Roots {
            model: Some(root.clone()),
            ..Default::default()
        };
        confine_links(&roots, Area::Model, "model.init", &folder, &LocalFs).unwrap();
        let text = "name = \"j\"\n[model]\nkind = \"mlp\"\ninit = \"sharded\"\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
        let spec = JobSpec::fields_from_toml_str(text, Path::new("t.toml")).unwrap();
        assert_eq!(
            spec.confined(&roots, &LocalFs).unwrap().model.init,
            Some(folder.clone())
        );
        // Out of the root: refused, naming the link, where it leads, the
        // root and its flag.
        let shard = folder.join("model-00002-of-00002.safetensors");
        symlink(outside.join("secret.safetensors"), &shard).unwrap();
        let SpecErrors(errors) = spec.confined(&roots, &LocalFs).unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        let e = &errors[0];
        assert_eq!(e.field, "model.init");
        assert_eq!(e.value, format!("{:?}", shard.display().to_string()));
        let text = e.to_string();
        for part in [
            root.display().to_string(),
            "--model-root".into(),
            format!(
                "resolves to {}",
                outside.join("secret.safetensors").display()
            ),
        ] {
            assert!(text.contains(&part), "{text:?} lacks {part:?}");
        }
        // A dangling link is refused too (it cannot be judged).
        std::fs::remove_file(&shard).unwrap();
        symlink(base.join("nowhere"), &shard).unwrap();
        assert!(confine_links(&roots, Area::Model, "model.init", &folder, &LocalFs).is_err());
        // The lexical view sees no links.
        assert!(confine_links(&roots, Area::Model, "model.init", &folder, &Lexical).is_ok());
        // No root: not confined.
        let none = Roots::default();
        assert!(confine_links(&none, Area::Model, "model.init", &folder, &LocalFs).is_ok());
    }

    fn component() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => "[a-c]{1,2}".prop_map(String::from),
            2 => Just("..".to_string()),
            1 => Just(".".to_string()),
        ]
    }

    fn path_of(parts: &[String], absolute: bool) -> PathBuf {
        let s = parts.join("/");
        PathBuf::from(if absolute { format!("/{s}") } else { s })
    }

    proptest! {
        /// Whatever it is given, an accepted path is lexically normal and
        /// under the root, and confining it again changes nothing.
        #[test]
        fn accepted_paths_are_normal_and_inside(
            root in prop::collection::vec("[a-c]{1,2}", 0..4),
            parts in prop::collection::vec(component(), 0..10),
            absolute in any::<bool>(),
        ) {
            let root = path_of(&root, true);
            let path = path_of(&parts, absolute);
            match confine_lexically(&root, &path) {
                Ok(lands) => {
                    prop_assert!(lands.starts_with(&root));
                    prop_assert!(lands.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_))));
                    prop_assert_eq!(confine_lexically(&root, &lands), Ok(lands.clone()));
                }
                Err(lands) => {
                    prop_assert!(!lands.starts_with(&root));
                    prop_assert!(lands.is_absolute());
                }
            }
        }

        /// Names and `.` alone never leave the root; a `..` more than the
        /// names before it (and a last name other than the root's) always
        /// does.
        #[test]
        fn escaping_needs_more_dotdots_than_names(
            root in prop::collection::vec("[a-c]{1,2}", 1..4),
            names in prop::collection::vec("[a-c]{1,2}", 0..4),
            extra in 1usize..4,
            tail in "[x-z]{1,2}",
        ) {
            let root_p = path_of(&root, true);
            let inside = path_of(&names, false);
            prop_assert_eq!(confine_lexically(&root_p, &inside), Ok(root_p.join(&inside)));
            let mut parts: Vec<String> = names.clone();
            parts.extend(std::iter::repeat_n("..".to_string(), names.len() + extra));
            parts.push(tail);
            prop_assert!(confine_lexically(&root_p, &path_of(&parts, false)).is_err());
        }

        /// `x/..` anywhere changes nothing (lexically).
        #[test]
        fn a_name_and_its_dotdot_cancel(
            parts in prop::collection::vec(component(), 0..8),
            at in 0usize..9,
        ) {
            let root = PathBuf::from("/r/s");
            let at = at.min(parts.len());
            let mut with = parts.clone();
            with.insert(at, "zz/..".to_string());
            prop_assert_eq!(
                confine_lexically(&root, &path_of(&with, false)),
                confine_lexically(&root, &path_of(&parts, false))
            );
        }
    }
}
