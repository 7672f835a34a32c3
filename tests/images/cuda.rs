//! The CUDA tree ships the libraries libtorch opens.

use super::*;

/// The CUDA mode on this machine's full PyTorch install (the nvidia/*
/// libraries the CUDA image ships): the CUDA libraries libtorch loads or
/// opens later are in the tree and resolve inside it, the driver is not.
/// Runs on CPU-only binaries (no GPU here): what it proves is the tree's
/// contents, not a CUDA run.
#[test]
fn cuda_mode_ships_the_cuda_libraries_libtorch_opens() {
    let torch_lib = resolve_on_host("accrue-worker", "libtorch_cpu.so")
        .parent()
        .unwrap()
        .to_path_buf();
    // The PyPI wheel `make setup` installs carries CUDA: a CPU-only
    // libtorch cannot show what the CUDA image ships, so it fails rather
    // than passing without a check (issue 28: no silent skips).
    assert!(
        torch_lib.join("libtorch_cuda.so").exists(),
        "{} has no libtorch_cuda.so (a CPU-only libtorch): this test needs the CUDA build of torch 2.11.0 that `make setup` installs from PyPI",
        torch_lib.display()
    );
    let tmp = tempfile::tempdir().unwrap();
    let tree = Tree {
        root: tmp.path().canonicalize().unwrap().join("tree"),
    };
    let o = assemble(&tree.root, &["--cuda"]);
    assert!(
        o.status.success(),
        "assemble-runtime.sh --cuda failed:\n{}",
        show(&o)
    );
    for lib in [
        "libtorch_cuda.so",
        "libc10_cuda.so",
        "libtorch_cuda_linalg.so",
        "libcaffe2_nvrtc.so",
        "libcudart.so.13",
        "libcublas.so.13",
        "libcublasLt.so.13",
        "libcudnn.so.9",
        "libcudnn_engines_precompiled.so.9",
        "libcudnn_cnn.so.9",
        "libnccl.so.2",
        "libnvrtc.so.13",
        "libnvrtc-builtins.so.13.0",
        "libcusparseLt.so.0",
    ] {
        assert!(
            tree.acclib().join(lib).is_file(),
            "{lib} is not in the tree"
        );
    }
    for lib in ["libcuda.so.1", "libtorch_python.so"] {
        assert!(!tree.acclib().join(lib).exists(), "{lib} is in the tree");
    }
    for lib in files_under(&tree.acclib()) {
        for e in rpath(&lib) {
            assert!(
                e.starts_with("$ORIGIN") || e.starts_with("${ORIGIN}"),
                "{} has the RPATH entry {e:?}",
                lib.display()
            );
        }
    }
    // libtorch_cuda and a cuDNN engine, as a CUDA worker would load them:
    // everything inside the tree, only the driver from elsewhere.
    for lib in ["libtorch_cuda.so", "libcudnn_engines_precompiled.so.9"] {
        let libs = tree.resolve(&tree.acclib().join(lib), &[tree.syslib(), tree.acclib()]);
        for (name, path) in &libs {
            match path {
                Some(p) => assert!(
                    lexical(p).starts_with(&tree.root),
                    "{lib} loads {name} from {}",
                    p.display()
                ),
                None => assert!(
                    name == "libcuda.so.1" || name == "libnvidia-ml.so.1",
                    "{lib}: {name} not found in the tree"
                ),
            }
        }
    }
}

/// Where this machine's loader finds `lib` for the build's binary `bin`.
fn resolve_on_host(bin: &str, lib: &str) -> PathBuf {
    let o = Command::new("ldd")
        .arg(built(bin))
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    text(&o.stdout)
        .lines()
        .filter_map(|l| l.trim().split_once(" => "))
        .find(|(n, _)| *n == lib)
        .map(|(_, p)| PathBuf::from(p.split(" (0x").next().unwrap()))
        .unwrap_or_else(|| panic!("{bin} does not load {lib}:\n{}", show(&o)))
}
