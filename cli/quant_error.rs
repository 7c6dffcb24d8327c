//! `loraq quant-error`: what a quantization scheme does to each weight, and to the
//! merged weight an adapter reproduces on the quantized base.

use crate::progress;
use anyhow::{Context, Result, bail};
use loraq_io::LoraAdapter;
use loraq_quant::layout::{DEFAULT_SKIP, compile_skip};
use loraq_quant::report::{
    LoraUpdate, ModuleReport, merged_quant_error, totals, totals_json, weight_quant_error,
};
use loraq_quant::{QuantizedBase, Scheme, WeightView};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

/// A measurement of a scheme on a base, alone and with an adapter against a merge:
/// what `loraq quant-error` does, and what the demo asks for without going through
/// the command line.
pub struct QuantErrorRequest<'a> {
    /// Base checkpoint.
    pub base: &'a Path,
    /// Scheme applied to it.
    pub scheme: Scheme,
    /// Adapter directory (with `merged`).
    pub adapter: Option<&'a Path>,
    /// Merged checkpoint (with `adapter`).
    pub merged: Option<&'a Path>,
    /// Extra skip regexes.
    pub skip: &'a [String],
}

/// Per module, the scheme's error alone and under the adapter.
pub fn measure(request: &QuantErrorRequest<'_>) -> Result<Vec<ModuleReport>> {
    let base = QuantizedBase::open(request.base)
        .with_context(|| format!("cannot open base {}", request.base.display()))?;
    let mut patterns: Vec<String> = DEFAULT_SKIP.iter().map(|s| s.to_string()).collect();
    patterns.extend(request.skip.iter().cloned());
    let skip = compile_skip(&patterns)?;
    let adapter = match request.adapter {
        Some(dir) => Some(
            // Module paths in the base's naming, whichever naming the adapter uses; a
            // module the base does not have is refused by name.
            LoraAdapter::open_for(dir, base.checkpoint())
                .with_context(|| format!("cannot open adapter {}", dir.display()))?,
        ),
        None => None,
    };
    let merged = match request.merged {
        Some(dir) => Some(
            QuantizedBase::open(dir)
                .with_context(|| format!("cannot open merged {}", dir.display()))?,
        ),
        None => None,
    };
    let adapted: BTreeMap<String, &loraq_io::LoraModuleInfo> = adapter
        .iter()
        .flat_map(|a| a.modules.iter())
        .map(|m| (format!("{}.weight", m.module_path), m))
        .collect();
    let names: Vec<String> = base
        .weights()
        .filter(|w| !skip.iter().any(|re| re.is_match(&w.name)) || adapted.contains_key(&w.name))
        .map(|w| w.name.clone())
        .collect();
    if names.is_empty() {
        bail!("{}: no linear weight to measure", request.base.display());
    }
    let bar = progress::bar(names.len() as u64, "quant-error");
    let mut reports = Vec::with_capacity(names.len());
    for name in &names {
        bar.set_message(name.clone());
        let weight = base.weight(name)?;
        let (rows, cols) = (weight.rows, weight.cols);
        let values = base.read_weight_f32(name)?;
        // A NaN weight gives a NaN error figure; refuse it by file and tensor.
        base.checkpoint().ensure_finite(name, &values)?;
        let view = WeightView::new(name, rows, cols, &values)?;
        let (quantized, weight_error) = weight_quant_error(request.scheme, view)?;
        let merged_error = match (adapted.get(name), &adapter, &merged) {
            (Some(module), Some(adapter), Some(merged)) => {
                if (module.out_features, module.in_features) != (rows, cols) {
                    bail!(
                        "adapter module {} is {}x{}, base weight {name} is {rows}x{cols}",
                        module.module_path,
                        module.out_features,
                        module.in_features
                    );
                }
                let merged_values = merged
                    .read_weight_f32(name)
                    .with_context(|| format!("merged checkpoint lacks {name}"))?;
                merged.checkpoint().ensure_finite(name, &merged_values)?;
                let b = adapter.read_b_f32(&module.module_path)?;
                let a = adapter.read_a_f32(&module.module_path)?;
                let update = LoraUpdate {
                    b: &b,
                    a: &a,
                    rank: module.rank,
                    scale: module.scale as f32,
                };
                Some((
                    module.rank,
                    merged_quant_error(view, &quantized, update, &merged_values)?,
                ))
            }
            _ => None,
        };
        reports.push(ModuleReport {
            name: name.clone(),
            rows,
            cols,
            weight: weight_error,
            merged: merged_error,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(reports)
}

/// Runs `loraq quant-error`.
pub fn run(args: Args) -> Result<()> {
    let reports = measure(&QuantErrorRequest {
        base: &args.base,
        scheme: args.scheme,
        adapter: args.adapter.as_deref(),
        merged: args.merged.as_deref(),
        skip: &args.skip,
    })?;
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
        let shape = format!("{}x{}", r.rows, r.cols);
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
