//! `loraq run`: the native forward pass over a records file, writing answers
//! (option logits at the last prompt position) and optionally per-layer hidden states.

use crate::progress;
use anyhow::{Context, Result, anyhow, bail};
use loraq_eval::answers::check_question;
use loraq_io::StagedOutputs;
use loraq_io::limits::elide;
use loraq_model::{
    LinearBackend, LoadOptions, Model, ScoreOptions, read_records, score_records_with_hidden,
    write_answers, write_hidden,
};
use loraq_quant::ActivationQuantKind;
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
    /// input_scale / input_global_scale; `loraq quantize --calibration` writes them),
    /// ggml (the ggml-typed linears of a GGUF base only, as llama.cpp's CPU backend
    /// quantizes their activations: Q8_K for the K types and IQ4_XS, Q8_0 otherwise).
    #[arg(long, default_value = "none", value_parser = ["none", "fp8", "fp8-token", "fp8-group", "nvfp4", "ggml"])]
    act_quant: String,
    /// Linear implementation: auto (the default: loraq-kernels' fused quantized-base +
    /// LoRA CPU linear for every linear whose stored format and adapter it runs, bf16 /
    /// fp8-block128 / NVFP4 with bf16 factors, dense for the others; the summary says
    /// how many went where), kernels (the CPU linear for every linear, refusing any it
    /// cannot run), reference (loraq-kernels' f64 reference; slow, for checks), or
    /// dense (weights decoded to f32 once, candle matmul; more memory).
    #[arg(long, default_value = "auto", value_parser = ["auto", "dense", "kernels", "reference"])]
    backend: String,
    /// Where the linears run: cpu, or cuda (loraq-kernels' CUDA kernels for every
    /// linear, the rest of each layer on the CPU; needs a build with the `cuda` feature,
    /// a GPU, and NVRTC or LORAQ_CUBIN_DIR; formats the GPU kernels do not run are
    /// refused). With cuda, --backend must be auto.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Records (JSON Lines: id, group?, tokens, options, option_tokens, gold?).
    #[arg(long)]
    records: PathBuf,
    /// Answers output (JSON Lines). It and the other outputs are written to temporary
    /// siblings and renamed into place together once all are written: all or none.
    #[arg(long)]
    out: PathBuf,
    /// Last-position hidden states of every layer (safetensors), for compare-hidden.
    #[arg(long)]
    hidden_out: Option<PathBuf>,
    /// Calibration statistics output (safetensors): for every linear the model runs, the mean over
    /// all prompt tokens of each input feature's square, `<module>.input_sq_mean`
    /// F32 `[in_features]`, and the largest absolute input, `<module>.input_abs_max`
    /// F32 `[]` (docs/formats.md): the input of `loraq extract --calibration` and of
    /// `loraq quantize --scheme nvfp4 --calibration`. Use records other than the
    /// evaluation questions.
    #[arg(long, value_name = "FILE")]
    collect_stats: Option<PathBuf>,
    /// Replace existing output files (never one of the inputs).
    #[arg(long)]
    force: bool,
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
    let act_quant: ActivationQuantKind = args
        .act_quant
        .parse()
        .with_context(|| format!("--act-quant {:?}", args.act_quant))?;
    let backend = match (args.device.as_str(), args.backend.as_str()) {
        ("cuda", "auto") => LinearBackend::Cuda,
        ("cuda", other) => bail!(
            "--device cuda runs every linear on the GPU; --backend {other} is a CPU implementation (leave --backend at auto)"
        ),
        (_, name) => LinearBackend::parse(name).with_context(|| format!("--backend {name:?}"))?,
    };
    let request = RunRequest {
        model: &args.model,
        adapter: args.adapter.as_deref(),
        act_quant,
        backend,
        records: &args.records,
        out: &args.out,
        hidden_out: args.hidden_out.as_deref(),
        collect_stats: args.collect_stats.as_deref(),
        force: args.force,
    };
    score_to_files(&request)?;
    println!("{}", args.out.display());
    Ok(())
}

/// One run of the model over a records file: what `loraq run` does, and what the
/// demo asks for without going through the command line.
pub struct RunRequest<'a> {
    /// Model directory.
    pub model: &'a Path,
    /// PEFT adapter directory, applied unmerged.
    pub adapter: Option<&'a Path>,
    /// Activation fake-quant of the base path.
    pub act_quant: ActivationQuantKind,
    /// Linear implementation.
    pub backend: LinearBackend,
    /// Records file.
    pub records: &'a Path,
    /// Answers output.
    pub out: &'a Path,
    /// Hidden-states output.
    pub hidden_out: Option<&'a Path>,
    /// Calibration statistics output.
    pub collect_stats: Option<&'a Path>,
    /// Replace existing outputs.
    pub force: bool,
}

/// What a run did.
pub struct RunSummary {
    /// Records scored.
    pub records: usize,
    /// Prompt tokens run.
    pub tokens: usize,
}

/// Scores every record of `request.records` and writes the answers (and the hidden
/// states and input statistics asked for), all outputs staged and committed together;
/// progress and the summary go to stderr.
pub fn score_to_files(request: &RunRequest<'_>) -> Result<RunSummary> {
    // Every output is checked and staged before the forward passes, so one that could
    // never be written fails now; they are committed together at the end.
    let mut inputs = vec![request.model, request.records];
    inputs.extend(request.adapter);
    let mut outputs = StagedOutputs::new(&inputs, request.force);
    let answers_temp = outputs
        .stage_file(request.out)
        .with_context(|| format!("--out {}", request.out.display()))?;
    let hidden_temp = match request.hidden_out {
        Some(path) => Some(
            outputs
                .stage_file(path)
                .with_context(|| format!("--hidden-out {}", path.display()))?,
        ),
        None => None,
    };
    let stats_temp = match request.collect_stats {
        Some(path) => Some(
            outputs
                .stage_file(path)
                .with_context(|| format!("--collect-stats {}", path.display()))?,
        ),
        None => None,
    };
    crate::outputs::report_stale(outputs.stale_siblings());
    let mut records = read_records(request.records)?;
    check_questions(request.records, &records)?;
    loraq_model::tokenize_records(request.model, &mut records, request.records)?;
    let started = Instant::now();
    let model = Model::load(
        request.model,
        request.adapter,
        &LoadOptions {
            act_quant: request.act_quant,
            backend: request.backend,
            collect_input_stats: request.collect_stats.is_some(),
            ..LoadOptions::default()
        },
    )
    .with_context(|| format!("loading {}", request.model.display()))?;
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
            source: request.records.to_path_buf(),
            on_record: Some(&tick),
        },
        request.hidden_out.is_some(),
    )?;
    bar.finish_and_clear();
    let seconds = scoring.elapsed().as_secs_f64();
    write_answers(&answers_temp, &answers)?;
    if let (Some(temp), Some(hidden)) = (&hidden_temp, hidden) {
        write_hidden(temp, &hidden)?;
    }
    let stats = match (request.collect_stats, &stats_temp) {
        (Some(path), Some(temp)) => {
            let stats = model
                .input_stats()
                .context("the model was loaded without input statistics")?;
            loraq_io::write_activation_stats(temp, &stats)
                .with_context(|| format!("writing --collect-stats {}", path.display()))?;
            Some((path, stats))
        }
        _ => None,
    };
    outputs.commit()?;
    if let Some((path, stats)) = stats {
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
    let linears: Vec<String> = model
        .linears_by_backend()
        .iter()
        .map(|(backend, count)| format!("{count} {backend}"))
        .collect();
    eprintln!(
        "loraq run: {} records ({tokens} prompt tokens) in {seconds:.2} s ({:.1} records/s, {:.0} tokens/s); model loaded in {load_seconds:.2} s, {} adapted modules, linears: {}",
        answers.len(),
        answers.len() as f64 / seconds.max(1e-9),
        tokens as f64 / seconds.max(1e-9),
        model.adapted_modules(),
        linears.join(", ")
    );
    Ok(RunSummary {
        records: answers.len(),
        tokens,
    })
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
