//! Decode rows of a GGUF base (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS) with each block's
//! dequantized vectors multiplied straight into the accumulators.
//!
//! Per block, the scales of each of the pass's `R` rows are unpacked once
//! ([`SimdBlock::scales512`] / [`SimdBlock::scales256`]); then step by step (a 32- or
//! 64-element unit of the block, [`SimdBlock::STEP`]) each row's codes are dequantized
//! in registers ([`SimdBlock::step512`] / [`SimdBlock::step256`]: Q4_0, Q4_K and IQ4_XS
//! look each 4-bit code up with one `vpermps` in a 16-entry table of the group's
//! dequantized values, Q5_K with `vpermt2ps` in 32 entries (with AVX512_VBMI its 64
//! codes of a step assembled as bytes and moved into the lanes by one `vpermb`:
//! [`SimdBlock::step512_vbmi`]), Q6_K assembles 64 codes `q - 32` as bytes and widens
//! them) and multiplied into every token's accumulator,
//! 16 (AVX-512) or 8 (AVX2) inputs per vector. The rows of a pass take turns step by
//! step, so the `R x T` accumulators' dependency chains overlap. The vectors are the
//! bits of `loraq_quant::ggml::block_element`, and each row's products are
//! accumulated in one vector per token in input order and reduced as
//! [`super::gemv::dot_rows`] reduces them, so the output equals the generic loop over
//! the dequantized weight bit for bit. GGUF rows are whole blocks (32 or 256 inputs),
//! so there is no tail.
//!
//! One loop serves the three instruction sets (AVX-512, AVX-512 with VBMI, AVX2)
//! through [`Width`], whose few vector
//! operations are `#[inline(always)]` wrappers of the intrinsics: monomorphized inside
//! the `#[target_feature]` entry points it compiles to the code written for each set.

use super::Isa;
use super::decode_ggml::{BlockRows, GgmlVisitor, ScalarBlock, SimdBlock, visit_ggml};
use super::fused::{self, BaseKernel, LoraPass, Schedule, Scratch};
use super::{Parallelism, gemv::hsum256};
use loraq_quant::ggml::GgmlWeight;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Inputs per prefetch span (one K-quant super-block, eight 32-element blocks).
const SPAN: usize = 256;

/// The vector operations of the loop on one instruction set.
trait Width {
    /// A vector of f32.
    type F: Copy;
    /// Lanes per vector.
    const LANES: usize;
    /// A block type's unpacked scales on this set.
    type Scales<B: SimdBlock>: Copy;
    /// A block type's vectors of one step on this set.
    type Step<B: SimdBlock>: AsRef<[Self::F]>;
    /// All lanes zero.
    ///
    /// # Safety
    /// The CPU has the set.
    unsafe fn zero() -> Self::F;
    /// `acc + w * x`, `x` the `LANES` f32 at `x` (one fused multiply-add).
    ///
    /// # Safety
    /// The CPU has the set; `x .. x + LANES` is readable.
    unsafe fn fmadd(w: Self::F, x: *const f32, acc: Self::F) -> Self::F;
    /// The sum of the lanes, in the generic loop's order.
    ///
    /// # Safety
    /// The CPU has the set.
    unsafe fn sum(v: Self::F) -> f32;
    /// [`SimdBlock::scales512_rows`], or [`SimdBlock::scales256`] of each row: the
    /// scales of the same block of `R` rows, into `out`.
    ///
    /// # Safety
    /// As those.
    unsafe fn scales_rows<B: SimdBlock, const R: usize>(
        blocks: [*const u8; R],
        out: &mut [MaybeUninit<Self::Scales<B>>; R],
    );
    /// [`SimdBlock::step512`] or [`SimdBlock::step256`].
    ///
    /// # Safety
    /// As those.
    unsafe fn step<B: SimdBlock>(
        block: *const u8,
        scales: &Self::Scales<B>,
        step: usize,
    ) -> Self::Step<B>;
}

/// AVX-512F/BW, 16 lanes.
struct Avx512;

impl Width for Avx512 {
    type F = __m512;
    const LANES: usize = 16;
    type Scales<B: SimdBlock> = B::Scales512;
    type Step<B: SimdBlock> = B::Step512;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: the caller's CPU has AVX-512F.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn fmadd(w: __m512, x: *const f32, acc: __m512) -> __m512 {
        // SAFETY: AVX-512F and 16 readable f32 (caller).
        unsafe { _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc) }
    }
    #[inline(always)]
    unsafe fn sum(v: __m512) -> f32 {
        // SAFETY: the caller's CPU has AVX-512F.
        unsafe { _mm512_reduce_add_ps(v) }
    }
    #[inline(always)]
    unsafe fn scales_rows<B: SimdBlock, const R: usize>(
        blocks: [*const u8; R],
        out: &mut [MaybeUninit<B::Scales512>; R],
    ) {
        // SAFETY: forwarded contract.
        unsafe { B::scales512_rows(blocks, out) }
    }
    #[inline(always)]
    unsafe fn step<B: SimdBlock>(
        block: *const u8,
        scales: &B::Scales512,
        step: usize,
    ) -> B::Step512 {
        // SAFETY: forwarded contract.
        unsafe { B::step512(block, scales, step) }
    }
}

/// AVX-512F/BW with AVX512_VBMI: [`Avx512`] with [`SimdBlock::step512_vbmi`].
struct Avx512Vbmi;

impl Width for Avx512Vbmi {
    type F = __m512;
    const LANES: usize = 16;
    type Scales<B: SimdBlock> = B::Scales512;
    type Step<B: SimdBlock> = B::Step512;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: forwarded contract.
        unsafe { Avx512::zero() }
    }
    #[inline(always)]
    unsafe fn fmadd(w: __m512, x: *const f32, acc: __m512) -> __m512 {
        // SAFETY: forwarded contract.
        unsafe { Avx512::fmadd(w, x, acc) }
    }
    #[inline(always)]
    unsafe fn sum(v: __m512) -> f32 {
        // SAFETY: forwarded contract.
        unsafe { Avx512::sum(v) }
    }
    #[inline(always)]
    unsafe fn scales_rows<B: SimdBlock, const R: usize>(
        blocks: [*const u8; R],
        out: &mut [MaybeUninit<B::Scales512>; R],
    ) {
        // SAFETY: forwarded contract.
        unsafe { B::scales512_rows(blocks, out) }
    }
    #[inline(always)]
    unsafe fn step<B: SimdBlock>(
        block: *const u8,
        scales: &B::Scales512,
        step: usize,
    ) -> B::Step512 {
        // SAFETY: forwarded contract (the CPU has AVX512_VBMI too).
        unsafe { B::step512_vbmi(block, scales, step) }
    }
}

/// AVX2 + FMA, 8 lanes.
struct Avx2;

impl Width for Avx2 {
    type F = __m256;
    const LANES: usize = 8;
    type Scales<B: SimdBlock> = B::Scales256;
    type Step<B: SimdBlock> = B::Step256;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: the caller's CPU has AVX.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn fmadd(w: __m256, x: *const f32, acc: __m256) -> __m256 {
        // SAFETY: AVX2 + FMA and 8 readable f32 (caller).
        unsafe { _mm256_fmadd_ps(w, _mm256_loadu_ps(x), acc) }
    }
    #[inline(always)]
    unsafe fn sum(v: __m256) -> f32 {
        // SAFETY: the caller's CPU has AVX2.
        unsafe { hsum256(v) }
    }
    #[inline(always)]
    unsafe fn scales_rows<B: SimdBlock, const R: usize>(
        blocks: [*const u8; R],
        out: &mut [MaybeUninit<B::Scales256>; R],
    ) {
        for (o, block) in out.iter_mut().zip(blocks) {
            // SAFETY: forwarded contract.
            o.write(unsafe { B::scales256(block) });
        }
    }
    #[inline(always)]
    unsafe fn step<B: SimdBlock>(
        block: *const u8,
        scales: &B::Scales256,
        step: usize,
    ) -> B::Step256 {
        // SAFETY: forwarded contract.
        unsafe { B::step256(block, scales, step) }
    }
}

/// A GGUF base of a [`SimdBlock`] type through the fused loop.
pub(crate) struct GgmlKernel<'a, B: SimdBlock> {
    /// AVX-512 or AVX2.
    pub isa: Isa,
    /// With [`Isa::Avx512`]: the CPU also has AVX512_VBMI ([`SimdBlock::step512_vbmi`]).
    pub vbmi: bool,
    pub weight: BlockRows<'a, B>,
    /// Activations, `[T, in_features]`, rows `x_stride` apart.
    pub x: &'a [f32],
    pub x_stride: usize,
}

/// Whether the CPU has AVX512_VBMI (byte permutes), which the AVX-512 loop uses where
/// it has [`SimdBlock::step512_vbmi`].
pub(crate) fn has_vbmi() -> bool {
    is_x86_feature_detected!("avx512vbmi")
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
            let kernel = GgmlKernel {
                isa: self.isa,
                vbmi: has_vbmi(),
                weight,
                x: self.x,
                x_stride: self.x_stride,
            };
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
                Isa::Avx512 if self.vbmi => self.rows_avx512_vbmi::<R, T>(row0, out),
                Isa::Avx512 => self.rows_avx512::<R, T>(row0, out),
                Isa::Avx2 => self.rows_avx2::<R, T>(row0, out),
                Isa::Scalar => unreachable!("the GGUF loop needs AVX2 or AVX-512"),
            }
        }
    }

    /// # Safety
    /// As [`Self::rows_simd`], on a CPU with AVX-512F/BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn rows_avx512<const R: usize, const T: usize>(&self, row0: usize, out: &mut [f32]) {
        // SAFETY: forwarded from the caller.
        unsafe { self.rows_with::<Avx512, R, T>(row0, out) }
    }

    /// # Safety
    /// As [`Self::rows_simd`], on a CPU with AVX-512F/BW and AVX512_VBMI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn rows_avx512_vbmi<const R: usize, const T: usize>(
        &self,
        row0: usize,
        out: &mut [f32],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { self.rows_with::<Avx512Vbmi, R, T>(row0, out) }
    }

    /// # Safety
    /// As [`Self::rows_simd`], on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_avx2<const R: usize, const T: usize>(&self, row0: usize, out: &mut [f32]) {
        // SAFETY: forwarded from the caller.
        unsafe { self.rows_with::<Avx2, R, T>(row0, out) }
    }

    /// The loop on `W`'s instruction set: per block, every row's scales, then step by
    /// step every row's vectors into its `T` accumulators.
    ///
    /// # Safety
    /// As [`Self::rows_simd`], on a CPU with `W`'s set.
    #[inline(always)]
    unsafe fn rows_with<W: Width, const R: usize, const T: usize>(
        &self,
        row0: usize,
        out: &mut [f32],
    ) {
        use super::decode::RowDecode;
        let cols = self.weight.cols();
        let blocks = cols / B::ELEMENTS;
        let span_blocks = SPAN / B::ELEMENTS;
        let xp = self.x.as_ptr();
        let mut rows = [std::ptr::null::<u8>(); R];
        for (r, row) in rows.iter_mut().enumerate() {
            // SAFETY: row0 + r < rows (caller).
            *row = unsafe { self.weight.row_unchecked(row0 + r).as_ptr() };
        }
        // SAFETY: the CPU has W's set (caller).
        let mut acc = [[unsafe { W::zero() }; T]; R];
        let mut scales = [const { MaybeUninit::<W::Scales<B>>::uninit() }; R];
        for b in 0..blocks {
            // SAFETY: block b of each row lies in the row (b < blocks); token t's
            // inputs b * ELEMENTS .. + ELEMENTS lie in its row of x (caller).
            unsafe {
                if b % span_blocks == 0 {
                    let span_bytes = span_blocks.min(blocks - b) * B::BYTES;
                    for row in rows {
                        for line in (0..span_bytes).step_by(64) {
                            super::prefetch_ahead(row.add(b * B::BYTES + line));
                        }
                    }
                }
                W::scales_rows::<B, R>(rows.map(|row| row.add(b * B::BYTES)), &mut scales);
                let x_block = xp.add(b * B::ELEMENTS);
                for step in 0..B::ELEMENTS / B::STEP {
                    for r in 0..R {
                        let block = rows[r].add(b * B::BYTES);
                        let w = W::step::<B>(block, scales[r].assume_init_ref(), step);
                        for (v, &w_v) in w.as_ref().iter().enumerate() {
                            let x = x_block.add(step * B::STEP + v * W::LANES);
                            for (t, a) in acc[r].iter_mut().enumerate() {
                                *a = W::fmadd(w_v, x.add(t * self.x_stride), *a);
                            }
                        }
                    }
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (t, a) in acc_r.iter().enumerate() {
                // SAFETY: the CPU has W's set (caller).
                out[r * T + t] += unsafe { W::sum(*a) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::decode::{F32Rows, RowDecode};
    use crate::cpu::decode_ggml::{Iq4XsBlock, Q4_0Block, Q4KBlock, Q5KBlock, Q6KBlock, Q8_0Block};
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
                let mut want = vec![0f32; rows * T];
                gemv::dot_rows::<_, T>(isa, &dense, 0, rows, &x, x_stride, &mut want);
                // AVX-512 with and (where the CPU has it) without AVX512_VBMI.
                let vbmi_variants = if isa == Isa::Avx512 && has_vbmi() {
                    &[false, true][..]
                } else {
                    &[false][..]
                };
                for &vbmi in vbmi_variants {
                    let kernel = GgmlKernel {
                        isa,
                        vbmi,
                        weight: BlockRows::new(&weight, B::default()),
                        x: &x,
                        x_stride,
                    };
                    let mut got = vec![0f32; rows * T];
                    kernel.dot_rows::<T>(0, rows, &mut got);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{} {isa:?} (vbmi {vbmi}) {blocks} blocks, {T} tokens, output {i}: \
                             {g:e} vs {w:e}",
                            B::TYPE
                        );
                    }
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
