//! Activation fake-quant, in place on a row-major `[tokens, hidden]` matrix: what a
//! W8A8 / W4A4 server does to the input of a quantized linear (the LoRA path sees the
//! unquantized activation).
//!
//! Unlike weights, activations are not checked for NaN: a NaN token stays NaN.

use crate::element::{E2M1_MAX, E2M1_TABLE, E4M3_MAX, E4M3_TABLE, e2m1_encode, e4m3_encode};
use crate::error::{QuantError, Result};
use crate::format::{NVFP4_BLOCK, Nvfp4GlobalScale};
use crate::ggml::{GgmlType, QK_K, fp16_to_f32, fp32_to_fp16};
use crate::runs::{self, abs_max_bits};
use rayon::prelude::*;
use std::fmt;
use std::str::FromStr;

/// The activation fake-quant of one linear's base path, as a W8A8 / W4A4 server
/// applies it; the LoRA path always sees the unquantized activation (as vLLM does).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum ActivationQuant {
    /// Unquantized (weight-only quantization).
    #[default]
    None,
    /// FP8 E4M3, one dynamic scale per token ($\max(a, 2^{-9}) / 448$ for the token's
    /// largest magnitude $a$, vLLM's floor):
    /// [`fp8_per_token`].
    Fp8PerToken,
    /// FP8 E4M3, one dynamic scale per 1x128 group of a token (block-FP8 serving):
    /// [`fp8_per_group`].
    Fp8PerGroup128,
    /// NVFP4 (W4A4) as vLLM applies it: a dynamic E4M3 scale per 16 inputs under the
    /// module's static global scale ([`nvfp4_static_vllm`]). The in-dimension must be
    /// a multiple of 16.
    Nvfp4 {
        /// The checkpoint's static scale: ModelOpt `input_scale` (multiplier) or
        /// compressed-tensors `input_global_scale` (divisor).
        input_scale: Nvfp4GlobalScale,
    },
    /// llama.cpp's CPU activation quantization for weights whose dot product takes
    /// Q8_0 activations (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4; Q4_1 / Q5_1 take Q8_1, the
    /// same values): [`ggml_q8_0`]. The in-dimension must be a multiple of 32.
    GgmlQ8_0,
    /// llama.cpp's CPU activation quantization for the K types and IQ4_XS (Q8_K):
    /// [`ggml_q8_k`]. The in-dimension must be a multiple of 256.
    GgmlQ8K,
}

impl ActivationQuant {
    /// Fake-quantizes `values` (row-major `[tokens, hidden]`) in place; `name` (the
    /// module) is for error messages.
    pub fn apply(&self, name: &str, values: &mut [f32], hidden: usize) -> Result<()> {
        match *self {
            Self::None => Ok(()),
            Self::Fp8PerToken => fp8_per_token(name, values, hidden, PER_TOKEN_EPS),
            Self::Fp8PerGroup128 => fp8_per_group(name, values, hidden, PER_GROUP_EPS),
            Self::Nvfp4 { input_scale } => nvfp4_static_vllm(name, values, hidden, input_scale),
            Self::GgmlQ8_0 => ggml_q8_0(name, values, hidden),
            Self::GgmlQ8K => ggml_q8_k(name, values, hidden),
        }
    }

    /// True when the base path sees `x` unchanged.
    pub fn is_identity(&self) -> bool {
        matches!(self, Self::None)
    }

    /// Which kind of activation quantization this is (its scales left out).
    pub fn kind(&self) -> ActivationQuantKind {
        match self {
            Self::None => ActivationQuantKind::None,
            Self::Fp8PerToken => ActivationQuantKind::Fp8PerToken,
            Self::Fp8PerGroup128 => ActivationQuantKind::Fp8PerGroup128,
            Self::Nvfp4 { .. } => ActivationQuantKind::Nvfp4,
            Self::GgmlQ8_0 | Self::GgmlQ8K => ActivationQuantKind::Ggml,
        }
    }

    /// What llama.cpp's CPU backend does to the activations of a linear whose weight
    /// is stored in `ggml_type` (the weight type's `vec_dot_type` in
    /// ggml/src/ggml-cpu/ggml-cpu.c): Q8_K for the K types and IQ4_XS, Q8_0 for the
    /// 32-element types, none for F32; F16 / BF16 weights (whose activations llama.cpp
    /// rounds to f16 / bf16) are left unquantized here.
    pub fn for_ggml_weight(ggml_type: GgmlType) -> Self {
        match ggml_type {
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_XS => Self::GgmlQ8K,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::IQ4_NL
            | GgmlType::MXFP4 => Self::GgmlQ8_0,
            // F32 / F16 / BF16, and the types loraq does not decode (refused before
            // any weight of theirs reaches a linear).
            _ => Self::None,
        }
    }
}

/// An [`ActivationQuant`] without its per-module scales: what a user asks for
/// (`--act-quant`) before each module's static scale is read from its checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ActivationQuantKind {
    /// No activation quantization.
    #[default]
    None,
    /// FP8 per token.
    Fp8PerToken,
    /// FP8 per 1x128 group.
    Fp8PerGroup128,
    /// NVFP4 with each module's static global scale.
    Nvfp4,
    /// llama.cpp's CPU activation quantization, Q8_0 or Q8_K by each module's ggml
    /// weight type ([`ActivationQuant::for_ggml_weight`]).
    Ggml,
}

impl ActivationQuantKind {
    /// Every kind.
    pub const ALL: [ActivationQuantKind; 5] = [
        Self::None,
        Self::Fp8PerToken,
        Self::Fp8PerGroup128,
        Self::Nvfp4,
        Self::Ggml,
    ];

    /// The command-line name: `none`, `fp8-token`, `fp8-group`, `nvfp4`, `ggml`.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Fp8PerToken => "fp8-token",
            Self::Fp8PerGroup128 => "fp8-group",
            Self::Nvfp4 => "nvfp4",
            Self::Ggml => "ggml",
        }
    }

    /// The quantization of this kind that needs no scale from a checkpoint; `None`
    /// for NVFP4, whose static global scale is each module's own, and for ggml, whose
    /// activation type is each module's weight type's.
    pub fn without_static_scale(self) -> Option<ActivationQuant> {
        match self {
            Self::None => Some(ActivationQuant::None),
            Self::Fp8PerToken => Some(ActivationQuant::Fp8PerToken),
            Self::Fp8PerGroup128 => Some(ActivationQuant::Fp8PerGroup128),
            Self::Nvfp4 | Self::Ggml => None,
        }
    }
}

impl fmt::Display for ActivationQuantKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ActivationQuantKind {
    type Err = QuantError;

    /// Parses a name; `fp8` is accepted for `fp8-token`.
    fn from_str(name: &str) -> Result<Self> {
        if name == "fp8" {
            return Ok(Self::Fp8PerToken);
        }
        Self::ALL
            .into_iter()
            .find(|kind| kind.name() == name)
            .ok_or_else(|| QuantError::UnknownScheme {
                name: name.to_string(),
                known: Self::ALL.map(Self::name).join(", "),
            })
    }
}

/// vLLM's smallest dynamic per-token FP8 scale is $1 / (448 \cdot 512)$; taking
/// $\max(a, 2^{-9}) / 448$ gives the same scale bit for bit.
pub const PER_TOKEN_EPS: f32 = 1.0 / 512.0;
/// vLLM's `per_token_group_quant_fp8` floors the group amax at `1e-10`.
pub const PER_GROUP_EPS: f32 = 1e-10;
/// Group width of block-FP8 activation quantization (DeepSeek / Qwen FP8 layout).
pub const ACT_GROUP: usize = 128;

fn check_width(name: &str, values: &[f32], hidden: usize) -> Result<()> {
    if hidden == 0 || !values.len().is_multiple_of(hidden) {
        return Err(QuantError::ShapeMismatch {
            tensor: name.to_string(),
            out_features: values.len().checked_div(hidden).unwrap_or(0),
            in_features: hidden,
            len: values.len(),
        });
    }
    Ok(())
}

/// `x <- e4m3(x / s) * s` for every value of a run with scale `s`.
fn fake_quant_fp8_run(values: &mut [f32], scale: f32) {
    let mut out = [0.0f32; ACT_GROUP];
    for chunk in values.chunks_mut(ACT_GROUP) {
        let out = &mut out[..chunk.len()];
        runs::fake_quant_fp8_run(chunk, scale, out);
        chunk.copy_from_slice(out);
    }
}

/// FP8 dynamic per-token fake-quant: per row `s = max(amax_t, eps) / 448`,
/// `x <- e4m3(x / s) * s`. Use [`PER_TOKEN_EPS`] for vLLM's behaviour.
pub fn fp8_per_token(name: &str, values: &mut [f32], hidden: usize, eps: f32) -> Result<()> {
    check_width(name, values, hidden)?;
    values.par_chunks_mut(hidden).for_each(|row| {
        let scale = f32::from_bits(abs_max_bits(row)).max(eps) / E4M3_MAX;
        fake_quant_fp8_run(row, scale);
    });
    Ok(())
}

/// FP8 dynamic per 1x128 group fake-quant (block-FP8 checkpoints): per token and
/// group of 128 inputs (the last may be partial), `s = max(amax_g, eps) / 448`.
/// Use [`PER_GROUP_EPS`] for vLLM's behaviour.
pub fn fp8_per_group(name: &str, values: &mut [f32], hidden: usize, eps: f32) -> Result<()> {
    check_width(name, values, hidden)?;
    values.par_chunks_mut(hidden).for_each(|row| {
        for group in row.chunks_mut(ACT_GROUP) {
            let scale = f32::from_bits(abs_max_bits(group)).max(eps) / E4M3_MAX;
            fake_quant_fp8_run(group, scale);
        }
    });
    Ok(())
}

/// FP8 static per-tensor fake-quant with a calibrated scale `s` (a checkpoint's
/// `input_scale`, dequantization direction): `x <- e4m3(clamp(x / s)) * s`.
pub fn fp8_static(name: &str, values: &mut [f32], scale: f32) -> Result<()> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(QuantError::BadScale {
            tensor: name.to_string(),
            value: scale,
        });
    }
    values
        .par_chunks_mut(1 << 14)
        .for_each(|run| fake_quant_fp8_run(run, scale));
    Ok(())
}

/// NVFP4 activation fake-quant as W4A4 serving does it: a static global scale `g`
/// (dequantization direction, e.g. ModelOpt `input_scale`) and a dynamic E4M3 scale
/// per 16 inputs, with the weight formula:
/// $s_b = \mathrm{e4m3}(\mathrm{clamp}(a_b / (6 g), 2^{-9}, 448))$ for the block's largest
/// magnitude $a_b$ (1 for an all-zero block), and
/// $x \leftarrow (\mathrm{e2m1}(x / (s_b g)) \cdot s_b) \cdot g$.
/// `hidden` must be a multiple of 16.
pub fn nvfp4_dynamic(name: &str, values: &mut [f32], hidden: usize, global: f32) -> Result<()> {
    check_width(name, values, hidden)?;
    if !hidden.is_multiple_of(NVFP4_BLOCK) {
        return Err(QuantError::InputDimNotDivisible {
            tensor: name.to_string(),
            scheme: "nvfp4",
            multiple: NVFP4_BLOCK,
            in_features: hidden,
        });
    }
    if !(global.is_finite() && global > 0.0) {
        return Err(QuantError::BadScale {
            tensor: name.to_string(),
            value: global,
        });
    }
    values.par_chunks_mut(NVFP4_BLOCK * 64).for_each(|run| {
        let mut out = [0.0f32; NVFP4_BLOCK * 64];
        let out = &mut out[..run.len()];
        runs::nvfp4_fake_quant_run(run, global, out);
        run.copy_from_slice(out);
    });
    Ok(())
}

/// NVFP4 static activation quantization exactly as vLLM applies it to the input of
/// a W4A4 linear (`scaled_fp4_quant`, csrc/quantization/fp4/nvfp4_utils.cuh
/// `cvt_warp_fp16_to_fp4`, and its torch twin `ref_nvfp4_quant` in
/// vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py), then
/// dequantized as the GEMM's `alpha` does. `input_scale` is the checkpoint's static
/// global scale: ModelOpt `input_scale = amax / 2688` ([`Nvfp4GlobalScale::Multiplier`])
/// or compressed-tensors `input_global_scale = 2688 / amax`
/// ([`Nvfp4GlobalScale::Divisor`]). With `q` the quantization-direction scale
/// (`1 / input_scale`, or the divisor as stored) and `m` the dequantization one
/// (`input_scale`, or `1 / divisor`), per token and 16 inputs:
///
/// * $s_b = \mathrm{e4m3}(q \cdot (a_b \cdot \mathrm{f32}(1/6)))$ for the block's largest
///   magnitude $a_b$, saturating, with no lower clamp: a block whose scale rounds to 0
///   quantizes to 0 (unlike the weight formula's $2^{-9}$ floor);
/// * $x_q = \mathrm{e2m1}(x \cdot (1 / (s_b \cdot (1 / q))))$ (0 where $s_b = 0$), round
///   to nearest even, saturating at 6;
/// * $x \leftarrow (x_q \cdot s_b) \cdot m$.
///
/// vLLM's CUDA kernel takes the reciprocals with `rcp.approx.ftz.f32`; this
/// computes them correctly rounded, as vLLM's torch reference does
/// (docs/quantization.md). `hidden` must be a multiple of 16.
pub fn nvfp4_static_vllm(
    name: &str,
    values: &mut [f32],
    hidden: usize,
    input_scale: Nvfp4GlobalScale,
) -> Result<()> {
    check_width(name, values, hidden)?;
    if !hidden.is_multiple_of(NVFP4_BLOCK) {
        return Err(QuantError::InputDimNotDivisible {
            tensor: name.to_string(),
            scheme: "nvfp4",
            multiple: NVFP4_BLOCK,
            in_features: hidden,
        });
    }
    let stored = match input_scale {
        Nvfp4GlobalScale::Multiplier(v) | Nvfp4GlobalScale::Divisor(v) => v,
    };
    if !(stored.is_finite() && stored > 0.0) {
        return Err(QuantError::BadScale {
            tensor: name.to_string(),
            value: stored,
        });
    }
    // vLLM: ModelOpt `input_global_scale_inv = (1.0 / input_scale).to(float32)`,
    // alpha uses `input_scale`; compressed-tensors uses the stored divisor and
    // `input_global_scale = (1.0 / divisor).to(float32)`.
    let (quant_scale, dequant_scale) = match input_scale {
        Nvfp4GlobalScale::Multiplier(s) => (1.0 / s, s),
        Nvfp4GlobalScale::Divisor(d) => (d, 1.0 / d),
    };
    let inverse_quant_scale = 1.0 / quant_scale;
    let reciprocal_e2m1_max = 1.0 / E2M1_MAX;
    values.par_chunks_mut(NVFP4_BLOCK * 64).for_each(|run| {
        for block in run.chunks_exact_mut(NVFP4_BLOCK) {
            let amax = f32::from_bits(abs_max_bits(block));
            let block_scale =
                E4M3_TABLE[e4m3_encode(quant_scale * (amax * reciprocal_e2m1_max)) as usize];
            let output_scale = if block_scale != 0.0 {
                1.0 / (block_scale * inverse_quant_scale)
            } else {
                0.0
            };
            for x in block.iter_mut() {
                let code = e2m1_encode(*x * output_scale) & 0xF;
                *x = E2M1_TABLE[code as usize] * block_scale * dequant_scale;
            }
        }
    });
    Ok(())
}

/// Fake-quantizes each token's 32-blocks as llama.cpp's CPU backend quantizes
/// activations to Q8_0 on x86-64 with AVX / AVX2 (`quantize_row_q8_0` in
/// ggml/src/ggml-cpu/arch/x86/quants.c, which the integer dot products then read):
/// `amax` of the block, `d = f16(amax / 127)`, `q = round_half_even(x * (127 / amax))`
/// (0 for an all-zero block), and the value `q * d` the dot product multiplies by.
/// `hidden` must be a multiple of 32.
pub fn ggml_q8_0(name: &str, values: &mut [f32], hidden: usize) -> Result<()> {
    check_ggml_width(name, values, hidden, 32)?;
    values.par_chunks_mut(32).for_each(|block| {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = fp16_to_f32(fp32_to_fp16(amax / 127.0));
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        for v in block.iter_mut() {
            // through the integer code, as the dot product reads it (no -0)
            let q = (*v * id).round_ties_even().clamp(-128.0, 127.0) as i32;
            *v = q as f32 * d;
        }
    });
    Ok(())
}

/// Fake-quantizes each token's 256-blocks as llama.cpp quantizes activations to Q8_K
/// for the K-type dot products (`quantize_row_q8_K_ref`, which the x86 backend
/// calls): `max` the first value of largest magnitude, `iscale = -127 / max`,
/// `q = min(127, nearest_int(iscale x))`, `d = 1 / iscale` kept in f32, value `q * d`
/// (0 for an all-zero block). `hidden` must be a multiple of 256.
pub fn ggml_q8_k(name: &str, values: &mut [f32], hidden: usize) -> Result<()> {
    check_ggml_width(name, values, hidden, QK_K)?;
    values.par_chunks_mut(QK_K).for_each(|block| {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in block.iter() {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            block.fill(0.0);
            return;
        }
        let iscale = -127.0 / max;
        let d = 1.0 / iscale;
        for v in block.iter_mut() {
            // nearest_int of ggml-quants.c (ties to even through the f32 mantissa)
            let shifted = (iscale * *v + 12_582_912.0).to_bits() as i32;
            let q = ((shifted & 0x007f_ffff) - 0x0040_0000).min(127);
            // int8 storage, as the C assigns the int to int8_t
            *v = f32::from(q as i8) * d;
        }
    });
    Ok(())
}

fn check_ggml_width(name: &str, values: &[f32], hidden: usize, block: usize) -> Result<()> {
    check_width(name, values, hidden)?;
    if !hidden.is_multiple_of(block) {
        return Err(QuantError::InputDimNotDivisible {
            tensor: name.to_string(),
            scheme: if block == 32 {
                "ggml q8_0 activations"
            } else {
                "ggml q8_K activations"
            },
            multiple: block,
            in_features: hidden,
        });
    }
    Ok(())
}
