//! loraq-collect: answers from a running serving engine (vLLM, llama.cpp's
//! llama-server) in the answers format `loraq compare` reads.
//!
//! - [`engine`]: each engine's request and answer, and the checks before the first
//!   request (model and adapter served, tokens inside the vocabulary, tokenizer);
//! - [`http`]: the blocking JSON client, timeouts, which failures are retried;
//! - [`output`]: the answers file, its header and incomplete file, resume by id;
//! - [`run`]: concurrency, retries with backoff, the summary;
//! - [`question`]: what is asked and what is written.
//!
//! What each engine's numbers are, and the sources they rely on: docs/collect.md.

pub mod engine;
pub mod error;
pub mod http;
pub mod output;
pub mod question;
pub mod run;

pub use engine::{Engine, EngineKind, Target};
pub use error::{CollectError, Result};
pub use http::Client;
pub use output::{AnswersOut, Header, Resumed};
pub use question::{Question, Scores};
pub use run::{RunOptions, Summary, collect};
