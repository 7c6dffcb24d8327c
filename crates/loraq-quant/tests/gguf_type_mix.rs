//! llama-quantize's per-tensor type choice (loraq_quant::ggml::mix) against
//! llama.cpp's own snapshots of it (tests/data/gguf_blocks/mix, copied by
//! scripts/gguf_blocks_oracle.py from the sdist's tests/snapshots), on the tensor
//! lists of Qwen3-0.6B, Qwen3-14B (qwen3) and Qwen3.6-27B (qwen35) rebuilt from
//! their hyperparameters and llama.cpp's tensor names; and the fallbacks for rows
//! that are not a whole number of blocks, against the table in
//! docs/quantization.md (derived from `tensor_type_fallback`).

use loraq_quant::ggml::GgmlType;
use loraq_quant::ggml::mix::{GgufFileType, MixModel, MixTensor, allows_quantization, plan_types};
use std::collections::BTreeMap;
use std::path::PathBuf;

struct Tensor {
    name: String,
    dims: Vec<usize>,
}

fn t(name: String, dims: &[usize]) -> Tensor {
    Tensor {
        name,
        dims: dims.to_vec(),
    }
}

struct Shape {
    n_layer: usize,
    n_embd: usize,
    n_ff: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    n_vocab: usize,
}

impl Shape {
    /// The model facts the type mix reads, for `architecture` of this shape.
    fn model(&self, architecture: &str) -> MixModel {
        MixModel {
            architecture: architecture.into(),
            block_count: self.n_layer,
            head_count: self.n_head,
            head_count_kv: self.n_head_kv,
        }
    }
}

/// Tensors of a qwen3 GGUF (src/models/qwen3.cpp), GGUF dims `ne[0]` first.
fn qwen3_tensors(s: &Shape) -> Vec<Tensor> {
    let mut v = vec![
        t("token_embd.weight".into(), &[s.n_embd, s.n_vocab]),
        t("output_norm.weight".into(), &[s.n_embd]),
        t("output.weight".into(), &[s.n_embd, s.n_vocab]),
    ];
    for il in 0..s.n_layer {
        let b = |n: &str| format!("blk.{il}.{n}.weight");
        v.push(t(b("attn_norm"), &[s.n_embd]));
        v.push(t(b("attn_q"), &[s.n_embd, s.n_head * s.head_dim]));
        v.push(t(b("attn_k"), &[s.n_embd, s.n_head_kv * s.head_dim]));
        v.push(t(b("attn_v"), &[s.n_embd, s.n_head_kv * s.head_dim]));
        v.push(t(b("attn_output"), &[s.n_head * s.head_dim, s.n_embd]));
        v.push(t(b("attn_q_norm"), &[s.head_dim]));
        v.push(t(b("attn_k_norm"), &[s.head_dim]));
        v.push(t(b("ffn_norm"), &[s.n_embd]));
        v.push(t(b("ffn_gate"), &[s.n_embd, s.n_ff]));
        v.push(t(b("ffn_up"), &[s.n_embd, s.n_ff]));
        v.push(t(b("ffn_down"), &[s.n_ff, s.n_embd]));
    }
    v
}

/// Tensors of a qwen35 GGUF (src/models/qwen35.cpp): a full-attention layer every
/// fourth, Gated DeltaNet layers between (`key_dim`, `value_dim`, `n_v_heads` of
/// the linear attention).
fn qwen35_tensors(s: &Shape, key_dim: usize, value_dim: usize, n_v_heads: usize) -> Vec<Tensor> {
    let mut v = vec![
        t("token_embd.weight".into(), &[s.n_embd, s.n_vocab]),
        t("output_norm.weight".into(), &[s.n_embd]),
        t("output.weight".into(), &[s.n_embd, s.n_vocab]),
    ];
    for il in 0..s.n_layer {
        let b = |n: &str| format!("blk.{il}.{n}.weight");
        v.push(t(b("attn_norm"), &[s.n_embd]));
        v.push(t(b("post_attention_norm"), &[s.n_embd]));
        if (il + 1) % 4 == 0 {
            v.push(t(b("attn_q"), &[s.n_embd, 2 * s.n_head * s.head_dim]));
            v.push(t(b("attn_k"), &[s.n_embd, s.n_head_kv * s.head_dim]));
            v.push(t(b("attn_v"), &[s.n_embd, s.n_head_kv * s.head_dim]));
            v.push(t(b("attn_output"), &[s.n_head * s.head_dim, s.n_embd]));
            v.push(t(b("attn_q_norm"), &[s.head_dim]));
            v.push(t(b("attn_k_norm"), &[s.head_dim]));
        } else {
            v.push(t(b("attn_qkv"), &[s.n_embd, 2 * key_dim + value_dim]));
            v.push(t(b("attn_gate"), &[s.n_embd, value_dim]));
            v.push(t(b("ssm_conv1d"), &[4, 2 * key_dim + value_dim]));
            v.push(t(format!("blk.{il}.ssm_dt.bias"), &[n_v_heads]));
            v.push(t(format!("blk.{il}.ssm_a"), &[n_v_heads]));
            v.push(t(b("ssm_beta"), &[s.n_embd, n_v_heads]));
            v.push(t(b("ssm_alpha"), &[s.n_embd, n_v_heads]));
            v.push(t(b("ssm_norm"), &[128]));
            v.push(t(b("ssm_out"), &[value_dim, s.n_embd]));
        }
        v.push(t(b("ffn_gate"), &[s.n_embd, s.n_ff]));
        v.push(t(b("ffn_down"), &[s.n_ff, s.n_embd]));
        v.push(t(b("ffn_up"), &[s.n_embd, s.n_ff]));
    }
    v
}

/// `[FTYPE] default` sections of a snapshot: file type -> (default, overrides).
fn snapshot(name: &str) -> BTreeMap<String, (String, BTreeMap<String, String>)> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/gguf_blocks/mix")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut sections = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        if let Some(rest) = line.strip_prefix('[') {
            let (ftype, default) = rest.split_once("] ").expect("[FTYPE] type");
            sections.insert(ftype.to_string(), (default.to_string(), BTreeMap::new()));
            current = Some(ftype.to_string());
        } else {
            let (tensor, ty) = line.split_once(' ').expect("tensor type");
            let section = sections
                .get_mut(current.as_ref().expect("section"))
                .expect("open");
            section.1.insert(tensor.to_string(), ty.to_string());
        }
    }
    sections
}

fn check_against_snapshot(file: &str, model: &MixModel, tensors: &[Tensor]) {
    let sections = snapshot(file);
    assert_eq!(
        sections.len(),
        GgufFileType::ALL.len(),
        "{file}: a section per file type"
    );
    let mix: Vec<MixTensor<'_>> = tensors
        .iter()
        .map(|t| MixTensor {
            name: &t.name,
            dims: &t.dims,
            stored_type: GgmlType::BF16,
        })
        .collect();
    for ftype in GgufFileType::ALL {
        let (default, overrides) = &sections[ftype.name()];
        // llama-quantize prints ggml_type_name (`q4_K`): GgmlType::name's letters.
        assert!(
            default.eq_ignore_ascii_case(ftype.default_type().name()),
            "{file} {}: {default}",
            ftype.name()
        );
        let types = plan_types(model, ftype, &mix).expect("plan");
        let mut seen = 0;
        for (tensor, ty) in mix.iter().zip(&types) {
            if !allows_quantization(tensor.name, tensor.dims) {
                assert_eq!(
                    *ty,
                    GgmlType::BF16,
                    "{file} {}: {} stays",
                    ftype.name(),
                    tensor.name
                );
                continue;
            }
            let want = overrides.get(tensor.name).unwrap_or(default);
            assert!(
                ty.name().eq_ignore_ascii_case(want),
                "{file} {}: {}: {ty}, llama-quantize {want}",
                ftype.name(),
                tensor.name
            );
            seen += usize::from(overrides.contains_key(tensor.name));
        }
        assert_eq!(
            seen,
            overrides.len(),
            "{file} {}: every override is a tensor of the list",
            ftype.name()
        );
    }
}

#[test]
fn qwen3_0_6b_matches_llama_cpps_snapshot() {
    let s = Shape {
        n_layer: 28,
        n_embd: 1024,
        n_ff: 3072,
        n_head: 16,
        n_head_kv: 8,
        head_dim: 128,
        n_vocab: 151_936,
    };
    let model = s.model("qwen3");
    check_against_snapshot("qwen3-0.6b.schema", &model, &qwen3_tensors(&s));
}

#[test]
fn qwen3_14b_matches_llama_cpps_snapshot() {
    let s = Shape {
        n_layer: 40,
        n_embd: 5120,
        n_ff: 17408,
        n_head: 40,
        n_head_kv: 8,
        head_dim: 128,
        n_vocab: 151_936,
    };
    let model = s.model("qwen3");
    check_against_snapshot("qwen3-14b.schema", &model, &qwen3_tensors(&s));
}

#[test]
fn qwen3_6_27b_matches_llama_cpps_snapshot() {
    let s = Shape {
        n_layer: 64,
        n_embd: 5120,
        n_ff: 17408,
        n_head: 24,
        n_head_kv: 4,
        head_dim: 256,
        n_vocab: 248_320,
    };
    let model = s.model("qwen35");
    // 16 key heads and 48 value heads of 128
    check_against_snapshot(
        "qwen3.6-27b.schema",
        &model,
        &qwen35_tensors(&s, 2048, 6144, 48),
    );
}

#[test]
fn rows_that_are_not_whole_blocks_fall_back_as_tensor_type_fallback_says() {
    // One qwen3 layer with in_features 320 (a multiple of 32, not of 256) for
    // ffn_down and 48 (not a multiple of 32) for attn_output; 8 layers so that
    // Q4_K_M's use_more_bits picks layer 0.
    let s = Shape {
        n_layer: 8,
        n_embd: 256,
        n_ff: 320,
        n_head: 3,
        n_head_kv: 1,
        head_dim: 16,
        n_vocab: 512,
    };
    let tensors = qwen3_tensors(&s);
    let model = s.model("qwen3");
    let mix: Vec<MixTensor<'_>> = tensors
        .iter()
        .map(|t| MixTensor {
            name: &t.name,
            dims: &t.dims,
            stored_type: GgmlType::F32,
        })
        .collect();
    let type_of = |ftype, name: &str| {
        let types = plan_types(&model, ftype, &mix).expect("plan");
        let i = mix.iter().position(|t| t.name == name).expect("tensor");
        types[i]
    };
    use GgmlType as G;
    use GgufFileType as F;
    // (file type, ffn_down of layer 0 (in 320), ffn_down of layer 2, attn_output (in 48))
    let table = [
        (F::Q8_0, G::Q8_0, G::Q8_0, G::F16),
        (F::Q6_K, G::Q8_0, G::Q8_0, G::F16),
        (F::Q5_K_M, G::Q8_0, G::Q5_1, G::F16),
        (F::Q4_K_M, G::Q8_0, G::Q5_0, G::F16),
        (F::Q4_0, G::Q4_0, G::Q4_0, G::F16),
        (F::IQ4_XS, G::Q5_1, G::IQ4_NL, G::F16),
    ];
    for (ftype, down0, down2, attn_output) in table {
        assert_eq!(
            type_of(ftype, "blk.0.ffn_down.weight"),
            down0,
            "{ftype:?} layer 0"
        );
        assert_eq!(
            type_of(ftype, "blk.2.ffn_down.weight"),
            down2,
            "{ftype:?} layer 2"
        );
        assert_eq!(
            type_of(ftype, "blk.3.attn_output.weight"),
            attn_output,
            "{ftype:?}"
        );
        assert_eq!(
            type_of(ftype, "blk.3.attn_norm.weight"),
            G::F32,
            "norms stay"
        );
    }
}

#[test]
fn other_architectures_are_refused() {
    let model = MixModel {
        architecture: "llama".into(),
        block_count: 80,
        head_count: 64,
        head_count_kv: 8,
    };
    let err = plan_types(&model, GgufFileType::Q4_K_M, &[]).expect_err("llama");
    assert!(err.to_string().contains("llama"), "{err}");
}

/// The values scripts/gguf_llama_quantize_check.py wrote into its f32 GGUF.
fn synthetic_values(index: u64, n: usize) -> Vec<f32> {
    let mut v: Vec<f32> = (0..n as u64)
        .map(|i| {
            let mut h = ((index << 32) | i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            h ^= h >> 29;
            h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((h >> 40) as i64 - (1 << 23)) as f32 * (-27f32).exp2()
        })
        .collect();
    v[0] = 1.0;
    v
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn llama_quantize_end_to_end() {
    // A real llama-quantize run (scripts/gguf_llama_quantize_check.py) on a synthetic
    // 8-layer qwen3 GGUF in f32: every tensor's type, its bytes, and the order of the
    // output file, for the six file types.
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/gguf_blocks/llama_quantize/qwen3-synthetic.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let run: serde_json::Value = serde_json::from_str(&text).expect("json");
    let tensors: Vec<Tensor> = run["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .map(|t| Tensor {
            name: t["name"].as_str().expect("name").to_string(),
            dims: t["dims"]
                .as_array()
                .expect("dims")
                .iter()
                .map(|d| d.as_u64().expect("dim") as usize)
                .collect(),
        })
        .collect();
    let model = MixModel {
        architecture: "qwen3".into(),
        block_count: run["block_count"].as_u64().expect("block_count") as usize,
        head_count: run["head_count"].as_u64().expect("head_count") as usize,
        head_count_kv: run["head_count_kv"].as_u64().expect("head_count_kv") as usize,
    };
    let mix: Vec<MixTensor<'_>> = tensors
        .iter()
        .map(|t| MixTensor {
            name: &t.name,
            dims: &t.dims,
            stored_type: GgmlType::F32,
        })
        .collect();
    let values: Vec<Vec<f32>> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| synthetic_values(i as u64, t.dims.iter().product()))
        .collect();
    let names: Vec<&str> = mix.iter().map(|t| t.name).collect();
    let order: Vec<&str> = loraq_quant::ggml::mix::llama_quantize_order(&names)
        .into_iter()
        .map(|i| names[i])
        .collect();
    let mut quantized = 0;
    for ftype in GgufFileType::ALL {
        let entry = &run["ftypes"][ftype.name()];
        let file_order: Vec<&str> = entry["file_order"]
            .as_array()
            .expect("order")
            .iter()
            .map(|n| n.as_str().expect("name"))
            .collect();
        assert_eq!(order, file_order, "{}: tensor order", ftype.name());
        let types = plan_types(&model, ftype, &mix).expect("plan");
        for ((tensor, ty), values) in mix.iter().zip(&types).zip(&values) {
            let want = &entry["tensors"][tensor.name];
            let context = format!("{} {}", ftype.name(), tensor.name);
            assert_eq!(
                GgmlType::from_name(want["type"].as_str().expect("type")),
                Some(*ty),
                "{context}: type"
            );
            let in_features = tensor.dims[0];
            let out_features = tensor.dims[1..].iter().product();
            let bytes = if *ty == GgmlType::F32 {
                values.iter().flat_map(|v| v.to_le_bytes()).collect()
            } else {
                quantized += 1;
                loraq_quant::GgmlWeight::quantize(
                    tensor.name,
                    *ty,
                    out_features,
                    in_features,
                    values,
                )
                .expect("quantize")
                .data
            };
            assert_eq!(
                sha256_hex(&bytes),
                want["sha256"].as_str().expect("sha256"),
                "{context}: bytes differ from llama-quantize's"
            );
        }
    }
    assert!(quantized > 300, "{quantized} quantized tensors compared");
}
