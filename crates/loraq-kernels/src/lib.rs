//! Fused "quantized base + LoRA" linear layers.
//!
//! `y = dequant(W_q) · act_q(x) + scale · B (A x)` over base weights
//! (`loraq_quant::QuantizedWeight`) stored as bf16, fp8-block128, NVFP4, MXFP4 or INT4
//! group 128 (layouts in docs/quantization.md), LoRA rank 1..=512, batch from one
//! token (decode) to thousands (prefill):
//!
//! - [`mod@reference`]: element-by-element decode, f64 accumulation: the oracle.
//! - [`QuantLoraLinear::forward`]: the fast CPU path (rayon + AVX-512/AVX2/scalar chosen at
//!   run time), dequantizing in registers, LoRA shrink and expand fused (see [`cpu`]).
//! - [`nvrtc`]: the CUDA kernels in `kernels/*.cu` and a dynamically loaded NVRTC to
//!   compile them (no CUDA needed to build); `cuda` (feature `cuda`) runs them, each
//!   kernel given one argument struct of [`kernel_args`].

pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod kernel_args;
#[cfg(any(feature = "cuda", test))]
mod launch_plan;
pub mod linear;
pub mod lora;
pub mod nvrtc;
pub mod reference;
pub mod weight;

pub use backend::{Backend, LoraLinear};
pub use cpu::{CpuOptions, Isa, Parallelism};
pub use error::{KernelError, Result};
pub use linear::QuantLoraLinear;
pub use lora::{LoraAdapter, MAX_RANK};
/// The weight and activation types the linears take, from `loraq-quant` (one
/// vocabulary for a quantized weight across the crates).
pub use loraq_quant::{
    ActivationQuant, Bf16Weight, Fp8Weight, Int4Weight, Mxfp4Weight, Nvfp4Weight, QuantizedWeight,
};
pub use weight::has_kernel;
