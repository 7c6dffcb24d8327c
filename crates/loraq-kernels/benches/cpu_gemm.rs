//! The CPU prefill GEMM against this machine's f32 FMA peak.
//!
//! - `fma_peak`: a loop of independent 512-bit (AVX-512; 256-bit on AVX2) FMAs, 12
//!   accumulators (more than latency x pipes on any x86 core), no memory operands: the
//!   most f32 FLOP/s one thread, and each of two threads at once, can issue.
//! - `gemm_demo`: the linears of a 512-token prefill of the demo model (hidden 512,
//!   intermediate 1536, 16 prompts of 512 tokens = 8192 rows) on a bf16 base without
//!   LoRA, through the public fused linear (`QuantLoraLinear::forward`): 512 -> 1024,
//!   512 -> 512, 512 -> 1536 and 1536 -> 512, one thread and two.
//!
//! Both report criterion throughput in elements = floating-point operations (2 per
//! multiply-add), so the `Gelem/s` criterion prints is GFLOP/s.
//!
//! `cargo bench -p loraq-kernels --bench cpu_gemm` (criterion, wall time), or
//! `cargo bench -p loraq-kernels --bench cpu_gemm -- --cpu-time [ROUNDS]`: one thread,
//! GFLOP per second of this process's user CPU time (getrusage), each shape timed
//! `ROUNDS` times (default 5) round-robin after the FMA loop, printing the median and
//! the best: on a machine shared with other work, user time is what a noisy wall clock
//! cannot give (a core taken away stops the clock of user time too). `LORAQ_BENCH_TOKENS`
//! overrides the 8192 rows.

use criterion::{BenchmarkId, Criterion, Throughput};
use half::bf16;
use loraq_kernels::{Bf16Weight, CpuOptions, Parallelism, QuantLoraLinear, QuantizedWeight};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::hint::black_box;
use std::time::Duration;

/// Independent accumulator chains of the FMA loop.
const CHAINS: usize = 12;
/// Loop trips of the FMA loop per call (each trip: `CHAINS` FMAs).
const FMA_TRIPS: usize = 20_000_000;

/// `FMA_TRIPS * CHAINS` FMAs on independent accumulators; returns their sum (so the
/// loop is not removed) and the FLOPs done.
fn fma_loop() -> (f32, u64) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F detected.
            let s = unsafe { fma_loop_avx512() };
            return (s, (FMA_TRIPS * CHAINS * 16 * 2) as u64);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA detected.
            let s = unsafe { fma_loop_avx2() };
            return (s, (FMA_TRIPS * CHAINS * 8 * 2) as u64);
        }
    }
    let mut acc = [0f32; CHAINS];
    for _ in 0..FMA_TRIPS {
        for (i, a) in acc.iter_mut().enumerate() {
            *a = a.mul_add(black_box(0.999_999), i as f32 * 1e-7);
        }
    }
    (acc.iter().sum(), (FMA_TRIPS * CHAINS * 2) as u64)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_loop_avx512() -> f32 {
    use std::arch::x86_64::*;
    let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut acc: [__m512; CHAINS] = std::array::from_fn(|i| _mm512_set1_ps(i as f32));
    for _ in 0..FMA_TRIPS {
        for a in &mut acc {
            *a = _mm512_fmadd_ps(*a, b, c);
        }
        // Keeps the loop from being folded, the chains in registers (an empty asm block
        // per register: no instruction, no memory round trip).
        for a in &mut acc {
            // SAFETY: an empty template; the register is only named.
            unsafe {
                std::arch::asm!(
                    "/* {0} */",
                    inout(zmm_reg) * a,
                    options(nomem, nostack, preserves_flags)
                )
            };
        }
    }
    acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_loop_avx2() -> f32 {
    use std::arch::x86_64::*;
    let (b, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut acc: [__m256; CHAINS] = std::array::from_fn(|i| _mm256_set1_ps(i as f32));
    for _ in 0..FMA_TRIPS {
        for a in &mut acc {
            *a = _mm256_fmadd_ps(*a, b, c);
        }
        for a in &mut acc {
            // SAFETY: as in fma_loop_avx512.
            unsafe {
                std::arch::asm!(
                    "/* {0} */",
                    inout(ymm_reg) * a,
                    options(nomem, nostack, preserves_flags)
                )
            };
        }
    }
    let mut out = [0f32; 8];
    let mut sum = 0.0;
    for a in acc {
        // SAFETY: 8 f32 stored into an 8-element array.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), a) };
        sum += out.iter().sum::<f32>();
    }
    sum
}

/// `(out_features, in_features)` of the demo model's prefill linears.
const DEMO_SHAPES: [(usize, usize); 4] = [(1024, 512), (512, 512), (1536, 512), (512, 1536)];

fn tokens() -> usize {
    std::env::var("LORAQ_BENCH_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16 * 512)
}

/// A bf16 linear with weights of the magnitude a trained 512-wide layer has.
fn bf16_linear(out_features: usize, in_features: usize) -> QuantLoraLinear {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let data = (0..out_features * in_features)
        .map(|_| bf16::from_f32(rng.random_range(-0.05..0.05)))
        .collect();
    let base = QuantizedWeight::Bf16(Bf16Weight::new(out_features, in_features, data));
    QuantLoraLinear::new(base, None).unwrap()
}

fn activations(len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn fma_peak(c: &mut Criterion) {
    let mut group = c.benchmark_group("fma_peak");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(4));
    let (_, flops) = fma_loop();
    for threads in [1usize, 2] {
        group.throughput(Throughput::Elements(flops * threads as u64));
        group.bench_function(BenchmarkId::new("threads", threads), |b| {
            b.iter(|| {
                std::thread::scope(|s| {
                    let handles: Vec<_> = (0..threads).map(|_| s.spawn(fma_loop)).collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().unwrap().0)
                        .sum::<f32>()
                })
            })
        });
    }
    group.finish();
}

fn gemm_demo(c: &mut Criterion) {
    let n = tokens();
    let x = activations(n * 1536);
    let mut group = c.benchmark_group(format!("gemm_demo_bf16_{n}_tokens"));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(6));
    for (out_features, in_features) in DEMO_SHAPES {
        let linear = bf16_linear(out_features, in_features);
        let mut y = vec![0f32; n * out_features];
        let flops = 2 * (n * out_features * in_features) as u64;
        group.throughput(Throughput::Elements(flops));
        for (label, parallelism, threads) in [
            ("1_thread", Parallelism::Sequential, 1),
            ("2_threads", Parallelism::Rayon, 2),
        ] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let opts = CpuOptions {
                isa: None,
                parallelism,
            };
            let id = BenchmarkId::new(label, format!("{in_features}->{out_features}"));
            group.bench_function(id, |b| {
                b.iter(|| {
                    pool.install(|| {
                        linear
                            .forward(black_box(&x[..n * in_features]), n, &mut y, opts)
                            .unwrap()
                    })
                })
            });
        }
    }
    group.finish();
}

/// User CPU seconds of this process so far.
fn user_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given; zeroed is a valid rusage.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_SELF, &mut usage), 0);
        usage
    };
    usage.ru_utime.tv_sec as f64 + usage.ru_utime.tv_usec as f64 * 1e-6
}

/// GFLOP per user CPU second of `f` (which does `flops`), at least 0.3 s of it.
fn cpu_rate(flops: u64, mut f: impl FnMut()) -> f64 {
    let start = user_seconds();
    let mut calls = 0u64;
    while calls == 0 || user_seconds() - start < 0.3 {
        f();
        calls += 1;
    }
    (flops * calls) as f64 / (user_seconds() - start) / 1e9
}

/// The `--cpu-time` mode: one thread, rounds of every case, median and best.
fn cpu_time(rounds: usize) {
    let n = tokens();
    let x = activations(n * 1536);
    let linears: Vec<_> = DEMO_SHAPES
        .iter()
        .map(|&(o, i)| (o, i, bf16_linear(o, i)))
        .collect();
    let opts = CpuOptions {
        isa: None,
        parallelism: Parallelism::Sequential,
    };
    let mut rates = vec![Vec::new(); 1 + linears.len()];
    for _ in 0..rounds {
        let (_, flops) = fma_loop();
        rates[0].push(cpu_rate(flops, || {
            black_box(fma_loop());
        }));
        for (i, (o, k, linear)) in linears.iter().enumerate() {
            let mut y = vec![0f32; n * o];
            let flops = 2 * (n * o * k) as u64;
            rates[i + 1].push(cpu_rate(flops, || {
                linear
                    .forward(black_box(&x[..n * k]), n, &mut y, opts)
                    .unwrap()
            }));
        }
    }
    let names = std::iter::once("fma_peak".to_string()).chain(
        linears
            .iter()
            .map(|(o, k, _)| format!("gemm bf16 {n} x {k} -> {o}")),
    );
    println!("one thread, GFLOP per user CPU second, {rounds} rounds: median (best)");
    for (name, mut r) in names.zip(rates) {
        r.sort_by(f64::total_cmp);
        println!("{name:<34} {:7.1} ({:.1})", r[r.len() / 2], r[r.len() - 1]);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--cpu-time") {
        let rounds = args.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or(5);
        cpu_time(rounds);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    fma_peak(&mut c);
    gemm_demo(&mut c);
    c.final_summary();
}
