//! Activation fake-quant against the numpy + ml_dtypes oracle: outlier channel,
//! all-zero token and group, a token below the per-token eps, a static scale that
//! saturates, an NVFP4 global scale small enough to clamp block scales at 448.

mod common;

use loraq_quant::activation;

fn check(key: &str, run: impl FnOnce(&mut [f32], usize)) {
    let manifest = common::manifest();
    let act = &manifest["activations"];
    let hidden = common::usize_of(&act["hidden"]);
    let mut values = common::f32s(&act["values"]);
    assert_eq!(values.len(), hidden * common::usize_of(&act["tokens"]));
    run(&mut values, hidden);
    let expected = common::f32s(&act[key]);
    for (i, (ours, theirs)) in values.iter().zip(&expected).enumerate() {
        assert_eq!(
            ours.to_bits(),
            theirs.to_bits(),
            "{key}: token {}, channel {}: {ours} vs oracle {theirs}",
            i / hidden,
            i % hidden
        );
    }
}

fn scalar(key: &str) -> f32 {
    common::manifest()["activations"][key].as_f64().unwrap() as f32
}

#[test]
fn fp8_per_token_matches_oracle() {
    assert_eq!(scalar("per_token_eps"), activation::PER_TOKEN_EPS);
    check("fp8_per_token", |x, h| {
        activation::fp8_per_token("x", x, h, activation::PER_TOKEN_EPS).unwrap()
    });
}

#[test]
fn fp8_per_group_matches_oracle() {
    assert_eq!(scalar("per_group_eps"), activation::PER_GROUP_EPS);
    check("fp8_per_group", |x, h| {
        activation::fp8_per_group("x", x, h, activation::PER_GROUP_EPS).unwrap()
    });
}

#[test]
fn fp8_static_matches_oracle() {
    let scale = scalar("static_scale");
    check("fp8_static", |x, _| {
        activation::fp8_static("x", x, scale).unwrap()
    });
}

#[test]
fn nvfp4_dynamic_matches_oracle() {
    let global = scalar("nvfp4_global_scale");
    check("nvfp4_dynamic", |x, h| {
        activation::nvfp4_dynamic("x", x, h, global).unwrap()
    });
}

/// The vectors of scripts/nvfp4_act_vllm_oracle.py (vLLM's `ref_nvfp4_quant` in
/// torch): input, stored scales, and the expected fake-quant per direction.
struct VllmVectors {
    x: Vec<f32>,
    hidden: usize,
    manifest: serde_json::Value,
}

fn vllm_vectors() -> VllmVectors {
    let dir = common::data_dir().join("act_nvfp4_vllm");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let hidden = common::usize_of(&manifest["hidden"]);
    let x = common::f32s(&"act_nvfp4_vllm/x.f32".into());
    assert_eq!(x.len(), hidden * common::usize_of(&manifest["tokens"]));
    VllmVectors {
        x,
        hidden,
        manifest,
    }
}

fn scale_of(v: &VllmVectors, key: &str) -> f32 {
    f32::from_bits(v.manifest[key].as_u64().unwrap() as u32)
}

/// Bit equality, except that +0 and -0 are the same: the sign of a zero
/// activation is invisible to the GEMM, and vLLM's two implementations disagree on
/// it (the CUDA kernel's `cvt` keeps the sign of `-0`, the torch reference's
/// `sign(x) * |x|` makes it `+0`).
fn assert_same_bits(ours: &[f32], expected: &[f32], hidden: usize, what: &str) {
    assert_eq!(ours.len(), expected.len());
    for (i, (o, e)) in ours.iter().zip(expected).enumerate() {
        let (o, e) = (o + 0.0, e + 0.0);
        assert_eq!(
            o.to_bits(),
            e.to_bits(),
            "{what}: token {}, channel {}: {o} vs vLLM {e}",
            i / hidden,
            i % hidden
        );
    }
}

/// `loraq run --act-quant nvfp4` on a ModelOpt checkpoint quantizes activations
/// as vLLM does with `input_scale`: its quantization scale is `1 / input_scale`, a
/// block whose scale rounds to 0 becomes 0, and outlier blocks saturate at 448.
#[test]
fn nvfp4_static_vllm_matches_vllm_with_modelopt_input_scale() {
    let v = vllm_vectors();
    let scale = scale_of(&v, "modelopt_input_scale_bits");
    let mut x = v.x.clone();
    activation::nvfp4_static_vllm(
        "x",
        &mut x,
        v.hidden,
        loraq_quant::Nvfp4GlobalScale::Multiplier(scale),
    )
    .unwrap();
    let expected = common::f32s(&"act_nvfp4_vllm/modelopt.f32".into());
    assert_same_bits(&x, &expected, v.hidden, "modelopt input_scale");
}

/// The same with a compressed-tensors `input_global_scale`, a divisor vLLM uses
/// as the quantization scale directly.
#[test]
fn nvfp4_static_vllm_matches_vllm_with_compressed_tensors_input_global_scale() {
    let v = vllm_vectors();
    let divisor = scale_of(&v, "ct_input_global_scale_bits");
    let mut x = v.x.clone();
    activation::nvfp4_static_vllm(
        "x",
        &mut x,
        v.hidden,
        loraq_quant::Nvfp4GlobalScale::Divisor(divisor),
    )
    .unwrap();
    let expected = common::f32s(&"act_nvfp4_vllm/ct.f32".into());
    assert_same_bits(
        &x,
        &expected,
        v.hidden,
        "compressed-tensors input_global_scale",
    );
}

/// Regression: `--act-quant nvfp4` used the weight formula, whose block scale is
/// floored at 2^-9, so blocks vLLM zeroes (scale rounding to 0 in E4M3) came out
/// non-zero; token 4 of the vectors holds such blocks.
#[test]
fn nvfp4_activation_blocks_below_the_e4m3_range_quantize_to_zero_as_in_vllm() {
    let v = vllm_vectors();
    let scale = scale_of(&v, "modelopt_input_scale_bits");
    let token = 4 * v.hidden..5 * v.hidden;
    let mut weight_formula = v.x.clone();
    activation::nvfp4_dynamic("x", &mut weight_formula, v.hidden, scale).unwrap();
    assert!(
        weight_formula[token.clone()].iter().any(|&y| y != 0.0),
        "the weight formula keeps some of the tiny token"
    );
    let mut served = v.x.clone();
    activation::nvfp4_static_vllm(
        "x",
        &mut served,
        v.hidden,
        loraq_quant::Nvfp4GlobalScale::Multiplier(scale),
    )
    .unwrap();
    assert!(served[token].iter().all(|&y| y == 0.0));
}
