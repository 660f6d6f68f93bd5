//! Compiles the .proto files with protox (a pure-Rust protobuf compiler, so building
//! needs no protoc) and generates tonic clients and servers. The encoded descriptor set
//! is kept for gRPC server reflection.

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "strata/inference/v1/inference.proto",
        "strata/admin/v1/admin.proto",
        "strata/worker/v1/worker.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("strata_descriptor.bin"), fds.encode_to_vec())?;
    // Decode errors are the sender's (INVALID_ARGUMENT), not INTERNAL: see src/codec.rs.
    tonic_prost_build::configure().codec_path("crate::codec::StrictCodec").compile_fds(fds)?;
    Ok(())
}
