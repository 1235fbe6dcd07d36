//! Integration tests of the wire crate: the shared vectors, hostile input, compatibility.

mod heap;
mod hostile;
mod leniency;
mod owned;
mod serde_model;
mod vectors;

use std::path::{Path, PathBuf};

/// The repository's `testdata/` (see its README: copies of the shared reference data).
pub(crate) fn shared_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

/// Every `(release, case, payload, expected json)` under `testdata/vectors`, sorted.
pub(crate) fn vectors() -> Vec<(String, String, Vec<u8>, serde_json::Value)> {
    vectors_of("vllm-")
}

/// The same for the folders named `<prefix><release>` (`vllm-`, `sglang-`).
pub(crate) fn vectors_of(prefix: &str) -> Vec<(String, String, Vec<u8>, serde_json::Value)> {
    let root = shared_dir().join("vectors");
    let mut out = Vec::new();
    for release_dir in std::fs::read_dir(&root).expect("read vectors") {
        let release_dir = release_dir.expect("entry").path();
        let Some(name) = release_dir.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(release) = name.strip_prefix(prefix) else {
            continue;
        };
        for file in std::fs::read_dir(&release_dir).expect("read release dir") {
            let path = file.expect("entry").path();
            if path.extension().is_some_and(|e| e == "msgpack") {
                let case = path.file_stem().and_then(|s| s.to_str()).expect("stem");
                let json = std::fs::read(path.with_extension("json")).expect("json beside");
                out.push((
                    release.to_owned(),
                    case.to_owned(),
                    std::fs::read(&path).expect("read payload"),
                    serde_json::from_slice(&json).expect("parse json"),
                ));
            }
        }
    }
    out.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
    assert!(
        out.len() >= 70,
        "expected the shared vectors, found {}",
        out.len()
    );
    out
}
