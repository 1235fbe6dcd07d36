//! Generates the messages (and, with feature `grpc`, the tonic client and server) from
//! `proto/` with protox: a pure-Rust compiler, so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("proto");
    let file = root.join("inferencecache/v1alpha1/inferencecache.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let descriptors = protox::compile([&file], [&root])?;
    let grpc = std::env::var_os("CARGO_FEATURE_GRPC").is_some();
    tonic_prost_build::configure()
        .build_client(grpc)
        .build_server(grpc)
        .build_transport(grpc)
        // A server implements only the calls its side serves; the rest answer `unimplemented`.
        .generate_default_stubs(true)
        .compile_fds(descriptors)?;
    Ok(())
}
