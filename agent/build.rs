//! Build script: generates the kubelet pod-resources gRPC client and server from the
//! vendored upstream proto, only when the `kubernetes` feature is on.
//!
//! protox parses the proto in pure Rust, so no `protoc` is needed on the build machine.
//! The generated file goes to `$OUT_DIR/podresources/v1.rs` (the proto package is `v1`,
//! which is too generic a name to leave at the top of `OUT_DIR`).

#[cfg(feature = "kubernetes")]
use std::env;
use std::error::Error;
#[cfg(feature = "kubernetes")]
use std::path::PathBuf;

const PROTO: &str = "podresources/v1/api.proto";

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=proto/{PROTO}");
    generate()
}

/// Without the feature the code generators are not even dependencies.
#[cfg(not(feature = "kubernetes"))]
fn generate() -> Result<(), Box<dyn Error>> {
    Ok(())
}

#[cfg(feature = "kubernetes")]
fn generate() -> Result<(), Box<dyn Error>> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let out_dir = PathBuf::from(env::var("OUT_DIR")?).join("podresources");
    std::fs::create_dir_all(&out_dir)?;

    let descriptors = protox::compile([PROTO], [manifest_dir.join("proto")])?;
    // The server half is generated too: the attribution tests run a fake kubelet with it.
    tonic_prost_build::configure().build_client(true).build_server(true).out_dir(&out_dir).compile_fds(descriptors)?;
    Ok(())
}
