//! Shared helpers for the benchmarks: where the shared vectors are, loaded once.

use std::path::{Path, PathBuf};

/// `shared/` beside the checkout (or `KVEVENT_SHARED_DIR`).
pub fn shared_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVEVENT_SHARED_DIR") {
        return PathBuf::from(dir);
    }
    let mut dir = Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf();
    loop {
        if dir.join("shared/vectors").is_dir() {
            return dir.join("shared");
        }
        if !dir.pop() {
            return PathBuf::from("../shared");
        }
    }
}

/// Every vector payload as `(release/case, bytes)`, sorted by name.
pub fn vector_payloads() -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for release in std::fs::read_dir(shared_dir().join("vectors"))? {
        let release = release?.path();
        if !release.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&release)? {
            let path = file?.path();
            if path.extension().is_some_and(|e| e == "msgpack") {
                let name = format!(
                    "{}/{}",
                    release.file_name().unwrap_or_default().to_string_lossy(),
                    path.file_stem().unwrap_or_default().to_string_lossy()
                );
                out.push((name, std::fs::read(&path)?));
            }
        }
    }
    out.sort();
    Ok(out)
}
