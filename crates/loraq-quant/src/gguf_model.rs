//! A quantized GGUF model written from a checkpoint, as llama.cpp's
//! `convert_hf_to_gguf.py` followed by `llama-quantize FTYPE` writes it: what
//! `loraq quantize --scheme gguf-*` does (the CLI adds argument parsing, progress and
//! printing).
//!
//! * The metadata and the value changes are the converter's
//!   ([`loraq_gguf::convert`]); `general.quantization_version` and
//!   `general.file_type` come last, where llama-quantize moves them.
//! * The converter's intermediate file is the checkpoint in its own 16-bit type
//!   (`--outtype auto`: bf16 or f16; an f32 checkpoint stays f32), with 1-D tensors,
//!   norms, `ssm_conv1d` and the tensors whose name does not end in `.weight` in f32
//!   (`ModelBase.prepare_tensors` in `conversion/base.py`); those are the stored types
//!   llama-quantize keeps for the tensors it leaves unquantized.
//! * Each tensor's type is llama-quantize's ([`crate::ggml::mix::plan_types`]), the
//!   tensors in its order ([`crate::ggml::mix::llama_quantize_order`]), the bytes the
//!   bit-exact quantizers' ([`crate::ggml::quantize()`]).
//!
//! The checkpoint is read one tensor at a time from its memory map and the file is
//! written as each tensor is quantized ([`GgufWriter::write_streamed`]): the memory
//! needed is about the largest tensor in f32 and its quantized bytes.

use crate::error::{QuantError, Result};
use crate::ggml::mix::{GgufFileType, MixModel, MixTensor, llama_quantize_order, plan_types};
use crate::ggml::{GgmlType, quantize};
use crate::quantize_dir::QuantizeProgress;
use loraq_gguf::convert::{self, QUANTIZATION_VERSION};
use loraq_gguf::{GgufArch, GgufWriter, MetadataValue, TensorSpec, VHeadLayout};
use loraq_io::{Checkpoint, DType, StagedOutputs};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A GGUF model to write.
#[derive(Clone, Debug)]
pub struct GgufQuantizeRequest<'a> {
    /// Input checkpoint directory (bf16, f16 or f32 weights, tokenizer.json beside).
    pub input: &'a Path,
    /// Output GGUF file.
    pub out: &'a Path,
    /// llama-quantize's file type.
    pub file_type: GgufFileType,
    /// Replace the output if it exists.
    pub force: bool,
}

/// What was written.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GgufQuantizeSummary {
    /// The output file, committed.
    pub out: PathBuf,
    /// llama.cpp's architecture (`qwen3`, `qwen35`).
    pub architecture: String,
    /// The file type's name (`Q4_K_M`).
    pub file_type: String,
    /// Tensors written.
    pub tensors: usize,
    /// Tensors stored in a block type.
    pub quantized: usize,
    /// Tensors per ggml type name.
    pub types: BTreeMap<String, usize>,
    /// Parameters (elements of every tensor).
    pub parameters: u64,
    /// Bytes of tensor data (without padding and header).
    pub tensor_bytes: u64,
}

/// One tensor of the plan: where it comes from and what it becomes.
struct PlannedTensor {
    checkpoint_name: String,
    gguf_name: String,
    shape: Vec<usize>,
    stored_type: GgmlType,
    /// The checkpoint stores it in f16: the converter's value changes run in f16.
    f16_source: bool,
}

/// The type the converter stores a tensor in before llama-quantize reads it
/// (`ModelBase.prepare_tensors`).
fn converter_type(gguf_name: &str, shape: &[usize], outtype: GgmlType) -> GgmlType {
    if shape.len() <= 1
        || gguf_name.ends_with("_norm.weight")
        || gguf_name.contains("ssm_conv1d")
        || !gguf_name.ends_with(".weight")
    {
        GgmlType::F32
    } else {
        outtype
    }
}

fn to_gguf_type(t: GgmlType) -> loraq_gguf::GgmlType {
    loraq_gguf::GgmlType::from_id(t.id()).expect("loraq-gguf knows every ggml type loraq-quant has")
}

/// `values` rounded to `t` and widened back (what storing them in the converter's
/// intermediate file and reading them in llama-quantize does).
fn through_stored_type(t: GgmlType, values: &mut [f32]) {
    match t {
        GgmlType::BF16 => {
            for v in values.iter_mut() {
                *v = half::bf16::from_f32(*v).to_f32();
            }
        }
        GgmlType::F16 => {
            for v in values.iter_mut() {
                *v = half::f16::from_f32(*v).to_f32();
            }
        }
        _ => {}
    }
}

/// Writes `request.input` as a quantized GGUF model at `request.out`, staged and
/// renamed into place only when complete; `progress` hears what happens. Refuses an
/// architecture other than qwen3 / qwen35, a missing or unusable tokenizer, a tensor
/// llama.cpp's architecture has no name for, a non-float tensor, and a NaN or infinite
/// weight (naming the file and the tensor).
pub fn quantize_to_gguf(
    request: &GgufQuantizeRequest<'_>,
    progress: &mut dyn FnMut(QuantizeProgress<'_>),
) -> Result<GgufQuantizeSummary> {
    let mut outputs = StagedOutputs::new(&[request.input], request.force);
    let temp = outputs.stage_file(request.out)?;
    progress(QuantizeProgress::StaleSiblings(outputs.stale_siblings()));
    let context = |e: QuantError| e.context(format!("quantizing {}", request.input.display()));
    let checkpoint = Checkpoint::open(request.input).map_err(|e| {
        QuantError::from(e).context(format!(
            "cannot open checkpoint {}",
            request.input.display()
        ))
    })?;
    let dir = convert::checkpoint_dir(request.input);
    let config = checkpoint
        .config()
        .ok_or_else(|| QuantError::UnsupportedConfig {
            path: dir.join(loraq_io::CONFIG_FILE),
            reason: "no config.json: the architecture and hyperparameters come from it".into(),
        })?;
    let arch = GgufArch::from_architecture(&config.architecture).ok_or_else(|| {
        QuantError::UnsupportedConfig {
            path: dir.join(loraq_io::CONFIG_FILE),
            reason: format!(
                "architecture {:?}: loraq writes GGUF models of qwen3 and qwen35 (llama.cpp's qwen3, qwen35)",
                config.architecture
            ),
        }
    })?;
    let layout: Option<VHeadLayout> = convert::v_head_layout(config);
    let plan = plan_tensors(&checkpoint, arch)?;
    let names: Vec<&str> = plan.iter().map(|t| t.gguf_name.as_str()).collect();
    let order = llama_quantize_order(&names);
    let hp = config.text();
    let count = |key: &str| hp.get(key).and_then(serde_json::Value::as_u64).unwrap_or(0) as usize;
    let mix_model = MixModel {
        architecture: arch.as_str().into(),
        block_count: count("num_hidden_layers"),
        head_count: count("num_attention_heads"),
        head_count_kv: count("num_key_value_heads"),
    };
    let dims: Vec<Vec<usize>> = plan
        .iter()
        .map(|t| t.shape.iter().rev().copied().collect())
        .collect();
    let mix: Vec<MixTensor<'_>> = plan
        .iter()
        .zip(&dims)
        .map(|(t, d)| MixTensor {
            name: &t.gguf_name,
            dims: d,
            stored_type: t.stored_type,
        })
        .collect();
    let types = plan_types(&mix_model, request.file_type, &mix)?;
    let parameters: u64 = plan
        .iter()
        .map(|t| t.shape.iter().product::<usize>() as u64)
        .sum();

    let mut writer = GgufWriter::new();
    let mut metadata = convert::general_metadata(arch, &dir, config, parameters)?;
    metadata.extend(convert::hyperparameters(
        arch,
        config,
        &dir.join(loraq_io::CONFIG_FILE),
    )?);
    metadata.extend(convert::tokenizer_metadata(arch, &dir, config)?);
    metadata.push((
        "general.quantization_version".into(),
        MetadataValue::U32(QUANTIZATION_VERSION),
    ));
    metadata.push((
        "general.file_type".into(),
        MetadataValue::U32(request.file_type.id()),
    ));
    for (key, value) in metadata {
        writer.add_metadata(key, value)?;
    }
    let specs: Vec<TensorSpec> = order
        .iter()
        .map(|&i| TensorSpec {
            name: plan[i].gguf_name.clone(),
            ggml_type: to_gguf_type(types[i]),
            shape: plan[i].shape.clone(),
        })
        .collect();
    progress(QuantizeProgress::Planned {
        tensors: specs.len(),
    });
    let mut tensor_bytes = 0u64;
    writer
        .write_streamed(&temp, &specs, &mut |index| -> Result<Vec<u8>> {
            let t = &plan[order[index]];
            let target = types[order[index]];
            let mut values = checkpoint.read_f32(&t.checkpoint_name)?;
            checkpoint.ensure_finite(&t.checkpoint_name, &values)?;
            convert::convert_values(
                arch,
                layout.as_ref(),
                &t.checkpoint_name,
                &t.shape,
                &mut values,
                t.f16_source,
            );
            through_stored_type(t.stored_type, &mut values);
            let in_features = t.shape.last().copied().unwrap_or(1).max(1);
            let out_features = values.len() / in_features;
            let bytes = quantize(&t.gguf_name, target, out_features, in_features, &values)?;
            tensor_bytes += bytes.len() as u64;
            progress(QuantizeProgress::Wrote(&t.gguf_name));
            Ok(bytes)
        })
        .map_err(context)?;
    outputs.commit()?;
    let mut by_type = BTreeMap::new();
    for t in &types {
        *by_type.entry(t.name().to_string()).or_insert(0) += 1;
    }
    Ok(GgufQuantizeSummary {
        out: request.out.to_path_buf(),
        architecture: arch.as_str().into(),
        file_type: request.file_type.name().into(),
        tensors: plan.len(),
        quantized: types.iter().filter(|t| t.is_quantized()).count(),
        types: by_type,
        parameters,
        tensor_bytes,
    })
}

/// The tensors the converter writes, with their GGUF names, converted shapes and
/// stored types, in the checkpoint's order.
fn plan_tensors(checkpoint: &Checkpoint, arch: GgufArch) -> Result<Vec<PlannedTensor>> {
    // --outtype auto: the first tensor of 2 dimensions or more decides
    let outtype = checkpoint
        .tensors()
        .filter(|t| t.shape.len() >= 2 && !convert::is_left_out(&t.name))
        .map(|t| match t.dtype {
            DType::BF16 => GgmlType::BF16,
            DType::F16 => GgmlType::F16,
            _ => GgmlType::F32,
        })
        .next()
        .unwrap_or(GgmlType::F32);
    let mut plan = Vec::new();
    for info in checkpoint.tensors() {
        if convert::is_left_out(&info.name) {
            continue;
        }
        let path = checkpoint.shard_path(info.shard);
        if !matches!(info.dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(loraq_gguf::GgufError::Tensor {
                path: path.to_path_buf(),
                tensor: info.name.clone(),
                reason: format!(
                    "stored as {}: loraq quantizes bf16, f16 or f32 checkpoints to GGUF",
                    info.dtype
                ),
            }
            .into());
        }
        let (gguf_name, shape) =
            convert::converted_name_and_shape(arch, path, &info.name, &info.shape)?;
        let stored_type = converter_type(&gguf_name, &shape, outtype);
        plan.push(PlannedTensor {
            checkpoint_name: info.name.clone(),
            gguf_name,
            shape,
            stored_type,
            f16_source: info.dtype == DType::F16,
        });
    }
    if plan.is_empty() {
        return Err(QuantError::NothingToDo {
            path: checkpoint.root().to_path_buf(),
            what: "tensor llama.cpp's converter writes",
        });
    }
    Ok(plan)
}
