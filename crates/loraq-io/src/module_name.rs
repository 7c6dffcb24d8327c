//! Decoder-layer tensor names: `<prefix>.layers.{i}.{block}.{module}[.{param}]`,
//! where the prefix is `model.language_model` (Qwen3.5 multimodal checkpoints),
//! `model` (text-only) or anything else that ends in `layers`.

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

#[cfg(test)]
mod tests {
    use super::*;

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
