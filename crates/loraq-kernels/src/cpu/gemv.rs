//! Decode-shaped products (1 to 8 tokens): one pass over the weight, each row segment
//! dequantized in registers and multiplied into every token's accumulator before the
//! next segment is loaded, so the weight is streamed exactly once per call.

use super::Isa;
use super::decode::RowDecode;
#[cfg(target_arch = "x86_64")]
use super::lanes::{Avx2, Avx512, Lanes};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Elements between two software prefetches of a row (one 64-byte line of fp8 codes).
#[cfg(target_arch = "x86_64")]
const PREFETCH_EVERY: usize = 64;

/// Adds `sum_k D[row0 + r, k] * x[t * x_stride + k]` to `out[r * T + t]` for `r < nrows`.
///
/// `x` holds `T` token rows of at least `d.cols()` elements each, `x_stride` apart.
pub(crate) fn dot_rows<D: RowDecode, const T: usize>(
    isa: Isa,
    d: &D,
    row0: usize,
    nrows: usize,
    x: &[f32],
    x_stride: usize,
    out: &mut [f32],
) {
    assert!(row0 + nrows <= d.rows());
    assert!(out.len() >= nrows * T);
    assert!(T == 0 || (T - 1) * x_stride + d.cols() <= x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            let mut r = 0;
            // Few tokens: four rows per pass share the loop and each x load over more
            // rows than two (docs/kernels-log.md, "Decode").
            if T <= 2 {
                while r + 4 <= nrows {
                    // SAFETY: Isa::Avx512 is only constructed after runtime detection;
                    // bounds asserted above.
                    unsafe { rows_avx512::<D, 4, T>(d, row0 + r, x, x_stride, &mut out[r * T..]) };
                    r += 4;
                }
            }
            while r + 2 <= nrows {
                // SAFETY: Isa::Avx512 is only constructed after runtime detection; bounds
                // asserted above.
                unsafe { rows_avx512::<D, 2, T>(d, row0 + r, x, x_stride, &mut out[r * T..]) };
                r += 2;
            }
            if r < nrows {
                // SAFETY: as above.
                unsafe { rows_avx512::<D, 1, T>(d, row0 + r, x, x_stride, &mut out[r * T..]) };
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            let mut r = 0;
            if T <= 2 {
                while r + 4 <= nrows {
                    // SAFETY: Isa::Avx2 is only constructed after runtime detection.
                    unsafe { rows_avx2::<D, 4, T>(d, row0 + r, x, x_stride, &mut out[r * T..]) };
                    r += 4;
                }
            }
            if T <= 4 {
                while r + 2 <= nrows {
                    // SAFETY: Isa::Avx2 is only constructed after runtime detection.
                    unsafe { rows_avx2::<D, 2, T>(d, row0 + r, x, x_stride, &mut out[r * T..]) };
                    r += 2;
                }
            }
            while r < nrows {
                // SAFETY: as above.
                unsafe { rows_avx2::<D, 1, T>(d, row0 + r, x, x_stride, &mut out[r * T..]) };
                r += 1;
            }
        }
        Isa::Scalar => rows_scalar::<D, T>(d, row0, nrows, x, x_stride, out),
    }
}

fn rows_scalar<D: RowDecode, const T: usize>(
    d: &D,
    row0: usize,
    nrows: usize,
    x: &[f32],
    x_stride: usize,
    out: &mut [f32],
) {
    let cols = d.cols();
    for r in 0..nrows {
        let mut acc = [0f32; T];
        for k in 0..cols {
            let w = d.get(row0 + r, k);
            for (t, a) in acc.iter_mut().enumerate() {
                *a += w * x[t * x_stride + k];
            }
        }
        for (t, a) in acc.iter().enumerate() {
            out[r * T + t] += a;
        }
    }
}

/// [`rows_simd`] on AVX-512.
///
/// # Safety
/// The CPU has AVX-512F/BW; as [`rows_simd`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn rows_avx512<D: RowDecode, const R: usize, const T: usize>(
    d: &D,
    row0: usize,
    x: &[f32],
    x_stride: usize,
    out: &mut [f32],
) {
    // SAFETY: AVX-512F/BW and the bounds (caller).
    unsafe { rows_simd::<Avx512, D, R, T>(d, row0, x, x_stride, out) }
}

/// Sum of the 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum256(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// [`rows_simd`] on AVX2.
///
/// # Safety
/// The CPU has AVX2 and FMA; as [`rows_simd`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2<D: RowDecode, const R: usize, const T: usize>(
    d: &D,
    row0: usize,
    x: &[f32],
    x_stride: usize,
    out: &mut [f32],
) {
    // SAFETY: AVX2, FMA and the bounds (caller).
    unsafe { rows_simd::<Avx2, D, R, T>(d, row0, x, x_stride, out) }
}

/// Adds `sum_k D[row0 + r, k] * x[t * x_stride + k]` to `out[r * T + t]` for `r < R`,
/// `L::WIDTH` inputs at a time, the last `cols % L::WIDTH` one by one: the body of
/// [`rows_avx512`] and [`rows_avx2`], inlined into each.
///
/// # Safety
/// The CPU has `L`'s features; rows `row0 .. row0 + R` exist, `out` holds `R * T`
/// values and `x` `T` rows of `d.cols()` from `t * x_stride` (asserted by [`dot_rows`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_simd<L: Lanes, D: RowDecode, const R: usize, const T: usize>(
    d: &D,
    row0: usize,
    x: &[f32],
    x_stride: usize,
    out: &mut [f32],
) {
    let cols = d.cols();
    let main = cols / L::WIDTH * L::WIDTH;
    let xp = x.as_ptr();
    // SAFETY: L's features (caller).
    let mut acc = [[unsafe { L::zero() }; T]; R];
    let mut k = 0;
    while k < main {
        if k % PREFETCH_EVERY == 0 {
            for r in 0..R {
                super::prefetch_ahead(d.code_address(row0 + r, k));
            }
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: k % WIDTH == 0, k + WIDTH <= cols, row in range (caller).
            let w = unsafe { L::decode(d, row0 + r, k) };
            for (t, a) in acc_r.iter_mut().enumerate() {
                // SAFETY: token t's row has cols elements from t * x_stride (caller).
                unsafe { *a = L::fmadd(w, L::load(xp.add(t * x_stride + k)), *a) };
            }
        }
        k += L::WIDTH;
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (t, a) in acc_r.iter().enumerate() {
            // SAFETY: L's features (caller).
            let mut s = unsafe { L::sum(*a) };
            for k in main..cols {
                s += d.get(row0 + r, k) * x[t * x_stride + k];
            }
            out[r * T + t] += s;
        }
    }
}
