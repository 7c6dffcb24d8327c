//! Decode rows of a GGUF base (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS) a span of 256
//! inputs at a time.
//!
//! For each span the `R` rows of a pass are dequantized block by block
//! ([`SimdBlock::decode512`] / [`SimdBlock::decode256`]: a block's scales unpacked once,
//! its codes widened 16 or 8 at a time; Q4_0, Q4_K and IQ4_XS look each 4-bit code up
//! with one `vpermps` in a 16-entry table of the group's dequantized values, Q5_K with
//! `vpermt2ps` in 32 entries) into a 1 KiB buffer per row that stays in L1, then
//! multiplied into every token's accumulator 16 (AVX-512) or 8 (AVX2) inputs at a time.
//! The buffered values are the bits of `loraq_quant::ggml::block_element`, and each
//! row's products are accumulated in one vector per token in input order and reduced
//! as [`super::gemv::dot_rows`] reduces them, so the output equals the generic loop over
//! the dequantized weight bit for bit. GGUF rows are whole blocks (32 or 256 inputs), so
//! there is no tail.

use super::Isa;
use super::decode_ggml::{
    BlockRows, Iq4XsBlock, Q4_0Block, Q4KBlock, Q5KBlock, Q6KBlock, Q8_0Block, SimdBlock,
};
use super::fused::{self, BaseKernel, LoraPass, Schedule, Scratch};
use super::{Parallelism, gemv::hsum256};
use loraq_quant::ggml::{GgmlType, GgmlWeight};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Inputs per span (one K-quant super-block, eight 32-element blocks).
const SPAN: usize = 256;

/// One row's dequantized span, aligned for the vector loads; left uninitialized (each
/// span's inputs are written by the block decoders before they are read).
#[repr(C, align(64))]
struct SpanBuffer([f32; SPAN]);

/// `R` uninitialized span buffers.
fn span_buffers<const R: usize>() -> [MaybeUninit<SpanBuffer>; R] {
    [const { MaybeUninit::uninit() }; R]
}

/// A GGUF base of a [`SimdBlock`] type through the span loop.
pub(crate) struct GgmlKernel<'a, B: SimdBlock> {
    /// AVX-512 or AVX2.
    pub isa: Isa,
    pub weight: BlockRows<'a, B>,
    /// Activations, `[T, in_features]`, rows `x_stride` apart.
    pub x: &'a [f32],
    pub x_stride: usize,
}

/// Runs the fused decode of `w` through the span loop when its type has one (returns
/// `false`, having done nothing, otherwise). `isa` is AVX-512 or AVX2.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode<const T: usize>(
    w: &GgmlWeight,
    isa: Isa,
    par: Parallelism,
    schedule: Schedule,
    x: &[f32],
    x_stride: usize,
    lora: Option<&LoraPass<'_>>,
    out: &mut [f32],
) -> bool {
    fn run<B: SimdBlock, const T: usize>(
        w: &GgmlWeight,
        isa: Isa,
        par: Parallelism,
        schedule: Schedule,
        x: &[f32],
        x_stride: usize,
        lora: Option<&LoraPass<'_>>,
        out: &mut [f32],
    ) -> bool {
        let kernel = GgmlKernel {
            isa,
            weight: BlockRows::new(w, B::default()),
            x,
            x_stride,
        };
        fused::decode::<_, T>(isa, par, schedule, &kernel, lora, out);
        true
    }
    debug_assert!(matches!(isa, Isa::Avx512 | Isa::Avx2));
    match w.ggml_type {
        GgmlType::Q8_0 => run::<Q8_0Block, T>(w, isa, par, schedule, x, x_stride, lora, out),
        GgmlType::Q4_0 => run::<Q4_0Block, T>(w, isa, par, schedule, x, x_stride, lora, out),
        GgmlType::Q4_K => run::<Q4KBlock, T>(w, isa, par, schedule, x, x_stride, lora, out),
        GgmlType::Q5_K => run::<Q5KBlock, T>(w, isa, par, schedule, x, x_stride, lora, out),
        GgmlType::Q6_K => run::<Q6KBlock, T>(w, isa, par, schedule, x, x_stride, lora, out),
        GgmlType::IQ4_XS => run::<Iq4XsBlock, T>(w, isa, par, schedule, x, x_stride, lora, out),
        _ => false,
    }
}

impl<B: SimdBlock> BaseKernel for GgmlKernel<'_, B> {
    fn rows(&self) -> usize {
        use super::decode::RowDecode;
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
        self.dot_rows::<T>(row0, nrows, out);
    }
}

impl<B: SimdBlock> GgmlKernel<'_, B> {
    /// Adds `sum_k W[row0 + r, k] x_t[k]` to `out[r * T + t]` for `r < nrows`: four rows
    /// per pass for one or two tokens (each activation load serves more rows), two up
    /// to four tokens, else one.
    fn dot_rows<const T: usize>(&self, row0: usize, nrows: usize, out: &mut [f32]) {
        use super::decode::RowDecode;
        assert!(row0 + nrows <= self.weight.rows());
        assert!(out.len() >= nrows * T);
        let cols = self.weight.cols();
        assert!(T == 0 || (T - 1) * self.x_stride + cols <= self.x.len());
        let mut r = 0;
        if T <= 2 {
            while r + 4 <= nrows {
                // SAFETY: the ISA was detected at run time; bounds asserted above.
                unsafe { self.rows_simd::<4, T>(row0 + r, &mut out[r * T..]) };
                r += 4;
            }
        }
        if T <= 4 {
            while r + 2 <= nrows {
                // SAFETY: as above.
                unsafe { self.rows_simd::<2, T>(row0 + r, &mut out[r * T..]) };
                r += 2;
            }
        }
        while r < nrows {
            // SAFETY: as above.
            unsafe { self.rows_simd::<1, T>(row0 + r, &mut out[r * T..]) };
            r += 1;
        }
    }

    /// `R` rows through the ISA's loop.
    ///
    /// # Safety
    /// `self.isa` was detected; rows `row0 .. row0 + R` exist; `out` holds `R * T`
    /// values; `x` holds `T` rows of `cols` inputs, `x_stride` apart.
    unsafe fn rows_simd<const R: usize, const T: usize>(&self, row0: usize, out: &mut [f32]) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match self.isa {
                Isa::Avx512 => self.rows_avx512::<R, T>(row0, out),
                Isa::Avx2 => self.rows_avx2::<R, T>(row0, out),
                Isa::Scalar => unreachable!("the span loop needs AVX2 or AVX-512"),
            }
        }
    }

    /// Dequantizes inputs `k0 .. k0 + len` of rows `row0 .. row0 + R` into `buffers`,
    /// prefetching ahead of each row's blocks.
    ///
    /// # Safety
    /// AVX-512F/BW (`WIDE`) or AVX2 + FMA; the rows exist; `k0` is a multiple of
    /// [`SPAN`], `len <= SPAN` a multiple of the block's elements and `k0 + len <= cols`.
    #[inline(always)]
    unsafe fn fill<const R: usize, const WIDE: bool>(
        &self,
        row0: usize,
        k0: usize,
        len: usize,
        buffers: &mut [MaybeUninit<SpanBuffer>; R],
    ) {
        let blocks = len / B::ELEMENTS;
        for (r, buffer) in buffers.iter_mut().enumerate() {
            // SAFETY: row in range and the span's blocks inside it (caller).
            unsafe {
                let row = self.weight.row_unchecked(row0 + r);
                let first = row.as_ptr().add(k0 / B::ELEMENTS * B::BYTES);
                for line in (0..blocks * B::BYTES).step_by(64) {
                    super::prefetch_ahead(first.add(line));
                }
                for b in 0..blocks {
                    let block = first.add(b * B::BYTES);
                    let dst = buffer.as_mut_ptr().cast::<f32>().add(b * B::ELEMENTS);
                    if WIDE {
                        B::decode512(block, dst);
                    } else {
                        B::decode256(block, dst);
                    }
                }
            }
        }
    }

    /// # Safety
    /// As [`Self::rows_simd`], on a CPU with AVX-512F/BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn rows_avx512<const R: usize, const T: usize>(&self, row0: usize, out: &mut [f32]) {
        use super::decode::RowDecode;
        let cols = self.weight.cols();
        let xp = self.x.as_ptr();
        let mut buffers = span_buffers::<R>();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut k0 = 0;
        while k0 < cols {
            let len = SPAN.min(cols - k0);
            // SAFETY: rows in range (caller); the span lies in the row.
            unsafe { self.fill::<R, true>(row0, k0, len, &mut buffers) };
            let mut e = 0;
            while e < len {
                // SAFETY: e + 16 <= len <= SPAN (len is a multiple of 16), and `fill`
                // wrote inputs 0..len of every buffer; token t's row holds cols inputs
                // from t * x_stride (caller).
                unsafe {
                    let w: [__m512; R] = std::array::from_fn(|r| {
                        _mm512_load_ps(buffers[r].as_ptr().cast::<f32>().add(e))
                    });
                    for t in 0..T {
                        let xv = _mm512_loadu_ps(xp.add(t * self.x_stride + k0 + e));
                        for (acc_r, &w_r) in acc.iter_mut().zip(&w) {
                            acc_r[t] = _mm512_fmadd_ps(w_r, xv, acc_r[t]);
                        }
                    }
                }
                e += 16;
            }
            k0 += len;
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                out[r * T + t] += _mm512_reduce_add_ps(*a);
            }
        }
    }

    /// # Safety
    /// As [`Self::rows_simd`], on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_avx2<const R: usize, const T: usize>(&self, row0: usize, out: &mut [f32]) {
        use super::decode::RowDecode;
        let cols = self.weight.cols();
        let xp = self.x.as_ptr();
        let mut buffers = span_buffers::<R>();
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut k0 = 0;
        while k0 < cols {
            let len = SPAN.min(cols - k0);
            // SAFETY: rows in range (caller); the span lies in the row.
            unsafe { self.fill::<R, false>(row0, k0, len, &mut buffers) };
            let mut e = 0;
            while e < len {
                // SAFETY: e + 8 <= len <= SPAN, and `fill` wrote inputs 0..len of every
                // buffer; token t's row holds cols inputs from t * x_stride (caller).
                unsafe {
                    let w: [__m256; R] = std::array::from_fn(|r| {
                        _mm256_load_ps(buffers[r].as_ptr().cast::<f32>().add(e))
                    });
                    for t in 0..T {
                        let xv = _mm256_loadu_ps(xp.add(t * self.x_stride + k0 + e));
                        for (acc_r, &w_r) in acc.iter_mut().zip(&w) {
                            acc_r[t] = _mm256_fmadd_ps(w_r, xv, acc_r[t]);
                        }
                    }
                }
                e += 8;
            }
            k0 += len;
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                out[r * T + t] += hsum256(*a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::decode::{F32Rows, RowDecode};
    use crate::cpu::gemv;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// A `[rows, blocks * B::ELEMENTS]` weight of random blocks whose f16 scales are
    /// finite, of either sign and of varied magnitude.
    fn random_weight<B: SimdBlock>(rows: usize, blocks: usize, seed: u64) -> GgmlWeight {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut data = vec![0u8; rows * blocks * B::BYTES];
        rng.fill(data.as_mut_slice());
        for chunk in data.chunks_exact_mut(B::BYTES) {
            for &offset in loraq_quant::ggml::f16_scale_offsets(B::TYPE) {
                let scale: f32 = rng.random_range(-4e-2..4e-2);
                let bits = loraq_quant::ggml::fp32_to_fp16(scale);
                chunk[offset..offset + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        GgmlWeight::new("span", B::TYPE, rows, blocks * B::ELEMENTS, data).unwrap()
    }

    /// The span loop against the generic loop over the weight dequantized by
    /// `block_element` (the fused path's baseline): the same bits for every ISA, 1 to
    /// 8 tokens, rows in passes of 4, 2 and 1, and rows of 1 to 9 blocks (spans shorter
    /// than 256 inputs for the 32-element types).
    fn check<B: SimdBlock, const T: usize>() {
        let rows = 7;
        for blocks in [1, 2, 3, 9] {
            let weight = random_weight::<B>(rows, blocks, 11 + blocks as u64);
            let cols = weight.in_features;
            let decoded = BlockRows::new(&weight, B::default());
            let dense: Vec<f32> = (0..rows)
                .flat_map(|r| (0..cols).map(move |k| (r, k)))
                .map(|(r, k)| decoded.get(r, k))
                .collect();
            let dense = F32Rows {
                data: &dense,
                rows,
                cols,
            };
            let x_stride = cols + 3;
            let mut rng = ChaCha8Rng::seed_from_u64(blocks as u64);
            let x: Vec<f32> = (0..T * x_stride)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            for isa in Isa::available() {
                if isa == Isa::Scalar {
                    continue;
                }
                let kernel = GgmlKernel {
                    isa,
                    weight: BlockRows::new(&weight, B::default()),
                    x: &x,
                    x_stride,
                };
                let mut got = vec![0f32; rows * T];
                kernel.dot_rows::<T>(0, rows, &mut got);
                let mut want = vec![0f32; rows * T];
                gemv::dot_rows::<_, T>(isa, &dense, 0, rows, &x, x_stride, &mut want);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{} {isa:?} {blocks} blocks, {T} tokens, output {i}: {g:e} vs {w:e}",
                        B::TYPE
                    );
                }
            }
        }
    }

    fn check_tokens<B: SimdBlock>() {
        check::<B, 1>();
        check::<B, 2>();
        check::<B, 3>();
        check::<B, 4>();
        check::<B, 5>();
        check::<B, 8>();
    }

    #[test]
    fn span_loop_is_the_generic_loop_over_the_decoded_weight() {
        check_tokens::<Q8_0Block>();
        check_tokens::<Q4_0Block>();
        check_tokens::<Q4KBlock>();
        check_tokens::<Q5KBlock>();
        check_tokens::<Q6KBlock>();
        check_tokens::<Iq4XsBlock>();
    }
}
