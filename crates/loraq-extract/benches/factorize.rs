//! Factorization of one 27b-slice projection delta (17408 x 5120, true rank 256 plus
//! bf16 merge rounding), by the randomized method and the exact one.
//!
//! The delta is also written to `$LORAQ_BENCH_DIR` (default: the system temp dir) as
//! `delta_17408x5120.f32` (raw little-endian f32, row-major) together with
//! `delta_17408x5120.json` (shape, floor, residuals), and the two bf16 weights it is the
//! difference of as `delta_17408x5120.merged.bf16` and `.base.bf16` (raw little-endian
//! bf16, for `factor_file --pair`'s whole run), so `scripts/bench_svd_reference.py`
//! times torch.svd_lowrank / torch.linalg.svd / f64 Gram eigh on the same matrix and
//! prints the ratios. Set `LORAQ_BENCH_ROWS` / `LORAQ_BENCH_COLS` for other shapes.

use criterion::{Criterion, criterion_group, criterion_main};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, Par};
use half::bf16;
use loraq_extract::factor::{FactorParams, Method, factorize};
use loraq_extract::floor::{FloorFormat, expected_floor_ratio, rounding_floor};
use loraq_io::convert::f32_to_bf16_bytes;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::time::Instant;

const RANK: usize = 256;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The bench's matrix and where it comes from.
struct Synthetic {
    /// merged - base, row-major f32.
    delta: Vec<f32>,
    /// The rounding floor of merged.
    floor: f64,
    /// merged and base as raw little-endian bf16 (what `loraq extract` reads).
    merged_bf16: Vec<u8>,
    base_bf16: Vec<u8>,
}

/// Base ~ N(0, 0.02) in bf16; a rank-256 change with singular values decaying 30x and
/// norm 10% of the base's; merged = bf16(base + change); delta = merged - base.
fn synthetic_delta(rows: usize, cols: usize) -> Synthetic {
    let mut rng = ChaCha8Rng::seed_from_u64(2026);
    let mut gauss = move || {
        let u1: f64 = rng.random::<f64>().max(1e-300);
        let u2: f64 = rng.random::<f64>();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    };
    let base: Vec<f32> = (0..rows * cols)
        .map(|_| bf16::from_f32(gauss() * 0.02).to_f32())
        .collect();
    let left = Mat::<f32>::from_fn(rows, RANK, |_, _| gauss());
    let decay: Vec<f32> = (0..RANK)
        .map(|i| 30f32.powf(-(i as f32) / (RANK - 1) as f32))
        .collect();
    let right = Mat::<f32>::from_fn(RANK, cols, |i, _| gauss() * decay[i]);
    let mut change = Mat::<f32>::zeros(rows, cols);
    matmul(
        change.as_mut(),
        Accum::Replace,
        left.as_ref(),
        right.as_ref(),
        1.0,
        Par::rayon(0),
    );
    let base_norm: f64 = base
        .par_iter()
        .map(|&x| (x as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let change_norm: f64 = change
        .col_iter()
        .map(|c| c.iter().map(|&x| (x as f64).powi(2)).sum::<f64>())
        .sum::<f64>()
        .sqrt();
    let scale = (0.1 * base_norm / change_norm) as f32;
    let mut merged = vec![0f32; rows * cols];
    merged
        .par_chunks_mut(cols)
        .enumerate()
        .for_each(|(i, row)| {
            for (j, m) in row.iter_mut().enumerate() {
                *m = bf16::from_f32(base[i * cols + j] + scale * change[(i, j)]).to_f32();
            }
        });
    let floor = rounding_floor(&merged, FloorFormat::Bf16);
    let delta: Vec<f32> = merged
        .par_iter()
        .zip(base.par_iter())
        .map(|(&m, &b)| m - b)
        .collect();
    Synthetic {
        delta,
        floor,
        merged_bf16: f32_to_bf16_bytes(&merged),
        base_bf16: f32_to_bf16_bytes(&base),
    }
}

fn bench(c: &mut Criterion) {
    let rows = env_usize("LORAQ_BENCH_ROWS", 17408);
    let cols = env_usize("LORAQ_BENCH_COLS", 5120);
    let Synthetic {
        delta,
        floor,
        merged_bf16,
        base_bf16,
    } = synthetic_delta(rows, cols);
    let params = |method| FactorParams {
        max_rank: RANK,
        method,
        floor: Some(floor),
        ..FactorParams::default()
    };

    // One timed run of each for the side-by-side figures, then the criterion loop.
    // Best of three, so a busy neighbour on a shared machine weighs less.
    let mut randomized_s = f64::INFINITY;
    let mut randomized = None;
    for _ in 0..3 {
        let t = Instant::now();
        let f = factorize("bench", &delta, rows, cols, &params(Method::Randomized)).unwrap();
        randomized_s = randomized_s.min(t.elapsed().as_secs_f64());
        randomized = Some(f);
    }
    let randomized = randomized.expect("three runs");
    let run_exact = std::env::var("LORAQ_BENCH_EXACT").is_ok_and(|v| v == "1");
    let exact = run_exact.then(|| {
        let t = Instant::now();
        let f = factorize("bench", &delta, rows, cols, &params(Method::Exact)).unwrap();
        (f, t.elapsed().as_secs_f64())
    });
    let expected = expected_floor_ratio(rows, cols, RANK);
    let residual = randomized.truncation_residual(RANK);
    eprintln!(
        "randomized: {randomized_s:.3} s, {:.2} passes, residual/floor {:.5} (expected {expected:.5}), converged {}",
        randomized.passes,
        residual / floor,
        randomized.converged
    );
    let mut summary = format!(
        "{{\"rows\": {rows}, \"cols\": {cols}, \"rank\": {RANK}, \"floor\": {floor:e}, \"delta_norm\": {:e}, \"randomized_seconds\": {randomized_s}, \"randomized_passes\": {}, \"randomized_residual\": {residual:e}",
        randomized.delta_norm(),
        randomized.passes
    );
    if let Some((f, secs)) = &exact {
        let exact_residual = f.truncation_residual(RANK);
        eprintln!(
            "exact (f64 Gram): {secs:.3} s, residual ratio randomized/exact {:.6}",
            residual / exact_residual
        );
        summary += &format!(", \"exact_seconds\": {secs}, \"exact_residual\": {exact_residual:e}");
    }
    summary += "}\n";
    let dir = std::env::var_os("LORAQ_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let stem = dir.join(format!("delta_{rows}x{cols}"));
    let bytes: Vec<u8> = delta.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(stem.with_extension("f32"), bytes).expect("write the bench delta");
    std::fs::write(stem.with_extension("merged.bf16"), merged_bf16).expect("write merged");
    std::fs::write(stem.with_extension("base.bf16"), base_bf16).expect("write base");
    std::fs::write(stem.with_extension("json"), summary).expect("write the bench summary");
    eprintln!(
        "wrote {}.f32 / .merged.bf16 / .base.bf16 / .json",
        stem.display()
    );

    let mut group = c.benchmark_group("factorize_17408x5120_r256");
    group.sample_size(10);
    group.bench_function("randomized", |b| {
        b.iter(|| factorize("bench", &delta, rows, cols, &params(Method::Randomized)).unwrap())
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
