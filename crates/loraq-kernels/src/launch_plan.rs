//! How the kernels of `kernels/` are launched for one forward of a linear: which
//! instantiation, how many shrink and base blocks, how the tensor-core shrink is sliced,
//! and the typed argument struct of each launch ([`crate::kernel_args`]). Pure
//! arithmetic on the shapes, the operands' device addresses and the number of
//! co-resident blocks: the CUDA launcher (`cuda.rs`, feature `cuda`) queues exactly the
//! launches [`ForwardPlan::launches`] returns, and the host emulation (the tests below,
//! which run the kernels on the CPU) runs the same launches.

use crate::error::{KernelError, Result};
use crate::kernel_args::{
    BaseDecodeArgs, DeviceAddress, FusedDecodeArgs, LaunchArgs, LoraExpandArgs, LoraShrinkArgs,
    TcGemmArgs,
};
use crate::linear::QuantLoraLinear;
use loraq_quant::{Nvfp4GlobalScale, QuantizedWeight};
use std::borrow::Cow;

/// Token counts the CUDA-core decode kernels are instantiated for (`ALL_FORMATS(NB)`).
pub(crate) const DECODE_BATCHES: [usize; 3] = [1, 4, 16];
/// Largest batch served by the decode kernels.
pub(crate) const DECODE_MAX_BATCH: usize = 16;
/// Threads of a decode block (`DECODE_WARPS` x 32 in lora_decode.cu).
pub(crate) const DECODE_THREADS: usize = 128;
/// Inputs per chunk of the tensor-core decode (`TC_CHUNK` in lora_decode.cu).
const TC_DECODE_CHUNK: usize = 128;
/// Chunks per slice of the tensor-core decode's shrink, when the grid has room.
const TC_SHRINK_SLICE_CHUNKS: usize = 8;

/// Which fused decode kernel a plan launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DecodeKernel {
    /// The CUDA-core kernel, `{format}_fused_b{NB}`.
    CudaCore,
    /// The tensor-core kernel, `{format}_tcdec_fused_b{NB}`.
    TensorCore,
}

impl DecodeKernel {
    /// The middle of the kernel's name in lora_decode.cu.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::CudaCore => "fused",
            Self::TensorCore => "tcdec_fused",
        }
    }
}

/// One fused decode launch: kernel `{format}_{kind}_b{nb}`, `shrink_blocks` blocks of
/// LoRA shrink first in the grid, then `base_blocks` of base stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FusedPlan {
    /// The CUDA-core or the tensor-core kernel.
    pub kind: DecodeKernel,
    /// The instantiation's token count.
    pub nb: usize,
    /// Blocks computing the LoRA shrink.
    pub shrink_blocks: usize,
    /// Blocks streaming the base.
    pub base_blocks: usize,
    /// Increments of the release counter the shrink makes when it is complete.
    pub releases: usize,
    /// Tensor-core decode: in-dim chunks per shrink slice (0 for the CUDA-core kernel).
    pub slice_chunks: usize,
    /// Tensor-core decode: slices of the shrink (its partial sums need `slices * 16 *
    /// rank` floats); 0 for the CUDA-core kernel.
    pub slices: usize,
}

/// The token count of the CUDA-core decode instantiation (`_b{NB}`: fused, base, LoRA
/// shrink and expand) serving `batch` tokens.
pub(crate) fn cuda_core_instance(batch: usize) -> usize {
    DECODE_BATCHES
        .iter()
        .copied()
        .find(|&b| b >= batch)
        .unwrap_or(DECODE_MAX_BATCH)
}

/// The CUDA-core fused decode (`{format}_fused_b{NB}`) of `batch` tokens (1..=16) over
/// an `n x k` weight with a rank-`rank` LoRA, `resident` blocks of it fitting on the
/// device at once.
pub(crate) fn cuda_core_plan(n: usize, batch: usize, rank: usize, resident: usize) -> FusedPlan {
    let nb = cuda_core_instance(batch);
    // Mirrors RowsPerWarp in lora_decode.cu.
    let rows_per_warp = if nb <= 4 { 2 } else { 1 };
    let rows_per_block = DECODE_THREADS / 32 * rows_per_warp;
    let shrink_blocks = rank.div_ceil(rows_per_block);
    FusedPlan {
        kind: DecodeKernel::CudaCore,
        nb,
        shrink_blocks,
        // Every block co-resident (the base blocks wait for the shrink), and no more
        // than one row group per warp.
        base_blocks: n
            .div_ceil(rows_per_block)
            .min(resident.saturating_sub(shrink_blocks).max(1)),
        // One release per shrink block.
        releases: shrink_blocks,
        slice_chunks: 0,
        slices: 0,
    }
}

/// The tensor-core decode (`{format}_tcdec_fused_b{8,16}`), or `None` where it does not
/// apply (rank not a multiple of 16, more than 16 tokens, or a shrink that would leave
/// no room for co-resident base blocks).
pub(crate) fn tensor_core_plan(
    n: usize,
    k: usize,
    batch: usize,
    rank: usize,
    resident: usize,
) -> Option<FusedPlan> {
    if !rank.is_multiple_of(16) || batch > 16 {
        return None;
    }
    let chunks = k.div_ceil(TC_DECODE_CHUNK);
    let rank_tiles = rank / 16;
    // The shrink is split over the in-dim into slices of about TC_SHRINK_SLICE_CHUNKS
    // chunks (two per warp) so it is done early in the base stream, using at most a
    // quarter of the co-resident blocks.
    let (slices, slice_chunks) = match (resident / 4).checked_div(rank_tiles) {
        None => (0, chunks),
        Some(most) => {
            let slices = chunks
                .div_ceil(TC_SHRINK_SLICE_CHUNKS)
                .clamp(1, most.max(1));
            let slice_chunks = chunks.div_ceil(slices);
            (chunks.div_ceil(slice_chunks), slice_chunks)
        }
    };
    let shrink_blocks = rank_tiles * slices;
    if shrink_blocks >= resident {
        return None;
    }
    // Every block gets the same number of 16-row tiles (the last may have fewer).
    let tiles = n.div_ceil(16);
    let per_block = tiles.div_ceil(resident - shrink_blocks);
    Some(FusedPlan {
        kind: DecodeKernel::TensorCore,
        nb: if batch <= 8 { 8 } else { 16 },
        shrink_blocks,
        base_blocks: tiles.div_ceil(per_block),
        // One release per 16 rows of A (by the block finishing its last slice).
        releases: rank_tiles,
        slice_chunks,
        slices,
    })
}

/// Which kernel sequence a forward of an uploaded linear runs.
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

/// The mode `CudaLinear` (the CUDA backend of [`crate::LoraLinear`]) runs.
pub(crate) const CUDA_LINEAR_MODE: GpuMode = GpuMode::Fused;

/// Threads of every block the linears launch (decode and prefill).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const BLOCK_THREADS: u32 = DECODE_THREADS as u32;
/// Output tile (rows and tokens) of the tensor-core prefill kernels.
const PREFILL_TILE: usize = 64;

/// The kernel-name prefix of a base weight format on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GpuFormat {
    /// bf16 values.
    Bf16,
    /// E4M3 codes with a 128 x 128 tile multiplier.
    Fp8Block128,
    /// NVFP4 codes with E4M3 block scales and a global multiplier.
    Nvfp4,
}

impl GpuFormat {
    /// The format's name in the kernels' entry points.
    pub(crate) fn kernel_prefix(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp8Block128 => "fp8b128",
            Self::Nvfp4 => "nvfp4",
        }
    }
}

/// What the launches need to know of a linear: base format and shape, global
/// multiplier, LoRA rank (0: none) and scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LinearGeometry {
    pub format: GpuFormat,
    pub out_features: usize,
    pub in_features: usize,
    pub w_global: f32,
    pub rank: usize,
    pub lora_scale: f32,
}

/// A linear's operands as the GPU kernels take them, still on the host: what `cuda.rs`
/// uploads and the host emulation hands the emulator. Building it refuses what the
/// kernels cannot run.
pub(crate) struct HostOperands<'a> {
    pub geometry: LinearGeometry,
    /// Base codes (bf16 values as little-endian bytes, E4M3 codes, packed E2M1).
    pub codes: Cow<'a, [u8]>,
    /// Base scales (fp8 tile multipliers as little-endian f32, NVFP4 E4M3 block scales;
    /// empty for bf16).
    pub scales: Cow<'a, [u8]>,
    /// LoRA A and B as bf16 bits (empty without LoRA).
    pub lora_a: Vec<u16>,
    pub lora_b: Vec<u16>,
}

impl<'a> HostOperands<'a> {
    /// The operands of `linear`; refuses MXFP4, INT4, fp8 layouts other than block128,
    /// in-dims that are not a multiple of 16 and activation fake-quant.
    pub(crate) fn new(linear: &'a QuantLoraLinear) -> Result<Self> {
        let refuse = |what: String| Err(KernelError::UnsupportedOnGpu { what });
        let (format, codes, scales, w_global) = match linear.base() {
            QuantizedWeight::Bf16(w) => (
                GpuFormat::Bf16,
                Cow::Owned(
                    w.data
                        .iter()
                        .flat_map(|v| v.to_bits().to_le_bytes())
                        .collect(),
                ),
                Cow::Borrowed(&[][..]),
                1.0,
            ),
            QuantizedWeight::Fp8(w) => (
                GpuFormat::Fp8Block128,
                Cow::Borrowed(&w.codes[..]),
                Cow::Owned(w.scales.iter().flat_map(|v| v.to_le_bytes()).collect()),
                1.0,
            ),
            QuantizedWeight::Nvfp4(w) => (
                GpuFormat::Nvfp4,
                Cow::Borrowed(&w.packed[..]),
                Cow::Borrowed(&w.block_scales[..]),
                // The kernels multiply by the global scale; a compressed-tensors divisor
                // becomes `1 / d`, one rounding more than the CPU path's division.
                match w.global_scale {
                    Nvfp4GlobalScale::Multiplier(g) => g,
                    Nvfp4GlobalScale::Divisor(d) => 1.0 / d,
                },
            ),
            QuantizedWeight::Mxfp4(_) => {
                return refuse("mxfp4 base weights (CPU path only)".into());
            }
            QuantizedWeight::Int4(_) => {
                return refuse("int4-g128 base weights (CPU path only)".into());
            }
            QuantizedWeight::Ggml(w) => {
                return refuse(format!("GGUF {} base weights (CPU path only)", w.ggml_type));
            }
        };
        let (out_features, in_features) = (linear.out_features(), linear.in_features());
        if !in_features.is_multiple_of(16) {
            return refuse(format!(
                "in-dim {in_features} (the GPU kernels need a multiple of 16)"
            ));
        }
        if !linear.activation_quant().is_identity() {
            return refuse("activation fake-quant (the GPU kernels take bf16 activations)".into());
        }
        let bits = |v: &[half::bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
        let (rank, lora_scale, lora_a, lora_b) = match linear.lora() {
            Some(l) => (l.rank, l.scale, bits(&l.a), bits(&l.b)),
            None => (0, 0.0, Vec::new(), Vec::new()),
        };
        Ok(Self {
            geometry: LinearGeometry {
                format,
                out_features,
                in_features,
                w_global,
                rank,
                lora_scale,
            },
            codes,
            scales,
            lora_a,
            lora_b,
        })
    }
}

/// Device addresses of a forward's operands and scratch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ForwardBuffers {
    /// bf16 activations `[batch, in_features]`.
    pub x: DeviceAddress,
    pub w_codes: DeviceAddress,
    pub w_scales: DeviceAddress,
    /// LoRA factors (the placeholder without LoRA).
    pub lora_a: DeviceAddress,
    pub lora_b: DeviceAddress,
    /// f32, at least [`ForwardPlan::t_floats`].
    pub t: DeviceAddress,
    /// The fused decode's release counter (u32).
    pub counter: DeviceAddress,
    /// f32, at least [`ForwardPlan::part_floats`].
    pub part: DeviceAddress,
    /// `MAX_RANK / 16` u32 tickets, all 0.
    pub tickets: DeviceAddress,
    /// bf16 output `[batch, out_features]`.
    pub y: DeviceAddress,
    /// Stands in for operands a launch never reads.
    pub placeholder: DeviceAddress,
}

/// Which module of `kernels/` a launch's kernel is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KernelModule {
    /// lora_decode.cu.
    Decode,
    /// lora_prefill.cu.
    Prefill,
}

/// One kernel launch: `grid` blocks of [`BLOCK_THREADS`] threads.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Launch {
    pub kernel: String,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub module: KernelModule,
    pub grid: (u32, u32),
    pub args: LaunchArgs,
    /// The kernel waits (`griddep_wait`) before it touches what the previous kernel on
    /// the stream may use, so it may start early under programmatic serialization.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub programmatic_safe: bool,
}

/// The launch sequence of one forward.
#[derive(Clone, Debug, PartialEq)]
enum Sequence {
    /// One fused decode launch (`{format}_{kind}_b{nb}`) laid out by `plan`.
    FusedDecode(FusedPlan),
    /// Decode base, then shrink and expand, `_b{nb}`; the base on `base_blocks`, the
    /// shrink and expand uncapped by co-residency.
    UnfusedDecode {
        nb: usize,
        base_blocks: usize,
        shrink_blocks: usize,
        expand_blocks: usize,
    },
    /// Prefill: tensor-core shrink, then base + expand (fused) or base and a separate
    /// expand (unfused).
    Prefill { fused: bool },
}

/// The launches of one forward of `batch` tokens through a linear, before the buffers
/// are bound: what scratch they need and how far they advance the release counter.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ForwardPlan {
    geometry: LinearGeometry,
    batch: usize,
    sequence: Sequence,
}

/// A size as the kernels' `int`, or the refusal naming it.
fn as_i32(v: usize, what: &'static str) -> Result<i32> {
    i32::try_from(v).map_err(|_| KernelError::UnsupportedOnGpu {
        what: format!("{what} = {v} exceeds i32"),
    })
}

fn blocks_u32(v: usize) -> Result<u32> {
    u32::try_from(v.max(1)).map_err(|_| KernelError::UnsupportedOnGpu {
        what: format!("a grid of {v} blocks"),
    })
}

impl ForwardPlan {
    /// Chooses the kernels for `batch` tokens (>= 1) in `mode`: the decode kernels up to
    /// [`DECODE_MAX_BATCH`] tokens, the tensor-core prefill above. `resident(kernel)` is
    /// how many blocks of that decode kernel the device holds at once.
    pub(crate) fn new(
        geometry: LinearGeometry,
        batch: usize,
        mode: GpuMode,
        mut resident: impl FnMut(&str) -> Result<usize>,
    ) -> Result<Self> {
        let (format, rank) = (geometry.format.kernel_prefix(), geometry.rank);
        let (out_features, in_features) = (geometry.out_features, geometry.in_features);
        let sequence = if batch > DECODE_MAX_BATCH {
            Sequence::Prefill {
                fused: mode != GpuMode::Unfused,
            }
        } else if mode == GpuMode::Unfused {
            let nb = cuda_core_instance(batch);
            let resident = resident(&format!("{format}_base_b{nb}"))?;
            // With no cap on co-residency: a block per 4 row groups of the expand, per 4
            // warps' rows of A for the shrink.
            let uncapped = cuda_core_plan(out_features, batch, rank, usize::MAX);
            Sequence::UnfusedDecode {
                nb,
                base_blocks: cuda_core_plan(out_features, batch, 0, resident).base_blocks,
                shrink_blocks: uncapped.shrink_blocks,
                expand_blocks: uncapped.base_blocks,
            }
        } else {
            let tensor_cores = if mode == GpuMode::FusedTensorCoreDecode {
                let tc_nb = if batch <= 8 { 8 } else { 16 };
                let name = format!("{format}_{}_b{tc_nb}", DecodeKernel::TensorCore.name());
                tensor_core_plan(out_features, in_features, batch, rank, resident(&name)?)
            } else {
                None
            };
            let plan = match tensor_cores {
                Some(plan) => plan,
                None => {
                    let nb = cuda_core_instance(batch);
                    let name = format!("{format}_{}_b{nb}", DecodeKernel::CudaCore.name());
                    cuda_core_plan(out_features, batch, rank, resident(&name)?)
                }
            };
            Sequence::FusedDecode(plan)
        };
        Ok(Self {
            geometry,
            batch,
            sequence,
        })
    }

    /// f32 elements the LoRA intermediate `t` needs.
    pub(crate) fn t_floats(&self) -> usize {
        self.batch * self.geometry.rank.max(1)
    }

    /// f32 elements of the tensor-core decode's per-slice partial sums (0 otherwise).
    pub(crate) fn part_floats(&self) -> usize {
        match &self.sequence {
            Sequence::FusedDecode(plan) => plan.slices * 16 * self.geometry.rank,
            _ => 0,
        }
    }

    /// Increments of the release counter the launches make.
    pub(crate) fn releases(&self) -> u32 {
        match &self.sequence {
            Sequence::FusedDecode(plan) => plan.releases as u32,
            _ => 0,
        }
    }

    /// The launches, in queue order, on `buffers`; `target` is the release counter's
    /// value once this forward's shrink is complete (its value before plus
    /// [`ForwardPlan::releases`], wrapping).
    pub(crate) fn launches(&self, buffers: &ForwardBuffers, target: u32) -> Result<Vec<Launch>> {
        let g = &self.geometry;
        let format = g.format.kernel_prefix();
        let batch = as_i32(self.batch, "batch")?;
        let out_features = as_i32(g.out_features, "out_features")?;
        let in_features = as_i32(g.in_features, "in_features")?;
        let rank = as_i32(g.rank, "rank")?;
        let b = buffers;
        // A launch no programmatic serialization may start early.
        let plain = |kernel: String, module, grid, args| Launch {
            kernel,
            module,
            grid,
            args,
            programmatic_safe: false,
        };
        let shrink = |t_scale| {
            LaunchArgs::LoraShrink(LoraShrinkArgs {
                x: b.x,
                lora_a: b.lora_a,
                t: b.t,
                batch,
                in_features,
                rank,
                t_scale,
            })
        };
        let mut launches = Vec::new();
        match &self.sequence {
            Sequence::FusedDecode(plan) => launches.push(Launch {
                kernel: format!("{format}_{}_b{}", plan.kind.name(), plan.nb),
                module: KernelModule::Decode,
                grid: (blocks_u32(plan.shrink_blocks + plan.base_blocks)?, 1),
                args: LaunchArgs::FusedDecode(FusedDecodeArgs {
                    x: b.x,
                    w_codes: b.w_codes,
                    w_scales: b.w_scales,
                    lora_a: b.lora_a,
                    lora_b: b.lora_b,
                    t: b.t,
                    counter: b.counter,
                    part: b.part,
                    tickets: b.tickets,
                    y: b.y,
                    batch,
                    out_features,
                    in_features,
                    rank,
                    w_global: g.w_global,
                    t_scale: g.lora_scale,
                    target,
                    shrink_blocks: as_i32(plan.shrink_blocks, "shrink blocks")?,
                    slice_chunks: as_i32(plan.slice_chunks, "shrink slice")?,
                }),
                // Only the CUDA-core kernel waits before touching what the previous
                // kernel may use (griddep_wait in lora_decode.cu).
                programmatic_safe: plan.kind == DecodeKernel::CudaCore,
            }),
            &Sequence::UnfusedDecode {
                nb,
                base_blocks,
                shrink_blocks,
                expand_blocks,
            } => {
                let base = BaseDecodeArgs {
                    x: b.x,
                    w_codes: b.w_codes,
                    w_scales: b.w_scales,
                    y: b.y,
                    batch,
                    out_features,
                    in_features,
                    w_global: g.w_global,
                };
                launches.push(plain(
                    format!("{format}_base_b{nb}"),
                    KernelModule::Decode,
                    (blocks_u32(base_blocks)?, 1),
                    LaunchArgs::BaseDecode(base),
                ));
                if g.rank > 0 {
                    launches.push(plain(
                        format!("lora_shrink_b{nb}"),
                        KernelModule::Decode,
                        (blocks_u32(shrink_blocks)?, 1),
                        shrink(g.lora_scale),
                    ));
                    let expand = LoraExpandArgs {
                        t: b.t,
                        lora_b: b.lora_b,
                        y: b.y,
                        batch,
                        out_features,
                        rank,
                    };
                    launches.push(plain(
                        format!("lora_expand_b{nb}"),
                        KernelModule::Decode,
                        (blocks_u32(expand_blocks)?, 1),
                        LaunchArgs::LoraExpand(expand),
                    ));
                }
            }
            &Sequence::Prefill { fused } => {
                let tiles = |columns: usize| -> Result<(u32, u32)> {
                    Ok((
                        blocks_u32(columns.div_ceil(PREFILL_TILE))?,
                        blocks_u32(self.batch.div_ceil(PREFILL_TILE))?,
                    ))
                };
                if g.rank > 0 {
                    // The tensor-core kernel scales the whole tile by the global scale,
                    // so the fused pass pre-divides the LoRA intermediate by it.
                    let t_scale = if fused {
                        g.lora_scale / g.w_global
                    } else {
                        g.lora_scale
                    };
                    launches.push(plain(
                        "lora_tc_shrink".into(),
                        KernelModule::Prefill,
                        tiles(g.rank)?,
                        shrink(t_scale),
                    ));
                }
                // y = W x, plus the LoRA expand B t in the same pass when fused.
                let (lora_b, lora_rank) = if fused && g.rank > 0 {
                    (b.lora_b, rank)
                } else {
                    (b.placeholder, 0)
                };
                let gemm = TcGemmArgs {
                    x: b.x,
                    w_codes: b.w_codes,
                    w_scales: b.w_scales,
                    t: b.t,
                    lora_b,
                    y: b.y,
                    batch,
                    in_features,
                    out_features,
                    rank: lora_rank,
                    accumulate: 0,
                    w_global: g.w_global,
                };
                let grid = tiles(g.out_features)?;
                launches.push(plain(
                    format!("{format}_tc_gemm"),
                    KernelModule::Prefill,
                    grid,
                    LaunchArgs::TcGemm(gemm),
                ));
                if !fused && g.rank > 0 {
                    // The expand alone: in-features 0 skips the base product, and y
                    // is accumulated into.
                    let expand = TcGemmArgs {
                        w_codes: b.placeholder,
                        w_scales: b.placeholder,
                        lora_b: b.lora_b,
                        in_features: 0,
                        rank,
                        accumulate: 1,
                        w_global: 1.0,
                        ..gemm
                    };
                    launches.push(plain(
                        "bf16_tc_gemm".into(),
                        KernelModule::Prefill,
                        grid,
                        LaunchArgs::TcGemm(expand),
                    ));
                }
            }
        }
        Ok(launches)
    }
}

/// The kernels run on the CPU through `host_emulation/` (g++ compiles `kernels/*.cu`
/// against stand-ins for the CUDA headers; one thread per CUDA thread, real barriers,
/// warp-collective mma and shuffles), in the launch sequences `cuda.rs` queues, the
/// decode laid out by the plans above on a small device (few co-resident blocks, so
/// blocks take several tiles and the tensor-core shrink several slices), against the
/// f64 reference. Checks the kernels' logic wherever a C++ compiler exists, without a
/// GPU; the memory model and the real compiler's code are left to `tests/gpu.rs` on a
/// device.
#[cfg(test)]
mod host_emulation {
    use super::*;
    use crate::kernel_args::FieldType;
    use crate::{LoraAdapter, MAX_RANK};
    use half::bf16;
    use loraq_quant::{Bf16Weight, Fp8Granularity, Fp8Weight, Nvfp4Weight};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::sync::OnceLock;

    /// Co-resident blocks of the emulated device.
    const RESIDENT: usize = 24;

    /// Kernel variants the emulator is built for: the defaults, and the decode lane steps
    /// `scripts/gpu-check.sh` times beside them (fp8 in 32-byte steps, NVFP4 in 8-byte
    /// steps), so a variant that may become the default is checked too.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Variant {
        Default,
        AlternateLaneSteps,
    }

    impl Variant {
        fn defines(self) -> &'static [&'static str] {
            match self {
                Variant::Default => &[],
                Variant::AlternateLaneSteps => &["-DLORAQ_FP8_PIECES=2", "-DLORAQ_NVFP4_PIECES=1"],
            }
        }
    }

    /// The emulator, built once per version of its sources and variant (kept in the
    /// system's temp directory under a hash of both); `None` (with the reason printed)
    /// where no C++20 compiler runs.
    fn emulator(variant: Variant) -> Option<&'static Path> {
        static DEFAULT: OnceLock<Option<PathBuf>> = OnceLock::new();
        static ALTERNATE: OnceLock<Option<PathBuf>> = OnceLock::new();
        let built = match variant {
            Variant::Default => &DEFAULT,
            Variant::AlternateLaneSteps => &ALTERNATE,
        };
        built
            .get_or_init(|| {
                use std::hash::{Hash, Hasher};
                let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
                let emulation = crate_dir.join("host_emulation");
                let kernels = crate_dir.join("../../kernels");
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                variant.defines().hash(&mut hasher);
                // Every source of the emulator: a change to any rebuilds it.
                for dir in [&emulation, &kernels] {
                    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                        .unwrap()
                        .map(|e| e.unwrap().path())
                        .collect();
                    files.sort();
                    for file in files {
                        file.hash(&mut hasher);
                        std::fs::read(&file).unwrap().hash(&mut hasher);
                    }
                }
                let dir = std::env::temp_dir()
                    .join(format!("loraq-host-emulation-{:016x}", hasher.finish()));
                std::fs::create_dir_all(&dir).unwrap();
                let exe = dir.join("emulator");
                if exe.exists() {
                    return Some(exe);
                }
                let partial = dir.join(format!("emulator.{}", std::process::id()));
                let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
                let built = Command::new(&cxx)
                    .args(["-std=c++20", "-O1", "-pthread", "-w"])
                    .args(variant.defines())
                    .arg("-I")
                    .arg(&emulation)
                    .arg("-I")
                    .arg(&kernels)
                    .arg(emulation.join("emulator.cpp"))
                    .arg("-o")
                    .arg(&partial)
                    .output();
                match built {
                    Ok(out) if out.status.success() => {
                        std::fs::rename(&partial, &exe).unwrap();
                        Some(exe)
                    }
                    Ok(out) => panic!(
                        "{cxx} failed to build the kernel emulator:\n{}",
                        String::from_utf8_lossy(&out.stderr)
                    ),
                    Err(e) => {
                        eprintln!("skipped: no C++ compiler ({cxx}: {e})");
                        None
                    }
                }
            })
            .as_deref()
    }

    fn bf16s(rng: &mut ChaCha8Rng, len: usize, range: f32) -> Vec<bf16> {
        (0..len)
            .map(|_| bf16::from_f32(rng.random_range(-range..range)))
            .collect()
    }

    fn random_linear(format: &str, n: usize, k: usize, rank: usize, seed: u64) -> QuantLoraLinear {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let base = match format {
            "bf16" => QuantizedWeight::Bf16(Bf16Weight {
                out_features: n,
                in_features: k,
                data: bf16s(&mut rng, n * k, 0.05),
            }),
            "fp8b128" => {
                let codes = (0..n * k)
                    .map(|_| rng.random::<u8>())
                    .map(|b| if b & 0x7F == 0x7F { b ^ 1 } else { b })
                    .collect();
                let scales = (0..n.div_ceil(128) * k.div_ceil(128))
                    .map(|_| rng.random_range(1e-3f32..1e-2))
                    .collect();
                QuantizedWeight::Fp8(Fp8Weight {
                    out_features: n,
                    in_features: k,
                    granularity: Fp8Granularity::Block128,
                    codes,
                    scales,
                })
            }
            _ => {
                let packed = (0..n * k / 2).map(|_| rng.random()).collect();
                // E4M3 block scales: zero, subnormals, normals up to 16, either sign.
                let scales = (0..n * k / 16)
                    .map(|_| rng.random_range(0u8..0x60) | (rng.random::<u8>() & 0x80))
                    .collect();
                let global = rng.random_range(1e-3f32..1e-1);
                QuantizedWeight::Nvfp4(Nvfp4Weight {
                    out_features: n,
                    in_features: k,
                    packed,
                    block_scales: scales,
                    global_scale: Nvfp4GlobalScale::Multiplier(global),
                })
            }
        };
        let lora = (rank > 0).then(|| {
            let a = bf16s(&mut rng, rank * k, 0.05);
            let b = bf16s(&mut rng, n * rank, 0.05);
            LoraAdapter::new(rank, k, n, a, b, 0.5).unwrap()
        });
        QuantLoraLinear::new(base, lora).unwrap()
    }

    fn bf16_bytes(v: &[u16]) -> Vec<u8> {
        v.iter().flat_map(|b| b.to_le_bytes()).collect()
    }

    /// Buffers and a sequence of launches for the emulator (its input format); a
    /// buffer's [`DeviceAddress`] is its index.
    #[derive(Default)]
    struct Job {
        buffers: Vec<Vec<u8>>,
        launches: Vec<u8>,
        count: u32,
    }

    impl Job {
        fn buffer(&mut self, bytes: Vec<u8>) -> DeviceAddress {
            self.buffers.push(bytes);
            DeviceAddress(self.buffers.len() as u64 - 1)
        }

        fn zeros(&mut self, bytes: usize) -> DeviceAddress {
            self.buffer(vec![0; bytes])
        }

        /// Queues `launch` as `cuda.rs` would: its kernel, grid and argument struct,
        /// with the offsets of the struct's pointer fields for the emulator to relocate.
        fn launch(&mut self, launch: &Launch) {
            let l = &mut self.launches;
            l.extend_from_slice(&(launch.kernel.len() as u32).to_le_bytes());
            l.extend_from_slice(launch.kernel.as_bytes());
            l.extend_from_slice(&launch.grid.0.to_le_bytes());
            l.extend_from_slice(&launch.grid.1.to_le_bytes());
            let bytes = launch.args.to_bytes();
            l.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            l.extend_from_slice(&bytes);
            let pointers: Vec<u32> = launch
                .args
                .fields()
                .iter()
                .filter(|f| f.field_type == FieldType::Pointer)
                .map(|f| f.offset as u32)
                .collect();
            l.extend_from_slice(&(pointers.len() as u32).to_le_bytes());
            for offset in pointers {
                l.extend_from_slice(&offset.to_le_bytes());
            }
            self.count += 1;
        }

        /// Runs the launches; returns buffer `output`. `checks`: buffers whose first
        /// word must then equal the value and every other word 0.
        fn run(
            self,
            exe: &Path,
            tag: &str,
            output: DeviceAddress,
            checks: &[(DeviceAddress, u32)],
        ) -> Vec<u8> {
            let index = |a: DeviceAddress| a.0 as u32;
            let mut input = Vec::new();
            input.extend_from_slice(&(self.buffers.len() as u32).to_le_bytes());
            for b in &self.buffers {
                input.extend_from_slice(&(b.len() as u64).to_le_bytes());
                input.extend_from_slice(b);
            }
            input.extend_from_slice(&self.count.to_le_bytes());
            input.extend_from_slice(&self.launches);
            input.extend_from_slice(&index(output).to_le_bytes());
            input.extend_from_slice(&(checks.len() as u32).to_le_bytes());
            for &(buffer, expected) in checks {
                input.extend_from_slice(&index(buffer).to_le_bytes());
                input.extend_from_slice(&expected.to_le_bytes());
            }
            let dir = exe.parent().unwrap();
            let stem = format!(
                "{}-{}",
                tag.replace([' ', '=', '/', '(', ')', ',', ':', '{', '}'], "_"),
                std::process::id()
            );
            let (in_path, out_path) = (
                dir.join(format!("{stem}.in")),
                dir.join(format!("{stem}.out")),
            );
            std::fs::write(&in_path, input).unwrap();
            let out = Command::new(exe)
                .arg(&in_path)
                .arg(&out_path)
                .output()
                .unwrap();
            std::fs::remove_file(&in_path).unwrap();
            assert!(
                out.status.success(),
                "{tag}: emulator failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let bytes = std::fs::read(&out_path).unwrap();
            std::fs::remove_file(&out_path).unwrap();
            bytes
        }
    }

    /// Runs a forward of `linear` on `x` (`batch` tokens, bf16 values) in `mode` in the
    /// emulator, through the operands, plan and launches `cuda.rs` uses (on a device of
    /// [`RESIDENT`] co-resident blocks); returns y as f32 and the kernels launched.
    fn run(
        exe: &Path,
        mode: GpuMode,
        linear: &QuantLoraLinear,
        x: &[f32],
        batch: usize,
    ) -> (Vec<f32>, Vec<String>) {
        let operands = HostOperands::new(linear).unwrap();
        let geometry = operands.geometry;
        let plan = ForwardPlan::new(geometry, batch, mode, |_| Ok(RESIDENT)).unwrap();
        let mut job = Job::default();
        let x_bits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let x = job.buffer(bf16_bytes(&x_bits));
        let w_codes = job.buffer(operands.codes.into_owned());
        let w_scales = job.buffer(operands.scales.into_owned());
        let lora_a = job.buffer(bf16_bytes(&operands.lora_a));
        let lora_b = job.buffer(bf16_bytes(&operands.lora_b));
        let t = job.zeros(4 * plan.t_floats());
        let counter = job.zeros(4);
        let part = job.zeros(4 * plan.part_floats());
        let tickets = job.zeros(4 * MAX_RANK.div_ceil(16));
        let y = job.zeros(2 * batch * geometry.out_features);
        let placeholder = job.zeros(16);
        let buffers = ForwardBuffers {
            x,
            w_codes,
            w_scales,
            lora_a,
            lora_b,
            t,
            counter,
            part,
            tickets,
            y,
            placeholder,
        };
        let launches = plan.launches(&buffers, plan.releases()).unwrap();
        for launch in &launches {
            job.launch(launch);
        }
        let kernels: Vec<String> = launches.iter().map(|l| l.kernel.clone()).collect();
        let tag = format!(
            "{} {}x{} r={} batch={batch} {mode:?} {}",
            geometry.format.kernel_prefix(),
            geometry.out_features,
            geometry.in_features,
            geometry.rank,
            kernels.join("+")
        );
        // The release counter reached its target, the shrink tickets are back at 0.
        let checks = [(counter, plan.releases()), (tickets, 0)];
        let bytes = job.run(exe, &tag, y, &checks);
        let y = bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect();
        (y, kernels)
    }

    /// Every output within bf16 rounding of |y| plus 2^-8 of the magnitude sum (the
    /// GPU test's tolerance); returns the failures.
    fn compare(tag: &str, got: &[f32], want: &[f32], magnitude: &[f64]) -> Option<String> {
        let bad: Vec<String> = got
            .iter()
            .zip(want)
            .zip(magnitude)
            .enumerate()
            .filter_map(|(i, ((&g, &w), &m))| {
                let tol = (m + f64::from(w.abs())) / 256.0 + 1e-6;
                let err = (f64::from(g) - f64::from(w)).abs();
                (err.is_nan() || err > tol).then(|| format!("output {i}: {g} vs {w}"))
            })
            .collect();
        (!bad.is_empty()).then(|| {
            format!(
                "{tag}: {} of {} outputs off, first {}",
                bad.len(),
                got.len(),
                bad[0]
            )
        })
    }

    /// Which kernels a checked configuration must have launched.
    #[derive(Clone, Copy, Debug)]
    enum Expect {
        /// Whatever the plan chooses.
        Any,
        /// The fused decode of this kind, where the plan could choose it.
        Fused(DecodeKernel),
    }

    fn check(
        mode: GpuMode,
        expect: Expect,
        ranks: &[usize],
        batches: &[usize],
        shapes: &[(usize, usize)],
    ) {
        check_variant(Variant::Default, mode, expect, ranks, batches, shapes);
    }

    fn check_variant(
        variant: Variant,
        mode: GpuMode,
        expect: Expect,
        ranks: &[usize],
        batches: &[usize],
        shapes: &[(usize, usize)],
    ) {
        let Some(exe) = emulator(variant) else {
            return;
        };
        let mut failures = Vec::new();
        let mut checked = 0;
        for format in ["bf16", "fp8b128", "nvfp4"] {
            for &(n, k) in shapes {
                for &rank in ranks {
                    let linear = random_linear(format, n, k, rank, 7 + rank as u64);
                    for &batch in batches {
                        let mut rng = ChaCha8Rng::seed_from_u64(batch as u64);
                        let x: Vec<f32> = (0..batch * k)
                            .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_f32())
                            .collect();
                        let (got, kernels) = run(exe, mode, &linear, &x, batch);
                        let tag = format!(
                            "{format} {n}x{k} r={rank} batch={batch} {mode:?} {}",
                            kernels.join("+")
                        );
                        if let Expect::Fused(kind) = expect {
                            let wanted = format!("{format}_{}_b", kind.name());
                            let applies = kind == DecodeKernel::CudaCore
                                || tensor_core_plan(n, k, batch, rank, RESIDENT).is_some();
                            assert_eq!(
                                kernels.len() == 1 && kernels[0].starts_with(&wanted),
                                applies,
                                "{tag}: expected {wanted}*"
                            );
                        }
                        let (want, magnitude) =
                            linear.forward_reference_with_magnitude(&x, batch).unwrap();
                        failures.extend(compare(&tag, &got, &want, &magnitude));
                        checked += 1;
                    }
                }
            }
        }
        eprintln!(
            "{checked} emulated runs of {mode:?}, {} failed",
            failures.len()
        );
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        assert!(checked > 0);
    }

    #[test]
    fn tensor_core_decode_matches_reference() {
        // Rank 48 at in-dim 1040 splits the shrink into 2 slices; 200 and 129 rows leave
        // a partial 16-row tile; in-dims 272 and 1040 a partial 128-wide chunk.
        let shapes = [(200, 272), (129, 1040)];
        check(
            GpuMode::FusedTensorCoreDecode,
            Expect::Fused(DecodeKernel::TensorCore),
            &[0, 48, 256],
            &[1, 6, 9, 16],
            &shapes,
        );
    }

    #[test]
    fn cuda_core_decode_matches_reference() {
        check(
            GpuMode::Fused,
            Expect::Fused(DecodeKernel::CudaCore),
            &[0, 37, 256],
            &[1, 3, 16],
            &[(200, 272)],
        );
        check(
            GpuMode::Unfused,
            Expect::Any,
            &[0, 37],
            &[1, 16],
            &[(129, 1040)],
        );
        // In-dim 2112 (K % 64 == 0, three 1024-wide NVFP4 steps, the last partial):
        // NVFP4's 16-byte copies and block-scale words through the ring, which the
        // in-dims above (K % 64 == 16) do not take.
        check(
            GpuMode::Fused,
            Expect::Fused(DecodeKernel::CudaCore),
            &[0, 256],
            &[1, 16],
            &[(72, 2112)],
        );
    }

    /// The lane-step variants of the CUDA-core decode (fp8 in 32-byte steps, NVFP4 in
    /// 8-byte steps): ragged and aligned in-dims, fused and unfused.
    #[test]
    fn alternate_lane_steps_match_reference() {
        check_variant(
            Variant::AlternateLaneSteps,
            GpuMode::Fused,
            Expect::Fused(DecodeKernel::CudaCore),
            &[0, 37],
            &[1, 16],
            &[(200, 272), (72, 2112)],
        );
        check_variant(
            Variant::AlternateLaneSteps,
            GpuMode::Unfused,
            Expect::Any,
            &[0],
            &[1],
            &[(129, 1040)],
        );
    }

    #[test]
    fn prefill_matches_reference() {
        for mode in [GpuMode::Fused, GpuMode::Unfused] {
            check(mode, Expect::Any, &[0, 37, 256], &[17, 100], &[(200, 272)]);
        }
    }

    /// The mode `CudaLinear` runs (what `loraq run --device cuda` launches), from one
    /// token to a prefill, with and without LoRA, including the NVFP4 global scale as a
    /// compressed-tensors divisor (which the launcher turns into a multiplier).
    #[test]
    fn cuda_linear_mode_matches_reference() {
        check(
            CUDA_LINEAR_MODE,
            Expect::Any,
            &[0, 16],
            &[1, 5, 16, 40],
            &[(96, 160)],
        );
        let Some(exe) = emulator(Variant::Default) else {
            return;
        };
        let mut linear = random_linear("nvfp4", 64, 128, 16, 3);
        if let QuantizedWeight::Nvfp4(w) = linear.base() {
            let mut w = w.clone();
            w.global_scale = Nvfp4GlobalScale::Divisor(64.0);
            let lora = linear.lora().cloned();
            linear = QuantLoraLinear::new(QuantizedWeight::Nvfp4(w), lora).unwrap();
        }
        let x: Vec<f32> = (0..2 * 128)
            .map(|i| bf16::from_f32((i as f32 * 0.37).sin()).to_f32())
            .collect();
        let (got, kernels) = run(exe, CUDA_LINEAR_MODE, &linear, &x, 2);
        let (want, magnitude) = linear.forward_reference_with_magnitude(&x, 2).unwrap();
        assert_eq!(kernels, ["nvfp4_fused_b4"]);
        assert_eq!(compare("divisor", &got, &want, &magnitude), None);
    }

    /// What the GPU kernels cannot run is refused when the operands are built, before
    /// anything is uploaded or launched.
    #[test]
    fn operands_refuse_what_the_kernels_cannot_run() {
        let ragged = random_linear("bf16", 8, 40, 0, 1);
        let message = HostOperands::new(&ragged).err().unwrap().to_string();
        assert!(message.contains("in-dim 40"), "{message}");
        let quantized = random_linear("bf16", 8, 64, 0, 1)
            .with_activation_quant(loraq_quant::ActivationQuant::Fp8PerToken);
        let message = HostOperands::new(&quantized).err().unwrap().to_string();
        assert!(message.contains("activation fake-quant"), "{message}");
        // A GGUF base's block types run on the CPU path only: refused, never decoded.
        let values: Vec<f32> = (0..8 * 64).map(|i| (i % 7) as f32 * 0.01).collect();
        let q8_0 = loraq_quant::GgmlWeight::quantize(
            "w",
            loraq_quant::ggml::GgmlType::Q8_0,
            8,
            64,
            &values,
        )
        .unwrap();
        let gguf = QuantLoraLinear::new(QuantizedWeight::Ggml(q8_0), None).unwrap();
        let message = HostOperands::new(&gguf).err().unwrap().to_string();
        assert!(message.contains("GGUF Q8_0 base weights"), "{message}");
    }

    #[test]
    fn plans_lay_out_the_small_device() {
        // Rank 48 at in-dim 1040: the shrink in 2 slices; rank 256: 16 shrink blocks
        // leave 8 for 13 tiles, so base blocks take 2 tiles each. The emulation above
        // runs both.
        let sliced = tensor_core_plan(200, 1040, 6, 48, RESIDENT).unwrap();
        assert_eq!((sliced.slices, sliced.shrink_blocks), (2, 6), "{sliced:?}");
        let tiled = tensor_core_plan(200, 1040, 6, 256, RESIDENT).unwrap();
        assert_eq!(
            (tiled.shrink_blocks, tiled.base_blocks),
            (16, 7),
            "{tiled:?}"
        );
        assert_eq!(tensor_core_plan(200, 1040, 6, 8, RESIDENT), None);
        assert_eq!(cuda_core_plan(200, 3, 37, RESIDENT).nb, 4);
    }
}
