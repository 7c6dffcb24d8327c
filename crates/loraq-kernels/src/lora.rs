//! LoRA factors attached to a base linear.

use crate::error::{KernelError, Result};
use crate::weight::checked_area;
use half::bf16;

/// Largest LoRA rank the kernels accept (vLLM's largest `max_lora_rank`).
pub const MAX_RANK: usize = 512;

/// A LoRA adapter for one linear: `delta_y = scale * B (A x)` with `A` `[rank, in_features]`
/// and `B` `[out_features, rank]`, both bf16 as PEFT stores them.
#[derive(Clone, Debug)]
pub struct LoraAdapter {
    pub(crate) rank: usize,
    pub(crate) in_features: usize,
    pub(crate) out_features: usize,
    pub(crate) a: Vec<bf16>,
    pub(crate) b: Vec<bf16>,
    pub(crate) scale: f32,
}

impl LoraAdapter {
    /// Wraps `A` (`[rank, in_features]`) and `B` (`[out_features, rank]`), row-major, and the
    /// module's scale (`lora_alpha / r`, or the rank/alpha pattern's value).
    pub fn new(
        rank: usize,
        in_features: usize,
        out_features: usize,
        a: Vec<bf16>,
        b: Vec<bf16>,
        scale: f32,
    ) -> Result<Self> {
        if rank == 0 || rank > MAX_RANK {
            return Err(KernelError::RankOutOfRange {
                rank,
                max: MAX_RANK,
            });
        }
        if checked_area("lora_A", rank, in_features)? != a.len() {
            return Err(KernelError::ShapeMismatch {
                what: "lora_A",
                expected: rank * in_features,
                actual: a.len(),
            });
        }
        if checked_area("lora_B", out_features, rank)? != b.len() {
            return Err(KernelError::ShapeMismatch {
                what: "lora_B",
                expected: out_features * rank,
                actual: b.len(),
            });
        }
        if !scale.is_finite() {
            return Err(KernelError::BadScale {
                what: "LoRA scale",
                index: 0,
                value: scale,
            });
        }
        Ok(Self {
            rank,
            in_features,
            out_features,
            a,
            b,
            scale,
        })
    }

    /// Rank r.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Scale applied to `B (A x)`.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// `A`, row-major `[rank, in_features]`.
    pub fn a(&self) -> &[bf16] {
        &self.a
    }

    /// `B`, row-major `[out_features, rank]`.
    pub fn b(&self) -> &[bf16] {
        &self.b
    }

    /// Bytes of both factors.
    pub fn stored_bytes(&self) -> usize {
        (self.a.len() + self.b.len()) * 2
    }
}
