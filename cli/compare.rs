//! `loraq compare`: how a candidate's answers differ from a reference's on the same
//! questions (flips, KL, accuracy change with McNemar and bootstrap, calibration,
//! near ties, groups). Definitions: docs/evaluation.md.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use loraq_eval::render::{markdown, svg, text_table};
use loraq_eval::{CompareOptions, compare_files};

/// Arguments of `loraq compare`.
#[derive(clap::Args)]
pub struct Args {
    /// Reference answers (JSON Lines: id, group?, options, logits|probs, gold?).
    #[arg(long, value_name = "FILE")]
    reference: PathBuf,
    /// Candidate answers, paired with the reference by id.
    #[arg(long, value_name = "FILE")]
    candidate: PathBuf,
    /// Write the JSON report to FILE ("-": stdout, and the table goes to stderr).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write a Markdown report to FILE.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
    /// Write an SVG figure (reliability diagram, flip-margin histogram) to FILE.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Calibration bins (equal-width for ECE, equal-mass for adaptive ECE).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u16).range(1..))]
    bins: u16,
    /// Paired bootstrap resamples of the accuracy change (0: no interval).
    #[arg(long, default_value_t = 10_000)]
    bootstrap: usize,
    /// Seed of the bootstrap.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Count ids present in only one file instead of refusing them.
    #[arg(long)]
    allow_unpaired: bool,
}

/// Runs `loraq compare`.
pub fn run(args: Args) -> Result<()> {
    let options = CompareOptions {
        bins: usize::from(args.bins),
        bootstrap: args.bootstrap,
        seed: args.seed,
        allow_unpaired: args.allow_unpaired,
    };
    let comparison = compare_files(&args.reference, &args.candidate, &options)?;
    let json = serde_json::to_string_pretty(&comparison.report)? + "\n";
    let table = text_table(&comparison);
    let json_to_stdout = args.json.as_deref() == Some(Path::new("-"));
    if let Some(path) = args.json.as_deref().filter(|_| !json_to_stdout) {
        write_file(path, &json)?;
    }
    if let Some(path) = &args.markdown {
        write_file(path, &markdown(&comparison))?;
    }
    if let Some(path) = &args.plot {
        write_file(path, &svg(&comparison))?;
    }
    if json_to_stdout {
        eprint!("{table}");
        std::io::stdout().write_all(json.as_bytes())?;
    } else {
        std::io::stdout().write_all(table.as_bytes())?;
    }
    Ok(())
}

/// Writes `text` to a temporary sibling and renames it into place, so a failed run
/// leaves no partial file.
pub fn write_file(path: &Path, text: &str) -> Result<()> {
    path.file_name()
        .with_context(|| format!("{}: not a file name", path.display()))?;
    loraq_io::write_file_atomically(path, |temp| -> Result<()> {
        Ok(std::fs::write(temp, text)?)
    })
    .with_context(|| format!("{}: cannot write", path.display()))
}
