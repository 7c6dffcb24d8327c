//! Gram and cross products of tall, thin matrices ($X^\top X$, $X^\top Y$ for
//! `count x k` operands with `count` much larger than `k`): the factorization's bases
//! (`17408 x 272` for a 27b-slice MLP projection) and the cast's factors.
//!
//! faer's GEMM parallelizes over blocks of the output, and a `k x k` output has few of
//! them, so a product whose length is all in its inner dimension runs on about one
//! thread. These split the rows into a fixed number of ranges, one task each, and add
//! the tasks' `k x k` sums in range order: the result depends neither on the thread count
//! nor on the scheduling. The f64 forms widen one block of rows at a time into a buffer
//! of the task (no widened copy of the whole operand).

use crate::cast::{lower_gram_add, mirror_lower};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatMut, MatRef, Par};
use rayon::prelude::*;

/// Row ranges a product is split into (fixed, so the sums do not depend on the thread
/// count; enough that two to eight threads stay busy).
const RANGES: usize = 16;

/// Rows widened to f64 at once within a range (a block of `k = 272` columns is 1.1 MB).
const BLOCK_ROWS: usize = 512;

/// The fewest rows a range gets: below this a product is one task.
const MIN_RANGE_ROWS: usize = 256;

/// The row ranges of a `count`-row operand.
fn ranges(count: usize) -> Vec<(usize, usize)> {
    let parts = count.div_ceil(MIN_RANGE_ROWS).clamp(1, RANGES);
    let per = count.div_ceil(parts).max(1);
    (0..count)
        .step_by(per)
        .map(|start| (start, per.min(count - start)))
        .collect()
}

/// The sum over the row ranges of a `count`-row operand of `part(start, len)` (a
/// `k_rows x k_cols` matrix each), the ranges in parallel and their sums added in
/// range order.
fn sum_over_ranges<T, F>(count: usize, k_rows: usize, k_cols: usize, part: F) -> Mat<T>
where
    T: faer::traits::ComplexField + Copy + std::ops::AddAssign,
    F: Fn(usize, usize) -> Mat<T> + Sync,
{
    let parts: Vec<Mat<T>> = ranges(count)
        .into_par_iter()
        .map(|(start, len)| part(start, len))
        .collect();
    let mut parts = parts.into_iter();
    let mut out = parts
        .next()
        .unwrap_or_else(|| Mat::<T>::zeros(k_rows, k_cols));
    for part in parts {
        for j in 0..k_cols {
            for i in 0..k_rows {
                out[(i, j)] += part[(i, j)];
            }
        }
    }
    out
}

/// Widens `src` into the column-major `dst` (same shape), row `i` multiplied by
/// `weights[i]` when given (the product of two f32 values is exact in f64). Columns
/// stored contiguously (the transposes of the cast's `k x count` factors, faer's
/// column-major blocks) are converted as slices, which vectorizes.
fn widen_into(mut dst: MatMut<'_, f64>, src: MatRef<'_, f32>, weights: Option<&[f32]>) {
    for j in 0..src.ncols() {
        let column = src.col(j);
        match (
            column.try_as_col_major(),
            dst.as_mut().col_mut(j).try_as_col_major_mut(),
        ) {
            (Some(s), Some(d)) => {
                let (s, d) = (s.as_slice(), d.as_slice_mut());
                match weights {
                    None => d.iter_mut().zip(s).for_each(|(d, &s)| *d = s as f64),
                    Some(w) => d
                        .iter_mut()
                        .zip(s)
                        .zip(w)
                        .for_each(|((d, &s), &w)| *d = s as f64 * w as f64),
                }
            }
            _ => {
                for i in 0..src.nrows() {
                    let w = weights.map_or(1.0, |w| w[i] as f64);
                    dst[(i, j)] = column[i] as f64 * w;
                }
            }
        }
    }
}

/// $X^\top X$ in f64 of a tall f32 matrix `x` (`count x k`, any strides): the products
/// exact (f32 values widened), the sums f64; the lower triangle computed, then
/// mirrored.
pub(crate) fn tall_gram_f64(x: MatRef<'_, f32>) -> Mat<f64> {
    tall_gram_f64_weighted(x, None)
}

/// $X^\top W^2 X$ in f64 for row weights `weights` (`count` of them; $X^\top X$ when
/// `None`), as [`tall_gram_f64`] forms it: each row widened and multiplied by its
/// weight once.
pub(crate) fn tall_gram_f64_weighted(x: MatRef<'_, f32>, weights: Option<&[f32]>) -> Mat<f64> {
    let k = x.ncols();
    let mut out = sum_over_ranges(x.nrows(), k, k, |start, len| {
        let mut sum = Mat::<f64>::zeros(k, k);
        let mut block = Mat::<f64>::zeros(BLOCK_ROWS.min(len), k);
        for first in (0..len).step_by(BLOCK_ROWS) {
            let rows = BLOCK_ROWS.min(len - first);
            let mut view = block.as_mut().subrows_mut(0, rows);
            let w = weights.map(|w| &w[start + first..start + first + rows]);
            widen_into(view.as_mut(), x.subrows(start + first, rows), w);
            lower_gram_add(sum.as_mut(), view.as_ref().transpose(), Par::Seq);
        }
        sum
    });
    mirror_lower(out.as_mut());
    out
}

/// $X^\top Y$ in f64 of tall f32 matrices `x` (`count x kx`) and `y` (`count x ky`), as
/// [`tall_gram_f64`] forms it.
pub(crate) fn tall_cross_f64(x: MatRef<'_, f32>, y: MatRef<'_, f32>) -> Mat<f64> {
    tall_cross_f64_weighted(x, y, None)
}

/// $X^\top W^2 Y$ in f64 for row weights `weights` ($X^\top Y$ when `None`), as
/// [`tall_cross_f64`] forms it: the rows of both operands widened and multiplied by
/// their weight.
pub(crate) fn tall_cross_f64_weighted(
    x: MatRef<'_, f32>,
    y: MatRef<'_, f32>,
    weights: Option<&[f32]>,
) -> Mat<f64> {
    let (kx, ky) = (x.ncols(), y.ncols());
    sum_over_ranges(x.nrows(), kx, ky, |start, len| {
        let mut sum = Mat::<f64>::zeros(kx, ky);
        let mut xb = Mat::<f64>::zeros(BLOCK_ROWS.min(len), kx);
        let mut yb = Mat::<f64>::zeros(BLOCK_ROWS.min(len), ky);
        for first in (0..len).step_by(BLOCK_ROWS) {
            let rows = BLOCK_ROWS.min(len - first);
            let mut xv = xb.as_mut().subrows_mut(0, rows);
            let mut yv = yb.as_mut().subrows_mut(0, rows);
            let w = weights.map(|w| &w[start + first..start + first + rows]);
            widen_into(xv.as_mut(), x.subrows(start + first, rows), w);
            widen_into(yv.as_mut(), y.subrows(start + first, rows), w);
            matmul(
                sum.as_mut(),
                Accum::Add,
                xv.as_ref().transpose(),
                yv.as_ref(),
                1.0,
                Par::Seq,
            );
        }
        sum
    })
}

/// The lower triangle of $X^\top X$ in f32 of a tall f32 matrix `x` (`count x k`); the
/// upper triangle is zero.
pub(crate) fn tall_lower_gram_f32(x: MatRef<'_, f32>) -> Mat<f32> {
    let k = x.ncols();
    sum_over_ranges(x.nrows(), k, k, |start, len| {
        let mut sum = Mat::<f32>::zeros(k, k);
        lower_gram_add(sum.as_mut(), x.subrows(start, len).transpose(), Par::Seq);
        sum
    })
}

/// $X^\top Y$ in f32 of tall f32 matrices `x` (`count x kx`) and `y` (`count x ky`).
pub(crate) fn tall_cross_f32(x: MatRef<'_, f32>, y: MatRef<'_, f32>) -> Mat<f32> {
    let (kx, ky) = (x.ncols(), y.ncols());
    sum_over_ranges(x.nrows(), kx, ky, |start, len| {
        let mut sum = Mat::<f32>::zeros(kx, ky);
        matmul(
            sum.as_mut(),
            Accum::Replace,
            x.subrows(start, len).transpose(),
            y.subrows(start, len),
            1.0,
            Par::Seq,
        );
        sum
    })
}

/// Output rows per task of [`split_product`] at least (a multiple of the 96 rows of
/// faer's f32 AVX-512 microkernel), and output columns (a multiple of its 4).
const SPLIT_ROWS: usize = 96;
const SPLIT_COLS: usize = 32;

/// Tasks per thread of [`split_product`]: enough that a thread that finishes early (or
/// one the OS gave less time on a shared machine) takes over the others' pieces.
const SPLIT_TASKS_PER_THREAD: usize = 4;

/// `dst = lhs rhs` (f32 or f64), the output cut into blocks of rows (a tall output) or of
/// columns (a wide one), each block a single-threaded faer product of its own, the
/// blocks run as rayon tasks.
///
/// faer's own multi-threaded f32 GEMM synchronizes its threads at every 512-deep slice
/// of the inner dimension; on the products of a factorization (a `272 x 5120` by
/// `5120 x 1088` range product of the row sample, the `17408 x 272` by `272 x 272`
/// orthonormalization) it spent 1.3-2.5x the CPU time of the single-threaded product at
/// two threads on the development VM (`RAYON_NUM_THREADS=2`, load 3), and gained little
/// or no wall time; the blocks run at the single-threaded product's CPU time. The
/// values are the same bits either way: faer's f32 kernels accumulate each output
/// entry over the inner dimension in the same order (512-deep slices, one fused
/// multiply-add per step) whatever the output's size, so neither the block boundaries
/// nor the thread count change a value (checked against one single-threaded product
/// on every shape the factorization uses).
pub(crate) fn split_product<T: faer::traits::ComplexField>(
    mut dst: MatMut<'_, T>,
    lhs: MatRef<'_, T>,
    rhs: MatRef<'_, T>,
    par: Par,
) {
    let (m, n) = (dst.nrows(), dst.ncols());
    let tasks = par.degree().saturating_mul(SPLIT_TASKS_PER_THREAD);
    let by_rows = m >= n;
    let (len, unit) = if by_rows {
        (m, SPLIT_ROWS)
    } else {
        (n, SPLIT_COLS)
    };
    let per = len.div_ceil(tasks.max(1)).next_multiple_of(unit);
    if tasks <= SPLIT_TASKS_PER_THREAD || per >= len {
        matmul(dst, Accum::Replace, lhs, rhs, T::one_impl(), Par::Seq);
        return;
    }
    if by_rows {
        dst.as_mut()
            .par_row_chunks_mut(per)
            .enumerate()
            .for_each(|(i, block)| {
                let rows = lhs.subrows(i * per, block.nrows());
                matmul(block, Accum::Replace, rows, rhs, T::one_impl(), Par::Seq);
            });
    } else {
        dst.as_mut()
            .par_col_chunks_mut(per)
            .enumerate()
            .for_each(|(j, block)| {
                let cols = rhs.subcols(j * per, block.ncols());
                matmul(block, Accum::Replace, lhs, cols, T::one_impl(), Par::Seq);
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `split_product` gives the single-threaded product's bits on tall and wide
    /// outputs, sizes that are and are not multiples of its blocks, at several thread
    /// counts (what lets the factorization call it without changing a factor).
    #[test]
    fn split_product_matches_the_single_threaded_product() {
        let pool = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a rayon pool")
        };
        for &(m, k, n) in &[
            (1000usize, 272usize, 272usize),
            (97, 600, 1088),
            (272, 5120, 70),
            (5, 3, 2),
        ] {
            let lhs = matrix(m, k, 3);
            let rhs = matrix(k, n, 4);
            let mut seq = Mat::<f32>::zeros(m, n);
            matmul(
                seq.as_mut(),
                Accum::Replace,
                lhs.as_ref(),
                rhs.as_ref(),
                1.0,
                Par::Seq,
            );
            for threads in [2usize, 3, 8] {
                let mut split = Mat::<f32>::zeros(m, n);
                pool(threads).install(|| {
                    split_product(
                        split.as_mut(),
                        lhs.as_ref(),
                        rhs.as_ref(),
                        Par::rayon(threads),
                    )
                });
                assert!(
                    (0..n)
                        .all(|j| (0..m).all(|i| split[(i, j)].to_bits() == seq[(i, j)].to_bits())),
                    "{m}x{k}x{n} at {threads} threads"
                );
            }
        }
    }

    /// A deterministic `rows x cols` matrix of values of mixed sign and scale.
    fn matrix(rows: usize, cols: usize, seed: usize) -> Mat<f32> {
        Mat::<f32>::from_fn(rows, cols, |i, j| {
            let h = (i * 7919 + j * 104_729 + seed * 31) % 1009;
            (h as f32 - 504.0) / 97.0 * if (i + j) % 3 == 0 { 1e-3 } else { 1.0 }
        })
    }

    /// The chunked products against the plain definition summed in f64, on row counts
    /// below, at and past a range and a block, and with a transposed (row-major) view.
    #[test]
    fn chunked_products_match_the_definition() {
        for &rows in &[1usize, 255, 256, 700, 5000] {
            let (kx, ky) = (9usize, 5usize);
            let x = matrix(rows, kx, 1);
            let y = matrix(rows, ky, 2);
            let direct = |a: MatRef<'_, f32>, b: MatRef<'_, f32>, i: usize, j: usize| -> f64 {
                (0..rows).map(|r| a[(r, i)] as f64 * b[(r, j)] as f64).sum()
            };
            let g = tall_gram_f64(x.as_ref());
            let c = tall_cross_f64(x.as_ref(), y.as_ref());
            let g32 = tall_lower_gram_f32(x.as_ref());
            let c32 = tall_cross_f32(x.as_ref(), y.as_ref());
            for i in 0..kx {
                for j in 0..kx {
                    let d = direct(x.as_ref(), x.as_ref(), i, j);
                    assert!(
                        (g[(i, j)] - d).abs() <= 1e-12 * d.abs().max(1.0),
                        "{rows} {i} {j}"
                    );
                    if i >= j {
                        let tol = 1e-5 * (rows as f64).sqrt() * d.abs().max(1.0);
                        assert!((g32[(i, j)] as f64 - d).abs() <= tol, "{rows} {i} {j}");
                    } else {
                        assert_eq!(g32[(i, j)], 0.0);
                    }
                }
                for j in 0..ky {
                    let d = direct(x.as_ref(), y.as_ref(), i, j);
                    assert!(
                        (c[(i, j)] - d).abs() <= 1e-12 * d.abs().max(1.0),
                        "{rows} {i} {j}"
                    );
                    let tol = 1e-5 * (rows as f64).sqrt() * d.abs().max(1.0);
                    assert!((c32[(i, j)] as f64 - d).abs() <= tol, "{rows} {i} {j}");
                }
            }
            // A row-major view of the same values gives the same f64 sums.
            let mut row_major = vec![0f32; rows * kx];
            for r in 0..rows {
                for j in 0..kx {
                    row_major[r * kx + j] = x[(r, j)];
                }
            }
            let gr = tall_gram_f64(MatRef::from_row_major_slice(&row_major, rows, kx));
            assert_eq!(gr, g);
        }
    }
}
