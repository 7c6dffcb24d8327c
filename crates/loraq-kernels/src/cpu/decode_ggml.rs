//! Row decoders of the ggml block types (GGUF bases, `QuantizedWeight::Ggml`): every
//! load dequantizes its run of elements in the loop, so the fused linears read the
//! stored blocks once and never a dequantized copy.
//!
//! Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and IQ4_XS are [`SimdBlock`] types: 8- and 16-lane
//! loads of one run (the generic and prefill loops), AVX2 block decoders in steps
//! (`scales256` then `step256`) that unpack a block's scales once, and the AVX-512
//! factored steps (`factors512`, then per step `codes512` and `step_scales512`: code
//! values before their scale and the per-lane scales they take, in the order of
//! `source512`) of the fused loop of `super::gemv_ggml`. Each dequantized lane has the
//! bits of `loraq_quant::ggml::block_element` (a product; Q4_K / Q5_K's `d sc q - dmin
//! m` as one fused multiply-subtract, whose one rounding is the scalar's because `d sc
//! q` is exact: [`k4_scales512`]), and so does each factored code times its scale, less
//! the minimum; so every SIMD decode and the scalar one give the same values. The
//! other types (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, MXFP4, the float types) are
//! [`ScalarBlock`]: per element by `block_element`. Both are read through one
//! [`BlockRows`]; [`visit_ggml`] maps a type to its format.

use super::decode::RowDecode;
use loraq_quant::ggml::{BlockGeometry, GgmlType, GgmlWeight, block_element};

#[cfg(target_arch = "x86_64")]
use loraq_quant::ggml::{decode::IQ4_VALUES, decode::scale_min_k4};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// A ggml block type with a SIMD load of 8 elements and whole-block SIMD decoders.
pub(crate) trait SimdBlock: Sync + Copy + Default {
    /// The type.
    const TYPE: GgmlType;
    /// Elements per block.
    #[cfg(target_arch = "x86_64")]
    const ELEMENTS: usize = Self::TYPE.block().elements;
    /// Bytes per block.
    #[cfg(target_arch = "x86_64")]
    const BYTES: usize = Self::TYPE.block().bytes;
    /// Elements `e .. e + 8` of the block at `block`, dequantized.
    ///
    /// # Safety
    /// AVX2 and FMA are available, `block` points at `Self::BYTES` readable bytes,
    /// `e % 8 == 0` and `e + 8 <= Self::ELEMENTS`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(block: *const u8, e: usize) -> __m256;
    /// Elements `e .. e + 16` of the block at `block`, dequantized (the group's scale
    /// unpacked once: a run of 16 lies in one scale group of every type).
    ///
    /// # Safety
    /// AVX-512F/BW are available, `block` points at `Self::BYTES` readable bytes,
    /// `e % 16 == 0` and `e + 16 <= Self::ELEMENTS`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(block: *const u8, e: usize) -> __m512;
    /// Elements per step of the AVX2 block decoders: the unit whose scales are applied
    /// together (Q8_0, Q4_0, IQ4_XS: a 32-element group; Q4_K, Q5_K: the two groups
    /// that share a run of code bytes; Q6_K: a quarter of a 256-element block).
    #[cfg(target_arch = "x86_64")]
    const STEP: usize;
    /// Elements per step of the AVX-512 factored decoders ([`SimdBlock::codes512`]):
    /// `CODES512 / 16` vectors that share one vector of scales.
    #[cfg(target_arch = "x86_64")]
    const CODES512: usize;
    /// Whether a block has group minimums (Q4_K, Q5_K: `x = d sc q - dmin m`), which
    /// the factored loop adds once per block as `dmin m` times the negated sums of the
    /// group's activations ([`SimdBlock::factors512`] lanes 8..16).
    #[cfg(target_arch = "x86_64")]
    const HAS_MINS: bool = false;
    /// A block's unpacked scales for the factored steps: 16 lanes, the type's group
    /// scales (and, with [`SimdBlock::HAS_MINS`], its eight minimums `dmin m` in lanes
    /// 8..16).
    ///
    /// # Safety
    /// AVX-512F/BW are available and `block` points at `Self::BYTES` readable bytes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn factors512(block: *const u8) -> __m512;
    /// [`SimdBlock::factors512`] of the same block of `R` rows, into `out` (Q4_K and
    /// Q5_K unpack four rows' at once).
    ///
    /// # Safety
    /// AVX-512F/BW are available and each of `blocks` points at `Self::BYTES` readable
    /// bytes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn factors512_rows<const R: usize>(blocks: [*const u8; R], out: &mut [__m512; R]) {
        for (o, block) in out.iter_mut().zip(blocks) {
            // SAFETY: forwarded contract.
            *o = unsafe { Self::factors512(block) };
        }
    }
    /// The step's vectors of code values before their scales (`q`, `q - 8`, `q - 32`,
    /// an IQ4 table value), exact small integers, in the order of
    /// [`SimdBlock::source512`]: every lane of every vector of a step is scaled by the
    /// same lane of [`SimdBlock::step_scales512`].
    ///
    /// # Safety
    /// AVX-512F/BW are available, `block` points at `Self::BYTES` readable bytes and
    /// `step < ELEMENTS / CODES512`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn codes512(block: *const u8, step: usize) -> Self::Codes512;
    /// The `CODES512 / 16` vectors of one factored step.
    #[cfg(target_arch = "x86_64")]
    type Codes512: AsRef<[__m512]>;
    /// The per-lane scales of `step`, from the block's [`SimdBlock::factors512`].
    ///
    /// # Safety
    /// AVX-512F/BW are available and `step < ELEMENTS / CODES512`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn step_scales512(factors: __m512, step: usize) -> __m512;
    /// The block element that position `p` of [`SimdBlock::codes512`]'s output holds
    /// (position `CODES512 step + 16 v + i`: lane `i` of vector `v` of `step`); the
    /// activation is reordered once per call to match.
    #[cfg(target_arch = "x86_64")]
    fn source512(p: usize) -> usize;
    /// A block's scales, unpacked once for the 8-lane steps.
    #[cfg(target_arch = "x86_64")]
    type Scales256: Copy;
    /// The `STEP / 8` vectors of one 8-lane step.
    #[cfg(target_arch = "x86_64")]
    type Step256: AsRef<[__m256]>;
    /// The block's scales, unpacked for [`SimdBlock::step256`].
    ///
    /// # Safety
    /// AVX2 and FMA are available and `block` points at `Self::BYTES` readable bytes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn scales256(block: *const u8) -> Self::Scales256;
    /// Elements `STEP * step ..` of the block, dequantized, 8 per vector in input
    /// order; every value the bits of `block_element`.
    ///
    /// # Safety
    /// AVX2 and FMA are available, `block` points at `Self::BYTES` readable bytes,
    /// `scales` are its [`SimdBlock::scales256`] and `step < ELEMENTS / STEP`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn step256(block: *const u8, scales: &Self::Scales256, step: usize) -> Self::Step256;
    /// Elements `e0 .. e0 + n` of the block (whole steps), dequantized into `out` in
    /// input order by [`SimdBlock::step256`], the block's scales unpacked once: the
    /// prefill's panel decode (`RowDecode::decode_span256`).
    ///
    /// # Safety
    /// AVX2 and FMA are available, `block` points at `Self::BYTES` readable bytes, `e0`
    /// and `n` are multiples of `Self::STEP`, `e0 + n <= Self::ELEMENTS`, and `out ..
    /// out + n` is writable.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn decode_steps256(block: *const u8, e0: usize, n: usize, out: *mut f32) {
        // SAFETY: forwarded contract; step < ELEMENTS / STEP.
        unsafe {
            let scales = Self::scales256(block);
            for step in e0 / Self::STEP..(e0 + n) / Self::STEP {
                let o = out.add(step * Self::STEP - e0);
                for (v, w) in Self::step256(block, &scales, step)
                    .as_ref()
                    .iter()
                    .enumerate()
                {
                    _mm256_storeu_ps(o.add(8 * v), *w);
                }
            }
        }
    }
    /// [`SimdBlock::decode_steps256`] with AVX-512: the 8-lane steps unless a type has
    /// 16-lane ones (Q4_K, Q5_K, Q6_K, a Q4_K_M base's types).
    ///
    /// # Safety
    /// As [`SimdBlock::decode_steps256`], with AVX-512F/BW (which imply AVX2 and FMA).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn decode_steps512(block: *const u8, e0: usize, n: usize, out: *mut f32) {
        // SAFETY: forwarded contract.
        unsafe { Self::decode_steps256(block, e0, n, out) }
    }
    /// The AVX2 factored loop's code values of `step` before their scales (`q`, `q -
    /// 8`, `q - 32`, an IQ4 table value: exact small integers), 8 per vector in input
    /// order, the vectors of [`SimdBlock::step256`] unscaled (and, for Q4_K / Q5_K,
    /// without the minimum).
    ///
    /// # Safety
    /// AVX2 and FMA are available, `block` points at `Self::BYTES` readable bytes and
    /// `step < ELEMENTS / STEP`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn codes256(block: *const u8, step: usize) -> Self::Step256;
    /// Consecutive vectors of a [`SimdBlock::codes256`] step that share one scale: 4 (a
    /// group of 32) or 2 (Q6_K's groups of 16).
    #[cfg(target_arch = "x86_64")]
    const SCALE_VECTORS256: usize = 4;
    /// The scale of vectors `SCALE_VECTORS256 g ..` of `step`, from the block's
    /// [`SimdBlock::scales256`].
    #[cfg(target_arch = "x86_64")]
    fn step_scale256(scales: &Self::Scales256, step: usize, g: usize) -> f32;
    /// With [`SimdBlock::HAS_MINS`]: the block's eight group minimums `dmin m` in
    /// input order, from its [`SimdBlock::scales256`] (other types: never called).
    ///
    /// # Safety
    /// AVX2 and FMA are available.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn mins256(scales: &Self::Scales256) -> __m256 {
        let _ = scales;
        _mm256_setzero_ps()
    }
    /// The block's `Self::ELEMENTS` values through [`SimdBlock::step256`], stored at
    /// `out` (the tests' view of the steps).
    ///
    /// # Safety
    /// As [`SimdBlock::step256`], and `out` points at `Self::ELEMENTS` writable f32.
    #[cfg(all(test, target_arch = "x86_64"))]
    unsafe fn decode256(block: *const u8, out: *mut f32) {
        // SAFETY: forwarded contract.
        unsafe { Self::decode_steps256(block, 0, Self::ELEMENTS, out) }
    }
}

/// The f16 at `block + offset`.
///
/// # Safety
/// `block + offset .. + 2` is readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_at(block: *const u8, offset: usize) -> f32 {
    // SAFETY: the caller guarantees the two bytes are readable.
    let bits = unsafe { block.add(offset).cast::<u16>().read_unaligned() };
    f16_bits_to_f32(u16::from_le(bits))
}

/// 2^112: moves an f16's exponent field, placed at the top of an f32's, from the f16
/// bias (15) to the f32 bias (127).
#[cfg(target_arch = "x86_64")]
const F16_REBIAS: f32 = f32::from_bits((127 + 112) << 23);

/// The f16 `h` as an f32, exactly: `loraq_quant::ggml::fp16_to_f32` in a few integer
/// ops and one multiply, inline (that one goes through the `half` crate's run-time
/// F16C dispatch, an out-of-line call per scale). Finite values: exponent and mantissa
/// shifted into place and rebiased by 2^112, an exact multiply (subnormal halves become
/// f32 subnormals and scale exactly too); infinities and NaNs (payload kept, quiet bit
/// set) by their bits. A test checks all 65536 inputs against `fp16_to_f32`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn f16_bits_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let magnitude = h & 0x7FFF;
    if magnitude >= 0x7C00 {
        let quiet = if magnitude > 0x7C00 { 0x0040_0000 } else { 0 };
        return f32::from_bits(sign | 0x7F80_0000 | quiet | ((magnitude & 0x3FF) << 13));
    }
    f32::from_bits(sign | (f32::from_bits(magnitude << 13) * F16_REBIAS).to_bits())
}

/// The eight 6-bit scales (bytes 0..8) and mins (bytes 8..16) of a Q4_K / Q5_K
/// super-block, unpacked from its 12 packed bytes by two byte shuffles: scale and min
/// `j < 4` are the low six bits of bytes `j` and `j + 4`; scale and min `j >= 4` take
/// the low and high nibble of byte `j + 4` and, as bits 4 and 5, the top two bits of
/// bytes `j - 4` and `j` (`loraq_quant::ggml::decode::scale_min_k4`, llama.cpp
/// `ggml/src/ggml-quants.c` `get_scale_min_k4`).
///
/// # Safety
/// AVX2, and the block's first 20 bytes readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn k4_scale_bytes(block: *const u8) -> __m128i {
    // SAFETY: bytes 4..20 are readable (caller).
    let packed = unsafe { _mm_loadu_si128(block.add(4).cast()) };
    // Scales 0..4, 4..8, mins 0..4, 4..8: bytes 0..4, 8..12, 4..8, 8..12.
    let low_source = _mm_shuffle_epi8(
        packed,
        _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11),
    );
    let low = _mm_or_si128(
        _mm_and_si128(
            low_source,
            _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0),
        ),
        _mm_and_si128(
            _mm_srli_epi16::<4>(low_source),
            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15),
        ),
    );
    // Scales 4..8 and mins 4..8 take bits 6, 7 of bytes 0..4 and 4..8 (the other lanes
    // zero: a shuffle index with its top bit set gives 0).
    let high_source = _mm_shuffle_epi8(
        packed,
        _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7),
    );
    let high = _mm_and_si128(_mm_srli_epi16::<2>(high_source), _mm_set1_epi8(0x30));
    _mm_or_si128(low, high)
}

/// The eight scales `d sc` (0..8) and mins `dmin m` (8..16) of a Q4_K / Q5_K
/// super-block, each product rounded as `block_element` rounds it; `d` and `dmin`
/// converted by F16C (exact, as `fp16_to_f32`).
///
/// Both products are exact in f32 (an f16's 11 significant bits times a 6-bit integer),
/// and so is `d sc q` for a code `q < 32` (at most 22 bits; f16's range keeps it far
/// from f32's overflow and subnormals). `block_element`'s `d sc q - dmin m` therefore
/// rounds once, at the subtraction, and a fused multiply-subtract `fmsub(q, d sc, dmin
/// m)` gives its bits (NaN payloads aside, where a scale is infinite or NaN), and so
/// does a code times `d sc` less `dmin m` (the factored steps, recombined).
///
/// # Safety
/// AVX-512F/BW, and the block's first 20 bytes readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn k4_scales512(block: *const u8) -> __m512 {
    // SAFETY: bytes 0..20 are readable (caller).
    unsafe {
        let values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k4_scale_bytes(block)));
        let d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(block.cast::<i32>().read_unaligned()));
        let by = _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
            _mm512_castps128_ps512(d_dmin),
        );
        _mm512_mul_ps(values, by)
    }
}

/// [`k4_scales512`] of the same block of four rows, unpacked together: the rows' first
/// 16 bytes (`d`, `dmin`, the 12 packed bytes) in the four 128-bit lanes of one vector
/// go through [`k4_scale_bytes`]' shuffles and masks once, and their eight f16 `d` /
/// `dmin` through one F16C conversion.
///
/// # Safety
/// AVX-512F/BW, and each block's first 16 bytes readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn k4_scales512_x4(blocks: [*const u8; 4]) -> [__m512; 4] {
    let mut out = [_mm512_setzero_ps(); 4];
    // SAFETY: 16 readable bytes at each block (caller).
    unsafe {
        let lane = |r: usize| _mm_loadu_si128(blocks[r].cast());
        let packed = _mm512_inserti32x4::<3>(
            _mm512_inserti32x4::<2>(
                _mm512_inserti32x4::<1>(_mm512_castsi128_si512(lane(0)), lane(1)),
                lane(2),
            ),
            lane(3),
        );
        // k4_scale_bytes' shuffles, the packed bytes starting at byte 4 of each lane.
        let low_source = _mm512_shuffle_epi8(
            packed,
            _mm512_broadcast_i32x4(_mm_setr_epi8(
                4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15,
            )),
        );
        let low = _mm512_or_si512(
            _mm512_and_si512(
                low_source,
                _mm512_broadcast_i32x4(_mm_setr_epi8(
                    63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0,
                )),
            ),
            _mm512_and_si512(
                _mm512_srli_epi16::<4>(low_source),
                _mm512_broadcast_i32x4(_mm_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15,
                )),
            ),
        );
        let high_source = _mm512_shuffle_epi8(
            packed,
            _mm512_broadcast_i32x4(_mm_setr_epi8(
                -1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11,
            )),
        );
        let high = _mm512_and_si512(_mm512_srli_epi16::<2>(high_source), _mm512_set1_epi8(0x30));
        let bytes = _mm512_or_si512(low, high);
        // d0, dmin0, d1, dmin1, ..: words 0 and 1 of each lane.
        let halves = _mm512_permutexvar_epi16(
            _mm512_castsi128_si512(_mm_setr_epi16(0, 1, 8, 9, 16, 17, 24, 25)),
            packed,
        );
        let d_dmin = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm512_castsi512_si128(halves)));
        let lanes = [
            _mm512_castsi512_si128(bytes),
            _mm512_extracti32x4_epi32::<1>(bytes),
            _mm512_extracti32x4_epi32::<2>(bytes),
            _mm512_extracti32x4_epi32::<3>(bytes),
        ];
        for (r, (lane_bytes, row)) in lanes.into_iter().zip(out.iter_mut()).enumerate() {
            let values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lane_bytes));
            let (d, dmin) = (2 * r as i32, 2 * r as i32 + 1);
            let by = _mm512_permutexvar_ps(
                _mm512_setr_epi32(
                    d, d, d, d, d, d, d, d, dmin, dmin, dmin, dmin, dmin, dmin, dmin, dmin,
                ),
                d_dmin,
            );
            *row = _mm512_mul_ps(values, by);
        }
    }
    out
}

/// [`SimdBlock::factors512_rows`] of Q4_K and Q5_K: four rows by [`k4_scales512_x4`],
/// other counts row by row.
///
/// # Safety
/// AVX-512F/BW, and each block's first 20 bytes readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn k4_scales512_rows<const R: usize>(blocks: [*const u8; R], out: &mut [__m512; R]) {
    // SAFETY: forwarded contract.
    unsafe {
        if R == 4 {
            let four = k4_scales512_x4([blocks[0], blocks[1], blocks[2], blocks[3]]);
            out.copy_from_slice(&four[..R]);
        } else {
            for (o, block) in out.iter_mut().zip(blocks) {
                *o = k4_scales512(block);
            }
        }
    }
}

/// As [`k4_scales512`], with AVX2 (`d` and `dmin` by [`f16_at`]).
///
/// # Safety
/// AVX2, and the block's first 20 bytes readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn k4_scales256(block: *const u8) -> [f32; 16] {
    let mut out = [0f32; 16];
    // SAFETY: bytes 0..20 are readable (caller); `out` holds 16 f32.
    unsafe {
        let bytes = k4_scale_bytes(block);
        for (half, by) in [f16_at(block, 0), f16_at(block, 2)].into_iter().enumerate() {
            let lanes = if half == 0 {
                bytes
            } else {
                _mm_srli_si128::<8>(bytes)
            };
            let values = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lanes));
            _mm256_storeu_ps(
                out.as_mut_ptr().add(8 * half),
                _mm256_mul_ps(values, _mm256_set1_ps(by)),
            );
        }
    }
    out
}

/// The eight group scales `d (ls - 32)` of an IQ4_XS block: `ls` is nibble `ib` of the
/// 32-bit `scales_l` and, as bits 4 and 5, bits `2 ib`, `2 ib + 1` of `scales_h`; `d`
/// is the block's f16 scale, converted by the caller.
///
/// # Safety
/// AVX2, and the block's first 8 bytes readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn iq4_xs_scales(block: *const u8, d: f32) -> [f32; 8] {
    let mut out = [0f32; 8];
    // SAFETY: the caller guarantees the 8 bytes (d, scales_h, scales_l); `out` holds 8.
    unsafe {
        let scales_h = block.add(2).cast::<u16>().read_unaligned();
        let scales_l = block.add(4).cast::<i32>().read_unaligned();
        let low = _mm256_and_si256(
            _mm256_srlv_epi32(
                _mm256_set1_epi32(scales_l),
                _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
            ),
            _mm256_set1_epi32(0xF),
        );
        let high = _mm256_and_si256(
            _mm256_srlv_epi32(
                _mm256_set1_epi32(i32::from(u16::from_le(scales_h))),
                _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14),
            ),
            _mm256_set1_epi32(3),
        );
        let ls = _mm256_or_si256(low, _mm256_slli_epi32::<4>(high));
        let values = _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)));
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(d), values));
    }
    out
}

/// The sixteen scales `d sc` of a Q6_K block (one per 16 elements, in storage order).
///
/// # Safety
/// AVX2, and the block's 210 bytes readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q6_k_scales(block: *const u8) -> [f32; 16] {
    let mut out = [0f32; 16];
    // SAFETY: bytes 192..210 are readable (caller); `out` holds 16 f32.
    unsafe {
        let d = _mm256_set1_ps(f16_at(block, 208));
        for half in 0..2 {
            let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(block.add(192 + 8 * half).cast()));
            let scaled = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * half), scaled);
        }
    }
    out
}

/// [`q6_k_scales`] with `d` by F16C.
///
/// # Safety
/// AVX-512F/BW, and the block's 210 bytes readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn q6_k_scales512(block: *const u8) -> __m512 {
    // SAFETY: bytes 192..210 are readable (caller).
    unsafe {
        let d = _mm512_set1_ps(f16c_at(block, 208));
        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(192).cast()));
        _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc))
    }
}

/// Elements `64 step .. + 64` of a Q6_K block (half `n = step / 2`, quarters `2 part`
/// and `2 part + 1`, `part = step % 2`) as 64 bytes `q - 32`: byte i < 32 is quarter
/// 2 part's element i, byte 32 + i quarter 2 part + 1's. Their low four bits are the
/// low (part 0) or high nibbles of `ql` bytes 64 n .. + 64 in order; their two high
/// bits are bits 2 quarter, 2 quarter + 1 of `qh` byte i, placed at bits 4 and 5 by a
/// shift of the 32 `qh` bytes held in both halves of the vector (the bits a 32-bit
/// shift carries in from a neighbouring byte are masked off).
///
/// # Safety
/// AVX-512F/BW, the block's 210 bytes readable and `step < 4`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn q6_k_step_codes(block: *const u8, step: usize) -> __m512i {
    let (n, part) = (step / 2, step % 2);
    // SAFETY: 210 readable bytes at `block`, step < 4 (caller).
    unsafe {
        let ql = _mm512_loadu_si512(block.add(64 * n).cast());
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(128 + 32 * n).cast()));
        let nibble = _mm512_set1_epi8(0x0F);
        let (low, high) = if part == 0 {
            let shifts = _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2);
            (_mm512_and_si512(ql, nibble), _mm512_sllv_epi32(qh, shifts))
        } else {
            let shifts = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
            let low = _mm512_and_si512(_mm512_srli_epi16::<4>(ql), nibble);
            (low, _mm512_srlv_epi32(qh, shifts))
        };
        let high = _mm512_and_si512(high, _mm512_set1_epi8(0x30));
        _mm512_sub_epi8(_mm512_or_si512(low, high), _mm512_set1_epi8(32))
    }
}

/// Eight bytes from `p` widened to eight i32 lanes, unsigned.
///
/// # Safety
/// AVX2, and `p .. p + 8` readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn bytes8_u(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 8 readable bytes.
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())) }
}

/// The low (`high == false`) or high nibbles of the eight bytes at `p`, as i32 lanes.
///
/// # Safety
/// As [`bytes8_u`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn nibbles8(p: *const u8, high: bool) -> __m256i {
    // SAFETY: forwarded contract.
    let w = unsafe { bytes8_u(p) };
    let w = if high { _mm256_srli_epi32::<4>(w) } else { w };
    _mm256_and_si256(w, _mm256_set1_epi32(0xF))
}

/// `i32` lanes to f32, times `scale` (one rounding: the scalar `q as f32 * d`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn scaled(q: __m256i, scale: f32) -> __m256 {
    _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(scale))
}

/// `i32` lanes `q` (Q4_K / Q5_K codes, below 32) to f32, times `scale`, less `min`, as
/// one fused multiply-subtract: the bits of the scalar `d * q - min`, which rounds the
/// product and then the difference, because the product is exact (see
/// [`k4_scales512`]), so only the difference rounds either way.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn scaled_less_min(q: __m256i, scale: f32, min: f32) -> __m256 {
    _mm256_fmsub_ps(
        _mm256_cvtepi32_ps(q),
        _mm256_set1_ps(scale),
        _mm256_set1_ps(min),
    )
}

/// Sixteen bytes from `p` widened to sixteen i32 lanes, unsigned.
///
/// # Safety
/// AVX-512F/BW, and `p .. p + 16` readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn bytes16_u(p: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 16 readable bytes.
    unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())) }
}

/// The 32 elements of a 32-element group whose 16 code bytes at `qs` hold element `j`
/// in the low nibble of byte `j` and element `16 + j` in the high one, each looked up
/// in `table` (the group's dequantized value per code), as two vectors in input order.
/// `vpermps` reads only the low 4 bits of each index lane, so the low nibbles need no
/// mask.
///
/// # Safety
/// AVX-512F/BW, and `qs .. qs + 16` readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn nibble_halves512(qs: *const u8, table: __m512) -> [__m512; 2] {
    // SAFETY: the caller guarantees the 16 bytes.
    let raw = unsafe { bytes16_u(qs) };
    [
        _mm512_permutexvar_ps(raw, table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(raw), table),
    ]
}

/// The f16 at `block + offset` as an f32, by F16C (exact; NaNs quieted, payload kept,
/// as `loraq_quant::ggml::fp16_to_f32`).
///
/// # Safety
/// AVX-512F (which implies F16C), and `block + offset .. + 2` readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn f16c_at(block: *const u8, offset: usize) -> f32 {
    // SAFETY: the caller guarantees the two bytes.
    let bits = unsafe { block.add(offset).cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le(
        bits,
    )))))
}

/// The scale `d (ls - 32)` of 32-element group `ib` of an IQ4_XS block.
///
/// # Safety
/// The block's first 8 bytes are readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn iq4_xs_scale(block: *const u8, ib: usize) -> f32 {
    // SAFETY: the caller guarantees the 8 bytes (d, scales_h, scales_l).
    unsafe {
        let scales_h = u16::from_le(block.add(2).cast::<u16>().read_unaligned());
        let ls = i32::from((*block.add(4 + ib / 2) >> (4 * (ib % 2))) & 0xF)
            | (i32::from((scales_h >> (2 * ib)) & 3) << 4);
        f16_at(block, 0) * (ls - 32) as f32
    }
}

/// The code values `0, 1, .., 31` as f32: Q4_K's (the first 16) and Q5_K's tables of
/// unscaled codes.
#[cfg(target_arch = "x86_64")]
const CODE_VALUES: [f32; 32] = {
    let mut values = [0f32; 32];
    let mut q = 0;
    while q < 32 {
        values[q] = q as f32;
        q += 1;
    }
    values
};

/// Q4_0's unscaled values `q - 8` by code.
#[cfg(target_arch = "x86_64")]
const Q4_0_VALUES: [f32; 16] = {
    let mut values = [0f32; 16];
    let mut q = 0;
    while q < 16 {
        values[q] = q as f32 - 8.0;
        q += 1;
    }
    values
};

/// The IQ4 table (`kvalues_iq4nl`) as f32.
#[cfg(target_arch = "x86_64")]
const IQ4_F32_VALUES: [f32; 16] = {
    let mut values = [0f32; 16];
    let mut q = 0;
    while q < 16 {
        values[q] = IQ4_VALUES[q] as f32;
        q += 1;
    }
    values
};

/// The block element at position `p` of Q4_K's and Q5_K's factored steps: step
/// `s = 2c + h` reads code bytes `64c .. 64c + 64` as 16 dword lanes, lane `i` holding
/// bytes `4i .. 4i + 4`: bytes `32 j + l` of super-block step `j = 2c + i / 8` hold
/// element `l` of group `2j` (low nibble, `h = 0`) and of group `2j + 1` (high), and
/// vector `k` takes byte `k` of each lane.
#[cfg(target_arch = "x86_64")]
fn k4_source512(p: usize) -> usize {
    let (step, k, i) = (p / 64, p % 64 / 16, p % 16);
    let (c, h) = (step / 2, step % 2);
    64 * (2 * c + i / 8) + 32 * h + 4 * (i % 8) + k
}

/// Per step of Q4_K / Q5_K, the scale lane of each vector lane: group `4c + h` in lanes
/// 0..8 and `4c + 2 + h` in lanes 8..16 ([`k4_source512`]).
#[cfg(target_arch = "x86_64")]
const K4_STEP_SCALE_LANES: [[i32; 16]; 4] = {
    let mut lanes = [[0i32; 16]; 4];
    let mut step = 0;
    while step < 4 {
        let mut i = 0;
        while i < 16 {
            lanes[step][i] = (4 * (step / 2) + step % 2 + 2 * (i / 8)) as i32;
            i += 1;
        }
        step += 1;
    }
    lanes
};

/// Per step of Q5_K, the left rotation of each `qh` dword lane that brings the fifth
/// bit of group `g = 4c + 2 (i / 8) + h` (bit `g` of each byte) to bit 4: `4 - g`,
/// modulo 32.
#[cfg(target_arch = "x86_64")]
const Q5K_QH_ROTATIONS: [[i32; 16]; 4] = {
    let mut rotations = [[0i32; 16]; 4];
    let mut step = 0;
    while step < 4 {
        let mut i = 0;
        while i < 16 {
            let group = 4 * (step / 2) + 2 * (i / 8) + step % 2;
            rotations[step][i] = ((36 - group) % 32) as i32;
            i += 1;
        }
        step += 1;
    }
    rotations
};

/// Lane `i` of the result is lane `lanes[i]` of `factors`: a step's per-lane scales.
///
/// # Safety
/// AVX-512F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn scale_lanes512(factors: __m512, lanes: &[i32; 16]) -> __m512 {
    // SAFETY: 16 i32.
    unsafe { _mm512_permutexvar_ps(_mm512_loadu_si512(lanes.as_ptr().cast()), factors) }
}

/// Q4_K / Q5_K step `2c + h`'s code bytes `64c .. 64c + 64` (from `codes`, the
/// block's 128 code bytes) as 16 dword lanes, shifted right by 4 for the high
/// nibbles (`h = 1`): byte `k` of each lane holds vector `k`'s code in its low 4 bits
/// ([`k4_source512`]).
///
/// # Safety
/// AVX-512F/BW, `codes .. codes + 128` readable and `step < 4`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn k4_step_nibbles(codes: *const u8, step: usize) -> __m512i {
    // SAFETY: 128 readable bytes (caller), step < 4.
    let raw = unsafe { _mm512_loadu_si512(codes.add(64 * (step / 2)).cast()) };
    if step.is_multiple_of(2) {
        raw
    } else {
        _mm512_srli_epi32::<4>(raw)
    }
}

/// Per step, scale lane `4 step + i / 4` for vector lane `i`: Q6_K's 16-element groups
/// and IQ4_XS's 32-element groups, four lanes each.
#[cfg(target_arch = "x86_64")]
const QUAD_SCALE_LANES: [[i32; 16]; 4] = {
    let mut lanes = [[0i32; 16]; 4];
    let mut step = 0;
    while step < 4 {
        let mut i = 0;
        while i < 16 {
            lanes[step][i] = (4 * step + i / 4) as i32;
            i += 1;
        }
        step += 1;
    }
    lanes
};

/// Q8_0: `x = q d`.
#[derive(Clone, Copy, Default)]
pub(crate) struct Q8_0Block;

impl SimdBlock for Q8_0Block {
    const TYPE: GgmlType = GgmlType::Q8_0;
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(block: *const u8, e: usize) -> __m512 {
        // SAFETY: 34 readable bytes at `block`, e + 16 <= 32 (caller).
        unsafe {
            let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(2 + e).cast()));
            _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(f16_at(block, 0)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    const STEP: usize = 32;
    #[cfg(target_arch = "x86_64")]
    const CODES512: usize = 32;
    #[cfg(target_arch = "x86_64")]
    type Codes512 = [__m512; 2];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn factors512(block: *const u8) -> __m512 {
        // SAFETY: the block's 34 bytes are readable (caller).
        unsafe { _mm512_set1_ps(f16c_at(block, 0)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn codes512(block: *const u8, _: usize) -> [__m512; 2] {
        // SAFETY: 34 readable bytes at `block` (caller).
        unsafe {
            [0, 16].map(|e| {
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    block.add(2 + e).cast(),
                )))
            })
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn step_scales512(d: __m512, _: usize) -> __m512 {
        d
    }
    #[cfg(target_arch = "x86_64")]
    fn source512(p: usize) -> usize {
        p
    }
    #[cfg(target_arch = "x86_64")]
    type Scales256 = f32;
    #[cfg(target_arch = "x86_64")]
    type Step256 = [__m256; 4];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn scales256(block: *const u8) -> f32 {
        // SAFETY: the block's 34 bytes are readable (caller).
        unsafe { f16_at(block, 0) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn step256(block: *const u8, d: &f32, _: usize) -> [__m256; 4] {
        // SAFETY: 34 readable bytes at `block` (caller).
        unsafe {
            [0, 8, 16, 24].map(|e| {
                let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(block.add(2 + e).cast()));
                scaled(q, *d)
            })
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn codes256(block: *const u8, _: usize) -> [__m256; 4] {
        // SAFETY: 34 readable bytes at `block` (caller).
        unsafe {
            [0, 8, 16, 24].map(|e| {
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    block.add(2 + e).cast(),
                )))
            })
        }
    }
    #[cfg(target_arch = "x86_64")]
    fn step_scale256(d: &f32, _: usize, _: usize) -> f32 {
        *d
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(block: *const u8, e: usize) -> __m256 {
        // SAFETY: the block's 34 bytes are readable and e + 8 <= 32 (caller); AVX2
        // is available (caller).
        unsafe {
            let d = f16_at(block, 0);
            let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(block.add(2 + e).cast()));
            scaled(q, d)
        }
    }
}

/// Q4_0: `x = (q - 8) d`; byte `j` holds elements `j` (low nibble) and `j + 16`.
#[derive(Clone, Copy, Default)]
pub(crate) struct Q4_0Block;

impl SimdBlock for Q4_0Block {
    const TYPE: GgmlType = GgmlType::Q4_0;
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(block: *const u8, e: usize) -> __m512 {
        // SAFETY: 18 readable bytes at `block`, e + 16 <= 32 (caller).
        unsafe {
            let raw = bytes16_u(block.add(2));
            let q = if e == 0 {
                _mm512_and_si512(raw, _mm512_set1_epi32(0xF))
            } else {
                _mm512_srli_epi32::<4>(raw)
            };
            let q = _mm512_sub_epi32(q, _mm512_set1_epi32(8));
            _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(f16_at(block, 0)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    const STEP: usize = 32;
    #[cfg(target_arch = "x86_64")]
    const CODES512: usize = 32;
    #[cfg(target_arch = "x86_64")]
    type Codes512 = [__m512; 2];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn factors512(block: *const u8) -> __m512 {
        // SAFETY: the block's 18 bytes are readable (caller).
        unsafe { _mm512_set1_ps(f16c_at(block, 0)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn codes512(block: *const u8, _: usize) -> [__m512; 2] {
        // SAFETY: 18 readable bytes at `block` (caller); 16 f32 in the table.
        unsafe { nibble_halves512(block.add(2), _mm512_loadu_ps(Q4_0_VALUES.as_ptr())) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn step_scales512(d: __m512, _: usize) -> __m512 {
        d
    }
    #[cfg(target_arch = "x86_64")]
    fn source512(p: usize) -> usize {
        p
    }
    #[cfg(target_arch = "x86_64")]
    type Scales256 = f32;
    #[cfg(target_arch = "x86_64")]
    type Step256 = [__m256; 4];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn scales256(block: *const u8) -> f32 {
        // SAFETY: the block's 18 bytes are readable (caller).
        unsafe { f16_at(block, 0) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn step256(block: *const u8, d: &f32, _: usize) -> [__m256; 4] {
        // SAFETY: 18 readable bytes at `block` (caller).
        unsafe {
            let eight = _mm256_set1_epi32(8);
            let [first, second] = [0, 8].map(|l| bytes8_u(block.add(2 + l)));
            let low = |w| _mm256_and_si256(w, _mm256_set1_epi32(0xF));
            [
                scaled(_mm256_sub_epi32(low(first), eight), *d),
                scaled(_mm256_sub_epi32(low(second), eight), *d),
                scaled(_mm256_sub_epi32(_mm256_srli_epi32::<4>(first), eight), *d),
                scaled(_mm256_sub_epi32(_mm256_srli_epi32::<4>(second), eight), *d),
            ]
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn codes256(block: *const u8, _: usize) -> [__m256; 4] {
        // SAFETY: 18 readable bytes at `block` (caller).
        unsafe {
            let eight = _mm256_set1_epi32(8);
            let [first, second] = [0, 8].map(|l| bytes8_u(block.add(2 + l)));
            let low = |w| _mm256_and_si256(w, _mm256_set1_epi32(0xF));
            [
                low(first),
                low(second),
                _mm256_srli_epi32::<4>(first),
                _mm256_srli_epi32::<4>(second),
            ]
            .map(|q| _mm256_cvtepi32_ps(_mm256_sub_epi32(q, eight)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    fn step_scale256(d: &f32, _: usize, _: usize) -> f32 {
        *d
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(block: *const u8, e: usize) -> __m256 {
        // SAFETY: as Q8_0Block::load8 (18-byte block, e + 8 <= 32).
        unsafe {
            let d = f16_at(block, 0);
            let q = nibbles8(block.add(2 + e % 16), e >= 16);
            scaled(_mm256_sub_epi32(q, _mm256_set1_epi32(8)), d)
        }
    }
}

/// Elements `e0 .. e0 + n` (whole 64-element steps) of a Q4_K / Q5_K super-block into
/// `out`, in input order: its scales and minimums unpacked once ([`k4_scales512`]), then
/// per step `j` the 32 code bytes at `codes + 32 j` give group `2 j` (low nibbles) and
/// `2 j + 1` (high), 16 elements per vector, with Q5_K's fifth bit (bit `g` of `qh`
/// byte `l` for element `l` of group `g`) where `qh` is given. Each value is one fused
/// multiply-subtract `q (d sc) - dmin m`, the bits of `load16` and of `block_element`
/// (the scale and minimum are the same exact products).
///
/// # Safety
/// AVX-512F/BW; the block's 16 scale bytes, `codes .. codes + 128` and `qh .. qh + 32`
/// readable; `e0`, `n` multiples of 64 with `e0 + n <= 256`; `out .. out + n` writable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn k4_decode_steps512(
    block: *const u8,
    codes: *const u8,
    qh: Option<*const u8>,
    e0: usize,
    n: usize,
    out: *mut f32,
) {
    // SAFETY: the bytes read and the values written are in range (caller).
    unsafe {
        let factors = k4_scales512(block);
        let nibble = _mm512_set1_epi32(0xF);
        for j in e0 / 64..(e0 + n) / 64 {
            let o = out.add(64 * j - e0);
            let group = |h: usize| (2 * j + h) as i32;
            let scale = |h: usize| _mm512_permutexvar_ps(_mm512_set1_epi32(group(h)), factors);
            let min = |h: usize| _mm512_permutexvar_ps(_mm512_set1_epi32(8 + group(h)), factors);
            let (d, m) = ([scale(0), scale(1)], [min(0), min(1)]);
            for half in 0..2 {
                let raw = bytes16_u(codes.add(32 * j + 16 * half));
                let fifth = qh.map(|qh| bytes16_u(qh.add(16 * half)));
                for h in 0..2 {
                    let mut q = if h == 0 {
                        _mm512_and_si512(raw, nibble)
                    } else {
                        _mm512_srli_epi32::<4>(raw)
                    };
                    if let Some(bits) = fifth {
                        let bit = _mm512_srl_epi32(bits, _mm_cvtsi32_si128(group(h)));
                        let bit = _mm512_and_si512(bit, _mm512_set1_epi32(1));
                        q = _mm512_or_si512(q, _mm512_slli_epi32::<4>(bit));
                    }
                    let values = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q), d[h], m[h]);
                    _mm512_storeu_ps(o.add(32 * h + 16 * half), values);
                }
            }
        }
    }
}

/// The scale `d * sc` and min `dmin * m` of 32-element group `group` of a Q4_K /
/// Q5_K super-block.
///
/// # Safety
/// The block's first 16 bytes are readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn k4_scale_min(block: *const u8, group: usize) -> (f32, f32) {
    // SAFETY: the caller guarantees the 16 bytes (d, dmin, 12 scale bytes).
    unsafe {
        let packed = std::slice::from_raw_parts(block.add(4), 12);
        let (sc, m) = scale_min_k4(group, packed);
        (
            f16_at(block, 0) * f32::from(sc),
            f16_at(block, 2) * f32::from(m),
        )
    }
}

/// Q4_K: 8 groups of 32, `x = (d sc) q - dmin m`; bytes `32 j ..` of the codes hold
/// groups `2 j` (low nibbles) and `2 j + 1` (high).
#[derive(Clone, Copy, Default)]
pub(crate) struct Q4KBlock;

impl SimdBlock for Q4KBlock {
    const TYPE: GgmlType = GgmlType::Q4_K;
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(block: *const u8, e: usize) -> __m512 {
        let (j, upper, l) = (e / 64, (e % 64) / 32, e % 32);
        // SAFETY: 144 readable bytes at `block`, e + 16 <= 256 (caller).
        unsafe {
            let (d, min) = k4_scale_min(block, 2 * j + upper);
            let raw = bytes16_u(block.add(16 + 32 * j + l));
            let q = if upper == 0 {
                _mm512_and_si512(raw, _mm512_set1_epi32(0xF))
            } else {
                _mm512_srli_epi32::<4>(raw)
            };
            // One rounding, as block_element's (k4_scales512).
            _mm512_fmsub_ps(
                _mm512_cvtepi32_ps(q),
                _mm512_set1_ps(d),
                _mm512_set1_ps(min),
            )
        }
    }
    #[cfg(target_arch = "x86_64")]
    const STEP: usize = 64;
    #[cfg(target_arch = "x86_64")]
    const CODES512: usize = 64;
    #[cfg(target_arch = "x86_64")]
    const HAS_MINS: bool = true;
    #[cfg(target_arch = "x86_64")]
    type Codes512 = [__m512; 4];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn factors512(block: *const u8) -> __m512 {
        // SAFETY: the block's 144 bytes are readable (caller).
        unsafe { k4_scales512(block) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn factors512_rows<const R: usize>(blocks: [*const u8; R], out: &mut [__m512; R]) {
        // SAFETY: each block's bytes are readable (caller).
        unsafe { k4_scales512_rows(blocks, out) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn step_scales512(factors: __m512, step: usize) -> __m512 {
        // SAFETY: step < 4 (caller).
        unsafe { scale_lanes512(factors, &K4_STEP_SCALE_LANES[step]) }
    }
    #[cfg(target_arch = "x86_64")]
    fn source512(p: usize) -> usize {
        k4_source512(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn codes512(block: *const u8, step: usize) -> [__m512; 4] {
        // Step 2c + h: the low (h = 0) or high nibbles of code bytes 64c .. 64c + 64 as
        // 16 dword lanes (k4_source512); byte k of each lane is vector k's code, and
        // `vpermps` reads only the low 4 bits of an index.
        // SAFETY: 144 readable bytes at `block`, step < 4 (caller); 16 f32 in the table.
        unsafe {
            let nibbles = k4_step_nibbles(block.add(16), step);
            let table = _mm512_loadu_ps(CODE_VALUES.as_ptr());
            [
                _mm512_permutexvar_ps(nibbles, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(nibbles), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<16>(nibbles), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<24>(nibbles), table),
            ]
        }
    }
    #[cfg(target_arch = "x86_64")]
    type Scales256 = [f32; 16];
    #[cfg(target_arch = "x86_64")]
    type Step256 = [__m256; 8];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn scales256(block: *const u8) -> [f32; 16] {
        // SAFETY: the block's 144 bytes are readable (caller).
        unsafe { k4_scales256(block) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn step256(block: *const u8, scales: &[f32; 16], j: usize) -> [__m256; 8] {
        // SAFETY: 144 readable bytes at `block`, j < 4 (caller).
        unsafe {
            let (d_low, min_low) = (scales[2 * j], scales[8 + 2 * j]);
            let (d_high, min_high) = (scales[2 * j + 1], scales[9 + 2 * j]);
            let mut out = [_mm256_setzero_ps(); 8];
            for l in 0..4 {
                let w = bytes8_u(block.add(16 + 32 * j + 8 * l));
                let low = _mm256_and_si256(w, _mm256_set1_epi32(0xF));
                out[l] = scaled_less_min(low, d_low, min_low);
                out[4 + l] = scaled_less_min(_mm256_srli_epi32::<4>(w), d_high, min_high);
            }
            out
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn codes256(block: *const u8, j: usize) -> [__m256; 8] {
        // SAFETY: 144 readable bytes at `block`, j < 4 (caller).
        unsafe {
            let mut out = [_mm256_setzero_ps(); 8];
            for l in 0..4 {
                let w = bytes8_u(block.add(16 + 32 * j + 8 * l));
                out[l] = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(0xF)));
                out[4 + l] = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(w));
            }
            out
        }
    }
    #[cfg(target_arch = "x86_64")]
    fn step_scale256(scales: &[f32; 16], j: usize, g: usize) -> f32 {
        scales[2 * j + g]
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn mins256(scales: &[f32; 16]) -> __m256 {
        // SAFETY: lanes 8..16 of the 16.
        unsafe { _mm256_loadu_ps(scales.as_ptr().add(8)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn decode_steps512(block: *const u8, e0: usize, n: usize, out: *mut f32) {
        // SAFETY: 144 readable bytes at `block`, whole steps j < 4 within the block,
        // `out` holds n values (caller).
        unsafe { k4_decode_steps512(block, block.add(16), None, e0, n, out) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(block: *const u8, e: usize) -> __m256 {
        let (j, upper, l) = (e / 64, (e % 64) / 32, e % 32);
        // SAFETY: the 144-byte block is readable and e + 8 <= 256 (caller).
        unsafe {
            let (d, min) = k4_scale_min(block, 2 * j + upper);
            let q = nibbles8(block.add(16 + 32 * j + l), upper == 1);
            scaled_less_min(q, d, min)
        }
    }
}

/// Q5_K: Q4_K's layout with a fifth bit per element in `qh` (byte `l`, bit
/// `group`).
#[derive(Clone, Copy, Default)]
pub(crate) struct Q5KBlock;

impl SimdBlock for Q5KBlock {
    const TYPE: GgmlType = GgmlType::Q5_K;
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(block: *const u8, e: usize) -> __m512 {
        let (j, upper, l) = (e / 64, (e % 64) / 32, e % 32);
        let group = 2 * j + upper;
        // SAFETY: 176 readable bytes at `block`, e + 16 <= 256 (caller).
        unsafe {
            let (d, min) = k4_scale_min(block, group);
            let raw = bytes16_u(block.add(48 + 32 * j + l));
            let low = if upper == 0 {
                _mm512_and_si512(raw, _mm512_set1_epi32(0xF))
            } else {
                _mm512_srli_epi32::<4>(raw)
            };
            let bit = _mm512_srl_epi32(
                bytes16_u(block.add(16 + l)),
                _mm_cvtsi32_si128(group as i32),
            );
            let high = _mm512_slli_epi32::<4>(_mm512_and_si512(bit, _mm512_set1_epi32(1)));
            let q = _mm512_or_si512(low, high);
            // One rounding, as block_element's (k4_scales512).
            _mm512_fmsub_ps(
                _mm512_cvtepi32_ps(q),
                _mm512_set1_ps(d),
                _mm512_set1_ps(min),
            )
        }
    }
    #[cfg(target_arch = "x86_64")]
    const STEP: usize = 64;
    #[cfg(target_arch = "x86_64")]
    const CODES512: usize = 64;
    #[cfg(target_arch = "x86_64")]
    const HAS_MINS: bool = true;
    #[cfg(target_arch = "x86_64")]
    type Codes512 = [__m512; 4];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn factors512(block: *const u8) -> __m512 {
        // SAFETY: the block's 176 bytes are readable (caller).
        unsafe { k4_scales512(block) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn factors512_rows<const R: usize>(blocks: [*const u8; R], out: &mut [__m512; R]) {
        // SAFETY: each block's bytes are readable (caller).
        unsafe { k4_scales512_rows(blocks, out) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn step_scales512(factors: __m512, step: usize) -> __m512 {
        // SAFETY: step < 4 (caller).
        unsafe { scale_lanes512(factors, &K4_STEP_SCALE_LANES[step]) }
    }
    #[cfg(target_arch = "x86_64")]
    fn source512(p: usize) -> usize {
        k4_source512(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn codes512(block: *const u8, step: usize) -> [__m512; 4] {
        // Q4_K's layout (k4_source512) with the fifth bit: lane i's byte k is element
        // 4 (i % 8) + k of group g = 4c + 2 (i / 8) + h, whose fifth bit is bit g of
        // `qh` byte 4 (i % 8) + k, i.e. bit 8k + g of `qh` dword i % 8 (the 32 `qh`
        // bytes in both halves of a vector). Rotating each dword left by 4 - g puts
        // that bit on bit 4 of byte k, and one ternary-logic merge takes bits 0..3 from
        // the nibbles and the rest from the rotated `qh` (bits 5..7 are left over, and
        // `vpermt2ps` reads only bits 0..4 of an index): byte k of each lane is then
        // vector k's 5-bit code.
        // SAFETY: 176 readable bytes at `block`, step < 4 (caller); 32 f32 in the
        // table, 16 i32 per rotation entry.
        unsafe {
            let nibbles = k4_step_nibbles(block.add(48), step);
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.add(16).cast()));
            let rotation = _mm512_loadu_si512(Q5K_QH_ROTATIONS[step].as_ptr().cast());
            // (a & c) | (b & !c), c the low-nibble mask.
            let codes = _mm512_ternarylogic_epi32::<0xE4>(
                nibbles,
                _mm512_rolv_epi32(qh, rotation),
                _mm512_set1_epi8(0x0F),
            );
            let low = _mm512_loadu_ps(CODE_VALUES.as_ptr());
            let high = _mm512_loadu_ps(CODE_VALUES.as_ptr().add(16));
            [
                _mm512_permutex2var_ps(low, codes, high),
                _mm512_permutex2var_ps(low, _mm512_srli_epi32::<8>(codes), high),
                _mm512_permutex2var_ps(low, _mm512_srli_epi32::<16>(codes), high),
                _mm512_permutex2var_ps(low, _mm512_srli_epi32::<24>(codes), high),
            ]
        }
    }
    #[cfg(target_arch = "x86_64")]
    type Scales256 = [f32; 16];
    #[cfg(target_arch = "x86_64")]
    type Step256 = [__m256; 8];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn scales256(block: *const u8) -> [f32; 16] {
        // SAFETY: the block's 176 bytes are readable (caller).
        unsafe { k4_scales256(block) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn step256(block: *const u8, scales: &[f32; 16], j: usize) -> [__m256; 8] {
        // Groups 2j and 2j + 1 share their code bytes and their `qh` bytes: each is
        // widened once for both. `qh` shifted left by 4 holds bit `g` of each byte at
        // bit 4 + g of its lane; a right shift by `g` and a mask leave it at bit 4.
        // SAFETY: 176 readable bytes at `block`, j < 4 (caller).
        unsafe {
            let (d_low, min_low) = (scales[2 * j], scales[8 + 2 * j]);
            let (d_high, min_high) = (scales[2 * j + 1], scales[9 + 2 * j]);
            let (shift_low, shift_high) = (
                _mm_cvtsi32_si128(2 * j as i32),
                _mm_cvtsi32_si128(2 * j as i32 + 1),
            );
            let (nibble, fifth) = (_mm256_set1_epi32(0xF), _mm256_set1_epi32(16));
            let mut out = [_mm256_setzero_ps(); 8];
            for l in 0..4 {
                let w = bytes8_u(block.add(48 + 32 * j + 8 * l));
                let qh = _mm256_slli_epi32::<4>(bytes8_u(block.add(16 + 8 * l)));
                let low = _mm256_or_si256(
                    _mm256_and_si256(w, nibble),
                    _mm256_and_si256(_mm256_srl_epi32(qh, shift_low), fifth),
                );
                let high = _mm256_or_si256(
                    _mm256_srli_epi32::<4>(w),
                    _mm256_and_si256(_mm256_srl_epi32(qh, shift_high), fifth),
                );
                out[l] = scaled_less_min(low, d_low, min_low);
                out[4 + l] = scaled_less_min(high, d_high, min_high);
            }
            out
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn codes256(block: *const u8, j: usize) -> [__m256; 8] {
        // As step256, the codes left unscaled.
        // SAFETY: 176 readable bytes at `block`, j < 4 (caller).
        unsafe {
            let (shift_low, shift_high) = (
                _mm_cvtsi32_si128(2 * j as i32),
                _mm_cvtsi32_si128(2 * j as i32 + 1),
            );
            let (nibble, fifth) = (_mm256_set1_epi32(0xF), _mm256_set1_epi32(16));
            let mut out = [_mm256_setzero_ps(); 8];
            for l in 0..4 {
                let w = bytes8_u(block.add(48 + 32 * j + 8 * l));
                let qh = _mm256_slli_epi32::<4>(bytes8_u(block.add(16 + 8 * l)));
                let low = _mm256_or_si256(
                    _mm256_and_si256(w, nibble),
                    _mm256_and_si256(_mm256_srl_epi32(qh, shift_low), fifth),
                );
                let high = _mm256_or_si256(
                    _mm256_srli_epi32::<4>(w),
                    _mm256_and_si256(_mm256_srl_epi32(qh, shift_high), fifth),
                );
                out[l] = _mm256_cvtepi32_ps(low);
                out[4 + l] = _mm256_cvtepi32_ps(high);
            }
            out
        }
    }
    #[cfg(target_arch = "x86_64")]
    fn step_scale256(scales: &[f32; 16], j: usize, g: usize) -> f32 {
        scales[2 * j + g]
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn mins256(scales: &[f32; 16]) -> __m256 {
        // SAFETY: lanes 8..16 of the 16.
        unsafe { _mm256_loadu_ps(scales.as_ptr().add(8)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn decode_steps512(block: *const u8, e0: usize, n: usize, out: *mut f32) {
        // SAFETY: 176 readable bytes at `block` (the fifth bits at 16..48, the codes at
        // 48..176), whole steps j < 4 within the block, `out` holds n values (caller).
        unsafe { k4_decode_steps512(block, block.add(48), Some(block.add(16)), e0, n, out) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(block: *const u8, e: usize) -> __m256 {
        let (j, upper, l) = (e / 64, (e % 64) / 32, e % 32);
        let group = 2 * j + upper;
        // SAFETY: the 176-byte block is readable and e + 8 <= 256 (caller).
        unsafe {
            let (d, min) = k4_scale_min(block, group);
            let low = nibbles8(block.add(48 + 32 * j + l), upper == 1);
            let qh = bytes8_u(block.add(16 + l));
            let bit = _mm256_srl_epi32(qh, _mm_cvtsi32_si128(group as i32));
            let high = _mm256_slli_epi32::<4>(_mm256_and_si256(bit, _mm256_set1_epi32(1)));
            let q = _mm256_or_si256(low, high);
            scaled_less_min(q, d, min)
        }
    }
}

/// Q6_K: two halves of 128, each four quarters of 32 (low nibbles in `ql`, two high
/// bits in `qh`), an int8 scale per 16, `x = (d sc) (q - 32)`.
#[derive(Clone, Copy, Default)]
pub(crate) struct Q6KBlock;

impl SimdBlock for Q6KBlock {
    const TYPE: GgmlType = GgmlType::Q6_K;
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(block: *const u8, e: usize) -> __m512 {
        let (n, quarter, l) = (e / 128, (e % 128) / 32, e % 32);
        // SAFETY: 210 readable bytes at `block`, e + 16 <= 256 (caller).
        unsafe {
            let ql = bytes16_u(block.add(64 * n + l + 32 * (quarter % 2)));
            let low = if quarter < 2 {
                _mm512_and_si512(ql, _mm512_set1_epi32(0xF))
            } else {
                _mm512_srli_epi32::<4>(ql)
            };
            let qh = bytes16_u(block.add(128 + 32 * n + l));
            let high = _mm512_and_si512(
                _mm512_srl_epi32(qh, _mm_cvtsi32_si128(2 * quarter as i32)),
                _mm512_set1_epi32(3),
            );
            let q = _mm512_sub_epi32(
                _mm512_or_si512(low, _mm512_slli_epi32::<4>(high)),
                _mm512_set1_epi32(32),
            );
            let sc = *block.add(192 + 8 * n + l / 16 + 2 * quarter) as i8;
            let scale = _mm512_set1_ps(f16_at(block, 208) * f32::from(sc));
            _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale)
        }
    }
    #[cfg(target_arch = "x86_64")]
    const STEP: usize = 64;
    #[cfg(target_arch = "x86_64")]
    const CODES512: usize = 64;
    #[cfg(target_arch = "x86_64")]
    type Codes512 = [__m512; 4];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn factors512(block: *const u8) -> __m512 {
        // SAFETY: the block's 210 bytes are readable (caller).
        unsafe { q6_k_scales512(block) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn codes512(block: *const u8, step: usize) -> [__m512; 4] {
        // The step's 64 codes `q - 32` as bytes (q6_k_step_codes); byte k of each dword
        // lane, sign-extended by a left and an arithmetic right shift, is vector k.
        // SAFETY: 210 readable bytes at `block`, step < 4 (caller).
        unsafe {
            let q = q6_k_step_codes(block, step);
            [
                _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(q))),
                _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(_mm512_slli_epi32::<16>(q))),
                _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(_mm512_slli_epi32::<8>(q))),
                _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(q)),
            ]
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn step_scales512(factors: __m512, step: usize) -> __m512 {
        // Lane i of step s holds elements of scale group 4s + i / 4 (source512).
        // SAFETY: step < 4 (caller).
        unsafe { scale_lanes512(factors, &QUAD_SCALE_LANES[step]) }
    }
    #[cfg(target_arch = "x86_64")]
    fn source512(p: usize) -> usize {
        // Step s = 2n + part, vector k, lane i: quarter 2 part + i / 8 of half n,
        // element 4 (i % 8) + k (q6_k_step_codes).
        let (step, k, i) = (p / 64, p % 64 / 16, p % 16);
        128 * (step / 2) + 32 * (2 * (step % 2) + i / 8) + 4 * (i % 8) + k
    }
    #[cfg(target_arch = "x86_64")]
    type Scales256 = [f32; 16];
    #[cfg(target_arch = "x86_64")]
    type Step256 = [__m256; 8];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn scales256(block: *const u8) -> [f32; 16] {
        // SAFETY: the block's 210 bytes are readable (caller).
        unsafe { q6_k_scales(block) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn step256(block: *const u8, scales: &[f32; 16], step: usize) -> [__m256; 8] {
        // As q6_k_step_codes, a quarter (32 codes `q - 32` as bytes) at a time: its low four
        // bits from `ql` bytes 64 n + 32 (quarter % 2) .., low or high nibbles, its two
        // high bits from `qh` bytes 128 + 32 n .., shifted to bits 4 and 5 (16-bit
        // shifts; the bits carried in from the neighbouring byte are masked off).
        let (n, part) = (step / 2, step % 2);
        let mut out = [_mm256_setzero_ps(); 8];
        // SAFETY: 210 readable bytes at `block`, step < 4 (caller).
        unsafe {
            let qh = _mm256_loadu_si256(block.add(128 + 32 * n).cast());
            let nibble = _mm256_set1_epi8(0x0F);
            for i in 0..2 {
                let quarter = 2 * part + i;
                let ql = _mm256_loadu_si256(block.add(64 * n + 32 * i).cast());
                let low = if part == 0 {
                    _mm256_and_si256(ql, nibble)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql), nibble)
                };
                let high = match quarter {
                    0 => _mm256_slli_epi16::<4>(qh),
                    1 => _mm256_slli_epi16::<2>(qh),
                    2 => qh,
                    _ => _mm256_srli_epi16::<2>(qh),
                };
                let high = _mm256_and_si256(high, _mm256_set1_epi8(0x30));
                let q = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
                let halves = [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)];
                for (h, half) in halves.into_iter().enumerate() {
                    for (e, bytes) in [half, _mm_srli_si128::<8>(half)].into_iter().enumerate() {
                        let l = 16 * h + 8 * e;
                        let values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                        let scale = scales[8 * n + l / 16 + 2 * quarter];
                        out[4 * i + 2 * h + e] = _mm256_mul_ps(values, _mm256_set1_ps(scale));
                    }
                }
            }
        }
        out
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn codes256(block: *const u8, step: usize) -> [__m256; 8] {
        // As step256, the codes `q - 32` left unscaled.
        let (n, part) = (step / 2, step % 2);
        let mut out = [_mm256_setzero_ps(); 8];
        // SAFETY: 210 readable bytes at `block`, step < 4 (caller).
        unsafe {
            let qh = _mm256_loadu_si256(block.add(128 + 32 * n).cast());
            let nibble = _mm256_set1_epi8(0x0F);
            for i in 0..2 {
                let quarter = 2 * part + i;
                let ql = _mm256_loadu_si256(block.add(64 * n + 32 * i).cast());
                let low = if part == 0 {
                    _mm256_and_si256(ql, nibble)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql), nibble)
                };
                let high = match quarter {
                    0 => _mm256_slli_epi16::<4>(qh),
                    1 => _mm256_slli_epi16::<2>(qh),
                    2 => qh,
                    _ => _mm256_srli_epi16::<2>(qh),
                };
                let high = _mm256_and_si256(high, _mm256_set1_epi8(0x30));
                let q = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
                let halves = [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)];
                for (h, half) in halves.into_iter().enumerate() {
                    for (e, bytes) in [half, _mm_srli_si128::<8>(half)].into_iter().enumerate() {
                        out[4 * i + 2 * h + e] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                    }
                }
            }
        }
        out
    }
    #[cfg(target_arch = "x86_64")]
    const SCALE_VECTORS256: usize = 2;
    #[cfg(target_arch = "x86_64")]
    fn step_scale256(scales: &[f32; 16], step: usize, g: usize) -> f32 {
        // Vectors 2g, 2g + 1 of step s: elements 64 s + 16 g .. + 16, scale 4 s + g.
        scales[4 * step + g]
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn decode_steps512(block: *const u8, e0: usize, n: usize, out: *mut f32) {
        // Step s's 64 codes `q - 32`, in input order (q6_k_step_codes), times the
        // scale of each 16 (lane e / 16 of the block's scales), as load16 multiplies:
        // `d sc` is the same exact product.
        // SAFETY: 210 readable bytes at `block`, whole steps s < 4 within the block,
        // `out` holds n values (caller).
        unsafe {
            let scales = q6_k_scales512(block);
            for step in e0 / 64..(e0 + n) / 64 {
                let o = out.add(64 * step - e0);
                let q = q6_k_step_codes(block, step);
                let lanes = [
                    _mm512_castsi512_si128(q),
                    _mm512_extracti32x4_epi32::<1>(q),
                    _mm512_extracti32x4_epi32::<2>(q),
                    _mm512_extracti32x4_epi32::<3>(q),
                ];
                for (v, bytes) in lanes.into_iter().enumerate() {
                    let scale =
                        _mm512_permutexvar_ps(_mm512_set1_epi32((4 * step + v) as i32), scales);
                    let values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
                    _mm512_storeu_ps(o.add(16 * v), _mm512_mul_ps(values, scale));
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(block: *const u8, e: usize) -> __m256 {
        let (n, quarter, l) = (e / 128, (e % 128) / 32, e % 32);
        // SAFETY: the 210-byte block is readable and e + 8 <= 256 (caller).
        unsafe {
            let low = nibbles8(block.add(64 * n + l + 32 * (quarter % 2)), quarter >= 2);
            let qh = bytes8_u(block.add(128 + 32 * n + l));
            let high = _mm256_and_si256(
                _mm256_srl_epi32(qh, _mm_cvtsi32_si128(2 * quarter as i32)),
                _mm256_set1_epi32(3),
            );
            let q = _mm256_sub_epi32(
                _mm256_or_si256(low, _mm256_slli_epi32::<4>(high)),
                _mm256_set1_epi32(32),
            );
            let sc = *block.add(192 + 8 * n + l / 16 + 2 * quarter) as i8;
            scaled(q, f16_at(block, 208) * f32::from(sc))
        }
    }
}

/// IQ4_XS: 8 groups of 32 with a 6-bit scale each, 4-bit indices into the
/// non-linear IQ4 table, `x = (d (ls - 32)) table[q]`.
#[derive(Clone, Copy, Default)]
pub(crate) struct Iq4XsBlock;

impl SimdBlock for Iq4XsBlock {
    const TYPE: GgmlType = GgmlType::IQ4_XS;
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(block: *const u8, e: usize) -> __m512 {
        let (ib, j) = (e / 32, e % 32);
        // SAFETY: 136 readable bytes at `block`, e + 16 <= 256 (caller).
        unsafe {
            let values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                IQ4_VALUES.as_ptr().cast(),
            )));
            let raw = bytes16_u(block.add(8 + 16 * ib));
            let index = if j == 0 {
                raw
            } else {
                _mm512_srli_epi32::<4>(raw)
            };
            let dl = _mm512_set1_ps(iq4_xs_scale(block, ib));
            _mm512_mul_ps(_mm512_permutexvar_ps(index, values), dl)
        }
    }
    #[cfg(target_arch = "x86_64")]
    const STEP: usize = 32;
    #[cfg(target_arch = "x86_64")]
    const CODES512: usize = 128;
    #[cfg(target_arch = "x86_64")]
    type Codes512 = [__m512; 8];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn factors512(block: *const u8) -> __m512 {
        // SAFETY: the block's 136 bytes are readable (caller).
        unsafe {
            let scales = iq4_xs_scales(block, f16c_at(block, 0));
            _mm512_castps256_ps512(_mm256_loadu_ps(scales.as_ptr()))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn codes512(block: *const u8, step: usize) -> [__m512; 8] {
        // Code bytes 64 step .. + 64 (groups 4 step .. + 4) as 16 dword lanes: nibble q
        // of every lane, by a shift of 4q, indexes the IQ4 table (`vpermps` reads only
        // the low 4 bits of an index), as NVFP4's loop does (gemv_fp4.rs).
        // SAFETY: 136 readable bytes at `block`, step < 2 (caller): the 64 code bytes
        // of the step are readable; 16 f32 in the table.
        unsafe {
            let table = _mm512_loadu_ps(IQ4_F32_VALUES.as_ptr());
            super::gemv_fp4::decode128_avx512(block.add(8 + 64 * step), table)
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn step_scales512(factors: __m512, step: usize) -> __m512 {
        // Lane i of step s holds elements of group 4s + i / 4 (source512).
        // SAFETY: step < 2 (caller).
        unsafe { scale_lanes512(factors, &QUAD_SCALE_LANES[step]) }
    }
    #[cfg(target_arch = "x86_64")]
    fn source512(p: usize) -> usize {
        // Step c, vector q = 2k + h, lane i: group 4c + i / 4, byte 4 (i % 4) + k of the
        // group's 16, its low (h = 0: element j) or high nibble (element 16 + j).
        let (step, q, i) = (p / 128, p % 128 / 16, p % 16);
        32 * (4 * step + i / 4) + 16 * (q % 2) + 4 * (i % 4) + q / 2
    }
    #[cfg(target_arch = "x86_64")]
    type Scales256 = [f32; 8];
    #[cfg(target_arch = "x86_64")]
    type Step256 = [__m256; 4];
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn scales256(block: *const u8) -> [f32; 8] {
        // SAFETY: the block's 136 bytes are readable (caller).
        unsafe { iq4_xs_scales(block, f16_at(block, 0)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn step256(block: *const u8, scales: &[f32; 8], ib: usize) -> [__m256; 4] {
        // SAFETY: 136 readable bytes at `block`, ib < 8 (caller).
        unsafe {
            let table = _mm_loadu_si128(IQ4_VALUES.as_ptr().cast());
            let mask = _mm_set1_epi8(0xF);
            let dl = scales[ib];
            let raw = _mm_loadu_si128(block.add(8 + 16 * ib).cast());
            let low = _mm_shuffle_epi8(table, _mm_and_si128(raw, mask));
            let high = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(raw), mask));
            [
                scaled(_mm256_cvtepi8_epi32(low), dl),
                scaled(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(low)), dl),
                scaled(_mm256_cvtepi8_epi32(high), dl),
                scaled(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(high)), dl),
            ]
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn codes256(block: *const u8, ib: usize) -> [__m256; 4] {
        // As step256, the table values left unscaled.
        // SAFETY: 136 readable bytes at `block`, ib < 8 (caller).
        unsafe {
            let table = _mm_loadu_si128(IQ4_VALUES.as_ptr().cast());
            let mask = _mm_set1_epi8(0xF);
            let raw = _mm_loadu_si128(block.add(8 + 16 * ib).cast());
            let low = _mm_shuffle_epi8(table, _mm_and_si128(raw, mask));
            let high = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(raw), mask));
            [
                low,
                _mm_srli_si128::<8>(low),
                high,
                _mm_srli_si128::<8>(high),
            ]
            .map(|bytes| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)))
        }
    }
    #[cfg(target_arch = "x86_64")]
    fn step_scale256(scales: &[f32; 8], ib: usize, _: usize) -> f32 {
        scales[ib]
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(block: *const u8, e: usize) -> __m256 {
        let (ib, j) = (e / 32, e % 32);
        // SAFETY: the 136-byte block is readable and e + 8 <= 256 (caller).
        unsafe {
            let dl = iq4_xs_scale(block, ib);
            let raw = _mm_loadl_epi64(block.add(8 + 16 * ib + j % 16).cast());
            let raw = if j >= 16 {
                _mm_srli_epi16::<4>(raw)
            } else {
                raw
            };
            let index = _mm_and_si128(raw, _mm_set1_epi8(0xF));
            let table = _mm_loadu_si128(IQ4_VALUES.as_ptr().cast());
            let values = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(table, index));
            scaled(values, dl)
        }
    }
}

/// What runs on a GGUF weight once its block format is known ([`visit_ggml`]).
pub(crate) trait GgmlVisitor {
    /// Result.
    type Output;
    /// A weight of a [`SimdBlock`] type.
    fn simd<B: SimdBlock>(self, rows: BlockRows<'_, B>) -> Self::Output;
    /// A weight of any other type, read element by element.
    fn scalar(self, rows: BlockRows<'_, ScalarBlock>) -> Self::Output;
}

/// Calls `v` with `w`'s rows read through its type's block format: the one place that
/// maps a [`GgmlType`] to its decoder.
pub(crate) fn visit_ggml<V: GgmlVisitor>(w: &GgmlWeight, v: V) -> V::Output {
    match w.ggml_type {
        GgmlType::Q8_0 => v.simd(BlockRows::new(w, Q8_0Block)),
        GgmlType::Q4_0 => v.simd(BlockRows::new(w, Q4_0Block)),
        GgmlType::Q4_K => v.simd(BlockRows::new(w, Q4KBlock)),
        GgmlType::Q5_K => v.simd(BlockRows::new(w, Q5KBlock)),
        GgmlType::Q6_K => v.simd(BlockRows::new(w, Q6KBlock)),
        GgmlType::IQ4_XS => v.simd(BlockRows::new(w, Iq4XsBlock)),
        other => v.scalar(BlockRows::new(w, ScalarBlock(other))),
    }
}

/// How the elements of one ggml type are read from a row of its blocks: a [`SimdBlock`]
/// type's SIMD load, or [`ScalarBlock`]'s element-by-element decode.
pub(crate) trait BlockFormat: Sync {
    /// The type.
    fn ggml_type(&self) -> GgmlType;
    /// Elements `k .. k + 8` of `row` (one row's blocks), dequantized.
    ///
    /// # Safety
    /// AVX2 and FMA are available, `k % 8 == 0` and `k + 8` is at most the row's
    /// elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(&self, row: &[u8], k: usize) -> __m256;
    /// Elements `k .. k + 16` of `row`, dequantized.
    ///
    /// # Safety
    /// AVX-512F/BW are available, `k % 16 == 0` and `k + 16` is at most the row's
    /// elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(&self, row: &[u8], k: usize) -> __m512;
    /// `RowDecode::SPAN` of the type's rows: a [`SimdBlock`]'s `STEP`, 0 for the
    /// others (no span decoders).
    #[cfg(target_arch = "x86_64")]
    const SPAN: usize = 0;
    /// Elements `k .. k + len` of `row` (whole spans) into `out`, AVX-512.
    ///
    /// # Safety
    /// `Self::SPAN > 0`, AVX-512F/BW, `k` and `len` multiples of `Self::SPAN` with `k +
    /// len` at most the row's elements, `out .. out + len` writable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn decode_span512(&self, row: &[u8], k: usize, len: usize, out: *mut f32) {
        let _ = (row, k, len, out);
        unreachable!("decode_span512 of a type without span decoders")
    }
    /// [`BlockFormat::decode_span512`] with AVX2 and FMA.
    ///
    /// # Safety
    /// As [`BlockFormat::decode_span512`], with AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    unsafe fn decode_span256(&self, row: &[u8], k: usize, len: usize, out: *mut f32) {
        let _ = (row, k, len, out);
        unreachable!("decode_span256 of a type without span decoders")
    }
}

impl<B: SimdBlock> BlockFormat for B {
    fn ggml_type(&self) -> GgmlType {
        B::TYPE
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(&self, row: &[u8], k: usize) -> __m256 {
        // SAFETY: k + 8 <= the row's elements with k % 8 == 0 (caller), and every block
        // holds a multiple of 8 elements: the run lies in one whole block of the row.
        unsafe {
            B::load8(
                row.as_ptr().add(k / B::ELEMENTS * B::BYTES),
                k % B::ELEMENTS,
            )
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(&self, row: &[u8], k: usize) -> __m512 {
        // SAFETY: as load8; every block holds a multiple of 16 elements.
        unsafe {
            B::load16(
                row.as_ptr().add(k / B::ELEMENTS * B::BYTES),
                k % B::ELEMENTS,
            )
        }
    }
    #[cfg(target_arch = "x86_64")]
    const SPAN: usize = B::STEP;
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn decode_span512(&self, row: &[u8], k: usize, len: usize, out: *mut f32) {
        // SAFETY: whole steps of whole blocks of the row (caller; a block holds whole
        // steps).
        unsafe {
            for_blocks::<B>(k, len, |b, e0, n, o| {
                B::decode_steps512(row.as_ptr().add(b * B::BYTES), e0, n, out.add(o))
            })
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn decode_span256(&self, row: &[u8], k: usize, len: usize, out: *mut f32) {
        // SAFETY: as decode_span512.
        unsafe {
            for_blocks::<B>(k, len, |b, e0, n, o| {
                B::decode_steps256(row.as_ptr().add(b * B::BYTES), e0, n, out.add(o))
            })
        }
    }
}

/// Splits elements `k .. k + len` of a row of `B` blocks by block: `f(block, e0, n,
/// offset)` for elements `e0 .. e0 + n` of block `block`, the run's values `offset ..`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn for_blocks<B: SimdBlock>(k: usize, len: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    let (mut e, end) = (k, k + len);
    while e < end {
        let e0 = e % B::ELEMENTS;
        let n = (B::ELEMENTS - e0).min(end - e);
        f(e / B::ELEMENTS, e0, n, e - k);
        e += n;
    }
}

/// The types without a SIMD load (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, MXFP4, the float
/// types): every lane by `block_element`.
pub(crate) struct ScalarBlock(pub GgmlType);

impl BlockFormat for ScalarBlock {
    fn ggml_type(&self) -> GgmlType {
        self.0
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8(&self, row: &[u8], k: usize) -> __m256 {
        let values: [f32; 8] = std::array::from_fn(|i| element(self.0, row, k + i));
        // SAFETY: `values` holds 8 f32.
        unsafe { _mm256_loadu_ps(values.as_ptr()) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(&self, row: &[u8], k: usize) -> __m512 {
        let values: [f32; 16] = std::array::from_fn(|i| element(self.0, row, k + i));
        // SAFETY: `values` holds 16 f32.
        unsafe { _mm512_loadu_ps(values.as_ptr()) }
    }
}

/// Element `k` of `row` (one row's blocks of `ggml_type`), by `block_element`.
#[inline(always)]
fn element(ggml_type: GgmlType, row: &[u8], k: usize) -> f32 {
    let block: BlockGeometry = ggml_type.block();
    let start = k / block.elements * block.bytes;
    block_element(
        ggml_type,
        &row[start..start + block.bytes],
        k % block.elements,
    )
}

/// A ggml weight's rows: blocks one after another, `row_bytes` per row, read through
/// the type's [`BlockFormat`].
pub(crate) struct BlockRows<'a, F: BlockFormat> {
    data: &'a [u8],
    format: F,
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

impl<'a, F: BlockFormat> BlockRows<'a, F> {
    /// Borrows a weight of `format`'s type whose lengths were checked
    /// (`weight::check_runnable`).
    pub(crate) fn new(w: &'a GgmlWeight, format: F) -> Self {
        debug_assert_eq!(w.ggml_type, format.ggml_type());
        Self {
            data: &w.data,
            format,
            rows: w.out_features,
            cols: w.in_features,
            row_bytes: w.row_bytes(),
        }
    }

    /// The stored blocks of `row`.
    #[inline(always)]
    pub(crate) fn row(&self, row: usize) -> &'a [u8] {
        &self.data[row * self.row_bytes..(row + 1) * self.row_bytes]
    }

    /// The stored blocks of `row`, without a bounds check.
    ///
    /// # Safety
    /// `row < rows`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(crate) unsafe fn row_unchecked(&self, row: usize) -> &'a [u8] {
        // SAFETY: the weight holds rows * row_bytes bytes (checked at construction of
        // the GgmlWeight) and row < rows (caller).
        unsafe {
            self.data
                .get_unchecked(row * self.row_bytes..(row + 1) * self.row_bytes)
        }
    }
}

impl<F: BlockFormat> RowDecode for BlockRows<'_, F> {
    #[inline(always)]
    fn code_address(&self, row: usize, k: usize) -> *const u8 {
        let block = self.format.ggml_type().block();
        self.data
            .as_ptr()
            .wrapping_add(row * self.row_bytes + k / block.elements * block.bytes)
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn get(&self, row: usize, k: usize) -> f32 {
        element(self.format.ggml_type(), self.row(row), k)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(&self, row: usize, k: usize) -> __m512 {
        // SAFETY: row < rows and k + 16 <= cols with k % 16 == 0 (trait contract).
        unsafe { self.format.load16(self.row_unchecked(row), k) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8(&self, row: usize, k: usize) -> __m256 {
        // SAFETY: row < rows and k + 8 <= cols with k % 8 == 0 (trait contract).
        unsafe { self.format.load8(self.row_unchecked(row), k) }
    }
    #[cfg(target_arch = "x86_64")]
    const SPAN: usize = F::SPAN;
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn decode_span512(&self, row: usize, k: usize, len: usize, out: *mut f32) {
        // SAFETY: row < rows, whole spans within the row (trait contract).
        unsafe {
            self.format
                .decode_span512(self.row_unchecked(row), k, len, out)
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn decode_span256(&self, row: usize, k: usize, len: usize, out: *mut f32) {
        // SAFETY: as decode_span512.
        unsafe {
            self.format
                .decode_span256(self.row_unchecked(row), k, len, out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Isa;
    use std::path::PathBuf;

    /// The committed decode vectors of `ggml_type` (scripts/gguf_blocks_oracle.py):
    /// random blocks and gguf-py's values for them.
    fn vectors(ggml_type: GgmlType) -> (Vec<u8>, Vec<f32>) {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/gguf_blocks");
        let read = |ext: &str| {
            let path = dir.join(format!("decode_{}.{ext}", ggml_type_file_name(ggml_type)));
            std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        };
        let values = read("f32")
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        (read("bin"), values)
    }

    /// The vector files' spelling of a type (`q4_K`, `iq4_xs`: ggml_type_name).
    fn ggml_type_file_name(ggml_type: GgmlType) -> String {
        let name = ggml_type.name().to_lowercase();
        match name.strip_suffix("_k") {
            Some(stem) => format!("{stem}_K"),
            None => name,
        }
    }

    fn check<B: SimdBlock>() {
        let (blocks, expected) = vectors(B::TYPE);
        // The vectors as one row per block... and as rows of two blocks, so that
        // block_start's row arithmetic is exercised.
        for per_row in [1, 2] {
            let rows = blocks.len() / B::BYTES / per_row;
            let in_features = per_row * B::ELEMENTS;
            let weight = GgmlWeight::new(
                "vectors",
                B::TYPE,
                rows,
                in_features,
                blocks[..rows * per_row * B::BYTES].to_vec(),
            )
            .unwrap();
            let d = BlockRows::new(&weight, B::default());
            for row in 0..rows {
                let want = &expected[row * in_features..(row + 1) * in_features];
                for (k, &w) in want.iter().enumerate() {
                    assert_eq!(d.get(row, k).to_bits(), w.to_bits(), "{} get", B::TYPE);
                }
                #[cfg(target_arch = "x86_64")]
                for isa in Isa::available() {
                    let mut got = vec![0f32; in_features];
                    match isa {
                        // SAFETY: the ISA was detected; k runs over whole runs in the row.
                        Isa::Avx2 => unsafe {
                            for k in (0..in_features).step_by(8) {
                                _mm256_storeu_ps(got[k..].as_mut_ptr(), d.load8(row, k));
                            }
                        },
                        // SAFETY: as above.
                        Isa::Avx512 => unsafe {
                            for k in (0..in_features).step_by(16) {
                                _mm512_storeu_ps(got[k..].as_mut_ptr(), d.load16(row, k));
                            }
                        },
                        Isa::Scalar => continue,
                    }
                    for (k, (g, w)) in got.iter().zip(want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{} {isa:?}: row {row} element {k}: {g:e}, gguf-py {w:e}",
                            B::TYPE
                        );
                    }
                    // The prefill's row decode (span decoders over whole spans).
                    let mut segment = vec![0f32; in_features];
                    crate::cpu::gemm::decode_segment(isa, &d, row, 0, &mut segment);
                    for (k, (g, w)) in segment.iter().zip(want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{} {isa:?} span decode: row {row} element {k}: {g:e}, gguf-py {w:e}",
                            B::TYPE
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn simd_loads_decode_the_committed_vectors_bit_exactly() {
        check::<Q8_0Block>();
        check::<Q4_0Block>();
        check::<Q4KBlock>();
        check::<Q5KBlock>();
        check::<Q6KBlock>();
        check::<Iq4XsBlock>();
    }

    /// f16 scales the random blocks take in turn: one, zeros of both signs, the
    /// smallest and largest subnormals, the smallest normal, the largest finite values
    /// of both signs (products overflow to infinity), infinity and NaN, and a few odd
    /// values.
    const F16_SCALES: [u16; 14] = [
        0x3C00, 0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0x7E00, 0x2E66,
        0xA9F1, 0x1234, 0xB800,
    ];

    /// `count` random blocks of `B`, the f16 scale fields set from [`F16_SCALES`] (the
    /// `d` and `dmin` of a block take different entries).
    fn random_blocks<B: SimdBlock>(count: usize, seed: u64) -> Vec<u8> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut blocks = vec![0u8; count * B::BYTES];
        rng.fill(blocks.as_mut_slice());
        for (i, block) in blocks.chunks_exact_mut(B::BYTES).enumerate() {
            for (f, &offset) in loraq_quant::ggml::f16_scale_offsets(B::TYPE)
                .iter()
                .enumerate()
            {
                let bits = F16_SCALES[(i + 5 * f) % F16_SCALES.len()];
                block[offset..offset + 2].copy_from_slice(&bits.to_le_bytes());
            }
            // Every fourth block: all codes zero (and the K types' packed scales).
            if i % 4 == 3 {
                let scales = loraq_quant::ggml::f16_scale_offsets(B::TYPE);
                for (b, byte) in block.iter_mut().enumerate() {
                    if !scales.iter().any(|&o| b == o || b == o + 1) {
                        *byte = 0;
                    }
                }
            }
        }
        blocks
    }

    /// The AVX-512 factored steps of one block, recombined per element: position `p`
    /// of step `s` is element `source512(p)`, its value the code times lane `p % 16`
    /// of the step's scales, less the group's minimum (`factors512` lane 8 + group)
    /// for types with minimums.
    ///
    /// # Safety
    /// AVX-512F/BW are available and `block` holds `B::BYTES` bytes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn factored_elements<B: SimdBlock>(block: &[u8]) -> Vec<f32> {
        let mut out = vec![f32::from_bits(0xDEAD_BEEF); B::ELEMENTS];
        let mut seen = vec![false; B::ELEMENTS];
        let lanes = |v: __m512| {
            let mut a = [0f32; 16];
            // SAFETY: 16 f32.
            unsafe { _mm512_storeu_ps(a.as_mut_ptr(), v) };
            a
        };
        // SAFETY: AVX-512 (caller); a whole block; step < ELEMENTS / CODES512.
        unsafe {
            let factors = B::factors512(block.as_ptr());
            let mins = lanes(factors);
            for step in 0..B::ELEMENTS / B::CODES512 {
                let scales = lanes(B::step_scales512(factors, step));
                for (v, codes) in B::codes512(block.as_ptr(), step)
                    .as_ref()
                    .iter()
                    .enumerate()
                {
                    for (i, code) in lanes(*codes).into_iter().enumerate() {
                        let e = B::source512(step * B::CODES512 + 16 * v + i);
                        assert!(
                            !std::mem::replace(&mut seen[e], true),
                            "{}: {e} twice",
                            B::TYPE
                        );
                        let scaled = code * scales[i];
                        out[e] = if B::HAS_MINS {
                            scaled - mins[8 + e / 32]
                        } else {
                            scaled
                        };
                    }
                }
            }
        }
        out
    }

    /// The AVX2 factored steps of one block, recombined per element: vector `v` of
    /// step `s` holds elements `STEP s + 8 v ..` (input order), each the code times the
    /// scale of the vector's group (`step_scale256`), less the group's minimum
    /// (`mins256` lane `e / 32`) for types with minimums.
    ///
    /// # Safety
    /// AVX2 and FMA are available and `block` holds `B::BYTES` bytes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn factored256_elements<B: SimdBlock>(block: &[u8]) -> Vec<f32> {
        let mut out = vec![f32::from_bits(0xDEAD_BEEF); B::ELEMENTS];
        let lanes = |v: __m256| {
            let mut a = [0f32; 8];
            // SAFETY: 8 f32.
            unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
            a
        };
        // SAFETY: AVX2 (caller); a whole block; step < ELEMENTS / STEP.
        unsafe {
            let scales = B::scales256(block.as_ptr());
            let mins = lanes(B::mins256(&scales));
            for step in 0..B::ELEMENTS / B::STEP {
                let codes = B::codes256(block.as_ptr(), step);
                assert_eq!(codes.as_ref().len() * 8, B::STEP);
                for (v, w) in codes.as_ref().iter().enumerate() {
                    let scale = B::step_scale256(&scales, step, v / B::SCALE_VECTORS256);
                    for (i, code) in lanes(*w).into_iter().enumerate() {
                        let e = step * B::STEP + 8 * v + i;
                        out[e] = if B::HAS_MINS {
                            code * scale - mins[e / 32]
                        } else {
                            code * scale
                        };
                    }
                }
            }
        }
        out
    }

    /// The whole-block decoders of every available ISA give the bits of
    /// `block_element` on every element of every block (NaN: any NaN): the AVX2
    /// steps, the loads, and the AVX-512 factored steps recombined (each code times
    /// its scale is exact, so one rounding at the minimum's subtraction, as
    /// `block_element`'s).
    fn check_block_decoders<B: SimdBlock>(blocks: &[u8]) {
        for (i, block) in blocks.chunks_exact(B::BYTES).enumerate() {
            let want: Vec<f32> = (0..B::ELEMENTS)
                .map(|e| block_element(B::TYPE, block, e))
                .collect();
            #[cfg(target_arch = "x86_64")]
            for isa in Isa::available() {
                let got = match isa {
                    // SAFETY: the ISA was detected; a whole block in.
                    Isa::Avx512 => unsafe { factored_elements::<B>(block) },
                    Isa::Avx2 => {
                        let mut got = vec![f32::from_bits(0xDEAD_BEEF); B::ELEMENTS];
                        // SAFETY: as above; its elements out.
                        unsafe { B::decode256(block.as_ptr(), got.as_mut_ptr()) };
                        got
                    }
                    Isa::Scalar => continue,
                };
                // The 16- and 8-lane loads (the prefill's panel decode) of the same block.
                let mut loaded = vec![f32::from_bits(0xDEAD_BEEF); B::ELEMENTS];
                for e in (0..B::ELEMENTS).step_by(16) {
                    // SAFETY: the ISA was detected; e + 16 <= ELEMENTS; 16 f32 out.
                    unsafe {
                        let out = loaded.as_mut_ptr().add(e);
                        match isa {
                            Isa::Avx512 => _mm512_storeu_ps(out, B::load16(block.as_ptr(), e)),
                            _ => {
                                _mm256_storeu_ps(out, B::load8(block.as_ptr(), e));
                                _mm256_storeu_ps(out.add(8), B::load8(block.as_ptr(), e + 8));
                            }
                        }
                    }
                }
                // The span decoders of the prefill's panels: the whole block, then each
                // step alone (the offsets into the block and into `out`).
                let mut spans = vec![f32::from_bits(0xDEAD_BEEF); B::ELEMENTS];
                let mut steps = vec![f32::from_bits(0xDEAD_BEEF); B::ELEMENTS];
                // SAFETY: the ISA was detected; whole steps of a whole block; as many f32
                // out.
                unsafe {
                    let decode = |e0: usize, n: usize, out: *mut f32| match isa {
                        Isa::Avx512 => B::decode_steps512(block.as_ptr(), e0, n, out),
                        _ => B::decode_steps256(block.as_ptr(), e0, n, out),
                    };
                    decode(0, B::ELEMENTS, spans.as_mut_ptr());
                    for e0 in (0..B::ELEMENTS).step_by(B::STEP) {
                        decode(e0, B::STEP, steps.as_mut_ptr().add(e0));
                    }
                }
                // AVX2: its factored steps too (each code times its scale exact, as the
                // AVX-512 ones).
                let factored = match isa {
                    // SAFETY: the ISA was detected; a whole block in.
                    Isa::Avx2 => unsafe { factored256_elements::<B>(block) },
                    _ => want.clone(),
                };
                for (what, values) in [
                    ("block decode", &got),
                    ("load", &loaded),
                    ("span decode", &spans),
                    ("step decode", &steps),
                    ("factored 8-lane steps", &factored),
                ] {
                    for (e, (g, w)) in values.iter().zip(&want).enumerate() {
                        assert!(
                            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                            "{} {isa:?} {what}: block {i} element {e}: {g:e}, block_element {w:e}",
                            B::TYPE
                        );
                    }
                }
            }
        }
    }

    fn check_decoders<B: SimdBlock>(seed: u64) {
        check_block_decoders::<B>(&vectors(B::TYPE).0);
        check_block_decoders::<B>(&random_blocks::<B>(200, seed));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16_conversion_is_loraq_quants_on_every_input() {
        for h in 0..=u16::MAX {
            let (got, want) = (f16_bits_to_f32(h), loraq_quant::ggml::fp16_to_f32(h));
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "f16 {h:#06x}: {got:e} vs {want:e}"
            );
        }
    }

    /// The AVX-512 steps' F16C conversion, on all 65536 inputs.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_conversion_is_loraq_quants_on_every_input() {
        if !Isa::available().contains(&Isa::Avx512) {
            return;
        }
        for h in 0..=u16::MAX {
            let bytes = h.to_le_bytes();
            // SAFETY: AVX-512 detected above; two readable bytes.
            let got = unsafe { f16c_at(bytes.as_ptr(), 0) };
            let want = loraq_quant::ggml::fp16_to_f32(h);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "f16 {h:#06x}: {got:e} vs {want:e}"
            );
        }
    }

    #[test]
    fn block_decoders_are_block_element_bit_for_bit() {
        check_decoders::<Q8_0Block>(1);
        check_decoders::<Q4_0Block>(2);
        check_decoders::<Q4KBlock>(3);
        check_decoders::<Q5KBlock>(4);
        check_decoders::<Q6KBlock>(5);
        check_decoders::<Iq4XsBlock>(6);
    }

    /// The prefill product (`gemm_rows`) on a GGUF weight, whose panels the span
    /// decoders pack, is bit for bit the product on the weight dequantized by
    /// `block_element` (an `F32Rows`, packed by plain loads): the panels hold the same
    /// values and the micro-kernels are the same. 70 rows (two whole 32-row blocks and
    /// an edge of 6, decoded row by row), 20 tokens, reduction slices of 128 (and a
    /// shorter last one for the 32-element types), every ISA.
    #[test]
    fn prefill_panels_are_the_dequantized_weight() {
        use crate::cpu::Parallelism;
        use crate::cpu::decode::F32Rows;
        use crate::cpu::gemm::{Segment, gemm_rows, tile_shape};
        use rand::{Rng, SeedableRng};
        fn run<B: SimdBlock>(seed: u64) {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let (rows, tokens): (usize, usize) = (70, 20);
            let cols = if B::ELEMENTS == 256 { 512 } else { 13 * 32 };
            let weight =
                crate::cpu::gemv_ggml::tests::random_weight::<B>(rows, cols / B::ELEMENTS, seed);
            let d = BlockRows::new(&weight, B::default());
            let dense: Vec<f32> = (0..rows * cols)
                .map(|i| d.get(i / cols, i % cols))
                .collect();
            let dense_rows = F32Rows {
                data: &dense,
                rows,
                cols,
            };
            for isa in Isa::available() {
                let (mr, _) = tile_shape(isa);
                let n_padded = tokens.div_ceil(mr) * mr;
                let mut x: Vec<f32> = (0..tokens * cols)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                x.resize(n_padded * cols, 0.0);
                let product = |y: &mut [f32], quantized: bool| {
                    if quantized {
                        let first = Segment {
                            weight: &d,
                            packed: None,
                            x: &x,
                            x_stride: cols,
                        };
                        gemm_rows::<_, F32Rows<'_>>(
                            isa,
                            Parallelism::Sequential,
                            n_padded,
                            &first,
                            None,
                            y,
                        );
                    } else {
                        let first = Segment {
                            weight: &dense_rows,
                            packed: None,
                            x: &x,
                            x_stride: cols,
                        };
                        gemm_rows::<_, F32Rows<'_>>(
                            isa,
                            Parallelism::Sequential,
                            n_padded,
                            &first,
                            None,
                            y,
                        );
                    }
                };
                let (mut got, mut want) = (vec![0f32; tokens * rows], vec![0f32; tokens * rows]);
                product(&mut got, true);
                product(&mut want, false);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{} {isa:?}: y[{}, {}] = {g:e}, dequantized weight's {w:e}",
                        B::TYPE,
                        i / rows,
                        i % rows
                    );
                }
            }
        }
        run::<Q8_0Block>(21);
        run::<Q4_0Block>(22);
        run::<Q4KBlock>(23);
        run::<Q5KBlock>(24);
        run::<Q6KBlock>(25);
        run::<Iq4XsBlock>(26);
    }

    /// The types without a SIMD load decode through `ScalarBlock`'s 8-lane load as
    /// through the element getter, rows of several blocks (and, for F16, runs that
    /// span blocks).
    #[test]
    fn scalar_block_loads_are_the_element_getter() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for ggml_type in [
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q2_K,
            GgmlType::F16,
        ] {
            let block = ggml_type.block();
            let in_features = 2 * block.elements.max(32);
            let mut data = vec![0u8; 3 * in_features / block.elements * block.bytes];
            rng.fill(data.as_mut_slice());
            for chunk in data.chunks_exact_mut(block.bytes) {
                for &offset in loraq_quant::ggml::f16_scale_offsets(ggml_type) {
                    chunk[offset..offset + 2].copy_from_slice(&0x2E66u16.to_le_bytes());
                }
            }
            if ggml_type == GgmlType::F16 {
                // Finite halves only: clear the top exponent bit.
                for pair in data.chunks_exact_mut(2) {
                    pair[1] &= 0xBF;
                }
            }
            let weight = GgmlWeight::new("scalar", ggml_type, 3, in_features, data).unwrap();
            let d = BlockRows::new(&weight, ScalarBlock(ggml_type));
            for isa in Isa::available() {
                for row in 0..3 {
                    let mut got = vec![0f32; in_features];
                    crate::cpu::gemm::decode_segment(isa, &d, row, 0, &mut got);
                    for (k, g) in got.iter().enumerate() {
                        let want = element(ggml_type, d.row(row), k);
                        assert_eq!(g.to_bits(), want.to_bits(), "{ggml_type} {isa:?} {row} {k}");
                    }
                }
            }
        }
    }
}
