//! The crate's single error type.

/// Everything that can go wrong building or running a quantized-base + LoRA linear.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A buffer does not have the length its declared shape implies.
    #[error("{what}: expected {expected} elements, got {actual}")]
    ShapeMismatch {
        /// Which buffer (e.g. "fp8-block128 weight scales").
        what: &'static str,
        /// Length implied by the shape.
        expected: usize,
        /// Length supplied.
        actual: usize,
    },
    /// A size computation overflowed `usize`.
    #[error("{what}: size overflows usize ({rows} x {cols})")]
    SizeOverflow {
        /// Which buffer.
        what: &'static str,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// A dimension is zero where it must be positive.
    #[error("{what} must be positive")]
    ZeroDimension {
        /// Which dimension.
        what: &'static str,
    },
    /// NVFP4 (and MXFP4) pack 16 (32) input elements per scale block; other in-dims are refused.
    #[error(
        "{format} weight needs an in-dimension divisible by {block}, got {in_features} \
         (pad the input dimension or keep this module in a higher-precision format)"
    )]
    InDimNotBlockAligned {
        /// Format name.
        format: &'static str,
        /// Block size along the input dimension.
        block: usize,
        /// The offending input dimension.
        in_features: usize,
    },
    /// The LoRA rank is outside 1..=MAX_RANK.
    #[error("LoRA rank {rank} outside the supported range 1..={max}")]
    RankOutOfRange {
        /// Rank supplied.
        rank: usize,
        /// Largest supported rank.
        max: usize,
    },
    /// The LoRA factors do not match the base weight's shape.
    #[error("LoRA {factor} is {rows}x{cols}, expected {expected_rows}x{expected_cols}")]
    LoraShape {
        /// "A" or "B".
        factor: &'static str,
        /// Rows supplied.
        rows: usize,
        /// Columns supplied.
        cols: usize,
        /// Rows expected.
        expected_rows: usize,
        /// Columns expected.
        expected_cols: usize,
    },
    /// A scale is not a finite positive number.
    #[error("{what} at index {index} is {value}, expected a finite positive number")]
    BadScale {
        /// Which scale tensor.
        what: &'static str,
        /// Flat index of the offending entry.
        index: usize,
        /// The value found.
        value: f32,
    },
    /// The input activation buffer does not match batch x in-dim.
    #[error("input has {actual} elements, expected batch {batch} x in-dim {in_features}")]
    InputShape {
        /// Tokens.
        batch: usize,
        /// Input features.
        in_features: usize,
        /// Elements supplied.
        actual: usize,
    },
    /// The output buffer does not match batch x out-dim.
    #[error("output has {actual} elements, expected batch {batch} x out-dim {out_features}")]
    OutputShape {
        /// Tokens.
        batch: usize,
        /// Output features.
        out_features: usize,
        /// Elements supplied.
        actual: usize,
    },
    /// The NVRTC shared library could not be loaded or lacks a symbol.
    #[error("cannot load NVRTC from {path}: {reason}")]
    NvrtcLibrary {
        /// Library path tried.
        path: String,
        /// Loader message.
        reason: String,
    },
    /// NVRTC rejected a kernel source.
    #[error("NVRTC failed to compile {kernel} for {arch} ({status}):\n{log}")]
    NvrtcCompile {
        /// Kernel file name.
        kernel: String,
        /// Target architecture, e.g. sm_90a.
        arch: String,
        /// NVRTC status string.
        status: String,
        /// Compiler log.
        log: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error during {during}: {message}")]
    Cuda {
        /// What was being done.
        during: &'static str,
        /// Driver message.
        message: String,
    },
    /// A number-format operation of `loraq-quant` (activation fake-quant, conversion of
    /// a quantized weight) failed.
    #[error(transparent)]
    Quant(#[from] loraq_quant::QuantError),
    /// A quantized weight's scheme has no fused kernel.
    #[error("no fused kernel for {what}")]
    UnsupportedScheme {
        /// Description of the scheme.
        what: String,
    },
    /// The requested configuration has no GPU kernel.
    #[error("no CUDA kernel for {what}")]
    UnsupportedOnGpu {
        /// Description of the unsupported configuration.
        what: String,
    },
}

/// Result alias for this crate.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;
