//! What the recording tests share: the program, and a scratch directory of their own.

use std::path::PathBuf;
use std::process::Command;

/// The `kvevents` binary under test.
pub(crate) fn kvevents() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvevents"))
}

/// An empty directory for `name`, this process's own.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvevents-rec-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}
