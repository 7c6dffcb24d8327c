//! Decode rows of an INT4 group-128 weight, one group (128 inputs, 64 bytes) per step,
//! against the same reordered activation as the NVFP4 loop ([`super::gemv_fp4`]).
//!
//! The step's 64 bytes are loaded as 16 dword lanes; nibble `q` of every lane comes from
//! a shift by `4q` and one `vpermps` on a 16-entry table that already holds the group's
//! dequantized values `(c - z) * s` for every code `c` (3 ops per row and group), so the
//! loop has no per-weight multiply and the weights equal the scalar decode bit for bit.
//! Inputs past the last whole group go through the generic 16-wide and scalar decode.

use super::decode::{Int4Rows, RowDecode};
use super::gemv_fp4::PairedRows;
use crate::weight::INT4_GROUP;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// INT4 rows with the per-group table decode.
pub(crate) struct Int4TableRows<'a> {
    pub rows: Int4Rows<'a>,
}

impl PairedRows for Int4TableRows<'_> {
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
        let d = &self.rows;
        let cols = d.cols;
        let row_bytes = cols.div_ceil(2);
        let groups = cols.div_ceil(INT4_GROUP);
        let steps = cols / INT4_GROUP;
        let pp = d.packed.as_ptr();
        let xp = xd.as_ptr();
        let codes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        // SAFETY (pointer arithmetic): rows row0..row0 + R exist (caller); step c's 64
        // bytes end at (c + 1) * 64 <= row_bytes; xd holds T rows of cols elements;
        // group indices are below rows * groups.
        unsafe {
            for c in 0..steps {
                for r in 0..R {
                    super::prefetch_ahead(pp.wrapping_add((row0 + r) * row_bytes + c * 64));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let g = (row0 + r) * groups + c;
                    let zero = _mm512_set1_epi32(i32::from(*d.zeros.get_unchecked(g)));
                    let table = _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_sub_epi32(codes, zero)),
                        _mm512_set1_ps(*d.scales.get_unchecked(g)),
                    );
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
                    for (t, a) in acc_r.iter_mut().enumerate() {
                        let x = xp.add(t * cols + c * INT4_GROUP);
                        for (q, &wq) in w.iter().enumerate() {
                            *a = _mm512_fmadd_ps(wq, _mm512_loadu_ps(x.add(16 * q)), *a);
                        }
                    }
                }
            }
            // The partial last group: 16 at a time, then one by one (xd is in input
            // order there).
            let mut k = steps * INT4_GROUP;
            while k + 16 <= cols {
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let w = d.load16(row0 + r, k);
                    for (t, a) in acc_r.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp.add(t * cols + k)), *a);
                    }
                }
                k += 16;
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                let tail: f32 = (k_tail(cols)..cols)
                    .map(|k| d.get(row0 + r, k) * xd[t * cols + k])
                    .sum();
                out[r * T + t] += _mm512_reduce_add_ps(*a) + tail;
            }
        }
    }
}

/// First input that neither a whole group nor a 16-wide run covers.
fn k_tail(cols: usize) -> usize {
    let steps_end = cols / INT4_GROUP * INT4_GROUP;
    steps_end + (cols - steps_end) / 16 * 16
}
