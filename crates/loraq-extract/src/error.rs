//! The one error type of this crate.

/// Everything that stops an extraction, a verification or a check. Every variant names
/// the module, tensor or file it is about, so a refusal says what to look at.
#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    /// The delta of a module is zero everywhere: there is nothing to factor.
    #[error(
        "{module}: the delta is all zero (the tensors differ only in the sign of zeros, or not at all)"
    )]
    AllZeroDelta {
        /// Module path or tensor name.
        module: String,
    },
    /// A value that must be finite is NaN or infinite.
    #[error("{module}: {what} has a non-finite value at element {index}")]
    NonFinite {
        /// Module path or tensor name.
        module: String,
        /// Which array: "merged", "base", "delta", "factor A after the bf16 cast", ...
        what: &'static str,
        /// Flat (row-major) index of the first non-finite element.
        index: usize,
    },
    /// A matrix's dimensions do not fit its data, or overflow.
    #[error("{module}: {what}")]
    BadShape {
        /// Module path or tensor name.
        module: String,
        /// What is wrong with the shape.
        what: String,
    },
    /// A dense linear-algebra routine failed (no convergence, not positive definite).
    #[error("{module}: {what} failed: {detail}")]
    Linalg {
        /// Module path or tensor name.
        module: String,
        /// The routine: "thin SVD of the projected delta", "Gram eigendecomposition", ...
        what: &'static str,
        /// The routine's own message.
        detail: String,
    },
    /// Reading or writing a checkpoint, adapter or output file failed.
    #[error(transparent)]
    Io(#[from] loraq_io::IoError),
    /// Decoding a quantized base failed.
    #[error(transparent)]
    Quant(#[from] loraq_quant::QuantError),
    /// The merge is not base + adapter: tensors that must not differ do, or do not exist.
    #[error("the merge is not the base plus a LoRA adapter; refused tensors:{}", list_refusals(.refusals))]
    Refused {
        /// Every refused tensor.
        refusals: Vec<Refusal>,
    },
    /// Modules whose truncation residual is above the threshold times the floor.
    #[error("residual above {threshold} x the bf16 rounding floor (raise --rank, or --allow-residual to write it anyway):{}", list_residuals(.modules))]
    ResidualAboveThreshold {
        /// The `--max-residual-ratio`.
        threshold: f64,
        /// (module path, residual / floor).
        modules: Vec<(String, f64)>,
    },
    /// Modules whose residual after the bf16 cast of the factors is above the
    /// threshold `loraq verify` applies by default: verify would reject the adapter.
    #[error("after the bf16 cast of the factors, residual above {threshold} x the floor, the threshold of loraq verify, which would reject the adapter (the delta is too large for bf16 factors to stay at the merge's floor; --allow-residual writes it anyway):{}", list_residuals(.modules))]
    CastAboveVerifyThreshold {
        /// `loraq verify`'s default `--max-residual-ratio`.
        threshold: f64,
        /// (module path, residual after the cast / floor).
        modules: Vec<(String, f64)>,
    },
    /// A `--copy` pattern that matches no file of the merged checkpoint's directory.
    #[error("--copy {pattern}: no file in {dir} matches")]
    CopyNoMatch {
        /// The glob.
        pattern: String,
        /// The directory searched.
        dir: std::path::PathBuf,
    },
    /// Reading a checkpoint file failed.
    // The OS error is the source, printed once by the error chain.
    #[error("{path}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Writing an output file failed.
    // The OS error is the source, printed once by the error chain.
    #[error("{path}")]
    Write {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The quantized target base (`--target-base DIR`) does not fit the base.
    #[error("--target-base {path}: {tensor}: {what}")]
    TargetBase {
        /// The target checkpoint.
        path: std::path::PathBuf,
        /// The tensor at fault.
        tensor: String,
        /// What is wrong.
        what: String,
    },
    /// The calibration statistics file (`--calibration FILE`) is unusable.
    #[error("--calibration {path}: {tensor}: {what}")]
    ActivationStats {
        /// The statistics file.
        path: std::path::PathBuf,
        /// The tensor (or metadata key) at fault.
        tensor: String,
        /// What is wrong.
        what: String,
    },
    /// A requested rank is not one a LoRA runtime accepts, or a parameter is out of range.
    #[error("invalid parameter {name}: {detail}")]
    InvalidParameter {
        /// The parameter (as spelled on the command line).
        name: &'static str,
        /// Why it is refused.
        detail: String,
    },
}

/// One tensor the scan refuses, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Refusal {
    /// Tensor name.
    pub tensor: String,
    /// Why it stops the extraction.
    pub reason: String,
}

fn list_refusals(refusals: &[Refusal]) -> String {
    refusals
        .iter()
        .map(|r| format!("\n  {}: {}", r.tensor, r.reason))
        .collect()
}

fn list_residuals(modules: &[(String, f64)]) -> String {
    modules
        .iter()
        .map(|(m, ratio)| format!("\n  {m}: residual {ratio:.3} x floor"))
        .collect()
}

/// Result with [`ExtractError`].
pub type Result<T, E = ExtractError> = std::result::Result<T, E>;
