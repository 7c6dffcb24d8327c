//! Row decoders: "dequantize a short run of one weight row straight into f32 registers".
//!
//! Each stored format implements [`RowDecode`]: a scalar element getter (tails, scalar
//! ISA) plus 16-wide (AVX-512) and 8-wide (AVX2) loads that turn packed codes into
//! dequantized f32 lanes with a handful of integer ops, never touching memory other than
//! the codes and their scale. The GEMV and GEMM kernels are generic over this trait, so a
//! new format is one impl.

use half::bf16;
use loraq_quant::element::{e4m3_decode, e8m0_decode};
use loraq_quant::{FP8_BLOCK, INT4_GROUP, MXFP4_BLOCK, NVFP4_BLOCK, Nvfp4GlobalScale};

#[cfg(target_arch = "x86_64")]
use super::lanes::{Avx2, Avx512, Lanes};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// E2M1 values by code (sign in bit 3): the permute table of the SIMD decoders
/// (checked against `loraq_quant::element::e2m1_decode` in the tests).
pub(crate) const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// 2^120: moves an E4M3 code, reinterpreted as an f32 with its exponent field shifted
/// into place, from the f32 bias (127) to the E4M3 bias (7). Subnormal E4M3 codes become
/// f32 subnormals and are scaled exactly as well.
const E4M3_REBIAS: f32 = f32::from_bits((127 + 120) << 23);
/// Bits kept of a sign-extended E4M3 code shifted left by 20: sign (31) and the
/// exponent + mantissa (30..20) of the code.
#[cfg(target_arch = "x86_64")]
pub(crate) const E4M3_F32_MASK: i32 = 0x87F0_0000_u32 as i32;

/// Decodes rows of a `[rows, cols]` matrix stored in some format into f32.
///
/// # Safety
/// The SIMD loads are `unsafe` because they need the CPU feature and read
/// `row * cols + k .. + 16` (or 8) without bounds checks: callers guarantee
/// `row < rows()`, `k % 16 == 0` (8 for `load8`) and `k + 16 <= cols()` (8 for `load8`).
pub(crate) trait RowDecode: Sync {
    /// Rows of the matrix.
    fn rows(&self) -> usize;
    /// Columns of the matrix.
    fn cols(&self) -> usize;
    /// One element, dequantized.
    fn get(&self, row: usize, k: usize) -> f32;
    /// 16 consecutive elements of `row` from `k`, dequantized (AVX-512F/BW).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(&self, row: usize, k: usize) -> __m512;
    /// 8 consecutive elements of `row` from `k`, dequantized (AVX2/FMA).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(&self, row: usize, k: usize) -> __m256;
    /// Elements per unit of [`RowDecode::decode_span512`] and
    /// [`RowDecode::decode_span256`]: a run whose scales those decoders unpack once (a
    /// ggml block, or the groups of a K-quant super-block that share their code bytes),
    /// a multiple of 16. 0, the default, where a format has no span decoder: its 16- and
    /// 8-lane loads look up one stored scale each, no more than a span decoder would.
    #[cfg(target_arch = "x86_64")]
    const SPAN: usize = 0;
    /// Elements `k .. k + len` of `row`, dequantized into `out` (AVX-512F/BW), each with
    /// the bits of [`RowDecode::get`]; the scales of each span are unpacked once, where
    /// every [`RowDecode::load16`] unpacks its own.
    ///
    /// # Safety
    /// `Self::SPAN > 0`; the CPU has AVX-512F/BW; `row < rows()`, `k` and `len` are
    /// multiples of `Self::SPAN`, `k + len <= cols()`; `out .. out + len` is writable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn decode_span512(&self, row: usize, k: usize, len: usize, out: *mut f32) {
        let _ = (row, k, len, out);
        unreachable!("decode_span512 of a format without span decoders (SPAN == 0)")
    }
    /// [`RowDecode::decode_span512`] with AVX2 and FMA.
    ///
    /// # Safety
    /// As [`RowDecode::decode_span512`], with AVX2 and FMA instead of AVX-512.
    #[cfg(target_arch = "x86_64")]
    unsafe fn decode_span256(&self, row: usize, k: usize, len: usize, out: *mut f32) {
        let _ = (row, k, len, out);
        unreachable!("decode_span256 of a format without span decoders (SPAN == 0)")
    }
    /// Address of the stored codes of element `(row, k)` (a software-prefetch target;
    /// may point past the end, it is never dereferenced). Only the x86-64 loops prefetch.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn code_address(&self, row: usize, k: usize) -> *const u8;
}

/// Row-major matrix of a float type that widens to f32 without a scale: f32 (the
/// dequantize-then-multiply baseline and tests) or bf16 (bf16 base weights and the LoRA
/// factors).
pub(crate) struct DenseRows<'a, E> {
    pub data: &'a [E],
    pub rows: usize,
    pub cols: usize,
}

/// Row-major f32 matrix.
pub(crate) type F32Rows<'a> = DenseRows<'a, f32>;
/// Row-major bf16 matrix.
pub(crate) type Bf16Rows<'a> = DenseRows<'a, bf16>;

/// An element type of [`DenseRows`]: how one value, and 16 or 8 consecutive ones,
/// become f32.
pub(crate) trait DenseElement: Copy + Sync {
    /// The value as f32 (exact).
    fn widen(self) -> f32;
    /// The 16 values from `p` (AVX-512F/BW).
    ///
    /// # Safety
    /// The CPU has AVX-512F/BW; `p .. p + 16` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> __m512;
    /// The 8 values from `p` (AVX2/FMA).
    ///
    /// # Safety
    /// The CPU has AVX2; `p .. p + 8` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

impl DenseElement for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: 16 readable values (caller).
        unsafe { _mm512_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: 8 readable values (caller).
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl DenseElement for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(p: *const bf16) -> __m512 {
        // bf16 is the top half of an f32: widen and shift.
        // SAFETY: 16 readable values (caller).
        unsafe {
            let raw = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8(p: *const bf16) -> __m256 {
        // SAFETY: 8 readable values (caller).
        unsafe {
            let raw = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
        }
    }
}

impl<E: DenseElement> RowDecode for DenseRows<'_, E> {
    #[inline(always)]
    fn code_address(&self, row: usize, k: usize) -> *const u8 {
        self.data
            .as_ptr()
            .wrapping_add(row * self.cols + k)
            .cast::<u8>()
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn get(&self, row: usize, k: usize) -> f32 {
        self.data[row * self.cols + k].widen()
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(&self, row: usize, k: usize) -> __m512 {
        // SAFETY: the caller holds the `RowDecode` contract (row < rows, k + 16 <= cols) and
        // the CPU feature this function is compiled for.
        unsafe { E::load16(self.data.as_ptr().add(row * self.cols + k)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8(&self, row: usize, k: usize) -> __m256 {
        // SAFETY: the caller holds the `RowDecode` contract (row < rows, k + 8 <= cols) and
        // the CPU feature this function is compiled for.
        unsafe { E::load8(self.data.as_ptr().add(row * self.cols + k)) }
    }
}

/// FP8 E4M3 codes with 128x128 tile multipliers.
///
/// `rebiased` holds `scale * 2^120` per tile (see [`E4M3_REBIAS`]) so a SIMD load is
/// one multiply; when some `scale * 2^120` overflows (a tile multiplier >= 2^8, never
/// seen in real checkpoints) `TWO_STEP` decoders multiply by 2^120 and the scale apart.
pub(crate) struct Fp8Block128Rows<'a, const TWO_STEP: bool> {
    pub codes: &'a [u8],
    pub scales: &'a [f32],
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub rebiased: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub scale_cols: usize,
}

/// `scale * 2^120` per tile, or `None` when one of them overflows.
pub(crate) fn fp8_rebiased_scales(scales: &[f32]) -> Option<Vec<f32>> {
    let rebiased: Vec<f32> = scales.iter().map(|s| s * E4M3_REBIAS).collect();
    rebiased.iter().all(|r| r.is_finite()).then_some(rebiased)
}

impl<const TWO_STEP: bool> Fp8Block128Rows<'_, TWO_STEP> {
    #[inline(always)]
    fn tile(&self, row: usize, k: usize) -> usize {
        (row / FP8_BLOCK) * self.scale_cols + k / FP8_BLOCK
    }
}

impl<const TWO_STEP: bool> RowDecode for Fp8Block128Rows<'_, TWO_STEP> {
    #[inline(always)]
    fn code_address(&self, row: usize, k: usize) -> *const u8 {
        self.codes.as_ptr().wrapping_add(row * self.cols + k)
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn get(&self, row: usize, k: usize) -> f32 {
        e4m3_decode(self.codes[row * self.cols + k]) * self.scales[self.tile(row, k)]
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(&self, row: usize, k: usize) -> __m512 {
        // SAFETY: AVX-512F/BW and the trait contract (caller).
        unsafe { self.load_lanes::<Avx512>(row, k) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8(&self, row: usize, k: usize) -> __m256 {
        // SAFETY: AVX2, FMA and the trait contract (caller).
        unsafe { self.load_lanes::<Avx2>(row, k) }
    }
}

impl<const TWO_STEP: bool> Fp8Block128Rows<'_, TWO_STEP> {
    /// The body of [`RowDecode::load16`] and [`RowDecode::load8`], inlined into each.
    ///
    /// # Safety
    /// The CPU has `L`'s features; the [`RowDecode`] contract for an `L::WIDTH` load.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_lanes<L: Lanes>(&self, row: usize, k: usize) -> L::F32 {
        // SAFETY: row < rows and k + WIDTH <= cols (trait contract), so the code run and
        // the tile index are in bounds.
        unsafe {
            let unbiased = L::e4m3_unbiased(self.codes.as_ptr().add(row * self.cols + k));
            let tile = self.tile(row, k);
            if TWO_STEP {
                let rebiased = L::mul(unbiased, L::splat(E4M3_REBIAS));
                L::mul(rebiased, L::splat(*self.scales.get_unchecked(tile)))
            } else {
                L::mul(unbiased, L::splat(*self.rebiased.get_unchecked(tile)))
            }
        }
    }
}

/// Packed E2M1 codes (even element in the low nibble) with one multiplier per block of
/// `BLOCK` inputs, looked up from a 256-entry table indexed by the stored scale byte
/// (NVFP4: E4M3 times the global scale; MXFP4: E8M0).
pub(crate) struct PackedFp4Rows<'a, const BLOCK: usize> {
    pub packed: &'a [u8],
    pub block_scales: &'a [u8],
    pub scale_table: &'a [f32; 256],
    pub rows: usize,
    pub cols: usize,
}

/// NVFP4 rows.
pub(crate) type Nvfp4Rows<'a> = PackedFp4Rows<'a, NVFP4_BLOCK>;
/// MXFP4 rows.
pub(crate) type Mxfp4Rows<'a> = PackedFp4Rows<'a, MXFP4_BLOCK>;

/// Scale table for NVFP4: `e4m3(code) * global_scale`.
pub(crate) fn nvfp4_scale_table(global_scale: Nvfp4GlobalScale) -> [f32; 256] {
    std::array::from_fn(|code| match global_scale {
        Nvfp4GlobalScale::Multiplier(g) => e4m3_decode(code as u8) * g,
        // compressed-tensors: `element * (block_scale / d)`, as the checkpoint's own
        // dequantization computes each weight.
        Nvfp4GlobalScale::Divisor(d) => e4m3_decode(code as u8) / d,
    })
}

/// Scale table for MXFP4: `2^(code - 127)` (code 255, NaN, is refused at construction).
pub(crate) fn mxfp4_scale_table() -> [f32; 256] {
    std::array::from_fn(|code| e8m0_decode(code as u8))
}

impl<const BLOCK: usize> PackedFp4Rows<'_, BLOCK> {
    #[inline(always)]
    fn scale(&self, row: usize, k: usize) -> f32 {
        self.scale_table[usize::from(self.block_scales[row * (self.cols / BLOCK) + k / BLOCK])]
    }

    /// # Safety
    /// `row < rows`, `k < cols`.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    unsafe fn scale_unchecked(&self, row: usize, k: usize) -> f32 {
        // SAFETY: in-bounds block index (caller); the table has 256 entries.
        unsafe {
            let code = *self
                .block_scales
                .get_unchecked(row * (self.cols / BLOCK) + k / BLOCK);
            *self.scale_table.get_unchecked(usize::from(code))
        }
    }
}

impl<const BLOCK: usize> RowDecode for PackedFp4Rows<'_, BLOCK> {
    #[inline(always)]
    fn code_address(&self, row: usize, k: usize) -> *const u8 {
        self.packed
            .as_ptr()
            .wrapping_add(row * (self.cols / 2) + k / 2)
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn get(&self, row: usize, k: usize) -> f32 {
        let byte = self.packed[row * (self.cols / 2) + k / 2];
        let code = if k.is_multiple_of(2) {
            byte & 0x0F
        } else {
            byte >> 4
        };
        E2M1_VALUES[usize::from(code)] * self.scale(row, k)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(&self, row: usize, k: usize) -> __m512 {
        // SAFETY: the caller holds the `RowDecode` contract (row < rows, k + 16 <= cols) and
        // the CPU feature this function is compiled for.
        unsafe {
            let bytes = _mm_loadl_epi64(
                self.packed
                    .as_ptr()
                    .add(row * (self.cols / 2) + k / 2)
                    .cast(),
            );
            // b0 b0 b1 b1 ...: each lane gets its byte, then the odd lanes shift by 4.
            let doubled = _mm_unpacklo_epi8(bytes, bytes);
            let lanes = _mm512_cvtepu8_epi32(doubled);
            let shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
            // vpermps reads only the low 4 bits of each index: no mask needed.
            let codes = _mm512_srlv_epi32(lanes, shifts);
            let table = _mm512_loadu_ps(E2M1_VALUES.as_ptr());
            let values = _mm512_permutexvar_ps(codes, table);
            _mm512_mul_ps(values, _mm512_set1_ps(self.scale_unchecked(row, k)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8(&self, row: usize, k: usize) -> __m256 {
        // SAFETY: the caller holds the `RowDecode` contract (row < rows, k + 8 <= cols) and
        // the CPU feature this function is compiled for.
        unsafe {
            let ptr = self.packed.as_ptr().add(row * (self.cols / 2) + k / 2);
            let word = std::ptr::read_unaligned(ptr.cast::<i32>());
            let bytes = _mm_cvtsi32_si128(word);
            let doubled = _mm_unpacklo_epi8(bytes, bytes);
            let lanes = _mm256_cvtepu8_epi32(doubled);
            let shifts = _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0);
            let codes = _mm256_srlv_epi32(lanes, shifts);
            // 8-entry permute on the magnitude (vpermps reads the low 3 bits of each
            // index), sign bit (bit 3) moved to bit 31 and xor-ed in.
            let table = _mm256_loadu_ps(E2M1_VALUES.as_ptr());
            let magnitude = _mm256_permutevar8x32_ps(table, codes);
            let sign =
                _mm256_and_si256(_mm256_slli_epi32::<28>(codes), _mm256_set1_epi32(i32::MIN));
            let values = _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
            _mm256_mul_ps(values, _mm256_set1_ps(self.scale_unchecked(row, k)))
        }
    }
}

/// INT4 codes packed two per byte (even element in the low nibble, rows of
/// `ceil(cols / 2)` bytes) with an f32 scale and a zero point per 128 inputs:
/// `(q - z) * s`, the integer difference converted exactly, one rounding in the multiply.
pub(crate) struct Int4Rows<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [f32],
    pub zeros: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

impl Int4Rows<'_> {
    #[inline(always)]
    fn row_bytes(&self) -> usize {
        self.cols.div_ceil(2)
    }

    #[inline(always)]
    fn group(&self, row: usize, k: usize) -> usize {
        row * self.cols.div_ceil(INT4_GROUP) + k / INT4_GROUP
    }
}

impl RowDecode for Int4Rows<'_> {
    #[inline(always)]
    fn code_address(&self, row: usize, k: usize) -> *const u8 {
        self.packed
            .as_ptr()
            .wrapping_add(row * self.row_bytes() + k / 2)
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn get(&self, row: usize, k: usize) -> f32 {
        let byte = self.packed[row * self.row_bytes() + k / 2];
        let code = if k.is_multiple_of(2) {
            byte & 0x0F
        } else {
            byte >> 4
        };
        let g = self.group(row, k);
        (i32::from(code) - i32::from(self.zeros[g])) as f32 * self.scales[g]
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(&self, row: usize, k: usize) -> __m512 {
        // SAFETY: k % 16 == 0 and k + 16 <= cols (trait contract): 8 whole bytes of the
        // row, all in one 128-group.
        unsafe {
            let bytes = _mm_loadl_epi64(self.code_address(row, k).cast());
            let doubled = _mm_unpacklo_epi8(bytes, bytes);
            let lanes = _mm512_cvtepu8_epi32(doubled);
            let shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
            let codes = _mm512_and_si512(_mm512_srlv_epi32(lanes, shifts), _mm512_set1_epi32(15));
            let g = self.group(row, k);
            let centred = _mm512_sub_epi32(
                codes,
                _mm512_set1_epi32(i32::from(*self.zeros.get_unchecked(g))),
            );
            _mm512_mul_ps(
                _mm512_cvtepi32_ps(centred),
                _mm512_set1_ps(*self.scales.get_unchecked(g)),
            )
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8(&self, row: usize, k: usize) -> __m256 {
        // SAFETY: as load16, 4 whole bytes.
        unsafe {
            let word = std::ptr::read_unaligned(self.code_address(row, k).cast::<i32>());
            let bytes = _mm_cvtsi32_si128(word);
            let doubled = _mm_unpacklo_epi8(bytes, bytes);
            let lanes = _mm256_cvtepu8_epi32(doubled);
            let shifts = _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0);
            let codes = _mm256_and_si256(_mm256_srlv_epi32(lanes, shifts), _mm256_set1_epi32(15));
            let g = self.group(row, k);
            let centred = _mm256_sub_epi32(
                codes,
                _mm256_set1_epi32(i32::from(*self.zeros.get_unchecked(g))),
            );
            _mm256_mul_ps(
                _mm256_cvtepi32_ps(centred),
                _mm256_set1_ps(*self.scales.get_unchecked(g)),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{Isa, gemm::decode_segment};

    /// Every SIMD decode equals the element getter on every code: all 254 finite E4M3
    /// codes, all 16 E2M1 codes against all block-scale codes.
    fn check_all_isas<D: RowDecode>(d: &D) {
        for isa in Isa::available() {
            for row in 0..d.rows() {
                let mut out = vec![0f32; d.cols()];
                decode_segment(isa, d, row, 0, &mut out);
                for (k, &v) in out.iter().enumerate() {
                    assert_eq!(
                        v.to_bits(),
                        d.get(row, k).to_bits(),
                        "{} row {row} col {k}",
                        isa.name()
                    );
                }
            }
        }
    }

    #[test]
    fn fp8_simd_decode_matches_scalar_for_every_code() {
        let codes: Vec<u8> = (0..=255u8)
            .filter(|c| c & 0x7F != 0x7F)
            .cycle()
            .take(2 * 256)
            .collect();
        // Includes a scale large enough that scale * 2^120 overflows (the two-step path).
        let scales = [3.0e-3, 1.5e-5];
        let rebiased = fp8_rebiased_scales(&scales).unwrap();
        let d = Fp8Block128Rows::<false> {
            codes: &codes,
            scales: &scales,
            rebiased: &rebiased,
            rows: 2,
            cols: 256,
            scale_cols: 2,
        };
        check_all_isas(&d);
        assert_eq!(d.get(0, 1), e4m3_decode(1) * 3.0e-3);
        // A multiplier whose product with 2^120 overflows takes the two-step decoder.
        let big = [3.0e-3, 7.5e2];
        assert!(fp8_rebiased_scales(&big).is_none());
        check_all_isas(&Fp8Block128Rows::<true> {
            codes: &codes,
            scales: &big,
            rebiased: &[],
            rows: 2,
            cols: 256,
            scale_cols: 2,
        });
    }

    #[test]
    fn fp4_simd_decode_matches_scalar_for_every_code_and_scale() {
        // 256 rows, one per scale code; each row holds every E2M1 code in both nibbles.
        let row: Vec<u8> = (0..16u8)
            .flat_map(|lo| (0..16u8).map(move |hi| lo | (hi << 4)))
            .collect();
        let packed: Vec<u8> = row.iter().copied().cycle().take(256 * row.len()).collect();
        let cols = row.len() * 2;
        let nv_scales: Vec<u8> = (0..256usize)
            .flat_map(|c| std::iter::repeat_n(c as u8, cols / 16))
            .collect();
        let table = nvfp4_scale_table(Nvfp4GlobalScale::Multiplier(0.25));
        let nvfp4 = Nvfp4Rows {
            packed: &packed,
            block_scales: &nv_scales,
            scale_table: &table,
            rows: 256,
            cols,
        };
        check_all_isas(&nvfp4);
        let mx_scales: Vec<u8> = (0..256usize)
            .flat_map(|c| std::iter::repeat_n(c as u8, cols / 32))
            .collect();
        let mx_table = mxfp4_scale_table();
        let mxfp4 = Mxfp4Rows {
            packed: &packed,
            block_scales: &mx_scales,
            scale_table: &mx_table,
            rows: 255,
            cols,
        };
        check_all_isas(&mxfp4);
    }

    #[test]
    fn int4_simd_decode_matches_scalar_for_every_code_and_zero() {
        // 16 rows (one per zero point), 2 groups of 128 per row, every code pair.
        let cols = 256;
        let packed: Vec<u8> = (0..16 * cols / 2).map(|i| (i * 37 % 256) as u8).collect();
        let zeros: Vec<u8> = (0..16u8).flat_map(|z| [z, 15 - z]).collect();
        let scales: Vec<f32> = (0..32).map(|i| 1e-3 * (i + 1) as f32).collect();
        check_all_isas(&Int4Rows {
            packed: &packed,
            scales: &scales,
            zeros: &zeros,
            rows: 16,
            cols,
        });
    }

    #[test]
    fn e2m1_table_is_loraq_quants() {
        for (code, &v) in E2M1_VALUES.iter().enumerate() {
            assert_eq!(
                v.to_bits(),
                loraq_quant::element::e2m1_decode(code as u8).to_bits()
            );
        }
    }

    #[test]
    fn bf16_simd_decode_matches_scalar() {
        let data: Vec<bf16> = (0..=u16::MAX)
            .step_by(7)
            .map(bf16::from_bits)
            .filter(|v| v.is_finite())
            .take(64 * 40)
            .collect();
        check_all_isas(&Bf16Rows {
            data: &data,
            rows: 40,
            cols: 64,
        });
    }
}
