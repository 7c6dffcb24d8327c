//! Tensor element types as safetensors names them.

use std::fmt;

/// An element type of a safetensors tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// bool, one byte.
    Bool,
    /// Unsigned 8-bit (also packed 4-bit formats).
    U8,
    /// Signed 8-bit.
    I8,
    /// Unsigned 16-bit.
    U16,
    /// Signed 16-bit.
    I16,
    /// Unsigned 32-bit.
    U32,
    /// Signed 32-bit.
    I32,
    /// Unsigned 64-bit.
    U64,
    /// Signed 64-bit.
    I64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// FP8 E4M3 (the "fn" variant: no infinities, max 448).
    F8E4M3,
    /// FP8 E5M2.
    F8E5M2,
}

impl DType {
    /// Every dtype loraq knows, in safetensors' order of alignment.
    pub const ALL: [DType; 15] = [
        DType::F64,
        DType::I64,
        DType::U64,
        DType::F32,
        DType::I32,
        DType::U32,
        DType::BF16,
        DType::F16,
        DType::I16,
        DType::U16,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I8,
        DType::U8,
        DType::Bool,
    ];

    /// The name safetensors headers use ("BF16", "F8_E4M3", ...).
    pub fn as_str(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::U16 => "U16",
            DType::I16 => "I16",
            DType::U32 => "U32",
            DType::I32 => "I32",
            DType::U64 => "U64",
            DType::I64 => "I64",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
        }
    }

    /// Parses a safetensors dtype name; `None` for names loraq does not know.
    pub fn from_safetensors_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.as_str() == name)
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// Whether the dtype is a floating-point format that converts to f32.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F16 | DType::BF16 | DType::F32 | DType::F64 | DType::F8E4M3 | DType::F8E5M2
        )
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
