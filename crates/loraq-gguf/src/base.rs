//! A GGUF model opened as a checkpoint in the checkpoint's own terms: tensor names,
//! shapes, value-head order and values as the Hugging Face checkpoint it was
//! converted from holds them, and a config.json built from the GGUF metadata, so that
//! every command that reads a base (`run`, `verify`, `quant-error`, `inspect`,
//! `extract --target-base`) reads a GGUF base unchanged.
//!
//! What the converter changed is undone (`Qwen3NextModel.modify_tensors` and
//! `_LinearAttentionVReorderBase.modify_tensors` in `conversion/qwen.py`): the value
//! heads are put back in grouped order (the inverse of [`crate::vhead`]), `ssm_a =
//! -exp(A_log)` is turned back into `A_log` (below), the `+ 1` of every qwen35 norm but
//! `ssm_norm` is subtracted, `ssm_conv1d` gets its middle dimension back. The norms
//! are exact: the converter added 1 in f32, and `(w + 1) - 1` is exact in f32 for
//! `|w| <= 1`, so the model's `1 + w` gives back the converter's f32 value bit for
//! bit. `A_log` is recovered as the bf16 (else f32) value whose `-exp` reproduces `ssm_a`:
//! the original when the checkpoint was bf16 and Rust's `exp` rounds as torch's did.
//!
//! F32, F16 and BF16 tensors are kept in their type. The linear weights of the decoder
//! layers in a block type (Q8_0, Q4_K, ...) are kept in it by [`open_with_blocks`]:
//! their rows as GGUF stores them (rows of whole blocks), the value-head order undone
//! by moving whole rows, or whole blocks within each row for `out_proj`; such a
//! weight is a U8 tensor `[out_features, row bytes]` of the checkpoint, its type and
//! logical shape in [`GgufCheckpoint::block_weights`]. An `out_proj` whose value heads
//! cut through its blocks (128-wide heads in 256-element K blocks) cannot have its
//! columns put back by moving blocks: it is kept in GGUF's column order, and its
//! [`BlockWeight::input_gather`] says which checkpoint column each stored column is,
//! so that a reader decodes it in the checkpoint's order or runs the stored blocks on
//! the input gathered into GGUF's order (the same product). Every other tensor of a
//! block type (the embeddings, `lm_head`) is decoded exactly to f32 by the decoder
//! loraq-quant passes in, and refused by name without one. The converted tensors are written once to an unlinked
//! temporary safetensors file (its own dtypes kept: F16 and BF16 stay 2 bytes) and
//! memory-mapped, the way every other checkpoint is read.

use crate::error::{GgufError, Result, os};
use crate::ggml_type::GgmlType;
use crate::names::{GgufArch, checkpoint_tensor_name};
use crate::reader::{GgufModel, GgufTensorInfo};
use crate::value::MetadataArray;
use crate::vhead::{PermutedAxis, VHeadLayout, gather_columns, gather_rows};
use loraq_io::{
    Checkpoint, DType, ModelConfig, ModuleKind, ModuleName, SafetensorsWriter, TensorSpec,
};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

/// Whether `path` names a GGUF file (by its `.gguf` extension).
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The config.json of a GGUF model, from the keys llama.cpp's converter writes
/// (docs/gguf.md), as a Hugging Face config of the text model.
pub fn config_json(model: &GgufModel, arch: GgufArch) -> Result<serde_json::Value> {
    let key = |k: &str| format!("{arch}.{k}");
    let blocks = model.require_usize(&key("block_count"))?;
    let nextn = model
        .optional_usize(&key("nextn_predict_layers"))?
        .unwrap_or(0);
    let layers = blocks
        .checked_sub(nextn)
        .ok_or_else(|| GgufError::Metadata {
            path: model.path().to_path_buf(),
            key: key("nextn_predict_layers"),
            reason: format!("{nextn} is more than the {blocks} blocks"),
        })?;
    let head_dim = model.require_usize(&key("attention.key_length"))?;
    let vocab = model
        .tensor("token_embd.weight")
        .and_then(|(_, t)| t.dims.get(1).copied())
        .ok_or_else(|| GgufError::Tensor {
            path: model.path().to_path_buf(),
            tensor: "token_embd.weight".into(),
            reason: "missing or not 2-D: the vocabulary size is unknown".into(),
        })?;
    let mut rope = json!({"rope_type": "default"});
    if let Some(theta) = model.optional_f64(&key("rope.freq_base"))? {
        rope["rope_theta"] = json!(theta);
    }
    let mut config = json!({
        "hidden_size": model.require_usize(&key("embedding_length"))?,
        "intermediate_size": model.require_usize(&key("feed_forward_length"))?,
        "num_hidden_layers": layers,
        "num_attention_heads": model.require_usize(&key("attention.head_count"))?,
        "num_key_value_heads": model.require_usize(&key("attention.head_count_kv"))?,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "tie_word_embeddings": model.tensor("output.weight").is_none(),
    });
    if let Some(eps) = model.optional_f64(&key("attention.layer_norm_rms_epsilon"))? {
        config["rms_norm_eps"] = json!(eps);
    }
    if let Some(context) = model.optional_usize(&key("context_length"))? {
        config["max_position_embeddings"] = json!(context);
    }
    match arch {
        GgufArch::Qwen3 => {
            config["model_type"] = json!("qwen3");
            config["architectures"] = json!(["Qwen3ForCausalLM"]);
        }
        GgufArch::Qwen35 => {
            config["model_type"] = json!("qwen3_5_text");
            config["architectures"] = json!(["Qwen3_5ForCausalLM"]);
            if let Some(rotary) = model.optional_usize(&key("rope.dimension_count"))? {
                rope["partial_rotary_factor"] = json!(rotary as f64 / head_dim.max(1) as f64);
            }
            let v = v_heads(model, arch)?;
            config["linear_conv_kernel_dim"] = json!(model.require_usize(&key("ssm.conv_kernel"))?);
            config["linear_key_head_dim"] = json!(v.head_k_dim);
            config["linear_num_key_heads"] = json!(v.num_k_heads);
            config["linear_num_value_heads"] = json!(v.num_v_heads);
            config["linear_value_head_dim"] = json!(v.head_v_dim);
            let recurrent_key = key("attention.recurrent_layers");
            match model.get(&recurrent_key).and_then(|v| v.as_array()) {
                Some(MetadataArray::Bool(flags)) if flags.len() >= layers => {
                    let types: Vec<&str> = flags[..layers]
                        .iter()
                        .map(|&r| {
                            if r {
                                "linear_attention"
                            } else {
                                "full_attention"
                            }
                        })
                        .collect();
                    config["layer_types"] = json!(types);
                }
                Some(other) => {
                    return Err(GgufError::Metadata {
                        path: model.path().to_path_buf(),
                        key: recurrent_key,
                        reason: format!(
                            "{} elements of {}, expected {layers} BOOL",
                            other.len(),
                            other.element_type()
                        ),
                    });
                }
                None => {
                    let interval = model
                        .optional_usize(&key("full_attention_interval"))?
                        .unwrap_or(4);
                    config["full_attention_interval"] = json!(interval);
                }
            }
        }
    }
    config["rope_parameters"] = rope;
    Ok(config)
}

/// The linear-attention head layout of a qwen35 model (`ssm.*` keys).
pub fn v_heads(model: &GgufModel, arch: GgufArch) -> Result<VHeadLayout> {
    let key = |k: &str| format!("{arch}.ssm.{k}");
    let num_v_heads = model.require_usize(&key("time_step_rank"))?;
    let inner = model.require_usize(&key("inner_size"))?;
    Ok(VHeadLayout {
        num_k_heads: model.require_usize(&key("group_count"))?,
        num_v_heads,
        head_k_dim: model.require_usize(&key("state_size"))?,
        head_v_dim: inner.checked_div(num_v_heads).unwrap_or(0),
    })
}

/// `A_log` from `ssm_a = -exp(A_log)`: the value whose `-exp` in f32 gives `ssm_a`
/// back exactly, preferring the bf16 one (checkpoints store A_log in bf16, and then
/// it is the original), else the f32 nearest `ln(-ssm_a)` within 4 ulps that does,
/// else `ln(-ssm_a)` itself.
fn a_log_of(ssm_a: f32) -> f32 {
    let guess = (-ssm_a).ln();
    let reproduces = |a: f32| -a.exp() == ssm_a;
    let bf16 = half::bf16::from_f32(guess).to_f32();
    if reproduces(bf16) {
        return bf16;
    }
    let mut candidates = vec![guess];
    for step in 1..=4u32 {
        for sign in [1i64, -1] {
            let bits = i64::from(guess.to_bits()) + sign * i64::from(step);
            if let Ok(bits) = u32::try_from(bits) {
                candidates.push(f32::from_bits(bits));
            }
        }
    }
    candidates
        .into_iter()
        .find(|&a| reproduces(a))
        .unwrap_or(guess)
}

/// One tensor of the converted checkpoint.
struct Converted {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
    /// Set for a linear weight kept in its block type (`bytes` are its blocks).
    blocks: Option<BlockWeight>,
}

/// A linear weight kept in its ggml block type: a U8 tensor `[out_features, row
/// bytes]` of the checkpoint, rows in the checkpoint's order, columns too unless
/// [`BlockWeight::input_gather`] is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockWeight {
    /// The stored type.
    pub ggml_type: GgmlType,
    /// Output features (rows; GGUF `ne[1]`).
    pub out_features: usize,
    /// Input features (elements per row; GGUF `ne[0]`).
    pub in_features: usize,
    /// `None` when the columns are in the checkpoint's order. Set for an `out_proj`
    /// whose value heads cut through its blocks, kept in GGUF's column order: stored
    /// column `j` is the checkpoint's column `input_gather[j]` (a permutation of
    /// `0..in_features`). The checkpoint's `W x` is then the stored matrix times the
    /// input gathered as `x[input_gather[j]]`, and a LoRA `B A` of the checkpoint
    /// applies to that gathered input with A's columns gathered the same way.
    pub input_gather: Option<Vec<usize>>,
}

/// A GGUF model opened as a checkpoint ([`open_with_blocks`]).
pub struct GgufCheckpoint {
    /// The tensors in the checkpoint's terms.
    pub checkpoint: Checkpoint,
    /// The linear weights kept in their block type, by tensor name
    /// (`<module path>.weight`).
    pub block_weights: BTreeMap<String, BlockWeight>,
}

/// Element gather `gather` (over rows of `gather.len()` elements) as a gather of
/// whole blocks of `block` elements, or `None` when it moves elements within a block
/// or splits one.
fn block_gather(gather: &[usize], block: usize) -> Option<Vec<usize>> {
    if block == 0 || !gather.len().is_multiple_of(block) {
        return None;
    }
    gather
        .chunks_exact(block)
        .map(|unit| {
            let first = unit[0];
            let whole = first % block == 0 && unit.iter().enumerate().all(|(i, &g)| g == first + i);
            whole.then_some(first / block)
        })
        .collect()
}

/// A decoder layer's linear weight of a block type, kept in it with the value-head
/// order undone on whole rows (or whole blocks of each row; an `out_proj` whose value
/// heads cut through its blocks is left in GGUF's column order with its
/// [`BlockWeight::input_gather`]); `None` for any other tensor.
fn linear_blocks(
    model: &GgufModel,
    v: Option<VHeadLayout>,
    t: &GgufTensorInfo,
    name: &str,
    stored: &[u8],
) -> Result<Option<Converted>> {
    let Some(module) = ModuleName::parse(name) else {
        return Ok(None);
    };
    if !t.ggml_type.is_quantized()
        || !module.kind.is_linear()
        || module.param != "weight"
        || t.dims.len() != 2
    {
        return Ok(None);
    }
    let (in_features, out_features) = (t.dims[0] as usize, t.dims[1] as usize);
    let row_bytes = stored.len().checked_div(out_features).unwrap_or(0);
    let mut bytes = stored.to_vec();
    let mut input_gather = None;
    match v.and_then(|v| v.axis(module.kind).map(|axis| (v, axis))) {
        Some((v, PermutedAxis::Rows { start, head_dim })) => {
            reorder(
                &mut bytes,
                row_bytes,
                1,
                start,
                &v.inverse_permutation(head_dim),
                model,
                t,
            )?;
        }
        Some((v, PermutedAxis::Columns { head_dim })) => {
            let gather = column_gather(v, head_dim, in_features, model, t)?;
            let block = t.ggml_type.block();
            match block_gather(&gather, block.elements) {
                // Whole blocks move: the columns are put back in the checkpoint's
                // order in the bytes.
                Some(blocks) => {
                    let mut row_blocks: Vec<&[u8]> = Vec::with_capacity(blocks.len());
                    let mut gathered = Vec::with_capacity(bytes.len());
                    for row in stored.chunks_exact(row_bytes.max(1)) {
                        row_blocks.clear();
                        row_blocks.extend(row.chunks_exact(block.bytes));
                        for &b in &blocks {
                            gathered.extend_from_slice(row_blocks[b]);
                        }
                    }
                    bytes = gathered;
                }
                // The value heads cut through the blocks: the bytes stay in GGUF's
                // column order (column j is the checkpoint's `permutation[j]`) and the
                // reader gathers the input instead.
                None => input_gather = Some(v.permutation(head_dim)),
            }
        }
        None => {}
    }
    Ok(Some(Converted {
        name: name.to_string(),
        dtype: DType::U8,
        shape: vec![out_features, row_bytes],
        bytes,
        blocks: Some(BlockWeight {
            ggml_type: t.ggml_type,
            out_features,
            in_features,
            input_gather,
        }),
    }))
}

fn tensor_error(model: &GgufModel, t: &GgufTensorInfo, reason: String) -> GgufError {
    GgufError::Tensor {
        path: model.path().to_path_buf(),
        tensor: t.name.clone(),
        reason,
    }
}

/// Converts one GGUF tensor back to the checkpoint's terms.
fn convert(
    model: &GgufModel,
    arch: GgufArch,
    v: Option<VHeadLayout>,
    t: &GgufTensorInfo,
    name: String,
    decoder: Option<BlockDecoder<'_>>,
    keep_blocks: bool,
) -> Result<Converted> {
    let (file, _) = model.tensor(&t.name).expect("listed by the model");
    let stored = file.tensor_bytes(&t.name)?;
    if keep_blocks && let Some(kept) = linear_blocks(model, v, t, &name, stored)? {
        return Ok(kept);
    }
    let decoded: Vec<u8>;
    let (dtype, element, raw) = match t.ggml_type {
        GgmlType::F32 => (DType::F32, 4, stored),
        GgmlType::F16 => (DType::F16, 2, stored),
        GgmlType::BF16 => (DType::BF16, 2, stored),
        other => {
            let mut values = vec![0f32; t.element_count()];
            let row = t.dims.first().map_or(1, |&d| d as usize);
            if !decoder.is_some_and(|decode| decode(other.id(), stored, row, &mut values)) {
                return Err(tensor_error(
                    model,
                    t,
                    format!("unsupported GGUF tensor type {other}: no decoder for it"),
                ));
            }
            decoded = values.iter().flat_map(|x| x.to_le_bytes()).collect();
            (DType::F32, 4, decoded.as_slice())
        }
    };
    let mut shape = t.shape();
    let parsed = ModuleName::parse(&name);
    let kind = parsed.as_ref().map(|m| m.kind);
    let is_norm = name.ends_with("norm.weight") && kind != Some(ModuleKind::Norm);
    let value_changed = arch == GgufArch::Qwen35 && (is_norm || kind == Some(ModuleKind::ALog));
    if value_changed {
        let mut values = crate::reader::decode_f32(file.path(), t, raw)?;
        if kind == Some(ModuleKind::ALog) {
            for x in &mut values {
                if x.is_nan() || *x >= 0.0 {
                    return Err(tensor_error(
                        model,
                        t,
                        format!("holds {x}, but ssm_a is -exp(A_log) < 0"),
                    ));
                }
                *x = a_log_of(*x);
            }
        } else {
            for x in &mut values {
                *x -= 1.0;
            }
        }
        let mut converted = Converted {
            name,
            dtype: DType::F32,
            shape,
            bytes: values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            blocks: None,
        };
        if let (Some(v), Some(ModuleKind::ALog)) = (v, kind)
            && v.reorders()
        {
            reorder(
                &mut converted.bytes,
                4,
                4,
                0,
                &v.inverse_permutation(1),
                model,
                t,
            )?;
        }
        return Ok(converted);
    }
    let mut bytes = raw.to_vec();
    if kind == Some(ModuleKind::Conv1d) && shape.len() == 2 {
        shape = vec![shape[0], 1, shape[1]];
    }
    if let (Some(v), Some(kind)) = (v.filter(VHeadLayout::reorders), kind) {
        let row_len = shape.iter().skip(1).product::<usize>().max(1);
        let row_bytes = row_len * element;
        match kind {
            ModuleKind::DtBias => reorder(
                &mut bytes,
                element,
                element,
                0,
                &v.inverse_permutation(1),
                model,
                t,
            )?,
            ModuleKind::Conv1d => {
                let start = 2 * v.num_k_heads * v.head_k_dim;
                reorder(
                    &mut bytes,
                    row_bytes,
                    element,
                    start,
                    &v.inverse_permutation(v.head_v_dim),
                    model,
                    t,
                )?;
            }
            _ => match v.axis(kind) {
                Some(PermutedAxis::Rows { start, head_dim }) => {
                    reorder(
                        &mut bytes,
                        row_bytes,
                        element,
                        start,
                        &v.inverse_permutation(head_dim),
                        model,
                        t,
                    )?;
                }
                Some(PermutedAxis::Columns { head_dim }) => {
                    let in_features = *shape.last().unwrap_or(&0);
                    let gather = column_gather(v, head_dim, in_features, model, t)?;
                    // Columns of a row-major matrix: gather elements within each row.
                    let mut elements: Vec<[u8; 4]> = bytes
                        .chunks_exact(element)
                        .map(|c| {
                            let mut e = [0u8; 4];
                            e[..element].copy_from_slice(c);
                            e
                        })
                        .collect();
                    gather_columns(&mut elements, in_features, &gather);
                    bytes = elements
                        .iter()
                        .flat_map(|e| e[..element].to_vec())
                        .collect();
                }
                None => {}
            },
        }
    }
    Ok(Converted {
        name,
        dtype,
        shape,
        bytes,
        blocks: None,
    })
}

/// The gather that puts `in_features` input columns back in the checkpoint's
/// value-head order, checking that the value heads take exactly them.
fn column_gather(
    v: VHeadLayout,
    head_dim: usize,
    in_features: usize,
    model: &GgufModel,
    t: &GgufTensorInfo,
) -> Result<Vec<usize>> {
    let gather = v.inverse_permutation(head_dim);
    if gather.len() != in_features {
        return Err(tensor_error(
            model,
            t,
            format!(
                "{in_features} input features, the value heads take {}",
                gather.len()
            ),
        ));
    }
    Ok(gather)
}

/// Gathers rows `start..` of `bytes` (rows of `row_bytes`), checking that the value
/// heads fill exactly the rows from `start` to the end.
fn reorder(
    bytes: &mut [u8],
    row_bytes: usize,
    element: usize,
    start: usize,
    gather: &[usize],
    model: &GgufModel,
    t: &GgufTensorInfo,
) -> Result<()> {
    let rows = bytes.len() / row_bytes.max(1);
    if start + gather.len() != rows || !row_bytes.is_multiple_of(element) {
        return Err(tensor_error(
            model,
            t,
            format!(
                "{rows} rows, but the value heads take rows {start}..{} (check ssm.* metadata)",
                start + gather.len()
            ),
        ));
    }
    gather_rows(bytes, row_bytes, start, gather);
    Ok(())
}

/// Decodes a tensor of a block (quantized) ggml type to f32: `(ggml type id, the
/// stored bytes, elements per row, out)`; false when it does not know the type or the
/// sizes disagree. loraq-quant passes its `ggml` decoders (this crate sits below it).
pub type BlockDecoder<'a> = &'a dyn Fn(u32, &[u8], usize, &mut [f32]) -> bool;

/// Opens a GGUF model of F32, F16 and BF16 tensors as a checkpoint of its Hugging
/// Face tensors (as [`open_with_blocks`], but a tensor of a block type is refused by
/// name).
pub fn open_as_checkpoint(path: &Path) -> Result<Checkpoint> {
    Ok(open(path, None, false)?.checkpoint)
}

/// Opens a GGUF model (the first file of a split model) as a checkpoint of its
/// Hugging Face tensors, with a config.json from its metadata. The decoder layers'
/// linear weights of a block type are kept in it (module docs); every other tensor
/// of a block type is decoded exactly to f32 by `decoder`. Tensors the architecture
/// does not name (llama.cpp's `rope_freqs`, multi-token prediction blocks past the
/// decoder layers) are left out.
pub fn open_with_blocks(path: &Path, decoder: BlockDecoder<'_>) -> Result<GgufCheckpoint> {
    open(path, Some(decoder), true)
}

fn open(
    path: &Path,
    decoder: Option<BlockDecoder<'_>>,
    keep_blocks: bool,
) -> Result<GgufCheckpoint> {
    let model = GgufModel::open(path)?;
    let arch_name = model.require_str("general.architecture")?;
    let arch = GgufArch::from_name(arch_name).ok_or_else(|| GgufError::Metadata {
        path: path.to_path_buf(),
        key: "general.architecture".into(),
        reason: format!("{arch_name:?}: loraq reads qwen3 and qwen35 GGUF models"),
    })?;
    if let Some(kind) = model.get("general.type").and_then(|v| v.as_str())
        && kind != "model"
    {
        return Err(GgufError::Metadata {
            path: path.to_path_buf(),
            key: "general.type".into(),
            reason: format!(
                "{kind:?}: not a model (a LoRA adapter is read with --adapter as a PEFT directory)"
            ),
        });
    }
    let config = config_json(&model, arch)?;
    let layers = config["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    let config = ModelConfig::from_json_str(&config.to_string(), path)?;
    let v = (arch == GgufArch::Qwen35)
        .then(|| v_heads(&model, arch))
        .transpose()?;
    let mut converted = BTreeMap::new();
    for t in model.tensors() {
        let Some(name) = checkpoint_tensor_name(arch, &t.name, "model") else {
            continue;
        };
        if ModuleName::parse(&name).is_some_and(|m| m.layer >= layers) {
            continue; // multi-token prediction blocks after the decoder layers
        }
        converted.insert(
            name.clone(),
            convert(&model, arch, v, t, name, decoder, keep_blocks)?,
        );
    }
    let image = tempfile::Builder::new()
        .prefix(".loraq-gguf-")
        .suffix(".safetensors")
        .tempfile()
        .map_err(os(path))?;
    let specs: Vec<TensorSpec> = converted
        .values()
        .map(|c| TensorSpec::new(c.name.clone(), c.dtype, c.shape.clone()))
        .collect();
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let mut writer = SafetensorsWriter::create(image.path(), specs, &metadata)?;
    for c in converted.values() {
        writer.write_tensor(&c.name, &c.bytes)?;
    }
    writer.finish()?;
    // Mapped, then unlinked when `image` drops: the mapping stays valid.
    let checkpoint = Checkpoint::open(image.path())?;
    let block_weights = converted
        .values()
        .filter_map(|c| Some((c.name.clone(), c.blocks.clone()?)))
        .collect();
    Ok(GgufCheckpoint {
        checkpoint: checkpoint.converted_from(path.to_path_buf(), config),
        block_weights,
    })
}
