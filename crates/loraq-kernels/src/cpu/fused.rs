//! The decode path (batch <= [`super::GEMV_MAX_BATCH`]) as one parallel region.
//!
//! Every worker first claims chunks of LoRA `A` rows (the shrink `s · A x`, the same `x`
//! the base pass is about to stream, so it stays in cache), then chunks of base rows;
//! after each base chunk it adds the expand `B t` for the same rows while their sums are
//! in L1, so `y` is written once. Work is claimed from atomic counters, so a slow (or
//! descheduled) worker only delays what it has claimed. A base chunk finished before the
//! last shrink chunk is kept and expanded when the worker runs out of base chunks; only
//! then does it wait, and the wait ends: every claimed shrink chunk is being computed by
//! a running worker that never blocks.
//!
//! The base rows come from a [`BaseKernel`]: the format-specific loops of
//! [`super::gemv_fp8`], [`super::gemv_fp4`] and [`super::gemv_int4`] on AVX-512 and AVX2,
//! the generic [`super::gemv::dot_rows`] otherwise.

use super::decode::{Bf16Rows, RowDecode};
use super::gemv;
#[cfg(target_arch = "x86_64")]
use super::gemv_fp4::PairedRows;
#[cfg(target_arch = "x86_64")]
use super::gemv_fp8::{BandActivations, Fp8BandedRows};
use super::{Isa, Parallelism};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// LoRA `A` rows per claimed shrink chunk.
const SHRINK_ROWS: usize = 16;

/// Per-worker scratch of a base kernel.
#[derive(Default)]
pub(crate) struct Scratch {
    #[cfg(target_arch = "x86_64")]
    fp8_band: BandActivations,
}

/// Base rows of one format, `out[r * T + t] += sum_k W[row0 + r, k] x_t[k]`.
pub(crate) trait BaseKernel: Sync {
    /// Output rows.
    fn rows(&self) -> usize;
    /// Rows per claimed chunk.
    fn chunk_rows(&self) -> usize;
    /// Adds the products of rows `row0 .. row0 + nrows` to `out` (`[nrows, T]`).
    fn dot_chunk<const T: usize>(
        &self,
        row0: usize,
        nrows: usize,
        out: &mut [f32],
        scratch: &mut Scratch,
    );
}

/// Any [`RowDecode`] through the generic loops.
pub(crate) struct GenericKernel<'a, D: RowDecode> {
    pub isa: Isa,
    pub weight: &'a D,
    pub x: &'a [f32],
    pub x_stride: usize,
}

impl<D: RowDecode> BaseKernel for GenericKernel<'_, D> {
    fn rows(&self) -> usize {
        self.weight.rows()
    }
    fn chunk_rows(&self) -> usize {
        64
    }
    fn dot_chunk<const T: usize>(
        &self,
        row0: usize,
        nrows: usize,
        out: &mut [f32],
        _: &mut Scratch,
    ) {
        gemv::dot_rows::<D, T>(
            self.isa,
            self.weight,
            row0,
            nrows,
            self.x,
            self.x_stride,
            out,
        );
    }
}

/// fp8-block128 through the banded AVX-512 or AVX2 loop.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Fp8Kernel<'a> {
    /// AVX-512 (else AVX2).
    pub wide: bool,
    pub weight: Fp8BandedRows<'a>,
    pub x: &'a [f32],
    pub x_stride: usize,
}

#[cfg(target_arch = "x86_64")]
impl BaseKernel for Fp8Kernel<'_> {
    fn rows(&self) -> usize {
        self.weight.rows
    }
    fn chunk_rows(&self) -> usize {
        // One band: its scaled activations are built once per chunk.
        loraq_quant::FP8_BLOCK
    }
    fn dot_chunk<const T: usize>(
        &self,
        row0: usize,
        nrows: usize,
        out: &mut [f32],
        scratch: &mut Scratch,
    ) {
        let band = &mut scratch.fp8_band;
        if self.wide {
            self.weight
                .dot_rows_simd::<T, true>(row0, nrows, self.x, self.x_stride, out, band);
        } else {
            self.weight
                .dot_rows_simd::<T, false>(row0, nrows, self.x, self.x_stride, out, band);
        }
    }
}

/// NVFP4, MXFP4 and INT4 group 128 through their reordered-activation AVX-512 or AVX2
/// loops.
#[cfg(target_arch = "x86_64")]
pub(crate) struct PairedKernel<W: PairedRows> {
    /// AVX-512 or AVX2.
    pub isa: Isa,
    pub weight: W,
    /// Reordered activations, `[T, cols]` ([`super::gemv_fp4::reorder_activation`]).
    pub x_paired: Vec<f32>,
}

#[cfg(target_arch = "x86_64")]
impl<W: PairedRows> BaseKernel for PairedKernel<W> {
    fn rows(&self) -> usize {
        self.weight.rows()
    }
    fn chunk_rows(&self) -> usize {
        64
    }
    fn dot_chunk<const T: usize>(
        &self,
        row0: usize,
        nrows: usize,
        out: &mut [f32],
        _: &mut Scratch,
    ) {
        self.weight
            .dot_rows::<T>(self.isa, row0, nrows, &self.x_paired, out);
    }
}

/// The LoRA factors and the activation they see.
pub(crate) struct LoraPass<'a> {
    pub a: Bf16Rows<'a>,
    pub b: Bf16Rows<'a>,
    pub scale: f32,
    /// Unquantized activation, `[T, in_features]`, rows `x_stride` apart.
    pub x: &'a [f32],
    pub x_stride: usize,
}

/// How the LoRA shrink is scheduled (the fused region is the default; the phased one
/// is the schedule before fusion, kept for the benches).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Schedule {
    /// Shrink, base and expand in one parallel region.
    Fused,
    /// The shrink as its own parallel pass, then base + expand.
    Phased,
}

/// Runs `work` once per worker of the pool (or once, sequentially).
fn run_workers(par: Parallelism, work: impl Fn() + Sync) {
    match par {
        Parallelism::Sequential => work(),
        Parallelism::Rayon => {
            let workers = rayon::current_num_threads().max(1);
            rayon::scope(|s| {
                for _ in 0..workers {
                    s.spawn(|_| work());
                }
            });
        }
    }
}

/// `y_t[o * T + t] = sum_k W[o, k] x_t[k] + (B t)_o` with `t = s · A x_t`.
pub(crate) fn decode<K: BaseKernel, const T: usize>(
    isa: Isa,
    par: Parallelism,
    schedule: Schedule,
    kernel: &K,
    lora: Option<&LoraPass<'_>>,
    y_t: &mut [f32],
) {
    let rows = kernel.rows();
    assert_eq!(y_t.len(), rows * T);
    let rank = lora.map_or(0, |l| l.a.rows);
    // Shrink outputs per chunk, [rows, T] each.
    let shrunk: Vec<Mutex<Vec<f32>>> = (0..rank.div_ceil(SHRINK_ROWS))
        .map(|i| Mutex::new(vec![0f32; SHRINK_ROWS.min(rank - i * SHRINK_ROWS) * T]))
        .collect();
    let next_shrink = AtomicUsize::new(0);
    let shrink_done = AtomicUsize::new(0);
    let shrink = || {
        let Some(l) = lora else { return };
        loop {
            let i = next_shrink.fetch_add(1, Ordering::Relaxed);
            let Some(chunk) = shrunk.get(i) else { break };
            let mut out = chunk.lock().expect("shrink chunk lock");
            gemv::dot_rows::<Bf16Rows<'_>, T>(
                isa,
                &l.a,
                i * SHRINK_ROWS,
                out.len() / T,
                l.x,
                l.x_stride,
                &mut out,
            );
            drop(out);
            shrink_done.fetch_add(1, Ordering::Release);
        }
    };
    if schedule == Schedule::Phased {
        run_workers(par, shrink);
    }

    let chunk_rows = kernel.chunk_rows();
    let outputs: Vec<Mutex<&mut [f32]>> = y_t.chunks_mut(chunk_rows * T).map(Mutex::new).collect();
    let next_base = AtomicUsize::new(0);
    run_workers(par, || {
        if schedule == Schedule::Fused {
            shrink();
        }
        let mut scratch = Scratch::default();
        // `s · A x` as `[T, rank]`, gathered once the last shrink chunk is done.
        let mut ts: Vec<f32> = Vec::new();
        let gather = |ts: &mut Vec<f32>, scale: f32| {
            *ts = vec![0f32; T * rank];
            for (c, chunk) in shrunk.iter().enumerate() {
                let part = chunk.lock().expect("shrink chunk lock");
                for (j, row) in part.chunks(T).enumerate() {
                    for (t, v) in row.iter().enumerate() {
                        ts[t * rank + c * SHRINK_ROWS + j] = v * scale;
                    }
                }
            }
        };
        // Base chunks finished before the shrink was: expanded at the end.
        let mut pending = Vec::new();
        loop {
            let i = next_base.fetch_add(1, Ordering::Relaxed);
            let Some(chunk) = outputs.get(i) else { break };
            let mut out = chunk.lock().expect("output chunk lock");
            let row0 = i * chunk_rows;
            let nrows = out.len() / T;
            out.fill(0.0);
            kernel.dot_chunk::<T>(row0, nrows, &mut out, &mut scratch);
            let Some(l) = lora else { continue };
            if ts.is_empty() {
                if shrink_done.load(Ordering::Acquire) < shrunk.len() {
                    pending.push((row0, out));
                    continue;
                }
                gather(&mut ts, l.scale);
            }
            // Expand into the same rows while they are in L1.
            gemv::dot_rows::<Bf16Rows<'_>, T>(isa, &l.b, row0, nrows, &ts, rank, &mut out);
        }
        if let (Some(l), false) = (lora, pending.is_empty()) {
            // Every shrink chunk is claimed by a running worker that never blocks.
            let mut spins = 0u32;
            while shrink_done.load(Ordering::Acquire) < shrunk.len() {
                if spins < 1 << 12 {
                    std::hint::spin_loop();
                    spins += 1;
                } else {
                    std::thread::yield_now();
                }
            }
            if ts.is_empty() {
                gather(&mut ts, l.scale);
            }
            for (row0, mut out) in pending {
                let nrows = out.len() / T;
                gemv::dot_rows::<Bf16Rows<'_>, T>(isa, &l.b, row0, nrows, &ts, rank, &mut out);
            }
        }
    });
}
