//! `loraq extract` as a library call, in stages over one list of planned modules:
//! [`plan`] (options checked, inputs opened and scanned, modules listed), [`factor`]
//! (each module factored at the rounding floor, its figures and bf16 factors),
//! [`check_residuals`] (the thresholds), [`write_adapter_dir`] (adapter, manifest,
//! report, model card, checksums) and [`check_written`] (the written directory re-read
//! as PEFT reads it); the output directory is staged and appears only when all passed.
//! Each stage lives in its own module and none imports this one.

use crate::error::{ExtractError, Result};
use crate::output::{check_written, write_adapter_dir};
use crate::plan::{input_paths, plan, validate_options};
use loraq_io::AtomicDir;
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
    validate_options(options)?;
    // Refuse an existing output, or one over an input, before any work.
    let out = AtomicDir::create(&options.out, options.force, &input_paths(options))?;
    let plan = plan(options)?;
    progress(Progress::Scanned(&plan.scan));
    let factored = factor(&plan, options, progress)?;
    let above_threshold = check_residuals(&factored, options)?;
    progress(Progress::Writing);
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
    Ok(written.report)
}
