//! What is asked of the server: one record of a records file (docs/model.md), reduced
//! to what a request needs, and what comes back.

use serde::Serialize;

/// One question: a prompt as token ids and the token scored for each option.
#[derive(Debug, Clone, PartialEq)]
pub struct Question {
    /// The record's id (unique in the records file).
    pub id: String,
    /// Benchmark or subset.
    pub group: Option<String>,
    /// Prompt text, when the record has it (used only by the tokenizer check).
    pub prompt: Option<String>,
    /// Prompt token ids, sent as they are.
    pub tokens: Vec<u32>,
    /// Option labels.
    pub options: Vec<String>,
    /// The vocabulary id scored for each option, in the order of `options`.
    pub option_tokens: Vec<u32>,
    /// The gold label, if known.
    pub gold: Option<String>,
    /// 1-based line in the records file.
    pub line: u64,
}

/// What an engine returned for one question: per option, the natural-log value the
/// engine gives for its token (docs/collect.md says which quantity that is per
/// engine), or `None` where the engine did not return the option.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    /// One entry per option, in the question's order.
    pub values: Vec<Option<f64>>,
}

/// One line of the answers file, in the answers format `loraq compare` reads
/// (docs/evaluation.md): `logits` are the engine's log-values, whose softmax over the
/// options is the answer's distribution.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AnswerLine<'a> {
    /// Question id.
    pub id: &'a str,
    /// Group.
    pub group: Option<&'a str>,
    /// Option labels.
    pub options: &'a [String],
    /// One log-value per option.
    pub logits: Vec<f64>,
    /// Gold label.
    pub gold: Option<&'a str>,
}

/// One line of the incomplete-answers file (`OUT.incomplete.jsonl`): a question some
/// of whose options the engine did not return, with what it did return.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IncompleteLine<'a> {
    /// Question id.
    pub id: &'a str,
    /// Option labels.
    pub options: &'a [String],
    /// The log-value of each option, null where missing.
    pub logits: Vec<Option<f64>>,
    /// Why options are missing.
    pub reason: &'a str,
}
