//! Base + extracted adapter reproduces the merged model's answers: synth tiny pair,
//! `loraq extract`, `loraq run` on both, `loraq compare` (no flips, tiny KL).

mod common;

use common::s;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output};

fn loraq(args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_loraq"))
        .args(args)
        .output()
        .expect("run loraq");
    assert!(
        o.status.success(),
        "loraq {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

#[test]
fn base_plus_extracted_adapter_reproduces_the_merged_answers() {
    let dir = tempfile::tempdir().unwrap();
    let (pair, adapter) = (dir.path().join("pair"), dir.path().join("adapter"));
    loraq(&[
        "synth",
        "--preset",
        "tiny",
        "--out",
        s(&pair),
        "--seed",
        "11",
    ]);
    let (base, merged) = (pair.join("base"), pair.join("merged"));
    loraq(&[
        "extract",
        "--merged",
        s(&merged),
        "--base",
        s(&base),
        "--out",
        s(&adapter),
        "--rank",
        "8",
    ]);

    // 40 questions over the tiny model's 256-token vocabulary, fixed by a small LCG.
    let records = dir.path().join("records.jsonl");
    let mut file = std::fs::File::create(&records).unwrap();
    let mut state = 12345u64;
    let mut next = |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    for i in 0..40 {
        let tokens: Vec<u64> = (0..3 + next(20)).map(|_| next(256)).collect();
        let mut options: Vec<u64> = Vec::new();
        while options.len() < 4 {
            let t = next(256);
            if !options.contains(&t) {
                options.push(t);
            }
        }
        let gold = ["A", "B", "C", "D"][next(4) as usize];
        let line = serde_json::json!({
            "id": format!("q{i}"), "tokens": tokens, "options": ["A", "B", "C", "D"],
            "option_tokens": options, "gold": gold,
        });
        writeln!(file, "{line}").unwrap();
    }
    drop(file);

    let (reference, candidate) = (
        dir.path().join("merged.jsonl"),
        dir.path().join("adapter.jsonl"),
    );
    loraq(&[
        "run",
        "--model",
        s(&merged),
        "--records",
        s(&records),
        "--out",
        s(&reference),
    ]);
    loraq(&[
        "run",
        "--model",
        s(&base),
        "--adapter",
        s(&adapter),
        "--records",
        s(&records),
        "--out",
        s(&candidate),
    ]);
    let true_answers = dir.path().join("true.jsonl");
    let true_adapter = pair.join("true-adapter");
    loraq(&[
        "run",
        "--model",
        s(&base),
        "--adapter",
        s(&true_adapter),
        "--records",
        s(&records),
        "--out",
        s(&true_answers),
    ]);
    let compare = |candidate: &Path, name: &str| -> serde_json::Value {
        let file = dir.path().join(name);
        loraq(&[
            "compare",
            "--reference",
            s(&reference),
            "--candidate",
            s(candidate),
            "--json",
            s(&file),
        ]);
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap()
    };
    let extracted = compare(&candidate, "extracted.json");
    let truth = compare(&true_answers, "true.json");
    assert_eq!(extracted["n"], 40);
    assert_eq!(extracted["flips"], 0, "{extracted}");
    // Both adapters are limited by the merge's bf16 rounding: the extracted one may
    // not land farther from the merge than the true one does (up to a factor 2).
    let (kl, true_kl) = (
        extracted["kl"]["max"].as_f64().unwrap(),
        truth["kl"]["max"].as_f64().unwrap(),
    );
    assert!(
        kl <= 2.0 * true_kl + 1e-6,
        "max KL {kl}, true adapter {true_kl}"
    );

    // Without the adapter the answers move far more: the checks above have teeth.
    let plain = dir.path().join("base.jsonl");
    loraq(&[
        "run",
        "--model",
        s(&base),
        "--records",
        s(&records),
        "--out",
        s(&plain),
    ]);
    let plain = compare(&plain, "plain.json");
    let (mean, plain_mean) = (
        extracted["kl"]["mean"].as_f64().unwrap(),
        plain["kl"]["mean"].as_f64().unwrap(),
    );
    assert!(
        mean < 0.02 * plain_mean,
        "mean KL {mean} with the adapter, {plain_mean} without"
    );
}
