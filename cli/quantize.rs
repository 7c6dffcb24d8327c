//! `loraq quantize`: write a quantized copy of a checkpoint, or a quantized GGUF
//! model of it.

use crate::progress;
use anyhow::{Result, bail};
use loraq_quant::ggml::mix::GgufFileType;
use loraq_quant::layout::Layout;
use loraq_quant::quantize_dir::DEFAULT_MAX_SHARD_BYTES;
use loraq_quant::{
    GgufQuantizeRequest, QuantizeProgress, QuantizeRequest, Scheme, quantize_to_dir,
    quantize_to_gguf,
};
use std::path::PathBuf;
use std::str::FromStr;

/// What `--scheme` names: a checkpoint scheme or a llama-quantize file type.
#[derive(Clone, Copy, Debug)]
pub enum QuantizeScheme {
    /// A quantized checkpoint directory.
    Checkpoint(Scheme),
    /// A quantized GGUF model file.
    Gguf(GgufFileType),
}

impl FromStr for QuantizeScheme {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        if name.to_ascii_lowercase().starts_with("gguf-") {
            return GgufFileType::from_scheme(name)
                .map(QuantizeScheme::Gguf)
                .ok_or_else(|| {
                    format!(
                        "unknown GGUF scheme {name:?} (known: {})",
                        GgufFileType::ALL.map(GgufFileType::scheme).join(", ")
                    )
                });
        }
        Scheme::from_str(name)
            .map(QuantizeScheme::Checkpoint)
            .map_err(|_| {
                format!(
                    "unknown quantization scheme {name:?} (known: {}, {})",
                    Scheme::ALL.map(Scheme::name).join(", "),
                    GgufFileType::ALL.map(GgufFileType::scheme).join(", ")
                )
            })
    }
}

/// Quantize a checkpoint, one tensor at a time, into a new directory; or, with a
/// `gguf-*` scheme, into one GGUF file as llama.cpp's convert_hf_to_gguf.py followed by
/// llama-quantize writes it (same metadata, tokenizer, tensor names, per-tensor types
/// and bytes; docs/gguf.md).
#[derive(clap::Args)]
pub struct Args {
    /// Input checkpoint directory (bf16 / f16 / f32 weights; for gguf-* also
    /// tokenizer.json and tokenizer_config.json).
    #[arg(long = "in", visible_alias = "model", value_name = "DIR")]
    input: PathBuf,
    /// Output directory, or the .gguf file for a gguf-* scheme (must not exist
    /// unless --force).
    #[arg(long, value_name = "DIR|FILE")]
    out: PathBuf,
    /// Scheme: fp8-tensor, fp8-channel, fp8-block128, nvfp4, mxfp4, int4-g128-sym,
    /// int4-g128-asym; or a llama-quantize file type: gguf-q8_0, gguf-q6_k,
    /// gguf-q5_k_m, gguf-q4_k_m, gguf-q4_0, gguf-iq4_xs.
    #[arg(long)]
    scheme: QuantizeScheme,
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
    /// Replace the output if it exists.
    #[arg(long)]
    force: bool,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

/// The progress bar of a quantize run (stderr, hidden when not a terminal), driven by
/// the library's events; the checkpoint and the GGUF paths share it.
#[derive(Default)]
struct QuantizeBar(Option<indicatif::ProgressBar>);

impl QuantizeBar {
    fn on(&mut self, event: QuantizeProgress<'_>) {
        match event {
            QuantizeProgress::StaleSiblings(stale) => crate::outputs::report_stale(stale),
            QuantizeProgress::Planned { tensors } => {
                self.0 = Some(progress::bar(tensors as u64, "quantize"));
            }
            QuantizeProgress::Wrote(name) => {
                if let Some(bar) = &self.0 {
                    bar.set_message(name.to_string());
                    bar.inc(1);
                }
            }
        }
    }

    fn finish(self) {
        if let Some(bar) = self.0 {
            bar.finish_and_clear();
        }
    }
}

/// Runs `loraq quantize`.
pub fn run(args: Args) -> Result<()> {
    let scheme = match args.scheme {
        QuantizeScheme::Gguf(file_type) => return run_gguf(&args, file_type),
        QuantizeScheme::Checkpoint(scheme) => scheme,
    };
    let mut bar = QuantizeBar::default();
    let summary = quantize_to_dir(
        &QuantizeRequest {
            input: &args.input,
            out: &args.out,
            scheme,
            layout: args.layout,
            activation_stats: args.calibration.as_deref(),
            skip: &args.skip,
            no_default_skip: args.no_default_skip,
            max_shard_bytes: args.max_shard_bytes,
            force: args.force,
        },
        &mut |event| bar.on(event),
    )?;
    bar.finish();
    if args.json {
        let value = serde_json::json!({
            "out": summary.out.display().to_string(),
            "scheme": scheme.name(),
            "layout": summary.layout.to_string(),
            "tensors": summary.tensors,
            "quantized": summary.quantized,
            "activation_scales": summary.activation_scales,
            "side_files": summary.side_files,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
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
        scheme,
        summary.layout,
        summary.tensors - summary.quantized,
        summary.side_files,
    );
    Ok(())
}

/// `loraq quantize --scheme gguf-*`: one GGUF file.
fn run_gguf(args: &Args, file_type: GgufFileType) -> Result<()> {
    let checkpoint_only = [
        (args.layout.is_some(), "--layout"),
        (args.calibration.is_some(), "--calibration"),
        (!args.skip.is_empty(), "--skip"),
        (args.no_default_skip, "--no-default-skip"),
        (
            args.max_shard_bytes != DEFAULT_MAX_SHARD_BYTES,
            "--max-shard-bytes",
        ),
    ];
    if let Some((_, flag)) = checkpoint_only.iter().find(|(given, _)| *given) {
        bail!(
            "{flag} does not apply to {}: llama-quantize's type mix decides every tensor's type",
            file_type.scheme()
        );
    }
    let mut bar = QuantizeBar::default();
    let summary = quantize_to_gguf(
        &GgufQuantizeRequest {
            input: &args.input,
            out: &args.out,
            file_type,
            force: args.force,
        },
        &mut |event| bar.on(event),
    )?;
    bar.finish();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
        return Ok(());
    }
    let types: Vec<String> = summary
        .types
        .iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect();
    println!(
        "wrote {}: llama.cpp {} {}, {} tensors ({}), {} of them quantized, {} parameters",
        summary.out.display(),
        summary.architecture,
        summary.file_type,
        summary.tensors,
        types.join(", "),
        summary.quantized,
        summary.parameters,
    );
    Ok(())
}
