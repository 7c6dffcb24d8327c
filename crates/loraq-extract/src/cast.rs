//! Cast-aware bf16 rounding of a pair of LoRA factors.
//!
//! Given f32 factors $B_0$ (`out_features x k`) and $A_0$ (`k x in_features`) of the
//! truncation $L = B_0 A_0$, the bf16 pair $(B_q, A_q)$ is chosen so that $B_q A_q$ stays
//! close to $L$, not each factor close to its own f32 values:
//!
//! 1. **Mixing rotation.** $B_0 \leftarrow B_0 M^\top$, $A_0 \leftarrow M A_0$ with $M$ a
//!    fixed random orthogonal $k \times k$ matrix: the product, $B_0^\top B_0$ against
//!    $A_0 A_0^\top$ (the balance) and orthonormal rows of $A_0$ are all kept. In the
//!    singular basis both Gram matrices are diagonal ($S$), every component's rounding
//!    error weighs $s_l$ and nothing can trade one against another; after mixing the
//!    Gram matrices are dense with equal diagonal, and the errors of the small
//!    components can absorb those of the large ones.
//! 2. **A rounded with error feedback.** Each column $a_j$ of $A$ ($k$ entries) enters
//!    the product as $B a_j$, so its rounding error $e_j$ costs $e_j^\top H e_j$ with
//!    $H = B^\top B$. The entries are rounded in order and each rounding error is
//!    carried into the entries not yet rounded through the Cholesky factor of $H^{-1}$
//!    (the GPTQ / LDLQ rule, optimal among sequential roundings), then single-ulp moves
//!    that lower $e_j^\top H e_j$ are taken while any does (a few sweeps; how many
//!    depends on the round: `POLISH_SWEEPS_FIRST`, `POLISH_SWEEPS_ALTERNATION`). Both run on
//!    blocks of 256 columns at once, 32 entries at a time: when a block of entries
//!    comes up, the errors of every earlier entry (in the sweeps, the current errors of
//!    every entry, for the block's gradients $H e_j$) reach it as one f32 matrix
//!    product, and within the block the entries are updated one by one, which gives
//!    the same choices as entry-by-entry updates up to f32 rounding.
//! 3. **B refit** in f64 against the rounded A: $B = L A_q^\top (A_q A_q^\top)^{-1}$
//!    (computed from the $k \times k$ matrices $A_0 A_q^\top$ and $A_q A_q^\top$; with
//!    column weights $w$, $A_q W^2 A_q^\top$), then rounded the same way, row by row,
//!    with $H = A_q W^2 A_q^\top$.
//! 4. **One alternation.** A refit against the rounded B,
//!    $A = (B_q^\top B_q)^{-1} B_q^\top L$, rounded again, then B refit and rounded again.
//!
//! The Gram matrices $H$ are accumulated in f64 (their Cholesky factors are taken, and
//! $s_0 / s_k$ can be large); the rounding's own arithmetic (error feedback, gradients)
//! is f32, which only decides between two neighbouring bf16 values. The cast error
//! $\\|B_q A_q - L\\|_F$ is measured exactly without forming either product (see
//! [`crate::split`]).

use crate::error::{ExtractError, Result};
use crate::gram;
use block_product::{Kernel, Panel, Write};
use faer::linalg::matmul::matmul;
use faer::linalg::solvers::{DenseSolveCore, Solve};
use faer::{Accum, Mat, MatMut, MatRef, Par, Side};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

mod block_product;

/// Seed of the mixing rotation (the factors are deterministic for a given rank).
const ROTATION_SEED: u64 = 0x6c6f_7261_7163_6173;

/// Sweeps of single-ulp moves after the sequential rounding, by rounding of the cast:
/// the first A, the first B, then each alternation's A and B. The first pair only sets
/// up the refits after it, so its polish matters little; the last A's matters most (its
/// errors are the ones the last B refit must absorb), and a B sweep costs 3.4 A sweeps
/// on the bench delta (17408 x 5120, rank 256: 17408 vectors against 5120). There, at
/// two threads, 1 / 0 / 7 / 3 gives a cast error of 2.31150e-2 against 2.31428e-2 for
/// 1 / 0 / 5 / 3 (0 / 0 / 6 / 3: 2.31321e-2, but a few 27b-slice modules a little
/// worse); docs/extraction.md, "Cost of the cast".
const POLISH_SWEEPS_FIRST: (usize, usize) = (1, 0);
/// [`POLISH_SWEEPS_FIRST`] for the rounds of each alternation (A, then B).
const POLISH_SWEEPS_ALTERNATION: (usize, usize) = (7, 3);

/// Sweeps of the one-by-one reference rule in the tests.
#[cfg(test)]
const POLISH_SWEEPS: usize = 3;

/// Refit-and-round rounds after the first one.
const ALTERNATIONS: usize = 1;

/// Entries rounded one by one before their errors reach the later entries as one
/// matrix product.
const FEEDBACK_BLOCK: usize = 32;

/// Vectors (columns of A, rows of B) one task rounds together.
const VECTORS_PER_TASK: usize = 256;

/// A fixed random orthogonal `k x k` matrix (QR of a seeded Gaussian matrix).
pub(crate) fn mixing_rotation(k: usize) -> Mat<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(ROTATION_SEED ^ k as u64);
    let g = Mat::<f64>::from_fn(k, k, |_, _| {
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    });
    g.qr().compute_thin_Q()
}

/// [`mixing_rotation`] narrowed to f32, formed once per rank in a process (a QR of a
/// `k x k` Gaussian matrix, serial: some milliseconds of every cast otherwise, and the
/// modules of a model share a few ranks).
fn rotation_f32(k: usize) -> Arc<Mat<f32>> {
    static ROTATIONS: Mutex<Vec<(usize, Arc<Mat<f32>>)>> = Mutex::new(Vec::new());
    let cached = |rotations: &[(usize, Arc<Mat<f32>>)]| {
        rotations
            .iter()
            .find(|(rank, _)| *rank == k)
            .map(|(_, m)| Arc::clone(m))
    };
    // A poisoned lock only means another cast panicked; the list is still valid.
    if let Some(m) = cached(&ROTATIONS.lock().unwrap_or_else(|e| e.into_inner())) {
        return m;
    }
    let m = Arc::new(narrow(mixing_rotation(k).as_ref()));
    let mut rotations = ROTATIONS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(existing) = cached(&rotations) {
        return existing;
    }
    rotations.push((k, Arc::clone(&m)));
    m
}

/// `x * y` in f32 as a row-major matrix.
fn product(x: MatRef<'_, f32>, y: MatRef<'_, f32>, par: Par) -> Vec<f32> {
    let (m, n) = (x.nrows(), y.ncols());
    let mut out = vec![0f32; m * n];
    let om = MatMut::from_row_major_slice_mut(&mut out, m, n);
    // Blocks of the output, each a single-threaded product (the same bits as faer's
    // threaded product, at its single-threaded CPU time: `gram::split_product`).
    gram::split_product(om, x, y, par);
    out
}

/// An f64 matrix narrowed to f32.
fn narrow(x: MatRef<'_, f64>) -> Mat<f32> {
    Mat::<f32>::from_fn(x.nrows(), x.ncols(), |i, j| x[(i, j)] as f32)
}

/// $X^\top Y$ in f64 for `count x k` row-major f32 matrices ($X^\top X$ when `y` is
/// `None`, its lower triangle computed and mirrored), over blocks of rows widened to f64
/// (an f32 Gram matrix is not accurate enough to invert when $s_0/s_k$ is large), on
/// row ranges in parallel ([`crate::gram`]).
fn tall_cross_f64(x: &[f32], y: Option<&[f32]>, k: usize) -> Mat<f64> {
    let count = x.len() / k.max(1);
    let xm = MatRef::from_row_major_slice(x, count, k);
    match y {
        Some(y) => gram::tall_cross_f64(xm, MatRef::from_row_major_slice(y, count, k)),
        None => gram::tall_gram_f64(xm),
    }
}

/// Adds the lower triangle of $M M^\top$ to `dst` (the upper triangle is left alone).
pub(crate) fn lower_gram_add<T: faer::traits::ComplexField>(
    dst: MatMut<'_, T>,
    m: MatRef<'_, T>,
    par: Par,
) {
    use faer::linalg::matmul::triangular::{BlockStructure, matmul as triangular_matmul};
    triangular_matmul(
        dst,
        BlockStructure::TriangularLower,
        Accum::Add,
        m,
        BlockStructure::Rectangular,
        m.transpose(),
        BlockStructure::Rectangular,
        T::one_impl(),
        par,
    );
}

/// Copies the lower triangle of a square matrix onto its upper triangle.
pub(crate) fn mirror_lower<T: Copy>(mut m: MatMut<'_, T>) {
    for j in 0..m.ncols() {
        for i in 0..j {
            m[(i, j)] = m[(j, i)];
        }
    }
}

/// $X W^2 Y^\top$ in f64 for `k x count` row-major f32 matrices (`w`: column weights);
/// $X W^2 X^\top$ when `y` is `None`, its lower triangle computed and mirrored. As
/// [`tall_cross_f64`]: the transposes are tall (`count x k`), and a `k x k` output has
/// too few blocks for faer's parallel GEMM (at two threads it took more wall time than
/// on one), so the products run on fixed row ranges ([`crate::gram`]), whatever the
/// thread count.
fn wide_cross_f64(x: &[f32], y: Option<&[f32]>, k: usize, weights: Option<&[f32]>) -> Mat<f64> {
    let count = x.len() / k.max(1);
    let xm = MatRef::from_row_major_slice(x, k, count).transpose();
    match y {
        Some(y) => gram::tall_cross_f64_weighted(
            xm,
            MatRef::from_row_major_slice(y, k, count).transpose(),
            weights,
        ),
        None => gram::tall_gram_f64_weighted(xm, weights),
    }
}

/// `(k x k) \ rhs` for a symmetric positive definite `h` (Cholesky in f64), or `None`.
fn spd_solve(h: MatRef<'_, f64>, rhs: MatRef<'_, f64>) -> Option<Mat<f64>> {
    let llt = h.llt(Side::Lower).ok()?;
    let x = llt.solve(rhs);
    let finite = x.col_iter().all(|c| c.iter().all(|v| v.is_finite()));
    finite.then_some(x)
}

/// The next bf16 value above (`up`) or below `x`, if finite: the reference that
/// [`bf16_step_f32`] is tested against.
#[cfg(test)]
fn bf16_step(x: bf16, up: bool) -> Option<bf16> {
    let bits = x.to_bits();
    let negative = bits & 0x8000 != 0;
    let magnitude = bits & 0x7fff;
    let next = if up != negative {
        // Away from zero.
        bits + 1
    } else if magnitude == 0 {
        // From a zero of either sign to the smallest subnormal on the other side.
        if up { 0x0001 } else { 0x8001 }
    } else {
        bits - 1
    };
    let y = bf16::from_bits(next);
    y.is_finite().then_some(y)
}

/// [`bf16_step`] on a bf16 value held in an f32 (its low 16 bits zero), without
/// branches so that the polish sweeps vectorize: the neighbour above (`up`) or below,
/// and whether it is finite. bf16 is the top half of f32, so one bf16 ulp is `0x10000`
/// in the f32 bits.
#[inline(always)]
fn bf16_step_f32(x: f32, up: bool) -> (f32, bool) {
    let bits = x.to_bits();
    let negative = bits >> 31 != 0;
    let zero = bits & 0x7fff_ffff == 0;
    let away = up != negative;
    let toward_or_across = if zero {
        // From a zero of either sign to the smallest subnormal on the other side.
        if up { 0x0001_0000 } else { 0x8001_0000 }
    } else {
        bits.wrapping_sub(0x1_0000)
    };
    let next = if away {
        bits.wrapping_add(0x1_0000)
    } else {
        toward_or_across
    };
    (f32::from_bits(next), next & 0x7f80_0000 != 0x7f80_0000)
}

/// `bf16::from_f32(x).to_f32()` (round to nearest, ties to even) on the f32 bits, so the
/// loop it is in vectorizes: a NaN stays non-finite (it may come out as an infinity),
/// which the caller's finite check refuses either way.
#[inline(always)]
fn round_to_bf16_f32(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(rounded)
}

/// A bf16 value held in an f32 (its low 16 bits zero) as bf16: its top half, no rounding.
#[inline(always)]
fn exact_bf16(x: f32) -> bf16 {
    bf16::from_bits((x.to_bits() >> 16) as u16)
}

/// How the vectors to round lie in a row-major matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Vectors {
    /// `count x k`: one vector per row (the rows of B).
    Rows,
    /// `k x count`: one vector per column (the columns of A).
    Columns,
}

/// The operands of a rounding's block products that every task shares, packed once for
/// the AVX-512 kernel ([`block_product`]): per block of [`FEEDBACK_BLOCK`] entries the
/// rows of $U^\top$ that carry the earlier entries' errors to the block and the rows of
/// $H$ that give its gradients, and the refit's $T^\top$.
struct Panels {
    kernel: Kernel,
    /// Block `b`: $U^\top$ rows `32 b..`, columns (earlier entries) `..32 b`; `None`
    /// for the first block or without feedback.
    feedback: Vec<Option<Panel>>,
    /// Block `b`: $H$ rows `32 b..`, every column; empty without sweeps.
    gradient: Vec<Panel>,
    /// $T^\top$ (`k x k`) where the task forms its rows of $x T$.
    transform: Option<Panel>,
}

impl Panels {
    fn new(
        kernel: Kernel,
        feedback: Option<MatRef<'_, f32>>,
        h: MatRef<'_, f32>,
        sweeps: usize,
        transform: Option<MatRef<'_, f32>>,
    ) -> Panels {
        let k = h.nrows();
        let blocks = (0..k).step_by(FEEDBACK_BLOCK).map(|first| {
            let width = FEEDBACK_BLOCK.min(k - first);
            (first, width)
        });
        Panels {
            kernel,
            feedback: blocks
                .clone()
                .map(|(first, width)| {
                    let u = feedback.filter(|_| first > 0)?;
                    Some(Panel::pack(u.submatrix(0, first, first, width).transpose()))
                })
                .collect(),
            gradient: if sweeps == 0 {
                Vec::new()
            } else {
                blocks
                    .map(|(first, width)| Panel::pack(h.submatrix(first, 0, width, k)))
                    .collect()
            },
            transform: transform.map(|t| Panel::pack(t.transpose())),
        }
    }
}

/// `len` rows of `k` values (row-major) as the columns of a `k x len` row-major block.
fn transpose_rows(rows: &[f32], k: usize, len: usize) -> Vec<f32> {
    let mut block = vec![0f32; k * len];
    // Eight rows at a time: each read row is sequential, each written row gets eight
    // consecutive values.
    for (c, chunk) in rows.chunks(8 * k).enumerate() {
        for (l, dst) in block.chunks_exact_mut(len).enumerate() {
            for (i, row) in chunk.chunks_exact(k).enumerate() {
                dst[8 * c + i] = row[l];
            }
        }
    }
    block
}

/// What a rounding with the Gram matrix $H$ shares between its tasks: $H$ in f32 and the
/// upper Cholesky factor $U$ of $H^{-1}$ ($H^{-1} = U^\top U$), `None` when $H$ is not
/// positive definite to f64 precision. Formed apart from [`round_vectors`] so that the
/// `k x k` factorizations can run alongside other `k x k` work.
struct Rounding {
    h32: Mat<f32>,
    feedback: Option<Mat<f32>>,
}

impl Rounding {
    fn new(h: MatRef<'_, f64>) -> Rounding {
        let k = h.nrows();
        // U = L^T with L L^T = H^-1.
        let feedback: Option<Mat<f32>> = (|| {
            let inverse = h.llt(Side::Lower).ok()?.inverse();
            let l = inverse.llt(Side::Lower).ok()?;
            let u = narrow(l.L().transpose());
            (0..k).all(|i| u[(i, i)] > 0.0).then_some(u)
        })();
        Rounding {
            h32: narrow(h),
            feedback,
        }
    }
}

/// Rounds every vector of `x` (`k` entries each, laid out as `layout` says) to bf16 so
/// that $e H e^\top$ is small for each vector's error $e$: sequential rounding with
/// error feedback through the upper Cholesky factor of $H^{-1}$, then `sweeps` sweeps
/// of single-ulp moves that lower the loss. Without feedback (plain round-to-nearest)
/// when $H$ is not positive definite to f64 precision ([`Rounding`]). Tasks of
/// [`VECTORS_PER_TASK`] vectors run in parallel; rows (`Vectors::Rows`) are written
/// into the output by the task that rounds them. Also returns the loss $\sum e H
/// e^\top$ over the vectors as the rounding tracked it ([`round_block`]), `None`
/// without feedback.
fn round_vectors(
    x: &[f32],
    k: usize,
    layout: Vectors,
    rounding: &Rounding,
    sweeps: usize,
    transform: Option<MatRef<'_, f32>>,
) -> (Vec<bf16>, Option<f64>) {
    let count = x.len() / k.max(1);
    let Rounding { h32, feedback } = rounding;
    let panels = Kernel::detect().map(|kernel| {
        Panels::new(
            kernel,
            feedback.as_ref().map(Mat::as_ref),
            h32.as_ref(),
            sweeps,
            transform,
        )
    });
    let round_task = |task: usize| -> (Vec<f32>, f64) {
        let start = task * VECTORS_PER_TASK;
        let len = VECTORS_PER_TASK.min(count - start);
        // The task's vectors as the columns of a k x len row-major block.
        let mut block = vec![0f32; k * len];
        match layout {
            Vectors::Rows => {
                let rows = &x[start * k..(start + len) * k];
                match (transform, &panels) {
                    // The task's rows of x T, formed here as (T^T x_rows^T): no
                    // product of all the rows first.
                    (Some(_), Some(panels)) => {
                        let transposed = transpose_rows(rows, k, len);
                        let t = panels
                            .transform
                            .as_ref()
                            .expect("packed with the transform");
                        panels
                            .kernel
                            .product(&mut block, t, &transposed, len, Write::Replace);
                    }
                    (Some(t), None) => matmul(
                        MatMut::from_row_major_slice_mut(&mut block, k, len),
                        Accum::Replace,
                        t.transpose(),
                        MatRef::from_row_major_slice(rows, len, k).transpose(),
                        1.0,
                        Par::Seq,
                    ),
                    (None, _) => block = transpose_rows(rows, k, len),
                }
            }
            Vectors::Columns => {
                for (l, dst) in block.chunks_exact_mut(len).enumerate() {
                    dst.copy_from_slice(&x[l * count + start..l * count + start + len]);
                }
            }
        }
        round_block(
            &block,
            k,
            len,
            feedback.as_ref().map(Mat::as_ref),
            h32.as_ref(),
            sweeps,
            panels.as_ref(),
        )
    };
    let mut out = vec![bf16::ZERO; x.len()];
    let losses: Vec<f64> = match layout {
        Vectors::Rows => out
            .par_chunks_mut((VECTORS_PER_TASK * k).max(1))
            .enumerate()
            .map(|(task, dst)| {
                let (rounded, loss) = round_task(task);
                // Back to rows, eight at a time: each read is eight consecutive values
                // of the block, each written row sequential.
                let len = dst.len() / k;
                for (c, chunk) in dst.chunks_mut(8 * k).enumerate() {
                    for l in 0..k {
                        let src = &rounded[l * len + 8 * c..];
                        for (i, row) in chunk.chunks_exact_mut(k).enumerate() {
                            row[l] = exact_bf16(src[i]);
                        }
                    }
                }
                loss
            })
            .collect(),
        Vectors::Columns => {
            let tasks: Vec<(Vec<f32>, f64)> = (0..count.div_ceil(VECTORS_PER_TASK))
                .into_par_iter()
                .map(round_task)
                .collect();
            out.par_chunks_mut(count.max(1))
                .enumerate()
                .for_each(|(l, dst)| {
                    for (task, (rounded, _)) in tasks.iter().enumerate() {
                        let start = task * VECTORS_PER_TASK;
                        let len = rounded.len() / k;
                        for (d, &v) in dst[start..start + len]
                            .iter_mut()
                            .zip(&rounded[l * len..(l + 1) * len])
                        {
                            *d = exact_bf16(v);
                        }
                    }
                });
            tasks.into_iter().map(|(_, loss)| loss).collect()
        }
    };
    // Summed in task order: the same figure whatever the thread count.
    let loss = feedback.is_some().then(|| losses.iter().sum::<f64>());
    (out, loss)
}

loraq_quant::multiversion! {
    /// [`round_vectors`] on one task's `k x len` block (vectors as columns): returns the
    /// bf16 values (as f32) in the same layout, and the block's loss
    /// $\sum_j e_j H e_j^\top$ as tracked by the rounding (meaningful with `feedback`
    /// only; [`round_block_body`]). The loops over the vectors (rounding, feedback,
    /// single-ulp moves) are compiled for AVX-512 and AVX2 too (`multiversion!`): the
    /// build targets baseline x86-64, whose SSE2 loops are four lanes wide, and on a CPU
    /// without AVX-512 they took about half of the cast's CPU time on the 17408 x 5120
    /// bench delta (docs/extraction.md, "The same loops on AVX2"). The products are
    /// faer's, which picks its kernels at run time either way. The loops have no
    /// multiply-add for the compiler to fuse (Rust never contracts `a * b + c`), so
    /// every ISA rounds to the same bits.
    fn round_block(
        x: &[f32],
        k: usize,
        len: usize,
        feedback: Option<MatRef<'_, f32>>,
        h: MatRef<'_, f32>,
        sweeps: usize,
        panels: Option<&Panels>,
    ) -> (Vec<f32>, f64) {
        round_block_body(x, k, len, feedback, h, sweeps, panels)
    }
}

/// The work of [`round_block`]. Both phases are ordered so that the products which
/// carry one block's results to the others have the block's 32 entries as their output
/// rows and every other entry as their inner dimension (`32 x k x len`, an output that
/// stays in L1), instead of the block as the inner dimension and every later entry as
/// the output (`k x 32 x len`, an output read and written again for each block): the
/// same sums, taken when a block needs them rather than when a block is done.
///
/// The loss $\sum_j e_j H e_j^\top$ comes with the rounding at no product's cost. After
/// the sequential rounding with feedback through $U$ ($H^{-1} = U^\top U$) a vector's
/// error is $e = -U^\top \varepsilon$ for its scaled errors
/// $\varepsilon_l = (w_l - q_l) / U_{ll}$, so $e H e^\top = \\|\varepsilon\\|^2$
/// ($U H U^\top = I$); each single-ulp move $d$ of entry $l$ then changes the loss by
/// $2 d g_l + d^2 H_{ll}$, the quantity its acceptance test computes. Both are summed
/// per vector in f64. The f32 arithmetic leaves the figure within about $10^{-6}$ of
/// the loss of the bf16 values returned: $U$ and $H$ rounded to f32 make
/// $U H U^\top = I + O(\kappa(H)\\, 2^{-24})$, the feedback's f32 sums put $e$ off
/// $-U^\top \varepsilon$ by about $2^{-24} \sqrt k$ of the entries, $2^{-15}$ of a
/// bf16 rounding error and of random sign over the entries, and the gradients are
/// those the moves are chosen by, accurate to f32.
#[inline(always)]
fn round_block_body(
    x: &[f32],
    k: usize,
    len: usize,
    feedback: Option<MatRef<'_, f32>>,
    h: MatRef<'_, f32>,
    sweeps: usize,
    panels: Option<&Panels>,
) -> (Vec<f32>, f64) {
    let round = round_to_bf16_f32;
    let mut q = vec![0f32; k * len];
    // Each vector's loss, as the rounding changes it (module doc of this function).
    let mut loss = vec![0f64; len];
    // The block's entries with the feedback of every earlier entry's error.
    let mut work = vec![0f32; FEEDBACK_BLOCK * len];
    // Every rounded entry's error over its pivot, (w - q) / U_ll: what the feedback of
    // the later entries is made of.
    let mut scaled = vec![0f32; if feedback.is_some() { k * len } else { 0 }];
    // Sequential rounding with error feedback: a block's entries first receive the
    // errors of every entry before the block as one product, then, one by one, those of
    // the entries before them in the block.
    for first in (0..k).step_by(FEEDBACK_BLOCK) {
        let end = (first + FEEDBACK_BLOCK).min(k);
        let width = end - first;
        let work = &mut work[..width * len];
        work.copy_from_slice(&x[first * len..end * len]);
        if let Some(u) = feedback
            && first > 0
        {
            let earlier = &scaled[..first * len];
            match panels
                .and_then(|p| Some((p.kernel, p.feedback[first / FEEDBACK_BLOCK].as_ref()?)))
            {
                Some((kernel, panel)) => {
                    kernel.product(work, panel, earlier, len, Write::Subtract);
                }
                None => matmul(
                    MatMut::from_row_major_slice_mut(work, width, len),
                    Accum::Add,
                    u.submatrix(0, first, first, width).transpose(),
                    MatRef::from_row_major_slice(earlier, first, len),
                    -1.0,
                    Par::Seq,
                ),
            }
        }
        for l in first..end {
            let (done, later) = work.split_at_mut((l - first + 1) * len);
            let wl = &done[(l - first) * len..];
            let ql = &mut q[l * len..(l + 1) * len];
            for (qv, &wv) in ql.iter_mut().zip(wl) {
                *qv = round(wv);
            }
            let Some(u) = feedback else { continue };
            let ull = u[(l, l)];
            let el = &mut scaled[l * len..(l + 1) * len];
            for (((ev, &wv), &qv), lv) in el.iter_mut().zip(wl).zip(ql.iter()).zip(&mut loss) {
                *ev = (wv - qv) / ull;
                *lv += f64::from(*ev) * f64::from(*ev);
            }
            for (l2, w2) in (l + 1..end).zip(later.chunks_exact_mut(len)) {
                let coefficient = u[(l, l2)];
                for (wv, &ev) in w2.iter_mut().zip(el.iter()) {
                    *wv -= ev * coefficient;
                }
            }
        }
    }
    drop(scaled);
    if sweeps == 0 || q.iter().any(|v| !v.is_finite()) {
        // Nothing to polish, or refused by the caller's finite check.
        return (q, loss.iter().sum());
    }
    // Every vector's error e = q - x, kept current as entries move.
    let mut errors: Vec<f32> = q.iter().zip(x).map(|(&r, &v)| r - v).collect();
    // Single-ulp moves that lower e H e^T: a block's gradients (H e) come from every
    // entry's current error as one product, and within the block the gradients of the
    // entries after each move are updated at once.
    let mut local = work;
    let mut moves = vec![0f32; FEEDBACK_BLOCK * len];
    for _ in 0..sweeps {
        let mut moved = false;
        for first in (0..k).step_by(FEEDBACK_BLOCK) {
            let end = (first + FEEDBACK_BLOCK).min(k);
            let width = end - first;
            let gradients = &mut local[..width * len];
            match panels.and_then(|p| Some((p.kernel, p.gradient.get(first / FEEDBACK_BLOCK)?))) {
                Some((kernel, panel)) => {
                    kernel.product(gradients, panel, &errors, len, Write::Replace);
                }
                None => matmul(
                    MatMut::from_row_major_slice_mut(gradients, width, len),
                    Accum::Replace,
                    h.submatrix(first, 0, width, k),
                    MatRef::from_row_major_slice(&errors, k, len),
                    1.0,
                    Par::Seq,
                ),
            }
            for l in first..end {
                let hll = h[(l, l)];
                let (current, later) = local.split_at_mut((l - first + 1) * len);
                let gl = &current[(l - first) * len..];
                let ql = &mut q[l * len..(l + 1) * len];
                let el = &mut errors[l * len..(l + 1) * len];
                let xl = &x[l * len..(l + 1) * len];
                let dl = &mut moves[..len];
                let mut any = false;
                for (((((qv, ev), &xv), dv), &gv), lv) in ql
                    .iter_mut()
                    .zip(el.iter_mut())
                    .zip(xl)
                    .zip(dl.iter_mut())
                    .zip(gl)
                    .zip(&mut loss)
                {
                    // Only a step against the gradient can lower the loss.
                    let (c, finite) = bf16_step_f32(*qv, gv < 0.0);
                    let d = c - *qv;
                    let change = 2.0 * d * gv + d * d * hll;
                    let accept = (gv != 0.0) & finite & (change < 0.0);
                    *qv = if accept { c } else { *qv };
                    *ev = *qv - xv;
                    *dv = if accept { d } else { 0.0 };
                    *lv += if accept { f64::from(change) } else { 0.0 };
                    any |= accept;
                }
                if !any {
                    continue;
                }
                moved = true;
                for (l2, g2) in (l + 1..end).zip(later.chunks_exact_mut(len)) {
                    let coefficient = h[(l, l2)];
                    for (gv, &dv) in g2.iter_mut().zip(dl.iter()) {
                        *gv += dv * coefficient;
                    }
                }
            }
        }
        if !moved {
            break;
        }
    }
    (q, loss.iter().sum())
}

/// bf16 values widened to f32.
pub(crate) fn widen(x: &[bf16]) -> Vec<f32> {
    x.par_iter().map(|v| v.to_f32()).collect()
}

/// What [`cast_aware`] returns: the bf16 pair and the rotated f32 factors it is measured
/// against.
pub(crate) struct CastPair {
    /// $B_q$, `out_features x k` row-major.
    pub(crate) bq: Vec<bf16>,
    /// $A_q$, `k x in_features` row-major.
    pub(crate) aq: Vec<bf16>,
    /// $B_0$ (rotated, f32), with $B_0 A_0 = B A$.
    pub(crate) b0: Vec<f32>,
    /// $A_0$ (rotated, f32).
    pub(crate) a0: Vec<f32>,
    /// $B_0^\top B_0$ in f64.
    pub(crate) b0tb0: Mat<f64>,
    /// $\\|B_q A_q - B_0 A_0\\|_F^2$ where the last B refit gives it without a pass over
    /// the factors ([`refit_cast_error_sq`]); `None` with column weights (the refit is
    /// then orthogonal in the weighted norm only) or where the refit or its feedback
    /// failed.
    pub(crate) error_sq: Option<f64>,
}

/// The first factor handed to [`cast_aware`].
pub(crate) enum FactorB<'a> {
    /// B, `out_features x k` row-major, which the cast rotates ($B_0 = B M^\top$).
    Rows(&'a [f32]),
    /// $B_0 = B M^\top$, already formed ([`rotated_basis`]).
    Rotated(Vec<f32>),
}

/// $B_0 = B M^\top$ for $B = U \mathrm{diag}(w)$ narrowed to f32 (`u(i, l)`: entry
/// `(i, l)` of the factorization's left basis, `rows` of them per column; `scale`: $w$,
/// `k` of them), without B itself: each task
/// packs its 256 rows of B straight from U's columns into the kernel's panel and
/// multiplies them by $M^\top$ ([`block_product`]). The entries of B are those of
/// `split::f32_factors`, and each entry of $B_0$ is the same sum in the same order as
/// the product of that B (faer's kernels also sum the 256 terms in order): bit for bit
/// what [`cast_aware`] forms from [`FactorB::Rows`], less a 17.8 MB matrix written and
/// read again on a 17408-row factor. `None` without the AVX-512 kernel.
pub(crate) fn rotated_basis(
    u: impl Fn(usize, usize) -> f64 + Sync,
    rows: usize,
    scale: &[f64],
) -> Option<Vec<f32>> {
    let kernel = Kernel::detect()?;
    let k = scale.len();
    let rotation = rotation_f32(k);
    // M^T row-major: entry (m, l) is M's (l, m).
    let mt: Vec<f32> = (0..k * k).map(|i| rotation[(i % k, i / k)]).collect();
    let mut b0 = vec![0f32; rows * k];
    b0.par_chunks_mut((VECTORS_PER_TASK * k).max(1))
        .enumerate()
        .for_each(|(task, out)| {
            let first = task * VECTORS_PER_TASK;
            let len = out.len() / k;
            let panel = Panel::from_fn(len, k, |i, l| (u(first + i, l) * scale[l]) as f32);
            kernel.product(out, &panel, &mt, k, Write::Replace);
        });
    Some(b0)
}

/// The cast-aware bf16 pair of B and A (module doc).
#[allow(clippy::too_many_arguments)]
pub(crate) fn cast_aware(
    module: &str,
    b: FactorB<'_>,
    a: &[f32],
    out_features: usize,
    in_features: usize,
    k: usize,
    weights: Option<&[f32]>,
    par: Par,
) -> Result<CastPair> {
    let rotation = rotation_f32(k);
    // B0 = B M^T, A0 = M A.
    let b0 = match b {
        FactorB::Rows(b) => product(
            MatRef::from_row_major_slice(b, out_features, k),
            rotation.transpose(),
            par,
        ),
        FactorB::Rotated(b0) => b0,
    };
    let a0 = product(
        rotation.as_ref().as_ref(),
        MatRef::from_row_major_slice(a, k, in_features),
        par,
    );
    let finite = |what: &'static str, x: &[bf16]| -> Result<()> {
        // Chunks tested with a branch-free exponent mask, the index searched only in a
        // chunk that fails (an element-wise parallel search costs more than the test).
        const CHUNK: usize = 1 << 14;
        let bad = x
            .par_chunks(CHUNK)
            .enumerate()
            .find_map_first(|(c, chunk)| {
                let all_finite = chunk
                    .iter()
                    .fold(true, |ok, v| ok & (v.to_bits() & 0x7f80 != 0x7f80));
                if all_finite {
                    None
                } else {
                    chunk
                        .iter()
                        .position(|v| !v.is_finite())
                        .map(|i| c * CHUNK + i)
                }
            });
        match bad {
            Some(index) => Err(ExtractError::NonFinite {
                module: module.to_string(),
                what,
                index,
            }),
            None => Ok(()),
        }
    };
    const WHAT_B: &str = "factor B after the bf16 cast";
    const WHAT_A: &str = "factor A after the bf16 cast";
    // First round: A with H = B0^T B0.
    let b0tb0 = tall_cross_f64(&b0, None, k);
    let (first_a, first_b) = POLISH_SWEEPS_FIRST;
    let (alternation_a, alternation_b) = POLISH_SWEEPS_ALTERNATION;
    let (mut aq, _) = round_vectors(
        &a0,
        k,
        Vectors::Columns,
        &Rounding::new(b0tb0.as_ref()),
        first_a,
        None,
    );
    finite(WHAT_A, &aq)?;
    let RoundedB { mut bq, mut refit } = refit_and_round_b(&b0, &a0, &aq, k, weights, first_b);
    finite(WHAT_B, &bq)?;
    for _ in 0..ALTERNATIONS {
        // A = (Bq^T Bq)^-1 (Bq^T B0) A0, rounded with H = Bq^T Bq.
        let (btb, btb0) = rounded_grams(&bq, &b0, b0tb0.as_ref(), k);
        // The rounding's k x k factorizations (serial) alongside the solve and the
        // product (parallel).
        let (a1, rounding) = rayon::join(
            || {
                let t = spd_solve(btb.as_ref(), btb0.as_ref())?;
                Some(product(
                    narrow(t.as_ref()).as_ref(),
                    MatRef::from_row_major_slice(&a0, k, in_features),
                    par,
                ))
            },
            || Rounding::new(btb.as_ref()),
        );
        let Some(a1) = a1 else {
            break;
        };
        let (aq1, _) = round_vectors(&a1, k, Vectors::Columns, &rounding, alternation_a, None);
        if finite(WHAT_A, &aq1).is_err() {
            break;
        }
        let bq1 = refit_and_round_b(&b0, &a0, &aq1, k, weights, alternation_b);
        if finite(WHAT_B, &bq1.bq).is_err() {
            break;
        }
        aq = aq1;
        bq = bq1.bq;
        refit = bq1.refit;
    }
    let error_sq = refit.map(|figures| refit_cast_error_sq(&figures, &a0, b0tb0.as_ref(), k));
    Ok(CastPair {
        bq,
        aq,
        b0,
        a0,
        b0tb0,
        error_sq,
    })
}

/// $B_q^\top B_q$ and $B_q^\top B_0$ in f64 for the rounded $B_q$ of $B_0$, from $B_0^\top
/// B_0$ (f64) and the rounding error $E = B_q - B_0$: $B_q^\top B_0 = B_0^\top B_0 +
/// E^\top B_0$ and $B_q^\top B_q = B_q^\top B_0 + B_0^\top E + E^\top E$. $E$ is a few
/// bf16 ulps of $B_0$, so its products are taken in f32 (one pass over $B_0$ and $E$,
/// no widening) with an error about $10^{-6} \\|E\\| \\|B_0\\|$, some $10^{-9}$ of
/// $\\|B_0\\|^2$. Where $B_q^\top B_q$ is so ill-conditioned that this could matter (a
/// Cholesky pivot below $10^{-4}$ of the largest diagonal entry), both are formed in f64
/// from $B_q$ instead.
fn rounded_grams(
    bq: &[bf16],
    b0: &[f32],
    b0tb0: MatRef<'_, f64>,
    k: usize,
) -> (Mat<f64>, Mat<f64>) {
    let count = b0.len() / k.max(1);
    let mut error = vec![0f32; b0.len()];
    error
        .par_chunks_mut(k * 64)
        .zip(bq.par_chunks(k * 64).zip(b0.par_chunks(k * 64)))
        .for_each(|(e, (q, b))| {
            for ((e, q), &b) in e.iter_mut().zip(q).zip(b) {
                *e = q.to_f32() - b;
            }
        });
    let em = MatRef::from_row_major_slice(&error, count, k);
    // E^T B0 and the lower triangle of E^T E, over row ranges in parallel.
    let cross = gram::tall_cross_f32(em, MatRef::from_row_major_slice(b0, count, k));
    let ete = gram::tall_lower_gram_f32(em);
    drop(error);
    let btb0 = Mat::<f64>::from_fn(k, k, |i, j| b0tb0[(i, j)] + cross[(i, j)] as f64);
    let btb = Mat::<f64>::from_fn(k, k, |i, j| {
        let (lo, hi) = if i >= j { (i, j) } else { (j, i) };
        btb0[(i, j)] + cross[(j, i)] as f64 + ete[(lo, hi)] as f64
    });
    let well_conditioned = btb.llt(Side::Lower).is_ok_and(|llt| {
        let l = llt.L();
        let largest = (0..k).map(|i| btb[(i, i)]).fold(0.0f64, f64::max);
        (0..k).all(|i| l[(i, i)] * l[(i, i)] > 1e-4 * largest)
    });
    if well_conditioned {
        return (btb, btb0);
    }
    let bqf = widen(bq);
    let btb = tall_cross_f64(&bqf, None, k);
    let btb0 = tall_cross_f64(&bqf, Some(b0), k);
    (btb, btb0)
}

/// A rounded B and, where its rounding allows, the two parts of its cast error
/// ([`refit_and_round_b`]).
struct RoundedB {
    /// $B_q$, `out_features x k` row-major.
    bq: Vec<bf16>,
    /// The refit's figures, `None` where the cast error is measured from the factors
    /// instead (column weights, a singular refit, rounding without feedback).
    refit: Option<RefitFigures>,
}

/// What the cast error of an unweighted refit B needs beyond the factors themselves.
struct RefitFigures {
    /// $\sum_i (b_{q,i} - b_i) H (b_{q,i} - b_i)^\top$ over the rows, $b_i$ the refit's
    /// rows and $H = A_q A_q^\top$, as the rounding tracked it.
    loss: f64,
    /// $C = A_0 A_q^\top$ (f64).
    cross: Mat<f64>,
    /// $G^{-1} C^\top$ for $G = A_q A_q^\top$ (f64): the refit is $B_0 (G^{-1} C^\top)^\top$.
    t: Mat<f64>,
}

/// B refit against $L = B_0 A_0$ for the rounded A, then rounded row by row with
/// $H = A_q W^2 A_q^\top$. Falls back to rounding $B_0$ when the refit is singular.
fn refit_and_round_b(
    b0: &[f32],
    a0: &[f32],
    aq: &[bf16],
    k: usize,
    weights: Option<&[f32]>,
    sweeps: usize,
) -> RoundedB {
    let aqf = widen(aq);
    let gram = wide_cross_f64(&aqf, None, k, weights);
    let cross = wide_cross_f64(a0, Some(&aqf), k, weights);
    drop(aqf);
    // B = B0 (A0 W^2 Aq^T) (Aq W^2 Aq^T)^-1 = B0 T, T = cross G^-1 = (G^-1 cross^T)^T;
    // the rounding's own factorizations of G alongside.
    let (t, rounding) = rayon::join(
        || spd_solve(gram.as_ref(), cross.transpose()),
        || Rounding::new(gram.as_ref()),
    );
    let Some(t) = t else {
        let (bq, _) = round_vectors(b0, k, Vectors::Rows, &rounding, sweeps, None);
        return RoundedB { bq, refit: None };
    };
    let refit = narrow(t.transpose());
    let (bq, loss) = round_vectors(
        b0,
        k,
        Vectors::Rows,
        &rounding,
        sweeps,
        Some(refit.as_ref()),
    );
    let refit = match (weights, loss) {
        (None, Some(loss)) => Some(RefitFigures { loss, cross, t }),
        _ => None,
    };
    RoundedB { bq, refit }
}

/// $\\|B_q A_q - B_0 A_0\\|_F^2$ for a $B_q$ rounded from the unweighted refit
/// $B^{\ast} = B_0 C G^{-1}$ ($C = A_0 A_q^\top$, $G = A_q A_q^\top$), without a product over
/// the rows. The refit's residual is orthogonal to the rows of $A_q$
/// ($(B_0 A_0 - B^{\ast} A_q) A_q^\top = B_0 C - B_0 C = 0$), so
/// $\\|B_q A_q - B_0 A_0\\|^2 = \\|(B_q - B^{\ast}) A_q\\|^2 + \\|B^{\ast} A_q - B_0 A_0\\|^2$: the first
/// term is the rounding's own loss $\sum_i e_i G e_i^\top$ (tracked by [`round_block`];
/// the rounding started from $B^{\ast}$ in f32, whose difference from $B^{\ast}$, about $2^{-24}$
/// of B, enters the sum only through a cross term of random sign), the second
/// $\langle B_0^\top B_0,\ A_0 A_0^\top - C G^{-1} C^\top\rangle$ from `k x k` f64
/// matrices. That difference, about $10^{-6}$ of $A_0 A_0^\top$ (the square of A's
/// relative cast error), is taken between two matrices of exact products summed in f64
/// and a Cholesky solve with $G$ (condition about $s_0 / s_k$), which leave it
/// accurate to some $10^{-9}$ of itself.
fn refit_cast_error_sq(
    figures: &RefitFigures,
    a0: &[f32],
    b0tb0: MatRef<'_, f64>,
    k: usize,
) -> f64 {
    let a0a0 = wide_cross_f64(a0, None, k, None);
    let mut fitted = Mat::<f64>::zeros(k, k);
    matmul(
        fitted.as_mut(),
        Accum::Replace,
        figures.cross.as_ref(),
        figures.t.as_ref(),
        1.0,
        Par::Seq,
    );
    let mut fit_sq = 0f64;
    for j in 0..k {
        for i in 0..k {
            fit_sq += b0tb0[(i, j)] * (a0a0[(i, j)] - fitted[(i, j)]);
        }
    }
    (figures.loss + fit_sq).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_steps_are_the_neighbours() {
        let one = bf16::from_f32(1.0);
        assert_eq!(bf16_step(one, true).unwrap().to_f32(), 1.0 + 2f32.powi(-7));
        assert_eq!(bf16_step(one, false).unwrap().to_f32(), 1.0 - 2f32.powi(-8));
        let minus = bf16::from_f32(-1.0);
        assert_eq!(
            bf16_step(minus, true).unwrap().to_f32(),
            -1.0 + 2f32.powi(-8)
        );
        assert_eq!(
            bf16_step(minus, false).unwrap().to_f32(),
            -1.0 - 2f32.powi(-7)
        );
        let tiny = bf16::from_bits(1).to_f32();
        assert_eq!(bf16_step(bf16::ZERO, true).unwrap().to_f32(), tiny);
        assert_eq!(bf16_step(bf16::NEG_ZERO, false).unwrap().to_f32(), -tiny);
        assert_eq!(bf16_step(bf16::ZERO, false).unwrap().to_f32(), -tiny);
        assert!(bf16_step(bf16::MAX, true).is_none());
    }

    /// The branch-free step and rounding on f32 bits agree with `bf16_step` and with
    /// half's `bf16::from_f32` on every bf16 value and direction, and on f32 values of
    /// every exponent (ties included).
    #[test]
    fn branch_free_bf16_step_and_rounding_match_the_references() {
        for bits in 0..=u16::MAX {
            let x = bf16::from_bits(bits);
            if !x.is_finite() {
                continue;
            }
            for up in [false, true] {
                let (value, finite) = bf16_step_f32(x.to_f32(), up);
                match bf16_step(x, up) {
                    Some(next) => {
                        assert!(finite, "{bits:#06x} up {up}");
                        assert_eq!(value.to_bits(), next.to_f32().to_bits(), "{bits:#06x}");
                    }
                    None => assert!(!finite, "{bits:#06x} up {up}"),
                }
            }
        }
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for i in 0..1_000_000u32 {
            // Random bit patterns, and every fourth one a tie (low half 0x8000).
            let mut bits: u32 = rng.random();
            if i % 4 == 0 {
                bits = (bits & 0xffff_0000) | 0x8000;
            }
            let x = f32::from_bits(bits);
            if !x.is_finite() {
                continue;
            }
            let expected = bf16::from_f32(x).to_f32();
            assert_eq!(
                round_to_bf16_f32(x).to_bits(),
                expected.to_bits(),
                "{bits:#010x}"
            );
        }
    }

    /// f32 factors of a rank-`k` product with singular values decaying `decay` times
    /// (balanced split), from seeded Gaussian bases.
    fn decaying_factors(rows: usize, cols: usize, k: usize, decay: f64) -> (Vec<f32>, Vec<f32>) {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut gauss = || {
            let u1: f64 = 1.0 - rng.random::<f64>();
            let u2: f64 = rng.random::<f64>();
            (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
        };
        let u = Mat::<f64>::from_fn(rows, k, |_, _| gauss())
            .qr()
            .compute_thin_Q();
        let v = Mat::<f64>::from_fn(cols, k, |_, _| gauss())
            .qr()
            .compute_thin_Q();
        let s: Vec<f64> = (0..k)
            .map(|l| 3.0 * decay.powf(-(l as f64) / (k - 1) as f64))
            .collect();
        let b = (0..rows * k)
            .map(|i| (u[(i / k, i % k)] * s[i % k].sqrt()) as f32)
            .collect();
        let a = (0..k * cols)
            .map(|i| (v[(i % cols, i / cols)] * s[i / cols].sqrt()) as f32)
            .collect();
        (b, a)
    }

    /// $\\|B_q A_q - BA\\|_F$ entry by entry in f64 (the independent measurement).
    fn dense_error(
        bq: &[bf16],
        aq: &[bf16],
        b: &[f32],
        a: &[f32],
        rows: usize,
        cols: usize,
        k: usize,
    ) -> f64 {
        let mut sum = 0f64;
        for i in 0..rows {
            for j in 0..cols {
                let (mut exact, mut rounded) = (0f64, 0f64);
                for l in 0..k {
                    exact += b[i * k + l] as f64 * a[l * cols + j] as f64;
                    rounded += bq[i * k + l].to_f64() * aq[l * cols + j].to_f64();
                }
                sum += (rounded - exact).powi(2);
            }
        }
        sum.sqrt()
    }

    /// On a product whose singular values decay 30x (the factorize bench's spectrum),
    /// the cast-aware pair reproduces the product at most 0.7x as far off as rounding
    /// each factor to nearest; the product itself, not the factors, is what is kept.
    #[test]
    fn cast_aware_factors_reproduce_the_product_better_than_nearest_rounding() {
        let (rows, cols, k) = (384usize, 192usize, 32usize);
        let (b, a) = decaying_factors(rows, cols, k, 30.0);
        let nearest = |x: &[f32]| -> Vec<bf16> { x.iter().map(|&v| bf16::from_f32(v)).collect() };
        let plain = dense_error(&nearest(&b), &nearest(&a), &b, &a, rows, cols, k);
        let CastPair { bq, aq, b0, a0, .. } =
            cast_aware("m", FactorB::Rows(&b), &a, rows, cols, k, None, Par::Seq).unwrap();
        let aware = dense_error(&bq, &aq, &b, &a, rows, cols, k);
        // The rotated f32 pair is the same product to f32 precision.
        let rotated = dense_error(&nearest(&b0), &nearest(&a0), &b, &a, rows, cols, k);
        assert!(aware < 0.7 * plain, "cast-aware {aware} vs nearest {plain}");
        assert!(
            aware < rotated,
            "cast-aware {aware} vs rotated nearest {rotated}"
        );
        // With a flat spectrum there is nothing to trade: no worse than nearest.
        let (b, a) = decaying_factors(rows, cols, k, 1.0);
        let plain = dense_error(&nearest(&b), &nearest(&a), &b, &a, rows, cols, k);
        let CastPair { bq, aq, .. } =
            cast_aware("m", FactorB::Rows(&b), &a, rows, cols, k, None, Par::Seq).unwrap();
        let aware = dense_error(&bq, &aq, &b, &a, rows, cols, k);
        assert!(
            aware < plain,
            "flat spectrum: cast-aware {aware} vs nearest {plain}"
        );
    }

    /// The cast error from the last refit's orthogonality (the rounding's tracked loss
    /// plus the refit's residual from `k x k` matrices) against the difference of the
    /// products entry by entry in f64; with column weights the refit is orthogonal in
    /// the weighted norm only, and the pair leaves the error to the factors' Gram
    /// identity ([`crate::split`]).
    #[test]
    fn refit_cast_error_matches_the_dense_difference() {
        let (rows, cols, k) = (384usize, 192usize, 32usize);
        for decay in [30.0, 1.0] {
            let (b, a) = decaying_factors(rows, cols, k, decay);
            let pair =
                cast_aware("m", FactorB::Rows(&b), &a, rows, cols, k, None, Par::Seq).unwrap();
            let estimate = pair.error_sq.expect("an unweighted refit").sqrt();
            let dense = dense_error(&pair.bq, &pair.aq, &pair.b0, &pair.a0, rows, cols, k);
            assert!(
                (estimate / dense - 1.0).abs() < 1e-5,
                "decay {decay}: {estimate} vs {dense}"
            );
        }
        let (b, a) = decaying_factors(rows, cols, k, 30.0);
        let weights: Vec<f32> = (0..cols).map(|j| 1.0 + (j % 5) as f32).collect();
        let pair = cast_aware(
            "m",
            FactorB::Rows(&b),
            &a,
            rows,
            cols,
            k,
            Some(&weights),
            Par::Seq,
        )
        .unwrap();
        assert!(pair.error_sq.is_none());
    }

    /// Column weights: the weighted error of the product is what the rounding lowers.
    #[test]
    fn weighted_cast_lowers_the_weighted_error() {
        let (rows, cols, k) = (256usize, 128usize, 16usize);
        let (b, a) = decaying_factors(rows, cols, k, 10.0);
        let weights: Vec<f32> = (0..cols)
            .map(|j| if j % 8 == 0 { 10.0 } else { 0.5 })
            .collect();
        let weighted_error = |bq: &[bf16], aq: &[bf16]| -> f64 {
            let mut sum = 0f64;
            for i in 0..rows {
                for j in 0..cols {
                    let e: f64 = (0..k)
                        .map(|l| {
                            bq[i * k + l].to_f64() * aq[l * cols + j].to_f64()
                                - b[i * k + l] as f64 * a[l * cols + j] as f64
                        })
                        .sum();
                    sum += (e * weights[j] as f64).powi(2);
                }
            }
            sum.sqrt()
        };
        let CastPair { bq, aq, .. } =
            cast_aware("m", FactorB::Rows(&b), &a, rows, cols, k, None, Par::Seq).unwrap();
        let unweighted = weighted_error(&bq, &aq);
        let CastPair { bq, aq, .. } = cast_aware(
            "m",
            FactorB::Rows(&b),
            &a,
            rows,
            cols,
            k,
            Some(&weights),
            Par::Seq,
        )
        .unwrap();
        let weighted = weighted_error(&bq, &aq);
        assert!(weighted < unweighted, "{weighted} vs {unweighted}");
    }

    /// The rule of [`round_vectors`] applied one vector and one entry at a time in f64:
    /// error feedback through the upper Cholesky factor of $H^{-1}$, then sweeps of
    /// single-ulp moves against the gradient $e H$.
    fn round_one_by_one(x: &[f64], h: &Mat<f64>) -> Vec<bf16> {
        let k = x.len();
        let l = h
            .llt(Side::Lower)
            .unwrap()
            .inverse()
            .llt(Side::Lower)
            .unwrap();
        let u = l.L().transpose().to_owned();
        let mut w = x.to_vec();
        let mut q = vec![bf16::ZERO; k];
        for i in 0..k {
            q[i] = bf16::from_f64(w[i]);
            let e = (w[i] - q[i].to_f64()) / u[(i, i)];
            for j in i + 1..k {
                w[j] -= e * u[(i, j)];
            }
        }
        let loss_gradient = |q: &[bf16], i: usize| -> f64 {
            (0..k).map(|j| h[(i, j)] * (q[j].to_f64() - x[j])).sum()
        };
        for _ in 0..POLISH_SWEEPS {
            for i in 0..k {
                let g = loss_gradient(&q, i);
                if g == 0.0 {
                    continue;
                }
                if let Some(c) = bf16_step(q[i], g < 0.0) {
                    let d = c.to_f64() - q[i].to_f64();
                    if 2.0 * d * g + d * d * h[(i, i)] < 0.0 {
                        q[i] = c;
                    }
                }
            }
        }
        q
    }

    /// The blocked rounding (tasks of 256 vectors, feedback and gradients as products
    /// over blocks of 32 entries, f32) makes the choices of the one-by-one rule, for
    /// vectors laid out as rows and as columns, with k and the count not multiples of
    /// the block sizes.
    #[test]
    fn blocked_rounding_makes_the_one_by_one_choices() {
        let (count, k) = (300usize, 45usize);
        let (b, _) = decaying_factors(count, 64, k, 20.0);
        let g = Mat::<f64>::from_fn(k + 7, k, |i, j| {
            ((i * 31 + j * 17) % 23) as f64 / 23.0 - 0.5 + if i == j { 2.0 } else { 0.0 }
        });
        let h = g.transpose() * &g;
        let reference: Vec<bf16> = b
            .chunks(k)
            .flat_map(|row| {
                round_one_by_one(&row.iter().map(|&v| v as f64).collect::<Vec<_>>(), &h)
            })
            .collect();
        let (by_rows, _) = round_vectors(
            &b,
            k,
            Vectors::Rows,
            &Rounding::new(h.as_ref()),
            POLISH_SWEEPS,
            None,
        );
        let columns: Vec<f32> = (0..k * count)
            .map(|i| b[(i % count) * k + i / count])
            .collect();
        let (by_columns, _) = round_vectors(
            &columns,
            k,
            Vectors::Columns,
            &Rounding::new(h.as_ref()),
            POLISH_SWEEPS,
            None,
        );
        let mut differ = 0;
        for i in 0..count {
            for l in 0..k {
                assert_eq!(by_rows[i * k + l], by_columns[l * count + i]);
                differ += usize::from(by_rows[i * k + l] != reference[i * k + l]);
            }
        }
        // f32 against f64 arithmetic may settle a near tie the other way (and the
        // vector's later entries with it), at no cost in the loss.
        assert!(
            differ * 100 <= count * k,
            "{differ} of {} entries differ",
            count * k
        );
        let loss = |q: &[bf16]| -> f64 {
            let mut total = 0f64;
            for (row, x) in q.chunks(k).zip(b.chunks(k)) {
                let e: Vec<f64> = row
                    .iter()
                    .zip(x)
                    .map(|(q, &v)| q.to_f64() - v as f64)
                    .collect();
                for i in 0..k {
                    for j in 0..k {
                        total += e[i] * h[(i, j)] * e[j];
                    }
                }
            }
            total
        };
        let (blocked, one_by_one) = (loss(&by_rows), loss(&reference));
        assert!(
            blocked <= 1.001 * one_by_one,
            "loss {blocked} vs {one_by_one}"
        );
        let nearest: usize = b
            .iter()
            .zip(&reference)
            .filter(|(v, r)| bf16::from_f32(**v) != **r)
            .count();
        assert!(
            nearest * 10 > count * k,
            "the rule moved only {nearest} entries off nearest"
        );
    }

    /// Rows rounded from `x T` formed by each task (the B refit's way) are the rows
    /// rounded from the product formed first: the same values in the same blocks.
    #[test]
    fn rows_transformed_by_the_tasks_round_as_the_product() {
        let (count, k) = (600usize, 40usize);
        let (x, _) = decaying_factors(count, 64, k, 20.0);
        let t = Mat::<f32>::from_fn(k, k, |i, j| {
            if i == j {
                1.0
            } else {
                ((i * 13 + j * 7) % 11) as f32 * 1e-3 - 5e-3
            }
        });
        let g = Mat::<f64>::from_fn(k + 5, k, |i, j| {
            ((i * 31 + j * 17) % 23) as f64 / 23.0 - 0.5 + if i == j { 2.0 } else { 0.0 }
        });
        let h = g.transpose() * &g;
        let (fused, fused_loss) = round_vectors(
            &x,
            k,
            Vectors::Rows,
            &Rounding::new(h.as_ref()),
            2,
            Some(t.as_ref()),
        );
        let target = product(
            MatRef::from_row_major_slice(&x, count, k),
            t.as_ref(),
            Par::Seq,
        );
        let (plain, plain_loss) = round_vectors(
            &target,
            k,
            Vectors::Rows,
            &Rounding::new(h.as_ref()),
            2,
            None,
        );
        let differ = fused.iter().zip(&plain).filter(|(a, b)| a != b).count();
        // Equal, unless the two products round a value differently in its last f32 bit
        // and that settles a near tie the other way.
        assert!(differ * 1000 <= count * k, "{differ} entries differ");
        let (a, b) = (fused_loss.unwrap(), plain_loss.unwrap());
        assert!((a / b - 1.0).abs() < 1e-3, "loss {a} vs {b}");
    }

    /// $B M^\top$ formed from the basis by the kernel is, bit for bit, each entry of the
    /// f32 B (`split::f32_factors`'s rounding of $U_{il} w_l$) times $M^\top$ summed in
    /// order with one rounding per multiply-add, on a row count that is not a multiple
    /// of the tasks' 256 rows nor of the kernel's 8.
    #[test]
    fn rotated_basis_is_the_in_order_product() {
        let (rows, k) = (300usize, 40usize);
        let u = Mat::<f64>::from_fn(rows, k, |i, j| {
            ((i * 31 + j * 17) % 97) as f64 / 97.0 - 0.5 + if i == j { 1.0 } else { 0.0 }
        });
        let w: Vec<f64> = (0..k).map(|l| 3.0 * 0.9f64.powi(l as i32)).collect();
        let Some(b0) = rotated_basis(|i, l| u[(i, l)], rows, &w) else {
            return;
        };
        let m = rotation_f32(k);
        for i in 0..rows {
            for l in 0..k {
                let expected = (0..k).fold(0f32, |acc, j| {
                    ((u[(i, j)] * w[j]) as f32).mul_add(m[(l, j)], acc)
                });
                assert_eq!(b0[i * k + l].to_bits(), expected.to_bits(), "({i}, {l})");
            }
        }
    }

    #[test]
    fn the_rotation_is_orthogonal() {
        let m = mixing_rotation(37);
        for i in 0..37 {
            for j in 0..37 {
                let dot: f64 = (0..37).map(|l| m[(l, i)] * m[(l, j)]).sum();
                let expected = if i == j { 1.0 } else { 0.0 };
                assert!((dot - expected).abs() < 1e-12);
            }
        }
    }
}
