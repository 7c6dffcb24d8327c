//! Bad shapes and scales are refused with errors that say what is wrong.

mod common;

use half::bf16;
use loraq_kernels::{
    Bf16Weight, CpuOptions, Fp8Weight, Int4Weight, Isa, KernelError, LoraAdapter, Nvfp4Weight,
    QuantLoraLinear, QuantizedWeight,
};
use loraq_quant::Nvfp4GlobalScale;

#[test]
fn nvfp4_in_dim_not_divisible_by_16_is_refused() {
    let err = QuantLoraLinear::new(
        QuantizedWeight::Nvfp4(Nvfp4Weight::new(
            4,
            24,
            vec![0; 4 * 12],
            vec![0x38; 4],
            Nvfp4GlobalScale::Multiplier(1.0),
        )),
        None,
    )
    .unwrap_err();
    assert!(matches!(
        err,
        KernelError::InDimNotBlockAligned {
            format: "nvfp4",
            block: 16,
            in_features: 24
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
    let base = QuantizedWeight::Bf16(Bf16Weight::new(3, 4, vec![bf16::ONE; 12]));
    let lora = LoraAdapter::new(2, 5, 3, vec![bf16::ONE; 10], vec![bf16::ONE; 6], 1.0).unwrap();
    let err = QuantLoraLinear::new(base, Some(lora)).unwrap_err();
    assert!(
        matches!(err, KernelError::LoraShape { factor: "A", .. }),
        "{err}"
    );
}

#[test]
fn fp8_scales_must_cover_every_tile_and_be_finite() {
    let err = QuantLoraLinear::new(
        QuantizedWeight::Fp8(Fp8Weight::block128(129, 10, vec![0; 1290], vec![1.0])),
        None,
    )
    .unwrap_err();
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
    let err = QuantLoraLinear::new(
        QuantizedWeight::Fp8(Fp8Weight::block128(2, 2, vec![0; 4], vec![f32::INFINITY])),
        None,
    )
    .unwrap_err();
    assert!(matches!(err, KernelError::BadScale { .. }), "{err}");
    let err = QuantLoraLinear::new(
        QuantizedWeight::Fp8(Fp8Weight::block128(2, 2, vec![0, 0x7F, 0, 0], vec![1.0])),
        None,
    )
    .unwrap_err();
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
                in_features: 4,
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
                out_features: 3,
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
    for scheme in [
        Scheme::Fp8Block128,
        Scheme::Nvfp4,
        Scheme::Mxfp4,
        Scheme::Int4G128Sym,
        Scheme::Int4G128Asym,
    ] {
        let quantized = scheme
            .quantize(WeightView::new("w", rows, cols, &data).unwrap())
            .unwrap();
        let expected = quantized.dequantize();
        let base = quantized;
        for (i, &e) in expected.iter().enumerate() {
            let got = loraq_kernels::reference::weight_element(&base, i / cols, i % cols);
            assert_eq!(got as f32, e, "{scheme:?} element {i}");
        }
        // The fast path's SIMD decoders give the same values (NVFP4 code 8 is -0.0 there,
        // +0.0 in loraq-quant: equal as numbers).
        let linear = QuantLoraLinear::new(base, None).unwrap();
        for isa in Isa::available() {
            let opts = CpuOptions {
                isa: Some(isa),
                ..CpuOptions::default()
            };
            let dense = linear.dequantize_base(opts);
            for (i, (&got, &e)) in dense.iter().zip(&expected).enumerate() {
                assert_eq!(got, e, "{scheme:?} {} element {i}", isa.name());
            }
        }
    }
    // NVFP4 with a compressed-tensors divisor global scale: every decoder gives
    // loraq-quant's own dequantization (`element * (block_scale / d)`) bit for bit.
    let QuantizedWeight::Nvfp4(mut nvfp4) = Scheme::Nvfp4
        .quantize(WeightView::new("w", rows, cols, &data).unwrap())
        .unwrap()
    else {
        unreachable!("nvfp4 quantizes to NVFP4")
    };
    nvfp4.global_scale = loraq_quant::Nvfp4GlobalScale::Divisor(2688.0 / 1.5);
    let divisor = QuantizedWeight::Nvfp4(nvfp4);
    let expected = divisor.dequantize();
    let linear = QuantLoraLinear::new(divisor, None).unwrap();
    for isa in Isa::available() {
        let opts = CpuOptions {
            isa: Some(isa),
            ..CpuOptions::default()
        };
        let dense = linear.dequantize_base(opts);
        for (i, (&got, &e)) in dense.iter().zip(&expected).enumerate() {
            assert_eq!(got, e, "nvfp4 divisor {} element {i}", isa.name());
        }
    }
    // fp8 per tensor has no fused kernel.
    let per_tensor = Scheme::Fp8Tensor
        .quantize(WeightView::new("w", 2, 128, &data[..256]).unwrap())
        .unwrap();
    assert!(matches!(
        QuantLoraLinear::new(per_tensor, None),
        Err(KernelError::UnsupportedScheme { .. })
    ));
}

/// INT4 codes above 15 and zero points above 15 are refused, naming what is wrong.
#[test]
fn int4_codes_and_zero_points_above_15_are_refused() {
    let err = Int4Weight::from_codes(1, 4, &[1, 2, 16, 3], vec![0.5], vec![8]).unwrap_err();
    assert!(err.to_string().contains("int4-g128 code"), "{err}");
    let err = QuantLoraLinear::new(
        QuantizedWeight::Int4(Int4Weight::from_packed(
            1,
            4,
            vec![0x21, 0x43],
            vec![0.5],
            vec![16],
        )),
        None,
    )
    .unwrap_err();
    assert!(err.to_string().contains("zero point"), "{err}");
    let err = QuantLoraLinear::new(
        QuantizedWeight::Int4(Int4Weight::from_packed(
            1,
            5,
            vec![0x21, 0x43],
            vec![0.5],
            vec![8],
        )),
        None,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::ShapeMismatch {
                expected: 3,
                actual: 2,
                ..
            }
        ),
        "{err}"
    );
}
