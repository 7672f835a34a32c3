//! Generates the gRPC code with the vendored protoc (no system protoc).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing reads the
    // environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=accrue/v1/accrue.proto");
    // The descriptor set: the spec messages' field lists, which the
    // converter's drift test (src/convert/drift_tests.rs) checks.
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // Our codec: a request that does not decode is INVALID_ARGUMENT, not
    // tonic-prost's INTERNAL (src/codec.rs).
    tonic_prost_build::configure()
        .codec_path("crate::codec::Codec")
        .file_descriptor_set_path(out.join("accrue_descriptor.bin"))
        .compile_protos(&["accrue/v1/accrue.proto"], &["."])?;
    Ok(())
}
