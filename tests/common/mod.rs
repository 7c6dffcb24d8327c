//! Helpers shared by the CLI integration tests: run the `loraq` binary and read its
//! outcome.
#![allow(dead_code)] // each test file uses its own subset

use loraq_io::{Checkpoint, DType, TensorSpec, write_safetensors_file};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The committed test model and records (tests/data/model).
pub fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/model")
}

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

/// Refused with status 2, the message holding every needle.
pub fn assert_refused(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "should be refused: {err}");
    for needle in needles {
        assert!(
            err.contains(needle),
            "message should name {needle:?}: {err}"
        );
    }
}

/// The arguments of `loraq run --model model --records records --out out`.
pub fn run_args<'a>(model: &'a Path, records: &'a Path, out: &'a Path) -> Vec<&'a str> {
    vec![
        "run",
        "--model",
        s(model),
        "--records",
        s(records),
        "--out",
        s(out),
    ]
}

/// `loraq extract --merged merged --base base --out out --json` and `extra`.
pub fn extract(merged: &Path, base: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "extract",
        "--merged",
        s(merged),
        "--base",
        s(base),
        "--out",
        s(out),
        "--json",
    ];
    args.extend_from_slice(extra);
    loraq(&args)
}

/// [`extract`], asserted to succeed; its JSON report.
pub fn extract_ok(merged: &Path, base: &Path, out: &Path, extra: &[&str]) -> serde_json::Value {
    let o = ok(extract(merged, base, out, extra));
    serde_json::from_slice(&o.stdout).expect("--json prints the report")
}

/// A temporary path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

/// The Python interpreter of the oracle environment (torch, transformers, peft,
/// compressed-tensors from scripts/requirements-clients.txt), named by
/// `LORAQ_ORACLE_PYTHON`; `.ci/run` installs it and sets the variable. Tests that load
/// loraq's outputs with the real clients call this: without the variable they are
/// skipped with a note on a developer's machine, and fail under CI (`CI` set), so a
/// missing install step cannot pass unnoticed.
pub fn oracle_python() -> Option<std::path::PathBuf> {
    match std::env::var_os("LORAQ_ORACLE_PYTHON") {
        Some(p) if !p.is_empty() => Some(p.into()),
        _ if std::env::var_os("CI").is_some() => {
            panic!("LORAQ_ORACLE_PYTHON is not set under CI: .ci/run must install the clients")
        }
        _ => {
            eprintln!("skipped: LORAQ_ORACLE_PYTHON is not set (see .ci/run)");
            None
        }
    }
}

/// Runs `script` (a path under scripts/) with the oracle interpreter and `args`;
/// asserts it succeeded and returns its stdout.
pub fn run_oracle(python: &Path, script: &str, args: &[&str]) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python)
        .arg(root.join(script))
        .args(args)
        .current_dir(root)
        .output()
        .expect("run the oracle interpreter");
    assert!(
        out.status.success(),
        "{script} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A rewritten tensor: dtype, shape, bytes.
pub type Tensor = (DType, Vec<usize>, Vec<u8>);

/// Maps (name, dtype, shape, bytes) to the tensor to write, or None to drop it.
pub type Edit<'a> = &'a mut dyn FnMut(&str, DType, &[usize], &[u8]) -> Option<Tensor>;

/// Writes `dst` = every tensor of `src` through `edit` (None drops it) plus `extra`,
/// one model.safetensors (tensors sorted by name) with src's config.json.
pub fn rewrite(src: &Path, dst: &Path, edit: Edit<'_>, extra: Vec<(TensorSpec, Vec<u8>)>) {
    std::fs::create_dir_all(dst).unwrap();
    std::fs::copy(src.join("config.json"), dst.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(src).unwrap();
    let mut tensors: Vec<(TensorSpec, Vec<u8>)> = Vec::new();
    for info in ckpt.tensors() {
        let bytes = ckpt.bytes(&info.name).unwrap();
        if let Some((dtype, shape, bytes)) = edit(&info.name, info.dtype, &info.shape, bytes) {
            tensors.push((TensorSpec::new(info.name.clone(), dtype, shape), bytes));
        }
    }
    tensors.extend(extra);
    tensors.sort_by(|a, b| a.0.name.cmp(&b.0.name));
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    write_owned(&dst.join("model.safetensors"), &tensors, &metadata);
}

/// Writes `tensors` (each spec with its owned bytes, in the order given) and `metadata`
/// to the safetensors file `path`.
pub fn write_owned(
    path: &Path,
    tensors: &[(TensorSpec, Vec<u8>)],
    metadata: &BTreeMap<String, String>,
) {
    let refs: Vec<(TensorSpec, &[u8])> = tensors
        .iter()
        .map(|(s, b)| (s.clone(), b.as_slice()))
        .collect();
    write_safetensors_file(path, &refs, metadata).unwrap();
}
