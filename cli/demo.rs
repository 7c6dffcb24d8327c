//! `loraq demo`: the main job on the built-in example.
//!
//! Each step calls what the subcommand a user would type calls (the libraries, or the
//! subcommand's own function where it holds the logic) and reads its typed result, so
//! the demo shows and checks the real workflow, and a renamed field fails to compile:
//! take a Qwen3.5-architecture model pair with a known LoRA merged into it (by
//! default the trained pair committed under data/demo-model/, merged at run time;
//! `--pair random` synthesizes a random one), extract the adapter back from the merge, verify it against the merge, quantize the
//! base to each scheme a deployment would use, and measure what each quantized base
//! does to the weights the adapter reproduces; then collect calibration statistics on
//! prompts other than the questions and extract, for each quantized base, a
//! quantization-aware adapter at the same rank (`extract --target-base`) whose
//! answers are compared beside the plain adapter's. The trained pair's question and
//! calibration sets are committed beside it (gold = the true answer, grouped by task;
//! docs/demo.md); the random pair's come from loraq-synth
//! ([`loraq_synth::questions`]). The steps' outputs stay under `--out` for a closer
//! look; each step prints the equivalent command line on stderr.

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
use loraq_quant::ggml::mix::GgufFileType;
use loraq_quant::quantize_dir::DEFAULT_MAX_SHARD_BYTES;
use loraq_quant::report::measure;
use loraq_quant::report::{QuantErrorTotals, totals};
use loraq_quant::{
    GgufQuantizeRequest, QuantErrorRequest, QuantizeProgress, QuantizeRequest, quantize_to_dir,
    quantize_to_gguf,
};
use loraq_synth::merge::{MergeSummary, merge_adapter};
use loraq_synth::questions::{
    NextTokenModel, RecordSetSpec, calibration_set, question_set, to_json_lines,
};
use loraq_synth::{Preset, SynthOptions, SynthSummary, write_synth};
use std::collections::BTreeMap;
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

/// The GGUF base the demo writes (llama-quantize's Q4_K_M, what llama.cpp users run).
const GGUF_BASE: &str = "base-q4_k_m.gguf";
/// Its label in the tables.
const GGUF_LABEL: &str = "Q4_K_M GGUF";

/// Size of the random pair's question set: enough for the paired test to mean
/// something, small enough for a few seconds per forward run.
const QUESTIONS: usize = 240;
/// Prompt length of each of the random pair's questions, in tokens.
const PROMPT_TOKENS: usize = 20;
/// Calibration prompts of the random pair for the quantization-aware adapters: other
/// random prompts than the questions (a different seed), as a user would calibrate on
/// their own data and evaluate on a benchmark. 48 x 20 tokens keep the run to a few
/// seconds.
const CALIBRATION_PROMPTS: usize = 48;

/// The trained pair (data/demo-model/, written by scripts/train_demo_model.py),
/// compiled into the binary so the demo runs from any directory: (path under the
/// pair's directory, contents).
const TRAINED_PAIR: [(&str, &[u8]); 5] = [
    (
        "base/config.json",
        include_bytes!("../data/demo-model/base/config.json"),
    ),
    (
        "base/model.safetensors",
        include_bytes!("../data/demo-model/base/model.safetensors"),
    ),
    (
        "base/tokenizer.json",
        include_bytes!("../data/demo-model/base/tokenizer.json"),
    ),
    (
        "trained-adapter/adapter_config.json",
        include_bytes!("../data/demo-model/adapter/adapter_config.json"),
    ),
    (
        "trained-adapter/adapter_model.safetensors",
        include_bytes!("../data/demo-model/adapter/adapter_model.safetensors"),
    ),
];
/// The trained pair's questions: JSON Lines records, round robin over the task
/// groups, gold = the true answer.
const TRAINED_QUESTIONS: &str = include_str!("../data/demo-model/questions.jsonl");
/// The trained pair's calibration prompts: other questions of the same tasks.
const TRAINED_CALIBRATION: &str = include_str!("../data/demo-model/calibration.jsonl");

/// `loraq verify`'s threshold on the trained pair (x the bf16 rounding floor): its
/// default (1.25) is met by every module but a few MLP ones of the fine-tune, whose
/// deltas are as large as the weights, so the bf16 cast of the extracted factors
/// adds about as much as the floor itself (1.25-1.30 x floor measured).
const TRAINED_MAX_RESIDUAL_RATIO: f64 = 1.5;

/// Which model pair the demo runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PairKind {
    /// The committed trained base and LoRA fine-tune (data/demo-model/), merged in bf16.
    Trained,
    /// A randomly initialized pair from `loraq synth --preset demo`.
    Random,
}
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
    /// The model pair: the trained one committed with loraq, or a random synthetic one.
    #[arg(long, value_enum, default_value_t = PairKind::Trained)]
    pair: PairKind,
    /// Seed of the random pair and its record sets (`--pair random`).
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

/// Questions with gold in one group of an answers file, and how many the top option
/// got right.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct GroupAccuracy {
    gold: usize,
    correct: usize,
}

impl GroupAccuracy {
    fn rate(self) -> Option<f64> {
        (self.gold > 0).then(|| self.correct as f64 / self.gold as f64)
    }
}

/// Accuracy on gold of the answers in `path`, per group (the top option is the first
/// of the largest probabilities).
fn group_accuracy(path: &Path) -> Result<BTreeMap<String, GroupAccuracy>> {
    let mut groups: BTreeMap<String, GroupAccuracy> = BTreeMap::new();
    for answer in loraq_eval::AnswersReader::open(path)? {
        let answer = answer?;
        let Some(gold) = answer.gold else { continue };
        let top =
            answer.probs.iter().enumerate().fold(
                0,
                |best, (i, &p)| if p > answer.probs[best] { i } else { best },
            );
        let group = answer.group.unwrap_or_else(|| "(ungrouped)".into());
        let entry = groups.entry(group).or_default();
        entry.gold += 1;
        entry.correct += usize::from(top == gold);
    }
    Ok(groups)
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
        "{:<40} {:>11} {:>9} {:>9} {:>20} {:>15} {:>12}",
        "setup (vs merged reference)",
        "changed",
        "mean KL",
        "max KL",
        "accuracy change (p)",
        "ECE ref / cand",
        "near-tie flips"
    );
    for row in rows {
        let r = &row.report;
        let accuracy = match (r.accuracy.delta, r.accuracy.mcnemar_p) {
            (Some(d), Some(p)) => format!("{:+.2} pts (p={p:.2})", 100.0 * d),
            _ => "-".into(),
        };
        println!(
            "{:<40} {:>11} {:>9} {:>9} {:>20} {:>15} {:>12}",
            row.setup,
            format!("{} ({:.1}%)", r.flips, 100.0 * r.flip_rate),
            fixed(Some(r.kl.mean), 5),
            fixed(Some(r.kl.max), 4),
            accuracy,
            format!(
                "{} / {}",
                fixed(r.calibration.reference.ece, 3),
                fixed(r.calibration.candidate.ece, 3)
            ),
            r.near_ties
                .flips_margin_below_0_1
                .map_or_else(|| "-".into(), |share| format!("{:.0}%", 100.0 * share)),
        );
    }
}

/// Prints accuracy on gold per group, one row per setup (the first is the merged
/// reference).
fn print_group_accuracy(rows: &[(String, BTreeMap<String, GroupAccuracy>)]) {
    let mut groups: Vec<&String> = rows.iter().flat_map(|(_, g)| g.keys()).collect();
    groups.sort();
    groups.dedup();
    print!("{:<40}", "setup");
    for g in &groups {
        print!(" {g:>9}");
    }
    println!();
    for (setup, accuracy) in rows {
        print!("{setup:<40}");
        for g in &groups {
            let cell = accuracy
                .get(*g)
                .and_then(|a| a.rate())
                .map_or_else(|| "-".into(), |r| format!("{:.1}%", 100.0 * r));
            print!(" {cell:>9}");
        }
        println!();
    }
}

/// Extraction of `merged` - `base` into `out` at `rank`; with a target, the
/// quantization-aware adapter on it with the calibration and extra rank;
/// `allow_residual` writes modules above the residual thresholds (`--allow-residual`).
fn run_extract(
    merged: &Path,
    base: &Path,
    out: &Path,
    rank: usize,
    quantization_aware: Option<(&Path, &Path, usize)>,
    allow_residual: bool,
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
    if allow_residual {
        line.push("--allow-residual");
        options.allow_residual = true;
    }
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

/// A record set the demo wrote: how many records and prompt tokens in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RecordCount {
    records: usize,
    tokens: usize,
}

/// Scores `records` with `model` (+ `adapter`) into `out`; refuses a run that did
/// not answer the `expected` records and tokens.
fn run_records(
    expected: RecordCount,
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
        ActivationQuantKind::Ggml => line.extend(["--act-quant", "ggml"]),
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
    if summary.records != expected.records || summary.tokens != expected.tokens {
        bail!(
            "run {}: {} records of {} tokens in all answered, {} of {} written",
            records.display(),
            summary.records,
            summary.tokens,
            expected.records,
            expected.tokens
        );
    }
    Ok(())
}

/// How many records the demo uses (the trained pair: the first of its committed
/// sets, which cycle through the task groups).
#[derive(Debug, Clone, Copy)]
struct DemoSizes {
    /// Questions.
    questions: usize,
    /// Calibration prompts.
    calibration_prompts: usize,
}

impl DemoSizes {
    /// Every record of the pair's sets.
    fn full(kind: PairKind) -> DemoSizes {
        match kind {
            PairKind::Trained => DemoSizes {
                questions: TRAINED_QUESTIONS.lines().count(),
                calibration_prompts: TRAINED_CALIBRATION.lines().count(),
            },
            PairKind::Random => DemoSizes {
                questions: QUESTIONS,
                calibration_prompts: CALIBRATION_PROMPTS,
            },
        }
    }
}

/// The model pair the demo runs on, as written under `out/pair`.
struct PairSummary {
    kind: PairKind,
    /// The base checkpoint.
    base: PathBuf,
    /// bf16(base + the adapter's product).
    merged: PathBuf,
    /// The adapter that made the merge (the synthetic true one, or the trained one).
    adapter: PathBuf,
    /// The rank the demo extracts at: the adapter's `r`.
    rank: usize,
    /// Modules the adapter changes.
    adapted_modules: usize,
    /// Parameters of the base.
    base_parameters: usize,
}

/// What the demo measured, typed, for the tables.
struct DemoResults {
    pair: PairSummary,
    extraction: ExtractionReport,
    verification: VerifyReport,
    weight_rows: Vec<WeightRow>,
    answer_rows: Vec<AnswerRow>,
    /// Accuracy on gold per group: the merged reference's, then each setup's.
    group_accuracy: Vec<(String, BTreeMap<String, GroupAccuracy>)>,
}

/// Runs `loraq demo`.
pub fn run(args: Args) -> Result<()> {
    prepare_out(&args.out)?;
    let sizes = DemoSizes::full(args.pair);
    let results = run_steps(&args.out, args.pair, args.seed, sizes)?;
    print_tables(&results, sizes, &args.out);
    Ok(())
}

/// The random pair: `loraq synth --preset demo` into `pair`.
fn synth_pair(pair: &Path, seed: u64) -> Result<PairSummary> {
    let seed_text = seed.to_string();
    announce(&[
        "synth",
        "--preset",
        "demo",
        "--out",
        path_str(pair)?,
        "--seed",
        &seed_text,
    ]);
    let bar = crate::progress::bar(0, "synth");
    let synth: SynthSummary = write_synth(
        pair,
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
    Ok(PairSummary {
        kind: PairKind::Random,
        base: pair.join("base"),
        merged: pair.join("merged"),
        adapter: pair.join("true-adapter"),
        rank: synth.rank,
        adapted_modules: synth.adapted_modules,
        base_parameters: synth.base_parameters,
    })
}

/// The trained pair: the committed base and adapter written into `pair`, and the
/// adapter merged into the base in bf16 as PEFT's `merge_and_unload` does
/// ([`loraq_synth::merge`]).
fn trained_pair(pair: &Path) -> Result<PairSummary> {
    eprintln!(
        "$ (demo) writing the trained base and its LoRA fine-tune (data/demo-model/) to {}",
        pair.display()
    );
    let staged = loraq_io::AtomicDir::create(pair, false, &[])?;
    for (name, bytes) in TRAINED_PAIR {
        let path = staged.path().join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    staged.commit()?;
    let (base, adapter, merged) = (
        pair.join("base"),
        pair.join("trained-adapter"),
        pair.join("merged"),
    );
    eprintln!(
        "$ (demo) merging {} into {} in bf16 (PEFT's merge_and_unload) -> {}",
        adapter.display(),
        base.display(),
        merged.display()
    );
    let merge: MergeSummary = merge_adapter(&base, &adapter, &merged, false)?;
    Ok(PairSummary {
        kind: PairKind::Trained,
        base,
        merged,
        adapter,
        rank: merge.max_rank,
        adapted_modules: merge.adapted_modules,
        base_parameters: merge.parameters,
    })
}

/// The first `count` records of a committed set, written to `path`, and their size.
fn write_committed_records(set: &str, count: usize, path: &Path) -> Result<RecordCount> {
    let lines: Vec<&str> = set.lines().take(count).collect();
    if lines.len() != count {
        bail!(
            "the trained pair's record set holds {} records, {count} asked for",
            lines.len()
        );
    }
    let mut text = String::new();
    let mut tokens = 0usize;
    for line in &lines {
        let record: serde_json::Value =
            serde_json::from_str(line).context("a committed record of the trained pair")?;
        tokens += record["tokens"]
            .as_array()
            .map(Vec::len)
            .context("a committed record without tokens")?;
        text.push_str(line);
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(RecordCount {
        records: count,
        tokens,
    })
}

/// Every step of the demo on the `kind` pair, writing under `out` (prepared), with
/// `sizes` records.
fn run_steps(out: &Path, kind: PairKind, seed: u64, sizes: DemoSizes) -> Result<DemoResults> {
    let adapter = out.join("adapter");

    // 1. The model pair.
    let pair = match kind {
        PairKind::Trained => trained_pair(&out.join("pair"))?,
        PairKind::Random => synth_pair(&out.join("pair"), seed)?,
    };
    let (base, merged, true_adapter) =
        (pair.base.clone(), pair.merged.clone(), pair.adapter.clone());
    let rank = pair.rank;

    // 2. Extraction and verification against the merge.
    // The trained fine-tune's deltas are as large as the weights in a few MLP
    // modules, where the bf16 cast of the extracted factors adds a little more than
    // the merge's rounding floor (docs/demo.md, "The merge"): extract writes them and
    // verify takes the trained pair's threshold.
    let allow_residual = kind == PairKind::Trained;
    let verify_ratio = match kind {
        PairKind::Trained => TRAINED_MAX_RESIDUAL_RATIO,
        PairKind::Random => DEFAULT_MAX_RESIDUAL_RATIO,
    };
    let extraction = run_extract(&merged, &base, &adapter, rank, None, allow_residual)?;
    let ratio_text = verify_ratio.to_string();
    let mut verify_line = vec![
        "verify",
        "--adapter",
        path_str(&adapter)?,
        "--base",
        path_str(&base)?,
        "--merged",
        path_str(&merged)?,
    ];
    if kind == PairKind::Trained {
        verify_line.extend(["--max-residual-ratio", &ratio_text]);
    }
    announce(&verify_line);
    let bar = crate::progress::bar(0, "verify");
    let verification: VerifyReport = verify(
        &VerifyOptions {
            adapter: adapter.clone(),
            base: base.clone(),
            merged: merged.clone(),
            max_residual_ratio: verify_ratio,
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

    // 3b. The GGUF Q4_K_M base llama.cpp users run, written as llama.cpp's converter
    //     and llama-quantize write it (its tokenizer embedded: the random pair has
    //     none, and no GGUF row).
    let gguf_base = out.join(GGUF_BASE);
    let has_gguf = base.join("tokenizer.json").is_file();
    if has_gguf {
        announce(&[
            "quantize",
            "--in",
            path_str(&base)?,
            "--out",
            path_str(&gguf_base)?,
            "--scheme",
            "gguf-q4_k_m",
        ]);
        quantize_to_gguf(
            &GgufQuantizeRequest {
                input: &base,
                out: &gguf_base,
                file_type: GgufFileType::Q4_K_M,
                force: false,
            },
            &mut |event| {
                if let QuantizeProgress::StaleSiblings(stale) = event {
                    crate::outputs::report_stale(stale);
                }
            },
        )?;
    }

    // 4. Calibration statistics on prompts that are not the questions, taken on the
    //    merged model (the activations the adapter must reproduce), and for each
    //    quantized base an adapter that also repairs that base's error, at the same
    //    rank as the plain one; plus one with extra rank on NVFP4.
    let calibration_records = out.join("calibration.jsonl");
    let calibration = out.join("calibration.safetensors");
    let vocab = loraq_io::ModelConfig::from_file(&merged.join(loraq_io::CONFIG_FILE))?.vocab_size;
    let record_spec = |count| RecordSetSpec {
        count,
        prompt_tokens: PROMPT_TOKENS,
        vocab,
        seed,
    };
    let random_count = |count| RecordCount {
        records: count,
        tokens: count * PROMPT_TOKENS,
    };
    let calibration_count = match kind {
        PairKind::Trained => {
            eprintln!(
                "$ (demo) writing {} calibration prompts of the trained tasks (not the questions)",
                sizes.calibration_prompts
            );
            write_committed_records(
                TRAINED_CALIBRATION,
                sizes.calibration_prompts,
                &calibration_records,
            )?
        }
        PairKind::Random => {
            eprintln!(
                "$ (demo) writing {} calibration prompts (not the questions)",
                sizes.calibration_prompts
            );
            write_records(
                &calibration_records,
                &calibration_set(&record_spec(sizes.calibration_prompts)),
            )?;
            random_count(sizes.calibration_prompts)
        }
    };
    run_records(
        calibration_count,
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
            allow_residual,
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
        allow_residual,
    )?;

    let qa_gguf = out.join("adapter-qa-q4_k_m");
    if has_gguf {
        run_extract(
            &merged,
            &base,
            &qa_gguf,
            rank,
            Some((&gguf_base, &calibration, 0)),
            allow_residual,
        )?;
    }

    // 5. Answers: the merged reference, then the adapter on each base.
    let records = out.join("questions.jsonl");
    let question_count = match kind {
        PairKind::Trained => {
            eprintln!(
                "$ (demo) writing {} questions of the trained tasks, gold = the true answer",
                sizes.questions
            );
            write_committed_records(TRAINED_QUESTIONS, sizes.questions, &records)?
        }
        PairKind::Random => {
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
            random_count(sizes.questions)
        }
    };
    let answers = out.join("answers");
    std::fs::create_dir_all(&answers).with_context(|| format!("creating {}", answers.display()))?;
    let reference = answers.join("merged.jsonl");
    run_records(
        question_count,
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
    let gguf_label = format!("{GGUF_LABEL} + adapter");
    let gguf_qa_label = format!("{GGUF_LABEL} + QA adapter");
    let mut setups = vec![
        setup("bf16 base, no adapter", "base-only", &base, None, none),
        setup(
            match kind {
                PairKind::Trained => "bf16 base + trained adapter",
                PairKind::Random => "bf16 base + true adapter",
            },
            match kind {
                PairKind::Trained => "trained-adapter",
                PairKind::Random => "true-adapter",
            },
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
    // llama.cpp's CPU backend quantizes the activations of its block-typed linears:
    // the GGUF rows run with the same quantization (--act-quant ggml).
    if has_gguf {
        setups.push(setup(
            &gguf_label,
            "q4_k_m",
            &gguf_base,
            Some(&adapter),
            ActivationQuantKind::Ggml,
        ));
        setups.push(setup(
            &gguf_qa_label,
            "q4_k_m-qa",
            &gguf_base,
            Some(&qa_gguf),
            ActivationQuantKind::Ggml,
        ));
    }
    let mut answer_rows = Vec::new();
    let mut group_accuracies = vec![("merged reference".to_string(), group_accuracy(&reference)?)];
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
            question_count,
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
        group_accuracies.push((setup.clone(), group_accuracy(&answer_file)?));
        answer_rows.push(AnswerRow {
            setup,
            report: compared.comparison.report,
        });
    }

    Ok(DemoResults {
        pair,
        extraction,
        verification,
        weight_rows,
        answer_rows,
        group_accuracy: group_accuracies,
    })
}

/// The label of the extra-rank quantization-aware setup.
fn qa_extra_label() -> String {
    format!("nvfp4 W4A16 + QA adapter, rank +{QA_EXTRA_RANK}")
}

/// Prints the demo's two tables and the lines around them.
fn print_tables(results: &DemoResults, sizes: DemoSizes, out: &Path) {
    let DemoResults {
        pair,
        extraction,
        verification,
        weight_rows,
        answer_rows,
        group_accuracy,
    } = results;
    let rank = pair.rank;
    let qa_extra_label = qa_extra_label();
    println!();
    match pair.kind {
        PairKind::Trained => println!(
            "Model pair: a trained Qwen3.5-architecture base (Gated DeltaNet + gated attention, {} parameters) and its LoRA fine-tune (rank {} on {} modules of layers 4-7), merged in bf16.",
            pair.base_parameters, pair.rank, pair.adapted_modules
        ),
        PairKind::Random => println!(
            "Model pair: Qwen3.5 architecture (Gated DeltaNet + gated attention), {} parameters, random weights; a rank-{} LoRA on {} modules merged in bf16.",
            pair.base_parameters, pair.rank, pair.adapted_modules
        ),
    }
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
    match pair.kind {
        PairKind::Trained => println!(
            "Answers on {} four-option questions (gold = the true answer), against the merged reference:",
            sizes.questions
        ),
        PairKind::Random => println!(
            "Answers on {} four-option questions (gold drawn from the reference's own probabilities):",
            sizes.questions
        ),
    }
    print_answer_table(answer_rows);
    println!(
        "QA adapter: `extract --target-base <quantized base> --calibration <E[x^2] of {} other prompts>`, rank {rank} as the plain one (\"rank +{QA_EXTRA_RANK}\": rank {}); it factors merged - dequant(base) instead of merged - base.",
        sizes.calibration_prompts,
        rank + QA_EXTRA_RANK
    );
    println!();
    println!("Accuracy on gold by task group:");
    print_group_accuracy(group_accuracy);
    println!();
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
        (
            "Q4_K_M",
            &format!("{GGUF_LABEL} + adapter"),
            &format!("{GGUF_LABEL} + QA adapter"),
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

    /// The whole demo at a reduced size (24 questions, 8 calibration prompts) on the
    /// `kind` pair: its typed results must agree with each other and with what the
    /// pair is known to hold (a LoRA of rank `pair.rank` merged in bf16).
    fn demo_at_reduced_size(kind: PairKind) -> (tempfile::TempDir, DemoResults) {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("demo");
        std::fs::create_dir(&out).unwrap();
        let sizes = DemoSizes {
            questions: 24,
            calibration_prompts: 8,
        };
        let r = run_steps(&out, kind, 0, sizes).unwrap();

        // The extraction finds every adapted module back, at most at the LoRA's rank,
        // and verify agrees with it.
        assert_eq!(r.extraction.totals.modules, r.pair.adapted_modules);
        assert!(r.extraction.modules.iter().all(|m| m.rank <= r.pair.rank));
        assert!(r.extraction.totals.max_ratio <= 1.10);
        assert!(r.verification.passed);
        assert_eq!(r.verification.modules.len(), r.pair.adapted_modules);

        // Weights: the adapter on the bf16 base sits near the bf16 floor, below its
        // error on any quantized base, and the quantization-aware adapter lowers the
        // error on its own base.
        assert_eq!(r.weight_rows.len(), SCHEMES.len());
        for row in &r.weight_rows {
            let a = row.totals.adapter.expect("measured with the adapter");
            assert_eq!(a.modules, r.pair.adapted_modules, "{}", row.scheme);
            assert!(a.exact_rel_error < 2.0 * a.bf16_floor_rel, "{}", row.scheme);
            assert!(
                a.quantized_rel_error > 2.0 * a.exact_rel_error,
                "{}",
                row.scheme
            );
            let qa = row.quantization_aware.expect("a target summary");
            assert!(qa < a.quantized_rel_error, "{}: {qa}", row.scheme);
        }

        // Answers: every setup answered every question; the extracted adapter is far
        // closer to the merged reference than the bare base.
        // The trained pair has a tokenizer and so the two Q4_K_M GGUF rows.
        let gguf_rows = if kind == PairKind::Trained { 2 } else { 0 };
        assert_eq!(r.answer_rows.len(), 10 + gguf_rows);
        for row in &r.answer_rows {
            assert_eq!(row.report.n, sizes.questions, "{}", row.setup);
        }
        assert!(kl(&r, "bf16 base + extracted adapter") < 0.1 * kl(&r, "bf16 base, no adapter"));
        let questions = std::fs::read_to_string(out.join("questions.jsonl")).unwrap();
        assert_eq!(questions.lines().count(), sizes.questions);
        assert_eq!(r.group_accuracy.len(), 11 + gguf_rows);
        (dir, r)
    }

    fn kl(r: &DemoResults, setup: &str) -> f64 {
        r.answer_rows
            .iter()
            .find(|row| row.setup == setup)
            .map(|row| row.report.kl.mean)
            .unwrap()
    }

    #[test]
    fn random_demo_at_reduced_size_is_consistent() {
        demo_at_reduced_size(PairKind::Random);
    }

    /// The trained pair besides: its first 24 questions are 6 of each task group; the
    /// merged model answers nearly all of them right, and the base without the
    /// adapter misses the fine-tune's task (sub) it never learned.
    #[test]
    fn trained_demo_at_reduced_size_is_consistent() {
        let (_dir, r) = demo_at_reduced_size(PairKind::Trained);
        let (label, reference) = &r.group_accuracy[0];
        assert_eq!(label, "merged reference");
        assert_eq!(
            reference.keys().collect::<Vec<_>>(),
            ["arith", "pattern", "recall", "sub"]
        );
        for (group, a) in reference {
            assert_eq!(a.gold, 6, "{group}");
            assert!(a.correct >= 5, "{group}: {a:?}");
        }
        let base_only = &r
            .group_accuracy
            .iter()
            .find(|(setup, _)| setup == "bf16 base, no adapter")
            .unwrap()
            .1;
        assert!(base_only["sub"].correct <= 3, "{:?}", base_only["sub"]);
    }
}
