//! The decoder: weights loaded tensor by tensor, and the forward pass of a prompt
//! up to the final norm's last-position hidden state.

use crate::config::TextConfig;
use crate::error::{ModelError, Result, TensorContext};
use crate::linear::{
    AmxLinear, AmxLora, DenseLinear, GatheredInputLinear, InputSqSum, InputStatsLinear,
    KernelLinear, LinearLayer, LoraFactorsF32,
};
use crate::ops::{self, DeltaRuleDims};
use candle_core::{DType, Device, Tensor};
use loraq_io::{Checkpoint, LayerType, LoraAdapter};
use loraq_quant::{
    ActivationQuant, ActivationQuantKind, Nvfp4GlobalScale, QuantizedBase, StoredWeight,
    WeightFormat,
};
use rayon::prelude::*;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A loaded text backbone with its (optional) adapter attached to the linears.
#[derive(Debug)]
pub struct Model {
    /// Hyperparameters.
    pub config: TextConfig,
    device: Device,
    /// `[vocab, hidden]`.
    embed: Tensor,
    layers: Vec<DecoderLayer>,
    /// The final norm's effective scale (offset applied).
    final_norm: Vec<f32>,
    /// `[vocab, hidden]`.
    lm_head: Tensor,
    /// `1 / theta^(2i / rotary_dim)`, `i < rotary_dim / 2`.
    inv_freq: Vec<f32>,
    /// Number of linears that carry an adapter.
    adapted: usize,
    /// How many linears each implementation runs.
    linears_by_backend: std::collections::BTreeMap<&'static str, usize>,
    /// Input statistics of every linear, in load order; `None` unless
    /// [`LoadOptions::collect_input_stats`].
    input_stats: Option<InputStatsRegistry>,
    /// The forward pass's activation buffers, kept from one batch to the next so a
    /// batch faults in no fresh pages (a pass that finds them in use by another
    /// thread's pass allocates its own).
    scratch: Mutex<Activations>,
    /// Whether linears on the same input may run at once (every backend but CUDA's,
    /// whose linears share one stream).
    concurrent_linears: bool,
}

/// The shared sums of every statistics-collecting linear, and what they were
/// taken over.
#[derive(Debug, Default)]
struct InputStatsRegistry {
    modules: Vec<(String, Arc<Mutex<InputSqSum>>)>,
    prompts: AtomicU64,
    tokens: AtomicU64,
}

#[derive(Debug)]
struct DecoderLayer {
    input_norm: Vec<f32>,
    post_attention_norm: Vec<f32>,
    mixer: Mixer,
    mlp: Mlp,
}

#[derive(Debug)]
enum Mixer {
    Linear(Box<GatedDeltaNet>),
    Full(Box<Attention>),
}

type Linear = Box<dyn LinearLayer>;

#[derive(Debug)]
struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_a: Linear,
    in_proj_b: Linear,
    out_proj: Linear,
    /// `[conv_dim, kernel]`.
    conv_weight: Vec<f32>,
    /// `-exp(A_log)` per value head.
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    /// Gated RMSNorm scale `[value_dim]` (used as is, no offset).
    norm_weight: Vec<f32>,
}

#[derive(Debug)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

#[derive(Debug)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

/// Reads tensors from a checkpoint onto a device, checking shapes, and attaches
/// adapter factors to linears.
struct Loader<'a> {
    base: &'a QuantizedBase,
    checkpoint: &'a Checkpoint,
    act_quant: ActivationQuantKind,
    backend: LinearBackend,
    /// The kernels backend the linears are built on (`None` for `Dense`).
    kernels: Option<loraq_kernels::Backend>,
    /// How many linears each implementation runs (`dense`, `cpu`, ...).
    linears_by_backend: std::collections::BTreeMap<&'static str, usize>,
    adapter: Option<(&'a LoraAdapter, &'a Path)>,
    used_adapter_modules: BTreeSet<String>,
    device: &'a Device,
    /// Where statistics-collecting linears register their sums; `None` when off.
    input_stats: Option<InputStatsRegistry>,
    /// Build the kernels' CPU linears with their weights decoded once into the prefill
    /// GEMM's f32 panels ([`PACKED_PANEL_BUDGET`]).
    pack_panels: bool,
}

/// The most memory [`Model::load`] spends on the CPU linears' packed f32 panels
/// (`loraq_kernels::QuantLoraLinear::with_packed_panels`): a model whose linears all
/// fit as f32 within it has every weight decoded once at load, so that prefill reads
/// the panels instead of decoding each block's again for every tile of tokens (2.5-3%
/// of a 512-token prefill's time on the demo model, whose panels take 108 MB); a
/// larger model (anything past a fraction of a billion parameters) keeps decoding per
/// tile, at no memory cost. All or none: the results are the same bits either way.
pub const PACKED_PANEL_BUDGET: usize = 512 << 20;

/// The `[out, in]` shape of every linear [`Model::load`] builds for `c` (for the panel
/// budget; the shapes are checked against the checkpoint as each is loaded).
fn linear_shapes(c: &TextConfig) -> Vec<(usize, usize)> {
    let h = c.hidden;
    let mut shapes = Vec::new();
    for layer_type in &c.layer_types {
        match layer_type {
            LayerType::LinearAttention => {
                let key_dim = c.linear_key_heads * c.linear_key_dim;
                let value_dim = c.linear_value_heads * c.linear_value_dim;
                shapes.extend([
                    (2 * key_dim + value_dim, h),
                    (value_dim, h),
                    (c.linear_value_heads, h),
                    (c.linear_value_heads, h),
                    (h, value_dim),
                ]);
            }
            LayerType::FullAttention => {
                let q_out = c.attention_heads * c.head_dim * if c.attn_output_gate { 2 } else { 1 };
                let kv_out = c.kv_heads * c.head_dim;
                shapes.extend([
                    (q_out, h),
                    (kv_out, h),
                    (kv_out, h),
                    (h, c.attention_heads * c.head_dim),
                ]);
            }
        }
        shapes.extend([
            (c.intermediate, h),
            (c.intermediate, h),
            (h, c.intermediate),
        ]);
    }
    shapes
}

impl Loader<'_> {
    fn root(&self) -> PathBuf {
        self.checkpoint.root().to_path_buf()
    }

    fn vec(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        let info = self.checkpoint.info(name)?;
        // Squeeze unit dimensions only for comparison: conv1d is stored [C, 1, K].
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if squeeze(&info.shape) != squeeze(expected) {
            return Err(ModelError::Shape {
                root: self.root(),
                tensor: name.to_string(),
                found: info.shape.clone(),
                expected: expected.to_vec(),
            });
        }
        for suffix in ["_scale_inv", "_scale", "_scale_2", "_packed"] {
            let sibling = format!("{name}{suffix}");
            if self.checkpoint.contains(&sibling) {
                return Err(ModelError::Config {
                    path: self.root(),
                    reason: format!(
                        "{name} is stored quantized (found {sibling}); loraq run reads bf16/f32 checkpoints (write a bf16-emulated copy with `loraq quantize`)"
                    ),
                });
            }
        }
        Ok(self.checkpoint.read_f32_finite(name)?)
    }

    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let v = self.vec(name, shape)?;
        Tensor::from_vec(v, shape, self.device).ctx(name)
    }

    /// A norm scale with the family's offset folded in (`1 + w` for Qwen3.5).
    fn norm(&self, name: &str, dim: usize, offset: f32) -> Result<Vec<f32>> {
        let mut v = self.vec(name, &[dim])?;
        for x in &mut v {
            *x += offset;
        }
        Ok(v)
    }

    /// The linear of `module_path` (`[out, inp]`), wrapped to record its input's
    /// mean square when statistics are collected.
    fn linear(&mut self, module_path: &str, out: usize, inp: usize) -> Result<Linear> {
        let linear = self.plain_linear(module_path, out, inp)?;
        Ok(match &mut self.input_stats {
            None => linear,
            Some(registry) => {
                let sums = Arc::new(Mutex::new(InputSqSum::new(inp)));
                registry
                    .modules
                    .push((module_path.to_string(), Arc::clone(&sums)));
                Box::new(InputStatsLinear::new(module_path.to_string(), linear, sums))
            }
        })
    }

    /// Looks up the weight, attaches the adapter once, and asks the backend for the
    /// linear; refuses (never falls back) when an explicitly requested kernels backend
    /// cannot run the weight or the adapter.
    fn plain_linear(&mut self, module_path: &str, out: usize, inp: usize) -> Result<Linear> {
        let weight_name = format!("{module_path}.weight");
        let quant_err = |source| ModelError::Quant {
            module: module_path.to_string(),
            source,
        };
        let stored = self.base.weight(&weight_name).map_err(quant_err)?;
        if (stored.out_features, stored.in_features) != (out, inp) {
            return Err(ModelError::Shape {
                root: self.root(),
                tensor: weight_name,
                found: vec![stored.out_features, stored.in_features],
                expected: vec![out, inp],
            });
        }
        // A GGUF weight kept in GGUF's column order (an out_proj whose value heads cut
        // through its blocks) runs on the kernels in that order, on the input gathered
        // into it; decoded (the dense path) it is in the checkpoint's order.
        let input_gather = stored.input_gather().map(<[usize]>::to_vec);
        let act_quant = self.activation_quant(module_path, &stored.stored)?;
        let adapter = self.adapter_factors(module_path, out, inp)?;
        let format = stored.stored.format();
        let runs_on_kernels = match &self.kernels {
            None => false,
            Some(backend) => {
                let format_runs = format.is_some_and(loraq_kernels::has_kernel);
                let factors_run = adapter.as_ref().is_none_or(AdapterFactors::is_bf16);
                match self.backend {
                    LinearBackend::Auto => format_runs && factors_run,
                    _ if !format_runs => {
                        return Err(ModelError::Kernel {
                            module: module_path.to_string(),
                            source: loraq_kernels::KernelError::UnsupportedScheme {
                                what: format!(
                                    "{} weights on the {} backend (--backend dense or auto runs them)",
                                    stored.stored.format_name(),
                                    backend.name()
                                ),
                            },
                        });
                    }
                    _ if !factors_run => {
                        let (_, dir) = self.adapter.expect("factors come from an adapter");
                        return Err(ModelError::Adapter {
                            path: dir.to_path_buf(),
                            reason: format!(
                                "{module_path}: the {} backend takes bf16 LoRA factors (--backend dense or auto runs others)",
                                backend.name()
                            ),
                        });
                    }
                    _ => true,
                }
            }
        };
        if let Some(adapter) = &adapter {
            self.used_adapter_modules.insert(module_path.to_string());
            debug_assert_eq!(adapter.a_len(), adapter.rank * inp);
        }
        if runs_on_kernels {
            let backend = self.kernels.clone().expect("checked above");
            let kernel_err = |source| ModelError::Kernel {
                module: module_path.to_string(),
                source,
            };
            // Read once, in the stored format; the read refuses a NaN or infinite value
            // (a NaN weight makes every logit NaN) by file, tensor and element.
            let weight = self.base.quantized_weight(module_path).map_err(quant_err)?;
            // The weight's columns in the stored order: A's columns follow them, so
            // that `A' x'` on the gathered input is the checkpoint's `A x`.
            let adapter = match (&input_gather, adapter) {
                (Some(gather), Some(mut f)) => {
                    f.values = match f.values {
                        FactorValues::Bf16 { a, b } => FactorValues::Bf16 {
                            a: gather_columns(&a, inp, gather),
                            b,
                        },
                        FactorValues::F32 { a, b } => FactorValues::F32 {
                            a: gather_columns(&a, inp, gather),
                            b,
                        },
                    };
                    Some(f)
                }
                (_, adapter) => adapter,
            };
            // The auto backend on an AMX machine runs prefill-sized products on AMX
            // tiles where the weight and the factors are bf16 values (exact as one
            // plane) and no activation fake-quant applies; LORAQ_AMX=0 turns it off.
            // Only an unquantized bf16 base: the tiles take a packed copy of the weight
            // (2 bytes a weight beside the kernel's copy), which for a 4-bit base would
            // be four times its codes, and decoding every quantized weight to test it
            // would slow every load.
            let amx = match self.backend {
                LinearBackend::Auto if act_quant == ActivationQuant::None => {
                    loraq_amx::Amx::detect()
                }
                _ => None,
            };
            let pack = |bits: &[half::bf16], rows, cols| {
                use half::slice::HalfFloatSliceExt;
                loraq_amx::PackedBf16::from_weight_bits(bits.reinterpret_cast(), rows, cols)
                    .map_err(|source| ModelError::Amx {
                        module: module_path.to_string(),
                        source,
                    })
            };
            // The tiles' packed weight made from the bf16 values just read, not read
            // again.
            let amx_weight = match (&amx, &weight) {
                (Some(_), loraq_quant::QuantizedWeight::Bf16(w)) => Some(pack(&w.data, out, inp)?),
                _ => None,
            };
            let has_adapter = adapter.is_some();
            let amx_lora = match (&amx_weight, &adapter) {
                (Some(_), Some(f)) => match &f.values {
                    FactorValues::Bf16 { a, b } => Some(AmxLora {
                        a: pack(a, f.rank, inp)?,
                        b: pack(b, out, f.rank)?,
                        scale: f.scale as f32,
                    }),
                    FactorValues::F32 { .. } => None,
                },
                _ => None,
            };
            let lora = adapter
                .map(|f| match f.values {
                    // The factors as stored: the kernels take bf16.
                    FactorValues::Bf16 { a, b } => {
                        loraq_kernels::LoraAdapter::new(f.rank, inp, out, a, b, f.scale as f32)
                    }
                    FactorValues::F32 { .. } => {
                        unreachable!("runs_on_kernels requires bf16 factors")
                    }
                })
                .transpose()
                .map_err(kernel_err)?;
            // Panels only where the kernels run the prefill (not the AMX tiles).
            let linear = if self.pack_panels && amx_weight.is_none() {
                backend.build_with_packed_panels(weight, lora, act_quant)
            } else {
                backend.build(weight, lora, act_quant)
            }
            .map_err(kernel_err)?;
            let linear: Linear = Box::new(KernelLinear::new(module_path.to_string(), linear));
            // A module with LoRA factors the tiles cannot take (f32) stays on the kernels.
            let amx = amx.filter(|_| amx_lora.is_some() || !has_adapter);
            let linear = match amx.zip(amx_weight) {
                None => linear,
                Some((amx, packed)) => {
                    match AmxLinear::new(module_path.to_string(), amx, linear, packed, amx_lora) {
                        // Only bf16 weights get here, and they have no input gather.
                        Ok(tiled) => {
                            *self.linears_by_backend.entry("cpu+amx").or_insert(0) += 1;
                            return Ok(Box::new(tiled));
                        }
                        // Shapes the tiles disagree with: the kernels' linear alone.
                        Err(linear) => linear,
                    }
                }
            };
            let linear: Linear = match &input_gather {
                None => linear,
                Some(gather) => Box::new(GatheredInputLinear::new(
                    module_path.to_string(),
                    linear,
                    gather,
                )?),
            };
            *self.linears_by_backend.entry(backend.name()).or_insert(0) += 1;
            return Ok(linear);
        }
        // Quantized layouts decode exactly to f32 (loraq-quant); the matmul then runs
        // on the decoded values, which is what a dequantizing kernel computes.
        let mut values = self.base.read_weight_f32(&weight_name).map_err(quant_err)?;
        // A NaN weight would turn every logit into NaN; refuse it by file and tensor.
        self.checkpoint.ensure_finite(&weight_name, &values)?;
        // The decoded values are in the checkpoint's column order, which gives the same
        // product. Under an activation quantization a weight kept in GGUF's column
        // order runs in that order here too (values, A and input gathered), so that the
        // quantization's blocks are the stored ones, as on the kernels and in llama.cpp.
        let stored_order = input_gather.filter(|_| act_quant != ActivationQuant::None);
        if let Some(gather) = &stored_order {
            values = gather_columns(&values, inp, gather);
        }
        let weight = Tensor::from_vec(values, (out, inp), self.device).ctx(&weight_name)?;
        let lora = adapter
            .map(|f| -> Result<LoraFactorsF32> {
                let (mut a, b) = f.values.into_f32();
                if let Some(gather) = &stored_order {
                    a = gather_columns(&a, inp, gather);
                }
                Ok(LoraFactorsF32 {
                    a: Tensor::from_vec(a, (f.rank, inp), self.device).ctx(module_path)?,
                    b: Tensor::from_vec(b, (out, f.rank), self.device).ctx(module_path)?,
                    scale: f.scale,
                })
            })
            .transpose()?;
        *self.linears_by_backend.entry("dense").or_insert(0) += 1;
        let dense: Linear = Box::new(
            DenseLinear::new(module_path.to_string(), &weight, lora)?.with_act_quant(act_quant),
        );
        Ok(match stored_order {
            None => dense,
            Some(gather) => Box::new(GatheredInputLinear::new(
                module_path.to_string(),
                dense,
                &gather,
            )?),
        })
    }

    /// The activation quantization of one module's base path. vLLM quantizes NVFP4
    /// activations only where the weight is NVFP4 (excluded modules such as in_proj_a /
    /// in_proj_b and lm_head run unquantized), with the module's static scale.
    fn activation_quant(
        &self,
        module_path: &str,
        stored: &StoredWeight,
    ) -> Result<ActivationQuant> {
        if let Some(quant) = self.act_quant.without_static_scale() {
            return Ok(quant);
        }
        if self.act_quant == ActivationQuantKind::Ggml {
            // llama.cpp quantizes the activations of each ggml weight to its dot
            // product's activation type (Q8_0 or Q8_K); other weights see them as is.
            return Ok(match stored.format() {
                Some(WeightFormat::Ggml(ggml_type)) => ActivationQuant::for_ggml_weight(ggml_type),
                _ => ActivationQuant::None,
            });
        }
        if stored.format() != Some(WeightFormat::Nvfp4) {
            return Ok(ActivationQuant::None);
        }
        // ModelOpt stores the static scale as a multiplier (`input_scale`),
        // compressed-tensors as a divisor (`input_global_scale`); vLLM quantizes with
        // each in its own direction.
        let modelopt = format!("{module_path}.input_scale");
        let compressed_tensors = format!("{module_path}.input_global_scale");
        let input_scale = if self.checkpoint.contains(&modelopt) {
            Nvfp4GlobalScale::Multiplier(self.checkpoint.read_f32_finite(&modelopt)?[0])
        } else if self.checkpoint.contains(&compressed_tensors) {
            Nvfp4GlobalScale::Divisor(self.checkpoint.read_f32_finite(&compressed_tensors)?[0])
        } else {
            return Err(ModelError::Config {
                path: self.root(),
                reason: format!(
                    "--act-quant nvfp4 needs the static global scale {modelopt} (or {compressed_tensors}), which the checkpoint lacks; quantize with --calibration to write it"
                ),
            });
        };
        Ok(ActivationQuant::Nvfp4 { input_scale })
    }

    /// The adapter's factors for `module_path` read once, as stored (bf16 when both
    /// are bf16, else as f32); `None` when the adapter has no such module (or there is
    /// no adapter). Refuses factors whose shape is not the weight's.
    fn adapter_factors(
        &self,
        module_path: &str,
        out: usize,
        inp: usize,
    ) -> Result<Option<AdapterFactors>> {
        let Some((adapter, dir)) = self.adapter else {
            return Ok(None);
        };
        let Some(info) = adapter.module(module_path) else {
            return Ok(None);
        };
        if (info.out_features, info.in_features) != (out, inp) {
            return Err(ModelError::Adapter {
                path: dir.to_path_buf(),
                reason: format!(
                    "{module_path}: adapter is {}x{}, the weight is {out}x{inp}",
                    info.out_features, info.in_features
                ),
            });
        }
        let bf16 = loraq_io::DType::BF16;
        let values = if adapter.factor_dtypes(module_path)? == (bf16, bf16) {
            FactorValues::Bf16 {
                a: adapter.read_a_bf16(module_path)?,
                b: adapter.read_b_bf16(module_path)?,
            }
        } else {
            FactorValues::F32 {
                a: adapter.read_a_f32(module_path)?,
                b: adapter.read_b_f32(module_path)?,
            }
        };
        Ok(Some(AdapterFactors {
            rank: info.rank,
            values,
            scale: info.scale,
        }))
    }
}

/// The columns of a row-major matrix with rows of `cols` gathered: column `j` of the
/// result is column `gather[j]` of `m`.
fn gather_columns<T: Copy>(m: &[T], cols: usize, gather: &[usize]) -> Vec<T> {
    m.chunks_exact(cols.max(1))
        .flat_map(|row| gather.iter().map(move |&c| row[c]))
        .collect()
}

/// One module's LoRA factors, read once whichever backend runs the module.
struct AdapterFactors {
    rank: usize,
    /// `lora_A` (`[rank, in]`) and `lora_B` (`[out, rank]`).
    values: FactorValues,
    /// `alpha / rank` of the module.
    scale: f64,
}

/// LoRA factors as read: bf16 as stored (what the kernels take), or converted to f32
/// when stored in another dtype.
enum FactorValues {
    Bf16 {
        a: Vec<half::bf16>,
        b: Vec<half::bf16>,
    },
    F32 {
        a: Vec<f32>,
        b: Vec<f32>,
    },
}

impl FactorValues {
    /// Both factors as f32 (bf16 converts exactly).
    fn into_f32(self) -> (Vec<f32>, Vec<f32>) {
        match self {
            Self::Bf16 { a, b } => {
                let widen = |v: Vec<half::bf16>| v.into_iter().map(half::bf16::to_f32).collect();
                (widen(a), widen(b))
            }
            Self::F32 { a, b } => (a, b),
        }
    }
}

impl AdapterFactors {
    /// Whether the factors are bf16 as stored (what the kernels take).
    fn is_bf16(&self) -> bool {
        matches!(self.values, FactorValues::Bf16 { .. })
    }

    /// Elements of `lora_A`.
    fn a_len(&self) -> usize {
        match &self.values {
            FactorValues::Bf16 { a, .. } => a.len(),
            FactorValues::F32 { a, .. } => a.len(),
        }
    }
}

/// The tensor-name prefix of the text backbone: `model.language_model.` or `model.`
/// (whatever precedes `embed_tokens.weight`).
fn backbone_prefix(checkpoint: &Checkpoint) -> Result<String> {
    let mut found: Vec<&str> = checkpoint
        .tensors()
        .filter_map(|t| t.name.strip_suffix("embed_tokens.weight"))
        .filter(|p| p.is_empty() || p.ends_with('.'))
        .collect();
    found.sort_unstable();
    match found.as_slice() {
        [one] => Ok(one.to_string()),
        [] => Err(ModelError::Config {
            path: checkpoint.root().to_path_buf(),
            reason: "no embed_tokens.weight tensor: not a text decoder checkpoint".into(),
        }),
        many => Err(ModelError::Config {
            path: checkpoint.root().to_path_buf(),
            reason: format!("several embed_tokens.weight tensors: {many:?}"),
        }),
    }
}

/// Which implementation runs the linears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinearBackend {
    /// Each linear on loraq-kernels' CPU path where it runs the stored format and the
    /// adapter's factors (bf16, fp8-block128, NVFP4 in either layout; bf16 factors),
    /// dense otherwise; [`Model::linears_by_backend`] says how many went where. The
    /// default.
    #[default]
    Auto,
    /// Weights decoded to f32 once, candle matmul (any stored format).
    Dense,
    /// loraq-kernels' fused CPU linear on the stored format for every linear; a format
    /// or adapter it cannot run is refused.
    Kernels,
    /// loraq-kernels' f64 reference for every linear (slow: for checks); refuses as
    /// `Kernels` does.
    Reference,
    /// loraq-kernels' CUDA kernels for every linear (feature `cuda`; the rest of each
    /// layer runs on the CPU); refuses a format or configuration they do not run.
    Cuda,
}

impl LinearBackend {
    /// Parses `auto`, `dense`, `kernels`, `reference` or `cuda`.
    pub fn parse(name: &str) -> Option<LinearBackend> {
        match name {
            "auto" => Some(LinearBackend::Auto),
            "dense" => Some(LinearBackend::Dense),
            "kernels" => Some(LinearBackend::Kernels),
            "reference" => Some(LinearBackend::Reference),
            "cuda" => Some(LinearBackend::Cuda),
            _ => None,
        }
    }

    /// The loraq-kernels backend of this choice (`None` for `Dense`); opens the CUDA
    /// device for `Cuda`.
    fn kernels(self) -> Result<Option<loraq_kernels::Backend>> {
        Ok(match self {
            Self::Dense => None,
            Self::Auto | Self::Kernels => Some(loraq_kernels::Backend::Cpu(
                loraq_kernels::CpuOptions::default(),
            )),
            Self::Reference => Some(loraq_kernels::Backend::Reference),
            Self::Cuda => Some(cuda_backend()?),
        })
    }
}

/// Opens CUDA device 0 with its kernels (precompiled cubins from `LORAQ_CUBIN_DIR`,
/// else NVRTC).
#[cfg(feature = "cuda")]
fn cuda_backend() -> Result<loraq_kernels::Backend> {
    use loraq_kernels::cuda::CudaBackend;
    let no_device = |reason: String| ModelError::Kernel {
        module: "(all linears)".to_string(),
        source: loraq_kernels::KernelError::UnsupportedOnGpu { what: reason },
    };
    if !loraq_kernels::cuda::driver_available() {
        return Err(no_device("no CUDA driver or device on this machine".into()));
    }
    let backend = CudaBackend::open_default(0)
        .map_err(|source| ModelError::Kernel {
            module: "(all linears)".to_string(),
            source,
        })?
        .ok_or_else(|| {
            no_device(format!(
                "no NVRTC found and {} is not set",
                loraq_kernels::cuda::CUBIN_DIR_ENV
            ))
        })?;
    Ok(loraq_kernels::Backend::Cuda(Arc::new(backend)))
}

/// Without the `cuda` feature there is no CUDA backend to open.
#[cfg(not(feature = "cuda"))]
fn cuda_backend() -> Result<loraq_kernels::Backend> {
    Err(ModelError::Kernel {
        module: "(all linears)".to_string(),
        source: loraq_kernels::KernelError::UnsupportedOnGpu {
            what: "this build (built without the `cuda` feature)".to_string(),
        },
    })
}

/// How [`Model::load`] builds the model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Where the weights live and the forward pass runs.
    pub device: Device,
    /// Activation fake-quant of every linear's base path (NVFP4: of the NVFP4
    /// linears, with each module's static scale from the checkpoint).
    pub act_quant: ActivationQuantKind,
    /// Which implementation runs the linears.
    pub backend: LinearBackend,
    /// Record the mean square of every linear's input (per input feature, over all
    /// tokens run), read back with [`Model::input_stats`]. Off by default: a model
    /// loaded without it runs its linears with no statistics code in the path.
    pub collect_input_stats: bool,
}

impl Default for LoadOptions {
    fn default() -> LoadOptions {
        LoadOptions {
            device: Device::Cpu,
            act_quant: ActivationQuantKind::None,
            backend: LinearBackend::Auto,
            collect_input_stats: false,
        }
    }
}

impl Model {
    /// Loads a model directory (config.json + safetensors: bf16/f32, or a quantized
    /// layout loraq-quant reads: fp8 tensor/channel/block128, NVFP4 ModelOpt or
    /// compressed-tensors) and optionally a PEFT adapter directory whose modules are
    /// applied unmerged at run time.
    ///
    /// Every adapter module must match a linear of the model: an adapter for another
    /// model is an error, not silently ignored.
    pub fn load(
        model_dir: &Path,
        adapter_dir: Option<&Path>,
        options: &LoadOptions,
    ) -> Result<Model> {
        let device = &options.device;
        let base = QuantizedBase::open(model_dir).map_err(|source| ModelError::Quant {
            module: model_dir.display().to_string(),
            source,
        })?;
        let checkpoint = base.checkpoint();
        let config_path = model_dir.join(loraq_io::CONFIG_FILE);
        let model_config = checkpoint.config().ok_or_else(|| ModelError::Config {
            path: config_path.clone(),
            reason: "missing config.json".into(),
        })?;
        let config = TextConfig::from_model_config(model_config, &config_path)?;
        // Module paths in the checkpoint's naming, whichever naming the adapter uses.
        let adapter = adapter_dir
            .map(|dir| LoraAdapter::open_for(dir, checkpoint))
            .transpose()?;
        let prefix = backbone_prefix(checkpoint)?;
        let kernels = options.backend.kernels()?;
        let pack_panels = kernels.as_ref().is_some_and(|backend| {
            linear_shapes(&config)
                .iter()
                .try_fold(0usize, |total, &(out, inp)| {
                    total.checked_add(backend.packed_panel_bytes(out, inp)?)
                })
                .is_some_and(|total| total <= PACKED_PANEL_BUDGET)
        });
        let mut loader = Loader {
            base: &base,
            checkpoint,
            act_quant: options.act_quant,
            backend: options.backend,
            kernels,
            pack_panels,
            linears_by_backend: std::collections::BTreeMap::new(),
            adapter: adapter.as_ref().zip(adapter_dir),
            used_adapter_modules: BTreeSet::new(),
            device,
            input_stats: options
                .collect_input_stats
                .then(InputStatsRegistry::default),
        };
        let c = &config;
        let (h, offset) = (c.hidden, c.norm_offset());
        let embed = loader.tensor(&format!("{prefix}embed_tokens.weight"), &[c.vocab, h])?;
        let mut layers = Vec::with_capacity(c.layer_types.len());
        for (i, layer_type) in c.layer_types.iter().enumerate() {
            let p = format!("{prefix}layers.{i}");
            let mixer = match layer_type {
                LayerType::LinearAttention => {
                    let la = format!("{p}.linear_attn");
                    let (nk, nv) = (c.linear_key_heads, c.linear_value_heads);
                    let key_dim = nk * c.linear_key_dim;
                    let value_dim = nv * c.linear_value_dim;
                    let conv_dim = 2 * key_dim + value_dim;
                    let a_log = loader.vec(&format!("{la}.A_log"), &[nv])?;
                    Mixer::Linear(Box::new(GatedDeltaNet {
                        in_proj_qkv: loader.linear(&format!("{la}.in_proj_qkv"), conv_dim, h)?,
                        in_proj_z: loader.linear(&format!("{la}.in_proj_z"), value_dim, h)?,
                        in_proj_a: loader.linear(&format!("{la}.in_proj_a"), nv, h)?,
                        in_proj_b: loader.linear(&format!("{la}.in_proj_b"), nv, h)?,
                        out_proj: loader.linear(&format!("{la}.out_proj"), h, value_dim)?,
                        conv_weight: loader.vec(
                            &format!("{la}.conv1d.weight"),
                            &[conv_dim, 1, c.conv_kernel],
                        )?,
                        neg_a: a_log.iter().map(|a| -a.exp()).collect(),
                        dt_bias: loader.vec(&format!("{la}.dt_bias"), &[nv])?,
                        norm_weight: loader
                            .vec(&format!("{la}.norm.weight"), &[c.linear_value_dim])?,
                    }))
                }
                LayerType::FullAttention => {
                    let sa = format!("{p}.self_attn");
                    let q_out =
                        c.attention_heads * c.head_dim * if c.attn_output_gate { 2 } else { 1 };
                    let kv_out = c.kv_heads * c.head_dim;
                    Mixer::Full(Box::new(Attention {
                        q_proj: loader.linear(&format!("{sa}.q_proj"), q_out, h)?,
                        k_proj: loader.linear(&format!("{sa}.k_proj"), kv_out, h)?,
                        v_proj: loader.linear(&format!("{sa}.v_proj"), kv_out, h)?,
                        o_proj: loader.linear(
                            &format!("{sa}.o_proj"),
                            h,
                            c.attention_heads * c.head_dim,
                        )?,
                        q_norm: loader.norm(&format!("{sa}.q_norm.weight"), c.head_dim, offset)?,
                        k_norm: loader.norm(&format!("{sa}.k_norm.weight"), c.head_dim, offset)?,
                    }))
                }
            };
            let m = format!("{p}.mlp");
            layers.push(DecoderLayer {
                input_norm: loader.norm(&format!("{p}.input_layernorm.weight"), h, offset)?,
                post_attention_norm: loader.norm(
                    &format!("{p}.post_attention_layernorm.weight"),
                    h,
                    offset,
                )?,
                mixer,
                mlp: Mlp {
                    gate_proj: loader.linear(&format!("{m}.gate_proj"), c.intermediate, h)?,
                    up_proj: loader.linear(&format!("{m}.up_proj"), c.intermediate, h)?,
                    down_proj: loader.linear(&format!("{m}.down_proj"), h, c.intermediate)?,
                },
            });
        }
        let final_norm = loader.norm(&format!("{prefix}norm.weight"), h, offset)?;
        let lm_head = if checkpoint.contains("lm_head.weight") {
            loader.tensor("lm_head.weight", &[c.vocab, h])?
        } else if c.tie_word_embeddings {
            embed.clone()
        } else {
            return Err(ModelError::Config {
                path: checkpoint.root().to_path_buf(),
                reason: "no lm_head.weight and tie_word_embeddings is false".into(),
            });
        };
        if let (Some(adapter), Some(dir)) = (&adapter, adapter_dir) {
            let unused: Vec<&str> = adapter
                .modules
                .iter()
                .map(|m| m.module_path.as_str())
                .filter(|p| !loader.used_adapter_modules.contains(*p))
                .collect();
            if !unused.is_empty() {
                return Err(ModelError::Adapter {
                    path: dir.to_path_buf(),
                    reason: format!(
                        "{} module(s) match no linear of {}: {}",
                        unused.len(),
                        model_dir.display(),
                        unused.join(", ")
                    ),
                });
            }
        }
        let adapted = loader.used_adapter_modules.len();
        let half = c.rotary_dim / 2;
        // transformers computes inv_freq in f32 from theta ** (arange(0, dim, 2) / dim).
        let inv_freq = (0..half)
            .map(|i| 1.0 / c.rope_theta.powf((2 * i) as f64 / c.rotary_dim as f64) as f32)
            .collect();
        Ok(Model {
            config,
            device: device.clone(),
            embed,
            layers,
            final_norm,
            lm_head,
            inv_freq,
            adapted,
            linears_by_backend: std::mem::take(&mut loader.linears_by_backend),
            input_stats: loader.input_stats.take(),
            scratch: Mutex::new(Activations::default()),
            concurrent_linears: options.backend != LinearBackend::Cuda,
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// How many linears carry an adapter.
    pub fn adapted_modules(&self) -> usize {
        self.adapted
    }

    /// How many linears each implementation runs (`dense`, `cpu`, `reference`,
    /// `cuda`), e.g. what [`LinearBackend::Auto`] chose.
    pub fn linears_by_backend(&self) -> &std::collections::BTreeMap<&'static str, usize> {
        &self.linears_by_backend
    }

    /// The mean square of every linear's input over the prompts run so far: one
    /// entry per linear (module path, as in the checkpoint, without `.weight`),
    /// `E[x_k^2]` per input feature, accumulated in f64 and rounded to f32 last,
    /// and the largest `|x|` the linear saw (the amax of a static activation scale).
    /// `None` unless the model was loaded with [`LoadOptions::collect_input_stats`].
    pub fn input_stats(&self) -> Option<loraq_io::ActivationStats> {
        let registry = self.input_stats.as_ref()?;
        let mut input_sq_mean = std::collections::BTreeMap::new();
        let mut input_abs_max = std::collections::BTreeMap::new();
        for (name, sums) in &registry.modules {
            let sums = sums.lock().unwrap_or_else(|e| e.into_inner());
            input_sq_mean.insert(
                name.clone(),
                sums.mean().into_iter().map(|m| m as f32).collect(),
            );
            input_abs_max.insert(name.clone(), sums.abs_max);
        }
        Some(loraq_io::ActivationStats {
            tokens: registry.tokens.load(Ordering::Relaxed),
            records: registry.prompts.load(Ordering::Relaxed),
            input_sq_mean,
            input_abs_max,
        })
    }

    /// Runs the prompt and returns the final-norm hidden state of its last token
    /// (`[hidden]`). Tokens must be below the vocabulary size (checked by callers
    /// that know the record; checked again here).
    pub fn last_hidden(&self, tokens: &[u32]) -> Result<Tensor> {
        let mut out = self.forward(&[tokens], None)?;
        Ok(out.pop().expect("one prompt in, one hidden state out"))
    }

    /// Like [`Model::last_hidden`], also collecting each decoder layer's output at the
    /// last position (`[hidden]` each) into `per_layer`.
    pub fn last_hidden_with_layers(
        &self,
        tokens: &[u32],
        per_layer: &mut Vec<Vec<f32>>,
    ) -> Result<Tensor> {
        let mut layers = vec![std::mem::take(per_layer)];
        let mut out = self.forward(&[tokens], Some(&mut layers))?;
        *per_layer = layers.pop().expect("one prompt");
        Ok(out.pop().expect("one prompt in, one hidden state out"))
    }

    /// [`Model::last_hidden`] of several prompts run together: their tokens are
    /// stacked into one matrix for every linear, norm and MLP (which act on each
    /// token alone), and only the token mixers (convolution, delta rule, attention)
    /// run prompt by prompt, each from its own zero state and position 0. The
    /// result equals running the prompts one by one; short prompts gain a
    /// matrix product with many rows instead of many with few. With `per_layer`,
    /// `per_layer[p]` receives prompt `p`'s decoder layer outputs at its last
    /// position (`per_layer` is resized to the prompt count).
    pub fn last_hidden_batch(
        &self,
        prompts: &[&[u32]],
        per_layer: Option<&mut Vec<Vec<Vec<f32>>>>,
    ) -> Result<Vec<Tensor>> {
        match per_layer {
            None => self.forward(prompts, None),
            Some(layers) => {
                layers.resize(prompts.len(), Vec::new());
                for l in layers.iter_mut() {
                    l.clear();
                }
                self.forward(prompts, Some(layers))
            }
        }
    }

    fn forward(
        &self,
        prompts: &[&[u32]],
        mut per_layer: Option<&mut Vec<Vec<Vec<f32>>>>,
    ) -> Result<Vec<Tensor>> {
        let mut segments = Vec::with_capacity(prompts.len());
        let mut all_tokens = Vec::new();
        for tokens in prompts {
            let t = tokens.len();
            if t == 0 {
                return Err(ModelError::Tensor {
                    context: "embedding".into(),
                    source: candle_core::Error::Msg("empty prompt".into()),
                });
            }
            if t > loraq_io::limits::MAX_PROMPT_TOKENS {
                return Err(ModelError::Tensor {
                    context: "embedding".into(),
                    source: candle_core::Error::Msg(format!(
                        "prompt of {t} tokens is longer than loraq's limit of {} tokens",
                        loraq_io::limits::MAX_PROMPT_TOKENS
                    )),
                });
            }
            if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= self.config.vocab) {
                return Err(ModelError::Tensor {
                    context: "embedding".into(),
                    source: candle_core::Error::Msg(format!(
                        "token {bad} outside the vocabulary of {}",
                        self.config.vocab
                    )),
                });
            }
            segments.push(Segment {
                start: all_tokens.len(),
                len: t,
            });
            all_tokens.extend_from_slice(tokens);
        }
        if segments.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(registry) = &self.input_stats {
            registry
                .prompts
                .fetch_add(segments.len() as u64, Ordering::Relaxed);
            registry
                .tokens
                .fetch_add(all_tokens.len() as u64, Ordering::Relaxed);
        }
        let rows = all_tokens.len();
        let c = &self.config;
        let h = c.hidden;
        let mut x = self.embed_rows(all_tokens)?;
        let rope = self.rope_table(&segments);
        // One set of activation buffers for the whole pass, reused by every layer (and
        // by the next batch).
        let mut pooled = self.scratch.try_lock().ok();
        let mut fresh = Activations::default();
        let arena: &mut Activations = match pooled.as_deref_mut() {
            Some(kept) => kept,
            None => &mut fresh,
        };
        let mut normed_buffer = std::mem::take(&mut arena.normed);
        let mut mixed_buffer = std::mem::take(&mut arena.mixed);
        let normed = sized(&mut normed_buffer, rows * h);
        let mixed = sized(&mut mixed_buffer, rows * h);
        // The last layer runs its token mixer's keys and values (or recurrence) over
        // every position, and the rest only on each prompt's last row, the one the
        // pass returns. Not when input statistics are collected: they are taken over
        // every token of every linear.
        let kept = if self.input_stats.is_none() && !self.layers.is_empty() {
            KeptRows::new(&segments, rows)
        } else {
            None
        };
        let last_layer = self.layers.len().saturating_sub(1);
        // The first layer's input norm; every later one is fused into the residual add
        // that ends the layer before it.
        if let Some(first) = self.layers.first() {
            crate::small_matmul::rms_norm_rows_into(&x, normed, &first.input_norm, c.rms_norm_eps);
        }
        for (index, layer) in self.layers.iter().enumerate() {
            let kept = kept.as_ref().filter(|_| index == last_layer);
            // `normed` holds this layer's input norm here.
            // The rows every step after the mixer runs on: all of them, or the kept ones.
            let out_rows = kept.map_or(rows, |k| k.padded);
            let mixed = &mut mixed[..out_rows * h];
            match &layer.mixer {
                Mixer::Linear(net) => {
                    self.gated_delta_net(net, normed, &segments, kept, arena, mixed)?
                }
                Mixer::Full(attn) => {
                    self.attention(attn, normed, &rope, &segments, kept, arena, mixed)?
                }
            }
            if let Some(kept) = kept {
                // The residual stream shrinks to the kept rows.
                let mut shrunk = vec![0f32; out_rows * h];
                kept.gather(&x, h, &mut shrunk);
                x = shrunk;
            }
            let post_normed = &mut normed[..out_rows * h];
            crate::small_matmul::add_rms_norm_rows_into(
                &mut x,
                mixed,
                post_normed,
                &layer.post_attention_norm,
                c.rms_norm_eps,
            );
            self.mlp(&layer.mlp, post_normed, out_rows, arena, mixed)?;
            match self.layers.get(index + 1) {
                // Not the last layer, so every row: the residual add and the next
                // layer's input norm in one pass.
                Some(next) => crate::small_matmul::add_rms_norm_rows_into(
                    &mut x,
                    mixed,
                    normed,
                    &next.input_norm,
                    c.rms_norm_eps,
                ),
                None => crate::small_matmul::add_assign(&mut x, mixed),
            }
            if let Some(out) = per_layer.as_deref_mut() {
                for (p, (seg, dst)) in segments.iter().zip(out.iter_mut()).enumerate() {
                    let row = if kept.is_some() { p } else { seg.last() };
                    dst.push(x[row * h..(row + 1) * h].to_vec());
                }
            }
        }
        arena.normed = normed_buffer;
        arena.mixed = mixed_buffer;
        segments
            .iter()
            .enumerate()
            .map(|(p, seg)| {
                let row = if kept.is_some() { p } else { seg.last() };
                let mut last = x[row * h..(row + 1) * h].to_vec();
                crate::small_matmul::rms_norm_rows(&mut last, &self.final_norm, c.rms_norm_eps);
                Tensor::from_vec(last, h, &self.device).ctx("final norm")
            })
            .collect()
    }

    /// The embedding rows of `tokens` (`[tokens, hidden]`; every id below the vocabulary
    /// size, as [`Model::forward`] checked). On the CPU the rows are copied straight
    /// from the table in parallel pieces: candle's `index_select` gathers them on the
    /// calling thread, and the copy out of its tensor is a second serial pass, a
    /// stretch of every batch in which the pool's threads wait. Other devices go
    /// through candle. The same values either way.
    fn embed_rows(&self, tokens: Vec<u32>) -> Result<Vec<f32>> {
        let h = self.config.hidden;
        {
            let (storage, layout) = self.embed.storage_and_layout();
            if let (candle_core::Storage::Cpu(cpu), Some((start, end))) =
                (&*storage, layout.contiguous_offsets())
                && let Ok(table) = cpu.as_slice::<f32>()
            {
                let table = &table[start..end];
                let mut x = vec![0f32; tokens.len() * h];
                let piece = crate::small_matmul::ELEMENTWISE_PIECE.div_ceil(h).max(1);
                x.par_chunks_mut(piece * h)
                    .zip(tokens.par_chunks(piece))
                    .for_each(|(rows, ids)| {
                        for (row, &id) in rows.chunks_exact_mut(h).zip(ids) {
                            let id = id as usize;
                            row.copy_from_slice(&table[id * h..(id + 1) * h]);
                        }
                    });
                return Ok(x);
            }
        }
        let n = tokens.len();
        let ids = Tensor::from_vec(tokens, n, &self.device).ctx("token ids")?;
        to_vec(
            &self.embed.index_select(&ids, 0).ctx("embedding")?,
            "embedding",
        )
    }

    /// The MLP of `rows` rows of `normed` into `out`: `down(silu(gate(x)) * up(x))`.
    fn mlp(
        &self,
        mlp: &Mlp,
        normed: &[f32],
        rows: usize,
        arena: &mut Activations,
        out: &mut [f32],
    ) -> Result<()> {
        let width = mlp.gate_proj.out_features();
        let gate = sized(&mut arena.gate, rows * width);
        let up = sized(&mut arena.up, rows * width);
        both(
            self.concurrent_linears,
            || mlp.gate_proj.forward(normed, rows, gate),
            || mlp.up_proj.forward(normed, rows, up),
        )?;
        crate::small_matmul::silu_mul(gate, up);
        mlp.down_proj.forward(gate, rows, out)
    }

    /// Logits of the given vocabulary rows for a final hidden state: only those rows
    /// of lm_head are multiplied.
    pub fn logits_of(&self, hidden: &Tensor, rows: &[u32]) -> Result<Vec<f32>> {
        let ids = Tensor::from_vec(rows.to_vec(), rows.len(), &self.device).ctx("option ids")?;
        let w = self.lm_head.index_select(&ids, 0).ctx("lm_head rows")?;
        let h = hidden.unsqueeze(1).ctx("lm_head")?;
        w.matmul(&h)
            .ctx("lm_head")?
            .flatten_all()
            .ctx("lm_head")?
            .to_vec1()
            .ctx("lm_head")
    }

    /// The rotary table of positions `0 .. longest prompt`.
    fn rope_table(&self, segments: &[Segment]) -> RopeTable {
        let longest = segments.iter().map(|s| s.len).max().unwrap_or(0);
        RopeTable::new(&self.inv_freq, longest)
    }

    /// The gated attention of a layer: `x` holds every row (`normed`), `out` receives
    /// every row, or with `kept` the kept rows only (queries, attention and `o_proj` on
    /// those; keys and values on every row).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        attn: &Attention,
        x: &[f32],
        rope: &RopeTable,
        segments: &[Segment],
        kept: Option<&KeptRows>,
        arena: &mut Activations,
        out: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let (hd, heads, kv) = (c.head_dim, c.attention_heads, c.kv_heads);
        let t = x.len() / c.hidden;
        // The rows whose queries run.
        let (q_input, q_rows): (&[f32], usize) = match kept {
            None => (x, t),
            Some(kept) => {
                let rows = sized(&mut arena.kept_input, kept.padded * c.hidden);
                kept.gather(x, c.hidden, rows);
                (&*rows, kept.padded)
            }
        };
        let q_width = attn.q_proj.out_features();
        let q_full = sized(&mut arena.projected, q_rows * q_width);
        let key = sized(&mut arena.key, t * kv * hd);
        let value = sized(&mut arena.value, t * kv * hd);
        // The three projections at once (see `both`).
        let concurrent = self.concurrent_linears;
        both(
            concurrent,
            || attn.q_proj.forward(q_input, q_rows, q_full),
            || {
                both(
                    concurrent,
                    || attn.k_proj.forward(x, t, key),
                    || attn.v_proj.forward(x, t, value),
                )
            },
        )?;
        // transformers: view(T, heads, 2 * head_dim) then chunk(2, -1): per head, the
        // query comes first and its gate second.
        let query = sized(&mut arena.query, q_rows * heads * hd);
        let gate = sized(&mut arena.gate, q_rows * heads * hd);
        let q_full = &*q_full;
        if c.attn_output_gate {
            // The split, then q_norm, per piece of tokens, the pieces in parallel.
            let width = heads * hd;
            crate::small_matmul::par_rows_pair(
                query,
                gate,
                width,
                crate::small_matmul::ELEMENTWISE_PIECE,
                |t0, q_rows, g_rows| {
                    let full_rows = &q_full[t0 * 2 * width..][..q_rows.len() * 2];
                    for ((q_row, gate_row), full) in q_rows
                        .chunks_exact_mut(hd)
                        .zip(g_rows.chunks_exact_mut(hd))
                        .zip(full_rows.chunks_exact(2 * hd))
                    {
                        q_row.copy_from_slice(&full[..hd]);
                        gate_row.copy_from_slice(&full[hd..]);
                    }
                    crate::small_matmul::rms_norm_rows_serial(q_rows, &attn.q_norm, c.rms_norm_eps);
                },
            );
        } else {
            crate::small_matmul::rms_norm_rows_into(q_full, query, &attn.q_norm, c.rms_norm_eps);
        }
        crate::small_matmul::rms_norm_rows(key, &attn.k_norm, c.rms_norm_eps);
        for (p, seg) in segments.iter().enumerate() {
            let rows = seg.start..seg.start + seg.len;
            match kept {
                None => rope.apply(
                    &mut query[rows.start * heads * hd..rows.end * heads * hd],
                    heads,
                    hd,
                    c.rotary_dim,
                ),
                // Kept row p is prompt p's last position.
                Some(_) => rope.apply_at(
                    &mut query[p * heads * hd..(p + 1) * heads * hd],
                    seg.len - 1,
                    heads,
                    hd,
                    c.rotary_dim,
                ),
            }
            rope.apply(
                &mut key[rows.start * kv * hd..rows.end * kv * hd],
                kv,
                hd,
                c.rotary_dim,
            );
        }
        // Each prompt attends to itself only. The prompts run in parallel (each
        // splitting its heads and query tiles in turn), each with its own scratch: one
        // parallel region per layer instead of one per prompt; each prompt's arithmetic
        // is unchanged, so the answers are byte-identical.
        let attended = sized(&mut arena.core, q_rows * heads * hd);
        let (query, key, value) = (&*query, &*key, &*value);
        let width = heads * hd;
        let dims_of = |seg: &Segment| crate::attention::AttentionDims {
            tokens: seg.len,
            heads,
            kv_heads: kv,
            head_dim: hd,
        };
        match kept {
            None => {
                if arena.per_segment.len() < segments.len() {
                    arena.per_segment.resize_with(segments.len(), Vec::new);
                }
                let tasks: Vec<_> = segments
                    .iter()
                    .zip(split_rows(attended, segments, width))
                    .zip(arena.per_segment.iter_mut())
                    .collect();
                tasks.into_par_iter().for_each(|((seg, out), scratch)| {
                    crate::attention::causal_attention_into(
                        seg.rows(query, width),
                        seg.rows(key, kv * hd),
                        seg.rows(value, kv * hd),
                        dims_of(seg),
                        scratch,
                        out,
                    )
                });
            }
            // Kept row p is prompt p's last position.
            Some(_) => attended[..segments.len() * width]
                .par_chunks_mut(width)
                .zip(segments)
                .enumerate()
                .for_each(|(p, (out, seg))| {
                    crate::attention::last_query_attention(
                        &query[p * width..(p + 1) * width],
                        seg.rows(key, kv * hd),
                        seg.rows(value, kv * hd),
                        dims_of(seg),
                        out,
                    )
                }),
        }
        if kept.is_some() {
            // The padding rows after the kept ones: zero, as their inputs.
            attended[segments.len() * heads * hd..].fill(0.0);
        }
        if c.attn_output_gate {
            crate::small_matmul::sigmoid_mul(attended, gate);
        }
        attn.o_proj.forward(attended, q_rows, out)
    }

    /// Gated DeltaNet of a layer: `x` holds every row (`normed`), `out` receives every
    /// row, or with `kept` the kept rows only (the recurrence runs over every row, the
    /// output path, `z`, the gated norm and `out_proj`, on the kept ones).
    fn gated_delta_net(
        &self,
        net: &GatedDeltaNet,
        x: &[f32],
        segments: &[Segment],
        kept: Option<&KeptRows>,
        arena: &mut Activations,
        out: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let t = x.len() / c.hidden;
        let (nk, nv, dk, dv) = (
            c.linear_key_heads,
            c.linear_value_heads,
            c.linear_key_dim,
            c.linear_value_dim,
        );
        let (key_dim, value_dim) = (nk * dk, nv * dv);
        let conv_dim = 2 * key_dim + value_dim;
        // The output path's input rows: all, or the kept ones.
        let (z_input, rows): (&[f32], usize) = match kept {
            None => (x, t),
            Some(kept) => {
                let input = sized(&mut arena.kept_input, kept.padded * c.hidden);
                kept.gather(x, c.hidden, input);
                (&*input, kept.padded)
            }
        };
        // The four projections of the layer's input at once (see `both`).
        let qkv = sized(&mut arena.projected, t * conv_dim);
        let z = sized(&mut arena.gate, rows * value_dim);
        let beta = sized(&mut arena.beta, t * nv);
        let decay = sized(&mut arena.decay, t * nv);
        let concurrent = self.concurrent_linears;
        both(
            concurrent,
            || net.in_proj_qkv.forward(x, t, qkv),
            || {
                both(
                    concurrent,
                    || net.in_proj_z.forward(z_input, rows, z),
                    || {
                        both(
                            concurrent,
                            || net.in_proj_b.forward(x, t, beta),
                            || net.in_proj_a.forward(x, t, decay),
                        )
                    },
                )
            },
        )?;
        // A sigmoid, an exp and a log1p per element: pieces of 2,048 elements.
        crate::small_matmul::par_rows_pair(beta, decay, nv, 2048, |_, beta, decay| {
            for v in beta.iter_mut() {
                *v = ops::sigmoid(*v);
            }
            for row in decay.chunks_exact_mut(nv) {
                for ((v, &neg_a), &dt_bias) in row.iter_mut().zip(&net.neg_a).zip(&net.dt_bias) {
                    *v = neg_a * ops::softplus(*v + dt_bias);
                }
            }
        });
        // The convolution and the delta rule of each prompt, from its own zero state.
        // The prompts run in parallel (each with its own scratch, each splitting its
        // heads and conv pieces in turn): one parallel region per layer instead of
        // several per prompt, so a batch of short prompts (about a hundred 20-token
        // prompts per batch) does not pay rayon's fork-join and wake-ups per prompt.
        // Every prompt's arithmetic is unchanged, so the answers are byte-identical.
        let mixed = sized(&mut arena.query, t * conv_dim);
        let core = sized(&mut arena.core, t * value_dim);
        let (decay, beta) = (&*decay, &*beta);
        // The taps transposed once per layer (`[kernel, channels]`), not per prompt.
        let kernel = c.conv_kernel;
        let mut weight_t = vec![0f32; kernel * conv_dim];
        for (ch, taps) in net
            .conv_weight
            .chunks_exact(kernel)
            .enumerate()
            .take(conv_dim)
        {
            for (j, &w) in taps.iter().enumerate() {
                weight_t[j * conv_dim + ch] = w;
            }
        }
        let weight_t = &weight_t;
        if arena.per_segment.len() < segments.len() {
            arena.per_segment.resize_with(segments.len(), Vec::new);
        }
        let tasks: Vec<_> = segments
            .iter()
            .zip(split_rows(mixed, segments, conv_dim))
            .zip(split_rows(core, segments, value_dim))
            .zip(arena.per_segment.iter_mut())
            .collect();
        tasks
            .into_par_iter()
            .for_each(|(((seg, seg_mixed), seg_core), scratch)| {
                // Every row of `seg_mixed` is overwritten (no zeroing first).
                crate::small_matmul::causal_conv_silu(
                    seg.rows(qkv, conv_dim),
                    weight_t,
                    kernel,
                    seg_mixed,
                );
                let dims = DeltaRuleDims {
                    tokens: seg.len,
                    key_heads: nk,
                    value_heads: nv,
                    key_dim: dk,
                    value_dim: dv,
                };
                let rows = seg.start * nv..(seg.start + seg.len) * nv;
                crate::chunked::gated_delta_rule_chunked_strided(
                    crate::chunked::StridedQkv {
                        rows: seg_mixed,
                        stride: conv_dim,
                        key_offset: key_dim,
                        value_offset: 2 * key_dim,
                    },
                    &decay[rows.clone()],
                    &beta[rows],
                    dims,
                    crate::chunked::DELTA_RULE_CHUNK,
                    scratch,
                    seg_core,
                );
            });
        // The output path's rows: all, or the kept ones.
        let core: &[f32] = match kept {
            None => core,
            Some(kept) => {
                let kept_core = sized(&mut arena.kept_core, kept.padded * value_dim);
                kept.gather(core, value_dim, kept_core);
                kept_core
            }
        };
        // Gated RMSNorm per value head, silu(z) * (w * norm(o)), in z's buffer: one pass
        // over both (the norm's row still in L1), the same bits as the norm in place
        // then the gate.
        crate::small_matmul::rms_norm_silu_gate(core, z, &net.norm_weight, c.rms_norm_eps);
        net.out_proj.forward(z, rows, out)
    }
}

/// The forward pass's scratch buffers, grown to the largest use and reused by every
/// layer (so a layer's activations never page-fault in fresh memory).
#[derive(Debug, Default)]
struct Activations {
    /// A mixer's first projection (`q_proj`, `in_proj_qkv`).
    projected: Vec<f32>,
    /// Queries (attention) or the convolved `in_proj_qkv` (linear attention).
    query: Vec<f32>,
    key: Vec<f32>,
    value: Vec<f32>,
    /// Attention's output gate, `in_proj_z`, the MLP's gate projection.
    gate: Vec<f32>,
    /// The MLP's up projection.
    up: Vec<f32>,
    /// A mixer's output before its last projection.
    core: Vec<f32>,
    beta: Vec<f32>,
    decay: Vec<f32>,
    /// A decoder layer's normed input.
    normed: Vec<f32>,
    /// A mixer's or the MLP's output, before it is added to the residual stream.
    mixed: Vec<f32>,
    /// Per prompt of a batch, the token mixers' per-head output blocks (head-major)
    /// before they are interleaved token-major (the prompts run in parallel).
    per_segment: Vec<Vec<f32>>,
    /// The last layer's kept rows of a mixer's input.
    kept_input: Vec<f32>,
    /// The last layer's kept rows of Gated DeltaNet's recurrence output.
    kept_core: Vec<f32>,
}

/// Runs two steps (linears on the same input) at once on rayon's pool when
/// `concurrent`, else one after the other; the first error either way. Together they
/// are one parallel region whose tasks the pool's threads share, instead of one region
/// each, each ending with a thread waiting for the other's last task (and in Gated
/// DeltaNet the 8-row `in_proj_a` and `in_proj_b`, three tasks each, fill the others'
/// gaps). Each linear computes what it computes alone, so the results are the same bits.
fn both(
    concurrent: bool,
    first: impl FnOnce() -> Result<()> + Send,
    second: impl FnOnce() -> Result<()> + Send,
) -> Result<()> {
    if concurrent {
        let (a, b) = rayon::join(first, second);
        a.and(b)
    } else {
        first()?;
        second()
    }
}

/// `x` (`width` values a row) cut into each prompt's rows, in order: the segments are
/// consecutive from row 0, as the forward pass stacks them.
fn split_rows<'a>(x: &'a mut [f32], segments: &[Segment], width: usize) -> Vec<&'a mut [f32]> {
    let mut rest = x;
    let mut out = Vec::with_capacity(segments.len());
    for seg in segments {
        debug_assert_eq!(
            seg.start * width,
            out.iter().map(|s: &&mut [f32]| s.len()).sum::<usize>()
        );
        let (rows, tail) = std::mem::take(&mut rest).split_at_mut(seg.len * width);
        out.push(rows);
        rest = tail;
    }
    out
}

/// `buffer[..len]`, grown (zero-filled) when shorter.
fn sized(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    &mut buffer[..len]
}

/// `cos` and `sin` of every position's rotary angles, `[positions, rotary_dim / 2]`.
/// Text tokens have the same position on all three mrope sections, so the interleaved
/// multimodal layout reduces to this plain table.
pub(crate) struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Angles `p * inv_freq[i]` for `p < positions`, as transformers computes them in f32.
    pub(crate) fn new(inv_freq: &[f32], positions: usize) -> RopeTable {
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for f in inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Rotary embedding in place on the first `rotary_dim` dimensions of every head of
    /// `x` (`[tokens, heads, head_dim]`, token `t` at position `t`, `tokens` within the
    /// table): `x_rot * cos + rotate_half(x_rot) * sin` (transformers' `rotate_half`
    /// layout, with `cat((freqs, freqs))`), the rest passed through. Pieces of tokens
    /// run in parallel.
    pub(crate) fn apply(&self, x: &mut [f32], heads: usize, head_dim: usize, rotary_dim: usize) {
        let half = rotary_dim / 2;
        if half == 0 {
            return;
        }
        assert_eq!(half, self.half, "rotary table of another rotary dimension");
        crate::small_matmul::par_rows(x, heads * head_dim, |first, tokens| {
            self.apply_from(tokens, first, heads, head_dim)
        });
    }

    /// [`RopeTable::apply`] to one token (`[heads, head_dim]`) at `position` (within
    /// the table).
    pub(crate) fn apply_at(
        &self,
        x: &mut [f32],
        position: usize,
        heads: usize,
        head_dim: usize,
        rotary_dim: usize,
    ) {
        if rotary_dim / 2 == 0 {
            return;
        }
        assert_eq!(
            rotary_dim / 2,
            self.half,
            "rotary table of another rotary dimension"
        );
        self.apply_from(&mut x[..heads * head_dim], position, heads, head_dim)
    }

    /// [`RopeTable::apply`] on the calling thread to tokens at positions `first ..`.
    fn apply_from(&self, x: &mut [f32], first: usize, heads: usize, head_dim: usize) {
        let half = self.half;
        for (i, token) in x.chunks_exact_mut(heads * head_dim).enumerate() {
            let t = first + i;
            let cos = &self.cos[t * half..(t + 1) * half];
            let sin = &self.sin[t * half..(t + 1) * half];
            for head in token.chunks_exact_mut(head_dim) {
                let (x1, rest) = head.split_at_mut(half);
                let x2 = &mut rest[..half];
                for (((a, b), &c), &s) in x1.iter_mut().zip(x2.iter_mut()).zip(cos).zip(sin) {
                    let (v1, v2) = (*a, *b);
                    // As transformers rounds it: each product, then the sum.
                    *a = v1 * c + -v2 * s;
                    *b = v2 * c + v1 * s;
                }
            }
        }
    }
}

/// Kept rows of the last layer under [`KeptRows::new`]: fewer rows than this are padded
/// up to it (or to the batch's row count, when smaller), so that every linear of the
/// last layer takes the same path (loraq-kernels' tiled GEMM, the AMX tiles from
/// [`crate::AMX_MIN_TOKENS`] rows) as it did for the whole batch, whose results per row
/// do not depend on the row count; the kernels' decode path
/// (`loraq_kernels::cpu::GEMV_MAX_BATCH` rows or fewer) sums in another order.
const KEPT_MIN_ROWS: usize = crate::linear::AMX_MIN_TOKENS;
const _: () = assert!(KEPT_MIN_ROWS > loraq_kernels::cpu::GEMV_MAX_BATCH);

/// The rows of a batch the last layer runs after its token mixer: each prompt's last,
/// in prompt order, then zero rows up to `padded` (see [`KEPT_MIN_ROWS`]). llama.cpp
/// does the same with `inp_out_ids` (its graph builders `ggml_get_rows` the hidden state
/// down to the output tokens in the last layer).
#[derive(Debug)]
struct KeptRows {
    /// Row of each prompt's last token in the batch.
    rows: Vec<usize>,
    /// Rows of the shrunk matrices (`rows.len()` and the padding).
    padded: usize,
}

impl KeptRows {
    /// The kept rows of `segments` (`total` rows in all); `None` when keeping them would
    /// leave as many rows as the batch has.
    fn new(segments: &[Segment], total: usize) -> Option<KeptRows> {
        let padded = segments.len().max(KEPT_MIN_ROWS.min(total));
        (padded < total).then(|| KeptRows {
            rows: segments.iter().map(Segment::last).collect(),
            padded,
        })
    }

    /// The kept rows of `src` (`width` wide) into `dst` (`padded` rows; the padding
    /// zeroed).
    fn gather(&self, src: &[f32], width: usize, dst: &mut [f32]) {
        assert_eq!(dst.len(), self.padded * width, "kept rows of another shape");
        let (kept, padding) = dst.split_at_mut(self.rows.len() * width);
        for (&row, out) in self.rows.iter().zip(kept.chunks_exact_mut(width)) {
            out.copy_from_slice(&src[row * width..(row + 1) * width]);
        }
        padding.fill(0.0);
    }
}

/// One prompt's rows in the stacked activations of a batch.
#[derive(Debug, Clone, Copy)]
struct Segment {
    /// First row.
    start: usize,
    /// Tokens (rows).
    len: usize,
}

impl Segment {
    /// The prompt's last row.
    fn last(&self) -> usize {
        self.start + self.len - 1
    }

    /// The prompt's rows of a row-major matrix `width` wide.
    fn rows<'a>(&self, x: &'a [f32], width: usize) -> &'a [f32] {
        &x[self.start * width..(self.start + self.len) * width]
    }
}

fn to_vec(x: &Tensor, ctx: &str) -> Result<Vec<f32>> {
    x.flatten_all().ctx(ctx)?.to_vec1().ctx(ctx)
}

/// The element type every weight is computed in.
pub const COMPUTE_DTYPE: DType = DType::F32;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::D;

    #[test]
    fn rope_rotates_pairs_by_known_angles() {
        // head_dim 4 with rotary_dim 2: the pair (x0, x1) is rotated by angle p * inv_freq,
        // dims 2..4 pass through. At angle pi/2: (x0, x1) -> (-x1, x0); position 0 is
        // left as is.
        let table = RopeTable {
            half: 1,
            cos: vec![1.0, 0.0],
            sin: vec![0.0, 1.0],
        };
        let mut x = vec![5f32, 6.0, 7.0, 8.0, 1.0, 2.0, 3.0, 4.0];
        table.apply(&mut x, 1, 4, 2);
        assert_eq!(x, vec![5.0, 6.0, 7.0, 8.0, -2.0, 1.0, 3.0, 4.0]);
        // The table's angles: position 3 of inv_freq 0.5 is 1.5 rad.
        let table = RopeTable::new(&[0.5], 4);
        assert_eq!((table.cos[3], table.sin[3]), (1.5f32.cos(), 1.5f32.sin()));
    }

    /// The attention of the whole prompt at once: a `[T, T]` score matrix, masked,
    /// softmaxed, times V, with candle's ops; `q` is `[kv, group, T, hd]`, `k` and
    /// `v` `[kv, T, hd]`.
    fn attention_unblocked(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let (kv, group, t, hd) = q.dims4().unwrap();
        let q = q.reshape((kv, group * t, hd)).unwrap();
        let scores = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap()
            * (hd as f64).powf(-0.5))
        .unwrap();
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), q.device()).unwrap();
        let scores = scores
            .reshape((kv, group, t, t))
            .unwrap()
            .broadcast_add(&mask)
            .unwrap();
        let max = scores.max_keepdim(D::Minus1).unwrap();
        let e = scores.broadcast_sub(&max).unwrap().exp().unwrap();
        let probs = e
            .broadcast_div(&e.sum_keepdim(D::Minus1).unwrap())
            .unwrap()
            .reshape((kv, group * t, t))
            .unwrap();
        probs
            .matmul(v)
            .unwrap()
            .reshape((kv, group, t, hd))
            .unwrap()
    }

    #[test]
    fn tiled_attention_equals_the_unblocked_score_matrix() {
        // 150 tokens (two whole query and key tiles of 64 and a partial one), 2 kv
        // heads of 3 query heads each, head_dim 16; scores spread over a wide range so
        // the running maximum changes between key tiles.
        use crate::attention::{AttentionDims, causal_attention};
        let dev = Device::Cpu;
        let (kv, group, t, hd) = (2, 3, 150, 16);
        let heads = kv * group;
        let values = |n: usize, seed: u32| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                    ((x >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 6.0
                })
                .collect()
        };
        // Row-major [T, heads, hd] / [T, kv, hd], as the forward pass holds them.
        let (q, k, v) = (
            values(t * heads * hd, 1),
            values(t * kv * hd, 2),
            values(t * kv * hd, 3),
        );
        let ours = causal_attention(
            &q,
            &k,
            &v,
            AttentionDims {
                tokens: t,
                heads,
                kv_heads: kv,
                head_dim: hd,
            },
        );
        let q_t = Tensor::from_vec(q, (t, heads, hd), &dev)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((kv, group, t, hd))
            .unwrap();
        let head_major = |x: Vec<f32>| {
            Tensor::from_vec(x, (t, kv, hd), &dev)
                .unwrap()
                .transpose(0, 1)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let reference: Vec<f32> = attention_unblocked(&q_t, &head_major(k), &head_major(v))
            .reshape((heads, t, hd))
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(ours.len(), reference.len());
        for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "element {i}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn rms_norm_by_hand() {
        // x = [3, 4]: mean square 12.5, scale [1, 2] -> [3, 8] / sqrt(12.5).
        let mut y = vec![3f32, 4.0];
        crate::small_matmul::rms_norm_rows(&mut y, &[1.0, 2.0], 0.0);
        let r = 12.5f32.sqrt();
        assert!((y[0] - 3.0 / r).abs() < 1e-6 && (y[1] - 8.0 / r).abs() < 1e-6);
    }
}
