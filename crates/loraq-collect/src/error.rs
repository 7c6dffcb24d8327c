//! The one error type of loraq-collect.

use std::path::PathBuf;

/// Everything that can stop a collection. Each variant names what it is about: the
/// file and line, the record, or the server and request.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A record cannot be sent (no tokens, no option tokens, too many options, ...).
    #[error("{}:{line}: record {id}: {reason}", path.display())]
    Record {
        /// The records file.
        path: PathBuf,
        /// 1-based line of the record.
        line: u64,
        /// The record's id, as shown.
        id: String,
        /// What is wrong.
        reason: String,
    },
    /// An existing answers file or its header cannot be resumed from.
    #[error("{}: {reason}", path.display())]
    Resume {
        /// The answers file or its header.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The server answered, but not what the request asks for (a malformed body, a
    /// missing field, an HTTP status that retrying cannot change).
    #[error("{server}: {request}: {reason}")]
    Server {
        /// The server's base URL.
        server: String,
        /// The request, e.g. `POST /completion for record "q7"`.
        request: String,
        /// What was wrong with the answer.
        reason: String,
    },
    /// The server could not be reached or kept failing after every retry.
    #[error("{server}: {request}: gave up after {attempts} attempt(s): {last}")]
    Unavailable {
        /// The server's base URL.
        server: String,
        /// The request.
        request: String,
        /// How many attempts were made.
        attempts: u32,
        /// The last failure.
        last: String,
    },
    /// A check before the first request failed (the model is not served, the adapter
    /// is unknown, a token is outside the server's vocabulary).
    #[error("{server}: {reason}")]
    Preflight {
        /// The server's base URL.
        server: String,
        /// What was found.
        reason: String,
    },
    /// Writing the header atomically failed (loraq-io's error names the file).
    #[error(transparent)]
    Output(#[from] loraq_io::IoError),
    /// An option was configured wrongly (a concurrency of 0, a scale that is not finite).
    #[error("{0}")]
    Options(String),
}

/// Results of loraq-collect.
pub type Result<T> = std::result::Result<T, CollectError>;

impl CollectError {
    /// An [`CollectError::Io`] for `path`.
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> CollectError {
        let path = path.into();
        move |source| CollectError::Io { path, source }
    }
}
