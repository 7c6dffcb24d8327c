//! The quantized-base + LoRA linear layer.

use crate::cpu::{self, CpuOptions, Isa};
use crate::error::{KernelError, Result};
use crate::lora::LoraAdapter;
use loraq_quant::{ActivationQuant, QuantizedWeight};

/// `y = dequant(W_q) · act_q(x) + scale · B (A x)` for a batch of tokens.
///
/// The base weight stays in its stored format; the fast path dequantizes it in
/// registers. The LoRA path sees the unquantized activation (as vLLM does), its
/// intermediate `A x` is kept in f32.
#[derive(Clone, Debug)]
pub struct QuantLoraLinear {
    base: QuantizedWeight,
    lora: Option<LoraAdapter>,
    activation_quant: ActivationQuant,
    /// Per-block-scale-code multipliers (NVFP4: E4M3 x global scale, MXFP4: E8M0).
    scale_table: Box<[f32; 256]>,
    /// fp8-block128: tile multipliers times 2^120 (`None`: some overflow, two-step decode).
    fp8_rebiased: Option<Vec<f32>>,
    /// The base weight decoded once into the prefill GEMM's f32 panels
    /// ([`QuantLoraLinear::with_packed_panels`]).
    panels: Option<PackedPanels>,
}

/// A base weight decoded into the f32 panels of the prefill GEMM's micro-kernel for one
/// instruction set (each block of output rows transposed, `[in_features, rows]`).
#[derive(Clone)]
struct PackedPanels {
    isa: Isa,
    values: Vec<f32>,
}

impl std::fmt::Debug for PackedPanels {
    // Its size, not a hundred million values.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedPanels")
            .field("isa", &self.isa)
            .field("values", &self.values.len())
            .finish()
    }
}

impl QuantLoraLinear {
    /// Builds a linear from a base weight in its stored format and an optional
    /// adapter; refuses a weight the kernels cannot run (fp8 per tensor or channel,
    /// buffers of the wrong length, NaN codes, non-finite scales) and an adapter whose
    /// shape is not the base's.
    pub fn new(base: QuantizedWeight, lora: Option<LoraAdapter>) -> Result<Self> {
        crate::weight::check_runnable(&base)?;
        let (out_features, in_features) = base.shape();
        if let Some(l) = &lora {
            if l.in_features != in_features {
                return Err(KernelError::LoraShape {
                    factor: "A",
                    rows: l.rank,
                    cols: l.in_features,
                    expected_rows: l.rank,
                    expected_cols: in_features,
                });
            }
            if l.out_features != out_features {
                return Err(KernelError::LoraShape {
                    factor: "B",
                    rows: l.out_features,
                    cols: l.rank,
                    expected_rows: out_features,
                    expected_cols: l.rank,
                });
            }
        }
        let scale_table = Box::new(match &base {
            QuantizedWeight::Nvfp4(w) => cpu::decode::nvfp4_scale_table(w.global_scale),
            QuantizedWeight::Mxfp4(_) => cpu::decode::mxfp4_scale_table(),
            _ => [0f32; 256],
        });
        let fp8_rebiased = match &base {
            QuantizedWeight::Fp8(w) => cpu::decode::fp8_rebiased_scales(&w.scales),
            _ => None,
        };
        Ok(Self {
            base,
            lora,
            activation_quant: ActivationQuant::None,
            scale_table,
            fp8_rebiased,
            panels: None,
        })
    }

    /// Bytes [`Self::with_packed_panels`] would hold for `opts`' instruction set: the
    /// base weight as f32, its output rows rounded up to the micro-kernel's block
    /// (`None` on overflow).
    pub fn packed_panel_bytes(&self, opts: CpuOptions) -> Option<usize> {
        cpu::gemm::packed_panels_len(opts.resolved_isa(), self.out_features(), self.in_features())?
            .checked_mul(std::mem::size_of::<f32>())
    }

    /// Decodes the base weight once, now, into the f32 panels the prefill GEMM
    /// (batches over [`cpu::GEMV_MAX_BATCH`] tokens on the CPU path with `opts`'
    /// instruction set) multiplies, instead of decoding every block's panel again for
    /// every tile of tokens: four bytes a weight ([`Self::packed_panel_bytes`]) beside
    /// the stored codes, for a model whose weights fit in memory as f32. The panels
    /// hold the values the per-tile decode writes, so the results are the same bits.
    pub fn with_packed_panels(mut self, opts: CpuOptions) -> Self {
        let isa = opts.resolved_isa();
        self.panels = Some(PackedPanels {
            isa,
            values: cpu::pack_base_panels(&self, isa, opts.parallelism),
        });
        self
    }

    /// The packed panels, if they were packed for `isa`.
    pub(crate) fn packed_panels(&self, isa: Isa) -> Option<&[f32]> {
        self.panels
            .as_ref()
            .filter(|p| p.isa == isa)
            .map(|p| p.values.as_slice())
    }

    /// Sets the activation fake-quant of the base path.
    pub fn with_activation_quant(mut self, activation_quant: ActivationQuant) -> Self {
        self.activation_quant = activation_quant;
        self
    }

    /// The base weight.
    pub fn base(&self) -> &QuantizedWeight {
        &self.base
    }

    /// The adapter, if any.
    pub fn lora(&self) -> Option<&LoraAdapter> {
        self.lora.as_ref()
    }

    /// The activation fake-quant of the base path.
    pub fn activation_quant(&self) -> ActivationQuant {
        self.activation_quant
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.base.shape().1
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.base.shape().0
    }

    /// Bytes one pass reads from the weights (base codes and scales, both LoRA factors):
    /// the numerator of effective bandwidth.
    pub fn weight_bytes(&self) -> usize {
        self.base.stored_bytes() + self.lora.as_ref().map_or(0, LoraAdapter::stored_bytes)
    }

    /// Multiply-adds of one token (base plus both LoRA products).
    pub fn macs_per_token(&self) -> usize {
        let base = self.out_features() * self.in_features();
        base + self
            .lora
            .as_ref()
            .map_or(0, |l| l.rank * (self.in_features() + self.out_features()))
    }

    pub(crate) fn scale_table(&self) -> &[f32; 256] {
        &self.scale_table
    }

    pub(crate) fn fp8_rebiased_scales(&self) -> Option<&[f32]> {
        self.fp8_rebiased.as_deref()
    }

    fn check_io(&self, x: &[f32], batch: usize, y: &[f32]) -> Result<()> {
        let (in_features, out_features) = (self.in_features(), self.out_features());
        if batch.checked_mul(in_features) != Some(x.len()) {
            return Err(KernelError::InputShape {
                batch,
                in_features,
                actual: x.len(),
            });
        }
        if batch.checked_mul(out_features) != Some(y.len()) {
            return Err(KernelError::OutputShape {
                batch,
                out_features,
                actual: y.len(),
            });
        }
        Ok(())
    }

    /// Fast CPU forward: `x` is `[batch, in_features]`, `y` (`[batch, out_features]`) is
    /// overwritten.
    pub fn forward(&self, x: &[f32], batch: usize, y: &mut [f32], opts: CpuOptions) -> Result<()> {
        self.check_io(x, batch, y)?;
        if batch > 0 {
            cpu::forward(self, x, batch, y, opts, cpu::Schedule::Fused)?;
        }
        Ok(())
    }

    /// As [`Self::forward`], but on the decode path (batch <= 8) the LoRA shrink runs as
    /// its own parallel pass before the base pass instead of inside it: the schedule
    /// before fusion, kept so the benches can measure what fusing it gives. Same
    /// arithmetic, same result bits.
    pub fn forward_lora_phased(
        &self,
        x: &[f32],
        batch: usize,
        y: &mut [f32],
        opts: CpuOptions,
    ) -> Result<()> {
        self.check_io(x, batch, y)?;
        if batch > 0 {
            cpu::forward(self, x, batch, y, opts, cpu::Schedule::Phased)?;
        }
        Ok(())
    }

    /// The f64-accumulating reference (see [`crate::reference`]).
    pub fn forward_reference(&self, x: &[f32], batch: usize) -> Result<Vec<f32>> {
        let in_features = self.in_features();
        if batch.checked_mul(in_features) != Some(x.len()) {
            return Err(KernelError::InputShape {
                batch,
                in_features,
                actual: x.len(),
            });
        }
        crate::reference::forward_reference(
            &self.base,
            self.lora.as_ref(),
            self.activation_quant,
            x,
            batch,
        )
    }

    /// As [`Self::forward_reference`], also returning per output the sum of the
    /// magnitudes of its products (see
    /// [`crate::reference::forward_reference_with_magnitude`]).
    pub fn forward_reference_with_magnitude(
        &self,
        x: &[f32],
        batch: usize,
    ) -> Result<(Vec<f32>, Vec<f64>)> {
        crate::reference::forward_reference_with_magnitude(
            &self.base,
            self.lora.as_ref(),
            self.activation_quant,
            x,
            batch,
        )
    }

    /// Dequantizes the whole base weight to f32, row-major `[out_features, in_features]`.
    /// This is what the fused path avoids; it exists for the baseline and debugging.
    pub fn dequantize_base(&self, opts: CpuOptions) -> Vec<f32> {
        cpu::dequantize_base(self, opts)
    }

    /// The unfused baseline: multiplies by `dense`, the output of
    /// [`Self::dequantize_base`], then adds the LoRA path computed separately.
    pub fn forward_dense_baseline(
        &self,
        dense: &[f32],
        x: &[f32],
        batch: usize,
        y: &mut [f32],
        opts: CpuOptions,
    ) -> Result<()> {
        self.check_io(x, batch, y)?;
        let expected = self.out_features() * self.in_features();
        if dense.len() != expected {
            return Err(KernelError::ShapeMismatch {
                what: "dense baseline weight",
                expected,
                actual: dense.len(),
            });
        }
        if batch > 0 {
            cpu::forward_with_dense(self, dense, x, batch, y, opts)?;
        }
        Ok(())
    }
}
