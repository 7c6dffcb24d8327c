//! The ggml weight types of GGUF files (llama.cpp), bit-exact with the llama.cpp that
//! the PyPI package llama-cpp-python 0.3.36 vendors.
//!
//! * [`GgmlType`]: the type ids of `enum ggml_type` (ggml/include/ggml.h) with their
//!   block geometry, declared once in loraq-gguf's table and re-exported here;
//!   [`DECODABLE`] and [`QUANTIZABLE`] say which of them this module decodes and
//!   writes.
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

pub use decode::{block_element, decode_row, dequantize};
pub use fp16::{fp16_to_f32, fp32_to_fp16};
pub use quantize::{quantize, quantize_row};

pub use loraq_gguf::{BlockGeometry, GgmlType, QK_K};

/// Every type [`mod@decode`] decodes.
pub const DECODABLE: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

/// Every type [`quantize::quantize`] writes, bit-exact with `ggml_quantize_chunk`.
pub const QUANTIZABLE: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
];

/// Whether [`mod@decode`] decodes `ggml_type`.
pub fn is_decodable(ggml_type: GgmlType) -> bool {
    DECODABLE.contains(&ggml_type)
}

/// Byte offsets of the f16 scales (`d`, `m`, `dmin`) in a block of a decodable
/// type (the struct layouts of ggml-common.h); empty for the float types and MXFP4
/// (whose E8M0 scale is always finite) and for the types loraq does not decode.
pub fn f16_scale_offsets(ggml_type: GgmlType) -> &'static [usize] {
    match ggml_type {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL | GgmlType::IQ4_XS => {
            &[0]
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// Bytes of one row of `in_features` elements (`ggml_row_size`), refusing a row
/// that is not a whole number of blocks or whose size overflows (`tensor` names the
/// weight in the error).
pub fn row_bytes(ggml_type: GgmlType, tensor: &str, in_features: usize) -> Result<usize> {
    let block = ggml_type.block();
    if !in_features.is_multiple_of(block.elements) {
        return Err(QuantError::InputDimNotDivisible {
            tensor: tensor.to_string(),
            scheme: ggml_type.name(),
            multiple: block.elements,
            in_features,
        });
    }
    (in_features / block.elements)
        .checked_mul(block.bytes)
        .ok_or_else(|| QuantError::GgmlSize {
            tensor: tensor.to_string(),
            ggml_type: ggml_type.name(),
            out_features: 1,
            in_features,
        })
}

/// Checks that `len` bytes hold exactly an `out_features x in_features` matrix of a
/// type this module decodes (`tensor` names the weight in the error).
fn check_stored(
    tensor: &str,
    ggml_type: GgmlType,
    out_features: usize,
    in_features: usize,
    len: usize,
) -> Result<()> {
    if !is_decodable(ggml_type) {
        return Err(QuantError::UnsupportedFormat {
            tensor: tensor.to_string(),
            format: ggml_type.name().to_string(),
        });
    }
    let expected = matrix_bytes(ggml_type, tensor, out_features, in_features)?;
    if len != expected {
        return Err(QuantError::GgmlDataLength {
            tensor: tensor.to_string(),
            ggml_type: ggml_type.name(),
            expected,
            actual: len,
        });
    }
    Ok(())
}

/// Bytes of an `out_features x in_features` matrix, checked as [`row_bytes`].
pub fn matrix_bytes(
    ggml_type: GgmlType,
    tensor: &str,
    out_features: usize,
    in_features: usize,
) -> Result<usize> {
    row_bytes(ggml_type, tensor, in_features)?
        .checked_mul(out_features)
        .ok_or_else(|| QuantError::GgmlSize {
            tensor: tensor.to_string(),
            ggml_type: ggml_type.name(),
            out_features,
            in_features,
        })
}

/// A linear weight stored in a ggml type, as a GGUF file holds it: `out_features`
/// rows of `in_features` elements, each row a run of blocks ([`row_bytes`] bytes),
/// rows one after another.
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
        check_stored(tensor, ggml_type, out_features, in_features, data.len())?;
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
