//! `loraq inspect`: what a checkpoint holds.

use anyhow::{Context, Result};
use loraq_io::{Checkpoint, DType, ModuleName};
use loraq_quant::{LinearWeight, QuantizedBase};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

/// Summarize a checkpoint directory (or one safetensors file).
#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (sharded or single-file), a .safetensors file, or a
    /// llama.cpp .gguf model (the first file of a split model).
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
    /// Distinct logical `[out, in]` shapes of the module's linear weight, whatever
    /// the layout packs it into (NVFP4 stores `[out, in / 2]` bytes).
    logical_shapes: Vec<Vec<usize>>,
    /// Distinct storage formats of the module's linear weight (`bf16`,
    /// `nvfp4 (modelopt)`, `nvfp4 (compressed-tensors)`, ...).
    formats: Vec<String>,
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
    /// Linear weights by storage format (e.g. `nvfp4 (modelopt)`: 24), from the
    /// tensors themselves; empty when the weights could not be classified.
    linear_formats: BTreeMap<String, usize>,
    /// Quantized linears that carry a static activation scale (`input_scale`,
    /// `input_global_scale`): W4A4 NVFP4; 0 for weight-only checkpoints.
    static_activation_scales: usize,
    /// Why the linear weights could not be classified, if they could not.
    linear_weights_note: Option<String>,
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
    // A GGUF file (llama.cpp) is read in the checkpoint's terms (docs/gguf.md).
    let ckpt = if loraq_gguf::base::is_gguf(&args.dir) {
        loraq_quant::layout::open_gguf_checkpoint(&args.dir).map(|gguf| gguf.checkpoint)
    } else {
        Checkpoint::open(&args.dir).map_err(loraq_quant::QuantError::from)
    }
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
    // The linear weights by the tensor holding their codes, to report each one's
    // logical shape and layout (a second, cheap mmap open of the same files).
    let (base, linear_weights_note) = match QuantizedBase::open(&args.dir) {
        Ok(base) => (Some(base), None),
        Err(e) => (None, Some(format!("linear weights not classified: {e}"))),
    };
    let mut linear_by_codes: HashMap<String, &LinearWeight> = HashMap::new();
    let mut linear_formats = BTreeMap::new();
    let mut static_activation_scales = 0;
    if let Some(base) = &base {
        for w in base.weights() {
            let codes = match &w.stored {
                loraq_quant::StoredWeight::Nvfp4CompressedTensors { packed, .. } => packed.clone(),
                _ => w.name.clone(),
            };
            linear_by_codes.insert(codes, w);
            *linear_formats.entry(w.stored.format_name()).or_insert(0) += 1;
            let module = w.name.trim_end_matches(".weight");
            if ckpt.contains(&format!("{module}.input_scale"))
                || ckpt.contains(&format!("{module}.input_global_scale"))
            {
                static_activation_scales += 1;
            }
        }
    }
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
                logical_shapes: Vec::new(),
                formats: Vec::new(),
                dtypes: Vec::new(),
            });
        // Count a module once (by its main parameter: the weight, or the packed
        // codes of compressed-tensors NVFP4); scales and the like only add their
        // dtype.
        let main = m.param == "weight" || m.param.is_empty() || m.param == "weight_packed";
        if main {
            entry.count += 1;
            if !entry.shapes.contains(&t.shape) {
                entry.shapes.push(t.shape.clone());
            }
            if let Some(w) = linear_by_codes.get(&t.name) {
                let logical = vec![w.out_features, w.in_features];
                if !entry.logical_shapes.contains(&logical) {
                    entry.logical_shapes.push(logical);
                }
                let format = w.stored.format_name();
                if !entry.formats.contains(&format) {
                    entry.formats.push(format);
                }
            }
        }
        let dtype = if main {
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
        linear_formats,
        static_activation_scales,
        linear_weights_note,
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
    let formats: Vec<String> = summary
        .linear_formats
        .iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect();
    if !formats.is_empty() {
        println!("linears       {}", formats.join(", "));
    }
    if summary
        .linear_formats
        .keys()
        .any(|f| f.starts_with("nvfp4"))
    {
        println!(
            "activations   {}",
            if summary.static_activation_scales == 0 {
                "unquantized (weight-only, W4A16)".to_string()
            } else {
                format!(
                    "NVFP4 with a static global scale on {} linears (W4A4)",
                    summary.static_activation_scales
                )
            }
        );
    }
    if let Some(note) = &summary.linear_weights_note {
        println!("note          {note}");
    }
    println!();
    println!(
        "{:<12} {:<14} {:>6}  {:<24} {:<24} dtypes",
        "block", "module", "count", "shapes", "logical [out, in]"
    );
    for m in &summary.modules {
        let shapes: Vec<String> = m.shapes.iter().map(|s| format!("{s:?}")).collect();
        let logical: Vec<String> = m.logical_shapes.iter().map(|s| format!("{s:?}")).collect();
        println!(
            "{:<12} {:<14} {:>6}  {:<24} {:<24} {}",
            m.block,
            m.module,
            m.count,
            shapes.join(" "),
            logical.join(" "),
            m.dtypes.join(", ")
        );
    }
    println!(
        "{} other tensors (embeddings, norms, heads)",
        summary.other_tensors
    );
    Ok(())
}
