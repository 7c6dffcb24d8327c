//! Row decoder of the ggml block types (GGUF bases, `QuantizedWeight::Ggml`): every
//! load dequantizes its run of elements in the loop, each element by
//! `loraq_quant::ggml::block_element` (the value the whole-row decode gives it), so
//! the fused linears read the stored blocks once and never a dequantized copy.
//!
//! The decode is scalar per element (the K types' packed scales and split bit planes
//! have no SIMD decoder here); the dot products around it are the generic GEMV / GEMM
//! loops' SIMD.

use super::decode::RowDecode;
use loraq_quant::ggml::{BlockGeometry, GgmlType, GgmlWeight, block_element};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// A ggml weight's rows: blocks one after another, `row_bytes` per row.
pub(crate) struct GgmlRows<'a> {
    data: &'a [u8],
    ggml_type: GgmlType,
    block: BlockGeometry,
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

impl<'a> GgmlRows<'a> {
    /// Borrows a weight whose lengths were checked (`weight::validate`).
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
