//! Reference implementation: every weight element decoded on its own by
//! `loraq_quant::element` (table lookups, independent of the fast path's bit tricks),
//! every sum accumulated in f64. Slow by design; the oracle for the fast CPU path and
//! the GPU kernels.

use crate::error::Result;
use crate::linear::QuantLoraLinear;
use crate::weight::{BaseWeight, FP8_BLOCK, INT4_GROUP, MXFP4_BLOCK, NVFP4_BLOCK};
use loraq_quant::element::{e2m1_decode, e4m3_decode, e8m0_decode};

fn nibble(packed: &[u8], row_bytes: usize, row: usize, k: usize) -> u8 {
    let byte = packed[row * row_bytes + k / 2];
    if k.is_multiple_of(2) {
        byte & 0x0F
    } else {
        byte >> 4
    }
}

/// Dequantized weight element `W[row, k]` in f64.
pub fn weight_element(base: &BaseWeight, row: usize, k: usize) -> f64 {
    match base {
        BaseWeight::Bf16(w) => f64::from(w.data[row * w.in_dim + k].to_f32()),
        BaseWeight::Fp8Block128(w) => {
            let q = f64::from(e4m3_decode(w.codes[row * w.in_dim + k]));
            let s = w.scales[(row / FP8_BLOCK) * w.scale_cols() + k / FP8_BLOCK];
            q * f64::from(s)
        }
        BaseWeight::Nvfp4(w) => {
            let q = f64::from(e2m1_decode(nibble(&w.packed, w.in_dim / 2, row, k)));
            let code = w.block_scales[row * (w.in_dim / NVFP4_BLOCK) + k / NVFP4_BLOCK];
            q * f64::from(e4m3_decode(code)) * f64::from(w.global_scale)
        }
        BaseWeight::Mxfp4(w) => {
            let q = f64::from(e2m1_decode(nibble(&w.packed, w.in_dim / 2, row, k)));
            let e = w.block_scales[row * (w.in_dim / MXFP4_BLOCK) + k / MXFP4_BLOCK];
            q * f64::from(e8m0_decode(e))
        }
        BaseWeight::Int4G128(w) => {
            let q = f64::from(nibble(&w.packed, w.in_dim.div_ceil(2), row, k));
            let g = row * w.groups() + k / INT4_GROUP;
            (q - f64::from(w.zeros[g])) * f64::from(w.scales[g])
        }
    }
}

/// `y = W x_q + scale * B (A x)` for `batch` tokens, f64 accumulation, rounded to f32
/// at the end. `x` is `[batch, in_dim]`, the result `[batch, out_dim]`.
pub fn forward_reference(linear: &QuantLoraLinear, x: &[f32], batch: usize) -> Result<Vec<f32>> {
    Ok(forward_reference_with_magnitude(linear, x, batch)?.0)
}

/// As [`forward_reference`], also returning per output the sum of the magnitudes of
/// every product that entered it (`sum |W||x_q| + |scale| sum |B| |A x|`), the natural
/// yardstick for rounding tolerances.
pub fn forward_reference_with_magnitude(
    linear: &QuantLoraLinear,
    x: &[f32],
    batch: usize,
) -> Result<(Vec<f32>, Vec<f64>)> {
    let base = linear.base();
    let (out_dim, in_dim) = (base.out_dim(), base.in_dim());
    let mut y = vec![0f32; batch * out_dim];
    let mut magnitude = vec![0f64; batch * out_dim];
    let mut xq = vec![0f32; in_dim];
    for t in 0..batch {
        let xt = &x[t * in_dim..(t + 1) * in_dim];
        xq.copy_from_slice(xt);
        linear.activation_quant().apply(&mut xq, in_dim)?;
        // (A x)_j and sum_k |A_jk x_k| per rank component.
        let shrunk: Vec<(f64, f64)> = match linear.lora() {
            Some(l) => (0..l.rank)
                .map(|j| {
                    (0..in_dim).fold((0.0, 0.0), |(s, m), k| {
                        let p = f64::from(l.a[j * in_dim + k].to_f32()) * f64::from(xt[k]);
                        (s + p, m + p.abs())
                    })
                })
                .collect(),
            None => Vec::new(),
        };
        for o in 0..out_dim {
            let mut acc = 0f64;
            let mut mag = 0f64;
            for (k, &xk) in xq.iter().enumerate() {
                let p = weight_element(base, o, k) * f64::from(xk);
                acc += p;
                mag += p.abs();
            }
            if let Some(l) = linear.lora() {
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
            y[t * out_dim + o] = acc as f32;
            magnitude[t * out_dim + o] = mag;
        }
    }
    Ok((y, magnitude))
}
