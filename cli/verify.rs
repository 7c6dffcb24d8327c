//! `loraq verify`: base + adapter against the merge, per module, over the floor.

use anyhow::{Result, bail};
use loraq_extract::verify::{VerifyOptions, verify};
use std::path::PathBuf;

/// Check that base + adapter reproduces the merge at the bf16 rounding floor.
#[derive(clap::Args)]
pub struct Args {
    /// The adapter directory.
    #[arg(long)]
    adapter: PathBuf,
    /// The base checkpoint.
    #[arg(long)]
    base: PathBuf,
    /// The merged checkpoint.
    #[arg(long)]
    merged: PathBuf,
    /// Fail when a module's residual exceeds this times the floor (the bf16 factors
    /// add their cast error to the truncation residual, hence above extract's 1.10).
    #[arg(long, default_value_t = loraq_extract::verify::DEFAULT_MAX_RESIDUAL_RATIO, value_parser = crate::args::positive_ratio)]
    max_residual_ratio: f64,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

/// Runs `loraq verify`.
pub fn run(args: Args) -> Result<()> {
    let options = VerifyOptions {
        adapter: args.adapter,
        base: args.base,
        merged: args.merged,
        max_residual_ratio: args.max_residual_ratio,
        threads: 0,
    };
    let bar = crate::progress::bar(0, "verify");
    let report = verify(&options, &mut |done, total, module| {
        crate::progress::track(&bar, done, total, module)
    });
    bar.finish_and_clear();
    let report = report?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{:<64} {:>13} {:>5} {:>12} {:>12} {:>8}",
            "module", "shape", "rank", "residual", "floor", "ratio"
        );
        for m in &report.modules {
            println!(
                "{:<64} {:>13} {:>5} {:>12.5e} {:>12.5e} {:>8.4}",
                m.module,
                format!("{}x{}", m.shape[0], m.shape[1]),
                m.rank,
                m.residual,
                m.floor,
                m.ratio
            );
        }
        if let Some(d) = &report.distribution {
            println!(
                "residual / floor: min {:.4}, median {:.4}, p90 {:.4}, max {:.4} ({}); bins <0.5 / <0.9 / <1.0 / <1.05 / <1.1 / more: {:?}",
                d.min,
                d.median,
                d.p90,
                d.max,
                report.worst_module.as_deref().unwrap_or("-"),
                d.histogram
            );
        }
        for t in &report.unexplained {
            println!("unexplained: {t} differs from the base but the adapter has no such module");
        }
        for t in &report.refused {
            println!("refused: {t}");
        }
    }
    if !report.passed {
        bail!(
            "verification failed: {} modules above {} x floor, {} unexplained, {} refused tensors",
            report.above_threshold.len(),
            report.max_residual_ratio,
            report.unexplained.len(),
            report.refused.len()
        );
    }
    Ok(())
}
