//! Input statistics (`loraq run --collect-stats`) against transformers: the mean
//! over all tokens of x_k^2 and the largest |x| at the input of every linear of the
//! tiny random Qwen3.5 fixture, with and without its PEFT LoRA, computed by forward
//! pre-hooks in float64 (tests/data/model/calibration-*.safetensors,
//! scripts/calibration_oracle.py).
//!
//! Tolerance: both sides compute the activations in f32 from identical weights and
//! differ only in summation order (~1e-6 relative on activations of magnitude ~1,
//! see parity.rs); a mean of squares doubles that relative error, and ours is
//! rounded to f32 at the end (6e-8). We allow 1e-4 relative to the module's largest
//! mean square, the parity tests' bound.

use loraq_io::{Checkpoint, read_activation_stats, write_activation_stats};
use loraq_model::{LinearBackend, LoadOptions, Model, ScoreOptions, read_records, score_records};
use loraq_quant::ActivationQuantKind;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/model")
}

/// The oracle's float64 means, absolute maxima and its token / record counts.
struct Expected {
    means: BTreeMap<String, Vec<f64>>,
    abs_max: BTreeMap<String, f64>,
    tokens: u64,
    records: u64,
}

fn expected(file: &str) -> Expected {
    let path = data().join(file);
    let ckpt = Checkpoint::open(&path).unwrap();
    let mut means = BTreeMap::new();
    let mut abs_max = BTreeMap::new();
    for info in ckpt.tensors() {
        assert_eq!(info.dtype, loraq_io::DType::F64, "{}", info.name);
        let values: Vec<f64> = ckpt
            .bytes(&info.name)
            .unwrap()
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        if let Some(module) = info.name.strip_suffix(".input_abs_max") {
            abs_max.insert(module.to_string(), values[0]);
            continue;
        }
        let module = info.name.strip_suffix(".input_sq_mean").unwrap();
        means.insert(module.to_string(), values);
    }
    let meta = ckpt.shard_metadata(0);
    Expected {
        means,
        abs_max,
        tokens: meta["tokens"].parse().unwrap(),
        records: meta["records"].parse().unwrap(),
    }
}

fn collect(
    adapter: Option<&str>,
    backend: LinearBackend,
    act_quant: ActivationQuantKind,
) -> loraq_io::ActivationStats {
    let dir = data();
    let adapter_dir = adapter.map(|a| dir.join(a));
    let model = Model::load(
        &dir.join("qwen3_5"),
        adapter_dir.as_deref(),
        &LoadOptions {
            backend,
            act_quant,
            collect_input_stats: true,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let records_path = dir.join("records.jsonl");
    let records = read_records(&records_path).unwrap();
    score_records(
        &model,
        &records,
        &ScoreOptions {
            source: records_path,
            on_record: None,
        },
    )
    .unwrap();
    model.input_stats().unwrap()
}

fn check(adapter: Option<&str>, backend: LinearBackend, expected_file: &str) {
    let stats = collect(adapter, backend, ActivationQuantKind::None);
    let oracle = expected(expected_file);
    assert_eq!(
        (stats.tokens, stats.records),
        (oracle.tokens, oracle.records)
    );
    let names: Vec<&String> = stats.input_sq_mean.keys().collect();
    assert_eq!(names, oracle.means.keys().collect::<Vec<_>>(), "module set");
    assert_eq!(
        stats.input_abs_max.keys().collect::<Vec<_>>(),
        oracle.abs_max.keys().collect::<Vec<_>>(),
        "modules with an absolute maximum"
    );
    let mut worst = 0f64;
    for (module, want) in &oracle.abs_max {
        let got = f64::from(stats.input_abs_max[module]);
        let rel = (got - want).abs() / want;
        worst = worst.max(rel);
        assert!(
            rel <= 1e-4,
            "{expected_file} {module} input_abs_max: got {got}, transformers {want}"
        );
    }
    for (module, want) in &oracle.means {
        let got = &stats.input_sq_mean[module];
        assert_eq!(got.len(), want.len(), "{module}");
        let scale = want.iter().fold(0f64, |m, v| m.max(*v));
        for (k, (g, w)) in got.iter().zip(want).enumerate() {
            let rel = (f64::from(*g) - w).abs() / scale;
            worst = worst.max(rel);
            assert!(
                rel <= 1e-4,
                "{expected_file} {module}[{k}]: got {g}, transformers {w}"
            );
        }
    }
    eprintln!("{expected_file} ({backend:?}): worst relative difference {worst:.2e}");
}

#[test]
fn input_sq_means_match_transformers_hooks() {
    check(
        None,
        LinearBackend::Dense,
        "calibration-qwen3_5.safetensors",
    );
}

#[test]
fn input_sq_means_with_lora_match_peft_hooks_on_kernels_linear() {
    check(
        Some("qwen3_5-lora"),
        LinearBackend::Kernels,
        "calibration-qwen3_5-lora.safetensors",
    );
}

/// The statistics describe the activation entering the module, before the
/// activation fake-quant the base path applies: layer 0's input projections read
/// the normed embeddings, which no quantization has touched yet, so their
/// statistics are bit-identical with and without `--act-quant fp8`, while the
/// layers after the first quantized matmul see different activations.
#[test]
fn input_stats_are_taken_before_activation_fake_quant() {
    let plain = collect(None, LinearBackend::Kernels, ActivationQuantKind::None);
    let quant = collect(
        None,
        LinearBackend::Kernels,
        ActivationQuantKind::Fp8PerToken,
    );
    let first = "model.layers.0.linear_attn.in_proj_qkv";
    assert_eq!(plain.input_sq_mean[first], quant.input_sq_mean[first]);
    let later = "model.layers.3.mlp.down_proj";
    assert_ne!(plain.input_sq_mean[later], quant.input_sq_mean[later]);
}

/// What `loraq run --collect-stats` writes reads back as the format says.
#[test]
fn collected_stats_round_trip_through_the_calibration_file() {
    let stats = collect(None, LinearBackend::Kernels, ActivationQuantKind::None);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calibration.safetensors");
    write_activation_stats(&path, &stats).unwrap();
    assert_eq!(read_activation_stats(&path).unwrap(), stats);
}

/// A model loaded without statistics has none to give.
#[test]
fn no_stats_unless_asked_for() {
    let model = Model::load(&data().join("qwen3_5"), None, &LoadOptions::default()).unwrap();
    assert!(model.input_stats().is_none());
}
