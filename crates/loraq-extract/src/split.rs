//! From singular triplets to LoRA factors: the split of $S$ between B and A, the bf16
//! cast (cast-aware: [`crate::cast`]) with finite checks, and the error the cast adds.

use crate::cast::{CastPair, FactorB, cast_aware, rotated_basis};
use crate::error::Result;
use crate::factor::Factorization;
use crate::gram::{tall_cross_f32, tall_lower_gram_f32};
use faer::{MatRef, Par};
use half::bf16;
use rayon::prelude::*;

/// How the singular values are shared between B and A.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// $B = U\sqrt{S}$, $A = \sqrt{S}V^\top$: both factors of the same scale, which
    /// minimises the bf16 cast error.
    Balanced,
    /// $B = US$, $A = V^\top$ (orthonormal rows).
    OrthonormalA,
}

impl Split {
    /// The command-line spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Split::Balanced => "balanced",
            Split::OrthonormalA => "orthonormal-a",
        }
    }
}

/// The bf16 factors of one module.
#[derive(Debug, Clone)]
pub struct CastFactors {
    /// Rank.
    pub rank: usize,
    /// lora_B, `[out, rank]` row-major, little-endian bf16 bytes.
    pub b_bf16: Vec<u8>,
    /// lora_A, `[rank, in]` row-major, little-endian bf16 bytes.
    pub a_bf16: Vec<u8>,
    /// $\\|B_{bf16} A_{bf16} - BA\\|_F$: what the cast adds to the truncation residual.
    pub cast_error: f64,
}

/// bf16 values as little-endian bytes, in parallel chunks of a preallocated buffer (a
/// `flat_map` over the values grows its vector from zero, one serial pass and several
/// copies of a 9 MB factor).
fn to_bytes(values: &[bf16]) -> Vec<u8> {
    const CHUNK: usize = 1 << 14;
    let mut bytes = vec![0u8; 2 * values.len()];
    bytes
        .par_chunks_mut(2 * CHUNK)
        .zip(values.par_chunks(CHUNK))
        .for_each(|(dst, src)| {
            for (d, x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&x.to_bits().to_le_bytes());
            }
        });
    bytes
}

/// The weights of the first `k` singular vectors in B and in A.
fn split_weights(f: &Factorization, k: usize, split: Split) -> (Vec<f64>, Vec<f64>) {
    f.s[..k]
        .iter()
        .map(|&s| match split {
            Split::Balanced => (s.sqrt(), s.sqrt()),
            Split::OrthonormalA => (s, 1.0),
        })
        .unzip()
}

/// A `[k, cols]` row-major: row `l` is column `l` of V times `wa[l]`, in f32.
fn f32_a(f: &Factorization, wa: &[f64]) -> Vec<f32> {
    let mut a = vec![0f32; wa.len() * f.cols];
    a.par_chunks_mut(f.cols.max(1))
        .enumerate()
        .for_each(|(l, row)| {
            for (j, x) in row.iter_mut().enumerate() {
                *x = (wa[l] * f.v.get(j, l)) as f32;
            }
        });
    a
}

/// The f32 factors of the rank-`k` truncation: B `[rows, k]` and A `[k, cols]`, row-major.
pub fn f32_factors(f: &Factorization, k: usize, split: Split) -> (Vec<f32>, Vec<f32>) {
    let k = k.min(f.kept());
    let (wb, wa) = split_weights(f, k, split);
    // U is column-major: blocks of rows, each filled column by column (reading U by
    // rows would touch one cache line per value).
    const BLOCK_ROWS: usize = 64;
    let mut b = vec![0f32; f.rows * k];
    b.par_chunks_mut((k * BLOCK_ROWS).max(1))
        .enumerate()
        .for_each(|(block, rows)| {
            let first = block * BLOCK_ROWS;
            let len = rows.len() / k.max(1);
            for (l, &w) in wb.iter().enumerate() {
                let column = f.u.col(l);
                for r in 0..len {
                    rows[r * k + l] = (column.get(first + r) * w) as f32;
                }
            }
        });
    (b, f32_a(f, &wa))
}

/// Splits and casts to bf16 cast-aware ([`crate::cast`]), and measures the cast error
/// $\\|B_{bf16} A_{bf16} - BA\\|_F$ without touching the delta: from the last B
/// refit's orthogonality and the rounding's tracked loss (`k x k` matrices only), or,
/// where that is not available (column weights, a singular refit), with
/// $E_B = B_{bf16} - B$ and $E_A = A_{bf16} - A$ (both exact in f32),
/// $B_{bf16}A_{bf16} - BA = [E_B\ B]\\,[A_{bf16};\ E_A]$ and its squared norm
/// $\langle P^\top P, Q Q^\top\rangle$ for $P = [E_B\ B]$, $Q = [A_{bf16}; E_A]$.
pub fn split_and_cast(
    module: &str,
    f: &Factorization,
    k: usize,
    split: Split,
    par: Par,
) -> Result<CastFactors> {
    let k = k.min(f.kept());
    if k > 0 {
        let (wb, wa) = split_weights(f, k, split);
        // B M^T formed from U directly where the cast's kernel runs (the same values).
        if let Some(b0) = rotated_basis(|i, l| f.u.get(i, l), f.rows, &wb) {
            let a = f32_a(f, &wa);
            return cast_factors(
                module,
                FactorB::Rotated(b0),
                &a,
                f.rows,
                f.cols,
                k,
                None,
                par,
            );
        }
    }
    let (b, a) = f32_factors(f, k, split);
    cast_pair(module, &b, &a, f.rows, f.cols, k, None, par)
}

/// Casts f32 factors B `[rows, k]` and A `[k, cols]` (row-major) to bf16, cast-aware
/// ([`crate::cast`]; with `weights`, the error that counts is $(B_{bf16}A_{bf16} - BA)W$,
/// $W = \mathrm{diag}(w)$), and measures the (unweighted) cast error as
/// [`split_and_cast`] does; for factors that do not come straight from a
/// [`Factorization`] (the calibration-weighted ones, $A = A^{\prime} S^{-1}$).
#[allow(clippy::too_many_arguments)]
pub fn cast_pair(
    module: &str,
    b: &[f32],
    a: &[f32],
    rows: usize,
    cols: usize,
    k: usize,
    weights: Option<&[f32]>,
    par: Par,
) -> Result<CastFactors> {
    cast_factors(module, FactorB::Rows(b), a, rows, cols, k, weights, par)
}

/// [`cast_pair`] for either form of B ([`FactorB`]).
#[allow(clippy::too_many_arguments)]
fn cast_factors(
    module: &str,
    b: FactorB<'_>,
    a: &[f32],
    rows: usize,
    cols: usize,
    k: usize,
    weights: Option<&[f32]>,
    par: Par,
) -> Result<CastFactors> {
    if k == 0 {
        return Ok(CastFactors {
            rank: 0,
            b_bf16: Vec::new(),
            a_bf16: Vec::new(),
            cast_error: 0.0,
        });
    }
    let pair = cast_aware(module, b, a, rows, cols, k, weights, par)?;
    let cast_error = match pair.error_sq {
        Some(error_sq) => error_sq.sqrt(),
        None => cast_error(&pair, rows, cols, k),
    };
    Ok(CastFactors {
        rank: k,
        b_bf16: to_bytes(&pair.bq),
        a_bf16: to_bytes(&pair.aq),
        cast_error,
    })
}

/// $\\|B_q A_q - BA\\|_F$ from $\langle P^\top P, Q Q^\top\rangle$, $P = [E_B\ B]$,
/// $Q = [A_q; E_A]$ (both Gram matrices symmetric: their lower triangles). $P^\top P$ by
/// blocks: $B^\top B$ is the cast's own f64 $B_0^\top B_0$, $E_B^\top B$ and
/// $E_B^\top E_B$ are f32 products over the rows ($P$ is not formed); $Q Q^\top$ in f32.
fn cast_error(pair: &CastPair, rows: usize, cols: usize, k: usize) -> f64 {
    let CastPair {
        bq,
        aq,
        b0: b,
        a0: a,
        b0tb0,
        ..
    } = pair;
    let mut eb = vec![0f32; rows * k];
    eb.par_chunks_mut(k * 64)
        .zip(bq.par_chunks(k * 64).zip(b.par_chunks(k * 64)))
        .for_each(|(e, (q, b))| {
            for ((e, q), &b) in e.iter_mut().zip(q).zip(b) {
                *e = q.to_f32() - b;
            }
        });
    let ebm = MatRef::from_row_major_slice(&eb, rows, k);
    let ebt_b = tall_cross_f32(ebm, MatRef::from_row_major_slice(b, rows, k));
    let ebt_eb = tall_lower_gram_f32(ebm);
    drop(eb);
    // Q = [A_q ; E_A]  (2k x cols), row-major.
    let mut q = vec![0f32; 2 * k * cols];
    let (rounded, error) = q.split_at_mut(k * cols);
    rounded
        .par_iter_mut()
        .zip(aq.par_iter())
        .for_each(|(r, &v)| *r = v.to_f32());
    error
        .par_iter_mut()
        .zip(aq.par_iter().zip(a.par_iter()))
        .for_each(|(e, (&q, &v))| *e = q.to_f32() - v);
    // Lower triangle, over row ranges (columns of Q) in parallel.
    let qqt = tall_lower_gram_f32(MatRef::from_row_major_slice(&q, 2 * k, cols).transpose());
    // (P^T P)(i, j) for i >= j.
    let ptp = |i: usize, j: usize| -> f64 {
        match (i < k, j < k) {
            (true, _) => ebt_eb[(i, j)] as f64,
            (false, true) => ebt_b[(j, i - k)] as f64,
            (false, false) => b0tb0[(i - k, j - k)],
        }
    };
    let mut cast_sq = 0f64;
    for j in 0..2 * k {
        cast_sq += ptp(j, j) * qqt[(j, j)] as f64;
        for i in j + 1..2 * k {
            cast_sq += 2.0 * ptp(i, j) * qqt[(i, j)] as f64;
        }
    }
    cast_sq.max(0.0).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ExtractError;
    use crate::factor::{FactorParams, Method, factorize};

    /// The cast error from the Gram identity equals the one computed entry by entry.
    #[test]
    fn cast_error_matches_the_dense_difference() {
        let (rows, cols) = (40usize, 24usize);
        let delta: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3 + ((i / cols) as f32) * 1e-4)
            .collect();
        let params = FactorParams {
            max_rank: 6,
            method: Method::Exact,
            ..FactorParams::default()
        };
        let f = factorize("m", &delta, rows, cols, &params).unwrap();
        for split in [Split::Balanced, Split::OrthonormalA] {
            let cast = split_and_cast("m", &f, 6, split, Par::Seq).unwrap();
            let (b, a) = f32_factors(&f, 6, split);
            let widen = |bytes: &[u8]| -> Vec<f64> {
                bytes
                    .chunks(2)
                    .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
                    .collect()
            };
            let (bb, ab) = (widen(&cast.b_bf16), widen(&cast.a_bf16));
            let mut direct = 0f64;
            for i in 0..rows {
                for j in 0..cols {
                    let exact: f64 = (0..6)
                        .map(|l| b[i * 6 + l] as f64 * a[l * cols + j] as f64)
                        .sum();
                    let rounded: f64 = (0..6).map(|l| bb[i * 6 + l] * ab[l * cols + j]).sum();
                    direct += (rounded - exact).powi(2);
                }
            }
            let direct = direct.sqrt();
            assert!(
                (cast.cast_error / direct - 1.0).abs() < 1e-3,
                "{split:?}: {} vs {direct}",
                cast.cast_error
            );
        }
    }

    #[test]
    fn a_factor_beyond_bf16_range_is_refused() {
        let delta = vec![1e30f32, 0.0, 0.0, 1e30];
        let params = FactorParams {
            max_rank: 2,
            method: Method::Exact,
            ..FactorParams::default()
        };
        let f = factorize("o_proj", &delta, 2, 2, &params).unwrap();
        // sqrt(1e30) = 1e15 fits bf16; with orthonormal-a, B = U S carries 1e30 (fits too,
        // bf16 max is 3.4e38), so scale the singular values to overflow.
        let mut big = f.clone();
        big.s.iter_mut().for_each(|s| *s *= 1e9);
        let err = split_and_cast("o_proj", &big, 2, Split::OrthonormalA, Par::Seq).unwrap_err();
        assert!(
            matches!(
                err,
                ExtractError::NonFinite {
                    what: "factor B after the bf16 cast",
                    ..
                }
            ),
            "{err}"
        );
    }
}
