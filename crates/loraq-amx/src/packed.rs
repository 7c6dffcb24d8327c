//! A linear's bf16 weight packed once into the tile layout of the right operand, and
//! the product `x W^T` that reads it ([`Amx::matmul_packed`]).
//!
//! Layout (docs/amx.md, "Packed weights"): the right operand of `x W^T` is `W^T`
//! (`in_features x out_features`), cut into column tiles of 16 output features and
//! k-steps of 32 input features. Tile `(c, s)` (column tile `c`, k-step `s`) is 16 rows
//! of 16 VNNI pairs: row `p`, pair `l` holds `W[16 c + l][32 s + 2 p]` in its low half
//! and `W[16 c + l][32 s + 2 p + 1]` in its high half. Tiles follow each other
//! `[c][s]` (a column tile's k-steps consecutive, as the kernel walks them), each 1,024
//! bytes aligned to 64; the column tiles are padded with zero tiles to an even count
//! (the kernel's 2x2 blocks), and values past the weight's edges are zero.

use crate::error::AmxError;
use crate::split::Planes;
use crate::view::{MatrixMut, MatrixRef};
use crate::{Accumulate, Amx};
use rayon::prelude::*;

/// Output features per column tile.
pub(crate) const TILE_COLUMNS: usize = 16;
/// Input features per k-step.
pub(crate) const TILE_DEPTH: usize = 32;
/// bf16 values in one tile (16 rows of 64 bytes).
pub(crate) const TILE_VALUES: usize = 512;

/// A linear's weight `W` (`out_features x in_features`, every value a bf16 value) packed
/// once into the VNNI tile layout of the right operand of `x W^T`, for
/// [`Amx::matmul_packed`]: 2 bytes a weight plus the padding to whole tiles.
#[derive(Clone)]
pub struct PackedBf16 {
    /// The tiles, from `offset` on (64-byte aligned), `[column tile][k-step]`.
    raw: Vec<u16>,
    offset: usize,
    out_features: usize,
    in_features: usize,
    column_tiles: usize,
    k_steps: usize,
}

impl std::fmt::Debug for PackedBf16 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedBf16")
            .field("out_features", &self.out_features)
            .field("in_features", &self.in_features)
            .finish_non_exhaustive()
    }
}

impl PackedBf16 {
    /// Packs the weight whose bf16 bits are `bits` (`out_features x in_features`,
    /// row-major). An error when `bits` does not hold that many values or the size
    /// overflows.
    pub fn from_weight_bits(
        bits: &[u16],
        out_features: usize,
        in_features: usize,
    ) -> Result<PackedBf16, AmxError> {
        check_len("weight bits", bits.len(), out_features, in_features)?;
        PackedBf16::pack(out_features, in_features, |row, k| {
            bits[row * in_features + k]
        })
    }

    /// Packs the weight `values` (`out_features x in_features`, row-major), every value
    /// a bf16 value (so one plane holds it exactly); an error naming the first value that
    /// is not, or when the length disagrees with the shape.
    pub fn from_weight_f32(
        values: &[f32],
        out_features: usize,
        in_features: usize,
    ) -> Result<PackedBf16, AmxError> {
        check_len("weight values", values.len(), out_features, in_features)?;
        if let Some(index) = values
            .iter()
            .position(|&v| crate::round_bf16(v).to_bits() != v.to_bits() && !v.is_nan())
        {
            return Err(AmxError::NotBf16 {
                index,
                value: format!("{:e}", values[index]),
            });
        }
        PackedBf16::pack(out_features, in_features, |row, k| {
            let v = values[row * in_features + k];
            (crate::round_bf16(v).to_bits() >> 16) as u16
        })
    }

    /// Packs the values `value(row, k)` (bf16 bits) of an `out_features x in_features`
    /// weight whose length was checked.
    fn pack(
        out_features: usize,
        in_features: usize,
        value: impl Fn(usize, usize) -> u16 + Sync,
    ) -> Result<PackedBf16, AmxError> {
        let column_tiles = 2 * out_features.div_ceil(2 * TILE_COLUMNS);
        // At least one k-step, so that a product over zero input features is a product
        // of zero tiles (its accumulators start at zero) like any other.
        let k_steps = in_features.div_ceil(TILE_DEPTH).max(1);
        let values = column_tiles
            .checked_mul(k_steps)
            .and_then(|tiles| tiles.checked_mul(TILE_VALUES))
            .and_then(|v| v.checked_add(32))
            .ok_or_else(|| AmxError::BadView {
                what: "packed weight",
                detail: format!("{out_features}x{in_features} overflows"),
            })?;
        // 32 spare values (64 bytes) to align the first tile to a cache line.
        let mut raw = vec![0u16; values];
        let offset = raw.as_ptr().align_offset(64);
        let tiles = &mut raw[offset..offset + column_tiles * k_steps * TILE_VALUES];
        // One column tile (16 rows of W, all its k-steps) per rayon task, a tile at a
        // time ([`pair_index`]).
        tiles
            .par_chunks_mut(k_steps * TILE_VALUES)
            .enumerate()
            .for_each(|(c, column)| {
                let rows = TILE_COLUMNS.min(out_features.saturating_sub(c * TILE_COLUMNS));
                for (s, tile) in column.chunks_exact_mut(TILE_VALUES).enumerate() {
                    let depth = TILE_DEPTH.min(in_features.saturating_sub(s * TILE_DEPTH));
                    for l in 0..rows {
                        let row = c * TILE_COLUMNS + l;
                        for d in 0..depth {
                            tile[pair_index(l, d)] = value(row, s * TILE_DEPTH + d);
                        }
                    }
                }
            });
        Ok(PackedBf16 {
            raw,
            offset,
            out_features,
            in_features,
            column_tiles,
            k_steps,
        })
    }

    /// Output features (rows of the weight, columns of the product).
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Input features (columns of the weight, the product's inner dimension).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Column tiles (16 output features each, an even count).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn column_tiles(&self) -> usize {
        self.column_tiles
    }

    /// k-steps (32 input features each, at least one).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn k_steps(&self) -> usize {
        self.k_steps
    }

    /// The first value of tile `(column_tile, step)`: 64-byte aligned, followed by the
    /// column tile's later k-steps.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn tile(&self, column_tile: usize, step: usize) -> *const u16 {
        assert!(column_tile < self.column_tiles && step < self.k_steps);
        self.raw[self.offset + (column_tile * self.k_steps + step) * TILE_VALUES..].as_ptr()
    }

    /// The weight value `(row, k)` as an f32 (for tests and checks; slow).
    pub fn get(&self, row: usize, k: usize) -> f32 {
        assert!(
            row < self.out_features && k < self.in_features,
            "({row}, {k}) outside {}x{}",
            self.out_features,
            self.in_features
        );
        let (c, l) = (row / TILE_COLUMNS, row % TILE_COLUMNS);
        let (s, d) = (k / TILE_DEPTH, k % TILE_DEPTH);
        let tile = self.offset + (c * self.k_steps + s) * TILE_VALUES;
        let bits = self.raw[tile + pair_index(l, d)];
        f32::from_bits(u32::from(bits) << 16)
    }
}

/// Where value `d` (of a k-step's 32) of output feature `l` (of a column tile's 16) lies
/// in its tile: VNNI pair row `d / 2`, column `l`, half `d % 2`.
fn pair_index(l: usize, d: usize) -> usize {
    (d / 2) * 2 * TILE_COLUMNS + 2 * l + d % 2
}

/// An error unless `len` is `out_features * in_features`.
fn check_len(
    what: &'static str,
    len: usize,
    out_features: usize,
    in_features: usize,
) -> Result<(), AmxError> {
    if out_features.checked_mul(in_features) != Some(len) {
        return Err(AmxError::BadView {
            what,
            detail: format!("{len} values for a {out_features}x{in_features} weight"),
        });
    }
    Ok(())
}

impl Amx {
    /// `out = x W^T` ([`Accumulate::Replace`]) or `out += x W^T` with `W` packed once
    /// ([`PackedBf16`]) and `x` (`tokens x in_features`) split into `planes` bf16
    /// planes, packed once per call; each product `x_k w_jk` is formed from the planes
    /// (exactly with [`Planes::Three`]) and accumulated in f32, on the current rayon
    /// pool. A row-major `out` is written by whole tiles. An error when the shapes
    /// disagree.
    pub fn matmul_packed(
        &self,
        out: MatrixMut<'_>,
        x: MatrixRef<'_>,
        planes: Planes,
        weight: &PackedBf16,
        accumulate: Accumulate,
    ) -> Result<(), AmxError> {
        if x.cols() != weight.in_features
            || out.rows() != x.rows()
            || out.cols() != weight.out_features
        {
            return Err(AmxError::ShapeMismatch {
                a_rows: x.rows(),
                a_cols: x.cols(),
                b_rows: weight.in_features,
                b_cols: weight.out_features,
                out_rows: out.rows(),
                out_cols: out.cols(),
            });
        }
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: an `Amx` exists only where `detect::usable` said yes; the shapes
            // agree (checked above).
            unsafe {
                crate::packed_kernel::matmul_packed(
                    out,
                    x,
                    planes,
                    weight,
                    accumulate == Accumulate::Add,
                );
            }
            Ok(())
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (planes, accumulate);
            Err(AmxError::Unavailable)
        }
    }
}
