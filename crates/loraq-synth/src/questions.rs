//! Record sets for the demo: multiple-choice questions whose gold answers are drawn
//! from a reference model's own probabilities, and calibration prompts.
//!
//! A question is a random prompt with four options chosen among the reference's
//! next-token candidates, so the set ranges, as real benchmarks do, from confident
//! questions (the top token against far-down ones) through ordinary ones to near-ties
//! (neighbours in the ranking). Its gold answer is drawn from the softmax of the
//! reference's option logits with a fixed seed, so the reference is calibrated by
//! construction. The records are the JSON Lines `loraq run` reads (docs/model.md).

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Option labels of a question.
pub const LABELS: [&str; 4] = ["A", "B", "C", "D"];
/// Benchmarks the questions are grouped into (round robin).
pub const GROUPS: [&str; 3] = ["arith", "recall", "logic"];
/// Salt of the questions' generator (xor-ed into the seed).
const QUESTION_SALT: u64 = 0x5eed_f00d;
/// Salt of the calibration prompts' generator: other prompts than the questions'.
const CALIBRATION_SALT: u64 = 0xca1b_5e75;

/// What the question set needs of the reference model.
pub trait NextTokenModel {
    /// The model's error.
    type Error;
    /// The model's state after a prompt (its last hidden state, say).
    type State;
    /// Runs `tokens` through the model.
    fn run_prompt(&self, tokens: &[u32]) -> Result<Self::State, Self::Error>;
    /// The logits of `candidates` as the next token after the prompt of `state`.
    fn next_token_logits(
        &self,
        state: &Self::State,
        candidates: &[u32],
    ) -> Result<Vec<f32>, Self::Error>;
}

/// The size of a record set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordSetSpec {
    /// Number of records.
    pub count: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Vocabulary size of the model (prompt tokens and options are below it).
    pub vocab: usize,
    /// Seed (the questions and the calibration prompts salt it differently).
    pub seed: u64,
}

/// One record of a question set or a calibration set. Fields are declared in the
/// order of their names, the order the demo has always written them in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Record {
    /// The gold label (questions only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gold: Option<String>,
    /// The benchmark group (questions only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// `q0000`, `c0000`, ...
    pub id: String,
    /// The token of each option.
    pub option_tokens: Vec<u32>,
    /// The option labels.
    pub options: Vec<String>,
    /// The prompt.
    pub tokens: Vec<u32>,
}

/// How the options of a question are picked from the reference's ranking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuestionKind {
    /// The top candidate against three from ranks 64..1024 (35% of the questions).
    Confident,
    /// Four of the top 48 (55%).
    Ordinary,
    /// Four neighbours three ranks apart, starting in the top 16 (10%).
    NearTie,
}

impl QuestionKind {
    fn from_draw(u: f64) -> QuestionKind {
        if u < 0.35 {
            QuestionKind::Confident
        } else if u < 0.9 {
            QuestionKind::Ordinary
        } else {
            QuestionKind::NearTie
        }
    }
}

/// Refuses a vocabulary the option rules cannot draw from.
fn check_vocab(vocab: usize) -> Result<(), String> {
    // Confident questions draw from ranks 64..min(vocab, 1024): at least three
    // distinct tokens there; near-ties need 10 ranks after their start.
    if vocab < 67 || u32::try_from(vocab).is_err() {
        return Err(format!(
            "a vocabulary of {vocab} tokens: the question set needs 67 to 2^32"
        ));
    }
    Ok(())
}

/// A random prompt of `len` tokens below `vocab`.
fn prompt(rng: &mut ChaCha8Rng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect()
}

/// The option tokens of a question of `kind`, in the reference's ranking order (before
/// the shuffle).
fn pick_options(rng: &mut ChaCha8Rng, kind: QuestionKind, ranked: &[u32]) -> Vec<u32> {
    let vocab = ranked.len();
    match kind {
        QuestionKind::Confident => {
            let mut o = vec![ranked[0]];
            while o.len() < LABELS.len() {
                let t = ranked[rng.random_range(64..vocab.min(1024))];
                if !o.contains(&t) {
                    o.push(t);
                }
            }
            o
        }
        QuestionKind::Ordinary => {
            let mut pool: Vec<u32> = ranked[..48.min(vocab)].to_vec();
            pool.shuffle(rng);
            pool[..LABELS.len()].to_vec()
        }
        QuestionKind::NearTie => {
            let start = rng.random_range(0..16.min(vocab - 10));
            (0..LABELS.len()).map(|k| ranked[start + 3 * k]).collect()
        }
    }
}

/// Index drawn from the softmax of `logits` with one uniform draw `u` in [0, 1)
/// (the last index when rounding leaves `u` past the sum).
fn draw_from_softmax(logits: &[f32], u: f64) -> usize {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = logits.iter().map(|&l| f64::from(l - max).exp()).collect();
    let mut draw = u * weights.iter().sum::<f64>();
    for (k, w) in weights.iter().enumerate() {
        if draw < *w {
            return k;
        }
        draw -= w;
    }
    weights.len() - 1
}

/// Errors of [`question_set`]: the model's, or a vocabulary too small.
#[derive(Debug)]
pub enum QuestionSetError<E> {
    /// The reference model failed.
    Model(E),
    /// The spec cannot be drawn from.
    Spec(String),
}

impl<E: std::fmt::Display> std::fmt::Display for QuestionSetError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuestionSetError::Model(e) => write!(f, "{e}"),
            QuestionSetError::Spec(what) => write!(f, "question set: {what}"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for QuestionSetError<E> {}

/// The demo's question set: `spec.count` random prompts with four options each among
/// the reference's next-token candidates ([`QuestionKind`]), gold drawn from the
/// reference's probabilities over the options, groups round robin over [`GROUPS`].
/// Deterministic in `spec.seed`.
pub fn question_set<M: NextTokenModel>(
    model: &M,
    spec: &RecordSetSpec,
) -> Result<Vec<Record>, QuestionSetError<M::Error>> {
    check_vocab(spec.vocab).map_err(QuestionSetError::Spec)?;
    let all_rows: Vec<u32> = (0..spec.vocab as u32).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed ^ QUESTION_SALT);
    let mut records = Vec::with_capacity(spec.count);
    for i in 0..spec.count {
        let tokens = prompt(&mut rng, spec.prompt_tokens, spec.vocab);
        let state = model.run_prompt(&tokens).map_err(QuestionSetError::Model)?;
        let logits = model
            .next_token_logits(&state, &all_rows)
            .map_err(QuestionSetError::Model)?;
        let mut ranked = all_rows.clone();
        ranked.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let kind = QuestionKind::from_draw(rng.random::<f64>());
        let mut option_tokens = pick_options(&mut rng, kind, &ranked);
        option_tokens.shuffle(&mut rng);
        let option_logits = model
            .next_token_logits(&state, &option_tokens)
            .map_err(QuestionSetError::Model)?;
        let gold = draw_from_softmax(&option_logits, rng.random::<f64>());
        records.push(Record {
            gold: Some(LABELS[gold].to_string()),
            group: Some(GROUPS[i % GROUPS.len()].to_string()),
            id: format!("q{i:04}"),
            option_tokens,
            options: LABELS.iter().map(|l| l.to_string()).collect(),
            tokens,
        });
    }
    Ok(records)
}

/// Calibration prompts: `spec.count` random prompts drawn with another salt than the
/// questions'. `loraq run` scores the options of every record and refuses a record
/// with fewer than two, so each carries two placeholder options (tokens 0 and 1);
/// only the prompts' activations matter.
pub fn calibration_set(spec: &RecordSetSpec) -> Vec<Record> {
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed ^ CALIBRATION_SALT);
    (0..spec.count)
        .map(|i| Record {
            gold: None,
            group: None,
            id: format!("c{i:04}"),
            option_tokens: vec![0, 1],
            options: vec!["A".into(), "B".into()],
            tokens: prompt(&mut rng, spec.prompt_tokens, spec.vocab),
        })
        .collect()
}

/// The records as JSON Lines (one object per line, newline-terminated).
pub fn to_json_lines(records: &[Record]) -> String {
    let mut out = String::new();
    for record in records {
        out.push_str(&serde_json::to_string(record).expect("a record serializes"));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A model whose next-token logits ignore the prompt: token t scores -t / 8, so
    /// the ranking is 0, 1, 2, ... and the probabilities are known in closed form.
    struct Linear {
        prompts: Cell<usize>,
    }

    impl NextTokenModel for Linear {
        type Error = String;
        type State = Vec<u32>;
        fn run_prompt(&self, tokens: &[u32]) -> Result<Vec<u32>, String> {
            self.prompts.set(self.prompts.get() + 1);
            Ok(tokens.to_vec())
        }
        fn next_token_logits(&self, _: &Vec<u32>, c: &[u32]) -> Result<Vec<f32>, String> {
            Ok(c.iter().map(|&t| -(t as f32) / 8.0).collect())
        }
    }

    fn spec(count: usize) -> RecordSetSpec {
        RecordSetSpec {
            count,
            prompt_tokens: 7,
            vocab: 2048,
            seed: 3,
        }
    }

    #[test]
    fn questions_follow_the_option_rules() {
        let model = Linear {
            prompts: Cell::new(0),
        };
        let records = question_set(&model, &spec(600)).unwrap();
        assert_eq!(model.prompts.get(), 600);
        let (mut confident, mut ordinary, mut near) = (0, 0, 0);
        for (i, r) in records.iter().enumerate() {
            assert_eq!(r.id, format!("q{i:04}"));
            assert_eq!(r.group.as_deref(), Some(GROUPS[i % 3]));
            assert_eq!(r.tokens.len(), 7);
            assert!(r.tokens.iter().all(|&t| t < 2048));
            assert_eq!(r.options, ["A", "B", "C", "D"]);
            let mut sorted = r.option_tokens.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(
                sorted.len(),
                4,
                "options are distinct: {:?}",
                r.option_tokens
            );
            // With the ranking 0, 1, 2, ..., the rank of a token is the token.
            if sorted[0] == 0 && sorted[1] >= 64 {
                assert!(sorted[3] < 1024);
                confident += 1;
            } else if sorted.windows(2).all(|w| w[1] - w[0] == 3) && sorted[0] < 16 {
                near += 1;
            } else {
                assert!(sorted[3] < 48, "ordinary options in the top 48: {sorted:?}");
                ordinary += 1;
            }
        }
        // 35% / 55% / 10% of 600, within a few standard deviations.
        assert!((170..=250).contains(&confident), "{confident}");
        assert!((290..=370).contains(&ordinary), "{ordinary}");
        assert!((35..=90).contains(&near), "{near}");
    }

    #[test]
    fn gold_follows_the_reference_probabilities() {
        // Confident questions put token 0 (logit 0) against tokens at least 64 ranks
        // down (logit <= -8): its probability is above 1 - 3 e^-8, so gold is token 0
        // in all of them.
        let model = Linear {
            prompts: Cell::new(0),
        };
        let records = question_set(&model, &spec(300)).unwrap();
        for r in &records {
            let gold = LABELS
                .iter()
                .position(|l| Some(*l) == r.gold.as_deref())
                .unwrap();
            let min = *r.option_tokens.iter().min().unwrap();
            if min == 0 && r.option_tokens.iter().filter(|&&t| t >= 64).count() == 3 {
                assert_eq!(r.option_tokens[gold], 0, "{r:?}");
            }
        }
    }

    #[test]
    fn softmax_draw_matches_the_cumulative_probabilities() {
        // logits ln 1, ln 2, ln 3, ln 4: probabilities 0.1, 0.2, 0.3, 0.4.
        let logits: Vec<f32> = [1f32, 2.0, 3.0, 4.0].iter().map(|x| x.ln()).collect();
        assert_eq!(draw_from_softmax(&logits, 0.05), 0);
        assert_eq!(draw_from_softmax(&logits, 0.15), 1);
        assert_eq!(draw_from_softmax(&logits, 0.45), 2);
        assert_eq!(draw_from_softmax(&logits, 0.65), 3);
        assert_eq!(draw_from_softmax(&logits, 0.999_999), 3);
    }

    #[test]
    fn sets_are_deterministic_and_distinct() {
        let model = Linear {
            prompts: Cell::new(0),
        };
        let a = question_set(&model, &spec(20)).unwrap();
        assert_eq!(a, question_set(&model, &spec(20)).unwrap());
        let c = calibration_set(&spec(20));
        assert_eq!(c, calibration_set(&spec(20)));
        assert_ne!(a[0].tokens, c[0].tokens, "other prompts than the questions");
        assert!(
            c.iter()
                .all(|r| r.option_tokens == [0, 1] && r.gold.is_none())
        );
        let lines = to_json_lines(&c[..1]);
        assert!(lines.starts_with(
            "{\"id\":\"c0000\",\"option_tokens\":[0,1],\"options\":[\"A\",\"B\"],\"tokens\":["
        ));
        assert!(lines.ends_with("]}\n"));
    }

    #[test]
    fn a_tiny_vocabulary_is_refused() {
        let model = Linear {
            prompts: Cell::new(0),
        };
        let small = RecordSetSpec {
            vocab: 50,
            ..spec(1)
        };
        assert!(matches!(
            question_set(&model, &small),
            Err(QuestionSetError::Spec(_))
        ));
    }
}
