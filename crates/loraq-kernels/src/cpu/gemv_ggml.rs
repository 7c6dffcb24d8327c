//! Decode rows of a GGUF base (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS) straight from its
//! blocks into the accumulators.
//!
//! AVX-512: the scales are factored out of the sums, as llama.cpp's own dot products
//! do (`ggml/src/ggml-cpu/arch/x86/quants.c`, `ggml_vec_dot_q4_K_q8_K` and its
//! siblings). Per block, the scales of each of the pass's `R` rows are unpacked once
//! into one vector ([`SimdBlock::factors512`]); then step by step each row's code
//! values before their scale ([`SimdBlock::codes512`]: `q`, `q - 8`, `q - 32`, an IQ4
//! table value, exact small integers) are multiplied by the activation and summed per
//! lane, and the sum is multiplied by the step's per-lane scales
//! ([`SimdBlock::step_scales512`]) into the token's accumulator, as NVFP4's loop does
//! (`gemv_fp4.rs`): `acc += (d sc) sum q x` per group. Q4_K / Q5_K's minimums add
//! `-(dmin m) sum x` per 32-element group once per block, the group sums of each
//! token's activation computed once per call. The codes are read as 16 dword lanes of
//! 64 code bytes, each code picked by a shift and looked up with one `vpermps` (Q5_K:
//! its fifth bit merged in by one rotation and one ternary-logic operation, then
//! `vpermt2ps` in 32 entries), so the lanes of a step are not in input order: the
//! activation is reordered once per call (and token) to the codes' order
//! ([`SimdBlock::source512`]) instead. The output differs from the generic loop over
//! the dequantized weight by the summation order and the factored scales only (within
//! rounding of the f64 reference: `tests/fast_vs_reference.rs`).
//!
//! AVX2: the same factoring, in input order. Per block each row's scales are unpacked
//! once ([`SimdBlock::scales256`]); then step by step each row's code values before
//! their scale ([`SimdBlock::codes256`], 8 per vector) are multiplied by the activation
//! and summed per lane over the vectors that share a scale (a group of 32, Q6_K's of
//! 16), and that sum is multiplied by the group's scale into the token's accumulator
//! ([`SimdBlock::step_scale256`]): one multiply-add per 8 inputs and token plus one per
//! group, where dequantizing first took a multiply (Q4_K / Q5_K: a multiply-subtract)
//! per 8 inputs more. Q4_K / Q5_K's minimums add `-(dmin m) sum x` once per block
//! ([`SimdBlock::mins256`] against the same group sums). The codes are in input order,
//! so the activation is read in place.
//!
//! Both loops let the rows of a pass take turns step by step, so the `R x T`
//! accumulators' dependency chains overlap. GGUF rows are whole blocks (32 or 256
//! inputs), so there is no tail.

use super::Isa;
use super::decode_ggml::{BlockRows, GgmlVisitor, ScalarBlock, SimdBlock, visit_ggml};
use super::fused::{self, BaseKernel, LoraPass, Schedule, Scratch};
use super::{Parallelism, gemv::hsum256};
use loraq_quant::ggml::GgmlWeight;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Inputs per prefetch span (one K-quant super-block, eight 32-element blocks).
const SPAN: usize = 256;

/// The activations in the AVX-512 loop's order, and their group sums (both loops).
pub(crate) struct FactoredActivations {
    /// `[T, in_features]`: each block's inputs in [`SimdBlock::source512`]'s order
    /// (AVX-512; empty for the AVX2 loop, which reads them in input order).
    reordered: Vec<f32>,
    /// `[T, blocks, 16]` with [`SimdBlock::HAS_MINS`] (else empty): lane `8 + g` of
    /// each block holds minus the sum of the block's group `g` of 32 inputs, lanes 0..8
    /// zero, so that one multiply-add with [`SimdBlock::factors512`] (`d sc` in lanes
    /// 0..8, `dmin m` in lanes 8..16) adds `-(dmin m) sum x` for every group.
    negated_group_sums: Vec<f32>,
}

impl FactoredActivations {
    /// `x` (`T` rows of `in_features`, `x_stride` apart) for `B`'s factored loops,
    /// reordered for the AVX-512 one when `reorder`.
    fn new<B: SimdBlock>(
        x: &[f32],
        tokens: usize,
        in_features: usize,
        x_stride: usize,
        reorder: bool,
    ) -> Self {
        let blocks = in_features / B::ELEMENTS;
        let mut reordered = vec![0f32; if reorder { tokens * in_features } else { 0 }];
        let mut negated_group_sums = if B::HAS_MINS {
            vec![0f32; tokens * blocks * 16]
        } else {
            Vec::new()
        };
        for t in 0..tokens {
            let src = &x[t * x_stride..t * x_stride + in_features];
            for (b, s) in src.chunks_exact(B::ELEMENTS).enumerate() {
                if reorder {
                    let d = &mut reordered[t * in_features + b * B::ELEMENTS..][..B::ELEMENTS];
                    for (p, v) in d.iter_mut().enumerate() {
                        *v = s[B::source512(p)];
                    }
                }
                if B::HAS_MINS {
                    let sums = &mut negated_group_sums[(t * blocks + b) * 16..][..16];
                    for (g, group) in s.chunks_exact(32).enumerate() {
                        sums[8 + g] = -group.iter().sum::<f32>();
                    }
                }
            }
        }
        Self {
            reordered,
            negated_group_sums,
        }
    }
}

/// A GGUF base of a [`SimdBlock`] type through the fused loop.
pub(crate) struct GgmlKernel<'a, B: SimdBlock> {
    /// AVX-512 or AVX2.
    pub isa: Isa,
    pub weight: BlockRows<'a, B>,
    /// Activations, `[T, in_features]`, rows `x_stride` apart (the AVX2 loop's).
    pub x: &'a [f32],
    pub x_stride: usize,
    /// The group sums, and with [`Isa::Avx512`] `x` in the factored loop's order.
    pub factored: FactoredActivations,
}

impl<'a, B: SimdBlock> GgmlKernel<'a, B> {
    /// The kernel of `weight` on `isa` (AVX-512 or AVX2) for `tokens` rows of `x`.
    pub(crate) fn new(
        isa: Isa,
        weight: BlockRows<'a, B>,
        x: &'a [f32],
        tokens: usize,
        x_stride: usize,
    ) -> Self {
        use super::decode::RowDecode;
        let factored =
            FactoredActivations::new::<B>(x, tokens, weight.cols(), x_stride, isa == Isa::Avx512);
        Self {
            isa,
            weight,
            x,
            x_stride,
            factored,
        }
    }
}

/// Runs the fused decode of `w` through this loop when its type has one (returns
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
    /// The decode's arguments, run once the block type is known.
    struct Run<'a, 'b, const T: usize> {
        isa: Isa,
        par: Parallelism,
        schedule: Schedule,
        x: &'a [f32],
        x_stride: usize,
        lora: Option<&'a LoraPass<'b>>,
        out: &'a mut [f32],
    }
    impl<const T: usize> GgmlVisitor for Run<'_, '_, T> {
        type Output = bool;
        fn simd<B: SimdBlock>(self, weight: BlockRows<'_, B>) -> bool {
            let kernel = GgmlKernel::new(self.isa, weight, self.x, T, self.x_stride);
            fused::decode::<_, T>(
                self.isa,
                self.par,
                self.schedule,
                &kernel,
                self.lora,
                self.out,
            );
            true
        }
        fn scalar(self, _: BlockRows<'_, ScalarBlock>) -> bool {
            false
        }
    }
    debug_assert!(matches!(isa, Isa::Avx512 | Isa::Avx2));
    visit_ggml(
        w,
        Run::<T> {
            isa,
            par,
            schedule,
            x,
            x_stride,
            lora,
            out,
        },
    )
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
        let f = &self.factored;
        assert!(self.isa != Isa::Avx512 || f.reordered.len() >= T * cols);
        assert!(!B::HAS_MINS || f.negated_group_sums.len() >= T * cols / B::ELEMENTS * 16);
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
    /// values; `x` holds `T` rows of `cols` inputs, `x_stride` apart, `self.factored`
    /// their group sums and, with AVX-512, the inputs reordered.
    unsafe fn rows_simd<const R: usize, const T: usize>(&self, row0: usize, out: &mut [f32]) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match self.isa {
                Isa::Avx512 => self.rows_avx512::<R, T>(row0, &self.factored, out),
                Isa::Avx2 => self.rows_avx2::<R, T>(row0, &self.factored, out),
                _ => unreachable!("the GGUF loop needs AVX2 or AVX-512"),
            }
        }
    }

    /// Prefetches the span of blocks from block `b` of each row when `b` starts one.
    ///
    /// # Safety
    /// Block `b` lies in each row (`b < blocks`).
    #[inline(always)]
    unsafe fn prefetch_span<const R: usize>(rows: &[*const u8; R], b: usize, blocks: usize) {
        let span_blocks = SPAN / B::ELEMENTS;
        if b.is_multiple_of(span_blocks) {
            let span_bytes = span_blocks.min(blocks - b) * B::BYTES;
            for &row in rows {
                for line in (0..span_bytes).step_by(64) {
                    // SAFETY: the span lies in the row (caller).
                    super::prefetch_ahead(unsafe { row.add(b * B::BYTES + line) });
                }
            }
        }
    }

    /// The first byte of each of the `R` rows from `row0`.
    ///
    /// # Safety
    /// Rows `row0 .. row0 + R` exist.
    #[inline(always)]
    unsafe fn row_starts<const R: usize>(&self, row0: usize) -> [*const u8; R] {
        // SAFETY: row0 + r < rows (caller).
        std::array::from_fn(|r| unsafe { self.weight.row_unchecked(row0 + r).as_ptr() })
    }

    /// The factored loop: per block, every row's scales; step by step every row's code
    /// values times the reordered activation, summed per lane and scaled once per step
    /// into its `T` accumulators; then, for types with minimums, `-(dmin m) sum x` of
    /// every group by one multiply-add per row and token.
    ///
    /// # Safety
    /// As [`Self::rows_simd`], on a CPU with AVX-512F/BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn rows_avx512<const R: usize, const T: usize>(
        &self,
        row0: usize,
        f: &FactoredActivations,
        out: &mut [f32],
    ) {
        use super::decode::RowDecode;
        let cols = self.weight.cols();
        let blocks = cols / B::ELEMENTS;
        let vectors = B::CODES512 / 16;
        let xp = f.reordered.as_ptr();
        let sums = f.negated_group_sums.as_ptr();
        // SAFETY: rows row0 .. row0 + R exist (caller).
        let rows = unsafe { self.row_starts::<R>(row0) };
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut factors = [_mm512_setzero_ps(); R];
        for b in 0..blocks {
            // SAFETY: block b of each row lies in the row (b < blocks); token t's
            // reordered inputs b * ELEMENTS .. + ELEMENTS lie in its row of
            // `reordered`, and its block sums in `negated_group_sums` (caller,
            // `dot_rows`' assertions).
            unsafe {
                Self::prefetch_span::<R>(&rows, b, blocks);
                B::factors512_rows::<R>(rows.map(|row| row.add(b * B::BYTES)), &mut factors);
                let x_block = xp.add(b * B::ELEMENTS);
                for step in 0..B::ELEMENTS / B::CODES512 {
                    for r in 0..R {
                        let w = B::codes512(rows[r].add(b * B::BYTES), step);
                        let w = w.as_ref();
                        let scales = B::step_scales512(factors[r], step);
                        for (t, a) in acc[r].iter_mut().enumerate() {
                            let x = x_block.add(t * cols + step * B::CODES512);
                            let mut p = _mm512_mul_ps(w[0], _mm512_loadu_ps(x));
                            // Indexed: the iterator adaptors over the step's
                            // vectors were left as calls (three times the loop's time).
                            #[allow(clippy::needless_range_loop)]
                            for v in 1..vectors {
                                p = _mm512_fmadd_ps(w[v], _mm512_loadu_ps(x.add(16 * v)), p);
                            }
                            *a = _mm512_fmadd_ps(p, scales, *a);
                        }
                    }
                }
                if B::HAS_MINS {
                    for r in 0..R {
                        for (t, a) in acc[r].iter_mut().enumerate() {
                            let s = _mm512_loadu_ps(sums.add((t * blocks + b) * 16));
                            *a = _mm512_fmadd_ps(factors[r], s, *a);
                        }
                    }
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                out[r * T + t] += _mm512_reduce_add_ps(*a);
            }
        }
    }

    /// The AVX2 factored loop: per block, every row's scales; step by step every row's
    /// code values times the activation, summed per lane over the vectors of a scale
    /// group and scaled once per group into its `T` accumulators; then, for types with
    /// minimums, `-(dmin m) sum x` of the block's eight groups by one multiply-add per
    /// row and token.
    ///
    /// # Safety
    /// As [`Self::rows_simd`], on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_avx2<const R: usize, const T: usize>(
        &self,
        row0: usize,
        f: &FactoredActivations,
        out: &mut [f32],
    ) {
        use super::decode::RowDecode;
        let cols = self.weight.cols();
        let blocks = cols / B::ELEMENTS;
        let group_vectors = B::SCALE_VECTORS256;
        let xp = self.x.as_ptr();
        let sums = f.negated_group_sums.as_ptr();
        // SAFETY: rows row0 .. row0 + R exist (caller).
        let rows = unsafe { self.row_starts::<R>(row0) };
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut scales = [const { MaybeUninit::<B::Scales256>::uninit() }; R];
        for b in 0..blocks {
            // SAFETY: block b of each row lies in the row (b < blocks); token t's
            // inputs b * ELEMENTS .. + ELEMENTS lie in its row of x, and its block sums
            // in `negated_group_sums` (caller, `dot_rows`' assertions).
            unsafe {
                Self::prefetch_span::<R>(&rows, b, blocks);
                for (s, row) in scales.iter_mut().zip(rows) {
                    s.write(B::scales256(row.add(b * B::BYTES)));
                }
                let x_block = xp.add(b * B::ELEMENTS);
                for step in 0..B::ELEMENTS / B::STEP {
                    for r in 0..R {
                        let w = B::codes256(rows[r].add(b * B::BYTES), step);
                        let w = w.as_ref();
                        let s_r = scales[r].assume_init_ref();
                        for g in 0..w.len() / group_vectors {
                            let scale = _mm256_set1_ps(B::step_scale256(s_r, step, g));
                            let v0 = g * group_vectors;
                            for (t, a) in acc[r].iter_mut().enumerate() {
                                let x = x_block.add(t * self.x_stride + step * B::STEP + 8 * v0);
                                let mut p = _mm256_mul_ps(w[v0], _mm256_loadu_ps(x));
                                for v in 1..group_vectors {
                                    p = _mm256_fmadd_ps(
                                        w[v0 + v],
                                        _mm256_loadu_ps(x.add(8 * v)),
                                        p,
                                    );
                                }
                                *a = _mm256_fmadd_ps(p, scale, *a);
                            }
                        }
                    }
                }
                if B::HAS_MINS {
                    for r in 0..R {
                        let mins = B::mins256(scales[r].assume_init_ref());
                        for (t, a) in acc[r].iter_mut().enumerate() {
                            let s = _mm256_loadu_ps(sums.add((t * blocks + b) * 16 + 8));
                            *a = _mm256_fmadd_ps(mins, s, *a);
                        }
                    }
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                out[r * T + t] += hsum256(*a);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cpu::decode::RowDecode;
    use crate::cpu::decode_ggml::{Iq4XsBlock, Q4_0Block, Q4KBlock, Q5KBlock, Q6KBlock, Q8_0Block};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// A `[rows, blocks * B::ELEMENTS]` weight of random blocks whose f16 scales are
    /// finite, of either sign and of varied magnitude.
    pub(crate) fn random_weight<B: SimdBlock>(rows: usize, blocks: usize, seed: u64) -> GgmlWeight {
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

    /// Both loops against the f64 sum over the weight dequantized by `block_element`,
    /// within rounding (2^-12 of `sum |w x|`; the AVX-512 loop sums in another order
    /// and scales each step's sums once): every ISA, 1 to 8 tokens, rows in passes of
    /// 4, 2 and 1, and rows of 1 to 9 blocks (spans shorter than 256 inputs for the
    /// 32-element types).
    fn check<B: SimdBlock, const T: usize>() {
        let rows = 7;
        for blocks in [1, 2, 3, 9] {
            let weight = random_weight::<B>(rows, blocks, 11 + blocks as u64);
            let cols = weight.in_features;
            let decoded = BlockRows::new(&weight, B::default());
            let x_stride = cols + 3;
            let mut rng = ChaCha8Rng::seed_from_u64(blocks as u64);
            let x: Vec<f32> = (0..T * x_stride)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let mut want = vec![0f64; rows * T];
            let mut magnitude = vec![0f64; rows * T];
            for r in 0..rows {
                for t in 0..T {
                    for k in 0..cols {
                        let p = f64::from(decoded.get(r, k)) * f64::from(x[t * x_stride + k]);
                        want[r * T + t] += p;
                        magnitude[r * T + t] += p.abs();
                    }
                }
            }
            for isa in Isa::available() {
                if isa == Isa::Scalar {
                    continue;
                }
                let kernel =
                    GgmlKernel::new(isa, BlockRows::new(&weight, B::default()), &x, T, x_stride);
                let mut got = vec![0f32; rows * T];
                kernel.dot_rows::<T>(0, rows, &mut got);
                for (i, g) in got.iter().enumerate() {
                    let err = (f64::from(*g) - want[i]).abs();
                    assert!(
                        err <= magnitude[i] / 4096.0,
                        "{} {isa:?} {blocks} blocks, {T} tokens, output {i}: {g:e} vs {:e} \
                         (magnitude {:e})",
                        B::TYPE,
                        want[i],
                        magnitude[i]
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
    fn span_loops_match_the_f64_sum_over_the_decoded_weight() {
        check_tokens::<Q8_0Block>();
        check_tokens::<Q4_0Block>();
        check_tokens::<Q4KBlock>();
        check_tokens::<Q5KBlock>();
        check_tokens::<Q6KBlock>();
        check_tokens::<Iq4XsBlock>();
    }
}
