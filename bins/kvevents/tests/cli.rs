//! The `kvevents` binary, run as a user would.

use std::path::PathBuf;
use std::process::{Command, Output};

fn shared() -> PathBuf {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    loop {
        if dir.join("shared/vectors").is_dir() {
            return dir.join("shared");
        }
        assert!(dir.pop(), "no shared/ above the crate");
    }
}

fn kvevents(args: &[&str], stdin: Option<&[u8]>) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvevents"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kvevents");
    let mut input = child.stdin.take().expect("stdin");
    input
        .write_all(stdin.unwrap_or_default())
        .expect("write stdin");
    drop(input);
    child.wait_with_output().expect("wait")
}

#[test]
fn decode_prints_the_vectors_json_one_line_each() {
    let dir = shared().join("vectors/vllm-0.26.0");
    let a = dir.join("basic.msgpack");
    let b = dir.join("media.msgpack");
    let out = kvevents(
        &[
            "decode",
            a.to_str().expect("path"),
            b.to_str().expect("path"),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf8");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    for (line, path) in lines.iter().zip([a, b]) {
        let want: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path.with_extension("json")).expect("read"))
                .expect("json");
        assert_eq!(line, &want);
    }
    assert_eq!(lines.len(), 2);
}

#[test]
fn a_bad_file_is_reported_and_the_rest_still_decode() {
    let good = shared().join("vectors/vllm-0.9.0/basic.msgpack");
    let payload = std::fs::read(&good).expect("read");
    let dir = std::env::temp_dir().join(format!("kvevents-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let bad = dir.join("cut.msgpack");
    std::fs::write(&bad, &payload[..payload.len() / 2]).expect("write");
    let out = kvevents(
        &[
            "decode",
            bad.to_str().expect("p"),
            "-",
            "/nonexistent/x.msgpack",
        ],
        Some(&payload),
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cut.msgpack: byte"), "{stderr}");
    assert!(
        stderr.contains("input ends in the middle of a value"),
        "{stderr}"
    );
    assert!(
        stderr.contains("/nonexistent/x.msgpack: cannot read"),
        "{stderr}"
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn encode_reproduces_the_release_bytes() {
    for release in ["0.9.0", "0.14.0", "0.24.0", "0.33.0"] {
        let dir = shared().join(format!("vectors/vllm-{release}"));
        let json = dir.join("basic.json");
        let out = kvevents(
            &["encode", "--release", release, json.to_str().expect("p")],
            None,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            out.stdout,
            std::fs::read(dir.join("basic.msgpack")).expect("read")
        );
    }
}

#[test]
fn encode_refuses_a_field_the_release_lacks_unless_lenient() {
    let json = shared().join("vectors/vllm-0.33.0/newest_fields.json");
    let path = json.to_str().expect("p");
    let out = kvevents(&["encode", "--release", "0.20.0", path], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("vLLM 0.20.0 has no field"));
    let out = kvevents(&["encode", "--release", "0.20.0", "--lenient", path], None);
    assert!(out.status.success());
    let out = kvevents(&["encode", "--release", "0.8.0", path], None);
    assert_eq!(
        out.status.code(),
        Some(2),
        "clap rejects an unknown release"
    );
}
