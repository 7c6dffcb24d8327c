//! GPU kernels against the CPU reference (feature `cuda`). Skipped, with the reason
//! printed, where no CUDA driver / device or no NVRTC is present; `scripts/gpu-check.sh`
//! runs them on a GPU machine.
#![cfg(feature = "cuda")]

mod common;

use common::{Format, random_activations, random_linear};
use loraq_kernels::cuda::{CudaBackend, GpuMode, driver_available};

fn backend_or_skip() -> Option<CudaBackend> {
    if !driver_available() {
        eprintln!("skipped: no CUDA driver or device");
        return None;
    }
    let backend = CudaBackend::open_default(0).expect("kernels compile and load");
    if backend.is_none() {
        eprintln!(
            "skipped: no NVRTC and no cubins (set LORAQ_CUDA_WHEELS, CUDA_HOME or LORAQ_CUBIN_DIR)"
        );
    }
    backend
}

fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

/// Runs every format x shape x rank x batch x mode against the f64 reference on the
/// same bf16-rounded activations and returns (configurations checked, failures). Every
/// configuration runs even after a failure, so one GPU run reports all of them.
/// Tolerance: bf16 output rounding (2^-8 of |y|) plus 2^-8 of the magnitude sum (bf16
/// weights in the tensor-core paths).
fn check_against_reference(
    backend: &CudaBackend,
    ranks: &[usize],
    batches: &[usize],
    modes: &[GpuMode],
) -> (usize, Vec<String>) {
    let mut checked = 0;
    let mut failures = Vec::new();
    for format in [Format::Bf16, Format::Fp8Block128, Format::Nvfp4] {
        // In-dims 272 and 1040 (K % 64 == 16: a half-valid last NVFP4 lane step, block
        // scales read at consumption) and 2112 (K % 64 == 0: NVFP4's 16-byte copies and
        // scale words through the ring, the layout of every Qwen3.8-27B projection).
        for (out_features, in_features) in [(200, 272), (129, 1040), (72, 2112)] {
            for &rank in ranks {
                let linear =
                    random_linear(format, out_features, in_features, rank, 42 + rank as u64);
                let mut gpu = backend.upload(&linear).unwrap();
                for &batch in batches {
                    let x = round_bf16(&random_activations(batch * in_features, batch as u64));
                    let (want, magnitude) =
                        linear.forward_reference_with_magnitude(&x, batch).unwrap();
                    for &mode in modes {
                        let config = format!(
                            "{format:?} {out_features}x{in_features} r={rank} batch={batch} {mode:?}"
                        );
                        eprintln!("{config}");
                        let got = match gpu.forward_host(backend, &x, batch, mode) {
                            Ok(got) => got,
                            Err(e) => {
                                failures.push(format!("{config}: {e}"));
                                continue;
                            }
                        };
                        failures.extend(compare(&config, &got, &want, &magnitude));
                        checked += 1;
                    }
                }
            }
        }
    }
    (checked, failures)
}

/// The failure line of one configuration, if any output is outside tolerance: bf16
/// output rounding (2^-8 of |y|) plus 2^-8 of the magnitude sum.
fn compare(config: &str, got: &[f32], want: &[f32], magnitude: &[f64]) -> Option<String> {
    let (mut bad, mut worst, mut first) = (0usize, 0.0f64, None);
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(magnitude).enumerate() {
        let tol = (m + f64::from(w.abs())) / 256.0 + 1e-6;
        let ratio = (f64::from(g) - f64::from(w)).abs() / tol;
        if ratio.is_nan() || ratio > 1.0 {
            bad += 1;
            first.get_or_insert(format!("output {i}: gpu {g}, reference {w}"));
        }
        worst = worst.max(if ratio.is_nan() { f64::INFINITY } else { ratio });
    }
    (bad > 0).then(|| {
        format!(
            "{config}: {bad}/{} outside tolerance (worst {worst:.2}x), first {}",
            got.len(),
            first.unwrap_or_default()
        )
    })
}

fn report(checked: usize, failures: &[String]) {
    eprintln!(
        "{checked} GPU configurations compared with the reference, {} failed",
        failures.len()
    );
    for failure in failures {
        eprintln!("FAILED {failure}");
    }
    assert!(
        failures.is_empty(),
        "{} configurations failed",
        failures.len()
    );
}

/// Every format x mode x batch (decode and prefill) x rank of the CUDA-core decode, the
/// tensor-core prefill and the unfused baseline.
#[test]
fn gpu_matches_cpu_reference() {
    let Some(backend) = backend_or_skip() else {
        return;
    };
    eprintln!("device: {} ({})", backend.device_name(), backend.arch());
    let (checked, failures) = check_against_reference(
        &backend,
        &[0, 8, 37, 48, 256],
        &[1, 3, 6, 16, 17, 100],
        &[GpuMode::Fused, GpuMode::Unfused],
    );
    report(checked, &failures);
}

/// The tensor-core decode (batch 1..16; ranks not a multiple of 16 fall back to the
/// CUDA-core kernel). Named to run after the other tests (libtest runs them in name
/// order with one thread), so a fault in this newer kernel cannot hide their results.
#[test]
fn tensor_core_decode_matches_cpu_reference() {
    let Some(backend) = backend_or_skip() else {
        return;
    };
    let (checked, failures) = check_against_reference(
        &backend,
        &[0, 8, 48, 256],
        &[1, 3, 5, 8, 9, 16],
        &[GpuMode::FusedTensorCoreDecode],
    );
    report(checked, &failures);
}

/// The fused decode kernel's release counter keeps working across many launches.
#[test]
fn fused_decode_is_repeatable() {
    repeatable(2, GpuMode::Fused);
}

/// The same for the tensor-core decode, whose shrink is split into several slices at
/// in-dim 2048 (per-tile tickets, reset by every launch).
#[test]
fn tensor_core_decode_is_repeatable() {
    repeatable(12, GpuMode::FusedTensorCoreDecode);
}

fn repeatable(batch: usize, mode: GpuMode) {
    let Some(backend) = backend_or_skip() else {
        return;
    };
    let linear = random_linear(Format::Fp8Block128, 300, 2048, 64, 1);
    let mut gpu = backend.upload(&linear).unwrap();
    let x = round_bf16(&random_activations(batch * 2048, 5));
    let first = gpu.forward_host(&backend, &x, batch, mode).unwrap();
    for _ in 0..50 {
        assert_eq!(gpu.forward_host(&backend, &x, batch, mode).unwrap(), first);
    }
}

/// Programmatic dependent launch (`set_programmatic_launch`): eight fused decodes of one
/// square linear queued back to back, each reading the previous one's output as its
/// activations (a layer chain) and all sharing the linear's LoRA intermediate and
/// release counter. A launch that read x or wrote t, the counter or y before the
/// previous launch had finished would break the chain; each output is checked against
/// the reference applied to the input it actually had. Named to run last (libtest runs
/// tests in name order, one thread here), so a fault in it cannot hide other results.
#[test]
fn with_programmatic_launch_chained_decodes_match_cpu_reference() {
    let Some(mut backend) = backend_or_skip() else {
        return;
    };
    backend.set_programmatic_launch(true);
    const CHAIN: usize = 8;
    let mut checked = 0;
    let mut failures = Vec::new();
    for format in [Format::Fp8Block128, Format::Nvfp4] {
        for dim in [1040, 2112] {
            for rank in [37, 256] {
                let linear = random_linear(format, dim, dim, rank, 11 + rank as u64);
                let mut gpu = backend.upload(&linear).unwrap();
                for batch in [1, 3, 16] {
                    let x0 = round_bf16(&random_activations(batch * dim, 77 + batch as u64));
                    let mut buffers = vec![backend.upload_activations(&x0).unwrap()];
                    for _ in 0..CHAIN {
                        buffers.push(backend.alloc_output(batch * dim).unwrap());
                    }
                    for step in 0..CHAIN {
                        let (inputs, outputs) = buffers.split_at_mut(step + 1);
                        gpu.forward(
                            &backend,
                            &inputs[step],
                            batch,
                            &mut outputs[0],
                            GpuMode::Fused,
                        )
                        .unwrap();
                    }
                    backend.synchronize().unwrap();
                    let values: Vec<Vec<f32>> = buffers
                        .iter()
                        .map(|b| backend.download(b).unwrap())
                        .collect();
                    for step in 0..CHAIN {
                        let config = format!(
                            "{format:?} {dim}x{dim} r={rank} batch={batch} chain step {step}"
                        );
                        let (want, magnitude) = linear
                            .forward_reference_with_magnitude(&values[step], batch)
                            .unwrap();
                        if let Some(failure) =
                            compare(&config, &values[step + 1], &want, &magnitude)
                        {
                            failures.push(failure);
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    report(checked, &failures);
}
