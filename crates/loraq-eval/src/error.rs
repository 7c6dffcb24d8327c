//! The one error type of loraq-eval.

use loraq_io::limits::elide;
use std::path::PathBuf;

/// An id as messages show it: quoted, escaped and cut to a few hundred characters.
fn shown_id(id: &str) -> String {
    elide(&format!("{id:?}"))
}

/// Everything that can go wrong reading answers files or comparing them.
///
/// Every variant that comes from a line of an answers file names the file and the
/// 1-based line number, so that the message on its own points at the bad record.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// An operating-system error on a file.
    // The OS error is in the message and deliberately not a `source`, so that
    // `loraq: {err:#}` does not print it twice.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        error: std::io::Error,
    },
    /// A line that is not valid JSON, or a field of the wrong JSON type.
    #[error("{path}:{line}: malformed JSON: {message}")]
    Json {
        /// The answers file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What serde_json reported (its column refers to this line).
        message: String,
    },
    /// A required field is absent (or null where null is not allowed).
    #[error("{path}:{line}: missing field `{field}`")]
    MissingField {
        /// The answers file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// The field name.
        field: &'static str,
    },
    /// A logit or probability that is NaN, infinite or null.
    #[error("{path}:{line}: id {}: {field}[{index}] is not a finite number ({})", shown_id(.id), elide(.value))]
    NonFinite {
        /// The answers file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// The question id.
        id: String,
        /// `logits` or `probs`.
        field: &'static str,
        /// 0-based position in the array.
        index: usize,
        /// How the value was written (`NaN`, `Infinity`, `null`, ...).
        value: String,
    },
    /// A record that is well-formed JSON but inconsistent in itself.
    #[error("{path}:{line}: id {}: {reason}", shown_id(.id))]
    InvalidRecord {
        /// The answers file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// The question id (empty when the id itself is the problem).
        id: String,
        /// What is wrong.
        reason: String,
    },
    /// The same id appears twice in one file.
    #[error("{path}:{line}: duplicate id {} (first at line {first_line})", shown_id(.id))]
    DuplicateId {
        /// The answers file.
        path: PathBuf,
        /// 1-based line number of the second occurrence.
        line: u64,
        /// The repeated id.
        id: String,
        /// 1-based line number of the first occurrence.
        first_line: u64,
    },
    /// The two files disagree about a paired question (options, gold or group).
    #[error("{0}")]
    Mismatch(Box<FieldMismatch>),
    /// A candidate id with no reference answer (without `allow_unpaired`).
    #[error(
        "{path}:{line}: id {} has no answer in {other_path} (pass --allow-unpaired to count such ids instead)",
        shown_id(.id)
    )]
    UnpairedCandidate {
        /// The candidate file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// The id.
        id: String,
        /// The reference file.
        other_path: PathBuf,
    },
    /// Reference ids with no candidate answer (without `allow_unpaired`).
    #[error(
        "{path}:{line}: id {} has no answer in {other_path} ({count} reference ids unpaired in all; pass --allow-unpaired to count them instead)",
        shown_id(.id)
    )]
    UnpairedReference {
        /// The reference file.
        path: PathBuf,
        /// 1-based line number of the first unpaired reference id.
        line: u64,
        /// The first unpaired reference id.
        id: String,
        /// The candidate file.
        other_path: PathBuf,
        /// How many reference ids are unpaired.
        count: usize,
    },
    /// A divergence or log-likelihood that would be infinite because a side gives
    /// probability zero where it must not.
    #[error("{path}:{line}: id {}: {reason}", shown_id(.id))]
    Infinite {
        /// The file whose zero probability causes it.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// The question id.
        id: String,
        /// Which figure and why.
        reason: String,
    },
    /// Nothing to compare.
    #[error("{reference} and {candidate} have no question id in common")]
    NoPairs {
        /// The reference file.
        reference: PathBuf,
        /// The candidate file.
        candidate: PathBuf,
    },
    /// An error from loraq-io reading a hidden-state file.
    #[error(transparent)]
    Checkpoint(#[from] loraq_io::IoError),
    /// An option value outside its allowed range (bins = 0, ...).
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// A hidden-state file problem (missing key, shape or dtype mismatch, ...).
    #[error("{path}: tensor {}: {reason}", elide(.tensor))]
    Hidden {
        /// The hidden-state file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
}

/// Details of [`EvalError::Mismatch`] (boxed: it is the largest variant).
#[derive(Debug, thiserror::Error)]
#[error(
    "{path}:{line}: id {}: {field} differ from {other_path}:{other_line} ({} vs {})",
    shown_id(.id),
    elide(.ours),
    elide(.theirs)
)]
pub struct FieldMismatch {
    /// The candidate file.
    pub path: PathBuf,
    /// 1-based line number in the candidate file.
    pub line: u64,
    /// The question id.
    pub id: String,
    /// `options`, `gold` or `group`.
    pub field: &'static str,
    /// The reference file.
    pub other_path: PathBuf,
    /// 1-based line number in the reference file.
    pub other_line: u64,
    /// The candidate's value, as JSON.
    pub ours: String,
    /// The reference's value, as JSON.
    pub theirs: String,
}

/// Result alias of loraq-eval.
pub type Result<T> = std::result::Result<T, EvalError>;
