//! The CUDA kernel sources and a minimal NVRTC binding loaded at run time.
//!
//! NVRTC is opened with `libloading` from an explicit path, so the same code compiles
//! kernels in CI (from the PyPI wheels `nvidia-cuda-nvrtc-cu12` and
//! `nvidia-cuda-runtime-cu12`, whose `site-packages/nvidia` directory is named by
//! [`CUDA_WHEELS_ENV`]) and on a GPU machine (a CUDA toolkit, or the same wheels).
//! Nothing here needs a GPU or a driver.

use crate::error::{KernelError, Result};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

/// Environment variable naming the `site-packages/nvidia` directory of the NVRTC and
/// CUDA runtime wheels (set by `.ci/run`).
pub const CUDA_WHEELS_ENV: &str = "LORAQ_CUDA_WHEELS";

/// Architectures every kernel must compile for (Hopper datacenter, Blackwell consumer).
pub const TARGET_ARCHS: [&str; 2] = ["sm_90a", "sm_120a"];

/// Header shared by the kernels, provided to NVRTC in memory.
pub const COMMON_HEADER: (&str, &str) = (
    "loraq_common.cuh",
    include_str!("../../../kernels/loraq_common.cuh"),
);

/// One kernel translation unit.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/`.
    pub file: &'static str,
    /// CUDA C++ source.
    pub source: &'static str,
    /// `extern "C"` entry points it defines.
    pub entry_points: &'static [&'static str],
}

/// Every kernel translation unit (the CI compile test iterates over this).
pub const KERNELS: &[KernelSource] = &[
    KernelSource {
        file: "lora_decode.cu",
        source: include_str!("../../../kernels/lora_decode.cu"),
        entry_points: crate::nvrtc::DECODE_ENTRY_POINTS,
    },
    KernelSource {
        file: "lora_prefill.cu",
        source: include_str!("../../../kernels/lora_prefill.cu"),
        entry_points: crate::nvrtc::PREFILL_ENTRY_POINTS,
    },
];

/// Entry points of `lora_decode.cu`: `{format}_{fused|base}_b{NB}`, `lora_shrink_b{NB}`,
/// `lora_expand_b{NB}` for NB (largest batch served) in 1, 4, 16, and `read_ceiling`
/// (the benchmark's measure of the card's read bandwidth).
pub const DECODE_ENTRY_POINTS: &[&str] = &[
    "bf16_fused_b1",
    "bf16_fused_b4",
    "bf16_fused_b16",
    "fp8b128_fused_b1",
    "fp8b128_fused_b4",
    "fp8b128_fused_b16",
    "nvfp4_fused_b1",
    "nvfp4_fused_b4",
    "nvfp4_fused_b16",
    "bf16_tcdec_fused_b8",
    "bf16_tcdec_fused_b16",
    "fp8b128_tcdec_fused_b8",
    "fp8b128_tcdec_fused_b16",
    "nvfp4_tcdec_fused_b8",
    "nvfp4_tcdec_fused_b16",
    "bf16_base_b1",
    "bf16_base_b4",
    "bf16_base_b16",
    "fp8b128_base_b1",
    "fp8b128_base_b4",
    "fp8b128_base_b16",
    "nvfp4_base_b1",
    "nvfp4_base_b4",
    "nvfp4_base_b16",
    "lora_shrink_b1",
    "lora_shrink_b4",
    "lora_shrink_b16",
    "lora_expand_b1",
    "lora_expand_b4",
    "lora_expand_b16",
    "read_ceiling",
];

/// Entry points of `lora_prefill.cu`.
pub const PREFILL_ENTRY_POINTS: &[&str] = &[
    "bf16_tc_gemm",
    "fp8b128_tc_gemm",
    "nvfp4_tc_gemm",
    "lora_tc_shrink",
];

/// Where the NVRTC library and the CUDA headers are.
#[derive(Clone, Debug)]
pub struct NvrtcLocation {
    /// `libnvrtc.so.12` (or another name of it).
    pub library: PathBuf,
    /// Directories with `cuda_bf16.h`, `cuda_fp8.h`, `cuda_fp4.h`.
    pub include_dirs: Vec<PathBuf>,
}

impl NvrtcLocation {
    /// The layout of the PyPI wheels under `site-packages/nvidia`.
    pub fn from_wheels(nvidia_dir: &Path) -> Self {
        Self {
            library: nvidia_dir.join("cuda_nvrtc/lib/libnvrtc.so.12"),
            include_dirs: vec![nvidia_dir.join("cuda_runtime/include")],
        }
    }

    /// The layout of a CUDA toolkit installation (`lib64/`, `include/`).
    pub fn from_toolkit(root: &Path) -> Self {
        Self {
            library: root.join("lib64/libnvrtc.so"),
            include_dirs: vec![root.join("include")],
        }
    }

    /// The wheels named by [`CUDA_WHEELS_ENV`], if set.
    pub fn from_env() -> Option<Self> {
        std::env::var_os(CUDA_WHEELS_ENV).map(|dir| Self::from_wheels(Path::new(&dir)))
    }

    /// First existing of: [`CUDA_WHEELS_ENV`], `$CUDA_HOME`, `$CUDA_PATH`,
    /// `/usr/local/cuda`.
    pub fn discover() -> Option<Self> {
        let mut candidates: Vec<Self> = Self::from_env().into_iter().collect();
        for var in ["CUDA_HOME", "CUDA_PATH"] {
            if let Some(root) = std::env::var_os(var) {
                candidates.push(Self::from_toolkit(Path::new(&root)));
            }
        }
        candidates.push(Self::from_toolkit(Path::new("/usr/local/cuda")));
        candidates.into_iter().find(|c| c.library.exists())
    }
}

type NvrtcResult = c_int;
type Program = *mut c_void;

/// Function table of the loaded NVRTC.
struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult,
    error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    log: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    destroy: unsafe extern "C" fn(*mut Program) -> NvrtcResult,
}

/// A loaded NVRTC library.
pub struct Nvrtc {
    location: NvrtcLocation,
    api: Api,
    // Keeps the function pointers in `api` valid.
    _library: libloading::Library,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("location", &self.location)
            .finish()
    }
}

/// Output of one compilation.
#[derive(Clone, Debug)]
pub struct CompiledKernel {
    /// The cubin image (loadable with `cuModuleLoadData`).
    pub cubin: Vec<u8>,
    /// Compiler log (warnings), possibly empty.
    pub log: String,
}

impl Nvrtc {
    /// Opens the NVRTC library at `location.library`.
    pub fn load(location: NvrtcLocation) -> Result<Self> {
        let path = location.library.display().to_string();
        let err = |reason: String| KernelError::NvrtcLibrary {
            path: path.clone(),
            reason,
        };
        // SAFETY: loading NVRTC runs its initializers, which have no preconditions.
        let library = unsafe { libloading::Library::new(&location.library) }
            .map_err(|e| err(e.to_string()))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is the documented NVRTC C signature.
                *unsafe { library.get($name) }.map_err(|e| err(e.to_string()))?
            };
        }
        let api = Api {
            version: sym!(b"nvrtcVersion\0"),
            error_string: sym!(b"nvrtcGetErrorString\0"),
            create: sym!(b"nvrtcCreateProgram\0"),
            compile: sym!(b"nvrtcCompileProgram\0"),
            log_size: sym!(b"nvrtcGetProgramLogSize\0"),
            log: sym!(b"nvrtcGetProgramLog\0"),
            cubin_size: sym!(b"nvrtcGetCUBINSize\0"),
            cubin: sym!(b"nvrtcGetCUBIN\0"),
            destroy: sym!(b"nvrtcDestroyProgram\0"),
        };
        Ok(Self {
            location,
            api,
            _library: library,
        })
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> (i32, i32) {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        unsafe { (self.api.version)(&mut major, &mut minor) };
        (major, minor)
    }

    fn status(&self, code: NvrtcResult) -> String {
        // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string.
        let s = unsafe { CStr::from_ptr((self.api.error_string)(code)) };
        s.to_string_lossy().into_owned()
    }

    /// Compiles `kernel` to a cubin for `arch` (e.g. `sm_90a`), with the shared header
    /// available as `#include "loraq_common.cuh"`.
    pub fn compile(&self, kernel: &KernelSource, arch: &str) -> Result<CompiledKernel> {
        self.compile_with_options(kernel, arch, &[])
    }

    /// [`Nvrtc::compile`] with extra NVRTC options (e.g. `-DNAME=VALUE` for the
    /// benchmark probes of `lora_decode.cu`).
    pub fn compile_with_options(
        &self,
        kernel: &KernelSource,
        arch: &str,
        extra_options: &[String],
    ) -> Result<CompiledKernel> {
        let fail = |status: String, log: String| KernelError::NvrtcCompile {
            kernel: kernel.file.to_string(),
            arch: arch.to_string(),
            status,
            log,
        };
        let nul =
            |s: &str| CString::new(s).map_err(|_| fail("NUL byte in input".into(), s.to_string()));
        let source = nul(kernel.source)?;
        let name = nul(kernel.file)?;
        let header_src = nul(COMMON_HEADER.1)?;
        let header_name = nul(COMMON_HEADER.0)?;
        let mut options = vec![
            nul(&format!("--gpu-architecture={arch}"))?,
            nul("--std=c++17")?,
            nul("--device-as-default-execution-space")?,
        ];
        for dir in &self.location.include_dirs {
            options.push(nul(&format!("--include-path={}", dir.display()))?);
        }
        for option in extra_options {
            options.push(nul(option)?);
        }
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: all pointers are valid NUL-terminated strings that outlive the call;
        // one header with its name.
        let code = unsafe {
            (self.api.create)(
                &mut program,
                source.as_ptr(),
                name.as_ptr(),
                1,
                &header_src.as_ptr(),
                &header_name.as_ptr(),
            )
        };
        if code != 0 {
            return Err(fail(self.status(code), String::new()));
        }
        // SAFETY: `program` was created above; option pointers valid for the call.
        let code = unsafe {
            (self.api.compile)(program, option_ptrs.len() as c_int, option_ptrs.as_ptr())
        };
        let log = self.program_log(program);
        let result = if code != 0 {
            Err(fail(self.status(code), log))
        } else {
            let mut size = 0usize;
            // SAFETY: valid program and out-pointer.
            let code = unsafe { (self.api.cubin_size)(program, &mut size) };
            if code != 0 {
                Err(fail(self.status(code), log))
            } else {
                let mut cubin = vec![0u8; size];
                // SAFETY: buffer of the size NVRTC reported.
                let code = unsafe { (self.api.cubin)(program, cubin.as_mut_ptr().cast()) };
                if code != 0 {
                    Err(fail(self.status(code), log))
                } else {
                    Ok(CompiledKernel { cubin, log })
                }
            }
        };
        // SAFETY: destroys the program created above exactly once.
        unsafe { (self.api.destroy)(&mut program) };
        result
    }

    fn program_log(&self, program: Program) -> String {
        let mut size = 0usize;
        // SAFETY: valid program and out-pointer.
        if unsafe { (self.api.log_size)(program, &mut size) } != 0 || size == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; size];
        // SAFETY: buffer of the size NVRTC reported.
        if unsafe { (self.api.log)(program, buf.as_mut_ptr().cast()) } != 0 {
            return String::new();
        }
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .trim()
            .to_string()
    }
}
