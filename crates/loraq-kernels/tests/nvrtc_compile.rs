//! Every CUDA kernel compiles with NVRTC to a cubin for every target architecture, and
//! the kernels' launch-argument structs have the layout of their Rust twins.
//!
//! Runs wherever `LORAQ_CUDA_WHEELS` names the `site-packages/nvidia` directory of the
//! `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-runtime-cu12` wheels (`.ci/run` sets it);
//! skipped, with the reason printed, only where the variable is unset. No GPU needed.

use loraq_kernels::kernel_args::{FusedDecodeArgs, KernelArgs, layout_assertions};
use loraq_kernels::nvrtc::{
    CUDA_WHEELS_ENV, KERNELS, KernelSource, Nvrtc, NvrtcLocation, TARGET_ARCHS,
};

fn nvrtc_or_skip() -> Option<Nvrtc> {
    let Some(location) = NvrtcLocation::from_env() else {
        eprintln!("skipped: {CUDA_WHEELS_ENV} is not set (see .ci/run for the NVRTC wheels)");
        return None;
    };
    // The variable is set: a broken installation is a failure, not a skip.
    Some(Nvrtc::load(location).expect("NVRTC named by LORAQ_CUDA_WHEELS loads"))
}

/// Looks for `name` as a NUL-terminated symbol in an ELF image (the cubin's string table).
fn contains_symbol(cubin: &[u8], name: &str) -> bool {
    let needle: Vec<u8> = name.bytes().chain(std::iter::once(0)).collect();
    cubin.windows(needle.len()).any(|w| w == needle.as_slice())
}

#[test]
fn every_kernel_compiles_to_cubin_for_sm90a_and_sm120a() {
    let Some(nvrtc) = nvrtc_or_skip() else { return };
    eprintln!("NVRTC {:?}", nvrtc.version());
    // One thread per (kernel, arch): NVRTC programs are independent, and ptxas dominates.
    let jobs: Vec<_> = KERNELS
        .iter()
        .flat_map(|k| TARGET_ARCHS.map(|arch| (k, arch)))
        .collect();
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|&(kernel, arch)| {
                let nvrtc = &nvrtc;
                scope.spawn(move || (kernel, arch, nvrtc.compile(kernel, arch)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (kernel, arch, result) in results {
        let compiled = result.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            &compiled.cubin[..4],
            b"\x7fELF",
            "{} {arch}: not an ELF cubin",
            kernel.file
        );
        for entry in kernel.entry_points {
            assert!(
                contains_symbol(&compiled.cubin, entry),
                "{} {arch}: entry point {entry} missing from the cubin",
                kernel.file
            );
        }
        if !compiled.log.is_empty() {
            eprintln!("{} {arch} log:\n{}", kernel.file, compiled.log);
        }
    }
}

/// The compile check is not vacuous: a kernel with an error is rejected with the
/// compiler's message.
#[test]
fn a_kernel_with_an_error_is_rejected_with_its_log() {
    let Some(nvrtc) = nvrtc_or_skip() else { return };
    let broken = KernelSource {
        file: "broken.cu",
        source: "#include \"loraq_common.cuh\"\nextern \"C\" __global__ void k(float* y) { y[0] = undefined_name; }\n",
        entry_points: &["k"],
    };
    let err = nvrtc
        .compile(&broken, TARGET_ARCHS[0])
        .expect_err("broken kernel must not compile");
    let message = err.to_string();
    assert!(message.contains("broken.cu"), "{message}");
    assert!(message.contains("undefined_name"), "{message}");
}

/// The layout check's designated initializers (member order) need C++20.
fn cxx20() -> Vec<String> {
    vec!["--std=c++20".to_string()]
}

/// The launch-argument structs of `kernels/loraq_common.cuh` have the layout of their
/// Rust twins (`loraq_kernels::kernel_args`) as NVRTC compiles the header: size,
/// alignment, every field's offset, size and type.
#[test]
fn launch_argument_structs_match_their_rust_layout() {
    let Some(nvrtc) = nvrtc_or_skip() else { return };
    let source: &'static str = Box::leak(layout_assertions().into_boxed_str());
    let check = KernelSource {
        file: "launch_args_layout.cu",
        source,
        entry_points: &[],
    };
    for arch in TARGET_ARCHS {
        nvrtc
            .compile_with_options(&check, arch, &cxx20())
            .unwrap_or_else(|e| panic!("launch argument layouts differ: {e}"));
    }
}

/// The layout check is not vacuous: a struct whose field sits elsewhere than Rust
/// says fails to compile, naming the field; so does one whose members are out of
/// Rust's order.
#[test]
fn a_layout_mismatch_fails_the_layout_check() {
    let Some(nvrtc) = nvrtc_or_skip() else { return };
    let fields = FusedDecodeArgs::fields();
    let target = fields.iter().find(|f| f.name == "target").unwrap();
    let correct = format!(
        "LORAQ_OFFSETOF(FusedDecodeArgs, target) == {}",
        target.offset
    );
    let wrong = format!(
        "LORAQ_OFFSETOF(FusedDecodeArgs, target) == {}",
        target.offset + 4
    );
    let assertions = layout_assertions();
    assert!(assertions.contains(&correct), "{assertions}");
    let source: &'static str = Box::leak(assertions.replace(&correct, &wrong).into_boxed_str());
    let check = KernelSource {
        file: "launch_args_mismatch.cu",
        source,
        entry_points: &[],
    };
    let message = nvrtc
        .compile_with_options(&check, TARGET_ARCHS[0], &cxx20())
        .expect_err("a wrong offset must not compile")
        .to_string();
    assert!(message.contains("FusedDecodeArgs::target"), "{message}");
    // Two members swapped in the header: the designated initializers refuse the order.
    let swapped_header = loraq_kernels::nvrtc::COMMON_HEADER.1.replacen(
        "    int shrink_blocks;\n    int slice_chunks;",
        "    int slice_chunks;\n    int shrink_blocks;",
        1,
    );
    assert_ne!(swapped_header, loraq_kernels::nvrtc::COMMON_HEADER.1);
    let source: &'static str = Box::leak(
        layout_assertions()
            .replace("#include \"loraq_common.cuh\"", &swapped_header)
            .into_boxed_str(),
    );
    let check = KernelSource {
        file: "launch_args_swapped.cu",
        source,
        entry_points: &[],
    };
    let message = nvrtc
        .compile_with_options(&check, TARGET_ARCHS[0], &cxx20())
        .expect_err("members out of order must not compile")
        .to_string();
    assert!(
        message.contains("loraq_layout_order_FusedDecodeArgs"),
        "{message}"
    );
}
