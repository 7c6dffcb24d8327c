//! The ggml weight types of GGUF files (llama.cpp), bit-exact with the llama.cpp that
//! the PyPI package llama-cpp-python 0.3.36 vendors.
//!
//! * [`GgmlType`]: the type ids of `enum ggml_type` (ggml/include/ggml.h) with their
//!   block geometry, declared once in [`GgmlType::block`].
//! * [`mod@decode`]: every supported type to `f32`, value for value what
//!   `dequantize_row_*` (ggml/src/ggml-quants.c) and gguf-py's `quants.py` give.
//! * [`mod@quantize`]: `f32` rows to blocks, byte for byte what `ggml_quantize_chunk`
//!   writes without an importance matrix (the reference quantizers
//!   `quantize_row_*_ref`, and `quantize_iq4_nl` / `quantize_iq4_xs`).
//! * [`mod@mix`]: the type llama-quantize gives each tensor of a `qwen3` / `qwen35`
//!   model for a file type (`llama_tensor_get_type` in src/llama-quant.cpp).
//! * [`GgmlWeight`]: a linear weight stored in one of these types, the
//!   [`crate::QuantizedWeight::Ggml`] variant.
//!
//! Layouts and formulas are in docs/quantization.md (GGUF block formats).

pub mod decode;
mod fp16;
pub mod mix;
pub mod quantize;

use crate::error::{QuantError, Result};
use std::fmt;

pub use decode::{block_element, decode_row, dequantize};
pub use fp16::{fp16_to_f32, fp32_to_fp16};
pub use quantize::{quantize, quantize_row};

/// Elements per K-quant super-block (`QK_K` in ggml-common.h).
pub const QK_K: usize = 256;

/// A ggml tensor type; the discriminant is its id in `enum ggml_type` and in GGUF
/// tensor infos.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
#[allow(non_camel_case_types)] // the names ggml and GGUF tools print
pub enum GgmlType {
    /// IEEE binary32.
    F32 = 0,
    /// IEEE binary16.
    F16 = 1,
    /// 32 elements: f16 scale `d`, 4-bit codes, `x = (q - 8) d`.
    Q4_0 = 2,
    /// 32 elements: f16 scale `d` and min `m`, 4-bit codes, `x = q d + m`.
    Q4_1 = 3,
    /// 32 elements: f16 scale `d`, 5-bit codes, `x = (q - 16) d`.
    Q5_0 = 6,
    /// 32 elements: f16 scale `d` and min `m`, 5-bit codes, `x = q d + m`.
    Q5_1 = 7,
    /// 32 elements: f16 scale `d`, int8 codes, `x = q d`.
    Q8_0 = 8,
    /// 256 elements in 16 groups of 16: 2-bit codes, 4-bit group scales and mins.
    Q2_K = 10,
    /// 256 elements in 16 groups of 16: 3-bit codes, 6-bit signed group scales.
    Q3_K = 11,
    /// 256 elements in 8 groups of 32: 4-bit codes, 6-bit group scales and mins.
    Q4_K = 12,
    /// 256 elements in 8 groups of 32: 5-bit codes, 6-bit group scales and mins.
    Q5_K = 13,
    /// 256 elements in 16 groups of 16: 6-bit codes, int8 group scales.
    Q6_K = 14,
    /// 32 elements: f16 scale, 4-bit indices into the non-linear IQ4 table.
    IQ4_NL = 20,
    /// 256 elements in 8 groups of 32: IQ4 table indices, 6-bit group scales.
    IQ4_XS = 23,
    /// bfloat16.
    BF16 = 30,
    /// 32 elements: E8M0 scale, E2M1 codes (the OCP MX format, ggml's layout).
    MXFP4 = 39,
}

/// Block geometry of a type: elements per block and bytes per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockGeometry {
    /// Elements per block (1 for the float types).
    pub elements: usize,
    /// Bytes per block.
    pub bytes: usize,
}

impl GgmlType {
    /// Every type this module decodes.
    pub const ALL: [GgmlType; 16] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::IQ4_NL,
        Self::IQ4_XS,
        Self::MXFP4,
    ];

    /// Every type [`quantize::quantize`] writes, bit-exact with `ggml_quantize_chunk`.
    pub const QUANTIZABLE: [GgmlType; 15] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::IQ4_NL,
        Self::IQ4_XS,
        Self::Q2_K,
        Self::Q3_K,
    ];

    /// The type with ggml id `id`, if this module knows it.
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| *t as u32 == id)
    }

    /// The ggml id (`enum ggml_type`, GGUF tensor info).
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The name ggml prints (`ggml_type_name`): `q4_K`, `iq4_xs`, `bf16`, ...
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q5_1 => "q5_1",
            Self::Q8_0 => "q8_0",
            Self::Q2_K => "q2_K",
            Self::Q3_K => "q3_K",
            Self::Q4_K => "q4_K",
            Self::Q5_K => "q5_K",
            Self::Q6_K => "q6_K",
            Self::IQ4_NL => "iq4_nl",
            Self::IQ4_XS => "iq4_xs",
            Self::BF16 => "bf16",
            Self::MXFP4 => "mxfp4",
        }
    }

    /// The type named `name` (as [`GgmlType::name`], case-insensitive).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Elements and bytes per block (`blck_size` and `type_size` of ggml's
    /// `type_traits`; the struct sizes of ggml-common.h).
    pub fn block(self) -> BlockGeometry {
        let (elements, bytes) = match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (32, 2 + 16),
            Self::Q4_1 => (32, 4 + 16),
            Self::Q5_0 => (32, 2 + 4 + 16),
            Self::Q5_1 => (32, 4 + 4 + 16),
            Self::Q8_0 => (32, 2 + 32),
            Self::Q2_K => (QK_K, QK_K / 16 + QK_K / 4 + 4),
            Self::Q3_K => (QK_K, QK_K / 8 + QK_K / 4 + 12 + 2),
            Self::Q4_K => (QK_K, 4 + 12 + QK_K / 2),
            Self::Q5_K => (QK_K, 4 + 12 + QK_K / 8 + QK_K / 2),
            Self::Q6_K => (QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2),
            Self::IQ4_NL => (32, 2 + 16),
            Self::IQ4_XS => (QK_K, 2 + 2 + QK_K / 64 + QK_K / 2),
            Self::MXFP4 => (32, 1 + 16),
        };
        BlockGeometry { elements, bytes }
    }

    /// Byte offsets of the f16 scales (`d`, `m`, `dmin`) in a block; empty for the
    /// float types and MXFP4 (whose E8M0 scale is always finite).
    pub fn f16_scale_offsets(self) -> &'static [usize] {
        match self {
            Self::F32 | Self::F16 | Self::BF16 | Self::MXFP4 => &[],
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 | Self::IQ4_NL | Self::IQ4_XS => &[0],
            Self::Q4_1 | Self::Q5_1 | Self::Q4_K | Self::Q5_K => &[0, 2],
            Self::Q2_K => &[80, 82],
            Self::Q3_K => &[108],
            Self::Q6_K => &[208],
        }
    }

    /// Whether the type has blocks (ggml's `ggml_is_quantized`).
    pub fn is_quantized(self) -> bool {
        self.block().elements > 1
    }

    /// Bytes of one row of `in_features` elements (`ggml_row_size`), refusing a row
    /// that is not a whole number of blocks or whose size overflows.
    pub fn row_bytes(self, tensor: &str, in_features: usize) -> Result<usize> {
        let block = self.block();
        if in_features % block.elements != 0 {
            return Err(QuantError::InputDimNotDivisible {
                tensor: tensor.to_string(),
                scheme: self.name(),
                multiple: block.elements,
                in_features,
            });
        }
        (in_features / block.elements)
            .checked_mul(block.bytes)
            .ok_or_else(|| QuantError::GgmlSize {
                tensor: tensor.to_string(),
                ggml_type: self.name(),
                out_features: 1,
                in_features,
            })
    }

    /// Bytes of an `out_features x in_features` matrix, checked as
    /// [`GgmlType::row_bytes`].
    pub fn matrix_bytes(
        self,
        tensor: &str,
        out_features: usize,
        in_features: usize,
    ) -> Result<usize> {
        self.row_bytes(tensor, in_features)?
            .checked_mul(out_features)
            .ok_or_else(|| QuantError::GgmlSize {
                tensor: tensor.to_string(),
                ggml_type: self.name(),
                out_features,
                in_features,
            })
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A linear weight stored in a ggml type, as a GGUF file holds it: `out_features`
/// rows of `in_features` elements, each row a run of blocks
/// ([`GgmlType::row_bytes`] bytes), rows one after another.
#[derive(Clone, Debug, PartialEq)]
pub struct GgmlWeight {
    /// Output features (rows; GGUF `ne[1]`).
    pub out_features: usize,
    /// Input features (elements per row; GGUF `ne[0]`).
    pub in_features: usize,
    /// The stored type.
    pub ggml_type: GgmlType,
    /// The blocks, `out_features * row_bytes` bytes.
    pub data: Vec<u8>,
}

impl GgmlWeight {
    /// Wraps stored blocks, checking that `data` holds exactly
    /// `out_features x in_features` elements of `ggml_type` (`tensor` names the
    /// weight in the error).
    pub fn new(
        tensor: &str,
        ggml_type: GgmlType,
        out_features: usize,
        in_features: usize,
        data: Vec<u8>,
    ) -> Result<Self> {
        let expected = ggml_type.matrix_bytes(tensor, out_features, in_features)?;
        if data.len() != expected {
            return Err(QuantError::GgmlDataLength {
                tensor: tensor.to_string(),
                ggml_type: ggml_type.name(),
                expected,
                actual: data.len(),
            });
        }
        Ok(Self {
            out_features,
            in_features,
            ggml_type,
            data,
        })
    }

    /// Quantizes a row-major `out_features x in_features` matrix as
    /// `ggml_quantize_chunk` does without an importance matrix.
    pub fn quantize(
        tensor: &str,
        ggml_type: GgmlType,
        out_features: usize,
        in_features: usize,
        values: &[f32],
    ) -> Result<Self> {
        let data = quantize::quantize(tensor, ggml_type, out_features, in_features, values)?;
        Ok(Self {
            out_features,
            in_features,
            ggml_type,
            data,
        })
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.data.len().checked_div(self.out_features).unwrap_or(0)
    }

    /// Element `(row, k)`, dequantized ([`block_element`] on its block).
    ///
    /// # Panics
    /// If `(row, k)` is outside the matrix.
    pub fn element(&self, row: usize, k: usize) -> f32 {
        assert!(
            row < self.out_features && k < self.in_features,
            "element out of range"
        );
        let block = self.ggml_type.block();
        let start = row * self.row_bytes() + k / block.elements * block.bytes;
        block_element(
            self.ggml_type,
            &self.data[start..start + block.bytes],
            k % block.elements,
        )
    }

    /// The dequantized matrix, row-major `[out_features * in_features]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.out_features * self.in_features];
        self.dequantize_into(&mut out);
        out
    }

    /// Dequantizes into `out` (`out_features * in_features` values).
    ///
    /// # Panics
    /// If `out` has the wrong length or the weight was built with inconsistent
    /// fields (the constructors check them).
    pub fn dequantize_into(&self, out: &mut [f32]) {
        decode::decode_rows(self.ggml_type, &self.data, self.in_features, out);
    }
}
