//! The product `x W^T` with `W` packed once ([`PackedBf16`]): the planes of a block of
//! `x`'s rows packed once per k-block into left tiles, every 2x2 block of 16x16
//! accumulators stored straight into a row-major output (x86_64 only).
//!
//! Per k-step a block loads the two weight tiles once and the two row tiles of each of
//! `x`'s planes, and multiplies every plane into the same accumulators (the planes sum
//! into one result): with three planes, 8 tile loads for 12 tile products.

use crate::kernel::{
    KSTEP, Line, Shared, TILE, Tile, TileScope, Tiles, block_dyn, gather, plane_words, tile_config,
};
use crate::packed::PackedBf16;
use crate::split::Planes;
use crate::view::{MatrixMut, MatrixRef};
use rayon::prelude::*;
use std::cell::RefCell;

/// Rows of `x` per task: 4 row tiles, so each pair of weight tiles loaded serves two
/// 2x2 blocks from L1.
const TASK_ROWS: usize = 64;
/// k-steps per k-block (512 input features): the task's packed planes of one k-block
/// (64 rows x 512 x 3 planes x 2 bytes = 192 KiB) stay in L2, a column pair's weight
/// tiles of it (32 KiB) in L1.
const KBLOCK_STEPS: usize = 16;

thread_local! {
    /// Each thread's buffer for the packed planes of its task's rows, reused across
    /// calls (a fresh one per task would be page-faulted in every time).
    static LEFT: RefCell<Tiles> = RefCell::new(Tiles::zeroed(0));
}

/// Packs the rows `[row0, row0 + 16 row_tiles)` of `x` over the k-steps
/// `[step0, step0 + steps)` into `out` as left tiles (16 rows of 32 consecutive k),
/// `[row tile][step][plane]`; rows and k past `x` are zero (every tile written whole).
fn pack_left(
    planes: usize,
    x: &MatrixRef<'_>,
    row0: usize,
    row_tiles: usize,
    step0: usize,
    steps: usize,
    out: &mut [Tile],
) {
    // SAFETY: AVX-512F and AVX-512BW are part of what `detect::usable` checked before
    // any product runs.
    unsafe {
        match planes {
            1 => pack_left_avx512::<1>(x, row0, row_tiles, step0, steps, out),
            2 => pack_left_avx512::<2>(x, row0, row_tiles, step0, steps, out),
            _ => pack_left_avx512::<3>(x, row0, row_tiles, step0, steps, out),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw")]
fn pack_left_avx512<const P: usize>(
    x: &MatrixRef<'_>,
    row0: usize,
    row_tiles: usize,
    step0: usize,
    steps: usize,
    out: &mut [Tile],
) {
    let (rows, depth) = (x.rows(), x.cols());
    let (row_stride, col_stride) = (x.row_stride(), x.col_stride());
    let data = x.data();
    for rt in 0..row_tiles {
        for r in 0..TILE {
            let row = row0 + rt * TILE + r;
            for s in 0..steps {
                let k0 = (step0 + s) * KSTEP;
                let count = KSTEP.min(depth.saturating_sub(k0));
                let values = if row < rows && count > 0 {
                    gather::<KSTEP>(data, row * row_stride + k0 * col_stride, col_stride, count)
                } else {
                    [0f32; KSTEP]
                };
                let words = plane_words::<P, KSTEP>(&values);
                for (q, plane) in words.iter().enumerate() {
                    let line = &mut out[(rt * steps + s) * P + q].0[r * KSTEP..(r + 1) * KSTEP];
                    for (value, &word) in line.iter_mut().zip(plane) {
                        *value = word as u16;
                    }
                }
            }
        }
    }
}

/// `out (+)= x W^T` with `planes` planes of `x`, on the calling thread's rayon pool.
///
/// # Safety
/// AMX must be usable in this process ([`crate::detect::usable`]); the shapes agree
/// (checked by the caller).
pub(crate) unsafe fn matmul_packed(
    mut out: MatrixMut<'_>,
    x: MatrixRef<'_>,
    planes: Planes,
    weight: &PackedBf16,
    accumulate: bool,
) {
    let (rows, cols) = (x.rows(), weight.out_features());
    if rows == 0 || cols == 0 {
        return;
    }
    let p = planes.count();
    let k_steps = weight.k_steps();
    // Tasks: blocks of rows by blocks of column pairs, the columns cut only as far as
    // needed to give every thread a few tasks (each task packs its rows' planes).
    let row_blocks = rows.div_ceil(TASK_ROWS);
    let column_pairs = weight.column_tiles() / 2;
    let wanted = 4 * rayon::current_num_threads();
    let pairs_per_task = column_pairs.div_ceil(wanted.div_ceil(row_blocks).clamp(1, column_pairs));
    let column_blocks = column_pairs.div_ceil(pairs_per_task);
    let direct = out.col_stride() == 1;
    let out_row_stride = out.row_stride();
    let out_col_stride = out.col_stride();
    let shared = Shared(out.data_mut().as_mut_ptr());
    let config = tile_config();
    let tile_bytes = size_of::<Tile>();
    (0..row_blocks * column_blocks)
        .into_par_iter()
        .for_each(|task| {
            let (row_block, column_block) = (task / column_blocks, task % column_blocks);
            let row0 = row_block * TASK_ROWS;
            let row_tiles = 2 * TASK_ROWS.min(rows - row0).div_ceil(2 * TILE);
            let pairs = column_block * pairs_per_task
                ..column_pairs.min((column_block + 1) * pairs_per_task);
            LEFT.with(|cell| {
                let mut left = cell.borrow_mut();
                let needed = row_tiles * KBLOCK_STEPS * p;
                if left.as_slice().len() < needed {
                    *left = Tiles::zeroed(needed);
                }
                let left = &mut left.as_mut_slice()[..needed];
                // SAFETY: AMX is usable (this function's contract).
                let scope = unsafe { TileScope::enter(&config) };
                // The edge blocks' accumulators (what lies outside an edge block's
                // valid part is never copied out, so it need not be cleared between
                // blocks).
                let mut scratch = [Line([0.0; 16]); 4 * TILE];
                let mut step0 = 0;
                while step0 < k_steps {
                    let steps = KBLOCK_STEPS.min(k_steps - step0);
                    pack_left(p, &x, row0, row_tiles, step0, steps, left);
                    let fresh = step0 == 0 && !accumulate;
                    for pair in pairs.clone() {
                        let w_tiles = [
                            weight.tile(2 * pair, step0).cast::<Tile>(),
                            weight.tile(2 * pair + 1, step0).cast::<Tile>(),
                        ];
                        let col = 2 * pair * TILE;
                        for row_pair in 0..row_tiles / 2 {
                            let x_tiles = [
                                left[2 * row_pair * steps * p..].as_ptr(),
                                left[(2 * row_pair + 1) * steps * p..].as_ptr(),
                            ];
                            let row = row0 + 2 * row_pair * TILE;
                            let (valid_rows, valid_cols) =
                                ((rows - row).min(2 * TILE), (cols - col).min(2 * TILE));
                            // SAFETY: tiles configured above; `x_tiles` address this
                            // k-block's `steps` k-steps of two packed row tiles (all
                            // planes), `w_tiles` the same k-steps of two column tiles
                            // (consecutive in the packed weight); the output block is
                            // either a whole 32x32 block of the row-major output, which
                            // only this task writes, or the scratch block.
                            // A whole 32x32 block of a row-major output is accumulated
                            // in place; an edge block (or an output with strided
                            // columns) in a 32x32 scratch block, its valid part copied
                            // in and out.
                            let whole = direct && valid_rows == 2 * TILE && valid_cols == 2 * TILE;
                            let at = |i: usize, j: usize| {
                                (row + i) * out_row_stride + (col + j) * out_col_stride
                            };
                            // SAFETY: tiles configured above; `x_tiles` address this
                            // k-block's `steps` k-steps of two packed row tiles (all
                            // planes), `w_tiles` the same k-steps of two column tiles
                            // (consecutive in the packed weight); the output block is
                            // either a whole 32x32 block of the row-major output, which
                            // only this task writes, or the scratch block; `at(i, j)`
                            // for the block's valid part lies in the output.
                            unsafe {
                                let (block, block_stride) = if whole {
                                    (
                                        shared.ptr().add(row * out_row_stride + col).cast::<u8>(),
                                        out_row_stride * 4,
                                    )
                                } else {
                                    if !fresh {
                                        for i in 0..valid_rows {
                                            for j in 0..valid_cols {
                                                scratch[2 * i + j / TILE].0[j % TILE] =
                                                    *shared.ptr().add(at(i, j));
                                            }
                                        }
                                    }
                                    (scratch.as_mut_ptr().cast::<u8>(), 2 * size_of::<Line>())
                                };
                                block_dyn(
                                    p,
                                    1,
                                    p,
                                    x_tiles,
                                    w_tiles,
                                    p * tile_bytes,
                                    tile_bytes,
                                    steps,
                                    block,
                                    block_stride,
                                    fresh,
                                );
                                if !whole {
                                    for i in 0..valid_rows {
                                        for j in 0..valid_cols {
                                            *shared.ptr().add(at(i, j)) =
                                                scratch[2 * i + j / TILE].0[j % TILE];
                                        }
                                    }
                                }
                            }
                        }
                    }
                    step0 += steps;
                }
                drop(scope);
            });
        });
}
