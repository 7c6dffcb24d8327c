//! The ggml block types against llama.cpp (vectors from
//! scripts/gguf_blocks_oracle.py in tests/data/gguf_blocks): every type decodes
//! random blocks to gguf-py's values (which the script checked equal to ggml's
//! `dequantize_row_*`), and every quantizable type turns the awkward inputs into
//! `ggml_quantize_chunk`'s bytes exactly.

use loraq_quant::ggml::{self, GgmlType, GgmlWeight};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/gguf_blocks")
}

fn manifest() -> Value {
    let path = data_dir().join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("manifest.json parses")
}

fn bytes(name: &Value) -> Vec<u8> {
    let path = data_dir().join(name.as_str().expect("file name"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn f32s(name: &Value) -> Vec<f32> {
    bytes(name)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The entry of `table` for `ty`: the vectors are keyed by ggml's `ggml_type_name`
/// (`q4_K`), the same letters as [`GgmlType::name`] in another case.
fn keyed<'a>(table: &'a serde_json::Map<String, Value>, ty: &str) -> Option<&'a Value> {
    table
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case(ty))
        .map(|(_, v)| v)
}

fn same_value(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn sha256_f32(values: &[f32]) -> String {
    let mut hasher = Sha256::new();
    for v in values {
        hasher.update(v.to_le_bytes());
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn every_type_decodes_like_gguf_py_and_ggml() {
    let manifest = manifest();
    let decode = manifest["decode"].as_object().expect("decode table");
    for ty in loraq_quant::ggml::DECODABLE {
        let entry =
            keyed(decode, ty.name()).unwrap_or_else(|| panic!("no decode vectors for {ty}"));
        let blocks = bytes(&entry["blocks"]);
        let expected = f32s(&entry["values"]);
        let mut ours = vec![0.0f32; expected.len()];
        ggml::decode_row(ty, &blocks, &mut ours);
        for (i, (&a, &b)) in ours.iter().zip(&expected).enumerate() {
            assert!(
                same_value(a, b),
                "{ty}: element {i} (block {}) decodes to {a:e}, gguf-py {b:e}",
                i / ty.block().elements
            );
        }
    }
    assert_eq!(
        decode.len(),
        loraq_quant::ggml::DECODABLE.len(),
        "a vector set per type"
    );
}

#[test]
fn every_element_decodes_on_its_own_like_gguf_py() {
    // block_element (what a kernel decoding in its loop reads) gives each element the
    // value the whole-row decode gives it.
    let manifest = manifest();
    for ty in loraq_quant::ggml::DECODABLE {
        let decode = manifest["decode"].as_object().expect("decode table");
        let entry = keyed(decode, ty.name()).expect("decode vectors");
        let blocks = bytes(&entry["blocks"]);
        let expected = f32s(&entry["values"]);
        let block = ty.block();
        for (i, &want) in expected.iter().enumerate() {
            let b = &blocks[i / block.elements * block.bytes..][..block.bytes];
            let got = ggml::block_element(ty, b, i % block.elements);
            assert!(
                same_value(got, want),
                "{ty}: element {i}: {got:e}, gguf-py {want:e}"
            );
        }
    }
}

#[test]
fn quantization_matches_ggml_quantize_chunk_byte_for_byte() {
    let manifest = manifest();
    let expected = manifest["quantize"]["expected"]
        .as_object()
        .expect("expected table");
    let mut checked = 0;
    for case in manifest["quantize"]["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().expect("case name");
        let values = f32s(&case["input"]);
        let out_features = case["out_features"].as_u64().expect("rows") as usize;
        let in_features = case["in_features"].as_u64().expect("cols") as usize;
        for ty in loraq_quant::ggml::QUANTIZABLE {
            let key = format!("{}/{name}", ty.name());
            let Some(entry) = keyed(expected, &key) else {
                assert!(
                    !in_features.is_multiple_of(ty.block().elements),
                    "{key}: no vector although the width fits"
                );
                continue;
            };
            let want = bytes(&entry["bytes"]);
            let weight = GgmlWeight::quantize(&key, ty, out_features, in_features, &values)
                .unwrap_or_else(|e| panic!("{key}: {e}"));
            if let Some(at) = weight.data.iter().zip(&want).position(|(a, b)| a != b) {
                let block = ty.block();
                panic!(
                    "{key}: byte {at} differs (block {}, byte {} of {}): ours {:#04x}, ggml {:#04x}",
                    at / block.bytes,
                    at % block.bytes,
                    block.bytes,
                    weight.data[at],
                    want[at]
                );
            }
            assert_eq!(weight.data.len(), want.len(), "{key}: length");
            let decoded = weight.dequantize();
            assert_eq!(
                sha256_f32(&decoded),
                entry["decode_sha256"].as_str().expect("hash"),
                "{key}: decode of the quantized blocks differs from ggml's"
            );
            checked += 1;
        }
    }
    assert_eq!(
        checked,
        expected.len(),
        "every committed vector was checked"
    );
    assert!(checked >= 100);
}

#[test]
fn the_legacy_quantizers_were_checked_against_gguf_py_too() {
    // The script compares gguf-py's numpy quantizers with ggml on every case and
    // lists any disagreement; none is expected at this llama.cpp version.
    let manifest = manifest();
    let differs = manifest["gguf_py_quantize_differs"]
        .as_array()
        .expect("list");
    assert!(
        differs.is_empty(),
        "gguf-py differs from ggml on {differs:?}"
    );
}

#[test]
fn bad_shapes_are_refused_with_the_tensor_named() {
    let err = GgmlWeight::quantize("blk.0.ffn_down.weight", GgmlType::Q4_K, 2, 96, &[0.0; 192])
        .expect_err("96 is not a multiple of 256");
    let text = err.to_string();
    assert!(
        text.contains("blk.0.ffn_down.weight") && text.contains("256"),
        "{text}"
    );

    let err = GgmlWeight::new("w", GgmlType::Q8_0, 2, 64, vec![0u8; 135]).expect_err("short");
    assert!(err.to_string().contains("136"), "{err}");

    let err = ggml::dequantize("w", GgmlType::IQ4_XS, 1, 32, &[0u8; 17]).expect_err("partial");
    assert!(err.to_string().contains("IQ4_XS"), "{err}");

    let err = GgmlWeight::quantize("w", GgmlType::Q8_0, 2, 32, &[0.0; 63]).expect_err("count");
    assert!(err.to_string().contains("63"), "{err}");

    let err =
        ggml::matrix_bytes(GgmlType::Q6_K, "huge", usize::MAX / 2, 256).expect_err("overflow");
    assert!(err.to_string().contains("huge"), "{err}");
}

#[test]
fn the_type_table_is_ggmls() {
    // Ids and sizes from ggml.h / ggml-common.h (type_traits): id, block, bytes.
    let table = [
        (GgmlType::F32, 0, 1, 4),
        (GgmlType::F16, 1, 1, 2),
        (GgmlType::Q4_0, 2, 32, 18),
        (GgmlType::Q4_1, 3, 32, 20),
        (GgmlType::Q5_0, 6, 32, 22),
        (GgmlType::Q5_1, 7, 32, 24),
        (GgmlType::Q8_0, 8, 32, 34),
        (GgmlType::Q2_K, 10, 256, 84),
        (GgmlType::Q3_K, 11, 256, 110),
        (GgmlType::Q4_K, 12, 256, 144),
        (GgmlType::Q5_K, 13, 256, 176),
        (GgmlType::Q6_K, 14, 256, 210),
        (GgmlType::IQ4_NL, 20, 32, 18),
        (GgmlType::IQ4_XS, 23, 256, 136),
        (GgmlType::BF16, 30, 1, 2),
        (GgmlType::MXFP4, 39, 32, 17),
    ];
    for (ty, id, elements, bytes) in table {
        assert_eq!(ty.id(), id, "{ty}");
        assert_eq!(GgmlType::from_id(id), Some(ty));
        assert_eq!(GgmlType::from_name(ty.name()), Some(ty));
        assert_eq!(
            (ty.block().elements, ty.block().bytes),
            (elements, bytes),
            "{ty}"
        );
    }
    assert_eq!(GgmlType::from_id(4), None);
}

#[test]
fn activation_quantization_matches_llama_cpps_cpu_backend() {
    // libggml-cpu's from_float of Q8_0 (x86 AVX2) and Q8_K, dequantized as the dot
    // products read them; the input has an all-zero block, exact .5 ties, an outlier,
    // tiny values and a negative-only block.
    use loraq_quant::ActivationQuant;
    let manifest = manifest();
    let entry = &manifest["activations"];
    let x = f32s(&entry["input"]);
    let hidden = entry["hidden"].as_u64().expect("hidden") as usize;
    for (quant, key) in [
        (ActivationQuant::GgmlQ8_0, "q8_0"),
        (ActivationQuant::GgmlQ8K, "q8_K"),
    ] {
        let want = f32s(&entry[key]);
        let mut ours = x.clone();
        quant.apply("x", &mut ours, hidden).expect("apply");
        for (i, (&a, &b)) in ours.iter().zip(&want).enumerate() {
            assert!(
                same_value(a, b),
                "{key}: element {i} of {}: ours {a:e}, llama.cpp {b:e}",
                x[i]
            );
        }
    }
    let err = ActivationQuant::GgmlQ8K
        .apply("blk.0.attn_q", &mut [0.0; 96], 96)
        .expect_err("96 is not a multiple of 256");
    assert!(err.to_string().contains("blk.0.attn_q"), "{err}");
    assert_eq!(
        ActivationQuant::for_ggml_weight(GgmlType::Q4_K),
        ActivationQuant::GgmlQ8K
    );
    assert_eq!(
        ActivationQuant::for_ggml_weight(GgmlType::Q4_0),
        ActivationQuant::GgmlQ8_0
    );
}
