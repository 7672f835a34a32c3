//! The runtime tree runs the binaries with nothing but its own libraries.

use super::*;

#[test]
fn runtime_tree_runs_the_binaries_with_only_its_own_libraries() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().canonicalize().unwrap();
    let tree = Tree {
        root: base.join("tree"),
    };
    let o = assemble(&tree.root, &[]);
    assert!(
        o.status.success(),
        "assemble-runtime.sh failed:\n{}",
        show(&o)
    );

    // Layout, and nothing in the tree names a path of the build machine.
    for name in BINS {
        assert!(tree.bin(name).is_file(), "{name} is not in the tree");
        assert_eq!(rpath(&tree.bin(name)), ["$ORIGIN/../lib/accrue"], "{name}");
    }
    for lib in files_under(&tree.acclib())
        .into_iter()
        .chain(files_under(&tree.syslib()))
    {
        for e in rpath(&lib) {
            assert!(
                e.starts_with("$ORIGIN") || e.starts_with("${ORIGIN}"),
                "{} has the RPATH entry {e:?}: a path outside the tree",
                lib.display()
            );
        }
    }
    for lib in ["libtorch_cpu.so", "libc10.so"] {
        assert!(
            tree.acclib().join(lib).is_file(),
            "{lib} is not in the tree"
        );
    }
    for lib in ["libc.so.6", "libstdc++.so.6", "libgcc_s.so.1"] {
        assert!(
            tree.syslib().join(lib).is_file(),
            "{lib} is not in the tree"
        );
    }
    let passwd = std::fs::read_to_string(tree.root.join("etc/passwd")).unwrap();
    assert!(passwd.contains("nonroot:x:65532:65532:"), "{passwd}");
    let sizes = |dir: &Path| -> u64 {
        files_under(dir)
            .iter()
            .map(|f| f.metadata().unwrap().len())
            .sum()
    };
    eprintln!(
        "tree: binaries {} MB (debug, stripped of debug info), accrue libraries {} MB, system libraries {} MB",
        sizes(&tree.root.join("usr/local/bin")) >> 20,
        sizes(&tree.acclib()) >> 20,
        sizes(&tree.syslib()) >> 20
    );

    // Every library each binary loads resolves inside the tree, with only
    // the tree's system folder on the path: the binaries' RPATH finds the rest.
    for name in BINS {
        let libs = tree.resolve(&tree.bin(name), &[tree.syslib()]);
        for (lib, path) in &libs {
            let path = path
                .as_ref()
                .unwrap_or_else(|| panic!("{name}: {lib} not found in the tree"));
            assert!(
                lexical(path).starts_with(&tree.root),
                "{name} loads {lib} from {}, outside the tree",
                path.display()
            );
        }
        let names: Vec<&str> = libs.iter().map(|(n, _)| n.as_str()).collect();
        assert!(names.contains(&"libc.so.6"), "{name}: {names:?}");
        if name == "accrue-worker" {
            for lib in ["libtorch_cpu.so", "libc10.so", "libgomp.so.1"] {
                assert!(
                    names.contains(&lib),
                    "{name} does not load {lib}: {names:?}"
                );
            }
        }
    }

    // The binaries start from the tree.
    let o = tree
        .command("accrue", &[])
        .arg("--version")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    assert!(text(&o.stdout).starts_with("accrue "), "{}", show(&o));
    let o = tree
        .command("accrue-coordinator", &[])
        .arg("--help")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        text(&o.stdout).contains("Usage: accrue-coordinator"),
        "{}",
        show(&o)
    );
    let o = tree
        .command("accrue-worker", &[])
        .arg("--version")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));

    // A real job from the tree: libtorch's forward and backward, a
    // checkpoint, an evaluation; the same progress as the build's own binary.
    let host_dir = base.join("host");
    let tree_dir = base.join("from-tree");
    for d in [&host_dir, &tree_dir] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("job.toml"), JOB).unwrap();
    }
    let train = ["train", "job.toml", "--state-dir", "state"];
    let t = Instant::now();
    let host = Command::new(built("accrue-worker"))
        .args(train)
        .current_dir(&host_dir)
        .env_clear()
        .output()
        .unwrap();
    let host_s = t.elapsed().as_secs_f64();
    assert!(host.status.success(), "{}", show(&host));
    let t = Instant::now();
    let run = tree
        .command("accrue-worker", &[("LD_DEBUG", "libs")])
        .args(train)
        .current_dir(&tree_dir)
        .output()
        .unwrap();
    eprintln!(
        "train: {host_s:.2} s with the build's binary, {:.2} s from the tree",
        t.elapsed().as_secs_f64()
    );
    assert!(run.status.success(), "{}", show(&run));
    let stdout = text(&run.stdout);
    assert!(
        stdout.contains("finished at step 4: 64 samples"),
        "{stdout}"
    );
    assert!(stdout.contains("final accuracy"), "{stdout}");
    assert_eq!(progress(&run.stdout), progress(&host.stdout));
    assert!(tree_dir
        .join("state/checkpoints/image-smoke/step-4")
        .is_dir());
    // The loader's own account (LD_DEBUG=libs): every file it tried and
    // every library it initialised, dlopen included, lies inside the tree.
    let debug = text(&run.stderr);
    let mut tried = 0;
    let mut initialised = Vec::new();
    for line in debug.lines() {
        let path = if let Some((_, p)) = line.split_once("trying file=") {
            tried += 1;
            p
        } else if let Some((_, p)) = line.split_once("calling init: ") {
            initialised.push(p.trim().to_string());
            p
        } else {
            continue;
        };
        assert!(
            lexical(Path::new(path.trim())).starts_with(&tree.root),
            "the worker's loader looked outside the tree: {line}"
        );
    }
    assert!(tried > 0, "no LD_DEBUG output:\n{debug}");
    for lib in [
        "libtorch_cpu.so",
        "libc10.so",
        "libc.so.6",
        "libstdc++.so.6",
    ] {
        assert!(
            initialised
                .iter()
                .any(|p| Path::new(p).file_name() == Some(OsStr::new(lib))),
            "{lib} was not loaded: {initialised:?}"
        );
    }

    // As the image's file system, chrooted into: a test of its own, which
    // needs root (the_runtime_tree_runs_chrooted_as_user_65532_as_root).

    // A library missing from a copy of the tree: the worker no longer starts
    // and the loader names the library; the script refuses such a binary.
    let broken = Tree {
        root: base.join("broken"),
    };
    // Hard links where allowed (protected_hardlinks may refuse files of
    // other users), a copy otherwise.
    let copy = |flags: &str| {
        let _ = std::fs::remove_dir_all(&broken.root);
        Command::new("cp")
            .arg(flags)
            .arg(&tree.root)
            .arg(&broken.root)
            .output()
            .unwrap()
    };
    if !copy("-al").status.success() {
        let o = copy("-a");
        assert!(o.status.success(), "{}", show(&o));
    }
    std::fs::remove_file(broken.acclib().join("libc10.so")).unwrap();
    let o = broken
        .command("accrue-worker", &[])
        .arg("--version")
        .output()
        .unwrap();
    assert!(
        !o.status.success(),
        "started without libc10.so:\n{}",
        show(&o)
    );
    let err = text(&o.stderr);
    assert!(
        err.contains("libc10.so") && err.contains("cannot open shared object file"),
        "{}",
        show(&o)
    );
    let libs = broken.resolve(&broken.bin("accrue-worker"), &[broken.syslib()]);
    assert!(libs.contains(&("libc10.so".to_string(), None)), "{libs:?}");
    let o = Command::new(repo().join("deploy/images/assemble-runtime.sh"))
        .arg(base.join("again"))
        .arg(broken.bin("accrue-worker"))
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", show(&o));
    assert!(
        text(&o.stderr).contains("libraries not found on this machine: libc10.so"),
        "{}",
        show(&o)
    );
}
