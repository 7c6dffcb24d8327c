//! Bad input gets a clear error naming the tensor.

use loraq_quant::{QuantError, Scheme, WeightView, activation};

fn message(err: QuantError) -> String {
    err.to_string()
}

#[test]
fn nvfp4_refuses_input_dim_not_divisible_by_16() {
    let data = vec![0.5f32; 4 * 24];
    let view = WeightView::new("layers.0.mlp.up_proj.weight", 4, 24, &data).unwrap();
    let err = Scheme::Nvfp4.quantize(view).unwrap_err();
    assert!(matches!(
        err,
        QuantError::InputDimNotDivisible {
            multiple: 16,
            in_features: 24,
            ..
        }
    ));
    let text = message(err);
    assert!(text.contains("layers.0.mlp.up_proj.weight"), "{text}");
    assert!(
        text.contains("nvfp4") && text.contains("16") && text.contains("24"),
        "{text}"
    );
}

#[test]
fn mxfp4_refuses_input_dim_not_divisible_by_32() {
    let data = vec![0.5f32; 2 * 48];
    let view = WeightView::new("w", 2, 48, &data).unwrap();
    let err = Scheme::Mxfp4.quantize(view).unwrap_err();
    assert!(matches!(
        err,
        QuantError::InputDimNotDivisible {
            multiple: 32,
            in_features: 48,
            ..
        }
    ));
}

#[test]
fn every_scheme_refuses_nan_and_inf_weights_naming_the_entry() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut data = vec![0.25f32; 3 * 64];
        data[2 * 64 + 17] = bad;
        let view = WeightView::new("model.layers.7.self_attn.q_proj.weight", 3, 64, &data).unwrap();
        for scheme in Scheme::ALL {
            let err = scheme.quantize(view).unwrap_err();
            match &err {
                QuantError::NonFinite {
                    tensor,
                    row,
                    col,
                    value,
                } => {
                    assert_eq!(tensor, "model.layers.7.self_attn.q_proj.weight");
                    assert_eq!((*row, *col), (2, 17), "{scheme}");
                    assert_eq!(value.to_bits(), bad.to_bits());
                }
                other => panic!("{scheme}: unexpected error {other}"),
            }
            assert!(message(err).contains("q_proj"), "{scheme}");
        }
    }
}

#[test]
fn unknown_scheme_lists_the_known_ones() {
    let err = "fp8-block64".parse::<Scheme>().unwrap_err();
    let text = message(err);
    assert!(
        text.contains("fp8-block64") && text.contains("fp8-block128"),
        "{text}"
    );
    assert_eq!("int4-g128".parse::<Scheme>().unwrap(), Scheme::Int4G128Sym);
    for scheme in Scheme::ALL {
        assert_eq!(scheme.name().parse::<Scheme>().unwrap(), scheme);
    }
}

#[test]
fn shape_mismatch_is_refused() {
    let data = vec![0.0f32; 10];
    let err = WeightView::new("w", 3, 4, &data).unwrap_err();
    assert!(matches!(
        err,
        QuantError::ShapeMismatch {
            out_features: 3,
            in_features: 4,
            len: 10,
            ..
        }
    ));
    let err = WeightView::new("w", usize::MAX, 2, &data).unwrap_err();
    assert!(matches!(err, QuantError::ShapeMismatch { .. }));
}

#[test]
fn activation_quantizers_refuse_bad_scales_and_widths() {
    let mut x = vec![1.0f32; 32];
    assert!(matches!(
        activation::fp8_static("x", &mut x, 0.0),
        Err(QuantError::BadScale { .. })
    ));
    assert!(matches!(
        activation::nvfp4_dynamic("x", &mut x, 8, 1.0),
        Err(QuantError::InputDimNotDivisible { .. })
    ));
    assert!(matches!(
        activation::fp8_per_token("x", &mut x, 5, activation::PER_TOKEN_EPS),
        Err(QuantError::ShapeMismatch { .. })
    ));
}
