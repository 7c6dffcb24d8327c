//! The sequential parts of Gated DeltaNet on plain row-major slices: the causal
//! depthwise convolution and the gated delta rule token by token (the definition the
//! chunked form of [`crate::chunked`], which the forward pass runs, is checked
//! against).

/// `log(1 + e^x)` as torch's `F.softplus` (beta 1, threshold 20) computes it.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// `x * sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `1 / (1 + e^-x)`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Causal depthwise convolution followed by SiLU, as Gated DeltaNet applies it to
/// the `in_proj_qkv` output.
///
/// `x` is `[tokens, channels]` row-major, `weight` is `[channels, kernel]` (the
/// checkpoint's `[channels, 1, kernel]` squeezed). With left zero padding of
/// `kernel - 1`, `out[t, c] = silu(sum_j weight[c, j] * x[t - (kernel - 1) + j, c])`:
/// the last tap multiplies the current token, as torch's cross-correlation does.
pub fn causal_conv1d_silu(x: &[f32], channels: usize, weight: &[f32], kernel: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    causal_conv1d_silu_into(x, channels, weight, kernel, &mut out);
    out
}

/// [`causal_conv1d_silu`] into `out` (`x`'s length; overwritten).
pub fn causal_conv1d_silu_into(
    x: &[f32],
    channels: usize,
    weight: &[f32],
    kernel: usize,
    out: &mut [f32],
) {
    let mut weight_t = vec![0f32; kernel * channels];
    for (c, taps) in weight.chunks_exact(kernel).enumerate().take(channels) {
        for (j, &w) in taps.iter().enumerate() {
            weight_t[j * channels + c] = w;
        }
    }
    out.fill(0.0);
    crate::small_matmul::causal_conv_silu(x, &weight_t, kernel, out);
}

/// `x / sqrt(sum x^2 + eps)` in place (FLA's l2norm with eps inside the root).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let inv = inverse_l2_norm(x, eps);
    for v in x {
        *v *= inv;
    }
}

/// `1 / sqrt(sum x^2 + eps)`, the factor [`l2_normalize`] multiplies by.
pub fn inverse_l2_norm(x: &[f32], eps: f32) -> f32 {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (sum + eps).sqrt()
}

/// Dimensions of one gated delta rule call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRuleDims {
    /// Sequence length.
    pub tokens: usize,
    /// Key (and query) heads.
    pub key_heads: usize,
    /// Value heads: a multiple of `key_heads`; key head `j` serves value heads
    /// `j * r .. (j + 1) * r` with `r = value_heads / key_heads` (repeat_interleave).
    pub value_heads: usize,
    /// Key head dimension.
    pub key_dim: usize,
    /// Value head dimension.
    pub value_dim: usize,
}

/// The gated delta rule over a whole sequence from a zero state.
///
/// Inputs are row-major: `query`, `key` `[tokens, key_heads, key_dim]` (raw: this
/// function l2-normalizes them and scales the query by `1/sqrt(key_dim)`), `value`
/// `[tokens, value_heads, value_dim]`, `decay` (log-space `g <= 0`) and `beta`
/// `[tokens, value_heads]`. Per value head, with state `S` of shape `[key_dim, value_dim]`:
///
/// ```text
/// S <- exp(g_t) S
/// S <- S + k_t (beta_t (v_t - S^T k_t))^T
/// o_t = S^T q_t
/// ```
///
/// Returns `o` as `[tokens, value_heads, value_dim]`.
pub fn gated_delta_rule(
    query: &[f32],
    key: &[f32],
    value: &[f32],
    decay: &[f32],
    beta: &[f32],
    dims: DeltaRuleDims,
) -> Vec<f32> {
    let DeltaRuleDims {
        tokens,
        key_heads,
        value_heads,
        key_dim: dk,
        value_dim: dv,
    } = dims;
    let group = value_heads / key_heads;
    let scale = 1.0 / (dk as f32).sqrt();
    // Normalized queries and keys, once per key head.
    let mut q = query.to_vec();
    let mut k = key.to_vec();
    for row in q.chunks_exact_mut(dk) {
        l2_normalize(row, 1e-6);
        for v in row.iter_mut() {
            *v *= scale;
        }
    }
    for row in k.chunks_exact_mut(dk) {
        l2_normalize(row, 1e-6);
    }
    let mut out = vec![0f32; tokens * value_heads * dv];
    let mut state = vec![0f32; dk * dv];
    let mut delta = vec![0f32; dv];
    for h in 0..value_heads {
        let kh = h / group;
        state.fill(0.0);
        for t in 0..tokens {
            let qt = &q[(t * key_heads + kh) * dk..][..dk];
            let kt = &k[(t * key_heads + kh) * dk..][..dk];
            let vt = &value[(t * value_heads + h) * dv..][..dv];
            let g = decay[t * value_heads + h].exp();
            let b = beta[t * value_heads + h];
            for s in state.iter_mut() {
                *s *= g;
            }
            // delta = beta (v - S^T k)
            delta.copy_from_slice(vt);
            for (i, &ki) in kt.iter().enumerate() {
                let srow = &state[i * dv..(i + 1) * dv];
                for (d, &s) in delta.iter_mut().zip(srow) {
                    *d -= ki * s;
                }
            }
            for d in delta.iter_mut() {
                *d *= b;
            }
            // S += k delta^T, and o = S^T q
            let ot = &mut out[(t * value_heads + h) * dv..][..dv];
            for i in 0..dk {
                let srow = &mut state[i * dv..(i + 1) * dv];
                let (ki, qi) = (kt[i], qt[i]);
                for ((s, &d), o) in srow.iter_mut().zip(delta.iter()).zip(ot.iter_mut()) {
                    *s += ki * d;
                    *o += qi * *s;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softplus_matches_closed_forms() {
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        assert!((softplus(-5.0) - (1.0 + (-5f32).exp()).ln()).abs() < 1e-9);
    }

    #[test]
    fn conv_taps_are_causal_with_last_tap_on_current_token() {
        // One channel, kernel 3 with taps [a, b, c]: out[t] = silu(a x[t-2] + b x[t-1] + c x[t]).
        let x = [1.0, 2.0, 3.0];
        let w = [0.5, -1.0, 2.0];
        let out = causal_conv1d_silu(&x, 1, &w, 3);
        let pre = [
            2.0 * 1.0,
            -1.0 + 2.0 * 2.0,
            0.5 * 1.0 - 1.0 * 2.0 + 2.0 * 3.0,
        ];
        for (o, p) in out.iter().zip(pre) {
            assert!((o - silu(p)).abs() < 1e-6, "{o} vs {}", silu(p));
        }
    }

    #[test]
    fn conv_in_parallel_pieces_equals_the_definition() {
        // 70 channels x 600 tokens: 42,000 values, more than one parallel piece, the
        // pieces starting mid-prompt (their first tokens read the previous piece's).
        let (channels, tokens, kernel) = (70, 600, 4);
        let value = |i: usize| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0;
        let x: Vec<f32> = (0..channels * tokens).map(value).collect();
        let w: Vec<f32> = (0..channels * kernel).map(|i| value(i + 7)).collect();
        let out = causal_conv1d_silu(&x, channels, &w, kernel);
        for t in 0..tokens {
            for c in 0..channels {
                let pre: f64 = (0..kernel)
                    .filter_map(|j| {
                        let src = (t + j).checked_sub(kernel - 1)?;
                        Some(f64::from(w[c * kernel + j]) * f64::from(x[src * channels + c]))
                    })
                    .sum();
                let want = pre / (1.0 + (-pre).exp());
                let got = f64::from(out[t * channels + c]);
                assert!(
                    (got - want).abs() < 1e-5,
                    "token {t} channel {c}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn delta_rule_two_tokens_by_hand() {
        // key_dim 2, value_dim 1, one head. Token 0: q = k = e1 (already unit), v = 2,
        // beta = 0.5, g = 0 (no decay). S = 0 -> delta = 0.5 * 2 = 1 -> S = [1, 0]^T.
        // o_0 = S^T q / sqrt(2) = 1 / sqrt(2).
        // Token 1: q = e2, k = (3, 4) -> normalized (0.6, 0.8), v = 1, beta = 1,
        // g = ln(0.5): S = [0.5, 0]; S^T k = 0.3; delta = 1 - 0.3 = 0.7;
        // S = [0.5 + 0.42, 0.56]; o_1 = 0.56 / sqrt(2).
        let dims = DeltaRuleDims {
            tokens: 2,
            key_heads: 1,
            value_heads: 1,
            key_dim: 2,
            value_dim: 1,
        };
        let q = [1.0, 0.0, 0.0, 1.0];
        let k = [1.0, 0.0, 3.0, 4.0];
        let v = [2.0, 1.0];
        let g = [0.0, 0.5f32.ln()];
        let beta = [0.5, 1.0];
        let o = gated_delta_rule(&q, &k, &v, &g, &beta, dims);
        let r2 = 2f32.sqrt();
        // l2norm's eps (1e-6 inside the root) moves results by ~5e-7 relative.
        assert!((o[0] - 1.0 / r2).abs() < 1e-5, "{}", o[0]);
        assert!((o[1] - 0.56 / r2).abs() < 1e-5, "{}", o[1]);
    }

    #[test]
    fn key_head_serves_consecutive_value_heads() {
        // Two key heads, four value heads: value heads 0,1 use key head 0, 2,3 key head 1.
        // One token, zero decay, beta 1: o_h = (q_kh . k_kh) v_h / sqrt(dk).
        let dims = DeltaRuleDims {
            tokens: 1,
            key_heads: 2,
            value_heads: 4,
            key_dim: 2,
            value_dim: 1,
        };
        let q = [1.0, 0.0, 1.0, 0.0];
        let k = [1.0, 0.0, 0.0, 1.0]; // head 0 aligned with q, head 1 orthogonal
        let v = [1.0, 2.0, 3.0, 4.0];
        let o = gated_delta_rule(&q, &k, &v, &[0.0; 4], &[1.0; 4], dims);
        let r2 = 2f32.sqrt();
        let expected = [1.0 / r2, 2.0 / r2, 0.0, 0.0];
        for (a, b) in o.iter().zip(expected) {
            assert!((a - b).abs() < 1e-5, "{o:?}");
        }
    }
}
