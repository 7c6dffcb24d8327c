//! Row decoders of the ggml block types (GGUF bases, `QuantizedWeight::Ggml`): every
//! load dequantizes its run of elements in the loop, so the fused linears read the
//! stored blocks once and never a dequantized copy.
//!
//! Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and IQ4_XS have SIMD loads ([`BlockRows`] over a
//! [`SimdBlock`]): 8 elements from their codes, scale and min in a few integer ops
//! (AVX2; AVX-512 takes two of them). Each lane is computed with the operations, in
//! the order, of `loraq_quant::ggml::block_element` (a product, or a product then a
//! subtraction, never a fused multiply-add), so a SIMD load and the scalar decode give
//! the same bits. The other types (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, MXFP4, the
//! float types) take [`GgmlRows`], scalar per element by `block_element`.

use super::decode::RowDecode;
use loraq_quant::ggml::{BlockGeometry, GgmlType, GgmlWeight, block_element};
use std::marker::PhantomData;

#[cfg(target_arch = "x86_64")]
use loraq_quant::ggml::{decode::IQ4_VALUES, decode::scale_min_k4, fp16_to_f32};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// A ggml weight's rows: blocks one after another, `row_bytes` per row, decoded one
/// element at a time (the types without a SIMD load).
pub(crate) struct GgmlRows<'a> {
    data: &'a [u8],
    ggml_type: GgmlType,
    block: BlockGeometry,
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

impl<'a> GgmlRows<'a> {
    /// Borrows a weight whose lengths were checked (`weight::check_runnable`).
    pub(crate) fn new(w: &'a GgmlWeight) -> Self {
        Self {
            data: &w.data,
            ggml_type: w.ggml_type,
            block: w.ggml_type.block(),
            rows: w.out_features,
            cols: w.in_features,
            row_bytes: w.row_bytes(),
        }
    }

    /// Byte offset of the block holding element `(row, k)`.
    #[inline(always)]
    fn block_start(&self, row: usize, k: usize) -> usize {
        row * self.row_bytes + k / self.block.elements * self.block.bytes
    }

    /// `N` consecutive elements of `row` from `k`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn run<const N: usize>(&self, row: usize, k: usize) -> [f32; N] {
        std::array::from_fn(|i| self.get(row, k + i))
    }
}

impl RowDecode for GgmlRows<'_> {
    #[inline(always)]
    fn code_address(&self, row: usize, k: usize) -> *const u8 {
        self.data.as_ptr().wrapping_add(self.block_start(row, k))
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn get(&self, row: usize, k: usize) -> f32 {
        let start = self.block_start(row, k);
        block_element(
            self.ggml_type,
            &self.data[start..start + self.block.bytes],
            k % self.block.elements,
        )
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(&self, row: usize, k: usize) -> __m512 {
        let values: [f32; 16] = self.run(row, k);
        // SAFETY: `values` holds 16 f32.
        unsafe { _mm512_loadu_ps(values.as_ptr()) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8(&self, row: usize, k: usize) -> __m256 {
        let values: [f32; 8] = self.run(row, k);
        // SAFETY: `values` holds 8 f32.
        unsafe { _mm256_loadu_ps(values.as_ptr()) }
    }
}

/// A ggml block type with a SIMD load of 8 elements.
pub(crate) trait SimdBlock: Sync {
    /// The type.
    const TYPE: GgmlType;
    /// Elements per block.
    const ELEMENTS: usize = Self::TYPE.block().elements;
    /// Bytes per block.
    const BYTES: usize = Self::TYPE.block().bytes;
    /// Elements `e .. e + 8` of the block at `block`, dequantized.
    ///
    /// # Safety
    /// AVX2 and FMA are available, `block` points at `Self::BYTES` readable bytes,
    /// `e % 8 == 0` and `e + 8 <= Self::ELEMENTS`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(block: *const u8, e: usize) -> __m256;
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
    fp16_to_f32(u16::from_le(bits))
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

/// `i32` lanes to f32, times `scale`, less `min` (two roundings: the scalar
/// `d * q - min` of the K types).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn scaled_less_min(q: __m256i, scale: f32, min: f32) -> __m256 {
    _mm256_sub_ps(scaled(q, scale), _mm256_set1_ps(min))
}

/// Q8_0: `x = q d`.
pub(crate) struct Q8_0Block;

impl SimdBlock for Q8_0Block {
    const TYPE: GgmlType = GgmlType::Q8_0;
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
pub(crate) struct Q4_0Block;

impl SimdBlock for Q4_0Block {
    const TYPE: GgmlType = GgmlType::Q4_0;
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
pub(crate) struct Q4KBlock;

impl SimdBlock for Q4KBlock {
    const TYPE: GgmlType = GgmlType::Q4_K;
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
pub(crate) struct Q5KBlock;

impl SimdBlock for Q5KBlock {
    const TYPE: GgmlType = GgmlType::Q5_K;
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
pub(crate) struct Q6KBlock;

impl SimdBlock for Q6KBlock {
    const TYPE: GgmlType = GgmlType::Q6_K;
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
pub(crate) struct Iq4XsBlock;

impl SimdBlock for Iq4XsBlock {
    const TYPE: GgmlType = GgmlType::IQ4_XS;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(block: *const u8, e: usize) -> __m256 {
        let (ib, j) = (e / 32, e % 32);
        // SAFETY: the 136-byte block is readable and e + 8 <= 256 (caller).
        unsafe {
            let scales_h = u16::from_le(block.add(2).cast::<u16>().read_unaligned());
            let ls = i32::from((*block.add(4 + ib / 2) >> (4 * (ib % 2))) & 0xF)
                | (i32::from((scales_h >> (2 * ib)) & 3) << 4);
            let dl = f16_at(block, 0) * (ls - 32) as f32;
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

/// A ggml weight of a [`SimdBlock`] type: blocks one after another, `row_bytes` per
/// row.
pub(crate) struct BlockRows<'a, B: SimdBlock> {
    data: &'a [u8],
    rows: usize,
    cols: usize,
    row_bytes: usize,
    format: PhantomData<B>,
}

impl<'a, B: SimdBlock> BlockRows<'a, B> {
    /// Borrows a weight of type `B::TYPE` whose lengths were checked
    /// (`weight::check_runnable`).
    pub(crate) fn new(w: &'a GgmlWeight) -> Self {
        debug_assert_eq!(w.ggml_type, B::TYPE);
        Self {
            data: &w.data,
            rows: w.out_features,
            cols: w.in_features,
            row_bytes: w.row_bytes(),
            format: PhantomData,
        }
    }

    /// Byte offset of the block holding element `(row, k)`.
    #[inline(always)]
    fn block_start(&self, row: usize, k: usize) -> usize {
        row * self.row_bytes + k / B::ELEMENTS * B::BYTES
    }
}

impl<B: SimdBlock> RowDecode for BlockRows<'_, B> {
    #[inline(always)]
    fn code_address(&self, row: usize, k: usize) -> *const u8 {
        self.data.as_ptr().wrapping_add(self.block_start(row, k))
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn get(&self, row: usize, k: usize) -> f32 {
        let start = self.block_start(row, k);
        block_element(
            B::TYPE,
            &self.data[start..start + B::BYTES],
            k % B::ELEMENTS,
        )
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn load16(&self, row: usize, k: usize) -> __m512 {
        // Every block holds a multiple of 16 elements, so a run of 16 from k % 16 == 0
        // is two runs of 8 in one block.
        // SAFETY: row < rows and k + 16 <= cols (trait contract): the block is in
        // bounds; AVX-512F implies AVX2 and FMA.
        unsafe {
            let block = self.data.as_ptr().add(self.block_start(row, k));
            let e = k % B::ELEMENTS;
            let lo = _mm256_castps_pd(B::load8(block, e));
            let hi = _mm256_castps_pd(B::load8(block, e + 8));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(lo), hi))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load8(&self, row: usize, k: usize) -> __m256 {
        // SAFETY: row < rows and k + 8 <= cols with k % 8 == 0 (trait contract): the
        // block is in bounds and the run inside it.
        unsafe {
            let block = self.data.as_ptr().add(self.block_start(row, k));
            B::load8(block, k % B::ELEMENTS)
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
            let d = BlockRows::<B>::new(&weight);
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
}
