//! The write and re-read stages of `loraq extract`: the adapter (PEFT safetensors and
//! adapter_config.json), the files `--copy` names, manifest.json,
//! extraction_report.json, the model card and SHA256SUMS, written into the staged
//! output directory; then the directory re-read as PEFT reads it and checked against
//! what was factored before it is committed.

use crate::error::{ExtractError, Result};
use crate::factoring::{Factored, ModuleFigures};
use crate::options::{CARD_FILE, ExtractOptions, MANIFEST_FILE, REPORT_FILE, RankChoice};
use crate::plan::ExtractionPlan;
use crate::report::{
    ActivationStatsRecord, ExtractionReport, InputRecord, TargetSummary, Totals, relative_totals,
};
use crate::target::TargetSpec;
use loraq_io::peft::VLLM_MAX_LORA_RANKS;
use loraq_io::sha256sums::sha256_file;
use loraq_io::{
    AdapterConfig, AdapterNaming, Checkpoint, LoraAdapter, LoraFactors, ModulePathMap,
    verify_sha256sums, write_adapter, write_sha256sums,
};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// One module of the adapter: the checkpoint's module path, `[out, in]`, and the
/// rank written. Built once from the factored modules; the manifest, the ranks of
/// adapter_config.json, the parameter count and the re-read check all use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterEntry {
    /// Module path as the checkpoint names it.
    pub module: String,
    /// `[out, in]`.
    pub shape: [usize; 2],
    /// Rank written.
    pub rank: usize,
}

/// What the write stage produced.
#[derive(Debug)]
pub struct Written {
    /// extraction_report.json as written.
    pub report: ExtractionReport,
    /// Every module of the adapter, in the order written.
    pub entries: Vec<AdapterEntry>,
}

#[derive(Serialize)]
struct ManifestModule<'a> {
    module: &'a str,
    /// The module as the adapter's tensors name it (differs with `--names text`).
    adapter_module: String,
    shape: [usize; 2],
    rank: usize,
    dtype: &'static str,
}

#[derive(Serialize)]
struct Manifest<'a> {
    tool: &'static str,
    version: &'static str,
    merged: &'a InputRecord,
    base: &'a InputRecord,
    base_model_name_or_path: &'a str,
    names: AdapterNaming,
    target_base: Option<String>,
    r: usize,
    lora_alpha: usize,
    split: &'static str,
    modules: Vec<ManifestModule<'a>>,
    copied: &'a [String],
}

/// The write stage: writes every file of the adapter directory into `dir` (the staged
/// output) from the plan and the factored modules; `above_threshold` lists the modules
/// written above `--max-residual-ratio` (with `--allow-residual`), `started` is when the
/// extraction began (the report's wall time).
pub fn write_adapter_dir(
    dir: &Path,
    plan: &ExtractionPlan,
    factored: Factored,
    above_threshold: Vec<String>,
    options: &ExtractOptions,
    started: Instant,
) -> Result<Written> {
    let entries: Vec<AdapterEntry> = factored
        .modules
        .iter()
        .map(|m| AdapterEntry {
            module: m.module().to_string(),
            shape: m.shape(),
            rank: m.adapter_rank(),
        })
        .collect();
    let mut modules = Vec::new();
    let mut corrections = Vec::new();
    // Module paths as the adapter names them; the report keeps the checkpoint's.
    let names = options.names;
    let factors: Vec<LoraFactors> = factored
        .modules
        .into_iter()
        .map(|m| {
            let [out_features, in_features] = m.shape();
            let module_path = names.module_path(m.module());
            match m.figures {
                ModuleFigures::Lora(report) => modules.push(report),
                ModuleFigures::Correction(report) => corrections.push(report),
            }
            LoraFactors {
                module_path,
                rank: m.factors.rank,
                in_features,
                out_features,
                a_bf16: m.factors.a_bf16,
                b_bf16: m.factors.b_bf16,
            }
        })
        .collect();
    let ranks: BTreeMap<String, usize> = entries
        .iter()
        .map(|e| (names.module_path(&e.module), e.rank))
        .collect();
    let r = adapter_r(ranks.values().copied());
    let base_model_name_or_path = match &options.base_id {
        Some(id) => id.clone(),
        None => absolute_base_path(&options.base)?,
    };
    let config = AdapterConfig::for_ranks(
        r,
        &ranks,
        Some(base_model_name_or_path.clone()),
        options.base_revision.clone(),
    );
    write_adapter(dir, &config, &factors)?;
    drop(factors);

    let merged_dir = if options.merged.is_dir() {
        options.merged.clone()
    } else {
        options
            .merged
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    };
    let copied = copy_files(&merged_dir, &options.copy, dir)?;
    let merged_record = input_record(&options.merged, &options.merged_revision)?;
    let base_record = input_record(&options.base, &options.base_revision)?;
    let manifest = Manifest {
        tool: "loraq",
        version: env!("CARGO_PKG_VERSION"),
        merged: &merged_record,
        base: &base_record,
        base_model_name_or_path: &base_model_name_or_path,
        names,
        target_base: options.target_base.as_ref().map(TargetSpec::describe),
        r,
        lora_alpha: r,
        split: options.split.as_str(),
        modules: entries
            .iter()
            .map(|e| ManifestModule {
                module: &e.module,
                adapter_module: names.module_path(&e.module),
                shape: e.shape,
                rank: e.rank,
                dtype: "BF16",
            })
            .collect(),
        copied: &copied,
    };
    write_json(&dir.join(MANIFEST_FILE), &manifest)?;

    let low_rank: Vec<f64> = modules
        .iter()
        .filter(|m| m.rank < m.shape[0].min(m.shape[1]))
        .map(|m| m.ratio)
        .collect();
    let worst = modules.iter().max_by(|a, b| a.ratio.total_cmp(&b.ratio));
    let totals = Totals {
        modules: entries.len(),
        parameters: entries
            .iter()
            .map(|e| e.rank * (e.shape[0] + e.shape[1]))
            .sum(),
        max_ratio: worst.map_or(0.0, |m| m.ratio),
        max_ratio_module: worst.map(|m| m.module.clone()),
        mean_ratio_low_rank: (!low_rank.is_empty())
            .then(|| low_rank.iter().sum::<f64>() / low_rank.len() as f64),
        max_ratio_after_cast: modules
            .iter()
            .map(|m| m.ratio_after_cast)
            .fold(0.0, f64::max),
        above_threshold,
        seconds: 0.0,
    };
    let target_summary = options.target_base.as_ref().map(|spec| {
        let mut totals = relative_totals(modules.iter().filter_map(|m| m.target.as_ref()));
        if options.all_layers {
            totals.corrections = Some(Box::new(relative_totals(
                corrections.iter().map(|c| &c.target),
            )));
        }
        TargetSummary {
            target_base: spec.describe(),
            activation_stats: plan
                .activation_stats
                .as_ref()
                .map(|c| ActivationStatsRecord {
                    path: c.path().to_path_buf(),
                    tokens: c.tokens(),
                    records: c.records(),
                }),
            extra_rank: options.extra_rank,
            correction_rank: options.all_layers.then_some(options.correction_rank),
            totals,
        }
    });
    let mut report = ExtractionReport {
        tool: "loraq",
        version: env!("CARGO_PKG_VERSION"),
        out: options.out.clone(),
        merged: merged_record,
        base: base_record,
        loading_class: loading_class(&plan.merged, names),
        base_model_name_or_path,
        names,
        target_modules: config.target_modules.clone(),
        r,
        rank_mode: match options.rank {
            RankChoice::Fixed(r) => r.to_string(),
            RankChoice::Auto => "auto".into(),
        },
        split: options.split.as_str(),
        method: options.method.as_str(),
        max_residual_ratio: options.max_residual_ratio,
        identical_tensors: plan.scan.identical,
        base_only: plan.scan.base_only.clone(),
        zero_delta: factored.zero_delta,
        copied,
        modules,
        corrections,
        target_base: target_summary,
        totals,
    };
    report.totals.seconds = started.elapsed().as_secs_f64();
    write_json(&dir.join(REPORT_FILE), &report)?;
    // The loading examples name the adapter where it will be once committed.
    let adapter_path = std::path::absolute(&options.out)
        .unwrap_or_else(|_| options.out.clone())
        .display()
        .to_string();
    let card = crate::card::render_model_card(&report, &adapter_path);
    std::fs::write(dir.join(CARD_FILE), card).map_err(|source| ExtractError::Write {
        path: dir.join(CARD_FILE),
        source,
    })?;
    write_sha256sums(dir)?;
    Ok(Written { report, entries })
}

/// The re-read stage: validates what was written before it appears. The adapter
/// parses as PEFT does, every module maps back onto the merge's tensors (in either
/// naming) with its shape, rank and scale 1, nothing else is in it, and every
/// checksum holds.
pub fn check_written(
    dir: &Path,
    plan: &ExtractionPlan,
    options: &ExtractOptions,
    entries: &[AdapterEntry],
) -> Result<()> {
    let mut written = LoraAdapter::open(dir)?;
    written.map_onto(
        &ModulePathMap::from_tensor_names(plan.merged.tensors().map(|t| t.name.as_str())),
        &options.merged.display().to_string(),
    )?;
    for entry in entries {
        let module = entry.module.as_str();
        let info = written
            .module(module)
            .ok_or_else(|| ExtractError::BadShape {
                module: module.to_string(),
                what: "missing from the written adapter".into(),
            })?;
        if info.rank != entry.rank
            || [info.out_features, info.in_features] != entry.shape
            || info.scale != 1.0
        {
            return Err(ExtractError::BadShape {
                module: module.to_string(),
                what: format!(
                    "written as rank {} [{}, {}] scale {}",
                    info.rank, info.out_features, info.in_features, info.scale
                ),
            });
        }
    }
    if written.modules.len() != entries.len() {
        return Err(ExtractError::BadShape {
            module: options.out.display().to_string(),
            what: format!(
                "adapter holds {} modules, {} extracted",
                written.modules.len(),
                entries.len()
            ),
        });
    }
    verify_sha256sums(dir)?;
    Ok(())
}

/// Adapter `r`: the smallest rank vLLM serves (its `--max-lora-rank` values) that covers
/// the largest module rank. Modules below it go through rank_pattern with alpha = rank,
/// so the scale is 1 everywhere; an `r` above every module would only force a larger
/// `--max-lora-rank` (vLLM refuses an adapter whose r exceeds it).
pub fn adapter_r(module_ranks: impl IntoIterator<Item = usize>) -> usize {
    let largest = module_ranks.into_iter().max().unwrap_or(1);
    VLLM_MAX_LORA_RANKS
        .iter()
        .copied()
        .find(|&v| v >= largest)
        .unwrap_or(largest)
}

/// The base's absolute path, as `base_model_name_or_path`: the directory (a
/// `.safetensors` file stands for the directory holding it), so that
/// `AutoPeftModel` finds it from any working directory instead of asking the Hub.
fn absolute_base_path(base: &Path) -> Result<String> {
    let path = std::fs::canonicalize(base).map_err(|source| ExtractError::Write {
        path: base.to_path_buf(),
        source,
    })?;
    let dir = if path.is_file() {
        path.parent().map(Path::to_path_buf).unwrap_or(path)
    } else {
        path
    };
    Ok(dir.display().to_string())
}

/// The transformers class that names the modules as the adapter does: the checkpoint's
/// own architecture for checkpoint names when they are multimodal, else
/// `AutoModelForCausalLM` (whose text-only class uses `model.layers.*`).
fn loading_class(merged: &Checkpoint, names: AdapterNaming) -> String {
    let multimodal = merged.tensors().any(|t| {
        t.name
            .starts_with(loraq_io::module_name::MULTIMODAL_TEXT_PREFIX)
    });
    if names == AdapterNaming::Text || !multimodal {
        return "AutoModelForCausalLM".into();
    }
    merged
        .config()
        .and_then(|c| {
            c.raw
                .get("architectures")?
                .get(0)?
                .as_str()
                .map(str::to_string)
        })
        .unwrap_or_else(|| "AutoModelForImageTextToText".into())
}

fn input_record(path: &Path, revision: &Option<String>) -> Result<InputRecord> {
    let dir = if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    let config = dir.join(loraq_io::CONFIG_FILE);
    let config_sha256 = if config.is_file() {
        Some(sha256_file(&config)?)
    } else {
        None
    };
    Ok(InputRecord {
        path: path.to_path_buf(),
        revision: revision.clone(),
        config_sha256,
    })
}

/// Translates a glob (`*`, `?`, `**`) into an anchored regex over `/`-separated paths.
fn glob_regex(glob: &str) -> regex::Regex {
    let mut re = String::from("^");
    let mut chars = glob.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '*' if chars.peek() == Some(&'*') => {
                chars.next();
                re.push_str(".*");
            }
            '*' => re.push_str("[^/]*"),
            '?' => re.push_str("[^/]"),
            c => re.push_str(&regex::escape(&c.to_string())),
        }
    }
    re.push('$');
    regex::Regex::new(&re).expect("escaped glob is a valid regex")
}

/// Lists the files under `dir` (paths relative to `root`). Directory symlinks are not
/// followed (a link to `.` would otherwise walk forever); symlinks to files are listed
/// and checked by [`copy_source`] when a glob matches them.
fn list_files(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|source| ExtractError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries {
        let entry = entry.map_err(|source| ExtractError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = entry.path();
        let file_type = entry.file_type().map_err(|source| ExtractError::Write {
            path: path.clone(),
            source,
        })?;
        if file_type.is_dir() {
            list_files(root, &path, out)?;
            continue;
        }
        if file_type.is_symlink() && path.is_dir() {
            continue;
        }
        if let Ok(rel) = path.strip_prefix(root) {
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
    Ok(())
}

/// The file `--copy` reads for `rel`: refused when it resolves (through symlinks)
/// outside the merged directory, so a link to a file elsewhere is never copied into
/// the adapter. One exception: a Hugging Face cache snapshot
/// (`models--ORG--NAME/snapshots/REV/`), whose files are links into the same repo's
/// `blobs/` directory.
fn copy_source(merged_dir: &Path, rel: &str) -> Result<PathBuf> {
    let source = merged_dir.join(rel);
    let io_error = |path: &Path, source| ExtractError::Write {
        path: path.to_path_buf(),
        source,
    };
    let root = std::fs::canonicalize(merged_dir).map_err(|e| io_error(merged_dir, e))?;
    let resolved = std::fs::canonicalize(&source).map_err(|e| io_error(&source, e))?;
    let hub_blobs = root
        .parent()
        .filter(|snapshots| snapshots.file_name().is_some_and(|n| n == "snapshots"))
        .and_then(Path::parent)
        .filter(|repo| {
            repo.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("models--"))
        })
        .map(|repo| repo.join("blobs"));
    let inside =
        resolved.starts_with(&root) || hub_blobs.is_some_and(|blobs| resolved.starts_with(blobs));
    if !inside {
        return Err(ExtractError::InvalidParameter {
            name: "--copy",
            detail: format!(
                "{} resolves to {}, outside the merged directory {}: not copied",
                source.display(),
                resolved.display(),
                merged_dir.display()
            ),
        });
    }
    Ok(source)
}

const GENERATED: [&str; 6] = [
    "adapter_model.safetensors",
    "adapter_config.json",
    MANIFEST_FILE,
    REPORT_FILE,
    CARD_FILE,
    "SHA256SUMS",
];

/// Copies the files of `merged_dir` matching the globs into `out`; returns their paths.
fn copy_files(merged_dir: &Path, globs: &[String], out: &Path) -> Result<Vec<String>> {
    if globs.is_empty() {
        return Ok(Vec::new());
    }
    let mut files = Vec::new();
    list_files(merged_dir, merged_dir, &mut files)?;
    files.sort();
    let mut copied = Vec::new();
    for glob in globs {
        let re = glob_regex(glob);
        let matched: Vec<&String> = files.iter().filter(|f| re.is_match(f)).collect();
        if matched.is_empty() {
            return Err(ExtractError::CopyNoMatch {
                pattern: glob.clone(),
                dir: merged_dir.to_path_buf(),
            });
        }
        for rel in matched {
            if GENERATED.contains(&rel.as_str()) {
                return Err(ExtractError::InvalidParameter {
                    name: "--copy",
                    detail: format!("{rel} would overwrite a file extract writes"),
                });
            }
            let dst = out.join(rel);
            if let Some(parent) = dst.parent() {
                std::fs::create_dir_all(parent).map_err(|source| ExtractError::Write {
                    path: parent.to_path_buf(),
                    source,
                })?;
            }
            let source = copy_source(merged_dir, rel)?;
            std::fs::copy(&source, &dst).map_err(|source| ExtractError::Write {
                path: dst.clone(),
                source,
            })?;
            if !copied.contains(rel) {
                copied.push(rel.clone());
            }
        }
    }
    Ok(copied)
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("report serializes") + "\n";
    std::fs::write(path, text).map_err(|source| ExtractError::Write {
        path: path.to_path_buf(),
        source,
    })
}
