//! What `loraq extract` takes: [`ExtractOptions`], the rank choice, the output
//! file names.

use crate::factor::Method;
use crate::split::Split;
use crate::target::TargetSpec;
use loraq_io::AdapterNaming;
use std::path::PathBuf;

/// The largest rank `--rank auto` goes to.
pub const AUTO_RANK_CAP: usize = 512;
/// `--rank auto` keeps the smallest rank whose residual is within this factor of what a
/// perfect fit leaves against the floor ($\rho^\ast(k) F$).
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
    pub activation_stats: Option<PathBuf>,
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
            activation_stats: None,
            extra_rank: 0,
            all_layers: false,
            correction_rank: 0,
        }
    }
}
