//! GPU benchmarks (feature `cuda`): fused vs unfused quantized-base + LoRA linears over
//! the Qwen3.8-27B layer shapes at rank 256, timed with CUDA events (device-synchronized).
//!
//! Environment:
//! - `LORAQ_GPU_TABLE=path`: also write a Markdown table (time, effective GB/s, share of
//!   the peak, fused vs unfused speedup) to `path`;
//! - `LORAQ_GPU_PEAK_GBPS`: peak memory bandwidth of the card (default 4800, H200);
//! - `LORAQ_GPU_TABLE_ONLY=1`: write the table and skip the criterion groups;
//! - `LORAQ_GPU_BATCHES=1,4`: only these batch sizes in the table;
//! - `LORAQ_GPU_FORMATS=nvfp4`: only these base formats (fp8-block128, nvfp4);
//! - `LORAQ_GPU_SECTIONS=main`: only these parts of the table (`main`: the fused vs
//!   unfused table, `grid`: blocks per SM, `tc`: the tensor-core decode, `pdl`: the
//!   fused decode with programmatic dependent launch), for probe and experiment runs.
//!
//! Skips (prints why) without a CUDA driver or NVRTC.

use criterion::{BenchmarkId, Criterion, Throughput};
use half::bf16;
use loraq_kernels::cuda::{CudaBackend, GpuLinear, GpuMode, driver_available};
use loraq_kernels::{Fp8Weight, LoraAdapter, Nvfp4Weight, QuantLoraLinear, QuantizedWeight};
use loraq_quant::Nvfp4GlobalScale;
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

/// [`BATCHES`], or the comma-separated list in `LORAQ_GPU_BATCHES` (for probe runs).
fn batches() -> Vec<usize> {
    std::env::var("LORAQ_GPU_BATCHES")
        .ok()
        .map(|v| v.split(',').filter_map(|b| b.trim().parse().ok()).collect())
        .filter(|b: &Vec<usize>| !b.is_empty())
        .unwrap_or_else(|| BATCHES.to_vec())
}

/// A comma-separated list from environment variable `name`, or `default`.
fn env_list(name: &str, default: &[&'static str]) -> Vec<String> {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        })
        .filter(|v: &Vec<String>| !v.is_empty())
        .unwrap_or_else(|| default.iter().map(|s| s.to_string()).collect())
}

/// The base formats benchmarked (`LORAQ_GPU_FORMATS`).
fn formats() -> Vec<String> {
    env_list("LORAQ_GPU_FORMATS", &["fp8-block128", "nvfp4"])
}

fn random_bytes(len: usize, seed: u64, map: impl Fn(u8) -> u8) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = vec![0u8; len];
    rng.fill(out.as_mut_slice());
    out.iter_mut().for_each(|b| *b = map(*b));
    out
}

fn lora(out_features: usize, in_features: usize) -> LoraAdapter {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let a = (0..RANK * in_features)
        .map(|_| bf16::from_f32(rng.random_range(-0.02..0.02)))
        .collect();
    let b = (0..out_features * RANK)
        .map(|_| bf16::from_f32(rng.random_range(-0.02..0.02)))
        .collect();
    LoraAdapter::new(RANK, in_features, out_features, a, b, 1.0).unwrap()
}

fn linear(format: &str, out_features: usize, in_features: usize) -> QuantLoraLinear {
    let base = match format {
        "fp8-block128" => {
            let codes = random_bytes(out_features * in_features, 1, |b| {
                if b & 0x7F == 0x7F { b ^ 1 } else { b }
            });
            let scales = vec![1e-3f32; out_features.div_ceil(128) * in_features.div_ceil(128)];
            QuantizedWeight::Fp8(Fp8Weight::block128(
                out_features,
                in_features,
                codes,
                scales,
            ))
        }
        _ => {
            let packed = random_bytes(out_features * in_features / 2, 2, |b| b);
            let scales = random_bytes(out_features * in_features / 16, 3, |b| 0x30 + (b & 0x0F));
            QuantizedWeight::Nvfp4(Nvfp4Weight::new(
                out_features,
                in_features,
                packed,
                scales,
                Nvfp4GlobalScale::Multiplier(1e-3),
            ))
        }
    };
    QuantLoraLinear::new(base, Some(lora(out_features, in_features))).unwrap()
}

/// Bytes of weights the timed loop cycles through, so that no launch finds its weights
/// in the L2 cache (60 MB on an H200): a server's next layer never does either.
const ROTATION_BYTES: usize = 512 << 20;
/// Forwards per CUDA-event-timed run; the per-call time is the run's time over this.
const CALLS_PER_RUN: usize = 24;
/// Timed runs; the median is reported.
const RUNS: usize = 9;

/// The card's peak memory bandwidth in GB/s (`LORAQ_GPU_PEAK_GBPS`, default the H200's
/// 4800).
fn peak_gbps() -> f64 {
    std::env::var("LORAQ_GPU_PEAK_GBPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4800.0)
}

/// The table at `path` so far, with a new section's caption and column header appended
/// (`columns` after the base and shape columns, each right-aligned).
fn start_section(path: &str, caption: &str, columns: &[&str]) -> String {
    let mut md = std::fs::read_to_string(path).unwrap_or_default();
    writeln!(md, "\n{caption}\n").unwrap();
    writeln!(md, "| base | shape | {} |", columns.join(" | ")).unwrap();
    writeln!(md, "|---|---|{}", "---:|".repeat(columns.len())).unwrap();
    md
}

/// Median milliseconds of one forward, over [`RUNS`] runs of [`CALLS_PER_RUN`]
/// back-to-back launches cycling through `copies` (distinct device copies of the same
/// linear, so each call streams its weights from HBM).
fn time_ms(
    backend: &CudaBackend,
    copies: &mut [GpuLinear],
    x: &cudarc::driver::CudaSlice<u16>,
    batch: usize,
    y: &mut cudarc::driver::CudaSlice<u16>,
    mode: GpuMode,
) -> f64 {
    let stream = backend.stream();
    let ctx = backend.context();
    for gpu in copies.iter_mut() {
        gpu.forward(backend, x, batch, y, mode).unwrap();
    }
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = ctx.new_event(flags).unwrap();
    let end = ctx.new_event(flags).unwrap();
    let count = copies.len();
    let mut times = Vec::with_capacity(RUNS);
    for run in 0..RUNS {
        start.record(stream).unwrap();
        for call in 0..CALLS_PER_RUN {
            copies[(run * CALLS_PER_RUN + call) % count]
                .forward(backend, x, batch, y, mode)
                .unwrap();
        }
        end.record(stream).unwrap();
        end.synchronize().unwrap();
        times.push(f64::from(start.elapsed_ms(&end).unwrap()) / CALLS_PER_RUN as f64);
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Enough device copies of one random linear to fill [`ROTATION_BYTES`] (at least two).
fn rotation_copies(
    backend: &CudaBackend,
    format: &str,
    out_features: usize,
    in_features: usize,
) -> Vec<GpuLinear> {
    let l = linear(format, out_features, in_features);
    let count = ROTATION_BYTES.div_ceil(l.weight_bytes()).max(2);
    (0..count).map(|_| backend.upload(&l).unwrap()).collect()
}

/// Device-to-device copy bandwidth (bytes read + written per second, GB/s) over a
/// 1 GiB buffer: the ceiling a streaming kernel can reach on this card.
fn measured_copy_gbps(backend: &CudaBackend) -> f64 {
    let stream = backend.stream();
    let len = 1usize << 30;
    let src = stream.alloc_zeros::<u8>(len).unwrap();
    let mut dst = stream.alloc_zeros::<u8>(len).unwrap();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = backend.context().new_event(flags).unwrap();
    let end = backend.context().new_event(flags).unwrap();
    stream.memcpy_dtod(&src, &mut dst).unwrap();
    let mut times = Vec::new();
    for _ in 0..5 {
        start.record(stream).unwrap();
        stream.memcpy_dtod(&src, &mut dst).unwrap();
        end.record(stream).unwrap();
        end.synchronize().unwrap();
        times.push(f64::from(start.elapsed_ms(&end).unwrap()));
    }
    times.sort_by(f64::total_cmp);
    2.0 * len as f64 / (times[times.len() / 2] * 1e-3) / 1e9
}

fn write_table(backend: &CudaBackend, path: &str) {
    let peak = peak_gbps();
    let copy = measured_copy_gbps(backend);
    let read = backend.measure_read_gbps(1 << 30).unwrap();
    eprintln!("device-to-device copy: {copy:.0} GB/s; streaming read: {read:.0} GB/s");
    let mut md = String::new();
    writeln!(md, "Device: {} ({}). Peak memory bandwidth taken as {peak} GB/s (datasheet); a 1 GiB device-to-device copy measured {copy:.0} GB/s (read + write) and a plain streaming read of 1 GiB {read:.0} GB/s (`read_ceiling`). Rank {RANK}, bf16 activations and outputs.", backend.device_name(), backend.arch()).unwrap();
    writeln!(md, "Effective GB/s = (base codes + scales + LoRA A + B bytes) / fused time. Time = median over {RUNS} runs of {CALLS_PER_RUN} back-to-back calls (CUDA events), cycling through enough copies of the weights ({} MiB) that none is served from L2. Unfused = base kernel, LoRA shrink, LoRA expand as three launches.\n", ROTATION_BYTES >> 20).unwrap();
    writeln!(
        md,
        "| base | shape | batch | fused us | unfused us | fused GB/s | % of peak | % of read | fused speedup |"
    )
    .unwrap();
    writeln!(md, "|---|---|---:|---:|---:|---:|---:|---:|---:|").unwrap();
    for format in formats() {
        let format = format.as_str();
        for (name, out_features, in_features) in SHAPES {
            let mut copies = rotation_copies(backend, format, out_features, in_features);
            let weight_bytes = copies[0].weight_bytes();
            for batch in batches() {
                let x = backend
                    .upload_activations(&vec![0.5f32; batch * in_features])
                    .unwrap();
                let mut y = backend.alloc_output(batch * out_features).unwrap();
                let fused = time_ms(backend, &mut copies, &x, batch, &mut y, GpuMode::Fused);
                let unfused = time_ms(backend, &mut copies, &x, batch, &mut y, GpuMode::Unfused);
                let gbps = weight_bytes as f64 / (fused * 1e-3) / 1e9;
                writeln!(
                    md,
                    "| {format} | {name} | {batch} | {:.1} | {:.1} | {gbps:.0} | {:.0}% | {:.0}% | {:.2}x |",
                    fused * 1e3,
                    unfused * 1e3,
                    100.0 * gbps / peak,
                    100.0 * gbps / read,
                    unfused / fused
                )
                .unwrap();
                eprintln!(
                    "{format} {name} batch {batch}: fused {:.1} us, unfused {:.1} us, {gbps:.0} GB/s",
                    fused * 1e3,
                    unfused * 1e3
                );
                // Written after every row, so a run cut short still leaves its table.
                std::fs::write(path, &md).unwrap();
            }
        }
    }
    std::fs::write(path, md).unwrap();
    eprintln!("wrote {path}");
}

/// Batch-1 fused time with the persistent decode grid capped at 1, 2 and 4 blocks per SM
/// against the default (as many as are co-resident), appended to the table: how much
/// in-flight data the stream needs.
fn explore_decode_grid(backend: &mut CudaBackend, path: &str) {
    let mut md = start_section(
        path,
        "Batch-1 fused decode time (us) by resident 4-warp blocks per SM (default: all that fit):",
        &["default", "1 per SM", "2 per SM", "4 per SM"],
    );
    for format in formats() {
        let format = format.as_str();
        for (name, out_features, in_features) in SHAPES {
            let mut copies = rotation_copies(backend, format, out_features, in_features);
            let x = backend
                .upload_activations(&vec![0.5f32; in_features])
                .unwrap();
            let mut y = backend.alloc_output(out_features).unwrap();
            let mut row = format!("| {format} | {name} |");
            for blocks in [None, Some(1), Some(2), Some(4)] {
                backend.set_decode_blocks_per_sm(blocks);
                let t = time_ms(backend, &mut copies, &x, 1, &mut y, GpuMode::Fused);
                write!(row, " {:.1} |", t * 1e3).unwrap();
            }
            backend.set_decode_blocks_per_sm(None);
            writeln!(md, "{row}").unwrap();
            eprintln!("{row}");
        }
    }
    std::fs::write(path, md).unwrap();
}

/// The tensor-core decode ([`GpuMode::FusedTensorCoreDecode`]) against the CUDA-core
/// fused decode and the unfused baseline at 1, 4, 8 and 16 tokens, appended to the table.
fn compare_tensor_core_decode(backend: &CudaBackend, path: &str) {
    let peak = peak_gbps();
    let mut md = start_section(
        path,
        "Tensor-core decode (`GpuMode::FusedTensorCoreDecode`) against the CUDA-core fused decode and the unfused baseline:",
        &[
            "batch",
            "tensor-core us",
            "GB/s",
            "% of peak",
            "CUDA-core fused us",
            "unfused us",
            "speedup vs CUDA-core fused",
            "vs unfused",
        ],
    );
    for format in formats() {
        let format = format.as_str();
        for (name, out_features, in_features) in SHAPES {
            let mut copies = rotation_copies(backend, format, out_features, in_features);
            let weight_bytes = copies[0].weight_bytes();
            for batch in [1usize, 4, 8, 16] {
                let x = backend
                    .upload_activations(&vec![0.5f32; batch * in_features])
                    .unwrap();
                let mut y = backend.alloc_output(batch * out_features).unwrap();
                let mut time = |mode| time_ms(backend, &mut copies, &x, batch, &mut y, mode);
                let tc = time(GpuMode::FusedTensorCoreDecode);
                let fused = time(GpuMode::Fused);
                let unfused = time(GpuMode::Unfused);
                let gbps = weight_bytes as f64 / (tc * 1e-3) / 1e9;
                let row = format!(
                    "| {format} | {name} | {batch} | {:.1} | {gbps:.0} | {:.0}% | {:.1} | {:.1} | {:.2}x | {:.2}x |",
                    tc * 1e3,
                    100.0 * gbps / peak,
                    fused * 1e3,
                    unfused * 1e3,
                    fused / tc,
                    unfused / tc
                );
                eprintln!("{row}");
                writeln!(md, "{row}").unwrap();
                std::fs::write(path, &md).unwrap();
            }
        }
    }
}

/// The CUDA-core fused decode launched with programmatic stream serialization
/// ([`CudaBackend::set_programmatic_launch`]) against the plain launch, at 1, 4 and 16
/// tokens, appended to the table: with back-to-back calls (each on its own weights, as
/// the timed loop cycles through copies) a launch's blocks fetch their first weights
/// while the previous launch drains. A last row per format times a tiny projection
/// (512 -> 256, two L2-resident copies) at batch 1: the per-call cost that does not
/// scale with the weights, plain and programmatic.
fn compare_programmatic_launch(backend: &mut CudaBackend, path: &str) {
    let peak = peak_gbps();
    let mut md = start_section(
        path,
        "Fused decode with programmatic dependent launch (`CudaBackend::set_programmatic_launch`) against the plain launch:",
        &[
            "batch",
            "plain us",
            "programmatic us",
            "GB/s",
            "% of peak",
            "speedup",
        ],
    );
    const FIXED_COST: (&str, usize, usize) = ("fixed cost 512->256, L2-resident", 256, 512);
    for format in formats() {
        let format = format.as_str();
        for (name, out_features, in_features) in SHAPES.into_iter().chain([FIXED_COST]) {
            let fixed_cost = name == FIXED_COST.0;
            let mut copies = if fixed_cost {
                let l = linear(format, out_features, in_features);
                vec![backend.upload(&l).unwrap(), backend.upload(&l).unwrap()]
            } else {
                rotation_copies(backend, format, out_features, in_features)
            };
            let weight_bytes = copies[0].weight_bytes();
            let batches: &[usize] = if fixed_cost { &[1] } else { &[1, 4, 16] };
            for &batch in batches {
                let x = backend
                    .upload_activations(&vec![0.5f32; batch * in_features])
                    .unwrap();
                let mut y = backend.alloc_output(batch * out_features).unwrap();
                backend.set_programmatic_launch(false);
                let plain = time_ms(backend, &mut copies, &x, batch, &mut y, GpuMode::Fused);
                backend.set_programmatic_launch(true);
                let programmatic = time_ms(backend, &mut copies, &x, batch, &mut y, GpuMode::Fused);
                backend.set_programmatic_launch(false);
                let gbps = weight_bytes as f64 / (programmatic * 1e-3) / 1e9;
                let row = format!(
                    "| {format} | {name} | {batch} | {:.1} | {:.1} | {gbps:.0} | {:.0}% | {:.2}x |",
                    plain * 1e3,
                    programmatic * 1e3,
                    100.0 * gbps / peak,
                    plain / programmatic
                );
                eprintln!("{row}");
                writeln!(md, "{row}").unwrap();
                std::fs::write(path, &md).unwrap();
            }
        }
    }
}

fn criterion_groups(c: &mut Criterion, backend: &CudaBackend) {
    let mut group = c.benchmark_group("gpu_decode_r256");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    for format in formats() {
        let format = format.as_str();
        let (out_features, in_features) = (17408, 5120);
        let l = linear(format, out_features, in_features);
        let mut gpu = backend.upload(&l).unwrap();
        group.throughput(Throughput::Bytes(gpu.weight_bytes() as u64));
        for batch in [1usize, 16] {
            let x = backend
                .upload_activations(&vec![0.5f32; batch * in_features])
                .unwrap();
            let mut y = backend.alloc_output(batch * out_features).unwrap();
            for mode in [
                GpuMode::Fused,
                GpuMode::Unfused,
                GpuMode::FusedTensorCoreDecode,
            ] {
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
    let Some(mut backend) = CudaBackend::open_default(0).unwrap() else {
        eprintln!(
            "gpu_linear: skipped: no NVRTC and no cubins (set LORAQ_CUDA_WHEELS, CUDA_HOME or LORAQ_CUBIN_DIR)"
        );
        return;
    };
    // Probe cubins (-DLORAQ_DECODE_PROBE=3) carry streaming experiments.
    if std::env::var("LORAQ_GPU_READ_PROBES").is_ok_and(|v| v == "1") {
        for (kernel, threads) in [
            ("read_ceiling", 256),
            ("read_rows_ldg", 128),
            ("read_rows_ldg4", 128),
            ("read_rows_cpasync", 128),
        ] {
            match backend.measure_read_gbps_with(kernel, threads, 1 << 30) {
                Ok(gbps) => eprintln!("{kernel}: {gbps:.0} GB/s"),
                Err(e) => eprintln!("{kernel}: {e}"),
            }
        }
    }
    if let Ok(path) = std::env::var("LORAQ_GPU_TABLE") {
        let sections = env_list("LORAQ_GPU_SECTIONS", &["main", "grid", "tc", "pdl"]);
        let wants = |name: &str| sections.iter().any(|s| s == name);
        if wants("main") {
            write_table(&backend, &path);
        }
        if wants("grid") {
            explore_decode_grid(&mut backend, &path);
        }
        if wants("tc") {
            compare_tensor_core_decode(&backend, &path);
        }
        if wants("pdl") {
            compare_programmatic_launch(&mut backend, &path);
        }
    }
    if std::env::var("LORAQ_GPU_TABLE_ONLY").is_ok_and(|v| v == "1") {
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    criterion_groups(&mut c, &backend);
    c.final_summary();
}
