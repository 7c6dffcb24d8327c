//! `loraq synth`: deterministic synthetic base / merged / true-adapter triples.

use anyhow::{Context, Result, bail};
use loraq_synth::{Preset, SynthOptions, write_synth};
use std::path::PathBuf;

/// Write DIR/base, DIR/merged and DIR/true-adapter (PEFT) with the real Qwen3.5
/// tensor names; merged = bf16(base + B A), computed in f32 and rounded once.
#[derive(clap::Args)]
pub struct Args {
    /// Model size: tiny (tests), demo (the demo), 9b-slice / 27b-slice (the exact
    /// layer shapes of Qwen3.5-9B / Qwen3.8-27B, one layer of each type).
    #[arg(long, value_parser = ["tiny", "demo", "9b-slice", "27b-slice"])]
    preset: String,
    /// Output directory (must not exist unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Seed of every random draw.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// LoRA rank (default: 8 tiny, 32 demo, 256 slices).
    #[arg(long)]
    rank: Option<usize>,
    /// Adapted layers, e.g. 2-3 (default: all).
    #[arg(long, value_name = "A-B")]
    lora_layers: Option<String>,
    /// Replace an existing output directory.
    #[arg(long)]
    force: bool,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

fn parse_layers(text: &str) -> Result<std::ops::RangeInclusive<usize>> {
    let (a, b) = text.split_once('-').unwrap_or((text, text));
    let a: usize = a
        .trim()
        .parse()
        .with_context(|| format!("--lora-layers {text:?}"))?;
    let b: usize = b
        .trim()
        .parse()
        .with_context(|| format!("--lora-layers {text:?}"))?;
    if a > b {
        bail!("--lora-layers {text:?}: start after end");
    }
    Ok(a..=b)
}

/// Runs `loraq synth`.
pub fn run(args: Args) -> Result<()> {
    let preset = Preset::parse(&args.preset).expect("clap checked the preset");
    let options = SynthOptions {
        preset,
        seed: args.seed,
        rank: args.rank,
        lora_layers: args.lora_layers.as_deref().map(parse_layers).transpose()?,
    };
    crate::outputs::sweep_and_report(&args.out);
    let started = std::time::Instant::now();
    let bar = crate::progress::bar(0, "synth");
    let summary = write_synth(&args.out, &options, args.force, &mut |done, total, name| {
        crate::progress::track(&bar, done, total, name)
    })?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!(
            "wrote {} ({} preset, seed {}) in {:.1} s",
            summary.out.display(),
            summary.preset,
            summary.seed,
            started.elapsed().as_secs_f64()
        );
        println!(
            "  base          {} tensors, {} parameters ({} of which base-only)",
            summary.base_tensors,
            summary.base_parameters,
            summary.base_tensors - summary.merged_tensors
        );
        println!("  merged        {} tensors", summary.merged_tensors);
        println!(
            "  true-adapter  {} modules, rank {} (in_proj_a/in_proj_b at full width)",
            summary.adapted_modules, summary.rank
        );
    }
    Ok(())
}
