//! What an extraction reports: extraction_report.json (also `loraq extract --json`),
//! one row per module, the corrections, the quantization-aware totals. The model card
//! ([`crate::card`]) is rendered from these types.

use crate::quant_aware::TargetReport;
use loraq_io::AdapterNaming;
use serde::Serialize;
use std::path::PathBuf;

/// Figures of one extracted module (a row of extraction_report.json).
#[derive(Debug, Clone, Serialize)]
pub struct ModuleReport {
    /// Module path.
    pub module: String,
    /// `[out, in]`.
    pub shape: [usize; 2],
    /// Rank of the factorization of merged - base (the plain adapter) that the
    /// figures below describe.
    pub rank: usize,
    /// Rank written to the adapter: `rank`, plus `--extra-rank` with `--target-base`.
    pub adapter_rank: usize,
    /// $\\|D\\|_F$.
    pub delta_norm: f64,
    /// The bf16 rounding floor of the merged weight.
    pub floor: f64,
    /// $\\|D - BA\\|_F$ with the f32 factors (the truncation residual).
    pub residual: f64,
    /// residual / floor: near 1 means at the floor; the refusal threshold applies to it.
    pub ratio: f64,
    /// What a perfect rank-`rank` fit of (low rank + rounding noise) leaves over the
    /// floor: $\sqrt{1 - r(m+n-r)/(mn)}$.
    pub expected_ratio: f64,
    /// $\\|B_{bf16}A_{bf16} - BA\\|_F$: the error the bf16 cast of the factors adds.
    pub cast_error: f64,
    /// The residual after the cast, $\sqrt{\mathrm{residual}^2 + \mathrm{cast}^2}$ (the cross term has zero
    /// mean; `loraq verify` measures it exactly).
    pub residual_after_cast: f64,
    /// residual_after_cast / floor.
    pub ratio_after_cast: f64,
    /// The singular values kept.
    pub singular_values_kept: Vec<f64>,
    /// The largest singular value computed and not kept, if any.
    pub first_dropped: Option<f64>,
    /// The certificate: the residual evaluated in f64 from the last pass.
    pub certificate_residual: f64,
    /// "randomized" or "exact".
    pub method: &'static str,
    /// Passes over the delta.
    pub passes: f64,
    /// Whether the randomized iteration met its stopping rule.
    pub converged: bool,
    /// Wall time of the module (read, factor, cast).
    pub seconds: f64,
    /// With `--target-base`: the plain and the quantization-aware adapter on the target
    /// (the quantization-aware one is what the adapter holds).
    pub target: Option<TargetReport>,
}

/// A module the LoRA leaves alone, corrected for the target's quantization error
/// (`--all-layers`).
#[derive(Debug, Clone, Serialize)]
pub struct CorrectionReport {
    /// Module path.
    pub module: String,
    /// `[out, in]`.
    pub shape: [usize; 2],
    /// Rank written.
    pub adapter_rank: usize,
    /// Figures on the target (the plain adapter has no factors here: rank 0).
    pub target: TargetReport,
    /// Wall time.
    pub seconds: f64,
}

/// Sums over modules of the figures on the target base.
#[derive(Debug, Clone, Serialize)]
pub struct TargetTotals {
    /// $\sqrt{\sum \\|M - (\hat W + BA)\\|^2} / \sqrt{\sum \\|M\\|^2}$ of the plain adapter,
    /// over the LoRA's modules.
    pub plain_relative: f64,
    /// The same for the quantization-aware adapter.
    pub quantization_aware_relative: f64,
    /// Weighted (output-error) counterparts, with `--calibration`.
    pub plain_weighted_relative: Option<f64>,
    /// Weighted, quantization-aware.
    pub quantization_aware_weighted_relative: Option<f64>,
    /// The same four over the corrected modules the LoRA leaves alone (`--all-layers`).
    pub corrections: Option<Box<TargetTotals>>,
}

/// How the quantization-aware extraction was asked for.
#[derive(Debug, Clone, Serialize)]
pub struct TargetSummary {
    /// The `--target-base` (scheme name or directory).
    pub target_base: String,
    /// The activation statistics file (`--calibration`), tokens and records it covers.
    #[serde(rename = "calibration")]
    pub activation_stats: Option<ActivationStatsRecord>,
    /// `--extra-rank`.
    pub extra_rank: usize,
    /// `--correction-rank` when `--all-layers`.
    pub correction_rank: Option<usize>,
    /// Totals.
    pub totals: TargetTotals,
}

/// The calibration statistics used.
#[derive(Debug, Clone, Serialize)]
pub struct ActivationStatsRecord {
    /// The file.
    pub path: PathBuf,
    /// Tokens in the statistics.
    pub tokens: u64,
    /// Records in the statistics.
    pub records: u64,
}

/// The input side of the manifest.
#[derive(Debug, Clone, Serialize)]
pub struct InputRecord {
    /// Path as given.
    pub path: PathBuf,
    /// Revision, when given.
    pub revision: Option<String>,
    /// SHA-256 of config.json, when the checkpoint has one.
    pub config_sha256: Option<String>,
}

/// Totals of an extraction.
#[derive(Debug, Clone, Serialize)]
pub struct Totals {
    /// Modules in the adapter.
    pub modules: usize,
    /// Parameters of the adapter (A and B).
    pub parameters: usize,
    /// Largest residual / floor.
    pub max_ratio: f64,
    /// The module with it.
    pub max_ratio_module: Option<String>,
    /// Mean residual / floor over modules whose rank is below their smaller dimension.
    pub mean_ratio_low_rank: Option<f64>,
    /// Largest residual-after-cast / floor.
    pub max_ratio_after_cast: f64,
    /// Modules above `--max-residual-ratio` (written only with `--allow-residual`).
    pub above_threshold: Vec<String>,
    /// Wall time of the whole extraction.
    pub seconds: f64,
}

/// extraction_report.json, also the `--json` summary.
#[derive(Debug, Clone, Serialize)]
pub struct ExtractionReport {
    /// "loraq".
    pub tool: &'static str,
    /// The tool's version.
    pub version: &'static str,
    /// Output directory.
    pub out: PathBuf,
    /// The merge.
    pub merged: InputRecord,
    /// The base.
    pub base: InputRecord,
    /// `base_model_name_or_path` written to adapter_config.json.
    pub base_model_name_or_path: String,
    /// How the adapter names its modules (the report's `module` fields are always the
    /// checkpoint's tensor names).
    pub names: AdapterNaming,
    /// The transformers class whose module names the adapter's match: the one to load
    /// the base with before `PeftModel.from_pretrained`.
    pub loading_class: String,
    /// The adapter's target_modules.
    pub target_modules: Vec<String>,
    /// Adapter `r`: the smallest rank vLLM serves that covers every module's rank, so
    /// `--max-lora-rank r` serves it.
    pub r: usize,
    /// "256" or "auto".
    pub rank_mode: String,
    /// "balanced" or "orthonormal-a".
    pub split: &'static str,
    /// The method asked for.
    pub method: &'static str,
    /// The refusal threshold.
    pub max_residual_ratio: f64,
    /// Tensors identical in both checkpoints.
    pub identical_tensors: usize,
    /// Tensors only the base has (ignored).
    pub base_only: Vec<String>,
    /// Tensors whose bytes differ but whose delta is zero (signed zeros): not factored.
    pub zero_delta: Vec<String>,
    /// Files copied by --copy.
    pub copied: Vec<String>,
    /// One entry per module.
    pub modules: Vec<ModuleReport>,
    /// Modules the LoRA leaves alone, corrected for the target (`--all-layers`).
    pub corrections: Vec<CorrectionReport>,
    /// The quantization-aware part, with `--target-base`.
    pub target_base: Option<TargetSummary>,
    /// Totals.
    pub totals: Totals,
}

/// Root-sum-square totals of the figures on the target, relative to the merged norms.
pub(crate) fn relative_totals<'a>(
    reports: impl Iterator<Item = &'a TargetReport> + Clone,
) -> TargetTotals {
    let sum = |f: &dyn Fn(&TargetReport) -> Option<f64>| -> Option<f64> {
        reports
            .clone()
            .map(|r| f(r).map(|x| x * x))
            .sum::<Option<f64>>()
            .map(f64::sqrt)
    };
    let merged = sum(&|r| Some(r.merged_norm)).unwrap_or(0.0);
    let weighted_merged = sum(&|r| r.weighted_merged_norm);
    let ratio = |x: Option<f64>, n: Option<f64>| x.zip(n).map(|(x, n)| x / n);
    TargetTotals {
        plain_relative: sum(&|r| Some(r.plain.residual)).unwrap_or(0.0) / merged,
        quantization_aware_relative: sum(&|r| Some(r.quantization_aware.residual)).unwrap_or(0.0)
            / merged,
        plain_weighted_relative: ratio(sum(&|r| r.plain.weighted_residual), weighted_merged),
        quantization_aware_weighted_relative: ratio(
            sum(&|r| r.quantization_aware.weighted_residual),
            weighted_merged,
        ),
        corrections: None,
    }
}
