//! Bad answers files: each is refused with the file name and line number of the
//! offending record in the message.

use std::path::PathBuf;

use loraq_eval::{CompareOptions, EvalError, compare_files};

const GOOD_A: &str = r#"{"id": "a", "options": ["A", "B"], "logits": [1.0, 0.0], "gold": "A"}"#;
const GOOD_B: &str = r#"{"id": "b", "options": ["A", "B"], "logits": [0.0, 1.0], "gold": "A"}"#;

struct Files {
    _dir: tempfile::TempDir,
    reference: PathBuf,
    candidate: PathBuf,
}

fn files(reference: &[&str], candidate: &[&str]) -> Files {
    let dir = tempfile::tempdir().unwrap();
    let reference_path = dir.path().join("ref.jsonl");
    let candidate_path = dir.path().join("cand.jsonl");
    std::fs::write(&reference_path, reference.join("\n")).unwrap();
    std::fs::write(&candidate_path, candidate.join("\n")).unwrap();
    Files {
        _dir: dir,
        reference: reference_path,
        candidate: candidate_path,
    }
}

fn run(
    reference: &[&str],
    candidate: &[&str],
    allow_unpaired: bool,
) -> Result<loraq_eval::Comparison, EvalError> {
    let f = files(reference, candidate);
    let options = CompareOptions {
        allow_unpaired,
        bootstrap: 100,
        ..CompareOptions::default()
    };
    compare_files(&f.reference, &f.candidate, &options)
}

fn message(err: EvalError) -> String {
    err.to_string()
}

#[test]
fn malformed_json_names_file_and_line() {
    let err = run(
        &[GOOD_A, GOOD_B],
        &[GOOD_A, r#"{"id": "b", "options": ["A", "B"]"#],
        false,
    )
    .unwrap_err();
    assert!(matches!(err, EvalError::Json { line: 2, .. }), "{err:?}");
    let msg = message(err);
    assert!(msg.contains("cand.jsonl:2: malformed JSON"), "{msg}");
}

#[test]
fn missing_field_names_the_field_and_line() {
    let err = run(
        &[GOOD_A, r#"{"id": "b", "logits": [0.0, 1.0]}"#],
        &[GOOD_A, GOOD_B],
        false,
    )
    .unwrap_err();
    let msg = message(err);
    assert!(
        msg.contains("ref.jsonl:2: missing field `options`"),
        "{msg}"
    );
    let err = run(
        &[GOOD_A],
        &[r#"{"options": ["A", "B"], "logits": [0, 1]}"#],
        false,
    )
    .unwrap_err();
    assert!(message(err).contains("cand.jsonl:1: missing field `id`"));
    let err = run(&[GOOD_A], &[r#"{"id": "a", "options": ["A", "B"]}"#], false).unwrap_err();
    assert!(message(err).contains("cand.jsonl:1: missing field `logits`"));
}

#[test]
fn non_finite_logits_are_refused_with_their_position() {
    for (written, shown) in [
        ("NaN", "NaN"),
        ("Infinity", "Infinity"),
        ("-Infinity", "-Infinity"),
        ("null", "null"),
    ] {
        let bad = format!(r#"{{"id": "b", "options": ["A", "B"], "logits": [0.5, {written}]}}"#);
        let err = run(&[GOOD_A, GOOD_B], &[GOOD_A, "", &bad], false).unwrap_err();
        let msg = message(err);
        assert!(
            msg.contains("cand.jsonl:3: id \"b\": logits[1] is not a finite number")
                && msg.contains(shown),
            "{msg}"
        );
    }
    // Out of f64 range is malformed JSON for serde_json; still with the line.
    let bad = r#"{"id": "b", "options": ["A", "B"], "logits": [0.5, 1e999]}"#;
    let msg = message(run(&[GOOD_A, bad], &[GOOD_A, GOOD_B], false).unwrap_err());
    assert!(msg.contains("ref.jsonl:2:"), "{msg}");
}

#[test]
fn the_same_id_twice_is_refused_in_either_file() {
    let err = run(&[GOOD_A, GOOD_B, GOOD_A], &[GOOD_A, GOOD_B], false).unwrap_err();
    assert!(
        matches!(
            err,
            EvalError::DuplicateId {
                line: 3,
                first_line: 1,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(message(err).contains("ref.jsonl:3: duplicate id \"a\" (first at line 1)"));
    let err = run(&[GOOD_A, GOOD_B], &[GOOD_B, GOOD_A, GOOD_B], false).unwrap_err();
    assert!(message(err).contains("cand.jsonl:3: duplicate id \"b\" (first at line 1)"));
}

#[test]
fn the_same_id_with_different_options_is_refused() {
    let reordered = r#"{"id": "b", "options": ["B", "A"], "logits": [0.0, 1.0], "gold": "A"}"#;
    let err = run(&[GOOD_A, GOOD_B], &[GOOD_A, reordered], false).unwrap_err();
    let msg = message(err);
    assert!(
        msg.contains("cand.jsonl:2: id \"b\": options differ from")
            && msg.contains("ref.jsonl:2")
            && msg.contains(r#"["B","A"] vs ["A","B"]"#),
        "{msg}"
    );
}

#[test]
fn gold_or_group_disagreeing_between_files_is_refused() {
    let other_gold = r#"{"id": "b", "options": ["A", "B"], "logits": [0.0, 1.0], "gold": "B"}"#;
    let msg = message(run(&[GOOD_A, GOOD_B], &[GOOD_A, other_gold], false).unwrap_err());
    assert!(msg.contains("cand.jsonl:2: id \"b\": gold differ"), "{msg}");
    let g1 = r#"{"id": "b", "group": "x", "options": ["A", "B"], "logits": [0.0, 1.0]}"#;
    let g2 = r#"{"id": "b", "group": "y", "options": ["A", "B"], "logits": [0.0, 1.0]}"#;
    let msg = message(run(&[GOOD_A, g1], &[GOOD_A, g2], false).unwrap_err());
    assert!(
        msg.contains("cand.jsonl:2: id \"b\": group differ"),
        "{msg}"
    );
}

#[test]
fn unpaired_ids_are_refused_unless_allowed_then_counted() {
    let c = r#"{"id": "c", "options": ["A", "B"], "logits": [0.0, 1.0]}"#;
    let msg = message(run(&[GOOD_A, GOOD_B], &[GOOD_A, c, GOOD_B], false).unwrap_err());
    assert!(
        msg.contains("cand.jsonl:2: id \"c\" has no answer in"),
        "{msg}"
    );
    let msg = message(run(&[GOOD_A, GOOD_B, c], &[GOOD_B], false).unwrap_err());
    assert!(
        msg.contains("ref.jsonl:1: id \"a\" has no answer in")
            && msg.contains("2 reference ids unpaired"),
        "{msg}"
    );
    let d = r#"{"id": "d", "options": ["A", "B"], "logits": [0.0, 1.0]}"#;
    let comparison = run(&[GOOD_A, GOOD_B, c], &[GOOD_B, d], true).unwrap();
    assert_eq!(comparison.report.n, 1);
    assert_eq!(comparison.report.unpaired, 3);
    assert_eq!(
        (comparison.reference_only, comparison.candidate_only),
        (2, 1)
    );
}

#[test]
fn inconsistent_records_are_refused() {
    let cases = [
        (
            r#"{"id": "", "options": ["A", "B"], "logits": [0, 1]}"#,
            "empty id",
        ),
        (
            r#"{"id": "x", "options": ["A"], "logits": [0]}"#,
            "at least 2",
        ),
        (
            r#"{"id": "x", "options": ["A", "A"], "logits": [0, 1]}"#,
            "appears twice",
        ),
        (
            r#"{"id": "x", "options": ["A", "B"], "logits": [0, 1, 2]}"#,
            "3 entries",
        ),
        (
            r#"{"id": "x", "options": ["A", "B"], "logits": [0, 1], "probs": [0.5, 0.5]}"#,
            "both",
        ),
        (
            r#"{"id": "x", "options": ["A", "B"], "logits": [0, 1], "gold": "C"}"#,
            "not one of the options",
        ),
        (
            r#"{"id": "x", "options": ["A", "B"], "logits": ["0", 1]}"#,
            "malformed JSON",
        ),
    ];
    for (line, expected) in cases {
        let msg = message(run(&[GOOD_A, line], &[GOOD_A], true).unwrap_err());
        assert!(
            msg.contains("ref.jsonl:2:") && msg.contains(expected),
            "{msg}"
        );
    }
}

#[test]
fn zero_probabilities_that_make_kl_or_nll_infinite_are_named() {
    let zero = r#"{"id": "b", "options": ["A", "B"], "probs": [0.0, 1.0], "gold": "A"}"#;
    let msg = message(run(&[GOOD_A, GOOD_B], &[GOOD_A, zero], false).unwrap_err());
    assert!(
        msg.contains("cand.jsonl:2: id \"b\": KL(reference || candidate) is infinite"),
        "{msg}"
    );
    let msg = message(run(&[GOOD_A, zero], &[GOOD_A, zero], false).unwrap_err());
    assert!(
        msg.contains("ref.jsonl:2: id \"b\": NLL is infinite"),
        "{msg}"
    );
    // Zeros where the reference is zero too are fine without gold.
    let zero_no_gold = r#"{"id": "b", "options": ["A", "B"], "probs": [0.0, 1.0]}"#;
    let c = run(&[GOOD_A, zero_no_gold], &[GOOD_A, zero_no_gold], false).unwrap();
    assert_eq!(c.report.kl.max, 0.0);
}

#[test]
fn no_common_id_is_an_error() {
    let msg = message(run(&[GOOD_A], &[GOOD_B], true).unwrap_err());
    assert!(msg.contains("no question id in common"), "{msg}");
}
