//! GPU benchmarks (feature `cuda`): fused vs unfused quantized-base + LoRA linears over
//! the Qwen3.8-27B layer shapes at rank 256, timed with CUDA events (device-synchronized).
//!
//! Environment:
//! - `LORAQ_GPU_TABLE=path`: also write a Markdown table (time, effective GB/s, share of
//!   the peak, fused vs unfused speedup) to `path`;
//! - `LORAQ_GPU_PEAK_GBPS`: peak memory bandwidth of the card (default 4800, H200);
//! - `LORAQ_GPU_TABLE_ONLY=1`: write the table and skip the criterion groups.
//!
//! Skips (prints why) without a CUDA driver or NVRTC.

use criterion::{BenchmarkId, Criterion, Throughput};
use half::bf16;
use loraq_kernels::cuda::{CudaBackend, GpuLinear, GpuMode, driver_available};
use loraq_kernels::{BaseWeight, Fp8Block128Weight, LoraAdapter, Nvfp4Weight, QuantLoraLinear};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt::Write as _;
use std::time::Duration;

/// (name, out, in) of the Qwen3.8-27B projections benchmarked.
const SHAPES: [(&str, usize, usize); 4] = [
    ("up/gate 5120->17408", 17408, 5120),
    ("down 17408->5120", 5120, 17408),
    ("5120->10240", 10240, 5120),
    ("5120->6144", 6144, 5120),
];
const BATCHES: [usize; 4] = [1, 4, 16, 128];
const RANK: usize = 256;

fn random_bytes(len: usize, seed: u64, map: impl Fn(u8) -> u8) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = vec![0u8; len];
    rng.fill(out.as_mut_slice());
    out.iter_mut().for_each(|b| *b = map(*b));
    out
}

fn lora(out_dim: usize, in_dim: usize) -> LoraAdapter {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let a = (0..RANK * in_dim)
        .map(|_| bf16::from_f32(rng.random_range(-0.02..0.02)))
        .collect();
    let b = (0..out_dim * RANK)
        .map(|_| bf16::from_f32(rng.random_range(-0.02..0.02)))
        .collect();
    LoraAdapter::new(RANK, in_dim, out_dim, a, b, 1.0).unwrap()
}

fn linear(format: &str, out_dim: usize, in_dim: usize) -> QuantLoraLinear {
    let base = match format {
        "fp8-block128" => {
            let codes = random_bytes(out_dim * in_dim, 1, |b| {
                if b & 0x7F == 0x7F { b ^ 1 } else { b }
            });
            let scales = vec![1e-3f32; out_dim.div_ceil(128) * in_dim.div_ceil(128)];
            BaseWeight::Fp8Block128(Fp8Block128Weight::new(out_dim, in_dim, codes, scales).unwrap())
        }
        _ => {
            let packed = random_bytes(out_dim * in_dim / 2, 2, |b| b);
            let scales = random_bytes(out_dim * in_dim / 16, 3, |b| 0x30 + (b & 0x0F));
            BaseWeight::Nvfp4(Nvfp4Weight::new(out_dim, in_dim, packed, scales, 1e-3).unwrap())
        }
    };
    QuantLoraLinear::new(base, Some(lora(out_dim, in_dim))).unwrap()
}

/// Median milliseconds of one forward over `iters` event-timed launches.
fn time_ms(
    backend: &CudaBackend,
    gpu: &mut GpuLinear,
    x: &cudarc::driver::CudaSlice<u16>,
    batch: usize,
    y: &mut cudarc::driver::CudaSlice<u16>,
    mode: GpuMode,
    iters: usize,
) -> f64 {
    let stream = backend.stream();
    let ctx = backend.context();
    for _ in 0..5 {
        gpu.forward(backend, x, batch, y, mode).unwrap();
    }
    let mut times = Vec::with_capacity(iters);
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = ctx.new_event(flags).unwrap();
    let end = ctx.new_event(flags).unwrap();
    for _ in 0..iters {
        start.record(stream).unwrap();
        gpu.forward(backend, x, batch, y, mode).unwrap();
        end.record(stream).unwrap();
        end.synchronize().unwrap();
        times.push(f64::from(start.elapsed_ms(&end).unwrap()));
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn write_table(backend: &CudaBackend, path: &str) {
    let peak: f64 = std::env::var("LORAQ_GPU_PEAK_GBPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4800.0);
    let mut md = String::new();
    writeln!(md, "Device: {} ({}), peak memory bandwidth taken as {peak} GB/s. Rank {RANK}, bf16 activations.", backend.device_name(), backend.arch()).unwrap();
    writeln!(md, "Effective GB/s = (base codes + scales + LoRA A + B bytes) / fused time; time = median of 50 CUDA-event-timed calls.\n").unwrap();
    writeln!(
        md,
        "| base | shape | batch | fused us | unfused us | fused GB/s | % of peak | fused speedup |"
    )
    .unwrap();
    writeln!(md, "|---|---|---:|---:|---:|---:|---:|---:|").unwrap();
    for format in ["fp8-block128", "nvfp4"] {
        for (name, out_dim, in_dim) in SHAPES {
            let l = linear(format, out_dim, in_dim);
            let mut gpu = backend.upload(&l).unwrap();
            for batch in BATCHES {
                let x = backend
                    .upload_activations(&vec![0.5f32; batch * in_dim])
                    .unwrap();
                let mut y = backend.alloc_output(batch * out_dim).unwrap();
                let fused = time_ms(backend, &mut gpu, &x, batch, &mut y, GpuMode::Fused, 50);
                let unfused = time_ms(backend, &mut gpu, &x, batch, &mut y, GpuMode::Unfused, 50);
                let gbps = gpu.weight_bytes() as f64 / (fused * 1e-3) / 1e9;
                writeln!(
                    md,
                    "| {format} | {name} | {batch} | {:.1} | {:.1} | {gbps:.0} | {:.0}% | {:.2}x |",
                    fused * 1e3,
                    unfused * 1e3,
                    100.0 * gbps / peak,
                    unfused / fused
                )
                .unwrap();
                eprintln!(
                    "{format} {name} batch {batch}: fused {:.1} us, unfused {:.1} us",
                    fused * 1e3,
                    unfused * 1e3
                );
            }
        }
    }
    std::fs::write(path, md).unwrap();
    eprintln!("wrote {path}");
}

fn criterion_groups(c: &mut Criterion, backend: &CudaBackend) {
    let mut group = c.benchmark_group("gpu_decode_r256");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    for format in ["fp8-block128", "nvfp4"] {
        let (out_dim, in_dim) = (17408, 5120);
        let l = linear(format, out_dim, in_dim);
        let mut gpu = backend.upload(&l).unwrap();
        group.throughput(Throughput::Bytes(gpu.weight_bytes() as u64));
        for batch in [1usize, 16] {
            let x = backend
                .upload_activations(&vec![0.5f32; batch * in_dim])
                .unwrap();
            let mut y = backend.alloc_output(batch * out_dim).unwrap();
            for mode in [GpuMode::Fused, GpuMode::Unfused] {
                let id = BenchmarkId::new(format!("{format}/{mode:?}"), batch);
                group.bench_function(id, |b| {
                    b.iter(|| {
                        gpu.forward(backend, &x, batch, &mut y, mode).unwrap();
                        backend.synchronize().unwrap();
                    })
                });
            }
        }
    }
    group.finish();
}

fn main() {
    if !driver_available() {
        eprintln!("gpu_linear: skipped: no CUDA driver or device");
        return;
    }
    let Some(backend) = CudaBackend::open_default(0).unwrap() else {
        eprintln!(
            "gpu_linear: skipped: no NVRTC and no cubins (set LORAQ_CUDA_WHEELS, CUDA_HOME or LORAQ_CUBIN_DIR)"
        );
        return;
    };
    if let Ok(path) = std::env::var("LORAQ_GPU_TABLE") {
        write_table(&backend, &path);
    }
    if std::env::var("LORAQ_GPU_TABLE_ONLY").is_ok_and(|v| v == "1") {
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    criterion_groups(&mut c, &backend);
    c.final_summary();
}
