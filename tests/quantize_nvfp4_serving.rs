//! `loraq quantize --scheme nvfp4` end to end on the tiny Qwen3.5 fixture: statistics
//! from `loraq run --collect-stats` become static activation scales (W4A4), `loraq
//! run --act-quant nvfp4` runs on them (and refuses a weight-only checkpoint), `loraq
//! inspect` shows both NVFP4 layouts, and compressed-tensors itself decompresses the
//! compressed-tensors layout to exactly the weights loraq decodes
//! (scripts/ct_nvfp4_decompress_oracle.py, skipped without LORAQ_ORACLE_PYTHON).

mod common;

use common::{loraq, ok, oracle_python, run_oracle, s, stderr};
use loraq_quant::QuantizedBase;
use std::path::{Path, PathBuf};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/model")
}

/// Collects statistics on the fixture and returns the calibration file.
fn collect_stats(dir: &Path) -> PathBuf {
    let stats = dir.join("stats.safetensors");
    ok(loraq(&[
        "run",
        "--model",
        s(&data().join("qwen3_5")),
        "--records",
        s(&data().join("records.jsonl")),
        "--out",
        s(&dir.join("collect.jsonl")),
        "--collect-stats",
        s(&stats),
    ]));
    stats
}

fn quantize(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let model = data().join("qwen3_5");
    let mut args = vec![
        "quantize",
        "--in",
        s(&model),
        "--out",
        s(&out),
        "--scheme",
        "nvfp4",
    ];
    args.extend_from_slice(extra);
    ok(loraq(&args));
    out
}

fn run_answers(model: &Path, out: &Path, act_quant: &str) -> std::process::Output {
    loraq(&[
        "run",
        "--model",
        s(model),
        "--records",
        s(&data().join("records.jsonl")),
        "--out",
        s(out),
        "--act-quant",
        act_quant,
    ])
}

/// The collected input absolute maxima become each quantized module's
/// `input_scale`, the run emulates W4A4 on them, and a weight-only checkpoint,
/// which has no static scale, is refused with exit status 2 naming the tensor.
#[test]
fn calibrated_nvfp4_has_input_scales_and_runs_w4a4() {
    let dir = tempfile::tempdir().unwrap();
    let stats = collect_stats(dir.path());
    let calibration = loraq_io::read_activation_stats(&stats).unwrap();
    let w4a4 = quantize(dir.path(), "w4a4", &["--calibration", s(&stats)]);
    let base = QuantizedBase::open(&w4a4).unwrap();
    let mut quantized = 0;
    for weight in base.weights() {
        let module = weight.name.trim_end_matches(".weight");
        let input_scale = format!("{module}.input_scale");
        if matches!(
            weight.stored,
            loraq_quant::StoredWeight::Nvfp4ModelOpt { .. }
        ) {
            let amax = calibration.abs_max(module).unwrap();
            let scale = base.checkpoint().read_f32(&input_scale).unwrap()[0];
            assert_eq!(scale, amax / 2688.0, "{module}");
            quantized += 1;
        } else {
            assert!(!base.checkpoint().contains(&input_scale), "{module}");
        }
    }
    assert!(quantized > 10, "{quantized} NVFP4 modules");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(w4a4.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization_config"]["quant_algo"], "NVFP4");

    let (plain, emulated) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    ok(run_answers(&w4a4, &plain, "none"));
    ok(run_answers(&w4a4, &emulated, "nvfp4"));
    assert_ne!(
        std::fs::read(&plain).unwrap(),
        std::fs::read(&emulated).unwrap(),
        "activation quantization changes the logits"
    );

    let w4a16 = quantize(dir.path(), "w4a16", &[]);
    let o = run_answers(&w4a16, &dir.path().join("c.jsonl"), "nvfp4");
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains("input_scale") && err.contains("--calibration"),
        "{err}"
    );
    assert!(!dir.path().join("c.jsonl").exists());
}

/// `loraq inspect` names each NVFP4 layout, counts its linears, and shows the
/// logical [out, in] shape next to the packed one.
#[test]
fn inspect_shows_both_nvfp4_layouts_with_logical_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let stats = collect_stats(dir.path());
    for (layout, format, packed) in [
        ("nvfp4-modelopt", "nvfp4 (modelopt)", "weight"),
        ("nvfp4-ct", "nvfp4 (compressed-tensors)", "weight_packed"),
    ] {
        let out = quantize(
            dir.path(),
            layout,
            &["--layout", layout, "--calibration", s(&stats)],
        );
        let o = ok(loraq(&["inspect", s(&out), "--json"]));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let count = v["linear_formats"][format].as_u64().unwrap();
        assert!(count > 10, "{layout}: {v}");
        assert_eq!(v["static_activation_scales"].as_u64().unwrap(), count);
        let down = v["modules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["block"] == "mlp" && m["module"] == "down_proj")
            .unwrap();
        // down_proj is [hidden 32, intermediate 48]: 24 bytes of codes per row.
        assert_eq!(down["count"], 4, "{layout}: {down}");
        assert_eq!(down["logical_shapes"], serde_json::json!([[32, 48]]));
        assert_eq!(down["shapes"], serde_json::json!([[32, 24]]));
        assert_eq!(down["formats"], serde_json::json!([format]));
        assert!(
            down["dtypes"].as_array().unwrap().contains(&"U8".into()),
            "{layout}: {down}; packed in {packed}"
        );
        let human = ok(loraq(&["inspect", s(&out)]));
        let text = String::from_utf8(human.stdout).unwrap();
        assert!(text.contains(&format!("{count} {format}")), "{text}");
        assert!(text.contains("W4A4") && text.contains("[32, 48]"), "{text}");
    }
}

/// compressed-tensors (the package vLLM and transformers load llm-compressor
/// checkpoints with) accepts loraq's compressed-tensors NVFP4 config and
/// decompresses every module to exactly the weights loraq decodes.
#[test]
fn compressed_tensors_decompresses_loraqs_nvfp4_to_the_weights_loraq_decodes() {
    let Some(python) = oracle_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let stats = collect_stats(dir.path());
    for (name, extra) in [
        ("w4a16", vec![]),
        ("w4a4", vec!["--calibration", s(&stats)]),
    ] {
        let mut args = vec!["--layout", "nvfp4-ct"];
        args.extend_from_slice(&extra);
        let out = quantize(dir.path(), name, &args);
        let decoded_dir = dir.path().join(format!("{name}-decoded"));
        let summary = run_oracle(
            &python,
            "scripts/ct_nvfp4_decompress_oracle.py",
            &[s(&out), s(&decoded_dir)],
        );
        let summary: serde_json::Value = serde_json::from_str(summary.trim()).unwrap();
        let base = QuantizedBase::open(&out).unwrap();
        let modules = summary["modules"].as_array().unwrap();
        assert!(modules.len() > 10, "{summary}");
        assert_eq!(
            summary["scheme"],
            if extra.is_empty() {
                "NVFP4A16"
            } else {
                "NVFP4"
            }
        );
        for module in modules {
            let module = module.as_str().unwrap();
            let ours = base.read_weight_f32(&format!("{module}.weight")).unwrap();
            let theirs: Vec<f32> = std::fs::read(decoded_dir.join(format!("{module}.f32")))
                .unwrap()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(ours.len(), theirs.len(), "{module}");
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{module}[{i}]: {a} vs {b}");
            }
        }
        // The skipped modules (in_proj_a / in_proj_b, lm_head, embeddings) are listed.
        let ignore = summary["ignore"].as_array().unwrap();
        assert!(ignore.contains(&"lm_head".into()), "{summary}");
    }
}
