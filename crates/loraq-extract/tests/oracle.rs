//! loraq-extract's numerics against numpy / ml_dtypes (vectors written once by
//! scripts/extract_oracle.py): the bf16 rounding floor, singular values and truncated
//! residuals of real bf16-merge deltas.

use loraq_extract::factor::{FactorParams, Method, factorize};
use loraq_extract::floor::{FloorFormat, rounding_floor};
use serde_json::Value;

fn oracle() -> Value {
    let text = include_str!("data/oracle.json");
    serde_json::from_str(text).expect("oracle.json parses")
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn rounding_floor_matches_ml_dtypes_spacing() {
    for case in oracle()["floors"].as_array().unwrap() {
        let values: Vec<f32> = case["bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| half::bf16::from_bits(b.as_u64().unwrap() as u16).to_f32())
            .collect();
        let expected = case["floor"].as_f64().unwrap();
        let ours = rounding_floor(&values, FloorFormat::Bf16);
        assert!(
            (ours / expected - 1.0).abs() < 1e-12,
            "{ours} vs {expected}"
        );
    }
}

#[test]
fn singular_values_and_truncated_residuals_match_numpy() {
    for case in oracle()["svd"].as_array().unwrap() {
        let rows = case["rows"].as_u64().unwrap() as usize;
        let cols = case["cols"].as_u64().unwrap() as usize;
        let delta: Vec<f32> = floats(&case["delta"]).iter().map(|&x| x as f32).collect();
        let s_numpy = floats(&case["singular_values"]);
        let delta_norm = case["delta_norm"].as_f64().unwrap();
        let true_rank = case["true_rank"].as_u64().unwrap() as usize;
        for (rank, residual) in case["residuals"].as_object().unwrap() {
            let rank: usize = rank.parse().unwrap();
            let residual = residual.as_f64().unwrap();
            for method in [Method::Exact, Method::Randomized] {
                let params = FactorParams {
                    max_rank: rank,
                    method,
                    oversample: 4,
                    ..FactorParams::default()
                };
                let f = factorize("oracle", &delta, rows, cols, &params).unwrap();
                assert_eq!(f.kept(), rank);
                assert!((f.delta_norm() / delta_norm - 1.0).abs() < 1e-12);
                let ours = f.truncation_residual(rank);
                // Exact: f64 throughout. Randomized: the f32 passes limit the identity
                // ||D||^2 - sum s^2 to about 1e-7 of ||D||^2.
                let tolerance = match method {
                    Method::Exact => 1e-8 * delta_norm,
                    _ => 3e-4 * delta_norm,
                };
                assert!(
                    (ours - residual).abs() <= tolerance,
                    "{rows}x{cols} rank {rank} {method:?}: {ours} vs numpy {residual}"
                );
                // The randomized method resolves the signal's singular values; those at the
                // noise level only approximately (they do not change the residual much).
                let resolved = if method == Method::Exact {
                    rank
                } else {
                    rank.min(true_rank)
                };
                for (i, (&a, &b)) in f.s.iter().zip(&s_numpy).take(resolved).enumerate() {
                    let tol = if method == Method::Exact { 1e-10 } else { 1e-5 };
                    assert!(
                        (a - b).abs() <= tol * s_numpy[0],
                        "{rows}x{cols} {method:?} s[{i}] {a} vs {b}"
                    );
                }
            }
        }
    }
}
