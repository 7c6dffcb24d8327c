//! `loraq run --collect-stats`: the binary writes the calibration file the format
//! describes, with the per-module input mean squares transformers' hooks compute on
//! the same fixture and records (scripts/calibration_oracle.py), and answers that
//! are the same with and without the flag.

mod common;

use common::{loraq, s};
use std::path::{Path, PathBuf};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/model")
}

#[test]
fn collect_stats_writes_the_hooks_means_and_leaves_answers_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let (model, records) = (data().join("qwen3_5"), data().join("records.jsonl"));
    let stats = dir.path().join("calibration.safetensors");
    let (with, without) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    let run = |out: &Path, extra: &[&str]| {
        let mut args = vec!["run", "--model", s(&model), "--records", s(&records)];
        args.extend_from_slice(&["--out", s(out)]);
        args.extend_from_slice(extra);
        let o = loraq(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    run(&with, &["--collect-stats", s(&stats)]);
    run(&without, &[]);
    assert_eq!(
        std::fs::read(&with).unwrap(),
        std::fs::read(&without).unwrap()
    );

    let got = loraq_io::read_activation_stats(&stats).unwrap();
    let oracle =
        loraq_io::Checkpoint::open(data().join("calibration-qwen3_5.safetensors")).unwrap();
    assert_eq!(got.tokens.to_string(), oracle.shard_metadata(0)["tokens"]);
    assert_eq!(got.records.to_string(), oracle.shard_metadata(0)["records"]);
    assert_eq!(
        got.input_sq_mean.len() + got.input_abs_max.len(),
        oracle.len()
    );
    for info in oracle.tensors() {
        if let Some(module) = info.name.strip_suffix(".input_abs_max") {
            let want = oracle.read_f32(&info.name).unwrap()[0];
            let got = got.abs_max(module).unwrap();
            assert!(
                (got - want).abs() <= 1e-4 * want,
                "{module}: {got} vs {want}"
            );
            continue;
        }
        let module = info.name.strip_suffix(".input_sq_mean").unwrap();
        let want: Vec<f64> = oracle
            .bytes(&info.name)
            .unwrap()
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let got = got
            .module(module)
            .unwrap_or_else(|| panic!("{module} missing"));
        let scale = want.iter().fold(0f64, |m, v| m.max(*v));
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-4 * scale,
                "{module}: {g} vs {w}"
            );
        }
    }
    // Only the statistics file and the two answer files: no temporary left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
}

#[test]
fn collect_stats_into_a_missing_directory_fails_before_running() {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("no/such/dir/calibration.safetensors");
    let o = loraq(&[
        "run",
        "--model",
        s(&data().join("qwen3_5")),
        "--records",
        s(&data().join("records.jsonl")),
        "--out",
        s(&dir.path().join("answers.jsonl")),
        "--collect-stats",
        s(&stats),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("calibration.safetensors"), "{err}");
    assert!(!stats.exists());
    assert!(!dir.path().join("answers.jsonl").exists());
}
