//! `loraq demo`: the main job on the built-in example.
//!
//! Each step calls what the subcommand a user would type calls (the libraries, or the
//! subcommand's own function where it holds the logic) and reads its typed result, so
//! the demo shows and checks the real workflow, and a renamed field fails to compile:
//! synthesize a Qwen3.5-architecture model pair with a known LoRA merged into it,
//! extract the adapter back from the merge, verify it against the merge, quantize the
//! base to each scheme a deployment would use, and measure what each quantized base
//! does to the weights the adapter reproduces; then collect calibration statistics on
//! prompts other than the questions and extract, for each quantized base, a
//! quantization-aware adapter at the same rank (`extract --target-base`) whose
//! answers are compared beside the plain adapter's. The record sets come from
//! loraq-synth ([`loraq_synth::questions`]). The steps' outputs stay under `--out`
//! for a closer look; each step prints the equivalent command line on stderr.

use crate::compare::{CompareRequest, compare_to_files};
use crate::run::{RunRequest, score_to_files};
use anyhow::{Context, Result, bail};
use loraq_eval::{CompareOptions, Report};
use loraq_extract::extract::{ExtractOptions, ExtractionReport, RankChoice, extract};
use loraq_extract::target::TargetSpec;
use loraq_extract::verify::{DEFAULT_MAX_RESIDUAL_RATIO, VerifyOptions, VerifyReport, verify};
use loraq_model::{LinearBackend, LoadOptions, Model};
use loraq_quant::ActivationQuantKind;
use loraq_quant::Scheme;
use loraq_quant::quantize_dir::DEFAULT_MAX_SHARD_BYTES;
use loraq_quant::report::measure;
use loraq_quant::report::{QuantErrorTotals, totals};
use loraq_quant::{QuantErrorRequest, QuantizeProgress, QuantizeRequest, quantize_to_dir};
use loraq_synth::questions::{
    NextTokenModel, RecordSetSpec, calibration_set, question_set, to_json_lines,
};
use loraq_synth::{Preset, SynthOptions, SynthSummary, write_synth};
use std::path::{Path, PathBuf};

/// Marker file that identifies a directory as a demo output loraq may replace.
const DEMO_MARKER: &str = ".loraq-demo";

/// Quantized bases the demo measures: what datacenter (FP8 blocks) and consumer
/// (NVFP4, 4-bit integer) deployments run.
const SCHEMES: [(&str, Scheme); 3] = [
    ("fp8-block128", Scheme::Fp8Block128),
    ("nvfp4", Scheme::Nvfp4),
    ("int4-g128", Scheme::Int4G128Sym),
];

/// Size of the demo's question set: enough for the paired test to mean something,
/// small enough for a few seconds per forward run.
const QUESTIONS: usize = 240;
/// Prompt length of each question, in tokens.
const PROMPT_TOKENS: usize = 20;
/// Calibration prompts for the quantization-aware adapters: other random prompts
/// than the questions (a different seed), as a user would calibrate on their own
/// data and evaluate on a benchmark. 48 x 20 tokens keep the run to a few seconds.
const CALIBRATION_PROMPTS: usize = 48;
/// Ranks the demo's extra quantization-aware adapter adds on NVFP4 (rank 32 + 96 =
/// 128): at the same rank, the repair has little room next to the LoRA itself.
const QA_EXTRA_RANK: usize = 96;
/// Run the main job on the built-in example.
#[derive(clap::Args)]
pub struct Args {
    /// Where the demo writes its models, adapters and reports (replaced when it
    /// holds an earlier demo's output).
    #[arg(long, default_value = "demo-out")]
    out: PathBuf,
    /// Seed of the synthetic model pair.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn prepare_out(out: &Path) -> Result<()> {
    // Never the working directory or one of its ancestors, marker or not.
    loraq_io::check_output_path(out, &[])?;
    if out.exists() {
        if !out.join(DEMO_MARKER).is_file() {
            bail!(
                "{} exists and is not a previous demo output; choose another --out",
                out.display()
            );
        }
        std::fs::remove_dir_all(out).with_context(|| format!("removing {}", out.display()))?;
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join(DEMO_MARKER), b"written by loraq demo\n")
        .with_context(|| format!("writing {}", out.join(DEMO_MARKER).display()))?;
    Ok(())
}

/// Prints the command line equivalent to a step, as the demo's log of what it does.
fn announce(args: &[&str]) {
    eprintln!("$ loraq {}", args.join(" "));
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str()
        .with_context(|| format!("{} is not valid UTF-8", p.display()))
}

fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_string(), |v| format!("{:.3}%", 100.0 * v))
}

fn fixed(x: Option<f64>, digits: usize) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{x:.digits$}"))
}

/// The merged reference model as the question set sees it: the last hidden state
/// after a prompt, and the logits of candidate next tokens from it.
struct Reference(Model);

impl NextTokenModel for Reference {
    type Error = loraq_model::ModelError;
    type State = candle_core::Tensor;

    fn run_prompt(&self, tokens: &[u32]) -> loraq_model::Result<candle_core::Tensor> {
        self.0.last_hidden(tokens)
    }

    fn next_token_logits(
        &self,
        state: &candle_core::Tensor,
        candidates: &[u32],
    ) -> loraq_model::Result<Vec<f32>> {
        self.0.logits_of(state, candidates)
    }
}

/// Writes records as JSON Lines.
fn write_records(path: &Path, records: &[loraq_synth::questions::Record]) -> Result<()> {
    std::fs::write(path, to_json_lines(records))
        .with_context(|| format!("writing {}", path.display()))
}

/// One run of the answers table: which base, adapter and activation fake-quant.
struct Setup<'a> {
    label: String,
    file: &'static str,
    model: &'a Path,
    adapter: Option<&'a Path>,
    act_quant: ActivationQuantKind,
}

/// One row of the answers table: a setup compared against the merged reference.
struct AnswerRow {
    setup: String,
    report: Report,
}

/// One row of the weights table: a scheme's error alone, the adapter's on the bf16
/// and on the quantized base, the floor, and the quantization-aware adapter's.
struct WeightRow {
    scheme: &'static str,
    totals: QuantErrorTotals,
    quantization_aware: Option<f64>,
}

fn print_answer_table(rows: &[AnswerRow]) {
    println!(
        "{:<40} {:>9} {:>9} {:>9} {:>8} {:>20} {:>15}",
        "setup (vs merged reference)",
        "changed",
        "mean KL",
        "max KL",
        "same top",
        "accuracy change (p)",
        "ECE ref / cand"
    );
    for row in rows {
        let r = &row.report;
        let accuracy = match (r.accuracy.delta, r.accuracy.mcnemar_p) {
            (Some(d), Some(p)) => format!("{:+.2} pts (p={p:.2})", 100.0 * d),
            _ => "-".into(),
        };
        println!(
            "{:<40} {:>9} {:>9} {:>9} {:>8} {:>20} {:>15}",
            row.setup,
            format!("{} ({:.1}%)", r.flips, 100.0 * r.flip_rate),
            fixed(Some(r.kl.mean), 5),
            fixed(Some(r.kl.max), 4),
            format!("{:.1}%", 100.0 * r.same_top),
            accuracy,
            format!(
                "{} / {}",
                fixed(r.calibration.reference.ece, 3),
                fixed(r.calibration.candidate.ece, 3)
            ),
        );
    }
}

/// Extraction of `merged` - `base` into `out` at `rank`; with a target, the
/// quantization-aware adapter on it with the calibration and extra rank.
fn run_extract(
    merged: &Path,
    base: &Path,
    out: &Path,
    rank: usize,
    quantization_aware: Option<(&Path, &Path, usize)>,
) -> Result<ExtractionReport> {
    let rank_text = rank.to_string();
    let mut line = vec![
        "extract",
        "--merged",
        path_str(merged)?,
        "--base",
        path_str(base)?,
        "--out",
        path_str(out)?,
        "--rank",
        &rank_text,
    ];
    let mut options = ExtractOptions::new(merged, base, out);
    options.rank = RankChoice::Fixed(rank);
    let extra_text;
    if let Some((target, calibration, extra_rank)) = quantization_aware {
        extra_text = extra_rank.to_string();
        line.extend([
            "--target-base",
            path_str(target)?,
            "--calibration",
            path_str(calibration)?,
            "--extra-rank",
            &extra_text,
        ]);
        options.target_base = Some(TargetSpec::Dir(target.to_path_buf()));
        options.activation_stats = Some(calibration.to_path_buf());
        options.extra_rank = extra_rank;
    }
    announce(&line);
    let bar = crate::progress::bar(0, "extract");
    let report = extract(&options, &mut |event| {
        crate::extract::show_progress(&bar, event)
    });
    bar.finish_and_clear();
    report.with_context(|| format!("extracting {}", out.display()))
}

/// Scores `records` with `model` (+ `adapter`) into `out`; refuses a run that did
/// not answer `expected` records of [`PROMPT_TOKENS`] tokens each.
fn run_records(
    expected: usize,
    model: &Path,
    adapter: Option<&Path>,
    act_quant: ActivationQuantKind,
    records: &Path,
    out: &Path,
    collect_stats: Option<&Path>,
) -> Result<()> {
    let mut line = vec!["run", "--model", path_str(model)?];
    if let Some(adapter) = adapter {
        line.extend(["--adapter", path_str(adapter)?]);
    }
    match act_quant {
        ActivationQuantKind::None => {}
        ActivationQuantKind::Fp8PerToken => line.extend(["--act-quant", "fp8"]),
        ActivationQuantKind::Fp8PerGroup128 => line.extend(["--act-quant", "fp8-group"]),
        ActivationQuantKind::Nvfp4 => line.extend(["--act-quant", "nvfp4"]),
    }
    line.extend(["--records", path_str(records)?, "--out", path_str(out)?]);
    if let Some(stats) = collect_stats {
        line.extend(["--collect-stats", path_str(stats)?]);
    }
    announce(&line);
    let summary = score_to_files(&RunRequest {
        model,
        adapter,
        act_quant,
        backend: LinearBackend::default(),
        records,
        out,
        hidden_out: None,
        collect_stats,
        force: false,
    })?;
    if summary.records != expected || summary.tokens != expected * PROMPT_TOKENS {
        bail!(
            "run {}: {} records of {} tokens in all answered, {expected} of {PROMPT_TOKENS} written",
            records.display(),
            summary.records,
            summary.tokens
        );
    }
    Ok(())
}

/// How many records the demo draws.
#[derive(Debug, Clone, Copy)]
struct DemoSizes {
    /// Questions.
    questions: usize,
    /// Calibration prompts.
    calibration_prompts: usize,
}

/// What the demo measured, typed, for the tables.
struct DemoResults {
    synth: SynthSummary,
    extraction: ExtractionReport,
    verification: VerifyReport,
    weight_rows: Vec<WeightRow>,
    answer_rows: Vec<AnswerRow>,
}

/// Runs `loraq demo`.
pub fn run(args: Args) -> Result<()> {
    prepare_out(&args.out)?;
    let sizes = DemoSizes {
        questions: QUESTIONS,
        calibration_prompts: CALIBRATION_PROMPTS,
    };
    let results = run_steps(&args.out, args.seed, sizes)?;
    print_tables(&results, sizes, &args.out);
    Ok(())
}

/// Every step of the demo, writing under `out` (prepared), with `sizes` records.
fn run_steps(out: &Path, seed: u64, sizes: DemoSizes) -> Result<DemoResults> {
    let pair = out.join("pair");
    let (base, merged, true_adapter) = (
        pair.join("base"),
        pair.join("merged"),
        pair.join("true-adapter"),
    );
    let adapter = out.join("adapter");
    let seed_text = seed.to_string();

    // 1. The model pair.
    announce(&[
        "synth",
        "--preset",
        "demo",
        "--out",
        path_str(&pair)?,
        "--seed",
        &seed_text,
    ]);
    let bar = crate::progress::bar(0, "synth");
    let synth: SynthSummary = write_synth(
        &pair,
        &SynthOptions {
            preset: Preset::Demo,
            seed,
            rank: None,
            lora_layers: None,
        },
        false,
        &mut |done, total, name| crate::progress::track(&bar, done, total, name),
    )?;
    bar.finish_and_clear();
    let rank = synth.rank;

    // 2. Extraction and verification against the merge.
    let extraction = run_extract(&merged, &base, &adapter, rank, None)?;
    announce(&[
        "verify",
        "--adapter",
        path_str(&adapter)?,
        "--base",
        path_str(&base)?,
        "--merged",
        path_str(&merged)?,
    ]);
    let bar = crate::progress::bar(0, "verify");
    let verification: VerifyReport = verify(
        &VerifyOptions {
            adapter: adapter.clone(),
            base: base.clone(),
            merged: merged.clone(),
            max_residual_ratio: DEFAULT_MAX_RESIDUAL_RATIO,
            threads: 0,
        },
        &mut |done, total, module| crate::progress::track(&bar, done, total, module),
    )?;
    bar.finish_and_clear();
    if !verification.passed {
        bail!(
            "verify: {} modules above {} x floor, {} unexplained, {} refused tensors",
            verification.above_threshold.len(),
            verification.max_residual_ratio,
            verification.unexplained.len(),
            verification.refused.len()
        );
    }

    // 3. Quantized bases, and the weight error each leaves under the adapter.
    let mut weight_rows: Vec<WeightRow> = Vec::new();
    for (name, scheme) in SCHEMES {
        let quantized = out.join(format!("base-{name}"));
        announce(&[
            "quantize",
            "--in",
            path_str(&base)?,
            "--out",
            path_str(&quantized)?,
            "--scheme",
            name,
        ]);
        quantize_to_dir(
            &QuantizeRequest {
                input: &base,
                out: &quantized,
                scheme,
                layout: None,
                activation_stats: None,
                skip: &[],
                no_default_skip: false,
                max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
                force: false,
            },
            &mut |event| {
                if let QuantizeProgress::StaleSiblings(stale) = event {
                    crate::outputs::report_stale(stale);
                }
            },
        )?;
        announce(&[
            "quant-error",
            "--base",
            path_str(&base)?,
            "--scheme",
            name,
            "--adapter",
            path_str(&adapter)?,
            "--merged",
            path_str(&merged)?,
        ]);
        let reports = measure(
            &QuantErrorRequest {
                base: &base,
                scheme,
                adapter: Some(&adapter),
                merged: Some(&merged),
                skip: &[],
            },
            &mut |_| {},
        )?;
        weight_rows.push(WeightRow {
            scheme: name,
            totals: totals(&reports),
            // The quantization-aware adapter's, filled in below.
            quantization_aware: None,
        });
    }

    // 4. Calibration statistics on prompts that are not the questions, taken on the
    //    merged model (the activations the adapter must reproduce), and for each
    //    quantized base an adapter that also repairs that base's error, at the same
    //    rank as the plain one; plus one with extra rank on NVFP4.
    let calibration_records = out.join("calibration.jsonl");
    let calibration = out.join("calibration.safetensors");
    let vocab = loraq_io::ModelConfig::from_file(&merged.join(loraq_io::CONFIG_FILE))?.vocab_size;
    eprintln!(
        "$ (demo) writing {} calibration prompts (not the questions)",
        sizes.calibration_prompts
    );
    let record_spec = |count| RecordSetSpec {
        count,
        prompt_tokens: PROMPT_TOKENS,
        vocab,
        seed,
    };
    write_records(
        &calibration_records,
        &calibration_set(&record_spec(sizes.calibration_prompts)),
    )?;
    run_records(
        sizes.calibration_prompts,
        &merged,
        None,
        ActivationQuantKind::None,
        &calibration_records,
        &out.join("calibration-answers.jsonl"),
        Some(&calibration),
    )?;
    for row in &mut weight_rows {
        let target = out.join(format!("base-{}", row.scheme));
        let qa_out = out.join(format!("adapter-qa-{}", row.scheme));
        let report = run_extract(
            &merged,
            &base,
            &qa_out,
            rank,
            Some((&target, &calibration, 0)),
        )?;
        row.quantization_aware = report
            .target_base
            .map(|t| t.totals.quantization_aware_relative);
    }
    let qa_extra_rank = out.join(format!("adapter-qa-nvfp4-extra{QA_EXTRA_RANK}"));
    run_extract(
        &merged,
        &base,
        &qa_extra_rank,
        rank,
        Some((&out.join("base-nvfp4"), &calibration, QA_EXTRA_RANK)),
    )?;

    // 5. Answers: the merged reference, then the adapter on each base.
    let records = out.join("questions.jsonl");
    eprintln!(
        "$ (demo) writing {} questions with gold drawn from the reference's probabilities",
        sizes.questions
    );
    let reference_model = Reference(
        Model::load(&merged, None, &LoadOptions::default())
            .with_context(|| format!("loading {}", merged.display()))?,
    );
    let questions = question_set(&reference_model, &record_spec(sizes.questions))?;
    drop(reference_model);
    write_records(&records, &questions)?;
    let answers = out.join("answers");
    std::fs::create_dir_all(&answers).with_context(|| format!("creating {}", answers.display()))?;
    let reference = answers.join("merged.jsonl");
    run_records(
        sizes.questions,
        &merged,
        None,
        ActivationQuantKind::None,
        &records,
        &reference,
        None,
    )?;
    let fp8 = out.join("base-fp8-block128");
    let nvfp4 = out.join("base-nvfp4");
    let int4 = out.join("base-int4-g128");
    let qa_fp8 = out.join("adapter-qa-fp8-block128");
    let qa_nvfp4 = out.join("adapter-qa-nvfp4");
    let qa_int4 = out.join("adapter-qa-int4-g128");
    let qa_extra_label = qa_extra_label();
    let none = ActivationQuantKind::None;
    let fp8_group = ActivationQuantKind::Fp8PerGroup128;
    let setup = |label: &str, file, model, adapter, act_quant| Setup {
        label: label.to_string(),
        file,
        model,
        adapter,
        act_quant,
    };
    let setups = [
        setup("bf16 base, no adapter", "base-only", &base, None, none),
        setup(
            "bf16 base + true adapter",
            "true-adapter",
            &base,
            Some(&true_adapter),
            none,
        ),
        setup(
            "bf16 base + extracted adapter",
            "bf16",
            &base,
            Some(&adapter),
            none,
        ),
        setup(
            "fp8-block128 W8A8 + adapter",
            "fp8",
            &fp8,
            Some(&adapter),
            fp8_group,
        ),
        setup(
            "fp8-block128 W8A8 + QA adapter",
            "fp8-qa",
            &fp8,
            Some(&qa_fp8),
            fp8_group,
        ),
        setup(
            "nvfp4 W4A16 + adapter",
            "nvfp4",
            &nvfp4,
            Some(&adapter),
            none,
        ),
        setup(
            "nvfp4 W4A16 + QA adapter",
            "nvfp4-qa",
            &nvfp4,
            Some(&qa_nvfp4),
            none,
        ),
        setup(
            &qa_extra_label,
            "nvfp4-qa-extra",
            &nvfp4,
            Some(&qa_extra_rank),
            none,
        ),
        setup(
            "int4-g128 W4A16 + adapter",
            "int4",
            &int4,
            Some(&adapter),
            none,
        ),
        setup(
            "int4-g128 W4A16 + QA adapter",
            "int4-qa",
            &int4,
            Some(&qa_int4),
            none,
        ),
    ];
    let mut answer_rows = Vec::new();
    for Setup {
        label: setup,
        file,
        model,
        adapter: lora,
        act_quant,
    } in setups
    {
        let answer_file = answers.join(format!("{file}.jsonl"));
        run_records(
            sizes.questions,
            model,
            lora,
            act_quant,
            &records,
            &answer_file,
            None,
        )?;
        let (json, markdown, plot) = (
            answers.join(format!("{file}.compare.json")),
            answers.join(format!("{file}.md")),
            answers.join(format!("{file}.svg")),
        );
        announce(&[
            "compare",
            "--reference",
            path_str(&reference)?,
            "--candidate",
            path_str(&answer_file)?,
            "--json",
            path_str(&json)?,
            "--markdown",
            path_str(&markdown)?,
            "--plot",
            path_str(&plot)?,
        ]);
        let compared = compare_to_files(&CompareRequest {
            reference: &reference,
            candidate: &answer_file,
            options: CompareOptions::default(),
            json: Some(&json),
            markdown: Some(&markdown),
            plot: Some(&plot),
            force: false,
        })?;
        answer_rows.push(AnswerRow {
            setup,
            report: compared.comparison.report,
        });
    }

    Ok(DemoResults {
        synth,
        extraction,
        verification,
        weight_rows,
        answer_rows,
    })
}

/// The label of the extra-rank quantization-aware setup.
fn qa_extra_label() -> String {
    format!("nvfp4 W4A16 + QA adapter, rank +{QA_EXTRA_RANK}")
}

/// Prints the demo's two tables and the lines around them.
fn print_tables(results: &DemoResults, sizes: DemoSizes, out: &Path) {
    let DemoResults {
        synth,
        extraction,
        verification,
        weight_rows,
        answer_rows,
    } = results;
    let rank = synth.rank;
    let qa_extra_label = qa_extra_label();
    println!();
    println!(
        "Model pair: Qwen3.5 architecture (Gated DeltaNet + gated attention), {} parameters; a rank-{} LoRA on {} modules merged in bf16.",
        synth.base_parameters, synth.rank, synth.adapted_modules
    );
    let totals = &extraction.totals;
    println!(
        "Extraction: {} modules; truncation residual up to {} x the bf16 rounding floor (mean {} where rank < width); verify: worst {} x floor.",
        totals.modules,
        fixed(Some(totals.max_ratio), 4),
        fixed(totals.mean_ratio_low_rank, 4),
        fixed(verification.distribution.as_ref().map(|d| d.max), 4),
    );
    println!();
    println!(
        "Weights the adapter reproduces on each base, against the merge (relative Frobenius error, adapted modules):"
    );
    println!(
        "{:<14} {:>14} {:>16} {:>16} {:>12} {:>19}",
        "base",
        "base W error",
        "bf16 base + BA",
        "quant base + BA",
        "bf16 floor",
        "quant base + QA BA"
    );
    for r in weight_rows {
        let adapter = r.totals.adapter.as_ref();
        println!(
            "{:<14} {:>14} {:>16} {:>16} {:>12} {:>19}",
            r.scheme,
            pct(Some(r.totals.quant_rel_error)),
            pct(adapter.map(|a| a.exact_rel_error)),
            pct(adapter.map(|a| a.quantized_rel_error)),
            pct(adapter.map(|a| a.bf16_floor_rel)),
            pct(r.quantization_aware),
        );
    }
    println!();
    println!(
        "Answers on {} four-option questions (gold drawn from the reference's own probabilities):",
        sizes.questions
    );
    print_answer_table(answer_rows);
    println!(
        "QA adapter: `extract --target-base <quantized base> --calibration <E[x^2] of {} other prompts>`, rank {rank} as the plain one (\"rank +{QA_EXTRA_RANK}\": rank {}); it factors merged - dequant(base) instead of merged - base.",
        sizes.calibration_prompts,
        rank + QA_EXTRA_RANK
    );
    let mean_kl = |setup: &str| {
        answer_rows
            .iter()
            .find(|r| r.setup == setup)
            .map(|r| r.report.kl.mean)
    };
    let changes: Vec<String> = [
        (
            "fp8-block128",
            "fp8-block128 W8A8 + adapter",
            "fp8-block128 W8A8 + QA adapter",
        ),
        ("nvfp4", "nvfp4 W4A16 + adapter", "nvfp4 W4A16 + QA adapter"),
        (
            &format!("nvfp4 rank +{QA_EXTRA_RANK}"),
            "nvfp4 W4A16 + adapter",
            &qa_extra_label,
        ),
        (
            "int4-g128",
            "int4-g128 W4A16 + adapter",
            "int4-g128 W4A16 + QA adapter",
        ),
    ]
    .iter()
    .filter_map(|(name, plain, qa)| {
        let (p, q) = (mean_kl(plain)?, mean_kl(qa)?);
        Some(format!("{name} {:+.1}%", 100.0 * (q - p) / p))
    })
    .collect();
    println!(
        "Mean KL of the QA adapter against the plain one: {}.",
        changes.join(", ")
    );
    println!();
    println!(
        "Everything the demo wrote (checkpoints, adapter, answers, reliability plots) is under {}.",
        out.display()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole demo at a reduced size (24 questions, 8 calibration prompts): its
    /// typed results must agree with each other and with what the pair is known to
    /// hold (a rank-`synth.rank` LoRA merged in bf16).
    #[test]
    fn demo_at_reduced_size_is_consistent() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("demo");
        std::fs::create_dir(&out).unwrap();
        let sizes = DemoSizes {
            questions: 24,
            calibration_prompts: 8,
        };
        let r = run_steps(&out, 0, sizes).unwrap();

        // The extraction finds every adapted module back, at most at the LoRA's rank,
        // and verify agrees with it.
        assert_eq!(r.extraction.totals.modules, r.synth.adapted_modules);
        assert!(r.extraction.modules.iter().all(|m| m.rank <= r.synth.rank));
        assert!(r.extraction.totals.max_ratio <= 1.10);
        assert!(r.verification.passed);
        assert_eq!(r.verification.modules.len(), r.synth.adapted_modules);

        // Weights: the adapter on the bf16 base sits near the bf16 floor, far below
        // its error on any quantized base, and the quantization-aware adapter lowers
        // the error on its own base.
        assert_eq!(r.weight_rows.len(), SCHEMES.len());
        for row in &r.weight_rows {
            let a = row.totals.adapter.expect("measured with the adapter");
            assert_eq!(a.modules, r.synth.adapted_modules, "{}", row.scheme);
            assert!(a.exact_rel_error < 2.0 * a.bf16_floor_rel, "{}", row.scheme);
            assert!(
                a.quantized_rel_error > 5.0 * a.exact_rel_error,
                "{}",
                row.scheme
            );
            let qa = row.quantization_aware.expect("a target summary");
            assert!(qa < a.quantized_rel_error, "{}: {qa}", row.scheme);
        }

        // Answers: every setup answered every question; the extracted adapter is far
        // closer to the merged reference than the bare base.
        assert_eq!(r.answer_rows.len(), 10);
        for row in &r.answer_rows {
            assert_eq!(row.report.n, sizes.questions, "{}", row.setup);
        }
        let kl = |setup: &str| {
            r.answer_rows
                .iter()
                .find(|row| row.setup == setup)
                .map(|row| row.report.kl.mean)
                .unwrap()
        };
        assert!(kl("bf16 base + extracted adapter") < 0.1 * kl("bf16 base, no adapter"));
        let questions = std::fs::read_to_string(out.join("questions.jsonl")).unwrap();
        assert_eq!(questions.lines().count(), sizes.questions);
    }
}
