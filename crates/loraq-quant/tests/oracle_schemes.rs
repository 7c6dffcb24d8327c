//! Weight schemes against the numpy + ml_dtypes oracle of scripts/quant_oracle.py:
//! codes, scales and zero points bit-identical, dequantized values identical (by
//! SHA-256 of the f32 bytes), on matrices with outliers, all-zero blocks, a floored
//! NVFP4 block scale and partial 128-blocks.

mod common;

use loraq_quant::{QuantizedWeight, Scheme, WeightView};
use serde_json::Value;

fn u8s(files: &Value, key: &str) -> Vec<u8> {
    common::bytes(&files[key])
}

fn f32s(files: &Value, key: &str) -> Vec<f32> {
    common::f32s(&files[key])
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn check_scheme(scheme: Scheme) {
    let manifest = common::manifest();
    let mut checked = 0;
    for (tensor, entry) in manifest["weights"].as_object().unwrap() {
        let Some(files) = entry["schemes"].get(scheme.name()) else {
            continue;
        };
        let rows = common::usize_of(&entry["rows"]);
        let cols = common::usize_of(&entry["cols"]);
        let values = common::bf16s(&entry["values"]);
        let view = WeightView::new(tensor, rows, cols, &values).unwrap();
        let quantized = scheme.quantize(view).unwrap();
        let context = format!("{scheme} on {tensor} ({rows}x{cols})");
        match &quantized {
            QuantizedWeight::Fp8(w) => {
                assert_eq!(w.codes, u8s(files, "codes"), "{context}: codes");
                assert_eq!(
                    bits(&w.scales),
                    bits(&f32s(files, "scales")),
                    "{context}: scales"
                );
            }
            QuantizedWeight::Nvfp4(w) => {
                assert_eq!(w.packed, u8s(files, "packed"), "{context}: packed codes");
                assert_eq!(
                    w.block_scales,
                    u8s(files, "block_scales"),
                    "{context}: block scales"
                );
                let global = f32s(files, "global_scale")[0];
                assert_eq!(
                    w.global_scale,
                    loraq_quant::Nvfp4GlobalScale::Multiplier(global),
                    "{context}: global scale"
                );
            }
            QuantizedWeight::Mxfp4(w) => {
                assert_eq!(w.packed, u8s(files, "packed"), "{context}: packed codes");
                assert_eq!(w.scales, u8s(files, "scales"), "{context}: scales");
            }
            QuantizedWeight::Bf16(_) | QuantizedWeight::Ggml(_) => {
                unreachable!("no scheme quantizes to bf16 or a ggml type")
            }
            QuantizedWeight::Int4(w) => {
                assert_eq!(w.codes(), u8s(files, "codes"), "{context}: codes");
                assert_eq!(
                    bits(&w.scales),
                    bits(&f32s(files, "scales")),
                    "{context}: scales"
                );
                assert_eq!(w.zeros, u8s(files, "zeros"), "{context}: zero points");
            }
        }
        let dequantized = quantized.dequantize();
        assert_eq!(
            common::sha256_f32(&dequantized),
            files["dequant_sha256"].as_str().unwrap(),
            "{context}: dequantized values"
        );
        // Fake-quant is quantize-then-dequantize.
        assert_eq!(
            bits(&scheme.fake_quant(view).unwrap()),
            bits(&dequantized),
            "{context}"
        );
        checked += 1;
    }
    assert!(
        checked >= 3,
        "{scheme}: every test matrix checked ({checked})"
    );
}

#[test]
fn fp8_tensor_matches_oracle() {
    check_scheme(Scheme::Fp8Tensor);
}

#[test]
fn fp8_channel_matches_oracle() {
    check_scheme(Scheme::Fp8Channel);
}

#[test]
fn fp8_block128_matches_oracle_with_partial_and_zero_tiles() {
    check_scheme(Scheme::Fp8Block128);
}

#[test]
fn nvfp4_matches_oracle() {
    check_scheme(Scheme::Nvfp4);
}

#[test]
fn mxfp4_matches_oracle() {
    check_scheme(Scheme::Mxfp4);
}

#[test]
fn int4_g128_sym_matches_oracle() {
    check_scheme(Scheme::Int4G128Sym);
}

#[test]
fn int4_g128_asym_matches_oracle() {
    check_scheme(Scheme::Int4G128Asym);
}
