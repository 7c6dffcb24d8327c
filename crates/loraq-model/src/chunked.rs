//! The gated delta rule in its chunkwise-parallel form (the algorithm of transformers'
//! `torch_chunk_gated_delta_rule` and fla's `chunk_gated_delta_rule`): within a chunk of
//! [`DELTA_RULE_CHUNK`] tokens the rank-one updates are gathered into a WY
//! representation and applied with small matrix products, and only the state passes
//! from one chunk to the next.
//!
//! Per value head, with the l2-normalized keys `k_t`, the scaled normalized queries
//! `q_t`, values `v_t`, `beta_t` and log decays `g_t`, a chunk of `L` tokens starting
//! from state `S` (`[key_dim, value_dim]`) computes, with `G_i = g_0 + ... + g_i` the
//! decay accumulated inside the chunk:
//!
//! ```text
//! M[i, j] = beta_i exp(G_i - G_j) k_i . k_j           (j < i; strictly lower)
//! (I + M) U = diag(beta) V                            (forward substitution)
//! (I + M) W = diag(beta exp(G)) K
//! V' = U - W S                                        (the chunk's corrected values)
//! O  = diag(exp(G)) Q S + (Q K^T * D) V'              (D[i, j] = exp(G_i - G_j), j <= i)
//! S <- exp(G_last) S + (K * exp(G_last - G))^T V'
//! ```
//!
//! which equals the token-by-token recurrence ([`crate::ops::gated_delta_rule`]) in
//! exact arithmetic: every `exp` argument is `<= 0`, so nothing overflows, and the
//! summation order differs from the recurrence's by f32 rounding only.

use crate::ops::{DeltaRuleDims, inverse_l2_norm};
use crate::small_matmul::{
    Product, axpy, dispatch_simd, exp_nonpositive, matmul_acc, per_head_parallel_into,
};

/// Tokens per chunk (transformers' and fla's `chunk_size`).
pub const DELTA_RULE_CHUNK: usize = 64;

/// The gated delta rule over a whole sequence from a zero state, chunk by chunk.
///
/// Same inputs and output as [`crate::ops::gated_delta_rule`] (`query`, `key`
/// `[tokens, key_heads, key_dim]` raw, `value` `[tokens, value_heads, value_dim]`,
/// `decay` and `beta` `[tokens, value_heads]`; output `[tokens, value_heads,
/// value_dim]`). The value heads run in parallel on rayon's current pool.
pub fn gated_delta_rule_chunked(
    query: &[f32],
    key: &[f32],
    value: &[f32],
    decay: &[f32],
    beta: &[f32],
    dims: DeltaRuleDims,
    chunk: usize,
) -> Vec<f32> {
    let inputs = TokenRows {
        query,
        key,
        value,
        query_stride: dims.key_heads * dims.key_dim,
        value_stride: dims.value_heads * dims.value_dim,
    };
    let mut out = vec![0f32; dims.tokens * dims.value_heads * dims.value_dim];
    chunked_from_rows(&inputs, decay, beta, dims, chunk, &mut Vec::new(), &mut out);
    out
}

/// The convolved `in_proj_qkv` output of one prompt as the forward pass holds it: per
/// token one row of `stride` values, the query heads first, the key heads from
/// `key_offset`, the value heads from `value_offset`.
pub(crate) struct StridedQkv<'a> {
    /// `[tokens, stride]` row-major.
    pub rows: &'a [f32],
    /// Values per token.
    pub stride: usize,
    /// Where a row's key heads start.
    pub key_offset: usize,
    /// Where a row's value heads start.
    pub value_offset: usize,
}

/// [`gated_delta_rule_chunked`] reading the query, key and value heads in place from
/// one `[tokens, stride]` matrix (no split copies), into `out` (`[tokens, value_heads,
/// value_dim]`, overwritten), with `scratch` (grown as needed, contents ignored) for
/// the per-head blocks.
pub(crate) fn gated_delta_rule_chunked_strided(
    qkv: StridedQkv<'_>,
    decay: &[f32],
    beta: &[f32],
    dims: DeltaRuleDims,
    chunk: usize,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let inputs = TokenRows {
        query: qkv.rows,
        key: &qkv.rows[qkv.key_offset.min(qkv.rows.len())..],
        value: &qkv.rows[qkv.value_offset.min(qkv.rows.len())..],
        query_stride: qkv.stride,
        value_stride: qkv.stride,
    };
    chunked_from_rows(&inputs, decay, beta, dims, chunk, scratch, out);
}

/// Token-major inputs: token `t`'s query (key) head `j` at `query[t * query_stride + j *
/// key_dim..]` (`key[..]` alike), value head `h` at `value[t * value_stride + h *
/// value_dim..]`.
#[derive(Clone, Copy)]
struct TokenRows<'a> {
    query: &'a [f32],
    key: &'a [f32],
    value: &'a [f32],
    query_stride: usize,
    value_stride: usize,
}

fn chunked_from_rows(
    inputs: &TokenRows<'_>,
    decay: &[f32],
    beta: &[f32],
    dims: DeltaRuleDims,
    chunk: usize,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    use rayon::prelude::*;
    let TokenRows {
        query,
        key,
        value,
        query_stride,
        value_stride,
    } = *inputs;
    let DeltaRuleDims {
        tokens,
        key_heads,
        value_heads,
        key_dim: dk,
        value_dim: dv,
    } = dims;
    // A prompt shorter than a chunk is one chunk: the per-head scratch (a few
    // chunk x chunk and chunk x dim buffers, zeroed per head) is sized to it, not to
    // the full chunk, which for 20-token prompts was most of the work.
    let chunk = chunk.min(tokens).max(1);
    let group = value_heads / key_heads;
    let scale = 1.0 / (dk as f32).sqrt();
    // Normalized queries and keys per key head, head-major ([key_heads, tokens, dk]),
    // one parallel task per (key head, query or key).
    let head_major = |x: &[f32], query: bool| -> Vec<Vec<f32>> {
        (0..key_heads)
            .into_par_iter()
            .map(|kh| {
                let mut out = Vec::with_capacity(tokens * dk);
                for t in 0..tokens {
                    // l2_normalize (then the query scale) read from the row in place
                    // and written once: the same products as on a copy.
                    let row = &x[t * query_stride + kh * dk..][..dk];
                    let inv = inverse_l2_norm(row, 1e-6);
                    if query {
                        out.extend(row.iter().map(|&v| v * inv * scale));
                    } else {
                        out.extend(row.iter().map(|&v| v * inv));
                    }
                }
                out
            })
            .collect()
    };
    let (q, k) = rayon::join(|| head_major(query, true), || head_major(key, false));
    per_head_parallel_into(tokens, value_heads, dv, scratch, out, |h, out| {
        let kh = h / group;
        let g: Vec<f32> = (0..tokens).map(|t| decay[t * value_heads + h]).collect();
        let b: Vec<f32> = (0..tokens).map(|t| beta[t * value_heads + h]).collect();
        let input = HeadInput {
            q: &q[kh],
            k: &k[kh],
            v: &value[(h * dv).min(value.len())..],
            v_stride: value_stride,
            g: &g,
            beta: &b,
            tokens,
            dk,
            dv,
            chunk,
        };
        delta_rule_head(&input, out);
    });
}

/// Rows of the forward substitution solved one by one between block products.
const SOLVE_BLOCK: usize = 16;

/// Rows per block of the triangular products (`K K^T`, `Q K^T`, `P V'`): the rows of
/// one register tile, so each block stops at its own diagonal.
const TRIANGLE_ROWS: usize = 8;

/// One value head's inputs, head-major.
struct HeadInput<'a> {
    /// `[tokens, dk]`, normalized and scaled.
    q: &'a [f32],
    /// `[tokens, dk]`, normalized.
    k: &'a [f32],
    /// This head's values in place: token `t`'s at `v[t * v_stride..][..dv]`.
    v: &'a [f32],
    v_stride: usize,
    /// `[tokens]` log decays.
    g: &'a [f32],
    /// `[tokens]`.
    beta: &'a [f32],
    tokens: usize,
    dk: usize,
    dv: usize,
    chunk: usize,
}

dispatch_simd!(
    /// Runs one head on the widest instruction set the CPU has, into `out` (`[tokens, dv]`).
    fn delta_rule_head(input: &HeadInput<'_>, out: &mut [f32]) = delta_rule_head_body
);

/// The chunked recurrence of one head, into `out` (`[tokens, dv]`).
#[inline(always)]
fn delta_rule_head_body<const FUSED: bool>(input: &HeadInput<'_>, out: &mut [f32]) {
    let HeadInput {
        q,
        k,
        v,
        v_stride,
        g,
        beta,
        tokens,
        dk,
        dv,
        chunk,
    } = *input;
    debug_assert_eq!(out.len(), tokens * dv);
    let mut state = vec![0f32; dk * dv];
    // Per-chunk scratch, sized for a full chunk.
    let mut cum = vec![0f32; chunk];
    let mut k_t = vec![0f32; dk * chunk];
    let mut gram_kk = vec![0f32; chunk * chunk];
    let mut gram_qk = vec![0f32; chunk * chunk];
    let mut u = vec![0f32; chunk * dv];
    let mut w = vec![0f32; chunk * dk];
    let mut q_decayed = vec![0f32; chunk * dk];
    let mut k_decayed_t = vec![0f32; dk * chunk];
    let mut c0 = 0;
    while c0 < tokens {
        let len = chunk.min(tokens - c0);
        let qc = &q[c0 * dk..(c0 + len) * dk];
        let kc = &k[c0 * dk..(c0 + len) * dk];
        let bc = &beta[c0..c0 + len];
        let mut acc = 0f32;
        for (cu, &gv) in cum.iter_mut().zip(&g[c0..c0 + len]) {
            acc += gv;
            *cu = acc;
        }
        let cum = &cum[..len];
        // K^T of the chunk, [dk, len].
        for (r, row) in kc.chunks_exact(dk).enumerate() {
            for (kk, &x) in row.iter().enumerate() {
                k_t[kk * len + r] = x;
            }
        }
        let k_t = &k_t[..dk * len];
        // K K^T and Q K^T, [len, len].
        let gram_kk = &mut gram_kk[..len * len];
        let gram_qk = &mut gram_qk[..len * len];
        gram_kk.fill(0.0);
        gram_qk.fill(0.0);
        // Only the lower triangle is used: each block of TRIANGLE_ROWS rows is
        // multiplied up to its diagonal, rounded up to the 32 columns of a register
        // tile (the blocks of whole 64-token chunks keep whole 8 x 32 tiles, and every
        // element computed is the same sum as the full product's). The rest stays zero.
        for (a, gram_out) in [(kc, &mut *gram_kk), (qc, &mut *gram_qk)] {
            let mut i0 = 0;
            while i0 < len {
                let rows = TRIANGLE_ROWS.min(len - i0);
                let product = Product {
                    m: rows,
                    k: dk,
                    n: len.min((i0 + rows).next_multiple_of(32)),
                    a: &a[i0 * dk..],
                    lda: dk,
                    b: k_t,
                    ldb: len,
                    alpha: 1.0,
                };
                matmul_acc::<FUSED>(&product, &mut gram_out[i0 * len..], len);
                i0 += rows;
            }
        }
        // M[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) for j < i, in place of K K^T;
        // P[i, j] = exp(G_i - G_j) (q_i . k_j) for j <= i, zero above, in place of Q K^T.
        // G decreases along the chunk (g <= 0), so the exponent is <= 0 on and below the
        // diagonal (above it the clamped value is masked), and the branch-free exp
        // vectorizes along the row.
        for (i, (kk_row, qk_row)) in gram_kk
            .chunks_exact_mut(len)
            .zip(gram_qk.chunks_exact_mut(len))
            .enumerate()
        {
            let (gi, bi) = (cum[i], bc[i]);
            for (j, ((m, p), &gj)) in kk_row
                .iter_mut()
                .zip(qk_row.iter_mut())
                .zip(cum)
                .enumerate()
            {
                let d = exp_nonpositive::<FUSED>(gi - gj);
                *m *= if j < i { bi * d } else { 0.0 };
                *p *= if j <= i { d } else { 0.0 };
            }
        }
        // Forward substitution: (I + M) U = diag(beta) V, (I + M) W = diag(beta e^G) K,
        // in blocks of SOLVE_BLOCK rows: the rows above a block enter it through one
        // product each for U and W, and only the rows inside the block go one by one.
        let u = &mut u[..len * dv];
        let w = &mut w[..len * dk];
        let mut i0 = 0;
        while i0 < len {
            let i1 = len.min(i0 + SOLVE_BLOCK);
            for i in i0..i1 {
                for (x, &vv) in u[i * dv..(i + 1) * dv]
                    .iter_mut()
                    .zip(&v[(c0 + i) * v_stride..][..dv])
                {
                    *x = bc[i] * vv;
                }
                let bw = bc[i] * cum[i].exp();
                for (x, &kv) in w[i * dk..(i + 1) * dk]
                    .iter_mut()
                    .zip(&kc[i * dk..(i + 1) * dk])
                {
                    *x = bw * kv;
                }
            }
            if i0 > 0 {
                let (done_u, block_u) = u.split_at_mut(i0 * dv);
                let (done_w, block_w) = w.split_at_mut(i0 * dk);
                for (done, block, width) in [(&*done_u, block_u, dv), (&*done_w, block_w, dk)] {
                    matmul_acc::<FUSED>(
                        &Product {
                            m: i1 - i0,
                            k: i0,
                            n: width,
                            a: &gram_kk[i0 * len..],
                            lda: len,
                            b: done,
                            ldb: width,
                            alpha: -1.0,
                        },
                        block,
                        width,
                    );
                }
            }
            for i in i0 + 1..i1 {
                let (done_u, rest_u) = u.split_at_mut(i * dv);
                let ui = &mut rest_u[..dv];
                let (done_w, rest_w) = w.split_at_mut(i * dk);
                let wi = &mut rest_w[..dk];
                for l in i0..i {
                    let mil = gram_kk[i * len + l];
                    axpy::<FUSED>(-mil, &done_u[l * dv..(l + 1) * dv], ui);
                    axpy::<FUSED>(-mil, &done_w[l * dk..(l + 1) * dk], wi);
                }
            }
            i0 = i1;
        }
        // V' = U - W S.
        matmul_acc::<FUSED>(
            &Product {
                m: len,
                k: dk,
                n: dv,
                a: w,
                lda: dk,
                b: &state,
                ldb: dv,
                alpha: -1.0,
            },
            u,
            dv,
        );
        // O = diag(e^G) Q S + P V'.
        let q_decayed = &mut q_decayed[..len * dk];
        for ((dst, src), &cu) in q_decayed
            .chunks_exact_mut(dk)
            .zip(qc.chunks_exact(dk))
            .zip(cum)
        {
            let e = cu.exp();
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = e * s;
            }
        }
        let oc = &mut out[c0 * dv..(c0 + len) * dv];
        matmul_acc::<FUSED>(
            &Product {
                m: len,
                k: dk,
                n: dv,
                a: q_decayed,
                lda: dk,
                b: &state,
                ldb: dv,
                alpha: 1.0,
            },
            oc,
            dv,
        );
        // P is lower triangular: row block i0 .. i0 + rows reads V' rows 0 .. i0 + rows
        // only (the terms left out are exact zeros).
        let mut i0 = 0;
        while i0 < len {
            let rows = TRIANGLE_ROWS.min(len - i0);
            matmul_acc::<FUSED>(
                &Product {
                    m: rows,
                    k: i0 + rows,
                    n: dv,
                    a: &gram_qk[i0 * len..],
                    lda: len,
                    b: u,
                    ldb: dv,
                    alpha: 1.0,
                },
                &mut oc[i0 * dv..],
                dv,
            );
            i0 += rows;
        }
        // S <- e^{G_last} S + (K * e^{G_last - G})^T V'.
        let last = cum[len - 1];
        let e_last = last.exp();
        for s in state.iter_mut() {
            *s *= e_last;
        }
        let k_decayed_t = &mut k_decayed_t[..dk * len];
        for (r, row) in kc.chunks_exact(dk).enumerate() {
            let e = (last - cum[r]).exp();
            for (kk, &x) in row.iter().enumerate() {
                k_decayed_t[kk * len + r] = e * x;
            }
        }
        matmul_acc::<FUSED>(
            &Product {
                m: dk,
                k: len,
                n: dv,
                a: k_decayed_t,
                lda: len,
                b: u,
                ldb: dv,
                alpha: 1.0,
            },
            &mut state,
            dv,
        );
        c0 += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gated_delta_rule;

    /// Deterministic values in `[-scale, scale)`.
    fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(seed.wrapping_mul(40_503));
                let x = x ^ (x >> 15);
                ((x >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }

    fn check(dims: DeltaRuleDims, chunk: usize) {
        let t = dims.tokens;
        let q = values(t * dims.key_heads * dims.key_dim, 1, 1.0);
        let k = values(t * dims.key_heads * dims.key_dim, 2, 1.0);
        let v = values(t * dims.value_heads * dims.value_dim, 3, 2.0);
        // Log decays in [-2, 0) and betas in (0, 1), as softplus / sigmoid give them.
        let decay: Vec<f32> = values(t * dims.value_heads, 4, 1.0)
            .iter()
            .map(|x| x - 1.0)
            .collect();
        let beta: Vec<f32> = values(t * dims.value_heads, 5, 1.0)
            .iter()
            .map(|x| 0.5 + 0.49 * x)
            .collect();
        let recurrent = gated_delta_rule(&q, &k, &v, &decay, &beta, dims);
        let chunked = gated_delta_rule_chunked(&q, &k, &v, &decay, &beta, dims, chunk);
        assert_eq!(recurrent.len(), chunked.len());
        let largest = recurrent.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (a, b)) in chunked.iter().zip(&recurrent).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * largest.max(1.0),
                "chunk {chunk}, element {i}: {a} vs {b} (largest {largest})"
            );
        }
    }

    #[test]
    fn chunked_equals_the_token_by_token_recurrence() {
        // 150 tokens: two whole chunks of 64 and a partial one of 22; dims not multiples
        // of the 16-wide tiles, and grouped value heads.
        let dims = DeltaRuleDims {
            tokens: 150,
            key_heads: 2,
            value_heads: 4,
            key_dim: 24,
            value_dim: 20,
        };
        for chunk in [1, 7, 64, 150, 256] {
            check(dims, chunk);
        }
        // Tile-aligned dims, as the demo model's (64 x 64).
        check(
            DeltaRuleDims {
                tokens: 130,
                key_heads: 1,
                value_heads: 2,
                key_dim: 64,
                value_dim: 64,
            },
            DELTA_RULE_CHUNK,
        );
    }

    #[test]
    fn chunked_reproduces_the_two_token_hand_computation() {
        // The case of ops::tests::delta_rule_two_tokens_by_hand, in one chunk of 2.
        let dims = DeltaRuleDims {
            tokens: 2,
            key_heads: 1,
            value_heads: 1,
            key_dim: 2,
            value_dim: 1,
        };
        let o = gated_delta_rule_chunked(
            &[1.0, 0.0, 0.0, 1.0],
            &[1.0, 0.0, 3.0, 4.0],
            &[2.0, 1.0],
            &[0.0, 0.5f32.ln()],
            &[0.5, 1.0],
            dims,
            DELTA_RULE_CHUNK,
        );
        let r2 = 2f32.sqrt();
        assert!((o[0] - 1.0 / r2).abs() < 1e-5, "{}", o[0]);
        assert!((o[1] - 0.56 / r2).abs() < 1e-5, "{}", o[1]);
    }
}
