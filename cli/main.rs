//! `loraq`: extract LoRA adapters from merged fine-tunes and measure them on
//! quantized bases. One module per subcommand; results go to stdout, progress and
//! diagnostics to stderr; errors print as `loraq: <error chain>` with exit status 2.

mod args;
mod check;
mod collect;
mod compare;
mod compare_hidden;
mod demo;
mod export_gguf;
mod extract;
mod inspect;
mod outputs;
mod progress;
mod quant_error;
mod quantize;
mod run;
mod synth;
mod verify;

use clap::{Parser, Subcommand};

/// Extract LoRA adapters from merged fine-tunes and measure what a quantized base
/// does to their answers.
#[derive(Parser)]
#[command(name = "loraq", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the main job on the built-in example (a synthetic Qwen3.5 model pair).
    Demo(demo::Args),
    /// Summarize a checkpoint: architecture, layer types, dtypes, quantization, modules.
    Inspect(inspect::Args),
    /// Write a deterministic synthetic base / merged / true-adapter triple.
    Synth(synth::Args),
    /// Extract the LoRA adapter from a merged fine-tune, certified at the bf16 rounding floor.
    Extract(extract::Args),
    /// Check that base + adapter reproduces the merge, per module, over the floor.
    Verify(verify::Args),
    /// Compare two adapter directories: deltas, factor pairs, ranks, shapes, configs.
    Check(check::Args),
    /// Score records natively (Qwen3.5 / Qwen3 forward pass, adapter applied unmerged).
    Run(run::Args),
    /// Write a quantized copy of a checkpoint (fp8, nvfp4, mxfp4, int4; native or bf16-emulated).
    Quantize(quantize::Args),
    /// Per-module error of a quantization scheme, alone and under an adapter.
    QuantError(quant_error::Args),
    /// Write a PEFT adapter as a llama.cpp LoRA (GGUF): names, value-head order, scales.
    ExportGguf(export_gguf::Args),
    /// Collect answers from a running vLLM or llama.cpp server, resumable.
    Collect(collect::Args),
    /// Compare a candidate's answers with a reference's: flips, KL, accuracy, calibration.
    Compare(compare::Args),
    /// Compare two hidden-state files per tensor: cosine, relative L2, SQNR.
    CompareHidden(compare_hidden::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Synth(args) => synth::run(args),
        Command::Extract(args) => extract::run(args),
        Command::Verify(args) => verify::run(args),
        Command::Check(args) => check::run(args),
        Command::Run(args) => run::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::QuantError(args) => quant_error::run(args),
        Command::ExportGguf(args) => export_gguf::run(args),
        Command::Collect(args) => collect::run(args),
        Command::Compare(args) => compare::run(args),
        Command::CompareHidden(args) => compare_hidden::run(args),
    };
    if let Err(err) = result {
        eprintln!("loraq: {err:#}");
        std::process::exit(2);
    }
}
