//! Activation fake-quant, in place on a row-major `[tokens, hidden]` matrix: what a
//! W8A8 / W4A4 server does to the input of a quantized linear (the LoRA path sees the
//! unquantized activation).
//!
//! Unlike weights, activations are not checked for NaN: a NaN token stays NaN.

use crate::element::E4M3_MAX;
use crate::error::{QuantError, Result};
use crate::kernels::{self, abs_max_bits};
use crate::scheme::NVFP4_BLOCK;
use rayon::prelude::*;

/// vLLM's smallest dynamic per-token FP8 scale is `1 / (448 * 512)`; taking
/// `max(amax, 2^-9) / 448` gives the same scale bit for bit.
pub const PER_TOKEN_EPS: f32 = 1.0 / 512.0;
/// vLLM's `per_token_group_quant_fp8` floors the group amax at `1e-10`.
pub const PER_GROUP_EPS: f32 = 1e-10;
/// Group width of block-FP8 activation quantization (DeepSeek / Qwen FP8 layout).
pub const ACT_GROUP: usize = 128;

fn check_width(name: &str, values: &[f32], hidden: usize) -> Result<()> {
    if hidden == 0 || values.len() % hidden != 0 {
        return Err(QuantError::ShapeMismatch {
            tensor: name.to_string(),
            rows: values.len().checked_div(hidden).unwrap_or(0),
            cols: hidden,
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
        kernels::fake_quant_fp8_run(chunk, scale, out);
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
/// per 16 inputs, with the weight formula: `s_b = e4m3(clamp(amax_b / (6 g), 2^-9,
/// 448))` (1 for an all-zero block), `x <- (e2m1(x / (s_b g)) * s_b) * g`.
/// `hidden` must be a multiple of 16.
pub fn nvfp4_dynamic(name: &str, values: &mut [f32], hidden: usize, global: f32) -> Result<()> {
    check_width(name, values, hidden)?;
    if hidden % NVFP4_BLOCK != 0 {
        return Err(QuantError::InputDimNotDivisible {
            tensor: name.to_string(),
            scheme: "nvfp4",
            multiple: NVFP4_BLOCK,
            cols: hidden,
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
        kernels::nvfp4_fake_quant_run(run, global, out);
        run.copy_from_slice(out);
    });
    Ok(())
}
