//! Extract a LoRA adapter from a merged fine-tune and its base with `loraq-extract`.
//!
//! ```sh
//! cargo run --release --example extract_adapter                  # a synthetic tiny pair
//! cargo run --release --example extract_adapter -- MERGED BASE OUT [RANK]
//! ```
//!
//! Without arguments it writes a tiny Qwen3.5-architecture base / merged pair (a rank-8
//! LoRA merged in bf16, `loraq-synth`) to a temporary directory and extracts from it. It
//! prints, per module, the truncation residual over the bf16 rounding floor of the
//! merge: near 1 means the adapter reproduces the merge as well as bf16 allows.

use std::path::PathBuf;

use anyhow::{Context, bail};
use loraq_extract::extract::{ExtractOptions, RankChoice, extract};
use loraq_synth::{Preset, SynthOptions, write_synth};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // Kept alive to the end: the synthetic pair and its adapter live in it.
    let scratch = tempfile::tempdir()?;
    let (merged, base, out, rank) = match args.as_slice() {
        [] => {
            let pair = scratch.path().join("pair");
            let options = SynthOptions {
                preset: Preset::Tiny,
                seed: 1,
                rank: None,
                lora_layers: None,
            };
            let summary = write_synth(&pair, &options, false, &mut |_, _, _| {})?;
            println!(
                "synthesized a {} pair: {} adapted modules, true rank {}",
                summary.preset, summary.adapted_modules, summary.rank
            );
            let out = scratch.path().join("adapter");
            (pair.join("merged"), pair.join("base"), out, summary.rank)
        }
        [merged, base, out] => (merged.into(), base.into(), PathBuf::from(out), 256),
        [merged, base, out, rank] => (
            merged.into(),
            base.into(),
            PathBuf::from(out),
            rank.parse().context("RANK is a number")?,
        ),
        _ => bail!("usage: extract_adapter [MERGED BASE OUT [RANK]]"),
    };

    // The command line's defaults (balanced split, randomized factorization with its
    // certificate, refusal above 1.10 x floor), with the rank asked for.
    let mut options = ExtractOptions::new(&merged, &base, &out);
    options.rank = RankChoice::Fixed(rank);
    let report = extract(&options, &mut |_| {})?;

    println!(
        "{:<56} {:>5} {:>14} {:>16}",
        "module", "rank", "residual/floor", "after bf16 cast"
    );
    for m in &report.modules {
        println!(
            "{:<56} {:>5} {:>14.4} {:>16.4}",
            m.module, m.rank, m.ratio, m.ratio_after_cast
        );
    }
    println!(
        "PEFT adapter (r = {}, {} modules) written to {}",
        report.r,
        report.modules.len(),
        out.display()
    );
    Ok(())
}
