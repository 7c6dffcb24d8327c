//! Every figure of the comparison report against the independent oracle
//! (scripts/eval_oracle.py: numpy / scipy / scikit-learn), on the committed answer
//! files under tests/data/eval/.

use std::path::PathBuf;

use loraq_eval::{CompareOptions, compare_files};
use serde_json::Value;

/// Tolerance of every oracle figure except the bootstrap bounds.
const TOLERANCE: f64 = 1e-9;
/// Tolerance of the bootstrap bounds (two different random streams).
const BOOTSTRAP_TOLERANCE: f64 = 1e-3;

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/eval")
}

fn expected(case: &str) -> Value {
    let path = data_dir().join(case).join("expected.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn options_of(expected: &Value) -> CompareOptions {
    let o = &expected["_options"];
    CompareOptions {
        bins: o["bins"].as_u64().unwrap() as usize,
        bootstrap: o["bootstrap"].as_u64().unwrap() as usize,
        seed: o["seed"].as_u64().unwrap(),
        allow_unpaired: o["allow_unpaired"].as_bool().unwrap(),
    }
}

/// Compares `ours` with `theirs` recursively: the same keys (oracle keys starting
/// with `_` are extras, not report keys), integers equal, floats within
/// TOLERANCE x max(1, |theirs|); p-values also within TOLERANCE relative.
fn assert_close(ours: &Value, theirs: &Value, path: &str) {
    match (ours, theirs) {
        (Value::Object(a), Value::Object(b)) => {
            let b_keys: Vec<&String> = b.keys().filter(|k| !k.starts_with('_')).collect();
            let a_keys: Vec<&String> = a.keys().collect();
            assert_eq!(a_keys, b_keys, "keys of {path}");
            for key in b_keys {
                assert_close(&a[key], &b[key], &format!("{path}.{key}"));
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "length of {path}");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_close(x, y, &format!("{path}[{i}]"));
            }
        }
        (Value::Number(a), Value::Number(b)) => {
            if b.is_u64() {
                assert_eq!(a.as_u64(), b.as_u64(), "{path}");
                return;
            }
            let (x, y) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            let tolerance = if path.contains("delta_ci95") {
                BOOTSTRAP_TOLERANCE
            } else {
                TOLERANCE
            };
            assert!(
                (x - y).abs() <= tolerance * y.abs().max(1.0),
                "{path}: ours {x:e}, oracle {y:e}"
            );
            if path.contains("mcnemar") {
                assert!(
                    (x - y).abs() <= TOLERANCE * y.abs(),
                    "{path}: ours {x:e}, oracle {y:e} (relative)"
                );
            }
        }
        _ => assert_eq!(ours, theirs, "{path}"),
    }
}

fn check_case(case: &str) {
    let expected = expected(case);
    let dir = data_dir().join(case);
    let comparison = compare_files(
        dir.join("reference.jsonl"),
        dir.join("candidate.jsonl"),
        &options_of(&expected),
    )
    .unwrap();
    let ours = serde_json::to_value(&comparison.report).unwrap();
    assert_close(&ours, &expected, case);

    // Reliability tables and flip margins, which the renderings use.
    match &comparison.reliability {
        Some((reference, candidate)) => {
            let tables = &expected["_tables"];
            assert_close(
                &serde_json::to_value(reference).unwrap(),
                &tables["reference"],
                &format!("{case} reliability reference"),
            );
            assert_close(
                &serde_json::to_value(candidate).unwrap(),
                &tables["candidate"],
                &format!("{case} reliability candidate"),
            );
        }
        None => assert!(expected["_tables"].as_object().unwrap().is_empty()),
    }
    assert_close(
        &serde_json::to_value(&comparison.flip_margins).unwrap(),
        &expected["_flip_margins"],
        &format!("{case} flip margins"),
    );
    // The bootstrap bounds also against the exact (infinite-resample) quantiles.
    if let (Some(ci), Some(exact)) = (
        comparison.report.accuracy.delta_ci95,
        expected["_exact_bootstrap_ci95"].as_array(),
    ) {
        for (ours, exact) in ci.iter().zip(exact) {
            let exact = exact.as_f64().unwrap();
            assert!(
                (ours - exact).abs() <= BOOTSTRAP_TOLERANCE,
                "{case}: bootstrap bound {ours} vs exact {exact}"
            );
        }
    }
}

#[test]
fn gold_groups_matches_oracle() {
    check_case("gold_groups");
}

#[test]
fn no_gold_matches_oracle_with_null_gold_fields() {
    check_case("no_gold");
}

#[test]
fn partial_gold_with_unpaired_ids_matches_oracle() {
    check_case("partial_gold_unpaired");
}

#[test]
fn eleven_questions_four_bins_match_oracle() {
    check_case("small_bins4");
}

#[test]
fn candidate_order_does_not_change_the_report() {
    // The candidate file of gold_groups is shuffled; pairs follow the reference, so
    // reversing the candidate lines again gives the identical report.
    let dir = data_dir().join("gold_groups");
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(dir.join("candidate.jsonl")).unwrap();
    let reversed: Vec<&str> = text.lines().rev().collect();
    let candidate = tmp.path().join("candidate.jsonl");
    std::fs::write(&candidate, reversed.join("\n")).unwrap();
    let options = CompareOptions::default();
    let a = compare_files(
        dir.join("reference.jsonl"),
        dir.join("candidate.jsonl"),
        &options,
    )
    .unwrap();
    let b = compare_files(dir.join("reference.jsonl"), &candidate, &options).unwrap();
    assert_eq!(a.report, b.report);
}
