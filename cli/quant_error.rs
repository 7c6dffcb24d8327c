//! `loraq quant-error`: what a quantization scheme does to each weight, and to the
//! merged weight an adapter reproduces on the quantized base.

use crate::progress;
use anyhow::Result;
use loraq_quant::report::{ModuleReport, measure, totals, totals_json};
use loraq_quant::{MeasureProgress, QuantErrorRequest, Scheme};
use std::path::PathBuf;

/// Per module, the relative error of dequant(Q(W)) against W, and with --adapter
/// and --merged, of dequant(Q(W_base)) + B A against the merged weight, with the
/// merged weight's bf16 rounding floor beside it.
#[derive(clap::Args)]
pub struct Args {
    /// Base checkpoint (plain or already quantized: decoded exactly first).
    #[arg(long, value_name = "DIR")]
    base: PathBuf,
    /// Scheme to apply to the base.
    #[arg(long)]
    scheme: Scheme,
    /// PEFT LoRA adapter directory (needs --merged).
    #[arg(long, value_name = "DIR", requires = "merged")]
    adapter: Option<PathBuf>,
    /// Merged checkpoint the adapter reproduces (needs --adapter).
    #[arg(long, value_name = "DIR", requires = "adapter")]
    merged: Option<PathBuf>,
    /// Extra regexes of weights to leave out (added to quantize's default skip list).
    #[arg(long, value_name = "REGEX")]
    skip: Vec<String>,
    /// Print JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs `loraq quant-error`.
pub fn run(args: Args) -> Result<()> {
    let mut bar = None;
    let reports = measure(
        &QuantErrorRequest {
            base: &args.base,
            scheme: args.scheme,
            adapter: args.adapter.as_deref(),
            merged: args.merged.as_deref(),
            skip: &args.skip,
        },
        &mut |event| match event {
            MeasureProgress::Planned { weights } => {
                bar = Some(progress::bar(weights as u64, "quant-error"));
            }
            MeasureProgress::Measuring(name) => {
                if let Some(bar) = &bar {
                    bar.set_message(name.to_string());
                }
            }
            MeasureProgress::Measured => {
                if let Some(bar) = &bar {
                    bar.inc(1);
                }
            }
        },
    )?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if args.json {
        let value = serde_json::json!({
            "base": args.base,
            "scheme": args.scheme.name(),
            "adapter": args.adapter,
            "merged": args.merged,
            "modules": reports.iter().map(ModuleReport::to_json).collect::<Vec<_>>(),
            "totals": totals_json(&reports),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    let with_adapter = reports.iter().any(|r| r.merged.is_some());
    if with_adapter {
        println!(
            "{:<60} {:>13} {:>10} {:>10} {:>10} {:>10}",
            "module", "shape", "W rel err", "exact+BA", "quant+BA", "bf16 floor"
        );
    } else {
        println!("{:<60} {:>13} {:>10}", "module", "shape", "W rel err");
    }
    for r in &reports {
        let shape = format!("{}x{}", r.out_features, r.in_features);
        let mut line = format!(
            "{:<60} {:>13} {:>10.3e}",
            r.name,
            shape,
            r.weight.relative()
        );
        if let Some((_, m)) = &r.merged {
            let (exact, quantized, floor) = m.relative();
            line += &format!(" {exact:>10.3e} {quantized:>10.3e} {floor:>10.3e}");
        }
        println!("{line}");
    }
    let totals = totals(&reports);
    println!(
        "total ({} modules): W rel err {:.3e}",
        reports.len(),
        totals.quant_rel_error
    );
    if let Some(a) = &totals.adapter {
        println!(
            "adapted ({} modules): exact+BA {:.3e}, quant+BA {:.3e}, bf16 floor {:.3e}",
            a.modules, a.exact_rel_error, a.quantized_rel_error, a.bf16_floor_rel
        );
    }
    Ok(())
}
