//! The one error type of this crate.

/// Why a product was not computed. Every variant says which operand and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmxError {
    /// The inner dimensions or the output's shape do not match.
    #[error("shape mismatch: {a_rows}x{a_cols} times {b_rows}x{b_cols} into {out_rows}x{out_cols}")]
    ShapeMismatch {
        /// Rows of the left operand.
        a_rows: usize,
        /// Columns of the left operand.
        a_cols: usize,
        /// Rows of the right operand.
        b_rows: usize,
        /// Columns of the right operand.
        b_cols: usize,
        /// Rows of the output.
        out_rows: usize,
        /// Columns of the output.
        out_cols: usize,
    },
    /// A view's strides reach past its slice, or its size overflows.
    #[error("{what}: {detail}")]
    BadView {
        /// Which matrix: "left operand", "right operand", "output".
        what: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A value packed as a bf16 operand is not a bf16 value (one plane would round it).
    #[error("weight value {index} ({value}) is not a bf16 value")]
    NotBf16 {
        /// Its index in the row-major values.
        index: usize,
        /// The value, printed.
        value: String,
    },
    /// The products were asked of a machine (or process) without usable AMX tiles.
    #[error("AMX bf16 tiles are not usable on this machine")]
    Unavailable,
}
