//! Element formats against ml_dtypes (vectors from scripts/quant_oracle.py): every
//! code decodes to ml_dtypes' value, and every one of >100,000 inputs encodes to
//! ml_dtypes' code, except the documented saturation classes, which are checked
//! against the documented value instead (and must occur in the vectors).

mod common;

use loraq_quant::ElementFormat;
use loraq_quant::element::{
    E2M1_TABLE, E4M3_TABLE, E5M2_TABLE, E8M0_TABLE, e2m1_encode, e4m3_encode, e5m2_encode,
    e8m0_encode,
};

fn same_value(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn check_decode(name: &str, table: &[f32]) {
    let manifest = common::manifest();
    let expected = common::f32s(&manifest["elements"][name]["decode"]);
    assert_eq!(expected.len(), table.len(), "{name}: code count");
    for (code, (&ours, &theirs)) in table.iter().zip(&expected).enumerate() {
        assert!(
            same_value(ours, theirs),
            "{name}: code {code:#04x} decodes to {ours}, ml_dtypes {theirs}"
        );
    }
}

#[test]
fn e4m3_decodes_all_256_codes_like_ml_dtypes() {
    check_decode("e4m3", &E4M3_TABLE);
}

#[test]
fn e5m2_decodes_all_256_codes_like_ml_dtypes() {
    check_decode("e5m2", &E5M2_TABLE);
}

#[test]
fn e2m1_decodes_all_16_codes_like_ml_dtypes() {
    check_decode("e2m1", &E2M1_TABLE);
}

#[test]
fn e8m0_decodes_all_256_codes_like_ml_dtypes() {
    check_decode("e8m0", &E8M0_TABLE);
}

/// Where our saturating encoder is documented to differ from ml_dtypes, the code we
/// give instead; `None` means "must equal ml_dtypes".
type Deviation = fn(f32) -> Option<u8>;

fn check_encode(name: &str, encode: fn(f32) -> u8, deviation: Deviation) -> usize {
    let manifest = common::manifest();
    let inputs = common::f32s(&manifest["elements"]["inputs"]);
    let expected = common::bytes(&manifest["elements"][name]["codes"]);
    assert_eq!(inputs.len(), expected.len());
    assert!(inputs.len() >= 100_000, "at least 100,000 inputs");
    let mut deviations = 0;
    for (&x, &theirs) in inputs.iter().zip(&expected) {
        let ours = encode(x);
        match deviation(x) {
            Some(documented) => {
                deviations += 1;
                assert_eq!(ours, documented, "{name}: {x:e} ({:#010x})", x.to_bits());
            }
            None => assert_eq!(
                ours,
                theirs,
                "{name}: {x:e} ({:#010x}) encodes to {ours:#04x}, ml_dtypes {theirs:#04x}",
                x.to_bits()
            ),
        }
    }
    // The slice encoder must agree with the scalar one.
    let format = ElementFormat::ALL
        .into_iter()
        .find(|f| f.name() == name)
        .unwrap();
    let mut codes = vec![0u8; inputs.len()];
    format.encode_slice(&inputs, &mut codes);
    for (i, (&x, &c)) in inputs.iter().zip(&codes).enumerate() {
        assert_eq!(c, encode(x), "{name}: slice encode differs at {i}");
    }
    deviations
}

/// E4M3: ml_dtypes turns |x| >= 464 (finite) and Inf into NaN; quantizers clamp to
/// 448 first.
fn e4m3_deviation(x: f32) -> Option<u8> {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    (!x.is_nan() && x.abs() > 464.0).then_some(sign | 0x7E)
}

/// E5M2: ml_dtypes turns |x| >= 61440 and Inf into Inf; we saturate to 57344.
fn e5m2_deviation(x: f32) -> Option<u8> {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    (!x.is_nan() && x.abs() >= 61440.0).then_some(sign | 0x7B)
}

/// E2M1: ml_dtypes gives NaN a zero with the sign bit inverted; we give +0.
fn e2m1_deviation(x: f32) -> Option<u8> {
    x.is_nan().then_some(0)
}

/// E8M0: overflow (rounding past 2^127) and +Inf saturate to 2^127 (ml_dtypes: NaN);
/// f32 subnormals round by value (ml_dtypes also sends (2^-127, 1.5 * 2^-127) up).
fn e8m0_deviation(x: f32) -> Option<u8> {
    if x > 0.0 && x.to_bits() >= 0x7F40_0000 {
        return Some(254);
    }
    let bits = x.to_bits();
    if x > 0.0 && bits > 0x0040_0000 && bits < 0x0060_0000 {
        return Some(0);
    }
    None
}

#[test]
fn e4m3_encodes_like_ml_dtypes_except_saturation() {
    let deviations = check_encode("e4m3", e4m3_encode, e4m3_deviation);
    assert!(
        deviations > 100,
        "overflow inputs are covered ({deviations})"
    );
}

#[test]
fn e5m2_encodes_like_ml_dtypes_except_saturation() {
    let deviations = check_encode("e5m2", e5m2_encode, e5m2_deviation);
    assert!(
        deviations > 100,
        "overflow inputs are covered ({deviations})"
    );
}

#[test]
fn e2m1_encodes_like_ml_dtypes_except_nan() {
    let deviations = check_encode("e2m1", e2m1_encode, e2m1_deviation);
    assert!(deviations >= 2, "NaN inputs are covered ({deviations})");
}

#[test]
fn e8m0_encodes_like_ml_dtypes_except_saturation_and_f32_subnormals() {
    let deviations = check_encode("e8m0", e8m0_encode, e8m0_deviation);
    assert!(
        deviations > 10,
        "overflow inputs are covered ({deviations})"
    );
}

#[test]
fn e4m3_464_is_a_tie_that_rounds_to_448_in_both() {
    // The boundary of the documented deviation: 464 is the midpoint of 448 and the
    // (NaN) code above it; ml_dtypes also gives 448 there.
    assert_eq!(e4m3_encode(464.0), 0x7E);
    assert_eq!(e4m3_encode(-464.0), 0xFE);
    assert_eq!(e4m3_encode(f32::INFINITY), 0x7E);
    assert_eq!(e4m3_encode(f32::NAN), 0x7F);
}
