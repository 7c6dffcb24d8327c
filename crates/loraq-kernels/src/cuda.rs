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
use crate::kernel_args::DeviceAddress;
use crate::launch_plan::{
    self, BLOCK_THREADS, CUDA_LINEAR_MODE, ForwardBuffers, ForwardPlan, HostOperands, KernelModule,
    LinearGeometry,
};
use crate::linear::QuantLoraLinear;
use crate::lora::MAX_RANK;
use crate::nvrtc::{KERNELS, KernelSource, Nvrtc, NvrtcLocation};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg, sys,
};
use cudarc::nvrtc::Ptx;
use half::bf16;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Environment variable naming a directory of precompiled cubins (see
/// [`CudaBackend::from_cubin_dir`]).
pub const CUBIN_DIR_ENV: &str = "LORAQ_CUBIN_DIR";

pub use crate::launch_plan::GpuMode;

/// Largest batch of the decode kernels; larger batches use the tensor-core kernels.
pub const DECODE_MAX_BATCH: usize = launch_plan::DECODE_MAX_BATCH;

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
                    .occupancy_max_active_blocks_per_multiprocessor(BLOCK_THREADS, 0, None)
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
        let operands = HostOperands::new(linear)?;
        let scales = if operands.scales.is_empty() {
            s.alloc_zeros::<u8>(4).map_err(&up)?
        } else {
            s.clone_htod(&operands.scales[..]).map_err(&up)?
        };
        let lora = match linear.lora() {
            Some(_) => Some(GpuLora {
                a: s.clone_htod(&operands.lora_a).map_err(&up)?,
                b: s.clone_htod(&operands.lora_b).map_err(&up)?,
            }),
            None => None,
        };
        Ok(GpuLinear {
            geometry: operands.geometry,
            codes: s.clone_htod(&operands.codes[..]).map_err(&up)?,
            scales,
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
}

/// A linear resident on the device.
pub struct GpuLinear {
    /// Format, shape, global multiplier, LoRA rank and scale.
    geometry: LinearGeometry,
    codes: CudaSlice<u8>,
    scales: CudaSlice<u8>,
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
    /// (`[batch, out]`), queued on the backend's stream: the launches of
    /// [`ForwardPlan::launches`], each kernel given its argument struct.
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
        let (out_features, in_features) = (self.geometry.out_features, self.geometry.in_features);
        if x.len() < batch * in_features || y.len() < batch * out_features {
            return Err(KernelError::InputShape {
                batch,
                in_features,
                actual: x.len(),
            });
        }
        let stream = &backend.stream;
        let plan = ForwardPlan::new(self.geometry, batch, mode, |kernel| {
            backend.decode_fn(kernel).map(|(_, resident)| resident)
        })?;
        self.ensure_t(stream, plan.t_floats())?;
        if self.tc_part.len() < plan.part_floats() {
            self.tc_part = stream
                .alloc_zeros::<f32>(plan.part_floats())
                .map_err(driver_err("allocating the shrink's partial sums"))?;
        }
        self.counter_value = self.counter_value.wrapping_add(plan.releases());
        let (a, b) = match &self.lora {
            Some(l) => (&l.a, &l.b),
            None => (&self.placeholder, &self.placeholder),
        };
        // Event tracking is off (with_images), so taking the addresses records nothing.
        let address = |ptr: u64| DeviceAddress(ptr);
        let buffers = ForwardBuffers {
            x: address(x.device_ptr(stream).0),
            w_codes: address(self.codes.device_ptr(stream).0),
            w_scales: address(self.scales.device_ptr(stream).0),
            lora_a: address(a.device_ptr(stream).0),
            lora_b: address(b.device_ptr(stream).0),
            t: address(self.t.device_ptr_mut(stream).0),
            counter: address(self.counter.device_ptr_mut(stream).0),
            part: address(self.tc_part.device_ptr_mut(stream).0),
            tickets: address(self.tc_tickets.device_ptr_mut(stream).0),
            y: address(y.device_ptr_mut(stream).0),
            placeholder: address(self.placeholder.device_ptr(stream).0),
        };
        let launch_err = driver_err("launching a kernel");
        for mut launch in plan.launches(&buffers, self.counter_value)? {
            let function = match launch.module {
                KernelModule::Decode => backend.decode_fn(&launch.kernel)?.0,
                KernelModule::Prefill => backend.prefill_fn(&launch.kernel)?,
            };
            let programmatic =
                launch.programmatic_safe && backend.programmatic_launch && backend.major >= 9;
            let config = LaunchConfig {
                grid_dim: (launch.grid.0, launch.grid.1, 1),
                block_dim: (BLOCK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut params = [launch.args.as_kernel_param()];
            // SAFETY: each kernel takes exactly one parameter, the argument struct its
            // `LaunchArgs` variant holds (kernel_args.rs, laid out as its C twin in
            // loraq_common.cuh, which tests/nvrtc_compile.rs asserts); `launch` outlives
            // the call. The buffers hold what the plan sized: t its t_floats, tc_part its
            // part_floats, tc_tickets one per 16 rows of A up to MAX_RANK; a fused
            // decode's grid is co-resident.
            unsafe { launch_raw(backend, &function, config, &mut params, programmatic) }
                .map_err(&launch_err)?;
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
        let mut yd = backend.alloc_output(batch * self.geometry.out_features)?;
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
    in_features: usize,
    out_features: usize,
}

impl CudaLinear {
    /// Uploads `linear` to `device` (refusing what the GPU kernels cannot run).
    pub fn new(device: Arc<CudaBackend>, linear: &QuantLoraLinear) -> Result<Self> {
        let uploaded = device.upload(linear)?;
        Ok(Self {
            device,
            linear: Mutex::new(uploaded),
            in_features: linear.in_features(),
            out_features: linear.out_features(),
        })
    }
}

impl std::fmt::Debug for CudaLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLinear")
            .field("device", &self.device.device_name())
            .field("in_features", &self.in_features)
            .field("out_features", &self.out_features)
            .finish()
    }
}

impl crate::LoraLinear for CudaLinear {
    fn forward(&self, x: &[f32], batch: usize, y: &mut [f32]) -> Result<()> {
        if batch.checked_mul(self.out_features) != Some(y.len()) {
            return Err(KernelError::OutputShape {
                batch,
                out_features: self.out_features,
                actual: y.len(),
            });
        }
        if batch.checked_mul(self.in_features) != Some(x.len()) {
            return Err(KernelError::InputShape {
                batch,
                in_features: self.in_features,
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
        let out = linear.forward_host(&self.device, x, batch, CUDA_LINEAR_MODE)?;
        y.copy_from_slice(&out);
        Ok(())
    }

    fn in_features(&self) -> usize {
        self.in_features
    }

    fn out_features(&self) -> usize {
        self.out_features
    }
}
