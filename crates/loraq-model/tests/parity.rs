//! Parity with transformers: the option logits of tiny random Qwen3.5 (both layer
//! types), Qwen3.5 + PEFT LoRA and dense Qwen3 models, computed by transformers
//! (and PEFT) in float32 on bf16-representable weights. Fixtures and the script that
//! made them: tests/data/model/, scripts/model_oracle.py.
//!
//! Tolerance: both sides compute in f32 from identical weights; they differ only in
//! summation order (matmul blocking, tiled attention, and the two chunked delta
//! rules' orders of work, equal in exact arithmetic). Over four layers
//! that moves logits of magnitude ~1 by ~1e-6; we allow 1e-4 relative to the
//! record's largest |logit| (at least 1), the bound the issue sets.

use loraq_model::{LinearBackend, LoadOptions, Model, ScoreOptions, read_records, score_records};
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
struct Expected {
    id: String,
    logits: Vec<f64>,
}

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/model")
}

fn check(model_dir: &str, adapter: Option<&str>, expected_file: &str) {
    check_with(model_dir, adapter, expected_file, LinearBackend::Dense);
}

fn check_with(model_dir: &str, adapter: Option<&str>, expected_file: &str, backend: LinearBackend) {
    let dir = data();
    let adapter_dir = adapter.map(|a| dir.join(a));
    let model = Model::load(
        &dir.join(model_dir),
        adapter_dir.as_deref(),
        &LoadOptions {
            backend,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    if adapter.is_some() {
        // Every linear of 2 linear-attention + 2 attention layers: 5 + 4 per mixer, 3 MLP.
        assert_eq!(model.adapted_modules(), 2 * 5 + 2 * 4 + 4 * 3);
    }
    let records_path = dir.join("records.jsonl");
    let records = read_records(&records_path).unwrap();
    let answers = score_records(
        &model,
        &records,
        &ScoreOptions {
            source: records_path,
            on_record: None,
        },
    )
    .unwrap();
    let expected: Vec<Expected> = std::fs::read_to_string(dir.join(expected_file))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(answers.len(), expected.len());
    let mut worst = 0f64;
    for (got, want) in answers.iter().zip(&expected) {
        assert_eq!(got.id, want.id);
        let scale = want.logits.iter().fold(1f64, |m, v| m.max(v.abs()));
        for (g, w) in got.logits.iter().zip(&want.logits) {
            let rel = (g - w).abs() / scale;
            worst = worst.max(rel);
            assert!(
                rel <= 1e-4,
                "{expected_file} {}: got {:?}, transformers {:?}",
                got.id,
                got.logits,
                want.logits
            );
        }
    }
    eprintln!("{expected_file} ({backend:?}): worst relative difference {worst:.2e}");
}

#[test]
fn qwen3_5_matches_transformers() {
    check("qwen3_5", None, "expected-qwen3_5.jsonl");
}

#[test]
fn qwen3_5_with_peft_lora_matches_peft() {
    check(
        "qwen3_5",
        Some("qwen3_5-lora"),
        "expected-qwen3_5-lora.jsonl",
    );
}

#[test]
fn qwen3_dense_matches_transformers() {
    check("qwen3", None, "expected-qwen3.jsonl");
}

/// loraq-kernels' fused linear (bf16 base, bf16 factors) in place of the dense one:
/// the same bound against the same transformers/PEFT logits.
#[test]
fn qwen3_5_with_peft_lora_on_kernels_linear_matches_peft() {
    check_with(
        "qwen3_5",
        Some("qwen3_5-lora"),
        "expected-qwen3_5-lora.jsonl",
        LinearBackend::Kernels,
    );
}

#[test]
fn qwen3_dense_on_kernels_linear_matches_transformers() {
    check_with(
        "qwen3",
        None,
        "expected-qwen3.jsonl",
        LinearBackend::Kernels,
    );
}
