//! The demo's trained pair (data/demo-model/, scripts/train_demo_model.py): its
//! committed prompts are what its tokenizer makes of their text; loraq's merge of the
//! adapter into the base equals PEFT's `merge_and_unload`; and loraq's native forward
//! gives transformers' answers on it (scripts/demo_model_oracle.py, through
//! `run_oracle`).

mod common;

use common::{loraq, ok, oracle_python, run_oracle, s};
use loraq_eval::AnswersReader;
use loraq_io::Checkpoint;
use loraq_io::convert::bf16_bits_to_f32;
use loraq_model::{read_records, tokenize_records};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/demo-model")
}

#[test]
fn committed_prompts_are_what_the_tokenizer_makes_of_their_text() {
    for set in ["questions.jsonl", "calibration.jsonl"] {
        let path = data().join(set);
        let committed = read_records(&path).unwrap();
        assert!(committed.len() >= 64, "{set}");
        let mut from_text = committed.clone();
        for r in &mut from_text {
            assert!(r.prompt.is_some(), "{set} {}: a prompt", r.id);
            r.tokens = None;
            r.option_tokens = None;
        }
        tokenize_records(&data().join("base"), &mut from_text, &path).unwrap();
        for (c, t) in committed.iter().zip(&from_text) {
            assert_eq!(c.tokens, t.tokens, "{set} {}", c.id);
            assert_eq!(c.option_tokens, t.option_tokens, "{set} {}", c.id);
            let gold = c.gold.as_ref().expect("gold");
            assert!(c.options.contains(gold), "{set} {}", c.id);
        }
    }
}

/// loraq's merge against PEFT's, tensor by tensor and element by element.
#[test]
fn the_merge_matches_peft_merge_and_unload() {
    let Some(python) = oracle_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (base, adapter) = (data().join("base"), data().join("adapter"));
    let merged = dir.path().join("merged");
    let summary = loraq_synth::merge::merge_adapter(&base, &adapter, &merged, false).unwrap();
    let peft = dir.path().join("peft.safetensors");
    run_oracle(
        &python,
        "scripts/demo_model_oracle.py",
        &[
            "merge",
            "--base",
            s(&base),
            "--adapter",
            s(&adapter),
            "--out",
            s(&peft),
        ],
    );
    let (ours, theirs, base) = (
        Checkpoint::open(&merged).unwrap(),
        Checkpoint::open(&peft).unwrap(),
        Checkpoint::open(&base).unwrap(),
    );
    let names = |c: &Checkpoint| c.tensors().map(|t| t.name.clone()).collect::<Vec<_>>();
    let mut expected = names(&theirs);
    expected.sort();
    let mut got = names(&ours);
    got.sort();
    assert_eq!(got, expected);
    let mut changed = 0;
    let mut differing_elements = 0usize;
    let mut elements = 0usize;
    for name in &expected {
        let (a, b) = (ours.bytes(name).unwrap(), theirs.bytes(name).unwrap());
        assert_eq!(a.len(), b.len(), "{name}");
        changed += usize::from(a != base.bytes(name).unwrap());
        for (x, y) in a.chunks_exact(2).zip(b.chunks_exact(2)) {
            elements += 1;
            if x != y {
                differing_elements += 1;
                let (x, y) = (
                    bf16_bits_to_f32(u16::from_le_bytes([x[0], x[1]])),
                    bf16_bits_to_f32(u16::from_le_bytes([y[0], y[1]])),
                );
                let ulp = loraq_io::convert::bf16_ulp(x.abs().max(y.abs()));
                assert!(
                    f64::from((x - y).abs()) <= ulp,
                    "{name}: {x} against PEFT's {y}, more than one bf16 ulp apart"
                );
            }
        }
    }
    assert_eq!(changed, summary.adapted_modules);
    eprintln!(
        "merge: {differing_elements} of {elements} elements differ from PEFT's by one bf16 ulp"
    );
    assert_eq!(
        differing_elements, 0,
        "loraq's f32 sum rounds differently from torch's matrix product somewhere"
    );
}

/// One answers file, read by loraq-eval's reader: id -> (group, log-softmax of the
/// option logits, index of the gold option).
fn answers(path: &Path) -> BTreeMap<String, (String, Vec<f64>, usize)> {
    AnswersReader::open(path)
        .unwrap()
        .map(|answer| {
            let answer = answer.unwrap();
            let group = answer.group.expect("a group");
            let gold = answer.gold.expect("a gold option");
            (answer.id, (group, answer.log_probs, gold))
        })
        .collect()
}

fn top(logits: &[f64]) -> usize {
    (0..logits.len()).fold(0, |best, i| if logits[i] > logits[best] { i } else { best })
}

/// Accuracy on gold per group.
fn accuracy(answers: &BTreeMap<String, (String, Vec<f64>, usize)>) -> BTreeMap<String, f64> {
    let mut counts: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (group, log_probs, gold) in answers.values() {
        let c = counts.entry(group.clone()).or_default();
        c.0 += 1;
        c.1 += usize::from(top(log_probs) == *gold);
    }
    counts
        .into_iter()
        .map(|(g, (n, k))| (g, k as f64 / n as f64))
        .collect()
}

/// `loraq run` on the merged model and on the base alone gives transformers' option
/// log-probabilities on the first 80 committed questions (20 per task group) within
/// float32 rounding, hence the same answers; and those answers show the pair is
/// trained: the merge right on at least 90% of every group, the base alone well below
/// on sub.
#[test]
fn native_forward_gives_transformers_answers_on_the_trained_pair() {
    let Some(python) = oracle_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let merged = dir.path().join("merged");
    loraq_synth::merge::merge_adapter(
        &data().join("base"),
        &data().join("adapter"),
        &merged,
        false,
    )
    .unwrap();
    let records = dir.path().join("questions.jsonl");
    let text = std::fs::read_to_string(data().join("questions.jsonl")).unwrap();
    let first: Vec<&str> = text.lines().take(80).collect();
    std::fs::write(&records, first.join("\n") + "\n").unwrap();

    let mut by_model = BTreeMap::new();
    for (label, model) in [("merged", merged.clone()), ("base", data().join("base"))] {
        let ours = dir.path().join(format!("{label}.loraq.jsonl"));
        ok(loraq(&[
            "run",
            "--model",
            s(&model),
            "--records",
            s(&records),
            "--out",
            s(&ours),
        ]));
        let theirs = dir.path().join(format!("{label}.transformers.jsonl"));
        run_oracle(
            &python,
            "scripts/demo_model_oracle.py",
            &[
                "answers",
                "--model",
                s(&model),
                "--records",
                s(&records),
                "--out",
                s(&theirs),
            ],
        );
        let (ours, theirs) = (answers(&ours), answers(&theirs));
        assert_eq!(ours.len(), 80);
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>()
        );
        for (id, (_, a, _)) in &ours {
            let b = &theirs[id].1;
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-3 * (1.0 + y.abs()),
                    "{label} {id}: {a:?} against transformers' {b:?}"
                );
            }
            assert_eq!(top(a), top(b), "{label} {id}: {a:?} against {b:?}");
        }
        by_model.insert(label, accuracy(&ours));
    }
    eprintln!("accuracy on gold by group: {by_model:?}");
    for (group, a) in &by_model["merged"] {
        assert!(*a >= 0.9, "merged, {group}: {a}");
    }
    assert!(by_model["base"]["sub"] <= by_model["merged"]["sub"] - 0.3);
}
