//! The AMX product: operands packed into bf16 plane tiles, 2x2 blocks of 16x16 f32
//! accumulator tiles, rayon tasks over blocks of the larger operand (x86_64 only).
//!
//! Tile registers: `tmm0..tmm3` the four accumulators of a 32x32 output block,
//! `tmm4`/`tmm5` two 16x32 tiles of the left operand, `tmm6`/`tmm7` two 32x16 tiles of
//! the right one (VNNI layout: 16 rows of 16 column pairs).

use crate::split::{Planes, round_bits};
use crate::view::{MatrixMut, MatrixRef};
use core::arch::asm;
use rayon::prelude::*;

/// Rows (and columns) of an f32 accumulator tile, rows of a left tile.
pub(crate) const TILE: usize = 16;
/// bf16 values along k in one tile.
pub(crate) const KSTEP: usize = 32;
/// k-steps per block of k (256 values): a block of the packed big operand stays in L2.
const KBLOCK_STEPS: usize = 8;
/// Rows of a big left operand per task.
const TASK_ROWS: usize = 64;
/// Columns of a big right operand per task: wide enough that packing reads 1 KiB of
/// each of its rows at a time.
const TASK_COLS: usize = 256;

/// One packed tile: 16 rows of 64 bytes, aligned to a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Tile(pub(crate) [u16; 512]);

/// A zeroed buffer of tiles (allocated zeroed by the system, not copied tile by tile).
pub(crate) struct Tiles {
    raw: Vec<u16>,
    offset: usize,
    len: usize,
}

impl Tiles {
    pub(crate) fn zeroed(len: usize) -> Tiles {
        // 32 spare u16 values (64 bytes) to align the first tile to a cache line.
        let raw = vec![0u16; len * 512 + 32];
        let offset = raw.as_ptr().align_offset(64);
        Tiles { raw, offset, len }
    }

    pub(crate) fn as_slice(&self) -> &[Tile] {
        // SAFETY: `raw[offset..]` is 64-byte aligned and holds `len * 512` initialized
        // u16 values, which are `len` valid Tiles (same size, any bit pattern valid).
        unsafe {
            std::slice::from_raw_parts(self.raw.as_ptr().add(self.offset).cast::<Tile>(), self.len)
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [Tile] {
        // SAFETY: as in `as_slice`, and the borrow of `raw` is exclusive.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.raw.as_mut_ptr().add(self.offset).cast::<Tile>(),
                self.len,
            )
        }
    }
}

/// 16 f32 values on one cache line (a row of an accumulator tile).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [f32; 16]);

/// The tile configuration (palette 1): all eight tiles 16 rows of 64 bytes.
#[repr(C, align(64))]
pub(crate) struct TileConfig([u8; 64]);

pub(crate) fn tile_config() -> TileConfig {
    let mut bytes = [0u8; 64];
    bytes[0] = 1;
    for t in 0..8 {
        bytes[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
        bytes[48 + t] = 16;
    }
    TileConfig(bytes)
}

/// Loads the tile configuration on this thread for as long as it lives, releases the
/// tiles when dropped.
pub(crate) struct TileScope;

impl TileScope {
    /// # Safety
    /// AMX must be usable in this process ([`crate::detect::usable`]).
    pub(crate) unsafe fn enter(config: &TileConfig) -> TileScope {
        // SAFETY: the caller checked AMX; `config` is a valid 64-byte palette-1
        // configuration.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly, preserves_flags));
        }
        TileScope
    }
}

impl Drop for TileScope {
    fn drop(&mut self) {
        // SAFETY: a TileScope exists only after ldtilecfg succeeded on this thread.
        unsafe {
            asm!("tilerelease", options(nostack, nomem, preserves_flags));
        }
    }
}

/// # Safety
/// Tiles configured on this thread; `ptr` points at 16 rows of 64 readable bytes,
/// `stride` bytes apart.
#[inline(always)]
unsafe fn load<const T: u8>(ptr: *const u8, stride: usize) {
    // SAFETY: per the function's contract.
    unsafe {
        asm!("tileloadd tmm{t}, [{p} + {s}*1]", t = const T, p = in(reg) ptr, s = in(reg) stride,
            options(nostack, readonly, preserves_flags));
    }
}

/// # Safety
/// Tiles configured on this thread; `ptr` points at 16 rows of 64 writable bytes.
#[inline(always)]
unsafe fn store<const T: u8>(ptr: *mut u8, stride: usize) {
    // SAFETY: per the function's contract.
    unsafe {
        asm!("tilestored [{p} + {s}*1], tmm{t}", t = const T, p = in(reg) ptr, s = in(reg) stride,
            options(nostack, preserves_flags));
    }
}

/// # Safety
/// Tiles configured on this thread.
#[inline(always)]
unsafe fn zero<const T: u8>() {
    // SAFETY: per the function's contract.
    unsafe {
        asm!("tilezero tmm{t}", t = const T, options(nostack, nomem, preserves_flags));
    }
}

/// `tmm C += tmm A * tmm B` (bf16 pairs, f32 accumulation).
///
/// # Safety
/// Tiles configured on this thread.
#[inline(always)]
unsafe fn dot<const C: u8, const A: u8, const B: u8>() {
    // SAFETY: per the function's contract.
    unsafe {
        asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
            options(nostack, nomem, preserves_flags));
    }
}

/// One 32x32 output block over `steps` k-steps: the accumulators loaded from (or set to
/// zero), the plane products `(i, j)`, `i < pa`, `j < pb`, `i + j < order` formed, the
/// accumulators stored. `a[r]` is the first tile (plane 0) of row tile r, each k-step
/// `a_step` bytes after the previous one, each plane `Tile` after the previous one;
/// `b` likewise for the two column tiles.
///
/// # Safety
/// Tiles configured on this thread; every tile addressed exists; `c` points at a 32x32
/// f32 block with rows `c_stride` bytes apart.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block<const PA: usize, const PB: usize, const ORDER: usize>(
    a: [*const Tile; 2],
    b: [*const Tile; 2],
    a_step: usize,
    b_step: usize,
    steps: usize,
    c: *mut u8,
    c_stride: usize,
    fresh: bool,
) {
    // SAFETY: per the function's contract; every pointer below stays inside the tiles
    // and the 32x32 block it describes.
    unsafe {
        let c10 = c.add(TILE * c_stride);
        if fresh {
            zero::<0>();
            zero::<1>();
            zero::<2>();
            zero::<3>();
        } else {
            load::<0>(c, c_stride);
            load::<1>(c.add(64), c_stride);
            load::<2>(c10, c_stride);
            load::<3>(c10.add(64), c_stride);
        }
        for s in 0..steps {
            let a0 = a[0].cast::<u8>().add(s * a_step);
            let a1 = a[1].cast::<u8>().add(s * a_step);
            let b0 = b[0].cast::<u8>().add(s * b_step);
            let b1 = b[1].cast::<u8>().add(s * b_step);
            let mut b_plane = usize::MAX;
            for i in 0..PA {
                let offset = i * size_of::<Tile>();
                load::<4>(a0.add(offset), 64);
                load::<5>(a1.add(offset), 64);
                for j in 0..PB {
                    if i + j >= ORDER {
                        continue;
                    }
                    if b_plane != j {
                        let offset = j * size_of::<Tile>();
                        load::<6>(b0.add(offset), 64);
                        load::<7>(b1.add(offset), 64);
                        b_plane = j;
                    }
                    dot::<0, 4, 6>();
                    dot::<1, 4, 7>();
                    dot::<2, 5, 6>();
                    dot::<3, 5, 7>();
                }
            }
        }
        store::<0>(c, c_stride);
        store::<1>(c.add(64), c_stride);
        store::<2>(c10, c_stride);
        store::<3>(c10.add(64), c_stride);
    }
}

/// [`block`] for plane counts known at run time (each 1 to 3).
///
/// # Safety
/// As [`block`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn block_dyn(
    pa: usize,
    pb: usize,
    order: usize,
    a: [*const Tile; 2],
    b: [*const Tile; 2],
    a_step: usize,
    b_step: usize,
    steps: usize,
    c: *mut u8,
    c_stride: usize,
    fresh: bool,
) {
    macro_rules! dispatch {
        ($(($pa:literal, $pb:literal, $o:literal)),*) => {
            match (pa, pb, order) {
                // SAFETY: per this function's contract.
                $(($pa, $pb, $o) => unsafe {
                    block::<$pa, $pb, $o>(a, b, a_step, b_step, steps, c, c_stride, fresh)
                },)*
                _ => unreachable!("plane counts are 1 to 3 and the order at most 3"),
            }
        };
    }
    dispatch!(
        (1, 1, 1),
        (1, 1, 2),
        (1, 1, 3),
        (1, 2, 1),
        (1, 2, 2),
        (1, 2, 3),
        (1, 3, 1),
        (1, 3, 2),
        (1, 3, 3),
        (2, 1, 1),
        (2, 1, 2),
        (2, 1, 3),
        (2, 2, 1),
        (2, 2, 2),
        (2, 2, 3),
        (2, 3, 1),
        (2, 3, 2),
        (2, 3, 3),
        (3, 1, 1),
        (3, 1, 2),
        (3, 1, 3),
        (3, 2, 1),
        (3, 2, 2),
        (3, 2, 3),
        (3, 3, 1),
        (3, 3, 2),
        (3, 3, 3)
    )
}

/// The bf16 bits of the planes of x (the first `P` of three), as [`crate::split_bf16`]
/// computes them; a non-finite x gives its bf16 (NaN stays NaN) and zero planes.
#[inline(always)]
fn plane_bits<const P: usize>(x: f32) -> [u16; P] {
    let bits = x.to_bits();
    let special = bits & 0x7f80_0000 == 0x7f80_0000;
    let nan = special && bits & 0x007f_ffff != 0;
    let hi = round_bits(bits);
    let mut out = [0u16; P];
    out[0] = if nan {
        0x7fc0
    } else if special {
        (bits >> 16) as u16
    } else {
        (hi >> 16) as u16
    };
    if P > 1 {
        let rest = x - f32::from_bits(hi);
        let mid = round_bits(rest.to_bits());
        out[1] = if special { 0 } else { (mid >> 16) as u16 };
        if P > 2 {
            let lo = round_bits((rest - f32::from_bits(mid)).to_bits());
            out[2] = if special { 0 } else { (lo >> 16) as u16 };
        }
    }
    out
}

/// Which operand of the product a packer reads, and in which tile layout.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Left tiles: 16 rows of 32 consecutive k.
    Left,
    /// Right tiles (VNNI): 16 rows of k pairs, each holding 16 columns' pairs.
    Right,
}

/// Packs the `[lines, lines + 16 * line_tiles)` rows (Left) or columns (Right) of `m`
/// over k-steps `[step0, step0 + steps)` into `out`, laid out `[tile][step][plane]`;
/// values outside `m` are zero. Returns the number of planes that hold a non-zero value
/// somewhere (at least 1).
#[allow(clippy::too_many_arguments)]
fn pack(
    side: Side,
    m: &MatrixRef<'_>,
    planes: usize,
    lines: usize,
    line_tiles: usize,
    step0: usize,
    steps: usize,
    out: &mut [Tile],
) -> usize {
    match planes {
        1 => pack_planes::<1>(side, m, lines, line_tiles, step0, steps, out),
        2 => pack_planes::<2>(side, m, lines, line_tiles, step0, steps, out),
        _ => pack_planes::<3>(side, m, lines, line_tiles, step0, steps, out),
    }
}

fn pack_planes<const P: usize>(
    side: Side,
    m: &MatrixRef<'_>,
    lines: usize,
    line_tiles: usize,
    step0: usize,
    steps: usize,
    out: &mut [Tile],
) -> usize {
    // SAFETY: AVX-512F and AVX-512BW are part of what `detect::usable` checked before
    // any product runs.
    unsafe { pack_planes_avx512::<P>(side, m, lines, line_tiles, step0, steps, out) }
}

/// The planes of `N` values as bf16 bits in u32 lanes (`[plane][value]`).
#[inline(always)]
pub(crate) fn plane_words<const P: usize, const N: usize>(values: &[f32; N]) -> [[u32; N]; P] {
    let mut out = [[0u32; N]; P];
    for (i, &x) in values.iter().enumerate() {
        let bits = plane_bits::<P>(x);
        for q in 0..P {
            out[q][i] = bits[q] as u32;
        }
    }
    out
}

/// `count` values of `data` from `base`, `stride` apart, zero-padded to `N`.
#[inline(always)]
pub(crate) fn gather<const N: usize>(
    data: &[f32],
    base: usize,
    stride: usize,
    count: usize,
) -> [f32; N] {
    let mut values = [0f32; N];
    if stride == 1 && count == N {
        values = <[f32; N]>::try_from(&data[base..base + N]).expect("N values");
    } else if stride == 1 {
        values[..count].copy_from_slice(&data[base..base + count]);
    } else {
        for (i, v) in values[..count].iter_mut().enumerate() {
            *v = data[base + i * stride];
        }
    }
    values
}

/// A tile's 256 VNNI pairs as u32 values.
fn tile_words(tile: &mut Tile) -> &mut [u32; 256] {
    // SAFETY: a Tile is 1024 bytes aligned to 64, so it is also a valid [u32; 256]
    // (every bit pattern is a valid u32), and the borrow is exclusive.
    unsafe { &mut *(tile as *mut Tile).cast::<[u32; 256]>() }
}

#[target_feature(enable = "avx512f,avx512bw")]
#[allow(clippy::needless_range_loop)]
fn pack_planes_avx512<const P: usize>(
    side: Side,
    m: &MatrixRef<'_>,
    lines: usize,
    line_tiles: usize,
    step0: usize,
    steps: usize,
    out: &mut [Tile],
) -> usize {
    // `along` is the k dimension, `across` the dimension tiles are cut along.
    let (across_len, along_len, across_stride, along_stride) = match side {
        Side::Left => (m.rows(), m.cols(), m.row_stride(), m.col_stride()),
        Side::Right => (m.cols(), m.rows(), m.col_stride(), m.row_stride()),
    };
    let data = m.data();
    let mut seen = [0u32; P];
    let line_count = |t: usize| TILE.min(across_len.saturating_sub(lines + t * TILE));
    let k_count = |s: usize| KSTEP.min(along_len.saturating_sub((step0 + s) * KSTEP));
    // Tiles with padding are cleared first (the others are overwritten whole).
    for t in 0..line_tiles {
        for s in 0..steps {
            if line_count(t) < TILE || k_count(s) < KSTEP {
                for tile in &mut out[(t * steps + s) * P..(t * steps + s + 1) * P] {
                    tile.0 = [0; 512];
                }
            }
        }
    }
    let tile_index = |t: usize, s: usize, q: usize| (t * steps + s) * P + q;
    match side {
        Side::Right if across_stride == 1 => {
            // Rows of the right operand contiguous: each pair of k rows becomes one row
            // of pairs in every tile, read one whole row segment at a time.
            for s in 0..steps {
                let (k0, kc) = ((step0 + s) * KSTEP, k_count(s));
                for pair in 0..kc.div_ceil(2) {
                    let k = 2 * pair;
                    for t in 0..line_tiles {
                        let (line0, lc) = (lines + t * TILE, line_count(t));
                        if lc == 0 {
                            continue;
                        }
                        let row = |kk: usize| {
                            if kk < kc {
                                gather::<TILE>(data, line0 + (k0 + kk) * along_stride, 1, lc)
                            } else {
                                [0f32; TILE]
                            }
                        };
                        let first = plane_words::<P, TILE>(&row(k));
                        let second = plane_words::<P, TILE>(&row(k + 1));
                        for q in 0..P {
                            let words = tile_words(&mut out[tile_index(t, s, q)]);
                            for line in 0..TILE {
                                let w = first[q][line] | (second[q][line] << 16);
                                words[pair * TILE + line] = w;
                                seen[q] |= w & 0x7fff_7fff;
                            }
                        }
                    }
                }
            }
        }
        _ => {
            // A row (left) or column (right) at a time, all its k-steps (contiguous or
            // gathered).
            for t in 0..line_tiles {
                let (line0, lc) = (lines + t * TILE, line_count(t));
                for line in 0..lc {
                    for s in 0..steps {
                        let (k0, kc) = ((step0 + s) * KSTEP, k_count(s));
                        if kc == 0 {
                            continue;
                        }
                        let values = gather::<KSTEP>(
                            data,
                            (line0 + line) * across_stride + k0 * along_stride,
                            along_stride,
                            kc,
                        );
                        let words = plane_words::<P, KSTEP>(&values);
                        for q in 0..P {
                            let tile = &mut out[tile_index(t, s, q)].0;
                            for kk in 0..KSTEP {
                                let at = match side {
                                    Side::Left => line * KSTEP + kk,
                                    Side::Right => (kk / 2) * 2 * TILE + 2 * line + kk % 2,
                                };
                                tile[at] = words[q][kk] as u16;
                                seen[q] |= words[q][kk] & 0x7fff;
                            }
                        }
                    }
                }
            }
        }
    }
    (1..P).rev().find(|&q| seen[q] != 0).map_or(1, |q| q + 1)
}

/// A raw pointer to the output, shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct Shared(pub(crate) *mut f32);
impl Shared {
    /// The pointer (a method, so that closures capture the whole `Shared`).
    pub(crate) fn ptr(&self) -> *mut f32 {
        self.0
    }
}

// SAFETY: the tasks write disjoint elements (rows or columns of an output whose
// elements are distinct, checked by its constructor).
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// `out (+)= a b` with `a_planes` / `b_planes` planes, on the calling thread's rayon
/// pool.
///
/// # Safety
/// AMX must be usable in this process ([`crate::detect::usable`]); the shapes agree
/// (checked by the caller).
pub(crate) unsafe fn matmul(
    out: MatrixMut<'_>,
    a: MatrixRef<'_>,
    a_planes: Planes,
    b: MatrixRef<'_>,
    b_planes: Planes,
    accumulate: bool,
) {
    // SAFETY: this function's contract.
    unsafe { matmul_oriented(out, a, a_planes, b, b_planes, accumulate, true) }
}

/// [`matmul`], turned into the transposed product once when that packs faster.
///
/// # Safety
/// As [`matmul`].
unsafe fn matmul_oriented(
    mut out: MatrixMut<'_>,
    a: MatrixRef<'_>,
    a_planes: Planes,
    b: MatrixRef<'_>,
    b_planes: Planes,
    accumulate: bool,
    may_transpose: bool,
) {
    let (m, k, n) = (a.rows(), a.cols(), b.cols());
    if m == 0 || n == 0 {
        return;
    }
    // The big operand is packed with its rows (left) or columns (right) contiguous when
    // it can be: a big left operand stored by columns (or a big right one stored by rows
    // seen from the other side) is handled as the transposed product C^T = B^T A^T.
    let left_big = m.saturating_mul(k) >= k.saturating_mul(n);
    let big = if left_big { &a } else { &b };
    if may_transpose && big.col_stride() != 1 && big.row_stride() == 1 {
        // SAFETY: as this function's contract (the transposed shapes agree too).
        unsafe {
            matmul_oriented(
                out.transpose(),
                b.transpose(),
                b_planes,
                a.transpose(),
                a_planes,
                accumulate,
                false,
            )
        };
        return;
    }
    let (pa, pb) = (a_planes.count(), b_planes.count());
    let order = pa.max(pb);
    // The big operand is cut into tasks and packed one k-block at a time; the small one
    // is packed whole, once. Left big: tasks over rows; right big: over columns.
    let (big, big_side, big_planes, big_len) = if left_big {
        (&a, Side::Left, pa, m)
    } else {
        (&b, Side::Right, pb, n)
    };
    let (small, small_side, small_planes, small_len) = if left_big {
        (&b, Side::Right, pb, n)
    } else {
        (&a, Side::Left, pa, m)
    };
    let k_steps = k.max(1).div_ceil(KSTEP);
    // `[tile][step][plane]`, tiles padded to an even count (2x2 blocks).
    let small_tiles = 2 * small_len.div_ceil(2 * TILE);
    let mut small_buffer = Tiles::zeroed(small_tiles * k_steps * small_planes);
    let small_used = small_buffer
        .as_mut_slice()
        .par_chunks_mut(k_steps * small_planes)
        .enumerate()
        .map(|(t, chunk)| {
            pack(
                small_side,
                small,
                small_planes,
                t * TILE,
                1,
                0,
                k_steps,
                chunk,
            )
        })
        .max()
        .unwrap_or(1);
    let small_packed = small_buffer.as_slice();
    let (rs, cs) = (out.row_stride(), out.col_stride());
    let shared = Shared(out.data_mut().as_mut_ptr());
    let config = tile_config();
    let tile_bytes = size_of::<Tile>();
    let task_len = if left_big { TASK_ROWS } else { TASK_COLS };
    (0..big_len.div_ceil(task_len))
        .into_par_iter()
        .for_each(|task| {
            let first = task * task_len;
            let len = task_len.min(big_len - first);
            let big_tiles = 2 * len.div_ceil(2 * TILE);
            // Accumulators, row-major in lines of 16: left big, the task's rows by the
            // padded columns; right big, the padded rows by the task's columns.
            let (acc_row_tiles, acc_col_tiles) = if left_big {
                (big_tiles, small_tiles)
            } else {
                (small_tiles, big_tiles)
            };
            let mut acc = vec![Line([0.0; 16]); acc_row_tiles * TILE * acc_col_tiles];
            let acc_stride = acc_col_tiles * TILE * 4;
            let mut packed_buffer = Tiles::zeroed(big_tiles * KBLOCK_STEPS * big_planes);
            let packed = packed_buffer.as_mut_slice();
            // SAFETY: AMX is usable (this function's contract).
            let scope = unsafe { TileScope::enter(&config) };
            let mut step0 = 0;
            while step0 < k_steps {
                let steps = KBLOCK_STEPS.min(k_steps - step0);
                let big_used = pack(
                    big_side, big, big_planes, first, big_tiles, step0, steps, packed,
                );
                for bt in (0..big_tiles).step_by(2) {
                    let big_tile = |t: usize| packed[t * steps * big_planes..].as_ptr();
                    for st in (0..small_tiles).step_by(2) {
                        let small_tile = |t: usize| {
                            small_packed[(t * k_steps + step0) * small_planes..].as_ptr()
                        };
                        let big_pair = [big_tile(bt), big_tile(bt + 1)];
                        let small_pair = [small_tile(st), small_tile(st + 1)];
                        let big_step = big_planes * tile_bytes;
                        let small_step = small_planes * tile_bytes;
                        let (a_pair, b_pair, a_step, b_step, a_used, b_used, row_tile, col_tile) =
                            if left_big {
                                (
                                    big_pair, small_pair, big_step, small_step, big_used,
                                    small_used, bt, st,
                                )
                            } else {
                                (
                                    small_pair, big_pair, small_step, big_step, small_used,
                                    big_used, st, bt,
                                )
                            };
                        let c = acc[row_tile * TILE * acc_col_tiles + col_tile..]
                            .as_mut_ptr()
                            .cast::<u8>();
                        // SAFETY: tiles configured above; the pairs address packed tiles of
                        // this k-block (two row tiles, two column tiles, `steps` k-steps,
                        // the planes packed); `c` is a 32x32 block of `acc`, rows
                        // `acc_stride` bytes apart.
                        unsafe {
                            block_dyn(
                                a_used,
                                b_used,
                                order,
                                a_pair,
                                b_pair,
                                a_step,
                                b_step,
                                steps,
                                c,
                                acc_stride,
                                step0 == 0,
                            );
                        }
                    }
                }
                step0 += steps;
            }
            drop(scope);
            let (rows, cols, row0, col0) = if left_big {
                (len, n, first, 0)
            } else {
                (m, len, 0, first)
            };
            for i in 0..rows {
                let line = &acc[i * acc_col_tiles..(i + 1) * acc_col_tiles];
                for j in 0..cols {
                    let value = line[j / TILE].0[j % TILE];
                    // SAFETY: (row0 + i, col0 + j) is inside the output view, whose elements
                    // are distinct; no other task writes this row (left big) or column.
                    unsafe {
                        let p = shared.ptr().add((row0 + i) * rs + (col0 + j) * cs);
                        if accumulate {
                            *p += value;
                        } else {
                            *p = value;
                        }
                    }
                }
            }
        });
}
