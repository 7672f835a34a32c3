//! Bakes libtorch's lib/ folder into the rpath of every binary, test and
//! example of this crate, so they run without LD_LIBRARY_PATH (SETUP-NOTES).
//! Compiles the autocast shim (csrc/amp.cpp). `ACCRUE_CUDA=1` also links libtorch_cuda explicitly: rustc passes
//! `--as-needed`, which would otherwise drop it and CUDA would never register.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=ACCRUE_CUDA");
    let Some(libtorch) = std::env::var_os("LIBTORCH") else {
        println!("cargo:warning=LIBTORCH is not set; run `make setup` first");
        return;
    };
    let libtorch = PathBuf::from(libtorch);
    // A missing folder is reported by torch-sys itself; keep the path as given then.
    let libtorch = libtorch.canonicalize().unwrap_or(libtorch);
    let lib = libtorch.join("lib");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // The autocast shim (csrc/amp.cpp, issue 18), against the wheel's
    // headers and C++ ABI; its symbols resolve in libtorch_cpu, which
    // torch-sys links after this crate.
    println!("cargo:rerun-if-changed=csrc/amp.cpp");
    cc::Build::new()
        .cpp(true)
        .file("csrc/amp.cpp")
        .include(libtorch.join("include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .warnings(false)
        .compile("accrue_amp");
    if std::env::var("ACCRUE_CUDA").as_deref() == Ok("1") {
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
