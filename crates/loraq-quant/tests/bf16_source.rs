//! `Scheme::quantize_bf16` (bf16 bytes converted run by run inside the quantizer, what
//! `loraq quantize` runs on bf16 checkpoints) against `Scheme::quantize` on the same
//! values converted to f32 first (the path the numpy oracle checks in
//! oracle_schemes.rs): the same codes and scales, bit for bit, for every scheme and
//! for shapes that leave partial bands and blocks; the same refusals.

use half::bf16;
use loraq_quant::{Bf16WeightView, QuantError, Scheme, WeightView};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// bf16 bytes of a weight whose rows have very different scales, with all-zero runs
/// (the groups whose scale is defined specially) and exact -0.0.
fn weight(out_features: usize, in_features: usize, seed: u64) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut bytes = Vec::with_capacity(2 * out_features * in_features);
    for row in 0..out_features {
        let scale = 10f32.powi(rng.random_range(-6..3));
        let zero_run = rng.random_range(0..in_features.max(1));
        for col in 0..in_features {
            let x = if row % 7 == 3 && col / 64 == zero_run / 64 {
                if rng.random_bool(0.5) { -0.0 } else { 0.0 }
            } else {
                scale * rng.random_range(-1.0f32..1.0).powi(3)
            };
            bytes.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
        }
    }
    bytes
}

fn to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
        .collect()
}

#[test]
fn bf16_input_quantizes_as_its_f32_values_in_every_scheme() {
    // Shapes: partial 128-row bands and 128-column blocks, one row, many NVFP4 runs.
    for (i, &(out_features, in_features)) in [(300, 320), (1, 256), (129, 4096), (257, 160)]
        .iter()
        .enumerate()
    {
        let bytes = weight(out_features, in_features, i as u64);
        let values = to_f32(&bytes);
        for scheme in Scheme::ALL {
            if in_features % scheme.input_multiple() != 0 {
                continue;
            }
            let ours = scheme
                .quantize_bf16(Bf16WeightView::new("w", out_features, in_features, &bytes).unwrap())
                .unwrap();
            let reference = scheme
                .quantize(WeightView::new("w", out_features, in_features, &values).unwrap())
                .unwrap();
            assert_eq!(ours, reference, "{scheme} {out_features}x{in_features}");
        }
    }
}

#[test]
fn bf16_input_is_refused_as_its_f32_values_are() {
    let (out_features, in_features) = (130, 256);
    let mut bytes = weight(out_features, in_features, 9);
    // A NaN at row 129, column 17, and an infinity after it.
    let nan = 2 * (129 * in_features + 17);
    bytes[nan..nan + 2].copy_from_slice(&0x7FC0u16.to_le_bytes());
    let inf = nan + 40;
    bytes[inf..inf + 2].copy_from_slice(&0xFF80u16.to_le_bytes());
    let values = to_f32(&bytes);
    for scheme in Scheme::ALL {
        let view = Bf16WeightView::new("w", out_features, in_features, &bytes).unwrap();
        assert_eq!(
            view.first_non_finite().map(|(i, _)| i),
            Some(129 * in_features + 17)
        );
        let ours = scheme.quantize_bf16(view).unwrap_err();
        let reference = scheme
            .quantize(WeightView::new("w", out_features, in_features, &values).unwrap())
            .unwrap_err();
        assert_eq!(ours.to_string(), reference.to_string(), "{scheme}");
        assert!(
            matches!(
                ours,
                QuantError::NonFinite {
                    row: 129,
                    col: 17,
                    ..
                }
            ),
            "{ours}"
        );
    }
    // NVFP4 needs 16 | in_features, refused before the values are read.
    let odd = weight(4, 24, 1);
    let err = Scheme::Nvfp4
        .quantize_bf16(Bf16WeightView::new("w", 4, 24, &odd).unwrap())
        .unwrap_err();
    let reference = Scheme::Nvfp4
        .quantize(WeightView::new("w", 4, 24, &to_f32(&odd)).unwrap())
        .unwrap_err();
    assert_eq!(err.to_string(), reference.to_string());
    // The byte count must match the shape.
    assert!(Bf16WeightView::new("w", 4, 16, &odd).is_err());
}
