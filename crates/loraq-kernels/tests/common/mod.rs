//! Random quantized linears for the tests: codes drawn directly in each storage format,
//! so every code path (subnormal E4M3, every E2M1 value, partial fp8 tiles) is exercised.
#![allow(dead_code)]

use half::bf16;
use loraq_kernels::{
    Bf16Weight, Fp8Weight, Int4Weight, LoraAdapter, Mxfp4Weight, Nvfp4Weight, QuantLoraLinear,
    QuantizedWeight,
};
use loraq_quant::Nvfp4GlobalScale;
use loraq_quant::ggml::{GgmlType, GgmlWeight};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Base formats the tests draw from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Bf16,
    Fp8Block128,
    Nvfp4,
    Mxfp4,
    Int4G128,
    /// A ggml type of a GGUF base (quantized from random values as llama-quantize
    /// does, so the blocks are the ones a GGUF file holds).
    Ggml(GgmlType),
}

pub const FORMATS: [Format; 9] = [
    Format::Bf16,
    Format::Fp8Block128,
    Format::Nvfp4,
    Format::Mxfp4,
    Format::Int4G128,
    Format::Ggml(GgmlType::Q8_0),
    Format::Ggml(GgmlType::Q4_K),
    Format::Ggml(GgmlType::Q5_K),
    Format::Ggml(GgmlType::Q6_K),
];

/// A non-NaN E4M3 code.
fn e4m3_code(rng: &mut ChaCha8Rng) -> u8 {
    loop {
        let c: u8 = rng.random();
        if c & 0x7F != 0x7F {
            return c;
        }
    }
}

pub fn random_base(
    format: Format,
    out_features: usize,
    in_features: usize,
    rng: &mut ChaCha8Rng,
) -> QuantizedWeight {
    match format {
        Format::Bf16 => QuantizedWeight::Bf16(Bf16Weight::new(
            out_features,
            in_features,
            (0..out_features * in_features)
                .map(|_| bf16::from_f32(rng.random_range(-0.1..0.1)))
                .collect(),
        )),
        Format::Fp8Block128 => {
            let tiles = out_features.div_ceil(128) * in_features.div_ceil(128);
            QuantizedWeight::Fp8(Fp8Weight::block128(
                out_features,
                in_features,
                (0..out_features * in_features)
                    .map(|_| e4m3_code(rng))
                    .collect(),
                (0..tiles)
                    .map(|_| rng.random_range(1e-5f32..1e-3))
                    .collect(),
            ))
        }
        Format::Nvfp4 => QuantizedWeight::Nvfp4(Nvfp4Weight::new(
            out_features,
            in_features,
            (0..out_features * in_features / 2)
                .map(|_| rng.random())
                .collect(),
            // E4M3 codes 0x00..0x5F: zero, subnormals, normals up to 16.
            (0..out_features * in_features / 16)
                .map(|_| rng.random_range(0u8..0x60) | (rng.random::<u8>() & 0x80))
                .collect(),
            Nvfp4GlobalScale::Multiplier(rng.random_range(1e-4f32..1e-2)),
        )),
        Format::Mxfp4 => QuantizedWeight::Mxfp4(Mxfp4Weight::new(
            out_features,
            in_features,
            (0..out_features * in_features / 2)
                .map(|_| rng.random())
                .collect(),
            (0..out_features * in_features / 32)
                .map(|_| rng.random_range(118u8..130))
                .collect(),
        )),
        Format::Int4G128 => {
            let groups = out_features * in_features.div_ceil(128);
            QuantizedWeight::Int4(Int4Weight::from_packed(
                out_features,
                in_features,
                (0..out_features * in_features.div_ceil(2))
                    .map(|_| rng.random())
                    .collect(),
                (0..groups)
                    .map(|_| rng.random_range(1e-3f32..0.1))
                    .collect(),
                (0..groups).map(|_| rng.random_range(0u8..16)).collect(),
            ))
        }
        Format::Ggml(ggml_type) => {
            let values: Vec<f32> = (0..out_features * in_features)
                .map(|_| rng.random_range(-0.1f32..0.1))
                .collect();
            QuantizedWeight::Ggml(
                GgmlWeight::quantize("test", ggml_type, out_features, in_features, &values)
                    .unwrap(),
            )
        }
    }
}

pub fn random_lora(
    rank: usize,
    out_features: usize,
    in_features: usize,
    rng: &mut ChaCha8Rng,
) -> LoraAdapter {
    let a = (0..rank * in_features)
        .map(|_| bf16::from_f32(rng.random_range(-0.05..0.05)))
        .collect();
    let b = (0..out_features * rank)
        .map(|_| bf16::from_f32(rng.random_range(-0.05..0.05)))
        .collect();
    LoraAdapter::new(
        rank,
        in_features,
        out_features,
        a,
        b,
        rng.random_range(0.25f32..2.0),
    )
    .unwrap()
}

pub fn random_linear(
    format: Format,
    out_features: usize,
    in_features: usize,
    rank: usize,
    seed: u64,
) -> QuantLoraLinear {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let base = random_base(format, out_features, in_features, &mut rng);
    let lora = (rank > 0).then(|| random_lora(rank, out_features, in_features, &mut rng));
    QuantLoraLinear::new(base, lora).unwrap()
}

pub fn random_activations(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

/// Rounds to the nearest multiple of the format's input block.
pub fn legal_in_features(format: Format, in_features: usize) -> usize {
    match format {
        Format::Nvfp4 => in_features.div_ceil(16).max(1) * 16,
        Format::Mxfp4 => in_features.div_ceil(32).max(1) * 32,
        Format::Ggml(t) => in_features.div_ceil(t.block().elements).max(1) * t.block().elements,
        _ => in_features.max(1),
    }
}

/// Asserts |got - want| <= rel * magnitude + tiny for every output.
pub fn assert_close(got: &[f32], want: &[f32], magnitude: &[f64], rel: f64, context: &str) {
    assert_eq!(got.len(), want.len(), "{context}: length");
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(magnitude).enumerate() {
        let tol = rel * m + 1e-30;
        let err = (f64::from(g) - f64::from(w)).abs();
        assert!(
            err <= tol,
            "{context}: output {i}: got {g}, reference {w}, |diff| {err:e} > tol {tol:e} (magnitude {m:e})"
        );
    }
}
