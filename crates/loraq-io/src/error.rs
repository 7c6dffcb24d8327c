//! The one error type of loraq-io.

use crate::limits::elide;
use std::path::PathBuf;

/// Everything that can go wrong reading or writing checkpoints and adapters.
///
/// Every variant names the file and, where there is one, the tensor, so that a
/// message on its own tells the user what to look at.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// An operating-system error on a file.
    // The OS error is the source, not part of the message: `loraq: {err:#}` prints
    // the chain, which would otherwise show it twice.
    #[error("{path}")]
    Os {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file that should exist does not.
    #[error("{path}: not found{context}")]
    Missing {
        /// The missing path.
        path: PathBuf,
        /// Why it was expected (e.g. " (named by model.safetensors.index.json)").
        context: String,
    },
    /// A safetensors header that is malformed or inconsistent with the file.
    #[error("{path}: invalid safetensors header: {reason}")]
    Header {
        /// The safetensors file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// One tensor entry of a safetensors header is invalid.
    #[error("{path}: tensor {}: {reason}", elide(.tensor))]
    Tensor {
        /// The file holding (or expected to hold) the tensor.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A dtype string that loraq does not know.
    #[error("{path}: tensor {}: unknown dtype {}", elide(.tensor), elide(&format!("{:?}", .dtype)))]
    UnknownDtype {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dtype as written.
        dtype: String,
    },
    /// A JSON file that does not parse or lacks a required field.
    #[error("{path}: invalid JSON: {reason}")]
    Json {
        /// The JSON file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A sharded checkpoint whose index and shards disagree.
    #[error("{path}: {reason}")]
    Index {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor asked for that the checkpoint does not hold.
    #[error("{root}: no tensor named {}", elide(.tensor))]
    TensorNotFound {
        /// The checkpoint root.
        root: PathBuf,
        /// The missing tensor.
        tensor: String,
    },
    /// A conversion that the tensor's dtype does not allow.
    #[error("{path}: tensor {}: cannot convert {dtype} to f32", elide(.tensor))]
    Unconvertible {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its dtype.
        dtype: String,
    },
    /// An output directory that exists already (pass `--force` to replace it).
    #[error("{path}: already exists (use --force to replace it)")]
    OutputExists {
        /// The target directory.
        path: PathBuf,
    },
    /// An output that is, contains or lies inside one of the command's inputs: refused
    /// with or without `--force`, which would destroy the input.
    #[error(
        "refusing to write {output}: it {relation} the input {input} (refused with or without --force)"
    )]
    OutputOverInput {
        /// The output as given.
        output: PathBuf,
        /// "is", "contains" or "lies inside".
        relation: &'static str,
        /// The input as given.
        input: PathBuf,
    },
    /// An output that is the working directory or one of its ancestors: refused with
    /// or without `--force`.
    #[error(
        "refusing to write {output}: it {relation} the working directory {cwd} (refused with or without --force)"
    )]
    OutputOverWorkingDir {
        /// The output as given.
        output: PathBuf,
        /// "is" or "contains".
        relation: &'static str,
        /// The working directory, resolved.
        cwd: PathBuf,
    },
    /// Two outputs of one command that are the same path or nested.
    #[error("refusing to write {output}: it {relation} the other output {other}")]
    OutputOverOutput {
        /// The later output.
        output: PathBuf,
        /// "is", "contains" or "lies inside".
        relation: &'static str,
        /// The earlier output.
        other: PathBuf,
    },
    /// An existing target of the other kind: a file output never replaces a
    /// directory, nor a directory output a file, even with `--force`.
    #[error("{path}: exists and is a {existing}; a {output} output never replaces it")]
    OutputKindMismatch {
        /// The target.
        path: PathBuf,
        /// "file" or "directory": what is there.
        existing: &'static str,
        /// "file" or "directory": what the command writes.
        output: &'static str,
    },
    /// A writer used out of its contract (wrong tensor order, wrong byte count, ...).
    #[error("{path}: {reason}")]
    Write {
        /// The file being written.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A SHA256SUMS line that does not match the file.
    #[error("{path}: checksum mismatch for {file}")]
    Checksum {
        /// The SHA256SUMS file.
        path: PathBuf,
        /// The file whose digest differs.
        file: String,
    },
    /// A PEFT adapter directory that does not follow the format.
    #[error("{path}: invalid adapter: {reason}")]
    Adapter {
        /// The adapter directory or file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A calibration statistics file (`loraq run --collect-stats`) that does not
    /// follow the format, or statistics that cannot be written.
    #[error("{path}: invalid calibration statistics: {reason}")]
    ActivationStats {
        /// The statistics file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An unknown synth preset or invalid synth parameter.
    #[error("synth: {0}")]
    Synth(String),
}

impl IoError {
    /// The error for a file that could not be opened: [`IoError::Missing`] (with
    /// `context` saying why it was expected) when it does not exist, else [`IoError::Os`].
    pub(crate) fn opening(
        path: &std::path::Path,
        source: std::io::Error,
        context: &str,
    ) -> IoError {
        if source.kind() == std::io::ErrorKind::NotFound {
            IoError::Missing {
                path: path.to_path_buf(),
                context: context.to_string(),
            }
        } else {
            IoError::Os {
                path: path.to_path_buf(),
                source,
            }
        }
    }
}

/// Result alias of loraq-io.
pub type Result<T, E = IoError> = std::result::Result<T, E>;

/// Attaches a path to an `std::io::Error`.
pub(crate) trait OsContext<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> OsContext<T> for std::result::Result<T, std::io::Error> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|source| IoError::Os {
            path: path.into(),
            source,
        })
    }
}
