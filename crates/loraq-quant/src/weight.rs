//! Weight containers in their stored formats: codes, scales and global scale
//! exactly as a checkpoint (or [`crate::scheme`]) holds them, with their exact
//! dequantization to `f32` (docs/quantization.md).
//!
//! The fields are public and unchecked; whoever runs a weight (the kernels) checks
//! lengths and codes first.

use crate::error::{QuantError, Result};
use crate::format::{
    FP8_BLOCK, Fp8Granularity, INT4_GROUP, MXFP4_BLOCK, NVFP4_BLOCK, Nvfp4GlobalScale,
    WeightFormat, blocks, fp8_scale_shape,
};
use crate::ggml::GgmlWeight;
use crate::runs::{self, MXFP4_RUN, NVFP4_RUN};
use half::bf16;
use rayon::prelude::*;

/// A linear weight in its stored format: the one type every crate passes a weight
/// around as, whether quantized here, read from a checkpoint
/// ([`crate::QuantizedBase::quantized_weight`]) or run by the kernels.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantizedWeight {
    /// Unquantized bf16.
    Bf16(Bf16Weight),
    /// FP8 E4M3, per tensor, channel or 128x128 tile.
    Fp8(Fp8Weight),
    /// NVFP4 (ModelOpt and compressed-tensors: the global scale keeps its direction).
    Nvfp4(Nvfp4Weight),
    /// MXFP4.
    Mxfp4(Mxfp4Weight),
    /// INT4, group 128.
    Int4(Int4Weight),
    /// A ggml type of a GGUF file, in ggml's block layout.
    Ggml(GgmlWeight),
}

impl QuantizedWeight {
    /// The stored format.
    pub fn format(&self) -> WeightFormat {
        match self {
            Self::Bf16(_) => WeightFormat::Bf16,
            Self::Fp8(w) => WeightFormat::Fp8(w.granularity),
            Self::Nvfp4(_) => WeightFormat::Nvfp4,
            Self::Mxfp4(_) => WeightFormat::Mxfp4,
            Self::Int4(_) => WeightFormat::Int4G128,
            Self::Ggml(w) => WeightFormat::Ggml(w.ggml_type),
        }
    }

    /// The dequantized matrix, `[out_features * in_features]`.
    pub fn dequantize(&self) -> Vec<f32> {
        match self {
            Self::Bf16(w) => w.data.iter().map(|v| v.to_f32()).collect(),
            Self::Fp8(w) => w.dequantize(),
            Self::Nvfp4(w) => w.dequantize(),
            Self::Mxfp4(w) => w.dequantize(),
            Self::Int4(w) => w.dequantize(),
            Self::Ggml(w) => w.dequantize(),
        }
    }

    /// `(out_features, in_features)` = (output features, input features) of the matrix.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Self::Bf16(w) => (w.out_features, w.in_features),
            Self::Fp8(w) => (w.out_features, w.in_features),
            Self::Nvfp4(w) => (w.out_features, w.in_features),
            Self::Mxfp4(w) => (w.out_features, w.in_features),
            Self::Int4(w) => (w.out_features, w.in_features),
            Self::Ggml(w) => (w.out_features, w.in_features),
        }
    }

    /// Bytes of codes and scales as stored (what one pass over the weight reads).
    pub fn stored_bytes(&self) -> usize {
        match self {
            Self::Bf16(w) => w.data.len() * 2,
            Self::Fp8(w) => w.codes.len() + w.scales.len() * 4,
            Self::Nvfp4(w) => w.packed.len() + w.block_scales.len() + 4,
            Self::Mxfp4(w) => w.packed.len() + w.scales.len(),
            Self::Int4(w) => w.packed.len() + w.scales.len() * 4 + w.zeros.len(),
            Self::Ggml(w) => w.data.len(),
        }
    }
}

/// An unquantized bf16 weight, row-major `[out_features, in_features]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Bf16Weight {
    /// Output features.
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
    /// `out_features * in_features` values.
    pub data: Vec<bf16>,
}

impl Bf16Weight {
    /// Wraps row-major bf16 values `[out_features, in_features]`.
    pub fn new(out_features: usize, in_features: usize, data: Vec<bf16>) -> Self {
        Self {
            out_features,
            in_features,
            data,
        }
    }
}

/// An FP8 E4M3 weight: `w[r, c] = e4m3(codes[r, c]) * scale(r, c)` with the scale in
/// the dequantization direction (what checkpoints call `weight_scale_inv` /
/// `weight_scale`).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Weight {
    /// Output features.
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
    /// Which scale applies where.
    pub granularity: Fp8Granularity,
    /// E4M3 codes, row-major `[out_features, in_features]`.
    pub codes: Vec<u8>,
    /// Scales, row-major in [`Fp8Weight::scale_shape`].
    pub scales: Vec<f32>,
}

impl Fp8Weight {
    /// Wraps E4M3 codes `[out_features, in_features]` and 128x128 tile multipliers
    /// `[ceil(out_features / 128), ceil(in_features / 128)]` (the Qwen / DeepSeek `weight` +
    /// `weight_scale_inv` layout).
    pub fn block128(
        out_features: usize,
        in_features: usize,
        codes: Vec<u8>,
        scales: Vec<f32>,
    ) -> Self {
        Self {
            out_features,
            in_features,
            granularity: Fp8Granularity::Block128,
            codes,
            scales,
        }
    }

    /// Shape of the scale tensor: `[1]`-like `[1, 1]`, `[out_features, 1]` or
    /// `[ceil(out_features/128), ceil(in_features/128)]`.
    pub fn scale_shape(&self) -> [usize; 2] {
        fp8_scale_shape(self.granularity, self.out_features, self.in_features)
    }

    /// The dequantized matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.codes.len()];
        self.dequantize_into(&mut out);
        out
    }

    /// Dequantizes into `out` (`out_features * in_features` values).
    ///
    /// # Panics
    /// If `out` has the wrong length.
    pub fn dequantize_into(&self, out: &mut [f32]) {
        dequantize_fp8_into(
            &self.codes,
            &self.scales,
            self.granularity,
            self.in_features,
            out,
        );
    }
}

/// Dequantizes FP8 E4M3 codes stored anywhere (e.g. zero-copy from a checkpoint):
/// `out[r, c] = e4m3(codes[r, c]) * scale(r, c)`, with `scales` in the
/// dequantization direction, laid out as [`fp8_scale_shape`] says for `granularity`.
///
/// This is the decode of the fp8-block128 checkpoint layout (`weight` +
/// `weight_scale_inv`, despite the name a multiplier) and of per-tensor / per-channel
/// `weight_scale`.
///
/// # Panics
/// If `codes` and `out` differ in length, `in_features` does not divide it, or `scales` is
/// shorter than the granularity needs.
pub fn dequantize_fp8_into(
    codes: &[u8],
    scales: &[f32],
    granularity: Fp8Granularity,
    in_features: usize,
    out: &mut [f32],
) {
    assert_eq!(
        out.len(),
        codes.len(),
        "dequantize_fp8_into: length mismatch"
    );
    if in_features == 0 || codes.is_empty() {
        return;
    }
    assert_eq!(
        codes.len() % in_features,
        0,
        "dequantize_fp8_into: ragged rows"
    );
    let out_features = codes.len() / in_features;
    let [scale_rows, scale_cols] = fp8_scale_shape(granularity, out_features, in_features);
    assert!(
        scales.len() >= scale_rows * scale_cols,
        "dequantize_fp8_into: too few scales"
    );
    out.par_chunks_mut(in_features)
        .zip(codes.par_chunks(in_features))
        .enumerate()
        .for_each(|(row, (out_row, code_row))| {
            for (block, (out_block, code_block)) in out_row
                .chunks_mut(FP8_BLOCK)
                .zip(code_row.chunks(FP8_BLOCK))
                .enumerate()
            {
                let scale = match granularity {
                    Fp8Granularity::Tensor => scales[0],
                    Fp8Granularity::Channel => scales[row],
                    Fp8Granularity::Block128 => scales[(row / FP8_BLOCK) * scale_cols + block],
                };
                runs::decode_fp8_run(code_block, scale, out_block);
            }
        });
}

/// An NVFP4 weight: `w[r, c] = e2m1(q[r, c]) * e4m3(block_scales[r, c / 16])`
/// combined with the global scale (see [`Nvfp4GlobalScale::dequantize`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Weight {
    /// Output features.
    pub out_features: usize,
    /// Input features (a multiple of 16).
    pub in_features: usize,
    /// E2M1 codes, two per byte, even element in the low nibble, `[out_features, in_features / 2]`.
    pub packed: Vec<u8>,
    /// E4M3 block-scale codes, `[out_features, in_features / 16]`.
    pub block_scales: Vec<u8>,
    /// Per-tensor scale.
    pub global_scale: Nvfp4GlobalScale,
}

impl Nvfp4Weight {
    /// Wraps packed E2M1 codes `[out_features, in_features / 2]`, E4M3 block scales
    /// `[out_features, in_features / 16]` and the global scale.
    pub fn new(
        out_features: usize,
        in_features: usize,
        packed: Vec<u8>,
        block_scales: Vec<u8>,
        global_scale: Nvfp4GlobalScale,
    ) -> Self {
        Self {
            out_features,
            in_features,
            packed,
            block_scales,
            global_scale,
        }
    }

    /// The dequantized matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.packed.len() * 2];
        self.dequantize_into(&mut out);
        out
    }

    /// Dequantizes into `out` (`out_features * in_features` values).
    ///
    /// # Panics
    /// If `out` has the wrong length.
    pub fn dequantize_into(&self, out: &mut [f32]) {
        dequantize_nvfp4_into(&self.packed, &self.block_scales, self.global_scale, out);
    }
}

/// Dequantizes NVFP4 stored anywhere (e.g. zero-copy from a checkpoint):
/// `packed` holds two E2M1 codes per byte (even element in the low nibble),
/// `block_scales` one E4M3 code per 16 elements, row-major; each value is computed
/// by [`Nvfp4GlobalScale::dequantize`] (ModelOpt `weight_scale_2` multiplies,
/// compressed-tensors `weight_global_scale` divides).
///
/// # Panics
/// If `out.len() != 2 * packed.len()` or `block_scales.len() * 16 != out.len()`.
pub fn dequantize_nvfp4_into(
    packed: &[u8],
    block_scales: &[u8],
    global: Nvfp4GlobalScale,
    out: &mut [f32],
) {
    assert_eq!(
        out.len(),
        packed.len() * 2,
        "dequantize_nvfp4_into: length mismatch"
    );
    assert_eq!(
        block_scales.len() * NVFP4_BLOCK,
        out.len(),
        "dequantize_nvfp4_into: block scale count"
    );
    out.par_chunks_mut(NVFP4_RUN)
        .zip(packed.par_chunks(NVFP4_RUN / 2))
        .zip(block_scales.par_chunks(NVFP4_RUN / NVFP4_BLOCK))
        .for_each(|((o, p), s)| runs::nvfp4_dequantize_run(p, s, global, o));
}

/// An MXFP4 weight: `w[r, c] = e2m1(q[r, c]) * e8m0(scales[r, c / 32])`.
#[derive(Clone, Debug, PartialEq)]
pub struct Mxfp4Weight {
    /// Output features.
    pub out_features: usize,
    /// Input features (a multiple of 32).
    pub in_features: usize,
    /// E2M1 codes, two per byte, even element in the low nibble, `[out_features, in_features / 2]`.
    pub packed: Vec<u8>,
    /// E8M0 scale codes, `[out_features, in_features / 32]`.
    pub scales: Vec<u8>,
}

impl Mxfp4Weight {
    /// Wraps packed E2M1 codes `[out_features, in_features / 2]` and E8M0 scales `[out_features, in_features / 32]`.
    pub fn new(out_features: usize, in_features: usize, packed: Vec<u8>, scales: Vec<u8>) -> Self {
        Self {
            out_features,
            in_features,
            packed,
            scales,
        }
    }

    /// The dequantized matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.packed.len() * 2];
        out.par_chunks_mut(MXFP4_RUN)
            .zip(self.packed.par_chunks(MXFP4_RUN / 2))
            .zip(self.scales.par_chunks(MXFP4_RUN / MXFP4_BLOCK))
            .for_each(|((o, p), s)| runs::mxfp4_dequantize_run(p, s, o));
        out
    }
}

/// A 4-bit integer weight, group 128 along the input dimension:
/// `w[r, c] = (q[r, c] - zero[r, g]) * scale[r, g]` with `g = c / 128`. Codes are
/// packed two per byte, the even element in the low nibble, each row padded to whole
/// bytes (`ceil(in_features / 2)` bytes per row), as the kernels stream them.
#[derive(Clone, Debug, PartialEq)]
pub struct Int4Weight {
    /// Output features.
    pub out_features: usize,
    /// Input features (the last group may be partial).
    pub in_features: usize,
    /// Whether the zero point is fixed at 8 (symmetric).
    pub symmetric: bool,
    /// Packed codes `0..=15`, `[out_features, ceil(in_features / 2)]`.
    pub packed: Vec<u8>,
    /// Scales, `[out_features, ceil(in_features / 128)]`.
    pub scales: Vec<f32>,
    /// Zero points `0..=15`, `[out_features, ceil(in_features / 128)]`.
    pub zeros: Vec<u8>,
}

/// Packs INT4 codes (one per byte, `[out_features, in_features]`) two per byte, each row padded to
/// whole bytes.
pub(crate) fn pack_int4_rows(out_features: usize, in_features: usize, codes: &[u8]) -> Vec<u8> {
    let row_bytes = in_features.div_ceil(2);
    let mut packed = vec![0u8; out_features * row_bytes];
    if in_features > 0 {
        for (dst, src) in packed.chunks_mut(row_bytes).zip(codes.chunks(in_features)) {
            pack_int4_row(src, dst);
        }
    }
    packed
}

/// Packs one row of INT4 codes (one per byte) two per byte, even element low.
fn pack_int4_row(codes: &[u8], packed: &mut [u8]) {
    for (byte, pair) in packed.iter_mut().zip(codes.chunks(2)) {
        *byte = (pair[0] & 0xF) | (pair.get(1).map_or(0, |hi| hi & 0xF) << 4);
    }
}

fn unpack_int4_row(packed: &[u8], codes: &mut [u8]) {
    for (pair, &byte) in codes.chunks_mut(2).zip(packed) {
        pair[0] = byte & 0xF;
        if let Some(hi) = pair.get_mut(1) {
            *hi = byte >> 4;
        }
    }
}

impl Int4Weight {
    /// Wraps packed codes `[out_features, ceil(in_features / 2)]` (even element in the low nibble),
    /// scales and zero points `[out_features, ceil(in_features / 128)]`; symmetric when every zero
    /// point is 8.
    pub fn from_packed(
        out_features: usize,
        in_features: usize,
        packed: Vec<u8>,
        scales: Vec<f32>,
        zeros: Vec<u8>,
    ) -> Self {
        Self {
            out_features,
            in_features,
            symmetric: zeros.iter().all(|&z| z == 8),
            packed,
            scales,
            zeros,
        }
    }

    /// Packs codes stored one per byte (`[out_features, in_features]`) and takes the group scales
    /// and zero points (`[out_features, ceil(in_features / 128)]`); symmetric when every zero point
    /// is 8. Refuses a code above 15 (the lengths are checked by whoever runs it).
    pub fn from_codes(
        out_features: usize,
        in_features: usize,
        codes: &[u8],
        scales: Vec<f32>,
        zeros: Vec<u8>,
    ) -> Result<Self> {
        if out_features.checked_mul(in_features) != Some(codes.len()) {
            return Err(QuantError::ShapeMismatch {
                tensor: "int4-g128 codes".to_string(),
                out_features,
                in_features,
                len: codes.len(),
            });
        }
        if let Some(index) = codes.iter().position(|&c| c > 15) {
            return Err(QuantError::InvalidCode {
                tensor: "int4-g128 codes".to_string(),
                index,
                code: codes[index],
            });
        }
        let packed = pack_int4_rows(out_features, in_features, codes);
        Ok(Self {
            out_features,
            in_features,
            symmetric: zeros.iter().all(|&z| z == 8),
            packed,
            scales,
            zeros,
        })
    }

    /// The codes one per byte, `[out_features, in_features]`.
    pub fn codes(&self) -> Vec<u8> {
        let mut codes = vec![0u8; self.out_features * self.in_features];
        if self.in_features > 0 {
            for (dst, src) in codes
                .chunks_mut(self.in_features)
                .zip(self.packed.chunks(self.in_features.div_ceil(2)))
            {
                unpack_int4_row(src, dst);
            }
        }
        codes
    }

    /// Groups per row.
    pub fn groups(&self) -> usize {
        blocks(self.in_features, INT4_GROUP)
    }

    /// The dequantized matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.out_features * self.in_features];
        if self.in_features == 0 {
            return out;
        }
        let groups = self.groups();
        out.par_chunks_mut(self.in_features)
            .zip(self.packed.par_chunks(self.in_features.div_ceil(2)))
            .zip(
                self.scales
                    .par_chunks(groups)
                    .zip(self.zeros.par_chunks(groups)),
            )
            .for_each(|((out_row, packed_row), (scale_row, zero_row))| {
                let mut code_row = vec![0u8; out_row.len()];
                unpack_int4_row(packed_row, &mut code_row);
                for (((o, c), &s), &z) in out_row
                    .chunks_mut(INT4_GROUP)
                    .zip(code_row.chunks(INT4_GROUP))
                    .zip(scale_row)
                    .zip(zero_row)
                {
                    runs::int4_decode_run(c, s, z, o);
                }
            });
        out
    }
}
