//! One loop body for both x86-64 vector widths.
//!
//! Several decode loops are the same on AVX-512 and AVX2 but for the width of their f32
//! vectors and the intrinsics' names. [`Lanes`] names those few operations once per
//! width ([`Avx512`], [`Avx2`]); a loop written once over `L: Lanes` and marked
//! `#[inline(always)]` is compiled per ISA by calling it from a `#[target_feature]`
//! function of that width, so each width still gets its own fully inlined body.

use super::decode::{E4M3_F32_MASK, RowDecode};
use std::arch::x86_64::*;

/// The f32 vector operations of one SIMD width.
///
/// # Safety
/// Every method needs the CPU features of its width (AVX-512F/BW for [`Avx512`], AVX2
/// and FMA for [`Avx2`]). They are `#[inline(always)]`, meant to be inlined into a
/// function compiled with those features (no function of their own is ever called).
pub(crate) trait Lanes {
    /// The f32 vector (`__m512` or `__m256`).
    type F32: Copy;
    /// f32 lanes per vector.
    const WIDTH: usize;
    /// All lanes 0.
    ///
    /// # Safety
    /// The CPU has this width's features (trait doc).
    unsafe fn zero() -> Self::F32;
    /// All lanes `v`.
    ///
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn splat(v: f32) -> Self::F32;
    /// `WIDTH` f32 from `p` (unaligned).
    ///
    /// # Safety
    /// As [`Lanes::zero`], and `p .. p + WIDTH` is readable.
    unsafe fn load(p: *const f32) -> Self::F32;
    /// `a * b`, lane by lane.
    ///
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn mul(a: Self::F32, b: Self::F32) -> Self::F32;
    /// `a * b + c`, lane by lane, one rounding.
    ///
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn fmadd(a: Self::F32, b: Self::F32, c: Self::F32) -> Self::F32;
    /// Sum of the lanes.
    ///
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn sum(v: Self::F32) -> f32;
    /// `WIDTH` elements of `row` from `k`, dequantized: [`RowDecode::load16`] or
    /// [`RowDecode::load8`].
    ///
    /// # Safety
    /// As [`Lanes::zero`], and the [`RowDecode`] contract for that load.
    unsafe fn decode<D: RowDecode>(d: &D, row: usize, k: usize) -> Self::F32;
    /// The `WIDTH` E4M3 codes at `codes` as f32 values times 2^-120: sign-extended code
    /// << 20 puts the sign in bit 31 and exponent and mantissa at the top of f32's
    /// fields; the mask clears the sign copies in between (exact, subnormals included).
    ///
    /// # Safety
    /// As [`Lanes::zero`], and `codes .. codes + WIDTH` is readable.
    unsafe fn e4m3_unbiased(codes: *const u8) -> Self::F32;
}

/// AVX-512F/BW: 16 lanes.
pub(crate) struct Avx512;

/// AVX2 and FMA: 8 lanes.
pub(crate) struct Avx2;

impl Lanes for Avx512 {
    type F32 = __m512;
    const WIDTH: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: AVX-512F (caller).
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m512 {
        // SAFETY: AVX-512F (caller).
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: AVX-512F and 16 readable f32 (caller).
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F (caller).
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: AVX-512F (caller).
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn sum(v: __m512) -> f32 {
        // SAFETY: AVX-512F (caller).
        unsafe { _mm512_reduce_add_ps(v) }
    }
    #[inline(always)]
    unsafe fn decode<D: RowDecode>(d: &D, row: usize, k: usize) -> __m512 {
        // SAFETY: AVX-512F/BW and the load's contract (caller).
        unsafe { d.load16(row, k) }
    }
    #[inline(always)]
    unsafe fn e4m3_unbiased(codes: *const u8) -> __m512 {
        // SAFETY: AVX-512F/BW and 16 readable bytes (caller).
        unsafe {
            let raw = _mm_loadu_si128(codes.cast());
            let v = _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(raw));
            _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(E4M3_F32_MASK)))
        }
    }
}

impl Lanes for Avx2 {
    type F32 = __m256;
    const WIDTH: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: AVX (caller).
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m256 {
        // SAFETY: AVX (caller).
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: AVX and 8 readable f32 (caller).
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX (caller).
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: FMA (caller).
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn sum(v: __m256) -> f32 {
        // SAFETY: AVX2 (caller).
        unsafe { super::gemv::hsum256(v) }
    }
    #[inline(always)]
    unsafe fn decode<D: RowDecode>(d: &D, row: usize, k: usize) -> __m256 {
        // SAFETY: AVX2, FMA and the load's contract (caller).
        unsafe { d.load8(row, k) }
    }
    #[inline(always)]
    unsafe fn e4m3_unbiased(codes: *const u8) -> __m256 {
        // SAFETY: AVX2 and 8 readable bytes (caller).
        unsafe {
            let raw = _mm_loadl_epi64(codes.cast());
            let v = _mm256_slli_epi32::<20>(_mm256_cvtepi8_epi32(raw));
            _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(E4M3_F32_MASK)))
        }
    }
}

/// `acc[r][t] += D[row0 + r, k .. k + WIDTH] . x[t * x_stride + k ..]` for `k` from
/// `from` in steps of `L::WIDTH` while a whole step fits below `to`, through the plain
/// decoder: the inputs past the last whole step of a paired loop ([`super::gemv_fp4`],
/// [`super::gemv_int4`]), where the reordered activation is in input order.
///
/// # Safety
/// The CPU has `L`'s features; rows `row0 .. row0 + R` exist, `from` is a multiple of
/// `L::WIDTH` and `to <= d.cols()`; `x + t * x_stride + k .. + WIDTH` is readable for
/// every `t < T` and step `k`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn add_plain_steps<L: Lanes, D: RowDecode, const R: usize, const T: usize>(
    acc: &mut [[L::F32; T]; R],
    d: &D,
    row0: usize,
    x: *const f32,
    x_stride: usize,
    from: usize,
    to: usize,
) {
    let mut k = from;
    while k + L::WIDTH <= to {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: L's features, the RowDecode contract and readable activations
            // (caller).
            unsafe {
                let w = L::decode(d, row0 + r, k);
                for (t, a) in acc_r.iter_mut().enumerate() {
                    *a = L::fmadd(w, L::load(x.add(t * x_stride + k)), *a);
                }
            }
        }
        k += L::WIDTH;
    }
}
