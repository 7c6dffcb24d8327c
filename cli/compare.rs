//! `loraq compare`: how a candidate's answers differ from a reference's on the same
//! questions (flips, KL, accuracy change with McNemar and bootstrap, calibration,
//! near ties, groups). Definitions: docs/evaluation.md.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use loraq_eval::render::{markdown, svg, text_table};
use loraq_eval::{CompareOptions, Comparison, compare_files};
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
    let json_to_stdout = args.json.as_deref() == Some(Path::new("-"));
    let request = CompareRequest {
        reference: &args.reference,
        candidate: &args.candidate,
        options: CompareOptions {
            bins: usize::from(args.bins),
            bootstrap: args.bootstrap,
            seed: args.seed,
            allow_unpaired: args.allow_unpaired,
        },
        json: args.json.as_deref().filter(|_| !json_to_stdout),
        markdown: args.markdown.as_deref(),
        plot: args.plot.as_deref(),
        force: args.force,
    };
    let compared = compare_to_files(&request)?;
    let table = text_table(&compared.comparison);
    if json_to_stdout {
        eprint!("{table}");
        std::io::stdout().write_all(compared.json.as_bytes())?;
    } else {
        std::io::stdout().write_all(table.as_bytes())?;
    }
    Ok(())
}

/// A comparison of two answers files and the reports to write: what `loraq compare`
/// does, and what the demo asks for without going through the command line.
pub struct CompareRequest<'a> {
    /// Reference answers.
    pub reference: &'a Path,
    /// Candidate answers.
    pub candidate: &'a Path,
    /// Bins, bootstrap, seed, unpaired ids.
    pub options: CompareOptions,
    /// JSON report output.
    pub json: Option<&'a Path>,
    /// Markdown report output.
    pub markdown: Option<&'a Path>,
    /// SVG figure output.
    pub plot: Option<&'a Path>,
    /// Replace existing report files.
    pub force: bool,
}

/// The comparison and its JSON report as written.
pub struct Compared {
    /// The typed comparison.
    pub comparison: Comparison,
    /// The JSON report's text.
    pub json: String,
}

/// Compares the answers and writes the reports asked for, staged and committed
/// together once all are written: all or none.
pub fn compare_to_files(request: &CompareRequest<'_>) -> Result<Compared> {
    // The reports are checked and staged before the comparison.
    let mut outputs = StagedOutputs::new(&[request.reference, request.candidate], request.force);
    let mut stage = |flag: &str, path: Option<&Path>| -> Result<Option<(PathBuf, PathBuf)>> {
        path.map(|p| {
            let temp = outputs
                .stage_file(p)
                .with_context(|| format!("{flag} {}", p.display()))?;
            Ok((p.to_path_buf(), temp))
        })
        .transpose()
    };
    let json_temp = stage("--json", request.json)?;
    let markdown_temp = stage("--markdown", request.markdown)?;
    let plot_temp = stage("--plot", request.plot)?;
    crate::outputs::report_stale(outputs.stale_siblings());
    let comparison = compare_files(request.reference, request.candidate, &request.options)?;
    let json = serde_json::to_string_pretty(&comparison.report)? + "\n";
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
    Ok(Compared { comparison, json })
}

/// Writes `text` to a staged output's temporary file (`(target, temporary)`); an
/// error names the target.
fn write_file((target, temp): &(PathBuf, PathBuf), text: &str) -> Result<()> {
    std::fs::write(temp, text).with_context(|| format!("{}: cannot write", target.display()))
}
