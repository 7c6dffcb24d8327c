//! CUDA path (feature `cuda`): uploads a [`QuantLoraLinear`] and runs the kernels of
//! `kernels/` on it, fused or as the unfused baseline.
//!
//! The driver is loaded at run time by cudarc (`dynamic-loading`), the kernels are
//! compiled at run time by [`Nvrtc`] for the device's architecture, so building needs no
//! CUDA. [`driver_available`] tells tests and benches whether to skip.
//!
//! Activations and outputs are bf16 on the device (what a server passes between layers);
//! accumulation is f32; the LoRA intermediate `s * A x` is f32.

use crate::error::{KernelError, Result};
use crate::launch_plan::{self, DecodeKernel, FusedPlan};
use crate::linear::QuantLoraLinear;
use crate::lora::MAX_RANK;
use crate::nvrtc::{KERNELS, KernelSource, Nvrtc, NvrtcLocation};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg, sys,
};
use cudarc::nvrtc::Ptx;
use half::bf16;
use loraq_quant::{Nvfp4GlobalScale, QuantizedWeight};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Environment variable naming a directory of precompiled cubins (see
/// [`CudaBackend::from_cubin_dir`]).
pub const CUBIN_DIR_ENV: &str = "LORAQ_CUBIN_DIR";

/// Largest batch of the decode kernels; larger batches use the tensor-core kernels.
pub const DECODE_MAX_BATCH: usize = launch_plan::DECODE_MAX_BATCH;
const TC_TILE: usize = 64;
/// Threads of a decode block (`DECODE_WARPS` in lora_decode.cu).
const DECODE_THREADS: u32 = launch_plan::DECODE_THREADS as u32;

fn driver_err(during: &'static str) -> impl Fn(cudarc::driver::DriverError) -> KernelError {
    move |e| KernelError::Cuda {
        during,
        message: e.to_string(),
    }
}

/// True when the CUDA driver library can be loaded and reports at least one device.
pub fn driver_available() -> bool {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    std::panic::catch_unwind(|| CudaContext::device_count().map(|n| n > 0).unwrap_or(false))
        .unwrap_or(false)
}

/// NVRTC architecture name for a compute capability (`sm_90a` for Hopper, `sm_120a` for
/// consumer Blackwell: the `a` variants unlock the architecture-specific instructions).
pub fn arch_for(major: i32, minor: i32) -> String {
    if major >= 9 {
        format!("sm_{major}{minor}a")
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Which kernel sequence [`GpuLinear::forward`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuMode {
    /// Decode: one launch (shrink overlapped with the base stream); prefill: shrink, then
    /// base + expand in one tensor-core pass.
    Fused,
    /// Base product, LoRA shrink, LoRA expand as three launches (the baseline).
    Unfused,
    /// As `Fused`, but decode batches (up to 16 tokens) with a rank that is a multiple of
    /// 16 (or no LoRA) run the tensor-core decode (`{format}_tcdec_fused_b{8,16}` in
    /// lora_decode.cu: 16 weight rows x the tokens per mma, one launch with the shrink).
    /// Opt-in: it matches the reference in the host emulation (`launch_plan.rs`), and
    /// becomes the default for those batches once `scripts/gpu-check.sh` shows it
    /// correct and faster on a device.
    FusedTensorCoreDecode,
}

/// A device, its stream and the loaded kernels.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    decode: Arc<CudaModule>,
    prefill: Arc<CudaModule>,
    arch: String,
    /// Compute capability major version (9: Hopper).
    major: i32,
    name: String,
    sm_count: usize,
    /// Cap on resident decode blocks per SM (benchmark exploration); `None`: as many as
    /// the kernel's occupancy allows.
    decode_blocks_per_sm: Option<u32>,
    /// Launch the CUDA-core fused decode with programmatic stream serialization.
    programmatic_launch: bool,
    /// Loaded decode kernels with their occupancy (blocks per SM at 128 threads).
    decode_functions: Mutex<HashMap<String, (CudaFunction, u32)>>,
}

impl CudaBackend {
    /// Opens device `ordinal` and compiles the kernels for it with NVRTC.
    pub fn new(ordinal: usize, nvrtc: &Nvrtc) -> Result<Self> {
        Self::with_images(ordinal, |kernel, arch| {
            Ok(nvrtc.compile(kernel, arch)?.cubin)
        })
    }

    /// Opens device `ordinal` and loads precompiled cubins `{dir}/{file}.{arch}.cubin`
    /// (written by `cargo run -p loraq-kernels --example compile_kernels`), for machines
    /// without NVRTC.
    pub fn from_cubin_dir(ordinal: usize, dir: &Path) -> Result<Self> {
        Self::with_images(ordinal, |kernel, arch| {
            let path = dir.join(format!("{}.{arch}.cubin", kernel.file));
            std::fs::read(&path).map_err(|e| KernelError::Cuda {
                during: "reading a precompiled cubin",
                message: format!("{}: {e}", path.display()),
            })
        })
    }

    /// [`CUBIN_DIR_ENV`] if set, else NVRTC from [`NvrtcLocation::discover`]; `Ok(None)`
    /// when neither exists.
    pub fn open_default(ordinal: usize) -> Result<Option<Self>> {
        if let Some(dir) = std::env::var_os(CUBIN_DIR_ENV) {
            return Self::from_cubin_dir(ordinal, Path::new(&dir)).map(Some);
        }
        match NvrtcLocation::discover() {
            Some(location) => Self::new(ordinal, &Nvrtc::load(location)?).map(Some),
            None => Ok(None),
        }
    }

    fn with_images(
        ordinal: usize,
        image: impl Fn(&KernelSource, &str) -> Result<Vec<u8>>,
    ) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).map_err(driver_err("opening the device"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("querying the compute capability"))?;
        let name = ctx.name().map_err(driver_err("querying the device name"))?;
        let arch = arch_for(major, minor);
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(driver_err("querying the SM count"))? as usize;
        let mut modules = Vec::new();
        for kernel in KERNELS {
            let cubin = image(kernel, &arch)?;
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(driver_err("loading a cubin"))?;
            modules.push(module);
        }
        let stream = ctx.default_stream();
        // One stream, no cross-stream hazards: skip cudarc's per-buffer event bookkeeping,
        // which would otherwise be timed along with the kernels.
        // SAFETY: every buffer of this backend is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        Ok(Self {
            decode: modules[0].clone(),
            prefill: modules[1].clone(),
            ctx,
            stream,
            arch,
            major,
            name,
            sm_count,
            decode_blocks_per_sm: None,
            programmatic_launch: false,
            decode_functions: Mutex::new(HashMap::new()),
        })
    }

    /// Caps the resident blocks per SM of the persistent decode kernels (`None`: as
    /// many as their occupancy allows). For benchmarks comparing launch shapes.
    pub fn set_decode_blocks_per_sm(&mut self, blocks: Option<u32>) {
        self.decode_blocks_per_sm = blocks.map(|b| b.max(1));
    }

    /// Launches the CUDA-core fused decode (`GpuMode::Fused`, batch 1..16) with
    /// programmatic stream serialization (programmatic dependent launch, sm_90+): a
    /// launch may then start while the previous kernel on the stream drains, its blocks
    /// taking the SM slots that kernel's blocks free; they fetch their first weights and
    /// wait (`griddepcontrol.wait`) for the previous kernel to complete before touching
    /// activations, outputs or the LoRA intermediate. For chains of layers on one stream
    /// (what a server runs); off by default. Ignored before sm_90.
    pub fn set_programmatic_launch(&mut self, enabled: bool) {
        self.programmatic_launch = enabled;
    }

    /// Read bandwidth (GB/s) of a plain streaming kernel over `bytes` of device memory
    /// (median of 5 event-timed passes): the ceiling a weight stream can approach on
    /// this card, measured rather than taken from the datasheet.
    pub fn measure_read_gbps(&self, bytes: usize) -> Result<f64> {
        self.measure_read_gbps_with("read_ceiling", 256, bytes)
    }

    /// [`CudaBackend::measure_read_gbps`] through another streaming kernel of the same
    /// signature `(const uint4*, unsigned long long n16, unsigned*)` (benchmark probes).
    pub fn measure_read_gbps_with(&self, kernel: &str, threads: u32, bytes: usize) -> Result<f64> {
        let err = driver_err("measuring read bandwidth");
        let n16 = (bytes / 16).max(1);
        let buffer = self.stream.alloc_zeros::<u8>(n16 * 16).map_err(&err)?;
        let mut out = self.stream.alloc_zeros::<u32>(1).map_err(&err)?;
        let function = self
            .decode
            .load_function(kernel)
            .map_err(driver_err("loading a read-bandwidth kernel"))?;
        let per_sm = function
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .map_err(&err)?
            .max(1) as usize;
        let config = grid_1d(per_sm * self.sm_count.max(1), threads);
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).map_err(&err)?;
        let end = self.ctx.new_event(flags).map_err(&err)?;
        let n16_u64 = n16 as u64;
        let mut times = Vec::new();
        for pass in 0..6 {
            start.record(&self.stream).map_err(&err)?;
            let mut builder = self.stream.launch_builder(&function);
            builder.arg(&buffer).arg(&n16_u64).arg(&mut out);
            // SAFETY: matches `read_ceiling(const uint4*, unsigned long long, unsigned*)`;
            // the buffer holds n16 16-byte elements.
            unsafe { builder.launch(config) }.map_err(&err)?;
            end.record(&self.stream).map_err(&err)?;
            end.synchronize().map_err(&err)?;
            if pass > 0 {
                times.push(f64::from(start.elapsed_ms(&end).map_err(&err)?));
            }
        }
        times.sort_by(f64::total_cmp);
        Ok((n16 * 16) as f64 / (times[times.len() / 2] * 1e-3) / 1e9)
    }

    /// Device name.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// Architecture the kernels were compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A decode kernel and the number of its 128-thread blocks that are co-resident on
    /// the whole device (occupancy x SMs, capped by `set_decode_blocks_per_sm`).
    fn decode_fn(&self, name: &str) -> Result<(CudaFunction, usize)> {
        let mut cache = self
            .decode_functions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (function, per_sm) = match cache.get(name) {
            Some(entry) => entry.clone(),
            None => {
                let function = self
                    .decode
                    .load_function(name)
                    .map_err(driver_err("loading a decode kernel"))?;
                let per_sm = function
                    .occupancy_max_active_blocks_per_multiprocessor(DECODE_THREADS, 0, None)
                    .map_err(driver_err("querying a decode kernel's occupancy"))?
                    .max(1);
                cache.insert(name.to_string(), (function.clone(), per_sm));
                (function, per_sm)
            }
        };
        let per_sm = self
            .decode_blocks_per_sm
            .map_or(per_sm, |cap| cap.min(per_sm));
        Ok((function, per_sm as usize * self.sm_count.max(1)))
    }

    fn prefill_fn(&self, name: &str) -> Result<CudaFunction> {
        self.prefill
            .load_function(name)
            .map_err(driver_err("loading a prefill kernel"))
    }

    /// Copies bf16 activations to the device.
    pub fn upload_activations(&self, x: &[f32]) -> Result<CudaSlice<u16>> {
        let bits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        self.stream
            .clone_htod(&bits)
            .map_err(driver_err("uploading activations"))
    }

    /// A zeroed bf16 output buffer of `len` elements.
    pub fn alloc_output(&self, len: usize) -> Result<CudaSlice<u16>> {
        self.stream
            .alloc_zeros::<u16>(len)
            .map_err(driver_err("allocating the output"))
    }

    /// Copies a bf16 device buffer back as f32.
    pub fn download(&self, y: &CudaSlice<u16>) -> Result<Vec<f32>> {
        let bits = self
            .stream
            .clone_dtoh(y)
            .map_err(driver_err("downloading the output"))?;
        Ok(bits
            .into_iter()
            .map(|b| bf16::from_bits(b).to_f32())
            .collect())
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver_err("synchronizing"))
    }

    /// Uploads a linear. Base formats: bf16, fp8-block128, NVFP4 (in-dim a multiple of 16).
    pub fn upload(&self, linear: &QuantLoraLinear) -> Result<GpuLinear> {
        let s = &self.stream;
        let up = driver_err("uploading weights");
        let (format, codes, scales, global) = match linear.base() {
            QuantizedWeight::Bf16(w) => {
                let bytes: Vec<u8> = w
                    .data
                    .iter()
                    .flat_map(|v| v.to_bits().to_le_bytes())
                    .collect();
                (
                    "bf16",
                    s.clone_htod(&bytes).map_err(&up)?,
                    s.alloc_zeros::<u8>(4).map_err(&up)?,
                    1.0,
                )
            }
            QuantizedWeight::Fp8(w) => {
                let scale_bytes: Vec<u8> = w.scales.iter().flat_map(|v| v.to_le_bytes()).collect();
                (
                    "fp8b128",
                    s.clone_htod(&w.codes).map_err(&up)?,
                    s.clone_htod(&scale_bytes).map_err(&up)?,
                    1.0,
                )
            }
            QuantizedWeight::Nvfp4(w) => (
                "nvfp4",
                s.clone_htod(&w.packed).map_err(&up)?,
                s.clone_htod(&w.block_scales).map_err(&up)?,
                // The kernels multiply by the global scale; a compressed-tensors divisor
                // becomes `1 / d`, one rounding more than the CPU path's division.
                match w.global_scale {
                    Nvfp4GlobalScale::Multiplier(g) => g,
                    Nvfp4GlobalScale::Divisor(d) => 1.0 / d,
                },
            ),
            QuantizedWeight::Mxfp4(_) => {
                return Err(KernelError::UnsupportedOnGpu {
                    what: "mxfp4 base weights (CPU path only)".into(),
                });
            }
            QuantizedWeight::Int4(_) => {
                return Err(KernelError::UnsupportedOnGpu {
                    what: "int4-g128 base weights (CPU path only)".into(),
                });
            }
            QuantizedWeight::Ggml(w) => {
                return Err(KernelError::UnsupportedOnGpu {
                    what: format!("ggml {} base weights", w.ggml_type),
                });
            }
        };
        let (n, k) = (linear.out_dim(), linear.in_dim());
        if !k.is_multiple_of(16) {
            return Err(KernelError::UnsupportedOnGpu {
                what: format!("in-dim {k} (the GPU kernels need a multiple of 16)"),
            });
        }
        if !linear.activation_quant().is_identity() {
            return Err(KernelError::UnsupportedOnGpu {
                what: "activation fake-quant (the GPU kernels take bf16 activations)".into(),
            });
        }
        let lora = match linear.lora() {
            Some(l) => Some(GpuLora {
                a: s.clone_htod(&l.a.iter().map(|v| v.to_bits()).collect::<Vec<u16>>())
                    .map_err(&up)?,
                b: s.clone_htod(&l.b.iter().map(|v| v.to_bits()).collect::<Vec<u16>>())
                    .map_err(&up)?,
                rank: l.rank,
                scale: l.scale,
            }),
            None => None,
        };
        Ok(GpuLinear {
            format,
            n,
            k,
            codes,
            scales,
            global,
            lora,
            t: s.alloc_zeros::<f32>(16).map_err(&up)?,
            counter: s.alloc_zeros::<u32>(1).map_err(&up)?,
            counter_value: 0,
            tc_part: s.alloc_zeros::<f32>(16).map_err(&up)?,
            tc_tickets: s.alloc_zeros::<u32>(MAX_RANK.div_ceil(16)).map_err(&up)?,
            placeholder: s.alloc_zeros::<u16>(16).map_err(&up)?,
            weight_bytes: linear.weight_bytes(),
        })
    }
}

struct GpuLora {
    a: CudaSlice<u16>,
    b: CudaSlice<u16>,
    rank: usize,
    scale: f32,
}

/// A linear resident on the device.
pub struct GpuLinear {
    format: &'static str,
    n: usize,
    k: usize,
    codes: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    global: f32,
    lora: Option<GpuLora>,
    /// LoRA intermediate, f32 `[batch, rank]` (grown on demand).
    t: CudaSlice<f32>,
    /// Monotonic release counter of the fused decode kernel.
    counter: CudaSlice<u32>,
    counter_value: u32,
    /// Tensor-core decode: the shrink's per-slice partial sums `[slices, 16, rank]`
    /// (grown on demand) and one ticket per 16 rows of `A` (left at 0 by every launch).
    tc_part: CudaSlice<f32>,
    tc_tickets: CudaSlice<u32>,
    /// Stands in for absent LoRA operands (the kernels never read it when rank is 0).
    placeholder: CudaSlice<u16>,
    weight_bytes: usize,
}

fn as_i32(v: usize, what: &'static str) -> Result<i32> {
    i32::try_from(v).map_err(|_| KernelError::UnsupportedOnGpu {
        what: format!("{what} = {v} exceeds i32"),
    })
}

/// A kernel argument as `cuLaunchKernel` takes it: a pointer to the argument's value.
fn kernel_param<T>(value: &T) -> *mut std::ffi::c_void {
    value as *const T as *mut std::ffi::c_void
}

/// Launches `function` on the backend's stream with raw parameters; `programmatic`
/// adds the programmatic-stream-serialization attribute (`cuLaunchKernelEx`).
///
/// # Safety
/// `params` must point to values matching the kernel's parameters, alive for the call.
unsafe fn launch_raw(
    backend: &CudaBackend,
    function: &CudaFunction,
    config: LaunchConfig,
    params: &mut [*mut std::ffi::c_void],
    programmatic: bool,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    backend.ctx.bind_to_thread()?;
    let stream = backend.stream.cu_stream();
    if !programmatic {
        // SAFETY: the caller's contract.
        return unsafe {
            cudarc::driver::result::launch_kernel(
                function.cu_function(),
                config.grid_dim,
                config.block_dim,
                config.shared_mem_bytes,
                stream,
                params,
            )
        };
    }
    // The field set below is the one the attribute's id selects.
    let mut attribute = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        // SAFETY: an all-zero launch attribute value is valid (a plain union of
        // integers and handles).
        value: unsafe { std::mem::zeroed() },
    };
    attribute.value.programmaticStreamSerializationAllowed = 1;
    let launch_config = sys::CUlaunchConfig {
        gridDimX: config.grid_dim.0,
        gridDimY: config.grid_dim.1,
        gridDimZ: config.grid_dim.2,
        blockDimX: config.block_dim.0,
        blockDimY: config.block_dim.1,
        blockDimZ: config.block_dim.2,
        sharedMemBytes: config.shared_mem_bytes,
        hStream: stream,
        attrs: &mut attribute,
        numAttrs: 1,
    };
    // SAFETY: the configuration and its one attribute live across the call; the
    // parameters are the caller's contract.
    unsafe {
        sys::cuLaunchKernelEx(
            &launch_config,
            function.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

fn grid_1d(blocks: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl GpuLinear {
    /// Bytes of weights one pass reads (base codes + scales + both LoRA factors).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn ensure_t(&mut self, stream: &Arc<CudaStream>, len: usize) -> Result<()> {
        if self.t.len() < len {
            self.t = stream
                .alloc_zeros::<f32>(len)
                .map_err(driver_err("allocating the LoRA intermediate"))?;
        }
        Ok(())
    }

    /// `y = W x + s B (A x)` for `batch` tokens of bf16 `x` (`[batch, in]`) into bf16 `y`
    /// (`[batch, out]`), queued on the backend's stream.
    pub fn forward(
        &mut self,
        backend: &CudaBackend,
        x: &CudaSlice<u16>,
        batch: usize,
        y: &mut CudaSlice<u16>,
        mode: GpuMode,
    ) -> Result<()> {
        if batch == 0 {
            return Ok(());
        }
        if x.len() < batch * self.k || y.len() < batch * self.n {
            return Err(KernelError::InputShape {
                batch,
                in_dim: self.k,
                actual: x.len(),
            });
        }
        let rank = self.lora.as_ref().map_or(0, |l| l.rank);
        self.ensure_t(&backend.stream, batch * rank.max(1))?;
        if batch <= DECODE_MAX_BATCH {
            self.forward_decode(backend, x, batch, y, mode)
        } else {
            self.forward_prefill(backend, x, batch, y, mode)
        }
    }

    fn forward_decode(
        &mut self,
        backend: &CudaBackend,
        x: &CudaSlice<u16>,
        batch: usize,
        y: &mut CudaSlice<u16>,
        mode: GpuMode,
    ) -> Result<()> {
        let threads = DECODE_THREADS;
        let (batch_i, n_i, k_i) = (
            as_i32(batch, "batch")?,
            as_i32(self.n, "out_dim")?,
            as_i32(self.k, "in_dim")?,
        );
        let stream = &backend.stream;
        let launch = driver_err("launching a decode kernel");
        let (rank, scale) = self.lora.as_ref().map_or((0, 0.0), |l| (l.rank, l.scale));
        let nb = launch_plan::cuda_core_instance(batch);
        match mode {
            GpuMode::Fused | GpuMode::FusedTensorCoreDecode => {
                let tensor_cores = if mode == GpuMode::FusedTensorCoreDecode {
                    let tc_nb = if batch <= 8 { 8 } else { 16 };
                    let (f, resident) = backend.decode_fn(&format!(
                        "{}_{}_b{tc_nb}",
                        self.format,
                        DecodeKernel::TensorCore.name()
                    ))?;
                    launch_plan::tensor_core_plan(self.n, self.k, batch, rank, resident)
                        .map(|plan| (f, plan))
                } else {
                    None
                };
                let (function, plan): (CudaFunction, FusedPlan) = match tensor_cores {
                    Some(chosen) => chosen,
                    None => {
                        let (f, resident) = backend.decode_fn(&format!(
                            "{}_{}_b{nb}",
                            self.format,
                            DecodeKernel::CudaCore.name()
                        ))?;
                        (
                            f,
                            launch_plan::cuda_core_plan(self.n, batch, rank, resident),
                        )
                    }
                };
                if self.tc_part.len() < plan.slices * 16 * rank {
                    self.tc_part = stream
                        .alloc_zeros::<f32>(plan.slices * 16 * rank)
                        .map_err(driver_err("allocating the shrink's partial sums"))?;
                }
                self.counter_value = self.counter_value.wrapping_add(plan.releases as u32);
                let (rank_i, shrink_i, slice_i) = (
                    as_i32(rank, "rank")?,
                    as_i32(plan.shrink_blocks, "shrink blocks")?,
                    as_i32(plan.slice_chunks, "shrink slice")?,
                );
                let target = self.counter_value;
                let (a, b) = match &self.lora {
                    Some(l) => (&l.a, &l.b),
                    None => (&self.placeholder, &self.placeholder),
                };
                // Raw pointers: the same argument list serves a plain and a programmatic
                // launch (cudarc's builder has no launch attributes). Event tracking is
                // off (with_images), so taking the pointers records nothing.
                let (x_ptr, codes, scales) = (
                    x.device_ptr(stream).0,
                    self.codes.device_ptr(stream).0,
                    self.scales.device_ptr(stream).0,
                );
                let (a_ptr, b_ptr) = (a.device_ptr(stream).0, b.device_ptr(stream).0);
                let (t_ptr, counter, part, tickets, y_ptr) = (
                    self.t.device_ptr_mut(stream).0,
                    self.counter.device_ptr_mut(stream).0,
                    self.tc_part.device_ptr_mut(stream).0,
                    self.tc_tickets.device_ptr_mut(stream).0,
                    y.device_ptr_mut(stream).0,
                );
                let mut params = [
                    kernel_param(&x_ptr),
                    kernel_param(&batch_i),
                    kernel_param(&n_i),
                    kernel_param(&k_i),
                    kernel_param(&codes),
                    kernel_param(&scales),
                    kernel_param(&self.global),
                    kernel_param(&a_ptr),
                    kernel_param(&b_ptr),
                    kernel_param(&rank_i),
                    kernel_param(&scale),
                    kernel_param(&t_ptr),
                    kernel_param(&counter),
                    kernel_param(&target),
                    kernel_param(&shrink_i),
                    kernel_param(&slice_i),
                    kernel_param(&part),
                    kernel_param(&tickets),
                    kernel_param(&y_ptr),
                ];
                // Only the CUDA-core kernel waits before touching what the previous
                // kernel may use (griddep_wait in lora_decode.cu).
                let programmatic = backend.programmatic_launch
                    && plan.kind == DecodeKernel::CudaCore
                    && backend.major >= 9;
                // SAFETY: the parameters match `{format}_fused_b{NB}` and
                // `{format}_tcdec_fused_b{NB}` in lora_decode.cu, in order and type, and
                // outlive the call; t holds batch * rank floats (forward), tc_part the
                // plan's slices * 16 * rank, tc_tickets one per 16 rows of A up to
                // MAX_RANK; the grid is co-resident.
                unsafe {
                    launch_raw(
                        backend,
                        &function,
                        grid_1d(plan.shrink_blocks + plan.base_blocks, threads),
                        &mut params,
                        programmatic,
                    )
                }
                .map_err(&launch)?;
            }
            GpuMode::Unfused => {
                let (f, resident) = backend.decode_fn(&format!("{}_base_b{nb}", self.format))?;
                let base_blocks =
                    launch_plan::cuda_core_plan(self.n, batch, 0, resident).base_blocks;
                // With no cap on co-residency: a block per 4 row groups of the expand, per
                // 4 warps' rows of A for the shrink.
                let uncapped = launch_plan::cuda_core_plan(self.n, batch, rank, usize::MAX);
                let mut builder = stream.launch_builder(&f);
                builder
                    .arg(x)
                    .arg(&batch_i)
                    .arg(&n_i)
                    .arg(&k_i)
                    .arg(&self.codes)
                    .arg(&self.scales)
                    .arg(&self.global)
                    .arg(&mut *y);
                // SAFETY: matches `{format}_base_b{NB}`.
                unsafe { builder.launch(grid_1d(base_blocks, threads)) }.map_err(&launch)?;
                if let Some(l) = &self.lora {
                    let rank_i = as_i32(l.rank, "rank")?;
                    let (shrink, _) = backend.decode_fn(&format!("lora_shrink_b{nb}"))?;
                    let mut builder = stream.launch_builder(&shrink);
                    builder
                        .arg(x)
                        .arg(&batch_i)
                        .arg(&k_i)
                        .arg(&l.a)
                        .arg(&rank_i)
                        .arg(&l.scale)
                        .arg(&mut self.t);
                    // SAFETY: matches `lora_shrink_b{NB}`.
                    unsafe { builder.launch(grid_1d(uncapped.shrink_blocks, threads)) }
                        .map_err(&launch)?;
                    let (expand, _) = backend.decode_fn(&format!("lora_expand_b{nb}"))?;
                    let mut builder = stream.launch_builder(&expand);
                    builder
                        .arg(&self.t)
                        .arg(&batch_i)
                        .arg(&n_i)
                        .arg(&l.b)
                        .arg(&rank_i)
                        .arg(y);
                    // SAFETY: matches `lora_expand_b{NB}`.
                    unsafe { builder.launch(grid_1d(uncapped.base_blocks, threads)) }
                        .map_err(&launch)?;
                }
            }
        }
        Ok(())
    }

    fn forward_prefill(
        &mut self,
        backend: &CudaBackend,
        x: &CudaSlice<u16>,
        batch: usize,
        y: &mut CudaSlice<u16>,
        mode: GpuMode,
    ) -> Result<()> {
        let stream = &backend.stream;
        let launch = driver_err("launching a prefill kernel");
        let (m_i, n_i, k_i) = (
            as_i32(batch, "batch")?,
            as_i32(self.n, "out_dim")?,
            as_i32(self.k, "in_dim")?,
        );
        let grid = |cols: usize| LaunchConfig {
            grid_dim: (
                cols.div_ceil(TC_TILE) as u32,
                batch.div_ceil(TC_TILE) as u32,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let gemm = backend.prefill_fn(&format!("{}_tc_gemm", self.format))?;
        let zero_i = 0i32;
        let placeholder = &self.placeholder;
        // y = W x, plus the LoRA expand B t when `lora_b` is given (its rank), in one
        // `{format}_tc_gemm` launch.
        let base_gemm = |lora_b: Option<(&CudaSlice<u16>, i32)>,
                         t: &CudaSlice<f32>,
                         y: &mut CudaSlice<u16>|
         -> Result<()> {
            let (b, rank_i) = lora_b.unwrap_or((placeholder, 0));
            let mut builder = stream.launch_builder(&gemm);
            builder
                .arg(x)
                .arg(&m_i)
                .arg(&k_i)
                .arg(&self.codes)
                .arg(&self.scales)
                .arg(&self.global)
                .arg(&n_i)
                .arg(t)
                .arg(b)
                .arg(&rank_i)
                .arg(y)
                .arg(&zero_i);
            // SAFETY: matches `{format}_tc_gemm`; t holds batch * rank floats (written by
            // the shrink before), rank 0 skips the LoRA operands.
            unsafe { builder.launch(grid(self.n)) }.map_err(&launch)?;
            Ok(())
        };
        match &self.lora {
            None => base_gemm(None, &self.t, y)?,
            Some(l) => {
                let rank_i = as_i32(l.rank, "rank")?;
                // The tensor-core kernel scales the whole tile by the global scale, so the
                // fused path pre-divides the LoRA intermediate by it.
                let t_scale = match mode {
                    GpuMode::Fused | GpuMode::FusedTensorCoreDecode => l.scale / self.global,
                    GpuMode::Unfused => l.scale,
                };
                let shrink = backend.prefill_fn("lora_tc_shrink")?;
                let mut builder = stream.launch_builder(&shrink);
                builder
                    .arg(x)
                    .arg(&m_i)
                    .arg(&k_i)
                    .arg(&l.a)
                    .arg(&rank_i)
                    .arg(&t_scale)
                    .arg(&mut self.t);
                // SAFETY: matches `lora_tc_shrink`; t holds batch * rank floats.
                unsafe { builder.launch(grid(l.rank)) }.map_err(&launch)?;
                match mode {
                    GpuMode::Fused | GpuMode::FusedTensorCoreDecode => {
                        base_gemm(Some((&l.b, rank_i)), &self.t, y)?;
                    }
                    GpuMode::Unfused => {
                        base_gemm(None, &self.t, y)?;
                        let expand = backend.prefill_fn("bf16_tc_gemm")?;
                        let one = 1i32;
                        let unit = 1.0f32;
                        let mut builder = stream.launch_builder(&expand);
                        builder
                            .arg(x)
                            .arg(&m_i)
                            .arg(&zero_i)
                            .arg(placeholder)
                            .arg(placeholder)
                            .arg(&unit)
                            .arg(&n_i)
                            .arg(&self.t)
                            .arg(&l.b)
                            .arg(&rank_i)
                            .arg(y)
                            .arg(&one);
                        // SAFETY: matches `bf16_tc_gemm` with K = 0 (LoRA segment only),
                        // accumulating into y.
                        unsafe { builder.launch(grid(self.n)) }.map_err(&launch)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Convenience for tests: uploads f32 activations as bf16, runs, returns f32.
    pub fn forward_host(
        &mut self,
        backend: &CudaBackend,
        x: &[f32],
        batch: usize,
        mode: GpuMode,
    ) -> Result<Vec<f32>> {
        let xd = backend.upload_activations(x)?;
        let mut yd = backend.alloc_output(batch * self.n)?;
        self.forward(backend, &xd, batch, &mut yd, mode)?;
        backend.synchronize()?;
        backend.download(&yd)
    }
}

/// A linear on the CUDA backend behind [`crate::LoraLinear`] (what
/// [`crate::Backend::Cuda`] builds): each call uploads the f32 activations as bf16, runs
/// the fused kernels ([`GpuMode::Fused`]) and downloads the bf16 output as f32, so the
/// rest of a layer can stay on the host.
pub struct CudaLinear {
    device: Arc<CudaBackend>,
    linear: Mutex<GpuLinear>,
    in_dim: usize,
    out_dim: usize,
}

impl CudaLinear {
    /// Uploads `linear` to `device` (refusing what the GPU kernels cannot run).
    pub fn new(device: Arc<CudaBackend>, linear: &QuantLoraLinear) -> Result<Self> {
        let uploaded = device.upload(linear)?;
        Ok(Self {
            device,
            linear: Mutex::new(uploaded),
            in_dim: linear.in_dim(),
            out_dim: linear.out_dim(),
        })
    }
}

impl std::fmt::Debug for CudaLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLinear")
            .field("device", &self.device.device_name())
            .field("in_dim", &self.in_dim)
            .field("out_dim", &self.out_dim)
            .finish()
    }
}

impl crate::LoraLinear for CudaLinear {
    fn forward(&self, x: &[f32], batch: usize, y: &mut [f32]) -> Result<()> {
        if batch.checked_mul(self.out_dim) != Some(y.len()) {
            return Err(KernelError::OutputShape {
                batch,
                out_dim: self.out_dim,
                actual: y.len(),
            });
        }
        if batch.checked_mul(self.in_dim) != Some(x.len()) {
            return Err(KernelError::InputShape {
                batch,
                in_dim: self.in_dim,
                actual: x.len(),
            });
        }
        if batch == 0 {
            return Ok(());
        }
        // The linear's LoRA intermediate and release counter are per call: one call at a
        // time (the forward pass runs its linears in order anyway).
        let mut linear = self
            .linear
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let out = linear.forward_host(&self.device, x, batch, GpuMode::Fused)?;
        y.copy_from_slice(&out);
        Ok(())
    }

    fn in_dim(&self) -> usize {
        self.in_dim
    }

    fn out_dim(&self) -> usize {
        self.out_dim
    }
}
