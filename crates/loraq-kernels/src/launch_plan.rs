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

/// One fused decode launch: kernel `{format}_{kind}_b{nb}`, `shrink_blocks` blocks of
/// LoRA shrink first in the grid, then `base_blocks` of base stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FusedPlan {
    /// `fused` (CUDA cores) or `tcdec_fused` (tensor cores).
    pub kind: &'static str,
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

/// The CUDA-core fused decode (`{format}_fused_b{NB}`) of `batch` tokens (1..=16) over
/// an `n x k` weight with a rank-`rank` LoRA, `resident` blocks of it fitting on the
/// device at once.
pub(crate) fn cuda_core_plan(n: usize, batch: usize, rank: usize, resident: usize) -> FusedPlan {
    let nb = DECODE_BATCHES
        .iter()
        .copied()
        .find(|&b| b >= batch)
        .unwrap_or(DECODE_MAX_BATCH);
    // Mirrors RowsPerWarp in lora_decode.cu.
    let rows_per_warp = if nb <= 4 { 2 } else { 1 };
    let rows_per_block = DECODE_THREADS / 32 * rows_per_warp;
    let shrink_blocks = rank.div_ceil(rows_per_block);
    FusedPlan {
        kind: "fused",
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
        kind: "tcdec_fused",
        nb: if batch <= 8 { 8 } else { 16 },
        shrink_blocks,
        base_blocks: tiles.div_ceil(per_block),
        // One release per 16 rows of A (by the block finishing its last slice).
        releases: rank_tiles,
        slice_chunks,
        slices,
    })
}

/// The decode kernels run on the CPU through `host_emulation/` (g++ compiles
/// `kernels/lora_decode.cu` against stand-ins for the CUDA headers; one OS thread per
/// CUDA thread, real barriers, warp-collective mma and shuffles), laid out by the plans
/// above with a small device (few co-resident blocks, so blocks take several tiles and
/// the tensor-core shrink several slices), against the f64 reference. Checks the
/// kernels' logic wherever a C++ compiler exists, without a GPU; the memory model and
/// the real compiler's code are left to `tests/gpu.rs` on a device.
#[cfg(test)]
mod host_emulation {
    use super::*;
    use crate::reference::forward_reference_with_magnitude;
    use crate::{
        BaseWeight, Bf16Weight, Fp8Block128Weight, LoraAdapter, Nvfp4Weight, QuantLoraLinear,
    };
    use half::bf16;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::sync::OnceLock;

    /// Co-resident blocks of the emulated device.
    const RESIDENT: usize = 24;

    /// The emulator, built once per version of its sources (kept in the system's temp
    /// directory under a hash of them); `None` (with the reason printed) where no C++20
    /// compiler runs.
    fn emulator() -> Option<&'static Path> {
        static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
        BUILT
            .get_or_init(|| {
                use std::hash::{Hash, Hasher};
                let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
                let emulation = crate_dir.join("host_emulation");
                let kernels = crate_dir.join("../../kernels");
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                for source in [
                    emulation.join("emulator.cpp"),
                    emulation.join("cuda_host_stub.h"),
                    kernels.join("lora_decode.cu"),
                    kernels.join("loraq_common.cuh"),
                ] {
                    std::fs::read(&source).unwrap().hash(&mut hasher);
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
                    .args(["-std=c++20", "-O1", "-pthread", "-w", "-I"])
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
            "bf16" => {
                BaseWeight::Bf16(Bf16Weight::new(n, k, bf16s(&mut rng, n * k, 0.05)).unwrap())
            }
            "fp8b128" => {
                let codes = (0..n * k)
                    .map(|_| rng.random::<u8>())
                    .map(|b| if b & 0x7F == 0x7F { b ^ 1 } else { b })
                    .collect();
                let scales = (0..n.div_ceil(128) * k.div_ceil(128))
                    .map(|_| rng.random_range(1e-3f32..1e-2))
                    .collect();
                BaseWeight::Fp8Block128(Fp8Block128Weight::new(n, k, codes, scales).unwrap())
            }
            _ => {
                let packed = (0..n * k / 2).map(|_| rng.random()).collect();
                // E4M3 block scales: zero, subnormals, normals up to 16, either sign.
                let scales = (0..n * k / 16)
                    .map(|_| rng.random_range(0u8..0x60) | (rng.random::<u8>() & 0x80))
                    .collect();
                let global = rng.random_range(1e-3f32..1e-1);
                BaseWeight::Nvfp4(Nvfp4Weight::new(n, k, packed, scales, global).unwrap())
            }
        };
        let lora = (rank > 0).then(|| {
            let a = bf16s(&mut rng, rank * k, 0.05);
            let b = bf16s(&mut rng, n * rank, 0.05);
            LoraAdapter::new(rank, k, n, a, b, 0.5).unwrap()
        });
        QuantLoraLinear::new(base, lora).unwrap()
    }

    fn push_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    }

    fn bf16_bytes(v: &[bf16]) -> Vec<u8> {
        v.iter().flat_map(|b| b.to_bits().to_le_bytes()).collect()
    }

    /// Runs `plan` for `linear` on `x` (`batch` tokens, bf16 values) in the emulator;
    /// returns y as f32.
    fn run(
        exe: &Path,
        format: &str,
        plan: &FusedPlan,
        linear: &QuantLoraLinear,
        x: &[f32],
        batch: usize,
    ) -> Vec<f32> {
        let (n, k) = (linear.out_dim(), linear.in_dim());
        let (codes, scales, global) = match linear.base() {
            BaseWeight::Bf16(w) => (bf16_bytes(&w.data), Vec::new(), 1.0f32),
            BaseWeight::Fp8Block128(w) => (
                w.codes.clone(),
                w.scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
                1.0,
            ),
            BaseWeight::Nvfp4(w) => (w.packed.clone(), w.block_scales.clone(), w.global_scale),
            _ => unreachable!("the GPU kernels take bf16, fp8-block128 and NVFP4"),
        };
        let (rank, scale, a, b) = match linear.lora() {
            Some(l) => (l.rank, l.scale, bf16_bytes(&l.a), bf16_bytes(&l.b)),
            None => (0, 0.0, Vec::new(), Vec::new()),
        };
        let name = format!("{format}_{}_b{}", plan.kind, plan.nb);
        let mut input = Vec::new();
        input.extend_from_slice(&(name.len() as u32).to_le_bytes());
        input.extend_from_slice(name.as_bytes());
        let ints = [
            batch,
            n,
            k,
            rank,
            plan.shrink_blocks,
            plan.base_blocks,
            plan.slice_chunks,
            plan.releases,
            plan.slices * 16 * rank,
        ];
        for v in ints {
            input.extend_from_slice(&i32::try_from(v).unwrap().to_le_bytes());
        }
        input.extend_from_slice(&global.to_le_bytes());
        input.extend_from_slice(&scale.to_le_bytes());
        push_bytes(&mut input, &codes);
        push_bytes(&mut input, &scales);
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        push_bytes(&mut input, &bf16_bytes(&xb));
        push_bytes(&mut input, &a);
        push_bytes(&mut input, &b);
        let dir = exe.parent().unwrap();
        let tag = format!("{name}-{n}x{k}-r{rank}-b{batch}-{}", std::process::id());
        let (in_path, out_path) = (
            dir.join(format!("{tag}.in")),
            dir.join(format!("{tag}.out")),
        );
        std::fs::write(&in_path, input).unwrap();
        let out = Command::new(exe)
            .arg(&in_path)
            .arg(&out_path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{tag}: emulator failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let y = std::fs::read(&out_path).unwrap();
        std::fs::remove_file(&in_path).unwrap();
        std::fs::remove_file(&out_path).unwrap();
        y.chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect()
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

    fn check(kernels: &str, ranks: &[usize], batches: &[usize], shapes: &[(usize, usize)]) {
        let Some(exe) = emulator() else {
            return;
        };
        let mut failures = Vec::new();
        let mut checked = 0;
        for format in ["bf16", "fp8b128", "nvfp4"] {
            for &(n, k) in shapes {
                for &rank in ranks {
                    let linear = random_linear(format, n, k, rank, 7 + rank as u64);
                    for &batch in batches {
                        let plan = match kernels {
                            "tcdec_fused" => match tensor_core_plan(n, k, batch, rank, RESIDENT) {
                                Some(plan) => plan,
                                None => continue,
                            },
                            _ => cuda_core_plan(n, batch, rank, RESIDENT),
                        };
                        let mut rng = ChaCha8Rng::seed_from_u64(batch as u64);
                        let x: Vec<f32> = (0..batch * k)
                            .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_f32())
                            .collect();
                        let (want, magnitude) =
                            forward_reference_with_magnitude(&linear, &x, batch).unwrap();
                        let got = run(exe, format, &plan, &linear, &x, batch);
                        let tag = format!("{format} {n}x{k} r={rank} batch={batch} {plan:?}");
                        failures.extend(compare(&tag, &got, &want, &magnitude));
                        checked += 1;
                    }
                }
            }
        }
        eprintln!(
            "{checked} emulated launches of {kernels}, {} failed",
            failures.len()
        );
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        assert!(checked > 0);
    }

    #[test]
    fn tensor_core_decode_matches_reference() {
        // Rank 48 at in-dim 1040 splits the shrink into 2 slices; 200 and 129 rows leave
        // a partial 16-row tile; in-dims 272 and 1040 a partial 128-wide chunk.
        check(
            "tcdec_fused",
            &[0, 48, 256],
            &[1, 6, 9, 16],
            &[(200, 272), (129, 1040)],
        );
    }

    #[test]
    fn cuda_core_decode_matches_reference() {
        check("fused", &[0, 37, 256], &[1, 3, 16], &[(200, 272)]);
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
