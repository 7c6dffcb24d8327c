//! Quantize a base weight with every scheme of `loraq-quant` and measure what it costs a
//! module: the weight's own error, and the error of base + adapter against the merge.
//!
//! ```sh
//! cargo run --release --example quantize_and_measure
//! ```
//!
//! The module is one synthetic projection (`loraq_synth::projection_pair`: a Qwen3.5
//! MLP down projection of the demo model's shape, 512 x 1536, with a rank-32 LoRA merged
//! in bf16). What `loraq quant-error` reports for every module of a checkpoint, here for
//! one, in memory.

use loraq_quant::report::{LoraUpdate, merged_quant_error, weight_quant_error};
use loraq_quant::{Scheme, WeightView};

fn main() -> anyhow::Result<()> {
    let name = "model.language_model.layers.0.mlp.down_proj.weight";
    let (rows, cols, rank) = (512, 1536, 32);
    let pair = loraq_synth::projection_pair(name, rows, cols, rank, 1)?;
    let base = WeightView::new(name, rows, cols, &pair.base)?;
    let update = LoraUpdate {
        b: &pair.lora_b,
        a: &pair.lora_a,
        rank,
        scale: 1.0,
    };

    println!("{name} [{rows} x {cols}], LoRA rank {rank}; errors relative to the norm:");
    println!(
        "{:<16} {:>12} {:>18} {:>12}",
        "scheme", "||W - Q(W)||", "||M - (Q(W) + BA)||", "bf16 floor"
    );
    for scheme in Scheme::ALL {
        // The fake-quantized weight (quantize, then dequantize to f32) and its error.
        let (quantized, weight_error) = weight_quant_error(scheme, base)?;
        // The adapter on that base against the merged weight.
        let merged_error = merged_quant_error(base, &quantized, update, &pair.merged)?;
        let (_, on_quantized, floor) = merged_error.relative();
        println!(
            "{:<16} {:>12.3e} {:>18.3e} {:>12.3e}",
            scheme.name(),
            weight_error.relative(),
            on_quantized,
            floor
        );
    }
    Ok(())
}
