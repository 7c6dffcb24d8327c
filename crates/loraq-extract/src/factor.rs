//! Top-r factorization of a delta with a certificate.
//!
//! The delta $D$ ($m \times n$, f32, row-major) is factored as $D \approx U_k S_k V_k^\top$
//! with $k \le r$. Two methods:
//!
//! * **randomized** (default): a row-space estimate from a random sample of the rows of
//!   the long side (one power iteration on a sixteenth of the rows costs an eighth of a pass), then
//!   two full passes: $W = D V_0$, $Q = \mathrm{orth}(W)$ (Cholesky-QR with the Gram
//!   matrix in f64; an eigendecomposition that drops negligible directions when W is
//!   nearly rank-deficient), $Z = D^\top Q$. The result is the rank-$k$ truncation of the
//!   projection $\tilde Q \tilde Q^\top D$, whose residual is known exactly without
//!   another pass: $\\|D - \tilde Q\tilde Q^\top D\\|^2 = \\|D\\|^2 - \\|Z L^{-\top}\\|^2$ with
//!   $\tilde Q = Q L^{-\top}$ and $G = Q^\top Q = L L^\top$ formed in f64, so it holds even
//!   where $Q$ is orthonormal only to f32 precision. Further iterations follow when the residual is not at the floor and
//!   still moving.
//! * **exact**: eigendecomposition of the f64 Gram matrix of the smaller side, then the
//!   kept directions are re-projected ($Y = D V_k$, thin SVD of $Y$) so the singular
//!   values are accurate to f64 precision in absolute terms, not only relative to $s_0$.
//!
//! The certificate: $\\|D - BA\\|_F$ evaluated in f64 from
//! $\\|D\\|^2 - 2\langle B^\top D, A\rangle + \langle B^\top B, A A^\top\rangle$, where
//! $B^\top D$ comes from the last pass (B lies in the span of Q), compared with
//! $\sqrt{\\|D\\|^2 - \sum s_i^2}$ and, by the caller, with the rounding floor.
//!
//! Numerical rank: only $s_i > s_0 \cdot 10^{-7}$ are kept. Nothing divides by a singular
//! value: the factors are built from orthonormal bases and $S^{1/2}$.

use crate::error::{ExtractError, Result};
use crate::floor::expected_floor_ratio;
use crate::gram::{split_product, tall_gram_f64};
use crate::ordered_sum::fold_in_order;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatMut, MatRef, Par, Side};
use loraq_amx::{Accumulate, Amx, MatrixMut, MatrixRef, Operand, Planes};
use rand::{Rng, SeedableRng, seq::index::sample};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::time::Instant;

/// Singular values at or below `s_0 * NUMERICAL_RANK_TOLERANCE` are not kept.
pub const NUMERICAL_RANK_TOLERANCE: f64 = 1e-7;

/// Power iterations on the row sample of a delta tall enough to sample.
const SAMPLE_ITERATIONS: usize = 1;

/// Which algorithm computes the top singular triplets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Randomized first; the exact method when it does not converge.
    Auto,
    /// Randomized subspace iteration only (more iterations when not converged).
    Randomized,
    /// f64 Gram eigendecomposition of the smaller side.
    Exact,
}

impl Method {
    /// The command-line spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Auto => "auto",
            Method::Randomized => "randomized",
            Method::Exact => "exact",
        }
    }
}

/// Parameters of [`factorize`], with [`Default`] values that reach the floor at 27B shapes.
#[derive(Debug, Clone)]
pub struct FactorParams {
    /// Largest rank to compute (the rank is `min(max_rank, m, n, numerical rank)`).
    pub max_rank: usize,
    /// Extra sketch columns beyond `max_rank`.
    pub oversample: usize,
    /// Algorithm.
    pub method: Method,
    /// Seed of the sketch (the result is deterministic for a given seed and thread count).
    pub seed: u64,
    /// The rounding floor of the merged tensor, when known: the randomized method stops
    /// as soon as its residual is within `floor_slack` of the floor's expectation.
    pub floor: Option<f64>,
    /// Relative slack over `expected_floor_ratio * floor` at which the randomized result
    /// is accepted without further iterations.
    pub floor_slack: f64,
    /// Extra pass pairs the randomized method may spend before giving up.
    pub max_extra_iterations: usize,
    /// An extra iteration that lowers the residual by less than this (relative) means
    /// the subspace has converged.
    pub convergence_tolerance: f64,
    /// Parallelism of the dense kernels.
    pub par: Par,
}

impl Default for FactorParams {
    fn default() -> Self {
        FactorParams {
            max_rank: 256,
            oversample: 16,
            method: Method::Auto,
            seed: 0x6c6f_7261_7100_0001,
            floor: None,
            floor_slack: 0.02,
            max_extra_iterations: 4,
            convergence_tolerance: 1e-4,
            par: Par::rayon(0),
        }
    }
}

/// Singular vectors, column-major: f32 where the method forms them in f32 (the
/// randomized method's long side, $Q C$ with C a small f64 matrix rounded to f32: the
/// values are f32 products, so storing them wider would only double the memory, 35.6 MB
/// instead of 17.8 MB at 17408 x 256, and cost a widening pass), f64 otherwise. Read
/// through [`Basis::get`] or [`Basis::col`], either is the same f64 value (an f32
/// widens exactly).
#[derive(Debug, Clone)]
pub enum Basis {
    /// f32 values, `rows x cols` column-major in one buffer (`values.len() == rows *
    /// cols`).
    F32 {
        /// The values, column by column.
        values: Vec<f32>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// f64 values.
    F64(Mat<f64>),
}

/// One column of a [`Basis`].
#[derive(Debug, Clone, Copy)]
pub enum BasisCol<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f64 values.
    F64(&'a [f64]),
}

impl BasisCol<'_> {
    /// Entry `i`, widened to f64.
    #[inline]
    pub fn get(&self, i: usize) -> f64 {
        match self {
            BasisCol::F32(c) => f64::from(c[i]),
            BasisCol::F64(c) => c[i],
        }
    }
}

impl Basis {
    /// Rows.
    pub fn nrows(&self) -> usize {
        match self {
            Basis::F32 { rows, .. } => *rows,
            Basis::F64(m) => m.nrows(),
        }
    }

    /// Columns.
    pub fn ncols(&self) -> usize {
        match self {
            Basis::F32 { cols, .. } => *cols,
            Basis::F64(m) => m.ncols(),
        }
    }

    /// Column `j`.
    #[inline]
    pub fn col(&self, j: usize) -> BasisCol<'_> {
        match self {
            Basis::F32 { values, rows, .. } => BasisCol::F32(&values[j * rows..(j + 1) * rows]),
            Basis::F64(m) => BasisCol::F64(m.col_as_slice(j)),
        }
    }

    /// Entry `(i, j)`, widened to f64.
    #[inline]
    pub fn get(&self, i: usize, j: usize) -> f64 {
        self.col(j).get(i)
    }

    /// Whether every entry is finite.
    pub fn is_finite(&self) -> bool {
        match self {
            Basis::F32 { values, .. } => values.iter().all(|x| x.is_finite()),
            Basis::F64(m) => m.col_iter().all(|c| c.iter().all(|x| x.is_finite())),
        }
    }
}

/// The singular triplets of a delta up to `max_rank` (singular values in f64).
#[derive(Debug, Clone)]
pub struct Factorization {
    /// Rows of the delta (output features).
    pub rows: usize,
    /// Columns of the delta (input features).
    pub cols: usize,
    /// Left singular vectors, `rows x kept` column-major.
    pub u: Basis,
    /// Singular values, non-increasing, all above the numerical-rank tolerance.
    pub s: Vec<f64>,
    /// Right singular vectors, `cols x kept` column-major.
    pub v: Basis,
    /// The largest singular value computed but not kept (by rank or tolerance), if any.
    pub first_dropped: Option<f64>,
    /// $\\|D\\|_F^2$ in f64.
    pub delta_norm_sq: f64,
    /// $U^\top U$ (the identity up to rounding), from the small matrices.
    u_gram: Mat<f64>,
    /// $V^\top V$.
    v_gram: Mat<f64>,
    /// The method that produced the result.
    pub method_used: Method,
    /// Full passes over the delta (sample passes counted by their share of the rows).
    pub passes: f64,
    /// Whether the randomized iteration met its stopping rule (always true for exact).
    pub converged: bool,
    /// Time spent per stage, in order (`check`, `sample`, `pass_w`,
    /// `orthonormalize`, `pass_z`, `project`; `gram`, `reproject` for the exact
    /// method): the breakdown `factor_file` prints.
    pub stages: Vec<Stage>,
}

/// The time one stage of [`factorize`] took.
#[derive(Debug, Clone, Copy)]
pub struct Stage {
    /// The stage's name.
    pub name: &'static str,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// CPU seconds of the whole process (all threads) over the stage: on a machine
    /// shared with other work, the figure that compares two runs.
    pub cpu_seconds: f64,
}

/// Residual figures of a rank-k truncation.
#[derive(Debug, Clone, Copy)]
pub struct Certificate {
    /// $\\|D - BA\\|_F$ computed in f64 from the last pass (f32-exact factors).
    pub residual: f64,
    /// $\sqrt{\\|D\\|^2 - \sum_{i \le k} s_i^2}$.
    pub singular_value_residual: f64,
}

impl Factorization {
    /// Number of kept singular triplets.
    pub fn kept(&self) -> usize {
        self.s.len()
    }

    /// $\\|D\\|_F$.
    pub fn delta_norm(&self) -> f64 {
        self.delta_norm_sq.sqrt()
    }

    /// $\sqrt{\\|D\\|^2 - \sum_{i \le k} s_i^2}$, clamped at zero.
    pub fn truncation_residual(&self, k: usize) -> f64 {
        let captured: f64 = self.s[..k.min(self.s.len())].iter().map(|s| s * s).sum();
        (self.delta_norm_sq - captured).max(0.0).sqrt()
    }

    /// The certificate of the rank-k truncation with the balanced split: the residual
    /// evaluated from $\\|D\\|^2 - 2\langle B^\top D, A\rangle + \langle B^\top B, AA^\top\rangle$.
    pub fn certificate(&self, k: usize) -> Certificate {
        let k = k.min(self.kept());
        // B = U_k S^1/2, A = S^1/2 V_k^T. <B^T D, A> = sum_i s_i <u_i^T D, v_i>, where
        // U^T D restricted to the kept directions comes from the last pass: U^T X =
        // S W^T for the randomized method (`project`), S V^T for the exact one, so row i
        // is s_i v_i^T (not stored: formed here, the same f64 products).
        let mut cross = 0.0f64;
        for i in 0..k {
            let v = self.v.col(i);
            let mut dot = 0.0f64;
            for j in 0..self.cols {
                let vji = v.get(j);
                dot += (self.s[i] * vji) * vji;
            }
            cross += self.s[i] * dot;
        }
        // <B^T B, A A^T> = sum_ij sqrt(s_i s_j) (u_i.u_j) sqrt(s_i s_j) (v_i.v_j).
        let (uu, vv) = (&self.u_gram, &self.v_gram);
        let mut quad = 0.0f64;
        for i in 0..k {
            for j in 0..k {
                quad += self.s[i].sqrt()
                    * self.s[j].sqrt()
                    * uu[(i, j)]
                    * self.s[i].sqrt()
                    * self.s[j].sqrt()
                    * vv[(i, j)];
            }
        }
        let residual_sq = self.delta_norm_sq - 2.0 * cross + quad;
        Certificate {
            residual: residual_sq.max(0.0).sqrt(),
            singular_value_residual: self.truncation_residual(k),
        }
    }

    /// Whether the certificate and the singular-value identity agree: they are equal in
    /// exact arithmetic; a disagreement beyond rounding means the small dense algebra
    /// lost accuracy.
    pub fn certificate_consistent(&self, k: usize) -> bool {
        let cert = self.certificate(k);
        let diff = (cert.residual.powi(2) - cert.singular_value_residual.powi(2)).abs();
        diff <= 1e-9 * self.delta_norm_sq + 1e-3 * cert.singular_value_residual.powi(2)
    }
}

/// CPU seconds the process has used so far (every thread), 0 where the clock is not
/// available.
pub fn process_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc == 0 {
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    } else {
        0.0
    }
}

/// Stage times: each `lap` records the wall and CPU seconds since the previous one.
struct StageClock {
    last: Instant,
    last_cpu: f64,
    stages: Vec<Stage>,
}

impl StageClock {
    fn start() -> StageClock {
        StageClock {
            last: Instant::now(),
            last_cpu: process_cpu_seconds(),
            stages: Vec::new(),
        }
    }

    fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        let cpu = process_cpu_seconds();
        self.stages.push(Stage {
            name,
            seconds: now.duration_since(self.last).as_secs_f64(),
            cpu_seconds: cpu - self.last_cpu,
        });
        self.last = now;
        self.last_cpu = cpu;
    }
}

/// $M_{:,:k}^\top M_{:,:k}$ in f64.
fn gram(m: MatRef<'_, f64>, k: usize) -> Mat<f64> {
    let sub = m.subcols(0, k);
    let mut g = Mat::<f64>::zeros(k, k);
    matmul(
        g.as_mut(),
        Accum::Replace,
        sub.transpose(),
        sub,
        1.0,
        Par::Seq,
    );
    g
}

/// Checks that `delta` is `rows x cols`, finite and not all zero; returns $\\|D\\|^2$ (f64).
pub fn check_delta(module: &str, delta: &[f32], rows: usize, cols: usize) -> Result<f64> {
    let len = rows
        .checked_mul(cols)
        .ok_or_else(|| ExtractError::BadShape {
            module: module.to_string(),
            what: format!("{rows} x {cols} overflows"),
        })?;
    if len != delta.len() || rows == 0 || cols == 0 {
        return Err(ExtractError::BadShape {
            module: module.to_string(),
            what: format!("delta has {} values, shape {rows} x {cols}", delta.len()),
        });
    }
    // One pass: the first non-finite index per chunk, and the sum of squares.
    const CHUNK: usize = 1 << 16;
    let parts = delta.par_chunks(CHUNK).enumerate().map(|(c, chunk)| {
        // Two branch-free loops the compiler vectorizes: eight f64 lanes of
        // squares, then the finite test (a mask on the exponent bits).
        let mut lanes = [0.0f64; 8];
        for block in chunk.chunks(8) {
            for (lane, &x) in lanes.iter_mut().zip(block) {
                *lane += (x as f64) * (x as f64);
            }
        }
        let sum: f64 = lanes.iter().sum();
        let bad = if chunk.iter().all(|x| x.is_finite()) {
            None
        } else {
            chunk
                .iter()
                .position(|x| !x.is_finite())
                .map(|i| c * CHUNK + i)
        };
        (bad, sum)
    });
    let (first_bad, norm_sq) = fold_in_order(parts, (None, 0.0), |a, b| {
        (
            a.0.or(b.0)
                .map(|_| a.0.unwrap_or(usize::MAX).min(b.0.unwrap_or(usize::MAX))),
            a.1 + b.1,
        )
    });
    if let Some(index) = first_bad {
        return Err(ExtractError::NonFinite {
            module: module.to_string(),
            what: "delta",
            index,
        });
    }
    if norm_sq == 0.0 {
        return Err(ExtractError::AllZeroDelta {
            module: module.to_string(),
        });
    }
    Ok(norm_sq)
}

/// Computes the top singular triplets of the `rows x cols` row-major delta.
pub fn factorize(
    module: &str,
    delta: &[f32],
    rows: usize,
    cols: usize,
    params: &FactorParams,
) -> Result<Factorization> {
    let mut clock = StageClock::start();
    let delta_norm_sq = check_delta(module, delta, rows, cols)?;
    clock.lap("check");
    factorize_checked(module, delta, rows, cols, delta_norm_sq, params, clock)
}

/// [`factorize`] of a delta the caller has already checked with [`check_delta`] (or
/// an equivalent pass that computed $\\|D\\|^2$ and refused non-finite values, as
/// [`crate::floor::delta_and_floor`] does): one pass over D fewer.
pub fn factorize_prechecked(
    module: &str,
    delta: &[f32],
    rows: usize,
    cols: usize,
    delta_norm_sq: f64,
    params: &FactorParams,
) -> Result<Factorization> {
    if delta_norm_sq == 0.0 {
        return Err(ExtractError::AllZeroDelta {
            module: module.to_string(),
        });
    }
    if rows.checked_mul(cols) != Some(delta.len()) || rows == 0 || cols == 0 {
        return Err(ExtractError::BadShape {
            module: module.to_string(),
            what: format!("delta has {} values, shape {rows} x {cols}", delta.len()),
        });
    }
    factorize_checked(
        module,
        delta,
        rows,
        cols,
        delta_norm_sq,
        params,
        StageClock::start(),
    )
}

fn factorize_checked(
    module: &str,
    delta: &[f32],
    rows: usize,
    cols: usize,
    delta_norm_sq: f64,
    params: &FactorParams,
    mut clock: StageClock,
) -> Result<Factorization> {
    if params.max_rank == 0 {
        return Err(ExtractError::InvalidParameter {
            name: "--rank",
            detail: "rank 0".into(),
        });
    }
    let d = MatRef::from_row_major_slice(delta, rows, cols);
    // Work on the orientation whose rows are the long side, so the sample is of rows.
    let transposed = rows < cols;
    let x = if transposed { d.transpose() } else { d };
    // A sketch as wide as the smaller side would be the whole space: the exact method
    // (f64 Gram of that side) is then both cheaper and exact to f64 precision, which
    // full-width modules (in_proj_a / in_proj_b) need to come out at ratio ~0.
    let narrow = params.max_rank + params.oversample >= rows.min(cols);
    let method = if narrow { Method::Exact } else { params.method };
    let mut result = match method {
        Method::Exact => exact(module, x, delta_norm_sq, params, &mut clock)?,
        Method::Randomized => randomized(module, x, delta_norm_sq, params, &mut clock)?,
        Method::Auto => {
            let r = randomized(module, x, delta_norm_sq, params, &mut clock)?;
            let ok = r.converged && r.certificate_consistent(r.kept());
            if ok {
                r
            } else {
                exact(module, x, delta_norm_sq, params, &mut clock)?
            }
        }
    };
    result.stages = clock.stages;
    Ok(if transposed {
        result.transpose()
    } else {
        result
    })
}

impl Factorization {
    /// The factorization of $D^\top$.
    fn transpose(self) -> Factorization {
        // D^T = V S U^T: for D^T the left vectors are V, and V^T D^T = (D V)^T = (U S)^T,
        // which is what the certificate forms from the new V (the old U).
        Factorization {
            rows: self.cols,
            cols: self.rows,
            u: self.v,
            s: self.s,
            v: self.u,
            first_dropped: self.first_dropped,
            delta_norm_sq: self.delta_norm_sq,
            u_gram: self.v_gram,
            v_gram: self.u_gram,
            method_used: self.method_used,
            passes: self.passes,
            converged: self.converged,
            stages: self.stages,
        }
    }
}

/// Number of triplets to keep out of `s` (non-increasing): at most `max_rank`, only
/// those above the numerical-rank tolerance.
fn numerical_rank(s: &[f64], max_rank: usize) -> usize {
    let Some(&s0) = s.first() else { return 0 };
    if s0 <= 0.0 {
        return 0;
    }
    s.iter()
        .take(max_rank)
        .take_while(|&&v| v > s0 * NUMERICAL_RANK_TOLERANCE)
        .count()
}

/// A basis of the significant column space of `w`, orthonormal to f32 precision: one
/// round of Cholesky-QR with the Gram matrix in f64 (directions whose singular value
/// is below `1e-6` of the largest are dropped: they carry no energy that matters next
/// to any rounding floor). Returns `None` when `w` is zero.
fn orthonormalize(w: MatRef<'_, f32>, par: Par) -> Option<Mat<f32>> {
    let m = orthonormalizer(w)?;
    Some(f32_product(w, m.as_ref(), par))
}

/// The `q x p` matrix M ($p \le q$) for which $W M$ is [`orthonormalize`]'s basis;
/// `None` when `w` is zero.
fn orthonormalizer(w: MatRef<'_, f32>) -> Option<Mat<f32>> {
    let g = tall_gram_f64(w);
    // Fast path: Cholesky-QR, Q = W L^-T with G = L L^T, when no direction of W is
    // below 1e-5 of its largest (every pivot above 1e-10 of the largest diagonal);
    // otherwise the eigendecomposition, which drops the negligible directions.
    if let Some(l_inv_t) = cholesky_inverse_transpose(g.as_ref(), 1e-10) {
        return Some(Mat::<f32>::from_fn(w.ncols(), w.ncols(), |i, j| {
            l_inv_t[(i, j)] as f32
        }));
    }
    let eig = g.self_adjoint_eigen(Side::Lower).ok()?;
    let lambda = eig.S().column_vector();
    let n = w.ncols();
    let lambda_max = (0..n).map(|i| lambda[i]).fold(0.0f64, f64::max);
    if lambda_max <= 0.0 || !lambda_max.is_finite() {
        return None;
    }
    let keep: Vec<usize> = (0..n)
        .rev()
        .filter(|&i| lambda[i] > lambda_max * 1e-12)
        .collect();
    let p = eig.U();
    Some(Mat::<f32>::from_fn(n, keep.len(), |i, j| {
        (p[(i, keep[j])] / lambda[keep[j]].sqrt()) as f32
    }))
}

/// A thin SVD $Z = U_z \\,\mathrm{diag}(s)\\, V_z^\top$: `left` $U_z$ (`n x q`), `right`
/// $V_z$ (`q x q`), and `left_gram` $U_z^\top U_z$ (f64).
struct TallSvd {
    s: Vec<f64>,
    left: Mat<f64>,
    right: Mat<f64>,
    left_gram: Mat<f64>,
}

/// The thin SVD of the tall $\tilde Z = Z T$ (`z`: `n x q`, $n \ge q$; `t`: `q x q`)
/// through its Cholesky QR, from the Gram matrix `zz` $= Z^\top Z$ (f64) without forming
/// $\tilde Z$: $\tilde Z^\top \tilde Z = T^\top Z^\top Z T = L L^\top$, the SVD of the
/// `q x q` factor $L^\top = U_R S V_R^\top$, and $U_z = Z (T L^{-\top} U_R)$: one product
/// with Z instead of a Householder bidiagonalization of $\tilde Z$ (about 4x the CPU time
/// at 5120 x 272), and $U_z^\top U_z = C^\top Z^\top Z \\, C$ for $C = T L^{-\top} U_R$
/// from `q x q` matrices. $U_z$ is orthonormal to about
/// $\kappa(\tilde Z)^2 \epsilon_{64}$, so $\tilde Z$ must be well conditioned: `None` when
/// a squared Cholesky pivot is below $10^{-8}$ of the largest diagonal entry
/// ($\kappa > 10^4$, or a rank-deficient delta), and the caller takes faer's SVD of
/// $\tilde Z$.
fn tall_svd(
    z: MatRef<'_, f64>,
    t: MatRef<'_, f64>,
    zz: MatRef<'_, f64>,
    par: Par,
) -> Option<TallSvd> {
    let q = z.ncols();
    let small_product = |x: MatRef<'_, f64>, y: MatRef<'_, f64>| -> Mat<f64> {
        let mut out = Mat::<f64>::zeros(x.nrows(), y.ncols());
        matmul(out.as_mut(), Accum::Replace, x, y, 1.0, Par::Seq);
        out
    };
    let g = small_product(t.transpose(), small_product(zz, t).as_ref());
    let (l, l_inv_t) = cholesky_factors(g.as_ref(), 1e-8)?;
    let svd = l.transpose().svd().ok()?;
    let basis = small_product(t, small_product(l_inv_t.as_ref(), svd.U()).as_ref());
    let mut left = Mat::<f64>::zeros(z.nrows(), q);
    split_product(left.as_mut(), z, basis.as_ref(), par);
    let left_gram = small_product(
        basis.transpose(),
        small_product(zz, basis.as_ref()).as_ref(),
    );
    let s: Vec<f64> = (0..q).map(|i| svd.S().column_vector()[i]).collect();
    let finite =
        s.iter().all(|v| v.is_finite()) && left.col_iter().all(|c| c.iter().all(|v| v.is_finite()));
    finite.then(|| TallSvd {
        s,
        left,
        right: svd.V().to_owned(),
        left_gram,
    })
}

/// $L^{-\top}$ for the Cholesky factor $G = L L^\top$ of a symmetric positive definite
/// `g`, when every squared pivot is above `relative` times the largest diagonal entry;
/// `None` otherwise (not positive definite to that margin).
fn cholesky_inverse_transpose(g: MatRef<'_, f64>, relative: f64) -> Option<Mat<f64>> {
    cholesky_factors(g, relative).map(|(_, l_inv_t)| l_inv_t)
}

/// The Cholesky factor $L$ ($G = L L^\top$) and $L^{-\top}$, under the conditions of
/// [`cholesky_inverse_transpose`].
fn cholesky_factors(g: MatRef<'_, f64>, relative: f64) -> Option<(Mat<f64>, Mat<f64>)> {
    let n = g.nrows();
    let largest = (0..n).map(|i| g[(i, i)]).fold(0.0f64, f64::max);
    if !(largest > 0.0 && largest.is_finite()) {
        return None;
    }
    let llt = g.llt(Side::Lower).ok()?;
    let l = llt.L();
    // Written so that a NaN pivot fails too.
    if !(0..n).all(|i| l[(i, i)] * l[(i, i)] > relative * largest) {
        return None;
    }
    let mut inverse = Mat::<f64>::identity(n, n);
    faer::linalg::triangular_solve::solve_lower_triangular_in_place(l, inverse.as_mut(), Par::Seq);
    let t = inverse.transpose().to_owned();
    let finite = t.col_iter().all(|c| c.iter().all(|v| v.is_finite()));
    let lower = Mat::<f64>::from_fn(n, n, |i, j| if i >= j { l[(i, j)] } else { 0.0 });
    finite.then_some((lower, t))
}

/// Widens a matrix to f64, by columns in parallel.
fn to_f64(m: MatRef<'_, f32>) -> Mat<f64> {
    let mut out = Mat::<f64>::zeros(m.nrows(), m.ncols());
    out.par_col_iter_mut().enumerate().for_each(|(j, mut col)| {
        let src = m.col(j);
        for i in 0..src.nrows() {
            col[i] = src[i] as f64;
        }
    });
    out
}

/// A Gaussian test matrix (Box-Muller): unlike random signs, singular with probability 0,
/// which matters when the sketch is as wide as the matrix. Columns are filled in
/// parallel, each from its own stream of a generator seeded by one draw of `rng`, so the
/// matrix does not depend on the thread count; each draw of 64 random bits gives two
/// 24-bit uniforms and each such pair two values (cosine and sine), in f32 arithmetic
/// (a test matrix needs no more, and f32 `ln` / `sin_cos` cost half the f64 ones).
fn gaussian(rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Mat<f32> {
    const UNIT: f32 = 1.0 / (1u32 << 24) as f32;
    let seed: u64 = rng.random();
    let mut out = Mat::<f32>::zeros(rows, cols);
    out.par_col_iter_mut().enumerate().for_each(|(j, mut col)| {
        let mut stream = ChaCha8Rng::seed_from_u64(seed);
        stream.set_stream(j as u64);
        let mut i = 0;
        while i < rows {
            let bits: u64 = stream.random();
            // u1 in (0, 1], u2 in [0, 1).
            let u1 = 1.0 - (bits >> 40) as f32 * UNIT;
            let u2 = ((bits >> 8) & 0x00ff_ffff) as f32 * UNIT;
            let radius = (-2.0 * u1.ln()).sqrt();
            let (sin, cos) = (std::f32::consts::TAU * u2).sin_cos();
            col[i] = radius * cos;
            if i + 1 < rows {
                col[i + 1] = radius * sin;
            }
            i += 2;
        }
    });
    out
}

/// The AMX view of a faer matrix with non-negative strides; `None` otherwise.
fn amx_view(m: MatRef<'_, f32>) -> Option<MatrixRef<'_>> {
    let (rs, cs) = (
        usize::try_from(m.row_stride()).ok()?,
        usize::try_from(m.col_stride()).ok()?,
    );
    if m.nrows() == 0 || m.ncols() == 0 {
        return None;
    }
    let len = (m.nrows() - 1)
        .checked_mul(rs)?
        .checked_add((m.ncols() - 1).checked_mul(cs)?)?
        .checked_add(1)?;
    // SAFETY: a faer matrix view addresses `(i, j)` at `ptr + i * rs + j * cs` for every
    // element, all inside one allocation that lives as long as the view; with
    // non-negative strides the elements between the first and the last lie in it too.
    let data = unsafe { std::slice::from_raw_parts(m.as_ptr(), len) };
    MatrixRef::new(data, m.nrows(), m.ncols(), rs, cs).ok()
}

/// `lhs bf16(rhs)` on AMX tiles (docs/amx.md) when this process can use them, `None`
/// otherwise (the caller takes faer's f32 GEMM): two bf16 planes of `lhs` (the delta,
/// exact where an entry needs at most 16 significant bits) against the bf16 rounding of
/// `rhs` (a range finder's basis, which may be any basis), the sums in f32. For the range
/// products only: docs/extraction.md, "Numerics", says why pass Z is not one.
/// The product is written column-major into `out` (resized to hold it); `None` leaves
/// `out`'s values unspecified.
fn amx_product_into(lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>, out: &mut Vec<f32>) -> Option<()> {
    let amx = Amx::detect()?;
    let (a, b) = (amx_view(lhs)?, amx_view(rhs)?);
    let (rows, cols) = (lhs.nrows(), rhs.ncols());
    out.resize(rows.checked_mul(cols)?, 0.0);
    amx.matmul(
        MatrixMut::col_major(out, rows, cols, rows).ok()?,
        Operand::new(a, Planes::Two),
        Operand::new(b, Planes::One),
        Accumulate::Replace,
    )
    .ok()
}

fn f32_product(lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>, par: Par) -> Mat<f32> {
    let mut out = Mat::<f32>::zeros(lhs.nrows(), rhs.ncols());
    split_product(out.as_mut(), lhs, rhs, par);
    out
}

/// `lhs rhs` in f32, written column-major into `out` (resized to hold it; its old
/// values are not read: every entry is written).
fn f32_product_into<'a>(
    lhs: MatRef<'_, f32>,
    rhs: MatRef<'_, f32>,
    par: Par,
    out: &'a mut Vec<f32>,
) -> MatRef<'a, f32> {
    let (rows, cols) = (lhs.nrows(), rhs.ncols());
    out.resize(rows * cols, 0.0);
    split_product(
        MatMut::from_column_major_slice_mut(out, rows, cols),
        lhs,
        rhs,
        par,
    );
    MatRef::from_column_major_slice(out, rows, cols)
}

/// Large f32 buffers handed from one stage of a factorization to the next (the row
/// sample, W, Q, U: 17-22 MB each at 17408 x 5120): a buffer the allocator takes
/// fresh from the kernel has every page faulted in and zeroed on first touch, which
/// on the development VM costs about 0.5 ms per MB, a warm memset 0.04 ms.
#[derive(Default)]
struct Buffers {
    free: Vec<Vec<f32>>,
}

impl Buffers {
    /// The free buffer with the largest capacity (empty when there is none), its
    /// values unspecified.
    fn take(&mut self) -> Vec<f32> {
        let largest = (0..self.free.len()).max_by_key(|&i| self.free[i].capacity());
        largest.map_or_else(Vec::new, |i| self.free.swap_remove(i))
    }

    /// Hands a buffer back.
    fn give(&mut self, buffer: Vec<f32>) {
        self.free.push(buffer);
    }
}

/// Power iteration on a row sample `xs` (or the whole matrix): an orthonormal basis of
/// its dominant row space, `q` wide at most, after `iterations` products with $X_s$ and
/// $X_s^\top$ each. `None` when the sample is zero.
fn row_space_estimate(
    xs: MatRef<'_, f32>,
    q: usize,
    iterations: usize,
    rng: &mut ChaCha8Rng,
    par: Par,
) -> Option<Mat<f32>> {
    let mut vs = gaussian(xs.ncols(), q, rng);
    let mut buffer = Vec::new();
    for _ in 0..iterations {
        let w = range_product(xs, vs.as_ref(), par, &mut buffer);
        let qs = orthonormalize(w, par)?;
        let z = transposed_product(xs, qs.as_ref(), par);
        vs = orthonormalize(z.as_ref(), par)?;
    }
    Some(vs)
}

/// Whether `x` is stored column by column (each column contiguous): the transposed
/// view of a row-major delta.
fn column_major(x: MatRef<'_, f32>) -> bool {
    x.row_stride() == 1
}

/// $Z = X^\top Q$ with the large $X$ as a column-major operand of faer's GEMM, the layout
/// it runs fastest (single-threaded CPU time on the 17408 x 5120 delta, q = 272: with X
/// row-major, $X^\top Q$ 0.46-0.52 s against 0.81 s for $(Q^\top X)^\top$; with X
/// column-major, $(Q^\top X)^\top$ 0.36-0.46 s against 0.44-0.51 s).
fn transposed_product(x: MatRef<'_, f32>, q: MatRef<'_, f32>, par: Par) -> Mat<f32> {
    if column_major(x) {
        f32_product(q.transpose(), x, par).transpose().to_owned()
    } else {
        f32_product(x.transpose(), q, par)
    }
}

/// $W = X V$, written into `out` (resized to hold it): on AMX tiles where available
/// ([`amx_product_into`]), otherwise with the large $X$ as a column-major operand:
/// $(V^\top X^\top)^\top$ when X is row-major (0.36-0.46 s single-threaded against
/// 0.46-0.50 s for $X V$), $X V$ when it is column-major (0.46-0.54 s against 0.97-1.26
/// s). W comes back column-major, or row-major (the transpose of the column-major
/// $V^\top X^\top$, not copied) for a row-major X on faer's path.
fn range_product<'a>(
    x: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    par: Par,
    out: &'a mut Vec<f32>,
) -> MatRef<'a, f32> {
    if amx_product_into(x, v, out).is_some() {
        return MatRef::from_column_major_slice(out, x.nrows(), v.ncols());
    }
    if column_major(x) {
        f32_product_into(x, v, par, out)
    } else {
        f32_product_into(v.transpose(), x.transpose(), par, out).transpose()
    }
}

/// The rows `picked` (sorted) of `x`, as a `picked.len() x x.ncols()` matrix in `out`
/// (resized to hold it), stored in the layout of `x`: copied row by row when x's rows
/// are contiguous, column by column (the sorted rows of one column read with the
/// previous columns' cache lines still resident) when its columns are.
fn gather_rows<'a>(x: MatRef<'_, f32>, picked: &[usize], out: &'a mut Vec<f32>) -> MatRef<'a, f32> {
    let (rows, cols) = (picked.len(), x.ncols());
    out.resize(rows * cols, 0.0);
    if column_major(x) {
        out.par_chunks_mut(rows.max(1))
            .enumerate()
            .for_each(|(j, col)| {
                for (value, &row) in col.iter_mut().zip(picked) {
                    *value = x[(row, j)];
                }
            });
        MatRef::from_column_major_slice(out, rows, cols)
    } else {
        out.par_chunks_mut(cols.max(1))
            .zip(picked.par_iter())
            .for_each(|(dst, &row)| {
                for (j, value) in dst.iter_mut().enumerate() {
                    *value = x[(row, j)];
                }
            });
        MatRef::from_row_major_slice(out, rows, cols)
    }
}

/// Randomized subspace iteration on `x` (`big x small`, `big >= small`).
fn randomized(
    module: &str,
    x: MatRef<'_, f32>,
    delta_norm_sq: f64,
    params: &FactorParams,
    clock: &mut StageClock,
) -> Result<Factorization> {
    let (big, small) = (x.nrows(), x.ncols());
    let k_target = params.max_rank.min(small);
    let q = (k_target + params.oversample).min(small);
    let par = params.par;
    let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
    let mut buffers = Buffers::default();

    // Row-space estimate from a sample of rows: enough rows (4q) that the sample's row
    // space carries every direction of the delta's; one power iteration on it (two
    // products with the sample, 1/8 of a pass at 1/16 of the rows), which the two full
    // passes then refine: on the `factorize` bench's delta the residual is 1.000076x the
    // exact truncation's (two iterations on the sample: 1.000052x, for 1/8 pass more;
    // half the rows: 1.00022x). A sample that is all zero (a delta confined to a few
    // rows) falls back to a random basis, which the first full pass turns into the
    // exact range. A matrix too short to sample gets two iterations on all its rows.
    let sample_rows = (4 * q).max(big / 16);
    let mut passes;
    let estimate = if sample_rows * 2 >= big {
        passes = 4.0;
        row_space_estimate(x, q, 2, &mut rng, par)
    } else {
        let mut picked = sample(&mut rng, big, sample_rows).into_vec();
        picked.sort_unstable();
        // The sample's buffer becomes W's, then U's (`Buffers`).
        let mut buffer = buffers.take();
        let xs = gather_rows(x, &picked, &mut buffer);
        passes = 2.0 * sample_rows as f64 / big as f64;
        let estimate = row_space_estimate(xs, q, SAMPLE_ITERATIONS, &mut rng, par);
        buffers.give(buffer);
        estimate
    };
    let mut v0 = match estimate {
        Some(v) => v,
        None => orthonormalize(gaussian(small, q, &mut rng).as_ref(), par)
            .expect("a random sign matrix has full rank"),
    };
    clock.lap("sample");

    let mut best: Option<Factorization> = None;
    let mut iteration = 0usize;
    loop {
        // Two full passes: W = X V0, Q = orth(W), Z = X^T Q.
        let mut w_buffer = buffers.take();
        let w = range_product(x, v0.as_ref(), par, &mut w_buffer);
        clock.lap("pass_w");
        let m = orthonormalizer(w).ok_or_else(|| ExtractError::Linalg {
            module: module.to_string(),
            what: "range of the sketch",
            detail: "the sketch of a non-zero delta is zero".into(),
        })?;
        let mut q_buffer = buffers.take();
        let qw = f32_product_into(w, m.as_ref(), par, &mut q_buffer);
        // W's buffer is free now: U is formed in it (`project`).
        buffers.give(w_buffer);
        clock.lap("orthonormalize");
        let z = transposed_product(x, qw, par);
        clock.lap("pass_z");
        passes += 2.0;
        let current = project(
            module,
            qw,
            z.as_ref(),
            delta_norm_sq,
            k_target,
            passes,
            par,
            buffers.take(),
        )?;
        let q_cols = qw.ncols();
        buffers.give(q_buffer);
        clock.lap("project");
        let k = current.kept();
        let residual = current.truncation_residual(k);
        let at_floor = params.floor.is_some_and(|f| {
            residual <= (1.0 + params.floor_slack) * expected_floor_ratio(big, small, k) * f
        });
        let improved_little = best.as_ref().is_some_and(|b| {
            let previous = b.truncation_residual(b.kept());
            previous - residual <= params.convergence_tolerance * previous
        });
        let better = best
            .as_ref()
            .is_none_or(|b| residual < b.truncation_residual(b.kept()));
        // A basis that spans the whole small side makes the projection exact.
        let converged = at_floor || improved_little || residual == 0.0 || q_cols == small;
        // The result not kept hands its U's buffer back for the next iteration's W.
        let discarded = if better {
            best.replace(current)
        } else {
            Some(current)
        };
        if let Some(Factorization {
            u: Basis::F32 { values, .. },
            ..
        }) = discarded
        {
            buffers.give(values);
        }
        if converged || iteration >= params.max_extra_iterations {
            let mut result = best.expect("at least one iteration ran");
            result.converged = converged;
            result.passes = passes;
            return Ok(result);
        }
        iteration += 1;
        v0 = orthonormalize(z.as_ref(), par).ok_or_else(|| ExtractError::Linalg {
            module: module.to_string(),
            what: "range of the projected delta",
            detail: "zero".into(),
        })?;
    }
}

/// The SVD of the projection $\tilde Q \tilde Q^\top X$ from $Q$ (`big x q`, orthonormal to
/// f32 precision) and $Z = X^\top Q$, with $G = Q^\top Q = L L^\top$ in f64 correcting the
/// basis: $\tilde Q = Q L^{-\top}$ is orthonormal in exact arithmetic whatever Q's rounding.
/// U is formed in `u_buffer`'s allocation.
#[allow(clippy::too_many_arguments)]
fn project(
    module: &str,
    qw: MatRef<'_, f32>,
    z: MatRef<'_, f32>,
    delta_norm_sq: f64,
    k_target: usize,
    passes: f64,
    par: Par,
    mut u_buffer: Vec<f32>,
) -> Result<Factorization> {
    let (big, q) = (qw.nrows(), qw.ncols());
    let small = z.nrows();
    // Q~ = Q L^-T with G = L L^T is orthonormal in exact arithmetic. Q is orthonormal
    // to f32 precision, so every pivot must be near 1: one below 0.5 means the basis
    // lost its orthonormality.
    // Z~ = Z L^-T = X^T Q~ = W S X_z^T  =>  Q~ Q~^T X = (Q L^-T X_z) S W^T. Z~ is not
    // formed: its SVD comes from Z's Gram matrix (f32 values widened: exact products,
    // f64 sums) and one product with Z. G and its Cholesky factor (serial, `q x q`)
    // are formed beside Z's widening and Gram matrix.
    let ((g, l_inv_t), (z64, zz)) = rayon::join(
        || {
            let g = tall_gram_f64(qw);
            let l_inv_t = cholesky_inverse_transpose(g.as_ref(), 0.5);
            (g, l_inv_t)
        },
        || (to_f64(z), tall_gram_f64(z)),
    );
    let l_inv_t = l_inv_t.ok_or_else(|| ExtractError::Linalg {
        module: module.to_string(),
        what: "orthonormal basis of the sketch",
        detail: "the Gram matrix of the basis has a pivot below 0.5".into(),
    })?;
    let svd = match tall_svd(z64.as_ref(), l_inv_t.as_ref(), zz.as_ref(), par) {
        Some(svd) => svd,
        None => {
            let mut zt = Mat::<f64>::zeros(small, q);
            matmul(
                zt.as_mut(),
                Accum::Replace,
                z64.as_ref(),
                l_inv_t.as_ref(),
                1.0,
                par,
            );
            let svd = zt.thin_svd().map_err(|e| ExtractError::Linalg {
                module: module.to_string(),
                what: "thin SVD of the projected delta",
                detail: format!("{e:?}"),
            })?;
            let left = svd.U().to_owned();
            let left_gram = gram(left.as_ref(), q);
            TallSvd {
                s: (0..q).map(|i| svd.S().column_vector()[i]).collect(),
                left,
                right: svd.V().to_owned(),
                left_gram,
            }
        }
    };
    drop(z64);
    let TallSvd {
        s: s_all,
        left,
        right,
        left_gram,
    } = svd;
    let k = numerical_rank(&s_all, k_target);
    let first_dropped = s_all.get(k).copied();
    let mut coeff = Mat::<f64>::zeros(q, k);
    matmul(
        coeff.as_mut(),
        Accum::Replace,
        l_inv_t.as_ref(),
        right.subcols(0, k),
        1.0,
        Par::Seq,
    );
    // U = Q coeff, formed in f32 (it becomes an f32 factor); its Gram matrix is known
    // exactly from the small matrices: U^T U = coeff^T G coeff.
    let coeff32 = Mat::<f32>::from_fn(q, k, |i, j| coeff[(i, j)] as f32);
    f32_product_into(qw, coeff32.as_ref(), par, &mut u_buffer);
    let u = Basis::F32 {
        values: u_buffer,
        rows: big,
        cols: k,
    };
    let mut g_coeff = Mat::<f64>::zeros(q, k);
    matmul(
        g_coeff.as_mut(),
        Accum::Replace,
        g.as_ref(),
        coeff.as_ref(),
        1.0,
        Par::Seq,
    );
    let mut u_gram = Mat::<f64>::zeros(k, k);
    matmul(
        u_gram.as_mut(),
        Accum::Replace,
        coeff.transpose(),
        g_coeff.as_ref(),
        1.0,
        Par::Seq,
    );
    // The kept columns, in place.
    let mut v = left;
    v.truncate(small, k);
    let v_gram = left_gram.submatrix(0, 0, k, k).to_owned();
    Ok(Factorization {
        rows: big,
        cols: small,
        u,
        s: s_all[..k].to_vec(),
        v: Basis::F64(v),
        first_dropped,
        delta_norm_sq,
        u_gram,
        v_gram,
        method_used: Method::Randomized,
        passes,
        converged: false,
        stages: Vec::new(),
    })
}

/// Exact method: f64 Gram matrix of the small side, eigendecomposition, re-projection.
fn exact(
    module: &str,
    x: MatRef<'_, f32>,
    delta_norm_sq: f64,
    params: &FactorParams,
    clock: &mut StageClock,
) -> Result<Factorization> {
    let (big, small) = (x.nrows(), x.ncols());
    let k_target = params.max_rank.min(small);
    // G = X^T X accumulated over blocks of rows widened to f64 (bounded memory).
    const BLOCK: usize = 512;
    let mut g = Mat::<f64>::zeros(small, small);
    let mut start = 0;
    while start < big {
        let len = BLOCK.min(big - start);
        let block = Mat::<f64>::from_fn(len, small, |i, j| x[(start + i, j)] as f64);
        matmul(
            g.as_mut(),
            Accum::Add,
            block.transpose(),
            block.as_ref(),
            1.0,
            params.par,
        );
        start += len;
    }
    let eig = g
        .self_adjoint_eigen(Side::Lower)
        .map_err(|e| ExtractError::Linalg {
            module: module.to_string(),
            what: "Gram eigendecomposition",
            detail: format!("{e:?}"),
        })?;
    // Eigenvalues ascending: take the top ones, largest first.
    let lambda = eig.S().column_vector();
    let s_gram: Vec<f64> = (0..small)
        .rev()
        .map(|i| lambda[i].max(0.0).sqrt())
        .collect();
    // Candidates: a little past the tolerance, since Gram eigenvalues near it are only
    // accurate relative to s_0^2; the re-projection decides.
    let candidates = s_gram
        .iter()
        .take(k_target)
        .take_while(|&&v| v > s_gram[0] * NUMERICAL_RANK_TOLERANCE * 1e-2)
        .count()
        .max(1);
    let vk = Mat::<f64>::from_fn(small, candidates, |i, j| eig.U()[(i, small - 1 - j)]);
    clock.lap("gram");
    // Y = X V_k in f64, by blocks of rows.
    let mut y = Mat::<f64>::zeros(big, candidates);
    let mut start = 0;
    while start < big {
        let len = BLOCK.min(big - start);
        let block = Mat::<f64>::from_fn(len, small, |i, j| x[(start + i, j)] as f64);
        matmul(
            y.as_mut().subrows_mut(start, len),
            Accum::Replace,
            block.as_ref(),
            vk.as_ref(),
            1.0,
            params.par,
        );
        start += len;
    }
    let svd = y.thin_svd().map_err(|e| ExtractError::Linalg {
        module: module.to_string(),
        what: "thin SVD of the re-projected delta",
        detail: format!("{e:?}"),
    })?;
    let s_all: Vec<f64> = (0..candidates)
        .map(|i| svd.S().column_vector()[i])
        .collect();
    let k = numerical_rank(&s_all, k_target);
    let first_dropped = s_all
        .get(k)
        .copied()
        .or_else(|| s_gram.get(k_target).copied());
    let u = svd.U().subcols(0, k).to_owned();
    let mut v = Mat::<f64>::zeros(small, k);
    matmul(
        v.as_mut(),
        Accum::Replace,
        vk.as_ref(),
        svd.V().subcols(0, k),
        1.0,
        Par::Seq,
    );
    let u_gram = gram(u.as_ref(), k);
    let v_gram = gram(v.as_ref(), k);
    clock.lap("reproject");
    Ok(Factorization {
        rows: big,
        cols: small,
        u: Basis::F64(u),
        s: s_all[..k].to_vec(),
        v: Basis::F64(v),
        first_dropped,
        delta_norm_sq,
        u_gram,
        v_gram,
        method_used: Method::Exact,
        passes: 2.0,
        converged: true,
        stages: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::floor::{FloorFormat, rounding_floor};
    use half::bf16;

    fn round_bf16(x: f32) -> f32 {
        bf16::from_f32(x).to_f32()
    }

    /// A bf16 base, a rank-`rank` change with singular values spread over `decay`, the
    /// merged weight rounded to bf16, and the delta merged - base (exact in f32).
    fn synthetic(
        rows: usize,
        cols: usize,
        rank: usize,
        relative: f64,
        decay: f64,
        seed: u64,
    ) -> (Vec<f32>, Vec<f32>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut gauss = || {
            // Box-Muller from two uniforms.
            let u1: f64 = rng.random::<f64>().max(1e-300);
            let u2: f64 = rng.random::<f64>();
            (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
        };
        let base: Vec<f32> = (0..rows * cols)
            .map(|_| round_bf16((gauss() * 0.02) as f32))
            .collect();
        let left = Mat::<f64>::from_fn(rows, rank, |_, _| gauss())
            .qr()
            .compute_thin_Q();
        let right = Mat::<f64>::from_fn(cols, rank, |_, _| gauss())
            .qr()
            .compute_thin_Q();
        let s: Vec<f64> = (0..rank)
            .map(|i| decay.powf(-(i as f64) / (rank.max(2) - 1) as f64))
            .collect();
        let mut low = vec![0f64; rows * cols];
        for i in 0..rows {
            for l in 0..rank {
                let a = left[(i, l)] * s[l];
                for j in 0..cols {
                    low[i * cols + j] += a * right[(j, l)];
                }
            }
        }
        let base_norm: f64 = base.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let low_norm: f64 = low.iter().map(|x| x * x).sum::<f64>().sqrt();
        let scale = relative * base_norm / low_norm;
        let merged: Vec<f32> = base
            .iter()
            .zip(&low)
            .map(|(&b, &l)| round_bf16(b + (l * scale) as f32))
            .collect();
        let delta: Vec<f32> = merged.iter().zip(&base).map(|(&m, &b)| m - b).collect();
        (merged, delta)
    }

    fn params(rank: usize, method: Method, floor: f64) -> FactorParams {
        FactorParams {
            max_rank: rank,
            method,
            floor: Some(floor),
            ..FactorParams::default()
        }
    }

    #[test]
    fn low_rank_plus_rounding_noise_is_recovered_at_the_floor() {
        for &(rows, cols, rank) in &[(640usize, 256usize, 32usize), (192, 576, 24)] {
            let (merged, delta) = synthetic(rows, cols, rank, 0.1, 30.0, 7);
            let floor = rounding_floor(&merged, FloorFormat::Bf16);
            let expected = expected_floor_ratio(rows, cols, rank);
            for method in [Method::Randomized, Method::Exact, Method::Auto] {
                let f = factorize("m", &delta, rows, cols, &params(rank, method, floor)).unwrap();
                assert_eq!(f.kept(), rank);
                let ratio = f.truncation_residual(rank) / floor;
                assert!(
                    (0.9..=1.05).contains(&(ratio / expected)),
                    "{rows}x{cols} {method:?}: ratio {ratio} expected {expected}"
                );
                assert!(f.certificate_consistent(rank));
            }
            let exact =
                factorize("m", &delta, rows, cols, &params(rank, Method::Exact, floor)).unwrap();
            let randomized = factorize(
                "m",
                &delta,
                rows,
                cols,
                &params(rank, Method::Randomized, floor),
            )
            .unwrap();
            let excess = randomized.truncation_residual(rank) / exact.truncation_residual(rank);
            assert!(
                (0.9999..1.001).contains(&excess),
                "randomized / exact residual {excess}"
            );
        }
    }

    /// The certificate must agree with the residual computed the slow way.
    #[test]
    fn certificate_matches_a_direct_f64_residual() {
        let (rows, cols, rank) = (300usize, 200usize, 16usize);
        let (merged, delta) = synthetic(rows, cols, rank, 0.05, 10.0, 3);
        let floor = rounding_floor(&merged, FloorFormat::Bf16);
        for method in [Method::Randomized, Method::Exact] {
            let f = factorize("m", &delta, rows, cols, &params(rank, method, floor)).unwrap();
            let mut direct = 0f64;
            for i in 0..rows {
                for j in 0..cols {
                    let approx: f64 = (0..rank)
                        .map(|l| f.u.get(i, l) * f.s[l] * f.v.get(j, l))
                        .sum();
                    direct += (delta[i * cols + j] as f64 - approx).powi(2);
                }
            }
            let direct = direct.sqrt();
            // Equal up to the f32 accumulation of the passes: a few 1e-8 of ||D||.
            let cert = f.certificate(rank);
            let tolerance = 1e-6 * f.delta_norm();
            assert!(
                (cert.residual - direct).abs() < tolerance,
                "{method:?} {} vs {direct}",
                cert.residual
            );
            assert!((cert.singular_value_residual - direct).abs() < tolerance);
            assert!(
                direct > 10.0 * tolerance,
                "the residual must be well above the tolerance"
            );
        }
    }

    /// A wide delta that changes only 2 of 16 rows has 14 zero singular values, which
    /// nothing may divide by: it keeps rank 2, finite factors, and reproduces the delta.
    #[test]
    fn rank_deficient_wide_delta_keeps_its_rank() {
        let (rows, cols) = (16usize, 48usize);
        let mut delta = vec![0f32; rows * cols];
        for j in 0..cols {
            delta[3 * cols + j] = round_bf16(((j * 7 % 11) as f32 - 5.0) * 0.01);
            delta[11 * cols + j] = round_bf16(((j * 5 % 13) as f32 - 6.0) * 0.02);
        }
        for method in [Method::Randomized, Method::Exact, Method::Auto] {
            let f = factorize("down_proj", &delta, rows, cols, &params(16, method, 1e-6)).unwrap();
            assert_eq!(f.kept(), 2, "{method:?}");
            assert!(f.u.is_finite());
            assert!(f.truncation_residual(2) < 1e-6 * f.delta_norm());
        }
    }

    #[test]
    fn all_zero_delta_is_refused() {
        let err = factorize(
            "q_proj",
            &[0.0, -0.0, 0.0, 0.0],
            2,
            2,
            &FactorParams::default(),
        )
        .unwrap_err();
        assert!(matches!(err, ExtractError::AllZeroDelta { ref module } if module == "q_proj"));
    }

    #[test]
    fn nan_delta_is_refused_with_its_index() {
        let err = factorize(
            "k_proj",
            &[0.5, 1.0, f32::NAN, 0.0],
            2,
            2,
            &FactorParams::default(),
        )
        .unwrap_err();
        assert!(
            matches!(err, ExtractError::NonFinite { index: 2, .. }),
            "{err}"
        );
    }
}

#[cfg(test)]
mod full_width_tests {
    use super::*;

    /// A delta narrower than the rank (in_proj_a / in_proj_b) is reproduced exactly.
    #[test]
    fn a_delta_narrower_than_the_rank_is_reproduced() {
        for &(rows, cols) in &[(4usize, 64usize), (64, 4), (48, 5120)] {
            let delta: Vec<f32> = (0..rows * cols)
                .map(|i| (((i * 7919) % 1009) as f32 - 504.0) * 1e-4)
                .collect();
            for method in [Method::Exact, Method::Randomized, Method::Auto] {
                let params = FactorParams {
                    max_rank: 256,
                    method,
                    floor: Some(1e-6),
                    ..FactorParams::default()
                };
                let f = factorize("in_proj_a", &delta, rows, cols, &params).unwrap();
                assert_eq!(f.kept(), rows.min(cols), "{rows}x{cols} {method:?}");
                let relative = f.truncation_residual(f.kept()) / f.delta_norm();
                assert!(
                    relative < 1e-5,
                    "{rows}x{cols} {method:?}: residual {relative}"
                );
            }
        }
    }
}

#[cfg(test)]
mod rank_deficient_tests {
    use super::*;

    /// The randomized path on a tall delta confined to 2 rows: the row sample misses
    /// them (it is all zero), the random fallback basis still finds the exact range.
    #[test]
    fn a_delta_confined_to_two_rows_keeps_rank_two_on_the_randomized_path() {
        let (rows, cols) = (1200usize, 200usize);
        let mut delta = vec![0f32; rows * cols];
        for j in 0..cols {
            delta[17 * cols + j] = ((j * 7 % 11) as f32 - 5.0) * 0.01;
            delta[901 * cols + j] = ((j * 5 % 13) as f32 - 6.0) * 0.02;
        }
        let params = FactorParams {
            max_rank: 32,
            method: Method::Randomized,
            floor: Some(1e-6),
            ..FactorParams::default()
        };
        let f = factorize("down_proj", &delta, rows, cols, &params).unwrap();
        assert_eq!(f.method_used, Method::Randomized);
        assert_eq!(f.kept(), 2);
        assert!(f.u.is_finite());
        assert!(f.truncation_residual(2) < 1e-3 * f.delta_norm());
    }
}
