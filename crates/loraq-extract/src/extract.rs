//! `loraq extract` as a library call, in stages over one list of planned modules:
//! [`plan`] (options checked, inputs opened and scanned, modules listed), [`factor`]
//! (each module factored at the rounding floor, its figures and bf16 factors),
//! [`check_residuals`] (the thresholds), [`write_adapter_dir`] (adapter, manifest,
//! report, model card, checksums) and [`check_written`] (the written directory re-read
//! as PEFT reads it); the output directory is staged and appears only when all passed.
//! Each stage lives in its own module and none imports this one.

use crate::error::{ExtractError, Result};
use crate::output::{check_written, write_adapter_dir};
use crate::plan::{ExtractionPlan, ModuleRole, PlannedModule, input_paths, plan, validate_options};
use crate::scan::PendingScan;
use crate::timeline;
use loraq_io::AtomicDir;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

pub use crate::factoring::{
    Factored, FactoredModule, ModuleFigures, Progress, auto_rank, check_residuals, factor,
};
pub use crate::options::{
    AUTO_RANK_CAP, AUTO_RANK_SLACK, CARD_FILE, ExtractOptions, MANIFEST_FILE, REPORT_FILE,
    RankChoice,
};
pub use crate::output::adapter_r;
pub use crate::report::{
    ActivationStatsRecord, CorrectionReport, ExtractionReport, InputRecord, ModuleReport,
    TargetSummary, TargetTotals, Totals,
};

/// Runs the extraction. Nothing appears at `options.out` unless every check passed.
/// With `threads > 0` everything (scan, conversions, products) runs on a pool that size.
pub fn extract(
    options: &ExtractOptions,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<ExtractionReport> {
    loraq_io::limits::check_threads(options.threads).map_err(|detail| {
        ExtractError::InvalidParameter {
            name: "--threads",
            detail,
        }
    })?;
    if options.threads == 0 {
        return extract_on_current_pool(options, progress);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(options.threads)
        .build()
        .map_err(|e| ExtractError::InvalidParameter {
            name: "--threads",
            detail: e.to_string(),
        })?;
    pool.install(|| extract_on_current_pool(options, progress))
}

fn extract_on_current_pool(
    options: &ExtractOptions,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<ExtractionReport> {
    let started = Instant::now();
    timeline::start();
    validate_options(options)?;
    // Refuse an existing output, or one over an input, before any work.
    let out = AtomicDir::create(&options.out, options.force, &input_paths(options))?;
    let mut plan = plan(options)?;
    progress(Progress::Scanned(&plan.scan));
    let factored = factor_while_scanning(&mut plan, options, progress)?;
    let above_threshold = check_residuals(&factored, options)?;
    progress(Progress::Writing);
    let writing = timeline::Span::start();
    let written = write_adapter_dir(
        out.path(),
        &plan,
        factored,
        above_threshold,
        options,
        started,
    )?;
    check_written(out.path(), &plan, options, &written.entries)?;
    out.commit()?;
    writing.end("write and check", "");
    Ok(written.report)
}

/// The factor stage, with the rest of the scan (the tensors whose first block matched
/// the base's: most of a model the LoRA leaves alone) compared on a thread of its own
/// meanwhile, so that reading them overlaps the factorization. A tensor found to differ
/// after its first block is a refusal, or a projection factored once the planned
/// modules are done; the modules then stand in the order the complete scan gives.
fn factor_while_scanning(
    plan: &mut ExtractionPlan,
    options: &ExtractOptions,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<Factored> {
    let cancel = AtomicBool::new(false);
    let (factored, outcome) = std::thread::scope(|scope| {
        let plan: &ExtractionPlan = plan;
        let cancel = &cancel;
        let rest = std::thread::Builder::new()
            .name("scan rest".into())
            .spawn_scoped(scope, move || {
                plan.pending.finish(&plan.merged, &plan.base, cancel)
            })
            .map_err(|source| ExtractError::Read {
                path: options.merged.clone(),
                source,
            });
        let factored = match &rest {
            Ok(_) => factor(plan, options, progress),
            Err(_) => Ok(Factored {
                modules: Vec::new(),
                zero_delta: Vec::new(),
            }),
        };
        if factored.is_err() {
            cancel.store(true, Ordering::Relaxed);
        }
        let outcome = rest.and_then(|handle| {
            handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        });
        (factored, outcome)
    });
    let mut factored = factored?;
    let outcome = outcome?;
    let late = !outcome.projections.is_empty() || !outcome.refusals.is_empty();
    plan.scan.absorb(outcome);
    plan.pending = PendingScan::default();
    if !late {
        return Ok(factored);
    }
    plan.scan = std::mem::take(&mut plan.scan).into_result()?;
    // A projection whose first block matched: factor the modules the complete scan
    // lists and the factoring has not seen (a module planned as a correction that is
    // in fact a projection is factored again as one).
    let all = plan.list_modules(options)?;
    let done: std::collections::BTreeSet<(String, bool)> = factored
        .modules
        .iter()
        .map(|m| {
            (
                m.planned.projection.tensor.clone(),
                m.planned.role == ModuleRole::Lora,
            )
        })
        .chain(factored.zero_delta.iter().map(|t| (t.clone(), true)))
        .collect();
    let todo: Vec<PlannedModule> = all
        .iter()
        .filter(|m| !done.contains(&(m.projection.tensor.clone(), m.role == ModuleRole::Lora)))
        .cloned()
        .collect();
    plan.modules = todo;
    let extra = factor(plan, options, progress);
    plan.modules = all;
    let extra = extra?;
    let position = |tensor: &str, role: ModuleRole| {
        plan.modules
            .iter()
            .position(|m| m.projection.tensor == tensor && m.role == role)
    };
    factored.modules.extend(extra.modules);
    factored
        .modules
        .retain(|m| position(&m.planned.projection.tensor, m.planned.role).is_some());
    factored
        .modules
        .sort_by_key(|m| position(&m.planned.projection.tensor, m.planned.role));
    factored.zero_delta.extend(extra.zero_delta);
    factored
        .zero_delta
        .sort_by_key(|t| position(t, ModuleRole::Lora));
    Ok(factored)
}
