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
