//! GPU kernels against the CPU reference (feature `cuda`). Skipped, with the reason
//! printed, where no CUDA driver / device or no NVRTC is present; `scripts/gpu-check.sh`
//! runs them on a GPU machine.
#![cfg(feature = "cuda")]

mod common;

use common::{Format, random_activations, random_linear};
use loraq_kernels::cuda::{CudaBackend, GpuMode, driver_available};
use loraq_kernels::reference::forward_reference_with_magnitude;

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

/// Every format x mode x batch (decode and prefill) x rank, against the f64 reference
/// on the same bf16-rounded activations. Tolerance: bf16 output rounding (2^-8 of |y|)
/// plus 2^-8 of the magnitude sum (bf16 weights in the tensor-core path).
#[test]
fn gpu_matches_cpu_reference() {
    let Some(backend) = backend_or_skip() else {
        return;
    };
    eprintln!("device: {} ({})", backend.device_name(), backend.arch());
    // Every configuration runs even after a failure, so one GPU run reports all of them.
    let mut checked = 0;
    let mut failures = Vec::new();
    for format in [Format::Bf16, Format::Fp8Block128, Format::Nvfp4] {
        for (out_dim, in_dim) in [(200, 272), (129, 1040)] {
            for rank in [0usize, 8, 37, 48, 256] {
                let linear = random_linear(format, out_dim, in_dim, rank, 42 + rank as u64);
                let mut gpu = backend.upload(&linear).unwrap();
                for batch in [1usize, 3, 6, 16, 17, 100] {
                    let x = round_bf16(&random_activations(batch * in_dim, batch as u64));
                    let (want, magnitude) =
                        forward_reference_with_magnitude(&linear, &x, batch).unwrap();
                    // The tensor-core decode only differs from Fused at 5..=16 tokens.
                    let modes: &[GpuMode] = if (5..=16).contains(&batch) {
                        &[
                            GpuMode::Fused,
                            GpuMode::Unfused,
                            GpuMode::FusedTensorCoreDecode,
                        ]
                    } else {
                        &[GpuMode::Fused, GpuMode::Unfused]
                    };
                    for &mode in modes {
                        let config = format!(
                            "{format:?} {out_dim}x{in_dim} r={rank} batch={batch} {mode:?}"
                        );
                        eprintln!("{config}");
                        let got = match gpu.forward_host(&backend, &x, batch, mode) {
                            Ok(got) => got,
                            Err(e) => {
                                failures.push(format!("{config}: {e}"));
                                continue;
                            }
                        };
                        let (mut bad, mut worst, mut first) = (0usize, 0.0f64, None);
                        for (i, ((&g, &w), &m)) in got.iter().zip(&want).zip(&magnitude).enumerate()
                        {
                            let tol = (m + f64::from(w.abs())) / 256.0 + 1e-6;
                            let ratio = (f64::from(g) - f64::from(w)).abs() / tol;
                            if ratio.is_nan() || ratio > 1.0 {
                                bad += 1;
                                first.get_or_insert(format!("output {i}: gpu {g}, reference {w}"));
                            }
                            worst = worst.max(if ratio.is_nan() { f64::INFINITY } else { ratio });
                        }
                        if bad > 0 {
                            failures.push(format!(
                                "{config}: {bad}/{} outside tolerance (worst {worst:.2}x), first {}",
                                got.len(),
                                first.unwrap_or_default()
                            ));
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    eprintln!(
        "{checked} GPU configurations compared with the reference, {} failed",
        failures.len()
    );
    for failure in &failures {
        eprintln!("FAILED {failure}");
    }
    assert!(
        failures.is_empty(),
        "{} configurations failed",
        failures.len()
    );
}

/// The fused decode kernels' release counter (and the tensor-core decode's per-tile
/// tickets, its shrink split into several slices at in-dim 2048) keep working across
/// many launches.
#[test]
fn fused_decode_is_repeatable() {
    let Some(backend) = backend_or_skip() else {
        return;
    };
    let linear = random_linear(Format::Fp8Block128, 300, 2048, 64, 1);
    let mut gpu = backend.upload(&linear).unwrap();
    for (batch, mode) in [(2, GpuMode::Fused), (12, GpuMode::FusedTensorCoreDecode)] {
        let x = round_bf16(&random_activations(batch * 2048, 5));
        let first = gpu.forward_host(&backend, &x, batch, mode).unwrap();
        for _ in 0..50 {
            assert_eq!(
                gpu.forward_host(&backend, &x, batch, mode).unwrap(),
                first,
                "{mode:?} batch {batch}"
            );
        }
    }
}
