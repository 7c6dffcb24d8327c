//! Activation fake-quantization on the base path (the LoRA path sees the unquantized
//! activation, as vLLM does). DESIGN.md, "Element formats": fp8 dynamic per token
//! (`s = max(amax_t, eps) / 448`) or per 1x128 group (block checkpoints).

use float8::F8E4M3;

/// Smallest amax used for a dynamic fp8 activation scale, so an all-zero token
/// gets a finite scale.
pub const FP8_ACT_EPS: f32 = 1e-12;
const E4M3_MAX: f32 = 448.0;

/// How the base path sees the activation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum ActivationQuant {
    /// Unquantized (weight-only quantization).
    #[default]
    None,
    /// FP8 E4M3 with one dynamic scale per token.
    Fp8PerToken,
    /// FP8 E4M3 with one dynamic scale per 1x128 group of a token (fp8-block128 serving).
    Fp8PerGroup128,
}

fn fake_quant_fp8_group(x: &[f32], out: &mut [f32]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = amax.max(FP8_ACT_EPS) / E4M3_MAX;
    for (o, &v) in out.iter_mut().zip(x) {
        let q = F8E4M3::from_f32((v / scale).clamp(-E4M3_MAX, E4M3_MAX));
        *o = q.to_f32() * scale;
    }
}

impl ActivationQuant {
    /// Writes the fake-quantized token `x` (one row of the activation) into `out`.
    pub fn apply_row(&self, x: &[f32], out: &mut [f32]) {
        debug_assert_eq!(x.len(), out.len());
        match self {
            Self::None => out.copy_from_slice(x),
            Self::Fp8PerToken => fake_quant_fp8_group(x, out),
            Self::Fp8PerGroup128 => {
                for (xg, og) in x.chunks(128).zip(out.chunks_mut(128)) {
                    fake_quant_fp8_group(xg, og);
                }
            }
        }
    }

    /// True when the base path sees `x` unchanged.
    pub fn is_identity(&self) -> bool {
        matches!(self, Self::None)
    }
}
