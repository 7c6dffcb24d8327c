//! Compiles every kernel with NVRTC and writes `{file}.{arch}.cubin` into a directory,
//! for GPU machines without NVRTC (`LORAQ_CUBIN_DIR`, see `scripts/gpu-check.sh`). A
//! tool for that script and `scripts/sass_census.py`, not a usage example: the examples
//! of the libraries are the workspace's top-level `examples/` (README.md).
//!
//! `cargo run --release -p loraq-kernels --example compile_kernels -- OUT_DIR [ARCH...]`
//! (default archs: sm_90a sm_100a sm_120a). NVRTC is found through `LORAQ_CUDA_WHEELS`,
//! `CUDA_HOME`, `CUDA_PATH` or `/usr/local/cuda`. `LORAQ_NVRTC_OPTIONS` (space-separated,
//! e.g. `-DLORAQ_DECODE_PROBE=1`) adds NVRTC options.

use loraq_kernels::nvrtc::{KERNELS, Nvrtc, NvrtcLocation};
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out: PathBuf = args
        .next()
        .ok_or("usage: compile_kernels OUT_DIR [ARCH...]")?
        .into();
    let mut archs: Vec<String> = args.collect();
    if archs.is_empty() {
        archs = ["sm_90a", "sm_100a", "sm_120a"].map(String::from).to_vec();
    }
    let location =
        NvrtcLocation::discover().ok_or("no NVRTC: set LORAQ_CUDA_WHEELS or CUDA_HOME")?;
    let nvrtc = Nvrtc::load(location)?;
    let options: Vec<String> = std::env::var("LORAQ_NVRTC_OPTIONS")
        .unwrap_or_default()
        .split_whitespace()
        .map(String::from)
        .collect();
    std::fs::create_dir_all(&out)?;
    for kernel in KERNELS {
        for arch in &archs {
            let compiled = nvrtc.compile_with_options(kernel, arch, &options)?;
            let path = out.join(format!("{}.{arch}.cubin", kernel.file));
            std::fs::write(&path, &compiled.cubin)?;
            eprintln!("wrote {} ({} bytes)", path.display(), compiled.cubin.len());
        }
    }
    Ok(())
}
