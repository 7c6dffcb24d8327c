//! Prefill-shaped products (many tokens): output columns are processed in blocks of
//! `nr` rows of the weight; for every [`PANEL_K`]-wide span of the reduction dimension
//! the block's weights are dequantized once into a per-thread panel (`PANEL_K x nr`
//! f32 at most, 256 KiB at `nr` = 32: L2-resident, never the whole matrix), in
//! [`KC`]-wide pieces, and reused by every token of a [`GEMM_TOKEN_TILE`] through a
//! register-blocked micro-kernel (`mr` tokens x `nr` outputs of accumulators) that runs
//! the whole span without leaving registers.
//!
//! A product may have several reduction segments, each with its own weight and
//! activation: the fused LoRA linear runs `[x_q | s * (A x)] * [W | B]^T`, so the LoRA
//! expand is accumulated into the same output tile, in registers, before it is written.

use super::decode::RowDecode;
use super::{Isa, Parallelism};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Reduction slice decoded in one piece (the span decoders' scratch block holds 16
/// rows of it).
pub(crate) const KC: usize = 128;

/// Reduction span of one panel, a multiple of [`KC`]: the micro-kernel runs a whole
/// span with its accumulators in registers, and a reduction of up to this many inputs
/// (every linear of the demo model and most of a 27B model's) is one span. With spans
/// of [`KC`] the accumulators went through `y` every 128 inputs: a store, a reload and
/// the loop's ramp per 2048 FMAs, which held the 512-token prefill's GEMM at 78-87% of
/// the FMA peak on Zen 4 (92-98% in whole-K runs of the same loop in a C model of it;
/// benches/cpu_gemm.rs measures both). The panel (256 KiB at `nr` = 32) stays in L2.
pub(crate) const PANEL_K: usize = 2048;

/// Tokens per micro-kernel call and outputs per block for an ISA.
pub(crate) fn tile_shape(isa: Isa) -> (usize, usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => (8, 32),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => (6, 16),
        Isa::Scalar => (4, 8),
    }
}

/// One reduction segment: `weight` (`[out, k]`) against `x` (`[n_padded, k]` with row
/// stride `x_stride`).
pub(crate) struct Segment<'a, D: RowDecode> {
    pub weight: &'a D,
    /// `weight` already decoded into panels ([`pack_panels`] for this ISA), read in
    /// place of decoding a panel per block and token tile; `None` decodes them.
    pub packed: Option<&'a [f32]>,
    pub x: &'a [f32],
    pub x_stride: usize,
}

/// Dequantizes `W[row, k0 .. k0 + out.len()]` into `out`.
pub(crate) fn decode_segment<D: RowDecode>(
    isa: Isa,
    d: &D,
    row: usize,
    k0: usize,
    out: &mut [f32],
) {
    let end = k0 + out.len();
    assert!(row < d.rows() && end <= d.cols());
    let k = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: detected ISA; bounds asserted above.
        Isa::Avx512 if k0.is_multiple_of(16) => unsafe { decode_avx512(d, row, k0, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 if k0.is_multiple_of(8) => unsafe { decode_avx2(d, row, k0, out) },
        _ => k0,
    };
    for (o, kk) in out[k - k0..].iter_mut().zip(k..end) {
        *o = d.get(row, kk);
    }
}

/// The whole 16-wide steps of [`decode_segment`]; returns where they stopped. Compiled
/// for AVX-512 so the decoder's `load16` and the store inline into the loop (called
/// from a function without the feature, each was an out-of-line call: a third of the
/// time of a 20-token prefill).
///
/// # Safety
/// The CPU has AVX-512F/BW; `k0 % 16 == 0`; `row` and `k0 .. k0 + out.len()` in range.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn decode_avx512<D: RowDecode>(d: &D, row: usize, k0: usize, out: &mut [f32]) -> usize {
    let end = k0 + out.len();
    let mut k = k0;
    if D::SPAN > 0 && k0.is_multiple_of(D::SPAN) {
        // Whole spans first, their scales unpacked once per span (a multiple of 16, so
        // the 16-lane steps below stay aligned).
        let len = out.len() / D::SPAN * D::SPAN;
        if len > 0 {
            // SAFETY: SPAN > 0, k0 and len multiples of it, k0 + len <= cols (caller);
            // out holds len values.
            unsafe { d.decode_span512(row, k0, len, out.as_mut_ptr()) };
            k += len;
        }
    }
    while k + 16 <= end {
        // SAFETY: k % 16 == 0 and k + 16 <= cols (caller).
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(k - k0), d.load16(row, k)) };
        k += 16;
    }
    k
}

/// [`decode_avx512`] for AVX2 (8-wide steps).
///
/// # Safety
/// The CPU has AVX2 and FMA; `k0 % 8 == 0`; `row` and `k0 .. k0 + out.len()` in range.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn decode_avx2<D: RowDecode>(d: &D, row: usize, k0: usize, out: &mut [f32]) -> usize {
    let end = k0 + out.len();
    let mut k = k0;
    if D::SPAN > 0 && k0.is_multiple_of(D::SPAN) {
        let len = out.len() / D::SPAN * D::SPAN;
        if len > 0 {
            // SAFETY: as in decode_avx512.
            unsafe { d.decode_span256(row, k0, len, out.as_mut_ptr()) };
            k += len;
        }
    }
    while k + 8 <= end {
        // SAFETY: k % 8 == 0 and k + 8 <= cols (caller).
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(k - k0), d.load8(row, k)) };
        k += 8;
    }
    k
}

/// `y_block[t * nr + j] = sum over segments of sum_k W_s[o0 + j, k] x_s[t, k]` for
/// `t < n_padded`, `j < nrows` (`nrows <= nr`, columns `j >= nrows` are left zero).
/// `n_padded` must be a multiple of the ISA's `mr`; padded activation rows are zero.
pub(crate) fn gemm_block<D1: RowDecode, D2: RowDecode>(
    isa: Isa,
    o0: usize,
    nrows: usize,
    n_padded: usize,
    first: &Segment<'_, D1>,
    second: Option<&Segment<'_, D2>>,
    y_block: &mut [f32],
) {
    let (_, nr) = tile_shape(isa);
    assert!(nrows <= nr);
    assert_eq!(y_block.len(), n_padded * nr);
    // SAFETY: y_block holds n_padded rows of nr values, borrowed mutably.
    unsafe {
        gemm_tile(
            isa,
            o0,
            nrows,
            n_padded,
            first,
            second,
            y_block.as_mut_ptr(),
            nr,
        )
    }
}

/// [`gemm_block`] into rows of `ldy` values: `y[t * ldy + j]` for `t < n_padded`, `j <
/// nr` (all `nr` columns are written; those `>= nrows` get zero). The first reduction
/// slice starts the accumulators from zero, so `y` need not be cleared.
///
/// # Safety
/// `y[t * ldy + j]` for `t < n_padded`, `j < nr` is valid for writes and no other
/// live reference covers it.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_tile<D1: RowDecode, D2: RowDecode>(
    isa: Isa,
    o0: usize,
    nrows: usize,
    n_padded: usize,
    first: &Segment<'_, D1>,
    second: Option<&Segment<'_, D2>>,
    y: *mut f32,
    ldy: usize,
) {
    let (mr, nr) = tile_shape(isa);
    assert!(nrows <= nr && n_padded.is_multiple_of(mr) && ldy >= nr);
    let out = OutTile { ptr: y, ld: ldy };
    if first.weight.cols() == 0 {
        // No reduction slice to start the accumulators from zero.
        for t in 0..n_padded {
            // SAFETY: row t's nr values are valid (caller).
            unsafe { std::slice::from_raw_parts_mut(y.add(t * ldy), nr) }.fill(0.0);
        }
    }
    // One panel per worker thread, reused by every block it computes (run_segment
    // writes every entry the micro-kernel reads, so no clearing between blocks).
    thread_local! {
        static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    PANEL.with_borrow_mut(|panel| {
        panel.resize(PANEL_K * nr, 0.0);
        let panel = &mut panel[..PANEL_K * nr];
        // SAFETY: `out` as the caller guarantees.
        unsafe {
            run_segment(isa, o0, nrows, n_padded, first, true, panel, out);
            if let Some(s) = second.filter(|s| s.weight.cols() > 0) {
                run_segment(isa, o0, nrows, n_padded, s, false, panel, out);
            }
        }
    });
}

/// Where a micro-kernel's output tile goes: row `t` at `ptr + t * ld`.
#[derive(Clone, Copy)]
struct OutTile {
    ptr: *mut f32,
    ld: usize,
}

/// Accumulates one segment into `out`; with `fresh`, its first reduction slice starts
/// from zero instead of `out`'s values.
///
/// # Safety
/// As [`gemm_tile`]'s `y`.
#[allow(clippy::too_many_arguments)]
unsafe fn run_segment<D: RowDecode>(
    isa: Isa,
    o0: usize,
    nrows: usize,
    n_padded: usize,
    seg: &Segment<'_, D>,
    fresh: bool,
    panel: &mut [f32],
    out: OutTile,
) {
    let (mr, nr) = tile_shape(isa);
    let k_total = seg.weight.cols();
    assert!(n_padded == 0 || (n_padded - 1) * seg.x_stride + k_total <= seg.x.len());
    assert_eq!(panel.len(), PANEL_K * nr);
    // The block's packed panels: `k_total * nr` values from `o0 * k_total`.
    let packed = seg.packed.map(|all| {
        assert!(o0.is_multiple_of(nr));
        &all[o0 * k_total..][..k_total * nr]
    });
    let mut k0 = 0;
    while k0 < k_total {
        let span = PANEL_K.min(k_total - k0);
        let load = !(fresh && k0 == 0);
        // Transposed panel: panel[kk * nr + j] = W[o0 + j, k0 + kk], packed KC at a time
        // (or read where pack_panels put it).
        let panel: &[f32] = match packed {
            Some(block) => &block[k0 * nr..(k0 + span) * nr],
            None => {
                let mut p0 = 0;
                while p0 < span {
                    let kc = KC.min(span - p0);
                    pack_piece(
                        isa,
                        seg.weight,
                        o0,
                        nrows,
                        k0 + p0,
                        &mut panel[p0 * nr..(p0 + kc) * nr],
                    );
                    p0 += kc;
                }
                &panel[..span * nr]
            }
        };
        let mut t0 = 0;
        while t0 < n_padded {
            let x_tile = &seg.x[t0 * seg.x_stride + k0..];
            // Rows t0 .. t0 + mr of `out` are valid (caller).
            let y_tile = OutTile {
                ptr: out.ptr.wrapping_add(t0 * out.ld),
                ld: out.ld,
            };
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: detected ISA; x_tile holds mr rows of span elements (asserted
                // above), panel span * nr, y_tile mr rows of nr.
                Isa::Avx512 => unsafe {
                    micro_avx512(span, panel, x_tile, seg.x_stride, y_tile, load)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Isa::Avx2 => unsafe { micro_avx2(span, panel, x_tile, seg.x_stride, y_tile, load) },
                // SAFETY: as above.
                Isa::Scalar => unsafe {
                    micro_scalar(span, panel, x_tile, seg.x_stride, y_tile, load)
                },
            }
            t0 += mr;
        }
        k0 += span;
    }
}

/// Fills `piece[kk * nr + j] = W[o0 + j, k0 + kk]` for `kk < piece.len() / nr <= KC`,
/// `j < nrows`, and zero for `nrows <= j < nr`: the SIMD transposes where a whole
/// block and an aligned `k0` allow, rows decoded one by one otherwise.
fn pack_piece<D: RowDecode>(
    isa: Isa,
    weight: &D,
    o0: usize,
    nrows: usize,
    k0: usize,
    piece: &mut [f32],
) {
    let (_, nr) = tile_shape(isa);
    let kc = piece.len() / nr;
    assert!(kc <= KC && nrows <= nr && o0 + nrows <= weight.rows() && k0 + kc <= weight.cols());
    let packed = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if nrows == nr && k0.is_multiple_of(16) => {
            // SAFETY: detected ISA; rows o0 .. o0 + 32 and inputs k0 .. k0 + kc exist
            // (asserted); the piece holds kc * 32 values.
            unsafe { pack_panel_avx512(weight, o0, k0, kc, piece) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if nrows == nr && k0.is_multiple_of(8) => {
            // SAFETY: detected ISA; rows o0 .. o0 + 16 and inputs k0 .. k0 + kc exist.
            unsafe { pack_panel_avx2(weight, o0, k0, kc, piece) }
        }
        _ => 0,
    };
    if packed < kc {
        if packed == 0 {
            piece.fill(0.0);
        }
        let mut row_buf = [0f32; KC];
        for j in 0..nrows {
            decode_segment(
                isa,
                weight,
                o0 + j,
                k0 + packed,
                &mut row_buf[..kc - packed],
            );
            for (kk, &v) in row_buf[..kc - packed].iter().enumerate() {
                piece[(packed + kk) * nr + j] = v;
            }
        }
    }
}

/// `weight` decoded once into the panels [`run_segment`] multiplies, every block's:
/// block `b` (rows `b * nr ..`) at `[b * nr * cols ..][.. cols * nr]`, `panel[kk * nr +
/// j] = W[b * nr + j, kk]`, zero past the last row; the same values [`pack_piece`]
/// writes per tile, so a product on them has the same bits. `rows.div_ceil(nr) * nr *
/// cols` values ([`packed_panels_len`]). The blocks are decoded in parallel.
pub(crate) fn pack_panels<D: RowDecode>(isa: Isa, par: Parallelism, weight: &D) -> Vec<f32> {
    let (_, nr) = tile_shape(isa);
    let (rows, cols) = (weight.rows(), weight.cols());
    let mut out = vec![0f32; rows.div_ceil(nr) * nr * cols];
    if cols == 0 {
        return out;
    }
    let block = |(b, panels): (usize, &mut [f32])| {
        let o0 = b * nr;
        let nrows = nr.min(rows - o0);
        let mut k0 = 0;
        while k0 < cols {
            let kc = KC.min(cols - k0);
            pack_piece(
                isa,
                weight,
                o0,
                nrows,
                k0,
                &mut panels[k0 * nr..(k0 + kc) * nr],
            );
            k0 += kc;
        }
    };
    match par {
        Parallelism::Sequential => out.chunks_mut(nr * cols).enumerate().for_each(block),
        Parallelism::Rayon => out.par_chunks_mut(nr * cols).enumerate().for_each(block),
    }
    out
}

/// Values [`pack_panels`] returns for a `rows x cols` weight on `isa`; `None` on
/// overflow.
pub(crate) fn packed_panels_len(isa: Isa, rows: usize, cols: usize) -> Option<usize> {
    let (_, nr) = tile_shape(isa);
    rows.div_ceil(nr).checked_mul(nr)?.checked_mul(cols)
}

/// Tokens per tile of [`gemm_rows`], a multiple of every ISA's `mr` (8, 6, 4): a block's
/// panels are decoded once per tile, so the decode costs 1 / `GEMM_TOKEN_TILE` of the
/// multiply-adds per weight (at 192 tokens, `pack_panel_avx512` was 5.7% of a 512-token
/// prefill's samples). The tile's activations (768 tokens x 512-1536 inputs, 1.5-4.5
/// MiB) are read from L3 once per block: 8 strided rows per micro-kernel call, a few
/// bytes per cycle, which the prefetchers keep up with.
pub(crate) const GEMM_TOKEN_TILE: usize = 768;

/// `y`'s base pointer, shared by the parallel tasks of [`gemm_rows`], each of which
/// writes its own disjoint rectangle of `y`.
#[derive(Clone, Copy)]
struct SharedOutput {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the tasks that share it write disjoint elements (gemm_rows' tiling), and the
// buffer outlives them (borrowed mutably for the whole parallel loop).
unsafe impl Send for SharedOutput {}
// SAFETY: as above.
unsafe impl Sync for SharedOutput {}

impl SharedOutput {
    /// A pointer to `y[start]`, after checking that `y[start .. start + span]` exists.
    fn pointer(&self, start: usize, span: usize) -> *mut f32 {
        assert!(start.checked_add(span).is_some_and(|end| end <= self.len));
        self.ptr.wrapping_add(start)
    }

    /// `y[start .. start + len]`.
    ///
    /// # Safety
    /// No other live reference covers those elements.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range_mut(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start.checked_add(len).is_some_and(|end| end <= self.len));
        // SAFETY: in bounds (asserted); exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

/// The tiled product written straight into `y` (`[rows, out_rows]` row-major, `rows =
/// y.len() / out_rows <= n_padded`): every (tile of [`GEMM_TOKEN_TILE`] tokens, block
/// of `nr` outputs) pair is one parallel task, which computes its tokens x outputs in
/// a per-thread block and copies the real rows into its rectangle of `y` itself (no
/// serial copy-out after the parallel loop, no per-task allocation).
pub(crate) fn gemm_rows<D1: RowDecode, D2: RowDecode>(
    isa: Isa,
    par: Parallelism,
    n_padded: usize,
    first: &Segment<'_, D1>,
    second: Option<&Segment<'_, D2>>,
    y: &mut [f32],
) {
    let (_, nr) = tile_shape(isa);
    let out_rows = first.weight.rows();
    if out_rows == 0 || n_padded == 0 {
        return;
    }
    let rows = y.len() / out_rows;
    assert!(rows <= n_padded && y.len() == rows * out_rows);
    let blocks = out_rows.div_ceil(nr);
    let tiles = n_padded.div_ceil(GEMM_TOKEN_TILE);
    let shared = SharedOutput {
        ptr: y.as_mut_ptr(),
        len: y.len(),
    };
    thread_local! {
        static BLOCK: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let task = |index: usize| {
        let (tile, bi) = (index / blocks, index % blocks);
        let t0 = tile * GEMM_TOKEN_TILE;
        let tile_padded = GEMM_TOKEN_TILE.min(n_padded - t0);
        let o0 = bi * nr;
        let nrows = nr.min(out_rows - o0);
        let first = Segment {
            weight: first.weight,
            packed: first.packed,
            x: &first.x[t0 * first.x_stride..],
            x_stride: first.x_stride,
        };
        let second = second.map(|s| Segment {
            weight: s.weight,
            packed: s.packed,
            x: &s.x[t0 * s.x_stride..],
            x_stride: s.x_stride,
        });
        let real = rows.saturating_sub(t0).min(tile_padded);
        if nrows == nr && real == tile_padded {
            // A whole tile: the micro-kernels write y in place.
            let y_tile = shared.pointer(t0 * out_rows + o0, (tile_padded - 1) * out_rows + nr);
            // SAFETY: this task is the only writer of rows t0 .. t0 + tile_padded,
            // columns o0 .. o0 + nr, all inside y (real rows, nrows == nr; bounds
            // checked by `pointer`); no reference to them is live.
            unsafe {
                gemm_tile(
                    isa,
                    o0,
                    nrows,
                    tile_padded,
                    &first,
                    second.as_ref(),
                    y_tile,
                    out_rows,
                );
            }
            return;
        }
        BLOCK.with_borrow_mut(|block| {
            block.resize(tile_padded * nr, 0.0);
            let y_block = &mut block[..tile_padded * nr];
            gemm_block(
                isa,
                o0,
                nrows,
                tile_padded,
                &first,
                second.as_ref(),
                y_block,
            );
            for (t, block_row) in y_block.chunks_exact(nr).take(real).enumerate() {
                // SAFETY: this task is the only writer of rows t0 .. t0 + real, columns
                // o0 .. o0 + nrows, and `y` is borrowed mutably for the whole loop.
                let dst = unsafe { shared.range_mut((t0 + t) * out_rows + o0, nrows) };
                dst.copy_from_slice(&block_row[..nrows]);
            }
        });
    };
    match par {
        Parallelism::Sequential => (0..tiles * blocks).for_each(task),
        Parallelism::Rayon => (0..tiles * blocks).into_par_iter().for_each(task),
    }
}

/// Fills `panel[kk * 32 + j] = W[o0 + j, k0 + kk]` for the 32 rows of a full AVX-512
/// block and `kk` below the largest multiple of 16 within `kc`, 16 x 16 at a time: 16
/// rows decoded into registers and transposed there (unpack, 64-bit unpack, two 128-bit
/// shuffles), instead of 256 scattered scalar stores. Returns how many inputs it packed.
///
/// # Safety
/// The CPU has AVX-512F/BW; rows `o0 .. o0 + 32` and inputs `k0 .. k0 + kc` exist;
/// `k0 % 16 == 0`; `panel` holds `kc * 32` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_panel_avx512<D: RowDecode>(
    d: &D,
    o0: usize,
    k0: usize,
    kc: usize,
    panel: &mut [f32],
) -> usize {
    const NR: usize = 32;
    debug_assert!(panel.len() >= kc * NR);
    let pp = panel.as_mut_ptr();
    if D::SPAN > 0 && k0.is_multiple_of(D::SPAN) && kc >= D::SPAN {
        // SAFETY: forwarded contract.
        return unsafe { pack_spans_avx512(d, o0, k0, kc / D::SPAN * D::SPAN, pp) };
    }
    let whole = kc / 16 * 16;
    for group in 0..NR / 16 {
        let mut kk0 = 0;
        while kk0 < whole {
            // SAFETY: rows and inputs in range (caller); stores within kc * 32.
            unsafe {
                let v: [__m512; 16] =
                    std::array::from_fn(|r| d.load16(o0 + 16 * group + r, k0 + kk0));
                let t = transpose16(v);
                for (c, col) in t.iter().enumerate() {
                    _mm512_storeu_ps(pp.add((kk0 + c) * NR + 16 * group), *col);
                }
            }
            kk0 += 16;
        }
    }
    whole
}

/// [`pack_panel_avx512`] of a format with span decoders, for inputs `k0 .. k0 + len`
/// (whole spans): 16 rows at a time decoded by [`RowDecode::decode_span512`] into a
/// row-major scratch block (8 KiB, in L1), each span's scales unpacked once, then
/// transposed 16 x 16 from there. The 16-lane loads would unpack a K-quant group's
/// scale and minimum again for every 16 inputs (in Q4_K's case, a scalar unpacking of
/// the packed 6-bit fields that cost more than the decode itself). Returns `len`.
///
/// # Safety
/// As [`pack_panel_avx512`]; `D::SPAN > 0`, `k0` and `len` are multiples of it and
/// `len <= kc`; `pp` points at the panel.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_spans_avx512<D: RowDecode>(
    d: &D,
    o0: usize,
    k0: usize,
    len: usize,
    pp: *mut f32,
) -> usize {
    const NR: usize = 32;
    debug_assert!(len <= KC && len.is_multiple_of(16));
    let mut rows = std::mem::MaybeUninit::<[f32; 16 * KC]>::uninit();
    let buf = rows.as_mut_ptr().cast::<f32>();
    for group in 0..NR / 16 {
        // SAFETY: rows o0 .. o0 + 32 and inputs k0 .. k0 + len exist, spans aligned
        // (caller); row r of the scratch block is buf[r * KC .. r * KC + len], written
        // before the loads below read it; stores within the panel's kc * 32.
        unsafe {
            for r in 0..16 {
                d.decode_span512(o0 + 16 * group + r, k0, len, buf.add(r * KC));
            }
            let mut kk0 = 0;
            while kk0 < len {
                let v: [__m512; 16] =
                    std::array::from_fn(|r| _mm512_loadu_ps(buf.add(r * KC + kk0)));
                let t = transpose16(v);
                for (c, col) in t.iter().enumerate() {
                    _mm512_storeu_ps(pp.add((kk0 + c) * NR + 16 * group), *col);
                }
                kk0 += 16;
            }
        }
    }
    len
}

/// The transpose of a 16 x 16 f32 matrix held as 16 row vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose16(v: [__m512; 16]) -> [__m512; 16] {
    // Rows 2i, 2i + 1 interleaved: lane L of a[2i] holds (r2i k4L, r2i+1 k4L, r2i k4L+1,
    // r2i+1 k4L+1), a[2i + 1] the same for k4L+2, k4L+3.
    let mut a = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        a[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    // Lane L of b[4i + m]: column 4L + m of rows 4i .. 4i + 3.
    let mut b = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        let pd = |x: __m512| _mm512_castps_pd(x);
        let (a0, a1, a2, a3) = (
            pd(a[4 * i]),
            pd(a[4 * i + 1]),
            pd(a[4 * i + 2]),
            pd(a[4 * i + 3]),
        );
        b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
        b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
        b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
        b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
    }
    // Gather lane L of b[m], b[4 + m], b[8 + m], b[12 + m]: column 4L + m, all 16 rows.
    let mut t = [_mm512_setzero_ps(); 16];
    for m in 0..4 {
        let even_lo = _mm512_shuffle_f32x4::<0x88>(b[m], b[4 + m]);
        let odd_lo = _mm512_shuffle_f32x4::<0xDD>(b[m], b[4 + m]);
        let even_hi = _mm512_shuffle_f32x4::<0x88>(b[8 + m], b[12 + m]);
        let odd_hi = _mm512_shuffle_f32x4::<0xDD>(b[8 + m], b[12 + m]);
        t[m] = _mm512_shuffle_f32x4::<0x88>(even_lo, even_hi);
        t[8 + m] = _mm512_shuffle_f32x4::<0xDD>(even_lo, even_hi);
        t[4 + m] = _mm512_shuffle_f32x4::<0x88>(odd_lo, odd_hi);
        t[12 + m] = _mm512_shuffle_f32x4::<0xDD>(odd_lo, odd_hi);
    }
    t
}

/// [`pack_panel_avx512`] for the 16-row AVX2 blocks, 8 x 8 at a time.
///
/// # Safety
/// The CPU has AVX2 and FMA; rows `o0 .. o0 + 16` and inputs `k0 .. k0 + kc` exist;
/// `k0 % 8 == 0`; `panel` holds `kc * 16` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_panel_avx2<D: RowDecode>(
    d: &D,
    o0: usize,
    k0: usize,
    kc: usize,
    panel: &mut [f32],
) -> usize {
    const NR: usize = 16;
    debug_assert!(panel.len() >= kc * NR);
    let pp = panel.as_mut_ptr();
    if D::SPAN > 0 && k0.is_multiple_of(D::SPAN) && kc >= D::SPAN {
        // SAFETY: forwarded contract.
        return unsafe { pack_spans_avx2(d, o0, k0, kc / D::SPAN * D::SPAN, pp) };
    }
    let whole = kc / 8 * 8;
    for group in 0..NR / 8 {
        let mut kk0 = 0;
        while kk0 < whole {
            // SAFETY: rows and inputs in range (caller); stores within kc * 16.
            unsafe {
                let v: [__m256; 8] = std::array::from_fn(|r| d.load8(o0 + 8 * group + r, k0 + kk0));
                let t = transpose8(v);
                for (c, col) in t.iter().enumerate() {
                    _mm256_storeu_ps(pp.add((kk0 + c) * NR + 8 * group), *col);
                }
            }
            kk0 += 8;
        }
    }
    whole
}

/// [`pack_spans_avx512`] for the 16-row AVX2 blocks: 8 rows at a time by
/// [`RowDecode::decode_span256`], transposed 8 x 8.
///
/// # Safety
/// As [`pack_panel_avx2`]; `D::SPAN > 0`, `k0` and `len` are multiples of it and
/// `len <= kc`; `pp` points at the panel.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_spans_avx2<D: RowDecode>(
    d: &D,
    o0: usize,
    k0: usize,
    len: usize,
    pp: *mut f32,
) -> usize {
    const NR: usize = 16;
    debug_assert!(len <= KC && len.is_multiple_of(8));
    let mut rows = std::mem::MaybeUninit::<[f32; 8 * KC]>::uninit();
    let buf = rows.as_mut_ptr().cast::<f32>();
    for group in 0..NR / 8 {
        // SAFETY: as in pack_spans_avx512, 8 rows of the scratch block per group.
        unsafe {
            for r in 0..8 {
                d.decode_span256(o0 + 8 * group + r, k0, len, buf.add(r * KC));
            }
            let mut kk0 = 0;
            while kk0 < len {
                let v: [__m256; 8] =
                    std::array::from_fn(|r| _mm256_loadu_ps(buf.add(r * KC + kk0)));
                let t = transpose8(v);
                for (c, col) in t.iter().enumerate() {
                    _mm256_storeu_ps(pp.add((kk0 + c) * NR + 8 * group), *col);
                }
                kk0 += 8;
            }
        }
    }
    len
}

/// The transpose of an 8 x 8 f32 matrix held as 8 row vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn transpose8(v: [__m256; 8]) -> [__m256; 8] {
    // As transpose16 within each 128-bit half, then the halves exchanged.
    let mut a = [_mm256_setzero_ps(); 8];
    for i in 0..4 {
        a[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    // Half H of b[4i + m]: column 4H + m of rows 4i .. 4i + 3.
    let mut b = [_mm256_setzero_ps(); 8];
    for i in 0..2 {
        let pd = |x: __m256| _mm256_castps_pd(x);
        let (a0, a1, a2, a3) = (
            pd(a[4 * i]),
            pd(a[4 * i + 1]),
            pd(a[4 * i + 2]),
            pd(a[4 * i + 3]),
        );
        b[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a0, a2));
        b[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a0, a2));
        b[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(a1, a3));
        b[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(a1, a3));
    }
    let mut t = [_mm256_setzero_ps(); 8];
    for m in 0..4 {
        t[m] = _mm256_permute2f128_ps::<0x20>(b[m], b[4 + m]);
        t[4 + m] = _mm256_permute2f128_ps::<0x31>(b[m], b[4 + m]);
    }
    t
}

/// The micro-kernels: `y[t * ld + j] (+)= sum_kk x[t * x_stride + kk] panel[kk * NR + j]`
/// for `t < MR`, `j < NR`, starting from `y` when `load`, from zero otherwise.
///
/// # Safety
/// `y`'s `MR` rows of `NR` values are valid for reads and writes; `x` holds `MR` rows
/// of `kc` values at `x_stride`; `panel` `kc * NR` values.
unsafe fn micro_scalar(
    kc: usize,
    panel: &[f32],
    x: &[f32],
    x_stride: usize,
    y: OutTile,
    load: bool,
) {
    const MR: usize = 4;
    const NR: usize = 8;
    let mut acc = [[0f32; NR]; MR];
    if load {
        for (t, acc_t) in acc.iter_mut().enumerate() {
            // SAFETY: row t of y (caller).
            acc_t.copy_from_slice(unsafe { std::slice::from_raw_parts(y.ptr.add(t * y.ld), NR) });
        }
    }
    for kk in 0..kc {
        let w = &panel[kk * NR..(kk + 1) * NR];
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let xv = x[t * x_stride + kk];
            for (a, &wv) in acc_t.iter_mut().zip(w) {
                *a += xv * wv;
            }
        }
    }
    for (t, acc_t) in acc.iter().enumerate() {
        // SAFETY: row t of y (caller).
        unsafe { std::slice::from_raw_parts_mut(y.ptr.add(t * y.ld), NR) }.copy_from_slice(acc_t);
    }
}

/// [`micro_scalar`] for AVX-512, 8 x 32.
///
/// # Safety
/// As [`micro_scalar`], and the CPU has AVX-512F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn micro_avx512(
    kc: usize,
    panel: &[f32],
    x: &[f32],
    x_stride: usize,
    y: OutTile,
    load: bool,
) {
    const MR: usize = 8;
    const NR: usize = 32;
    debug_assert!(panel.len() >= kc * NR && y.ld >= NR);
    debug_assert!(x.len() >= (MR - 1) * x_stride + kc);
    let (pp, xp, yp, ld) = (panel.as_ptr(), x.as_ptr(), y.ptr, y.ld);
    // SAFETY: all pointer arithmetic below: bounds asserted by the caller and above.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        if load {
            for (t, a) in acc.iter_mut().enumerate() {
                a[0] = _mm512_loadu_ps(yp.add(t * ld));
                a[1] = _mm512_loadu_ps(yp.add(t * ld + 16));
            }
        }
        for kk in 0..kc {
            let w0 = _mm512_loadu_ps(pp.add(kk * NR));
            let w1 = _mm512_loadu_ps(pp.add(kk * NR + 16));
            for (t, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*xp.add(t * x_stride + kk));
                a[0] = _mm512_fmadd_ps(xv, w0, a[0]);
                a[1] = _mm512_fmadd_ps(xv, w1, a[1]);
            }
        }
        for (t, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(yp.add(t * ld), a[0]);
            _mm512_storeu_ps(yp.add(t * ld + 16), a[1]);
        }
    }
}

/// [`micro_scalar`] for AVX2, 6 x 16.
///
/// # Safety
/// As [`micro_scalar`], and the CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_avx2(kc: usize, panel: &[f32], x: &[f32], x_stride: usize, y: OutTile, load: bool) {
    const MR: usize = 6;
    const NR: usize = 16;
    debug_assert!(panel.len() >= kc * NR && y.ld >= NR);
    debug_assert!(x.len() >= (MR - 1) * x_stride + kc);
    let (pp, xp, yp, ld) = (panel.as_ptr(), x.as_ptr(), y.ptr, y.ld);
    // SAFETY: all pointer arithmetic below: bounds asserted by the caller and above.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        if load {
            for (t, a) in acc.iter_mut().enumerate() {
                a[0] = _mm256_loadu_ps(yp.add(t * ld));
                a[1] = _mm256_loadu_ps(yp.add(t * ld + 8));
            }
        }
        // The reduction four steps per loop trip, each token's row through its own
        // pointer: the plain loop recomputed `t * x_stride + kk` and paid a loop
        // trip per 12 FMAs, and ran 5-7% slower on a Zen 4 without AVX-512
        // (docs/kernels.md, "The AVX2 prefill GEMM"). Every accumulator still takes
        // its FMAs in the order of kk, so the bits are the plain loop's.
        let rows: [*const f32; MR] = std::array::from_fn(|t| xp.add(t * x_stride));
        let step = |acc: &mut [[__m256; 2]; MR], kk: usize| {
            let w0 = _mm256_loadu_ps(pp.add(kk * NR));
            let w1 = _mm256_loadu_ps(pp.add(kk * NR + 8));
            for (a, row) in acc.iter_mut().zip(rows) {
                let xv = _mm256_broadcast_ss(&*row.add(kk));
                a[0] = _mm256_fmadd_ps(xv, w0, a[0]);
                a[1] = _mm256_fmadd_ps(xv, w1, a[1]);
            }
        };
        let mut kk = 0;
        while kk + 4 <= kc {
            step(&mut acc, kk);
            step(&mut acc, kk + 1);
            step(&mut acc, kk + 2);
            step(&mut acc, kk + 3);
            kk += 4;
        }
        while kk < kc {
            step(&mut acc, kk);
            kk += 1;
        }
        for (t, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(yp.add(t * ld), a[0]);
            _mm256_storeu_ps(yp.add(t * ld + 8), a[1]);
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// `gemm_rows` on every ISA against a triple loop in f64: a whole token tile and 8
    /// more tokens (both tiles written in place), and a whole tile and 5 more (the
    /// second tile padded: through the per-thread block), 70 outputs (whole 32-wide
    /// blocks and an edge), `PANEL_K + 300` inputs (two panel spans, the second of
    /// pieces of 128, 128, 44), plus a second segment of 5 inputs (the LoRA expand's
    /// shape); both parallelisms; `y` starts as NaN. Tolerance: 2^-12 of the sum of
    /// |products| (the f32 sum's rounding, far above it for a wrong product). Then again
    /// on the first weight's panels packed beforehand: bit for bit the same.
    #[test]
    fn gemm_rows_equals_the_triple_loop() {
        use super::super::decode::F32Rows;
        let value =
            |i: usize, seed: usize| ((i * 2_654_435_761 + seed) % 1000) as f32 / 500.0 - 1.0;
        let (out_rows, k1, k2) = (70, PANEL_K + 300, 5);
        let w1: Vec<f32> = (0..out_rows * k1).map(|i| value(i, 1)).collect();
        let w2: Vec<f32> = (0..out_rows * k2).map(|i| value(i, 2)).collect();
        for isa in Isa::available() {
            let (mr, _) = tile_shape(isa);
            for rows in [GEMM_TOKEN_TILE + 8, GEMM_TOKEN_TILE + 5] {
                let n_padded = rows.div_ceil(mr) * mr;
                let mut x1: Vec<f32> = (0..rows * k1).map(|i| value(i, 3)).collect();
                let mut x2: Vec<f32> = (0..rows * k2).map(|i| value(i, 4)).collect();
                x1.resize(n_padded * k1, 0.0);
                x2.resize(n_padded * k2, 0.0);
                let weight1 = F32Rows {
                    data: &w1,
                    rows: out_rows,
                    cols: k1,
                };
                let weight2 = F32Rows {
                    data: &w2,
                    rows: out_rows,
                    cols: k2,
                };
                let first = Segment {
                    weight: &weight1,
                    packed: None,
                    x: &x1,
                    x_stride: k1,
                };
                let second = Segment {
                    weight: &weight2,
                    packed: None,
                    x: &x2,
                    x_stride: k2,
                };
                let mut want = vec![(0f64, 0f64); rows * out_rows];
                for t in 0..rows {
                    for o in 0..out_rows {
                        let products = (0..k1)
                            .map(|k| f64::from(w1[o * k1 + k]) * f64::from(x1[t * k1 + k]))
                            .chain(
                                (0..k2)
                                    .map(|k| f64::from(w2[o * k2 + k]) * f64::from(x2[t * k2 + k])),
                            );
                        want[t * out_rows + o] =
                            products.fold((0.0, 0.0), |(s, a), p| (s + p, a + p.abs()));
                    }
                }
                for par in [Parallelism::Sequential, Parallelism::Rayon] {
                    let mut y = vec![f32::NAN; rows * out_rows];
                    gemm_rows(isa, par, n_padded, &first, Some(&second), &mut y);
                    for (i, (&got, &(sum, magnitude))) in y.iter().zip(&want).enumerate() {
                        let got = f64::from(got);
                        assert!(
                            (got - sum).abs() <= magnitude / 4096.0,
                            "{isa:?} {par:?} rows {rows}: y[{}, {}] = {got}, want {sum}",
                            i / out_rows,
                            i % out_rows
                        );
                    }
                    // On panels packed beforehand (the edge block's rows past the
                    // weight's zero): the same bits as decoding them per tile.
                    let panels = pack_panels(isa, par, &weight1);
                    assert_eq!(
                        Some(panels.len()),
                        packed_panels_len(isa, out_rows, k1),
                        "{isa:?}"
                    );
                    let packed_first = Segment {
                        packed: Some(&panels),
                        ..first
                    };
                    let mut y_packed = vec![f32::NAN; rows * out_rows];
                    gemm_rows(
                        isa,
                        par,
                        n_padded,
                        &packed_first,
                        Some(&second),
                        &mut y_packed,
                    );
                    assert!(
                        y.iter()
                            .zip(&y_packed)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} {par:?} rows {rows}: packed panels change the result"
                    );
                }
            }
        }
    }

    #[test]
    fn transpose8_transposes() {
        if !is_x86_feature_detected!("avx2") {
            eprintln!("skipped: no AVX2");
            return;
        }
        let m: Vec<f32> = (0..64).map(|i| i as f32).collect();
        // SAFETY: AVX2 detected; 8 loads of 8 values from a 64-value buffer.
        let t = unsafe {
            transpose8(std::array::from_fn(|r| {
                _mm256_loadu_ps(m.as_ptr().add(8 * r))
            }))
        };
        let mut out = vec![0f32; 64];
        for (c, col) in t.iter().enumerate() {
            // SAFETY: AVX2 detected; 8 stores into a 64-value buffer.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), *col) };
        }
        for r in 0..8 {
            for c in 0..8 {
                assert_eq!(out[8 * c + r], m[8 * r + c], "row {r} column {c}");
            }
        }
    }

    #[test]
    fn transpose16_transposes() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
            eprintln!("skipped: no AVX-512");
            return;
        }
        let m: Vec<f32> = (0..256).map(|i| i as f32).collect();
        // SAFETY: AVX-512 detected; 16 loads of 16 values from a 256-value buffer.
        let t = unsafe {
            transpose16(std::array::from_fn(|r| {
                _mm512_loadu_ps(m.as_ptr().add(16 * r))
            }))
        };
        let mut out = vec![0f32; 256];
        for (c, col) in t.iter().enumerate() {
            // SAFETY: AVX-512 detected; 16 stores into a 256-value buffer.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), *col) };
        }
        for r in 0..16 {
            for c in 0..16 {
                assert_eq!(out[16 * c + r], m[16 * r + c], "row {r} column {c}");
            }
        }
    }
}
