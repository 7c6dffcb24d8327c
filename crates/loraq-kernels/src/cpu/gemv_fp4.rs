//! Decode rows of an NVFP4 or MXFP4 weight, 128 inputs (64 bytes) per step, against a
//! reordered copy of the activation; the [`PairedRows`] interface that the INT4 loop
//! (`gemv_int4.rs`) shares.
//!
//! The 64 bytes of a step are loaded as 16 dword lanes; lane `i` holds inputs `8i ..
//! 8i + 7`, one per nibble. `vpermps` reads only the low 4 bits of each index lane, so
//! the E2M1 values of nibble `q` of every lane come from one shift by `4q` and one
//! `vpermps` on the 16-entry table: no widening shuffles, no masks. The activation is
//! reordered once per call so that vector `q` of a step holds inputs `8i + q`. Every
//! lane lies in one scale block (NVFP4: lanes `2b, 2b + 1` are the step's 16-block `b`;
//! MXFP4: lanes `4b .. 4b + 3` its 32-block `b`), so the step's eight products per lane
//! are summed first and multiplied by one vector of block scales: NVFP4's decoded from
//! the 8 scale bytes with the E4M3 bit trick (`e4m3 * 2^-120` times `global * 2^120`:
//! one rounding, as `e4m3 * global`), MXFP4's E8M0 `2^(e - 127)` placed in the f32
//! exponent (exact; code 0, 2^-127, is the f32 subnormal with only bit 22 set).

use super::decode::{E2M1_VALUES, E4M3_F32_MASK, PackedFp4Rows, RowDecode};
use crate::weight::{MXFP4_BLOCK, NVFP4_BLOCK};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// 2^120 (see `decode.rs`).
const E4M3_REBIAS: f32 = f32::from_bits((127 + 120) << 23);
/// Inputs per step.
const STEP: usize = 128;

/// Rows decoded one 128-input step at a time against [`deinterleave`]d activations
/// (NVFP4, MXFP4 and INT4 group 128), AVX-512F/BW.
pub(crate) trait PairedRows: Sync {
    /// Output rows.
    fn rows(&self) -> usize;
    /// Inputs per row.
    fn cols(&self) -> usize;

    /// Adds `sum_k W[row0 + r, k] x_t[k]` to `out[r * T + t]` for `r < R`.
    ///
    /// # Safety
    /// The CPU has AVX-512F/BW; rows `row0 .. row0 + R` exist; `out` holds `R * T`
    /// values and `xd` `T * cols`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx512<const R: usize, const T: usize>(
        &self,
        row0: usize,
        xd: &[f32],
        out: &mut [f32],
    );

    /// Adds `sum_k W[row0 + r, k] x_t[k]` to `out[r * T + t]` for `r < nrows`, `xd`
    /// being [`deinterleave`]`(x)` (`[T, cols]`), four rows at a time for one or two
    /// tokens (the activation loads are shared), two up to four tokens, else one. The
    /// caller checked the CPU has AVX-512F/BW.
    #[cfg(target_arch = "x86_64")]
    fn dot_rows_avx512<const T: usize>(
        &self,
        row0: usize,
        nrows: usize,
        xd: &[f32],
        out: &mut [f32],
    ) {
        assert!(row0 + nrows <= self.rows());
        assert!(out.len() >= nrows * T);
        assert!(xd.len() >= T * self.cols());
        let mut r = 0;
        if T <= 2 {
            while r + 4 <= nrows {
                // SAFETY: AVX-512 F/BW detected by the caller; bounds asserted above.
                unsafe { self.rows_avx512::<4, T>(row0 + r, xd, &mut out[r * T..]) };
                r += 4;
            }
        }
        if T <= 4 {
            while r + 2 <= nrows {
                // SAFETY: as above.
                unsafe { self.rows_avx512::<2, T>(row0 + r, xd, &mut out[r * T..]) };
                r += 2;
            }
        }
        while r < nrows {
            // SAFETY: as above.
            unsafe { self.rows_avx512::<1, T>(row0 + r, xd, &mut out[r * T..]) };
            r += 1;
        }
    }
}

/// NVFP4 (`BLOCK` 16) or MXFP4 (`BLOCK` 32) rows with the de-interleaved decode.
pub(crate) struct PairedFp4Rows<'a, const BLOCK: usize> {
    /// The weight (codes, scales, dimensions; its decoder serves the trailing inputs).
    pub rows: PackedFp4Rows<'a, BLOCK>,
    /// NVFP4: `global_scale * 2^120`, finite (else this decoder is not used); MXFP4: 1.
    pub scale_multiplier: f32,
}

/// The `scale_multiplier` of an NVFP4 weight's [`PairedFp4Rows`], `global_scale *
/// 2^120`; `None` where that is not finite and the paired decoder cannot serve it.
pub(crate) fn nvfp4_scale_multiplier(global_scale: f32) -> Option<f32> {
    Some(global_scale * E4M3_REBIAS).filter(|m| m.is_finite())
}

/// `x` (`[T, cols]`, rows `x_stride` apart) reordered step by step (position `16q + i`
/// of a step holds input `8i + q`) into `[T, cols]`; a trailing partial step is copied
/// unchanged.
pub(crate) fn deinterleave(x: &[f32], tokens: usize, cols: usize, x_stride: usize) -> Vec<f32> {
    let mut out = vec![0f32; tokens * cols];
    for t in 0..tokens {
        let src = &x[t * x_stride..t * x_stride + cols];
        let dst = &mut out[t * cols..(t + 1) * cols];
        let full = cols / STEP * STEP;
        for (d, s) in dst[..full]
            .chunks_exact_mut(STEP)
            .zip(src[..full].chunks_exact(STEP))
        {
            for q in 0..8 {
                for i in 0..16 {
                    d[16 * q + i] = s[8 * i + q];
                }
            }
        }
        dst[full..].copy_from_slice(&src[full..]);
    }
    out
}

impl<const BLOCK: usize> PairedFp4Rows<'_, BLOCK> {
    /// The block scales of step `c` of `row`, one per lane (each block's over its 2
    /// (NVFP4) or 4 (MXFP4) lanes), times `scale_multiplier` (NVFP4).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn step_scales(&self, row: usize, c: usize) -> __m512 {
        let blocks = self.rows.cols / BLOCK;
        let per_step = STEP / BLOCK;
        // SAFETY: a full step has `per_step` blocks, all in this row.
        unsafe {
            let p = self
                .rows
                .block_scales
                .as_ptr()
                .add(row * blocks + c * per_step);
            if BLOCK == NVFP4_BLOCK {
                let raw = _mm_loadl_epi64(p.cast());
                let doubled = _mm_unpacklo_epi8(raw, raw);
                let v = _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(doubled));
                let unbiased =
                    _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(E4M3_F32_MASK)));
                _mm512_mul_ps(unbiased, _mm512_set1_ps(self.scale_multiplier))
            } else {
                debug_assert_eq!(BLOCK, MXFP4_BLOCK);
                let raw = _mm_cvtsi32_si128(p.cast::<i32>().read_unaligned());
                let spread = _mm_shuffle_epi8(
                    raw,
                    _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                );
                let codes = _mm512_cvtepu8_epi32(spread);
                let zero = _mm512_cmpeq_epi32_mask(codes, _mm512_setzero_si512());
                let bits = _mm512_mask_mov_epi32(
                    _mm512_slli_epi32::<23>(codes),
                    zero,
                    _mm512_set1_epi32(0x0040_0000),
                );
                _mm512_castsi512_ps(bits)
            }
        }
    }
}

impl<const BLOCK: usize> PairedRows for PairedFp4Rows<'_, BLOCK> {
    fn rows(&self) -> usize {
        self.rows.rows
    }
    fn cols(&self) -> usize {
        self.rows.cols
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn rows_avx512<const R: usize, const T: usize>(
        &self,
        row0: usize,
        xd: &[f32],
        out: &mut [f32],
    ) {
        let cols = self.rows.cols;
        let row_bytes = cols / 2;
        let steps = cols / STEP;
        let pp = self.rows.packed.as_ptr();
        let xp = xd.as_ptr();
        // SAFETY: 16 f32 in the table.
        let table = unsafe { _mm512_loadu_ps(E2M1_VALUES.as_ptr()) };
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        // SAFETY (pointer arithmetic): rows row0..row0 + R exist (caller); step c's 64
        // bytes end at (c + 1) * 64 <= row_bytes; xd holds T rows of cols elements.
        unsafe {
            for c in 0..steps {
                for r in 0..R {
                    super::prefetch_ahead(pp.wrapping_add((row0 + r) * row_bytes + c * 64));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let raw = _mm512_loadu_si512(pp.add((row0 + r) * row_bytes + c * 64).cast());
                    let w = [
                        _mm512_permutexvar_ps(raw, table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(raw), table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(raw), table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<12>(raw), table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<16>(raw), table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<20>(raw), table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<24>(raw), table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<28>(raw), table),
                    ];
                    let s = self.step_scales(row0 + r, c);
                    for (t, a) in acc_r.iter_mut().enumerate() {
                        let x = xp.add(t * cols + c * STEP);
                        let mut p = _mm512_mul_ps(w[0], _mm512_loadu_ps(x));
                        for (q, &wq) in w.iter().enumerate().skip(1) {
                            p = _mm512_fmadd_ps(wq, _mm512_loadu_ps(x.add(16 * q)), p);
                        }
                        *a = _mm512_fmadd_ps(p, s, *a);
                    }
                }
            }
            // Trailing inputs (cols % 128 != 0, a multiple of 16): 16 at a time through
            // the plain decoder; xd is in input order there.
            let mut k = steps * STEP;
            while k < cols {
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let w = self.rows.load16(row0 + r, k);
                    for (t, a) in acc_r.iter_mut().enumerate() {
                        let xv = _mm512_loadu_ps(xp.add(t * cols + k));
                        *a = _mm512_fmadd_ps(w, xv, *a);
                    }
                }
                k += 16;
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                out[r * T + t] += _mm512_reduce_add_ps(*a);
            }
        }
    }
}
