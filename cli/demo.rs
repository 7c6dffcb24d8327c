//! `loraq demo`: the main job on the built-in example.
//!
//! Each step runs the very subcommand a user would type (this binary, as a child
//! process, with `--json` where the step reports figures), so the demo shows and
//! checks the real workflow: synthesize a Qwen3.5-architecture model pair with a known
//! LoRA merged into it, extract the adapter back from the merge, verify it against
//! the merge and compare it with the true adapter, quantize the base to each scheme a
//! deployment would use, and measure what each quantized base does to the weights the
//! adapter reproduces. The steps' outputs stay under `--out` for a closer look.

use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Marker file that identifies a directory as a demo output loraq may replace.
const DEMO_MARKER: &str = ".loraq-demo";

/// Quantized bases the demo measures: what datacenter (FP8 blocks) and consumer
/// (NVFP4, 4-bit integer) deployments run.
const SCHEMES: [&str; 3] = ["fp8-block128", "nvfp4", "int4-g128"];

/// Run the main job on the built-in example.
#[derive(clap::Args)]
pub struct Args {
    /// Where the demo writes its models, adapters and reports (replaced when it
    /// holds an earlier demo's output).
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

/// Runs `loraq <args>` as a child process with stderr (progress) passed through and
/// returns its stdout; a failing step fails the demo with the step's command line.
fn step(args: &[&str]) -> Result<String> {
    let exe = std::env::current_exe().context("locating the loraq binary")?;
    eprintln!("$ loraq {}", args.join(" "));
    let output = Command::new(&exe)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running loraq {}", args.join(" ")))?;
    if !output.status.success() {
        bail!("step `loraq {}` failed ({})", args.join(" "), output.status);
    }
    String::from_utf8(output.stdout).context("step output is not UTF-8")
}

/// Runs a step that prints JSON on stdout and parses it.
fn json_step(args: &[&str]) -> Result<Value> {
    let text = step(args)?;
    serde_json::from_str(&text)
        .with_context(|| format!("parsing the JSON of loraq {}", args.join(" ")))
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str()
        .with_context(|| format!("{} is not valid UTF-8", p.display()))
}

fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_string(), |v| format!("{:.3}%", 100.0 * v))
}

/// Runs `loraq demo`.
pub fn run(args: Args) -> Result<()> {
    prepare_out(&args.out)?;
    let pair = args.out.join("pair");
    let (base, merged, true_adapter) = (
        pair.join("base"),
        pair.join("merged"),
        pair.join("true-adapter"),
    );
    let seed = args.seed.to_string();

    let synth = json_step(&[
        "synth",
        "--preset",
        "demo",
        "--out",
        path_str(&pair)?,
        "--seed",
        &seed,
        "--json",
    ])?;
    println!(
        "model pair: Qwen3.5 architecture, {} parameters; a rank-{} LoRA on {} modules merged into bf16",
        synth["base_parameters"], synth["rank"], synth["adapted_modules"]
    );

    let mut rows: Vec<[String; 5]> = Vec::new();
    for scheme in SCHEMES {
        let quantized = args.out.join(format!("base-{scheme}"));
        step(&[
            "quantize",
            "--in",
            path_str(&base)?,
            "--out",
            path_str(&quantized)?,
            "--scheme",
            scheme,
        ])?;
        let errors = json_step(&[
            "quant-error",
            "--base",
            path_str(&base)?,
            "--scheme",
            scheme,
            "--adapter",
            path_str(&true_adapter)?,
            "--merged",
            path_str(&merged)?,
            "--json",
        ])?;
        let totals = &errors["totals"];
        let adapter = &totals["adapter"];
        rows.push([
            scheme.to_string(),
            pct(totals["quant_rel_error"].as_f64()),
            pct(adapter["exact_rel_error"].as_f64()),
            pct(adapter["quantized_rel_error"].as_f64()),
            pct(adapter["bf16_floor_rel"].as_f64()),
        ]);
    }

    println!();
    println!(
        "The adapter on each base, against the merged weights (relative Frobenius error over all adapted modules):"
    );
    println!(
        "{:<14} {:>14} {:>16} {:>16} {:>12}",
        "base", "base W error", "bf16 base + BA", "quant base + BA", "bf16 floor"
    );
    for r in &rows {
        println!(
            "{:<14} {:>14} {:>16} {:>16} {:>12}",
            r[0], r[1], r[2], r[3], r[4]
        );
    }
    println!();
    println!("Everything the demo wrote is under {}.", args.out.display());
    Ok(())
}
