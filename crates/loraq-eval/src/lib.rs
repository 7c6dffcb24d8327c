//! loraq-eval: how a candidate's answers differ from a reference's on the same
//! questions.
//!
//! - [`answers`]: the answers format (JSON Lines) and its streaming reader;
//! - [`pair`]: pairing two files by id and reducing each pair;
//! - [`stats`]: means with standard errors, percentiles, Wilson, McNemar, bootstrap;
//! - [`calibration`]: ECE, adaptive ECE, reliability tables;
//! - [`compare`](mod@compare): the comparison report with its exact JSON keys;
//! - [`render`]: the report for people (text table, Markdown, SVG);
//! - [`hidden`]: per-tensor cosine, relative L2 and SQNR of two hidden-state files.
//!
//! Definitions of every figure: docs/evaluation.md.

pub mod answers;
pub mod calibration;
pub mod compare;
pub mod error;
pub mod hidden;
mod id_table;
pub mod pair;
mod plain_line;
pub mod render;
pub mod stats;

pub use answers::{Answer, AnswersReader};
pub use compare::{CompareOptions, Comparison, Report, compare, compare_files};
pub use error::{EvalError, FieldMismatch, Result};
pub use hidden::{HiddenComparison, compare_hidden};
pub use pair::{PairStats, PairedAnswers, pair_answers, pair_files};
