//! One linear, several backends: the base weight in its stored format
//! ([`QuantizedWeight`]) and the LoRA factors go in once, [`Backend::build`] gives
//! something that runs them behind [`LoraLinear`], whichever backend was asked for.
//! A backend that cannot run a weight refuses it when it is built
//! ([`crate::KernelError::UnsupportedScheme`], [`crate::KernelError::UnsupportedOnGpu`]); nothing
//! falls back to another backend.

use crate::cpu::CpuOptions;
use crate::error::Result;
use crate::linear::QuantLoraLinear;
use crate::lora::LoraAdapter;
use loraq_quant::{ActivationQuant, QuantizedWeight};
use std::fmt;

/// A quantized-base + LoRA linear ready to run: `y = W act(x) + s B (A x)` for
/// `batch` tokens, `x` `[batch, in_features]`, `y` `[batch, out_features]` (overwritten).
pub trait LoraLinear: Send + Sync + fmt::Debug {
    /// Runs the linear on `batch` tokens.
    fn forward(&self, x: &[f32], batch: usize, y: &mut [f32]) -> Result<()>;
    /// Input features.
    fn in_features(&self) -> usize;
    /// Output features.
    fn out_features(&self) -> usize;
}

/// Where a linear runs.
#[derive(Clone)]
pub enum Backend {
    /// The f64 reference ([`crate::reference`]): every weight decoded on its own.
    Reference,
    /// The fast CPU path with the given instruction set and threading.
    Cpu(CpuOptions),
    /// The CUDA kernels on an opened device (feature `cuda`): activations and outputs
    /// cross as bf16, as between a server's layers.
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<crate::cuda::CudaBackend>),
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Reference => f.write_str("Reference"),
            Self::Cpu(options) => f.debug_tuple("Cpu").field(options).finish(),
            #[cfg(feature = "cuda")]
            Self::Cuda(device) => f.debug_tuple("Cuda").field(&device.device_name()).finish(),
        }
    }
}

impl Backend {
    /// Short name for messages (`reference`, `cpu`, `cuda`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Reference => "reference",
            Self::Cpu(_) => "cpu",
            #[cfg(feature = "cuda")]
            Self::Cuda(_) => "cuda",
        }
    }

    /// Builds the linear on this backend, or refuses a weight, adapter or activation
    /// quantization it cannot run.
    pub fn build(
        &self,
        base: QuantizedWeight,
        lora: Option<LoraAdapter>,
        activation_quant: ActivationQuant,
    ) -> Result<Box<dyn LoraLinear>> {
        let linear = QuantLoraLinear::new(base, lora)?.with_activation_quant(activation_quant);
        Ok(match self {
            Self::Reference => Box::new(ReferenceLinear(linear)),
            Self::Cpu(options) => Box::new(CpuLinear {
                linear,
                options: *options,
            }),
            #[cfg(feature = "cuda")]
            Self::Cuda(device) => Box::new(crate::cuda::CudaLinear::new(device.clone(), &linear)?),
        })
    }
}

impl Backend {
    /// Bytes the panels of [`Backend::build_with_packed_panels`] take for an
    /// `out_features x in_features` weight on this backend: `Some` on the CPU backend
    /// (the only one that packs them; also `None` on overflow).
    pub fn packed_panel_bytes(&self, out_features: usize, in_features: usize) -> Option<usize> {
        match self {
            Self::Cpu(options) => crate::cpu::gemm::packed_panels_len(
                options.resolved_isa(),
                out_features,
                in_features,
            )?
            .checked_mul(std::mem::size_of::<f32>()),
            _ => None,
        }
    }

    /// As [`Backend::build`], with the CPU backend's base weight decoded once into the
    /// prefill GEMM's f32 panels ([`QuantLoraLinear::with_packed_panels`]: faster
    /// prefill, [`Backend::packed_panel_bytes`] more memory, the same results); the
    /// other backends build as [`Backend::build`] does.
    pub fn build_with_packed_panels(
        &self,
        base: QuantizedWeight,
        lora: Option<LoraAdapter>,
        activation_quant: ActivationQuant,
    ) -> Result<Box<dyn LoraLinear>> {
        match self {
            Self::Cpu(options) => {
                let linear = QuantLoraLinear::new(base, lora)?
                    .with_activation_quant(activation_quant)
                    .with_packed_panels(*options);
                Ok(Box::new(CpuLinear {
                    linear,
                    options: *options,
                }))
            }
            _ => self.build(base, lora, activation_quant),
        }
    }
}

/// [`Backend::Reference`]'s linear.
#[derive(Debug)]
struct ReferenceLinear(QuantLoraLinear);

impl LoraLinear for ReferenceLinear {
    fn forward(&self, x: &[f32], batch: usize, y: &mut [f32]) -> Result<()> {
        let out = self.0.forward_reference(x, batch)?;
        if out.len() != y.len() {
            return Err(crate::KernelError::OutputShape {
                batch,
                out_features: self.0.out_features(),
                actual: y.len(),
            });
        }
        y.copy_from_slice(&out);
        Ok(())
    }

    fn in_features(&self) -> usize {
        self.0.in_features()
    }

    fn out_features(&self) -> usize {
        self.0.out_features()
    }
}

/// [`Backend::Cpu`]'s linear.
#[derive(Debug)]
struct CpuLinear {
    linear: QuantLoraLinear,
    options: CpuOptions,
}

impl LoraLinear for CpuLinear {
    fn forward(&self, x: &[f32], batch: usize, y: &mut [f32]) -> Result<()> {
        self.linear.forward(x, batch, y, self.options)
    }

    fn in_features(&self) -> usize {
        self.linear.in_features()
    }

    fn out_features(&self) -> usize {
        self.linear.out_features()
    }
}
