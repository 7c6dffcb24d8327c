//! Share of the measured memory bandwidth the batch-1 fused decode reaches, measured
//! round-robin so that both sides of every ratio see the same machine load.
//!
//! The development machine's two cores are shared with other processes, so timings made
//! seconds apart (criterion's one-benchmark-after-another) drift by 2x. Here every round
//! measures the memory read (rayon + SIMD sum over 256 MiB, the best of two plain and two
//! software-prefetched passes) and, right after it, each format's fused decode and the
//! phased schedule (LoRA shrink as its own pass; the two alternate which goes first),
//! each the best of 3 calls, each call after reading a 64 MiB eviction buffer so no
//! weight is served from cache. Reported: medians
//! and quartiles over the rounds of GB/s and of the per-round ratio to the memory read,
//! and the median fused / phased time ratio. Bytes = what one call must read (base codes
//! + scales + LoRA A and B), as in `cpu_linear`.
//!
//! Formats: fp8-block128, NVFP4, INT4, MXFP4, bf16, and the GGUF types Q4_K, Q6_K,
//! Q5_K, Q8_0 and IQ4_XS (a GGUF base's linears).
//!
//! `cargo bench -p loraq-kernels --bench cpu_decode_ratio` (`LORAQ_BENCH_ROUNDS`, default 31;
//! `LORAQ_BENCH_ISA=avx2` or `scalar` times a narrower instruction set than the CPU's
//! widest, e.g. what a machine without AVX-512 runs). Instruction counts per weight
//! byte: `valgrind --tool=callgrind target/release/deps/cpu_decode_ratio-* --count NAME
//! CALLS` at `CALLS` 1 and 3 ([`count`]).

use half::bf16;
use loraq_kernels::{
    Bf16Weight, CpuOptions, Fp8Weight, Int4Weight, Isa, LoraAdapter, Mxfp4Weight, Nvfp4Weight,
    Parallelism, QuantLoraLinear, QuantizedWeight,
};
use loraq_quant::Nvfp4GlobalScale;
use loraq_quant::ggml::{self, GgmlType, GgmlWeight};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::hint::black_box;
use std::time::Instant;

const OUT: usize = 17408;
const IN: usize = 5120;
const RANK: usize = 256;

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

fn lora() -> LoraAdapter {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut factor = |n: usize| -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(rng.random_range(-0.02..0.02)))
            .collect()
    };
    let a = factor(RANK * IN);
    let b = factor(OUT * RANK);
    LoraAdapter::new(RANK, IN, OUT, a, b, 1.0).unwrap()
}

/// A 17408 x 5120 weight of Gaussian values quantized to fp8-block128 the way a
/// checkpoint is (`quantize_fp8`, scale = tile max / 448). Uniformly random code bytes
/// would make one code in 18 an E4M3 subnormal (exponent field 0), which the kernel's
/// exact bit-trick decode turns into an f32 subnormal, and on Intel cores an FMA with a
/// subnormal operand takes a microcode assist (about 25x slower): such a bench measures
/// the assists. A quantized Gaussian weight has about one subnormal code in 10^4, as a
/// real checkpoint has.
fn fp8_block128_of_gaussian_weight() -> Fp8Weight {
    let mut values = vec![0f32; OUT * IN];
    values
        .par_chunks_mut(1 << 20)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = ChaCha8Rng::seed_from_u64(1u64.wrapping_add(i as u64));
            for v in chunk.iter_mut() {
                // Box-Muller: one standard normal value per pair of uniforms.
                let u1: f32 = 1.0 - rng.random::<f32>();
                let u2: f32 = rng.random::<f32>();
                *v = 0.02 * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
            }
        });
    let view = loraq_quant::WeightView::new("bench.fp8", OUT, IN, &values).unwrap();
    loraq_quant::scheme::quantize_fp8(view, loraq_quant::Fp8Granularity::Block128).unwrap()
}

/// The GGUF (llama.cpp) types of a Q4_K_M / Q5_K_M / Q6_K / Q8_0 / IQ4_XS base, with
/// their bench names and random seeds.
const GGUF_TYPES: [(&str, u64, GgmlType); 5] = [
    ("gguf-q4_k", 10, GgmlType::Q4_K),
    ("gguf-q6_k", 11, GgmlType::Q6_K),
    ("gguf-q5_k", 14, GgmlType::Q5_K),
    ("gguf-q8_0", 12, GgmlType::Q8_0),
    ("gguf-iq4_xs", 13, GgmlType::IQ4_XS),
];

/// An `out_features x IN` weight of random `ggml_type` blocks whose f16 scales are set
/// to 2^-10 (1e-3 for the K mins).
fn ggml_base(name: &str, seed: u64, ggml_type: GgmlType, out_features: usize) -> GgmlWeight {
    let block = ggml_type.block();
    let mut data = random_bytes(
        out_features * IN / block.elements * block.bytes,
        seed,
        |b| b,
    );
    for chunk in data.chunks_exact_mut(block.bytes) {
        for (i, &offset) in ggml::f16_scale_offsets(ggml_type).iter().enumerate() {
            let scale = ggml::fp32_to_fp16(if i == 0 { 1.0 / 1024.0 } else { 1e-3 });
            chunk[offset..offset + 2].copy_from_slice(&scale.to_le_bytes());
        }
    }
    GgmlWeight::new(name, ggml_type, out_features, IN, data).unwrap()
}

/// An `out_features x IN` NVFP4 weight of random codes, E4M3 block scales 2^-9 .. 2^-8.
fn nvfp4_base(out_features: usize) -> Nvfp4Weight {
    Nvfp4Weight::new(
        out_features,
        IN,
        random_bytes(out_features * IN / 2, 2, |b| b),
        random_bytes(out_features * IN / 16, 3, |b| 0x30 + (b & 0x0F)),
        Nvfp4GlobalScale::Multiplier(1e-3),
    )
}

/// An `out_features x IN` INT4 group-128 weight of random codes and zero points.
fn int4_base(out_features: usize) -> Int4Weight {
    let groups = out_features * IN.div_ceil(128);
    Int4Weight::from_packed(
        out_features,
        IN,
        random_bytes(out_features * IN / 2, 4, |b| b),
        vec![2e-3; groups],
        random_bytes(groups, 5, |b| b & 0x0F),
    )
}

/// Rows of the `--count` runs' base.
const COUNT_OUT: usize = 512;

/// `--count NAME CALLS`: `CALLS` one-thread fused decodes (batch 1, no LoRA) of a
/// `COUNT_OUT x IN` base `NAME` (`nvfp4`, `int4-g128` or a `gguf-*` row), and nothing
/// else, for instruction counts under callgrind (which runs the AVX2 loops): the
/// difference of the counts at `CALLS` 3 and 1, halved, is one call's.
fn count(name: &str, calls: usize) {
    let base = match name {
        "nvfp4" => QuantizedWeight::Nvfp4(nvfp4_base(COUNT_OUT)),
        "int4-g128" => QuantizedWeight::Int4(int4_base(COUNT_OUT)),
        _ => {
            let &(name, seed, ggml_type) = GGUF_TYPES
                .iter()
                .find(|(n, _, _)| *n == name)
                .unwrap_or_else(|| panic!("--count {name}: not a bench row"));
            QuantizedWeight::Ggml(ggml_base(name, seed, ggml_type, COUNT_OUT))
        }
    };
    let linear = QuantLoraLinear::new(base, None).unwrap();
    let opts = CpuOptions {
        isa: std::env::var("LORAQ_BENCH_ISA")
            .ok()
            .and_then(|n| Isa::from_name(&n)),
        parallelism: Parallelism::Sequential,
    };
    let x: Vec<f32> = (0..IN).map(|k| ((k % 17) as f32 - 8.0) / 8.0).collect();
    let mut y = vec![0f32; COUNT_OUT];
    for _ in 0..calls {
        linear.forward(black_box(&x), 1, &mut y, opts).unwrap();
    }
    black_box(&y);
    println!(
        "{name}: {calls} calls, {} weight bytes each",
        linear.weight_bytes()
    );
}

fn linears() -> Vec<(&'static str, QuantLoraLinear)> {
    let fp8 = fp8_block128_of_gaussian_weight();
    let nvfp4 = nvfp4_base(OUT);
    let int4 = int4_base(OUT);
    // MXFP4: E8M0 scales 2^-10 .. 2^-5 (codes 117 ..= 122).
    let mxfp4 = Mxfp4Weight::new(
        OUT,
        IN,
        random_bytes(OUT * IN / 2, 6, |b| b),
        random_bytes(OUT * IN / 32, 7, |b| 117 + b % 6),
    );
    // The unquantized base for comparison: bf16 values of about +-0.03.
    let bf16_base = Bf16Weight::new(
        OUT,
        IN,
        random_bytes(OUT * IN, 8, |b| b)
            .into_iter()
            .map(|b| bf16::from_f32((f32::from(b) - 127.5) / 4096.0))
            .collect(),
    );
    let mut bases = vec![
        ("fp8-block128", QuantizedWeight::Fp8(fp8)),
        ("nvfp4", QuantizedWeight::Nvfp4(nvfp4)),
        ("int4-g128", QuantizedWeight::Int4(int4)),
        ("mxfp4", QuantizedWeight::Mxfp4(mxfp4)),
        ("bf16", QuantizedWeight::Bf16(bf16_base)),
    ];
    for (name, seed, ggml_type) in GGUF_TYPES {
        bases.push((
            name,
            QuantizedWeight::Ggml(ggml_base(name, seed, ggml_type, OUT)),
        ));
    }
    bases
        .into_iter()
        .map(|(name, base)| (name, QuantLoraLinear::new(base, Some(lora())).unwrap()))
        .collect()
}

/// GB/s of one rayon + SIMD pass summing `buffer`; with `PREFETCH`, each 64-byte block
/// also prefetches the line 4 KiB ahead into L2, as the decode loops do (the better of
/// the two is the reference, so the decode's software prefetch is not measured against
/// a read that lacks it).
fn memory_read_with<const PREFETCH: bool>(buffer: &[u64]) -> f64 {
    let start = Instant::now();
    let s: u64 = buffer
        .par_chunks(1 << 16)
        .map(|chunk| {
            // 8 independent lanes so the adds vectorize and never serialize.
            let mut lanes = [0u64; 8];
            for block in chunk.chunks_exact(8) {
                #[cfg(target_arch = "x86_64")]
                if PREFETCH {
                    // SAFETY: a prefetch never faults and reads nothing observable.
                    unsafe {
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                            block.as_ptr().cast::<i8>().wrapping_add(4096),
                        )
                    };
                }
                for (l, v) in lanes.iter_mut().zip(block) {
                    *l = l.wrapping_add(*v);
                }
            }
            lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b))
        })
        .reduce(|| 0, u64::wrapping_add);
    black_box(s);
    (buffer.len() * 8) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// The plain read (also the eviction pass before each timed call).
fn memory_read(buffer: &[u64]) -> f64 {
    memory_read_with::<false>(buffer)
}

/// This round's memory bandwidth: the best of two plain and two prefetched reads.
fn memory_bandwidth(buffer: &[u64]) -> f64 {
    [
        memory_read_with::<false>(buffer),
        memory_read_with::<true>(buffer),
        memory_read_with::<false>(buffer),
        memory_read_with::<true>(buffer),
    ]
    .into_iter()
    .fold(0.0, f64::max)
}

/// Best of 3 calls, seconds; before each, `evict` is read (untimed) so the call finds
/// none of its weights in the caches (the 32 MiB L3 would otherwise keep part of the
/// previous call's).
fn best_of_3(evict: &[u64], mut call: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            memory_read(evict);
            let start = Instant::now();
            call();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn quartiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.25), at(0.5), at(0.75))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this with no argument
    // and only needs it to build; `cargo bench ... -- --test` runs every format once.
    if std::env::args().any(|a| a == "--test") {
        let mut y = vec![0f32; OUT];
        let x = vec![0.5f32; IN];
        for (name, linear) in linears() {
            linear
                .forward(&x, 1, &mut y, CpuOptions::default())
                .unwrap();
            assert!(y.iter().all(|v| v.is_finite()), "{name}");
            println!("{name}: ok");
        }
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--count") {
        let calls = args.get(i + 2).and_then(|c| c.parse().ok()).unwrap_or(1);
        count(&args[i + 1], calls);
        return;
    }
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let rounds: usize = std::env::var("LORAQ_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(31);
    let buffer: Vec<u64> = (0..(256usize << 20) / 8)
        .into_par_iter()
        .map(|i| i as u64)
        .collect();
    let evict: Vec<u64> = (0..(64usize << 20) / 8)
        .into_par_iter()
        .map(|i| !i as u64)
        .collect();
    let linears = linears();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let x: Vec<f32> = (0..IN).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut y = vec![0f32; OUT];
    let isa = match std::env::var("LORAQ_BENCH_ISA") {
        Ok(name) => Isa::from_name(&name).unwrap_or_else(|| {
            panic!(
                "LORAQ_BENCH_ISA={name}: this CPU has {:?}",
                Isa::available()
            )
        }),
        Err(_) => Isa::detect(),
    };
    let opts = CpuOptions {
        isa: Some(isa),
        ..CpuOptions::default()
    };
    println!(
        "decode {OUT}x{IN} + r{RANK}, batch 1, {} rayon threads, {} loops, {rounds} rounds, load average at start {}",
        rayon::current_num_threads(),
        isa.name(),
        load_average()
    );
    let mut memory = Vec::new();
    // [format][fused, phased] -> (GB/s, share of the round's memory read)
    let mut runs = vec![[Vec::new(), Vec::new()]; linears.len()];
    let mut speedups = vec![Vec::new(); linears.len()];
    for round in 0..rounds {
        let mem = memory_bandwidth(&buffer);
        memory.push(mem);
        for (f, (_, linear)) in linears.iter().enumerate() {
            let gb = linear.weight_bytes() as f64 / 1e9;
            let mut seconds = [0f64; 2];
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for schedule in order {
                seconds[schedule] = best_of_3(&evict, || {
                    if schedule == 0 {
                        linear.forward(black_box(&x), 1, &mut y, opts).unwrap();
                    } else {
                        linear
                            .forward_lora_phased(black_box(&x), 1, &mut y, opts)
                            .unwrap();
                    }
                });
            }
            for (schedule, s) in seconds.iter().enumerate() {
                runs[f][schedule].push((gb / s, gb / s / mem));
            }
            speedups[f].push(seconds[1] / seconds[0]);
        }
    }
    let (lo, mid, hi) = quartiles(memory);
    println!("memory read: median {mid:.2} GB/s (quartiles {lo:.2} - {hi:.2})");
    println!("| base | schedule | GB/s (median) | share of memory read: median (quartiles) |");
    println!("|---|---|---:|---:|");
    for (f, (name, _)) in linears.iter().enumerate() {
        for (schedule, label) in ["fused", "lora_phased"].iter().enumerate() {
            let (_, gbs, _) = quartiles(runs[f][schedule].iter().map(|r| r.0).collect());
            let (lo, mid, hi) = quartiles(runs[f][schedule].iter().map(|r| r.1).collect());
            println!(
                "| {name} | {label} | {gbs:.2} | {:.0}% ({:.0}% - {:.0}%) |",
                100.0 * mid,
                100.0 * lo,
                100.0 * hi
            );
        }
    }
    for (f, (name, _)) in linears.iter().enumerate() {
        let (lo, mid, hi) = quartiles(speedups[f].clone());
        println!("{name}: phased time / fused time median {mid:.3} (quartiles {lo:.3} - {hi:.3})");
    }
    println!("load average at end {}", load_average());
}
