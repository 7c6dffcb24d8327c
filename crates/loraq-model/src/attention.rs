//! Causal softmax attention in tiles with a streaming (online) softmax, flash-style:
//! for each head and each tile of [`QUERY_TILE`] queries, the key tiles up to the
//! diagonal are visited in order (the tiles past it are skipped, not masked), keeping
//! per query row the running maximum `m`, the sum `l` of `exp(s - m)` and the output
//! `acc` of `exp(s - m) V`, each rescaled by `exp(m_old - m_new)` when the maximum
//! grows; the result is `acc / l`, `softmax(Q K^T / sqrt(d) + mask) V` up to f32
//! rounding. Memory is one `QUERY_TILE x KEY_TILE` score tile per task instead of a
//! `T x T` matrix, and the (head, query tile) tasks run in parallel on rayon's pool.

use crate::small_matmul::{
    Product, RowProduct, dispatch_simd, exp_nonpositive, madd, matmul_acc, matmul_acc_row,
    per_head_parallel_into,
};
use rayon::prelude::*;

/// Queries per tile (and per parallel task).
pub const QUERY_TILE: usize = 64;
/// Keys per tile.
pub const KEY_TILE: usize = 64;

/// Shapes of one prompt's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionDims {
    /// Prompt length.
    pub tokens: usize,
    /// Query heads: a multiple of `kv_heads`; query head `h` reads kv head
    /// `h / (heads / kv_heads)` (transformers' `repeat_kv`).
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

/// Causal attention of one prompt: `query` `[tokens, heads, head_dim]`, `key` and
/// `value` `[tokens, kv_heads, head_dim]` (row-major, rotary embedding applied);
/// returns `[tokens, heads, head_dim]`, scores scaled by `head_dim^-0.5`.
pub fn causal_attention(
    query: &[f32],
    key: &[f32],
    value: &[f32],
    dims: AttentionDims,
) -> Vec<f32> {
    let mut out = vec![0f32; dims.tokens * dims.heads * dims.head_dim];
    causal_attention_into(query, key, value, dims, &mut Vec::new(), &mut out);
    out
}

/// [`causal_attention`] into `out` (`[tokens, heads, head_dim]`, overwritten), with
/// `scratch` (grown as needed, contents ignored) for the per-head blocks, so the
/// forward pass reuses one buffer for every layer and prompt.
pub fn causal_attention_into(
    query: &[f32],
    key: &[f32],
    value: &[f32],
    dims: AttentionDims,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let AttentionDims {
        tokens,
        heads,
        kv_heads,
        head_dim: hd,
    } = dims;
    let group = heads / kv_heads;
    let key_tiles = tokens.div_ceil(KEY_TILE);
    let tile_len = hd * KEY_TILE;
    let key_t = &key_in_tiles(key, dims);
    // Within a head, the query tiles run in parallel too.
    per_head_parallel_into(tokens, heads, hd, scratch, out, |h, head_out| {
        let kv = h / group;
        head_out
            .par_chunks_mut(QUERY_TILE * hd)
            .enumerate()
            .for_each(|(tile, out)| {
                let tile_input = TileInput {
                    query,
                    key_t: &key_t[kv * key_tiles * tile_len..][..key_tiles * tile_len],
                    value,
                    dims,
                    head: h,
                    kv_head: kv,
                    q0: tile * QUERY_TILE,
                };
                attend_tile(&tile_input, out);
            });
    });
}

/// K^T per kv head in key tiles (`[kv_heads, key tiles, head_dim, KEY_TILE]`): tile `kt`
/// is a contiguous `[head_dim, KEY_TILE]` block (the last one zero-padded), so a score
/// tile is a product with row stride KEY_TILE. A `[head_dim, tokens]` K^T instead puts
/// the rows a product reads `tokens * 4` bytes apart: a multiple of 4 KiB for prompts
/// of 1,024, 2,048, 4,096 tokens, so all of them fall in one L1 set and evict each
/// other. The key tiles are built in parallel, one task per (kv head, key tile).
fn key_in_tiles(key: &[f32], dims: AttentionDims) -> Vec<f32> {
    let AttentionDims {
        tokens,
        kv_heads,
        head_dim: hd,
        ..
    } = dims;
    let key_tiles = tokens.div_ceil(KEY_TILE);
    let tile_len = hd * KEY_TILE;
    let mut key_t = vec![0f32; kv_heads * key_tiles * tile_len];
    key_t
        .par_chunks_mut(tile_len)
        .enumerate()
        .for_each(|(index, block)| {
            let (j, tile) = (index / key_tiles, index % key_tiles);
            let t0 = tile * KEY_TILE;
            for t in t0..tokens.min(t0 + KEY_TILE) {
                let column = t - t0;
                for (d, &x) in key[(t * kv_heads + j) * hd..][..hd].iter().enumerate() {
                    block[d * KEY_TILE + column] = x;
                }
            }
        });
    key_t
}

/// The output of [`causal_attention`] at the prompt's last position alone
/// (`[heads, head_dim]` into `out`): `last_query` is that position's query (`[heads,
/// head_dim]`), `key` and `value` the whole prompt's (`[tokens, kv_heads, head_dim]`).
/// The same operations as the last query tile of the whole computation, in the same
/// order (its score and value products through `small_matmul::matmul_acc_row`, which follows the
/// row's path through the tile's products), so the result is bit-identical to that
/// row of [`causal_attention`]; the work is one query's instead of `tokens`. The heads
/// run in parallel.
pub fn last_query_attention(
    last_query: &[f32],
    key: &[f32],
    value: &[f32],
    dims: AttentionDims,
    out: &mut [f32],
) {
    let AttentionDims {
        tokens,
        heads,
        kv_heads,
        head_dim: hd,
    } = dims;
    assert_eq!(last_query.len(), heads * hd, "one query row per head");
    assert_eq!(out.len(), heads * hd, "one output row per head");
    if tokens == 0 {
        out.fill(0.0);
        return;
    }
    let group = heads / kv_heads;
    let key_tiles = tokens.div_ceil(KEY_TILE);
    let tile_len = hd * KEY_TILE;
    let key_t = &key_in_tiles(key, dims);
    out.par_chunks_mut(hd).enumerate().for_each(|(h, out)| {
        let kv = h / group;
        let input = LastQueryInput {
            query: &last_query[h * hd..(h + 1) * hd],
            key_t: &key_t[kv * key_tiles * tile_len..][..key_tiles * tile_len],
            value,
            dims,
            kv_head: kv,
        };
        attend_last_query(&input, out);
    });
}

/// One head's operands of [`last_query_attention`].
struct LastQueryInput<'a> {
    /// The last position's query of this head, `[head_dim]`.
    query: &'a [f32],
    /// As [`TileInput::key_t`].
    key_t: &'a [f32],
    value: &'a [f32],
    dims: AttentionDims,
    kv_head: usize,
}

dispatch_simd!(
    /// The last query of one head on the widest instruction set the CPU has.
    fn attend_last_query(input: &LastQueryInput<'_>, out: &mut [f32]) = attend_last_query_body
);

/// [`attend_tile_body`]'s row of the last query, alone: the same key tiles, the same
/// products (as row `i` of `rows`), the same softmax steps.
#[inline(always)]
fn attend_last_query_body<const FUSED: bool>(input: &LastQueryInput<'_>, out: &mut [f32]) {
    let LastQueryInput {
        query,
        key_t,
        value,
        dims,
        kv_head,
    } = *input;
    let AttentionDims {
        tokens,
        kv_heads,
        head_dim: hd,
        ..
    } = dims;
    // The last query tile starts at q0 and holds `rows` queries; the last query is its
    // row `i`.
    let q0 = (tokens - 1) / QUERY_TILE * QUERY_TILE;
    let rows = tokens - q0;
    let i = rows - 1;
    let scale = (hd as f32).powf(-0.5);
    let mut scores = [0f32; KEY_TILE];
    let mut max = f32::NEG_INFINITY;
    let mut sum = 0f32;
    out.fill(0.0);
    let mut k0 = 0;
    while k0 < tokens {
        let cols = KEY_TILE.min(tokens - k0);
        let row = &mut scores[..cols];
        row.fill(0.0);
        matmul_acc_row::<FUSED>(
            &RowProduct {
                m: rows,
                i,
                k: hd,
                n: cols,
                a_row: query,
                b: &key_t[k0 * hd..],
                ldb: KEY_TILE,
                alpha: scale,
            },
            row,
        );
        // The last query sees every key: nothing is masked.
        let new_max = max.max(row_max(row));
        let rescale = exp_nonpositive::<FUSED>(max - new_max);
        let row_sum = exp_shifted_sum::<FUSED>(row, new_max);
        sum = madd::<FUSED>(sum, rescale, row_sum);
        max = new_max;
        if rescale != 1.0 {
            for o in out.iter_mut() {
                *o *= rescale;
            }
        }
        matmul_acc_row::<FUSED>(
            &RowProduct {
                m: rows,
                i,
                k: cols,
                n: hd,
                a_row: row,
                b: &value[(k0 * kv_heads + kv_head) * hd..],
                ldb: kv_heads * hd,
                alpha: 1.0,
            },
            out,
        );
        k0 += cols;
    }
    let inv = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// One (head, query tile) task's operands.
struct TileInput<'a> {
    query: &'a [f32],
    /// This head's kv head, transposed in key tiles: `[key tiles, head_dim, KEY_TILE]`.
    key_t: &'a [f32],
    value: &'a [f32],
    dims: AttentionDims,
    head: usize,
    kv_head: usize,
    /// First query of the tile.
    q0: usize,
}

dispatch_simd!(
    /// One query tile of one head on the widest instruction set the CPU has.
    fn attend_tile(input: &TileInput<'_>, out: &mut [f32]) = attend_tile_body
);

/// Replaces each score of a row by `exp(score - max)` and returns their sum, in 16
/// partial lanes so the loop vectorizes. The tiled pass and the last query's pass both
/// call it, so the last row of a prompt gets the same bits either way.
#[inline(always)]
fn exp_shifted_sum<const FUSED: bool>(row: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0f32; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        for (l, x) in lanes.iter_mut().zip(c.iter_mut()) {
            *x = exp_nonpositive::<FUSED>(*x - max);
            *l += *x;
        }
    }
    let mut row_sum: f32 = lanes.iter().sum();
    for x in chunks.into_remainder() {
        *x = exp_nonpositive::<FUSED>(*x - max);
        row_sum += *x;
    }
    row_sum
}

/// Lane-wise maximum of a row, in 16 partial lanes so the loop vectorizes.
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let mut m = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for &x in chunks.remainder() {
        m = m.max(x);
    }
    m
}

#[inline(always)]
fn attend_tile_body<const FUSED: bool>(input: &TileInput<'_>, out: &mut [f32]) {
    let TileInput {
        query,
        key_t,
        value,
        dims,
        head,
        kv_head,
        q0,
    } = *input;
    let AttentionDims {
        heads,
        kv_heads,
        head_dim: hd,
        ..
    } = dims;
    let rows = out.len() / hd;
    let scale = (hd as f32).powf(-0.5);
    let mut scores = [0f32; QUERY_TILE * KEY_TILE];
    let mut max = [f32::NEG_INFINITY; QUERY_TILE];
    let mut sum = [0f32; QUERY_TILE];
    out.fill(0.0);
    let q_rows = &query[(q0 * heads + head) * hd..];
    // Keys 0 ..= the tile's last query.
    let key_end = q0 + rows;
    let mut k0 = 0;
    while k0 < key_end {
        let cols = KEY_TILE.min(key_end - k0);
        let s = &mut scores[..rows * cols];
        s.fill(0.0);
        matmul_acc::<FUSED>(
            &Product {
                m: rows,
                k: hd,
                n: cols,
                a: q_rows,
                lda: heads * hd,
                b: &key_t[k0 * hd..],
                ldb: KEY_TILE,
                alpha: scale,
            },
            s,
            cols,
        );
        for (i, row) in s.chunks_exact_mut(cols).enumerate() {
            // Query q0 + i sees keys up to itself.
            let visible = (q0 + i + 1).saturating_sub(k0).min(cols);
            for x in &mut row[visible..] {
                *x = f32::NEG_INFINITY;
            }
            let new_max = max[i].max(row_max(&row[..visible]));
            // The first tile holds key 0, visible to every query: new_max is finite.
            let rescale = exp_nonpositive::<FUSED>(max[i] - new_max);
            let row_sum = exp_shifted_sum::<FUSED>(row, new_max);
            sum[i] = madd::<FUSED>(sum[i], rescale, row_sum);
            max[i] = new_max;
            if rescale != 1.0 {
                for o in &mut out[i * hd..(i + 1) * hd] {
                    *o *= rescale;
                }
            }
        }
        matmul_acc::<FUSED>(
            &Product {
                m: rows,
                k: cols,
                n: hd,
                a: s,
                lda: cols,
                b: &value[(k0 * kv_heads + kv_head) * hd..],
                ldb: kv_heads * hd,
                alpha: 1.0,
            },
            out,
            hd,
        );
        k0 += cols;
    }
    for (row, &l) in out.chunks_exact_mut(hd).zip(&sum[..rows]) {
        let inv = 1.0 / l;
        for o in row {
            *o *= inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values that round in every product (so another summation order shows).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                let x = x ^ (x >> 13);
                ((x >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 5.3
            })
            .collect()
    }

    #[test]
    fn the_last_query_alone_is_bit_identical_to_the_whole_pass() {
        // Prompt lengths inside one query tile, on its edges and over several, with its
        // last tile whole or not; grouped heads; head_dim 64 (the demo's) and 24.
        for (tokens, heads, kv_heads, head_dim) in [
            (1, 2, 1, 64),
            (5, 4, 2, 24),
            (20, 8, 2, 64),
            (63, 2, 2, 64),
            (64, 4, 1, 64),
            (65, 4, 2, 64),
            (150, 6, 2, 24),
            (512, 8, 2, 64),
        ] {
            let dims = AttentionDims {
                tokens,
                heads,
                kv_heads,
                head_dim,
            };
            let q = values(tokens * heads * head_dim, 1);
            let k = values(tokens * kv_heads * head_dim, 2);
            let v = values(tokens * kv_heads * head_dim, 3);
            let whole = causal_attention(&q, &k, &v, dims);
            let width = heads * head_dim;
            let last = (tokens - 1) * width;
            let mut alone = vec![f32::NAN; width];
            last_query_attention(&q[last..], &k, &v, dims, &mut alone);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&alone),
                bits(&whole[last..]),
                "{tokens} tokens, {heads} heads, {kv_heads} kv heads, head_dim {head_dim}"
            );
        }
    }
}
