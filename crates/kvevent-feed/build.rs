//! Generates the feed's messages and its tonic client from `proto/kvevent/feed/v1` with protox
//! (pure Rust: no system `protoc`). The server is written by hand (`server.rs`) so that a
//! change is encoded once and the same bytes go to every follower.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("proto");
    let file = root.join("kvevent/feed/v1/feed.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let descriptors = protox::compile([&file], [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        // The client is generic over its channel: a router brings tonic's (feature
        // `channel`), the sidecar builds none.
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}
