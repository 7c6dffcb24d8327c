//! Checkpoint tensor names <-> GGUF tensor names for llama.cpp's `qwen3` and
//! `qwen35` architectures, both ways.
//!
//! The mapping is the one llama.cpp's converter applies (`convert_hf_to_gguf.py`
//! through `gguf-py/gguf/tensor_mapping.py`, `TensorNameMap`, with the names of
//! `gguf-py/gguf/constants.py`, `TENSOR_NAMES`, restricted to each architecture's
//! `MODEL_TENSORS` list): `post_attention_layernorm` is `post_attention_norm` in
//! qwen35 (which lists `ATTN_POST_NORM`) and `ffn_norm` in qwen3 (which lists
//! `FFN_NORM`); `dt_bias` becomes `ssm_dt.bias` and `A_log` becomes `ssm_a`
//! (`Qwen3NextModel.modify_tensors` in `conversion/qwen.py`).
//!
//! | checkpoint (under `<prefix>.layers.{i}.`) | GGUF (under `blk.{i}.`) |
//! |---|---|
//! | `input_layernorm.weight` | `attn_norm.weight` |
//! | `post_attention_layernorm.weight` | `post_attention_norm.weight` (qwen35), `ffn_norm.weight` (qwen3) |
//! | `self_attn.{q,k,v,o}_proj.weight` | `attn_{q,k,v}.weight`, `attn_output.weight` |
//! | `self_attn.{q,k}_norm.weight` | `attn_{q,k}_norm.weight` |
//! | `linear_attn.in_proj_qkv.weight` | `attn_qkv.weight` |
//! | `linear_attn.in_proj_z.weight` | `attn_gate.weight` |
//! | `linear_attn.in_proj_a.weight` / `in_proj_b.weight` | `ssm_alpha.weight` / `ssm_beta.weight` |
//! | `linear_attn.out_proj.weight` | `ssm_out.weight` |
//! | `linear_attn.conv1d.weight` | `ssm_conv1d.weight` |
//! | `linear_attn.A_log` / `dt_bias` | `ssm_a` / `ssm_dt.bias` |
//! | `linear_attn.norm.weight` | `ssm_norm.weight` |
//! | `mlp.{gate,up,down}_proj.weight` | `ffn_{gate,up,down}.weight` |
//!
//! and `embed_tokens.weight` <-> `token_embd.weight`, the final `norm.weight` <->
//! `output_norm.weight`, `lm_head.weight` <-> `output.weight`.

use loraq_io::{Architecture, Block, ModuleKind, ModuleName};
use std::fmt;

/// A llama.cpp architecture loraq maps names for (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufArch {
    /// `qwen3`: dense Qwen3.
    Qwen3,
    /// `qwen35`: the Qwen3.5 hybrid (Gated DeltaNet + attention).
    Qwen35,
}

impl GgufArch {
    /// The name GGUF stores in `general.architecture` and as the metadata prefix.
    pub fn as_str(self) -> &'static str {
        match self {
            GgufArch::Qwen3 => "qwen3",
            GgufArch::Qwen35 => "qwen35",
        }
    }

    /// The architecture named `name` in `general.architecture`.
    pub fn from_name(name: &str) -> Option<GgufArch> {
        match name {
            "qwen3" => Some(GgufArch::Qwen3),
            "qwen35" => Some(GgufArch::Qwen35),
            _ => None,
        }
    }

    /// The llama.cpp architecture a checkpoint of this family converts to
    /// (`Qwen3ForCausalLM` -> `Qwen3Model`, `Qwen3_5ForCausalLM` /
    /// `Qwen3_5ForConditionalGeneration` -> `Qwen3_5TextModel` in `conversion/qwen.py`).
    pub fn from_architecture(architecture: &Architecture) -> Option<GgufArch> {
        match architecture {
            Architecture::Qwen3 => Some(GgufArch::Qwen3),
            Architecture::Qwen3_5 | Architecture::Qwen3_5Text => Some(GgufArch::Qwen35),
            _ => None,
        }
    }
}

impl fmt::Display for GgufArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The GGUF name (without `blk.{i}.` and the parameter) of a layer module, or `None`
/// when the architecture has no such tensor.
fn module_stem(arch: GgufArch, block: Block, kind: ModuleKind) -> Option<&'static str> {
    use ModuleKind::*;
    Some(match (block, kind) {
        (Block::SelfAttn, QProj) => "attn_q",
        (Block::SelfAttn, KProj) => "attn_k",
        (Block::SelfAttn, VProj) => "attn_v",
        (Block::SelfAttn, OProj) => "attn_output",
        (Block::SelfAttn, QNorm) => "attn_q_norm",
        (Block::SelfAttn, KNorm) => "attn_k_norm",
        (Block::Mlp, GateProj) => "ffn_gate",
        (Block::Mlp, UpProj) => "ffn_up",
        (Block::Mlp, DownProj) => "ffn_down",
        (Block::LinearAttn, _) if arch == GgufArch::Qwen3 => return None,
        (Block::LinearAttn, InProjQkv) => "attn_qkv",
        (Block::LinearAttn, InProjZ) => "attn_gate",
        (Block::LinearAttn, InProjA) => "ssm_alpha",
        (Block::LinearAttn, InProjB) => "ssm_beta",
        (Block::LinearAttn, OutProj) => "ssm_out",
        (Block::LinearAttn, Conv1d) => "ssm_conv1d",
        (Block::LinearAttn, Norm) => "ssm_norm",
        _ => return None,
    })
}

/// Layer-level norms (directly under `layers.{i}`), checkpoint name -> GGUF stem.
fn layer_norm_stem(arch: GgufArch, name: &str) -> Option<&'static str> {
    match name {
        "input_layernorm" => Some("attn_norm"),
        "post_attention_layernorm" => Some(match arch {
            GgufArch::Qwen35 => "post_attention_norm",
            GgufArch::Qwen3 => "ffn_norm",
        }),
        _ => None,
    }
}

/// The GGUF tensor name of a linear module's weight, e.g. layer 3, `mlp`,
/// `down_proj` -> `blk.3.ffn_down.weight`; `None` when llama.cpp's architecture has
/// no tensor for it.
pub fn gguf_linear_weight_name(arch: GgufArch, module: &ModuleName) -> Option<String> {
    if !module.kind.is_linear() {
        return None;
    }
    let stem = module_stem(arch, module.block, module.kind)?;
    Some(format!("blk.{}.{stem}.weight", module.layer))
}

/// The GGUF name of a checkpoint tensor (the text backbone's: `model.` or
/// `model.language_model.` names, and `lm_head.weight`); `None` for a tensor the
/// converter does not write under a mapped name (vision tower, `mtp.*`, ...).
pub fn gguf_tensor_name(arch: GgufArch, checkpoint_name: &str) -> Option<String> {
    if checkpoint_name == "lm_head.weight" {
        return Some("output.weight".into());
    }
    if let Some(module) = ModuleName::parse(checkpoint_name) {
        let linear_attn = arch == GgufArch::Qwen35 && module.block == Block::LinearAttn;
        return match (module.kind, module.param.as_str()) {
            (ModuleKind::ALog, "") if linear_attn => Some(format!("blk.{}.ssm_a", module.layer)),
            (ModuleKind::DtBias, "") if linear_attn => {
                Some(format!("blk.{}.ssm_dt.bias", module.layer))
            }
            (kind, "weight") => Some(format!(
                "blk.{}.{}.weight",
                module.layer,
                module_stem(arch, module.block, kind)?
            )),
            _ => None,
        };
    }
    let rest = text_relative(checkpoint_name)?;
    match rest {
        "embed_tokens.weight" => return Some("token_embd.weight".into()),
        "norm.weight" => return Some("output_norm.weight".into()),
        _ => {}
    }
    let rest = rest.strip_prefix("layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (norm, param) = rest.split_once('.')?;
    if param != "weight" {
        return None;
    }
    Some(format!(
        "blk.{layer}.{}.weight",
        layer_norm_stem(arch, norm)?
    ))
}

/// The part of a text-backbone tensor name after `model.` or `model.language_model.`.
fn text_relative(name: &str) -> Option<&str> {
    name.strip_prefix(loraq_io::module_name::MULTIMODAL_TEXT_PREFIX)
        .or_else(|| name.strip_prefix(loraq_io::module_name::TEXT_PREFIX))
}

/// The checkpoint name of a GGUF tensor, with `prefix` before `layers` / `norm` /
/// `embed_tokens` (`model` or `model.language_model`); the inverse of
/// [`gguf_tensor_name`]. `None` for a name the architecture does not have.
pub fn checkpoint_tensor_name(arch: GgufArch, gguf_name: &str, prefix: &str) -> Option<String> {
    match gguf_name {
        "token_embd.weight" => return Some(format!("{prefix}.embed_tokens.weight")),
        "output_norm.weight" => return Some(format!("{prefix}.norm.weight")),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let digits = layer;
    let layer: usize = layer.parse().ok()?;
    // The converter writes no leading zeros: `blk.01.` names no tensor.
    if layer.to_string() != digits {
        return None;
    }
    let at = format!("{prefix}.layers.{layer}");
    match rest {
        "ssm_a" if arch == GgufArch::Qwen35 => return Some(format!("{at}.linear_attn.A_log")),
        "ssm_dt.bias" if arch == GgufArch::Qwen35 => {
            return Some(format!("{at}.linear_attn.dt_bias"));
        }
        _ => {}
    }
    let stem = rest.strip_suffix(".weight")?;
    for norm in ["input_layernorm", "post_attention_layernorm"] {
        if layer_norm_stem(arch, norm) == Some(stem) {
            return Some(format!("{at}.{norm}.weight"));
        }
    }
    for block in [Block::SelfAttn, Block::LinearAttn, Block::Mlp] {
        for &kind in ModuleKind::ALL {
            if module_stem(arch, block, kind) == Some(stem) {
                return Some(format!("{at}.{}.{}.weight", block.as_str(), kind.as_str()));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        let cases = [
            (
                GgufArch::Qwen35,
                "model.layers.0.linear_attn.in_proj_qkv.weight",
                "blk.0.attn_qkv.weight",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.0.linear_attn.in_proj_z.weight",
                "blk.0.attn_gate.weight",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.0.linear_attn.in_proj_a.weight",
                "blk.0.ssm_alpha.weight",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.0.linear_attn.in_proj_b.weight",
                "blk.0.ssm_beta.weight",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.0.linear_attn.out_proj.weight",
                "blk.0.ssm_out.weight",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.0.linear_attn.conv1d.weight",
                "blk.0.ssm_conv1d.weight",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.0.linear_attn.norm.weight",
                "blk.0.ssm_norm.weight",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.0.linear_attn.A_log",
                "blk.0.ssm_a",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.0.linear_attn.dt_bias",
                "blk.0.ssm_dt.bias",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.12.self_attn.o_proj.weight",
                "blk.12.attn_output.weight",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.1.self_attn.q_norm.weight",
                "blk.1.attn_q_norm.weight",
            ),
            (
                GgufArch::Qwen35,
                "model.layers.1.post_attention_layernorm.weight",
                "blk.1.post_attention_norm.weight",
            ),
            (
                GgufArch::Qwen3,
                "model.layers.1.post_attention_layernorm.weight",
                "blk.1.ffn_norm.weight",
            ),
            (
                GgufArch::Qwen3,
                "model.layers.1.input_layernorm.weight",
                "blk.1.attn_norm.weight",
            ),
            (
                GgufArch::Qwen3,
                "model.layers.2.mlp.down_proj.weight",
                "blk.2.ffn_down.weight",
            ),
            (
                GgufArch::Qwen3,
                "model.embed_tokens.weight",
                "token_embd.weight",
            ),
            (GgufArch::Qwen3, "model.norm.weight", "output_norm.weight"),
            (GgufArch::Qwen3, "lm_head.weight", "output.weight"),
        ];
        for (arch, checkpoint, gguf) in cases {
            assert_eq!(
                gguf_tensor_name(arch, checkpoint).as_deref(),
                Some(gguf),
                "{checkpoint}"
            );
            assert_eq!(
                checkpoint_tensor_name(arch, gguf, "model").as_deref(),
                Some(checkpoint),
                "{gguf}"
            );
        }
        let multimodal = "model.language_model.layers.3.mlp.up_proj.weight";
        assert_eq!(
            gguf_tensor_name(GgufArch::Qwen35, multimodal).as_deref(),
            Some("blk.3.ffn_up.weight")
        );
        assert_eq!(
            checkpoint_tensor_name(
                GgufArch::Qwen35,
                "blk.3.ffn_up.weight",
                "model.language_model"
            )
            .as_deref(),
            Some(multimodal)
        );
        // qwen3 has no linear attention; unknown and oddly written names map to nothing.
        assert_eq!(
            gguf_tensor_name(
                GgufArch::Qwen3,
                "model.layers.0.linear_attn.in_proj_z.weight"
            ),
            None
        );
        assert_eq!(
            checkpoint_tensor_name(GgufArch::Qwen3, "blk.0.ssm_a", "model"),
            None
        );
        assert_eq!(
            checkpoint_tensor_name(GgufArch::Qwen35, "blk.01.attn_q.weight", "model"),
            None
        );
        assert_eq!(
            checkpoint_tensor_name(GgufArch::Qwen35, "blk.x.attn_q.weight", "model"),
            None
        );
        assert_eq!(gguf_tensor_name(GgufArch::Qwen35, "mtp.fc.weight"), None);
    }
}
