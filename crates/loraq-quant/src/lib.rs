//! `loraq-quant`: the number formats and quantization schemes of loraq.
//!
//! * [`element`]: E4M3 (fn), E5M2, E2M1 and E8M0 encode (round to nearest even,
//!   saturating) and decode, scalar and over slices.
//! * [`mod@format`]: the stored weight formats ([`WeightFormat`]) with their block
//!   geometry, declared once, the NVFP4 global scale and the block scale codes.
//! * [`weight`]: [`QuantizedWeight`], a linear weight in its stored format (codes,
//!   scales, global scale), and its exact dequantization.
//! * [`scheme`]: weight schemes (fp8 per tensor / channel / 128x128 block, NVFP4,
//!   MXFP4, INT4 group 128), each with quantize and fake-quant.
//! * [`layout`]: quantized checkpoint layouts: [`QuantizedBase`] decodes any linear
//!   weight of an fp8-block128 / fp8 / NVFP4 (ModelOpt or compressed-tensors) / plain
//!   checkpoint exactly to `f32`; [`layout::plan_quantization`] (or
//!   [`layout::plan_quantization_calibrated`], for NVFP4 with static activation
//!   scales) and [`layout::write_quantized`] write fp8-block128, fp8-tensor,
//!   fp8-channel compressed-tensors, NVFP4 ModelOpt, NVFP4 compressed-tensors and
//!   bf16-emulated checkpoints.
//! * [`report`]: quantization error of weights, alone and under a LoRA adapter
//!   against a merged checkpoint, with the bf16 floor (`loraq quant-error`).
//! * [`ggml`]: the ggml block types of GGUF files (Q8_0, Q4_K, IQ4_XS, ...): decode,
//!   quantization and llama-quantize's per-tensor type choice, bit-exact with
//!   llama.cpp.
//! * [`gguf_model`]: a checkpoint written as a quantized GGUF model, as llama.cpp's
//!   converter and llama-quantize write it (`loraq quantize --scheme gguf-*`).
//! * [`activation`]: activation fake-quant ([`ActivationQuant`] picks one per linear) (FP8 per token / per 1x128 group / static,
//!   NVFP4 dynamic per 16 under a static global scale, with the weight formula or
//!   exactly as vLLM's W4A4 linears apply it).
//!
//! The exact formulas, and where they differ from `ml_dtypes` and from other
//! producers, are in `docs/quantization.md`.

pub mod activation;
pub mod element;
pub mod error;
pub mod format;
pub mod ggml;
pub mod gguf_model;
pub mod layout;
mod multiversion;
pub mod quantize_dir;
pub mod report;
mod runs;
pub mod scheme;
pub mod weight;

pub use activation::{ActivationQuant, ActivationQuantKind};
pub use element::ElementFormat;
pub use error::{QuantError, Result};
pub use format::{
    FP8_BLOCK, Fp8Granularity, INT4_GROUP, MXFP4_BLOCK, NVFP4_BLOCK, Nvfp4GlobalScale, ScaleBlock,
    WeightFormat,
};
pub use ggml::{GgmlType, GgmlWeight};
pub use gguf_model::{GgufQuantizeRequest, GgufQuantizeSummary, quantize_to_gguf};
pub use layout::{Layout, LinearWeight, QuantizedBase, StoredWeight};
pub use quantize_dir::{QuantizeProgress, QuantizeRequest, QuantizeSummary, quantize_to_dir};
pub use report::{MeasureProgress, QuantErrorRequest};
pub use scheme::{Bf16WeightView, Scheme, WeightView};
pub use weight::{
    Bf16Weight, Fp8Weight, Int4Weight, Mxfp4Weight, Nvfp4Weight, QuantizedWeight,
    dequantize_fp8_into, dequantize_nvfp4_into,
};
