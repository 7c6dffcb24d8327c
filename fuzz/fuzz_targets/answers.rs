//! Fuzzes the answers reader and the whole comparison: the input is one line for
//! `parse_line`, then, split at its first 0xFF byte (never valid in UTF-8 JSON), a
//! reference and a candidate file that are paired, compared and rendered. Every
//! input must be refused with an error or compared; never a panic.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use loraq_eval::answers::parse_line;
use loraq_eval::render::{markdown, svg, text_table};
use loraq_eval::{AnswersReader, CompareOptions, compare, pair_answers};

fuzz_target!(|data: &[u8]| {
    let _ = parse_line(data, Path::new("fuzz.jsonl"), 1);

    let split = data.iter().position(|&b| b == 0xFF).unwrap_or(data.len());
    let reference = &data[..split];
    let candidate = &data[(split + 1).min(data.len())..];
    let Ok(paired) = pair_answers(
        AnswersReader::new(reference, "reference.jsonl"),
        AnswersReader::new(candidate, "candidate.jsonl"),
        true,
    ) else {
        return;
    };
    let options = CompareOptions {
        bins: 1 + data.len() % 20,
        bootstrap: 50,
        seed: 0,
        allow_unpaired: true,
    };
    if let Ok(comparison) = compare(&paired, &options) {
        let _ = serde_json::to_string(&comparison.report);
        let _ = text_table(&comparison);
        let _ = markdown(&comparison);
        let _ = svg(&comparison);
    }
});
