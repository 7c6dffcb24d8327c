//! A PEFT LoRA adapter exported as a llama.cpp LoRA adapter (GGUF).
//!
//! What llama.cpp reads (`llama_adapter_lora_init_impl` in `src/llama-adapter.cpp`,
//! the keys of `gguf-py/gguf/constants.py`, `Keys.Adapter`): `general.type =
//! "adapter"`, `adapter.type = "lora"`, `general.architecture` equal to the base's,
//! `adapter.lora.alpha` (FLOAT32); for each adapted weight `W` named `N` in the base,
//! `N.lora_a` with shape `[rank, in_features]` (ggml dimensions `[in_features, rank]`)
//! and `N.lora_b` with shape `[out_features, rank]`. Each product is scaled by
//! `request_scale * alpha / rank`, `rank` being that tensor's, or by
//! `request_scale` alone when alpha is 0 (`llama_adapter_lora_weight::get_scale` in
//! `src/llama-adapter.h`).
//!
//! PEFT's scale is `alpha_m / r_m` per module (`rank_pattern`, `alpha_pattern`), or
//! `alpha_m / sqrt(r_m)` with rsLoRA. One GGUF alpha reproduces it only when
//! `scale_m * r_m` is the same for every module. So: when it is, the file gets that
//! alpha and the factors unchanged (bit-identical to PEFT's, and what llama.cpp's
//! `convert_lora_to_gguf.py` writes for such an adapter); otherwise it gets alpha 0
//! and each module's scale is folded into its B (`B * scale_m`, computed in f32 and
//! rounded once to the output type), where llama.cpp's own converter, which writes
//! `lora_alpha` alone, would scale every module with a rank or alpha pattern wrongly.
//!
//! Names are mapped as [`crate::names`] maps them and, for `qwen35` with fewer key
//! than value heads, the rows of B (`in_proj_qkv`'s V part, `in_proj_z`, `in_proj_a`,
//! `in_proj_b`) and the columns of A (`out_proj`) are permuted as [`crate::vhead`]
//! describes. Refused by module: a module llama.cpp has no tensor for, a shape that
//! differs from the base weight's, DoRA, bias LoRA, `modules_to_save`.

use crate::error::{GgufError, Result};
use crate::ggml_type::GgmlType;
use crate::names::{GgufArch, gguf_linear_weight_name};
use crate::reader::GgufModel;
use crate::value::MetadataValue;
use crate::vhead::{PermutedAxis, VHeadLayout, gather_columns, gather_rows};
use crate::writer::GgufWriter;
use loraq_io::{Checkpoint, LoraAdapter, ModuleName};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `general.type` of an adapter.
pub const GENERAL_TYPE_ADAPTER: &str = "adapter";
/// `adapter.type` of a LoRA adapter.
pub const ADAPTER_TYPE_LORA: &str = "lora";
/// The key of the LoRA alpha.
pub const LORA_ALPHA_KEY: &str = "adapter.lora.alpha";
/// ggml's quantization version (`GGML_QNT_VERSION`), which the converters write as
/// `general.quantization_version`.
pub const QUANTIZATION_VERSION: u32 = 2;

/// The element type of the exported factors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FactorType {
    /// bfloat16 (PEFT's own factors are bf16: unchanged when nothing is folded).
    Bf16,
    /// IEEE half precision.
    F16,
    /// IEEE single precision.
    F32,
}

impl FactorType {
    fn ggml(self) -> GgmlType {
        match self {
            FactorType::Bf16 => GgmlType::BF16,
            FactorType::F16 => GgmlType::F16,
            FactorType::F32 => GgmlType::F32,
        }
    }

    /// Parses `bf16`, `f16` or `f32`.
    pub fn parse(text: &str) -> Option<FactorType> {
        match text {
            "bf16" => Some(FactorType::Bf16),
            "f16" => Some(FactorType::F16),
            "f32" => Some(FactorType::F32),
            _ => None,
        }
    }

    /// Encodes values, or returns the first one that does not fit (f16 overflow).
    fn encode(self, values: &[f32]) -> std::result::Result<Vec<u8>, usize> {
        let mut out = Vec::with_capacity(values.len() * 4);
        for (i, &x) in values.iter().enumerate() {
            match self {
                FactorType::F32 => out.extend_from_slice(&x.to_le_bytes()),
                FactorType::Bf16 => {
                    let y = half::bf16::from_f32(x);
                    if !y.is_finite() {
                        return Err(i);
                    }
                    out.extend_from_slice(&y.to_le_bytes());
                }
                FactorType::F16 => {
                    let y = half::f16::from_f32(x);
                    if !y.is_finite() {
                        return Err(i);
                    }
                    out.extend_from_slice(&y.to_le_bytes());
                }
            }
        }
        Ok(out)
    }
}

/// What an adapter is exported against: the base's llama.cpp architecture, its
/// value-head layout, and the shape (`[out_features, in_features]`) of every linear
/// weight by GGUF name.
#[derive(Debug, Clone)]
pub struct BaseLayout {
    /// The base, for messages.
    pub path: PathBuf,
    /// llama.cpp's architecture.
    pub arch: GgufArch,
    /// The linear-attention heads (qwen35).
    pub v_heads: Option<VHeadLayout>,
    /// GGUF weight name -> `[out_features, in_features]`.
    pub weight_shapes: BTreeMap<String, [usize; 2]>,
}

impl BaseLayout {
    /// Opens a base: a `.gguf` file (or the first file of a split model) or a
    /// checkpoint directory with config.json.
    pub fn open(path: &Path) -> Result<BaseLayout> {
        if path.extension().is_some_and(|e| e == "gguf") {
            BaseLayout::from_gguf(&GgufModel::open(path)?)
        } else {
            BaseLayout::from_checkpoint(&Checkpoint::open(path)?)
        }
    }

    /// The layout of a checkpoint (its config.json gives the architecture and heads).
    pub fn from_checkpoint(checkpoint: &Checkpoint) -> Result<BaseLayout> {
        let path = checkpoint.root().to_path_buf();
        let config = checkpoint.config().ok_or_else(|| GgufError::Format {
            path: path.clone(),
            reason: "no config.json: the architecture and head layout are unknown".into(),
        })?;
        let arch =
            GgufArch::from_architecture(&config.architecture).ok_or_else(|| GgufError::Format {
                path: path.clone(),
                reason: format!(
                    "architecture {}: loraq maps names for llama.cpp's qwen3 and qwen35 only",
                    config.architecture
                ),
            })?;
        let v_heads = (arch == GgufArch::Qwen35).then(|| VHeadLayout {
            num_k_heads: config.text_usize("linear_num_key_heads").unwrap_or(0),
            num_v_heads: config.text_usize("linear_num_value_heads").unwrap_or(0),
            head_k_dim: config.text_usize("linear_key_head_dim").unwrap_or(0),
            head_v_dim: config.text_usize("linear_value_head_dim").unwrap_or(0),
        });
        let mut weight_shapes = BTreeMap::new();
        for t in checkpoint.tensors() {
            if let (Some(m), Some((out_features, in_features))) =
                (ModuleName::parse(&t.name), t.matrix_shape())
                && m.is_linear_weight()
                && let Some(name) = gguf_linear_weight_name(arch, &m)
            {
                weight_shapes.insert(name, [out_features, in_features]);
            }
        }
        Ok(BaseLayout {
            path,
            arch,
            v_heads,
            weight_shapes,
        })
    }

    /// The layout of a GGUF model (`general.architecture`, the `ssm.*` keys, the
    /// tensors' dimensions).
    pub fn from_gguf(model: &GgufModel) -> Result<BaseLayout> {
        let name = model.require_str("general.architecture")?;
        let arch = GgufArch::from_name(name).ok_or_else(|| GgufError::Metadata {
            path: model.path().to_path_buf(),
            key: "general.architecture".into(),
            reason: format!("{name:?}: loraq maps names for qwen3 and qwen35 only"),
        })?;
        let v_heads = if arch == GgufArch::Qwen35 {
            Some(crate::base::v_heads(model, arch)?)
        } else {
            None
        };
        let mut weight_shapes = BTreeMap::new();
        for t in model.tensors() {
            if let [in_features, out_features] = t.dims[..] {
                weight_shapes.insert(
                    t.name.clone(),
                    [out_features as usize, in_features as usize],
                );
            }
        }
        Ok(BaseLayout {
            path: model.path().to_path_buf(),
            arch,
            v_heads,
            weight_shapes,
        })
    }
}

/// One exported module.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ExportedModule {
    /// The module path as the adapter names it.
    pub module: String,
    /// The base's GGUF weight name (the tensors are `<name>.lora_a` / `.lora_b`).
    pub gguf_name: String,
    /// Rank.
    pub rank: usize,
    /// PEFT's scale for the module.
    pub scale: f64,
    /// Whether the value heads were reordered.
    pub v_heads_reordered: bool,
}

/// How the adapter's scales were written.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ExportSummary {
    /// llama.cpp's architecture.
    pub architecture: String,
    /// `adapter.lora.alpha` as written.
    pub alpha: f32,
    /// Whether each module's scale was folded into its B (alpha 0).
    pub scales_folded: bool,
    /// The factors' type.
    pub dtype: FactorType,
    /// Every module, in the file's order.
    pub modules: Vec<ExportedModule>,
}

/// Reads the adapter config's fields that llama.cpp cannot represent and refuses them.
fn refuse_unrepresentable(adapter: &LoraAdapter) -> Result<()> {
    let path = adapter.dir().join(loraq_io::peft::ADAPTER_CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(crate::error::os(&path))?;
    let raw: serde_json::Value = serde_json::from_str(&text).map_err(|e| GgufError::Format {
        path: path.clone(),
        reason: format!("not valid JSON: {e}"),
    })?;
    let refuse = |what: &str| GgufError::Adapter {
        path: adapter.dir().to_path_buf(),
        module: "(every module)".into(),
        reason: format!("{what}: llama.cpp's LoRA adapters hold lora_a / lora_b only"),
    };
    if raw.get("use_dora").and_then(|v| v.as_bool()) == Some(true) {
        return Err(refuse("use_dora is true (DoRA's magnitude vectors)"));
    }
    if raw.get("lora_bias").and_then(|v| v.as_bool()) == Some(true) {
        return Err(refuse("lora_bias is true (a bias on lora_B)"));
    }
    if adapter.config.bias != "none" {
        return Err(refuse(&format!(
            "bias is {:?} (trained biases)",
            adapter.config.bias
        )));
    }
    if raw
        .get("modules_to_save")
        .and_then(|v| v.as_array())
        .is_some_and(|a| !a.is_empty())
    {
        return Err(refuse(
            "modules_to_save is not empty (fully trained modules)",
        ));
    }
    Ok(())
}

/// Builds the GGUF LoRA of `adapter` for `base`, in memory; write it with
/// [`GgufWriter::write`] (to a staged path) or [`GgufWriter::write_atomically`].
pub fn export_adapter(
    adapter: &LoraAdapter,
    base: &BaseLayout,
    dtype: FactorType,
) -> Result<(GgufWriter, ExportSummary)> {
    refuse_unrepresentable(adapter)?;
    let refuse = |module: &str, reason: String| GgufError::Adapter {
        path: adapter.dir().to_path_buf(),
        module: module.into(),
        reason,
    };
    if adapter.modules.is_empty() {
        return Err(refuse("(none)", "the adapter has no modules".into()));
    }
    // One alpha serves every module when scale * rank is the same for all.
    let products: Vec<f64> = adapter
        .modules
        .iter()
        .map(|m| m.scale * m.rank as f64)
        .collect();
    let uniform = products.iter().all(|&p| p == products[0]);
    let alpha = if uniform { products[0] as f32 } else { 0.0 };
    let scales_folded = !uniform;
    if uniform && !(alpha.is_finite() && alpha != 0.0) {
        return Err(refuse(
            &adapter.modules[0].module_path,
            format!("alpha {alpha} (scale x rank) cannot be written as llama.cpp's alpha"),
        ));
    }

    let mut entries = Vec::new();
    for m in &adapter.modules {
        let parsed =
            ModuleName::parse(&m.module_path).filter(|p| p.kind.is_linear() && p.param.is_empty());
        let name = parsed
            .as_ref()
            .and_then(|p| gguf_linear_weight_name(base.arch, p))
            .ok_or_else(|| {
                refuse(
                    &m.module_path,
                    format!("llama.cpp's {} has no tensor for this module", base.arch),
                )
            })?;
        let shape = base.weight_shapes.get(&name).ok_or_else(|| {
            refuse(
                &m.module_path,
                format!("the base {} has no tensor {name}", base.path.display()),
            )
        })?;
        if *shape != [m.out_features, m.in_features] {
            return Err(refuse(
                &m.module_path,
                format!(
                    "the factors are [{}, {}] x [{}, {}], the base's {name} is [{}, {}]",
                    m.out_features, m.rank, m.rank, m.in_features, shape[0], shape[1]
                ),
            ));
        }
        entries.push((m, parsed.expect("parsed above"), name));
    }
    // Layer by layer, as the converter orders them.
    entries.sort_by(|a, b| (a.1.layer, &a.2).cmp(&(b.1.layer, &b.2)));

    let mut writer = GgufWriter::new();
    writer.add_metadata(
        "general.architecture",
        MetadataValue::String(base.arch.as_str().into()),
    )?;
    writer.add_metadata(
        "general.type",
        MetadataValue::String(GENERAL_TYPE_ADAPTER.into()),
    )?;
    writer.add_metadata(
        "adapter.type",
        MetadataValue::String(ADAPTER_TYPE_LORA.into()),
    )?;
    let name = adapter
        .dir()
        .file_name()
        .map_or_else(|| "adapter".into(), |n| n.to_string_lossy().into_owned());
    writer.add_metadata("general.name", MetadataValue::String(name))?;
    writer.add_metadata(LORA_ALPHA_KEY, MetadataValue::F32(alpha))?;
    writer.add_metadata(
        "general.quantization_version",
        MetadataValue::U32(QUANTIZATION_VERSION),
    )?;

    let mut modules = Vec::with_capacity(entries.len());
    for (m, parsed, name) in entries {
        let mut a = adapter.read_a_f32(&m.module_path)?;
        let mut b = adapter.read_b_f32(&m.module_path)?;
        if scales_folded {
            let scale = m.scale as f32;
            for x in &mut b {
                *x *= scale;
            }
        }
        let axis = base
            .v_heads
            .and_then(|v| v.axis(parsed.kind).map(|axis| (v, axis)));
        if let Some((v, axis)) = axis {
            let permuted = match axis {
                PermutedAxis::Rows { head_dim, .. } | PermutedAxis::Columns { head_dim } => {
                    v.num_v_heads * head_dim
                }
            };
            match axis {
                PermutedAxis::Rows { start, head_dim } => {
                    if start + permuted != m.out_features {
                        return Err(refuse(
                            &m.module_path,
                            format!(
                                "{} output features, the value heads take rows {start}..{} ({} heads of {head_dim})",
                                m.out_features,
                                start + permuted,
                                v.num_v_heads
                            ),
                        ));
                    }
                    gather_rows(&mut b, m.rank, start, &v.permutation(head_dim));
                }
                PermutedAxis::Columns { head_dim } => {
                    if permuted != m.in_features {
                        return Err(refuse(
                            &m.module_path,
                            format!(
                                "{} input features, the value heads take {permuted} ({} heads of {head_dim})",
                                m.in_features, v.num_v_heads
                            ),
                        ));
                    }
                    gather_columns(&mut a, m.in_features, &v.permutation(head_dim));
                }
            }
        }
        let encode = |values: &[f32], factor: &str| {
            dtype.encode(values).map_err(|i| {
                refuse(
                    &m.module_path,
                    format!("{factor} element {i} ({}) overflows {dtype:?}", values[i]),
                )
            })
        };
        let a_bytes = encode(&a, "lora_A")?;
        let b_bytes = encode(&b, "lora_B (scale folded in)")?;
        writer.add_tensor(
            format!("{name}.lora_a"),
            dtype.ggml(),
            &[m.rank, m.in_features],
            a_bytes,
        )?;
        writer.add_tensor(
            format!("{name}.lora_b"),
            dtype.ggml(),
            &[m.out_features, m.rank],
            b_bytes,
        )?;
        modules.push(ExportedModule {
            module: m.module_path.clone(),
            gguf_name: name,
            rank: m.rank,
            scale: m.scale,
            v_heads_reordered: axis.is_some(),
        });
    }
    Ok((
        writer,
        ExportSummary {
            architecture: base.arch.as_str().into(),
            alpha,
            scales_folded,
            dtype,
            modules,
        },
    ))
}
