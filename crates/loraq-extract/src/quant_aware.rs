//! Quantization-aware extraction of one module: factor $D_q = M - \hat W$ where
//! $\hat W$ is the target (quantized) base's weight, so the adapter carries the LoRA and,
//! within its rank, the strongest directions of the base's quantization error.
//!
//! With calibration statistics $S = \mathrm{diag}(s)$, $s_k = \sqrt{E[x_k^2]}$, the
//! factorization minimizes $\\|(D_q - BA)S\\|_F$ (the error that reaches the outputs on
//! inputs with those second moments): the top-r factorization of $D_q S$ gives
//! $B$, $A^{\prime}$ and $A = A^{\prime} S^{-1}$.
//!
//! Every residual is measured with the bf16 factors as stored, against the merged
//! weight: $\\|M - (\hat W + B_{bf16} A_{bf16})\\|_F$, reported over $\\|M\\|_F$ and over the
//! bf16 rounding floor of $M$ (the figure `loraq verify --base <quantized>` gives).

use crate::activation_stats::ActivationStatsFile;
use crate::error::{ExtractError, Result};
use crate::factor::{FactorParams, Method, factorize};
use crate::floor::FloorFormat;
use crate::ordered_sum::fold_in_order;
use crate::read::ShardFiles;
use crate::split::{CastFactors, Split, cast_pair, f32_factors};
use crate::target::TargetBase;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};
use loraq_io::{Checkpoint, DType, TensorInfo};
use rayon::prelude::*;
use serde::Serialize;

/// One adapter's residual against the merged weight on the target base.
#[derive(Debug, Clone, Serialize)]
pub struct TargetResidual {
    /// The adapter's rank in this module (0: the adapter has no factors here).
    pub rank: usize,
    /// $\\|M - (\hat W + BA)\\|_F$, bf16 factors.
    pub residual: f64,
    /// residual / $\\|M\\|_F$.
    pub relative: f64,
    /// residual / the bf16 rounding floor of $M$.
    pub ratio: f64,
    /// $\\|(M - \hat W - BA)S\\|_F$ (with `--calibration`).
    pub weighted_residual: Option<f64>,
    /// weighted_residual / $\\|MS\\|_F$: the relative output error on inputs with the
    /// calibration's second moments.
    pub weighted_relative: Option<f64>,
}

/// Figures of one module on the target base (a field of the extraction report).
#[derive(Debug, Clone, Serialize)]
pub struct TargetReport {
    /// How the target stores the weight (`fp8-block128`, `bf16 (not quantized)`, ...).
    pub format: String,
    /// $\\|M\\|_F$.
    pub merged_norm: f64,
    /// $\\|W - \hat W\\|_F$: the base's quantization error in this module.
    pub quantization_error: f64,
    /// The bf16 rounding floor of $M$.
    pub floor: f64,
    /// $\\|MS\\|_F$ (with `--calibration`).
    pub weighted_merged_norm: Option<f64>,
    /// The plain adapter (the factorization of $M - W$) run on the target.
    pub plain: TargetResidual,
    /// The quantization-aware adapter (written) run on the target.
    pub quantization_aware: TargetResidual,
}

/// What one quantization-aware module computation takes.
pub(crate) struct QaContext<'a> {
    pub merged: &'a Checkpoint,
    pub base: &'a Checkpoint,
    pub merged_files: &'a ShardFiles,
    pub base_files: &'a ShardFiles,
    pub target: &'a TargetBase,
    pub activation_stats: Option<&'a ActivationStatsFile>,
    pub split: Split,
    pub method: Method,
    pub par: Par,
}

/// The result of one module.
pub(crate) struct QaModule {
    pub report: TargetReport,
    /// The quantization-aware factors (what is written).
    pub factors: CastFactors,
}

/// A tensor's values as f32 through positioned reads (no growth of the resident set).
fn read_f32(files: &ShardFiles, info: &TensorInfo) -> Result<Vec<f32>> {
    const CHUNK: usize = 1 << 16;
    let width = info.dtype.size_bytes();
    let mut out = vec![0f32; info.element_count()];
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .try_for_each(|(c, dst)| {
            let mut bytes = vec![0u8; dst.len() * width];
            files.read(info, c * CHUNK * width, &mut bytes)?;
            if loraq_io::convert::decode_to_f32(info.dtype, &bytes, dst) {
                Ok(())
            } else {
                Err(ExtractError::BadShape {
                    module: info.name.clone(),
                    what: format!("{} is not a float dtype", info.dtype.as_str()),
                })
            }
        })?;
    Ok(out)
}

/// bf16 bytes widened to f32.
fn widen(bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; bytes.len() / 2];
    loraq_io::convert::decode_to_f32(DType::BF16, bytes, &mut out);
    out
}

/// $\\|D - BA\\|_F$ and, with column weights $s$, $\\|(D - BA)S\\|_F$, in f64 from an f32
/// product (B `[rows, k]`, A `[k, cols]`, row-major; k may be 0).
pub fn residuals(
    delta: &[f32],
    rows: usize,
    cols: usize,
    factors: Option<(&[f32], &[f32], usize)>,
    weights: Option<&[f32]>,
    par: Par,
) -> (f64, Option<f64>) {
    let product = factors.filter(|f| f.2 > 0).map(|(b, a, k)| {
        let bm = MatRef::from_row_major_slice(b, rows, k);
        let am = MatRef::from_row_major_slice(a, k, cols);
        let mut p = Mat::<f32>::zeros(rows, cols);
        matmul(p.as_mut(), Accum::Replace, bm, am, 1.0, par);
        p
    });
    let (plain, weighted) = fold_in_order(
        (0..rows).into_par_iter().map(|i| {
            let row = &delta[i * cols..(i + 1) * cols];
            let (mut sum, mut wsum) = (0f64, 0f64);
            for (j, &d) in row.iter().enumerate() {
                let p = product.as_ref().map_or(0.0, |p| p[(i, j)] as f64);
                let e = (d as f64 - p).powi(2);
                sum += e;
                if let Some(w) = weights {
                    wsum += e * (w[j] as f64).powi(2);
                }
            }
            (sum, wsum)
        }),
        (0.0, 0.0),
        |x, y| (x.0 + y.0, x.1 + y.1),
    );
    (plain.sqrt(), weights.map(|_| weighted.sqrt()))
}

fn target_residual(
    rank: usize,
    (residual, weighted): (f64, Option<f64>),
    merged_norm: f64,
    weighted_merged_norm: Option<f64>,
    floor: f64,
) -> TargetResidual {
    TargetResidual {
        rank,
        residual,
        relative: residual / merged_norm,
        ratio: residual / floor,
        weighted_residual: weighted,
        weighted_relative: weighted.zip(weighted_merged_norm).map(|(w, n)| w / n),
    }
}

/// Factors $M - \hat W$ of one module at rank `rank` (weighted when calibration is
/// given) and measures it and the plain adapter `plain` (bf16 factors as stored, or
/// `None` where the LoRA has no module) on the target. `floor` is the merged weight's
/// bf16 floor when the caller computed it already (the same value keeps the randomized
/// method's stopping rule, hence the factors, identical to the plain extraction's when
/// the target equals the base). Returns `None` when the target equals the merge here
/// (nothing to correct).
pub(crate) fn qa_module(
    ctx: &QaContext<'_>,
    tensor: &str,
    module: &str,
    rank: usize,
    plain: Option<&CastFactors>,
    floor: Option<f64>,
) -> Result<Option<QaModule>> {
    let info = ctx.merged.info(tensor)?;
    let base_info = ctx.base.info(tensor)?;
    let (rows, cols) = info.matrix_shape().ok_or_else(|| ExtractError::BadShape {
        module: module.to_string(),
        what: format!("{:?} is not a matrix", info.shape),
    })?;
    let weights = ctx
        .activation_stats
        .map(|c| c.column_weights(module, cols))
        .transpose()?;
    let mut merged = read_f32(ctx.merged_files, info)?;
    if let Some(index) = merged.iter().position(|x| !x.is_finite()) {
        return Err(ExtractError::NonFinite {
            module: tensor.to_string(),
            what: "merged",
            index,
        });
    }
    let floor =
        floor.unwrap_or_else(|| crate::floor::rounding_floor(&merged, FloorFormat::of(info.dtype)));
    let format = FloorFormat::of(info.dtype);
    let (merged_sq, weighted_merged_sq, weighted_floor_sq) = fold_in_order(
        merged.par_chunks(cols).map(|row| {
            let (mut m2, mut wm2, mut wf2) = (0f64, 0f64, 0f64);
            for (j, &m) in row.iter().enumerate() {
                let m = m as f64;
                m2 += m * m;
                if let Some(w) = &weights {
                    let w2 = (w[j] as f64).powi(2);
                    wm2 += m * m * w2;
                    let u = format.ulp(m as f32);
                    wf2 += u * u * w2;
                }
            }
            (m2, wm2, wf2)
        }),
        (0.0, 0.0, 0.0),
        |x, y| (x.0 + y.0, x.1 + y.1, x.2 + y.2),
    );
    let merged_norm = merged_sq.sqrt();
    let weighted_merged_norm = weights.as_ref().map(|_| weighted_merged_sq.sqrt());
    let weighted_floor = (weighted_floor_sq / 12.0).sqrt();

    let base = read_f32(ctx.base_files, base_info)?;
    let target = ctx.target.weight(tensor, rows, cols, &base)?;
    // D_q = f32(M) - target, one subtraction (bit-identical to the plain delta when
    // the target keeps the base's weight).
    let (quantization_error, target_values) = match &target {
        Some(t) => {
            let parts = base
                .par_chunks(1 << 16)
                .zip(t.par_chunks(1 << 16))
                .map(|(b, q)| {
                    b.iter()
                        .zip(q)
                        .map(|(&b, &q)| ((b - q) as f64).powi(2))
                        .sum::<f64>()
                });
            (fold_in_order(parts, 0.0, |a, b| a + b).sqrt(), t.as_slice())
        }
        None => (0.0, base.as_slice()),
    };
    merged
        .par_iter_mut()
        .zip(target_values)
        .for_each(|(m, &t)| *m -= t);
    drop(target);
    drop(base);
    let delta = merged;
    if plain.is_none() && delta.iter().all(|&x| x == 0.0) {
        return Ok(None);
    }

    // `auto` keeps the randomized result here instead of falling back to the exact
    // method: D_q is the LoRA plus the quantization error, whose flat tail keeps the
    // randomized iteration from meeting its stopping rule, and the exact method (an f64
    // Gram of the smaller side) then costs most of the extraction for the last 1% of the
    // improvement (demo, NVFP4, rank 32: 98.9% of the exact method's error reduction at
    // 0.54x auto's time; docs/extraction.md). A delta that does converge (a target equal
    // to the base) gets the same factors as before.
    let method = match ctx.method {
        Method::Auto => Method::Randomized,
        other => other,
    };
    let params = FactorParams {
        max_rank: rank,
        method,
        floor: Some(if weights.is_some() {
            weighted_floor
        } else {
            floor
        }),
        par: ctx.par,
        ..FactorParams::default()
    };
    let (b, a, k) = match &weights {
        None => {
            let f = factorize(module, &delta, rows, cols, &params)?;
            let k = f.kept();
            let (b, a) = f32_factors(&f, k, ctx.split);
            (b, a, k)
        }
        Some(w) => {
            let mut scaled = delta.clone();
            scaled.par_chunks_mut(cols).for_each(|row| {
                for (x, &s) in row.iter_mut().zip(w) {
                    *x *= s;
                }
            });
            let f = factorize(module, &scaled, rows, cols, &params)?;
            drop(scaled);
            let k = f.kept();
            let (b, mut a) = f32_factors(&f, k, ctx.split);
            a.par_chunks_mut(cols).for_each(|row| {
                for (x, &s) in row.iter_mut().zip(w) {
                    *x /= s;
                }
            });
            (b, a, k)
        }
    };
    let factors = cast_pair(module, &b, &a, rows, cols, k, weights.as_deref(), ctx.par)?;
    drop((b, a));

    let w = weights.as_deref();
    let qa_b = widen(&factors.b_bf16);
    let qa_a = widen(&factors.a_bf16);
    let qa = residuals(&delta, rows, cols, Some((&qa_b, &qa_a, k)), w, ctx.par);
    drop((qa_b, qa_a));
    let plain_figures = match plain {
        Some(p) => {
            let (pb, pa) = (widen(&p.b_bf16), widen(&p.a_bf16));
            residuals(&delta, rows, cols, Some((&pb, &pa, p.rank)), w, ctx.par)
        }
        None => residuals(&delta, rows, cols, None, w, ctx.par),
    };
    let report = TargetReport {
        format: ctx.target.format_of(tensor, info.dtype.as_str()),
        merged_norm,
        quantization_error,
        floor,
        weighted_merged_norm,
        plain: target_residual(
            plain.map_or(0, |p| p.rank),
            plain_figures,
            merged_norm,
            weighted_merged_norm,
            floor,
        ),
        quantization_aware: target_residual(k, qa, merged_norm, weighted_merged_norm, floor),
    };
    Ok(Some(QaModule { report, factors }))
}
