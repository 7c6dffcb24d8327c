//! `loraq compare-hidden`: per-tensor (per-layer) cosine similarity, relative L2
//! and SQNR of two hidden-state safetensors files with the same tensor names.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::Result;
use loraq_eval::compare_hidden;

/// Arguments of `loraq compare-hidden`.
#[derive(clap::Args)]
pub struct Args {
    /// Reference hidden states (safetensors file or checkpoint directory).
    a: PathBuf,
    /// Hidden states to compare with A (same tensor names and shapes).
    b: PathBuf,
    /// Print JSON (a list of per-tensor objects) instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs `loraq compare-hidden`.
pub fn run(args: Args) -> Result<()> {
    let rows = compare_hidden(&args.a, &args.b)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&rows)?)?;
        return Ok(());
    }
    let width = rows
        .iter()
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(6)
        .max(6)
        + 2;
    writeln!(
        out,
        "{:<width$}{:>16}{:>12}{:>16}{:>14}{:>12}",
        "tensor", "shape", "cosine", "min row cosine", "relative L2", "SQNR dB"
    )?;
    let f = |x: Option<f64>, digits: usize| {
        x.map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
    };
    for r in &rows {
        let shape = format!("{:?}", r.shape);
        let sqnr = if r.identical {
            "identical".to_string()
        } else {
            f(r.sqnr_db, 2)
        };
        writeln!(
            out,
            "{:<width$}{:>16}{:>12}{:>16}{:>14}{:>12}",
            r.name,
            shape,
            f(r.cosine, 6),
            f(r.min_row_cosine, 6),
            r.relative_l2
                .map_or_else(|| "-".to_string(), |v| format!("{v:.3e}")),
            sqnr
        )?;
    }
    Ok(())
}
