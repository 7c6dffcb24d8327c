//! The f16 / bf16 conversions ggml uses, bit for bit.

/// `ggml_compute_fp32_to_fp16` (ggml/src/ggml-impl.h): round to nearest even,
/// overflow to infinity, NaN to the quiet NaN `0x7E00` with the input's sign.
pub fn fp32_to_fp16(f: f32) -> u16 {
    let scale_to_inf = f32::from_bits(0x7780_0000); // 2^112
    let scale_to_zero = f32::from_bits(0x0880_0000); // 2^-110
    let mut base = (f.abs() * scale_to_inf) * scale_to_zero;
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let bias = (shl1_w & 0xFF00_0000).max(0x7100_0000);
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let exp_bits = (bits >> 13) & 0x0000_7C00;
    let mantissa_bits = bits & 0x0000_0FFF;
    let nonsign = exp_bits + mantissa_bits;
    ((sign >> 16)
        | if shl1_w > 0xFF00_0000 {
            0x7E00
        } else {
            nonsign
        }) as u16
}

/// f16 bits to f32 (exact).
pub fn fp16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// `ggml_compute_fp32_to_bf16`: round to nearest even, NaN forced quiet.
pub(crate) fn fp32_to_bf16(f: f32) -> u16 {
    let i = f.to_bits();
    if i & 0x7fff_ffff > 0x7f80_0000 {
        return ((i >> 16) | 64) as u16;
    }
    (i.wrapping_add(0x7fff + ((i >> 16) & 1)) >> 16) as u16
}

/// bf16 bits to f32 (exact).
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp16_rounding_agrees_with_the_half_crate_on_finite_values() {
        // Both are round-to-nearest-even with overflow to infinity; spot-check a
        // spread of magnitudes including ties, subnormals and the overflow edge.
        let mut x = 1.0e-9f32;
        while x < 1.0e6 {
            for v in [x, -x, x * 1.000_488_3, f32::from_bits(x.to_bits() | 0x1000)] {
                assert_eq!(fp32_to_fp16(v), half::f16::from_f32(v).to_bits(), "{v:e}");
            }
            x *= 1.37;
        }
        assert_eq!(fp32_to_fp16(65520.0), 0x7C00);
        assert_eq!(fp32_to_fp16(65519.0), 0x7BFF);
    }
}
