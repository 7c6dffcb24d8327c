//! Text prompts are tokenized exactly as Hugging Face `tokenizers` does: the fixture
//! (scripts/tokenizer_fixture.py) is a byte-level BPE tokenizer.json of Qwen's kind and
//! the ids the Python library gives for prompts with accents, CJK and emoji.

use loraq_model::{Record, tokenize_records};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/tokenizer")
}

fn record(id: &str, prompt: &str, options: &[&str]) -> Record {
    Record {
        id: id.into(),
        group: None,
        prompt: Some(prompt.into()),
        tokens: None,
        options: options.iter().map(|s| s.to_string()).collect(),
        option_tokens: None,
        gold: None,
        line: 1,
    }
}

#[test]
fn prompts_tokenize_like_hugging_face_tokenizers() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap())
            .unwrap();
    let encodings = expected["encodings"].as_object().unwrap();
    let mut records: Vec<Record> = encodings
        .keys()
        .enumerate()
        .map(|(i, prompt)| record(&format!("r{i}"), prompt, &[" A"]))
        .collect();
    tokenize_records(&fixture(), &mut records, Path::new("records.jsonl")).unwrap();
    for r in &records {
        let want: Vec<u32> =
            serde_json::from_value(encodings[r.prompt.as_deref().unwrap()].clone()).unwrap();
        assert_eq!(r.tokens.as_deref(), Some(want.as_slice()), "{:?}", r.prompt);
        let a: Vec<u32> = serde_json::from_value(encodings[" A"].clone()).unwrap();
        assert_eq!(r.option_tokens.as_deref(), Some(a.as_slice()));
    }
}

#[test]
fn an_option_of_several_tokens_or_a_missing_tokenizer_is_named() {
    let mut records = vec![record("q7", "Is a service down?", &[" A", "naïve café"])];
    let err = tokenize_records(&fixture(), &mut records, Path::new("records.jsonl"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("records.jsonl:1") && err.contains("q7") && err.contains("not one"),
        "{err}"
    );
    let mut records = vec![record("q8", "Is a service down?", &[" A"])];
    let err = tokenize_records(
        Path::new("/nonexistent"),
        &mut records,
        Path::new("r.jsonl"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("q8"),
        "{err}"
    );
}

#[test]
fn records_with_ids_do_not_need_a_tokenizer() {
    let mut records = vec![Record {
        tokens: Some(vec![1, 2]),
        option_tokens: Some(vec![3]),
        ..record("q9", "ignored", &["A"])
    }];
    tokenize_records(
        Path::new("/nonexistent"),
        &mut records,
        Path::new("r.jsonl"),
    )
    .unwrap();
    assert_eq!(records[0].tokens.as_deref(), Some(&[1u32, 2][..]));
}
