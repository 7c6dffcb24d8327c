//! Bad shapes and scales are refused with errors that say what is wrong.

mod common;

use half::bf16;
use loraq_kernels::{
    BaseWeight, Bf16Weight, CpuOptions, Fp8Block128Weight, KernelError, LoraAdapter, Nvfp4Weight,
    QuantLoraLinear,
};

#[test]
fn nvfp4_in_dim_not_divisible_by_16_is_refused() {
    let err = Nvfp4Weight::new(4, 24, vec![0; 4 * 12], vec![0x38; 4], 1.0).unwrap_err();
    assert!(matches!(
        err,
        KernelError::InDimNotBlockAligned {
            format: "nvfp4",
            block: 16,
            in_dim: 24
        }
    ));
    let message = err.to_string();
    assert!(
        message.contains("divisible by 16") && message.contains("24"),
        "{message}"
    );
}

#[test]
fn lora_rank_outside_1_to_512_is_refused() {
    for rank in [0usize, 513] {
        let err = LoraAdapter::new(
            rank,
            2,
            2,
            vec![bf16::ZERO; rank * 2],
            vec![bf16::ZERO; rank * 2],
            1.0,
        )
        .unwrap_err();
        assert!(
            matches!(err, KernelError::RankOutOfRange { max: 512, .. }),
            "{err}"
        );
    }
}

#[test]
fn lora_shape_must_match_the_base() {
    let base = BaseWeight::Bf16(Bf16Weight::new(3, 4, vec![bf16::ONE; 12]).unwrap());
    let lora = LoraAdapter::new(2, 5, 3, vec![bf16::ONE; 10], vec![bf16::ONE; 6], 1.0).unwrap();
    let err = QuantLoraLinear::new(base, Some(lora)).unwrap_err();
    assert!(
        matches!(err, KernelError::LoraShape { factor: "A", .. }),
        "{err}"
    );
}

#[test]
fn fp8_scales_must_cover_every_tile_and_be_finite() {
    let err = Fp8Block128Weight::new(129, 10, vec![0; 1290], vec![1.0]).unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::ShapeMismatch {
                expected: 2,
                actual: 1,
                ..
            }
        ),
        "{err}"
    );
    let err = Fp8Block128Weight::new(2, 2, vec![0; 4], vec![f32::INFINITY]).unwrap_err();
    assert!(matches!(err, KernelError::BadScale { .. }), "{err}");
    let err = Fp8Block128Weight::new(2, 2, vec![0, 0x7F, 0, 0], vec![1.0]).unwrap_err();
    assert!(
        matches!(err, KernelError::BadScale { index: 1, .. }),
        "{err}"
    );
}

#[test]
fn io_shapes_are_checked() {
    let linear = common::random_linear(common::Format::Bf16, 3, 4, 0, 1);
    let mut y = vec![0f32; 6];
    let err = linear
        .forward(&[0.0; 7], 2, &mut y, CpuOptions::default())
        .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::InputShape {
                batch: 2,
                in_dim: 4,
                actual: 7
            }
        ),
        "{err}"
    );
    let err = linear
        .forward(&[0.0; 8], 2, &mut y[..5], CpuOptions::default())
        .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::OutputShape {
                batch: 2,
                out_dim: 3,
                actual: 5
            }
        ),
        "{err}"
    );
}

/// A weight quantized by loraq-quant converts to a base weight whose reference decode
/// equals loraq-quant's own dequantization, for every scheme with a fused kernel.
#[test]
fn loraq_quant_weights_convert_and_decode_identically() {
    use loraq_quant::{Scheme, WeightView};
    let (rows, cols) = (130, 160);
    let data: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    for scheme in [Scheme::Fp8Block128, Scheme::Nvfp4, Scheme::Mxfp4] {
        let quantized = scheme
            .quantize(WeightView::new("w", rows, cols, &data).unwrap())
            .unwrap();
        let expected = quantized.dequantize();
        let base = BaseWeight::try_from(quantized).unwrap();
        for (i, &e) in expected.iter().enumerate() {
            let got = loraq_kernels::reference::weight_element(&base, i / cols, i % cols);
            assert_eq!(got as f32, e, "{scheme:?} element {i}");
        }
    }
    let int4 = Scheme::Int4G128Sym
        .quantize(WeightView::new("w", 2, 128, &data[..256]).unwrap())
        .unwrap();
    assert!(matches!(
        BaseWeight::try_from(int4),
        Err(KernelError::UnsupportedScheme { .. })
    ));
}
