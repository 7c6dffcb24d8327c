//! The one error type of loraq-gguf.

use loraq_io::limits::elide;
use std::path::PathBuf;

/// Everything that can go wrong reading or writing GGUF files and exporting adapters.
///
/// Every variant names the file and, where there is one, the tensor, metadata key or
/// module, so that a message on its own tells the user what to look at.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// An operating-system error on a file.
    #[error("{path}")]
    Os {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A malformed or inconsistent GGUF header (magic, version, counts, layout).
    #[error("{path}: invalid GGUF file: {reason}")]
    Format {
        /// The GGUF file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A metadata key-value pair that is malformed, missing or of the wrong type.
    #[error("{path}: metadata key {}: {reason}", elide(.key))]
    Metadata {
        /// The GGUF file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// One tensor of a GGUF file is invalid or cannot be used as asked.
    #[error("{path}: tensor {}: {reason}", elide(.tensor))]
    Tensor {
        /// The GGUF file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A module of an adapter that cannot be exported as a llama.cpp LoRA.
    #[error("{path}: module {}: {reason}", elide(.module))]
    Adapter {
        /// The adapter directory.
        path: PathBuf,
        /// The module path.
        module: String,
        /// What is wrong.
        reason: String,
    },
    /// A checkpoint (its config, tokenizer or a tensor) that cannot be converted to a
    /// GGUF model as llama.cpp's converter would.
    #[error("{path}: {reason}")]
    Convert {
        /// The file or directory concerned.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An error from loraq-io (checkpoints, adapters, atomic outputs).
    #[error(transparent)]
    Io(#[from] loraq_io::IoError),
}

/// Result with [`GgufError`].
pub type Result<T> = std::result::Result<T, GgufError>;

pub(crate) fn os(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> GgufError + '_ {
    move |source| GgufError::Os {
        path: path.to_path_buf(),
        source,
    }
}
