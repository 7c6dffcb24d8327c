//! Deterministic synthetic checkpoints for loraq's tests and benchmarks.
//!
//! [`write_synth`] writes `base/`, `merged/` and `true-adapter/` with the real
//! Qwen3.5 tensor names (`model.language_model.layers...`), config.json and module
//! set: linear-attention (Gated DeltaNet) and full-attention layers interleaved as
//! `layer_types` says. The merged weights are `bf16(base + B A)`, computed in f32 from
//! the bf16 factors of the true adapter and rounded once, so the true adapter
//! reproduces the merge up to that single rounding.
//!
//! Magnitudes follow what a real fine-tune leaves: base weights `N(0, 1/in)`; the
//! LoRA delta of each module has an RMS of 11-60 bf16 ulps of the weights
//! (drawn per module), with a singular spectrum decaying tenfold over the rank, so a
//! perfect extraction leaves 0.2-4% of the delta norm (the bf16 rounding floor).
//!
//! [`questions`] draws the random demo's record sets: questions whose gold answers
//! follow a reference model's own probabilities, and calibration prompts.
//! [`merge`] merges a PEFT adapter into a bf16 base as PEFT does, for the demo's
//! trained pair (a committed base and a LoRA fine-tune of it, merged at run time).

pub mod merge;
pub mod questions;

use loraq_io::convert::{f32_to_bf16_bits, round_to_bf16};
use loraq_io::{
    AdapterConfig, AtomicDir, CheckpointWriter, DType, IoError, LayerType, LoraFactors, TensorSpec,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

/// Errors of synthetic checkpoint generation.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// Writing a checkpoint failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// An option outside what the preset allows.
    #[error("synth: {0}")]
    Invalid(String),
}

/// Result alias of loraq-synth.
pub type Result<T> = std::result::Result<T, SynthError>;

/// Model sizes `loraq synth` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// Hidden 64, 4 layers: unit and end-to-end tests.
    Tiny,
    /// About 30M parameters, 8 layers: the demo.
    Demo,
    /// Qwen3.5-9B's exact layer shapes, one layer of each type.
    Slice9b,
    /// Qwen3.8-27B's exact layer shapes, one layer of each type.
    Slice27b,
}

impl Preset {
    /// Parses `tiny`, `demo`, `9b-slice`, `27b-slice`.
    pub fn parse(name: &str) -> Option<Preset> {
        match name {
            "tiny" => Some(Preset::Tiny),
            "demo" => Some(Preset::Demo),
            "9b-slice" => Some(Preset::Slice9b),
            "27b-slice" => Some(Preset::Slice27b),
            _ => None,
        }
    }

    /// The preset's name.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Demo => "demo",
            Preset::Slice9b => "9b-slice",
            Preset::Slice27b => "27b-slice",
        }
    }

    /// The preset's dimensions.
    pub fn shapes(self) -> Shapes {
        match self {
            Preset::Tiny => Shapes {
                hidden: 64,
                intermediate: 128,
                layer_types: hybrid_layer_types(4),
                linear_key_heads: 2,
                linear_value_heads: 4,
                linear_key_dim: 16,
                linear_value_dim: 16,
                conv_kernel: 4,
                attention_heads: 4,
                kv_heads: 2,
                head_dim: 16,
                vocab: 256,
                default_rank: 8,
                max_shard_bytes: 128 << 10,
            },
            Preset::Demo => Shapes {
                hidden: 512,
                intermediate: 1536,
                layer_types: hybrid_layer_types(8),
                linear_key_heads: 4,
                linear_value_heads: 8,
                linear_key_dim: 64,
                linear_value_dim: 64,
                conv_kernel: 4,
                attention_heads: 8,
                kv_heads: 2,
                head_dim: 64,
                vocab: 4096,
                default_rank: 32,
                max_shard_bytes: 32 << 20,
            },
            Preset::Slice9b => Shapes {
                hidden: 4096,
                intermediate: 12288,
                layer_types: vec![LayerType::LinearAttention, LayerType::FullAttention],
                linear_key_heads: 16,
                linear_value_heads: 32,
                linear_key_dim: 128,
                linear_value_dim: 128,
                conv_kernel: 4,
                attention_heads: 16,
                kv_heads: 4,
                head_dim: 256,
                vocab: 2048,
                default_rank: 256,
                max_shard_bytes: 1 << 30,
            },
            Preset::Slice27b => Shapes {
                hidden: 5120,
                intermediate: 17408,
                layer_types: vec![LayerType::LinearAttention, LayerType::FullAttention],
                linear_key_heads: 16,
                linear_value_heads: 48,
                linear_key_dim: 128,
                linear_value_dim: 128,
                conv_kernel: 4,
                attention_heads: 24,
                kv_heads: 4,
                head_dim: 256,
                vocab: 2048,
                default_rank: 256,
                max_shard_bytes: 1 << 30,
            },
        }
    }
}

fn hybrid_layer_types(layers: usize) -> Vec<LayerType> {
    (0..layers)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                LayerType::FullAttention
            } else {
                LayerType::LinearAttention
            }
        })
        .collect()
}

/// Dimensions of a synthetic Qwen3.5 text backbone.
#[derive(Debug, Clone, PartialEq)]
pub struct Shapes {
    /// Hidden size.
    pub hidden: usize,
    /// MLP intermediate size.
    pub intermediate: usize,
    /// Token mixer per layer.
    pub layer_types: Vec<LayerType>,
    /// Gated DeltaNet key heads.
    pub linear_key_heads: usize,
    /// Gated DeltaNet value heads.
    pub linear_value_heads: usize,
    /// Gated DeltaNet key head dimension.
    pub linear_key_dim: usize,
    /// Gated DeltaNet value head dimension.
    pub linear_value_dim: usize,
    /// Causal conv1d kernel width.
    pub conv_kernel: usize,
    /// Attention query heads.
    pub attention_heads: usize,
    /// Attention key/value heads.
    pub kv_heads: usize,
    /// Attention head dimension.
    pub head_dim: usize,
    /// Vocabulary size (small in the slices: they exist for the projections).
    pub vocab: usize,
    /// LoRA rank when none is given.
    pub default_rank: usize,
    /// Shard size limit of the written checkpoints.
    pub max_shard_bytes: usize,
}

impl Shapes {
    fn conv_dim(&self) -> usize {
        2 * self.linear_key_heads * self.linear_key_dim
            + self.linear_value_heads * self.linear_value_dim
    }

    /// Every tensor of the backbone, in write order: (name, shape, kind).
    fn tensors(&self) -> Vec<(String, Vec<usize>, Init)> {
        let h = self.hidden;
        let mut out = vec![(
            "model.language_model.embed_tokens.weight".to_string(),
            vec![self.vocab, h],
            Init::Embedding,
        )];
        for (i, layer_type) in self.layer_types.iter().enumerate() {
            let p = format!("model.language_model.layers.{i}");
            out.push((
                format!("{p}.input_layernorm.weight"),
                vec![h],
                Init::NormOffset,
            ));
            match layer_type {
                LayerType::LinearAttention => {
                    let nv = self.linear_value_heads;
                    let value_dim = nv * self.linear_value_dim;
                    let la = format!("{p}.linear_attn");
                    out.extend([
                        (
                            format!("{la}.in_proj_qkv.weight"),
                            vec![self.conv_dim(), h],
                            Init::Linear,
                        ),
                        (
                            format!("{la}.in_proj_z.weight"),
                            vec![value_dim, h],
                            Init::Linear,
                        ),
                        (format!("{la}.in_proj_a.weight"), vec![nv, h], Init::Linear),
                        (format!("{la}.in_proj_b.weight"), vec![nv, h], Init::Linear),
                        (
                            format!("{la}.conv1d.weight"),
                            vec![self.conv_dim(), 1, self.conv_kernel],
                            Init::Conv,
                        ),
                        (format!("{la}.A_log"), vec![nv], Init::ALog),
                        (format!("{la}.dt_bias"), vec![nv], Init::Ones),
                        (
                            format!("{la}.norm.weight"),
                            vec![self.linear_value_dim],
                            Init::NormScale,
                        ),
                        (
                            format!("{la}.out_proj.weight"),
                            vec![h, value_dim],
                            Init::Linear,
                        ),
                    ]);
                }
                LayerType::FullAttention => {
                    let sa = format!("{p}.self_attn");
                    let (heads, kv, hd) = (self.attention_heads, self.kv_heads, self.head_dim);
                    out.extend([
                        // Twice the heads: the query and its output gate.
                        (
                            format!("{sa}.q_proj.weight"),
                            vec![2 * heads * hd, h],
                            Init::Linear,
                        ),
                        (
                            format!("{sa}.k_proj.weight"),
                            vec![kv * hd, h],
                            Init::Linear,
                        ),
                        (
                            format!("{sa}.v_proj.weight"),
                            vec![kv * hd, h],
                            Init::Linear,
                        ),
                        (
                            format!("{sa}.o_proj.weight"),
                            vec![h, heads * hd],
                            Init::Linear,
                        ),
                        (format!("{sa}.q_norm.weight"), vec![hd], Init::NormOffset),
                        (format!("{sa}.k_norm.weight"), vec![hd], Init::NormOffset),
                    ]);
                }
            }
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                Init::NormOffset,
            ));
            let m = format!("{p}.mlp");
            out.extend([
                (
                    format!("{m}.gate_proj.weight"),
                    vec![self.intermediate, h],
                    Init::Linear,
                ),
                (
                    format!("{m}.up_proj.weight"),
                    vec![self.intermediate, h],
                    Init::Linear,
                ),
                (
                    format!("{m}.down_proj.weight"),
                    vec![h, self.intermediate],
                    Init::Linear,
                ),
            ]);
        }
        out.push((
            "model.language_model.norm.weight".into(),
            vec![h],
            Init::NormOffset,
        ));
        out.push(("lm_head.weight".into(), vec![self.vocab, h], Init::Linear));
        out
    }

    /// Tensors only the base holds: a multi-token-prediction head the merge dropped,
    /// as published merges often do.
    fn base_only_tensors(&self) -> Vec<(String, Vec<usize>, Init)> {
        let h = self.hidden;
        vec![
            ("mtp.fc.weight".into(), vec![h, 2 * h], Init::Linear),
            ("mtp.norm.weight".into(), vec![h], Init::NormOffset),
            (
                "mtp.pre_fc_norm_embedding.weight".into(),
                vec![h],
                Init::NormOffset,
            ),
            (
                "mtp.pre_fc_norm_hidden.weight".into(),
                vec![h],
                Init::NormOffset,
            ),
        ]
    }

    /// config.json of the synthetic model, as Qwen3.5 checkpoints write it.
    pub fn config_json(&self) -> serde_json::Value {
        let layer_types: Vec<&str> = self.layer_types.iter().map(|t| t.as_str()).collect();
        serde_json::json!({
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "text_config": {
                "model_type": "qwen3_5_text",
                "hidden_size": self.hidden,
                "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layer_types.len(),
                "layer_types": layer_types,
                "full_attention_interval": 4,
                "num_attention_heads": self.attention_heads,
                "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "attn_output_gate": true,
                "linear_num_key_heads": self.linear_key_heads,
                "linear_num_value_heads": self.linear_value_heads,
                "linear_key_head_dim": self.linear_key_dim,
                "linear_value_head_dim": self.linear_value_dim,
                "linear_conv_kernel_dim": self.conv_kernel,
                "vocab_size": self.vocab,
                "rms_norm_eps": 1e-6,
                "hidden_act": "silu",
                "max_position_embeddings": 262144,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10_000_000.0,
                    "partial_rotary_factor": 0.25
                },
                "tie_word_embeddings": false,
                "dtype": "bfloat16"
            }
        })
    }
}

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Init {
    /// N(0, 1/in): a trained projection's scale.
    Linear,
    /// N(0, 1).
    Embedding,
    /// Qwen3.5's (1 + w) norms: w ~ N(0, 0.1^2).
    NormOffset,
    /// The gated norm's plain scale: 1 + N(0, 0.1^2).
    NormScale,
    /// Causal conv taps: N(0, 1/kernel).
    Conv,
    /// log(U(1, 16)), as Gated DeltaNet initializes A.
    ALog,
    /// Ones (dt_bias).
    Ones,
}

/// What `write_synth` should produce.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthOptions {
    /// Model size.
    pub preset: Preset,
    /// Seed of every random draw.
    pub seed: u64,
    /// LoRA rank (the preset's default when `None`).
    pub rank: Option<usize>,
    /// Adapted layers (all when `None`).
    pub lora_layers: Option<RangeInclusive<usize>>,
}

/// What `write_synth` wrote.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SynthSummary {
    /// Output directory.
    pub out: PathBuf,
    /// Preset name.
    pub preset: &'static str,
    /// Seed.
    pub seed: u64,
    /// Default LoRA rank.
    pub rank: usize,
    /// Tensors in the base.
    pub base_tensors: usize,
    /// Tensors in the merge.
    pub merged_tensors: usize,
    /// Adapted modules.
    pub adapted_modules: usize,
    /// Parameters of the base.
    pub base_parameters: usize,
    /// Bytes of each checkpoint's weights.
    pub base_bytes: usize,
}

/// Per-tensor seed: the run's seed mixed with the tensor name (FNV-1a), so every
/// tensor's values are independent of the order and the thread count.
fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Standard normal draws (Box-Muller), `n` of them, filled in parallel chunks each
/// with its own generator so the result does not depend on the thread count.
fn normals(seed: u64, n: usize) -> Vec<f32> {
    const CHUNK: usize = 1 << 16;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, dst)| {
        let mut rng =
            ChaCha8Rng::seed_from_u64(seed ^ (c as u64).wrapping_mul(0xd6e8_feb8_6659_fd93));
        for pair in dst.chunks_mut(2) {
            let u1 = (rng.random::<u32>() as f64 + 1.0) / 4_294_967_297.0;
            let u2 = rng.random::<u32>() as f64 / 4_294_967_296.0;
            let r = (-2.0 * u1.ln()).sqrt();
            let t = std::f64::consts::TAU * u2;
            pair[0] = (r * t.cos()) as f32;
            if pair.len() > 1 {
                pair[1] = (r * t.sin()) as f32;
            }
        }
    });
    out
}

fn draw(seed: u64, name: &str, shape: &[usize], init: Init) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let seed = tensor_seed(seed, name);
    let fan_in = *shape.last().unwrap_or(&1) as f32;
    match init {
        Init::Ones => vec![1.0; n],
        Init::ALog => {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..n)
                .map(|_| rng.random_range(1.0f32..16.0).ln())
                .collect()
        }
        _ => {
            let (offset, std) = match init {
                Init::Linear => (0.0, fan_in.sqrt().recip()),
                Init::Embedding => (0.0, 1.0),
                Init::NormOffset => (0.0, 0.1),
                Init::NormScale => (1.0, 0.1),
                Init::Conv => (0.0, (shape[shape.len() - 1] as f32).sqrt().recip()),
                Init::Ones | Init::ALog => unreachable!(),
            };
            let mut v = normals(seed, n);
            v.iter_mut().for_each(|x| *x = offset + std * *x);
            v
        }
    }
}

/// `out[i, :] = sum_k b[i, k] * a[k, :]` in f32, one output row per task with a fixed
/// summation order, so the product is the same on every machine and thread count.
fn low_rank_product(b: &[f32], a: &[f32], rows: usize, rank: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    out.par_chunks_mut(cols).enumerate().for_each(|(i, row)| {
        for k in 0..rank {
            let coef = b[i * rank + k];
            let a_row = &a[k * cols..(k + 1) * cols];
            for (o, &x) in row.iter_mut().zip(a_row) {
                *o += coef * x;
            }
        }
    });
    out
}

/// The true LoRA factors of one module, already rounded to bf16 (held as f32).
struct TrueFactors {
    rank: usize,
    a: Vec<f32>,
    b: Vec<f32>,
}

/// Draws factors whose product has an RMS of `ulps` bf16 ulps of weights of scale
/// `weight_std`, with singular values decaying tenfold from the first to the last.
fn draw_factors(
    seed: u64,
    name: &str,
    out_f: usize,
    in_f: usize,
    rank: usize,
    weight_std: f32,
) -> TrueFactors {
    let mut rng = ChaCha8Rng::seed_from_u64(tensor_seed(seed, &format!("{name}#magnitude")));
    // A typical bf16 ulp of N(0, s^2) weights is about s * 2^-8. 11-60 of them put the
    // rounding floor of the merge at 0.6-3.7% of the delta norm: inside the 0.2-4% a
    // real fine-tune leaves.
    let ulps = (11f32.ln() + rng.random::<f32>() * (60f32.ln() - 11f32.ln())).exp();
    let target_rms = ulps * weight_std * 2f32.powi(-8);
    let decay: Vec<f32> = (0..rank)
        .map(|j| 10f32.powf(-(j as f32) / (rank.max(2) - 1) as f32))
        .collect();
    let norm = decay.iter().map(|d| d * d).sum::<f32>().sqrt();
    let a = normals(tensor_seed(seed, &format!("{name}#lora_A")), rank * in_f)
        .into_iter()
        .map(round_to_bf16)
        .collect();
    let mut b = normals(tensor_seed(seed, &format!("{name}#lora_B")), out_f * rank);
    for row in b.chunks_mut(rank) {
        for (x, d) in row.iter_mut().zip(&decay) {
            *x = round_to_bf16(*x * d * target_rms / norm);
        }
    }
    TrueFactors { rank, a, b }
}

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    loraq_io::convert::f32_to_bf16_bytes(values)
}

/// One linear projection of a synthetic pair, in memory: what [`write_synth`] draws
/// for a module of this name and shape, without writing a checkpoint (benchmarks and
/// examples of a single 27B-sized projection).
#[derive(Debug, Clone, PartialEq)]
pub struct ProjectionPair {
    /// Output features (rows).
    pub out_features: usize,
    /// Input features (columns).
    pub in_features: usize,
    /// Rank of the true LoRA.
    pub rank: usize,
    /// The base weight, `[out, in]` row-major, bf16 values held as f32.
    pub base: Vec<f32>,
    /// `bf16(base + B A)`, `[out, in]` row-major, bf16 values held as f32.
    pub merged: Vec<f32>,
    /// The true LoRA `A`, `[rank, in]`, bf16 values held as f32.
    pub lora_a: Vec<f32>,
    /// The true LoRA `B`, `[out, rank]`, bf16 values held as f32.
    pub lora_b: Vec<f32>,
}

/// Draws the projection `name` of shape `[out_features, in_features]` with a true
/// LoRA of `rank`, exactly as [`write_synth`] does for a module of that name, shape,
/// rank and seed (base `N(0, 1/in)`, delta of 11-60 bf16 ulps RMS, singular values
/// decaying tenfold, merge rounded to bf16 once).
pub fn projection_pair(
    name: &str,
    out_features: usize,
    in_features: usize,
    rank: usize,
    seed: u64,
) -> Result<ProjectionPair> {
    if out_features == 0 || in_features == 0 {
        return Err(SynthError::Invalid(format!(
            "projection {name}: shape [{out_features}, {in_features}] is empty"
        )));
    }
    if rank == 0 || rank > out_features.min(in_features) || rank > 512 {
        return Err(SynthError::Invalid(format!(
            "projection {name}: rank {rank} is outside 1..={}",
            out_features.min(in_features).min(512)
        )));
    }
    let mut base = draw(seed, name, &[out_features, in_features], Init::Linear);
    base.par_iter_mut().for_each(|x| *x = round_to_bf16(*x));
    let f = draw_factors(
        seed,
        name,
        out_features,
        in_features,
        rank,
        (in_features as f32).sqrt().recip(),
    );
    let mut merged = low_rank_product(&f.b, &f.a, out_features, f.rank, in_features);
    merged
        .par_iter_mut()
        .zip(&base)
        .for_each(|(d, w)| *d = round_to_bf16(*d + w));
    Ok(ProjectionPair {
        out_features,
        in_features,
        rank,
        base,
        merged,
        lora_a: f.a,
        lora_b: f.b,
    })
}

/// Writes `out/base`, `out/merged` and `out/true-adapter`. The whole of `out`
/// appears at once when everything is written; an existing `out` is refused
/// unless `force`. `progress(done, total, tensor)` is called after each tensor.
pub fn write_synth(
    out: &Path,
    options: &SynthOptions,
    force: bool,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<SynthSummary> {
    let shapes = options.preset.shapes();
    let rank = options.rank.unwrap_or(shapes.default_rank);
    if rank == 0 || rank > 512 {
        return Err(SynthError::Invalid(format!(
            "rank {rank} is outside 1..=512"
        )));
    }
    let layers = shapes.layer_types.len();
    let lora_layers = options.lora_layers.clone().unwrap_or(0..=layers - 1);
    if *lora_layers.end() >= layers || lora_layers.is_empty() {
        return Err(SynthError::Invalid(format!(
            "--lora-layers {}-{} is outside the preset's layers 0-{}",
            lora_layers.start(),
            lora_layers.end(),
            layers - 1
        )));
    }
    let dir = AtomicDir::create(out, force, &[])?;
    let base_dir = dir.path().join("base");
    let merged_dir = dir.path().join("merged");
    let adapter_dir = dir.path().join("true-adapter");
    for d in [&base_dir, &merged_dir, &adapter_dir] {
        std::fs::create_dir(d).map_err(|source| IoError::Os {
            path: d.clone(),
            source,
        })?;
    }
    let config = serde_json::to_string_pretty(&shapes.config_json()).expect("json") + "\n";
    for d in [&base_dir, &merged_dir] {
        let path = d.join(loraq_io::CONFIG_FILE);
        std::fs::write(&path, &config).map_err(|source| IoError::Os { path, source })?;
    }

    let tensors = shapes.tensors();
    let base_only = shapes.base_only_tensors();
    let spec = |(name, shape, _): &(String, Vec<usize>, Init)| {
        TensorSpec::new(name.clone(), DType::BF16, shape.clone())
    };
    let base_specs: Vec<TensorSpec> = tensors.iter().chain(&base_only).map(spec).collect();
    let merged_specs: Vec<TensorSpec> = tensors.iter().map(spec).collect();
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let mut base = CheckpointWriter::new(
        &base_dir,
        base_specs.clone(),
        shapes.max_shard_bytes,
        metadata.clone(),
    )?;
    let mut merged = CheckpointWriter::new(
        &merged_dir,
        merged_specs.clone(),
        shapes.max_shard_bytes,
        metadata,
    )?;

    let mut factors = Vec::new();
    let mut ranks = BTreeMap::new();
    let mut base_parameters = 0usize;
    let total = tensors.len() + base_only.len();
    for (done, entry) in tensors.iter().chain(&base_only).enumerate() {
        let (name, shape, init) = entry;
        progress(done, total, name);
        let mut values = draw(options.seed, name, shape, *init);
        values.par_iter_mut().for_each(|x| *x = round_to_bf16(*x));
        base_parameters += values.len();
        let bytes = bf16_bytes(&values);
        base.write_tensor(name, &bytes)?;
        if base_only.contains(entry) {
            continue;
        }
        let module = loraq_io::ModuleName::parse(name)
            .filter(|m| m.is_linear_weight() && lora_layers.contains(&m.layer));
        let Some(module) = module else {
            merged.write_tensor(name, &bytes)?;
            continue;
        };
        let (out_f, in_f) = (shape[0], shape[1]);
        // in_proj_a / in_proj_b are adapted at their full width, as published
        // adapters of Qwen3.5 do (rank_pattern entries).
        let module_rank = if matches!(
            module.kind,
            loraq_io::ModuleKind::InProjA | loraq_io::ModuleKind::InProjB
        ) {
            out_f.min(in_f)
        } else {
            rank.min(out_f).min(in_f)
        };
        let f = draw_factors(
            options.seed,
            name,
            out_f,
            in_f,
            module_rank,
            (in_f as f32).sqrt().recip(),
        );
        let delta = low_rank_product(&f.b, &f.a, out_f, f.rank, in_f);
        let mut merged_values = delta;
        merged_values
            .par_iter_mut()
            .zip(&values)
            .for_each(|(d, w)| *d += w);
        merged.write_tensor(name, &bf16_bytes(&merged_values))?;
        let module_path = module.module_path();
        ranks.insert(module_path.clone(), f.rank);
        factors.push(LoraFactors {
            module_path,
            rank: f.rank,
            in_features: in_f,
            out_features: out_f,
            a_bf16: f
                .a
                .iter()
                .flat_map(|&x| f32_to_bf16_bits(x).to_le_bytes())
                .collect(),
            b_bf16: f
                .b
                .iter()
                .flat_map(|&x| f32_to_bf16_bits(x).to_le_bytes())
                .collect(),
        });
    }
    base.finish()?;
    merged.finish()?;
    let adapter_config = AdapterConfig::for_ranks(
        rank,
        &ranks,
        Some(format!(
            "loraq-synth/{}-seed{}",
            options.preset.name(),
            options.seed
        )),
        None,
    );
    loraq_io::write_adapter(&adapter_dir, &adapter_config, &factors)?;
    let base_bytes = base_specs
        .iter()
        .map(|s| s.shape.iter().product::<usize>() * 2)
        .sum();
    let summary = SynthSummary {
        out: out.to_path_buf(),
        preset: options.preset.name(),
        seed: options.seed,
        rank,
        base_tensors: base_specs.len(),
        merged_tensors: merged_specs.len(),
        adapted_modules: factors.len(),
        base_parameters,
        base_bytes,
    };
    dir.commit()?;
    Ok(summary)
}
