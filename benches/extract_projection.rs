//! Extraction of one projection of the 27b-slice shape: the MLP up projection (17408 x
//! 5120) of a synthetic merge with a rank-256 LoRA (`loraq_synth::projection_pair`), from
//! the two bf16 weights' bytes to the bf16 LoRA factors: delta, its norm and rounding
//! floor in one pass ([`PairBytes::delta`]), randomized factorization with its
//! certificate, balanced split and bf16 cast. What `loraq extract` spends per projection,
//! less the reads.
//!
//! `cargo bench --bench extract_projection` (benches/README.md).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use faer::Par;
use loraq_extract::factoring::factor_projection_at_rank;
use loraq_extract::floor::{PairBytes, expected_floor_ratio};
use loraq_io::DType;
use loraq_io::convert::f32_to_bf16_bytes;

const NAME: &str = "model.language_model.layers.0.mlp.up_proj.weight";
const ROWS: usize = 17408;
const COLS: usize = 5120;
const RANK: usize = 256;

/// merged - base to the bf16 factors of rank `RANK`, as `loraq extract` does it once the
/// two tensors' bytes are read ([`factor_projection_at_rank`]); the delta's buffer is
/// handed from one iteration to the next, as `loraq extract` hands it from module to
/// module.
fn extract_projection(pair: &PairBytes, spare: &mut Vec<f32>) -> (f64, f64) {
    let (factors, cast, floor) =
        factor_projection_at_rank(NAME, pair, [ROWS, COLS], RANK, Par::rayon(0), spare)
            .expect("bf16 factors");
    black_box(&cast);
    (factors.truncation_residual(RANK), floor)
}

fn bench(c: &mut Criterion) {
    let pair = loraq_synth::projection_pair(NAME, ROWS, COLS, RANK, 1).expect("synthetic pair");
    let bytes = PairBytes::from_bytes(
        NAME,
        DType::BF16,
        f32_to_bf16_bytes(&pair.merged),
        f32_to_bf16_bytes(&pair.base),
        "merged".into(),
        "base".into(),
    )
    .expect("a pair of equal lengths");
    drop(pair);
    let mut spare = Vec::new();
    let (residual, floor) = extract_projection(&bytes, &mut spare);
    eprintln!(
        "{ROWS}x{COLS} rank {RANK}: residual / floor {:.5} (a perfect fit: {:.5})",
        residual / floor,
        expected_floor_ratio(ROWS, COLS, RANK)
    );
    let mut group = c.benchmark_group("extract_17408x5120_r256");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(40));
    // Bytes of the two bf16 weights an extraction reads.
    group.throughput(Throughput::Bytes((2 * ROWS * COLS * 2) as u64));
    group.bench_function("delta_factor_cast", |b| {
        b.iter(|| extract_projection(black_box(&bytes), &mut spare))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
