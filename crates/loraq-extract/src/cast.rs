//! Cast-aware bf16 rounding of a pair of LoRA factors.
//!
//! Given f32 factors $B_0$ (`rows x k`) and $A_0$ (`k x cols`) of the truncation
//! $L = B_0 A_0$, the bf16 pair $(B_q, A_q)$ is chosen so that $B_q A_q$ stays close to
//! $L$, not each factor close to its own f32 values:
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
//!    that lower $e_j^\top H e_j$ are taken while any does (a few sweeps).
//! 3. **B refit** in f64 against the rounded A: $B = L A_q^\top (A_q A_q^\top)^{-1}$
//!    (computed from the $k \times k$ matrices $A_0 A_q^\top$ and $A_q A_q^\top$; with
//!    column weights $w$, $A_q W^2 A_q^\top$), then rounded the same way, row by row,
//!    with $H = A_q W^2 A_q^\top$.
//! 4. **One alternation.** A refit against the rounded B,
//!    $A = (B_q^\top B_q)^{-1} B_q^\top L$, rounded again, then B refit and rounded again.
//!
//! The cast error $\\|B_q A_q - L\\|_F$ is measured exactly without forming either
//! product (see [`crate::split`]).

use crate::error::{ExtractError, Result};
use faer::linalg::matmul::matmul;
use faer::linalg::solvers::{DenseSolveCore, Solve};
use faer::{Accum, Mat, MatRef, Par, Side};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// Seed of the mixing rotation (the factors are deterministic for a given rank).
const ROTATION_SEED: u64 = 0x6c6f_7261_7163_6173;

/// Sweeps of single-ulp moves after the sequential rounding.
const POLISH_SWEEPS: usize = 3;

/// Refit-and-round rounds after the first one.
const ALTERNATIONS: usize = 1;

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

/// `x` (`rows x k`, row-major f32) times `t` (`k x k2`, f64) in f32.
fn times_small(x: &[f32], rows: usize, k: usize, t: MatRef<'_, f64>, par: Par) -> Vec<f32> {
    let k2 = t.ncols();
    let t32 = Mat::<f32>::from_fn(k, k2, |i, j| t[(i, j)] as f32);
    let xm = MatRef::from_row_major_slice(x, rows, k);
    let mut out = vec![0f32; rows * k2];
    let om = faer::MatMut::from_row_major_slice_mut(&mut out, rows, k2);
    matmul(om, Accum::Replace, xm, t32.as_ref(), 1.0, par);
    out
}

/// $X^\top Y$ in f64 for `rows x k` row-major f32 matrices, over blocks of rows widened
/// to f64 (an f32 Gram matrix is not accurate enough to invert when $s_0/s_k$ is large).
fn cross_f64(x: &[f32], y: &[f32], rows: usize, kx: usize, ky: usize, par: Par) -> Mat<f64> {
    const BLOCK: usize = 1024;
    let mut out = Mat::<f64>::zeros(kx, ky);
    let mut start = 0;
    while start < rows {
        let len = BLOCK.min(rows - start);
        let xb = Mat::<f64>::from_fn(len, kx, |i, l| x[(start + i) * kx + l] as f64);
        let yb = Mat::<f64>::from_fn(len, ky, |i, l| y[(start + i) * ky + l] as f64);
        matmul(
            out.as_mut(),
            Accum::Add,
            xb.transpose(),
            yb.as_ref(),
            1.0,
            par,
        );
        start += len;
    }
    out
}

/// $X W^2 Y^\top$ in f64 for `k x cols` row-major f32 matrices (`w`: column weights).
fn wide_cross_f64(
    x: &[f32],
    y: &[f32],
    kx: usize,
    ky: usize,
    cols: usize,
    weights: Option<&[f32]>,
    par: Par,
) -> Mat<f64> {
    let weight = |j: usize| weights.map_or(1.0, |w| w[j] as f64);
    let xm = Mat::<f64>::from_fn(cols, kx, |j, l| x[l * cols + j] as f64 * weight(j));
    let ym = Mat::<f64>::from_fn(cols, ky, |j, l| y[l * cols + j] as f64 * weight(j));
    let mut out = Mat::<f64>::zeros(kx, ky);
    matmul(
        out.as_mut(),
        Accum::Replace,
        xm.transpose(),
        ym.as_ref(),
        1.0,
        par,
    );
    out
}

/// `(k x k) \ rhs` for a symmetric positive definite `h` (Cholesky in f64), or `None`.
fn spd_solve(h: MatRef<'_, f64>, rhs: MatRef<'_, f64>) -> Option<Mat<f64>> {
    let llt = h.llt(Side::Lower).ok()?;
    let x = llt.solve(rhs);
    let finite = x.col_iter().all(|c| c.iter().all(|v| v.is_finite()));
    finite.then_some(x)
}

/// The next bf16 value above (`up`) or below `x`, if finite.
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

/// Rounds every row of `x` (`rows x k`, row-major) to bf16 so that $e H e^\top$ is small
/// for each row's error $e$: sequential rounding with error feedback through the upper
/// Cholesky factor of $H^{-1}$, then sweeps of single-ulp moves that lower the loss.
/// Plain round-to-nearest when $H$ is not positive definite to f64 precision.
fn round_rows(x: &[f32], k: usize, h: MatRef<'_, f64>, par: Par) -> Vec<bf16> {
    // Upper Cholesky factor of H^-1: H^-1 = U^T U, U = L^T with L L^T = H^-1.
    let feedback: Option<Vec<f64>> = (|| {
        let inverse = h.llt(Side::Lower).ok()?.inverse();
        let l = inverse.llt(Side::Lower).ok()?;
        let l = l.L();
        let mut u = vec![0f64; k * k];
        for i in 0..k {
            for j in i..k {
                u[i * k + j] = l[(j, i)];
            }
        }
        (0..k).all(|i| u[i * k + i] > 0.0).then_some(u)
    })();
    let hk: Vec<f64> = (0..k * k).map(|i| h[(i / k, i % k)]).collect();
    let rows = x.len() / k;
    // Sequential rounding with error feedback, row by row.
    let mut out = vec![bf16::ZERO; x.len()];
    out.par_chunks_mut(k).zip(x.par_chunks(k)).for_each_init(
        || vec![0f64; k],
        |w, (q, row)| {
            for (wi, &v) in w.iter_mut().zip(row) {
                *wi = v as f64;
            }
            for l in 0..k {
                let r = bf16::from_f64(w[l]);
                q[l] = r;
                if let Some(u) = &feedback {
                    let e = (w[l] - r.to_f64()) / u[l * k + l];
                    for (wt, &ut) in w[l + 1..].iter_mut().zip(&u[l * k + l + 1..(l + 1) * k]) {
                        *wt -= e * ut;
                    }
                }
            }
        },
    );
    if out.par_iter().any(|v| !v.is_finite()) {
        // Refused by the caller's finite check.
        return out;
    }
    // g = e H for every row's error e = q - x, as one product.
    let errors: Vec<f64> = out
        .par_iter()
        .zip(x.par_iter())
        .map(|(&r, &v)| r.to_f64() - v as f64)
        .collect();
    let mut gradients = vec![0f64; x.len()];
    matmul(
        faer::MatMut::from_row_major_slice_mut(&mut gradients, rows, k),
        Accum::Replace,
        MatRef::from_row_major_slice(&errors, rows, k),
        h,
        1.0,
        par,
    );
    drop(errors);
    // Single-ulp moves that lower e H e^T, row by row.
    out.par_chunks_mut(k)
        .zip(gradients.par_chunks_mut(k))
        .for_each(|(q, g)| {
            for _ in 0..POLISH_SWEEPS {
                let mut moved = false;
                for l in 0..k {
                    let hll = hk[l * k + l];
                    for up in [true, false] {
                        let Some(c) = bf16_step(q[l], up) else {
                            continue;
                        };
                        let d = c.to_f64() - q[l].to_f64();
                        if 2.0 * d * g[l] + d * d * hll < 0.0 {
                            q[l] = c;
                            let hl = &hk[l * k..(l + 1) * k];
                            for (gi, &hv) in g.iter_mut().zip(hl) {
                                *gi += d * hv;
                            }
                            moved = true;
                            break;
                        }
                    }
                }
                if !moved {
                    break;
                }
            }
        });
    out
}

/// Transposes a row-major `rows x cols` matrix.
fn transpose<T: Copy + Send + Sync + Default>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut out = vec![T::default(); x.len()];
    out.par_chunks_mut(rows.max(1))
        .enumerate()
        .for_each(|(j, col)| {
            for (i, v) in col.iter_mut().enumerate() {
                *v = x[i * cols + j];
            }
        });
    out
}

fn widen(x: &[bf16]) -> Vec<f32> {
    x.par_iter().map(|v| v.to_f32()).collect()
}

/// Rounds A (`k x cols`) column by column with $H = B^\top B$.
fn round_a(a: &[f32], k: usize, cols: usize, btb: MatRef<'_, f64>, par: Par) -> Vec<bf16> {
    let at = transpose(a, k, cols);
    let qt = round_rows(&at, k, btb, par);
    transpose(&qt, cols, k)
}

/// The cast-aware bf16 pair: `(B_q, A_q, B_0, A_0)` with $B_0 A_0 = B A$ the rotated f32
/// factors the cast error is measured against.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub(crate) fn cast_aware(
    module: &str,
    b: &[f32],
    a: &[f32],
    rows: usize,
    cols: usize,
    k: usize,
    weights: Option<&[f32]>,
    par: Par,
) -> Result<(Vec<bf16>, Vec<bf16>, Vec<f32>, Vec<f32>)> {
    let rotation = mixing_rotation(k);
    // B0 = B M^T, A0 = M A.
    let b0 = times_small(b, rows, k, rotation.transpose(), par);
    let a0t = times_small(&transpose(a, k, cols), cols, k, rotation.transpose(), par);
    let a0 = transpose(&a0t, cols, k);
    drop(a0t);
    let finite = |what: &'static str, x: &[bf16]| -> Result<()> {
        match x.par_iter().position_first(|v| !v.is_finite()) {
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
    let b0tb0 = cross_f64(&b0, &b0, rows, k, k, par);
    let mut aq = round_a(&a0, k, cols, b0tb0.as_ref(), par);
    finite(WHAT_A, &aq)?;
    let mut bq = refit_and_round_b(&b0, &a0, &aq, rows, cols, k, weights, par);
    finite(WHAT_B, &bq)?;
    for _ in 0..ALTERNATIONS {
        // A = (Bq^T Bq)^-1 (Bq^T B0) A0, rounded with H = Bq^T Bq.
        let bqf = widen(&bq);
        let btb = cross_f64(&bqf, &bqf, rows, k, k, par);
        let btb0 = cross_f64(&bqf, &b0, rows, k, k, par);
        drop(bqf);
        let Some(t) = spd_solve(btb.as_ref(), btb0.as_ref()) else {
            break;
        };
        let a1t = times_small(&transpose(&a0, k, cols), cols, k, t.transpose(), par);
        let a1 = transpose(&a1t, cols, k);
        let aq1 = round_a(&a1, k, cols, btb.as_ref(), par);
        if finite(WHAT_A, &aq1).is_err() {
            break;
        }
        let bq1 = refit_and_round_b(&b0, &a0, &aq1, rows, cols, k, weights, par);
        if finite(WHAT_B, &bq1).is_err() {
            break;
        }
        aq = aq1;
        bq = bq1;
    }
    Ok((bq, aq, b0, a0))
}

/// B refit against $L = B_0 A_0$ for the rounded A, then rounded row by row with
/// $H = A_q W^2 A_q^\top$. Falls back to rounding $B_0$ when the refit is singular.
#[allow(clippy::too_many_arguments)]
fn refit_and_round_b(
    b0: &[f32],
    a0: &[f32],
    aq: &[bf16],
    rows: usize,
    cols: usize,
    k: usize,
    weights: Option<&[f32]>,
    par: Par,
) -> Vec<bf16> {
    let aqf = widen(aq);
    let gram = wide_cross_f64(&aqf, &aqf, k, k, cols, weights, par);
    let cross = wide_cross_f64(a0, &aqf, k, k, cols, weights, par);
    // B = B0 (A0 W^2 Aq^T) (Aq W^2 Aq^T)^-1 = B0 T, T = cross G^-1 = (G^-1 cross^T)^T.
    let refit = spd_solve(gram.as_ref(), cross.transpose()).map(|t| {
        let t = t.transpose().to_owned();
        times_small(b0, rows, k, t.as_ref(), par)
    });
    let target = refit.as_deref().unwrap_or(b0);
    round_rows(target, k, gram.as_ref(), par)
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
        let (bq, aq, b0, a0) = cast_aware("m", &b, &a, rows, cols, k, None, Par::Seq).unwrap();
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
        let (bq, aq, _, _) = cast_aware("m", &b, &a, rows, cols, k, None, Par::Seq).unwrap();
        let aware = dense_error(&bq, &aq, &b, &a, rows, cols, k);
        assert!(
            aware < plain,
            "flat spectrum: cast-aware {aware} vs nearest {plain}"
        );
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
        let (bq, aq, _, _) = cast_aware("m", &b, &a, rows, cols, k, None, Par::Seq).unwrap();
        let unweighted = weighted_error(&bq, &aq);
        let (bq, aq, _, _) =
            cast_aware("m", &b, &a, rows, cols, k, Some(&weights), Par::Seq).unwrap();
        let weighted = weighted_error(&bq, &aq);
        assert!(weighted < unweighted, "{weighted} vs {unweighted}");
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
