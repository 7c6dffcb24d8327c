//! Decoder-layer tensor names: `<prefix>.layers.{i}.{block}.{module}[.{param}]`,
//! where the prefix is `model.language_model` (Qwen3.5 multimodal checkpoints),
//! `model` (text-only) or anything else that ends in `layers`.
//!
//! Also the two ways an adapter can name the same module ([`AdapterNaming`]), and the
//! one place that maps an adapter's module paths onto a checkpoint's ([`ModulePathMap`]).
//! A published Qwen3.5 checkpoint is `Qwen3_5ForConditionalGeneration`: its text
//! modules are `model.language_model.layers.*`. transformers 5.x loads the same files
//! through `AutoModelForCausalLM` as `Qwen3_5ForCausalLM`, renaming them to
//! `model.layers.*` (and dropping the vision tower). PEFT matches adapter keys by the
//! loaded model's module names, so an adapter written in one naming and loaded with the
//! other class applies nothing (PEFT only warns "Found missing adapter keys").

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// The block a module belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Block {
    /// Gated DeltaNet linear attention.
    LinearAttn,
    /// Softmax attention.
    SelfAttn,
    /// Feed-forward.
    Mlp,
}

impl Block {
    /// The name used in tensor paths.
    pub fn as_str(self) -> &'static str {
        match self {
            Block::LinearAttn => "linear_attn",
            Block::SelfAttn => "self_attn",
            Block::Mlp => "mlp",
        }
    }

    fn parse(s: &str) -> Option<Block> {
        match s {
            "linear_attn" => Some(Block::LinearAttn),
            "self_attn" => Some(Block::SelfAttn),
            "mlp" => Some(Block::Mlp),
            _ => None,
        }
    }
}

macro_rules! module_kinds {
    ($( $variant:ident => $name:literal, linear: $linear:literal; )*) => {
        /// A module of a decoder block.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum ModuleKind {
            $(
                #[doc = concat!("`", $name, "`")]
                $variant,
            )*
        }

        impl ModuleKind {
            /// Every known module kind.
            pub const ALL: &'static [ModuleKind] = &[$(ModuleKind::$variant),*];

            /// The name used in tensor paths.
            pub fn as_str(self) -> &'static str {
                match self { $(ModuleKind::$variant => $name),* }
            }

            /// Whether the module is a 2-D linear projection (a LoRA target).
            pub fn is_linear(self) -> bool {
                match self { $(ModuleKind::$variant => $linear),* }
            }

            /// Parses a module name.
            pub fn parse(s: &str) -> Option<ModuleKind> {
                match s { $($name => Some(ModuleKind::$variant),)* _ => None }
            }
        }
    };
}

module_kinds! {
    InProjQkv => "in_proj_qkv", linear: true;
    InProjZ => "in_proj_z", linear: true;
    InProjA => "in_proj_a", linear: true;
    InProjB => "in_proj_b", linear: true;
    InProjQkvz => "in_proj_qkvz", linear: true;
    InProjBa => "in_proj_ba", linear: true;
    OutProj => "out_proj", linear: true;
    Conv1d => "conv1d", linear: false;
    ALog => "A_log", linear: false;
    DtBias => "dt_bias", linear: false;
    Norm => "norm", linear: false;
    QProj => "q_proj", linear: true;
    KProj => "k_proj", linear: true;
    VProj => "v_proj", linear: true;
    OProj => "o_proj", linear: true;
    QNorm => "q_norm", linear: false;
    KNorm => "k_norm", linear: false;
    GateProj => "gate_proj", linear: true;
    UpProj => "up_proj", linear: true;
    DownProj => "down_proj", linear: true;
}

impl fmt::Display for ModuleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A parsed decoder-layer tensor name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModuleName {
    /// Everything before `.{layer}`, ending in `layers` (e.g. `model.language_model.layers`).
    pub prefix: String,
    /// Layer index.
    pub layer: usize,
    /// The block.
    pub block: Block,
    /// The module.
    pub kind: ModuleKind,
    /// What follows the module (`weight`, `weight_scale_inv`, ...; empty for `A_log`).
    pub param: String,
}

impl ModuleName {
    /// Parses `...layers.{i}.{block}.{module}[.{param}]`; `None` for anything else
    /// (embeddings, layer norms directly under the layer, lm_head, vision tower).
    pub fn parse(name: &str) -> Option<ModuleName> {
        let parts: Vec<&str> = name.split('.').collect();
        // The last `layers.<number>.<block>` triple wins, so a prefix that itself
        // contains "layers" (a vision tower nested in a layer) still parses right.
        let at = (0..parts.len().saturating_sub(3)).rev().find(|&i| {
            parts[i] == "layers"
                && parts[i + 1].parse::<usize>().is_ok()
                && Block::parse(parts[i + 2]).is_some()
        })?;
        let kind = ModuleKind::parse(parts.get(at + 3)?)?;
        Some(ModuleName {
            prefix: parts[..=at].join("."),
            layer: parts[at + 1].parse().ok()?,
            block: Block::parse(parts[at + 2])?,
            kind,
            param: parts[at + 4..].join("."),
        })
    }

    /// The module's path without the parameter, e.g.
    /// `model.language_model.layers.40.mlp.gate_proj`.
    pub fn module_path(&self) -> String {
        format!(
            "{}.{}.{}.{}",
            self.prefix,
            self.layer,
            self.block.as_str(),
            self.kind.as_str()
        )
    }

    /// Whether this names the weight of a linear projection.
    pub fn is_linear_weight(&self) -> bool {
        self.kind.is_linear() && self.param == "weight"
    }
}

/// The text backbone's prefix in multimodal checkpoints (`*ForConditionalGeneration`).
pub const MULTIMODAL_TEXT_PREFIX: &str = "model.language_model.";
/// The same modules' prefix in the text-only causal-LM class (`*ForCausalLM`).
pub const TEXT_PREFIX: &str = "model.";

/// How an adapter names the modules it adapts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AdapterNaming {
    /// As the checkpoint names its tensors (`model.language_model.layers.*` for a
    /// multimodal Qwen3.5 checkpoint): what the checkpoint's own class and vLLM load.
    Checkpoint,
    /// As `AutoModelForCausalLM` names the modules (`model.layers.*`): the text-only
    /// class transformers builds from the same checkpoint.
    Text,
}

impl AdapterNaming {
    /// The name used on the command line and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            AdapterNaming::Checkpoint => "checkpoint",
            AdapterNaming::Text => "text",
        }
    }

    /// Parses `checkpoint` or `text`.
    pub fn parse(s: &str) -> Option<AdapterNaming> {
        match s {
            "checkpoint" => Some(AdapterNaming::Checkpoint),
            "text" => Some(AdapterNaming::Text),
            _ => None,
        }
    }

    /// The adapter's name for a module the checkpoint calls `checkpoint_path`.
    pub fn module_path(self, checkpoint_path: &str) -> String {
        match self {
            AdapterNaming::Checkpoint => checkpoint_path.to_string(),
            AdapterNaming::Text => text_module_path(checkpoint_path),
        }
    }
}

impl fmt::Display for AdapterNaming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A module path as the text-only causal-LM class names it: a leading
/// `model.language_model.` becomes `model.`; any other path is unchanged (text-only
/// checkpoints already use that naming).
pub fn text_module_path(path: &str) -> String {
    match path.strip_prefix(MULTIMODAL_TEXT_PREFIX) {
        Some(rest) => format!("{TEXT_PREFIX}{rest}"),
        None => path.to_string(),
    }
}

/// The modules of a checkpoint, for mapping adapter module paths onto them.
///
/// A module path resolves to itself when the checkpoint has a tensor under it, else to
/// the one checkpoint module with the same text-only name ([`text_module_path`]), so an
/// adapter in either naming lands on the same tensors, and a path that names no module
/// of the checkpoint resolves to nothing (callers refuse it by name).
#[derive(Debug, Clone, Default)]
pub struct ModulePathMap {
    modules: BTreeSet<String>,
    /// Text-only name -> the checkpoint's module paths with that name.
    by_text_name: BTreeMap<String, Vec<String>>,
}

impl ModulePathMap {
    /// The modules under which `tensor_names` lie: every name without its last
    /// component (`X.weight`, `X.weight_scale_inv`, `X.weight_packed`, ... all give `X`).
    pub fn from_tensor_names<'a>(tensor_names: impl IntoIterator<Item = &'a str>) -> Self {
        Self::from_module_paths(
            tensor_names
                .into_iter()
                .filter_map(|name| name.rsplit_once('.').map(|(module, _)| module)),
        )
    }

    /// A map over the given module paths themselves (e.g. another adapter's modules).
    pub fn from_module_paths<'a>(module_paths: impl IntoIterator<Item = &'a str>) -> Self {
        let mut map = ModulePathMap::default();
        for path in module_paths {
            if map.modules.insert(path.to_string()) {
                map.by_text_name
                    .entry(text_module_path(path))
                    .or_default()
                    .push(path.to_string());
            }
        }
        map
    }

    /// The checkpoint's path for the module an adapter calls `adapter_path`, in either
    /// naming; `None` when it names no module of the checkpoint (or two, which only a
    /// checkpoint holding both namings could cause).
    pub fn resolve(&self, adapter_path: &str) -> Option<&str> {
        if let Some(path) = self.modules.get(adapter_path) {
            return Some(path.as_str());
        }
        match self
            .by_text_name
            .get(&text_module_path(adapter_path))?
            .as_slice()
        {
            [only] => Some(only.as_str()),
            _ => None,
        }
    }

    /// Whether any module of the checkpoint has a multimodal path, i.e. whether the two
    /// namings differ for it.
    pub fn has_multimodal_names(&self) -> bool {
        self.modules
            .iter()
            .any(|m| m.starts_with(MULTIMODAL_TEXT_PREFIX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_path_map_resolves_either_naming_onto_the_checkpoint() {
        let multimodal = ModulePathMap::from_tensor_names([
            "model.language_model.layers.3.mlp.up_proj.weight",
            "model.language_model.layers.3.self_attn.q_proj.weight_scale_inv",
            "model.visual.blocks.0.mlp.linear_fc1.weight",
        ]);
        assert!(multimodal.has_multimodal_names());
        for adapter in [
            "model.layers.3.mlp.up_proj",
            "model.language_model.layers.3.mlp.up_proj",
        ] {
            assert_eq!(
                multimodal.resolve(adapter),
                Some("model.language_model.layers.3.mlp.up_proj")
            );
        }
        assert_eq!(
            multimodal.resolve("model.layers.3.self_attn.q_proj"),
            Some("model.language_model.layers.3.self_attn.q_proj")
        );
        // A module the checkpoint does not have, in either naming, resolves to nothing.
        assert_eq!(multimodal.resolve("model.layers.4.mlp.up_proj"), None);
        assert_eq!(multimodal.resolve("model.layers.3.mlp.gate_proj"), None);
        // A multimodal adapter on a text-only checkpoint lands on the same modules.
        let text = ModulePathMap::from_tensor_names(["model.layers.3.mlp.up_proj.weight"]);
        assert!(!text.has_multimodal_names());
        assert_eq!(
            text.resolve("model.language_model.layers.3.mlp.up_proj"),
            Some("model.layers.3.mlp.up_proj")
        );
    }

    #[test]
    fn text_naming_renames_only_the_multimodal_prefix() {
        let naming = AdapterNaming::Text;
        assert_eq!(
            naming.module_path("model.language_model.layers.40.mlp.gate_proj"),
            "model.layers.40.mlp.gate_proj"
        );
        assert_eq!(
            naming.module_path("model.layers.40.mlp.gate_proj"),
            "model.layers.40.mlp.gate_proj"
        );
        assert_eq!(
            AdapterNaming::Checkpoint.module_path("model.language_model.layers.1.mlp.up_proj"),
            "model.language_model.layers.1.mlp.up_proj"
        );
        assert_eq!(AdapterNaming::parse("text"), Some(AdapterNaming::Text));
        assert_eq!(AdapterNaming::parse("causal"), None);
    }

    #[test]
    fn parses_both_prefixes() {
        let m = ModuleName::parse("model.language_model.layers.40.mlp.gate_proj.weight").unwrap();
        assert_eq!(m.prefix, "model.language_model.layers");
        assert_eq!(
            (m.layer, m.block, m.kind),
            (40, Block::Mlp, ModuleKind::GateProj)
        );
        assert!(m.is_linear_weight());
        assert_eq!(
            m.module_path(),
            "model.language_model.layers.40.mlp.gate_proj"
        );
        let m = ModuleName::parse("model.layers.3.linear_attn.A_log").unwrap();
        assert_eq!(
            (m.layer, m.kind, m.param.as_str()),
            (3, ModuleKind::ALog, "")
        );
        assert!(!m.is_linear_weight());
        let m = ModuleName::parse("model.layers.3.self_attn.q_proj.weight_scale_inv").unwrap();
        assert_eq!(m.param, "weight_scale_inv");
    }

    #[test]
    fn rejects_non_module_names() {
        assert!(ModuleName::parse("model.language_model.embed_tokens.weight").is_none());
        assert!(ModuleName::parse("model.layers.3.input_layernorm.weight").is_none());
        assert!(ModuleName::parse("lm_head.weight").is_none());
        assert!(ModuleName::parse("model.layers.x.mlp.up_proj.weight").is_none());
    }
}
