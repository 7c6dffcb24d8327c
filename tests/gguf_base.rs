//! A GGUF base read by the commands that read bases: `loraq run` on llama.cpp's f32
//! GGUF of the test model (tests/data/gguf/qwen3_5-f32.gguf, convert_hf_to_gguf.py,
//! scripts/gguf_lora_fixture.py base) against `loraq run` on the safetensors it was
//! converted from, with and without an adapter; `inspect` and `quant-error` on it.

mod common;

use common::{loraq, ok, s, stderr};
use std::path::{Path, PathBuf};

fn data(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(path)
}

fn logits(path: &Path) -> Vec<(String, Vec<f64>)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let logits = v["logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            (v["id"].as_str().unwrap().to_string(), logits)
        })
        .collect()
}

/// Largest |logit difference| allowed between `loraq run` on the GGUF (f32 weights)
/// and on the bf16 safetensors it came from. The weights are the same numbers (the
/// GGUF reads back as the checkpoint, value for value: crates/loraq-gguf/tests/
/// gguf_base.rs), but bf16 and f32 weights take different linear paths (the bf16
/// kernel against the f32 matmul), which sum in another order; against an f32 copy
/// of the same checkpoint the answers are byte-identical (checked below).
const LOGIT_TOLERANCE: f64 = 1e-4;

/// The test model with every tensor widened to f32, written by loraq-io.
fn f32_copy(dir: &Path) -> PathBuf {
    let source = data("model/qwen3_5");
    let ckpt = loraq_io::Checkpoint::open(&source).unwrap();
    let out = dir.join("qwen3_5-f32");
    std::fs::create_dir(&out).unwrap();
    std::fs::copy(source.join("config.json"), out.join("config.json")).unwrap();
    let tensors: Vec<(loraq_io::TensorSpec, Vec<u8>)> = ckpt
        .tensors()
        .map(|t| {
            let bytes = ckpt
                .read_f32(&t.name)
                .unwrap()
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            (
                loraq_io::TensorSpec::new(t.name.clone(), loraq_io::DType::F32, t.shape.clone()),
                bytes,
            )
        })
        .collect();
    let refs: Vec<(loraq_io::TensorSpec, &[u8])> = tensors
        .iter()
        .map(|(s, b)| (s.clone(), b.as_slice()))
        .collect();
    let metadata = std::collections::BTreeMap::from([("format".to_string(), "pt".to_string())]);
    loraq_io::write_safetensors_file(&out.join("model.safetensors"), &refs, &metadata).unwrap();
    out
}

#[test]
fn run_on_the_gguf_base_matches_run_on_the_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let records = data("model/records.jsonl");
    let widened = f32_copy(dir.path());
    for adapter in [None, Some(data("model/qwen3_5-lora"))] {
        let mut outs = Vec::new();
        let mut texts = Vec::new();
        for (name, model) in [
            ("safetensors", data("model/qwen3_5")),
            ("gguf", data("gguf/qwen3_5-f32.gguf")),
            ("f32", widened.clone()),
        ] {
            let out = dir
                .path()
                .join(format!("{name}-{}.jsonl", adapter.is_some()));
            let mut args = vec![
                "run",
                "--model",
                s(&model),
                "--records",
                s(&records),
                "--out",
                s(&out),
            ];
            if let Some(a) = &adapter {
                args.extend(["--adapter", s(a)]);
            }
            ok(loraq(&args));
            outs.push(logits(&out));
            texts.push(std::fs::read_to_string(&out).unwrap());
        }
        assert_eq!(
            texts[1], texts[2],
            "the GGUF and the f32 safetensors give other answers"
        );
        assert_eq!(outs[0].len(), outs[1].len());
        let mut max = 0f64;
        for ((id, a), (id2, b)) in outs[0].iter().zip(&outs[1]) {
            assert_eq!(id, id2);
            max = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(max, f64::max);
        }
        eprintln!(
            "run on the f32 GGUF (adapter: {}): identical to the f32 safetensors; against the bf16 safetensors max |d logit| {max:.3e}",
            adapter.is_some()
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

#[test]
fn a_q8_0_gguf_base_decodes_within_q8_0_rounding_of_the_checkpoint() {
    // convert_hf_to_gguf.py --outtype q8_0: Q8_0 where rows are whole blocks of 32,
    // F16 for ffn_down (48-wide rows), F32 for norms (gguf_lora_fixture.py base).
    let gguf = data("gguf/qwen3_5-q8_0.gguf");
    let base = loraq_quant::QuantizedBase::open(&gguf).unwrap();
    let original = loraq_io::Checkpoint::open(data("model/qwen3_5")).unwrap();
    let mut checked = 0;
    for w in base.weights() {
        let ours = base.read_weight_f32(&w.name).unwrap();
        let theirs = original.read_f32(&w.name).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{}", w.name);
        // Q8_0 stores round(x / d) with d = max|x| / 127 per block of 32, d in f16:
        // |error| <= d / 2 plus 127 x the f16 rounding of d, under 0.6 d <= 0.6 x
        // max|x| / 127 for the tensor; F16 rounds far closer. A value-head order left
        // permuted would put other heads' weights here, off by the weights' own size.
        let max_abs = theirs.iter().fold(0f32, |m, x| m.max(x.abs()));
        let bound = 0.6 * max_abs / 127.0;
        let err = ours
            .iter()
            .zip(&theirs)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= bound, "{}: max |error| {err} above {bound}", w.name);
        checked += 1;
    }
    assert_eq!(
        checked, 32,
        "the 30 linear weights, the embeddings and lm_head"
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q8_0.jsonl");
    ok(loraq(&[
        "run",
        "--model",
        s(&gguf),
        "--records",
        s(&data("model/records.jsonl")),
        "--out",
        s(&out),
    ]));
    assert_eq!(logits(&out).len(), 9);
}
