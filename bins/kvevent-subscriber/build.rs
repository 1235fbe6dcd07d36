//! Records the git commit the binary is built from, for `--version`: `KVEVENT_GIT_COMMIT` when
//! set (an image build, where `.git` is not copied in), else `git rev-parse`, else "unknown"
//! (e.g. a source tarball).

fn main() {
    println!("cargo:rerun-if-env-changed=KVEVENT_GIT_COMMIT");
    if let Ok(commit) = std::env::var("KVEVENT_GIT_COMMIT")
        && !commit.trim().is_empty()
    {
        println!("cargo:rustc-env=KVEVENT_GIT_COMMIT={}", commit.trim());
        return;
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=KVEVENT_GIT_COMMIT={commit}");
    println!("cargo:rerun-if-changed=../../.git/HEAD");
    println!("cargo:rerun-if-changed=../../.git/refs/heads");
}
