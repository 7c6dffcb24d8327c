//! Decode rows of an NVFP4 or MXFP4 weight against a reordered copy of the activation;
//! the [`PairedRows`] interface that the INT4 loop (`gemv_int4.rs`) shares.
//!
//! AVX-512, 128 inputs (64 bytes) per step: the 64 bytes are loaded as 16 dword lanes;
//! lane `i` holds inputs `8i .. 8i + 7`, one per nibble. `vpermps` reads only the low 4
//! bits of each index lane, so the E2M1 values of nibble `q` of every lane come from one
//! shift by `4q` and one `vpermps` on the 16-entry table: no widening shuffles, no masks.
//! The activation is reordered once per call so that vector `q` of a step holds inputs
//! `8i + q`. Every lane lies in one scale block (NVFP4: lanes `2b, 2b + 1` are the
//! step's 16-block `b`; MXFP4: lanes `4b .. 4b + 3` its 32-block `b`), so the step's
//! eight products per lane are summed first and multiplied by one vector of block
//! scales: NVFP4's decoded from the 8 scale bytes with the E4M3 bit trick (`e4m3 *
//! 2^-120` times `global * 2^120`: one rounding, as `e4m3 * global`), MXFP4's E8M0
//! `2^(e - 127)` placed in the f32 exponent (exact; code 0, 2^-127, is the f32 subnormal
//! with only bit 22 set).
//!
//! AVX2, 32 inputs (16 bytes) per step ([`decode32_avx2`]): AVX2's `vpermps` has 8
//! entries, too few for a 16-entry table, and its cross-lane shuffles share one port on
//! many cores, so the codes are looked up with in-lane byte shuffles instead. Every value
//! these formats decode to before their scale (E2M1, and INT4's `c - z`) is exact in
//! bf16, so two `vpshufb` give the high and low byte of each code's bf16 value, two
//! unpacks pair them, and a shift or a mask makes each pair an f32: 10 instructions per
//! 32 weights, 4 of them shuffles. Each resulting vector lies in one scale block, so its
//! products are summed and scaled once per block ([`add_scaled_avx2`]).

use super::Isa;
use super::decode::{E2M1_VALUES, E4M3_F32_MASK, PackedFp4Rows};
#[cfg(target_arch = "x86_64")]
use super::lanes::{Avx2, Avx512, add_plain_steps};
use loraq_quant::{MXFP4_BLOCK, NVFP4_BLOCK};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// 2^120 (see `decode.rs`).
const E4M3_REBIAS: f32 = f32::from_bits((127 + 120) << 23);
/// Inputs per step of the AVX-512 loops.
const STEP: usize = 128;
/// Inputs per step of the AVX2 loops.
pub(crate) const AVX2_STEP: usize = 32;

/// Rows decoded step by step against an activation reordered by [`reorder_activation`]
/// (NVFP4, MXFP4 and INT4 group 128), AVX-512F/BW or AVX2 + FMA.
pub(crate) trait PairedRows: Sync {
    /// Output rows.
    fn rows(&self) -> usize;
    /// Inputs per row.
    fn cols(&self) -> usize;

    /// Adds `sum_k W[row0 + r, k] x_t[k]` to `out[r * T + t]` for `r < R`.
    ///
    /// # Safety
    /// The CPU has AVX-512F/BW; rows `row0 .. row0 + R` exist; `out` holds `R * T`
    /// values and `xd` `T * cols`, reordered for [`Isa::Avx512`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx512<const R: usize, const T: usize>(
        &self,
        row0: usize,
        xd: &[f32],
        out: &mut [f32],
    );

    /// As [`PairedRows::rows_avx512`], on AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; rows `row0 .. row0 + R` exist; `out` holds `R * T`
    /// values and `xd` `T * cols`, reordered for [`Isa::Avx2`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx2<const R: usize, const T: usize>(
        &self,
        row0: usize,
        xd: &[f32],
        out: &mut [f32],
    );

    /// `R` rows through `isa`'s loop.
    ///
    /// # Safety
    /// As [`PairedRows::rows_avx512`] or [`PairedRows::rows_avx2`], for `isa`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_simd<const R: usize, const T: usize>(
        &self,
        isa: Isa,
        row0: usize,
        xd: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match isa {
                Isa::Avx512 => self.rows_avx512::<R, T>(row0, xd, out),
                Isa::Avx2 => self.rows_avx2::<R, T>(row0, xd, out),
                Isa::Scalar => unreachable!("the paired loops need AVX2 or AVX-512"),
            }
        }
    }

    /// Adds `sum_k W[row0 + r, k] x_t[k]` to `out[r * T + t]` for `r < nrows`, `xd`
    /// being [`reorder_activation`]`(isa, x)` (`[T, cols]`), four rows at a time for one
    /// or two tokens (the activation loads are shared), two up to four tokens, else one.
    /// `isa` is AVX-512 or AVX2 ([`Isa`] values come from run-time detection).
    #[cfg(target_arch = "x86_64")]
    fn dot_rows<const T: usize>(
        &self,
        isa: Isa,
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
                // SAFETY: the ISA was detected at run time (`Isa::available`); bounds
                // asserted above.
                unsafe { self.rows_simd::<4, T>(isa, row0 + r, xd, &mut out[r * T..]) };
                r += 4;
            }
        }
        if T <= 4 {
            while r + 2 <= nrows {
                // SAFETY: as above.
                unsafe { self.rows_simd::<2, T>(isa, row0 + r, xd, &mut out[r * T..]) };
                r += 2;
            }
        }
        while r < nrows {
            // SAFETY: as above.
            unsafe { self.rows_simd::<1, T>(isa, row0 + r, xd, &mut out[r * T..]) };
            r += 1;
        }
    }
}

/// Position `p` of an AVX-512 step holds input `source(p)`: vector `q` (positions `16q ..
/// 16q + 15`) holds nibble `q` of the 16 dword lanes, inputs `8i + q`.
fn avx512_source(p: usize) -> usize {
    8 * (p % 16) + p / 16
}

/// Position `p` of an AVX2 step holds input `source(p)`: the order in which
/// [`decode32_avx2`] leaves the 32 weights of 16 code bytes in its four vectors.
fn avx2_source(p: usize) -> usize {
    let (vector, lane) = (p / 8, p % 8);
    16 * (vector / 2) + 2 * (vector % 2) + 4 * (lane % 4) + lane / 4
}

/// `x` (`[T, cols]`, rows `x_stride` apart) reordered step by step for `isa`'s paired
/// loop (128-input steps on AVX-512, 32 on AVX2) into `[T, cols]`; a trailing partial
/// step is copied unchanged.
pub(crate) fn reorder_activation(
    isa: Isa,
    x: &[f32],
    tokens: usize,
    cols: usize,
    x_stride: usize,
) -> Vec<f32> {
    let (step, source): (usize, fn(usize) -> usize) = if isa == Isa::Avx512 {
        (STEP, avx512_source)
    } else {
        (AVX2_STEP, avx2_source)
    };
    let mut out = vec![0f32; tokens * cols];
    for t in 0..tokens {
        let src = &x[t * x_stride..t * x_stride + cols];
        let dst = &mut out[t * cols..(t + 1) * cols];
        let full = cols / step * step;
        for (d, s) in dst[..full]
            .chunks_exact_mut(step)
            .zip(src[..full].chunks_exact(step))
        {
            for (p, v) in d.iter_mut().enumerate() {
                *v = s[source(p)];
            }
        }
        dst[full..].copy_from_slice(&src[full..]);
    }
    out
}

/// The 128 weights whose 4-bit codes are the 64 bytes at `codes`, looked up in the
/// 16-entry `table`, in the AVX-512 step order ([`avx512_source`]): vector `q` holds
/// nibble `q` of each of the 16 dword lanes (`vpermps` reads only the low 4 bits of
/// each index, so a shift by `4q` is all the unpacking).
///
/// # Safety
/// The CPU has AVX-512F; 64 bytes are readable at `codes`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(crate) unsafe fn decode128_avx512(codes: *const u8, table: __m512) -> [__m512; 8] {
    // SAFETY: 64 readable bytes (caller).
    let raw = unsafe { _mm512_loadu_si512(codes.cast()) };
    [
        _mm512_permutexvar_ps(raw, table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(raw), table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(raw), table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<12>(raw), table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<16>(raw), table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<20>(raw), table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<24>(raw), table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<28>(raw), table),
    ]
}

/// The low and high bytes of the bf16 encodings of 16 values that bf16 holds exactly:
/// the `vpshufb` tables of [`decode32_avx2`].
pub(crate) const fn bf16_byte_tables(values: [f32; 16]) -> [[u8; 16]; 2] {
    let mut tables = [[0u8; 16]; 2];
    let mut code = 0;
    while code < 16 {
        let bits = values[code].to_bits();
        assert!(bits & 0xFFFF == 0, "value not exact in bf16");
        tables[0][code] = (bits >> 16) as u8;
        tables[1][code] = (bits >> 24) as u8;
        code += 1;
    }
    tables
}

/// E2M1's byte tables.
const E2M1_BF16_BYTES: [[u8; 16]; 2] = bf16_byte_tables(E2M1_VALUES);

/// A pair of byte tables broadcast to both 128-bit lanes.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) fn load_byte_tables(tables: &[[u8; 16]; 2]) -> [__m256i; 2] {
    // SAFETY: each table is 16 bytes.
    unsafe { tables.map(|t| _mm256_broadcastsi128_si256(_mm_loadu_si128(t.as_ptr().cast()))) }
}

/// The 32 weights whose 4-bit codes are the 16 bytes at `codes` (input `2j` in the low
/// nibble of byte `j`, `2j + 1` in the high one), looked up in `tables`
/// ([`bf16_byte_tables`]), as four f32 vectors in the order [`avx2_source`] gives:
/// vectors 0 and 1 hold inputs 0..16, vectors 2 and 3 inputs 16..32.
///
/// # Safety
/// The CPU has AVX2; 16 bytes are readable at `codes`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn decode32_avx2(codes: *const u8, tables: &[__m256i; 2]) -> [__m256; 4] {
    // SAFETY: 16 readable bytes (caller).
    let raw = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(codes.cast())) };
    // Low lane: the low nibbles (even inputs); high lane: the high nibbles (odd inputs).
    let nibbles = _mm256_and_si256(
        _mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
        _mm256_set1_epi8(0x0F),
    );
    let low = _mm256_shuffle_epi8(tables[0], nibbles);
    let high = _mm256_shuffle_epi8(tables[1], nibbles);
    // 16-bit bf16 values: bytes 0..8 of each lane, then bytes 8..16.
    let first = _mm256_unpacklo_epi8(low, high);
    let second = _mm256_unpackhi_epi8(low, high);
    let upper = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
    [
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(first)),
        _mm256_castsi256_ps(_mm256_and_si256(first, upper)),
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(second)),
        _mm256_castsi256_ps(_mm256_and_si256(second, upper)),
    ]
}

/// `acc[t] += scale * sum_v w[v] * x_t[v]`, `x_t[v]` the 8 floats at `x + t * x_stride +
/// 8 * v`. One or two tokens: each token's products are summed, then scaled once; more:
/// the weights are scaled once and shared by the tokens.
///
/// # Safety
/// The CPU has AVX2 and FMA; `x + t * x_stride + 8 * v .. + 8` is readable for every
/// `t < T`, `v < N`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn add_scaled_avx2<const T: usize, const N: usize>(
    acc: &mut [__m256; T],
    w: &[__m256; N],
    scale: __m256,
    x: *const f32,
    x_stride: usize,
) {
    // SAFETY: readable activations (caller).
    unsafe {
        if T <= 2 {
            for (t, a) in acc.iter_mut().enumerate() {
                let xt = x.add(t * x_stride);
                let mut p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xt));
                for (v, &wv) in w.iter().enumerate().skip(1) {
                    p = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xt.add(8 * v)), p);
                }
                *a = _mm256_fmadd_ps(p, scale, *a);
            }
        } else {
            let scaled = w.map(|wv| _mm256_mul_ps(wv, scale));
            for (t, a) in acc.iter_mut().enumerate() {
                let xt = x.add(t * x_stride);
                for (v, &wv) in scaled.iter().enumerate() {
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xt.add(8 * v)), *a);
                }
            }
        }
    }
}

/// NVFP4 (`BLOCK` 16) or MXFP4 (`BLOCK` 32) rows with the de-interleaved decode.
pub(crate) struct PairedFp4Rows<'a, const BLOCK: usize> {
    /// The weight (codes, scales, dimensions; its decoder serves the trailing inputs).
    pub rows: PackedFp4Rows<'a, BLOCK>,
    /// NVFP4: `global_scale * 2^120`, finite (else this decoder is not used); MXFP4: 1.
    /// (The AVX-512 loop's; the AVX2 loop reads `rows.scale_table`.)
    pub scale_multiplier: f32,
}

/// The `scale_multiplier` of an NVFP4 weight's [`PairedFp4Rows`], `global_scale *
/// 2^120`; `None` where that is not finite and the paired decoder cannot serve it.
pub(crate) fn nvfp4_scale_multiplier(global_scale: f32) -> Option<f32> {
    Some(global_scale * E4M3_REBIAS).filter(|m| m.is_finite())
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
        // SAFETY: pointer arithmetic: rows row0..row0 + R exist (caller); step c's 64
        // bytes end at (c + 1) * 64 <= row_bytes; xd holds T rows of cols elements.
        unsafe {
            for c in 0..steps {
                for r in 0..R {
                    super::prefetch_ahead(pp.wrapping_add((row0 + r) * row_bytes + c * 64));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let w = decode128_avx512(pp.add((row0 + r) * row_bytes + c * 64), table);
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
            // the plain decoder.
            add_plain_steps::<Avx512, _, R, T>(
                &mut acc,
                &self.rows,
                row0,
                xp,
                cols,
                steps * STEP,
                cols,
            );
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                out[r * T + t] += _mm512_reduce_add_ps(*a);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_avx2<const R: usize, const T: usize>(
        &self,
        row0: usize,
        xd: &[f32],
        out: &mut [f32],
    ) {
        let cols = self.rows.cols;
        let row_bytes = cols / 2;
        let blocks = cols / BLOCK;
        let steps = cols / AVX2_STEP;
        let pp = self.rows.packed.as_ptr();
        let scale_codes = self.rows.block_scales;
        let scale_table = self.rows.scale_table;
        let xp = xd.as_ptr();
        let tables = load_byte_tables(&E2M1_BF16_BYTES);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        // SAFETY: pointer arithmetic: rows row0..row0 + R exist (caller); step j's 16
        // bytes end at (j + 1) * 16 <= row_bytes and its blocks below `blocks`; xd holds
        // T rows of cols elements.
        unsafe {
            for j in 0..steps {
                if j % 4 == 0 {
                    for r in 0..R {
                        super::prefetch_ahead(pp.wrapping_add((row0 + r) * row_bytes + 16 * j));
                    }
                }
                let x = xp.add(j * AVX2_STEP);
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let [w0, w1, w2, w3] =
                        decode32_avx2(pp.add((row0 + r) * row_bytes + 16 * j), &tables);
                    let scale = |b: usize| {
                        let code = *scale_codes.get_unchecked((row0 + r) * blocks + b);
                        _mm256_set1_ps(*scale_table.get_unchecked(usize::from(code)))
                    };
                    if BLOCK == NVFP4_BLOCK {
                        add_scaled_avx2(acc_r, &[w0, w1], scale(2 * j), x, cols);
                        add_scaled_avx2(acc_r, &[w2, w3], scale(2 * j + 1), x.add(16), cols);
                    } else {
                        debug_assert_eq!(BLOCK, MXFP4_BLOCK);
                        add_scaled_avx2(acc_r, &[w0, w1, w2, w3], scale(j), x, cols);
                    }
                }
            }
            // Trailing inputs (NVFP4 in-dims of 16 mod 32): 8 at a time through the plain
            // decoder.
            let from = steps * AVX2_STEP;
            add_plain_steps::<Avx2, _, R, T>(&mut acc, &self.rows, row0, xp, cols, from, cols);
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                out[r * T + t] += super::gemv::hsum256(*a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use loraq_quant::element::e2m1_decode;

    /// Each step position reads a distinct input, for both layouts.
    #[test]
    fn reorderings_are_permutations() {
        for (step, source) in [
            (STEP, avx512_source as fn(usize) -> usize),
            (AVX2_STEP, avx2_source),
        ] {
            let mut seen = vec![false; step];
            for p in 0..step {
                assert!(!std::mem::replace(&mut seen[source(p)], true));
            }
        }
    }

    /// The AVX2 byte-table decode puts E2M1 code of input `avx2_source(p)` at position
    /// `p`, for every code in both nibbles of every byte position.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn decode32_avx2_matches_e2m1_in_layout_order() {
        if !Isa::available().contains(&Isa::Avx2) {
            return;
        }
        for first in 0..=255u8 {
            let codes: [u8; 16] = std::array::from_fn(|j| first.wrapping_add(37 * j as u8));
            // SAFETY: AVX2 detected above; 16 readable bytes.
            let vectors = unsafe {
                let tables = load_byte_tables(&E2M1_BF16_BYTES);
                decode32_avx2(codes.as_ptr(), &tables)
            };
            let lanes: Vec<f32> = vectors
                .iter()
                .flat_map(|v| {
                    let mut a = [0f32; 8];
                    // SAFETY: 8 floats.
                    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), *v) };
                    a
                })
                .collect();
            for (p, lane) in lanes.iter().enumerate() {
                let input = avx2_source(p);
                let code = (codes[input / 2] >> (4 * (input % 2))) & 0x0F;
                assert_eq!(lane.to_bits(), e2m1_decode(code).to_bits(), "position {p}");
            }
        }
    }
}
