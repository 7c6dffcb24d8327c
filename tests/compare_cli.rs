//! End-to-end tests of `loraq compare` (and `compare-hidden` where loraq-io is
//! there): the binary on the committed answer files of tests/data/eval, checked
//! against the oracle's expected JSON (scripts/eval_oracle.py).

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{loraq, stderr};
use serde_json::Value;

fn data(case: &str, file: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/eval")
        .join(case)
        .join(file)
        .display()
        .to_string()
}

fn expected(case: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(data(case, "expected.json")).unwrap()).unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// Same keys as the oracle (its `_` keys are extras); numbers within 1e-9 x max(1, |x|),
/// the bootstrap bounds within 1e-3.
fn assert_close(ours: &Value, theirs: &Value, path: &str) {
    match (ours, theirs) {
        (Value::Object(a), Value::Object(b)) => {
            let b_keys: Vec<&String> = b.keys().filter(|k| !k.starts_with('_')).collect();
            assert_eq!(a.keys().collect::<Vec<_>>(), b_keys, "keys of {path}");
            for key in b_keys {
                assert_close(&a[key], &b[key], &format!("{path}.{key}"));
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "{path}");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_close(x, y, &format!("{path}[{i}]"));
            }
        }
        (Value::Number(a), Value::Number(b)) => {
            let (x, y) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            let tolerance = if path.contains("delta_ci95") {
                1e-3
            } else {
                1e-9
            };
            assert!(
                (x - y).abs() <= tolerance * y.abs().max(1.0),
                "{path}: {x} vs {y}"
            );
        }
        _ => assert_eq!(ours, theirs, "{path}"),
    }
}

#[test]
fn json_on_stdout_matches_the_oracle_for_every_case() {
    for case in [
        "gold_groups",
        "no_gold",
        "partial_gold_unpaired",
        "small_bins4",
    ] {
        let e = expected(case);
        let o = &e["_options"];
        let reference = data(case, "reference.jsonl");
        let candidate = data(case, "candidate.jsonl");
        let bins = o["bins"].to_string();
        let bootstrap = o["bootstrap"].to_string();
        let seed = o["seed"].to_string();
        let mut args = vec![
            "compare",
            "--reference",
            &reference,
            "--candidate",
            &candidate,
            "--json",
            "-",
            "--bins",
            &bins,
            "--bootstrap",
            &bootstrap,
            "--seed",
            &seed,
        ];
        if o["allow_unpaired"].as_bool().unwrap() {
            args.push("--allow-unpaired");
        }
        let out = loraq(&args);
        assert!(out.status.success(), "{case}: {}", stderr(&out));
        let ours: Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_close(&ours, &e, case);
        // The table for people goes to stderr when stdout carries the JSON.
        assert!(stderr(&out).contains("answers changed"), "{case}");
    }
}

#[test]
fn table_markdown_json_and_svg_files_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let md = dir.path().join("report.md");
    let svg = dir.path().join("plot.svg");
    let reference = data("gold_groups", "reference.jsonl");
    let candidate = data("gold_groups", "candidate.jsonl");
    let out = loraq(&[
        "compare",
        "--reference",
        &reference,
        "--candidate",
        &candidate,
        "--json",
        json.to_str().unwrap(),
        "--markdown",
        md.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    let e = expected("gold_groups");
    for needle in [
        "answers changed         275 of 2000".to_string(),
        "McNemar p = ".to_string(),
        format!("{:.2}%", 100.0 * e["flip_rate"].as_f64().unwrap()),
        "hellaswag".to_string(),
        "adaptive ECE".to_string(),
    ] {
        assert!(table.contains(&needle), "table lacks {needle:?}:\n{table}");
    }
    let written: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_close(&written, &e, "file");

    let markdown = std::fs::read_to_string(&md).unwrap();
    assert!(markdown.contains("## Calibration") && markdown.contains("### Reliability"));
    assert!(markdown.contains("| mmlu | 524 |"), "{markdown}");

    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(svg.trim_end().ends_with("</svg>"));
    // Two reliability curves, the diagonal, labelled axes, the histogram.
    assert_eq!(svg.matches("<polyline").count(), 2);
    assert!(svg.contains("stroke-dasharray=\"6 4\""));
    for label in [
        "confidence (top-1 probability)",
        "accuracy",
        "perfect calibration",
        "flipped answers",
    ] {
        assert!(svg.contains(label), "svg lacks {label}");
    }
    // No temporary files left behind.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
}

fn write(dir: &Path, name: &str, lines: &[&str]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, lines.join("\n")).unwrap();
    path.display().to_string()
}

const GOOD_A: &str = r#"{"id": "a", "options": ["A", "B"], "logits": [1.0, 0.0], "gold": "A"}"#;
const GOOD_B: &str = r#"{"id": "b", "options": ["A", "B"], "logits": [0.0, 1.0], "gold": "A"}"#;

/// Runs compare on two inline files; returns (exit code, stderr).
fn compare_inline(reference: &[&str], candidate: &[&str], extra: &[&str]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let r = write(dir.path(), "ref.jsonl", reference);
    let c = write(dir.path(), "cand.jsonl", candidate);
    let mut args = vec!["compare", "--reference", &r, "--candidate", &c];
    args.extend_from_slice(extra);
    let out = loraq(&args);
    (out.status.code(), stderr(&out))
}

#[test]
fn bad_input_exits_2_with_file_and_line() {
    let nan = r#"{"id": "b", "options": ["A", "B"], "logits": [NaN, 0.0]}"#;
    let other_options = r#"{"id": "b", "options": ["A", "C"], "logits": [0.0, 1.0]}"#;
    let no_logits = r#"{"id": "b", "options": ["A", "B"]}"#;
    let extra = r#"{"id": "z", "options": ["A", "B"], "logits": [0.0, 1.0]}"#;
    let cases: [(&[&str], &str); 6] = [
        (&[GOOD_A, "{not json"], "cand.jsonl:2: malformed JSON"),
        (&[GOOD_A, no_logits], "cand.jsonl:2: missing field `logits`"),
        (
            &[GOOD_A, nan],
            "cand.jsonl:2: id \"b\": logits[0] is not a finite number (NaN)",
        ),
        (
            &[GOOD_A, GOOD_B, GOOD_A],
            "cand.jsonl:3: duplicate id \"a\" (first at line 1)",
        ),
        (
            &[GOOD_A, other_options],
            "cand.jsonl:2: id \"b\": options differ from",
        ),
        (
            &[GOOD_A, GOOD_B, extra],
            "cand.jsonl:3: id \"z\" has no answer in",
        ),
    ];
    for (candidate, message) in cases {
        let (code, err) = compare_inline(&[GOOD_A, GOOD_B], candidate, &[]);
        assert_eq!(code, Some(2), "{err}");
        assert!(
            err.starts_with("loraq: ") && err.contains(message),
            "want {message:?}, got {err}"
        );
    }
}

#[test]
fn allow_unpaired_counts_instead_of_refusing() {
    let extra = r#"{"id": "z", "options": ["A", "B"], "logits": [0.0, 1.0]}"#;
    let dir = tempfile::tempdir().unwrap();
    let r = write(dir.path(), "ref.jsonl", &[GOOD_A, GOOD_B]);
    let c = write(dir.path(), "cand.jsonl", &[GOOD_A, extra]);
    let out = loraq(&[
        "compare",
        "--reference",
        &r,
        "--candidate",
        &c,
        "--allow-unpaired",
        "--json",
        "-",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(report["n"], 1);
    assert_eq!(report["unpaired"], 2);
}

#[test]
fn zero_bins_is_a_usage_error() {
    let (code, err) = compare_inline(&[GOOD_A], &[GOOD_A], &["--bins", "0"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--bins"), "{err}");
}

#[test]
fn compare_hidden_matches_the_oracle() {
    let a = data("hidden", "a.safetensors");
    let b = data("hidden", "b.safetensors");
    let out = loraq(&["compare-hidden", &a, &b, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let expected = expected("hidden");
    let rows = rows.as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    // Natural order: layers.10 after layers.5.
    assert_eq!(
        names,
        [
            "layers.0",
            "layers.1",
            "layers.2",
            "layers.3",
            "layers.4",
            "layers.5",
            "layers.10"
        ]
    );
    for row in rows {
        let name = row["name"].as_str().unwrap();
        let mut ours = row.as_object().unwrap().clone();
        ours.remove("name");
        assert_close(&Value::Object(ours), &expected[name], name);
    }
    let table = loraq(&["compare-hidden", &a, &b]);
    assert!(table.status.success());
    let text = stdout(&table);
    assert!(
        text.contains("SQNR dB") && text.contains("identical"),
        "{text}"
    );
}

/// A one-tensor F32 safetensors file, written by hand (8-byte header length,
/// JSON header, data).
fn write_safetensors(path: &Path, name: &str, shape: &[usize], values: &[f32]) {
    let header = serde_json::json!({
        name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 4 * values.len()]}
    })
    .to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    for v in values {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn compare_hidden_refuses_different_tensor_sets_and_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let a = data("hidden", "a.safetensors");
    let other = dir.path().join("other.safetensors");
    write_safetensors(&other, "layers.0", &[6, 64], &[1.0; 384]);
    let out = loraq(&["compare-hidden", &a, other.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("other.safetensors: tensor layers.1: missing"),
        "{err}"
    );

    let x = dir.path().join("x.safetensors");
    let y = dir.path().join("y.safetensors");
    write_safetensors(&x, "h", &[2, 3], &[1.0; 6]);
    write_safetensors(&y, "h", &[3, 2], &[1.0; 6]);
    let out = loraq(&["compare-hidden", x.to_str().unwrap(), y.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("y.safetensors: tensor h: shape [3, 2] differs"),
        "{}",
        stderr(&out)
    );
}
