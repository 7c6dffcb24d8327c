//! `loraq demo`: the main job on the built-in example.
//!
//! Each step runs the very subcommand a user would type (this binary, as a child
//! process, with `--json` where the step reports figures), so the demo shows and
//! checks the real workflow: synthesize a Qwen3.5-architecture model pair with a known
//! LoRA merged into it, extract the adapter back from the merge, verify it against
//! the merge and compare it with the true adapter, quantize the base to each scheme a
//! deployment would use, and measure what each quantized base does to the weights the
//! adapter reproduces; then collect calibration statistics on prompts other than the
//! questions and extract, for each quantized base, a quantization-aware adapter at
//! the same rank (`extract --target-base`) whose answers are compared beside the
//! plain adapter's. The steps' outputs stay under `--out` for a closer look.

use anyhow::{Context, Result, bail};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Marker file that identifies a directory as a demo output loraq may replace.
const DEMO_MARKER: &str = ".loraq-demo";

/// Quantized bases the demo measures: what datacenter (FP8 blocks) and consumer
/// (NVFP4, 4-bit integer) deployments run.
const SCHEMES: [&str; 3] = ["fp8-block128", "nvfp4", "int4-g128"];

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
/// Option labels.
const LABELS: [&str; 4] = ["A", "B", "C", "D"];
/// Benchmarks the questions are grouped into.
const GROUPS: [&str; 3] = ["arith", "recall", "logic"];

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

/// Runs `loraq <args>` as a child process with stderr (progress) passed through and
/// returns its stdout; a failing step fails the demo with the step's command line.
fn step(args: &[&str]) -> Result<String> {
    let exe = std::env::current_exe().context("locating the loraq binary")?;
    eprintln!("$ loraq {}", args.join(" "));
    let output = Command::new(&exe)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running loraq {}", args.join(" ")))?;
    if !output.status.success() {
        bail!("step `loraq {}` failed ({})", args.join(" "), output.status);
    }
    String::from_utf8(output.stdout).context("step output is not UTF-8")
}

/// Runs a step that prints JSON on stdout and parses it.
fn json_step(args: &[&str]) -> Result<Value> {
    let text = step(args)?;
    serde_json::from_str(&text)
        .with_context(|| format!("parsing the JSON of loraq {}", args.join(" ")))
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str()
        .with_context(|| format!("{} is not valid UTF-8", p.display()))
}

fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_string(), |v| format!("{:.3}%", 100.0 * v))
}

/// Writes the demo's question set: random prompts with four options each, whose gold
/// answers are drawn from the merged (reference) model's own probabilities with a fixed
/// seed, so the reference is calibrated by construction. Options are chosen among the
/// reference's next-token candidates so the set ranges, as real benchmarks do, from
/// confident questions (the top token against far-down ones) through ordinary ones to
/// near-ties (neighbours in the ranking).
fn write_question_set(reference: &Path, out: &Path, seed: u64) -> Result<()> {
    let model = loraq_model::Model::load(reference, None, &loraq_model::LoadOptions::default())
        .with_context(|| format!("loading {}", reference.display()))?;
    let vocab =
        loraq_io::ModelConfig::from_file(&reference.join(loraq_io::CONFIG_FILE))?.vocab_size;
    let all_rows: Vec<u32> = (0..vocab as u32).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_f00d);
    let mut lines = Vec::with_capacity(QUESTIONS);
    for i in 0..QUESTIONS {
        let tokens: Vec<u32> = (0..PROMPT_TOKENS)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        let hidden = model.last_hidden(&tokens)?;
        let logits = model.logits_of(&hidden, &all_rows)?;
        let mut ranked: Vec<u32> = all_rows.clone();
        ranked.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let kind = rng.random::<f64>();
        let mut option_tokens: Vec<u32> = if kind < 0.35 {
            // Confident: the top candidate against three from far down the ranking.
            let mut o = vec![ranked[0]];
            while o.len() < 4 {
                let t = ranked[rng.random_range(64..vocab.min(1024))];
                if !o.contains(&t) {
                    o.push(t);
                }
            }
            o
        } else if kind < 0.9 {
            // Ordinary: four of the top 48.
            let mut pool: Vec<u32> = ranked[..48.min(vocab)].to_vec();
            pool.shuffle(&mut rng);
            pool[..4].to_vec()
        } else {
            // Near-ties: four close neighbours in the ranking (every third candidate).
            let start = rng.random_range(0..16.min(vocab - 10));
            (0..4).map(|k| ranked[start + 3 * k]).collect()
        };
        option_tokens.shuffle(&mut rng);
        let option_logits = model.logits_of(&hidden, &option_tokens)?;
        let max = option_logits
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f64> = option_logits
            .iter()
            .map(|&l| f64::from(l - max).exp())
            .collect();
        let mut draw = rng.random::<f64>() * weights.iter().sum::<f64>();
        let mut gold = LABELS.len() - 1;
        for (k, w) in weights.iter().enumerate() {
            if draw < *w {
                gold = k;
                break;
            }
            draw -= w;
        }
        lines.push(json!({
            "id": format!("q{i:04}"),
            "group": GROUPS[i % GROUPS.len()],
            "tokens": tokens,
            "options": LABELS,
            "option_tokens": option_tokens,
            "gold": LABELS[gold],
        }));
    }
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?,
    );
    for line in lines {
        writeln!(file, "{line}").with_context(|| format!("writing {}", out.display()))?;
    }
    file.flush()
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

/// Writes the calibration record set: random prompts drawn with another seed than
/// the questions'. `loraq run` scores the options of every record and, like `loraq
/// compare`, refuses a record with fewer than two, so each carries two placeholder
/// options; only the prompts' activations matter here.
fn write_calibration_set(vocab: usize, out: &Path, seed: u64) -> Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xca1b_5e75);
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?,
    );
    for i in 0..CALIBRATION_PROMPTS {
        let tokens: Vec<u32> = (0..PROMPT_TOKENS)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        let line = json!({
            "id": format!("c{i:04}"),
            "tokens": tokens,
            "options": ["A", "B"],
            "option_tokens": [0, 1],
        });
        writeln!(file, "{line}").with_context(|| format!("writing {}", out.display()))?;
    }
    file.flush()
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

/// One run of the answers table: which base, adapter and activation fake-quant.
struct Setup<'a> {
    label: String,
    file: &'static str,
    model: &'a Path,
    adapter: Option<&'a Path>,
    act_quant: Option<&'static str>,
}

/// One row of the answers table: a setup compared against the merged reference.
struct AnswerRow {
    setup: String,
    report: Value,
}

fn f(v: &Value, digits: usize) -> String {
    v.as_f64()
        .map_or_else(|| "-".into(), |x| format!("{x:.digits$}"))
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
        let acc = &r["accuracy"];
        let accuracy = match (acc["delta"].as_f64(), acc["mcnemar_p"].as_f64()) {
            (Some(d), Some(p)) => format!("{:+.2} pts (p={p:.2})", 100.0 * d),
            _ => "-".into(),
        };
        let cal = &r["calibration"];
        println!(
            "{:<40} {:>9} {:>9} {:>9} {:>8} {:>20} {:>15}",
            row.setup,
            format!(
                "{} ({:.1}%)",
                r["flips"],
                100.0 * r["flip_rate"].as_f64().unwrap_or(0.0)
            ),
            f(&r["kl"]["mean"], 5),
            f(&r["kl"]["max"], 4),
            format!("{:.1}%", 100.0 * r["same_top"].as_f64().unwrap_or(0.0)),
            accuracy,
            format!(
                "{} / {}",
                f(&cal["reference"]["ece"], 3),
                f(&cal["candidate"]["ece"], 3)
            ),
        );
    }
}

/// Runs `loraq demo`.
pub fn run(args: Args) -> Result<()> {
    prepare_out(&args.out)?;
    let out = &args.out;
    let pair = out.join("pair");
    let (base, merged, true_adapter) = (
        pair.join("base"),
        pair.join("merged"),
        pair.join("true-adapter"),
    );
    let adapter = out.join("adapter");
    let seed = args.seed.to_string();

    // 1. The model pair.
    let synth = json_step(&[
        "synth",
        "--preset",
        "demo",
        "--out",
        path_str(&pair)?,
        "--seed",
        &seed,
        "--json",
    ])?;
    let rank = synth["rank"].to_string();

    // 2. Extraction, verification against the merge, and comparison with the truth.
    let extraction = json_step(&[
        "extract",
        "--merged",
        path_str(&merged)?,
        "--base",
        path_str(&base)?,
        "--out",
        path_str(&adapter)?,
        "--rank",
        &rank,
        "--json",
    ])?;
    let verification = json_step(&[
        "verify",
        "--adapter",
        path_str(&adapter)?,
        "--base",
        path_str(&base)?,
        "--merged",
        path_str(&merged)?,
        "--json",
    ])?;

    // 3. Quantized bases, and the weight error each leaves under the adapter.
    let mut weight_rows: Vec<[String; 6]> = Vec::new();
    for scheme in SCHEMES {
        let quantized = out.join(format!("base-{scheme}"));
        step(&[
            "quantize",
            "--in",
            path_str(&base)?,
            "--out",
            path_str(&quantized)?,
            "--scheme",
            scheme,
        ])?;
        let errors = json_step(&[
            "quant-error",
            "--base",
            path_str(&base)?,
            "--scheme",
            scheme,
            "--adapter",
            path_str(&adapter)?,
            "--merged",
            path_str(&merged)?,
            "--json",
        ])?;
        let totals = &errors["totals"];
        let a = &totals["adapter"];
        weight_rows.push([
            scheme.to_string(),
            pct(totals["quant_rel_error"].as_f64()),
            pct(a["exact_rel_error"].as_f64()),
            pct(a["quantized_rel_error"].as_f64()),
            pct(a["bf16_floor_rel"].as_f64()),
            String::new(), // the quantization-aware adapter's, filled in below
        ]);
    }

    // 4. Calibration statistics on prompts that are not the questions, taken on the
    //    merged model (the activations the adapter must reproduce), and for each
    //    quantized base an adapter that also repairs that base's error, at the same
    //    rank as the plain one; plus one with extra rank on NVFP4.
    let calibration_records = out.join("calibration.jsonl");
    let calibration = out.join("calibration.safetensors");
    let vocab = loraq_io::ModelConfig::from_file(&merged.join(loraq_io::CONFIG_FILE))?.vocab_size;
    eprintln!("$ (demo) writing {CALIBRATION_PROMPTS} calibration prompts (not the questions)");
    write_calibration_set(vocab, &calibration_records, args.seed)?;
    step(&[
        "run",
        "--model",
        path_str(&merged)?,
        "--records",
        path_str(&calibration_records)?,
        "--out",
        path_str(&out.join("calibration-answers.jsonl"))?,
        "--collect-stats",
        path_str(&calibration)?,
    ])?;
    let qa_extract = |scheme: &str, qa_out: &Path, extra_rank: usize| -> Result<Value> {
        let extra = extra_rank.to_string();
        json_step(&[
            "extract",
            "--merged",
            path_str(&merged)?,
            "--base",
            path_str(&base)?,
            "--out",
            path_str(qa_out)?,
            "--rank",
            &rank,
            "--target-base",
            path_str(&out.join(format!("base-{scheme}")))?,
            "--calibration",
            path_str(&calibration)?,
            "--extra-rank",
            &extra,
            "--json",
        ])
    };
    for (scheme, row) in SCHEMES.iter().zip(&mut weight_rows) {
        let report = qa_extract(scheme, &out.join(format!("adapter-qa-{scheme}")), 0)?;
        row[5] = pct(report["target_base"]["totals"]["quantization_aware_relative"].as_f64());
    }
    let qa_extra_rank = out.join(format!("adapter-qa-nvfp4-extra{QA_EXTRA_RANK}"));
    qa_extract("nvfp4", &qa_extra_rank, QA_EXTRA_RANK)?;

    // 5. Answers: the merged reference, then the adapter on each base.
    let records = out.join("questions.jsonl");
    eprintln!(
        "$ (demo) writing {QUESTIONS} questions with gold drawn from the reference's probabilities"
    );
    write_question_set(&merged, &records, args.seed)?;
    let answers = out.join("answers");
    std::fs::create_dir_all(&answers).with_context(|| format!("creating {}", answers.display()))?;
    let reference = answers.join("merged.jsonl");
    step(&[
        "run",
        "--model",
        path_str(&merged)?,
        "--records",
        path_str(&records)?,
        "--out",
        path_str(&reference)?,
    ])?;
    let fp8 = out.join("base-fp8-block128");
    let nvfp4 = out.join("base-nvfp4");
    let int4 = out.join("base-int4-g128");
    let qa_fp8 = out.join("adapter-qa-fp8-block128");
    let qa_nvfp4 = out.join("adapter-qa-nvfp4");
    let qa_int4 = out.join("adapter-qa-int4-g128");
    let qa_extra_label = format!("nvfp4 W4A16 + QA adapter, rank +{QA_EXTRA_RANK}");
    let setup = |label: &str, file, model, adapter, act_quant| Setup {
        label: label.to_string(),
        file,
        model,
        adapter,
        act_quant,
    };
    let setups = [
        setup("bf16 base, no adapter", "base-only", &base, None, None),
        setup(
            "bf16 base + true adapter",
            "true-adapter",
            &base,
            Some(&true_adapter),
            None,
        ),
        setup(
            "bf16 base + extracted adapter",
            "bf16",
            &base,
            Some(&adapter),
            None,
        ),
        setup(
            "fp8-block128 W8A8 + adapter",
            "fp8",
            &fp8,
            Some(&adapter),
            Some("fp8-group"),
        ),
        setup(
            "fp8-block128 W8A8 + QA adapter",
            "fp8-qa",
            &fp8,
            Some(&qa_fp8),
            Some("fp8-group"),
        ),
        setup(
            "nvfp4 W4A16 + adapter",
            "nvfp4",
            &nvfp4,
            Some(&adapter),
            None,
        ),
        setup(
            "nvfp4 W4A16 + QA adapter",
            "nvfp4-qa",
            &nvfp4,
            Some(&qa_nvfp4),
            None,
        ),
        setup(
            &qa_extra_label,
            "nvfp4-qa-extra",
            &nvfp4,
            Some(&qa_extra_rank),
            None,
        ),
        setup(
            "int4-g128 W4A16 + adapter",
            "int4",
            &int4,
            Some(&adapter),
            None,
        ),
        setup(
            "int4-g128 W4A16 + QA adapter",
            "int4-qa",
            &int4,
            Some(&qa_int4),
            None,
        ),
    ];
    let mut answer_rows = Vec::new();
    for Setup {
        label: setup,
        file,
        model,
        adapter: lora,
        act_quant: act,
    } in setups
    {
        let answer_file = answers.join(format!("{file}.jsonl"));
        let mut run_args = vec!["run", "--model", path_str(model)?];
        if let Some(lora) = lora {
            run_args.extend(["--adapter", path_str(lora)?]);
        }
        if let Some(act) = act {
            run_args.extend(["--act-quant", act]);
        }
        run_args.extend([
            "--records",
            path_str(&records)?,
            "--out",
            path_str(&answer_file)?,
        ]);
        step(&run_args)?;
        // compare prints its table for people on stdout and the figures to --json.
        let report_file = answers.join(format!("{file}.compare.json"));
        step(&[
            "compare",
            "--reference",
            path_str(&reference)?,
            "--candidate",
            path_str(&answer_file)?,
            "--json",
            path_str(&report_file)?,
            "--markdown",
            path_str(&answers.join(format!("{file}.md")))?,
            "--plot",
            path_str(&answers.join(format!("{file}.svg")))?,
        ])?;
        let report: Value = serde_json::from_str(
            &std::fs::read_to_string(&report_file)
                .with_context(|| format!("reading {}", report_file.display()))?,
        )
        .with_context(|| format!("parsing {}", report_file.display()))?;
        answer_rows.push(AnswerRow { setup, report });
    }

    // 6. The tables.
    println!();
    println!(
        "Model pair: Qwen3.5 architecture (Gated DeltaNet + gated attention), {} parameters; a rank-{} LoRA on {} modules merged in bf16.",
        synth["base_parameters"], synth["rank"], synth["adapted_modules"]
    );
    let totals = &extraction["totals"];
    println!(
        "Extraction: {} modules; truncation residual up to {} x the bf16 rounding floor (mean {} where rank < width); verify: worst {} x floor.",
        totals["modules"],
        f(&totals["max_ratio"], 4),
        f(&totals["mean_ratio_low_rank"], 4),
        f(&verification["distribution"]["max"], 4),
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
    for r in &weight_rows {
        println!(
            "{:<14} {:>14} {:>16} {:>16} {:>12} {:>19}",
            r[0], r[1], r[2], r[3], r[4], r[5]
        );
    }
    println!();
    println!(
        "Answers on {QUESTIONS} four-option questions (gold drawn from the reference's own probabilities):"
    );
    print_answer_table(&answer_rows);
    println!(
        "QA adapter: `extract --target-base <quantized base> --calibration <E[x^2] of {CALIBRATION_PROMPTS} other prompts>`, rank {rank} as the plain one (\"rank +{QA_EXTRA_RANK}\": rank {}); it factors merged - dequant(base) instead of merged - base.",
        synth["rank"].as_u64().unwrap_or(0) + QA_EXTRA_RANK as u64
    );
    let mean_kl = |setup: &str| {
        answer_rows
            .iter()
            .find(|r| r.setup == setup)
            .and_then(|r| r.report["kl"]["mean"].as_f64())
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
    Ok(())
}
