//! Reference implementation: every weight element decoded on its own by
//! `loraq_quant::element` (table lookups, independent of the fast path's bit tricks),
//! every sum accumulated in f64. Slow by design; the oracle for the fast CPU path and
//! the GPU kernels. It takes the weight, the adapter and the activation quantization
//! as they are, not the linear it checks.

use crate::error::Result;
use crate::lora::LoraAdapter;
use loraq_quant::element::{e2m1_decode, e4m3_decode, e8m0_decode};
use loraq_quant::{
    ActivationQuant, FP8_BLOCK, INT4_GROUP, MXFP4_BLOCK, NVFP4_BLOCK, Nvfp4GlobalScale,
    QuantizedWeight,
};

fn nibble(packed: &[u8], row_bytes: usize, row: usize, k: usize) -> u8 {
    let byte = packed[row * row_bytes + k / 2];
    if k.is_multiple_of(2) {
        byte & 0x0F
    } else {
        byte >> 4
    }
}

/// Dequantized weight element `W[row, k]` in f64 (fp8 per tensor or channel has no
/// kernel, but its element is defined all the same).
pub fn weight_element(base: &QuantizedWeight, row: usize, k: usize) -> f64 {
    match base {
        QuantizedWeight::Bf16(w) => f64::from(w.data[row * w.in_features + k].to_f32()),
        QuantizedWeight::Fp8(w) => {
            let q = f64::from(e4m3_decode(w.codes[row * w.in_features + k]));
            let [_, scale_cols] = w.scale_shape();
            let s = match w.granularity {
                loraq_quant::Fp8Granularity::Tensor => w.scales[0],
                loraq_quant::Fp8Granularity::Channel => w.scales[row],
                loraq_quant::Fp8Granularity::Block128 => {
                    w.scales[(row / FP8_BLOCK) * scale_cols + k / FP8_BLOCK]
                }
            };
            q * f64::from(s)
        }
        QuantizedWeight::Nvfp4(w) => {
            let q = f64::from(e2m1_decode(nibble(&w.packed, w.in_features / 2, row, k)));
            let code = w.block_scales[row * (w.in_features / NVFP4_BLOCK) + k / NVFP4_BLOCK];
            let block_scale = f64::from(e4m3_decode(code));
            match w.global_scale {
                Nvfp4GlobalScale::Multiplier(g) => q * block_scale * f64::from(g),
                Nvfp4GlobalScale::Divisor(d) => q * block_scale / f64::from(d),
            }
        }
        QuantizedWeight::Mxfp4(w) => {
            let q = f64::from(e2m1_decode(nibble(&w.packed, w.in_features / 2, row, k)));
            let e = w.scales[row * (w.in_features / MXFP4_BLOCK) + k / MXFP4_BLOCK];
            q * f64::from(e8m0_decode(e))
        }
        QuantizedWeight::Int4(w) => {
            let q = f64::from(nibble(&w.packed, w.in_features.div_ceil(2), row, k));
            let g = row * w.groups() + k / INT4_GROUP;
            (q - f64::from(w.zeros[g])) * f64::from(w.scales[g])
        }
        QuantizedWeight::Ggml(w) => f64::from(w.element(row, k)),
    }
}

/// `y = W act(x) + scale * B (A x)` for `batch` tokens, f64 accumulation, rounded to
/// f32 at the end. `x` is `[batch, in_features]`, the result `[batch, out_features]`; the
/// caller checks the shapes (as [`crate::QuantLoraLinear::forward_reference`] does).
pub fn forward_reference(
    base: &QuantizedWeight,
    lora: Option<&LoraAdapter>,
    activation_quant: ActivationQuant,
    x: &[f32],
    batch: usize,
) -> Result<Vec<f32>> {
    Ok(forward_reference_with_magnitude(base, lora, activation_quant, x, batch)?.0)
}

/// As [`forward_reference`], also returning per output the sum of the magnitudes of
/// every product that entered it (`sum |W||x_q| + |scale| sum |B| |A x|`), the natural
/// yardstick for rounding tolerances.
pub fn forward_reference_with_magnitude(
    base: &QuantizedWeight,
    lora: Option<&LoraAdapter>,
    activation_quant: ActivationQuant,
    x: &[f32],
    batch: usize,
) -> Result<(Vec<f32>, Vec<f64>)> {
    let (out_features, in_features) = base.shape();
    let mut y = vec![0f32; batch * out_features];
    let mut magnitude = vec![0f64; batch * out_features];
    let mut xq = vec![0f32; in_features];
    for t in 0..batch {
        let xt = &x[t * in_features..(t + 1) * in_features];
        xq.copy_from_slice(xt);
        activation_quant.apply("activation", &mut xq, in_features)?;
        // (A x)_j and sum_k |A_jk x_k| per rank component.
        let shrunk: Vec<(f64, f64)> = match lora {
            Some(l) => (0..l.rank)
                .map(|j| {
                    (0..in_features).fold((0.0, 0.0), |(s, m), k| {
                        let p = f64::from(l.a[j * in_features + k].to_f32()) * f64::from(xt[k]);
                        (s + p, m + p.abs())
                    })
                })
                .collect(),
            None => Vec::new(),
        };
        for o in 0..out_features {
            let mut acc = 0f64;
            let mut mag = 0f64;
            for (k, &xk) in xq.iter().enumerate() {
                let p = weight_element(base, o, k) * f64::from(xk);
                acc += p;
                mag += p.abs();
            }
            if let Some(l) = lora {
                let mut lora = 0f64;
                let mut lora_mag = 0f64;
                for (j, &(sj, abs_sj)) in shrunk.iter().enumerate() {
                    let bj = f64::from(l.b[o * l.rank + j].to_f32());
                    lora += bj * sj;
                    lora_mag += bj.abs() * abs_sj;
                }
                acc += f64::from(l.scale) * lora;
                mag += f64::from(l.scale).abs() * lora_mag;
            }
            y[t * out_features + o] = acc as f32;
            magnitude[t * out_features + o] = mag;
        }
    }
    Ok((y, magnitude))
}
