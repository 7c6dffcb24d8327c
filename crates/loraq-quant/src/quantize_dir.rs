//! A quantized copy of a checkpoint directory, written all or none: what
//! `loraq quantize` does (the CLI adds argument parsing, progress and printing).

use crate::error::{QuantError, Result};
use crate::layout::{
    DEFAULT_SKIP, InputActivationStats, Layout, QuantizeOptions, compile_skip,
    plan_quantization_calibrated, write_quantized,
};
use crate::scheme::Scheme;
use loraq_io::{AtomicDir, Checkpoint, StaleSibling};
use std::path::{Path, PathBuf};

/// The largest shard `loraq quantize` writes unless told otherwise, in bytes.
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5_000_000_000;

/// A quantized copy of a checkpoint to write.
#[derive(Clone, Debug)]
pub struct QuantizeRequest<'a> {
    /// Input checkpoint.
    pub input: &'a Path,
    /// Output directory.
    pub out: &'a Path,
    /// Scheme.
    pub scheme: Scheme,
    /// Layout (`None`: the scheme's own).
    pub layout: Option<Layout>,
    /// Activation statistics from `loraq run --collect-stats` (NVFP4 static activation
    /// scales).
    pub activation_stats: Option<&'a Path>,
    /// Extra skip regexes.
    pub skip: &'a [String],
    /// Only the `skip` patterns, not the default list.
    pub no_default_skip: bool,
    /// Largest shard, in bytes.
    pub max_shard_bytes: usize,
    /// Replace the output directory.
    pub force: bool,
}

/// What was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizeSummary {
    /// The output directory, committed.
    pub out: PathBuf,
    /// The layout written.
    pub layout: Layout,
    /// Tensors in the checkpoint.
    pub tensors: usize,
    /// Tensors quantized.
    pub quantized: usize,
    /// Whether NVFP4 static activation scales were written.
    pub activation_scales: bool,
    /// Side files copied.
    pub side_files: usize,
}

/// What [`quantize_to_dir`] reports while it works.
#[derive(Clone, Copy, Debug)]
pub enum QuantizeProgress<'a> {
    /// Temporaries a killed earlier run left beside the output (found once the output
    /// is staged).
    StaleSiblings(&'a [StaleSibling]),
    /// The plan is made: this many tensors will be written.
    Planned {
        /// Tensors of the output.
        tensors: usize,
    },
    /// One tensor is written.
    Wrote(&'a str),
}

/// Files of the input directory copied as they are (tokenizer, generation config,
/// chat template, ...): everything but the weights, their index and the configs
/// the output rewrites.
fn copy_side_files(input: &Path, out: &Path) -> Result<usize> {
    if !input.is_dir() {
        return Ok(0);
    }
    let file_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| QuantError::File { path, source }
    };
    let mut copied = 0;
    for entry in std::fs::read_dir(input).map_err(file_err(input))? {
        let entry = entry.map_err(file_err(input))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let rewritten = name.ends_with(".safetensors")
            || name == loraq_io::INDEX_FILE
            || name == loraq_io::CONFIG_FILE
            || name == "hf_quant_config.json"
            || name == "SHA256SUMS";
        let path = entry.path();
        if entry.file_type().map_err(file_err(&path))?.is_file() && !rewritten {
            std::fs::copy(&path, out.join(&*name)).map_err(file_err(&path))?;
            copied += 1;
        }
    }
    Ok(copied)
}

/// Quantizes `request.input` into `request.out`, written to a temporary sibling and
/// renamed into place only when complete; `progress` hears what happens.
pub fn quantize_to_dir(
    request: &QuantizeRequest<'_>,
    progress: &mut dyn FnMut(QuantizeProgress<'_>),
) -> Result<QuantizeSummary> {
    let layout = request
        .layout
        .unwrap_or(Layout::default_for(request.scheme));
    let mut patterns: Vec<String> = if request.no_default_skip {
        Vec::new()
    } else {
        DEFAULT_SKIP.iter().map(|s| s.to_string()).collect()
    };
    patterns.extend(request.skip.iter().cloned());
    let options = QuantizeOptions {
        scheme: request.scheme,
        layout,
        skip: compile_skip(&patterns)?,
        max_shard_bytes: request.max_shard_bytes,
    };
    // Refuse an output over an input (or an existing one without force) before
    // opening anything.
    let mut inputs = vec![request.input];
    inputs.extend(request.activation_stats);
    let out = AtomicDir::create(request.out, request.force, &inputs)?;
    progress(QuantizeProgress::StaleSiblings(out.stale_siblings()));
    let activation_stats = match request.activation_stats {
        Some(path) => {
            let stats = loraq_io::read_activation_stats(path).map_err(|e| {
                QuantError::from(e).context(format!("--calibration {}", path.display()))
            })?;
            Some(InputActivationStats {
                source: path.to_path_buf(),
                abs_max: stats.input_abs_max,
            })
        }
        None => None,
    };
    let input = Checkpoint::open(request.input).map_err(|e| {
        QuantError::from(e).context(format!(
            "cannot open checkpoint {}",
            request.input.display()
        ))
    })?;
    let plan = plan_quantization_calibrated(&input, &options, activation_stats.as_ref())?;
    if plan.quantized_count() == 0 {
        return Err(QuantError::NothingToDo {
            path: request.input.to_path_buf(),
            what: "tensor to quantize (every 2-D float .weight is skipped)",
        });
    }
    progress(QuantizeProgress::Planned {
        tensors: plan.actions.len(),
    });
    write_quantized(&input, &plan, &options, out.path(), &mut |name| {
        progress(QuantizeProgress::Wrote(name))
    })
    // The scheme's errors name the tensor; this names the checkpoint holding it.
    .map_err(|e| e.context(format!("quantizing {}", request.input.display())))?;
    let side_files = copy_side_files(request.input, out.path())?;
    let out = out.commit()?;
    Ok(QuantizeSummary {
        out,
        layout,
        tensors: plan.actions.len(),
        quantized: plan.quantized_count(),
        activation_scales: !plan.input_abs_max.is_empty(),
        side_files,
    })
}
