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

/// Runs `head(h, out)` for every head `h < heads` in parallel on rayon's pool, each
/// filling its own `[tokens, dim]` block of `scratch` (head-major, so every task owns a
/// contiguous slice; zeroed by the task before `head` runs), and writes the blocks
/// interleaved token-major into `out` (`[tokens, heads, dim]`, the layout the linear
/// after a token mixer reads), that copy too in parallel pieces of whole tokens. The
/// scaffold of tiled attention and of the chunked delta rule. `scratch` is grown to
/// `heads * tokens * dim` and reused, so repeated calls fault in no fresh pages.
pub(crate) fn per_head_parallel_into<F>(
    tokens: usize,
    heads: usize,
    dim: usize,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
    head: F,
) where
    F: Fn(usize, &mut [f32]) + Sync,
{
    use rayon::prelude::*;
    let block = tokens * dim;
    let width = heads * dim;
    assert_eq!(
        out.len(),
        tokens * width,
        "per-head output of another shape"
    );
    if block == 0 {
        return;
    }
    if scratch.len() < heads * block {
        scratch.resize(heads * block, 0.0);
    }
    let head_major = &mut scratch[..heads * block];
    head_major
        .par_chunks_mut(block)
        .enumerate()
        .for_each(|(h, head_out)| {
            head_out.fill(0.0);
            head(h, head_out)
        });
    let head_major = &*head_major;
    let piece_tokens = ELEMENTWISE_PIECE.div_ceil(width).max(1);
    out.par_chunks_mut(piece_tokens * width)
        .enumerate()
        .for_each(|(piece, rows)| {
            let t0 = piece * piece_tokens;
            for (i, row) in rows.chunks_exact_mut(width).enumerate() {
                let t = t0 + i;
                for (h, dst) in row.chunks_exact_mut(dim).enumerate() {
                    dst.copy_from_slice(&head_major[h * block + t * dim..][..dim]);
                }
            }
        });
}

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

/// `C += alpha A B` (`C` with row stride `ldc`) in register tiles: on AVX-512, 8 rows x
/// 32 columns (16 accumulators, enough independent FMA chains to keep both FMA units
/// busy, where 4 x 16 left them waiting on latency), then 4 x 16 tiles (four vectors on
/// AVX-512, eight on AVX2, which has 16 registers only) for what is left, the last
/// rows and columns one by one. `alpha` scales each tile's sum once, when it is added
/// to `C`.
#[inline(always)]
pub(crate) fn matmul_acc<const FUSED: bool>(p: &Product<'_>, c: &mut [f32], ldc: usize) {
    #[cfg(target_arch = "x86_64")]
    if FUSED && Simd::detect() == Simd::Avx512 {
        let (row_end, col_end) = cover_tiles::<FUSED, 8, 32>(p, c, ldc, 0..p.m, 0..p.n);
        // The right strip beside the wide tiles, then the rows below them.
        matmul_acc_narrow::<FUSED>(p, c, ldc, 0..row_end, col_end..p.n);
        matmul_acc_narrow::<FUSED>(p, c, ldc, row_end..p.m, 0..p.n);
        return;
    }
    matmul_acc_narrow::<FUSED>(p, c, ldc, 0..p.m, 0..p.n);
}

/// Where [`matmul_acc`]'s register tiles end along row `i` of an `m x n` product: its
/// columns `0 .. end` are summed in a tile (an accumulator from zero over `k`, then
/// added to `C` times `alpha`), the columns from `end` one `axpy` per step of `k`
/// (`C += (alpha a_ik) B[k, ..]`). The two round differently, so a row computed alone
/// has to follow the path its row took in the whole product.
#[inline(always)]
fn tiled_columns<const FUSED: bool>(m: usize, n: usize, i: usize) -> usize {
    let narrow = |rows: std::ops::Range<usize>, cols: std::ops::Range<usize>| {
        // matmul_acc_narrow: 4 x 16 tiles from the block's top left corner.
        let row_end = rows.start + rows.len() / 4 * 4;
        if rows.contains(&i) && i < row_end {
            cols.start + cols.len() / 16 * 16
        } else {
            cols.start
        }
    };
    #[cfg(target_arch = "x86_64")]
    if FUSED && Simd::detect() == Simd::Avx512 {
        let (row_end, col_end) = (m / 8 * 8, n / 32 * 32);
        return if i < row_end {
            // The 8 x 32 tiles, then the narrow strip beside them (rows 0 .. row_end,
            // a multiple of 4: every row of it is in a 4 x 16 tile).
            narrow(0..row_end, col_end..n)
        } else {
            narrow(row_end..m, 0..n)
        };
    }
    narrow(0..m, 0..n)
}

/// One row of a product: row `i` of `C += alpha A B` for an `A` of `m` rows, `a_row`
/// being that row (`k` values) and `c_row` that row of `C` (`n` values).
pub(crate) struct RowProduct<'a> {
    pub m: usize,
    pub i: usize,
    pub k: usize,
    pub n: usize,
    pub a_row: &'a [f32],
    pub b: &'a [f32],
    pub ldb: usize,
    pub alpha: f32,
}

/// Row `p.i` of what [`matmul_acc`] adds to `C` for the whole `p.m`-row product, with
/// the same roundings in the same order (bit-identical), computing that row alone: the
/// last layer's attention runs one query a prompt where the whole pass ran them all.
#[inline(always)]
pub(crate) fn matmul_acc_row<const FUSED: bool>(p: &RowProduct<'_>, c_row: &mut [f32]) {
    let RowProduct {
        m,
        i,
        k,
        n,
        a_row,
        b,
        ldb,
        alpha,
    } = *p;
    let end = tiled_columns::<FUSED>(m, n, i);
    // The tiled columns, in blocks of an accumulator array (the tile's accumulator of
    // each column is its own chain over k, so the blocking changes no rounding).
    const BLOCK: usize = 64;
    let mut j0 = 0;
    while j0 < end {
        let width = BLOCK.min(end - j0);
        let mut acc = [0f32; BLOCK];
        let acc = &mut acc[..width];
        for (kk, &av) in a_row[..k].iter().enumerate() {
            let brow = &b[kk * ldb + j0..][..width];
            for (x, &bv) in acc.iter_mut().zip(brow) {
                *x = madd::<FUSED>(av, bv, *x);
            }
        }
        for (cv, &x) in c_row[j0..j0 + width].iter_mut().zip(acc.iter()) {
            *cv = madd::<FUSED>(alpha, x, *cv);
        }
        j0 += width;
    }
    if end < n {
        for (kk, &a) in a_row[..k].iter().enumerate() {
            axpy::<FUSED>(
                alpha * a,
                &b[kk * ldb + end..kk * ldb + n],
                &mut c_row[end..n],
            );
        }
    }
}

/// The `rows x cols` block of `C += alpha A B` in 4 x 16 tiles, the rest row by row.
#[inline(always)]
fn matmul_acc_narrow<const FUSED: bool>(
    p: &Product<'_>,
    c: &mut [f32],
    ldc: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) {
    if rows.is_empty() || cols.is_empty() {
        return;
    }
    let (row_end, col_end) = cover_tiles::<FUSED, 4, 16>(p, c, ldc, rows.clone(), cols.clone());
    // Leftover columns of the tiled rows, then the leftover rows (all columns).
    for i in rows.start..rows.end {
        let cols = if i < row_end {
            col_end..cols.end
        } else {
            cols.clone()
        };
        if cols.is_empty() {
            continue;
        }
        for kk in 0..p.k {
            let av = p.alpha * p.a[i * p.lda + kk];
            axpy::<FUSED>(
                av,
                &p.b[kk * p.ldb + cols.start..kk * p.ldb + cols.end],
                &mut c[i * ldc + cols.start..i * ldc + cols.end],
            );
        }
    }
}

/// Covers the `rows x cols` block of `C += alpha A B` with whole `ROWS x COLS` tiles
/// from its top left corner, each tile's accumulators in registers; returns where the
/// whole tiles end (`(row_end, col_end)`: rows `rows.start .. row_end` and columns
/// `cols.start .. col_end` are done).
#[inline(always)]
fn cover_tiles<const FUSED: bool, const ROWS: usize, const COLS: usize>(
    p: &Product<'_>,
    c: &mut [f32],
    ldc: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) -> (usize, usize) {
    let Product {
        k,
        a,
        lda,
        b,
        ldb,
        alpha,
        ..
    } = *p;
    let row_end = rows.start + rows.len() / ROWS * ROWS;
    let col_end = cols.start + cols.len() / COLS * COLS;
    #[cfg(target_arch = "x86_64")]
    if FUSED && row_end > rows.start && col_end > cols.start {
        // The register tiles on raw pointers: 8 x 32 only on matmul_acc's AVX-512 path
        // (Simd::detect found AVX-512F); 4 x 16 wherever the CPU has AVX2 and FMA
        // (FUSED: Simd::detect found AVX2 or AVX-512F and FMA).
        let on_pointers = match (ROWS, COLS) {
            (8, 32) => true,
            (4, 16) => is_x86_feature_detected!("avx2"),
            _ => false,
        };
        if on_pointers {
            // Every element the tiles read or write exists (each slice index below is
            // checked once here instead of in the inner loop).
            assert!(k == 0 || (row_end - 1) * lda + k <= a.len());
            assert!(k == 0 || (k - 1) * ldb + col_end <= b.len());
            assert!((row_end - 1) * ldc + col_end <= c.len());
            let mut i0 = rows.start;
            while i0 < row_end {
                let mut j0 = cols.start;
                while j0 < col_end {
                    let tile = TilePointers {
                        k,
                        a: a[i0 * lda..].as_ptr(),
                        lda,
                        b: b[j0..].as_ptr(),
                        ldb,
                        c: c[i0 * ldc + j0..].as_mut_ptr(),
                        ldc,
                        alpha,
                    };
                    // SAFETY: the tile's instruction set is present (above); rows
                    // i0 .. i0 + ROWS of A (k values each), rows 0 .. k of B (columns
                    // j0 .. j0 + COLS) and the ROWS x COLS block of C are in bounds
                    // (asserted above), C borrowed mutably.
                    unsafe {
                        if ROWS == 8 {
                            tile_8x32_avx512(&tile)
                        } else {
                            tile_4x16_avx2(&tile)
                        }
                    };
                    j0 += COLS;
                }
                i0 += ROWS;
            }
            return (row_end, col_end);
        }
    }
    let mut i0 = rows.start;
    while i0 < row_end {
        let mut j0 = cols.start;
        while j0 < col_end {
            let mut acc = [[0f32; COLS]; ROWS];
            for kk in 0..k {
                let brow: &[f32; COLS] = b[kk * ldb + j0..][..COLS].try_into().expect("COLS");
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let av = a[(i0 + r) * lda + kk];
                    for (x, &bv) in acc_r.iter_mut().zip(brow) {
                        *x = madd::<FUSED>(av, bv, *x);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let crow = &mut c[(i0 + r) * ldc + j0..][..COLS];
                for (cv, &x) in crow.iter_mut().zip(acc_r) {
                    *cv = madd::<FUSED>(alpha, x, *cv);
                }
            }
            j0 += COLS;
        }
        i0 += ROWS;
    }
    (row_end, col_end)
}

/// One register tile of `C += alpha A B` by raw pointers (the bounds are checked once by
/// the caller, so the inner loop of the 8 x 32 tile is two loads, eight broadcasts and
/// sixteen FMAs with no per-iteration index checks, which the slice-indexed loop
/// carried: eight compares and stack reloads per step of `k`). Same operations in the
/// same order as the portable tile loop, so the results are bit-identical.
#[cfg(target_arch = "x86_64")]
struct TilePointers {
    k: usize,
    /// `A[i0, 0]`; row `r` at `a + r * lda`.
    a: *const f32,
    lda: usize,
    /// `B[0, j0]`; row `kk` at `b + kk * ldb`.
    b: *const f32,
    ldb: usize,
    /// `C[i0, j0]`; row `r` at `c + r * ldc`.
    c: *mut f32,
    ldc: usize,
    alpha: f32,
}

/// Runs one 8 x 32 [`TilePointers`] tile.
///
/// # Safety
/// The CPU has AVX-512F; `a + r * lda + kk` (`r < 8`, `kk < k`), `b + kk * ldb + j`
/// (`j < 32`) are readable and `c + r * ldc + j` writable, with no other live reference
/// to the latter.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
// Intrinsics rather than plain arrays: written as arrays, the loop stored its sixteen
// accumulators to the stack at every step of k.
unsafe fn tile_8x32_avx512(t: &TilePointers) {
    use std::arch::x86_64::*;
    let zero = _mm512_setzero_ps();
    let mut acc = [[zero; 2]; 8];
    // SAFETY: every pointer below stays inside the ranges the caller guarantees.
    unsafe {
        let rows: [*const f32; 8] = std::array::from_fn(|r| t.a.add(r * t.lda));
        let mut brow = t.b;
        for kk in 0..t.k {
            let b0 = _mm512_loadu_ps(brow);
            let b1 = _mm512_loadu_ps(brow.add(16));
            for (acc_r, row) in acc.iter_mut().zip(&rows) {
                let av = _mm512_set1_ps(*row.add(kk));
                acc_r[0] = _mm512_fmadd_ps(av, b0, acc_r[0]);
                acc_r[1] = _mm512_fmadd_ps(av, b1, acc_r[1]);
            }
            brow = brow.add(t.ldb);
        }
        let alpha = _mm512_set1_ps(t.alpha);
        for (r, acc_r) in acc.iter().enumerate() {
            let crow = t.c.add(r * t.ldc);
            for (half, &x) in acc_r.iter().enumerate() {
                let dst = crow.add(16 * half);
                _mm512_storeu_ps(dst, _mm512_fmadd_ps(alpha, x, _mm512_loadu_ps(dst)));
            }
        }
    }
}

/// Runs one 4 x 16 [`TilePointers`] tile: two loads, four broadcasts and eight FMAs
/// per step of `k`. The portable loop it replaces (on AVX2, and for the narrow strips
/// on AVX-512) kept its accumulators in arrays indexed through slices, with a bounds
/// check per load; the same operations in the same order, so the results are
/// bit-identical (`one_row_alone_equals_its_row_of_the_whole_product` compares them
/// with the scalar row path bit for bit).
///
/// # Safety
/// The CPU has AVX2 and FMA; `a + r * lda + kk` (`r < 4`, `kk < k`), `b + kk * ldb + j`
/// (`j < 16`) are readable and `c + r * ldc + j` writable, with no other live reference
/// to the latter.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_4x16_avx2(t: &TilePointers) {
    use std::arch::x86_64::*;
    let zero = _mm256_setzero_ps();
    let mut acc = [[zero; 2]; 4];
    // SAFETY: every pointer below stays inside the ranges the caller guarantees.
    unsafe {
        let rows: [*const f32; 4] = std::array::from_fn(|r| t.a.add(r * t.lda));
        let mut brow = t.b;
        for kk in 0..t.k {
            let b0 = _mm256_loadu_ps(brow);
            let b1 = _mm256_loadu_ps(brow.add(8));
            for (acc_r, row) in acc.iter_mut().zip(&rows) {
                let av = _mm256_broadcast_ss(&*row.add(kk));
                acc_r[0] = _mm256_fmadd_ps(av, b0, acc_r[0]);
                acc_r[1] = _mm256_fmadd_ps(av, b1, acc_r[1]);
            }
            brow = brow.add(t.ldb);
        }
        let alpha = _mm256_set1_ps(t.alpha);
        for (r, acc_r) in acc.iter().enumerate() {
            let crow = t.c.add(r * t.ldc);
            for (half, &x) in acc_r.iter().enumerate() {
                let dst = crow.add(8 * half);
                _mm256_storeu_ps(dst, _mm256_fmadd_ps(alpha, x, _mm256_loadu_ps(dst)));
            }
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
    // `biased` is 1.5 * 2^23 + n exactly (ulp 1 in [2^23, 2^24)), n = round(x log2 e).
    let biased = madd::<FUSED>(clamped, LOG2E, ROUND);
    let n = biased - ROUND;
    let r = madd::<FUSED>(n, -LN2_LO, madd::<FUSED>(n, -LN2_HI, clamped));
    let mut p = 1.0 / 720.0;
    p = madd::<FUSED>(p, r, 1.0 / 120.0);
    p = madd::<FUSED>(p, r, 1.0 / 24.0);
    p = madd::<FUSED>(p, r, 1.0 / 6.0);
    p = madd::<FUSED>(p, r, 0.5);
    p = madd::<FUSED>(p, r, 1.0);
    p = madd::<FUSED>(p, r, 1.0);
    // n is an integer in [-126, 0]: 2^n is a normal f32, its exponent field n + 127
    // read from `biased`'s low bits with integer arithmetic (a float-to-int `as`
    // saturates and maps NaN to 0, which the compiler cannot vectorize: every exp of a
    // loop ran as scalar code).
    let two_n = f32::from_bits(
        biased
            .to_bits()
            .wrapping_sub(ROUND.to_bits())
            .wrapping_add(127)
            << 23,
    );
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
    /// [`silu_mul`] on the calling thread.
    fn silu_mul_serial(gate: &mut [f32], up: &[f32]) = silu_mul_body
);

/// `gate <- silu(gate) * up` elementwise (the MLP's activation), vectorized, in
/// parallel pieces on rayon's pool.
pub(crate) fn silu_mul(gate: &mut [f32], up: &[f32]) {
    par_pieces(gate, up, ELEMENTWISE_PIECE, silu_mul_serial);
}

#[inline(always)]
fn sigmoid_mul_body<const FUSED: bool>(x: &mut [f32], gate: &[f32]) {
    for (v, &g) in x.iter_mut().zip(gate) {
        *v *= sigmoid_fast::<FUSED>(g);
    }
}

dispatch_simd!(
    /// [`sigmoid_mul`] on the calling thread.
    fn sigmoid_mul_serial(x: &mut [f32], gate: &[f32]) = sigmoid_mul_body
);

/// `x <- x * sigmoid(gate)` elementwise (attention's output gate), vectorized, in
/// parallel pieces on rayon's pool.
pub(crate) fn sigmoid_mul(x: &mut [f32], gate: &[f32]) {
    par_pieces(x, gate, ELEMENTWISE_PIECE, sigmoid_mul_serial);
}

/// `1 / sqrt(mean(row^2) + eps)`, the sum in sixteen partial lanes so the loop
/// vectorizes.
#[inline(always)]
fn inverse_rms<const FUSED: bool>(row: &[f32], eps: f32) -> f32 {
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
    1.0 / (sum / row.len() as f32 + eps).sqrt()
}

#[inline(always)]
fn rms_norm_body<const FUSED: bool>(x: &mut [f32], scale: &[f32], eps: f32) {
    let width = scale.len();
    for row in x.chunks_exact_mut(width) {
        let inv = inverse_rms::<FUSED>(row, eps);
        for (v, &w) in row.iter_mut().zip(scale) {
            *v = *v * inv * w;
        }
    }
}

/// [`rms_norm_body`] of `src`'s rows written to `out` (the same operations, so the same
/// bits as copying first and normalizing in place, without the copy).
#[inline(always)]
fn rms_norm_into_body<const FUSED: bool>(src: &[f32], out: &mut [f32], scale: &[f32], eps: f32) {
    let width = scale.len();
    for (row, dst) in src.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let inv = inverse_rms::<FUSED>(row, eps);
        for ((d, &v), &w) in dst.iter_mut().zip(row).zip(scale) {
            *d = v * inv * w;
        }
    }
}

/// `x <- x + y` per row, then that row's [`rms_norm_into_body`] into `out`, while the
/// row is still in L1: the same operations in the same order as [`add_assign`] then
/// [`rms_norm_rows_into`], so the same bits, with one pass over the residual stream
/// instead of two.
#[inline(always)]
fn add_rms_norm_into_body<const FUSED: bool>(
    x: &mut [f32],
    y: &[f32],
    out: &mut [f32],
    scale: &[f32],
    eps: f32,
) {
    let width = scale.len();
    for ((row, add), dst) in x
        .chunks_exact_mut(width)
        .zip(y.chunks_exact(width))
        .zip(out.chunks_exact_mut(width))
    {
        for (a, &b) in row.iter_mut().zip(add) {
            *a += b;
        }
        let inv = inverse_rms::<FUSED>(row, eps);
        for ((d, &v), &w) in dst.iter_mut().zip(&*row).zip(scale) {
            *d = v * inv * w;
        }
    }
}

dispatch_simd!(
    /// [`add_rms_norm_rows_into`] on the calling thread.
    fn add_rms_norm_rows_into_serial(
        x: &mut [f32],
        y: &[f32],
        out: &mut [f32],
        scale: &[f32],
        eps: f32,
    ) = add_rms_norm_into_body
);

/// The residual add `x <- x + y` and the RMSNorm of the sum into `out` (all three the
/// same length, whole rows of `scale.len()`), fused per row, in parallel pieces of
/// whole rows on rayon's pool: bit-identical to [`add_assign`] then
/// [`rms_norm_rows_into`].
pub(crate) fn add_rms_norm_rows_into(
    x: &mut [f32],
    y: &[f32],
    out: &mut [f32],
    scale: &[f32],
    eps: f32,
) {
    use rayon::prelude::*;
    assert!(
        x.len() == y.len() && x.len() == out.len(),
        "residual add and RMSNorm of buffers of other lengths"
    );
    let piece = whole_rows_piece(scale.len());
    if x.len() <= piece {
        add_rms_norm_rows_into_serial(x, y, out, scale, eps);
    } else {
        x.par_chunks_mut(piece)
            .zip(y.par_chunks(piece))
            .zip(out.par_chunks_mut(piece))
            .for_each(|((x, y), out)| add_rms_norm_rows_into_serial(x, y, out, scale, eps));
    }
}

dispatch_simd!(
    /// [`rms_norm_rows_into`] on the calling thread.
    fn rms_norm_rows_into_serial(src: &[f32], out: &mut [f32], scale: &[f32], eps: f32) = rms_norm_into_body
);

dispatch_simd!(
    /// [`rms_norm_rows`] on the calling thread.
    pub(crate) fn rms_norm_rows_serial(x: &mut [f32], scale: &[f32], eps: f32) = rms_norm_body
);

/// `x <- x / sqrt(mean(x^2) + eps) * scale` for every row of `x` (`scale.len()`
/// wide), vectorized, in parallel pieces of whole rows on rayon's pool.
pub(crate) fn rms_norm_rows(x: &mut [f32], scale: &[f32], eps: f32) {
    use rayon::prelude::*;
    let piece = whole_rows_piece(scale.len());
    if x.len() <= piece {
        rms_norm_rows_serial(x, scale, eps);
    } else {
        x.par_chunks_mut(piece)
            .for_each(|rows| rms_norm_rows_serial(rows, scale, eps));
    }
}

/// Gated DeltaNet's gated RMSNorm per row of `x` (`scale.len()` wide, a value head),
/// `gate <- silu(gate) * (x / rms(x) * scale)`, one row at a time: the same operations
/// in the same order as [`rms_norm_body`] on `x` then [`silu_mul_body`] on `gate`,
/// so the same bits, in one pass over both instead of two (and `x` is not written).
#[inline(always)]
fn rms_norm_silu_gate_body<const FUSED: bool>(
    x: &[f32],
    gate: &mut [f32],
    scale: &[f32],
    eps: f32,
) {
    let width = scale.len();
    for (row, g_row) in x.chunks_exact(width).zip(gate.chunks_exact_mut(width)) {
        let inv = inverse_rms::<FUSED>(row, eps);
        for ((g, &v), &w) in g_row.iter_mut().zip(row).zip(scale) {
            let u = v * inv * w;
            *g = *g * sigmoid_fast::<FUSED>(*g) * u;
        }
    }
}

dispatch_simd!(
    /// [`rms_norm_silu_gate`] on the calling thread.
    fn rms_norm_silu_gate_serial(x: &[f32], gate: &mut [f32], scale: &[f32], eps: f32) = rms_norm_silu_gate_body
);

/// `gate <- silu(gate) * rms_norm(x) * scale` per row of `scale.len()` (`x` and `gate`
/// the same length), in parallel pieces of whole rows on rayon's pool: bit-identical to
/// [`rms_norm_rows`] of `x` then [`silu_mul`] of `gate` by it, without writing `x`.
pub(crate) fn rms_norm_silu_gate(x: &[f32], gate: &mut [f32], scale: &[f32], eps: f32) {
    assert_eq!(
        x.len(),
        gate.len(),
        "gated RMSNorm of buffers of other lengths"
    );
    let piece = whole_rows_piece(scale.len());
    par_pieces(gate, x, piece, |g, from| {
        rms_norm_silu_gate_serial(from, g, scale, eps)
    });
}

/// [`rms_norm_rows`] of `src` into `out` (same length), read from `src` and written to
/// `out` in one pass (no copy first), in parallel pieces (the residual stream stays as
/// is).
pub(crate) fn rms_norm_rows_into(src: &[f32], out: &mut [f32], scale: &[f32], eps: f32) {
    assert_eq!(
        src.len(),
        out.len(),
        "RMSNorm into a buffer of another length"
    );
    let piece = whole_rows_piece(scale.len());
    par_pieces(out, src, piece, |rows, from| {
        rms_norm_rows_into_serial(from, rows, scale, eps)
    });
}

/// [`par_rows`] over two matrices of the same row count, `x` `width` wide and `y`
/// `y.len() / rows` wide: `f(first_row, x_rows, y_rows)` on matching pieces of about
/// `piece` elements of `x` (smaller than the default for costly per-element work).
pub(crate) fn par_rows_pair<F>(x: &mut [f32], y: &mut [f32], width: usize, piece: usize, f: F)
where
    F: Fn(usize, &mut [f32], &mut [f32]) + Sync,
{
    use rayon::prelude::*;
    let width = width.max(1);
    let rows = x.len() / width;
    let y_width = y.len().checked_div(rows).unwrap_or(0);
    let piece_rows = piece.div_ceil(width).max(1);
    if rows <= piece_rows || y_width == 0 {
        f(0, x, y);
    } else {
        x.par_chunks_mut(piece_rows * width)
            .zip(y.par_chunks_mut(piece_rows * y_width))
            .enumerate()
            .for_each(|(i, (xs, ys))| f(i * piece_rows, xs, ys));
    }
}

/// Runs `f(first_row, rows)` on pieces of whole rows of `x` (`width` values each) in
/// parallel on rayon's pool, or once on the whole when it fits in one piece: for
/// per-token work that is not one of the helpers above (rope, gates, splits).
pub(crate) fn par_rows<F>(x: &mut [f32], width: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    use rayon::prelude::*;
    let width = width.max(1);
    let piece_rows = ELEMENTWISE_PIECE.div_ceil(width).max(1);
    if x.len() <= piece_rows * width {
        f(0, x);
    } else {
        x.par_chunks_mut(piece_rows * width)
            .enumerate()
            .for_each(|(i, rows)| f(i * piece_rows, rows));
    }
}

/// Elements per parallel piece of the elementwise helpers: large enough that a piece
/// outweighs handing it to another thread, small enough that a batch's activations
/// (hundreds of thousands of values) split among the threads.
pub(crate) const ELEMENTWISE_PIECE: usize = 1 << 15;

/// [`ELEMENTWISE_PIECE`] rounded up to whole rows of `width` (at least 1): the pieces
/// of the row-wise helpers (norms), so no row is split between two threads.
fn whole_rows_piece(width: usize) -> usize {
    let width = width.max(1);
    ELEMENTWISE_PIECE.div_ceil(width) * width
}

/// Runs `f` on matching pieces of `x` and `y` (`piece` long, the last shorter) in
/// parallel, or once on the whole when they fit in one piece.
fn par_pieces<F>(x: &mut [f32], y: &[f32], piece: usize, f: F)
where
    F: Fn(&mut [f32], &[f32]) + Sync,
{
    use rayon::prelude::*;
    let y = &y[..x.len().min(y.len())];
    let x_len = y.len();
    let x = &mut x[..x_len];
    if x.len() <= piece {
        f(x, y);
    } else {
        x.par_chunks_mut(piece)
            .zip(y.par_chunks(piece))
            .for_each(|(xs, ys)| f(xs, ys));
    }
}

#[inline(always)]
fn add_assign_body<const FUSED: bool>(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

dispatch_simd!(
    /// [`add_assign`] on the calling thread.
    fn add_assign_serial(x: &mut [f32], y: &[f32]) = add_assign_body
);

/// `x <- x + y` elementwise (the residual stream), in parallel pieces on rayon's pool.
pub(crate) fn add_assign(x: &mut [f32], y: &[f32]) {
    par_pieces(x, y, ELEMENTWISE_PIECE, add_assign_serial);
}

#[inline(always)]
fn causal_conv_silu_body<const FUSED: bool>(
    x: &[f32],
    weight_t: &[f32],
    kernel: usize,
    first: usize,
    out: &mut [f32],
) {
    let channels = weight_t.len() / kernel;
    for (row_index, row) in out.chunks_exact_mut(channels).enumerate() {
        let t = first + row_index;
        // The first tap that reads a token (`t >= 0` always reads one: `j = kernel - 1`
        // is the token itself) starts the row from zero, the same `madd(w, v, 0.0)` as
        // accumulating into a zeroed row, so the caller need not zero `out` first (a
        // memset of the whole projection per prompt and layer, outside L1).
        let mut started = false;
        for j in 0..kernel {
            // Input token t - (kernel - 1) + j; skipped when before the start.
            let Some(src) = (t + j).checked_sub(kernel - 1) else {
                continue;
            };
            let taps = &weight_t[j * channels..(j + 1) * channels];
            let xs = &x[src * channels..(src + 1) * channels];
            if started {
                for ((o, &w), &v) in row.iter_mut().zip(taps).zip(xs) {
                    *o = madd::<FUSED>(w, v, *o);
                }
            } else {
                for ((o, &w), &v) in row.iter_mut().zip(taps).zip(xs) {
                    *o = madd::<FUSED>(w, v, 0.0);
                }
                started = true;
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
    /// along channels, for the tokens `first ..` of `x` that `out` holds (`out`'s values
    /// on entry are not read: every row is overwritten).
    fn causal_conv_silu_serial(
        x: &[f32],
        weight_t: &[f32],
        kernel: usize,
        first: usize,
        out: &mut [f32],
    ) = causal_conv_silu_body
);

/// [`causal_conv_silu_serial`] over all of `x`'s tokens (`out`, `x`'s shape, overwritten), in
/// parallel pieces of whole tokens: each output token reads only its own and the
/// `kernel - 1` tokens before it.
pub(crate) fn causal_conv_silu(x: &[f32], weight_t: &[f32], kernel: usize, out: &mut [f32]) {
    use rayon::prelude::*;
    let channels = (weight_t.len() / kernel.max(1)).max(1);
    let piece = ELEMENTWISE_PIECE.div_ceil(channels) * channels;
    if out.len() <= piece {
        causal_conv_silu_serial(x, weight_t, kernel, 0, out);
    } else {
        out.par_chunks_mut(piece).enumerate().for_each(|(i, rows)| {
            causal_conv_silu_serial(x, weight_t, kernel, i * piece / channels, rows)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn product_body<const FUSED: bool>(p: &Product<'_>, c: &mut [f32], ldc: usize) {
        matmul_acc::<FUSED>(p, c, ldc)
    }
    dispatch_simd!(fn run_product(p: &Product<'_>, c: &mut [f32], ldc: usize) = product_body);
    dispatch_simd!(fn run_exp(x: f32) -> f32 = exp_nonpositive);
    fn exp_slice_body<const FUSED: bool>(xs: &mut [f32]) {
        for x in xs {
            *x = exp_nonpositive::<FUSED>(*x);
        }
    }
    dispatch_simd!(fn run_exp_slice(xs: &mut [f32]) = exp_slice_body);

    #[test]
    fn product_equals_the_triple_loop() {
        // 7 x 5 times 5 x 37: whole 4 x 16 tiles, leftover rows and columns; 21 x 5
        // times 5 x 83: whole 8 x 32 tiles (AVX-512), then 4 x 16 ones and single rows
        // and columns beside and below them; alpha -2.
        for (m, k, n) in [(7, 5, 37), (21, 5, 83)] {
            check_product(m, k, n);
        }
    }

    fn row_body<const FUSED: bool>(p: &RowProduct<'_>, c: &mut [f32]) {
        matmul_acc_row::<FUSED>(p, c)
    }
    dispatch_simd!(fn run_row(p: &RowProduct<'_>, c: &mut [f32]) = row_body);

    #[test]
    fn one_row_alone_equals_its_row_of_the_whole_product() {
        // Values whose products and sums round, so a row summed in another order or
        // with alpha applied elsewhere differs in its last bits. Shapes around the
        // tiles: rows in 8 x 32 tiles, in 4 x 16 ones beside and below them, and left
        // over; columns likewise (attention's key tiles of 1 .. 64, head dims 64, 256).
        let value = |i: usize, seed: usize| {
            let x = (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97)) % 10_007;
            x as f32 / 3_001.7 - 1.6
        };
        for (m, k, n) in [
            (1, 5, 3),
            (3, 17, 20),
            (7, 64, 37),
            (20, 64, 20),
            (21, 9, 83),
            (64, 64, 64),
            (37, 40, 256),
            (12, 64, 48),
        ] {
            let a: Vec<f32> = (0..m * k).map(|i| value(i, 1)).collect();
            let b: Vec<f32> = (0..k * n).map(|i| value(i, 2)).collect();
            let c0: Vec<f32> = (0..m * n).map(|i| value(i, 3)).collect();
            let mut whole = c0.clone();
            let p = Product {
                m,
                k,
                n,
                a: &a,
                lda: k,
                b: &b,
                ldb: n,
                alpha: 0.37,
            };
            run_product(&p, &mut whole, n);
            for i in 0..m {
                let mut row = c0[i * n..(i + 1) * n].to_vec();
                run_row(
                    &RowProduct {
                        m,
                        i,
                        k,
                        n,
                        a_row: &a[i * k..(i + 1) * k],
                        b: &b,
                        ldb: n,
                        alpha: 0.37,
                    },
                    &mut row,
                );
                let want: Vec<u32> = whole[i * n..(i + 1) * n]
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                let got: Vec<u32> = row.iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want, "{m} x {k} x {n}, row {i}");
            }
        }
    }

    fn check_product(m: usize, k: usize, n: usize) {
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
        // The whole range softmax and the decays see, [-87.3, 0] (below it the result
        // is 0), one value every 2^-12 or so, through the vectorized loop (which once
        // fell back to scalar code) and one call at a time: the same bits, within
        // 5e-7 of e^x in f64.
        let xs: Vec<f32> = (0..=360_000)
            .map(|i| -87.3 * i as f32 / 360_000.0)
            .chain([-87.3, -0.346_573_6, -0.346_573_56, -1e-30, -0.0])
            .collect();
        let mut vectorized = xs.clone();
        run_exp_slice(&mut vectorized);
        let mut worst = 0f64;
        for (&x, &v) in xs.iter().zip(&vectorized) {
            let ours = run_exp(x);
            assert_eq!(
                ours.to_bits(),
                v.to_bits(),
                "exp({x}) one by one vs in a loop"
            );
            let exact = (x as f64).exp();
            worst = worst.max((ours as f64 - exact).abs() / exact);
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive::<false>(0.0), 1.0);
        assert_eq!(exp_nonpositive::<false>(-200.0), 0.0);
        assert_eq!(exp_nonpositive::<false>(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn conv_overwrites_its_output() {
        // 70 channels x 600 tokens (more than one parallel piece): an output full of
        // NaN gives the same bits as the zeroed output the convolution used to add into.
        let (channels, tokens, kernel) = (70, 600, 4);
        let value = |i: usize| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0;
        let x: Vec<f32> = (0..channels * tokens).map(value).collect();
        let weight_t: Vec<f32> = (0..channels * kernel).map(|i| value(i + 7)).collect();
        let mut zeroed = vec![0f32; x.len()];
        let mut nan = vec![f32::NAN; x.len()];
        causal_conv_silu(&x, &weight_t, kernel, &mut zeroed);
        causal_conv_silu(&x, &weight_t, kernel, &mut nan);
        assert!(
            zeroed
                .iter()
                .zip(&nan)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }

    #[test]
    fn gated_rms_norm_equals_the_norm_then_the_gate() {
        // 600 rows of 64 (more than one parallel piece): bit-equal to the two passes it
        // replaces, and within 1e-5 of z sigmoid(z) x w / rms(x) in f64.
        let (width, rows, eps) = (64, 600, 1e-6);
        let value = |i: usize| ((i * 2_654_435_761) % 1000) as f32 / 250.0 - 2.0;
        let x: Vec<f32> = (0..width * rows).map(value).collect();
        let z: Vec<f32> = (0..width * rows).map(|i| value(i + 3)).collect();
        let scale: Vec<f32> = (0..width).map(|i| 0.5 + value(i + 11).abs()).collect();
        let mut fused = z.clone();
        rms_norm_silu_gate(&x, &mut fused, &scale, eps);
        let mut normed = x.clone();
        rms_norm_rows(&mut normed, &scale, eps);
        let mut two_pass = z.clone();
        silu_mul(&mut two_pass, &normed);
        assert!(
            fused
                .iter()
                .zip(&two_pass)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        for (r, row) in x.chunks_exact(width).enumerate() {
            let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / width as f64;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            for (c, &v) in row.iter().enumerate() {
                let g = f64::from(z[r * width + c]);
                let want = g / (1.0 + (-g).exp()) * f64::from(v) * inv * f64::from(scale[c]);
                let got = f64::from(fused[r * width + c]);
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "row {r} col {c}"
                );
            }
        }
    }

    #[test]
    fn silu_and_sigmoid_match_their_definitions() {
        // 80,001 values: more than one parallel piece.
        let xs: Vec<f32> = (-40_000..=40_000).map(|i| i as f32 * 0.001).collect();
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
