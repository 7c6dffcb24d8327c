//! The one error type of loraq-model.

use loraq_io::limits::elide;
use std::path::PathBuf;

/// Errors of loading a model, running it, and scoring records.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Reading a checkpoint, config or adapter failed.
    #[error(transparent)]
    Io(#[from] loraq_io::IoError),
    /// Quantized weights or activations failed to decode or quantize.
    #[error("{module}")]
    Quant {
        /// The module or checkpoint concerned.
        module: String,
        /// The loraq-quant error.
        source: loraq_quant::QuantError,
    },
    /// A loraq-kernels linear refused its inputs.
    #[error("{module}")]
    Kernel {
        /// The module.
        module: String,
        /// The loraq-kernels error.
        source: loraq_kernels::KernelError,
    },
    /// An AMX tile product refused its operands.
    #[error("{module}")]
    Amx {
        /// The module.
        module: String,
        /// The loraq-amx error.
        source: loraq_amx::AmxError,
    },
    /// A tensor operation failed (shape mismatch, device error).
    #[error("tensor operation in {context}")]
    Tensor {
        /// What was being computed.
        context: String,
        /// The candle error.
        source: candle_core::Error,
    },
    /// The model directory holds an architecture this crate does not run.
    #[error(
        "{path}: unsupported architecture {architecture} (loraq run supports qwen3_5, qwen3_5_text and qwen3)"
    )]
    UnsupportedArchitecture {
        /// The config.json.
        path: PathBuf,
        /// The model_type found.
        architecture: String,
    },
    /// A field config.json must have is missing or invalid.
    #[error("{path}: {reason}")]
    Config {
        /// The config.json.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A weight has a shape other than the config implies.
    #[error("{root}: tensor {} has shape {found:?}, the config implies {expected:?}", elide(.tensor))]
    Shape {
        /// The checkpoint directory.
        root: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its shape in the file.
        found: Vec<usize>,
        /// The shape the config implies.
        expected: Vec<usize>,
    },
    /// An adapter does not fit the model.
    #[error("adapter {path}: {reason}")]
    Adapter {
        /// The adapter directory.
        path: PathBuf,
        /// What does not fit.
        reason: String,
    },
    /// A record cannot be scored.
    #[error("{path}:{line}: record {}: {reason}", elide(&format!("{id:?}")))]
    Record {
        /// The records file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// The record id (empty when the line did not parse).
        id: String,
        /// What is wrong.
        reason: String,
    },
    /// Reading or writing a records/answers file failed.
    #[error("cannot read or write {path}")]
    File {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Result alias of loraq-model.
pub type Result<T> = std::result::Result<T, ModelError>;

/// Attaches a context to candle errors.
pub(crate) trait TensorContext<T> {
    /// Names what was being computed.
    fn ctx(self, context: &str) -> Result<T>;
}

impl<T> TensorContext<T> for std::result::Result<T, candle_core::Error> {
    fn ctx(self, context: &str) -> Result<T> {
        self.map_err(|source| ModelError::Tensor {
            context: context.to_string(),
            source,
        })
    }
}
