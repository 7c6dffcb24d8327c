//! Decode rows of an fp8-block128 weight with the tile scale moved into the activation.
//!
//! All rows of one 128-row band share their tile multipliers, so instead of scaling every
//! weight (`e4m3 * s`) the band's activation is scaled once: `xs[k] = x[k] * s[band,
//! k / 128] * 2^(120 - e)`. The inner loop then turns a code into f32 lanes with three
//! integer ops (sign-extend, shift, mask: the E4M3 value times 2^-120, exact including
//! subnormals) and one FMA against `xs`, and the row's sum is multiplied by `2^e` at the
//! end. `e >= 0` is chosen per token and band so that `xs` and the scaled tile
//! multipliers stay finite; the f32 products are then the true products times `2^-e`,
//! so no extra underflow happens where the plain product would not underflow.

#[cfg(target_arch = "x86_64")]
use super::lanes::{Avx2, Avx512, Lanes};
use loraq_quant::FP8_BLOCK;

/// Elements between two software prefetches of a row (one 64-byte line of codes).
#[cfg(target_arch = "x86_64")]
const PREFETCH_EVERY: usize = 64;

/// `2^e` for `-126 <= e <= 127`.
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((127 + e) as u32) << 23)
}

/// fp8-block128 rows with the banded decode.
pub(crate) struct Fp8BandedRows<'a> {
    pub codes: &'a [u8],
    pub scales: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub scale_cols: usize,
    /// [`tile_amax`] of the activation, `[T, scale_cols]`.
    pub tile_amax: &'a [f32],
}

/// Largest `|x_t[k]|` per token and 128-wide column tile, `[tokens, ceil(cols / 128)]`
/// (computed once per call; every band needs it). A NaN gives NaN.
pub(crate) fn tile_amax(x: &[f32], tokens: usize, cols: usize, x_stride: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(tokens * cols.div_ceil(FP8_BLOCK));
    for t in 0..tokens {
        for seg in x[t * x_stride..t * x_stride + cols].chunks(FP8_BLOCK) {
            // |x| as bits: an integer max orders non-negative floats (NaN above
            // infinity) and vectorizes, unlike f32::max.
            let bits = seg
                .iter()
                .fold(0u32, |a, v| a.max(v.to_bits() & 0x7FFF_FFFF));
            out.push(f32::from_bits(bits));
        }
    }
    out
}

/// The activations of one band, scaled by its tile multipliers.
#[derive(Default)]
pub(crate) struct BandActivations {
    /// Band these were built for.
    band: Option<usize>,
    /// `[T, cols]`: `x_t[k] * s[band, k / 128] * 2^(120 - e_t)`.
    xs: Vec<f32>,
    /// `2^e_t` per token.
    post: Vec<f32>,
}

impl Fp8BandedRows<'_> {
    /// One weight, dequantized (the tail inputs past the last multiple of 16).
    #[inline(always)]
    fn get(&self, row: usize, k: usize) -> f32 {
        loraq_quant::element::e4m3_decode(self.codes[row * self.cols + k])
            * self.scales[(row / FP8_BLOCK) * self.scale_cols + k / FP8_BLOCK]
    }

    /// Builds (or keeps, when already built for `band`) the scaled activations of `band`
    /// for `T` tokens of `x` (`x_stride` apart).
    fn prepare_band<const T: usize>(
        &self,
        band: usize,
        x: &[f32],
        x_stride: usize,
        acts: &mut BandActivations,
    ) {
        if acts.band == Some(band) && acts.post.len() == T {
            return;
        }
        let cols = self.cols;
        acts.xs.resize(T * cols, 0.0);
        acts.post.resize(T, 1.0);
        let tile_scales = &self.scales[band * self.scale_cols..(band + 1) * self.scale_cols];
        for t in 0..T {
            let xt = &x[t * x_stride..t * x_stride + cols];
            let amax = &self.tile_amax[t * self.scale_cols..(t + 1) * self.scale_cols];
            // Largest |x s| and |s| of the band: e keeps both below 2^126 once scaled.
            let mut largest = 0f32;
            for (&a, &s) in amax.iter().zip(tile_scales) {
                if a.is_nan() {
                    largest = f32::NAN;
                    break;
                }
                largest = largest.max(a * s.abs()).max(s.abs());
            }
            let e = if largest.is_finite() && largest > 0.0 {
                let floor_log2 = ((largest.to_bits() >> 23) & 0xFF) as i32 - 127;
                (floor_log2 - 6).clamp(0, 127)
            } else {
                0
            };
            let shift = pow2(120 - e);
            let xs_t = &mut acts.xs[t * cols..(t + 1) * cols];
            for ((dst, src), &s) in xs_t
                .chunks_mut(FP8_BLOCK)
                .zip(xt.chunks(FP8_BLOCK))
                .zip(tile_scales)
            {
                let f = s * shift;
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d = v * f;
                }
            }
            acts.post[t] = pow2(e);
        }
        acts.band = Some(band);
    }

    /// Adds `sum_k W[row0 + r, k] x_t[k]` to `out[r * T + t]` for `r < nrows`, with
    /// AVX-512F/BW (`WIDE`) or AVX2 + FMA; the caller checked the CPU has them.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn dot_rows_simd<const T: usize, const WIDE: bool>(
        &self,
        row0: usize,
        nrows: usize,
        x: &[f32],
        x_stride: usize,
        out: &mut [f32],
        acts: &mut BandActivations,
    ) {
        assert!(row0 + nrows <= self.rows);
        assert!(out.len() >= nrows * T);
        assert!(T == 0 || (T - 1) * x_stride + self.cols <= x.len());
        let mut r = 0;
        while r < nrows {
            let row = row0 + r;
            let band = row / FP8_BLOCK;
            let band_end = ((band + 1) * FP8_BLOCK).min(row0 + nrows);
            self.prepare_band::<T>(band, x, x_stride, acts);
            let mut rr = row;
            let out_band = |rr: usize| (rr - row0) * T;
            // Few tokens: four rows per pass share every activation load.
            if T <= 2 {
                while rr + 4 <= band_end {
                    // SAFETY: AVX-512 detected by the caller; rows in range.
                    unsafe { self.rows::<4, T, WIDE>(rr, acts, &mut out[out_band(rr)..]) };
                    rr += 4;
                }
            }
            while rr + 2 <= band_end {
                // SAFETY: as above.
                unsafe { self.rows::<2, T, WIDE>(rr, acts, &mut out[out_band(rr)..]) };
                rr += 2;
            }
            if rr < band_end {
                // SAFETY: as above.
                unsafe { self.rows::<1, T, WIDE>(rr, acts, &mut out[out_band(rr)..]) };
            }
            // Inputs past the last multiple of the width: plain decode, unscaled x.
            let main = if WIDE {
                self.cols / 16 * 16
            } else {
                self.cols / 8 * 8
            };
            for rr in row..band_end {
                for t in 0..T {
                    let xt = &x[t * x_stride..];
                    let tail: f32 = (main..self.cols).map(|k| self.get(rr, k) * xt[k]).sum();
                    out[out_band(rr) + t] += tail;
                }
            }
            r = band_end - row0;
        }
    }

    /// # Safety
    /// The CPU has AVX-512F/BW (`WIDE`) or AVX2 + FMA; rows `row0 .. row0 + R` exist.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn rows<const R: usize, const T: usize, const WIDE: bool>(
        &self,
        row0: usize,
        acts: &BandActivations,
        out: &mut [f32],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            if WIDE {
                self.rows_avx512::<R, T>(row0, acts, out)
            } else {
                self.rows_avx2::<R, T>(row0, acts, out)
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_avx2<const R: usize, const T: usize>(
        &self,
        row0: usize,
        acts: &BandActivations,
        out: &mut [f32],
    ) {
        // SAFETY: AVX2, FMA and the rows (caller).
        unsafe { self.rows_lanes::<Avx2, R, T>(row0, acts, out) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn rows_avx512<const R: usize, const T: usize>(
        &self,
        row0: usize,
        acts: &BandActivations,
        out: &mut [f32],
    ) {
        // SAFETY: AVX-512F/BW and the rows (caller).
        unsafe { self.rows_lanes::<Avx512, R, T>(row0, acts, out) }
    }

    /// The body of [`Self::rows_avx512`] and [`Self::rows_avx2`], inlined into each:
    /// `L::WIDTH` codes of each row at a time against the band's scaled activations.
    ///
    /// # Safety
    /// The CPU has `L`'s features; rows `row0 .. row0 + R` exist.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn rows_lanes<L: Lanes, const R: usize, const T: usize>(
        &self,
        row0: usize,
        acts: &BandActivations,
        out: &mut [f32],
    ) {
        let cols = self.cols;
        let main = cols / L::WIDTH * L::WIDTH;
        let xp = acts.xs.as_ptr();
        let cp = self.codes.as_ptr();
        // SAFETY: L's features (caller).
        let mut acc = [[unsafe { L::zero() }; T]; R];
        let mut k = 0;
        // SAFETY: L's features (caller); pointer arithmetic: rows row0..row0 + R exist
        // (caller), k + WIDTH <= cols, xs holds T rows of cols elements.
        unsafe {
            while k < main {
                if k % PREFETCH_EVERY == 0 {
                    for r in 0..R {
                        super::prefetch_ahead(cp.wrapping_add((row0 + r) * cols + k));
                    }
                }
                let mut xv = [L::zero(); T];
                for (t, v) in xv.iter_mut().enumerate() {
                    *v = L::load(xp.add(t * cols + k));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let w = L::e4m3_unbiased(cp.add((row0 + r) * cols + k));
                    for (a, &xt) in acc_r.iter_mut().zip(&xv) {
                        *a = L::fmadd(w, xt, *a);
                    }
                }
                k += L::WIDTH;
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                // SAFETY: L's features (caller).
                out[r * T + t] += unsafe { L::sum(*a) } * acts.post[t];
            }
        }
    }
}
