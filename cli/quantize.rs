//! `loraq quantize`: write a quantized copy of a checkpoint.

use crate::progress;
use anyhow::Result;
use loraq_quant::layout::Layout;
use loraq_quant::quantize_dir::DEFAULT_MAX_SHARD_BYTES;
use loraq_quant::{QuantizeProgress, QuantizeRequest, Scheme, quantize_to_dir};
use std::path::PathBuf;

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

/// Runs `loraq quantize`.
pub fn run(args: Args) -> Result<()> {
    let mut bar = None;
    let summary = quantize_to_dir(
        &QuantizeRequest {
            input: &args.input,
            out: &args.out,
            scheme: args.scheme,
            layout: args.layout,
            activation_stats: args.calibration.as_deref(),
            skip: &args.skip,
            no_default_skip: args.no_default_skip,
            max_shard_bytes: args.max_shard_bytes,
            force: args.force,
        },
        &mut |event| match event {
            QuantizeProgress::StaleSiblings(stale) => crate::outputs::report_stale(stale),
            QuantizeProgress::Planned { tensors } => {
                bar = Some(progress::bar(tensors as u64, "quantize"));
            }
            QuantizeProgress::Wrote(name) => {
                if let Some(bar) = &bar {
                    bar.set_message(name.to_string());
                    bar.inc(1);
                }
            }
        },
    )?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
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
