//! Quantization error of weights, alone and under a LoRA adapter: what
//! `loraq quant-error` reports per module.
//!
//! All norms are Frobenius norms accumulated in f64.

use crate::error::{QuantError, Result};
use crate::layout::{DEFAULT_SKIP, QuantizedBase, compile_skip};
use crate::scheme::{Scheme, WeightView};
use loraq_io::LoraAdapter;
use rayon::prelude::*;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

/// Relative error of the fake-quantized weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightQuantError {
    /// $\lVert W \rVert$.
    pub weight_norm: f64,
    /// $\lVert \mathrm{dequant}(Q(W)) - W \rVert$.
    pub error_norm: f64,
}

impl WeightQuantError {
    /// $\lVert \mathrm{dequant}(Q(W)) - W \rVert / \lVert W \rVert$ (0 for an all-zero weight).
    pub fn relative(&self) -> f64 {
        ratio(self.error_norm, self.weight_norm)
    }
}

/// Errors of `base + scale * B A` against the merged weight, with the merged
/// weight's bf16 rounding floor beside them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MergedQuantError {
    /// $\lVert M \rVert$.
    pub merged_norm: f64,
    /// $\lVert W + s B A - M \rVert$: the adapter on the unquantized base.
    pub exact_error_norm: f64,
    /// $\lVert \mathrm{dequant}(Q(W)) + s B A - M \rVert$: the adapter on the quantized base.
    pub quantized_error_norm: f64,
    /// bf16 rounding floor of $M$, $\sqrt{\sum_{ij} \mathrm{ulp}(m_{ij})^2 / 12}$
    /// (docs/extraction.md).
    pub floor: f64,
}

impl MergedQuantError {
    /// The figures relative to $\lVert M \rVert$: exact, quantized, floor.
    pub fn relative(&self) -> (f64, f64, f64) {
        (
            ratio(self.exact_error_norm, self.merged_norm),
            ratio(self.quantized_error_norm, self.merged_norm),
            ratio(self.floor, self.merged_norm),
        )
    }
}

fn ratio(num: f64, den: f64) -> f64 {
    if den == 0.0 { 0.0 } else { num / den }
}

/// The fake-quantized weight and its error against `weight`.
pub fn weight_quant_error(
    scheme: Scheme,
    weight: WeightView<'_>,
) -> Result<(Vec<f32>, WeightQuantError)> {
    let quantized = scheme.fake_quant(weight)?;
    let (weight_sq, error_sq) = weight
        .data
        .par_chunks(1 << 14)
        .zip(quantized.par_chunks(1 << 14))
        .map(|(w, q)| {
            w.iter()
                .zip(q)
                .fold((0.0f64, 0.0f64), |(ws, es), (&w, &q)| {
                    let d = f64::from(q) - f64::from(w);
                    (ws + f64::from(w) * f64::from(w), es + d * d)
                })
        })
        .reduce(|| (0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    Ok((
        quantized,
        WeightQuantError {
            weight_norm: weight_sq.sqrt(),
            error_norm: error_sq.sqrt(),
        },
    ))
}

/// A LoRA update `scale * B A` of one module: `b` is `[out, rank]`, `a` is
/// `[rank, in]`, row-major f32.
#[derive(Clone, Copy, Debug)]
pub struct LoraUpdate<'a> {
    /// `[out, rank]`.
    pub b: &'a [f32],
    /// `[rank, in]`.
    pub a: &'a [f32],
    /// Rank.
    pub rank: usize,
    /// `alpha / r`.
    pub scale: f32,
}

/// Errors of the adapter on the unquantized and on the quantized base against the
/// merged weight. `base` and `quantized` are the base weight and its fake-quant
/// (from [`weight_quant_error`]); `merged` has the same shape.
pub fn merged_quant_error(
    base: WeightView<'_>,
    quantized: &[f32],
    update: LoraUpdate<'_>,
    merged: &[f32],
) -> Result<MergedQuantError> {
    let (out_features, in_features, rank) = (base.out_features, base.in_features, update.rank);
    let shape_error = |len| QuantError::ShapeMismatch {
        tensor: base.name.to_string(),
        out_features,
        in_features,
        len,
    };
    if merged.len() != base.data.len() || quantized.len() != base.data.len() {
        return Err(shape_error(merged.len()));
    }
    if out_features.checked_mul(rank) != Some(update.b.len())
        || rank.checked_mul(in_features) != Some(update.a.len())
    {
        return Err(shape_error(update.b.len() + update.a.len()));
    }
    if in_features == 0 {
        return Ok(MergedQuantError {
            merged_norm: 0.0,
            exact_error_norm: 0.0,
            quantized_error_norm: 0.0,
            floor: 0.0,
        });
    }
    let sums = (0..out_features)
        .into_par_iter()
        .map(|row| {
            // delta = scale * B[row, :] A, accumulated as axpys over A's rows.
            let mut delta = vec![0.0f32; in_features];
            for k in 0..rank {
                let coefficient = update.scale * update.b[row * rank + k];
                if coefficient != 0.0 {
                    for (d, &a) in delta
                        .iter_mut()
                        .zip(&update.a[k * in_features..(k + 1) * in_features])
                    {
                        *d += coefficient * a;
                    }
                }
            }
            let range = row * in_features..(row + 1) * in_features;
            let mut acc = [0.0f64; 4];
            for (((&d, &w), &q), &m) in delta
                .iter()
                .zip(&base.data[range.clone()])
                .zip(&quantized[range.clone()])
                .zip(&merged[range])
            {
                let (d, m64) = (f64::from(d), f64::from(m));
                let exact = f64::from(w) + d - m64;
                let quant = f64::from(q) + d - m64;
                let ulp = loraq_io::convert::bf16_ulp(m);
                acc[0] += m64 * m64;
                acc[1] += exact * exact;
                acc[2] += quant * quant;
                acc[3] += ulp * ulp / 12.0;
            }
            acc
        })
        .reduce(
            || [0.0f64; 4],
            |a, b| [a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]],
        );
    Ok(MergedQuantError {
        merged_norm: sums[0].sqrt(),
        exact_error_norm: sums[1].sqrt(),
        quantized_error_norm: sums[2].sqrt(),
        floor: sums[3].sqrt(),
    })
}

/// One module's line of the report.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleReport {
    /// Weight tensor name.
    pub name: String,
    /// Output features.
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
    /// The weight's own quantization error.
    pub weight: WeightQuantError,
    /// With an adapter and a merged checkpoint, the errors against the merged weight.
    pub merged: Option<(usize, MergedQuantError)>,
}

impl ModuleReport {
    /// JSON object of this line.
    pub fn to_json(&self) -> Value {
        let mut value = json!({
            "name": self.name,
            "shape": [self.out_features, self.in_features],
            "weight_norm": self.weight.weight_norm,
            "quant_error": self.weight.error_norm,
            "quant_rel_error": self.weight.relative(),
        });
        if let Some((rank, merged)) = &self.merged {
            let (exact, quantized, floor) = merged.relative();
            value["adapter"] = json!({
                "rank": rank,
                "merged_norm": merged.merged_norm,
                "exact_rel_error": exact,
                "quantized_rel_error": quantized,
                "bf16_floor_rel": floor,
                "quantized_over_floor": ratio(merged.quantized_error_norm, merged.floor),
            });
        }
        value
    }
}

/// Totals over the adapted modules, each
/// $\sqrt{\sum e^2} / \sqrt{\sum \lVert M \rVert^2}$ over the modules' errors $e$.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdapterTotals {
    /// Modules with an adapter.
    pub modules: usize,
    /// The adapter on the unquantized base.
    pub exact_rel_error: f64,
    /// The adapter on the quantized base.
    pub quantized_rel_error: f64,
    /// The merged weights' bf16 rounding floor.
    pub bf16_floor_rel: f64,
}

/// Totals over modules: $\sqrt{\sum e^2} / \sqrt{\sum n^2}$ of the errors $e$ and norms $n$
/// for each figure (the
/// `totals` object of `loraq quant-error --json`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantErrorTotals {
    /// Under an adapter, over the adapted modules.
    pub adapter: Option<AdapterTotals>,
    /// Modules measured.
    pub modules: usize,
    /// The weights' own error.
    pub quant_rel_error: f64,
}

/// Totals over modules: $\sqrt{\sum e^2} / \sqrt{\sum n^2}$ of the errors $e$ and norms $n$
/// for each figure.
pub fn totals(reports: &[ModuleReport]) -> QuantErrorTotals {
    let sum = |f: &dyn Fn(&ModuleReport) -> Option<f64>| -> f64 {
        reports
            .iter()
            .filter_map(f)
            .map(|x| x * x)
            .sum::<f64>()
            .sqrt()
    };
    let weight_norm = sum(&|r| Some(r.weight.weight_norm));
    let weight_error = sum(&|r| Some(r.weight.error_norm));
    let adapted: Vec<&MergedQuantError> = reports
        .iter()
        .filter_map(|r| r.merged.as_ref().map(|m| &m.1))
        .collect();
    let adapter = (!adapted.is_empty()).then(|| {
        let norm = adapted
            .iter()
            .map(|m| m.merged_norm.powi(2))
            .sum::<f64>()
            .sqrt();
        let exact = adapted
            .iter()
            .map(|m| m.exact_error_norm.powi(2))
            .sum::<f64>()
            .sqrt();
        let quant = adapted
            .iter()
            .map(|m| m.quantized_error_norm.powi(2))
            .sum::<f64>()
            .sqrt();
        let floor = adapted.iter().map(|m| m.floor.powi(2)).sum::<f64>().sqrt();
        AdapterTotals {
            modules: adapted.len(),
            exact_rel_error: ratio(exact, norm),
            quantized_rel_error: ratio(quant, norm),
            bf16_floor_rel: ratio(floor, norm),
        }
    });
    QuantErrorTotals {
        adapter,
        modules: reports.len(),
        quant_rel_error: ratio(weight_error, weight_norm),
    }
}

/// [`totals`] as JSON.
pub fn totals_json(reports: &[ModuleReport]) -> Value {
    let totals = totals(reports);
    let mut value = json!({
        "modules": totals.modules,
        "quant_rel_error": totals.quant_rel_error,
    });
    if let Some(a) = totals.adapter {
        value["adapter"] = json!({
            "modules": a.modules,
            "exact_rel_error": a.exact_rel_error,
            "quantized_rel_error": a.quantized_rel_error,
            "bf16_floor_rel": a.bf16_floor_rel,
        });
    }
    value
}

/// A measurement of a scheme on a base checkpoint, alone and with an adapter against a
/// merge: what `loraq quant-error` does.
#[derive(Clone, Debug)]
pub struct QuantErrorRequest<'a> {
    /// Base checkpoint (plain or already quantized: decoded exactly first).
    pub base: &'a Path,
    /// Scheme applied to it.
    pub scheme: Scheme,
    /// Adapter directory (with `merged`).
    pub adapter: Option<&'a Path>,
    /// Merged checkpoint (with `adapter`).
    pub merged: Option<&'a Path>,
    /// Extra regexes of weights to leave out (added to [`DEFAULT_SKIP`]).
    pub skip: &'a [String],
}

/// What [`measure`] reports while it works.
#[derive(Clone, Copy, Debug)]
pub enum MeasureProgress<'a> {
    /// The weights to measure are known: this many.
    Planned {
        /// Weights to measure.
        weights: usize,
    },
    /// Starting on one weight.
    Measuring(&'a str),
    /// One weight measured.
    Measured,
}

/// Per weight of `request.base` (skipped ones left out unless the adapter has them),
/// the scheme's error alone and, with an adapter and a merged checkpoint, under the
/// adapter against the merged weight. A NaN or infinite weight is refused by file and
/// tensor.
pub fn measure(
    request: &QuantErrorRequest<'_>,
    progress: &mut dyn FnMut(MeasureProgress<'_>),
) -> Result<Vec<ModuleReport>> {
    let base = QuantizedBase::open(request.base)
        .map_err(|e| e.context(format!("cannot open base {}", request.base.display())))?;
    let mut patterns: Vec<String> = DEFAULT_SKIP.iter().map(|s| s.to_string()).collect();
    patterns.extend(request.skip.iter().cloned());
    let skip = compile_skip(&patterns)?;
    let adapter = match request.adapter {
        // Module paths in the base's naming, whichever naming the adapter uses; a
        // module the base does not have is refused by name.
        Some(dir) => Some(LoraAdapter::open_for(dir, base.checkpoint()).map_err(|e| {
            QuantError::from(e).context(format!("cannot open adapter {}", dir.display()))
        })?),
        None => None,
    };
    let merged = match request.merged {
        Some(dir) => Some(
            QuantizedBase::open(dir)
                .map_err(|e| e.context(format!("cannot open merged {}", dir.display())))?,
        ),
        None => None,
    };
    let adapted: BTreeMap<String, &loraq_io::LoraModuleInfo> = adapter
        .iter()
        .flat_map(|a| a.modules.iter())
        .map(|m| (format!("{}.weight", m.module_path), m))
        .collect();
    let names: Vec<String> = base
        .weights()
        .filter(|w| !skip.iter().any(|re| re.is_match(&w.name)) || adapted.contains_key(&w.name))
        .map(|w| w.name.clone())
        .collect();
    if names.is_empty() {
        return Err(QuantError::NothingToDo {
            path: request.base.to_path_buf(),
            what: "linear weight to measure",
        });
    }
    progress(MeasureProgress::Planned {
        weights: names.len(),
    });
    let mut reports = Vec::with_capacity(names.len());
    for name in &names {
        progress(MeasureProgress::Measuring(name));
        let weight = base.weight(name)?;
        let (out_features, in_features) = (weight.out_features, weight.in_features);
        let values = base.read_weight_f32(name)?;
        // A NaN weight gives a NaN error figure; refuse it by file and tensor.
        base.checkpoint().ensure_finite(name, &values)?;
        let view = WeightView::new(name, out_features, in_features, &values)?;
        let (quantized, weight_error) = weight_quant_error(request.scheme, view)?;
        let merged_error = match (adapted.get(name), &adapter, &merged) {
            (Some(module), Some(adapter), Some(merged)) => {
                if (module.out_features, module.in_features) != (out_features, in_features) {
                    return Err(QuantError::AdapterShape {
                        module: module.module_path.clone(),
                        adapter_out_features: module.out_features,
                        adapter_in_features: module.in_features,
                        tensor: name.clone(),
                        out_features,
                        in_features,
                    });
                }
                let merged_values = merged
                    .read_weight_f32(name)
                    .map_err(|e| e.context(format!("merged checkpoint lacks {name}")))?;
                merged.checkpoint().ensure_finite(name, &merged_values)?;
                let b = adapter.read_b_f32(&module.module_path)?;
                let a = adapter.read_a_f32(&module.module_path)?;
                let update = LoraUpdate {
                    b: &b,
                    a: &a,
                    rank: module.rank,
                    scale: module.scale as f32,
                };
                Some((
                    module.rank,
                    merged_quant_error(view, &quantized, update, &merged_values)?,
                ))
            }
            _ => None,
        };
        reports.push(ModuleReport {
            name: name.clone(),
            out_features,
            in_features,
            weight: weight_error,
            merged: merged_error,
        });
        progress(MeasureProgress::Measured);
    }
    Ok(reports)
}
