//! The ggml type llama-quantize gives each tensor for a file type ("Q4_K_M", ...),
//! ported from src/llama-quant.cpp of the llama.cpp that llama-cpp-python 0.3.36
//! vendors, for the dense architectures `qwen3` and `qwen35` without an
//! importance matrix and with llama-quantize's default options:
//!
//! * which tensors are quantized at all (`tensor_allows_quantization`): 2-D and
//!   larger, name ending in `weight`, not a norm, not `ssm_conv1d`, ...; the others
//!   keep their stored type;
//! * the category of a tensor (`tensor_get_category`) and the per-category choice
//!   (`llama_tensor_get_type_impl`), which depends on the position of the tensor
//!   among the `attn_v`-like tensors and among the `ffn_down` tensors, counted in
//!   the order llama-quantize visits the tensors (`weight_name_comparer` of
//!   src/llama-model-loader.h: by layer, then by name);
//! * the fallback when a row is not a whole number of blocks
//!   (`tensor_type_fallback`).
//!
//! The table this gives for the six file types is in docs/quantization.md.

use super::GgmlType;
use crate::error::{QuantError, Result};
use std::cmp::Ordering;

/// A llama-quantize file type (`enum llama_ftype`, `general.file_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // llama-quantize's names
pub enum GgufFileType {
    /// `LLAMA_FTYPE_MOSTLY_Q8_0`.
    Q8_0,
    /// `LLAMA_FTYPE_MOSTLY_Q6_K`.
    Q6_K,
    /// `LLAMA_FTYPE_MOSTLY_Q5_K_M`.
    Q5_K_M,
    /// `LLAMA_FTYPE_MOSTLY_Q4_K_M`.
    Q4_K_M,
    /// `LLAMA_FTYPE_MOSTLY_Q4_0`.
    Q4_0,
    /// `LLAMA_FTYPE_MOSTLY_IQ4_XS`.
    IQ4_XS,
}

impl GgufFileType {
    /// Every file type planned here.
    pub const ALL: [GgufFileType; 6] = [
        Self::Q8_0,
        Self::Q6_K,
        Self::Q5_K_M,
        Self::Q4_K_M,
        Self::Q4_0,
        Self::IQ4_XS,
    ];

    /// The `llama_ftype` value (what `general.file_type` holds).
    pub fn id(self) -> u32 {
        match self {
            Self::Q4_0 => 2,
            Self::Q8_0 => 7,
            Self::Q4_K_M => 15,
            Self::Q5_K_M => 17,
            Self::Q6_K => 18,
            Self::IQ4_XS => 30,
        }
    }

    /// The name llama-quantize takes on its command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q8_0 => "Q8_0",
            Self::Q6_K => "Q6_K",
            Self::Q5_K_M => "Q5_K_M",
            Self::Q4_K_M => "Q4_K_M",
            Self::Q4_0 => "Q4_0",
            Self::IQ4_XS => "IQ4_XS",
        }
    }

    /// The file type named `name` (case-insensitive).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// The file type of a `loraq quantize` scheme name: `gguf-` and the file type's
    /// name (`gguf-q4_k_m`), case-insensitive.
    pub fn from_scheme(scheme: &str) -> Option<Self> {
        let lower = scheme.to_ascii_lowercase();
        lower.strip_prefix("gguf-").and_then(Self::from_name)
    }

    /// The `loraq quantize` scheme name (`gguf-q4_k_m`).
    pub fn scheme(self) -> String {
        format!("gguf-{}", self.name().to_ascii_lowercase())
    }

    /// The type of the tensors no rule singles out
    /// (`llama_ftype_get_default_type`).
    pub fn default_type(self) -> GgmlType {
        match self {
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q6_K => GgmlType::Q6_K,
            Self::Q5_K_M => GgmlType::Q5_K,
            Self::Q4_K_M => GgmlType::Q4_K,
            Self::Q4_0 => GgmlType::Q4_0,
            Self::IQ4_XS => GgmlType::IQ4_XS,
        }
    }
}

/// The model facts the type choice reads (GGUF metadata of the input file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MixModel {
    /// `general.architecture`: `qwen3` or `qwen35`.
    pub architecture: String,
    /// `{arch}.block_count` (`n_layer_all`, MTP layers included): the number of
    /// `ffn_down` tensors the position rule divides by.
    pub block_count: usize,
    /// `{arch}.attention.head_count` of layer 0.
    pub head_count: usize,
    /// `{arch}.attention.head_count_kv` of layer 0.
    pub head_count_kv: usize,
}

impl MixModel {
    /// `n_gqa()` of layer 0: heads per KV head, 0 without KV heads.
    fn n_gqa(&self) -> usize {
        self.head_count.checked_div(self.head_count_kv).unwrap_or(0)
    }
}

/// A tensor as the type choice sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixTensor<'a> {
    /// GGUF name (`blk.3.attn_v.weight`).
    pub name: &'a str,
    /// GGUF dimensions, `ne[0]` first (for a linear: `[in_features, out_features]`).
    pub dims: &'a [usize],
    /// The type it is stored in the input file (kept when it is not quantized).
    pub stored_type: GgmlType,
}

/// `tensor_category` of src/llama-quant.cpp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    AttentionQ,
    AttentionV,
    AttentionK,
    AttentionQkv,
    AttentionKvB,
    AttentionOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Output,
    Other,
}

// tensor_get_category
fn category(name: &str) -> Category {
    if name == "output.weight" {
        return Category::Output;
    }
    if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        return Category::TokenEmbd;
    }
    let table = [
        ("attn_qkv.weight", Category::AttentionQkv),
        ("attn_kv_b.weight", Category::AttentionKvB),
        ("attn_v.weight", Category::AttentionV),
        ("attn_k.weight", Category::AttentionK),
        ("attn_q.weight", Category::AttentionQ),
        ("attn_output.weight", Category::AttentionOutput),
        ("ffn_up", Category::FfnUp),
        ("ffn_gate", Category::FfnGate),
        ("ffn_down", Category::FfnDown),
    ];
    table
        .into_iter()
        .find(|(pattern, _)| name.contains(pattern))
        .map_or(Category::Other, |(_, c)| c)
}

// category_is_attn_v
fn is_attn_v_like(c: Category) -> bool {
    matches!(
        c,
        Category::AttentionV | Category::AttentionQkv | Category::AttentionKvB
    )
}

/// `ggml_n_dims`: the index of the last dimension above 1, plus one (at least 1).
fn n_dims(dims: &[usize]) -> usize {
    dims.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1)
}

/// Whether llama-quantize quantizes the tensor at all
/// (`tensor_allows_quantization` with the default options, the name rules that
/// apply to every architecture; those of `glm5-next` are left out).
pub fn allows_quantization(name: &str, dims: &[usize]) -> bool {
    if n_dims(dims) < 2 || !name.ends_with("weight") || name.contains("_norm.weight") {
        return false;
    }
    const EXCLUDED: [&str; 31] = [
        "ffn_gate_inp.weight",
        "ffn_gate_tid2eid.weight",
        "altup",
        "laurel",
        "per_layer_model_proj",
        "ssm_conv1d",
        "shortconv.conv.weight",
        "indexer.k_proj.weight",
        "indexer.q_proj.weight",
        "time_mix_first.weight",
        "time_mix_w0.weight",
        "time_mix_w1.weight",
        "time_mix_w2.weight",
        "time_mix_v0.weight",
        "time_mix_v1.weight",
        "time_mix_v2.weight",
        "time_mix_a0.weight",
        "time_mix_a1.weight",
        "time_mix_a2.weight",
        "time_mix_g1.weight",
        "time_mix_g2.weight",
        "time_mix_decay_w1.weight",
        "time_mix_decay_w2.weight",
        "time_mix_lerp_fused.weight",
        "attn_rel_b.weight",
        ".position_embd",
        "sam.pos_embd",
        "sam.neck.",
        "sam.net_",
        ".rel_pos",
        ".patch_embd",
    ];
    const EXCLUDED_MORE: [&str; 3] = [".patch_merger", "a.rvq.codebook", "mm.a.code_embd"];
    if EXCLUDED
        .iter()
        .chain(EXCLUDED_MORE.iter())
        .any(|p| name.contains(p))
    {
        return false;
    }
    // LLM_TENSOR_POS_EMBD and LLM_TENSOR_TOKEN_TYPES
    name != "position_embd.weight" && name != "token_types.weight"
}

/// The layer of a `blk.N.` name, -1 for the others (`sscanf(name, "blk.%d.")`).
fn layer_of(name: &str) -> i64 {
    name.strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(n, _)| n.parse::<i64>().ok())
        .unwrap_or(-1)
}

/// The order llama-quantize visits (and writes) the tensors
/// (`weight_name_comparer`): by layer (tensors outside `blk.N.` first), then by
/// name, bytewise. Returns indices into `names`.
pub fn llama_quantize_order(names: &[&str]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..names.len()).collect();
    order.sort_by(|&a, &b| match layer_of(names[a]).cmp(&layer_of(names[b])) {
        Ordering::Equal => names[a].as_bytes().cmp(names[b].as_bytes()),
        other => other,
    });
    order
}

/// `use_more_bits` of `llama_tensor_get_type_impl`.
fn use_more_bits(i_layer: usize, n_layers: usize) -> bool {
    i_layer < n_layers / 8
        || i_layer >= 7 * n_layers / 8
        // reached only when i_layer >= n_layers / 8, so the difference is not negative
        || (i_layer - n_layers / 8) % 3 == 2
}

/// Where a tensor stands among the others, the facts of the whole tensor list that
/// the per-tensor choice reads (`quantize_state_impl`'s counters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MixPosition {
    /// No `output.weight` in the file: `token_embd.weight` is also the output.
    pub has_tied_embeddings: bool,
    /// `attn_v`-like tensors (`attn_v`, `attn_qkv`, `attn_kv_b`) visited before this
    /// one, in [`llama_quantize_order`].
    pub i_attention_wv: usize,
    /// `attn_v`-like tensors in the file.
    pub n_attention_wv: usize,
    /// `ffn_down` tensors visited before this one.
    pub i_ffn_down: usize,
}

/// The type llama-quantize gives one tensor (`llama_tensor_get_type`): its stored
/// type when it is not quantized ([`allows_quantization`]), else the file type's
/// choice for its category and position, after the fallback for rows that are not
/// whole blocks. Pure; [`plan_types`] computes the positions.
pub fn tensor_type(
    model: &MixModel,
    ftype: GgufFileType,
    tensor: &MixTensor<'_>,
    position: &MixPosition,
) -> GgmlType {
    if !allows_quantization(tensor.name, tensor.dims) {
        return tensor.stored_type;
    }
    let chosen = choose(model, ftype, tensor, category(tensor.name), position);
    fallback(chosen, tensor.dims.first().copied().unwrap_or(0))
}

/// The type of each tensor, in the order given, as llama-quantize writes it for
/// `ftype` (no importance matrix, default options). Refuses an architecture other
/// than `qwen3` / `qwen35`.
pub fn plan_types(
    model: &MixModel,
    ftype: GgufFileType,
    tensors: &[MixTensor<'_>],
) -> Result<Vec<GgmlType>> {
    if model.architecture != "qwen3" && model.architecture != "qwen35" {
        return Err(QuantError::GgmlPlan {
            what: format!(
                "llama-quantize's type mix is ported for qwen3 and qwen35, not {:?}",
                model.architecture
            ),
        });
    }
    let names: Vec<&str> = tensors.iter().map(|t| t.name).collect();
    let n_attention_wv = names.iter().filter(|n| is_attn_v_like(category(n))).count();
    let mut position = MixPosition {
        has_tied_embeddings: !names.contains(&"output.weight"),
        n_attention_wv,
        ..MixPosition::default()
    };
    let mut types = vec![GgmlType::F32; tensors.len()];
    for index in llama_quantize_order(&names) {
        let t = &tensors[index];
        types[index] = tensor_type(model, ftype, t, &position);
        if allows_quantization(t.name, t.dims) {
            let c = category(t.name);
            if is_attn_v_like(c) {
                position.i_attention_wv += 1;
            } else if c == Category::FfnDown {
                position.i_ffn_down += 1;
            }
        }
    }
    Ok(types)
}

// llama_tensor_get_type_impl, the branches that apply to qwen3 / qwen35 (one
// expert, not Falcon, not a 70B llama) and the six file types.
fn choose(
    model: &MixModel,
    ftype: GgufFileType,
    tensor: &MixTensor<'_>,
    category: Category,
    position: &MixPosition,
) -> GgmlType {
    let mut new_type = ftype.default_type();
    if category == Category::Output
        || (position.has_tied_embeddings && category == Category::TokenEmbd)
    {
        let nx = tensor.dims.first().copied().unwrap_or(0);
        if nx % new_type.block().elements != 0 {
            new_type = GgmlType::Q8_0;
        } else if new_type != GgmlType::Q8_0 {
            new_type = GgmlType::Q6_K;
        }
    } else if category == Category::TokenEmbd {
        // no rule for these file types
    } else if is_attn_v_like(category) {
        if ftype == GgufFileType::IQ4_XS && model.n_gqa() >= 4 {
            new_type = GgmlType::Q5_K;
        } else if matches!(ftype, GgufFileType::Q4_K_M | GgufFileType::Q5_K_M)
            && use_more_bits(position.i_attention_wv, position.n_attention_wv)
        {
            new_type = GgmlType::Q6_K;
        }
    } else if category == Category::FfnDown {
        // layer_info: with one expert the layer is the running count of ffn_down
        // tensors, out of block_count.
        let (i_layer, n_layer) = (position.i_ffn_down, model.block_count);
        match ftype {
            GgufFileType::Q4_K_M if use_more_bits(i_layer, n_layer) => {
                new_type = GgmlType::Q6_K;
            }
            GgufFileType::IQ4_XS if i_layer < n_layer / 8 => new_type = GgmlType::Q5_K,
            GgufFileType::Q5_K_M if use_more_bits(i_layer, n_layer) => {
                new_type = GgmlType::Q6_K;
            }
            _ => {}
        }
    }
    // attn_k, attn_q, attn_output, ffn_gate, ffn_up: no rule for these file types
    // (the attn_qkv branch further down in the C is unreachable: attn_qkv is
    // attn_v-like).
    new_type
}

// tensor_type_fallback
fn fallback(target: GgmlType, in_features: usize) -> GgmlType {
    let block = target.block().elements;
    if in_features.is_multiple_of(block) {
        return target;
    }
    let demoted = match target {
        GgmlType::IQ4_XS => GgmlType::IQ4_NL,
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        other => other,
    };
    if in_features.is_multiple_of(demoted.block().elements) {
        demoted
    } else {
        GgmlType::F16
    }
}
