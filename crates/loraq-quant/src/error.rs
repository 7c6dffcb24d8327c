//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong while quantizing, dequantizing or reading and
/// writing quantized checkpoints. Variants name the tensor (or file) concerned.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    /// A scheme name that is not one of [`crate::Scheme::ALL`].
    #[error("unknown quantization scheme {name:?} (known: {known})")]
    UnknownScheme {
        /// The name given.
        name: String,
        /// The accepted names, comma separated.
        known: String,
    },
    /// A layout name that is not known.
    #[error("unknown checkpoint layout {name:?} (known: {known})")]
    UnknownLayout {
        /// The name given.
        name: String,
        /// The accepted names, comma separated.
        known: String,
    },
    /// A scheme cannot be written in the requested layout.
    #[error("scheme {scheme} cannot be written in layout {layout}")]
    SchemeLayoutMismatch {
        /// The scheme.
        scheme: &'static str,
        /// The layout.
        layout: &'static str,
    },
    /// The data length does not match `out_features * in_features` (or the product overflows).
    #[error("tensor {tensor}: {len} values do not form a {out_features}x{in_features} matrix")]
    ShapeMismatch {
        /// Tensor name.
        tensor: String,
        /// Rows (output features).
        out_features: usize,
        /// Columns (input features).
        in_features: usize,
        /// Number of values given.
        len: usize,
    },
    /// A weight or activation entry is NaN or infinite.
    #[error("tensor {tensor}: non-finite value {value} at row {row}, column {col}")]
    NonFinite {
        /// Tensor name.
        tensor: String,
        /// Row of the first offending entry.
        row: usize,
        /// Column of the first offending entry.
        col: usize,
        /// The value.
        value: f32,
    },
    /// The input dimension is not a multiple of what the scheme needs.
    #[error(
        "tensor {tensor}: scheme {scheme} needs the input dimension to be a multiple of {multiple}, got {in_features}"
    )]
    InputDimNotDivisible {
        /// Tensor name.
        tensor: String,
        /// The scheme.
        scheme: &'static str,
        /// Required multiple.
        multiple: usize,
        /// The input dimension given.
        in_features: usize,
    },
    /// A global or static scale that is zero, negative or not finite.
    #[error("tensor {tensor}: scale {value} is not a positive finite number")]
    BadScale {
        /// Tensor name.
        tensor: String,
        /// The scale.
        value: f32,
    },
    /// A code outside its format's range (an INT4 code above 15).
    #[error("tensor {tensor}: code {code} at index {index} is outside the format's range")]
    InvalidCode {
        /// Tensor name.
        tensor: String,
        /// Flat index of the code.
        index: usize,
        /// The code.
        code: u8,
    },
    /// A weight stored in a format the caller cannot use as a stored-format weight
    /// (an f16 / f32 matrix where [`crate::QuantizedWeight`] holds bf16).
    #[error("tensor {tensor}: stored as {format}, which has no stored-format weight")]
    UnsupportedFormat {
        /// Tensor name.
        tensor: String,
        /// The stored format.
        format: String,
    },
    /// A tensor of a quantized checkpoint has the wrong shape.
    #[error("tensor {tensor}: shape {actual:?}, expected {expected:?}")]
    TensorShape {
        /// Tensor name.
        tensor: String,
        /// Shape found.
        actual: Vec<usize>,
        /// Shape expected.
        expected: Vec<usize>,
    },
    /// A tensor of a quantized checkpoint has a dtype the layout does not allow.
    #[error("tensor {tensor}: dtype {actual}, expected {expected}")]
    TensorDtype {
        /// Tensor name.
        tensor: String,
        /// Dtype found.
        actual: String,
        /// Dtype(s) expected.
        expected: String,
    },
    /// A tensor the layout needs is missing from the checkpoint.
    #[error("{path}: tensor {tensor} is missing (needed by the {layout} layout)")]
    MissingTensor {
        /// Checkpoint directory.
        path: PathBuf,
        /// Tensor name.
        tensor: String,
        /// The layout.
        layout: &'static str,
    },
    /// The checkpoint's quantization_config is not one this crate reads.
    #[error("{path}: unsupported quantization_config: {reason}")]
    UnsupportedConfig {
        /// Checkpoint directory or config file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Data stored in a ggml type whose length is not what the shape needs.
    #[error("tensor {tensor}: {actual} bytes of {ggml_type}, expected {expected}")]
    GgmlDataLength {
        /// Tensor name.
        tensor: String,
        /// The ggml type.
        ggml_type: &'static str,
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// The byte size of a matrix in a ggml type overflows.
    #[error(
        "tensor {tensor}: {out_features}x{in_features} in {ggml_type} overflows the address space"
    )]
    GgmlSize {
        /// Tensor name.
        tensor: String,
        /// The ggml type.
        ggml_type: &'static str,
        /// Output features.
        out_features: usize,
        /// Input features.
        in_features: usize,
    },
    /// A ggml file type (llama-quantize ftype) or architecture this crate does not
    /// plan.
    #[error("{what}")]
    GgmlPlan {
        /// What is not supported.
        what: String,
    },
    /// An error from the checkpoint I/O crate.
    #[error(transparent)]
    Io(#[from] loraq_io::IoError),
    /// An error reading a GGUF base.
    #[error(transparent)]
    Gguf(#[from] loraq_gguf::GgufError),
    /// A file system error outside loraq-io.
    // The OS error is the source, printed once by the error chain.
    #[error("{path}")]
    File {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A calibration file cannot give a module the static activation scale the
    /// quantized checkpoint needs.
    #[error("{path}: {module}: {reason}")]
    ActivationStats {
        /// The calibration file.
        path: PathBuf,
        /// The module path (no `.weight`).
        module: String,
        /// What is wrong.
        reason: String,
    },
    /// Something went wrong while working on a checkpoint; `context` names it (the
    /// checkpoint, the option that named the file).
    #[error("{context}")]
    Context {
        /// What was being done, with the path concerned.
        context: String,
        /// The cause.
        #[source]
        source: Box<QuantError>,
    },
    /// Every 2-D float `.weight` of a checkpoint is skipped: nothing to quantize or
    /// measure.
    #[error("{path}: no {what}")]
    NothingToDo {
        /// The checkpoint.
        path: PathBuf,
        /// What was looked for.
        what: &'static str,
    },
    /// An adapter module's shape is not the base weight's.
    #[error(
        "adapter module {module} is {adapter_out_features}x{adapter_in_features}, base weight {tensor} is {out_features}x{in_features}"
    )]
    AdapterShape {
        /// The adapter's module path.
        module: String,
        /// The adapter's output features.
        adapter_out_features: usize,
        /// The adapter's input features.
        adapter_in_features: usize,
        /// The base weight.
        tensor: String,
        /// The base weight's output features.
        out_features: usize,
        /// The base weight's input features.
        in_features: usize,
    },
    /// A regular expression given to the skip list does not compile.
    #[error("bad --skip pattern {pattern:?}: {reason}")]
    BadPattern {
        /// The pattern.
        pattern: String,
        /// Why it does not compile.
        reason: String,
    },
}

impl QuantError {
    /// This error with `context` (what was being done, naming the path) above it.
    pub fn context(self, context: impl Into<String>) -> QuantError {
        QuantError::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = QuantError> = std::result::Result<T, E>;
