//! Fast CPU path: rayon across output rows, SIMD inside (AVX-512 or AVX2 picked at run
//! time, scalar otherwise), weights dequantized in registers.
//!
//! Batch <= [`GEMV_MAX_BATCH`] takes the decode path (`gemv`, `fused`): the weight is streamed
//! once and every token's dot product is accumulated from the same registers. Larger
//! batches take the tiled path (`gemm`). In both, the LoRA shrink `s * (A x)` is one
//! pass over `x` (together with the activation fake-quant), and the expand `B (s A x)` is
//! accumulated into each output tile while it is still in registers / L1, so `y` is
//! written once.

pub(crate) mod decode;
pub(crate) mod decode_ggml;
pub(crate) mod fused;
pub(crate) mod gemm;
pub(crate) mod gemv;
#[cfg(target_arch = "x86_64")]
pub(crate) mod lanes;
// The format-specific decode loops are x86-64 SIMD only; elsewhere the generic loop
// serves every format.
#[cfg(target_arch = "x86_64")]
pub(crate) mod gemv_fp4;
#[cfg(target_arch = "x86_64")]
pub(crate) mod gemv_fp8;
#[cfg(target_arch = "x86_64")]
pub(crate) mod gemv_ggml;
#[cfg(target_arch = "x86_64")]
pub(crate) mod gemv_int4;

use crate::error::Result;
use crate::linear::QuantLoraLinear;
use decode::{Bf16Rows, F32Rows, Fp8Block128Rows, Int4Rows, Mxfp4Rows, Nvfp4Rows, RowDecode};
pub(crate) use fused::Schedule;
use loraq_quant::FP8_BLOCK;
#[cfg(target_arch = "x86_64")]
use loraq_quant::Nvfp4GlobalScale;
use loraq_quant::{Bf16Weight, Fp8Weight, Int4Weight, Mxfp4Weight, Nvfp4Weight, QuantizedWeight};
use rayon::prelude::*;

/// How far ahead of the decode loops' loads the software prefetch reaches, in bytes of
/// the weight's codes (rows are contiguous, so past a row's end it reaches into the rows
/// the same worker decodes next).
///
/// The lines go to L2 (`T1`): a miss queue deeper than L1's fill buffers, so about 24 KiB
/// stay in flight per core where the hardware prefetchers alone keep far less; the
/// distances and levels compared are in docs/kernels-log.md.
#[cfg(target_arch = "x86_64")]
pub(crate) const PREFETCH_AHEAD_BYTES: usize = 24 << 10;

/// Software prefetch of the line holding `p + PREFETCH_AHEAD_BYTES` into L2; `p` may
/// point anywhere (a prefetch never faults and the address is never dereferenced).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_ahead(p: *const u8) {
    // SAFETY: a prefetch is a hint; it reads nothing the program can observe and does
    // not fault on any address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
            p.wrapping_add(PREFETCH_AHEAD_BYTES).cast(),
        )
    }
}

/// Largest batch served by the single-pass decode (GEMV) path.
pub const GEMV_MAX_BATCH: usize = 8;
/// Weight rows per rayon task on the decode path.
const GEMV_ROWS_PER_TASK: usize = 32;

/// Instruction set used by the fast CPU path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust (auto-vectorized at best).
    Scalar,
    /// AVX2 + FMA, 8 lanes.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F + BW, 16 lanes.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The widest instruction set this CPU supports.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                return Self::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Self::Avx2;
            }
        }
        Self::Scalar
    }

    /// Every instruction set this CPU supports, widest first (for tests and benches).
    pub fn available() -> Vec<Self> {
        let mut out = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                out.push(Self::Avx512);
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                out.push(Self::Avx2);
            }
        }
        out.push(Self::Scalar);
        out
    }

    /// The instruction set [`Isa::name`] calls `name`, if this CPU has it.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::available().into_iter().find(|isa| isa.name() == name)
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => "avx512",
        }
    }
}

/// Whether work is spread over rayon's current thread pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Parallelism {
    /// One thread.
    Sequential,
    /// rayon's current pool (use `ThreadPool::install` to bound it).
    #[default]
    Rayon,
}

/// Options of the fast CPU path.
#[derive(Clone, Copy, Debug)]
pub struct CpuOptions {
    /// Instruction set; must be one [`Isa::available`] lists. `None` = [`Isa::detect`].
    pub isa: Option<Isa>,
    /// Threading.
    pub parallelism: Parallelism,
}

impl Default for CpuOptions {
    fn default() -> Self {
        Self {
            isa: None,
            parallelism: Parallelism::Rayon,
        }
    }
}

impl CpuOptions {
    pub(crate) fn resolved_isa(&self) -> Isa {
        match self.isa {
            Some(isa) if Isa::available().contains(&isa) => isa,
            _ => Isa::detect(),
        }
    }
}

/// Calls `f` with the row decoder of a base weight.
pub(crate) trait DecoderVisitor {
    /// Result.
    type Output;
    /// Runs with a concrete decoder.
    fn visit<D: RowDecode>(self, d: &D) -> Self::Output;
}

pub(crate) fn visit_base<V: DecoderVisitor>(linear: &QuantLoraLinear, v: V) -> V::Output {
    match linear.base() {
        QuantizedWeight::Bf16(w) => v.visit(&bf16_rows(w)),
        QuantizedWeight::Fp8(w) => match linear.fp8_rebiased_scales() {
            Some(rebiased) => v.visit(&fp8_rows::<false>(w, rebiased)),
            None => v.visit(&fp8_rows::<true>(w, &[])),
        },
        QuantizedWeight::Nvfp4(w) => v.visit(&nvfp4_rows(linear, w)),
        QuantizedWeight::Mxfp4(w) => v.visit(&mxfp4_rows(linear, w)),
        QuantizedWeight::Int4(w) => v.visit(&int4_rows(w)),
        QuantizedWeight::Ggml(w) => {
            use decode_ggml::{BlockRows, GgmlVisitor, ScalarBlock, SimdBlock};
            /// Any block format's rows, handed to the decoder visitor.
            struct Rows<V>(V);
            impl<V: DecoderVisitor> GgmlVisitor for Rows<V> {
                type Output = V::Output;
                fn simd<B: SimdBlock>(self, rows: BlockRows<'_, B>) -> V::Output {
                    self.0.visit(&rows)
                }
                fn scalar(self, rows: BlockRows<'_, ScalarBlock>) -> V::Output {
                    self.0.visit(&rows)
                }
            }
            decode_ggml::visit_ggml(w, Rows(v))
        }
    }
}

/// `w`'s rows; `rebiased` is [`decode::fp8_rebiased_scales`] of its scales, or empty
/// for the two-step decoder.
fn fp8_rows<'a, const TWO_STEP: bool>(
    w: &'a Fp8Weight,
    rebiased: &'a [f32],
) -> Fp8Block128Rows<'a, TWO_STEP> {
    Fp8Block128Rows {
        codes: &w.codes,
        scales: &w.scales,
        rebiased,
        rows: w.out_features,
        cols: w.in_features,
        scale_cols: w.in_features.div_ceil(FP8_BLOCK),
    }
}

fn bf16_rows(w: &Bf16Weight) -> Bf16Rows<'_> {
    Bf16Rows {
        data: &w.data,
        rows: w.out_features,
        cols: w.in_features,
    }
}

fn nvfp4_rows<'a>(linear: &'a QuantLoraLinear, w: &'a Nvfp4Weight) -> Nvfp4Rows<'a> {
    Nvfp4Rows {
        packed: &w.packed,
        block_scales: &w.block_scales,
        scale_table: linear.scale_table(),
        rows: w.out_features,
        cols: w.in_features,
    }
}

fn mxfp4_rows<'a>(linear: &'a QuantLoraLinear, w: &'a Mxfp4Weight) -> Mxfp4Rows<'a> {
    Mxfp4Rows {
        packed: &w.packed,
        block_scales: &w.scales,
        scale_table: linear.scale_table(),
        rows: w.out_features,
        cols: w.in_features,
    }
}

fn int4_rows(w: &Int4Weight) -> Int4Rows<'_> {
    Int4Rows {
        packed: &w.packed,
        scales: &w.scales,
        zeros: &w.zeros,
        rows: w.out_features,
        cols: w.in_features,
    }
}

/// Splits `out` (row-major `[rows, width]`) into chunks of `rows_per_task` rows and runs
/// `f(first_row, chunk)` on each, in parallel or not.
fn for_row_chunks<F>(par: Parallelism, out: &mut [f32], width: usize, rows_per_task: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    let chunk = rows_per_task * width;
    match par {
        Parallelism::Sequential => out
            .chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i * rows_per_task, c)),
        Parallelism::Rayon => out
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| f(i * rows_per_task, c)),
    }
}

/// Runs `$body` with `$t` a `const usize` equal to `$batch` (1 to [`GEMV_MAX_BATCH`]),
/// so the decode loops are compiled for each batch size.
macro_rules! with_const_batch {
    ($batch:expr, $t:ident => $body:expr) => {
        with_const_batch!(@arms $batch, $t => $body; 1 2 3 4 5 6 7 8)
    };
    (@arms $batch:expr, $t:ident => $body:expr; $($n:literal)+) => {
        match $batch {
            $($n => {
                const $t: usize = $n;
                $body
            })+
            _ => unreachable!("decode path batch is 1..=GEMV_MAX_BATCH"),
        }
    };
}

/// `out[j][t] = sum_k D[j, k] x[t, k]` for all rows of `d` (`out` is `[rows, T]`).
fn gemv_t<D: RowDecode, const T: usize>(
    isa: Isa,
    par: Parallelism,
    d: &D,
    x: &[f32],
    x_stride: usize,
    second: Option<(&Bf16Rows<'_>, &[f32], usize)>,
    out: &mut [f32],
) {
    for_row_chunks(par, out, T, GEMV_ROWS_PER_TASK, |row0, chunk| {
        let nrows = chunk.len() / T;
        gemv::dot_rows::<D, T>(isa, d, row0, nrows, x, x_stride, chunk);
        if let Some((b, ts, ts_stride)) = second {
            // Expand fused into the output write: same rows, same accumulators in L1.
            gemv::dot_rows::<Bf16Rows<'_>, T>(isa, b, row0, nrows, ts, ts_stride, chunk);
        }
    });
}

/// Copies `x` into a zero-padded `[padded, in_features]` buffer and applies the activation
/// fake-quant to the `batch` real tokens.
fn quantize_activations(
    linear: &QuantLoraLinear,
    x: &[f32],
    batch: usize,
    padded: usize,
) -> Result<Vec<f32>> {
    let in_features = linear.in_features();
    let mut xq = vec![0f32; padded * in_features];
    xq[..batch * in_features].copy_from_slice(x);
    linear
        .activation_quant()
        .apply("activation", &mut xq[..batch * in_features], in_features)?;
    Ok(xq)
}

/// Transposes `src` (`[rows, cols]`) into `dst` (`[cols', rows]` for `cols' <= cols`).
fn transpose_into(src: &[f32], rows: usize, cols: usize, dst: &mut [f32], scale: f32) {
    let used_cols = dst.len() / rows;
    for (c, dst_row) in dst.chunks_mut(rows).enumerate().take(used_cols) {
        for (r, d) in dst_row.iter_mut().enumerate() {
            *d = src[r * cols + c] * scale;
        }
    }
}

/// The fast path's entry: `y = W x_q + s B (A x)`, shapes already checked.
pub(crate) fn forward(
    linear: &QuantLoraLinear,
    x: &[f32],
    batch: usize,
    y: &mut [f32],
    opts: CpuOptions,
    schedule: Schedule,
) -> Result<()> {
    let isa = opts.resolved_isa();
    if batch <= GEMV_MAX_BATCH {
        forward_gemv(linear, x, batch, y, isa, opts.parallelism, schedule)
    } else {
        forward_gemm(linear, x, batch, y, isa, opts.parallelism)
    }
}

fn lora_views(linear: &QuantLoraLinear) -> Option<(Bf16Rows<'_>, Bf16Rows<'_>, f32)> {
    linear.lora().map(|l| {
        (
            Bf16Rows {
                data: &l.a,
                rows: l.rank,
                cols: l.in_features,
            },
            Bf16Rows {
                data: &l.b,
                rows: l.out_features,
                cols: l.rank,
            },
            l.scale,
        )
    })
}

/// The decode path's base rows through the generic loops, for any format and ISA.
struct GenericDecode<'a, const T: usize> {
    isa: Isa,
    par: Parallelism,
    schedule: Schedule,
    xq: &'a [f32],
    in_features: usize,
    lora: Option<&'a fused::LoraPass<'a>>,
    out: &'a mut [f32],
}

impl<const T: usize> DecoderVisitor for GenericDecode<'_, T> {
    type Output = ();
    fn visit<D: RowDecode>(self, d: &D) {
        let kernel = fused::GenericKernel {
            isa: self.isa,
            weight: d,
            x: self.xq,
            x_stride: self.in_features,
        };
        fused::decode::<_, T>(
            self.isa,
            self.par,
            self.schedule,
            &kernel,
            self.lora,
            self.out,
        );
    }
}

/// Picks the decode loop: the format-specific ones (fp8-block128, NVFP4, MXFP4, INT4 and
/// the GGUF types Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and IQ4_XS on AVX-512 and AVX2), the
/// generic one otherwise (bf16, the other GGUF types, the scalar ISA, an NVFP4 global
/// scale too large for the paired loops).
#[allow(clippy::too_many_arguments)]
fn decode_base<const T: usize>(
    linear: &QuantLoraLinear,
    isa: Isa,
    par: Parallelism,
    schedule: Schedule,
    xq: &[f32],
    lora: Option<&fused::LoraPass<'_>>,
    out: &mut [f32],
) {
    let in_features = linear.in_features();
    #[cfg(target_arch = "x86_64")]
    if let (Isa::Avx512 | Isa::Avx2, QuantizedWeight::Fp8(w)) = (isa, linear.base()) {
        let tile_amax = gemv_fp8::tile_amax(xq, T, in_features, in_features);
        let kernel = fused::Fp8Kernel {
            wide: isa == Isa::Avx512,
            weight: gemv_fp8::Fp8BandedRows {
                codes: &w.codes,
                scales: &w.scales,
                rows: w.out_features,
                cols: w.in_features,
                scale_cols: w.in_features.div_ceil(FP8_BLOCK),
                tile_amax: &tile_amax,
            },
            x: xq,
            x_stride: in_features,
        };
        return fused::decode::<_, T>(isa, par, schedule, &kernel, lora, out);
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx512 | Isa::Avx2) {
        let nvfp4_multiplier = match linear.base() {
            QuantizedWeight::Nvfp4(w) => match w.global_scale {
                Nvfp4GlobalScale::Multiplier(g) => gemv_fp4::nvfp4_scale_multiplier(g),
                // The paired loop folds a multiplier into the block scales; a divisor
                // takes the generic loop, whose scale table divides as the checkpoint's
                // dequantization does.
                Nvfp4GlobalScale::Divisor(_) => None,
            },
            _ => None,
        };
        // The paired loops (NVFP4, MXFP4, INT4): `$weight` against the reordered
        // activation. (A macro: each arm's weight is a different type.)
        macro_rules! decode_paired {
            ($weight:expr) => {{
                let kernel = fused::PairedKernel {
                    isa,
                    weight: $weight,
                    x_paired: gemv_fp4::reorder_activation(isa, xq, T, in_features, in_features),
                };
                return fused::decode::<_, T>(isa, par, schedule, &kernel, lora, out);
            }};
        }
        match (linear.base(), nvfp4_multiplier) {
            (QuantizedWeight::Nvfp4(w), Some(scale_multiplier)) => {
                decode_paired!(gemv_fp4::PairedFp4Rows {
                    rows: nvfp4_rows(linear, w),
                    scale_multiplier,
                })
            }
            (QuantizedWeight::Mxfp4(w), _) => decode_paired!(gemv_fp4::PairedFp4Rows {
                rows: mxfp4_rows(linear, w),
                scale_multiplier: 1.0,
            }),
            (QuantizedWeight::Int4(w), _) => {
                decode_paired!(gemv_int4::Int4TableRows { rows: int4_rows(w) })
            }
            (QuantizedWeight::Ggml(w), _)
                if gemv_ggml::decode::<T>(w, isa, par, schedule, xq, in_features, lora, out) =>
            {
                return;
            }
            _ => {}
        }
    }
    visit_base(
        linear,
        GenericDecode::<T> {
            isa,
            par,
            schedule,
            xq,
            in_features,
            lora,
            out,
        },
    );
}

fn forward_gemv(
    linear: &QuantLoraLinear,
    x: &[f32],
    batch: usize,
    y: &mut [f32],
    isa: Isa,
    par: Parallelism,
    schedule: Schedule,
) -> Result<()> {
    let (out_features, in_features) = (linear.out_features(), linear.in_features());
    let quantized;
    let xq: &[f32] = if linear.activation_quant().is_identity() {
        x
    } else {
        quantized = quantize_activations(linear, x, batch, batch)?;
        &quantized
    };
    let lora = lora_views(linear).map(|(a, b, scale)| fused::LoraPass {
        a,
        b,
        scale,
        x,
        x_stride: in_features,
    });
    if batch == 1 {
        // [out, 1] is already y's layout.
        decode_base::<1>(linear, isa, par, schedule, xq, lora.as_ref(), y);
    } else {
        let mut y_t = vec![0f32; out_features * batch];
        with_const_batch!(batch, T => decode_base::<T>(linear, isa, par, schedule, xq, lora.as_ref(), &mut y_t));
        transpose_into(&y_t, out_features, batch, y, 1.0);
    }
    Ok(())
}

/// Runs the tiled product over all output blocks; returns `[out_rows, n_padded]`.
fn gemm_all<D1: RowDecode, D2: RowDecode>(
    isa: Isa,
    par: Parallelism,
    n_padded: usize,
    first: &gemm::Segment<'_, D1>,
    second: Option<&gemm::Segment<'_, D2>>,
) -> Vec<f32> {
    let (_, nr) = gemm::tile_shape(isa);
    let out_rows = first.weight.rows();
    let mut y_t = vec![0f32; out_rows * n_padded];
    for_row_chunks(par, &mut y_t, n_padded, nr, |o0, chunk| {
        let nrows = chunk.len() / n_padded.max(1);
        let mut y_block = vec![0f32; n_padded * nr];
        gemm::gemm_block(isa, o0, nrows, n_padded, first, second, &mut y_block);
        for (j, out_row) in chunk.chunks_mut(n_padded).enumerate() {
            for (t, o) in out_row.iter_mut().enumerate() {
                *o = y_block[t * nr + j];
            }
        }
    });
    y_t
}

struct GemmVisitor<'a> {
    isa: Isa,
    par: Parallelism,
    n_padded: usize,
    /// The base weight's panels for `isa`, if packed at load.
    packed: Option<&'a [f32]>,
    xq: &'a [f32],
    in_features: usize,
    second: Option<gemm::Segment<'a, Bf16Rows<'a>>>,
    /// `[batch, out_features]`.
    y: &'a mut [f32],
}

impl DecoderVisitor for GemmVisitor<'_> {
    type Output = ();
    fn visit<D: RowDecode>(self, d: &D) {
        let first = gemm::Segment {
            weight: d,
            packed: self.packed,
            x: self.xq,
            x_stride: self.in_features,
        };
        gemm::gemm_rows(
            self.isa,
            self.par,
            self.n_padded,
            &first,
            self.second.as_ref(),
            self.y,
        )
    }
}

fn forward_gemm(
    linear: &QuantLoraLinear,
    x: &[f32],
    batch: usize,
    y: &mut [f32],
    isa: Isa,
    par: Parallelism,
) -> Result<()> {
    let in_features = linear.in_features();
    let (mr, _) = gemm::tile_shape(isa);
    let n_padded = batch.div_ceil(mr) * mr;
    let whole = batch / mr * mr;
    if linear.activation_quant().is_identity() && whole > 0 && whole < batch {
        // A batch that is not a whole number of micro-kernel rows (8192 tokens on the
        // AVX2 tile's 6): the whole rows read `x` in place and the last few go through
        // a padded copy of their own, instead of a zeroed copy of the whole batch on
        // the calling thread (1.9% of a 16 x 512 prefill's samples on AVX2, the other
        // thread idle meanwhile). Each output is the same sum over the inputs in the
        // same order whatever rows share its tile, so the bits are unchanged.
        let out_features = linear.out_features();
        let (head, tail) = y[..batch * out_features].split_at_mut(whole * out_features);
        forward_gemm(linear, &x[..whole * in_features], whole, head, isa, par)?;
        return forward_gemm(
            linear,
            &x[whole * in_features..batch * in_features],
            batch - whole,
            tail,
            isa,
            par,
        );
    }
    let padded_copy;
    let xq: &[f32] = if linear.activation_quant().is_identity() && batch == n_padded {
        // Whole micro-kernel rows and nothing to quantize: the GEMM reads `x` itself.
        // (The copy into a zeroed buffer was a serial memset and memcpy on the calling
        // thread for every linear, 2.5% of a 512-token prefill's samples.)
        x
    } else {
        padded_copy = quantize_activations(linear, x, batch, n_padded)?;
        &padded_copy
    };
    let views = lora_views(linear);
    let ts = views.as_ref().map(|(a, _, scale)| {
        // The LoRA path sees the unquantized activation.
        let x_pad_owned;
        let x_pad: &[f32] = if linear.activation_quant().is_identity() {
            xq
        } else {
            let mut buf = vec![0f32; n_padded * in_features];
            buf[..batch * in_features].copy_from_slice(x);
            x_pad_owned = buf;
            &x_pad_owned
        };
        let seg = gemm::Segment {
            weight: a,
            packed: None,
            x: x_pad,
            x_stride: in_features,
        };
        let mut ts = vec![0f32; n_padded * a.rows];
        gemm::gemm_rows::<_, Bf16Rows<'_>>(isa, par, n_padded, &seg, None, &mut ts);
        for v in &mut ts {
            *v *= *scale;
        }
        ts
    });
    let second = match (&views, &ts) {
        (Some((_, b, _)), Some(ts)) => Some(gemm::Segment {
            weight: b,
            packed: None,
            x: ts.as_slice(),
            x_stride: b.cols,
        }),
        _ => None,
    };
    let out_features = linear.out_features();
    visit_base(
        linear,
        GemmVisitor {
            isa,
            par,
            n_padded,
            packed: linear.packed_panels(isa),
            xq,
            in_features,
            second,
            y: &mut y[..batch * out_features],
        },
    );
    Ok(())
}

/// [`gemm::pack_panels`] of a base weight.
struct PackVisitor {
    isa: Isa,
    par: Parallelism,
}

impl DecoderVisitor for PackVisitor {
    type Output = Vec<f32>;
    fn visit<D: RowDecode>(self, d: &D) -> Vec<f32> {
        gemm::pack_panels(self.isa, self.par, d)
    }
}

/// The base weight of `linear` decoded into the prefill GEMM's panels for `isa`.
pub(crate) fn pack_base_panels(linear: &QuantLoraLinear, isa: Isa, par: Parallelism) -> Vec<f32> {
    visit_base(linear, PackVisitor { isa, par })
}

struct DequantVisitor<'a> {
    isa: Isa,
    par: Parallelism,
    out: &'a mut [f32],
}

impl DecoderVisitor for DequantVisitor<'_> {
    type Output = ();
    fn visit<D: RowDecode>(self, d: &D) {
        let isa = self.isa;
        for_row_chunks(self.par, self.out, d.cols(), 1, |row, out_row| {
            gemm::decode_segment(isa, d, row, 0, out_row)
        });
    }
}

/// Dequantizes the whole base weight to f32 (`[out, in]`): the baseline the fused path
/// is measured against, and a debugging aid.
pub(crate) fn dequantize_base(linear: &QuantLoraLinear, opts: CpuOptions) -> Vec<f32> {
    let mut out = vec![0f32; linear.out_features() * linear.in_features()];
    visit_base(
        linear,
        DequantVisitor {
            isa: opts.resolved_isa(),
            par: opts.parallelism,
            out: &mut out,
        },
    );
    out
}

/// The unfused baseline: multiply by an already dequantized f32 weight with the same
/// kernels (the LoRA path unchanged).
pub(crate) fn forward_with_dense(
    linear: &QuantLoraLinear,
    dense: &[f32],
    x: &[f32],
    batch: usize,
    y: &mut [f32],
    opts: CpuOptions,
) -> Result<()> {
    let dense_linear = DenseView { linear, dense };
    dense_linear.forward(x, batch, y, opts)
}

struct DenseView<'a> {
    linear: &'a QuantLoraLinear,
    dense: &'a [f32],
}

impl DenseView<'_> {
    fn forward(&self, x: &[f32], batch: usize, y: &mut [f32], opts: CpuOptions) -> Result<()> {
        let isa = opts.resolved_isa();
        let par = opts.parallelism;
        let (out_features, in_features) = (self.linear.out_features(), self.linear.in_features());
        let d = F32Rows {
            data: self.dense,
            rows: out_features,
            cols: in_features,
        };
        let (mr, _) = gemm::tile_shape(isa);
        let n_padded = if batch <= GEMV_MAX_BATCH {
            batch
        } else {
            batch.div_ceil(mr) * mr
        };
        let xq = quantize_activations(self.linear, x, batch, n_padded)?;
        let views = lora_views(self.linear);
        // LoRA exactly as the fused path computes it, then the base product separately.
        let mut lora_out = vec![0f32; batch * out_features];
        if let Some((a, b, scale)) = views {
            let mut shrunk = vec![0f32; a.rows * batch];
            let mut ts = vec![0f32; batch * a.rows];
            if batch <= GEMV_MAX_BATCH {
                with_const_batch!(batch, T => gemv_t::<Bf16Rows<'_>, T>(isa, par, &a, x, in_features, None, &mut shrunk));
                transpose_into(&shrunk, a.rows, batch, &mut ts, scale);
                let mut expanded = vec![0f32; out_features * batch];
                with_const_batch!(batch, T => gemv_t::<Bf16Rows<'_>, T>(isa, par, &b, &ts, a.rows, None, &mut expanded));
                transpose_into(&expanded, out_features, batch, &mut lora_out, 1.0);
            } else {
                let mut x_pad = vec![0f32; n_padded * in_features];
                x_pad[..batch * in_features].copy_from_slice(x);
                let seg = gemm::Segment {
                    weight: &a,
                    packed: None,
                    x: &x_pad,
                    x_stride: in_features,
                };
                let shrunk_t = gemm_all::<_, Bf16Rows<'_>>(isa, par, n_padded, &seg, None);
                let mut ts = vec![0f32; n_padded * a.rows];
                transpose_into(&shrunk_t, a.rows, n_padded, &mut ts, scale);
                let seg = gemm::Segment {
                    weight: &b,
                    packed: None,
                    x: &ts,
                    x_stride: a.rows,
                };
                let expanded_t = gemm_all::<_, Bf16Rows<'_>>(isa, par, n_padded, &seg, None);
                for (t, row) in lora_out.chunks_mut(out_features).enumerate() {
                    for (o, v) in row.iter_mut().enumerate() {
                        *v = expanded_t[o * n_padded + t];
                    }
                }
            }
        }
        let base_t = if batch <= GEMV_MAX_BATCH {
            let mut base_t = vec![0f32; out_features * batch];
            with_const_batch!(batch, T => gemv_t::<F32Rows<'_>, T>(isa, par, &d, &xq, in_features, None, &mut base_t));
            base_t
        } else {
            let seg = gemm::Segment {
                weight: &d,
                packed: None,
                x: &xq,
                x_stride: in_features,
            };
            gemm_all::<_, Bf16Rows<'_>>(isa, par, n_padded, &seg, None)
        };
        for (t, row) in y.chunks_mut(out_features).enumerate().take(batch) {
            for (o, v) in row.iter_mut().enumerate() {
                *v = base_t[o * n_padded + t] + lora_out[t * out_features + o];
            }
        }
        Ok(())
    }
}
