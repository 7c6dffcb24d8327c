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

/// `loraq run` of `records` on the GGUF base `gguf` with `--backend backend` (and the
/// adapter, if any), answers to `out`; its stderr summary.
fn run_on_backend(
    gguf: &Path,
    records: &Path,
    out: &Path,
    backend: &str,
    adapter: Option<&PathBuf>,
) -> String {
    let mut args = vec![
        "run",
        "--model",
        s(gguf),
        "--records",
        s(records),
        "--out",
        s(out),
        "--backend",
        backend,
    ];
    if let Some(a) = adapter {
        args.extend(["--adapter", s(a)]);
    }
    stderr(&ok(loraq(&args)))
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

/// The linear weights' GGUF names (the converter's, for both architectures).
const GGUF_LINEARS: [&str; 13] = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_qkv",
    "attn_gate",
    "ssm_alpha",
    "ssm_beta",
    "ssm_out",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ssm_in",
];

/// The block types of 32 elements loraq quantizes bit-exactly as ggml does (the test
/// models' rows are 32 or 48 wide, too narrow for the 256-element K types; the K types
/// run through the same loader and are checked kernel by kernel in loraq-kernels).
const RETYPES: [loraq_quant::ggml::GgmlType; 6] = {
    use loraq_quant::ggml::GgmlType as G;
    [G::Q4_0, G::Q5_1, G::IQ4_NL, G::Q8_0, G::Q4_1, G::Q5_0]
};

/// A copy of the GGUF `source` with its decoder layers' linear weights requantized,
/// the `i`-th such weight whose rows are whole blocks of 32 to `RETYPES[i % 6]` (the
/// others as they are): a GGUF base of every 32-element block type, in llama.cpp's
/// names and value-head order. Returns how many weights were requantized.
fn retyped(source: &Path, out: &Path) -> usize {
    use loraq_gguf::{GgufFile, GgufWriter};
    let file = GgufFile::open(source).unwrap();
    let mut writer = GgufWriter::new();
    for (key, value) in file.metadata() {
        if !key.starts_with("GGUF.") && key != "general.alignment" {
            writer.add_metadata(key.clone(), value.clone()).unwrap();
        }
    }
    let mut requantized = 0;
    for t in file.tensors() {
        let bytes = file.tensor_bytes(&t.name).unwrap().to_vec();
        let shape = t.shape();
        let is_linear = t.name.starts_with("blk.")
            && t.name.ends_with(".weight")
            && GGUF_LINEARS
                .iter()
                .any(|l| t.name.contains(&format!(".{l}.")));
        let (out_features, in_features) = (shape[0], *shape.last().unwrap());
        if !(is_linear && shape.len() == 2 && in_features % 32 == 0) {
            writer
                .add_tensor(&t.name, t.ggml_type, &shape, bytes)
                .unwrap();
            continue;
        }
        let values =
            loraq_quant::ggml::dequantize(&t.name, t.ggml_type, out_features, in_features, &bytes)
                .unwrap();
        let ggml_type = RETYPES[requantized % RETYPES.len()];
        let weight = loraq_quant::GgmlWeight::quantize(
            &t.name,
            ggml_type,
            out_features,
            in_features,
            &values,
        )
        .unwrap();
        writer
            .add_tensor(&t.name, ggml_type, &shape, weight.data)
            .unwrap();
        requantized += 1;
    }
    writer.write(out).unwrap();
    requantized
}

fn max_abs_diff(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut max = 0f64;
    for ((id, x), (id2, y)) in a.iter().zip(b) {
        assert_eq!(id, id2);
        assert_eq!(x.len(), y.len());
        max = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(max, f64::max);
    }
    max
}

/// Largest |logit difference| allowed between a GGUF base whose block-type linears run
/// in their type on the fused CPU kernel (dequantized in the loop) and the same base
/// decoded to f32 once (`--backend dense`, candle's matmul). The decoded weights are
/// the same f32 values bit for bit, but the products are not: the fused kernel sums
/// in its own order and (AVX-512) multiplies each step's sum of code values times
/// activations by the scales once, adding Q4_K / Q5_K's minimums through per-group
/// activation sums (crates/loraq-kernels' `ggml_fused_matches_reference_and_the_
/// decoded_weight` holds both within 2^-12 of `sum |w x|` of the f64 sum): a few f32
/// ulps per dot product carried through the layers.
const QUANTIZED_VS_DECODED_TOLERANCE: f64 = 1e-4;

#[test]
fn a_gguf_base_runs_its_block_types_on_the_kernels_as_the_decoded_weights() {
    let dir = tempfile::tempdir().unwrap();
    let records = data("model/records.jsonl");
    for (name, source, adapter) in [
        (
            "qwen35",
            data("gguf/qwen3_5-q8_0.gguf"),
            data("model/qwen3_5-lora"),
        ),
        (
            "qwen3",
            data("gguf/qwen3-q8_0.gguf"),
            data("gguf/qwen3-lora"),
        ),
    ] {
        let gguf = dir.path().join(format!("{name}-retyped.gguf"));
        let requantized = retyped(&source, &gguf);
        assert!(requantized >= RETYPES.len(), "{name}: {requantized}");
        let base = loraq_quant::QuantizedBase::open(&gguf).unwrap();
        let in_blocks = base
            .weights()
            .filter(|w| matches!(w.stored, loraq_quant::StoredWeight::Ggml { .. }))
            .count();
        // Every requantized weight stays in blocks, qwen35's out_proj too, whose 4
        // value heads of 8 columns cut through its blocks of 32: it is kept in GGUF's
        // column order and runs on the gathered input.
        assert_eq!(in_blocks, requantized, "{name}");
        let gathered = base
            .weights()
            .filter(|w| w.input_gather().is_some())
            .count();
        assert_eq!(gathered, if name == "qwen35" { 2 } else { 0 }, "{name}");
        for adapter in [None, Some(&adapter)] {
            let mut outs = Vec::new();
            // (`--backend reference` and `kernels` refuse this base: its F16 ffn_down
            // has no kernel, docs/gguf.md.)
            for backend in ["auto", "dense"] {
                let out = dir
                    .path()
                    .join(format!("{name}-{backend}-{}.jsonl", adapter.is_some()));
                let summary = run_on_backend(&gguf, &records, &out, backend, adapter);
                if backend == "auto" {
                    // Every block-type linear (and the bf16 adapter) on the fused kernel.
                    assert!(
                        summary.contains(&format!("{in_blocks} cpu")),
                        "{name}: {summary}"
                    );
                }
                outs.push(logits(&out));
            }
            assert_eq!(outs[0].len(), 9);
            let max = max_abs_diff(&outs[0], &outs[1]);
            eprintln!(
                "{name} (adapter: {}): fused kernel vs dense: max |d logit| {max:.3e}",
                adapter.is_some()
            );
            assert!(
                max <= QUANTIZED_VS_DECODED_TOLERANCE,
                "{name} vs dense: {max}"
            );
        }
        // --act-quant ggml quantizes each block-type linear's activations as
        // llama.cpp's CPU backend does; it runs and changes the answers.
        let out = dir.path().join(format!("{name}-act-ggml.jsonl"));
        ok(loraq(&[
            "run",
            "--model",
            s(&gguf),
            "--records",
            s(&records),
            "--out",
            s(&out),
            "--act-quant",
            "ggml",
        ]));
        assert_eq!(logits(&out).len(), 9);
    }
}

/// The demo pair (`loraq synth --preset demo --seed 0`: Qwen3.5, hidden 512, 4 key
/// heads and 8 value heads of 64) with the demo tokenizer, its base written by `loraq
/// quantize --scheme gguf-q4_k_m`: every `out_proj` has 512 input columns, two Q4_K /
/// Q6_K blocks of 256 per row, and GGUF's value-head order puts the checkpoint's heads
/// 0, 2, 4, 6 in the first block: the heads cut through the blocks. Returns the GGUF
/// and the true adapter (rank 32 on every linear, `out_proj` included).
fn demo_q4_k_m(dir: &Path) -> (PathBuf, PathBuf) {
    let synth = dir.join("demo");
    ok(loraq(&[
        "synth",
        "--preset",
        "demo",
        "--seed",
        "0",
        "--out",
        s(&synth),
    ]));
    let tokenizer =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("data/demo-model/base/tokenizer.json");
    std::fs::copy(tokenizer, synth.join("base/tokenizer.json")).unwrap();
    let gguf = dir.join("demo-q4_k_m.gguf");
    ok(loraq(&[
        "quantize",
        "--in",
        s(&synth.join("base")),
        "--scheme",
        "gguf-q4_k_m",
        "--out",
        s(&gguf),
    ]));
    (gguf, synth.join("true-adapter"))
}

/// Deterministic values in about `[-1, 1)`.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Bound on the difference between the kept `out_proj` run on the fused kernel (its
/// input gathered into GGUF's column order) and the f64 product of the decoded weight
/// in the checkpoint's order, per output, in units of the sum of the magnitudes of its
/// terms (`sum_k |w_jk x_k| + s sum_r |b_jr| sum_k |a_rk x_k|`): 2^-12, the fused
/// kernel's own bound against the f64 sum (loraq-kernels'
/// `ggml_fused_matches_reference_and_the_decoded_weight`); the dense f32 matmul of the
/// decoded weight sums 512 terms within 512 f32 ulps of the same sum, far inside it.
/// Only the summation order differs: the terms are the same products.
const GATHERED_RELATIVE_BOUND: f64 = 1.0 / 4096.0;

#[test]
fn a_q4_k_out_proj_cut_by_its_value_heads_runs_its_blocks_on_the_gathered_input() {
    use loraq_model::{DenseLinear, GatheredInputLinear, KernelLinear, LinearLayer};
    let dir = tempfile::tempdir().unwrap();
    let (gguf, adapter_dir) = demo_q4_k_m(dir.path());
    let base = loraq_quant::QuantizedBase::open(&gguf).unwrap();
    let file = loraq_gguf::GgufModel::open(&gguf).unwrap();
    let original = loraq_io::Checkpoint::open(dir.path().join("demo/base")).unwrap();
    let adapter = loraq_io::LoraAdapter::open_for(&adapter_dir, base.checkpoint()).unwrap();
    let layout = loraq_gguf::VHeadLayout {
        num_k_heads: 4,
        num_v_heads: 8,
        head_k_dim: 64,
        head_v_dim: 64,
    };
    let out_projs: Vec<&loraq_quant::LinearWeight> = base
        .weights()
        .filter(|w| w.name.ends_with("linear_attn.out_proj.weight"))
        .collect();
    assert_eq!(out_projs.len(), 6, "the demo's six linear-attention layers");
    for w in out_projs {
        let (out, inp) = (w.out_features, w.in_features);
        assert_eq!((out, inp), (512, 512));
        // Kept in its block type, in GGUF's column order.
        let loraq_quant::StoredWeight::Ggml {
            ggml_type,
            input_gather: Some(gather),
        } = &w.stored
        else {
            panic!("{}: {:?}", w.name, w.stored);
        };
        assert_eq!(gather, &layout.permutation(64), "{}", w.name);
        // Decoded, it is what decoding the GGUF tensor and undoing the converter's
        // column reorder gives, bit for bit (loraq-quant's decoder, loraq-gguf's
        // inverse permutation): the decoded path of every other command is unchanged.
        let suffix = &w.name[w.name.find("layers.").unwrap()..];
        let layer = suffix.split('.').nth(1).unwrap();
        let gguf_name = format!("blk.{layer}.ssm_out.weight");
        let (f, t) = file.tensor(&gguf_name).unwrap();
        assert_eq!(t.ggml_type, *ggml_type);
        let mut expected = loraq_quant::ggml::dequantize(
            &gguf_name,
            t.ggml_type,
            out,
            inp,
            f.tensor_bytes(&gguf_name).unwrap(),
        )
        .unwrap();
        let stored_order = expected.clone();
        loraq_gguf::vhead::gather_columns(&mut expected, inp, &layout.inverse_permutation(64));
        let decoded = base.read_weight_f32(&w.name).unwrap();
        assert!(
            decoded
                .iter()
                .zip(&expected)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}",
            w.name
        );
        // ... and that is the checkpoint's weight within the 4-bit rounding, where the
        // columns left in GGUF's order are other heads' weights.
        // (The synth checkpoint names its tensors model.language_model.layers.*.)
        let theirs = original
            .read_f32(&format!("model.language_model.{suffix}"))
            .unwrap();
        let norm = |v: &[f32], o: &[f32]| {
            v.iter()
                .zip(o)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum::<f64>()
                .sqrt()
        };
        let zero = vec![0f32; theirs.len()];
        let scale = norm(&theirs, &zero);
        assert!(norm(&decoded, &theirs) < 0.25 * scale, "{}", w.name);
        assert!(norm(&stored_order, &theirs) > scale, "{}", w.name);

        // The linear: the stored blocks on the fused CPU kernel with the input and
        // A's columns gathered, against the decoded weight and A as stored (dense f32
        // matmul) and their f64 product.
        let module = w.name.trim_end_matches(".weight");
        let info = adapter.module(module).unwrap();
        let rank = info.rank;
        let a = adapter.read_a_bf16(module).unwrap();
        let b = adapter.read_b_bf16(module).unwrap();
        let a_gathered: Vec<half::bf16> = a
            .chunks_exact(inp)
            .flat_map(|row| gather.iter().map(move |&c| row[c]))
            .collect();
        let scale_f32 = info.scale as f32;
        let kernel = |a: Vec<half::bf16>| {
            let lora =
                loraq_kernels::LoraAdapter::new(rank, inp, out, a, b.clone(), scale_f32).unwrap();
            let linear = loraq_kernels::Backend::Cpu(loraq_kernels::CpuOptions::default())
                .build(
                    base.quantized_weight(module).unwrap(),
                    Some(lora),
                    loraq_quant::ActivationQuant::None,
                )
                .unwrap();
            Box::new(KernelLinear::new(module.to_string(), linear))
        };
        let gathered =
            GatheredInputLinear::new(module.to_string(), kernel(a_gathered), gather).unwrap();
        let ungathered = kernel(a.clone());
        let dev = candle_core::Device::Cpu;
        let widen = |v: &[half::bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let (a32, b32) = (widen(&a), widen(&b));
        let dense = DenseLinear::new(
            module.to_string(),
            &candle_core::Tensor::from_slice(&decoded, (out, inp), &dev).unwrap(),
            Some(loraq_model::LoraFactorsF32 {
                a: candle_core::Tensor::from_slice(&a32, (rank, inp), &dev).unwrap(),
                b: candle_core::Tensor::from_slice(&b32, (out, rank), &dev).unwrap(),
                scale: info.scale,
            }),
        )
        .unwrap();
        // 3 tokens (the kernel's GEMV) and 20 (prefill panels and the tiled GEMM).
        for tokens in [3usize, 20] {
            let x = values(tokens * inp, tokens as u64);
            let run = |linear: &dyn LinearLayer| {
                let mut y = vec![f32::NAN; tokens * out];
                linear.forward(&x, tokens, &mut y).unwrap();
                y
            };
            let (y_gathered, y_dense, y_ungathered) =
                (run(&gathered), run(&dense), run(ungathered.as_ref()));
            let mut worst = 0f64;
            let mut ungathered_worst = 0f64;
            for t in 0..tokens {
                let xr = &x[t * inp..(t + 1) * inp];
                let low: Vec<(f64, f64)> = (0..rank)
                    .map(|r| {
                        let ar = &a32[r * inp..(r + 1) * inp];
                        xr.iter().zip(ar).fold((0.0, 0.0), |(s, m), (&p, &q)| {
                            let term = f64::from(p) * f64::from(q);
                            (s + term, m + term.abs())
                        })
                    })
                    .collect();
                for j in 0..out {
                    let wr = &decoded[j * inp..(j + 1) * inp];
                    let (mut y, mut m) = xr.iter().zip(wr).fold((0.0, 0.0), |(s, m), (&p, &q)| {
                        let term = f64::from(p) * f64::from(q);
                        (s + term, m + term.abs())
                    });
                    for (r, &(l, lm)) in low.iter().enumerate() {
                        let bj = f64::from(b32[j * rank + r]) * info.scale;
                        y += bj * l;
                        m += bj.abs() * lm;
                    }
                    let i = t * out + j;
                    for (name, got) in [("gathered", y_gathered[i]), ("dense", y_dense[i])] {
                        let ratio = (f64::from(got) - y).abs() / m;
                        assert!(
                            ratio <= GATHERED_RELATIVE_BOUND,
                            "{module} {name}, {tokens} tokens, output {i}: {got} vs {y} ({ratio:.3e} of sum |terms| {m:.3e})"
                        );
                        worst = worst.max(ratio);
                    }
                    ungathered_worst =
                        ungathered_worst.max((f64::from(y_ungathered[i]) - y).abs() / m);
                }
            }
            // Without the gather the blocks multiply other heads' inputs.
            assert!(
                ungathered_worst > 100.0 * GATHERED_RELATIVE_BOUND,
                "{module}: {ungathered_worst}"
            );
            if layer == "0" {
                eprintln!(
                    "{module}, {tokens} tokens: gathered kernel and dense within {worst:.2e} of sum |terms| of the f64 product; ungathered {ungathered_worst:.2e}"
                );
            }
        }
    }

    // `loraq run`: every linear of the GGUF on the fused kernel (out_proj included),
    // against the same base decoded (`--backend dense`), with and without the adapter.
    let records = dir.path().join("records.jsonl");
    let lines: Vec<String> = (0..8u32)
        .map(|i| {
            // 20-token prompts take the prefill path, 5-token ones the GEMV.
            let len = if i % 2 == 0 { 20 } else { 5 };
            let tokens: Vec<u32> = (0..len).map(|t| (t * 389 + i * 97 + 11) % 4096).collect();
            serde_json::json!({
                "id": format!("r{i}"),
                "tokens": tokens,
                "options": ["A", "B", "C"],
                "option_tokens": [i + 3, 1000 + i, 3000 + i],
            })
            .to_string()
        })
        .collect();
    std::fs::write(&records, lines.join("\n") + "\n").unwrap();
    for adapter in [None, Some(&adapter_dir)] {
        let mut outs = Vec::new();
        for backend in ["auto", "dense"] {
            let out = dir
                .path()
                .join(format!("demo-{backend}-{}.jsonl", adapter.is_some()));
            let summary = run_on_backend(&gguf, &records, &out, backend, adapter);
            if backend == "auto" {
                // All 62 linears on the kernel, none left to the dense matmul.
                assert!(
                    summary.contains("linears: 62 cpu") && !summary.contains("cpu, "),
                    "{summary}"
                );
            }
            outs.push(logits(&out));
        }
        let max = max_abs_diff(&outs[0], &outs[1]);
        eprintln!(
            "demo Q4_K_M (adapter: {}): fused kernel with gathered out_proj vs dense: max |d logit| {max:.3e}",
            adapter.is_some()
        );
        assert!(max <= QUANTIZED_VS_DECODED_TOLERANCE, "{max}");
    }
}
