//! Quantization of one projection of the 27b-slice shape (17408 x 5120, the base of a
//! synthetic pair) with every scheme `loraq quantize` writes: codes and scales from the
//! f32 weight, as `loraq quantize` computes them per tensor.
//!
//! `cargo bench --bench quantize_projection` (benches/README.md).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use loraq_quant::{Scheme, WeightView};

const NAME: &str = "model.language_model.layers.0.mlp.up_proj.weight";
const ROWS: usize = 17408;
const COLS: usize = 5120;

fn bench(c: &mut Criterion) {
    // Only the base is used: rank 1 keeps the pair's low-rank product cheap.
    let pair = loraq_synth::projection_pair(NAME, ROWS, COLS, 1, 1).expect("synthetic pair");
    let view = WeightView::new(NAME, ROWS, COLS, &pair.base).expect("weight view");
    let mut group = c.benchmark_group("quantize_17408x5120");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5));
    // Bytes of the bf16 weight a checkpoint stores.
    group.throughput(Throughput::Bytes((ROWS * COLS * 2) as u64));
    for scheme in Scheme::ALL {
        group.bench_function(BenchmarkId::from_parameter(scheme.name()), |b| {
            b.iter(|| black_box(scheme.quantize(black_box(view)).expect("quantize")))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
