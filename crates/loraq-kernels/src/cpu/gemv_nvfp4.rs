//! Decode rows of an NVFP4 weight, 32 inputs (16 bytes) per step, against a
//! de-interleaved copy of the activation.
//!
//! The activation is reordered once per call so that in every 32-wide chunk the even
//! inputs come first, then the odd ones. One zero-extending load then puts byte `i` of
//! the chunk in lane `i`: `vpermps` on the lanes (it reads only the low 4 bits) gives
//! the E2M1 values of the low nibbles (the even inputs), a shift by 4 and a second
//! `vpermps` those of the high nibbles (the odd inputs), with no unpacking. Lanes 0-7
//! belong to the chunk's first 16-block, lanes 8-15 to its second, so one scale vector
//! (two block scales, each over 8 lanes) multiplies the chunk's partial sum. Block scales
//! are decoded 16 at a time with the E4M3 bit trick (`e4m3 * 2^-120` times
//! `global * 2^120`: one rounding, as `e4m3 * global`), and spread over the lanes with a
//! third `vpermps`.

use super::decode::{E2M1_VALUES, E4M3_F32_MASK, Nvfp4Rows, RowDecode};
use crate::weight::NVFP4_BLOCK;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// 2^120 (see `decode.rs`).
const E4M3_REBIAS: f32 = f32::from_bits((127 + 120) << 23);
/// Inputs per step.
const CHUNK: usize = 32;
/// Steps between two software prefetches of a row (4 x 16 bytes = one line).
#[cfg(target_arch = "x86_64")]
const PREFETCH_EVERY: usize = 4;
/// How far ahead the prefetch reaches, in bytes of codes.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 512;

/// Lane -> block-scale index for step `j` of a 16-block scale group: lanes 0-7 read
/// scale `2j`, lanes 8-15 scale `2j + 1`.
#[cfg(target_arch = "x86_64")]
static SCALE_LANES: [[i32; 16]; 8] = {
    let mut out = [[0i32; 16]; 8];
    let mut j = 0;
    while j < 8 {
        let mut lane = 0;
        while lane < 16 {
            out[j][lane] = (2 * j + lane / 8) as i32;
            lane += 1;
        }
        j += 1;
    }
    out
};

/// NVFP4 rows with the de-interleaved decode.
pub(crate) struct Nvfp4PairedRows<'a> {
    /// The weight (codes, scales, dimensions; its decoder serves a trailing 16-block).
    pub rows: Nvfp4Rows<'a>,
    /// `global_scale * 2^120`, finite (else this decoder is not used).
    pub global_rebiased: f32,
}

/// Whether the paired decoder can serve a weight with this global scale.
pub(crate) fn nvfp4_paired_usable(global_scale: f32) -> bool {
    (global_scale * E4M3_REBIAS).is_finite()
}

/// `x` (`[T, cols]`, rows `x_stride` apart) reordered chunk by chunk (evens, then odds)
/// into `[T, cols]`; a trailing partial chunk is copied unchanged.
pub(crate) fn deinterleave(x: &[f32], tokens: usize, cols: usize, x_stride: usize) -> Vec<f32> {
    let mut out = vec![0f32; tokens * cols];
    for t in 0..tokens {
        let src = &x[t * x_stride..t * x_stride + cols];
        let dst = &mut out[t * cols..(t + 1) * cols];
        let full = cols / CHUNK * CHUNK;
        for (d, s) in dst[..full]
            .chunks_exact_mut(CHUNK)
            .zip(src[..full].chunks_exact(CHUNK))
        {
            for i in 0..CHUNK / 2 {
                d[i] = s[2 * i];
                d[CHUNK / 2 + i] = s[2 * i + 1];
            }
        }
        dst[full..].copy_from_slice(&src[full..]);
    }
    out
}

impl Nvfp4PairedRows<'_> {
    /// Adds `sum_k W[row0 + r, k] x_t[k]` to `out[r * T + t]` for `r < nrows`.
    /// `xd` is [`deinterleave`]`(x)`; `x` the original (for a trailing 16-block).
    /// AVX-512F/BW/VL; the caller checked the CPU has them.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn dot_rows_avx512<const T: usize>(
        &self,
        row0: usize,
        nrows: usize,
        xd: &[f32],
        x: &[f32],
        x_stride: usize,
        out: &mut [f32],
    ) {
        let cols = self.rows.cols;
        assert!(row0 + nrows <= self.rows.rows);
        assert!(out.len() >= nrows * T);
        assert!(xd.len() >= T * cols);
        assert!(T == 0 || (T - 1) * x_stride + cols <= x.len());
        let mut r = 0;
        if T <= 2 {
            while r + 4 <= nrows {
                // SAFETY: AVX-512 F/BW/VL detected by the caller; bounds asserted above.
                unsafe { self.rows_avx512::<4, T>(row0 + r, xd, x, x_stride, &mut out[r * T..]) };
                r += 4;
            }
        }
        if T <= 4 {
            while r + 2 <= nrows {
                // SAFETY: as above.
                unsafe { self.rows_avx512::<2, T>(row0 + r, xd, x, x_stride, &mut out[r * T..]) };
                r += 2;
            }
        }
        while r < nrows {
            // SAFETY: as above.
            unsafe { self.rows_avx512::<1, T>(row0 + r, xd, x, x_stride, &mut out[r * T..]) };
            r += 1;
        }
    }

    /// 16 block scales of `row` from block `b0` (fewer at the row's end; the missing
    /// lanes are zero), times the global scale.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn block_scales16(&self, row: usize, b0: usize) -> __m512 {
        let blocks = self.rows.cols / NVFP4_BLOCK;
        let left = blocks - b0;
        let mask: __mmask16 = if left >= 16 {
            0xFFFF
        } else {
            ((1u32 << left) - 1) as u16
        };
        // SAFETY: the mask covers only this row's remaining scale bytes.
        unsafe {
            let p = self.rows.block_scales.as_ptr().add(row * blocks + b0);
            let raw = _mm_maskz_loadu_epi8(mask, p.cast());
            let v = _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(raw));
            let unbiased =
                _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(E4M3_F32_MASK)));
            _mm512_mul_ps(unbiased, _mm512_set1_ps(self.global_rebiased))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn rows_avx512<const R: usize, const T: usize>(
        &self,
        row0: usize,
        xd: &[f32],
        x: &[f32],
        x_stride: usize,
        out: &mut [f32],
    ) {
        let cols = self.rows.cols;
        let row_bytes = cols / 2;
        let chunks = cols / CHUNK;
        let pp = self.rows.packed.as_ptr();
        let xp = xd.as_ptr();
        // SAFETY: 16 f32 in the table.
        let table = unsafe { _mm512_loadu_ps(E2M1_VALUES.as_ptr()) };
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut scales = [_mm512_setzero_ps(); R];
        // SAFETY (pointer arithmetic): rows row0..row0 + R exist (caller); chunk c's 16
        // bytes end at (c + 1) * 16 <= row_bytes; xd holds T rows of cols elements.
        unsafe {
            for c in 0..chunks {
                let j = c % 8;
                if j == 0 {
                    for (r, s) in scales.iter_mut().enumerate() {
                        *s = self.block_scales16(row0 + r, 2 * c);
                    }
                }
                if c % PREFETCH_EVERY == 0 {
                    for r in 0..R {
                        _mm_prefetch::<_MM_HINT_T0>(
                            pp.wrapping_add((row0 + r) * row_bytes + c * 16 + PREFETCH_AHEAD)
                                .cast(),
                        );
                    }
                }
                let lanes = _mm512_loadu_si512(SCALE_LANES[j].as_ptr().cast());
                let mut x_even = [_mm512_setzero_ps(); T];
                let mut x_odd = [_mm512_setzero_ps(); T];
                for t in 0..T {
                    x_even[t] = _mm512_loadu_ps(xp.add(t * cols + c * CHUNK));
                    x_odd[t] = _mm512_loadu_ps(xp.add(t * cols + c * CHUNK + 16));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let raw = _mm_loadu_si128(pp.add((row0 + r) * row_bytes + c * 16).cast());
                    let bytes = _mm512_cvtepu8_epi32(raw);
                    let w_even = _mm512_permutexvar_ps(bytes, table);
                    let w_odd = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table);
                    let s = _mm512_permutexvar_ps(lanes, scales[r]);
                    if T == 1 {
                        // One token: scale the partial sum (3 FP ops, not 4).
                        let p = _mm512_mul_ps(w_even, x_even[0]);
                        let p = _mm512_fmadd_ps(w_odd, x_odd[0], p);
                        acc_r[0] = _mm512_fmadd_ps(p, s, acc_r[0]);
                    } else {
                        // Several tokens: scale the weights once, reuse for each.
                        let w_even = _mm512_mul_ps(w_even, s);
                        let w_odd = _mm512_mul_ps(w_odd, s);
                        for (t, a) in acc_r.iter_mut().enumerate() {
                            *a = _mm512_fmadd_ps(w_even, x_even[t], *a);
                            *a = _mm512_fmadd_ps(w_odd, x_odd[t], *a);
                        }
                    }
                }
            }
            // A trailing 16-block (cols % 32 == 16): the plain decoder on the original x.
            let k = chunks * CHUNK;
            if k < cols {
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let w = self.rows.load16(row0 + r, k);
                    for (t, a) in acc_r.iter_mut().enumerate() {
                        let xv = _mm512_loadu_ps(x.as_ptr().add(t * x_stride + k));
                        *a = _mm512_fmadd_ps(w, xv, *a);
                    }
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                out[r * T + t] += _mm512_reduce_add_ps(*a);
            }
        }
    }
}
