//! `loraq-quant`: the number formats and quantization schemes of loraq.
//!
//! * [`element`]: E4M3 (fn), E5M2, E2M1 and E8M0 encode (round to nearest even,
//!   saturating) and decode, scalar and over slices.
//! * [`scheme`]: weight schemes (fp8 per tensor / channel / 128x128 block, NVFP4,
//!   MXFP4, INT4 group 128), each with quantize, dequantize and fake-quant.
//! * [`layout`]: quantized checkpoint layouts: [`QuantizedBase`] decodes any linear
//!   weight of an fp8-block128 / fp8 / NVFP4 (ModelOpt or compressed-tensors) / plain
//!   checkpoint exactly to `f32`; [`layout::plan_quantization`] (or
//!   [`layout::plan_quantization_calibrated`], for NVFP4 with static activation
//!   scales) and [`layout::write_quantized`] write fp8-block128, fp8-tensor,
//!   fp8-channel compressed-tensors, NVFP4 ModelOpt, NVFP4 compressed-tensors and
//!   bf16-emulated checkpoints.
//! * [`report`]: quantization error of weights, alone and under a LoRA adapter
//!   against a merged checkpoint, with the bf16 floor (`loraq quant-error`).
//! * [`activation`]: activation fake-quant (FP8 per token / per 1x128 group / static,
//!   NVFP4 dynamic per 16 under a static global scale, with the weight formula or
//!   exactly as vLLM's W4A4 linears apply it).
//!
//! The exact formulas, and where they differ from `ml_dtypes` and from other
//! producers, are in `docs/quantization.md`.

pub mod activation;
pub mod element;
pub mod error;
mod kernels;
pub mod layout;
pub mod report;
pub mod scheme;

pub use element::ElementFormat;
pub use error::{QuantError, Result};
pub use layout::{Layout, LinearWeight, QuantizedBase, StoredWeight};
pub use scheme::{
    Fp8Granularity, Fp8Weight, Int4Weight, Mxfp4Weight, Nvfp4GlobalScale, Nvfp4Weight,
    QuantizedWeight, Scheme, WeightView, dequantize_fp8_into, dequantize_nvfp4_into,
};
