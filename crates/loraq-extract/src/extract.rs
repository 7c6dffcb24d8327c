//! `loraq extract` as a library call: scan, factor every differing projection at the
//! rounding floor, validate, and write the adapter directory atomically.

use crate::calibration::Calibration;
use crate::error::{ExtractError, Result};
use crate::factor::{FactorParams, Factorization, Method, factorize};
use crate::floor::{FloorFormat, expected_floor_ratio};
use crate::quant_aware::{QaContext, TargetReport, qa_module};
use crate::read::ShardFiles;
use crate::scan::{Projection, ScanReport, scan};
use crate::split::{Split, split_and_cast};
use crate::target::{TargetBase, TargetSpec};
use faer::Par;
use loraq_io::peft::VLLM_MAX_LORA_RANKS;
use loraq_io::sha256sums::sha256_file;
use loraq_io::{
    AdapterConfig, AdapterNaming, AtomicDir, Checkpoint, DType, LoraAdapter, LoraFactors,
    ModuleName, ModulePathMap, verify_sha256sums, write_adapter, write_sha256sums,
};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The largest rank `--rank auto` goes to.
pub const AUTO_RANK_CAP: usize = 512;
/// `--rank auto` keeps the smallest rank whose residual is within this factor of what a
/// perfect fit leaves against the floor ($\rho^*(k) F$).
pub const AUTO_RANK_SLACK: f64 = 1.05;

/// Output file names.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The per-module report.
pub const REPORT_FILE: &str = "extraction_report.json";
/// The model card.
pub const CARD_FILE: &str = "README.md";

/// How the rank of each module is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankChoice {
    /// `min(r, out, in, numerical rank)`; r must be a rank vLLM serves.
    Fixed(usize),
    /// Per module, the smallest rank that reaches the floor, at most [`AUTO_RANK_CAP`].
    Auto,
}

/// Everything `loraq extract` takes.
#[derive(Debug, Clone)]
pub struct ExtractOptions {
    /// The merged fine-tune.
    pub merged: PathBuf,
    /// Its base.
    pub base: PathBuf,
    /// The adapter directory to write.
    pub out: PathBuf,
    /// Rank choice.
    pub rank: RankChoice,
    /// Split of the singular values between B and A.
    pub split: Split,
    /// Factorization method.
    pub method: Method,
    /// Refuse a module whose truncation residual exceeds this times the floor.
    pub max_residual_ratio: f64,
    /// Write the adapter even above the threshold (the report still lists them).
    pub allow_residual: bool,
    /// Worker threads (0: all cores).
    pub threads: usize,
    /// Revision of the merge, recorded in the manifest.
    pub merged_revision: Option<String>,
    /// Revision of the base, recorded in the manifest and adapter_config.json.
    pub base_revision: Option<String>,
    /// `base_model_name_or_path` of adapter_config.json (a Hub id, say); `None`: the
    /// base's absolute path, which resolves from any directory.
    pub base_id: Option<String>,
    /// How the adapter names its modules: as the checkpoint does, or as
    /// `AutoModelForCausalLM` does.
    pub names: AdapterNaming,
    /// Globs of files in the merged directory to copy (LICENSE, head files).
    pub copy: Vec<String>,
    /// Replace an existing output directory.
    pub force: bool,
    /// The base the adapter will run on, when it is not `base`: the adapter then
    /// factors merged - target instead of merged - base (quantization-aware).
    pub target_base: Option<TargetSpec>,
    /// Input second moments per module (`loraq run --collect-stats`): the
    /// quantization-aware factorization minimizes the error weighted by them.
    pub calibration: Option<PathBuf>,
    /// Ranks added to every LoRA module's quantization-aware factorization.
    pub extra_rank: usize,
    /// Also correct the target's quantization error in modules the LoRA leaves alone,
    /// at `correction_rank`.
    pub all_layers: bool,
    /// Rank of the correction in modules the LoRA leaves alone (with `all_layers`).
    pub correction_rank: usize,
}

impl ExtractOptions {
    /// Options with the defaults of the command line.
    pub fn new(
        merged: impl Into<PathBuf>,
        base: impl Into<PathBuf>,
        out: impl Into<PathBuf>,
    ) -> ExtractOptions {
        ExtractOptions {
            merged: merged.into(),
            base: base.into(),
            out: out.into(),
            rank: RankChoice::Fixed(256),
            split: Split::Balanced,
            method: Method::Auto,
            max_residual_ratio: 1.10,
            allow_residual: false,
            threads: 0,
            merged_revision: None,
            base_revision: None,
            base_id: None,
            names: AdapterNaming::Checkpoint,
            copy: Vec::new(),
            force: false,
            target_base: None,
            calibration: None,
            extra_rank: 0,
            all_layers: false,
            correction_rank: 0,
        }
    }
}

/// Figures of one extracted module (a row of extraction_report.json).
#[derive(Debug, Clone, Serialize)]
pub struct ModuleReport {
    /// Module path.
    pub module: String,
    /// `[out, in]`.
    pub shape: [usize; 2],
    /// Rank of the factorization of merged - base (the plain adapter) that the
    /// figures below describe.
    pub rank: usize,
    /// Rank written to the adapter: `rank`, plus `--extra-rank` with `--target-base`.
    pub adapter_rank: usize,
    /// $\|D\|_F$.
    pub delta_norm: f64,
    /// The bf16 rounding floor of the merged weight.
    pub floor: f64,
    /// $\|D - BA\|_F$ with the f32 factors (the truncation residual).
    pub residual: f64,
    /// residual / floor: near 1 means at the floor; the refusal threshold applies to it.
    pub ratio: f64,
    /// What a perfect rank-`rank` fit of (low rank + rounding noise) leaves over the
    /// floor: $\sqrt{1 - r(m+n-r)/(mn)}$.
    pub expected_ratio: f64,
    /// $\|B_{bf16}A_{bf16} - BA\|_F$: the error the bf16 cast of the factors adds.
    pub cast_error: f64,
    /// The residual after the cast, $\sqrt{residual^2 + cast^2}$ (the cross term has zero
    /// mean; `loraq verify` measures it exactly).
    pub residual_after_cast: f64,
    /// residual_after_cast / floor.
    pub ratio_after_cast: f64,
    /// The singular values kept.
    pub singular_values_kept: Vec<f64>,
    /// The largest singular value computed and not kept, if any.
    pub first_dropped: Option<f64>,
    /// The certificate: the residual evaluated in f64 from the last pass.
    pub certificate_residual: f64,
    /// "randomized" or "exact".
    pub method: &'static str,
    /// Passes over the delta.
    pub passes: f64,
    /// Whether the randomized iteration met its stopping rule.
    pub converged: bool,
    /// Wall time of the module (read, factor, cast).
    pub seconds: f64,
    /// With `--target-base`: the plain and the quantization-aware adapter on the target
    /// (the quantization-aware one is what the adapter holds).
    pub target: Option<TargetReport>,
}

/// A module the LoRA leaves alone, corrected for the target's quantization error
/// (`--all-layers`).
#[derive(Debug, Clone, Serialize)]
pub struct CorrectionReport {
    /// Module path.
    pub module: String,
    /// `[out, in]`.
    pub shape: [usize; 2],
    /// Rank written.
    pub adapter_rank: usize,
    /// Figures on the target (the plain adapter has no factors here: rank 0).
    pub target: TargetReport,
    /// Wall time.
    pub seconds: f64,
}

/// Sums over modules of the figures on the target base.
#[derive(Debug, Clone, Serialize)]
pub struct TargetTotals {
    /// $\sqrt{\sum \|M - (\hat W + BA)\|^2} / \sqrt{\sum \|M\|^2}$ of the plain adapter,
    /// over the LoRA's modules.
    pub plain_relative: f64,
    /// The same for the quantization-aware adapter.
    pub quantization_aware_relative: f64,
    /// Weighted (output-error) counterparts, with `--calibration`.
    pub plain_weighted_relative: Option<f64>,
    /// Weighted, quantization-aware.
    pub quantization_aware_weighted_relative: Option<f64>,
    /// The same four over the corrected modules the LoRA leaves alone (`--all-layers`).
    pub corrections: Option<Box<TargetTotals>>,
}

/// How the quantization-aware extraction was asked for.
#[derive(Debug, Clone, Serialize)]
pub struct TargetSummary {
    /// The `--target-base` (scheme name or directory).
    pub target_base: String,
    /// The calibration file, tokens and records it covers.
    pub calibration: Option<CalibrationRecord>,
    /// `--extra-rank`.
    pub extra_rank: usize,
    /// `--correction-rank` when `--all-layers`.
    pub correction_rank: Option<usize>,
    /// Totals.
    pub totals: TargetTotals,
}

/// The calibration statistics used.
#[derive(Debug, Clone, Serialize)]
pub struct CalibrationRecord {
    /// The file.
    pub path: PathBuf,
    /// Tokens in the statistics.
    pub tokens: u64,
    /// Records in the statistics.
    pub records: u64,
}

/// The input side of the manifest.
#[derive(Debug, Clone, Serialize)]
pub struct InputRecord {
    /// Path as given.
    pub path: PathBuf,
    /// Revision, when given.
    pub revision: Option<String>,
    /// SHA-256 of config.json, when the checkpoint has one.
    pub config_sha256: Option<String>,
}

/// Totals of an extraction.
#[derive(Debug, Clone, Serialize)]
pub struct Totals {
    /// Modules in the adapter.
    pub modules: usize,
    /// Parameters of the adapter (A and B).
    pub parameters: usize,
    /// Largest residual / floor.
    pub max_ratio: f64,
    /// The module with it.
    pub max_ratio_module: Option<String>,
    /// Mean residual / floor over modules whose rank is below their smaller dimension.
    pub mean_ratio_low_rank: Option<f64>,
    /// Largest residual-after-cast / floor.
    pub max_ratio_after_cast: f64,
    /// Modules above `--max-residual-ratio` (written only with `--allow-residual`).
    pub above_threshold: Vec<String>,
    /// Wall time of the whole extraction.
    pub seconds: f64,
}

/// extraction_report.json, also the `--json` summary.
#[derive(Debug, Clone, Serialize)]
pub struct ExtractionReport {
    /// "loraq".
    pub tool: &'static str,
    /// The tool's version.
    pub version: &'static str,
    /// Output directory.
    pub out: PathBuf,
    /// The merge.
    pub merged: InputRecord,
    /// The base.
    pub base: InputRecord,
    /// `base_model_name_or_path` written to adapter_config.json.
    pub base_model_name_or_path: String,
    /// How the adapter names its modules (the report's `module` fields are always the
    /// checkpoint's tensor names).
    pub names: AdapterNaming,
    /// The transformers class whose module names the adapter's match: the one to load
    /// the base with before `PeftModel.from_pretrained`.
    pub loading_class: String,
    /// The adapter's target_modules.
    pub target_modules: Vec<String>,
    /// Adapter `r`: the smallest rank vLLM serves that covers every module's rank, so
    /// `--max-lora-rank r` serves it.
    pub r: usize,
    /// "256" or "auto".
    pub rank_mode: String,
    /// "balanced" or "orthonormal-a".
    pub split: &'static str,
    /// The method asked for.
    pub method: &'static str,
    /// The refusal threshold.
    pub max_residual_ratio: f64,
    /// Tensors identical in both checkpoints.
    pub identical_tensors: usize,
    /// Tensors only the base has (ignored).
    pub base_only: Vec<String>,
    /// Tensors whose bytes differ but whose delta is zero (signed zeros): not factored.
    pub zero_delta: Vec<String>,
    /// Files copied by --copy.
    pub copied: Vec<String>,
    /// One entry per module.
    pub modules: Vec<ModuleReport>,
    /// Modules the LoRA leaves alone, corrected for the target (`--all-layers`).
    pub corrections: Vec<CorrectionReport>,
    /// The quantization-aware part, with `--target-base`.
    pub target_base: Option<TargetSummary>,
    /// Totals.
    pub totals: Totals,
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

/// What the progress callback is told.
#[derive(Debug)]
pub enum Progress<'a> {
    /// The scan finished.
    Scanned(&'a ScanReport),
    /// Work on a projection started (index from 0).
    ModuleStarted {
        /// Index.
        index: usize,
        /// Number of projections.
        total: usize,
        /// The projection.
        projection: &'a Projection,
    },
    /// A projection finished.
    ModuleDone(&'a ModuleReport),
    /// A correction of a module the LoRA leaves alone finished (`--all-layers`).
    CorrectionDone(&'a CorrectionReport),
    /// Writing and validating the output.
    Writing,
}

pub(crate) fn floor_format(dtype: DType) -> FloorFormat {
    match dtype {
        DType::F16 => FloorFormat::F16,
        DType::F32 => FloorFormat::F32,
        _ => FloorFormat::Bf16,
    }
}

/// $D = f32(merged) - f32(base)$ and the floor of the merged tensor, in one parallel pass
/// over both mappings; refuses a non-finite value in either input.
pub fn delta_and_floor(
    merged: &Checkpoint,
    base: &Checkpoint,
    tensor: &str,
) -> Result<(Vec<f32>, f64)> {
    let info = merged.info(tensor)?;
    let dtype = info.dtype;
    let width = dtype.size_bytes();
    let base_info = base.info(tensor)?;
    if base_info.dtype != dtype || base_info.shape != info.shape {
        return Err(ExtractError::BadShape {
            module: tensor.to_string(),
            what: format!(
                "base is {} {:?}, merged {} {:?}",
                base_info.dtype.as_str(),
                base_info.shape,
                dtype.as_str(),
                info.shape
            ),
        });
    }
    let (merged_files, base_files) = (ShardFiles::open(merged)?, ShardFiles::open(base)?);
    let format = floor_format(dtype);
    const CHUNK: usize = 1 << 16;
    let mut delta = vec![0f32; info.element_count()];
    let partials = delta
        .par_chunks_mut(CHUNK)
        .enumerate()
        .map(|(c, d)| {
            let offset = c * CHUNK * width;
            let mut m_bytes = vec![0u8; d.len() * width];
            let mut b_bytes = vec![0u8; d.len() * width];
            merged_files.read(info, offset, &mut m_bytes)?;
            base_files.read(base_info, offset, &mut b_bytes)?;
            let mut m = vec![0f32; d.len()];
            let mut b = vec![0f32; d.len()];
            loraq_io::convert::decode_to_f32(dtype, &m_bytes, &mut m);
            loraq_io::convert::decode_to_f32(dtype, &b_bytes, &mut b);
            let bad_m = m.iter().position(|x| !x.is_finite()).map(|i| c * CHUNK + i);
            let bad_b = b.iter().position(|x| !x.is_finite()).map(|i| c * CHUNK + i);
            let mut sq = 0f64;
            for ((d, &m), &b) in d.iter_mut().zip(&m).zip(&b) {
                *d = m - b;
                let u = format.ulp(m);
                sq += u * u;
            }
            Ok((bad_m, bad_b, sq))
        })
        .collect::<Result<Vec<_>>>()?;
    let (bad_merged, bad_base, floor_sq) = partials.into_iter().fold((None, None, 0.0), |x, y| {
        (min_index(x.0, y.0), min_index(x.1, y.1), x.2 + y.2)
    });
    // Named by the file that holds the value, as every refusal of an input is.
    let non_finite = |checkpoint: &Checkpoint, shard: usize, index: usize| {
        ExtractError::Io(loraq_io::IoError::Tensor {
            path: checkpoint.shard_path(shard).to_path_buf(),
            tensor: tensor.to_string(),
            reason: format!("element {index} is not finite (NaN or infinite)"),
        })
    };
    if let Some(index) = bad_merged {
        return Err(non_finite(merged, info.shard, index));
    }
    if let Some(index) = bad_base {
        return Err(non_finite(base, base_info.shard, index));
    }
    Ok((delta, (floor_sq / 12.0).sqrt()))
}

fn min_index(a: Option<usize>, b: Option<usize>) -> Option<usize> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
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

/// The rank `--rank auto` picks: the smallest k whose truncation residual is within
/// [`AUTO_RANK_SLACK`] of $\rho^*(k) F$, else everything kept.
pub fn auto_rank(f: &Factorization, floor: f64) -> usize {
    (1..=f.kept())
        .find(|&k| {
            f.truncation_residual(k)
                <= AUTO_RANK_SLACK * expected_floor_ratio(f.rows, f.cols, k) * floor
        })
        .unwrap_or(f.kept())
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

/// The largest rank of any module.
const MAX_MODULE_RANK: usize = VLLM_MAX_LORA_RANKS[VLLM_MAX_LORA_RANKS.len() - 1];

/// Refuses quantization-aware options without `--target-base`, and ranks past 512.
fn validate_target_options(options: &ExtractOptions) -> Result<()> {
    let invalid =
        |name: &'static str, detail: String| Err(ExtractError::InvalidParameter { name, detail });
    if options.target_base.is_none()
        && (options.calibration.is_some() || options.extra_rank > 0 || options.all_layers)
    {
        return invalid(
            "--target-base",
            "--calibration, --extra-rank and --all-layers shape a quantization-aware adapter: they need --target-base".into(),
        );
    }
    if options.all_layers != (options.correction_rank > 0) {
        return invalid(
            "--correction-rank",
            "--all-layers needs a --correction-rank above 0, and --correction-rank needs --all-layers".into(),
        );
    }
    if options.correction_rank > MAX_MODULE_RANK {
        return invalid(
            "--correction-rank",
            format!(
                "{} is above {MAX_MODULE_RANK}, the largest rank vLLM serves",
                options.correction_rank
            ),
        );
    }
    if let RankChoice::Fixed(r) = options.rank
        && r + options.extra_rank > MAX_MODULE_RANK
    {
        return invalid(
            "--extra-rank",
            format!(
                "rank {r} + {} is above {MAX_MODULE_RANK}, the largest rank vLLM serves",
                options.extra_rank
            ),
        );
    }
    Ok(())
}

/// Candidates for `--all-layers`: linear weights (2-D float) of the merge that the scan
/// found identical to the base, and that the target changes.
fn untouched_linears(merged: &Checkpoint, scanned: &ScanReport) -> Vec<Projection> {
    let touched: std::collections::BTreeSet<&str> = scanned
        .projections
        .iter()
        .map(|p| p.tensor.as_str())
        .collect();
    let mut out: Vec<Projection> = merged
        .tensors()
        .filter(|t| !touched.contains(t.name.as_str()))
        .filter(|t| matches!(t.dtype, DType::BF16 | DType::F16 | DType::F32))
        .filter_map(|t| {
            let name = ModuleName::parse(&t.name).filter(|n| n.is_linear_weight())?;
            let (out_features, in_features) = t.matrix_shape()?;
            Some(Projection {
                tensor: t.name.clone(),
                module_path: name.module_path(),
                out_features,
                in_features,
            })
        })
        .collect();
    out.sort_by(|a, b| a.tensor.cmp(&b.tensor));
    out
}

fn relative_totals<'a>(reports: impl Iterator<Item = &'a TargetReport> + Clone) -> TargetTotals {
    let sum = |f: &dyn Fn(&TargetReport) -> Option<f64>| -> Option<f64> {
        reports
            .clone()
            .map(|r| f(r).map(|x| x * x))
            .sum::<Option<f64>>()
            .map(f64::sqrt)
    };
    let merged = sum(&|r| Some(r.merged_norm)).unwrap_or(0.0);
    let weighted_merged = sum(&|r| r.weighted_merged_norm);
    let ratio = |x: Option<f64>, n: Option<f64>| x.zip(n).map(|(x, n)| x / n);
    TargetTotals {
        plain_relative: sum(&|r| Some(r.plain.residual)).unwrap_or(0.0) / merged,
        quantization_aware_relative: sum(&|r| Some(r.quantization_aware.residual)).unwrap_or(0.0)
            / merged,
        plain_weighted_relative: ratio(sum(&|r| r.plain.weighted_residual), weighted_merged),
        quantization_aware_weighted_relative: ratio(
            sum(&|r| r.quantization_aware.weighted_residual),
            weighted_merged,
        ),
        corrections: None,
    }
}

fn validate_rank(rank: RankChoice) -> Result<()> {
    if let RankChoice::Fixed(r) = rank {
        if !VLLM_MAX_LORA_RANKS.contains(&r) {
            return Err(ExtractError::InvalidParameter {
                name: "--rank",
                detail: format!("{r} is not a rank vLLM serves ({VLLM_MAX_LORA_RANKS:?}) or auto"),
            });
        }
    }
    Ok(())
}

/// Runs the extraction. Nothing appears at `options.out` unless every check passed.
/// With `threads > 0` everything (scan, conversions, products) runs on a pool that size.
pub fn extract(
    options: &ExtractOptions,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<ExtractionReport> {
    loraq_io::limits::check_threads(options.threads).map_err(|detail| {
        ExtractError::InvalidParameter {
            name: "--threads",
            detail,
        }
    })?;
    if options.threads == 0 {
        return extract_on_current_pool(options, progress);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(options.threads)
        .build()
        .map_err(|e| ExtractError::InvalidParameter {
            name: "--threads",
            detail: e.to_string(),
        })?;
    pool.install(|| extract_on_current_pool(options, progress))
}

fn extract_on_current_pool(
    options: &ExtractOptions,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<ExtractionReport> {
    let started = Instant::now();
    validate_rank(options.rank)?;
    validate_target_options(options)?;
    if !(options.max_residual_ratio.is_finite() && options.max_residual_ratio > 0.0) {
        return Err(ExtractError::InvalidParameter {
            name: "--max-residual-ratio",
            detail: "must be positive".into(),
        });
    }
    // Refuse an existing output, or one over an input, before any work.
    let mut inputs = vec![options.merged.as_path(), options.base.as_path()];
    inputs.extend(options.calibration.as_deref());
    if let Some(TargetSpec::Dir(dir)) = &options.target_base {
        inputs.push(dir);
    }
    let out = AtomicDir::create(&options.out, options.force, &inputs)?;
    let merged = Checkpoint::open(&options.merged)?;
    let base = Checkpoint::open(&options.base)?;
    let scanned = scan(&merged, &base)?.into_result()?;
    let target = options
        .target_base
        .as_ref()
        .map(|spec| TargetBase::open(spec, &base))
        .transpose()?;
    let calibration = options
        .calibration
        .as_deref()
        .map(Calibration::open)
        .transpose()?;
    let corrections_todo = if options.all_layers {
        let target = target
            .as_ref()
            .expect("validated: --all-layers needs a target");
        untouched_linears(&merged, &scanned)
            .into_iter()
            .filter(|p| target.may_change(&p.tensor))
            .collect()
    } else {
        Vec::new()
    };
    // Every module's statistics are checked before any work.
    if let Some(c) = &calibration {
        for p in scanned.projections.iter().chain(&corrections_todo) {
            c.input_sq_mean(&p.module_path, p.in_features)?;
        }
    }
    progress(Progress::Scanned(&scanned));
    let (merged_files, base_files) = (ShardFiles::open(&merged)?, ShardFiles::open(&base)?);

    let par = if options.threads == 0 {
        Par::rayon(0)
    } else {
        Par::rayon(options.threads)
    };
    let qa_context = target.as_ref().map(|target| QaContext {
        merged: &merged,
        base: &base,
        merged_files: &merged_files,
        base_files: &base_files,
        target,
        calibration: calibration.as_ref(),
        split: options.split,
        method: options.method,
        par,
    });
    let total = scanned.projections.len() + corrections_todo.len();
    let mut factors = Vec::with_capacity(total);
    let mut modules = Vec::with_capacity(total);
    let mut zero_delta = Vec::new();
    for (index, projection) in scanned.projections.iter().enumerate() {
        progress(Progress::ModuleStarted {
            index,
            total,
            projection,
        });
        let module_started = Instant::now();
        let (rows, cols) = (projection.out_features, projection.in_features);
        let (delta, floor) = delta_and_floor(&merged, &base, &projection.tensor)?;
        let max_rank = match options.rank {
            RankChoice::Fixed(r) => r,
            RankChoice::Auto => AUTO_RANK_CAP,
        };
        let params = FactorParams {
            max_rank,
            method: options.method,
            floor: Some(floor),
            par,
            ..FactorParams::default()
        };
        let f = match factorize(&projection.module_path, &delta, rows, cols, &params) {
            Err(ExtractError::AllZeroDelta { .. }) => {
                zero_delta.push(projection.tensor.clone());
                continue;
            }
            other => other?,
        };
        drop(delta);
        let rank = match options.rank {
            RankChoice::Fixed(_) => f.kept(),
            RankChoice::Auto => auto_rank(&f, floor),
        };
        let cast = split_and_cast(&projection.module_path, &f, rank, options.split, par)?;
        // Quantization-aware: the adapter written factors merged - target at rank +
        // extra; the plain factors above are measured on the target for comparison.
        let qa = match &qa_context {
            Some(ctx) => qa_module(
                ctx,
                &projection.tensor,
                &projection.module_path,
                (rank + options.extra_rank).min(MAX_MODULE_RANK),
                Some(&cast),
                Some(floor),
            )?,
            None => None,
        };
        let residual = f.truncation_residual(rank);
        let certificate = f.certificate(rank);
        let residual_after_cast = residual.hypot(cast.cast_error);
        let report = ModuleReport {
            module: projection.module_path.clone(),
            shape: [rows, cols],
            rank,
            adapter_rank: qa.as_ref().map_or(rank, |q| q.factors.rank),
            delta_norm: f.delta_norm(),
            floor,
            residual,
            ratio: residual / floor,
            expected_ratio: expected_floor_ratio(rows, cols, rank),
            cast_error: cast.cast_error,
            residual_after_cast,
            ratio_after_cast: residual_after_cast / floor,
            singular_values_kept: f.s[..rank].to_vec(),
            first_dropped: if rank < f.kept() {
                Some(f.s[rank])
            } else {
                f.first_dropped
            },
            certificate_residual: certificate.residual,
            method: f.method_used.as_str(),
            passes: f.passes,
            converged: f.converged,
            seconds: module_started.elapsed().as_secs_f64(),
            target: qa.as_ref().map(|q| q.report.clone()),
        };
        progress(Progress::ModuleDone(&report));
        modules.push(report);
        let written = qa.map_or(cast, |q| q.factors);
        factors.push(LoraFactors {
            module_path: projection.module_path.clone(),
            rank: written.rank,
            in_features: cols,
            out_features: rows,
            a_bf16: written.a_bf16,
            b_bf16: written.b_bf16,
        });
    }
    let mut corrections = Vec::new();
    for (i, projection) in corrections_todo.iter().enumerate() {
        let ctx = qa_context.as_ref().expect("corrections need a target");
        progress(Progress::ModuleStarted {
            index: scanned.projections.len() + i,
            total,
            projection,
        });
        let module_started = Instant::now();
        let Some(qa) = qa_module(
            ctx,
            &projection.tensor,
            &projection.module_path,
            options.correction_rank,
            None,
            None,
        )?
        else {
            continue;
        };
        let report = CorrectionReport {
            module: projection.module_path.clone(),
            shape: [projection.out_features, projection.in_features],
            adapter_rank: qa.factors.rank,
            target: qa.report,
            seconds: module_started.elapsed().as_secs_f64(),
        };
        progress(Progress::CorrectionDone(&report));
        factors.push(LoraFactors {
            module_path: projection.module_path.clone(),
            rank: qa.factors.rank,
            in_features: projection.in_features,
            out_features: projection.out_features,
            a_bf16: qa.factors.a_bf16,
            b_bf16: qa.factors.b_bf16,
        });
        corrections.push(report);
    }

    let above: Vec<(String, f64)> = modules
        .iter()
        // A NaN ratio is above every threshold.
        .filter(|m| crate::verify::above_threshold(m.ratio, options.max_residual_ratio))
        .map(|m| (m.module.clone(), m.ratio))
        .collect();
    if !above.is_empty() && !options.allow_residual {
        return Err(ExtractError::ResidualAboveThreshold {
            threshold: options.max_residual_ratio,
            modules: above,
        });
    }
    // The truncation residual can be at the floor while the bf16 cast adds more
    // than the floor (a delta as large as the weights: 0.16% of ||D|| against the
    // floor's ~0.11% of ||merged||); verify measures the factors as stored and
    // would reject them, so extract does not report success. A quantization-aware
    // adapter reproduces the merge on its target, not on this base: not compared.
    let verify_threshold = crate::verify::DEFAULT_MAX_RESIDUAL_RATIO;
    let cast_above: Vec<(String, f64)> = modules
        .iter()
        .filter(|m| {
            m.target.is_none()
                && crate::verify::above_threshold(m.ratio_after_cast, verify_threshold)
        })
        .map(|m| (m.module.clone(), m.ratio_after_cast))
        .collect();
    if !cast_above.is_empty() && !options.allow_residual {
        return Err(ExtractError::CastAboveVerifyThreshold {
            threshold: verify_threshold,
            modules: cast_above,
        });
    }
    if factors.is_empty() {
        return Err(ExtractError::Refused {
            refusals: vec![crate::error::Refusal {
                tensor: options.merged.display().to_string(),
                reason: "no projection differs from the base: there is no adapter to extract"
                    .into(),
            }],
        });
    }

    progress(Progress::Writing);
    // Module paths as the adapter names them; the report keeps the checkpoint's.
    let names = options.names;
    for f in &mut factors {
        f.module_path = names.module_path(&f.module_path);
    }
    let ranks: BTreeMap<String, usize> = modules
        .iter()
        .map(|m| (names.module_path(&m.module), m.adapter_rank))
        .chain(
            corrections
                .iter()
                .map(|c| (names.module_path(&c.module), c.adapter_rank)),
        )
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
    write_adapter(out.path(), &config, &factors)?;
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
    let copied = copy_files(&merged_dir, &options.copy, out.path())?;
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
        modules: modules
            .iter()
            .map(|m| ManifestModule {
                module: &m.module,
                adapter_module: names.module_path(&m.module),
                shape: m.shape,
                rank: m.adapter_rank,
                dtype: "BF16",
            })
            .chain(corrections.iter().map(|c| ManifestModule {
                module: &c.module,
                adapter_module: names.module_path(&c.module),
                shape: c.shape,
                rank: c.adapter_rank,
                dtype: "BF16",
            }))
            .collect(),
        copied: &copied,
    };
    write_json(&out.path().join(MANIFEST_FILE), &manifest)?;

    let low_rank: Vec<f64> = modules
        .iter()
        .filter(|m| m.rank < m.shape[0].min(m.shape[1]))
        .map(|m| m.ratio)
        .collect();
    let worst = modules.iter().max_by(|a, b| a.ratio.total_cmp(&b.ratio));
    let totals = Totals {
        modules: modules.len() + corrections.len(),
        parameters: modules
            .iter()
            .map(|m| (m.adapter_rank, m.shape))
            .chain(corrections.iter().map(|c| (c.adapter_rank, c.shape)))
            .map(|(rank, shape)| rank * (shape[0] + shape[1]))
            .sum(),
        max_ratio: worst.map_or(0.0, |m| m.ratio),
        max_ratio_module: worst.map(|m| m.module.clone()),
        mean_ratio_low_rank: (!low_rank.is_empty())
            .then(|| low_rank.iter().sum::<f64>() / low_rank.len() as f64),
        max_ratio_after_cast: modules
            .iter()
            .map(|m| m.ratio_after_cast)
            .fold(0.0, f64::max),
        above_threshold: above.into_iter().map(|(m, _)| m).collect(),
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
            calibration: calibration.as_ref().map(|c| CalibrationRecord {
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
        loading_class: loading_class(&merged, names),
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
        identical_tensors: scanned.identical,
        base_only: scanned.base_only.clone(),
        zero_delta,
        copied,
        modules,
        corrections,
        target_base: target_summary,
        totals,
    };
    report.totals.seconds = started.elapsed().as_secs_f64();
    write_json(&out.path().join(REPORT_FILE), &report)?;
    // The loading examples name the adapter where it will be once committed.
    let adapter_path = std::path::absolute(&options.out)
        .unwrap_or_else(|_| options.out.clone())
        .display()
        .to_string();
    let card = crate::card::render_model_card(&report, &adapter_path);
    std::fs::write(out.path().join(CARD_FILE), card).map_err(|source| ExtractError::Write {
        path: out.path().join(CARD_FILE),
        source,
    })?;
    write_sha256sums(out.path())?;

    // Validate what was written before it appears: the adapter parses as PEFT does,
    // every module maps back onto the merge's tensors (in either naming) with its shape
    // and rank, and every checksum holds.
    let mut written = LoraAdapter::open(out.path())?;
    written.map_onto(
        &ModulePathMap::from_tensor_names(merged.tensors().map(|t| t.name.as_str())),
        &options.merged.display().to_string(),
    )?;
    let expected: Vec<(&str, usize, [usize; 2])> = report
        .modules
        .iter()
        .map(|m| (m.module.as_str(), m.adapter_rank, m.shape))
        .chain(
            report
                .corrections
                .iter()
                .map(|c| (c.module.as_str(), c.adapter_rank, c.shape)),
        )
        .collect();
    for &(module, rank, shape) in &expected {
        let info = written
            .module(module)
            .ok_or_else(|| ExtractError::BadShape {
                module: module.to_string(),
                what: "missing from the written adapter".into(),
            })?;
        if info.rank != rank || [info.out_features, info.in_features] != shape || info.scale != 1.0
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
    if written.modules.len() != expected.len() {
        return Err(ExtractError::BadShape {
            module: options.out.display().to_string(),
            what: format!(
                "adapter holds {} modules, {} extracted",
                written.modules.len(),
                expected.len()
            ),
        });
    }
    verify_sha256sums(out.path())?;
    out.commit()?;
    Ok(report)
}
