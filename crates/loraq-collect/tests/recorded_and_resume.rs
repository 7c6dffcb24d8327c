//! The engines' answer readers on recorded response bodies (tests/data/collect), and
//! the output's resume rules: a cut last line, an id twice, a changed setup, a file
//! that is not a collection.

use loraq_collect::engine::{llama_parse, llama_request, vllm_parse, vllm_request};
use loraq_collect::output::{Header, header_path, incomplete_path};
use loraq_collect::{AnswersOut, CollectError, Question, Scores};
use serde_json::{Value, json};
use std::path::Path;

fn recorded(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/collect")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn question(id: &str, options: &[u32]) -> Question {
    Question {
        id: id.into(),
        group: Some("g".into()),
        prompt: None,
        tokens: vec![5, 6, 7],
        options: ["A", "B", "C", "D"][..options.len()]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        option_tokens: options.to_vec(),
        gold: Some("A".into()),
        line: 1,
    }
}

fn header(scale: Option<f64>) -> Header {
    Header {
        format: "loraq-collect".into(),
        version: 1,
        engine: "llama-cpp".into(),
        model: "m".into(),
        adapter: None,
        lora_id: scale.map(|_| 0),
        lora_scale: scale,
        values: "v".into(),
        records: "r.jsonl".into(),
        records_sha256: "00".into(),
        records_count: 3,
        server: "http://x".into(),
        server_version: "llama.cpp b1".into(),
    }
}

#[test]
fn the_recorded_vllm_completion_gives_each_option_its_value_and_minus_9999_is_minus_inf() {
    let q = question("q", &[11, 12, 13, 14]);
    let scores = vllm_parse(&q, &recorded("vllm/completion.json")).unwrap();
    assert_eq!(
        scores.values,
        vec![
            Some(-0.3184),
            Some(-1.5471),
            Some(f64::NEG_INFINITY),
            Some(-3.0625)
        ]
    );
    // A server that ignores logprob_token_ids returns only the sampled token.
    let scores = vllm_parse(&q, &recorded("vllm/completion-ignored-ids.json")).unwrap();
    assert_eq!(scores.values, vec![Some(-0.3184), None, None, None]);
    // Prompt tokens counted differently (special tokens added) is refused.
    let mut long = q.clone();
    long.tokens.push(1);
    let e = vllm_parse(&long, &recorded("vllm/completion.json")).unwrap_err();
    assert!(
        e.contains("counted 3 prompt tokens, the record has 4"),
        "{e}"
    );
    let body = vllm_request(&q, "adapter");
    assert_eq!(body["logprob_token_ids"], json!([11, 12, 13, 14]));
    assert_eq!(body["prompt"], json!([5, 6, 7]));
}

#[test]
fn llama_answers_are_the_log_of_the_option_softmax_and_a_missed_bias_is_refused() {
    let q = question("q", &[3, 9, 3]);
    let body = llama_request(&q, &[(0, 1.0), (1, 0.0)]);
    assert_eq!(body["n_probs"], 2, "distinct option tokens");
    assert_eq!(body["logit_bias"], json!([[3, 100.0], [9, 100.0]]));
    assert_eq!(
        body["lora"],
        json!([{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}])
    );
    assert_eq!(body["cache_prompt"], false);
    let answer = json!({"tokens_evaluated": 3, "completion_probabilities": [{"id": 3, "prob": 0.75,
        "top_probs": [{"id": 3, "token": "x", "prob": 0.75}, {"id": 9, "token": "y", "prob": 0.25}]}]});
    let scores = llama_parse(&q, &answer).unwrap();
    assert_eq!(
        scores.values,
        vec![Some(0.75f64.ln()), Some(0.25f64.ln()), Some(0.75f64.ln())]
    );
    let unbiased = json!({"completion_probabilities": [{"top_probs": [
        {"id": 3, "prob": 0.5}, {"id": 9, "prob": 0.1}]}]});
    let e = llama_parse(&q, &unbiased).unwrap_err();
    assert!(e.contains("did not apply logit_bias"), "{e}");
    let truncated = json!({"truncated": true, "completion_probabilities": []});
    assert!(
        llama_parse(&q, &truncated)
            .unwrap_err()
            .contains("truncated")
    );
}

#[test]
fn answers_are_appended_resumed_by_id_and_a_cut_line_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("a.jsonl");
    let qs = vec![
        question("a", &[1, 2]),
        question("b", &[1, 2]),
        question("c", &[1, 2]),
    ];
    let h = header(Some(1.0));
    {
        let (mut o, r) = AnswersOut::open(&out, &h, &qs).unwrap();
        assert!(r.done.is_empty());
        assert!(
            o.write(
                &qs[0],
                &Scores {
                    values: vec![Some(-0.1), Some(-2.0)]
                },
                ""
            )
            .unwrap()
        );
        // -inf becomes probs with an exact 0.
        assert!(
            o.write(
                &qs[1],
                &Scores {
                    values: vec![Some(-0.1), Some(f64::NEG_INFINITY)]
                },
                ""
            )
            .unwrap()
        );
        o.sync().unwrap();
    }
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        text.lines().nth(1).unwrap().contains("\"probs\":[1.0,0.0]"),
        "{text}"
    );
    // loraq-eval reads the file as compare does.
    let answers: Vec<_> = loraq_eval::AnswersReader::open(&out)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(answers.len(), 2);

    // A crash in the middle of a write leaves a line without newline: removed.
    std::fs::write(&out, format!("{text}{{\"id\": \"c\", \"opt")).unwrap();
    let (mut o, r) = AnswersOut::open(&out, &h, &qs).unwrap();
    assert_eq!(r.done.len(), 2);
    assert!(
        r.notes[0].contains("removed a last line cut short"),
        "{:?}",
        r.notes
    );
    assert!(
        !o.write(
            &qs[2],
            &Scores {
                values: vec![Some(-0.1), None]
            },
            "missing"
        )
        .unwrap()
    );
    drop(o);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), text);
    let inc = std::fs::read_to_string(incomplete_path(&out)).unwrap();
    assert!(inc.contains("\"logits\":[-0.1,null]"), "{inc}");
    let (_, r) = AnswersOut::open(&out, &h, &qs).unwrap();
    assert_eq!(r.done.len(), 3);

    // Another setup is refused by field.
    let e = AnswersOut::open(&out, &header(Some(0.5)), &qs)
        .err()
        .unwrap();
    assert!(e.to_string().contains("lora_scale was Some(1.0)"), "{e}");
    // An id twice, an id not in the records.
    std::fs::write(&out, format!("{text}{}\n", text.lines().next().unwrap())).unwrap();
    std::fs::write(incomplete_path(&out), "").unwrap();
    let e = AnswersOut::open(&out, &h, &qs).err().unwrap();
    assert!(
        e.to_string()
            .contains("line 3: id \"a\" was already answered at"),
        "{e}"
    );
    let e = AnswersOut::open(&out, &h, &qs[1..]).err().unwrap();
    assert!(
        e.to_string()
            .contains("line 1: id \"a\" is not in the records file"),
        "{e}"
    );
    // A garbage line names the file and line.
    std::fs::write(&out, "{\"id\": \"a\", \"options\": [\"A\"]}\n").unwrap();
    let e = AnswersOut::open(&out, &h, &qs).err().unwrap();
    assert!(
        matches!(e, CollectError::Resume { .. }) && e.to_string().contains(":1:"),
        "{e}"
    );
    // An answers file without its header is not a collection.
    std::fs::remove_file(header_path(&out)).unwrap();
    let e = AnswersOut::open(&out, &h, &qs).err().unwrap();
    assert!(e.to_string().contains("exists without the header"), "{e}");
}
