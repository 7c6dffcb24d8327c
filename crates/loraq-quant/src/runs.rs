//! Hot loops over runs of values (the crate's SIMD layer; built on [`crate::element`]
//! and [`mod@crate::format`] only), compiled several times (AVX-512, AVX2, baseline)
//! and picked at run time, so the branch-free encoders vectorize on the machine at
//! hand while the crate still builds for the baseline target. Every version runs the
//! same scalar code, so results are bit-identical whichever is picked.

use crate::element::{E2M1_TABLE, E4M3_TABLE, E8M0_TABLE, e2m1_encode, e4m3_encode};
use crate::format::{
    MXFP4_BLOCK, NVFP4_BLOCK, Nvfp4GlobalScale, fp8_scale, mxfp4_scale_code, nvfp4_block_scale_code,
};
use crate::multiversion::multiversion;

/// Values per parallel work item of the NVFP4 runs (whole blocks, so a run never
/// splits a block; rows do not matter since blocks never cross rows).
pub(crate) const NVFP4_RUN: usize = NVFP4_BLOCK * 256;
/// Values per parallel work item of the MXFP4 runs.
pub(crate) const MXFP4_RUN: usize = MXFP4_BLOCK * 128;

multiversion! {
    /// Largest `|x|` as bits: for non-negative floats the integer order is the float
    /// order, and NaN / Inf compare above every finite value, so one integer max both
    /// finds the maximum and flags non-finite input.
    pub fn abs_max_bits(values: &[f32]) -> u32 {
        // A plain fold: LLVM turns this integer max reduction into vector maxes.
        values
            .iter()
            .fold(0u32, |max, x| max.max(x.to_bits() & 0x7FFF_FFFF))
    }
}

multiversion! {
    /// `codes[i] = e4m3(values[i] / scale)`.
    pub fn encode_fp8_run(values: &[f32], scale: f32, codes: &mut [u8]) {
        for (c, &x) in codes.iter_mut().zip(values) {
            *c = e4m3_encode(x / scale);
        }
    }
}

/// The f32 value of the little-endian bf16 `b` (exact).
#[inline(always)]
fn bf16_value(b: &[u8]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
}

/// Largest `|x|` of little-endian bf16 values as the bits of the f32 it converts to
/// (see [`bf16_abs_max_bits`]), inlined into the kernels that call it.
#[inline(always)]
fn bf16_block_abs_max_bits(bytes: &[u8]) -> u32 {
    let max = bytes.chunks_exact(2).fold(0u16, |max, b| {
        max.max(u16::from_le_bytes([b[0], b[1]]) & 0x7FFF)
    });
    u32::from(max) << 16
}

multiversion! {
    /// FP8 codes and scales of one band of rows of little-endian bf16 values (`band`:
    /// whole rows of `in_features` values) whose columns fall into blocks of `block`
    /// (the last one may be shorter), one scale per block over all the band's rows:
    /// `scales[j] = a_j / 448` of the block's largest magnitude `a_j` (1 if zero),
    /// `codes[i] = e4m3(x_i / scale)`. Reads the bf16 values in place (no f32 copy of
    /// the band): the same codes and scales as the f32 path on the converted values,
    /// bit for bit. Returns the band's largest magnitude as bits; at or above
    /// `0x7F80_0000` the band holds a NaN or an infinity, and the codes mean nothing.
    pub fn fp8_bf16_band(band: &[u8], in_features: usize, block: usize, scales: &mut [f32], codes: &mut [u8]) -> u32 {
        let mut max_bits = vec![0u32; scales.len()];
        for row in band.chunks_exact(2 * in_features) {
            for (m, run) in max_bits.iter_mut().zip(row.chunks(2 * block)) {
                *m = (*m).max(bf16_block_abs_max_bits(run));
            }
        }
        for (s, &m) in scales.iter_mut().zip(&max_bits) {
            *s = fp8_scale(f32::from_bits(m));
        }
        for (code_row, row) in codes.chunks_exact_mut(in_features).zip(band.chunks_exact(2 * in_features)) {
            for ((code_run, run), &scale) in code_row.chunks_mut(block).zip(row.chunks(2 * block)).zip(scales.iter()) {
                for (c, b) in code_run.iter_mut().zip(run.chunks_exact(2)) {
                    *c = e4m3_encode(bf16_value(b) / scale);
                }
            }
        }
        max_bits.into_iter().max().unwrap_or(0)
    }
}

multiversion! {
    /// `out[i] = e4m3_value(codes[i]) * scale`.
    pub fn decode_fp8_run(codes: &[u8], scale: f32, out: &mut [f32]) {
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = E4M3_TABLE[c as usize] * scale;
        }
    }
}

multiversion! {
    /// `out[i] = e4m3_value(e4m3(values[i] / scale)) * scale`: FP8 fake-quant of a run.
    pub fn fake_quant_fp8_run(values: &[f32], scale: f32, out: &mut [f32]) {
        for (o, &x) in out.iter_mut().zip(values) {
            *o = E4M3_TABLE[e4m3_encode(x / scale) as usize] * scale;
        }
    }
}

/// Largest `|x|` bits of a short block, inlined into the kernels that call it.
#[inline(always)]
fn block_abs_max_bits(values: &[f32]) -> u32 {
    values
        .iter()
        .fold(0u32, |max, x| max.max(x.to_bits() & 0x7FFF_FFFF))
}

/// Packs 2 codes per byte, even element in the low nibble.
#[inline(always)]
fn pack_pairs(codes: &[u8], packed: &mut [u8]) {
    for (byte, pair) in packed.iter_mut().zip(codes.chunks_exact(2)) {
        *byte = pair[0] | (pair[1] << 4);
    }
}

multiversion! {
    /// NVFP4-quantizes whole 16-blocks under global scale `global` (dequantization
    /// direction): per block of largest magnitude $a_b$,
    /// $s_b = \mathrm{e4m3}(\mathrm{clamp}(a_b / (6 g), 2^{-9}, 448))$ (1 for an all-zero block)
    /// and $q = \mathrm{e2m1}(x / (\mathrm{f32}(s_b) g))$, packed two per byte.
    pub fn nvfp4_quantize_run(values: &[f32], global: f32, packed: &mut [u8], scale_codes: &mut [u8]) {
        for ((block, p), s) in values
            .chunks_exact(NVFP4_BLOCK)
            .zip(packed.chunks_exact_mut(NVFP4_BLOCK / 2))
            .zip(scale_codes.iter_mut())
        {
            *s = nvfp4_block_scale_code(f32::from_bits(block_abs_max_bits(block)), global);
            let divisor = E4M3_TABLE[*s as usize] * global;
            let mut codes = [0u8; NVFP4_BLOCK];
            for (c, &x) in codes.iter_mut().zip(block) {
                // `+ 0.0` turns -0.0 into +0.0 (nothing else changes): ModelOpt
                // encodes an exact -0.0 as code 0.
                *c = e2m1_encode(x / divisor + 0.0);
            }
            pack_pairs(&codes, p);
        }
    }
}

multiversion! {
    /// NVFP4 fake-quant of whole 16-blocks: `x <- e2m1 * (f32(s_b) * g)`.
    pub fn nvfp4_fake_quant_run(values: &[f32], global: f32, out: &mut [f32]) {
        for (block, o) in values.chunks_exact(NVFP4_BLOCK).zip(out.chunks_exact_mut(NVFP4_BLOCK)) {
            let code = nvfp4_block_scale_code(f32::from_bits(block_abs_max_bits(block)), global);
            let block_scale = E4M3_TABLE[code as usize];
            let divisor = block_scale * global;
            for (y, &x) in o.iter_mut().zip(block) {
                // ModelOpt reads code 8 (-0) as +0: `+ 0.0` (see Nvfp4GlobalScale).
                *y = E2M1_TABLE[(e2m1_encode(x / divisor + 0.0) & 0xF) as usize] * divisor + 0.0;
            }
        }
    }
}

multiversion! {
    /// NVFP4 dequantization of whole 16-blocks (see `Nvfp4GlobalScale::dequantize`).
    pub fn nvfp4_dequantize_run(packed: &[u8], scale_codes: &[u8], global: Nvfp4GlobalScale, out: &mut [f32]) {
        for ((o, p), &s) in out
            .chunks_exact_mut(NVFP4_BLOCK)
            .zip(packed.chunks_exact(NVFP4_BLOCK / 2))
            .zip(scale_codes)
        {
            let block_scale = E4M3_TABLE[s as usize];
            for (pair, &byte) in o.chunks_exact_mut(2).zip(p) {
                pair[0] = global.dequantize(E2M1_TABLE[(byte & 0xF) as usize], block_scale);
                pair[1] = global.dequantize(E2M1_TABLE[(byte >> 4) as usize], block_scale);
            }
        }
    }
}

multiversion! {
    /// MXFP4-quantizes whole 32-blocks: per block the E8M0 scale
    /// `2^(floor(log2 amax) - 2)` and `q = e2m1(x / s)`, packed two per byte.
    pub fn mxfp4_quantize_run(values: &[f32], packed: &mut [u8], scale_codes: &mut [u8]) {
        for ((block, p), s) in values
            .chunks_exact(MXFP4_BLOCK)
            .zip(packed.chunks_exact_mut(MXFP4_BLOCK / 2))
            .zip(scale_codes.iter_mut())
        {
            *s = mxfp4_scale_code(f32::from_bits(block_abs_max_bits(block)));
            let scale = E8M0_TABLE[*s as usize];
            let mut codes = [0u8; MXFP4_BLOCK];
            for (c, &x) in codes.iter_mut().zip(block) {
                *c = e2m1_encode(x / scale);
            }
            pack_pairs(&codes, p);
        }
    }
}

multiversion! {
    /// MXFP4 dequantization of whole 32-blocks: `e2m1 * e8m0` (exact).
    pub fn mxfp4_dequantize_run(packed: &[u8], scale_codes: &[u8], out: &mut [f32]) {
        for ((o, p), &s) in out
            .chunks_exact_mut(MXFP4_BLOCK)
            .zip(packed.chunks_exact(MXFP4_BLOCK / 2))
            .zip(scale_codes)
        {
            let scale = E8M0_TABLE[s as usize];
            for (pair, &byte) in o.chunks_exact_mut(2).zip(p) {
                pair[0] = E2M1_TABLE[(byte & 0xF) as usize] * scale;
                pair[1] = E2M1_TABLE[(byte >> 4) as usize] * scale;
            }
        }
    }
}

multiversion! {
    /// INT4 codes of one group: `clamp(round_half_even(x / s) + z, 0, 15)`.
    pub fn int4_encode_run(values: &[f32], scale: f32, zero: u8, codes: &mut [u8]) {
        let zero = f32::from(zero);
        for (c, &x) in codes.iter_mut().zip(values) {
            *c = ((x / scale).round_ties_even() + zero).clamp(0.0, 15.0) as u8;
        }
    }
}

multiversion! {
    /// INT4 dequantization of one group: `(q - z) * s`.
    pub fn int4_decode_run(codes: &[u8], scale: f32, zero: u8, out: &mut [f32]) {
        for (o, &q) in out.iter_mut().zip(codes) {
            *o = (i32::from(q) - i32::from(zero)) as f32 * scale;
        }
    }
}

multiversion! {
    /// Largest `|x|` of little-endian bf16 values, as the bits of the f32 it converts
    /// to: the bf16 bits shifted into place, so the same integer order and the same
    /// non-finite flag as [`abs_max_bits`] on the converted values.
    pub fn bf16_abs_max_bits(bytes: &[u8]) -> u32 {
        bf16_block_abs_max_bits(bytes)
    }
}

multiversion! {
    /// `out[i]` = the little-endian bf16 value `i` of `bytes` as f32 (exact).
    pub fn bf16_to_f32_run(bytes: &[u8], out: &mut [f32]) {
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = bf16_value(b);
        }
    }
}
