//! Tiled attention and the chunked delta rule against transformers on long prompts
//! (up to 4096 tokens): `loraq run` on the qwen3_5 parity fixture, its context limit raised,
//! must give transformers' option logits (float32, eager attention) within f32
//! rounding. The real client runs through `run_oracle` (scripts/long_prompt_oracle.py).

mod common;

use common::{loraq, ok, oracle_python, run_oracle, s};
use std::path::Path;

#[test]
fn prompts_longer_than_one_attention_block_match_transformers() {
    let Some(python) = oracle_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/model/qwen3_5");
    std::fs::copy(
        fixture.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap())
            .unwrap();
    config["max_position_embeddings"] = 4096.into();
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();

    // 513 tokens (one past 512), 1,300 (partial attention tiles and delta-rule
    // chunks) and 4,096 (64 chunks of the chunked delta rule, whose summation order
    // differs from transformers' over the whole prompt), from a fixed LCG over the
    // fixture's 128-token vocabulary.
    let mut state = 7u64;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % 128
    };
    let records = dir.path().join("records.jsonl");
    let lines: Vec<String> = [513usize, 1300, 4096]
        .iter()
        .map(|&n| {
            let tokens: Vec<u64> = (0..n).map(|_| next()).collect();
            serde_json::json!({"id": format!("t{n}"), "tokens": tokens,
                "options": ["A", "B", "C", "D"], "option_tokens": [3, 17, 64, 100]})
            .to_string()
        })
        .collect();
    std::fs::write(&records, lines.join("\n") + "\n").unwrap();

    let answers = dir.path().join("answers.jsonl");
    ok(loraq(&[
        "run",
        "--model",
        s(&model),
        "--records",
        s(&records),
        "--out",
        s(&answers),
    ]));
    let expected = run_oracle(
        &python,
        "scripts/long_prompt_oracle.py",
        &[s(&model), s(&records)],
    );
    let ours = std::fs::read_to_string(&answers).unwrap();
    let parse = |text: &str| -> Vec<Vec<f64>> {
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["logits"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect()
            })
            .collect()
    };
    let (ours, theirs) = (parse(&ours), parse(&expected));
    assert_eq!(ours.len(), 3);
    assert_eq!(ours.len(), theirs.len());
    // As the parity tests: 1e-4 relative to the largest logit (measured: 6e-7).
    for ((a, b), tokens) in ours.iter().zip(&theirs).zip([513, 1300, 4096]) {
        let scale = b.iter().fold(1f64, |m, v| m.max(v.abs()));
        let worst = a
            .iter()
            .zip(b)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs() / scale));
        eprintln!("{tokens} tokens: worst difference {worst:.1e} of the largest logit");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-4 * scale, "{a:?} vs {b:?}");
        }
    }
}
