//! The answers reader's fast path against serde_json: every line, valid or not, must
//! give through `AnswerColumns::push_line` (the plain-shape scanner, with serde_json
//! behind it) exactly what `parse_line` (serde_json alone) gives: the same answer, bit
//! for bit, or the same error message.

use std::path::Path;

use loraq_eval::answers::{AnswerColumns, parse_line};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A JSON string literal: mostly plain, sometimes escaped, non-ASCII or empty.
fn string(rng: &mut ChaCha8Rng) -> String {
    const PLAIN: [&str; 8] = ["A", "B", "C", "D", "q1", "mmlu", "NaN", "x y"];
    match rng.random_range(0..12) {
        0 => "\"\"".into(),
        1 => "\"q\\\"1\"".into(),
        2 => "\"\\u00e9t\\u00e9\"".into(),
        3 => "\"été\"".into(),
        4 => "\"tab\\there\"".into(),
        _ => format!("\"{}\"", PLAIN[rng.random_range(0..PLAIN.len())]),
    }
}

/// A JSON number (or a token that is not one) in the ways writers print them.
fn number(rng: &mut ChaCha8Rng) -> String {
    let x: f64 = rng.random_range(-8.0..8.0);
    match rng.random_range(0..40) {
        0 => "NaN".into(),
        1 => "-Infinity".into(),
        2 => "null".into(),
        3 => "1e400".into(),
        4 => "-0".into(),
        5 => "-0.0".into(),
        6 => format!("{}", rng.random_range(-5i64..5)),
        7 => format!("{x:e}"),
        8 => format!("{x:.3E}"),
        9 => format!("{x:.25}"),
        10 => "0.30000000000000004".into(),
        11 => "123456789012345678901234567890.5".into(),
        12 => "1.5e-320".into(),
        13 => "01.5".into(),
        14 => "1.".into(),
        15 => ".5".into(),
        16..=25 => format!("{x:.4}"),
        _ => format!("{x}"),
    }
}

fn value_array(rng: &mut ChaCha8Rng, len: usize, ws: &str) -> String {
    let values: Vec<String> = (0..len).map(|_| number(rng)).collect();
    format!("[{ws}{}{ws}]", values.join(&format!(",{ws}")))
}

fn probs_array(rng: &mut ChaCha8Rng, len: usize) -> String {
    if rng.random_bool(0.3) {
        return value_array(rng, len, "");
    }
    let raw: Vec<f64> = (0..len).map(|_| rng.random_range(0.0..1.0)).collect();
    let sum: f64 = raw.iter().sum();
    let values: Vec<String> = raw.iter().map(|p| format!("{:.6}", p / sum)).collect();
    format!("[{}]", values.join(", "))
}

fn unknown_value(rng: &mut ChaCha8Rng) -> String {
    match rng.random_range(0..7) {
        0 => "true".into(),
        1 => "null".into(),
        2 => "{\"a\": [1, 2.5, {\"b\": false}], \"c\": \"d\"}".into(),
        3 => "[]".into(),
        4 => "-12.75".into(),
        5 => "3e8".into(),
        _ => string(rng),
    }
}

/// One answers line: fields in random order, some missing, repeated or malformed.
fn line(rng: &mut ChaCha8Rng) -> String {
    let ws = [" ", "", "\t", "  "][rng.random_range(0..4)];
    let width = rng.random_range(0..6);
    let options: Vec<String> = (0..width)
        .map(|k| {
            if rng.random_bool(0.95) {
                format!("\"{}\"", ["A", "B", "C", "D", "E"][k])
            } else {
                string(rng)
            }
        })
        .collect();
    let values_width = if rng.random_bool(0.95) {
        width
    } else {
        rng.random_range(0..6)
    };
    let mut fields: Vec<String> = Vec::new();
    if rng.random_bool(0.97) {
        fields.push(format!("\"id\":{ws}{}", string(rng)));
    }
    if rng.random_bool(0.5) {
        let group = if rng.random_bool(0.2) {
            "null".into()
        } else {
            string(rng)
        };
        fields.push(format!("\"group\":{ws}{group}"));
    }
    if rng.random_bool(0.97) {
        fields.push(format!(
            "\"options\":{ws}[{}]",
            options.join(&format!(",{ws}"))
        ));
    }
    match rng.random_range(0..20) {
        0 => {}
        1 => {
            fields.push(format!(
                "\"logits\": {}",
                value_array(rng, values_width, ws)
            ));
            fields.push(format!("\"probs\": {}", probs_array(rng, values_width)));
        }
        2..=5 => fields.push(format!("\"probs\":{ws}{}", probs_array(rng, values_width))),
        _ => fields.push(format!(
            "\"logits\":{ws}{}",
            value_array(rng, values_width, ws)
        )),
    }
    if rng.random_bool(0.6) {
        let gold = match rng.random_range(0..6) {
            0 => "null".into(),
            1 => string(rng),
            _ if !options.is_empty() => options[rng.random_range(0..options.len())].clone(),
            _ => "\"A\"".into(),
        };
        fields.push(format!("\"gold\":{ws}{gold}"));
    }
    if rng.random_bool(0.2) {
        fields.push(format!("\"extra\":{ws}{}", unknown_value(rng)));
    }
    if rng.random_bool(0.03) && !fields.is_empty() {
        let repeated = fields[rng.random_range(0..fields.len())].clone();
        fields.push(repeated);
    }
    fields.shuffle(rng);
    let mut text = format!("{{{ws}{}{ws}}}", fields.join(&format!(",{ws}")));
    if rng.random_bool(0.1) {
        // A random edit: most break the JSON, some only its meaning.
        let mut bytes = text.into_bytes();
        let at = rng.random_range(0..bytes.len());
        match rng.random_range(0..3) {
            0 => {
                bytes.remove(at);
            }
            1 => {
                const INSERTED: &[u8] = b"{}[],:\"\\ 0e-.x";
                bytes.insert(at, INSERTED[rng.random_range(0..INSERTED.len())]);
            }
            _ => bytes.truncate(at),
        }
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
    if rng.random_bool(0.5) {
        text.push('\n');
    }
    text
}

fn check(text: &str, path: &Path) -> bool {
    let expected = parse_line(text.as_bytes(), path, 7);
    let mut columns = AnswerColumns::default();
    let got = columns.push_line(text.as_bytes(), path, 7);
    match (expected, got) {
        (Ok(view), Ok(())) => {
            let row = &columns.rows[0];
            assert_eq!(row.id, view.id, "{text}");
            assert_eq!(row.group, view.group, "{text}");
            assert_eq!(columns.options_of(row), &view.options[..], "{text}");
            assert_eq!(row.gold, view.gold, "{text}");
            assert_eq!(row.line, view.line, "{text}");
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&columns.probs), bits(&view.probs), "{text}");
            assert_eq!(bits(&columns.log_probs), bits(&view.log_probs), "{text}");
            true
        }
        (Err(expected), Err(got)) => {
            assert_eq!(got.to_string(), expected.to_string(), "{text}");
            assert!(
                columns.rows.is_empty() && columns.options.is_empty(),
                "{text}"
            );
            assert!(
                columns.probs.is_empty() && columns.log_probs.is_empty(),
                "{text}"
            );
            false
        }
        (expected, got) => panic!("{text}: serde_json {expected:?}, fast path {got:?}"),
    }
}

#[test]
fn every_line_reads_as_serde_json_reads_it() {
    let path = Path::new("answers.jsonl");
    let mut rng = ChaCha8Rng::seed_from_u64(20);
    let (mut valid, mut invalid) = (0, 0);
    for _ in 0..60_000 {
        if check(&line(&mut rng), path) {
            valid += 1;
        } else {
            invalid += 1;
        }
    }
    // Both outcomes must be well represented for the comparison to mean something.
    assert!(
        valid > 10_000 && invalid > 10_000,
        "{valid} valid, {invalid} invalid"
    );
}

#[test]
fn the_formats_writers_use_read_identically() {
    let path = Path::new("answers.jsonl");
    for text in [
        r#"{"id": "mmlu-0001", "group": "mmlu", "options": ["A", "B", "C", "D"], "logits": [1.2, -0.3, 0.1, 2.5], "gold": "D"}"#,
        r#"{"id":"q","options":["A","B"],"probs":[0.25,0.75],"gold":null,"usage":{"prompt_tokens":12}}"#,
        "{\"id\":\"q\",\"options\":[\"A\",\"B\"],\"logits\":[-0.0,0.0]}\r\n",
        r#"{"id":"q","options":["A","B","A"],"logits":[1.5,2.5,3.5]}"#,
        r#"{"id":"q","options":["A","B"],"logits":[1.5,2.5],"gold":"C"}"#,
        r#"{"id":"q","options":["A","B"],"probs":[0.5,-0.5]}"#,
        r#"{"id":"q","options":["A","B"],"logits":[1.5e3,2.5E-3]}"#,
        r#"{"id":"","options":["A","B"],"logits":[1.5,2.5]}"#,
    ] {
        check(text, path);
    }
}
