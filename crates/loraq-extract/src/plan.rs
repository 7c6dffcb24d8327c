//! The plan stage of `loraq extract`: the options checked, the inputs opened and
//! scanned, the target and calibration opened, and the one list of modules the later
//! stages work through (the LoRA's projections, then with `--all-layers` the modules
//! it leaves alone that the target changes), every module's statistics checked
//! before any work.

use crate::activation_stats::ActivationStatsFile;
use crate::error::{ExtractError, Result};
use crate::options::{ExtractOptions, RankChoice};
use crate::scan::{PendingScan, Projection, ScanReport, scan_first_blocks};
use crate::target::{TargetBase, TargetSpec};
use loraq_io::peft::VLLM_MAX_LORA_RANKS;
use loraq_io::{Checkpoint, DType, ModuleName};
use std::path::Path;

/// The largest rank of any module.
pub(crate) const MAX_MODULE_RANK: usize = VLLM_MAX_LORA_RANKS[VLLM_MAX_LORA_RANKS.len() - 1];

/// What a planned module is in the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleRole {
    /// A projection the merge changes: one of the LoRA's modules.
    Lora,
    /// A module the LoRA leaves alone whose quantization error on the target is
    /// corrected (`--all-layers`).
    Correction,
}

/// One module the extraction factors: its tensor, module path and shape, and its role.
#[derive(Debug, Clone)]
pub struct PlannedModule {
    /// Tensor, module path, `[out, in]`.
    pub projection: Projection,
    /// LoRA module or correction.
    pub role: ModuleRole,
}

/// The inputs of an extraction, opened and checked, and the modules to factor.
#[derive(Debug)]
pub struct ExtractionPlan {
    /// The merged checkpoint.
    pub merged: Checkpoint,
    /// The base.
    pub base: Checkpoint,
    /// What the scan found (the LoRA's projections, identical and base-only tensors):
    /// complete once [`ExtractionPlan::pending`] has been compared and absorbed.
    pub scan: ScanReport,
    /// The tensors whose first block matched the base's, to compare in full while the
    /// modules are factored.
    pub pending: PendingScan,
    /// The base the adapter will run on (`--target-base`).
    pub target: Option<TargetBase>,
    /// Input second moments (`--calibration`).
    pub activation_stats: Option<ActivationStatsFile>,
    /// Every module to factor, in the order the adapter lists them: the scan's
    /// projections, then the corrections.
    pub modules: Vec<PlannedModule>,
}

/// Refuses options no extraction can use: a rank vLLM does not serve, quantization-aware
/// options without a target, a non-positive threshold. Runs before any file is touched.
pub fn validate_options(options: &ExtractOptions) -> Result<()> {
    validate_rank(options.rank)?;
    validate_target_options(options)?;
    if !(options.max_residual_ratio.is_finite() && options.max_residual_ratio > 0.0) {
        return Err(ExtractError::InvalidParameter {
            name: "--max-residual-ratio",
            detail: "must be positive".into(),
        });
    }
    Ok(())
}

/// Every path the extraction reads, which its output must not be or contain.
pub fn input_paths(options: &ExtractOptions) -> Vec<&Path> {
    let mut inputs = vec![options.merged.as_path(), options.base.as_path()];
    inputs.extend(options.activation_stats.as_deref());
    if let Some(TargetSpec::Dir(dir)) = &options.target_base {
        inputs.push(dir);
    }
    inputs
}

/// The plan stage: opens both checkpoints and scans them (dtype, shape and first block
/// of every tensor, refusing what is not base + LoRA; the rest of the tensors whose
/// first block matched is left in [`ExtractionPlan::pending`]), opens the target and
/// the calibration, lists the modules and checks every module's statistics before any
/// factorization.
pub fn plan(options: &ExtractOptions) -> Result<ExtractionPlan> {
    let merged = Checkpoint::open(&options.merged)?;
    let base = Checkpoint::open(&options.base)?;
    let (scanned, pending) = scan_first_blocks(&merged, &base)?;
    let scanned = scanned.into_result()?;
    let target = options
        .target_base
        .as_ref()
        .map(|spec| TargetBase::open(spec, &base))
        .transpose()?;
    let activation_stats = options
        .activation_stats
        .as_deref()
        .map(ActivationStatsFile::open)
        .transpose()?;
    let mut plan = ExtractionPlan {
        merged,
        base,
        scan: scanned,
        pending,
        target,
        activation_stats,
        modules: Vec::new(),
    };
    plan.modules = plan.list_modules(options)?;
    Ok(plan)
}

impl ExtractionPlan {
    /// The modules to factor as [`ExtractionPlan::scan`] stands: the scan's projections,
    /// then (`--all-layers`) the untouched linears the target changes; every module's
    /// statistics checked.
    pub fn list_modules(&self, options: &ExtractOptions) -> Result<Vec<PlannedModule>> {
        let corrections = if options.all_layers {
            let target = self
                .target
                .as_ref()
                .expect("validated: --all-layers needs a target");
            untouched_linears(&self.merged, &self.scan)
                .into_iter()
                .filter(|p| target.may_change(&p.tensor))
                .collect()
        } else {
            Vec::new()
        };
        let modules: Vec<PlannedModule> = self
            .scan
            .projections
            .iter()
            .cloned()
            .map(|projection| PlannedModule {
                projection,
                role: ModuleRole::Lora,
            })
            .chain(corrections.into_iter().map(|projection| PlannedModule {
                projection,
                role: ModuleRole::Correction,
            }))
            .collect();
        // Every module's statistics are checked before any work.
        if let Some(c) = &self.activation_stats {
            for p in modules.iter().map(|m| &m.projection) {
                c.input_sq_mean(&p.module_path, p.in_features)?;
            }
        }
        Ok(modules)
    }
}

fn validate_rank(rank: RankChoice) -> Result<()> {
    if let RankChoice::Fixed(r) = rank
        && !VLLM_MAX_LORA_RANKS.contains(&r)
    {
        return Err(ExtractError::InvalidParameter {
            name: "--rank",
            detail: format!("{r} is not a rank vLLM serves ({VLLM_MAX_LORA_RANKS:?}) or auto"),
        });
    }
    Ok(())
}

/// Refuses quantization-aware options without `--target-base`, and ranks past 512.
fn validate_target_options(options: &ExtractOptions) -> Result<()> {
    let invalid =
        |name: &'static str, detail: String| Err(ExtractError::InvalidParameter { name, detail });
    if options.target_base.is_none()
        && (options.activation_stats.is_some() || options.extra_rank > 0 || options.all_layers)
    {
        return invalid(
            "--target-base",
            "--calibration, --extra-rank and --all-layers shape a quantization-aware adapter: they need --target-base".into(),
        );
    }
    if options.all_layers != (options.correction_rank > 0) {
        return invalid(
            "--correction-rank",
            "--all-layers needs a --correction-rank above 0, and --correction-rank needs --all-layers".into(),
        );
    }
    if options.correction_rank > MAX_MODULE_RANK {
        return invalid(
            "--correction-rank",
            format!(
                "{} is above {MAX_MODULE_RANK}, the largest rank vLLM serves",
                options.correction_rank
            ),
        );
    }
    if let RankChoice::Fixed(r) = options.rank
        && r + options.extra_rank > MAX_MODULE_RANK
    {
        return invalid(
            "--extra-rank",
            format!(
                "rank {r} + {} is above {MAX_MODULE_RANK}, the largest rank vLLM serves",
                options.extra_rank
            ),
        );
    }
    Ok(())
}

/// Candidates for `--all-layers`: linear weights (2-D float) of the merge that the scan
/// found identical to the base, and that the target changes.
fn untouched_linears(merged: &Checkpoint, scanned: &ScanReport) -> Vec<Projection> {
    let touched: std::collections::BTreeSet<&str> = scanned
        .projections
        .iter()
        .map(|p| p.tensor.as_str())
        .collect();
    let mut out: Vec<Projection> = merged
        .tensors()
        .filter(|t| !touched.contains(t.name.as_str()))
        .filter(|t| matches!(t.dtype, DType::BF16 | DType::F16 | DType::F32))
        .filter_map(|t| {
            let name = ModuleName::parse(&t.name).filter(|n| n.is_linear_weight())?;
            let (out_features, in_features) = t.matrix_shape()?;
            Some(Projection {
                tensor: t.name.clone(),
                module_path: name.module_path(),
                out_features,
                in_features,
            })
        })
        .collect();
    out.sort_by(|a, b| a.tensor.cmp(&b.tensor));
    out
}
