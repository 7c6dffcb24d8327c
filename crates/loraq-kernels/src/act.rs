//! Activation fake-quantization on the base path (the LoRA path sees the unquantized
//! activation, as vLLM does). The formats and their exact formulas live in
//! `loraq_quant::activation`; this enum picks one per linear.

use crate::error::Result;
use loraq_quant::{Nvfp4GlobalScale, activation};

/// How the base path sees the activation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum ActivationQuant {
    /// Unquantized (weight-only quantization).
    #[default]
    None,
    /// FP8 E4M3, one dynamic scale per token (`max(amax, 2^-9) / 448`, vLLM's floor).
    Fp8PerToken,
    /// FP8 E4M3, one dynamic scale per 1x128 group of a token (block-FP8 serving).
    Fp8PerGroup128,
    /// NVFP4 (W4A4) as vLLM applies it: dynamic E4M3 scale per 16 inputs under a
    /// static global scale (`loraq_quant::activation::nvfp4_static_vllm`). The
    /// in-dimension must be a multiple of 16.
    Nvfp4 {
        /// The checkpoint's static scale: ModelOpt `input_scale` (multiplier) or
        /// compressed-tensors `input_global_scale` (divisor).
        input_scale: Nvfp4GlobalScale,
    },
}

impl ActivationQuant {
    /// Fake-quantizes `values` (row-major `[tokens, hidden]`) in place.
    pub fn apply(&self, values: &mut [f32], hidden: usize) -> Result<()> {
        const NAME: &str = "activation";
        match *self {
            Self::None => {}
            Self::Fp8PerToken => {
                activation::fp8_per_token(NAME, values, hidden, activation::PER_TOKEN_EPS)?
            }
            Self::Fp8PerGroup128 => {
                activation::fp8_per_group(NAME, values, hidden, activation::PER_GROUP_EPS)?
            }
            Self::Nvfp4 { input_scale } => {
                activation::nvfp4_static_vllm(NAME, values, hidden, input_scale)?
            }
        }
        Ok(())
    }

    /// True when the base path sees `x` unchanged.
    pub fn is_identity(&self) -> bool {
        matches!(self, Self::None)
    }
}
