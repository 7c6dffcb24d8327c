//! The f32 products of the cast's rounding tasks on AVX-512: a `rows x inner` matrix
//! that every task shares (a block of rows of $H$ or of $U^\top$, the refit's
//! $T^\top$), packed once, times a task's own `inner x len` row-major block (the
//! errors, the scaled errors, the transposed rows), into a `rows x len` row-major
//! output.
//!
//! faer's GEMM packs both operands on every call; here the shared operand is packed
//! once per rounding and the task's operand is read in place, rows of `len` values
//! (`len` is at most 256, so a task's operand stays in L2). An 8 x 32 register tile
//! (16 accumulators) takes eight broadcasts and two loads per 16 fused multiply-adds.
//! Each output is one sum over `inner` in order, whatever the task or thread count.

use faer::MatRef;

/// Output rows of the register tile.
const MR: usize = 8;

/// What the product does with the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Write {
    /// `out = P`.
    Replace,
    /// `out = out - P`.
    Subtract,
}

/// A `rows x inner` f32 matrix packed for [`Kernel::product`]: groups of [`MR`] rows,
/// the group's column `kk` as `MR` consecutive values (rows past `rows` zero).
pub(crate) struct Panel {
    data: Vec<f32>,
    rows: usize,
    inner: usize,
}

impl Panel {
    /// Packs `a` (any strides).
    pub(crate) fn pack(a: MatRef<'_, f32>) -> Panel {
        Panel::from_fn(a.nrows(), a.ncols(), |i, kk| a[(i, kk)])
    }

    /// Packs the `rows x inner` matrix of entries `value(i, kk)`, read a group of
    /// [`MR`] rows at a time, column by column (consecutive rows of a column-major
    /// source).
    pub(crate) fn from_fn(rows: usize, inner: usize, value: impl Fn(usize, usize) -> f32) -> Panel {
        let groups = rows.div_ceil(MR);
        let mut data = vec![0f32; groups * inner * MR];
        for (g, group) in data.chunks_exact_mut((inner * MR).max(1)).enumerate() {
            let live = MR.min(rows - g * MR);
            for (kk, dst) in group.chunks_exact_mut(MR).enumerate() {
                for (t, d) in dst[..live].iter_mut().enumerate() {
                    *d = value(g * MR + t, kk);
                }
            }
        }
        Panel { data, rows, inner }
    }
}

/// Proof that the CPU runs the AVX-512 kernel: only [`Kernel::detect`] makes one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kernel(());

impl Kernel {
    /// The kernel, where the CPU has AVX-512F.
    pub(crate) fn detect() -> Option<Kernel> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some(Kernel(()));
        }
        None
    }

    /// `out (rows x len) = P` or `out - P` ([`Write`]), `P = a b` for the packed `a`
    /// (`rows x inner`) and `b` (`inner x len`, row-major, rows `len` apart); both
    /// row-major with rows `len` values apart.
    pub(crate) fn product(self, out: &mut [f32], a: &Panel, b: &[f32], len: usize, write: Write) {
        let (rows, inner) = (a.rows, a.inner);
        assert!(out.len() >= rows * len && b.len() >= inner * len);
        if rows == 0 || len == 0 {
            return;
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("a Kernel exists only on x86_64 ({write:?})");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a Kernel exists only where the CPU has AVX-512F; the lengths of `out`
        // and `b` are asserted above and the panel holds `rows.div_ceil(MR) * inner *
        // MR` values by construction.
        unsafe {
            product_avx512(
                out.as_mut_ptr(),
                rows,
                len,
                a.data.as_ptr(),
                inner,
                b.as_ptr(),
                write,
            );
        }
    }
}

/// The mask of the first `n` of 16 lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lanes(n: usize) -> u16 {
    if n >= 16 { u16::MAX } else { (1u16 << n) - 1 }
}

/// [`Kernel::product`] on pointers.
///
/// # Safety
/// The CPU has AVX-512F; `out` holds `rows * len` values, `b` `inner * len`, `a`
/// `rows.div_ceil(MR) * inner * MR`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn product_avx512(
    out: *mut f32,
    rows: usize,
    len: usize,
    a: *const f32,
    inner: usize,
    b: *const f32,
    write: Write,
) {
    use std::arch::x86_64::*;
    for g in 0..rows.div_ceil(MR) {
        let live = MR.min(rows - g * MR);
        // SAFETY: group g's values lie within `a` (caller).
        let pa = unsafe { a.add(g * inner * MR) };
        for j0 in (0..len).step_by(32) {
            let n = (len - j0).min(32);
            // Lanes past `len` are masked off: not loaded (no fault), not stored.
            let (m0, m1) = (lanes(n), lanes(n.saturating_sub(16)));
            let mut acc = [_mm512_setzero_ps(); 2 * MR];
            for kk in 0..inner {
                // SAFETY: row kk of b from column j0, the lanes up to `len` (masked
                // loads read nothing where the mask is off; wrapping_add, since the
                // second half may start past the row's last value).
                let (b0, b1) = unsafe {
                    let pb = b.wrapping_add(kk * len + j0);
                    (
                        _mm512_maskz_loadu_ps(m0, pb),
                        _mm512_maskz_loadu_ps(m1, pb.wrapping_add(16)),
                    )
                };
                // SAFETY: entry (kk, 0..MR) of the group, within `a` (caller).
                let pk = unsafe { pa.add(kk * MR) };
                for t in 0..MR {
                    // SAFETY: as above.
                    let x = _mm512_set1_ps(unsafe { *pk.add(t) });
                    acc[2 * t] = _mm512_fmadd_ps(x, b0, acc[2 * t]);
                    acc[2 * t + 1] = _mm512_fmadd_ps(x, b1, acc[2 * t + 1]);
                }
            }
            for t in 0..live {
                for (half, mask) in [(0usize, m0), (1, m1)] {
                    let po = out.wrapping_add((g * MR + t) * len + j0 + 16 * half);
                    let p = acc[2 * t + half];
                    // SAFETY: row g * MR + t of out, the lanes up to `len` (masked).
                    unsafe {
                        let v = match write {
                            Write::Replace => p,
                            Write::Subtract => _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, po), p),
                        };
                        _mm512_mask_storeu_ps(po, mask, v);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faer::Mat;

    /// The product against the definition summed in f64, on shapes with partial row
    /// groups and partial column tiles, from a strided (transposed) operand, both writes.
    #[test]
    fn panel_products_match_the_definition() {
        let Some(kernel) = Kernel::detect() else {
            return;
        };
        for &(rows, inner, len) in &[
            (32usize, 256usize, 256usize),
            (13, 45, 44),
            (8, 1, 17),
            (45, 7, 300),
        ] {
            let a = Mat::<f32>::from_fn(inner, rows, |i, j| {
                ((i * 37 + j * 11) % 29) as f32 / 29.0 - 0.5
            });
            let at = a.transpose();
            let b: Vec<f32> = (0..inner * len)
                .map(|i| ((i * 53) % 31) as f32 / 31.0 - 0.4)
                .collect();
            let panel = Panel::pack(at);
            let start: Vec<f32> = (0..rows * len).map(|i| (i % 7) as f32).collect();
            for write in [Write::Replace, Write::Subtract] {
                // One value past the end, which the product must leave alone.
                let mut out = start.clone();
                out.push(99.0);
                kernel.product(&mut out, &panel, &b, len, write);
                assert_eq!(out[rows * len], 99.0);
                for t in 0..rows {
                    for j in 0..len {
                        let p: f64 = (0..inner)
                            .map(|kk| at[(t, kk)] as f64 * b[kk * len + j] as f64)
                            .sum();
                        let expected = match write {
                            Write::Replace => p,
                            Write::Subtract => start[t * len + j] as f64 - p,
                        };
                        let got = out[t * len + j] as f64;
                        assert!(
                            (got - expected).abs() <= 1e-5 * (inner as f64).sqrt() * 4.0,
                            "{rows}x{inner}x{len} {write:?} ({t}, {j}): {got} vs {expected}"
                        );
                    }
                }
            }
        }
    }
}
