//! `loraq check`: two adapter directories compared.

use anyhow::{Result, bail};
use loraq_extract::check::check;
use std::path::PathBuf;

/// Compare two adapters: modules, shapes, ranks, configs, reconstructed deltas, factor
/// pairs up to a shared sign per singular component.
#[derive(clap::Args)]
pub struct Args {
    /// The first adapter directory (the reference of relative differences).
    first: PathBuf,
    /// The other adapter directory.
    other: PathBuf,
    /// Largest allowed ||delta1 - delta2|| / ||delta1|| per module.
    #[arg(long, default_value_t = 1e-2, value_parser = crate::args::positive_ratio)]
    tolerance: f64,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

/// Runs `loraq check`.
pub fn run(args: Args) -> Result<()> {
    let bar = crate::progress::bar(0, "check");
    let report = check(
        &args.first,
        &args.other,
        args.tolerance,
        0,
        &mut |done, total, module| crate::progress::track(&bar, done, total, module),
    );
    bar.finish_and_clear();
    let report = report?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{:<64} {:>18} {:>12} {:>22}",
            "module", "out x in x rank", "rel. diff", "pairs same/sign/other"
        );
        for m in &report.modules {
            let shape = if m.first == m.second {
                format!("{}x{}x{}", m.first[0], m.first[1], m.first[2])
            } else {
                format!("{:?} vs {:?}", m.first, m.second)
            };
            let pairs = m.factor_pairs.as_ref().map_or("-".to_string(), |p| {
                format!("{}/{}/{}", p.identical, p.equal_up_to_sign, p.different)
            });
            let diff = m
                .relative_difference
                .map_or("-".to_string(), |d| format!("{d:.3e}"));
            println!("{:<64} {:>18} {:>12} {:>22}", m.module, shape, diff, pairs);
        }
        for m in &report.only_in_first {
            println!("only in {}: {m}", args.first.display());
        }
        for m in &report.only_in_second {
            println!("only in {}: {m}", args.other.display());
        }
        for d in &report.config_differences {
            println!("config differs: {d}");
        }
        for d in &report.config_notes {
            println!("config note: {d}");
        }
        println!(
            "worst relative difference {:.3e} ({}), tolerance {:.1e}",
            report.worst_relative_difference,
            report.worst_module.as_deref().unwrap_or("-"),
            report.tolerance
        );
    }
    if !report.passed {
        bail!("the adapters differ");
    }
    Ok(())
}
