//! A GGUF base read by the commands that read bases: `loraq run` on llama.cpp's f32
//! GGUF of the test model (tests/data/gguf/qwen3_5-f32.gguf, convert_hf_to_gguf.py,
//! scripts/gguf_lora_fixture.py base) against `loraq run` on the safetensors it was
//! converted from, with and without an adapter; `inspect` and `quant-error` on it.

mod common;

use common::{loraq, ok, s, stderr};
use std::path::{Path, PathBuf};

fn data(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(path)
}

fn logits(path: &Path) -> Vec<(String, Vec<f64>)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let logits = v["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            (v["id"].as_str().unwrap().to_string(), logits)
        })
        .collect()
}

/// Largest |logit difference| allowed between `loraq run` on the GGUF and on the
/// safetensors. The weights are the same f32 numbers (bf16 widened; the norms' `+ 1`
/// undone exactly, docs/gguf.md), but `A_log` comes back as `ln(-ssm_a)` with
/// `ssm_a = -exp(A_log)` rounded to f32, within an ulp or two of the original, and that
/// decay moves the logits by a few f32 ulps at most.
const LOGIT_TOLERANCE: f64 = 1e-4;

#[test]
fn run_on_the_gguf_base_matches_run_on_the_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let records = data("model/records.jsonl");
    for adapter in [None, Some(data("model/qwen3_5-lora"))] {
        let mut outs = Vec::new();
        for (name, model) in [("safetensors", data("model/qwen3_5")), ("gguf", data("gguf/qwen3_5-f32.gguf"))] {
            let out = dir.path().join(format!("{name}-{}.jsonl", adapter.is_some()));
            let mut args = vec!["run", "--model", s(&model), "--records", s(&records), "--out", s(&out)];
            if let Some(a) = &adapter {
                args.extend(["--adapter", s(a)]);
            }
            ok(loraq(&args));
            outs.push(logits(&out));
        }
        assert_eq!(outs[0].len(), outs[1].len());
        let mut max = 0f64;
        let mut exact = 0usize;
        for ((id, a), (id2, b)) in outs[0].iter().zip(&outs[1]) {
            assert_eq!(id, id2);
            let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
            max = max.max(d);
            exact += usize::from(d == 0.0);
        }
        eprintln!(
            "run on GGUF vs safetensors (adapter: {}): max |d logit| {max:.3e}, {exact} of {} records identical",
            adapter.is_some(),
            outs[0].len()
        );
        assert!(max <= LOGIT_TOLERANCE, "max |d logit| {max}");
    }
}

#[test]
fn inspect_and_quant_error_read_a_gguf_base() {
    let gguf = data("gguf/qwen3_5-f32.gguf");
    let o = ok(loraq(&["inspect", s(&gguf), "--json"]));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let text = v.to_string();
    assert!(text.contains("qwen3_5_text"), "{text}");
    let o = loraq(&["quant-error", "--base", s(&gguf), "--scheme", "fp8-tensor"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A GGUF adapter is not a base.
    let o = loraq(&["inspect", s(&data("gguf/qwen3-lora-converter.gguf"))]);
    assert!(!o.status.success());
}
