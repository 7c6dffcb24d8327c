//! How the fused decode kernels of `kernels/lora_decode.cu` are laid out on the device:
//! which instantiation, how many shrink and base blocks, how the tensor-core shrink is
//! sliced. Pure arithmetic on the shapes and the number of co-resident blocks, so the
//! CUDA launcher (`cuda.rs`, feature `cuda`) and the host emulation of the kernels (the
//! tests below, which run them on the CPU) lay them out identically.

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
    use crate::{LoraAdapter, QuantLoraLinear};
    use half::bf16;
    use loraq_quant::{
        Bf16Weight, Fp8Granularity, Fp8Weight, Nvfp4GlobalScale, Nvfp4Weight, QuantizedWeight,
    };
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
                rows: n,
                cols: k,
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
                    rows: n,
                    cols: k,
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
                    rows: n,
                    cols: k,
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

    fn bf16_bytes(v: &[bf16]) -> Vec<u8> {
        v.iter().flat_map(|b| b.to_bits().to_le_bytes()).collect()
    }

    /// An argument of an emulated launch.
    #[derive(Clone, Copy)]
    enum Arg {
        Buf(u32),
        I(usize),
        F(f32),
        U(usize),
    }

    /// Buffers and a sequence of launches for the emulator (its input format).
    #[derive(Default)]
    struct Job {
        buffers: Vec<Vec<u8>>,
        launches: Vec<u8>,
        count: u32,
    }

    impl Job {
        fn buffer(&mut self, bytes: Vec<u8>) -> Arg {
            self.buffers.push(bytes);
            Arg::Buf(self.buffers.len() as u32 - 1)
        }

        fn zeros(&mut self, bytes: usize) -> Arg {
            self.buffer(vec![0; bytes])
        }

        fn launch(&mut self, name: &str, grid: (usize, usize), args: &[Arg]) {
            let l = &mut self.launches;
            l.extend_from_slice(&(name.len() as u32).to_le_bytes());
            l.extend_from_slice(name.as_bytes());
            for v in [grid.0, grid.1, args.len()] {
                l.extend_from_slice(&u32::try_from(v).unwrap().to_le_bytes());
            }
            for arg in args {
                let (kind, bits) = match *arg {
                    Arg::Buf(i) => (0u8, i),
                    Arg::I(v) => (1, i32::try_from(v).unwrap() as u32),
                    Arg::F(v) => (2, v.to_bits()),
                    Arg::U(v) => (3, u32::try_from(v).unwrap()),
                };
                l.push(kind);
                l.extend_from_slice(&bits.to_le_bytes());
            }
            self.count += 1;
        }

        /// Runs the launches; returns buffer `output`. `checks`: buffers whose first
        /// word must then equal the value and every other word 0.
        fn run(self, exe: &Path, tag: &str, output: Arg, checks: &[(Arg, u32)]) -> Vec<u8> {
            let index = |a: Arg| match a {
                Arg::Buf(i) => i,
                _ => unreachable!("not a buffer"),
            };
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
                tag.replace([' ', '=', '/'], "_"),
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

    /// Which launch sequence to emulate (as `cuda.rs` queues them).
    #[derive(Clone, Copy, Debug)]
    enum Sequence {
        /// One fused decode launch laid out by a plan.
        Fused(&'static str),
        /// Decode base, shrink, expand.
        UnfusedDecode,
        /// Prefill: tensor-core shrink, then base + expand in one tensor-core pass.
        FusedPrefill,
        /// Prefill: base, shrink, expand.
        UnfusedPrefill,
    }

    /// Runs `path` for `linear` on `x` (`batch` tokens, bf16 values) in the emulator;
    /// returns y as f32, or `None` where the path does not apply.
    fn run(
        exe: &Path,
        format: &str,
        path: Sequence,
        linear: &QuantLoraLinear,
        x: &[f32],
        batch: usize,
    ) -> Option<Vec<f32>> {
        let (n, k) = (linear.out_dim(), linear.in_dim());
        let (codes, scales, global) = match linear.base() {
            QuantizedWeight::Bf16(w) => (bf16_bytes(&w.data), Vec::new(), 1.0f32),
            QuantizedWeight::Fp8(w) => (
                w.codes.clone(),
                w.scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
                1.0,
            ),
            QuantizedWeight::Nvfp4(Nvfp4Weight {
                packed,
                block_scales,
                global_scale: Nvfp4GlobalScale::Multiplier(global),
                ..
            }) => (packed.clone(), block_scales.clone(), *global),
            _ => unreachable!("the GPU kernels take bf16, fp8-block128 and NVFP4"),
        };
        let (rank, scale, a, b) = match linear.lora() {
            Some(l) => (l.rank, l.scale, bf16_bytes(&l.a), bf16_bytes(&l.b)),
            None => (0, 0.0, Vec::new(), Vec::new()),
        };
        let mut job = Job::default();
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let (xa, codes, scales) = (
            job.buffer(bf16_bytes(&xb)),
            job.buffer(codes),
            job.buffer(scales),
        );
        let (la, lb) = (job.buffer(a), job.buffer(b));
        let t = job.zeros(4 * batch * rank.max(1));
        let y = job.zeros(2 * batch * n);
        let (bt, nt, kt, rt) = (Arg::I(batch), Arg::I(n), Arg::I(k), Arg::I(rank));
        let mut checks = Vec::new();
        let tag = match path {
            Sequence::Fused(kind) => {
                let plan = match kind {
                    "tcdec_fused" => tensor_core_plan(n, k, batch, rank, RESIDENT)?,
                    _ => cuda_core_plan(n, batch, rank, RESIDENT),
                };
                let counter = job.zeros(4);
                let part = job.zeros(4 * plan.slices * 16 * rank);
                let tickets = job.zeros(4 * 32);
                let name = format!("{format}_{}_b{}", plan.kind.name(), plan.nb);
                job.launch(
                    &name,
                    (plan.shrink_blocks + plan.base_blocks, 1),
                    &[
                        xa,
                        bt,
                        nt,
                        kt,
                        codes,
                        scales,
                        Arg::F(global),
                        la,
                        lb,
                        rt,
                        Arg::F(scale),
                        t,
                        counter,
                        Arg::U(plan.releases),
                        Arg::I(plan.shrink_blocks),
                        Arg::I(plan.slice_chunks),
                        part,
                        tickets,
                        y,
                    ],
                );
                checks.push((counter, plan.releases as u32));
                checks.push((tickets, 0));
                format!("{format} {n}x{k} r={rank} batch={batch} {plan:?}")
            }
            Sequence::UnfusedDecode => {
                let nb = cuda_core_instance(batch);
                let base_blocks = cuda_core_plan(n, batch, 0, RESIDENT).base_blocks;
                let uncapped = cuda_core_plan(n, batch, rank, usize::MAX);
                let base = [xa, bt, nt, kt, codes, scales, Arg::F(global), y];
                job.launch(&format!("{format}_base_b{nb}"), (base_blocks, 1), &base);
                if rank > 0 {
                    let shrink = [xa, bt, kt, la, rt, Arg::F(scale), t];
                    job.launch(
                        &format!("lora_shrink_b{nb}"),
                        (uncapped.shrink_blocks, 1),
                        &shrink,
                    );
                    let expand = [t, bt, nt, lb, rt, y];
                    job.launch(
                        &format!("lora_expand_b{nb}"),
                        (uncapped.base_blocks, 1),
                        &expand,
                    );
                }
                format!("{format} {n}x{k} r={rank} batch={batch} unfused decode b{nb}")
            }
            Sequence::FusedPrefill | Sequence::UnfusedPrefill => {
                let fused = matches!(path, Sequence::FusedPrefill);
                let tiles = |cols: usize| (cols.div_ceil(64), batch.div_ceil(64));
                if rank > 0 {
                    // The fused pass scales the whole tile by the global scale.
                    let t_scale = if fused { scale / global } else { scale };
                    job.launch(
                        "lora_tc_shrink",
                        tiles(rank),
                        &[xa, bt, kt, la, rt, Arg::F(t_scale), t],
                    );
                }
                let lora_rank = if fused { rank } else { 0 };
                let gemm = [
                    xa,
                    bt,
                    kt,
                    codes,
                    scales,
                    Arg::F(global),
                    nt,
                    t,
                    lb,
                    Arg::I(lora_rank),
                    y,
                    Arg::I(0),
                ];
                job.launch(&format!("{format}_tc_gemm"), tiles(n), &gemm);
                if !fused && rank > 0 {
                    let expand = [
                        xa,
                        bt,
                        Arg::I(0),
                        la,
                        la,
                        Arg::F(1.0),
                        nt,
                        t,
                        lb,
                        rt,
                        y,
                        Arg::I(1),
                    ];
                    job.launch("bf16_tc_gemm", tiles(n), &expand);
                }
                format!("{format} {n}x{k} r={rank} batch={batch} {path:?}")
            }
        };
        let bytes = job.run(exe, &tag, y, &checks);
        Some(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        )
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

    fn check(path: Sequence, ranks: &[usize], batches: &[usize], shapes: &[(usize, usize)]) {
        check_variant(Variant::Default, path, ranks, batches, shapes);
    }

    fn check_variant(
        variant: Variant,
        path: Sequence,
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
                        let Some(got) = run(exe, format, path, &linear, &x, batch) else {
                            continue;
                        };
                        let (want, magnitude) =
                            linear.forward_reference_with_magnitude(&x, batch).unwrap();
                        let tag = format!("{format} {n}x{k} r={rank} batch={batch} {path:?}");
                        failures.extend(compare(&tag, &got, &want, &magnitude));
                        checked += 1;
                    }
                }
            }
        }
        eprintln!(
            "{checked} emulated runs of {path:?}, {} failed",
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
            Sequence::Fused("tcdec_fused"),
            &[0, 48, 256],
            &[1, 6, 9, 16],
            &shapes,
        );
    }

    #[test]
    fn cuda_core_decode_matches_reference() {
        check(
            Sequence::Fused("fused"),
            &[0, 37, 256],
            &[1, 3, 16],
            &[(200, 272)],
        );
        check(Sequence::UnfusedDecode, &[0, 37], &[1, 16], &[(129, 1040)]);
        // In-dim 2112 (K % 64 == 0, three 1024-wide NVFP4 steps, the last partial):
        // NVFP4's 16-byte copies and block-scale words through the ring, which the
        // in-dims above (K % 64 == 16) do not take.
        check(Sequence::Fused("fused"), &[0, 256], &[1, 16], &[(72, 2112)]);
    }

    /// The lane-step variants of the CUDA-core decode (fp8 in 32-byte steps, NVFP4 in
    /// 8-byte steps): ragged and aligned in-dims, fused and unfused.
    #[test]
    fn alternate_lane_steps_match_reference() {
        check_variant(
            Variant::AlternateLaneSteps,
            Sequence::Fused("fused"),
            &[0, 37],
            &[1, 16],
            &[(200, 272), (72, 2112)],
        );
        check_variant(
            Variant::AlternateLaneSteps,
            Sequence::UnfusedDecode,
            &[0],
            &[1],
            &[(129, 1040)],
        );
    }

    #[test]
    fn prefill_matches_reference() {
        for path in [Sequence::FusedPrefill, Sequence::UnfusedPrefill] {
            check(path, &[0, 37, 256], &[17, 100], &[(200, 272)]);
        }
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
