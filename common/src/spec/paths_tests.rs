//! The confinement of job paths under their roots (paths.rs).

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
