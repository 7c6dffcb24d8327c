//! Helpers shared by the CLI integration tests: run the `loraq` binary and read its
//! outcome.
#![allow(dead_code)] // each test file uses its own subset

use std::path::Path;
use std::process::{Command, Output};

/// Runs the `loraq` binary built for these tests with `args`.
pub fn loraq(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_loraq"))
        .args(args)
        .output()
        .expect("run loraq")
}

/// The run's stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts the run succeeded (showing its stderr otherwise) and hands it back.
pub fn ok(o: Output) -> Output {
    assert!(o.status.success(), "{}", stderr(&o));
    o
}

/// A temporary path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}
