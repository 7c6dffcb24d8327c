//! `loraq demo`: the main job on the built-in example.
//!
//! Synthesizes the demo model pair (a Qwen3.5-architecture backbone of about 30M
//! parameters with a known LoRA merged into it) and walks through what loraq does
//! with it. Each step is the library call the matching subcommand makes.

use anyhow::{Context, Result, bail};
use loraq_synth::{Preset, SynthOptions, write_synth};
use std::path::{Path, PathBuf};

/// Marker file that identifies a directory as a demo output loraq may replace.
const DEMO_MARKER: &str = ".loraq-demo";

/// Run the main job on the built-in example.
#[derive(clap::Args)]
pub struct Args {
    /// Where the demo writes its models, adapters and reports.
    #[arg(long, default_value = "demo-out")]
    out: PathBuf,
    /// Seed of the synthetic model pair.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn prepare_out(out: &Path) -> Result<()> {
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

/// Runs `loraq demo`.
pub fn run(args: Args) -> Result<()> {
    prepare_out(&args.out)?;
    let pair = args.out.join("pair");
    eprintln!(
        "[1] synthesizing the demo model pair into {}",
        pair.display()
    );
    let bar = crate::progress::bar(0, "synth");
    let summary = write_synth(
        &pair,
        &SynthOptions {
            preset: Preset::Demo,
            seed: args.seed,
            rank: None,
            lora_layers: None,
        },
        false,
        &mut |done, total, name| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(name.to_string());
        },
    )?;
    bar.finish_and_clear();
    println!(
        "demo pair: {} base tensors ({} parameters), {} merged tensors, true adapter of {} modules at rank {}",
        summary.base_tensors,
        summary.base_parameters,
        summary.merged_tensors,
        summary.adapted_modules,
        summary.rank
    );
    println!("  base         {}", pair.join("base").display());
    println!("  merged       {}", pair.join("merged").display());
    println!("  true adapter {}", pair.join("true-adapter").display());
    Ok(())
}
