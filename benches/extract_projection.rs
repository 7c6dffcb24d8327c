//! Extraction of one projection of the 27b-slice shape: the MLP up projection (17408 x
//! 5120) of a synthetic merge with a rank-256 LoRA (`loraq_synth::projection_pair`), from
//! the two bf16 weights to the bf16 LoRA factors: delta, rounding floor, randomized
//! factorization with its certificate, balanced split and bf16 cast. What `loraq
//! extract` spends per projection, less the reads.
//!
//! `cargo bench --bench extract_projection` (benches/README.md).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use faer::Par;
use loraq_extract::factor::{FactorParams, Method, factorize};
use loraq_extract::floor::{FloorFormat, expected_floor_ratio, rounding_floor};
use loraq_extract::split::{Split, split_and_cast};
use rayon::prelude::*;

const NAME: &str = "model.language_model.layers.0.mlp.up_proj.weight";
const ROWS: usize = 17408;
const COLS: usize = 5120;
const RANK: usize = 256;

/// merged - base to the bf16 factors of rank `RANK`.
fn extract_projection(base: &[f32], merged: &[f32]) -> (f64, f64) {
    let delta: Vec<f32> = merged.par_iter().zip(base).map(|(m, b)| m - b).collect();
    let floor = rounding_floor(merged, FloorFormat::Bf16);
    let params = FactorParams {
        max_rank: RANK,
        method: Method::Randomized,
        floor: Some(floor),
        ..FactorParams::default()
    };
    let factors = factorize(NAME, &delta, ROWS, COLS, &params).expect("factorize");
    let cast =
        split_and_cast(NAME, &factors, RANK, Split::Balanced, Par::rayon(0)).expect("bf16 factors");
    black_box(&cast);
    (factors.truncation_residual(RANK), floor)
}

fn bench(c: &mut Criterion) {
    let pair = loraq_synth::projection_pair(NAME, ROWS, COLS, RANK, 1).expect("synthetic pair");
    let (residual, floor) = extract_projection(&pair.base, &pair.merged);
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
        b.iter(|| extract_projection(black_box(&pair.base), black_box(&pair.merged)))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
