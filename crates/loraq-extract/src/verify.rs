//! `loraq verify`: how well base + adapter reproduces the merge, per module, over the
//! bf16 rounding floor, with every differing tensor accounted for.

use crate::error::{ExtractError, Result};
use crate::floor::{FloorFormat, delta_and_floor};
use crate::ordered_sum::{fold_in_order, sum_in_order};
use crate::scan::scan;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};
use loraq_io::{Checkpoint, LoraAdapter};
use rayon::prelude::*;
use serde::Serialize;
use std::path::PathBuf;

/// `loraq verify`'s default threshold on residual / floor: the bf16 factors add
/// their cast error to the truncation residual, hence above extract's 1.10.
/// `loraq extract` refuses an adapter whose residual after the cast is above it,
/// so that it never writes one that verify rejects.
pub const DEFAULT_MAX_RESIDUAL_RATIO: f64 = 1.25;

/// Whether a residual / floor ratio fails a threshold: above it, or NaN (a NaN
/// residual must never pass, and `NaN > x` is false, so the test is "not at most").
pub fn above_threshold(ratio: f64, threshold: f64) -> bool {
    !matches!(
        ratio.partial_cmp(&threshold),
        Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
    )
}

/// What `loraq verify` takes.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// The adapter directory.
    pub adapter: PathBuf,
    /// The base checkpoint.
    pub base: PathBuf,
    /// The merged checkpoint.
    pub merged: PathBuf,
    /// A module fails above this residual / floor.
    pub max_residual_ratio: f64,
    /// Worker threads of the products (0: all cores).
    pub threads: usize,
}

/// One module's figures.
#[derive(Debug, Clone, Serialize)]
pub struct VerifiedModule {
    /// Module path.
    pub module: String,
    /// `[out, in]`.
    pub shape: [usize; 2],
    /// Rank.
    pub rank: usize,
    /// alpha / r.
    pub scale: f64,
    /// $\\|\mathrm{merged} - \mathrm{base}\\|_F$.
    pub delta_norm: f64,
    /// $\\|\mathrm{merged} - (\mathrm{base} + s\\,BA)\\|_F$ with $s$ = `scale`, the bf16 factors as stored.
    pub residual: f64,
    /// The bf16 rounding floor of the merged weight.
    pub floor: f64,
    /// residual / floor.
    pub ratio: f64,
}

/// Distribution of residual / floor over modules.
#[derive(Debug, Clone, Serialize)]
pub struct RatioDistribution {
    /// Smallest.
    pub min: f64,
    /// Median.
    pub median: f64,
    /// 90th percentile (nearest rank).
    pub p90: f64,
    /// Largest.
    pub max: f64,
    /// Counts in [0, 0.5), [0.5, 0.9), [0.9, 1.0), [1.0, 1.05), [1.05, 1.1), [1.1, inf).
    pub histogram: [usize; 6],
}

/// The verification result.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// The base's quantization scheme when it is a quantized checkpoint (decoded
    /// exactly; the ratios then include its quantization error).
    pub base_quantization: Option<String>,
    /// Every adapter module.
    pub modules: Vec<VerifiedModule>,
    /// Distribution of the ratios.
    pub distribution: Option<RatioDistribution>,
    /// The module with the largest ratio.
    pub worst_module: Option<String>,
    /// Projections that differ between base and merge but that the adapter lacks.
    pub unexplained: Vec<String>,
    /// Tensors that differ and cannot be in an adapter (norms, embeddings, ...) or exist
    /// only in the merge, with the reason.
    pub refused: Vec<String>,
    /// Modules above the threshold.
    pub above_threshold: Vec<String>,
    /// The threshold.
    pub max_residual_ratio: f64,
    /// True when nothing is unexplained or refused and every module is under the threshold.
    pub passed: bool,
}

/// A LoRA pair as stored: B `[rows, rank]`, A `[rank, cols]`, row-major, and its scale.
#[derive(Debug, Clone, Copy)]
pub struct LoraPair<'a> {
    /// lora_B.
    pub b: &'a [f32],
    /// lora_A.
    pub a: &'a [f32],
    /// Rank.
    pub rank: usize,
    /// alpha / r.
    pub scale: f64,
}

/// $\\|D - s\\,BA\\|_F$ in f64, with the product formed in f32 (an error far below the floor).
pub fn residual_of(delta: &[f32], rows: usize, cols: usize, pair: LoraPair<'_>, par: Par) -> f64 {
    let scale = pair.scale;
    let bm = MatRef::from_row_major_slice(pair.b, rows, pair.rank);
    let am = MatRef::from_row_major_slice(pair.a, pair.rank, cols);
    let mut product = Mat::<f32>::zeros(rows, cols);
    matmul(product.as_mut(), Accum::Replace, bm, am, 1.0, par);
    let product = &product;
    let rows_sq = (0..rows).into_par_iter().map(|i| {
        let row = &delta[i * cols..(i + 1) * cols];
        row.iter()
            .enumerate()
            .map(|(j, &d)| (d as f64 - scale * product[(i, j)] as f64).powi(2))
            .sum::<f64>()
    });
    fold_in_order(rows_sq, 0.0, |a, b| a + b).sqrt()
}

fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    let idx = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[idx]
}

/// The merge minus a quantized base decoded exactly, and the merge's rounding floor.
fn quantized_delta_and_floor(
    merged: &Checkpoint,
    base: &loraq_quant::QuantizedBase,
    tensor: &str,
) -> Result<(Vec<f32>, f64)> {
    let info = merged.info(tensor)?;
    // Both inputs are refused by file and tensor when not finite, as extract does.
    let mut delta = merged.read_f32_finite(tensor)?;
    let floor = crate::floor::rounding_floor(&delta, FloorFormat::of(info.dtype));
    let decoded = base.read_weight_f32(tensor)?;
    base.checkpoint().ensure_finite(tensor, &decoded)?;
    if decoded.len() != delta.len() {
        return Err(ExtractError::BadShape {
            module: tensor.to_string(),
            what: format!("base has {} values, merged {:?}", decoded.len(), info.shape),
        });
    }
    delta
        .par_iter_mut()
        .zip(&decoded)
        .for_each(|(d, &b)| *d -= b);
    Ok((delta, floor))
}

/// Runs the verification.
pub fn verify(
    options: &VerifyOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<VerifyReport> {
    // A NaN threshold made every comparison false: nothing was ever above it.
    if !(options.max_residual_ratio.is_finite() && options.max_residual_ratio > 0.0) {
        return Err(ExtractError::InvalidParameter {
            name: "--max-residual-ratio",
            detail: format!(
                "{} is not a finite number above 0",
                options.max_residual_ratio
            ),
        });
    }
    let merged = Checkpoint::open(&options.merged)?;
    // Module paths in the merge's naming, whichever naming the adapter was written in;
    // a module the merge does not have is refused by name.
    let adapter = LoraAdapter::open_for(&options.adapter, &merged)?;
    // A quantized base (fp8, NVFP4, ...) is decoded exactly; every projection then
    // differs from the merge, so the byte scan has nothing to say and is skipped, and
    // each ratio measures the quantization error the adapter runs on. A GGUF base
    // (llama.cpp) is read in the checkpoint's terms, its block-type linears in their
    // type (docs/gguf.md), and decoded the same way.
    let mut base_quantization = None;
    let (quantized_base, scanned) = if loraq_gguf::base::is_gguf(&options.base) {
        (Some(loraq_quant::QuantizedBase::open(&options.base)?), None)
    } else {
        let base = Checkpoint::open(&options.base)?;
        base_quantization = base
            .config()
            .and_then(|c| c.quantization.as_ref())
            .map(|q| q.scheme_name());
        if base_quantization.is_some() {
            (Some(loraq_quant::QuantizedBase::new(base)?), None)
        } else {
            let scanned = scan(&merged, &base)?;
            (None, Some((base, scanned)))
        }
    };
    let mut modules = Vec::new();
    for (i, m) in adapter.modules.iter().enumerate() {
        progress(i, adapter.modules.len(), &m.module_path);
        let tensor = format!("{}.weight", m.module_path);
        let (delta, floor) = match (&quantized_base, &scanned) {
            (Some(q), _) => quantized_delta_and_floor(&merged, q, &tensor)?,
            (None, Some((base, _))) => delta_and_floor(&merged, base, &tensor)?,
            (None, None) => unreachable!("one of the two bases is set"),
        };
        let a = adapter.read_a_f32(&m.module_path)?;
        let b = adapter.read_b_f32(&m.module_path)?;
        let (rows, cols) = (m.out_features, m.in_features);
        if delta.len() != rows * cols {
            return Err(ExtractError::BadShape {
                module: m.module_path.clone(),
                what: format!(
                    "adapter is [{rows}, {cols}], the weight has {} values",
                    delta.len()
                ),
            });
        }
        let delta_norm = sum_in_order(&delta, |&x| (x as f64).powi(2)).sqrt();
        let pair = LoraPair {
            b: &b,
            a: &a,
            rank: m.rank,
            scale: m.scale,
        };
        let residual = residual_of(&delta, rows, cols, pair, Par::rayon(options.threads));
        modules.push(VerifiedModule {
            module: m.module_path.clone(),
            shape: [rows, cols],
            rank: m.rank,
            scale: m.scale,
            delta_norm,
            residual,
            floor,
            // An exact reproduction of an all-zero merge is 0 / 0: at the floor.
            ratio: if residual == 0.0 {
                0.0
            } else {
                residual / floor
            },
        });
    }
    progress(adapter.modules.len(), adapter.modules.len(), "");
    let covered: std::collections::BTreeSet<&str> = adapter
        .modules
        .iter()
        .map(|m| m.module_path.as_str())
        .collect();
    let mut unexplained = Vec::new();
    let mut refused = Vec::new();
    if let Some((base, scanned)) = &scanned {
        for p in &scanned.projections {
            if covered.contains(p.module_path.as_str()) {
                continue;
            }
            // Bytes that differ only by signed zeros need no adapter.
            let (delta, _) = delta_and_floor(&merged, base, &p.tensor)?;
            if delta.iter().any(|&x| x != 0.0) {
                unexplained.push(p.tensor.clone());
            }
        }
        refused = scanned
            .refusals
            .iter()
            .map(|r| format!("{}: {}", r.tensor, r.reason))
            .collect();
    }
    let mut ratios: Vec<f64> = modules.iter().map(|m| m.ratio).collect();
    ratios.sort_by(f64::total_cmp);
    let distribution = (!ratios.is_empty()).then(|| {
        let mut histogram = [0usize; 6];
        for &r in &ratios {
            let bin = [0.5, 0.9, 1.0, 1.05, 1.1]
                .iter()
                // NaN counts in the last bin ("more"), never under an edge.
                .take_while(|&&edge| r.partial_cmp(&edge) != Some(std::cmp::Ordering::Less))
                .count();
            histogram[bin] += 1;
        }
        RatioDistribution {
            min: ratios[0],
            median: nearest_rank(&ratios, 0.5),
            p90: nearest_rank(&ratios, 0.9),
            max: ratios[ratios.len() - 1],
            histogram,
        }
    });
    let worst_module = modules
        .iter()
        .max_by(|a, b| a.ratio.total_cmp(&b.ratio))
        .map(|m| m.module.clone());
    let above_threshold: Vec<String> = modules
        .iter()
        .filter(|m| above_threshold(m.ratio, options.max_residual_ratio))
        .map(|m| m.module.clone())
        .collect();
    let passed = unexplained.is_empty() && refused.is_empty() && above_threshold.is_empty();
    Ok(VerifyReport {
        base_quantization,
        modules,
        distribution,
        worst_module,
        unexplained,
        refused,
        above_threshold,
        max_residual_ratio: options.max_residual_ratio,
        passed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_ratio_is_above_every_threshold() {
        assert!(above_threshold(f64::NAN, 1.25));
        assert!(above_threshold(f64::INFINITY, 1.25));
        assert!(above_threshold(1.26, 1.25));
        assert!(!above_threshold(1.25, 1.25));
        assert!(!above_threshold(0.0, 1.25));
    }
}
