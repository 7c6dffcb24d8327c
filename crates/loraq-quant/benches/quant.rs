//! Fake-quant throughput on a 17408x5120 matrix (the Qwen3.5-27B MLP up/gate shape),
//! in bytes of bf16 input per second: fp8-block128 and nvfp4 (the two published
//! base formats), plus quantize-only and dequantize-only for both. The input is a
//! deterministic bf16-representable Gaussian-like matrix, widened to f32 once.
//!
//! Run: `cargo bench -p loraq-quant --bench quant` (set `RAYON_NUM_THREADS=1` for the
//! per-core figure). `scripts/quant_bench_numpy.py` times the numpy oracle of the same
//! formulas on the same shape for the ratio.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use loraq_quant::{Scheme, WeightView};
use std::hint::black_box;

const ROWS: usize = 17408;
const COLS: usize = 5120;

/// bf16-representable values from a 64-bit LCG: a sum of uniforms (roughly normal)
/// times 0.02, with a rare outlier, like trained weights.
fn weights() -> Vec<f32> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32) / (1u64 << 24) as f32
    };
    (0..ROWS * COLS)
        .map(|i| {
            let normal = next() + next() + next() - 1.5;
            let value = if i % 100_003 == 0 {
                normal * 2.0
            } else {
                normal * 0.02
            };
            f32::from_bits(value.to_bits() & 0xFFFF_0000)
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let data = weights();
    let view = WeightView::new("bench", ROWS, COLS, &data).unwrap();
    let mut group = c.benchmark_group("quant_17408x5120");
    group.sample_size(10);
    group.throughput(Throughput::Bytes((ROWS * COLS * 2) as u64));
    for scheme in [Scheme::Fp8Block128, Scheme::Nvfp4] {
        let mut out = vec![0.0f32; ROWS * COLS];
        group.bench_function(format!("fake_quant_into/{scheme}"), |b| {
            b.iter(|| {
                scheme
                    .fake_quant_into(black_box(view), black_box(&mut out))
                    .unwrap()
            })
        });
        group.bench_function(format!("fake_quant/{scheme}"), |b| {
            b.iter(|| black_box(scheme.fake_quant(black_box(view)).unwrap()))
        });
        group.bench_function(format!("quantize/{scheme}"), |b| {
            b.iter(|| black_box(scheme.quantize(black_box(view)).unwrap()))
        });
        let quantized = scheme.quantize(view).unwrap();
        group.bench_function(format!("dequantize/{scheme}"), |b| {
            b.iter(|| black_box(quantized.dequantize()))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
