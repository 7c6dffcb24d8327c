//! Run the fused "quantized base + LoRA" linear of `loraq-kernels` on a base quantized
//! by `loraq-quant`, and check it against the f64 reference and the merged weight.
//!
//! ```sh
//! cargo run --release --example fused_linear
//! ```
//!
//! `y = dequant(W_q) x + B (A x)` for one token (decode) and for 16 (prefill), on a
//! synthetic 1536 x 512 projection (a Qwen3.5 MLP up projection of the demo model's
//! shape) with its rank-32 LoRA, for every base format the CPU kernels take.

use half::bf16;
use loraq_kernels::{CpuOptions, LoraAdapter, QuantLoraLinear};
use loraq_quant::{Scheme, WeightView};

fn main() -> anyhow::Result<()> {
    let name = "model.language_model.layers.0.mlp.up_proj.weight";
    let (out_features, in_features, rank) = (1536, 512, 32);
    let pair = loraq_synth::projection_pair(name, out_features, in_features, rank, 1)?;
    let to_bf16 = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();

    for scheme in [
        Scheme::Fp8Block128,
        Scheme::Nvfp4,
        Scheme::Mxfp4,
        Scheme::Int4G128Asym,
    ] {
        // The base in its stored format (codes and scales), never dequantized as a whole.
        let base = scheme.quantize(WeightView::new(
            name,
            out_features,
            in_features,
            &pair.base,
        )?)?;
        // The adapter's factors in bf16, as PEFT stores them; scale alpha / r = 1.
        let lora = LoraAdapter::new(
            rank,
            in_features,
            out_features,
            to_bf16(&pair.lora_a),
            to_bf16(&pair.lora_b),
            1.0,
        )?;
        let linear = QuantLoraLinear::new(base, Some(lora))?;

        for batch in [1, 16] {
            let x: Vec<f32> = (0..batch * in_features)
                .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let mut y = vec![0f32; batch * out_features];
            linear.forward(&x, batch, &mut y, CpuOptions::default())?;
            let reference = linear.forward_reference(&x, batch)?;
            // What the merged model computes, for scale: the quantized base's error.
            let merged: Vec<f32> = (0..batch * out_features)
                .map(|i| {
                    let (t, o) = (i / out_features, i % out_features);
                    let row = &pair.merged[o * in_features..(o + 1) * in_features];
                    row.iter()
                        .zip(&x[t * in_features..])
                        .map(|(w, v)| w * v)
                        .sum()
                })
                .collect();
            println!(
                "{:<16} batch {batch:>2}: fast vs f64 reference {:.1e}, vs the merged weight {:.1e} (relative L2)",
                scheme.name(),
                relative_l2(&y, &reference),
                relative_l2(&y, &merged)
            );
        }
    }
    Ok(())
}

/// `||a - b|| / ||b||`.
fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        diff += (f64::from(x) - f64::from(y)).powi(2);
        norm += f64::from(y).powi(2);
    }
    (diff / norm).sqrt()
}
