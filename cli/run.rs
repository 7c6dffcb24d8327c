//! `loraq run`: the native forward pass over a records file, writing answers
//! (option logits at the last prompt position) and optionally per-layer hidden states.

use crate::progress;
use anyhow::{Context, Result, anyhow, bail};
use loraq_eval::answers::check_question;
use loraq_io::limits::elide;
use loraq_model::{
    ActQuantScheme, LinearBackend, LoadOptions, Model, ScoreOptions, read_records,
    score_records_with_hidden, write_answers, write_hidden,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Score option tokens of every record with a Qwen3.5 / Qwen3 model on the CPU, with
/// an adapter applied unmerged at run time.
#[derive(clap::Args)]
pub struct Args {
    /// Model directory (config.json + safetensors; bf16/f32, fp8 or NVFP4 layouts).
    #[arg(long)]
    model: PathBuf,
    /// PEFT LoRA adapter directory, applied unmerged with its per-module scales.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Activation fake-quant of every linear's base path (the adapter sees the
    /// unquantized activation): none, fp8 (per token), fp8-group (1x128), nvfp4
    /// (the NVFP4 linears only, as vLLM's W4A4 applies it with each module's static
    /// input_scale / input_global_scale; `loraq quantize --calibration` writes them).
    #[arg(long, default_value = "none", value_parser = ["none", "fp8", "fp8-token", "fp8-group", "nvfp4"])]
    act_quant: String,
    /// Linear implementation: kernels (loraq-kernels' fused quantized-base + LoRA CPU
    /// linear on the stored bf16 / fp8-block128 / NVFP4 weights, the default) or dense
    /// (weights decoded to f32 once, candle matmul; faster on this CPU, more memory).
    #[arg(long, default_value = "kernels", value_parser = ["dense", "kernels"])]
    backend: String,
    /// Records (JSON Lines: id, group?, tokens, options, option_tokens, gold?).
    #[arg(long)]
    records: PathBuf,
    /// Answers output (JSON Lines), written atomically.
    #[arg(long)]
    out: PathBuf,
    /// Last-position hidden states of every layer (safetensors), for compare-hidden.
    #[arg(long)]
    hidden_out: Option<PathBuf>,
    /// Calibration statistics output (safetensors, written atomically; an existing
    /// file is replaced, as --out is): for every linear the model runs, the mean over
    /// all prompt tokens of each input feature's square, `<module>.input_sq_mean`
    /// F32 `[in_features]`, and the largest absolute input, `<module>.input_abs_max`
    /// F32 `[]` (docs/formats.md): the input of `loraq extract --calibration` and of
    /// `loraq quantize --scheme nvfp4 --calibration`. Use records other than the
    /// evaluation questions.
    #[arg(long, value_name = "FILE")]
    collect_stats: Option<PathBuf>,
    /// Worker threads (default: the physical cores; at most 4 per logical core,
    /// 1024 in all).
    #[arg(long, value_parser = crate::args::threads)]
    threads: Option<usize>,
}

/// Runs `loraq run`.
pub fn run(args: Args) -> Result<()> {
    if let Some(n) = args.threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        // candle's matmul and rayon's global pool (built lazily, on first use) both
        // read RAYON_NUM_THREADS.
        // SAFETY: set before this process starts any thread.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
    }
    let act_quant = ActQuantScheme::parse(&args.act_quant)
        .with_context(|| format!("--act-quant {:?}", args.act_quant))?;
    if let Some(path) = &args.collect_stats {
        // Fail before the forward passes, not after them, when the statistics could
        // never be written.
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
        if let Some(dir) = parent.filter(|d| !d.is_dir()) {
            bail!(
                "--collect-stats {}: directory {} does not exist",
                path.display(),
                dir.display()
            );
        }
    }
    let mut records = read_records(&args.records)?;
    check_questions(&args.records, &records)?;
    loraq_model::tokenize_records(&args.model, &mut records, &args.records)?;
    let started = Instant::now();
    let model = Model::load(
        &args.model,
        args.adapter.as_deref(),
        &LoadOptions {
            act_quant,
            backend: LinearBackend::parse(&args.backend)
                .with_context(|| format!("--backend {:?}", args.backend))?,
            collect_input_stats: args.collect_stats.is_some(),
            ..LoadOptions::default()
        },
    )
    .with_context(|| format!("loading {}", args.model.display()))?;
    let load_seconds = started.elapsed().as_secs_f64();
    let bar = progress::bar(records.len() as u64, "run");
    let tick = |done: usize| {
        bar.set_position(done as u64);
        let secs = bar.elapsed().as_secs_f64();
        if secs > 0.0 {
            bar.set_message(format!("{:.1} records/s", done as f64 / secs));
        }
    };
    let scoring = Instant::now();
    let (answers, hidden) = score_records_with_hidden_opt(
        &model,
        &records,
        &ScoreOptions {
            source: args.records.clone(),
            on_record: Some(&tick),
        },
        args.hidden_out.is_some(),
    )?;
    bar.finish_and_clear();
    let seconds = scoring.elapsed().as_secs_f64();
    write_answers(&args.out, &answers)?;
    if let (Some(path), Some(hidden)) = (&args.hidden_out, hidden) {
        write_hidden(path, &hidden)?;
    }
    if let Some(path) = &args.collect_stats {
        let stats = model
            .input_stats()
            .context("the model was loaded without input statistics")?;
        loraq_io::write_calibration(path, &stats)
            .with_context(|| format!("writing --collect-stats {}", path.display()))?;
        eprintln!(
            "loraq run: input statistics of {} linears over {} tokens written to {}",
            stats.input_sq_mean.len(),
            stats.tokens,
            path.display()
        );
    }
    let tokens: usize = records
        .iter()
        .map(|r| r.tokens.as_ref().map_or(0, Vec::len))
        .sum();
    eprintln!(
        "loraq run: {} records ({tokens} prompt tokens) in {seconds:.2} s ({:.1} records/s, {:.0} tokens/s); model loaded in {load_seconds:.2} s, {} adapted modules",
        answers.len(),
        answers.len() as f64 / seconds.max(1e-9),
        tokens as f64 / seconds.max(1e-9),
        model.adapted_modules()
    );
    println!("{}", args.out.display());
    Ok(())
}

fn score_records_with_hidden_opt(
    model: &Model,
    records: &[loraq_model::Record],
    options: &ScoreOptions<'_>,
    hidden: bool,
) -> Result<(
    Vec<loraq_model::OptionAnswer>,
    Option<loraq_model::HiddenStates>,
)> {
    if hidden {
        let (answers, states) = score_records_with_hidden(model, records, options)?;
        Ok((answers, Some(states)))
    } else {
        Ok((loraq_model::score_records(model, records, options)?, None))
    }
}

/// Refuses what `loraq compare` would refuse in the answers later (an id twice, a
/// single option, an option twice, a gold that is not an option), with the rules
/// compare applies, before any forward pass.
fn check_questions(path: &Path, records: &[loraq_model::Record]) -> Result<()> {
    let mut first_line: HashMap<&str, u64> = HashMap::with_capacity(records.len());
    for record in records {
        let shown_id = elide(&format!("{:?}", record.id));
        check_question(&record.id, &record.options, record.gold.as_deref()).map_err(|reason| {
            anyhow!(
                "{}:{}: record {shown_id}: {reason} (loraq compare would refuse its answer)",
                path.display(),
                record.line
            )
        })?;
        if let Some(first) = first_line.insert(&record.id, record.line) {
            bail!(
                "{}:{}: duplicate id {shown_id} (first at line {first}): answers are paired by id",
                path.display(),
                record.line
            );
        }
    }
    Ok(())
}
