//! The fast CPU path equals the f64 reference within rounding tolerance, on random
//! shapes, every base format, every instruction set this CPU has, decode and prefill
//! batches, ranks 1..=512, in-dims that are not multiples of 128.

mod common;

use common::{FORMATS, Format, assert_close, legal_in_features, random_activations, random_linear};
use loraq_kernels::{
    ActivationQuant, CpuOptions, Fp8Weight, Isa, Mxfp4Weight, Nvfp4Weight, Parallelism,
    QuantLoraLinear, QuantizedWeight,
};
use loraq_quant::Nvfp4GlobalScale;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// f32 accumulation over at most a few thousand terms stays far inside this; bf16
/// tolerance (2^-8 of the magnitude) is 16x looser.
const REL_TOL: f64 = 1.0 / 4096.0;

fn check(
    format: Format,
    out_features: usize,
    in_features: usize,
    rank: usize,
    batch: usize,
    act: ActivationQuant,
    seed: u64,
) {
    let in_features = legal_in_features(format, in_features);
    let linear =
        random_linear(format, out_features, in_features, rank, seed).with_activation_quant(act);
    let x = random_activations(batch * in_features, seed);
    let (want, magnitude) = linear.forward_reference_with_magnitude(&x, batch).unwrap();
    for isa in Isa::available() {
        for parallelism in [Parallelism::Rayon, Parallelism::Sequential] {
            let opts = CpuOptions {
                isa: Some(isa),
                parallelism,
            };
            let mut y = vec![f32::NAN; batch * out_features];
            linear.forward(&x, batch, &mut y, opts).unwrap();
            let context = format!(
                "{format:?} {out_features}x{in_features} r={rank} batch={batch} {act:?} {} {parallelism:?}",
                isa.name()
            );
            assert_close(&y, &want, &magnitude, REL_TOL, &context);
        }
    }
}

fn format_strategy() -> impl Strategy<Value = Format> {
    prop::sample::select(FORMATS.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn fast_path_matches_reference(
        format in format_strategy(),
        out_features in 1usize..72,
        in_features in 1usize..300,
        rank in prop_oneof![Just(0usize), 1usize..48, Just(512usize), 48usize..512],
        batch in prop_oneof![1usize..=8, 9usize..30],
        seed in any::<u64>(),
    ) {
        check(format, out_features, in_features, rank, batch, ActivationQuant::None, seed);
    }

    #[test]
    fn fast_path_matches_reference_with_quantized_activations(
        format in format_strategy(),
        out_features in 1usize..40,
        in_features in 1usize..300,
        rank in 0usize..64,
        batch in 1usize..20,
        act_kind in 0u8..3,
        seed in any::<u64>(),
    ) {
        let (act, in_features) = match act_kind {
            0 => (ActivationQuant::Fp8PerToken, in_features),
            1 => (ActivationQuant::Fp8PerGroup128, in_features),
            // W4A4: the activation's NVFP4 blocks need in-dim % 16 == 0.
            _ => (ActivationQuant::Nvfp4 { input_scale: loraq_quant::Nvfp4GlobalScale::Multiplier(2.0 / 2688.0) }, in_features.div_ceil(32) * 32),
        };
        check(format, out_features, in_features, rank, batch, act, seed);
    }
}

/// Shapes at the edges of every tile and block: fp8 tiles of 128 with partial tiles in
/// both directions, SIMD widths 8/16 plus tails, the GEMM's KC = 128 slices.
#[test]
fn fp8_block_edges() {
    for (out_features, in_features) in [
        (1, 1),
        (129, 127),
        (130, 129),
        (17, 256),
        (128, 383),
        (33, 15),
    ] {
        for batch in [1, 3, 8, 9, 17] {
            check(
                Format::Fp8Block128,
                out_features,
                in_features,
                5,
                batch,
                ActivationQuant::None,
                7,
            );
        }
    }
}

/// Every ggml block type of a GGUF base (decoded in the loop) on both paths, with rows
/// of several blocks, SIMD tails in the output dimension and the GEMM's KC slices.
#[test]
fn ggml_block_types() {
    for ggml_type in loraq_quant::ggml::QUANTIZABLE {
        let in_features = legal_in_features(Format::Ggml(ggml_type), 300);
        for batch in [1, 5, 9, 17] {
            check(
                Format::Ggml(ggml_type),
                33,
                in_features,
                6,
                batch,
                ActivationQuant::None,
                13,
            );
        }
    }
}

/// Rank 512 (the largest accepted) on both paths.
#[test]
fn rank_512() {
    for batch in [1, 2, 12] {
        check(Format::Nvfp4, 40, 96, 512, batch, ActivationQuant::None, 11);
    }
}

/// The unfused baseline (dequantize the whole weight, then multiply) computes the same
/// function; the benches compare against it.
#[test]
fn dense_baseline_matches_reference() {
    for format in FORMATS {
        for batch in [1, 5, 13] {
            let in_features = legal_in_features(format, 160);
            let linear = random_linear(format, 50, in_features, 24, 3);
            let x = random_activations(batch * in_features, 3);
            let (want, magnitude) = linear.forward_reference_with_magnitude(&x, batch).unwrap();
            let opts = CpuOptions::default();
            let dense = linear.dequantize_base(opts);
            let mut y = vec![0f32; batch * 50];
            linear
                .forward_dense_baseline(&dense, &x, batch, &mut y, opts)
                .unwrap();
            assert_close(
                &y,
                &want,
                &magnitude,
                REL_TOL,
                &format!("dense baseline {format:?} batch {batch}"),
            );
        }
    }
}

/// The phased schedule (LoRA shrink as its own pass, what the benches compare the fused
/// region with) runs the same arithmetic: same result bits.
#[test]
fn lora_phased_schedule_gives_the_same_bits() {
    for format in FORMATS {
        for batch in [1, 3, 8, 20] {
            let in_features = legal_in_features(format, 272);
            let linear = random_linear(format, 300, in_features, 37, 5);
            let x = random_activations(batch * in_features, 5);
            for isa in Isa::available() {
                let opts = CpuOptions {
                    isa: Some(isa),
                    parallelism: Parallelism::Rayon,
                };
                let mut fused = vec![0f32; batch * 300];
                let mut phased = vec![0f32; batch * 300];
                linear.forward(&x, batch, &mut fused, opts).unwrap();
                linear
                    .forward_lora_phased(&x, batch, &mut phased, opts)
                    .unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&fused),
                    bits(&phased),
                    "{format:?} batch {batch} {}",
                    isa.name()
                );
            }
        }
    }
}

/// A prefill batch that is not a whole number of micro-kernel rows (262 tokens: 6 x 43 +
/// 4 on AVX2, 8 x 32 + 6 on AVX-512) runs its whole rows in place and its last rows
/// through a padded copy; each row's outputs are bit for bit those the same row gets in
/// a batch of whole rows (264 tokens, the copy-free path), with and without a LoRA.
#[test]
fn a_ragged_prefill_batch_gives_the_bits_of_a_whole_one() {
    let (ragged, whole) = (262, 264);
    for format in FORMATS {
        for rank in [0, 24] {
            let in_features = legal_in_features(format, 272);
            let linear = random_linear(format, 70, in_features, rank, 9);
            let x = random_activations(whole * in_features, 9);
            for isa in Isa::available() {
                let opts = CpuOptions {
                    isa: Some(isa),
                    parallelism: Parallelism::Rayon,
                };
                let mut y_whole = vec![f32::NAN; whole * 70];
                let mut y_ragged = vec![f32::NAN; ragged * 70];
                linear.forward(&x, whole, &mut y_whole, opts).unwrap();
                linear
                    .forward(&x[..ragged * in_features], ragged, &mut y_ragged, opts)
                    .unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&y_ragged),
                    bits(&y_whole[..ragged * 70]),
                    "{format:?} rank {rank} {}",
                    isa.name()
                );
            }
        }
    }
}

fn check_linear(linear: &QuantLoraLinear, batch: usize, x: &[f32], context: &str) {
    let (want, magnitude) = linear.forward_reference_with_magnitude(x, batch).unwrap();
    for isa in Isa::available() {
        let opts = CpuOptions {
            isa: Some(isa),
            parallelism: Parallelism::Rayon,
        };
        let mut y = vec![f32::NAN; batch * linear.out_features()];
        linear.forward(x, batch, &mut y, opts).unwrap();
        assert_close(
            &y,
            &want,
            &magnitude,
            REL_TOL,
            &format!("{context} {}", isa.name()),
        );
    }
}

/// fp8 tile multipliers >= 2^8 and activations near 1e20: the banded decode scales the
/// activation by `s * 2^(120 - e)` and must pick `e > 0` to stay finite.
#[test]
fn fp8_large_scales_and_activations_stay_finite() {
    let (out_features, in_features) = (260, 300);
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let codes = (0..out_features * in_features)
        .map(|_| {
            loop {
                let c: u8 = rng.random();
                if c & 0x7F != 0x7F {
                    break c;
                }
            }
        })
        .collect();
    let scales = (0..3 * 3).map(|i| [300.0f32, 1e-3, 7.0e4][i % 3]).collect();
    let base = QuantizedWeight::Fp8(Fp8Weight::block128(
        out_features,
        in_features,
        codes,
        scales,
    ));
    let linear = QuantLoraLinear::new(base, None).unwrap();
    for (batch, amplitude) in [(1, 1e20f32), (2, 1e-20), (5, 3.0)] {
        let x: Vec<f32> = (0..batch * in_features)
            .map(|_| rng.random_range(-1.0f32..1.0) * amplitude)
            .collect();
        check_linear(&linear, batch, &x, &format!("fp8 amplitude {amplitude:e}"));
    }
}

/// An NVFP4 global scale so large that `global * 2^120` overflows takes the generic
/// decoder; in-dims of 16 mod 32 and scale groups past 16 blocks take the tails.
#[test]
fn nvfp4_tails_and_large_global_scale() {
    for (in_features, global) in [(16, 1e-3f32), (48, 2.0), (272, 5e-3), (528, 1e3)] {
        let mut rng = ChaCha8Rng::seed_from_u64(in_features as u64);
        let out_features = 37;
        let packed = (0..out_features * in_features / 2)
            .map(|_| rng.random())
            .collect();
        let scales = (0..out_features * in_features / 16)
            .map(|_| rng.random_range(0u8..0x30))
            .collect();
        let base = QuantizedWeight::Nvfp4(Nvfp4Weight::new(
            out_features,
            in_features,
            packed,
            scales,
            Nvfp4GlobalScale::Multiplier(global),
        ));
        let linear = QuantLoraLinear::new(
            base,
            Some(common::random_lora(9, out_features, in_features, &mut rng)),
        )
        .unwrap();
        for batch in [1, 2, 4, 7] {
            let x = random_activations(batch * in_features, in_features as u64);
            check_linear(
                &linear,
                batch,
                &x,
                &format!("nvfp4 in {in_features} global {global:e} batch {batch}"),
            );
        }
    }
}

/// MXFP4 block scales at the ends of E8M0's range, code 0 (2^-127, an f32 subnormal)
/// included, through the AVX-512 step loop (one whole 128-input step and 96 trailing
/// inputs) and the generic decoders; activations scaled so every output is a normal
/// f32 far above the comparison's absolute floor.
#[test]
fn mxfp4_extreme_block_scales_match_reference() {
    let (out_features, in_features) = (37, 224);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (code, x_scale) in [(0u8, 1e30f32), (1, 1e30), (127, 1.0), (200, 1e-20)] {
        let packed: Vec<u8> = (0..out_features * in_features / 2)
            .map(|_| rng.random())
            .collect();
        let scales = vec![code; out_features * in_features / 32];
        let base = Mxfp4Weight::new(out_features, in_features, packed, scales);
        let linear = QuantLoraLinear::new(QuantizedWeight::Mxfp4(base), None).unwrap();
        for batch in [1usize, 3] {
            let x: Vec<f32> = random_activations(batch * in_features, u64::from(code))
                .iter()
                .map(|v| v * x_scale)
                .collect();
            let (want, magnitude) = linear.forward_reference_with_magnitude(&x, batch).unwrap();
            assert!(want.iter().all(|v| v.is_normal() || *v == 0.0));
            for isa in Isa::available() {
                let mut y = vec![f32::NAN; batch * out_features];
                let opts = CpuOptions {
                    isa: Some(isa),
                    parallelism: Parallelism::Sequential,
                };
                linear.forward(&x, batch, &mut y, opts).unwrap();
                let context = format!("mxfp4 scale code {code} batch {batch} {}", isa.name());
                assert_close(&y, &want, &magnitude, REL_TOL, &context);
            }
        }
    }
}

/// A GGUF base's fused linear on the stored blocks (the factored AVX-512 loops and the
/// dequantizing AVX2 loops of Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and IQ4_XS; the scalar
/// decode of Q2_K) equals the f64 reference within rounding tolerance, and so does the
/// unfused baseline over `GgmlWeight::dequantize` (loraq-quant's whole-row decoder,
/// checked against gguf-py): the two differ by summation order and the AVX-512 loops'
/// factored scales only. Rows of one to several blocks, output counts that are not a
/// multiple of the four-row passes, every ISA, decode and prefill batches, with and
/// without a LoRA.
#[test]
fn ggml_fused_matches_reference_and_the_decoded_weight() {
    use loraq_quant::ggml::GgmlType;
    for ggml_type in [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
        GgmlType::Q2_K,
    ] {
        let format = Format::Ggml(ggml_type);
        for (out_features, in_features) in [(37, 520), (5, 1), (1, 300), (11, 1100)] {
            let in_features = legal_in_features(format, in_features);
            for rank in [0, 5] {
                let seed = 21 + in_features as u64;
                let linear = random_linear(format, out_features, in_features, rank, seed);
                let QuantizedWeight::Ggml(weight) = linear.base() else {
                    panic!("a ggml base")
                };
                let dense = weight.dequantize();
                for batch in [1, 3, 8, 9, 17] {
                    let x = random_activations(batch * in_features, 5);
                    let (want, magnitude) =
                        linear.forward_reference_with_magnitude(&x, batch).unwrap();
                    for isa in Isa::available() {
                        let opts = CpuOptions {
                            isa: Some(isa),
                            parallelism: Parallelism::Rayon,
                        };
                        let mut fused = vec![f32::NAN; batch * out_features];
                        let mut baseline = vec![f32::NAN; batch * out_features];
                        linear.forward(&x, batch, &mut fused, opts).unwrap();
                        linear
                            .forward_dense_baseline(&dense, &x, batch, &mut baseline, opts)
                            .unwrap();
                        let context = format!(
                            "{ggml_type} {out_features}x{in_features} {} batch {batch} rank {rank}",
                            isa.name()
                        );
                        assert_close(&fused, &want, &magnitude, REL_TOL, &context);
                        assert_close(&baseline, &want, &magnitude, REL_TOL, &context);
                        let context = format!("{context}: fused vs dense baseline");
                        assert_close(&fused, &baseline, &magnitude, REL_TOL, &context);
                    }
                }
            }
        }
    }
}
