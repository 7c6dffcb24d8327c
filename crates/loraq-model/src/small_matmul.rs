//! Small dense products and elementwise helpers for the token mixers (the chunked
//! delta rule, blocked attention), written as plain loops for the compiler to
//! vectorize: callers compile them inside a `#[target_feature]` function (AVX-512 or
//! AVX2 + FMA, picked at run time by [`Simd::detect`]), where `FUSED = true` turns
//! every multiply-add into one FMA instruction.
//!
//! Generic dense-matrix names (`m`, `k`, `n`) are used here as in BLAS: `C[m, n] +=
//! alpha A[m, k] B[k, n]`, all row-major.

/// The widest vector instruction set the mixers' loops are compiled for.
// Only x86_64 builds dispatch on it; elsewhere the portable loops run directly.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Simd {
    /// Portable code (whatever the build's baseline target vectorizes to).
    Baseline,
    /// AVX2 + FMA.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512F (+ FMA).
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Simd {
    /// The widest set this CPU has (the detection is cached by the standard library).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
                return Simd::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Simd::Avx2;
            }
        }
        Simd::Baseline
    }
}

/// Defines `$name`, which runs `$body_fn::<FUSED>` compiled for the widest instruction
/// set [`Simd::detect`] finds (`FUSED = true` on AVX-512 and AVX2 + FMA, whose
/// variants are `#[target_feature]` functions so the loops inlined into them vectorize
/// to those widths).
macro_rules! dispatch_simd {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body_fn:ident) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,fma")]
                unsafe fn on_avx512($($arg: $ty),*) $(-> $ret)? {
                    $body_fn::<true>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn on_avx2($($arg: $ty),*) $(-> $ret)? {
                    $body_fn::<true>($($arg),*)
                }
                match $crate::small_matmul::Simd::detect() {
                    // SAFETY: the CPU has AVX-512F and FMA (Simd::detect checked).
                    $crate::small_matmul::Simd::Avx512 => return unsafe { on_avx512($($arg),*) },
                    // SAFETY: the CPU has AVX2 and FMA (Simd::detect checked).
                    $crate::small_matmul::Simd::Avx2 => return unsafe { on_avx2($($arg),*) },
                    $crate::small_matmul::Simd::Baseline => {}
                }
            }
            $body_fn::<false>($($arg),*)
        }
    };
}
pub(crate) use dispatch_simd;

/// `a * b + c`, fused when the instruction set has FMA (`FUSED`), else two roundings
/// (a fused multiply-add without the instruction is a slow library call).
#[inline(always)]
pub(crate) fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED { a.mul_add(b, c) } else { a * b + c }
}

/// `y += a * x` over the common length.
#[inline(always)]
pub(crate) fn axpy<const FUSED: bool>(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = madd::<FUSED>(a, x, *y);
    }
}

/// Row-major operands of a small product `C += alpha A B`: `A` `[m, k]` with row
/// stride `lda`, `B` `[k, n]` with row stride `ldb`.
pub(crate) struct Product<'a> {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub a: &'a [f32],
    pub lda: usize,
    pub b: &'a [f32],
    pub ldb: usize,
    pub alpha: f32,
}

/// `C += alpha A B` (`C` with row stride `ldc`) in tiles of 4 rows x 16 columns whose
/// accumulators stay in registers (four vectors on AVX-512, eight on AVX2), the rest
/// row by row.
#[inline(always)]
pub(crate) fn matmul_acc<const FUSED: bool>(p: &Product<'_>, c: &mut [f32], ldc: usize) {
    const ROWS: usize = 4;
    const COLS: usize = 16;
    let Product {
        m,
        k,
        n,
        a,
        lda,
        b,
        ldb,
        alpha,
    } = *p;
    let whole_cols = n / COLS * COLS;
    let mut i0 = 0;
    while i0 + ROWS <= m {
        let mut j0 = 0;
        while j0 < whole_cols {
            let mut acc = [[0f32; COLS]; ROWS];
            for kk in 0..k {
                let brow: &[f32; COLS] = b[kk * ldb + j0..][..COLS].try_into().expect("16");
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let av = alpha * a[(i0 + r) * lda + kk];
                    for (x, &bv) in acc_r.iter_mut().zip(brow) {
                        *x = madd::<FUSED>(av, bv, *x);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let crow = &mut c[(i0 + r) * ldc + j0..][..COLS];
                for (cv, &x) in crow.iter_mut().zip(acc_r) {
                    *cv += x;
                }
            }
            j0 += COLS;
        }
        i0 += ROWS;
    }
    // Leftover rows (all columns), then leftover columns of the tiled rows.
    for i in 0..m {
        let cols = if i < i0 { whole_cols..n } else { 0..n };
        if cols.is_empty() {
            continue;
        }
        for kk in 0..k {
            let av = alpha * a[i * lda + kk];
            axpy::<FUSED>(
                av,
                &b[kk * ldb + cols.start..kk * ldb + cols.end],
                &mut c[i * ldc + cols.start..i * ldc + cols.end],
            );
        }
    }
}

/// `e^x` for `x <= 0` (as softmax and decays use it; larger `x` is clamped to 0),
/// branch-free so that a loop of it vectorizes: `x = n ln2 + r` with `|r| <= ln2 / 2`,
/// `e^r` by its degree-6 Taylor polynomial (relative error below 2e-7 on that range),
/// times `2^n` built in the exponent bits. Underflows to 0 below `-87.3`.
#[inline(always)]
pub(crate) fn exp_nonpositive<const FUSED: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n * LN2_HI is exact for |n| < 2^8.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let clamped = x.clamp(-87.3, 0.0);
    let n = madd::<FUSED>(clamped, LOG2E, ROUND) - ROUND;
    let r = madd::<FUSED>(n, -LN2_LO, madd::<FUSED>(n, -LN2_HI, clamped));
    let mut p = 1.0 / 720.0;
    p = madd::<FUSED>(p, r, 1.0 / 120.0);
    p = madd::<FUSED>(p, r, 1.0 / 24.0);
    p = madd::<FUSED>(p, r, 1.0 / 6.0);
    p = madd::<FUSED>(p, r, 0.5);
    p = madd::<FUSED>(p, r, 1.0);
    p = madd::<FUSED>(p, r, 1.0);
    // n is an integer in [-126, 0]: 2^n is a normal f32.
    let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.3 { 0.0 } else { p * two_n }
}

/// `1 / (1 + e^-x)` through [`exp_nonpositive`] of `-|x|` (so it never overflows),
/// branch-free: with `t = e^-|x|`, `1 / (1 + t)` for `x >= 0` and `t / (1 + t)` below.
#[inline(always)]
pub(crate) fn sigmoid_fast<const FUSED: bool>(x: f32) -> f32 {
    let t = exp_nonpositive::<FUSED>(-x.abs());
    let numerator = if x >= 0.0 { 1.0 } else { t };
    numerator / (1.0 + t)
}

#[inline(always)]
fn silu_mul_body<const FUSED: bool>(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g * sigmoid_fast::<FUSED>(*g) * u;
    }
}

dispatch_simd!(
    /// `gate <- silu(gate) * up` elementwise (the MLP's activation), vectorized.
    pub(crate) fn silu_mul(gate: &mut [f32], up: &[f32]) = silu_mul_body
);

#[inline(always)]
fn sigmoid_mul_body<const FUSED: bool>(x: &mut [f32], gate: &[f32]) {
    for (v, &g) in x.iter_mut().zip(gate) {
        *v *= sigmoid_fast::<FUSED>(g);
    }
}

dispatch_simd!(
    /// `x <- x * sigmoid(gate)` elementwise (attention's output gate), vectorized.
    pub(crate) fn sigmoid_mul(x: &mut [f32], gate: &[f32]) = sigmoid_mul_body
);

#[inline(always)]
fn rms_norm_body<const FUSED: bool>(x: &mut [f32], scale: &[f32], eps: f32) {
    let width = scale.len();
    for row in x.chunks_exact_mut(width) {
        // Sixteen partial sums so the loop vectorizes.
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for (l, &v) in lanes.iter_mut().zip(c) {
                *l = madd::<FUSED>(v, v, *l);
            }
        }
        let mut sum: f32 = lanes.iter().sum();
        for &v in chunks.remainder() {
            sum = madd::<FUSED>(v, v, sum);
        }
        let inv = 1.0 / (sum / width as f32 + eps).sqrt();
        for (v, &w) in row.iter_mut().zip(scale) {
            *v = *v * inv * w;
        }
    }
}

dispatch_simd!(
    /// `x <- x / sqrt(mean(x^2) + eps) * scale` for every row of `x` (`scale.len()`
    /// wide), vectorized.
    pub(crate) fn rms_norm_rows(x: &mut [f32], scale: &[f32], eps: f32) = rms_norm_body
);

#[inline(always)]
fn causal_conv_silu_body<const FUSED: bool>(
    x: &[f32],
    weight_t: &[f32],
    kernel: usize,
    out: &mut [f32],
) {
    let channels = weight_t.len() / kernel;
    for (t, row) in out.chunks_exact_mut(channels).enumerate() {
        for j in 0..kernel {
            // Input token t - (kernel - 1) + j; skipped when before the start.
            let Some(src) = (t + j).checked_sub(kernel - 1) else {
                continue;
            };
            let taps = &weight_t[j * channels..(j + 1) * channels];
            let xs = &x[src * channels..(src + 1) * channels];
            for ((o, &w), &v) in row.iter_mut().zip(taps).zip(xs) {
                *o = madd::<FUSED>(w, v, *o);
            }
        }
        for o in row.iter_mut() {
            *o *= sigmoid_fast::<FUSED>(*o);
        }
    }
}

dispatch_simd!(
    /// The causal depthwise convolution + SiLU of [`crate::ops::causal_conv1d_silu`]
    /// with the taps transposed (`weight_t` `[kernel, channels]`) so every loop runs
    /// along channels; `out` (`x`'s shape) must be zero.
    pub(crate) fn causal_conv_silu(
        x: &[f32],
        weight_t: &[f32],
        kernel: usize,
        out: &mut [f32],
    ) = causal_conv_silu_body
);

#[cfg(test)]
mod tests {
    use super::*;

    fn product_body<const FUSED: bool>(p: &Product<'_>, c: &mut [f32], ldc: usize) {
        matmul_acc::<FUSED>(p, c, ldc)
    }
    dispatch_simd!(fn run_product(p: &Product<'_>, c: &mut [f32], ldc: usize) = product_body);
    dispatch_simd!(fn run_exp(x: f32) -> f32 = exp_nonpositive);

    #[test]
    fn product_equals_the_triple_loop() {
        // 7 x 5 times 5 x 37: whole 4 x 16 tiles, leftover rows and columns; alpha -2.
        let (m, k, n) = (7, 5, 37);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 - 5.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.5 - 1.0).collect();
        let mut c: Vec<f32> = (0..m * n).map(|i| i as f32).collect();
        let mut expected = c.clone();
        for i in 0..m {
            for j in 0..n {
                let dot: f32 = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
                expected[i * n + j] += -2.0 * dot;
            }
        }
        let p = Product {
            m,
            k,
            n,
            a: &a,
            lda: k,
            b: &b,
            ldb: n,
            alpha: -2.0,
        };
        run_product(&p, &mut c, n);
        // Small integers and halves: every product and sum is exact.
        assert_eq!(c, expected);
    }

    #[test]
    fn exp_matches_the_standard_library() {
        let mut worst = 0f32;
        for i in 0..=100_000 {
            let x = -87.0 * i as f32 / 100_000.0;
            let ours = run_exp(x);
            let exact = (x as f64).exp() as f32;
            worst = worst.max((ours - exact).abs() / exact);
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive::<false>(0.0), 1.0);
        assert_eq!(exp_nonpositive::<false>(-200.0), 0.0);
        assert_eq!(exp_nonpositive::<false>(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn silu_and_sigmoid_match_their_definitions() {
        let xs: Vec<f32> = (-4000..=4000).map(|i| i as f32 * 0.01).collect();
        let mut gate = xs.clone();
        silu_mul(&mut gate, &vec![2.0; xs.len()]);
        let mut gated = vec![3.0; xs.len()];
        sigmoid_mul(&mut gated, &xs);
        for ((&x, &g), &s) in xs.iter().zip(&gate).zip(&gated) {
            let sig = 1.0 / (1.0 + (-(x as f64)).exp());
            let (silu2, sig3) = (2.0 * x as f64 * sig, 3.0 * sig);
            assert!(
                (g as f64 - silu2).abs() <= 1e-6 * (1.0 + silu2.abs()),
                "silu({x})"
            );
            assert!((s as f64 - sig3).abs() <= 1e-6 * sig3, "sigmoid({x})");
        }
    }
}
