//! The factor stage of `loraq extract`: every planned module factored in order (the
//! LoRA's modules at the rounding floor, or quantization-aware on a target; the
//! corrections), its figures and the bf16 factors the adapter holds; then the
//! thresholds checked before anything is written.

use crate::error::{ExtractError, Result};
use crate::factor::{FactorParams, Factorization, Method, factorize_prechecked};
use crate::floor::{DeltaFigures, PairBytes, expected_floor_ratio};
use crate::options::{AUTO_RANK_CAP, AUTO_RANK_SLACK, ExtractOptions, RankChoice};
use crate::plan::{ExtractionPlan, MAX_MODULE_RANK, ModuleRole, PlannedModule};
use crate::quant_aware::{QaContext, qa_module};
use crate::read::{PairQueue, ShardFiles};
use crate::report::{CorrectionReport, ModuleReport};
use crate::scan::{Projection, ScanReport};
use crate::split::{CastFactors, Split, split_and_cast};
use faer::Par;
use std::time::Instant;

/// What the progress callback is told.
#[derive(Debug)]
pub enum Progress<'a> {
    /// The scan finished.
    Scanned(&'a ScanReport),
    /// Work on a projection started (index from 0).
    ModuleStarted {
        /// Index.
        index: usize,
        /// Number of projections.
        total: usize,
        /// The projection.
        projection: &'a Projection,
    },
    /// A projection finished.
    ModuleDone(&'a ModuleReport),
    /// A correction of a module the LoRA leaves alone finished (`--all-layers`).
    CorrectionDone(&'a CorrectionReport),
    /// Writing and validating the output.
    Writing,
}

/// The figures of one factored module, by its role.
#[derive(Debug, Clone)]
pub enum ModuleFigures {
    /// A row of the report's `modules`.
    Lora(ModuleReport),
    /// A row of the report's `corrections`.
    Correction(CorrectionReport),
}

/// One module after the factor stage: what the report says of it and the bf16
/// factors the adapter holds.
#[derive(Debug)]
pub struct FactoredModule {
    /// The planned module (checkpoint names, shape, role).
    pub planned: PlannedModule,
    /// Its figures.
    pub figures: ModuleFigures,
    /// The factors written (quantization-aware ones with a target).
    pub factors: CastFactors,
}

impl FactoredModule {
    /// The module path, as the checkpoint names it.
    pub fn module(&self) -> &str {
        &self.planned.projection.module_path
    }

    /// `[out, in]`.
    pub fn shape(&self) -> [usize; 2] {
        [
            self.planned.projection.out_features,
            self.planned.projection.in_features,
        ]
    }

    /// The rank the adapter holds for this module.
    pub fn adapter_rank(&self) -> usize {
        self.factors.rank
    }

    /// The LoRA module's report row, `None` for a correction.
    pub fn lora_report(&self) -> Option<&ModuleReport> {
        match &self.figures {
            ModuleFigures::Lora(report) => Some(report),
            ModuleFigures::Correction(_) => None,
        }
    }
}

/// What the factor stage produced.
#[derive(Debug)]
pub struct Factored {
    /// The modules factored, in the plan's order (a module without a delta left out).
    pub modules: Vec<FactoredModule>,
    /// Projections whose bytes differ but whose delta is zero (signed zeros).
    pub zero_delta: Vec<String>,
}

/// The rank `--rank auto` picks: the smallest k whose truncation residual is within
/// [`AUTO_RANK_SLACK`] of $\rho^\ast(k) F$, else everything kept.
pub fn auto_rank(f: &Factorization, floor: f64) -> usize {
    (1..=f.kept())
        .find(|&k| {
            f.truncation_residual(k)
                <= AUTO_RANK_SLACK * expected_floor_ratio(f.rows, f.cols, k) * floor
        })
        .unwrap_or(f.kept())
}

/// The factor stage: every planned module in the plan's order, each factored at the
/// rounding floor (or, with a target, quantization-aware) and cast to bf16, with the
/// progress callback told as each starts and finishes. A LoRA module whose delta is
/// zero is left out and listed; a correction the target does not need is left out.
pub fn factor(
    plan: &ExtractionPlan,
    options: &ExtractOptions,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<Factored> {
    let merged_files = ShardFiles::open(&plan.merged)?;
    let base_files = ShardFiles::open(&plan.base)?;
    let par = Par::rayon(options.threads);
    let qa_context = plan.target.as_ref().map(|target| QaContext {
        merged: &plan.merged,
        base: &plan.base,
        merged_files: &merged_files,
        base_files: &base_files,
        target,
        activation_stats: plan.activation_stats.as_ref(),
        split: options.split,
        method: options.method,
        par,
    });
    let total = plan.modules.len();
    let mut modules = Vec::with_capacity(total);
    let mut zero_delta = Vec::new();
    // The reader runs one module ahead (`read::with_reader_ahead`).
    crate::read::with_reader_ahead(plan, |pairs| {
        factor_in_order(
            plan,
            options,
            qa_context.as_ref(),
            par,
            pairs,
            progress,
            &mut modules,
            &mut zero_delta,
        )
    })?;
    Ok(Factored {
        modules,
        zero_delta,
    })
}

/// The factor loop of [`factor`]: every planned module in order, its read pair (LoRA
/// modules) taken from the reader.
#[allow(clippy::too_many_arguments)]
fn factor_in_order(
    plan: &ExtractionPlan,
    options: &ExtractOptions,
    qa_context: Option<&QaContext<'_>>,
    par: Par,
    pairs: &PairQueue,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
    modules: &mut Vec<FactoredModule>,
    zero_delta: &mut Vec<String>,
) -> Result<()> {
    let total = plan.modules.len();
    // The last module's delta buffer, for the next delta (`PairBytes::delta_into`).
    let mut spare = Vec::new();
    for (index, planned) in plan.modules.iter().enumerate() {
        let pair = pairs.next_pair();
        progress(Progress::ModuleStarted {
            index,
            total,
            projection: &planned.projection,
        });
        let module_started = Instant::now();
        let factored = match planned.role {
            ModuleRole::Lora => {
                let pair = pair.expect("the reader reads every LoRA module")?;
                let factored =
                    factor_lora_module(pair, planned, options, qa_context, par, &mut spare)?;
                if factored.is_none() {
                    zero_delta.push(planned.projection.tensor.clone());
                }
                factored
            }
            ModuleRole::Correction => {
                let ctx = qa_context.expect("corrections need a target");
                factor_correction(ctx, planned, options)?
            }
        };
        let Some((figures, factors)) = factored else {
            continue;
        };
        let seconds = module_started.elapsed().as_secs_f64();
        crate::timeline::span("factor module", &planned.projection.tensor, module_started);
        let figures = match figures {
            ModuleFigures::Lora(mut report) => {
                report.seconds = seconds;
                progress(Progress::ModuleDone(&report));
                ModuleFigures::Lora(report)
            }
            ModuleFigures::Correction(mut report) => {
                report.seconds = seconds;
                progress(Progress::CorrectionDone(&report));
                ModuleFigures::Correction(report)
            }
        };
        modules.push(FactoredModule {
            planned: planned.clone(),
            figures,
            factors,
        });
    }
    Ok(())
}

/// The factorization of a checked delta at its rounding floor, up to `max_rank`: the
/// step [`factor_lora_module`] and [`factor_projection_at_rank`] share. The delta's
/// buffer goes back into `spare` when one is given (as `loraq extract` hands it from
/// module to module), and is dropped otherwise. Returns the factorization and the floor.
fn factor_delta(
    module: &str,
    figures: DeltaFigures,
    shape: [usize; 2],
    max_rank: usize,
    method: Method,
    par: Par,
    spare: Option<&mut Vec<f32>>,
) -> Result<(Factorization, f64)> {
    let DeltaFigures {
        delta,
        floor,
        norm_sq,
    } = figures;
    let [rows, cols] = shape;
    let params = FactorParams {
        max_rank,
        method,
        floor: Some(floor),
        par,
        ..FactorParams::default()
    };
    let factorization = factorize_prechecked(module, &delta, rows, cols, norm_sq, &params);
    if let Some(spare) = spare {
        *spare = delta;
    }
    Ok((factorization?, floor))
}

/// One projection at a fixed rank, as [`factor`] handles a LoRA module without a
/// quantization target, from the two tensors' bytes to the bf16 factors: the delta,
/// its norm and rounding floor in one pass ([`PairBytes::delta_into`]), the randomized
/// factorization of the checked delta, then the balanced split and the cast. The
/// delta is written into `spare`'s buffer and the buffer left there, as `loraq extract`
/// hands each module's delta buffer to the next. What the `extract_projection` bench
/// and `factor_file --pair` time; returns the factorization, the factors and the floor.
pub fn factor_projection_at_rank(
    module: &str,
    pair: &PairBytes,
    shape: [usize; 2],
    rank: usize,
    par: Par,
    spare: &mut Vec<f32>,
) -> Result<(Factorization, CastFactors, f64)> {
    let figures = pair.delta_into(std::mem::take(spare))?;
    let (factorization, floor) = factor_delta(
        module,
        figures,
        shape,
        rank,
        Method::Randomized,
        par,
        Some(spare),
    )?;
    let cast = split_and_cast(module, &factorization, rank, Split::Balanced, par)?;
    Ok((factorization, cast, floor))
}

/// One of the LoRA's modules: merged - base factored at the floor (rank fixed or
/// auto), split and cast; with a target, the quantization-aware factors of merged -
/// target at rank + extra are what is written, and the plain ones are measured on
/// the target beside them. `None` when the delta is zero (signed zeros only). The
/// delta is formed in `spare`'s allocation and its buffer left there for the next
/// module (not with a target: the quantization-aware factors form a delta of their
/// own, which should not find this one still held).
fn factor_lora_module(
    pair: PairBytes,
    planned: &PlannedModule,
    options: &ExtractOptions,
    qa_context: Option<&QaContext<'_>>,
    par: Par,
    spare: &mut Vec<f32>,
) -> Result<Option<(ModuleFigures, CastFactors)>> {
    let projection = &planned.projection;
    let (rows, cols) = (projection.out_features, projection.in_features);
    let figures = pair.delta_into(std::mem::take(spare))?;
    drop(pair);
    let max_rank = match options.rank {
        RankChoice::Fixed(r) => r,
        RankChoice::Auto => AUTO_RANK_CAP,
    };
    let spare = qa_context.is_none().then_some(spare);
    let (f, floor) = match factor_delta(
        &projection.module_path,
        figures,
        [rows, cols],
        max_rank,
        options.method,
        par,
        spare,
    ) {
        Err(ExtractError::AllZeroDelta { .. }) => return Ok(None),
        other => other?,
    };
    let rank = match options.rank {
        RankChoice::Fixed(_) => f.kept(),
        RankChoice::Auto => auto_rank(&f, floor),
    };
    let cast = split_and_cast(&projection.module_path, &f, rank, options.split, par)?;
    // Quantization-aware: the adapter written factors merged - target at rank +
    // extra; the plain factors above are measured on the target for comparison.
    let qa = match qa_context {
        Some(ctx) => qa_module(
            ctx,
            &projection.tensor,
            &projection.module_path,
            (rank + options.extra_rank).min(MAX_MODULE_RANK),
            Some(&cast),
            Some(floor),
        )?,
        None => None,
    };
    let residual = f.truncation_residual(rank);
    let certificate = f.certificate(rank);
    let residual_after_cast = residual.hypot(cast.cast_error);
    let report = ModuleReport {
        module: projection.module_path.clone(),
        shape: [rows, cols],
        rank,
        adapter_rank: qa.as_ref().map_or(rank, |q| q.factors.rank),
        delta_norm: f.delta_norm(),
        floor,
        residual,
        ratio: residual / floor,
        expected_ratio: expected_floor_ratio(rows, cols, rank),
        cast_error: cast.cast_error,
        residual_after_cast,
        ratio_after_cast: residual_after_cast / floor,
        singular_values_kept: f.s[..rank].to_vec(),
        first_dropped: if rank < f.kept() {
            Some(f.s[rank])
        } else {
            f.first_dropped
        },
        certificate_residual: certificate.residual,
        method: f.method_used.as_str(),
        passes: f.passes,
        converged: f.converged,
        // Set by the caller once the module is done.
        seconds: 0.0,
        target: qa.as_ref().map(|q| q.report.clone()),
    };
    let written = qa.map_or(cast, |q| q.factors);
    Ok(Some((ModuleFigures::Lora(report), written)))
}

/// A module the LoRA leaves alone, corrected for the target's quantization error at
/// `--correction-rank`; `None` when the target equals the merge there.
fn factor_correction(
    ctx: &QaContext<'_>,
    planned: &PlannedModule,
    options: &ExtractOptions,
) -> Result<Option<(ModuleFigures, CastFactors)>> {
    let projection = &planned.projection;
    let Some(qa) = qa_module(
        ctx,
        &projection.tensor,
        &projection.module_path,
        options.correction_rank,
        None,
        None,
    )?
    else {
        return Ok(None);
    };
    let report = CorrectionReport {
        module: projection.module_path.clone(),
        shape: [projection.out_features, projection.in_features],
        adapter_rank: qa.factors.rank,
        target: qa.report,
        // Set by the caller once the module is done.
        seconds: 0.0,
    };
    Ok(Some((ModuleFigures::Correction(report), qa.factors)))
}

/// The thresholds, checked before anything is written: every LoRA module's truncation
/// residual within `--max-residual-ratio` x floor and its residual after the cast
/// within verify's threshold (both unless `--allow-residual`), and at least one
/// module. Returns the modules above `--max-residual-ratio` (written only with
/// `--allow-residual`).
pub fn check_residuals(factored: &Factored, options: &ExtractOptions) -> Result<Vec<String>> {
    let lora = || {
        factored
            .modules
            .iter()
            .filter_map(FactoredModule::lora_report)
    };
    let above: Vec<(String, f64)> = lora()
        // A NaN ratio is above every threshold.
        .filter(|m| crate::verify::above_threshold(m.ratio, options.max_residual_ratio))
        .map(|m| (m.module.clone(), m.ratio))
        .collect();
    if !above.is_empty() && !options.allow_residual {
        return Err(ExtractError::ResidualAboveThreshold {
            threshold: options.max_residual_ratio,
            modules: above,
        });
    }
    // The truncation residual can be at the floor while the bf16 cast adds more
    // than the floor (a delta as large as the weights: 0.16% of ||D|| against the
    // floor's ~0.11% of ||merged||); verify measures the factors as stored and
    // would reject them, so extract does not report success. A quantization-aware
    // adapter reproduces the merge on its target, not on this base: not compared.
    let verify_threshold = crate::verify::DEFAULT_MAX_RESIDUAL_RATIO;
    let cast_above: Vec<(String, f64)> = lora()
        .filter(|m| {
            m.target.is_none()
                && crate::verify::above_threshold(m.ratio_after_cast, verify_threshold)
        })
        .map(|m| (m.module.clone(), m.ratio_after_cast))
        .collect();
    if !cast_above.is_empty() && !options.allow_residual {
        return Err(ExtractError::CastAboveVerifyThreshold {
            threshold: verify_threshold,
            modules: cast_above,
        });
    }
    if factored.modules.is_empty() {
        return Err(ExtractError::Refused {
            refusals: vec![crate::error::Refusal {
                tensor: options.merged.display().to_string(),
                reason: "no projection differs from the base: there is no adapter to extract"
                    .into(),
            }],
        });
    }
    Ok(above.into_iter().map(|(m, _)| m).collect())
}
