//! Pairing files of several 4 MiB blocks (the block pipeline, the id table with short
//! and long ids) against a line-by-line oracle: every pair's KL and flip equal what
//! the answers read one line at a time (`AnswersReader` as an iterator, a `HashMap`
//! by id) give, bit for bit, and the first error in file order is reported whatever
//! the number of threads.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use loraq_eval::{Answer, AnswersReader, EvalError, PairedAnswers, pair_files};

/// Questions per file: about 14 MB of lines, four blocks.
const QUESTIONS: usize = 100_000;

/// A small deterministic generator (64-bit LCG, top bits).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn logit(&mut self) -> f64 {
        (self.next() % 80_000) as f64 / 10_000.0 - 4.0
    }
}

fn id(i: usize) -> String {
    // Every fifth id is longer than the 23 bytes a table slot holds, and they share
    // their first 23 bytes.
    if i.is_multiple_of(5) {
        format!("a-question-with-a-long-identifier-{i}")
    } else {
        format!("q{i}")
    }
}

fn line(out: &mut String, i: usize, logits: [f64; 4], gold: usize) {
    let groups = ["arc", "mmlu", "gsm", "piqa"];
    let _ = writeln!(
        out,
        r#"{{"id": "{}", "group": "{}", "options": ["A", "B", "C", "D"], "logits": [{:.4}, {:.4}, {:.4}, {:.4}], "gold": "{}"}}"#,
        id(i),
        groups[i % 4],
        logits[0],
        logits[1],
        logits[2],
        logits[3],
        ["A", "B", "C", "D"][gold]
    );
}

/// (reference text, candidate lines in shuffled order).
fn answers() -> (String, Vec<String>) {
    let mut rng = Lcg(7);
    let mut reference = String::new();
    let mut candidate = Vec::with_capacity(QUESTIONS);
    for i in 0..QUESTIONS {
        let logits = [rng.logit(), rng.logit(), rng.logit(), rng.logit()];
        let noisy = logits.map(|l| l + rng.logit() / 8.0);
        let gold = (rng.next() % 4) as usize;
        line(&mut reference, i, logits, gold);
        let mut text = String::new();
        line(&mut text, i, noisy, gold);
        candidate.push(text);
    }
    for i in (1..candidate.len()).rev() {
        let j = (rng.next() as usize) % (i + 1);
        candidate.swap(i, j);
    }
    (reference, candidate)
}

fn read_all(path: &Path) -> Vec<Answer> {
    AnswersReader::open(path)
        .unwrap()
        .map(|answer| answer.unwrap())
        .collect()
}

fn first_max(probs: &[f64]) -> usize {
    let mut top = 0;
    for (k, &p) in probs.iter().enumerate() {
        if p > probs[top] {
            top = k;
        }
    }
    top
}

fn pair_with_threads(
    threads: usize,
    reference: &Path,
    candidate: &Path,
) -> Result<PairedAnswers, EvalError> {
    pair_allowing_unpaired(threads, reference, candidate, false)
}

fn pair_allowing_unpaired(
    threads: usize,
    reference: &Path,
    candidate: &Path,
    allow_unpaired: bool,
) -> Result<PairedAnswers, EvalError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(|| pair_files(reference, candidate, allow_unpaired))
}

/// With ids missing from the candidate in every block, the pairs left (taken out of
/// the reference-ordered figures in place) are the reference's paired questions in
/// reference order, each with the oracle's KL bit for bit.
#[test]
fn unpaired_reference_ids_over_many_blocks_leave_the_oracle_pairs() {
    let dir = tempfile::tempdir().unwrap();
    let (reference_text, candidate_lines) = answers();
    let reference = dir.path().join("reference.jsonl");
    let candidate = dir.path().join("candidate.jsonl");
    std::fs::write(&reference, &reference_text).unwrap();
    // Every seventh candidate line (shuffled: ids all over the reference) is left out.
    let kept: Vec<&String> = candidate_lines
        .iter()
        .enumerate()
        .filter(|(n, _)| n % 7 != 3)
        .map(|(_, line)| line)
        .collect();
    std::fs::write(
        &candidate,
        kept.iter().map(|line| line.as_str()).collect::<String>(),
    )
    .unwrap();

    let by_id: HashMap<String, Answer> = read_all(&candidate)
        .into_iter()
        .map(|answer| (answer.id.clone(), answer))
        .collect();
    let expected: Vec<(Answer, f64)> = read_all(&reference)
        .into_iter()
        .filter_map(|r| {
            let c = by_id.get(&r.id)?;
            let mut kl = 0.0;
            for k in 0..4 {
                if r.probs[k] > 0.0 {
                    kl += r.probs[k] * (r.log_probs[k] - c.log_probs[k]);
                }
            }
            Some((r, kl))
        })
        .collect();
    assert_eq!(expected.len(), kept.len());
    for threads in [1, 2, 3] {
        assert!(matches!(
            pair_with_threads(threads, &reference, &candidate),
            Err(EvalError::UnpairedReference { .. })
        ));
        let paired = pair_allowing_unpaired(threads, &reference, &candidate, true).unwrap();
        assert_eq!(
            (paired.reference_only, paired.candidate_only),
            (QUESTIONS - kept.len(), 0)
        );
        assert_eq!(paired.pairs.len(), expected.len());
        for (pair, (r, kl)) in paired.pairs.iter().zip(&expected) {
            assert_eq!(
                pair.kl.to_bits(),
                kl.to_bits(),
                "{} ({threads} threads)",
                r.id
            );
            assert_eq!(paired.groups[pair.group as usize], r.group.clone().unwrap());
        }
    }
}

#[test]
fn pairs_over_many_blocks_match_a_line_by_line_pairing() {
    let dir = tempfile::tempdir().unwrap();
    let (reference_text, candidate_lines) = answers();
    let reference = dir.path().join("reference.jsonl");
    let candidate = dir.path().join("candidate.jsonl");
    assert!(reference_text.len() > 3 * (4 << 20), "at least four blocks");
    std::fs::write(&reference, &reference_text).unwrap();
    std::fs::write(&candidate, candidate_lines.concat()).unwrap();

    let reference_answers = read_all(&reference);
    let by_id: HashMap<String, Answer> = read_all(&candidate)
        .into_iter()
        .map(|answer| (answer.id.clone(), answer))
        .collect();
    for threads in [1, 2, 3] {
        let paired = pair_with_threads(threads, &reference, &candidate).unwrap();
        assert_eq!(paired.pairs.len(), QUESTIONS);
        assert_eq!((paired.reference_only, paired.candidate_only), (0, 0));
        for (pair, r) in paired.pairs.iter().zip(&reference_answers) {
            let c = &by_id[&r.id];
            let mut kl = 0.0;
            for k in 0..4 {
                if r.probs[k] > 0.0 {
                    kl += r.probs[k] * (r.log_probs[k] - c.log_probs[k]);
                }
            }
            assert_eq!(
                pair.kl.to_bits(),
                kl.to_bits(),
                "{} ({threads} threads)",
                r.id
            );
            assert_eq!(
                pair.flip,
                first_max(&r.probs) != first_max(&c.probs),
                "{}",
                r.id
            );
            assert_eq!(paired.groups[pair.group as usize], r.group.clone().unwrap());
        }
    }
}

#[test]
fn the_first_error_in_file_order_is_reported_over_many_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let (reference_text, mut candidate_lines) = answers();
    let reference = dir.path().join("reference.jsonl");
    let candidate = dir.path().join("candidate.jsonl");
    std::fs::write(&reference, &reference_text).unwrap();

    // The candidate repeats a long id (in its third block, or earlier where the
    // original comes later), then has an unknown id in its fourth: the repetition is
    // the error.
    let repeated = 70_000;
    let first = 1 + candidate_lines
        .iter()
        .position(|l| l.starts_with(&format!(r#"{{"id": "{}""#, id(5))))
        .unwrap();
    assert!(![repeated, 90_001].contains(&first));
    candidate_lines[repeated - 1] = candidate_lines[first - 1].clone();
    let (first, repeated) = (first.min(repeated), first.max(repeated));
    candidate_lines[90_000] =
        candidate_lines[90_000].replacen(r#""id": ""#, r#""id": "unknown-"#, 1);
    std::fs::write(&candidate, candidate_lines.concat()).unwrap();
    for threads in [1, 2, 3] {
        match pair_with_threads(threads, &reference, &candidate) {
            Err(EvalError::DuplicateId {
                path,
                line,
                id: repeated_id,
                first_line,
            }) => {
                assert_eq!(path, candidate);
                assert_eq!((line, first_line), (repeated as u64, first as u64));
                assert_eq!(repeated_id, id(5));
            }
            other => panic!("{threads} threads: {:?}", other.map(|p| p.pairs.len())),
        }
    }

    // A long id repeated in the reference's fourth block comes before any candidate
    // error.
    let mut reference_lines: Vec<&str> = reference_text.lines().collect();
    let duplicate = reference_lines[10].to_string();
    reference_lines[95_000] = &duplicate;
    std::fs::write(&reference, reference_lines.join("\n")).unwrap();
    for threads in [1, 2, 3] {
        match pair_with_threads(threads, &reference, &candidate) {
            Err(EvalError::DuplicateId {
                path,
                line,
                first_line,
                ..
            }) => {
                assert_eq!(path, reference);
                assert_eq!((line, first_line), (95_001, 11));
            }
            other => panic!("{threads} threads: {:?}", other.map(|p| p.pairs.len())),
        }
    }
}
