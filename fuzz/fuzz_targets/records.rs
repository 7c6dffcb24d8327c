//! Fuzzes the records file of `loraq run` (JSON Lines: id, group?, prompt | tokens,
//! options, option_tokens?, gold?): reading, then tokenizing the records that need it
//! with the committed test tokenizer (tests/data/tokenizer/tokenizer.json), as `run`
//! does before the forward pass. Must refuse or read; never a panic.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

const TOKENIZER: &[u8] = include_bytes!("../../tests/data/tokenizer/tokenizer.json");

/// A model directory holding only the tokenizer, written once.
fn model_dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("tokenizer.json"), TOKENIZER).expect("tokenizer");
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(dir) = tempfile::tempdir() else { return };
    let path = dir.path().join("records.jsonl");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(mut records) = loraq_model::read_records(&path) {
        let _ = loraq_model::tokenize_records(model_dir().path(), &mut records, &path);
    }
});
