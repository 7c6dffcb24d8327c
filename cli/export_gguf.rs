//! `loraq export-gguf`: a PEFT adapter as a llama.cpp LoRA adapter (GGUF).

use anyhow::{Context, Result};
use loraq_gguf::{BaseLayout, FactorType, export_adapter};
use loraq_io::{LoraAdapter, StagedOutputs};
use std::path::PathBuf;

/// Write a PEFT LoRA adapter as a llama.cpp LoRA (GGUF): tensor names mapped as
/// llama.cpp's converter maps them, the qwen35 value heads reordered as its converter
/// reorders the base, and the PEFT scales (rank_pattern, alpha_pattern, rsLoRA)
/// carried exactly: one adapter.lora.alpha when scale x rank is the same for every
/// module (factors unchanged), else alpha 0 with each module's scale folded into
/// its lora_b. Refuses, by module, what llama.cpp cannot apply (a module it has no
/// tensor for, DoRA, bias LoRA, modules_to_save). Load it with
/// `llama-server -m BASE.gguf --lora ADAPTER.gguf`.
#[derive(clap::Args)]
pub struct Args {
    /// The PEFT adapter directory (adapter_config.json, adapter_model.safetensors).
    #[arg(long, value_name = "DIR")]
    adapter: PathBuf,
    /// The base it applies to: the checkpoint directory or a GGUF base (.gguf, or the
    /// first file of a split model). It gives the architecture, the value-head layout
    /// and the weight shapes the factors are checked against.
    #[arg(long, value_name = "BASE")]
    base: PathBuf,
    /// The GGUF file to write (refused if it exists, unless --force).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// Element type of the factors: bf16 (PEFT's own; unchanged when no scale is
    /// folded), f16 or f32.
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    dtype: FactorType,
    /// Replace the output if it exists.
    #[arg(long)]
    force: bool,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

fn parse_dtype(text: &str) -> Result<FactorType, String> {
    FactorType::parse(text).ok_or_else(|| format!("{text:?}: the factor type is bf16, f16 or f32"))
}

/// Runs `loraq export-gguf`.
pub fn run(args: Args) -> Result<()> {
    let mut outputs =
        StagedOutputs::new(&[args.adapter.as_path(), args.base.as_path()], args.force);
    let temp = outputs
        .stage_file(&args.out)
        .with_context(|| format!("--out {}", args.out.display()))?;
    crate::outputs::report_stale(outputs.stale_siblings());
    let base =
        BaseLayout::open(&args.base).with_context(|| format!("--base {}", args.base.display()))?;
    let adapter = LoraAdapter::open(&args.adapter)?;
    let (writer, summary) = export_adapter(&adapter, &base, args.dtype)?;
    writer
        .write(&temp)
        .with_context(|| format!("writing {}", args.out.display()))?;
    outputs.commit()?;
    if args.json {
        let mut value = serde_json::to_value(&summary)?;
        value["out"] = serde_json::json!(args.out.display().to_string());
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        let scales = if summary.scales_folded {
            "alpha 0, each module's scale folded into its lora_b".to_string()
        } else {
            format!("alpha {} (factors as PEFT wrote them)", summary.alpha)
        };
        let reordered = summary
            .modules
            .iter()
            .filter(|m| m.v_heads_reordered)
            .count();
        println!(
            "wrote {}: {} modules for llama.cpp's {}, {:?} factors, {scales}; value heads reordered in {reordered}",
            args.out.display(),
            summary.modules.len(),
            summary.architecture,
            summary.dtype,
        );
    }
    Ok(())
}
