//! `loraq inspect`: what a checkpoint holds.

use anyhow::{Context, Result};
use loraq_io::{Checkpoint, DType, ModuleName};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Summarize a checkpoint directory (or one safetensors file).
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (sharded or single-file) or a .safetensors file.
    dir: PathBuf,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct ModuleKindSummary {
    block: String,
    module: String,
    count: usize,
    /// Distinct shapes of the module's `weight` (or of its first parameter).
    shapes: Vec<Vec<usize>>,
    dtypes: Vec<String>,
}

#[derive(Serialize)]
struct Summary {
    path: PathBuf,
    architecture: Option<String>,
    num_layers: Option<usize>,
    layer_types: BTreeMap<String, usize>,
    layer_pattern: Option<String>,
    shards: usize,
    tensors: usize,
    tensors_by_dtype: BTreeMap<String, usize>,
    total_bytes: u64,
    quantization: String,
    modules: Vec<ModuleKindSummary>,
    other_tensors: usize,
}

/// The quantization a checkpoint declares, or what its tensor names and dtypes show.
fn detect_quantization(ckpt: &Checkpoint) -> String {
    if let Some(q) = ckpt.config().and_then(|c| c.quantization.as_ref()) {
        return q.scheme_name();
    }
    let has = |suffix: &str| ckpt.tensors().any(|t| t.name.ends_with(suffix));
    if has(".weight_scale_inv") {
        "fp8-block (from tensor names)".into()
    } else if has(".weight_packed") {
        "compressed-tensors (from tensor names)".into()
    } else if has(".weight_scale_2") {
        "nvfp4 modelopt (from tensor names)".into()
    } else if ckpt.tensors().any(|t| t.dtype == DType::F8E4M3) {
        "fp8 (from dtypes)".into()
    } else {
        "none".into()
    }
}

fn summarize(args: &Args) -> Result<Summary> {
    let ckpt = Checkpoint::open(&args.dir)
        .with_context(|| format!("cannot open checkpoint {}", args.dir.display()))?;
    let config = ckpt.config();
    let mut layer_types = BTreeMap::new();
    for t in config.map(|c| c.layer_types.as_slice()).unwrap_or(&[]) {
        *layer_types.entry(t.as_str().to_string()).or_insert(0) += 1;
    }
    let layer_pattern = config.map(|c| {
        c.layer_types
            .iter()
            .map(|t| match t {
                loraq_io::LayerType::LinearAttention => 'L',
                loraq_io::LayerType::FullAttention => 'A',
            })
            .collect::<String>()
    });
    let mut by_dtype = BTreeMap::new();
    let mut total_bytes = 0u64;
    let mut kinds: BTreeMap<(String, String), ModuleKindSummary> = BTreeMap::new();
    let mut other_tensors = 0;
    for t in ckpt.tensors() {
        *by_dtype.entry(t.dtype.to_string()).or_insert(0) += 1;
        total_bytes += t.byte_len() as u64;
        let Some(m) = ModuleName::parse(&t.name) else {
            other_tensors += 1;
            continue;
        };
        let key = (m.block.as_str().to_string(), m.kind.as_str().to_string());
        let entry = kinds
            .entry(key.clone())
            .or_insert_with(|| ModuleKindSummary {
                block: key.0.clone(),
                module: key.1.clone(),
                count: 0,
                shapes: Vec::new(),
                dtypes: Vec::new(),
            });
        // Count a module once (by its main parameter); scales and the like only
        // add their dtype.
        if m.param == "weight" || m.param.is_empty() {
            entry.count += 1;
            if !entry.shapes.contains(&t.shape) {
                entry.shapes.push(t.shape.clone());
            }
        }
        let dtype = if m.param == "weight" || m.param.is_empty() {
            t.dtype.to_string()
        } else {
            format!("{}:{}", m.param, t.dtype)
        };
        if !entry.dtypes.contains(&dtype) {
            entry.dtypes.push(dtype);
        }
    }
    Ok(Summary {
        path: args.dir.clone(),
        architecture: config.map(|c| c.architecture.to_string()),
        num_layers: config.map(|c| c.num_hidden_layers),
        layer_types,
        layer_pattern,
        shards: ckpt.shard_count(),
        tensors: ckpt.len(),
        tensors_by_dtype: by_dtype,
        total_bytes,
        quantization: detect_quantization(&ckpt),
        modules: kinds.into_values().collect(),
        other_tensors,
    })
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// Runs `loraq inspect`.
pub fn run(args: Args) -> Result<()> {
    let summary = summarize(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
        return Ok(());
    }
    println!("checkpoint    {}", summary.path.display());
    println!(
        "architecture  {}",
        summary
            .architecture
            .as_deref()
            .unwrap_or("unknown (no config.json)")
    );
    if let (Some(n), Some(pattern)) = (summary.num_layers, &summary.layer_pattern) {
        let counts: Vec<String> = summary
            .layer_types
            .iter()
            .map(|(k, v)| format!("{v} {k}"))
            .collect();
        println!(
            "layers        {n} ({}); pattern {pattern}",
            counts.join(", ")
        );
    }
    let dtypes: Vec<String> = summary
        .tensors_by_dtype
        .iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect();
    println!(
        "tensors       {} in {} shard(s): {}",
        summary.tensors,
        summary.shards,
        dtypes.join(", ")
    );
    println!(
        "size          {} ({} bytes)",
        human_bytes(summary.total_bytes),
        summary.total_bytes
    );
    println!("quantization  {}", summary.quantization);
    println!();
    println!(
        "{:<12} {:<14} {:>6}  {:<24} dtypes",
        "block", "module", "count", "shapes"
    );
    for m in &summary.modules {
        let shapes: Vec<String> = m.shapes.iter().map(|s| format!("{s:?}")).collect();
        println!(
            "{:<12} {:<14} {:>6}  {:<24} {}",
            m.block,
            m.module,
            m.count,
            shapes.join(" "),
            m.dtypes.join(", ")
        );
    }
    println!(
        "{} other tensors (embeddings, norms, heads)",
        summary.other_tensors
    );
    Ok(())
}
