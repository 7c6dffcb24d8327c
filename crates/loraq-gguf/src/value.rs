//! GGUF metadata values: the thirteen value types (`GGUFValueType` in
//! `gguf-py/gguf/constants.py`, `gguf_type` in `ggml/include/gguf.h`), arrays of any
//! of them but arrays (ggml's reader refuses nested arrays: `gguf_init_from_file_impl`
//! in `ggml/src/gguf.cpp`).

use std::fmt;

/// The type id of a metadata value as GGUF stores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// 0
    U8,
    /// 1
    I8,
    /// 2
    U16,
    /// 3
    I16,
    /// 4
    U32,
    /// 5
    I32,
    /// 6
    F32,
    /// 7: one byte, 0 or 1
    Bool,
    /// 8: u64 length, then UTF-8 bytes
    String,
    /// 9: element type (u32), count (u64), elements
    Array,
    /// 10
    U64,
    /// 11
    I64,
    /// 12
    F64,
}

impl ValueType {
    /// The type with this id.
    pub fn from_id(id: u32) -> Option<ValueType> {
        Some(match id {
            0 => ValueType::U8,
            1 => ValueType::I8,
            2 => ValueType::U16,
            3 => ValueType::I16,
            4 => ValueType::U32,
            5 => ValueType::I32,
            6 => ValueType::F32,
            7 => ValueType::Bool,
            8 => ValueType::String,
            9 => ValueType::Array,
            10 => ValueType::U64,
            11 => ValueType::I64,
            12 => ValueType::F64,
            _ => return None,
        })
    }

    /// The id GGUF stores.
    pub fn id(self) -> u32 {
        match self {
            ValueType::U8 => 0,
            ValueType::I8 => 1,
            ValueType::U16 => 2,
            ValueType::I16 => 3,
            ValueType::U32 => 4,
            ValueType::I32 => 5,
            ValueType::F32 => 6,
            ValueType::Bool => 7,
            ValueType::String => 8,
            ValueType::Array => 9,
            ValueType::U64 => 10,
            ValueType::I64 => 11,
            ValueType::F64 => 12,
        }
    }

    /// The fewest bytes one value of this type takes (a string: its 8-byte length;
    /// an array: its type and count), used to bound counts read from a file by the
    /// bytes left.
    pub fn min_bytes(self) -> u64 {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 | ValueType::String => 8,
            ValueType::Array => 12,
        }
    }

    /// gguf-py's name for the type (`UINT32`, `STRING`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "UINT8",
            ValueType::I8 => "INT8",
            ValueType::U16 => "UINT16",
            ValueType::I16 => "INT16",
            ValueType::U32 => "UINT32",
            ValueType::I32 => "INT32",
            ValueType::F32 => "FLOAT32",
            ValueType::Bool => "BOOL",
            ValueType::String => "STRING",
            ValueType::Array => "ARRAY",
            ValueType::U64 => "UINT64",
            ValueType::I64 => "INT64",
            ValueType::F64 => "FLOAT64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An array of metadata values, all of one type.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataArray {
    /// UINT8 elements.
    U8(Vec<u8>),
    /// INT8 elements.
    I8(Vec<i8>),
    /// UINT16 elements.
    U16(Vec<u16>),
    /// INT16 elements.
    I16(Vec<i16>),
    /// UINT32 elements.
    U32(Vec<u32>),
    /// INT32 elements.
    I32(Vec<i32>),
    /// FLOAT32 elements.
    F32(Vec<f32>),
    /// BOOL elements.
    Bool(Vec<bool>),
    /// STRING elements.
    String(Vec<String>),
    /// UINT64 elements.
    U64(Vec<u64>),
    /// INT64 elements.
    I64(Vec<i64>),
    /// FLOAT64 elements.
    F64(Vec<f64>),
}

impl MetadataArray {
    /// The elements' type.
    pub fn element_type(&self) -> ValueType {
        match self {
            MetadataArray::U8(_) => ValueType::U8,
            MetadataArray::I8(_) => ValueType::I8,
            MetadataArray::U16(_) => ValueType::U16,
            MetadataArray::I16(_) => ValueType::I16,
            MetadataArray::U32(_) => ValueType::U32,
            MetadataArray::I32(_) => ValueType::I32,
            MetadataArray::F32(_) => ValueType::F32,
            MetadataArray::Bool(_) => ValueType::Bool,
            MetadataArray::String(_) => ValueType::String,
            MetadataArray::U64(_) => ValueType::U64,
            MetadataArray::I64(_) => ValueType::I64,
            MetadataArray::F64(_) => ValueType::F64,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            MetadataArray::U8(v) => v.len(),
            MetadataArray::I8(v) => v.len(),
            MetadataArray::U16(v) => v.len(),
            MetadataArray::I16(v) => v.len(),
            MetadataArray::U32(v) => v.len(),
            MetadataArray::I32(v) => v.len(),
            MetadataArray::F32(v) => v.len(),
            MetadataArray::Bool(v) => v.len(),
            MetadataArray::String(v) => v.len(),
            MetadataArray::U64(v) => v.len(),
            MetadataArray::I64(v) => v.len(),
            MetadataArray::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as integers, when they are integers (or bools, as 0 / 1).
    pub fn to_i128(&self) -> Option<Vec<i128>> {
        Some(match self {
            MetadataArray::U8(v) => v.iter().map(|&x| x.into()).collect(),
            MetadataArray::I8(v) => v.iter().map(|&x| x.into()).collect(),
            MetadataArray::U16(v) => v.iter().map(|&x| x.into()).collect(),
            MetadataArray::I16(v) => v.iter().map(|&x| x.into()).collect(),
            MetadataArray::U32(v) => v.iter().map(|&x| x.into()).collect(),
            MetadataArray::I32(v) => v.iter().map(|&x| x.into()).collect(),
            MetadataArray::U64(v) => v.iter().map(|&x| x.into()).collect(),
            MetadataArray::I64(v) => v.iter().map(|&x| x.into()).collect(),
            MetadataArray::Bool(v) => v.iter().map(|&x| i128::from(x)).collect(),
            _ => return None,
        })
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    /// UINT8
    U8(u8),
    /// INT8
    I8(i8),
    /// UINT16
    U16(u16),
    /// INT16
    I16(i16),
    /// UINT32
    U32(u32),
    /// INT32
    I32(i32),
    /// FLOAT32
    F32(f32),
    /// BOOL
    Bool(bool),
    /// STRING
    String(String),
    /// ARRAY
    Array(MetadataArray),
    /// UINT64
    U64(u64),
    /// INT64
    I64(i64),
    /// FLOAT64
    F64(f64),
}

impl MetadataValue {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            MetadataValue::U8(_) => ValueType::U8,
            MetadataValue::I8(_) => ValueType::I8,
            MetadataValue::U16(_) => ValueType::U16,
            MetadataValue::I16(_) => ValueType::I16,
            MetadataValue::U32(_) => ValueType::U32,
            MetadataValue::I32(_) => ValueType::I32,
            MetadataValue::F32(_) => ValueType::F32,
            MetadataValue::Bool(_) => ValueType::Bool,
            MetadataValue::String(_) => ValueType::String,
            MetadataValue::Array(_) => ValueType::Array,
            MetadataValue::U64(_) => ValueType::U64,
            MetadataValue::I64(_) => ValueType::I64,
            MetadataValue::F64(_) => ValueType::F64,
        }
    }

    /// The value as an integer, when it is one of the integer types.
    pub fn to_i128(&self) -> Option<i128> {
        Some(match *self {
            MetadataValue::U8(x) => x.into(),
            MetadataValue::I8(x) => x.into(),
            MetadataValue::U16(x) => x.into(),
            MetadataValue::I16(x) => x.into(),
            MetadataValue::U32(x) => x.into(),
            MetadataValue::I32(x) => x.into(),
            MetadataValue::U64(x) => x.into(),
            MetadataValue::I64(x) => x.into(),
            _ => return None,
        })
    }

    /// The value as a float, when it is a float or an integer.
    pub fn to_f64(&self) -> Option<f64> {
        match *self {
            MetadataValue::F32(x) => Some(x.into()),
            MetadataValue::F64(x) => Some(x),
            _ => self.to_i128().map(|x| x as f64),
        }
    }

    /// The value as a string slice, when it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array, when it is one.
    pub fn as_array(&self) -> Option<&MetadataArray> {
        match self {
            MetadataValue::Array(a) => Some(a),
            _ => None,
        }
    }
}
