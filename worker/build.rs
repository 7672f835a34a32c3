//! Bakes libtorch's lib/ folder into the rpath of every binary, test and
//! example of this crate, so they run without LD_LIBRARY_PATH
//! (docs/ARCHITECTURE.md, "Build and run-time linking").
//! Compiles the autocast shim (csrc/amp.cpp), the profiler's
//! (csrc/profile.cpp), the storage resize (csrc/storage.cpp, ZeRO-3) and the fused operations' (csrc/fused_ops.cpp, with
//! PyTorch's fused Adam/AdamW; with ACCRUE_CUDA=1 also csrc/kernels.cu). `ACCRUE_CUDA=1` also links
//! libtorch_cuda explicitly (rustc passes `--as-needed`, which would
//! otherwise drop it and CUDA would never register), compiles the CUDA-graph
//! shim (csrc/graph.cpp, host code against the wheel's headers: no nvcc)
//! and sets cfg `accrue_cuda` for its Rust side.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=ACCRUE_CUDA");
    println!("cargo::rustc-check-cfg=cfg(accrue_cuda)");
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
    println!("cargo:rerun-if-changed=csrc/profile.cpp");
    println!("cargo:rerun-if-changed=csrc/storage.cpp");
    cc::Build::new()
        .cpp(true)
        .file("csrc/amp.cpp")
        .file("csrc/profile.cpp")
        .file("csrc/storage.cpp")
        .include(libtorch.join("include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .warnings(false)
        .compile("accrue_amp");
    // libtorch's c10d process groups (csrc/c10d.cpp, issue 38): gloo's
    // ProcessGroupGloo from libtorch_cpu. Its header includes gloo's own
    // headers, which the wheel does not ship: Debian's libgloo-dev (`make
    // setup` installs it; GLOO_INCLUDE overrides the folder). Only the
    // declarations are used: the gloo code that runs is libtorch's.
    println!("cargo:rerun-if-changed=csrc/c10d.cpp");
    println!("cargo:rerun-if-changed=csrc/shim.h");
    println!("cargo:rerun-if-env-changed=GLOO_INCLUDE");
    let gloo = std::env::var_os("GLOO_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/include"));
    if !gloo.join("gloo/context.h").is_file() {
        panic!(
            "gloo's headers are missing ({} has no gloo/context.h): run `make setup` \
             (it installs Debian's libgloo-dev) or set GLOO_INCLUDE",
            gloo.display()
        );
    }
    let cuda = std::env::var("ACCRUE_CUDA").as_deref() == Ok("1");
    let mut c10d = cc::Build::new();
    c10d.cpp(true)
        .file("csrc/c10d.cpp")
        .include(libtorch.join("include"))
        .include(libtorch.join("include/torch/csrc/api/include"))
        .include(&gloo)
        .define("USE_C10D_GLOO", None)
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .warnings(false);
    if cuda {
        // ProcessGroupNCCL from libtorch_cuda (linked below); its header
        // wants CUDA's (the wheel's nvidia/cu13, with the crt/ `make
        // gpu-worker` adds) and NCCL's (nvidia/nccl).
        c10d.include(libtorch.join("../nvidia/cu13/include"))
            .include(libtorch.join("../nvidia/nccl/include"))
            .define("USE_C10D_NCCL", None)
            .define("ACCRUE_C10D_NCCL", None);
    }
    c10d.compile("accrue_c10d");
    // The Llama family's fused operations as autograd functions and the
    // fused optimizer (csrc/fused_ops.cpp): ATen everywhere, and with ACCRUE_CUDA=1
    // accrue's CUDA kernels (csrc/kernels.cu, compiled by nvcc from the
    // nvidia-cuda-nvcc wheel: `make gpu-worker` installs it).
    println!("cargo:rerun-if-changed=csrc/fused_ops.cpp");
    println!("cargo:rerun-if-changed=csrc/kernels.cu");
    println!("cargo:rerun-if-env-changed=NVCC");
    let mut ops = cc::Build::new();
    ops.cpp(true)
        .file("csrc/fused_ops.cpp")
        .include(libtorch.join("include"))
        .include(libtorch.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .warnings(false);
    if cuda {
        ops.include(libtorch.join("../nvidia/cu13/include"))
            .define("ACCRUE_CUDA_KERNELS", None);
    }
    ops.compile("accrue_ops");
    if cuda {
        let nvcc = std::env::var_os("NVCC")
            .map(PathBuf::from)
            .unwrap_or_else(|| libtorch.join("../nvidia/cu13/bin/nvcc"));
        let mut kernels = cc::Build::new();
        kernels
            .cuda(true)
            // libcudart.so.13 is linked below, as for the graph shim.
            .cudart("none")
            .compiler(&nvcc)
            // cc's default host flags are gcc's, which nvcc refuses.
            .no_default_flags(true)
            .file("csrc/kernels.cu")
            .flag("-Xcompiler=-fPIC")
            .flag("-std=c++17")
            .flag("-O3")
            .warnings(false);
        // Every GPU generation CUDA 13 and PyTorch's cu130 wheel support
        // (Turing to Blackwell: T4, A100, A10, L4, H100/H200, B200,
        // RTX 50), and PTX for later ones to compile.
        for arch in ["75", "80", "86", "89", "90", "100", "120"] {
            kernels.flag(format!("-gencode=arch=compute_{arch},code=sm_{arch}"));
        }
        kernels.flag("-gencode=arch=compute_120,code=compute_120");
        kernels.compile("accrue_kernels");
    }
    if cuda {
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
        // The graph shim (issue 19): CUDA's headers come with the wheel
        // (site-packages/nvidia/cu13/include, next to torch/).
        println!("cargo:rerun-if-changed=csrc/graph.cpp");
        let cuda_include = libtorch.join("../nvidia/cu13/include");
        cc::Build::new()
            .cpp(true)
            .file("csrc/graph.cpp")
            .include(libtorch.join("include"))
            .include(&cuda_include)
            .flag("-std=c++17")
            .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
            .warnings(false)
            .compile("accrue_graph");
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
        // The headers' inline code calls the CUDA runtime (events, stream
        // capture queries): libcudart.so.13 from the wheel's nvidia/cu13,
        // which has no unversioned name; its folder goes into the rpath
        // too (elsewhere: LD_LIBRARY_PATH, as docs/ARCHITECTURE.md says).
        let cuda_lib = libtorch.join("../nvidia/cu13/lib");
        let cuda_lib = cuda_lib.canonicalize().unwrap_or(cuda_lib);
        println!("cargo:rustc-link-search=native={}", cuda_lib.display());
        println!("cargo:rustc-link-lib=dylib:+verbatim=libcudart.so.13");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", cuda_lib.display());
        println!("cargo:rustc-cfg=accrue_cuda");
    }
}
