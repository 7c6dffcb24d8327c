//! Quantization of `f32` rows into ggml blocks, byte for byte what
//! `ggml_quantize_chunk` (ggml/src/ggml.c) writes without an importance matrix:
//! the reference quantizers `quantize_row_*_ref` of ggml/src/ggml-quants.c for
//! the legacy and K types, and `quantize_iq4_nl` / `quantize_iq4_xs` (their
//! search with 7 tries, not the `_ref` variant's) for the IQ4 types.
//!
//! Every function follows its C original operation for operation in `f32`
//! (products and sums in the same order, no fused multiply-add), with the same
//! rounding helper (`nearest_int`) and the same f16 conversion
//! ([`super::fp32_to_fp16`]). Conversions of out-of-range floats to small integers
//! follow what x86-64 does for the C casts (`cvttss2si`, then the low byte).

use super::decode::{IQ4_VALUES, q3_k_scales, scale_min_k4};
use super::fp16::{fp16_to_f32, fp32_to_bf16, fp32_to_fp16};
use super::{GgmlType, QK_K, QUANTIZABLE, matrix_bytes, row_bytes};
use crate::error::{QuantError, Result};
use rayon::prelude::*;

/// `GROUP_MAX_EPS` of ggml-quants.c: groups whose largest magnitude is below it
/// count as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// `nearest_int` of ggml-quants.c: round to nearest (ties to even) by adding
/// `1.5 * 2^23` and reading the mantissa bits; exact for `|x| <= 4194303`, and
/// reproduced bit for bit outside that range too.
#[inline(always)]
fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// The C cast of a float to a 32-bit integer as x86-64 executes it
/// (`cvttss2si`): truncation, and `i32::MIN` for NaN and out-of-range values.
#[inline(always)]
fn c_f32_to_i32(x: f32) -> i32 {
    if x.is_nan() || !(-2_147_483_648.0..2_147_483_648.0).contains(&x) {
        i32::MIN
    } else {
        x as i32
    }
}

/// The C cast of a float to `int8_t` / `uint8_t` as gcc compiles it on x86-64:
/// the low byte of [`c_f32_to_i32`].
#[inline(always)]
fn c_f32_to_byte(x: f32) -> u8 {
    c_f32_to_i32(x) as u8
}

fn put_f16(dst: &mut [u8], offset: usize, value: f32) {
    dst[offset..offset + 2].copy_from_slice(&fp32_to_fp16(value).to_le_bytes());
}

/// Quantizes a row-major `out_features x in_features` matrix into `ggml_type`
/// (rows one after another, each [`super::row_bytes`] bytes). Refuses a row
/// that is not a whole number of blocks, a value count that does not match, and
/// the types without a bit-exact quantizer here (MXFP4); `tensor` names the
/// weight in the error.
pub fn quantize(
    tensor: &str,
    ggml_type: GgmlType,
    out_features: usize,
    in_features: usize,
    values: &[f32],
) -> Result<Vec<u8>> {
    if !QUANTIZABLE.contains(&ggml_type) {
        return Err(QuantError::UnsupportedFormat {
            tensor: tensor.to_string(),
            format: format!("ggml {ggml_type} (decode only)"),
        });
    }
    if out_features.checked_mul(in_features) != Some(values.len()) {
        return Err(QuantError::ShapeMismatch {
            tensor: tensor.to_string(),
            out_features,
            in_features,
            len: values.len(),
        });
    }
    let row_bytes = row_bytes(ggml_type, tensor, in_features)?;
    let total = matrix_bytes(ggml_type, tensor, out_features, in_features)?;
    let mut out = vec![0u8; total];
    if in_features > 0 {
        out.par_chunks_mut(row_bytes)
            .zip(values.par_chunks(in_features))
            .for_each(|(dst, src)| quantize_row(ggml_type, src, dst));
    }
    Ok(out)
}

/// Quantizes `src` (a whole number of blocks) into `dst` (their bytes).
///
/// # Panics
/// If the lengths do not match, or `ggml_type` has no quantizer here (MXFP4).
pub fn quantize_row(ggml_type: GgmlType, src: &[f32], dst: &mut [u8]) {
    let block = ggml_type.block();
    assert_eq!(src.len() % block.elements, 0, "quantize_row: partial block");
    assert_eq!(
        src.len() / block.elements * block.bytes,
        dst.len(),
        "quantize_row: length mismatch"
    );
    for (x, y) in src
        .chunks_exact(block.elements)
        .zip(dst.chunks_exact_mut(block.bytes))
    {
        match ggml_type {
            GgmlType::F32 => y.copy_from_slice(&x[0].to_le_bytes()),
            GgmlType::F16 => y.copy_from_slice(&fp32_to_fp16(x[0]).to_le_bytes()),
            GgmlType::BF16 => y.copy_from_slice(&fp32_to_bf16(x[0]).to_le_bytes()),
            GgmlType::Q4_0 => quantize_q4_0(x, y),
            GgmlType::Q4_1 => quantize_q4_1(x, y),
            GgmlType::Q5_0 => quantize_q5_0(x, y),
            GgmlType::Q5_1 => quantize_q5_1(x, y),
            GgmlType::Q8_0 => quantize_q8_0(x, y),
            GgmlType::Q2_K => quantize_q2_k(x, y),
            GgmlType::Q3_K => quantize_q3_k(x, y),
            GgmlType::Q4_K => quantize_q45_k(x, y, 15),
            GgmlType::Q5_K => quantize_q45_k(x, y, 31),
            GgmlType::Q6_K => quantize_q6_k(x, y),
            GgmlType::IQ4_NL => quantize_iq4(x, y, false),
            GgmlType::IQ4_XS => quantize_iq4(x, y, true),
            other => panic!("quantize_row: no bit-exact {other} quantizer"),
        }
    }
}

/// The first value of largest magnitude (`if (amax < fabsf(v))`).
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn reciprocal_or_zero(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

// quantize_row_q4_0_ref
fn quantize_q4_0(x: &[f32], y: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -8.0;
    let id = reciprocal_or_zero(d);
    put_f16(y, 0, d);
    for j in 0..16 {
        let xi0 = (c_f32_to_byte(x[j] * id + 8.5) as i8).min(15) as u8;
        let xi1 = (c_f32_to_byte(x[j + 16] * id + 8.5) as i8).min(15) as u8;
        y[2 + j] = xi0 | (xi1 << 4);
    }
}

// quantize_row_q4_1_ref
fn quantize_q4_1(x: &[f32], y: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = reciprocal_or_zero(d);
    put_f16(y, 0, d);
    put_f16(y, 2, min);
    for j in 0..16 {
        let xi0 = (c_f32_to_byte((x[j] - min) * id + 0.5) as i8).min(15) as u8;
        let xi1 = (c_f32_to_byte((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
        y[4 + j] = xi0 | (xi1 << 4);
    }
}

fn pack_q5(codes0: [u8; 16], codes1: [u8; 16], qh_qs: &mut [u8]) {
    let mut qh = 0u32;
    for j in 0..16 {
        let (xi0, xi1) = (codes0[j], codes1[j]);
        qh_qs[4 + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
        qh |= u32::from((xi0 & 0x10) >> 4) << j;
        qh |= u32::from((xi1 & 0x10) >> 4) << (j + 16);
    }
    qh_qs[..4].copy_from_slice(&qh.to_le_bytes());
}

// quantize_row_q5_0_ref
fn quantize_q5_0(x: &[f32], y: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -16.0;
    let id = reciprocal_or_zero(d);
    put_f16(y, 0, d);
    let code = |v: f32| (c_f32_to_byte(v * id + 16.5) as i8).min(31) as u8;
    let codes0 = std::array::from_fn(|j| code(x[j]));
    let codes1 = std::array::from_fn(|j| code(x[j + 16]));
    pack_q5(codes0, codes1, &mut y[2..]);
}

// quantize_row_q5_1_ref (no clamp to 31 in the original)
fn quantize_q5_1(x: &[f32], y: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = reciprocal_or_zero(d);
    put_f16(y, 0, d);
    put_f16(y, 2, min);
    let code = |v: f32| c_f32_to_byte((v - min) * id + 0.5);
    let codes0 = std::array::from_fn(|j| code(x[j]));
    let codes1 = std::array::from_fn(|j| code(x[j + 16]));
    pack_q5(codes0, codes1, &mut y[4..]);
}

// quantize_row_q8_0_ref
fn quantize_q8_0(x: &[f32], y: &mut [u8]) {
    let mut amax = 0.0f32;
    for &v in x {
        // MAX(amax, fabsf(v))
        amax = if amax > v.abs() { amax } else { v.abs() };
    }
    let d = amax / 127.0;
    let id = reciprocal_or_zero(d);
    put_f16(y, 0, d);
    for (q, &v) in y[2..].iter_mut().zip(x) {
        *q = c_f32_to_byte((v * id).round());
    }
}

/// `make_qkx2_quants`: the asymmetric `scale * L + min` search of the K types;
/// returns the scale and writes `-min` (non-negative) to `the_min`.
#[allow(clippy::too_many_arguments)] // the C signature, kept for checking against it
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    the_min: &mut f32,
    l_aux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> f32 {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.fill(0);
        *the_min = -min;
        return 0.0;
    }
    let error_of = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min));
        l_out[i] = l.clamp(0, nmax) as u8;
        let diff = scale * f32::from(l_out[i]) + min - x[i];
        best_error += weights[i] * error_of(diff);
    }
    if nstep < 1 {
        *the_min = -min;
        return scale;
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            l_aux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(l_aux[i]) + this_min - x[i];
                cur_error += weights[i] * error_of(diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&l_aux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    scale
}

/// `make_qx_quants` with `rmse_type = 1` and no importance weights (the weights
/// are `x^2`), as `quantize_row_q6_K_ref` calls it: the symmetric search of Q6_K.
fn make_qx_quants_rmse1(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let (amax, max) = {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        (amax, max)
    };
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (i, &v) in x.iter().enumerate() {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
        let w = v * v;
        let lf = l as f32;
        sumlx += w * v * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9i32..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
            let w = v * v;
            let lf = l as f32;
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (i, &v) in x.iter().enumerate() {
                let l = nearest_int(iscale * v);
                l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_q3_quants` with `do_rmse = true`: the symmetric search of Q3_K.
fn make_q3_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (i, &v) in x.iter().enumerate() {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        l_out[i] = l as i8;
        let w = v * v;
        let lf = l as f32;
        sumlx += w * v * lf;
        suml2 += w * lf * lf;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let li = f32::from(l_out[i]);
            let mut slx = sumlx - w * v * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != i32::from(l_out[i]) {
                    let nl = new_l as f32;
                    slx += w * v * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l_out[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for l in l_out.iter_mut() {
        *l += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Packs 2-bit codes as Q2_K / Q3_K do: byte `l` of each 32-byte run holds
/// elements `l`, `l + 32`, `l + 64`, `l + 96` of its 128.
fn pack_2bit(codes: &[u8; QK_K], qs: &mut [u8]) {
    for j in (0..QK_K).step_by(128) {
        for l in 0..32 {
            qs[j / 4 + l] = codes[j + l]
                | (codes[j + l + 32] << 2)
                | (codes[j + l + 64] << 4)
                | (codes[j + l + 96] << 6);
        }
    }
}

// quantize_row_q2_K_ref; block_q2_K: scales[16], qs[64], d, dmin.
fn quantize_q2_k(x: &[f32], y: &mut [u8]) {
    let mut codes = [0u8; QK_K];
    let mut l_aux = [0u8; 16];
    let mut weights = [0.0f32; 16];
    let mut mins = [0.0f32; QK_K / 16];
    let mut scales = [0.0f32; QK_K / 16];
    let q4scale = 15.0f32;
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..QK_K / 16 {
        let xg = &x[16 * j..16 * j + 16];
        for (w, v) in weights.iter_mut().zip(xg) {
            *w = v.abs();
        }
        scales[j] = make_qkx2_quants(
            3,
            xg,
            &weights,
            &mut codes[16 * j..16 * j + 16],
            &mut mins[j],
            &mut l_aux,
            -0.5,
            0.1,
            15,
            true,
        );
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let (sc, rest) = y.split_at_mut(16);
    if max_scale > 0.0 {
        let iscale = q4scale / max_scale;
        for j in 0..QK_K / 16 {
            sc[j] = nearest_int(iscale * scales[j]) as u8;
        }
        put_f16(rest, 64, max_scale / q4scale);
    } else {
        sc.fill(0);
        put_f16(rest, 64, 0.0);
    }
    if max_min > 0.0 {
        let iscale = q4scale / max_min;
        for j in 0..QK_K / 16 {
            sc[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        put_f16(rest, 66, max_min / q4scale);
    } else {
        put_f16(rest, 66, 0.0);
    }
    let d_all = fp16_to_f32(u16::from_le_bytes([rest[64], rest[65]]));
    let dmin_all = fp16_to_f32(u16::from_le_bytes([rest[66], rest[67]]));
    for j in 0..QK_K / 16 {
        let d = d_all * f32::from(sc[j] & 0xF);
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * f32::from(sc[j] >> 4);
        for ii in 0..16 {
            codes[16 * j + ii] = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3) as u8;
        }
    }
    pack_2bit(&codes, &mut rest[..64]);
}

// quantize_row_q3_K_ref; block_q3_K: hmask[32], qs[64], scales[12], d.
fn quantize_q3_k(x: &[f32], y: &mut [u8]) {
    let mut signed = [0i8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
    for j in 0..QK_K / 16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut signed[16 * j..16 * j + 16]);
        let scale = scales[j].abs();
        if scale > amax {
            amax = scale;
            max_scale = scales[j];
        }
    }
    let (hmask, rest) = y.split_at_mut(32);
    let (qs, rest) = rest.split_at_mut(64);
    let (packed, d_bytes) = rest.split_at_mut(12);
    packed.fill(0);
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for j in 0..QK_K / 16 {
            let l8 = nearest_int(iscale * scales[j]) as i8;
            let l = (l8.clamp(-32, 31) + 32) as u8;
            if j < 8 {
                packed[j] = l & 0xF;
            } else {
                packed[j - 8] |= (l & 0xF) << 4;
            }
            packed[j % 4 + 8] |= (l >> 4) << (2 * (j / 4));
        }
        put_f16(d_bytes, 0, 1.0 / iscale);
    } else {
        put_f16(d_bytes, 0, 0.0);
    }
    let d_all = fp16_to_f32(u16::from_le_bytes([d_bytes[0], d_bytes[1]]));
    let group_scales = q3_k_scales(packed);
    for j in 0..QK_K / 16 {
        let sc = i32::from(group_scales[j] as i8) - 32;
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let l = nearest_int(x[16 * j + ii] / d).clamp(-4, 3);
            signed[16 * j + ii] = (l + 4) as i8;
        }
    }
    let mut codes = [0u8; QK_K];
    for (c, &s) in codes.iter_mut().zip(&signed) {
        *c = s as u8;
    }
    hmask.fill(0);
    let (mut m, mut hm) = (0usize, 1u8);
    for c in codes.iter_mut() {
        if *c > 3 {
            hmask[m] |= hm;
            *c -= 4;
        }
        m += 1;
        if m == QK_K / 8 {
            m = 0;
            hm <<= 1;
        }
    }
    pack_2bit(&codes, qs);
}

/// `quantize_row_q4_K_ref` (`nmax = 15`) and `quantize_row_q5_K_ref`
/// (`nmax = 31`); block: d, dmin, scales[12], (Q5_K: qh[32]), qs[128].
fn quantize_q45_k(x: &[f32], y: &mut [u8], nmax: i32) {
    let mut codes = [0u8; QK_K];
    let mut l_aux = [0u8; 32];
    let mut weights = [0.0f32; 32];
    let mut mins = [0.0f32; QK_K / 32];
    let mut scales = [0.0f32; QK_K / 32];
    let (rmin, nstep) = if nmax == 15 { (-1.0, 20) } else { (-0.5, 15) };
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..QK_K / 32 {
        let xg = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xg {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(xg) {
            *w = av_x + v.abs();
        }
        scales[j] = make_qkx2_quants(
            nmax,
            xg,
            &weights,
            &mut codes[32 * j..32 * j + 32],
            &mut mins[j],
            &mut l_aux,
            rmin,
            0.1,
            nstep,
            false,
        );
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let packed = &mut y[4..16];
    for j in 0..QK_K / 32 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    put_f16(y, 0, max_scale / 63.0);
    put_f16(y, 2, max_min / 63.0);
    let d_all = fp16_to_f32(u16::from_le_bytes([y[0], y[1]]));
    let dmin_all = fp16_to_f32(u16::from_le_bytes([y[2], y[3]]));
    for j in 0..QK_K / 32 {
        let (sc, m) = scale_min_k4(j, &y[4..16]);
        let d = d_all * f32::from(sc);
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * f32::from(m);
        for ii in 0..32 {
            codes[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    if nmax == 15 {
        let qs = &mut y[16..144];
        for (n, q) in (0..QK_K).step_by(64).zip(qs.chunks_exact_mut(32)) {
            for l in 0..32 {
                q[l] = codes[n + l] | (codes[n + l + 32] << 4);
            }
        }
    } else {
        let (qh, ql) = y[16..176].split_at_mut(32);
        qh.fill(0);
        let (mut m1, mut m2) = (1u8, 2u8);
        for (n, ql) in (0..QK_K).step_by(64).zip(ql.chunks_exact_mut(32)) {
            for j in 0..32 {
                let mut l1 = codes[n + j];
                if l1 > 15 {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                let mut l2 = codes[n + j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                ql[j] = l1 | (l2 << 4);
            }
            m1 <<= 2;
            m2 <<= 2;
        }
    }
}

// quantize_row_q6_K_ref; block_q6_K: ql[128], qh[64], scales[16], d.
fn quantize_q6_k(x: &[f32], y: &mut [u8]) {
    let mut codes = [0i8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for ib in 0..QK_K / 16 {
        let scale = make_qx_quants_rmse1(
            32,
            &x[16 * ib..16 * ib + 16],
            &mut codes[16 * ib..16 * ib + 16],
        );
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        y.fill(0);
        put_f16(y, 208, 0.0);
        return;
    }
    let iscale = -128.0 / max_scale;
    put_f16(y, 208, 1.0 / iscale);
    for ib in 0..QK_K / 16 {
        y[192 + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
    }
    let d_all = fp16_to_f32(u16::from_le_bytes([y[208], y[209]]));
    for j in 0..QK_K / 16 {
        let d = d_all * f32::from(y[192 + j] as i8);
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let l = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
            codes[16 * j + ii] = (l + 32) as i8;
        }
    }
    let codes: [u8; QK_K] = std::array::from_fn(|i| codes[i] as u8);
    let (ql_all, rest) = y.split_at_mut(128);
    let qh_all = &mut rest[..64];
    for (half, j) in (0..QK_K).step_by(128).enumerate() {
        let ql = &mut ql_all[64 * half..64 * half + 64];
        let qh = &mut qh_all[32 * half..32 * half + 32];
        for l in 0..32 {
            let q1 = codes[j + l] & 0xF;
            let q2 = codes[j + l + 32] & 0xF;
            let q3 = codes[j + l + 64] & 0xF;
            let q4 = codes[j + l + 96] & 0xF;
            ql[l] = q1 | (q3 << 4);
            ql[l + 32] = q2 | (q4 << 4);
            qh[l] = (codes[j + l] >> 4)
                | ((codes[j + l + 32] >> 4) << 2)
                | ((codes[j + l + 64] >> 4) << 4)
                | ((codes[j + l + 96] >> 4) << 6);
        }
    }
}

/// `best_index_int8(16, kvalues_iq4nl, x)`: the index of the table value nearest
/// `x` (binary search, ties to the upper value), with the C comparisons' NaN
/// behaviour.
fn best_index_iq4(x: f32) -> usize {
    let val = |i: usize| f32::from(IQ4_VALUES[i]);
    if x <= val(0) {
        return 0;
    }
    if x >= val(15) {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < val(mav) {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - val(mu - 1) < val(mu) - x {
        mu - 1
    } else {
        mu
    }
}

/// `quantize_row_iq4_nl_impl` with `ntry = 7` and no importance weights, as
/// `quantize_iq4_nl` (one 32-block per call, `xs = false`) and `quantize_iq4_xs`
/// (one 256-super-block, `xs = true`) call it. IQ4_NL block: d, qs[16]; IQ4_XS
/// block: d, scales_h, scales_l[4], qs[128].
fn quantize_iq4(x: &[f32], y: &mut [u8], xs: bool) {
    const NTRY: i32 = 7;
    let super_block = x.len();
    let n_blocks = super_block / 32;
    let mut codes = [0u8; QK_K];
    let mut scales = [0.0f32; QK_K / 32];
    let values0 = f32::from(IQ4_VALUES[0]);
    let (mut max_scale, mut amax_scale) = (0.0f32, 0.0f32);
    for ib in 0..n_blocks {
        let xb = &x[32 * ib..32 * ib + 32];
        let lb = &mut codes[32 * ib..32 * ib + 32];
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax < GROUP_MAX_EPS {
            scales[ib] = 0.0;
            continue;
        }
        let mut d = -max / values0;
        let mut id = 1.0 / d;
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for (j, &v) in xb.iter().enumerate() {
            let l = best_index_iq4(id * v);
            lb[j] = l as u8;
            let q = f32::from(IQ4_VALUES[l]);
            let w = v * v;
            sumqx += w * q * v;
            sumq2 += w * q * q;
        }
        d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
        let mut best = d * sumqx;
        for itry in -NTRY..=NTRY {
            id = (itry + i32::from(IQ4_VALUES[0])) as f32 / max;
            sumqx = 0.0;
            sumq2 = 0.0;
            for &v in xb {
                let q = f32::from(IQ4_VALUES[best_index_iq4(id * v)]);
                let w = v * v;
                sumqx += w * q * v;
                sumq2 += w * q * q;
            }
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        if d.abs() > amax_scale {
            amax_scale = d.abs();
            max_scale = d;
        }
    }
    let qs_offset;
    if xs {
        let d = -max_scale / 32.0;
        put_f16(y, 0, d);
        let id = reciprocal_or_zero(d);
        let mut scales_h = 0u16;
        let mut scales_l = [0u8; 4];
        for ib in 0..n_blocks {
            let l = nearest_int(id * scales[ib]).clamp(-32, 31);
            let dl = d * l as f32;
            let idl = reciprocal_or_zero(dl);
            for j in 0..32 {
                codes[32 * ib + j] = best_index_iq4(idl * x[32 * ib + j]) as u8;
            }
            let l = (l + 32) as u8;
            let (l_l, l_h) = (l & 0xF, l >> 4);
            if ib % 2 == 0 {
                scales_l[ib / 2] = l_l;
            } else {
                scales_l[ib / 2] |= l_l << 4;
            }
            scales_h |= u16::from(l_h) << (2 * (ib % 8));
        }
        y[2..4].copy_from_slice(&scales_h.to_le_bytes());
        y[4..8].copy_from_slice(&scales_l);
        qs_offset = 8;
    } else {
        put_f16(y, 0, scales[0]);
        let id = reciprocal_or_zero(scales[0]);
        for j in 0..super_block {
            codes[j] = best_index_iq4(id * x[j]) as u8;
        }
        qs_offset = 2;
    }
    for i in 0..super_block / 32 {
        for j in 0..16 {
            y[qs_offset + 16 * i + j] = codes[32 * i + j] | (codes[32 * i + 16 + j] << 4);
        }
    }
}
