//! Decode of the ggml types to `f32`, value for value what `dequantize_row_*` in
//! ggml/src/ggml-quants.c computes (each product in the same order, in `f32`).

use super::fp16::{bf16_to_f32, fp16_to_f32};
use super::{GgmlType, QK_K, check_stored};
use crate::error::{QuantError, Result};
use rayon::prelude::*;

/// The non-linear 4-bit values of IQ4_NL and IQ4_XS (`kvalues_iq4nl`,
/// ggml-common.h).
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Twice the E2M1 values, as ggml's MXFP4 blocks index them (`kvalues_mxfp4`,
/// ggml-common.h); the block scale is halved to match
/// ([`mxfp4_half_scale`]).
pub const MXFP4_DOUBLED_VALUES: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `ggml_e8m0_to_fp32_half`: half the E8M0 scale, `2^(e - 128)` (subnormal for
/// `e < 2`).
pub fn mxfp4_half_scale(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

fn f16_at(bytes: &[u8], offset: usize) -> f32 {
    fp16_to_f32(u16::from_le_bytes([bytes[offset], bytes[offset + 1]]))
}

/// The 6-bit scale and min of group `j` of a Q4_K / Q5_K super-block
/// (`get_scale_min_k4`), from the 12 packed scale bytes `q`.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Decodes one run of whole blocks of `ggml_type` (`bytes`) into `out`.
///
/// # Panics
/// If `bytes` is not a whole number of blocks, `out` does not hold exactly their
/// elements, or the type is not one [`super::DECODABLE`] lists.
pub fn decode_row(ggml_type: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let block = ggml_type.block();
    assert_eq!(bytes.len() % block.bytes, 0, "decode_row: partial block");
    assert_eq!(
        bytes.len() / block.bytes * block.elements,
        out.len(),
        "decode_row: length mismatch"
    );
    for (b, y) in bytes
        .chunks_exact(block.bytes)
        .zip(out.chunks_exact_mut(block.elements))
    {
        match ggml_type {
            GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            GgmlType::F16 => y[0] = f16_at(b, 0),
            GgmlType::BF16 => y[0] = bf16_to_f32(u16::from_le_bytes([b[0], b[1]])),
            GgmlType::Q4_0 => decode_q4_0(b, y),
            GgmlType::Q4_1 => decode_q4_1(b, y),
            GgmlType::Q5_0 => decode_q5_0(b, y),
            GgmlType::Q5_1 => decode_q5_1(b, y),
            GgmlType::Q8_0 => decode_q8_0(b, y),
            GgmlType::Q2_K => decode_q2_k(b, y),
            GgmlType::Q3_K => decode_q3_k(b, y),
            GgmlType::Q4_K => decode_q4_k(b, y),
            GgmlType::Q5_K => decode_q5_k(b, y),
            GgmlType::Q6_K => decode_q6_k(b, y),
            GgmlType::IQ4_NL => decode_iq4_nl(b, y),
            GgmlType::IQ4_XS => decode_iq4_xs(b, y),
            GgmlType::MXFP4 => decode_mxfp4(b, y),
            other => panic!("decode_row: no decoder for {other}"),
        }
    }
}

/// Decodes rows of `in_features` elements (`data`, rows one after another) into
/// `out`, rows in parallel.
///
/// # Panics
/// As [`decode_row`], and if `in_features` is not a whole number of blocks.
pub fn decode_rows(ggml_type: GgmlType, data: &[u8], in_features: usize, out: &mut [f32]) {
    if in_features == 0 || out.is_empty() {
        return;
    }
    let block = ggml_type.block();
    assert_eq!(
        in_features % block.elements,
        0,
        "decode_rows: partial block"
    );
    let row_bytes = in_features / block.elements * block.bytes;
    assert!(
        out.len().is_multiple_of(in_features) && data.len() == out.len() / in_features * row_bytes,
        "decode_rows: length mismatch"
    );
    out.par_chunks_mut(in_features)
        .zip(data.par_chunks(row_bytes))
        .for_each(|(y, b)| decode_row(ggml_type, b, y));
}

/// The `out_features x in_features` matrix stored in `data` as `ggml_type`,
/// row-major; refuses a row that is not a whole number of blocks and data of the
/// wrong length (`tensor` names the weight in the error).
pub fn dequantize(
    tensor: &str,
    ggml_type: GgmlType,
    out_features: usize,
    in_features: usize,
    data: &[u8],
) -> Result<Vec<f32>> {
    check_stored(tensor, ggml_type, out_features, in_features, data.len())?;
    let len = out_features
        .checked_mul(in_features)
        .ok_or_else(|| QuantError::GgmlSize {
            tensor: tensor.to_string(),
            ggml_type: ggml_type.name(),
            out_features,
            in_features,
        })?;
    let mut out = vec![0.0f32; len];
    decode_rows(ggml_type, data, in_features, &mut out);
    Ok(out)
}

fn decode_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        let x0 = i32::from(qs[j] & 0x0F) - 8;
        let x1 = i32::from(qs[j] >> 4) - 8;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

fn decode_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = f32::from(qs[j] & 0x0F) * d + m;
        y[j + 16] = f32::from(qs[j] >> 4) * d + m;
    }
}

fn q5_high_bits(qh: &[u8]) -> u32 {
    u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]])
}

fn decode_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = q5_high_bits(&b[2..6]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh_0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh_1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = i32::from((qs[j] & 0x0F) | xh_0) - 16;
        let x1 = i32::from((qs[j] >> 4) | xh_1) - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

fn decode_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = q5_high_bits(&b[4..8]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh_0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh_1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = f32::from((qs[j] & 0x0F) | xh_0) * d + m;
        y[j + 16] = f32::from((qs[j] >> 4) | xh_1) * d + m;
    }
}

fn decode_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[2..34]) {
        *v = f32::from(q as i8) * d;
    }
}

// block_q2_K: scales[16], qs[64], d, dmin.
fn decode_q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let d = f16_at(b, 80);
    let min = f16_at(b, 82);
    let mut out = 0;
    let mut is = 0;
    for n in 0..2 {
        let q = &b[16 + 32 * n..16 + 32 * n + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * f32::from(sc & 0xF);
                let ml = min * f32::from(sc >> 4);
                for l in 0..16 {
                    y[out] = dl * f32::from((q[l + 16 * half] >> shift) & 3) - ml;
                    out += 1;
                }
            }
        }
    }
}

/// The 16 signed 6-bit group scales of a Q3_K super-block, unpacked from its 12
/// bytes as `dequantize_row_q3_K` does (before the `- 32`).
pub(crate) fn q3_k_scales(packed: &[u8]) -> [u8; 16] {
    let mut scales = [0u8; 16];
    for (j, s) in scales.iter_mut().enumerate() {
        let low = if j < 8 {
            packed[j] & 0xF
        } else {
            packed[j - 8] >> 4
        };
        let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        *s = low | (high << 4);
    }
    scales
}

// block_q3_K: hmask[32], qs[64], scales[12], d.
fn decode_q3_k(b: &[u8], y: &mut [f32]) {
    let hm = &b[0..32];
    let scales = q3_k_scales(&b[96..108]);
    let d_all = f16_at(b, 108);
    let mut out = 0;
    let mut is = 0;
    let mut m = 1u8;
    for n in 0..2 {
        let q = &b[32 + 32 * n..32 + 32 * n + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let dl = d_all * (i32::from(scales[is]) - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let low = i32::from((q[l + 16 * half] >> shift) & 3);
                    let sub = if hm[l + 16 * half] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (low - sub) as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

// block_q4_K: d, dmin, scales[12], qs[128].
fn decode_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    for j in 0..QK_K / 64 {
        let q = &b[16 + 32 * j..16 + 32 * j + 32];
        let (sc, m) = scale_min_k4(2 * j, scales);
        let (d1, m1) = (d * f32::from(sc), min * f32::from(m));
        let (sc, m) = scale_min_k4(2 * j + 1, scales);
        let (d2, m2) = (d * f32::from(sc), min * f32::from(m));
        let y = &mut y[64 * j..64 * j + 64];
        for l in 0..32 {
            y[l] = d1 * f32::from(q[l] & 0xF) - m1;
            y[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
        }
    }
}

// block_q5_K: d, dmin, scales[12], qh[32], qs[128].
fn decode_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    for j in 0..QK_K / 64 {
        let ql = &b[48 + 32 * j..48 + 32 * j + 32];
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        let (sc, m) = scale_min_k4(2 * j, scales);
        let (d1, m1) = (d * f32::from(sc), min * f32::from(m));
        let (sc, m) = scale_min_k4(2 * j + 1, scales);
        let (d2, m2) = (d * f32::from(sc), min * f32::from(m));
        let y = &mut y[64 * j..64 * j + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * f32::from((ql[l] & 0xF) + h1) - m1;
            y[l + 32] = d2 * f32::from((ql[l] >> 4) + h2) - m2;
        }
    }
}

// block_q6_K: ql[128], qh[64], scales[16] (int8), d.
fn decode_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            let s = |k: usize| f32::from(sc[is + k] as i8);
            y[l] = d * s(0) * q1 as f32;
            y[l + 32] = d * s(2) * q2 as f32;
            y[l + 64] = d * s(4) * q3 as f32;
            y[l + 96] = d * s(6) * q4 as f32;
        }
    }
}

fn decode_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * f32::from(IQ4_VALUES[usize::from(qs[j] & 0xF)]);
        y[j + 16] = d * f32::from(IQ4_VALUES[usize::from(qs[j] >> 4)]);
    }
}

// block_iq4_xs: d, scales_h (u16), scales_l[4], qs[128].
fn decode_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let scales_l = &b[4..8];
    for ib in 0..QK_K / 32 {
        let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
        let ls = i32::from((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF)
            | (i32::from((scales_h >> (2 * ib)) & 3) << 4);
        let dl = d * (ls - 32) as f32;
        let y = &mut y[32 * ib..32 * ib + 32];
        for j in 0..16 {
            y[j] = dl * f32::from(IQ4_VALUES[usize::from(qs[j] & 0xF)]);
            y[j + 16] = dl * f32::from(IQ4_VALUES[usize::from(qs[j] >> 4)]);
        }
    }
}

// block_mxfp4: e (E8M0), qs[16].
fn decode_mxfp4(b: &[u8], y: &mut [f32]) {
    let d = mxfp4_half_scale(b[0]);
    let qs = &b[1..17];
    for j in 0..16 {
        y[j] = f32::from(MXFP4_DOUBLED_VALUES[usize::from(qs[j] & 0xF)]) * d;
        y[j + 16] = f32::from(MXFP4_DOUBLED_VALUES[usize::from(qs[j] >> 4)]) * d;
    }
}

/// Element `e` (`0 <= e < block elements`) of one block of `ggml_type`, the same
/// value [`decode_row`] gives it (each element's formula on its own: what a kernel
/// that dequantizes in its loop reads).
///
/// # Panics
/// If `block` is shorter than the type's block, `e` is outside it, or the type is
/// not one [`super::DECODABLE`] lists.
pub fn block_element(ggml_type: GgmlType, block: &[u8], e: usize) -> f32 {
    // the 32-element types: byte j holds elements j (low nibble) and j + 16 (high)
    let nibble = |qs: &[u8], e: usize| {
        if e < 16 { qs[e] & 0xF } else { qs[e - 16] >> 4 }
    };
    let b = block;
    match ggml_type {
        GgmlType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => f16_at(b, 0),
        GgmlType::BF16 => bf16_to_f32(u16::from_le_bytes([b[0], b[1]])),
        GgmlType::Q4_0 => (i32::from(nibble(&b[2..18], e)) - 8) as f32 * f16_at(b, 0),
        GgmlType::Q4_1 => f32::from(nibble(&b[4..20], e)) * f16_at(b, 0) + f16_at(b, 2),
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (qh_at, qs_at) = if ggml_type == GgmlType::Q5_0 {
                (2, 6)
            } else {
                (4, 8)
            };
            let qh = q5_high_bits(&b[qh_at..qh_at + 4]);
            let high = (((qh >> e) & 1) << 4) as u8;
            let q = nibble(&b[qs_at..qs_at + 16], e) | high;
            if ggml_type == GgmlType::Q5_0 {
                (i32::from(q) - 16) as f32 * f16_at(b, 0)
            } else {
                f32::from(q) * f16_at(b, 0) + f16_at(b, 2)
            }
        }
        GgmlType::Q8_0 => f32::from(b[2 + e] as i8) * f16_at(b, 0),
        GgmlType::IQ4_NL => f16_at(b, 0) * f32::from(IQ4_VALUES[usize::from(nibble(&b[2..18], e))]),
        GgmlType::MXFP4 => {
            f32::from(MXFP4_DOUBLED_VALUES[usize::from(nibble(&b[1..17], e))])
                * mxfp4_half_scale(b[0])
        }
        GgmlType::Q2_K => {
            // element e: 128-half n, 32-run r (shift 2r), 16-half h, position l
            let (n, rest) = (e / 128, e % 128);
            let (r, h, l) = (rest / 32, (rest % 32) / 16, rest % 16);
            let sc = b[8 * n + 2 * r + h];
            let dl = f16_at(b, 80) * f32::from(sc & 0xF);
            let ml = f16_at(b, 82) * f32::from(sc >> 4);
            let q = (b[16 + 32 * n + l + 16 * h] >> (2 * r)) & 3;
            dl * f32::from(q) - ml
        }
        GgmlType::Q3_K => {
            let (n, rest) = (e / 128, e % 128);
            let (r, h, l) = (rest / 32, (rest % 32) / 16, rest % 16);
            let scales = q3_k_scales(&b[96..108]);
            let dl = f16_at(b, 108) * (i32::from(scales[8 * n + 2 * r + h]) - 32) as f32;
            let low = i32::from((b[32 + 32 * n + l + 16 * h] >> (2 * r)) & 3);
            let m = 1u8 << (4 * n + r);
            let sub = if b[l + 16 * h] & m != 0 { 0 } else { 4 };
            dl * (low - sub) as f32
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (j, rest) = (e / 64, e % 64);
            let (upper, l) = (rest / 32, rest % 32);
            let (sc, m) = scale_min_k4(2 * j + upper, &b[4..16]);
            let d = f16_at(b, 0) * f32::from(sc);
            let min = f16_at(b, 2) * f32::from(m);
            let q = if ggml_type == GgmlType::Q4_K {
                let byte = b[16 + 32 * j + l];
                if upper == 0 { byte & 0xF } else { byte >> 4 }
            } else {
                let byte = b[48 + 32 * j + l];
                let low = if upper == 0 { byte & 0xF } else { byte >> 4 };
                let bit = 1u8 << (2 * j + upper);
                low + if b[16 + l] & bit != 0 { 16 } else { 0 }
            };
            d * f32::from(q) - min
        }
        GgmlType::Q6_K => {
            let (n, rest) = (e / 128, e % 128);
            let (quarter, l) = (rest / 32, rest % 32);
            let ql = b[64 * n + l + 32 * (quarter % 2)];
            let low = if quarter < 2 { ql & 0xF } else { ql >> 4 };
            let high = (b[128 + 32 * n + l] >> (2 * quarter)) & 3;
            let q = i32::from(low | (high << 4)) - 32;
            let sc = f32::from(b[192 + 8 * n + l / 16 + 2 * quarter] as i8);
            f16_at(b, 208) * sc * q as f32
        }
        GgmlType::IQ4_XS => {
            let (ib, j) = (e / 32, e % 32);
            let scales_h = u16::from_le_bytes([b[2], b[3]]);
            let ls = i32::from((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF)
                | (i32::from((scales_h >> (2 * ib)) & 3) << 4);
            let dl = f16_at(b, 0) * (ls - 32) as f32;
            dl * f32::from(IQ4_VALUES[usize::from(nibble(&b[8 + 16 * ib..8 + 16 * ib + 16], j))])
        }
        other => panic!("block_element: no decoder for {other}"),
    }
}
