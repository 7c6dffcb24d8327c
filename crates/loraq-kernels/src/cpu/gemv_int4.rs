//! Decode rows of an INT4 group-128 weight against the same reordered activation as the
//! NVFP4 loop ([`super::gemv_fp4`]).
//!
//! AVX-512, one group (128 inputs, 64 bytes) per step: the step's 64 bytes are loaded as
//! 16 dword lanes; nibble `q` of every lane comes from a shift by `4q` and one `vpermps`
//! on a 16-entry table that already holds the group's dequantized values `(c - z) * s`
//! for every code `c` (3 ops per row and group), so the loop has no per-weight multiply
//! and the weights equal the scalar decode bit for bit. Inputs past the last whole group
//! go through the generic 16-wide and scalar decode.
//!
//! AVX2, 32 inputs (16 bytes) per step: the byte-table decode of
//! [`super::gemv_fp4::decode32_avx2`] on the integers `c - z` (exact in bf16; one table
//! pair per zero point, [`INT4_BF16_BYTES`]), each step's products summed and multiplied
//! by its group's scale once (1-2 tokens; more share the weights scaled once). A step
//! never straddles two groups (128 is 4 steps), so a
//! partial last group's whole steps take this path too; the last `cols % 32` inputs are
//! decoded one by one.

use super::decode::{Int4Rows, RowDecode};
use super::gemv_fp4::{
    AVX2_STEP, PairedRows, add_scaled_avx2, bf16_byte_tables, decode32_avx2, decode128_avx512,
    load_byte_tables,
};
#[cfg(target_arch = "x86_64")]
use super::lanes::{Avx512, add_plain_steps};
use loraq_quant::INT4_GROUP;

/// For each zero point `z` (0..=15), the [`bf16_byte_tables`] of `c - z` for codes `c`.
const INT4_BF16_BYTES: [[[u8; 16]; 2]; 16] = {
    let mut tables = [[[0u8; 16]; 2]; 16];
    let mut zero = 0;
    while zero < 16 {
        let mut values = [0f32; 16];
        let mut code = 0;
        while code < 16 {
            values[code] = (code as i32 - zero as i32) as f32;
            code += 1;
        }
        tables[zero] = bf16_byte_tables(values);
        zero += 1;
    }
    tables
};

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
        // SAFETY: pointer arithmetic: rows row0..row0 + R exist (caller); step c's 64
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
                    let w = decode128_avx512(pp.add((row0 + r) * row_bytes + c * 64), table);
                    for (t, a) in acc_r.iter_mut().enumerate() {
                        let x = xp.add(t * cols + c * INT4_GROUP);
                        for (q, &wq) in w.iter().enumerate() {
                            *a = _mm512_fmadd_ps(wq, _mm512_loadu_ps(x.add(16 * q)), *a);
                        }
                    }
                }
            }
            // The partial last group: 16 at a time, then one by one (after the loop).
            let from = steps * INT4_GROUP;
            add_plain_steps::<Avx512, _, R, T>(&mut acc, d, row0, xp, cols, from, cols);
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                let tail = tail_dot(d, row0 + r, k_tail(cols), &xd[t * cols..]);
                out[r * T + t] += _mm512_reduce_add_ps(*a) + tail;
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
        let d = &self.rows;
        let cols = d.cols;
        let row_bytes = cols.div_ceil(2);
        let groups = cols.div_ceil(INT4_GROUP);
        let steps = cols / AVX2_STEP;
        let pp = d.packed.as_ptr();
        let xp = xd.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        // SAFETY: pointer arithmetic: rows row0..row0 + R exist (caller); step j's 16
        // bytes end at (j + 1) * 16 <= row_bytes; xd holds T rows of cols elements; group
        // indices are below rows * groups and zero points at most 15 (checked at
        // construction).
        unsafe {
            for j in 0..steps {
                if j % 4 == 0 {
                    for r in 0..R {
                        super::prefetch_ahead(pp.wrapping_add((row0 + r) * row_bytes + 16 * j));
                    }
                }
                let x = xp.add(j * AVX2_STEP);
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let g = (row0 + r) * groups + j * AVX2_STEP / INT4_GROUP;
                    let zero = usize::from(*d.zeros.get_unchecked(g));
                    let tables = load_byte_tables(INT4_BF16_BYTES.get_unchecked(zero));
                    let w = decode32_avx2(pp.add((row0 + r) * row_bytes + 16 * j), &tables);
                    let scale = _mm256_set1_ps(*d.scales.get_unchecked(g));
                    add_scaled_avx2(acc_r, &w, scale, x, cols);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                let tail = tail_dot(d, row0 + r, steps * AVX2_STEP, &xd[t * cols..]);
                out[r * T + t] += super::gemv::hsum256(*a) + tail;
            }
        }
    }
}

/// `sum_k W[row, k] x[k]` over inputs `from..cols`, one by one (`x` in input order
/// there).
fn tail_dot(d: &Int4Rows<'_>, row: usize, from: usize, x: &[f32]) -> f32 {
    (from..d.cols).map(|k| d.get(row, k) * x[k]).sum()
}

/// First input that neither a whole group nor a 16-wide run covers.
fn k_tail(cols: usize) -> usize {
    let steps_end = cols / INT4_GROUP * INT4_GROUP;
    steps_end + (cols - steps_end) / 16 * 16
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Every table pair encodes `c - z` exactly.
    #[test]
    fn int4_tables_hold_code_minus_zero() {
        for (zero, [low, high]) in INT4_BF16_BYTES.iter().enumerate() {
            for code in 0..16 {
                let value = bf16::from_bits(u16::from(low[code]) | u16::from(high[code]) << 8);
                assert_eq!(value.to_f32(), code as f32 - zero as f32);
            }
        }
    }
}
