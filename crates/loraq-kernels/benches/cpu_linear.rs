//! CPU benchmarks of the fused quantized-base + LoRA linear.
//!
//! - `memory_read`: this machine's streaming read bandwidth (rayon + SIMD sum over
//!   256 MiB), the physical limit the decode path is compared against.
//! - `decode`: batch 1 at 17408x5120 (Qwen3.8-27B up/gate shape) + rank 256, fp8-block128,
//!   nvfp4 and int4-g128 bases: the fused path, dequantize-then-multiply (dequantizing every call),
//!   and multiplying by a pre-dequantized f32 weight. Throughput = weight bytes the fused
//!   path reads (codes + scales + both LoRA factors), so the figures are effective GB/s.
//! - `decode` also runs `lora_phased`: the same kernels with the LoRA shrink as its own
//!   parallel pass before the base pass (the schedule before fusion).
//! - `decode_l2_resident`: one thread over a 256x2048 weight that stays in L2: the decode
//!   loop's instruction throughput, the ceiling a core reaches when DRAM is not the limit;
//!   once per SIMD instruction set this CPU has (AVX-512, AVX2).
//! - `prefill`: 128 tokens at 6144x5120 + rank 256: throughput in elements = multiply-adds,
//!   so GFLOP/s = 2 x the reported Gelem/s.
//!
//! `cargo bench -p loraq-kernels --bench cpu_linear` (`LORAQ_BENCH_ISA=avx2` runs the
//! prefill on AVX2 on a machine that has AVX-512)

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use loraq_kernels::{
    CpuOptions, Fp8Weight, Int4Weight, Isa, LoraAdapter, Nvfp4Weight, Parallelism, QuantLoraLinear,
    QuantizedWeight,
};
use loraq_quant::Nvfp4GlobalScale;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::hint::black_box;
use std::time::Duration;

fn random_bytes(len: usize, seed: u64, map: impl Fn(u8) -> u8 + Sync) -> Vec<u8> {
    let mut out = vec![0u8; len];
    out.par_chunks_mut(1 << 20)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(i as u64));
            rng.fill(chunk);
            chunk.iter_mut().for_each(|b| *b = map(*b));
        });
    out
}

fn no_nan_e4m3(b: u8) -> u8 {
    if b & 0x7F == 0x7F { b ^ 1 } else { b }
}

fn lora(out_features: usize, in_features: usize, rank: usize) -> Option<LoraAdapter> {
    if rank == 0 {
        return None;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let a = (0..rank * in_features)
        .map(|_| bf16::from_f32(rng.random_range(-0.02..0.02)))
        .collect();
    let b = (0..out_features * rank)
        .map(|_| bf16::from_f32(rng.random_range(-0.02..0.02)))
        .collect();
    Some(LoraAdapter::new(rank, in_features, out_features, a, b, 1.0).unwrap())
}

fn fp8_linear(out_features: usize, in_features: usize, rank: usize) -> QuantLoraLinear {
    let codes = random_bytes(out_features * in_features, 1, no_nan_e4m3);
    let scales = vec![1e-3f32; out_features.div_ceil(128) * in_features.div_ceil(128)];
    let base = QuantizedWeight::Fp8(Fp8Weight::block128(
        out_features,
        in_features,
        codes,
        scales,
    ));
    QuantLoraLinear::new(base, lora(out_features, in_features, rank)).unwrap()
}

fn nvfp4_linear(out_features: usize, in_features: usize, rank: usize) -> QuantLoraLinear {
    let packed = random_bytes(out_features * in_features / 2, 2, |b| b);
    let scales = random_bytes(out_features * in_features / 16, 3, |b| 0x30 + (b & 0x0F));
    let base = QuantizedWeight::Nvfp4(Nvfp4Weight::new(
        out_features,
        in_features,
        packed,
        scales,
        Nvfp4GlobalScale::Multiplier(1e-3),
    ));
    QuantLoraLinear::new(base, lora(out_features, in_features, rank)).unwrap()
}

fn int4_linear(out_features: usize, in_features: usize, rank: usize) -> QuantLoraLinear {
    let packed = random_bytes(out_features * in_features / 2, 4, |b| b);
    let groups = out_features * in_features.div_ceil(128);
    let scales = vec![2e-3f32; groups];
    let zeros = random_bytes(groups, 5, |b| b & 0x0F);
    let base = QuantizedWeight::Int4(Int4Weight::from_packed(
        out_features,
        in_features,
        packed,
        scales,
        zeros,
    ));
    QuantLoraLinear::new(base, lora(out_features, in_features, rank)).unwrap()
}

fn activations(len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn memory_read(c: &mut Criterion) {
    const BYTES: usize = 256 << 20;
    let buffer: Vec<u64> = (0..BYTES / 8).into_par_iter().map(|i| i as u64).collect();
    let mut group = c.benchmark_group("memory_read");
    group.throughput(Throughput::Bytes(BYTES as u64));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(4));
    group.bench_function("rayon_sum_256MiB", |b| {
        b.iter(|| {
            // 8 independent lanes per chunk so the adds vectorize and never serialize.
            let s: u64 = buffer
                .par_chunks(1 << 16)
                .map(|chunk| {
                    let mut lanes = [0u64; 8];
                    for block in chunk.chunks_exact(8) {
                        for (l, v) in lanes.iter_mut().zip(block) {
                            *l = l.wrapping_add(*v);
                        }
                    }
                    lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                })
                .reduce(|| 0, u64::wrapping_add);
            black_box(s)
        })
    });
    group.finish();
}

fn decode(c: &mut Criterion) {
    let (out_features, in_features, rank) = (17408, 5120, 256);
    let opts = CpuOptions::default();
    let x = activations(in_features);
    let mut group = c.benchmark_group("decode_17408x5120_r256_b1");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5));
    for (name, linear) in [
        ("fp8-block128", fp8_linear(out_features, in_features, rank)),
        ("nvfp4", nvfp4_linear(out_features, in_features, rank)),
        ("int4-g128", int4_linear(out_features, in_features, rank)),
    ] {
        group.throughput(Throughput::Bytes(linear.weight_bytes() as u64));
        let mut y = vec![0f32; out_features];
        group.bench_function(BenchmarkId::new("fused", name), |b| {
            b.iter(|| linear.forward(black_box(&x), 1, &mut y, opts).unwrap())
        });
        group.bench_function(BenchmarkId::new("lora_phased", name), |b| {
            b.iter(|| {
                linear
                    .forward_lora_phased(black_box(&x), 1, &mut y, opts)
                    .unwrap()
            })
        });
        group.bench_function(BenchmarkId::new("dequantize_then_multiply", name), |b| {
            b.iter(|| {
                let dense = linear.dequantize_base(opts);
                linear
                    .forward_dense_baseline(&dense, black_box(&x), 1, &mut y, opts)
                    .unwrap()
            })
        });
        let dense = linear.dequantize_base(opts);
        group.bench_function(BenchmarkId::new("predequantized_f32_multiply", name), |b| {
            b.iter(|| {
                linear
                    .forward_dense_baseline(&dense, black_box(&x), 1, &mut y, opts)
                    .unwrap()
            })
        });
    }
    group.finish();
}

fn decode_compute(c: &mut Criterion) {
    // 256 KiB - 512 KiB of codes: L2-resident, so the time is the decode loop's
    // instructions, not DRAM; one thread, no LoRA.
    let (out_features, in_features) = (256, 2048);
    let x = activations(in_features);
    let mut group = c.benchmark_group("decode_l2_resident_256x2048_b1_1thread");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(2));
    for isa in Isa::available()
        .into_iter()
        .filter(|&isa| isa != Isa::Scalar)
    {
        let opts = CpuOptions {
            isa: Some(isa),
            parallelism: Parallelism::Sequential,
        };
        for (name, linear) in [
            ("fp8-block128", fp8_linear(out_features, in_features, 0)),
            ("nvfp4", nvfp4_linear(out_features, in_features, 0)),
            ("int4-g128", int4_linear(out_features, in_features, 0)),
        ] {
            group.throughput(Throughput::Bytes(linear.weight_bytes() as u64));
            let mut y = vec![0f32; out_features];
            let id = BenchmarkId::new(format!("fused/{}", isa.name()), name);
            group.bench_function(id, |b| {
                b.iter(|| linear.forward(black_box(&x), 1, &mut y, opts).unwrap())
            });
        }
    }
    group.finish();
}

fn prefill(c: &mut Criterion) {
    let (out_features, in_features, rank, batch) = (6144, 5120, 256, 128);
    // `LORAQ_BENCH_ISA=avx2` times the AVX2 kernels on an AVX-512 machine.
    let isa = std::env::var("LORAQ_BENCH_ISA").ok().map(|name| {
        Isa::from_name(&name).unwrap_or_else(|| {
            panic!(
                "LORAQ_BENCH_ISA={name}: this CPU has {:?}",
                Isa::available()
            )
        })
    });
    let opts = CpuOptions {
        isa,
        ..CpuOptions::default()
    };
    let x = activations(batch * in_features);
    let mut group = c.benchmark_group("prefill_6144x5120_r256_b128");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(8));
    for (name, linear) in [
        ("fp8-block128", fp8_linear(out_features, in_features, rank)),
        ("nvfp4", nvfp4_linear(out_features, in_features, rank)),
    ] {
        group.throughput(Throughput::Elements(
            (linear.macs_per_token() * batch) as u64,
        ));
        let mut y = vec![0f32; batch * out_features];
        group.bench_function(BenchmarkId::new("fused", name), |b| {
            b.iter(|| linear.forward(black_box(&x), batch, &mut y, opts).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, memory_read, decode, decode_compute, prefill);
criterion_main!(benches);
