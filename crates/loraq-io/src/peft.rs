//! PEFT LoRA adapters: `adapter_config.json` and `adapter_model.safetensors`.
//!
//! Tensor names are `base_model.model.<module path>.lora_A.weight` ([r, in]) and
//! `.lora_B.weight` ([out, r]). A module's rank and alpha come from `rank_pattern` /
//! `alpha_pattern` when a key matches it, as PEFT matches them: the key is a regular
//! expression that must match the whole module path or a suffix of it starting after
//! a dot (a leading `^` anchors it at the start).

use crate::checkpoint::Checkpoint;
use crate::dtype::DType;
use crate::error::{IoError, OsContext, Result};
use crate::limits::elide;
use crate::module_name::ModulePathMap;
use crate::writer::{TensorSpec, write_safetensors_file};
use serde::{Deserialize, Serialize, Serializer};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// File name of the adapter weights.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// File name of the adapter configuration.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// Prefix PEFT puts before module paths in adapter tensor names.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// Ranks vLLM accepts as `--max-lora-rank`; an adapter's ranks must not exceed the
/// one it is served with.
pub const VLLM_MAX_LORA_RANKS: [usize; 9] = [1, 8, 16, 32, 64, 128, 256, 320, 512];

fn serialize_number<S: Serializer>(x: &f64, s: S) -> std::result::Result<S::Ok, S::Error> {
    // Whole alphas are written as integers, as PEFT writes `lora_alpha = r`.
    if x.fract() == 0.0 && x.abs() < 9.0e15 {
        s.serialize_i64(*x as i64)
    } else {
        s.serialize_f64(*x)
    }
}

fn serialize_number_map<S: Serializer>(
    map: &BTreeMap<String, f64>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(map.len()))?;
    for (k, v) in map {
        if v.fract() == 0.0 && v.abs() < 9.0e15 {
            m.serialize_entry(k, &(*v as i64))?;
        } else {
            m.serialize_entry(k, v)?;
        }
    }
    m.end()
}

fn default_lora() -> String {
    "LORA".into()
}

fn default_bias() -> String {
    "none".into()
}

/// PEFT's LoRA configuration, with the fields loraq writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterConfig {
    /// Always "LORA".
    #[serde(default = "default_lora")]
    pub peft_type: String,
    /// "CAUSAL_LM".
    #[serde(default)]
    pub task_type: Option<String>,
    /// Default rank.
    pub r: usize,
    /// Default alpha (scale = alpha / r).
    #[serde(serialize_with = "serialize_number")]
    pub lora_alpha: f64,
    /// Module names (last path component) the adapter targets.
    #[serde(default, deserialize_with = "target_modules_list")]
    pub target_modules: Vec<String>,
    /// Per-module ranks differing from `r`, keyed by `^`-anchored module paths.
    #[serde(default)]
    pub rank_pattern: BTreeMap<String, usize>,
    /// Per-module alphas, keyed like `rank_pattern`.
    #[serde(default, serialize_with = "serialize_number_map")]
    pub alpha_pattern: BTreeMap<String, f64>,
    /// The base model's name or path.
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    /// The base model's revision.
    #[serde(default)]
    pub revision: Option<String>,
    /// Always "none".
    #[serde(default = "default_bias")]
    pub bias: String,
    /// Rank-stabilized scaling ($\alpha / \sqrt{r}$); loraq writes false.
    #[serde(default)]
    pub use_rslora: bool,
    /// Dropout (0 for inference).
    #[serde(default)]
    pub lora_dropout: f64,
    /// Whether weights are stored transposed (GPT-2 Conv1D); loraq writes false.
    #[serde(default)]
    pub fan_in_fan_out: bool,
    /// Inference only.
    #[serde(default)]
    pub inference_mode: bool,
}

fn target_modules_list<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<String>, D::Error> {
    // PEFT allows a list or a single regex string.
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Targets {
        List(Vec<String>),
        One(String),
        Null,
    }
    Ok(match Targets::deserialize(d)? {
        Targets::List(l) => l,
        Targets::One(s) => vec![s],
        Targets::Null => Vec::new(),
    })
}

impl AdapterConfig {
    /// A loraq adapter config: alpha = r, scale 1 everywhere; `ranks` maps module
    /// paths to ranks, and those differing from `r` go into both patterns.
    pub fn for_ranks(
        r: usize,
        ranks: &BTreeMap<String, usize>,
        base_model_name_or_path: Option<String>,
        revision: Option<String>,
    ) -> AdapterConfig {
        let mut target_modules: Vec<String> = ranks
            .keys()
            .filter_map(|p| p.rsplit('.').next().map(str::to_string))
            .collect();
        target_modules.sort();
        target_modules.dedup();
        let rank_pattern: BTreeMap<String, usize> = ranks
            .iter()
            .filter(|&(_, &rank)| rank != r)
            .map(|(p, &rank)| (format!("^{p}"), rank))
            .collect();
        let alpha_pattern = rank_pattern
            .iter()
            .map(|(k, &v)| (k.clone(), v as f64))
            .collect();
        AdapterConfig {
            peft_type: "LORA".into(),
            task_type: Some("CAUSAL_LM".into()),
            r,
            lora_alpha: r as f64,
            target_modules,
            rank_pattern,
            alpha_pattern,
            base_model_name_or_path,
            revision,
            bias: "none".into(),
            use_rslora: false,
            lora_dropout: 0.0,
            fan_in_fan_out: false,
            inference_mode: true,
        }
    }

    fn pattern_key<'a, V>(map: &'a BTreeMap<String, V>, module_path: &str) -> Option<&'a V> {
        map.iter()
            .find(|(key, _)| pattern_matches(key, module_path))
            .map(|(_, v)| v)
    }

    /// Whether `target_modules` selects the module, as PEFT matches it: an entry
    /// equal to the path or to its last components after a dot, or (a single
    /// string in the file) a regular expression matching the whole path;
    /// `all-linear` and an absent list select every module.
    pub fn targets(&self, module_path: &str) -> bool {
        // A one-element list and a single string read alike; accepting either
        // reading never refuses an adapter that PEFT would apply.
        self.target_modules.is_empty()
            || self.target_modules.iter().any(|target| {
                target == "all-linear"
                    || target == module_path
                    || module_path
                        .strip_suffix(target.as_str())
                        .is_some_and(|head| head.ends_with('.'))
                    || regex::Regex::new(&format!("^(?:{target})$"))
                        .is_ok_and(|re| re.is_match(module_path))
            })
    }

    /// The module's rank as PEFT resolves it.
    pub fn rank_for(&self, module_path: &str) -> usize {
        Self::pattern_key(&self.rank_pattern, module_path)
            .copied()
            .unwrap_or(self.r)
    }

    /// The module's alpha as PEFT resolves it.
    pub fn alpha_for(&self, module_path: &str) -> f64 {
        Self::pattern_key(&self.alpha_pattern, module_path)
            .copied()
            .unwrap_or(self.lora_alpha)
    }

    /// The module's scale: $\alpha / r$, or $\alpha / \sqrt{r}$ with rsLoRA.
    pub fn scale_for(&self, module_path: &str) -> f64 {
        let r = self.rank_for(module_path) as f64;
        let alpha = self.alpha_for(module_path);
        if self.use_rslora {
            alpha / r.sqrt()
        } else {
            alpha / r
        }
    }
}

/// Whether a rank/alpha pattern key matches a module path, as PEFT matches it:
/// the key must match the whole path, or a suffix of it that starts after a dot.
pub fn pattern_matches(key: &str, module_path: &str) -> bool {
    if key == module_path {
        return true;
    }
    let body = key.strip_prefix('^').unwrap_or(key);
    let anchored = key.starts_with('^');
    let pattern = if anchored {
        format!("^(?:{body})$")
    } else {
        format!(r"^(?:.*\.)?(?:{body})$")
    };
    regex::Regex::new(&pattern).is_ok_and(|re| re.is_match(module_path))
}

/// One adapted module as found in an adapter directory.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraModuleInfo {
    /// Module path without PEFT's prefix, e.g. `model.language_model.layers.40.mlp.up_proj`:
    /// as the adapter names it, or the checkpoint's name for it after
    /// [`LoraAdapter::map_onto`].
    pub module_path: String,
    /// The module path as the adapter's tensor names spell it.
    pub stored_path: String,
    /// Rank (rows of A).
    pub rank: usize,
    /// Input features (columns of A).
    pub in_features: usize,
    /// Output features (rows of B).
    pub out_features: usize,
    /// alpha / r for this module.
    pub scale: f64,
}

/// An adapter directory opened for reading.
#[derive(Debug)]
pub struct LoraAdapter {
    /// The configuration.
    pub config: AdapterConfig,
    /// Every module, sorted by path.
    pub modules: Vec<LoraModuleInfo>,
    dir: PathBuf,
    weights: Checkpoint,
}

fn a_name(module_path: &str) -> String {
    format!("{PEFT_PREFIX}{module_path}.lora_A.weight")
}

fn b_name(module_path: &str) -> String {
    format!("{PEFT_PREFIX}{module_path}.lora_B.weight")
}

impl LoraAdapter {
    /// Opens and validates an adapter directory.
    pub fn open(dir: impl AsRef<Path>) -> Result<LoraAdapter> {
        let dir = dir.as_ref();
        let config_path = dir.join(ADAPTER_CONFIG_FILE);
        let text = std::fs::read_to_string(&config_path).map_err(|source| {
            IoError::opening(&config_path, source, " (not a PEFT adapter directory)")
        })?;
        let config: AdapterConfig = serde_json::from_str(&text).map_err(|e| IoError::Json {
            path: config_path.clone(),
            reason: e.to_string(),
        })?;
        if config.peft_type != "LORA" {
            return Err(IoError::Adapter {
                path: config_path,
                reason: format!("peft_type is {:?}, not \"LORA\"", config.peft_type),
            });
        }
        if config.fan_in_fan_out {
            return Err(IoError::Adapter {
                path: config_path,
                reason: "fan_in_fan_out is true: the factors are stored transposed for GPT-2 style Conv1D layers, which loraq cannot apply (PEFT would transpose them; loraq reads [out, in] linears only)".into(),
            });
        }
        let weights_path = dir.join(ADAPTER_WEIGHTS_FILE);
        let weights = Checkpoint::open(&weights_path)?;
        let bad = |reason: String| IoError::Adapter {
            path: weights_path.clone(),
            reason,
        };
        let mut modules = Vec::new();
        for info in weights.tensors() {
            if let Some(path) = info.name.strip_suffix(".lora_B.weight") {
                let module = path.strip_prefix(PEFT_PREFIX).unwrap_or(path);
                if !weights.contains(&a_name(module)) {
                    return Err(bad(format!("{} has no matching lora_A", info.name)));
                }
                continue;
            }
            let Some(path) = info.name.strip_suffix(".lora_A.weight") else {
                return Err(bad(format!(
                    "tensor {} is not a lora_A/lora_B weight (vLLM refuses extra tensors)",
                    info.name
                )));
            };
            let module_path = path.strip_prefix(PEFT_PREFIX).unwrap_or(path).to_string();
            let b = weights
                .get(&b_name(&module_path))
                .ok_or_else(|| bad(format!("{} has no matching lora_B", info.name)))?;
            let (rank, in_features) = info
                .matrix_shape()
                .ok_or_else(|| bad(format!("{} is not 2-D: {:?}", info.name, info.shape)))?;
            let (out_features, b_rank) = b
                .matrix_shape()
                .ok_or_else(|| bad(format!("{} is not 2-D: {:?}", b.name, b.shape)))?;
            if b_rank != rank {
                return Err(bad(format!(
                    "{module_path}: lora_A has rank {rank}, lora_B has {b_rank}"
                )));
            }
            if rank == 0 {
                return Err(bad(format!(
                    "{}: rank 0 (lora_A has no rows): the scale alpha / r is undefined",
                    elide(&module_path)
                )));
            }
            if !config.targets(&module_path) {
                return Err(IoError::Adapter {
                    path: config_path,
                    reason: format!(
                        "module {} is not matched by target_modules {}: PEFT would leave it without an adapter and ignore its factors",
                        elide(&module_path),
                        elide(&format!("{:?}", config.target_modules))
                    ),
                });
            }
            let declared = config.rank_for(&module_path);
            if declared != rank {
                return Err(bad(format!(
                    "{module_path}: tensors have rank {rank}, adapter_config.json says {declared}"
                )));
            }
            let scale = config.scale_for(&module_path);
            if !scale.is_finite() {
                return Err(IoError::Adapter {
                    path: config_path,
                    reason: format!(
                        "{}: the scale (alpha {} over rank {rank}) is {scale}, not a finite number",
                        elide(&module_path),
                        config.alpha_for(&module_path)
                    ),
                });
            }
            modules.push(LoraModuleInfo {
                scale,
                stored_path: module_path.clone(),
                module_path,
                rank,
                in_features,
                out_features,
            });
        }
        modules.sort_by(|a, b| a.module_path.cmp(&b.module_path));
        Ok(LoraAdapter {
            config,
            modules,
            dir: dir.to_path_buf(),
            weights,
        })
    }

    /// Opens an adapter directory and maps its modules onto `checkpoint`'s names
    /// ([`LoraAdapter::map_onto`]), so an adapter in either naming applies to it.
    pub fn open_for(dir: impl AsRef<Path>, checkpoint: &Checkpoint) -> Result<LoraAdapter> {
        let mut adapter = LoraAdapter::open(dir)?;
        let map = ModulePathMap::from_tensor_names(checkpoint.tensors().map(|t| t.name.as_str()));
        adapter.map_onto(&map, &checkpoint.root().display().to_string())?;
        Ok(adapter)
    }

    /// Renames every module to the path `map` resolves it to (the same module in the
    /// checkpoint's naming; see [`ModulePathMap::resolve`]). A module that resolves to
    /// nothing is refused by name, never skipped: an adapter that silently applies to
    /// fewer modules than it holds is the failure this guards against. `target` names
    /// what the map describes, for the message.
    pub fn map_onto(&mut self, map: &ModulePathMap, target: &str) -> Result<()> {
        let mut unmatched = Vec::new();
        let mut resolved = BTreeMap::<String, &str>::new();
        for m in &self.modules {
            match map.resolve(&m.stored_path) {
                Some(path) => {
                    if let Some(other) = resolved.insert(path.to_string(), &m.stored_path) {
                        return Err(IoError::Adapter {
                            path: self.dir.clone(),
                            reason: format!(
                                "modules {other} and {} are the same module {path} of {target} (the adapter holds it in both namings)",
                                m.stored_path
                            ),
                        });
                    }
                }
                None => unmatched.push(m.stored_path.as_str()),
            }
        }
        if !unmatched.is_empty() {
            return Err(IoError::Adapter {
                path: self.dir.clone(),
                reason: format!(
                    "{} module(s) name no module of {target}, neither as written nor in the other naming (model.layers.* <-> model.language_model.layers.*): {}",
                    unmatched.len(),
                    unmatched.join(", ")
                ),
            });
        }
        for m in &mut self.modules {
            if let Some(path) = map.resolve(&m.stored_path) {
                m.module_path = path.to_string();
            }
        }
        self.modules
            .sort_by(|a, b| a.module_path.cmp(&b.module_path));
        Ok(())
    }

    /// The directory the adapter was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The module with that path.
    pub fn module(&self, module_path: &str) -> Option<&LoraModuleInfo> {
        self.modules.iter().find(|m| m.module_path == module_path)
    }

    /// The path the adapter's tensor names use for `module_path` (itself when the
    /// module is not known: the read then fails naming the tensor).
    fn stored_path<'a>(&'a self, module_path: &'a str) -> &'a str {
        self.module(module_path)
            .map_or(module_path, |m| m.stored_path.as_str())
    }

    /// lora_A of a module as f32, row-major [rank, in].
    /// A NaN or infinite entry is refused with the file, tensor and element.
    pub fn read_a_f32(&self, module_path: &str) -> Result<Vec<f32>> {
        self.weights
            .read_f32_finite(&a_name(self.stored_path(module_path)))
    }

    /// lora_B of a module as f32, row-major [out, rank].
    /// A NaN or infinite entry is refused with the file, tensor and element.
    pub fn read_b_f32(&self, module_path: &str) -> Result<Vec<f32>> {
        self.weights
            .read_f32_finite(&b_name(self.stored_path(module_path)))
    }

    /// lora_A of a module as its stored bf16 values, row-major [rank, in]. A factor
    /// stored in another dtype is refused, and so is a NaN or infinite entry, with the
    /// file, tensor and element.
    pub fn read_a_bf16(&self, module_path: &str) -> Result<Vec<half::bf16>> {
        self.weights
            .read_bf16_finite(&a_name(self.stored_path(module_path)))
    }

    /// lora_B of a module as its stored bf16 values, row-major [out, rank] (refusals as
    /// [`LoraAdapter::read_a_bf16`]).
    pub fn read_b_bf16(&self, module_path: &str) -> Result<Vec<half::bf16>> {
        self.weights
            .read_bf16_finite(&b_name(self.stored_path(module_path)))
    }

    /// The dtypes lora_A and lora_B of a module are stored in.
    pub fn factor_dtypes(&self, module_path: &str) -> Result<(DType, DType)> {
        let stored = self.stored_path(module_path);
        Ok((
            self.weights.info(&a_name(stored))?.dtype,
            self.weights.info(&b_name(stored))?.dtype,
        ))
    }

    /// The dtype lora_A of a module is stored in.
    pub fn factor_dtype(&self, module_path: &str) -> Result<DType> {
        Ok(self
            .weights
            .info(&a_name(self.stored_path(module_path)))?
            .dtype)
    }
}

/// The factors of one module in bf16, ready to write.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraFactors {
    /// Module path without PEFT's prefix.
    pub module_path: String,
    /// Rank.
    pub rank: usize,
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    /// lora_A as little-endian bf16 bytes, row-major [rank, in].
    pub a_bf16: Vec<u8>,
    /// lora_B as little-endian bf16 bytes, row-major [out, rank].
    pub b_bf16: Vec<u8>,
}

/// Writes `adapter_model.safetensors` and `adapter_config.json` into `dir`.
/// Checks that every module's rank agrees with the config and is servable by vLLM.
pub fn write_adapter(dir: &Path, config: &AdapterConfig, modules: &[LoraFactors]) -> Result<()> {
    let weights_path = dir.join(ADAPTER_WEIGHTS_FILE);
    let mut tensors: Vec<(TensorSpec, &[u8])> = Vec::with_capacity(modules.len() * 2);
    let max_rank = VLLM_MAX_LORA_RANKS[VLLM_MAX_LORA_RANKS.len() - 1];
    for m in modules {
        let declared = config.rank_for(&m.module_path);
        if declared != m.rank || m.rank == 0 || m.rank > max_rank {
            return Err(IoError::Adapter {
                path: weights_path.clone(),
                reason: format!(
                    "{}: rank {} (config says {declared}; vLLM serves ranks 1..={max_rank})",
                    m.module_path, m.rank
                ),
            });
        }
        tensors.push((
            TensorSpec::new(
                a_name(&m.module_path),
                DType::BF16,
                vec![m.rank, m.in_features],
            ),
            &m.a_bf16,
        ));
        tensors.push((
            TensorSpec::new(
                b_name(&m.module_path),
                DType::BF16,
                vec![m.out_features, m.rank],
            ),
            &m.b_bf16,
        ));
    }
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors_file(&weights_path, &tensors, &metadata)?;
    let config_path = dir.join(ADAPTER_CONFIG_FILE);
    let text = serde_json::to_string_pretty(config).expect("config serializes");
    std::fs::write(&config_path, text + "\n").at(&config_path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchored_and_suffix_keys_match_like_peft() {
        let path = "model.language_model.layers.40.linear_attn.in_proj_a";
        assert!(pattern_matches(&format!("^{}", regex::escape(path)), path));
        assert!(pattern_matches("in_proj_a", path));
        assert!(pattern_matches(r"layers\.40\.linear_attn\.in_proj_a", path));
        assert!(!pattern_matches("proj_a", path));
        assert!(!pattern_matches("^layers.40.linear_attn.in_proj_a", path));
    }

    #[test]
    fn target_modules_select_modules_like_peft() {
        let path = "model.layers.3.self_attn.q_proj";
        let with = |targets: &[&str]| AdapterConfig {
            target_modules: targets.iter().map(|t| t.to_string()).collect(),
            ..AdapterConfig::for_ranks(8, &BTreeMap::new(), None, None)
        };
        assert!(with(&["q_proj", "v_proj"]).targets(path));
        assert!(with(&["self_attn.q_proj"]).targets(path));
        assert!(with(&[r".*layers\.3\..*q_proj"]).targets(path));
        assert!(with(&["all-linear"]).targets(path));
        assert!(with(&[]).targets(path));
        assert!(!with(&["v_proj"]).targets(path));
        // A suffix must start after a dot: "proj" does not select "q_proj".
        assert!(!with(&["proj"]).targets(path));
    }

    #[test]
    fn config_serializes_alpha_as_integer_and_patterns_identical() {
        let ranks = BTreeMap::from([
            ("model.layers.0.mlp.up_proj".to_string(), 256),
            ("model.layers.0.linear_attn.in_proj_a".to_string(), 48),
        ]);
        let c = AdapterConfig::for_ranks(256, &ranks, None, None);
        let v: serde_json::Value = serde_json::to_value(&c).unwrap();
        assert_eq!(v["lora_alpha"], serde_json::json!(256));
        assert_eq!(v["rank_pattern"], v["alpha_pattern"]);
        assert_eq!(c.rank_for("model.layers.0.linear_attn.in_proj_a"), 48);
        assert_eq!(c.scale_for("model.layers.0.linear_attn.in_proj_a"), 1.0);
        assert_eq!(c.target_modules, vec!["in_proj_a", "up_proj"]);
        assert!(v.get("modules_to_save").is_none());
    }
}
