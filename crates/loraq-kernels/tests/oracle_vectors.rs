//! The reference and the fast CPU path against outputs computed independently by
//! numpy (float64) with ml_dtypes decoding the stored codes
//! (`scripts/kernels_oracle.py`, vectors in `tests/data/oracle_vectors.json`).

use half::bf16;
use loraq_kernels::{
    Bf16Weight, CpuOptions, Fp8Weight, Isa, LoraAdapter, Mxfp4Weight, Nvfp4Weight, Parallelism,
    QuantLoraLinear, QuantizedWeight,
};
use loraq_quant::Nvfp4GlobalScale;
use serde_json::Value;

fn u8s(v: &Value) -> Vec<u8> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_u64().unwrap() as u8)
        .collect()
}

fn bf16s(v: &Value) -> Vec<bf16> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| bf16::from_bits(e.as_u64().unwrap() as u16))
        .collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_f64().unwrap() as f32)
        .collect()
}

fn usize_of(v: &Value, key: &str) -> usize {
    v[key].as_u64().unwrap() as usize
}

fn build(case: &Value) -> QuantLoraLinear {
    let (out_features, in_features, rank) = (
        usize_of(case, "out_dim"),
        usize_of(case, "in_dim"),
        usize_of(case, "rank"),
    );
    let base = match case["format"].as_str().unwrap() {
        "bf16" => QuantizedWeight::Bf16(Bf16Weight::new(
            out_features,
            in_features,
            bf16s(&case["weight_bits"]),
        )),
        "fp8-block128" => QuantizedWeight::Fp8(Fp8Weight::block128(
            out_features,
            in_features,
            u8s(&case["codes"]),
            f32s(&case["scales"]),
        )),
        "nvfp4" => QuantizedWeight::Nvfp4(Nvfp4Weight::new(
            out_features,
            in_features,
            u8s(&case["packed"]),
            u8s(&case["block_scales"]),
            Nvfp4GlobalScale::Multiplier(case["global_scale"].as_f64().unwrap() as f32),
        )),
        "mxfp4" => QuantizedWeight::Mxfp4(Mxfp4Weight::new(
            out_features,
            in_features,
            u8s(&case["packed"]),
            u8s(&case["block_scales"]),
        )),
        other => panic!("unknown format {other}"),
    };
    let lora = LoraAdapter::new(
        rank,
        in_features,
        out_features,
        bf16s(&case["lora_a_bits"]),
        bf16s(&case["lora_b_bits"]),
        case["lora_scale"].as_f64().unwrap() as f32,
    )
    .unwrap();
    QuantLoraLinear::new(base, Some(lora)).unwrap()
}

#[test]
fn reference_and_fast_path_match_numpy_ml_dtypes() {
    let text = include_str!("data/oracle_vectors.json");
    let root: Value = serde_json::from_str(text).unwrap();
    let cases = root["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    for case in cases {
        let linear = build(case);
        let batch = usize_of(case, "batch");
        let x = f32s(&case["x"]);
        let want: Vec<f64> = case["y"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_f64().unwrap())
            .collect();
        let (reference, magnitude) = linear.forward_reference_with_magnitude(&x, batch).unwrap();
        let name = case["format"].as_str().unwrap();
        for (i, (&r, &w)) in reference.iter().zip(&want).enumerate() {
            // The reference rounds an f64 sum to f32 once.
            let tol = 1e-6 * magnitude[i] + f64::from(f32::EPSILON) * w.abs();
            assert!(
                (f64::from(r) - w).abs() <= tol,
                "{name} reference output {i}: {r} vs numpy {w}"
            );
        }
        for isa in Isa::available() {
            let mut y = vec![0f32; want.len()];
            let opts = CpuOptions {
                isa: Some(isa),
                parallelism: Parallelism::Rayon,
            };
            linear.forward(&x, batch, &mut y, opts).unwrap();
            for (i, (&g, &w)) in y.iter().zip(&want).enumerate() {
                let tol = magnitude[i] / 4096.0;
                assert!(
                    (f64::from(g) - w).abs() <= tol,
                    "{name} {} output {i}: {g} vs numpy {w}",
                    isa.name()
                );
            }
        }
    }
}
