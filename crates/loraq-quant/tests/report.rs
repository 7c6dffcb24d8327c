//! The quant-error figures against a direct f64 computation of their definitions.

use loraq_quant::report::{LoraUpdate, merged_quant_error, weight_quant_error};
use loraq_quant::{Scheme, WeightView};

fn bf16(x: f32) -> f32 {
    // Round to nearest even, as a merged checkpoint stores it.
    let bits = x.to_bits();
    f32::from_bits((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000)
}

#[test]
fn weight_and_merged_errors_match_their_definitions() {
    let (rows, cols, rank) = (24usize, 160usize, 3usize);
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| bf16((i as f32 * 0.37).sin() * 0.1))
        .collect();
    let b: Vec<f32> = (0..rows * rank)
        .map(|i| (i as f32 * 0.71).cos() * 0.05)
        .collect();
    let a: Vec<f32> = (0..rank * cols)
        .map(|i| (i as f32 * 0.13).sin() * 0.05)
        .collect();
    let scale = 2.0f32;
    let mut delta = vec![0.0f64; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            for k in 0..rank {
                delta[r * cols + c] +=
                    f64::from(scale) * f64::from(b[r * rank + k]) * f64::from(a[k * cols + c]);
            }
        }
    }
    let merged: Vec<f32> = w
        .iter()
        .zip(&delta)
        .map(|(&w, &d)| bf16((f64::from(w) + d) as f32))
        .collect();

    let view = WeightView::new("m.weight", rows, cols, &w).unwrap();
    let (quantized, weight) = weight_quant_error(Scheme::Nvfp4, view).unwrap();
    assert_eq!(quantized, Scheme::Nvfp4.fake_quant(view).unwrap());
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let w_norm = norm(&mut w.iter().map(|&x| f64::from(x)));
    let q_err = norm(
        &mut w
            .iter()
            .zip(&quantized)
            .map(|(&w, &q)| f64::from(q) - f64::from(w)),
    );
    assert!((weight.weight_norm - w_norm).abs() <= 1e-12 * w_norm);
    assert!((weight.error_norm - q_err).abs() <= 1e-12 * w_norm);
    assert!(
        weight.relative() > 0.01 && weight.relative() < 0.2,
        "{}",
        weight.relative()
    );

    let update = LoraUpdate {
        b: &b,
        a: &a,
        rank,
        scale,
    };
    let m = merged_quant_error(view, &quantized, update, &merged).unwrap();
    let m_norm = norm(&mut merged.iter().map(|&x| f64::from(x)));
    let exact =
        norm(&mut (0..rows * cols).map(|i| f64::from(w[i]) + delta[i] - f64::from(merged[i])));
    let quant = norm(
        &mut (0..rows * cols).map(|i| f64::from(quantized[i]) + delta[i] - f64::from(merged[i])),
    );
    let floor = (merged
        .iter()
        .map(|&x| {
            let ulp = 2f64.powi(((x.to_bits() >> 23) & 0xFF) as i32 - 127 - 7);
            ulp * ulp / 12.0
        })
        .sum::<f64>())
    .sqrt();
    // The update is accumulated in f32, so allow f32-level differences.
    assert!((m.merged_norm - m_norm).abs() <= 1e-9 * m_norm);
    assert!(
        (m.exact_error_norm - exact).abs() <= 1e-5 * m_norm,
        "{} vs {exact}",
        m.exact_error_norm
    );
    assert!((m.quantized_error_norm - quant).abs() <= 1e-5 * m_norm);
    assert!((m.floor - floor).abs() <= 1e-12 * floor);
    // The adapter on the exact base is at the bf16 floor; on NVFP4 far above it.
    assert!(
        m.exact_error_norm < 2.0 * m.floor,
        "{} vs floor {}",
        m.exact_error_norm,
        m.floor
    );
    assert!(m.quantized_error_norm > 10.0 * m.floor);
}

#[test]
fn mismatched_factor_shapes_are_refused() {
    let w = vec![0.5f32; 4 * 16];
    let view = WeightView::new("m.weight", 4, 16, &w).unwrap();
    let update = LoraUpdate {
        b: &[0.0; 4],
        a: &[0.0; 15],
        rank: 1,
        scale: 1.0,
    };
    assert!(merged_quant_error(view, &w, update, &w).is_err());
}
