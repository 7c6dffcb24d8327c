//! `loraq compare`: how a candidate's answers differ from a reference's on the same
//! questions (flips, KL, accuracy change with McNemar and bootstrap, calibration,
//! near ties, groups). Definitions: docs/evaluation.md.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use loraq_eval::render::{markdown, svg, text_table};
use loraq_eval::{CompareOptions, compare_files};
use loraq_io::StagedOutputs;

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
    /// Replace existing report files (never one of the answers files).
    #[arg(long)]
    force: bool,
}

/// Runs `loraq compare`.
pub fn run(args: Args) -> Result<()> {
    let options = CompareOptions {
        bins: usize::from(args.bins),
        bootstrap: args.bootstrap,
        seed: args.seed,
        allow_unpaired: args.allow_unpaired,
    };
    // The reports are checked and staged before the comparison, and committed
    // together once all are written: all or none.
    let json_to_stdout = args.json.as_deref() == Some(Path::new("-"));
    let mut outputs = StagedOutputs::new(
        &[args.reference.as_path(), args.candidate.as_path()],
        args.force,
    );
    let mut stage = |flag: &str, path: Option<&Path>| -> Result<Option<(PathBuf, PathBuf)>> {
        path.map(|p| {
            let temp = outputs
                .stage_file(p)
                .with_context(|| format!("{flag} {}", p.display()))?;
            Ok((p.to_path_buf(), temp))
        })
        .transpose()
    };
    let json_temp = stage("--json", args.json.as_deref().filter(|_| !json_to_stdout))?;
    let markdown_temp = stage("--markdown", args.markdown.as_deref())?;
    let plot_temp = stage("--plot", args.plot.as_deref())?;
    crate::outputs::report_stale(outputs.stale_siblings());
    let comparison = compare_files(&args.reference, &args.candidate, &options)?;
    let json = serde_json::to_string_pretty(&comparison.report)? + "\n";
    let table = text_table(&comparison);
    if let Some(staged) = &json_temp {
        write_file(staged, &json)?;
    }
    if let Some(staged) = &markdown_temp {
        write_file(staged, &markdown(&comparison))?;
    }
    if let Some(staged) = &plot_temp {
        write_file(staged, &svg(&comparison))?;
    }
    outputs.commit()?;
    if json_to_stdout {
        eprint!("{table}");
        std::io::stdout().write_all(json.as_bytes())?;
    } else {
        std::io::stdout().write_all(table.as_bytes())?;
    }
    Ok(())
}

/// Writes `text` to a staged output's temporary file (`(target, temporary)`); an
/// error names the target.
fn write_file((target, temp): &(PathBuf, PathBuf), text: &str) -> Result<()> {
    std::fs::write(temp, text).with_context(|| format!("{}: cannot write", target.display()))
}
