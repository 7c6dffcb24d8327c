//! `loraq quantize`: write a quantized copy of a checkpoint.

use crate::progress;
use anyhow::{Context, Result, bail};
use loraq_io::{AtomicDir, Checkpoint};
use loraq_quant::Scheme;
use loraq_quant::layout::{
    DEFAULT_SKIP, InputCalibration, Layout, QuantizeOptions, compile_skip,
    plan_quantization_calibrated, write_quantized,
};
use std::path::{Path, PathBuf};

/// The largest shard `loraq quantize` writes unless told otherwise, in bytes.
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5_000_000_000;

/// Quantize a checkpoint, one tensor at a time, into a new directory.
#[derive(clap::Args)]
pub struct Args {
    /// Input checkpoint directory (bf16 / f16 / f32 weights).
    #[arg(long = "in", value_name = "DIR")]
    input: PathBuf,
    /// Output directory (must not exist unless --force).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Scheme: fp8-tensor, fp8-channel, fp8-block128, nvfp4, mxfp4, int4-g128-sym,
    /// int4-g128-asym.
    #[arg(long)]
    scheme: Scheme,
    /// Layout: fp8-block128, fp8-tensor, fp8-channel-ct (compressed-tensors),
    /// nvfp4-modelopt, nvfp4-ct (compressed-tensors, llm-compressor's NVFP4) or
    /// bf16-emulated; default the scheme's own (bf16-emulated for mxfp4 and int4).
    #[arg(long)]
    layout: Option<Layout>,
    /// Calibration statistics from `loraq run --collect-stats` on this model (NVFP4
    /// layouts only): every quantized module gets a static activation scale from
    /// its input absolute maximum (ModelOpt `input_scale = amax / 2688`,
    /// compressed-tensors `input_global_scale = 2688 / amax`) and the config says
    /// W4A4. Without it NVFP4 is written weight-only (W4A16).
    #[arg(long, value_name = "FILE")]
    calibration: Option<PathBuf>,
    /// Keep tensors whose names match this regex unquantized (repeatable; added to
    /// the default list of embeddings, lm_head, norms, linear-attention
    /// conv1d / A_log / dt_bias / in_proj_a / in_proj_b, MoE routers and the
    /// multi-token-prediction head mtp.*).
    #[arg(long, value_name = "REGEX")]
    skip: Vec<String>,
    /// Do not use the default skip list, only the --skip patterns.
    #[arg(long)]
    no_default_skip: bool,
    /// Largest shard of the output, in bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_SHARD_BYTES)]
    max_shard_bytes: usize,
    /// Replace the output directory if it exists.
    #[arg(long)]
    force: bool,
}

/// Files of the input directory copied as they are (tokenizer, generation config,
/// chat template, ...): everything but the weights, their index and the configs
/// the output rewrites.
fn copy_side_files(input: &Path, out: &Path) -> Result<usize> {
    if !input.is_dir() {
        return Ok(0);
    }
    let mut copied = 0;
    for entry in std::fs::read_dir(input).with_context(|| format!("reading {}", input.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let rewritten = name.ends_with(".safetensors")
            || name == loraq_io::INDEX_FILE
            || name == loraq_io::CONFIG_FILE
            || name == "hf_quant_config.json"
            || name == "SHA256SUMS";
        if entry.file_type()?.is_file() && !rewritten {
            std::fs::copy(entry.path(), out.join(&*name))
                .with_context(|| format!("copying {}", entry.path().display()))?;
            copied += 1;
        }
    }
    Ok(copied)
}

/// Runs `loraq quantize`.
pub fn run(args: Args) -> Result<()> {
    let summary = quantize_to_dir(&QuantizeRequest {
        input: &args.input,
        out: &args.out,
        scheme: args.scheme,
        layout: args.layout,
        calibration: args.calibration.as_deref(),
        skip: &args.skip,
        no_default_skip: args.no_default_skip,
        max_shard_bytes: args.max_shard_bytes,
        force: args.force,
    })?;
    let activations = if !summary.layout.is_nvfp4() {
        ""
    } else if !summary.activation_scales {
        " (weight-only, W4A16)"
    } else {
        " (W4A4, static activation scales)"
    };
    println!(
        "wrote {}: {} of {} tensors quantized with {} in the {} layout{activations}, {} kept as they were, {} side files copied",
        summary.out.display(),
        summary.quantized,
        summary.tensors,
        args.scheme,
        summary.layout,
        summary.tensors - summary.quantized,
        summary.side_files,
    );
    Ok(())
}

/// A quantized copy of a checkpoint to write: what `loraq quantize` does, and what
/// the demo asks for without going through the command line.
pub struct QuantizeRequest<'a> {
    /// Input checkpoint.
    pub input: &'a Path,
    /// Output directory.
    pub out: &'a Path,
    /// Scheme.
    pub scheme: Scheme,
    /// Layout (`None`: the scheme's own).
    pub layout: Option<Layout>,
    /// Calibration statistics (NVFP4 static activation scales).
    pub calibration: Option<&'a Path>,
    /// Extra skip regexes.
    pub skip: &'a [String],
    /// Only the `skip` patterns, not the default list.
    pub no_default_skip: bool,
    /// Largest shard, in bytes.
    pub max_shard_bytes: usize,
    /// Replace the output directory.
    pub force: bool,
}

/// What was written.
pub struct QuantizeSummary {
    /// The output directory, committed.
    pub out: PathBuf,
    /// The layout written.
    pub layout: Layout,
    /// Tensors in the checkpoint.
    pub tensors: usize,
    /// Tensors quantized.
    pub quantized: usize,
    /// Whether NVFP4 static activation scales were written.
    pub activation_scales: bool,
    /// Side files copied.
    pub side_files: usize,
}

/// Quantizes `request.input` into `request.out`, written to a temporary sibling and
/// renamed into place only when complete.
pub fn quantize_to_dir(request: &QuantizeRequest<'_>) -> Result<QuantizeSummary> {
    let layout = request
        .layout
        .unwrap_or(Layout::default_for(request.scheme));
    let mut patterns: Vec<String> = if request.no_default_skip {
        Vec::new()
    } else {
        DEFAULT_SKIP.iter().map(|s| s.to_string()).collect()
    };
    patterns.extend(request.skip.iter().cloned());
    let options = QuantizeOptions {
        scheme: request.scheme,
        layout,
        skip: compile_skip(&patterns)?,
        max_shard_bytes: request.max_shard_bytes,
    };
    // Refuse an output over an input (or an existing one without --force) before
    // opening anything.
    let mut inputs = vec![request.input];
    inputs.extend(request.calibration);
    let out = AtomicDir::create(request.out, request.force, &inputs)?;
    crate::outputs::report_stale(out.stale_siblings());
    let calibration = match request.calibration {
        Some(path) => {
            let stats = loraq_io::read_calibration(path)
                .with_context(|| format!("--calibration {}", path.display()))?;
            Some(InputCalibration {
                source: path.to_path_buf(),
                abs_max: stats.input_abs_max,
            })
        }
        None => None,
    };
    let input = Checkpoint::open(request.input)
        .with_context(|| format!("cannot open checkpoint {}", request.input.display()))?;
    let plan = plan_quantization_calibrated(&input, &options, calibration.as_ref())?;
    if plan.quantized_count() == 0 {
        bail!(
            "{}: no tensor to quantize (every 2-D float .weight is skipped)",
            request.input.display()
        );
    }
    let bar = progress::bar(plan.actions.len() as u64, "quantize");
    write_quantized(&input, &plan, &options, out.path(), &mut |name| {
        bar.set_message(name.to_string());
        bar.inc(1);
    })
    // The scheme's errors name the tensor; this names the checkpoint holding it.
    .with_context(|| format!("quantizing {}", request.input.display()))?;
    bar.finish_and_clear();
    let side_files = copy_side_files(request.input, out.path())?;
    let out = out.commit()?;
    Ok(QuantizeSummary {
        out,
        layout,
        tensors: plan.actions.len(),
        quantized: plan.quantized_count(),
        activation_scales: !plan.input_abs_max.is_empty(),
        side_files,
    })
}
