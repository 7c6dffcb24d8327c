//! `loraq extract`: the LoRA adapter inside a merged fine-tune, certified at the bf16
//! rounding floor, written only when every check passed.

use anyhow::{Result, bail};
use loraq_extract::extract::{ExtractOptions, Progress, RankChoice, extract};
use loraq_extract::factor::Method;
use loraq_extract::split::Split;
use loraq_extract::target::TargetSpec;
use loraq_io::AdapterNaming;
use std::path::PathBuf;

/// Extract the LoRA adapter from a merged fine-tune and its base.
#[derive(clap::Args)]
pub struct Args {
    /// The merged fine-tune (checkpoint directory or .safetensors file).
    #[arg(long)]
    merged: PathBuf,
    /// The base it was merged into.
    #[arg(long)]
    base: PathBuf,
    /// Adapter directory to write (must not exist unless --force).
    #[arg(long)]
    out: PathBuf,
    /// LoRA rank: one vLLM serves (1, 8, 16, 32, 64, 128, 256, 320, 512) or `auto`
    /// (per module the smallest rank reaching the floor, at most 512).
    #[arg(long, default_value = "256")]
    rank: String,
    /// How S is shared: B = U sqrt(S), A = sqrt(S) V^T, or B = U S, A = V^T.
    #[arg(long, default_value = "balanced", value_parser = ["balanced", "orthonormal-a"])]
    split: String,
    /// Factorization: randomized with a certificate, falling back to exact when it does
    /// not converge (auto), or one of them only.
    #[arg(long, default_value = "auto", value_parser = ["auto", "randomized", "exact"])]
    method: String,
    /// Refuse the extraction when a module's truncation residual exceeds this times
    /// the bf16 rounding floor of the merge.
    #[arg(long, default_value_t = 1.10, value_parser = crate::args::positive_ratio)]
    max_residual_ratio: f64,
    /// Write the adapter even when modules are above --max-residual-ratio.
    #[arg(long)]
    allow_residual: bool,
    /// Worker threads (default: all cores; at most 4 per logical core, 1024 in all).
    #[arg(long, default_value_t = 0, value_parser = crate::args::threads)]
    threads: usize,
    /// Revision (commit) of the merge, recorded in manifest.json.
    #[arg(long, value_name = "SHA")]
    merged_revision: Option<String>,
    /// Revision (commit) of the base, recorded in manifest.json and adapter_config.json.
    #[arg(long, value_name = "SHA")]
    base_revision: Option<String>,
    /// `base_model_name_or_path` in adapter_config.json and the model card (a Hub id such
    /// as Qwen/Qwen3.5-9B); default: the base's absolute path.
    #[arg(long, value_name = "ID")]
    base_id: Option<String>,
    /// Module names of the adapter: `checkpoint` (as the merged checkpoint names them,
    /// e.g. model.language_model.layers.*: what vLLM and the checkpoint's own class load)
    /// or `text` (model.layers.*: what AutoModelForCausalLM loads).
    #[arg(long, default_value = "checkpoint", value_parser = ["checkpoint", "text"])]
    names: String,
    /// Copy files of the merged directory matching GLOB (LICENSE, head files); repeatable.
    #[arg(long, value_name = "GLOB")]
    copy: Vec<String>,
    /// Replace an existing output directory.
    #[arg(long)]
    force: bool,
    /// Print the summary (extraction_report.json) as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Quantization-aware: the base the adapter will run on. A scheme (fp8-block128,
    /// nvfp4, int4-g128, ...: the base quantized exactly as `loraq quantize --scheme`
    /// does, same skip list) or a quantized checkpoint directory. The adapter then
    /// factors merged - dequant(Q(base)): the LoRA plus, within its rank, the strongest
    /// directions of the base's quantization error. The report compares it with the
    /// plain adapter on that base.
    #[arg(long, value_name = "SCHEME|DIR")]
    target_base: Option<String>,
    /// Input second moments per module (`loraq run --collect-stats FILE`): the
    /// quantization-aware factorization minimizes the error weighted by them, i.e.
    /// the error that reaches the module's outputs.
    #[arg(long, value_name = "FILE", requires = "target_base")]
    calibration: Option<PathBuf>,
    /// Ranks added to the quantization-aware factorization of every module the LoRA
    /// touches (rank + K must be at most 512).
    #[arg(long, value_name = "K", default_value_t = 0, requires = "target_base")]
    extra_rank: usize,
    /// Also correct the target's quantization error in modules the LoRA leaves alone,
    /// at --correction-rank (written through rank_pattern).
    #[arg(long, requires_all = ["target_base", "correction_rank"])]
    all_layers: bool,
    /// Rank of the correction in modules the LoRA leaves alone (with --all-layers).
    #[arg(long, value_name = "K", requires = "all_layers")]
    correction_rank: Option<usize>,
}

fn parse_rank(text: &str) -> Result<RankChoice> {
    if text == "auto" {
        return Ok(RankChoice::Auto);
    }
    match text.parse::<usize>() {
        Ok(r) => Ok(RankChoice::Fixed(r)),
        Err(_) => bail!("--rank {text:?}: expected a number or auto"),
    }
}

/// Runs `loraq extract`.
pub fn run(args: Args) -> Result<()> {
    let options = ExtractOptions {
        merged: args.merged,
        base: args.base,
        out: args.out,
        rank: parse_rank(&args.rank)?,
        split: if args.split == "orthonormal-a" {
            Split::OrthonormalA
        } else {
            Split::Balanced
        },
        method: match args.method.as_str() {
            "randomized" => Method::Randomized,
            "exact" => Method::Exact,
            _ => Method::Auto,
        },
        max_residual_ratio: args.max_residual_ratio,
        allow_residual: args.allow_residual,
        threads: args.threads,
        merged_revision: args.merged_revision,
        base_revision: args.base_revision,
        base_id: args.base_id,
        names: AdapterNaming::parse(&args.names).expect("clap checked the value"),
        copy: args.copy,
        force: args.force,
        target_base: args.target_base.as_deref().map(TargetSpec::parse),
        activation_stats: args.calibration,
        extra_rank: args.extra_rank,
        all_layers: args.all_layers,
        correction_rank: args.correction_rank.unwrap_or(0),
    };
    crate::outputs::sweep_and_report(&options.out);
    let bar = crate::progress::bar(0, "extract");
    let report = extract(&options, &mut |event| show_progress(&bar, event));
    bar.finish_and_clear();
    let report = report?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{:<64} {:>13} {:>5} {:>8} {:>8} {:>8} {:>7}",
        "module", "shape", "rank", "ratio", "expect", "w/ cast", "s"
    );
    for m in &report.modules {
        println!(
            "{:<64} {:>13} {:>5} {:>8.4} {:>8.4} {:>8.4} {:>7.2}",
            m.module,
            format!("{}x{}", m.shape[0], m.shape[1]),
            m.rank,
            m.ratio,
            m.expected_ratio,
            m.ratio_after_cast,
            m.seconds
        );
    }
    if let Some(summary) = &report.target_base {
        print_target_table(&report, summary);
    }
    for t in &report.zero_delta {
        println!("{t}: bytes differ but the delta is zero (signed zeros): not in the adapter");
    }
    println!(
        "wrote {}: {} modules, r = {}, {} parameters; worst residual {:.4} x floor ({}); {} identical tensors, {} base-only ignored; {:.1} s",
        report.out.display(),
        report.totals.modules,
        report.r,
        report.totals.parameters,
        report.totals.max_ratio,
        report.totals.max_ratio_module.as_deref().unwrap_or("-"),
        report.identical_tensors,
        report.base_only.len(),
        report.totals.seconds
    );
    if !report.totals.above_threshold.is_empty() {
        eprintln!(
            "warning: {} modules above {} x floor written because of --allow-residual: {}",
            report.totals.above_threshold.len(),
            report.max_residual_ratio,
            report.totals.above_threshold.join(", ")
        );
    }
    Ok(())
}

/// Shows an extraction's progress on `bar`: the scan's counts, each module as it
/// starts, and a line per module done.
pub fn show_progress(bar: &indicatif::ProgressBar, event: Progress<'_>) {
    match event {
        Progress::Scanned(scan) => {
            bar.set_length(scan.projections.len() as u64);
            let pending = if scan.pending_identical > 0 {
                format!(
                    " ({} more with an identical first block, compared in full while factoring)",
                    scan.pending_identical
                )
            } else {
                String::new()
            };
            bar.println(format!(
                "scan: {} identical{pending}, {} differing projections, {} base-only (ignored)",
                scan.identical,
                scan.projections.len(),
                scan.base_only.len()
            ));
        }
        Progress::ModuleStarted {
            index, projection, ..
        } => {
            bar.set_position(index as u64);
            bar.set_message(format!(
                "{} [{}x{}]",
                projection.module_path, projection.out_features, projection.in_features
            ));
        }
        Progress::ModuleDone(m) => {
            bar.inc(1);
            let on_target = m.target.as_ref().map_or(String::new(), |t| {
                format!(
                    "; on the target: plain {:.3e}, quantization-aware {:.3e} of ||merged|| (rank {})",
                    t.plain.relative, t.quantization_aware.relative, m.adapter_rank
                )
            });
            bar.println(format!(
                "{}: rank {}, residual {:.3} x floor{on_target} ({:.2} s)",
                m.module, m.rank, m.ratio, m.seconds
            ));
        }
        Progress::CorrectionDone(c) => {
            bar.inc(1);
            bar.println(format!(
                "{}: correction rank {}, on the target: {:.3e} -> {:.3e} of ||merged|| ({:.2} s)",
                c.module,
                c.adapter_rank,
                c.target.plain.relative,
                c.target.quantization_aware.relative,
                c.seconds
            ));
        }
        Progress::Writing => bar.set_message("writing and validating"),
    }
}

/// One row of the target table: plain vs quantization-aware, relative to ||merged||,
/// over the floor, and (with calibration) weighted.
fn target_row(module: &str, rank: String, t: &loraq_extract::quant_aware::TargetReport) {
    let weighted = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.3e}"));
    println!(
        "{:<64} {:>18} {:>9} {:>10.3e} {:>10.3e} {:>9.2} {:>9.2} {:>10} {:>10}",
        module,
        t.format,
        rank,
        t.plain.relative,
        t.quantization_aware.relative,
        t.plain.ratio,
        t.quantization_aware.ratio,
        weighted(t.plain.weighted_relative),
        weighted(t.quantization_aware.weighted_relative),
    );
}

fn print_target_table(
    report: &loraq_extract::extract::ExtractionReport,
    summary: &loraq_extract::extract::TargetSummary,
) {
    println!();
    println!(
        "on the target base {}: ||merged - (target + BA)|| relative to ||merged|| and over the floor; weighted = output error on the calibration's second moments",
        summary.target_base
    );
    println!(
        "{:<64} {:>18} {:>9} {:>10} {:>10} {:>9} {:>9} {:>10} {:>10}",
        "module", "target", "rank", "plain", "qa", "plain/F", "qa/F", "plain w", "qa w"
    );
    for m in &report.modules {
        if let Some(t) = &m.target {
            target_row(&m.module, format!("{}->{}", m.rank, m.adapter_rank), t);
        }
    }
    for c in &report.corrections {
        target_row(&c.module, format!("0->{}", c.adapter_rank), &c.target);
    }
    let fmt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.4e}"));
    let t = &summary.totals;
    println!(
        "total over the LoRA's modules: plain {:.4e}, quantization-aware {:.4e}; weighted: plain {}, quantization-aware {}",
        t.plain_relative,
        t.quantization_aware_relative,
        fmt(t.plain_weighted_relative),
        fmt(t.quantization_aware_weighted_relative)
    );
    if let Some(c) = &t.corrections {
        println!(
            "total over the corrected modules the LoRA leaves alone: no adapter {:.4e}, corrected {:.4e}; weighted: {} -> {}",
            c.plain_relative,
            c.quantization_aware_relative,
            fmt(c.plain_weighted_relative),
            fmt(c.quantization_aware_weighted_relative)
        );
    }
}
