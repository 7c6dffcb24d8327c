//! AMX products against f64 reference products, within the bounds docs/amx.md derives:
//! `|c - c_ref| <= (rel + acc (1 + rel)) sum_k |a_ik| |b_kj| + abs`, with `rel`
//! [`relative_error_bound`] of the planes, `acc` [`accumulation_bound`] of the number
//! of terms accumulated, and `abs` the absolute term of the values AMX flushes to zero
//! (`2^-124` times the sums of the operands' magnitudes, zero unless a plane falls below
//! `2^-126`). Skipped (with a note) where AMX is not usable.

use loraq_amx::{
    Accumulate, Amx, MatrixMut, MatrixRef, Operand, PackedBf16, Planes, accumulation_bound,
    plane_pairs, relative_error_bound, round_bf16,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn amx() -> Option<Amx> {
    let amx = Amx::detect();
    if amx.is_none() {
        eprintln!("AMX not usable here: the products are not tested");
    }
    amx
}

/// A dense matrix and the strides it is viewed with.
struct Dense {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    col_major: bool,
}

impl Dense {
    fn new(
        rows: usize,
        cols: usize,
        col_major: bool,
        mut f: impl FnMut(usize, usize) -> f32,
    ) -> Dense {
        let mut data = vec![0f32; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                let index = if col_major {
                    i + j * rows
                } else {
                    i * cols + j
                };
                data[index] = f(i, j);
            }
        }
        Dense {
            data,
            rows,
            cols,
            col_major,
        }
    }

    fn view(&self) -> MatrixRef<'_> {
        if self.col_major {
            MatrixRef::col_major(&self.data, self.rows, self.cols).unwrap()
        } else {
            MatrixRef::row_major(&self.data, self.rows, self.cols).unwrap()
        }
    }

    fn at(&self, i: usize, j: usize) -> f32 {
        self.view().get(i, j)
    }
}

struct Case<'a> {
    a: &'a Dense,
    a_planes: Planes,
    a_bf16: bool,
    b: &'a Dense,
    b_planes: Planes,
    b_bf16: bool,
    out_col_major: bool,
    accumulate: bool,
    /// B (bf16 values) packed once as the weight `W = B^T` and multiplied by
    /// [`Amx::matmul_packed`] instead of [`Amx::matmul`].
    packed: bool,
}

/// Runs the product and checks every element against the f64 reference; returns the
/// largest error over its bound.
fn check(amx: Amx, case: &Case<'_>, what: &str) -> f64 {
    let (m, k, n) = (case.a.rows, case.a.cols, case.b.cols);
    let initial = |i: usize, j: usize| {
        if case.accumulate {
            (i as f32 - j as f32) * 0.25
        } else {
            f32::NAN
        }
    };
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let index = if case.out_col_major {
                i + j * m
            } else {
                i * n + j
            };
            out[index] = initial(i, j);
        }
    }
    {
        let view = if case.out_col_major {
            MatrixMut::col_major(&mut out, m, n, m).unwrap()
        } else {
            MatrixMut::row_major(&mut out, m, n, n).unwrap()
        };
        let accumulate = if case.accumulate {
            Accumulate::Add
        } else {
            Accumulate::Replace
        };
        if case.packed {
            assert!(case.b_bf16 && case.b_planes == Planes::One);
            let weight: Vec<f32> = (0..n)
                .flat_map(|j| (0..k).map(move |l| (l, j)))
                .map(|(l, j)| case.b.at(l, j))
                .collect();
            let packed = PackedBf16::from_weight_f32(&weight, n, k).unwrap();
            assert_eq!((packed.out_features(), packed.in_features()), (n, k));
            amx.matmul_packed(view, case.a.view(), case.a_planes, &packed, accumulate)
                .unwrap();
        } else {
            amx.matmul(
                view,
                Operand::new(case.a.view(), case.a_planes),
                Operand::new(case.b.view(), case.b_planes),
                accumulate,
            )
            .unwrap();
        }
    }
    let rel = relative_error_bound(case.a_planes, case.a_bf16, case.b_planes, case.b_bf16);
    let terms = k * plane_pairs(case.a_planes, case.b_planes).len() + usize::from(case.accumulate);
    let acc = accumulation_bound(terms);
    let mut worst = 0f64;
    for i in 0..m {
        for j in 0..n {
            let mut exact = if case.accumulate {
                initial(i, j) as f64
            } else {
                0.0
            };
            let mut magnitude = exact.abs();
            let (mut sum_a, mut sum_b) = (0f64, 0f64);
            for l in 0..k {
                let (x, y) = (case.a.at(i, l) as f64, case.b.at(l, j) as f64);
                exact += x * y;
                magnitude += (x * y).abs();
                sum_a += x.abs();
                sum_b += y.abs();
            }
            let flush = f64::powi(2.0, -124) * (sum_a + sum_b + terms as f64);
            let bound = (rel + acc * (1.0 + rel)) * magnitude + flush;
            let index = if case.out_col_major {
                i + j * m
            } else {
                i * n + j
            };
            let error = (out[index] as f64 - exact).abs();
            assert!(
                error <= bound,
                "{what}: ({i}, {j}) of {m}x{k}x{n}: {} against {exact:e}, error {error:e} over the bound {bound:e}",
                out[index]
            );
            if bound > 0.0 {
                worst = worst.max(error / bound);
            }
        }
    }
    worst
}

fn gaussian(rng: &mut ChaCha8Rng) -> f32 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

const PLANE_CASES: [(Planes, bool, Planes, bool); 6] = [
    (Planes::Three, false, Planes::One, true),
    (Planes::Two, false, Planes::One, true),
    (Planes::One, true, Planes::Three, false),
    (Planes::Two, false, Planes::Two, false),
    (Planes::Three, false, Planes::Three, false),
    (Planes::One, false, Planes::One, false),
];

#[test]
fn random_products_of_awkward_shapes_are_within_their_bounds() {
    let Some(amx) = amx() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(20);
    // Sizes not multiples of 16 or 32; the left operand bigger, then the right one
    // (the two task layouts); k below one tile, across k-blocks of 256.
    let shapes = [
        (1, 1, 1),
        (17, 33, 15),
        (31, 65, 47),
        (130, 300, 20),
        (20, 290, 150),
        (64, 513, 70),
    ];
    for &(m, k, n) in &shapes {
        for (case_index, &(a_planes, a_bf16, b_planes, b_bf16)) in PLANE_CASES.iter().enumerate() {
            let layouts = case_index % 4;
            let a = Dense::new(m, k, layouts & 1 == 1, |_, _| {
                let x = gaussian(&mut rng);
                if a_bf16 { round_bf16(x) } else { x }
            });
            let b = Dense::new(k, n, layouts & 2 == 2, |_, _| {
                let x = gaussian(&mut rng) * 3.0;
                if b_bf16 { round_bf16(x) } else { x }
            });
            let case = Case {
                a: &a,
                a_planes,
                a_bf16,
                b: &b,
                b_planes,
                b_bf16,
                out_col_major: case_index % 3 == 1,
                accumulate: case_index % 2 == 1,
                packed: false,
            };
            check(amx, &case, &format!("{a_planes:?}x{b_planes:?}"));
        }
    }
}

/// The bounds are not loose by orders of magnitude: two planes each (about `3 * 2^-16`
/// per product) reach a sizeable fraction of theirs on a single long product, and one
/// plane each (plain bf16) is far from f32.
#[test]
fn the_bounds_are_attained_in_order_of_magnitude() {
    let Some(amx) = amx() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let a = Dense::new(16, 1, false, |_, _| gaussian(&mut rng));
    let b = Dense::new(1, 512, false, |_, _| gaussian(&mut rng));
    let case = Case {
        a: &a,
        a_planes: Planes::Two,
        a_bf16: false,
        b: &b,
        b_planes: Planes::Two,
        b_bf16: false,
        out_col_major: false,
        accumulate: false,
        packed: false,
    };
    let worst = check(amx, &case, "two planes each, k = 1");
    assert!(worst > 0.05, "the worst error is only {worst} of its bound");
}

/// With one operand bf16 and three planes of the other, every product is exact: on
/// values whose sums are exact in f32 too (integers below 2^24 in every partial sum),
/// the result is the exact integer.
#[test]
fn bf16_operand_times_three_planes_is_exact() {
    let Some(amx) = amx() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (m, k, n) = (45, 96, 37);
    // |a| < 2^14 with up to 14 significant bits (two planes), |b| < 2^4 (bf16): every
    // partial sum below 96 * 2^18 < 2^25... kept below 2^24 by |a| < 2^13.
    let a = Dense::new(m, k, false, |_, _| rng.random_range(-8191i32..=8191) as f32);
    let b = Dense::new(k, n, true, |_, _| {
        rng.random_range(-15i32..=15) as f32 * 0.5
    });
    let mut out = vec![0f32; m * n];
    amx.matmul(
        MatrixMut::row_major(&mut out, m, n, n).unwrap(),
        Operand::new(a.view(), Planes::Three),
        Operand::new(b.view(), Planes::One),
        Accumulate::Replace,
    )
    .unwrap();
    for i in 0..m {
        for j in 0..n {
            let exact: f64 = (0..k).map(|l| a.at(i, l) as f64 * b.at(l, j) as f64).sum();
            assert_eq!(out[i * n + j] as f64, exact, "({i}, {j})");
        }
    }
    // Full 24-bit values of a times powers of two, k = 1 (every partial sum of the plane
    // products exact in f32): the three planes carry every bit.
    let a = Dense::new(33, 1, false, |i, _| {
        f32::from_bits(0x3f80_0000 | (0x5a5a5a + 0x1357 * i as u32))
    });
    let b = Dense::new(1, 19, false, |_, j| {
        let sign = if j % 2 == 0 { 1.0 } else { -1.0 };
        sign * f32::powi(2.0, j as i32 - 9)
    });
    let mut out = vec![0f32; 33 * 19];
    amx.matmul(
        MatrixMut::row_major(&mut out, 33, 19, 19).unwrap(),
        Operand::new(a.view(), Planes::Three),
        Operand::new(b.view(), Planes::One),
        Accumulate::Replace,
    )
    .unwrap();
    for i in 0..33 {
        for j in 0..19 {
            let exact = a.at(i, 0) * b.at(0, j);
            assert_eq!(out[i * 19 + j], exact, "({i}, {j})");
        }
    }
}

/// Zeros, a dynamic range of 2^-90 to 2^90 inside one matrix, and subnormal inputs (AMX
/// reads bf16 subnormals as zero: the absolute term of the bound).
#[test]
fn zeros_wide_range_and_subnormals_are_within_their_bounds() {
    let Some(amx) = amx() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (m, k, n) = (40, 70, 36);
    let zeros = Dense::new(m, k, false, |_, _| 0.0);
    let wide = Dense::new(m, k, false, |_, _| {
        gaussian(&mut rng) * f32::powi(2.0, rng.random_range(-90..=90))
    });
    let tiny = Dense::new(m, k, true, |i, j| {
        let scale = if (i + j) % 3 == 0 { 1e-40 } else { 1e-33 };
        gaussian(&mut rng) * scale
    });
    let b = Dense::new(k, n, false, |_, _| gaussian(&mut rng));
    for (a, name) in [
        (&zeros, "zeros"),
        (&wide, "wide range"),
        (&tiny, "subnormal"),
    ] {
        for &(a_planes, b_planes) in &[(Planes::Three, Planes::Three), (Planes::Two, Planes::Two)] {
            let case = Case {
                a,
                a_planes,
                a_bf16: false,
                b: &b,
                b_planes,
                b_bf16: false,
                out_col_major: false,
                accumulate: false,
                packed: false,
            };
            check(amx, &case, name);
        }
    }
    // A subnormal value times one: flushed to zero by AMX (documented in docs/amx.md).
    let a = Dense::new(1, 1, false, |_, _| 1e-40);
    let one = Dense::new(1, 1, false, |_, _| 1.0);
    let mut out = [f32::NAN];
    amx.matmul(
        MatrixMut::row_major(&mut out, 1, 1, 1).unwrap(),
        Operand::new(a.view(), Planes::Three),
        Operand::new(one.view(), Planes::One),
        Accumulate::Replace,
    )
    .unwrap();
    assert_eq!(out[0], 0.0, "a subnormal input is read as zero");
}

#[test]
fn shape_and_view_errors_are_refused() {
    let data = [0f32; 6];
    assert!(MatrixRef::row_major(&data, 3, 3).is_err());
    assert!(MatrixRef::new(&data, 2, 2, 5, 1).is_err());
    let mut out = [0f32; 4];
    assert!(MatrixMut::row_major(&mut out, 2, 3, 3).is_err());
    let Some(amx) = amx() else { return };
    let a = MatrixRef::row_major(&data, 2, 3).unwrap();
    let err = amx
        .matmul(
            MatrixMut::row_major(&mut out, 2, 2, 2).unwrap(),
            Operand::new(a, Planes::One),
            Operand::new(a, Planes::One),
            Accumulate::Replace,
        )
        .unwrap_err();
    assert!(
        matches!(err, loraq_amx::AmxError::ShapeMismatch { .. }),
        "{err}"
    );
}

/// The packed weight ([`PackedBf16`], [`Amx::matmul_packed`]): awkward shapes (token
/// counts and features not multiples of 16 or 32, fewer than 32 tokens, more than one
/// task of rows and k-block of 512), one to three planes of x by rows and by columns,
/// row- and column-major outputs, replacing and adding; every element within the bound
/// of its plane set (three planes of x against the bf16 weight: exact products).
#[test]
fn packed_weight_products_of_awkward_shapes_are_within_their_bounds() {
    let Some(amx) = amx() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let shapes = [
        (1, 1, 1),
        (16, 32, 32),
        (17, 33, 15),
        (31, 65, 47),
        (64, 64, 64),
        (130, 300, 20),
        (20, 290, 150),
        (97, 1100, 70),
        (200, 40, 8),
    ];
    for &(m, k, n) in &shapes {
        for (index, a_planes) in [Planes::Three, Planes::Two, Planes::One]
            .into_iter()
            .enumerate()
        {
            for accumulate in [false, true] {
                let a = Dense::new(m, k, index == 1, |_, _| gaussian(&mut rng));
                let b = Dense::new(k, n, false, |_, _| round_bf16(gaussian(&mut rng) * 3.0));
                let case = Case {
                    a: &a,
                    a_planes,
                    a_bf16: false,
                    b: &b,
                    b_planes: Planes::One,
                    b_bf16: true,
                    out_col_major: index == 2,
                    accumulate,
                    packed: true,
                };
                check(amx, &case, &format!("packed, {a_planes:?}, {m}x{k}x{n}"));
            }
        }
    }
}

/// The packed weight on zeros, a range of 2^-90 to 2^90 in x and the weight, and
/// subnormal inputs; three planes of integers against a bf16 weight give the exact
/// integer sums, as the unpacked product does.
#[test]
fn packed_weight_zeros_wide_range_and_exact_sums() {
    let Some(amx) = amx() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let (m, k, n) = (40, 70, 36);
    let zeros = Dense::new(m, k, false, |_, _| 0.0);
    let wide = Dense::new(m, k, false, |_, _| {
        gaussian(&mut rng) * f32::powi(2.0, rng.random_range(-90..=90))
    });
    let tiny = Dense::new(m, k, false, |i, j| {
        let scale = if (i + j) % 3 == 0 { 1e-40 } else { 1e-33 };
        gaussian(&mut rng) * scale
    });
    let b = Dense::new(k, n, false, |_, _| {
        round_bf16(gaussian(&mut rng) * f32::powi(2.0, rng.random_range(-20..=20)))
    });
    let b_zero = Dense::new(k, n, false, |_, _| 0.0);
    for (a, b, name) in [
        (&zeros, &b, "zero x"),
        (&wide, &b, "wide range"),
        (&tiny, &b, "subnormal"),
        (&wide, &b_zero, "zero weight"),
    ] {
        for accumulate in [false, true] {
            let case = Case {
                a,
                a_planes: Planes::Three,
                a_bf16: false,
                b,
                b_planes: Planes::One,
                b_bf16: true,
                out_col_major: false,
                accumulate,
                packed: true,
            };
            check(amx, &case, name);
        }
    }
    let (m, k, n) = (45, 96, 37);
    let a = Dense::new(m, k, false, |_, _| rng.random_range(-8191i32..=8191) as f32);
    let weight: Vec<f32> = (0..n * k)
        .map(|_| rng.random_range(-15i32..=15) as f32 * 0.5)
        .collect();
    let packed = PackedBf16::from_weight_f32(&weight, n, k).unwrap();
    let mut out = vec![f32::NAN; m * n];
    amx.matmul_packed(
        MatrixMut::row_major(&mut out, m, n, n).unwrap(),
        a.view(),
        Planes::Three,
        &packed,
        Accumulate::Replace,
    )
    .unwrap();
    for i in 0..m {
        for j in 0..n {
            let exact: f64 = (0..k)
                .map(|l| a.at(i, l) as f64 * weight[j * k + l] as f64)
                .sum();
            assert_eq!(out[i * n + j] as f64, exact, "({i}, {j})");
            assert_eq!(packed.get(j, 0), weight[j * k]);
        }
    }
}

/// A packed weight is built from bf16 bits or from bf16 values; other values, lengths
/// that disagree with the shape and products of the wrong shape are refused.
#[test]
fn packed_weight_refuses_bad_input() {
    let bits: Vec<u16> = (0..6u16).map(|i| 0x3f80 + i).collect();
    let from_bits = PackedBf16::from_weight_bits(&bits, 2, 3).unwrap();
    let values: Vec<f32> = bits
        .iter()
        .map(|&b| f32::from_bits(u32::from(b) << 16))
        .collect();
    let from_values = PackedBf16::from_weight_f32(&values, 2, 3).unwrap();
    for i in 0..2 {
        for j in 0..3 {
            assert_eq!(from_bits.get(i, j), values[i * 3 + j]);
            assert_eq!(from_values.get(i, j), values[i * 3 + j]);
        }
    }
    assert!(PackedBf16::from_weight_bits(&bits, 2, 2).is_err());
    assert!(PackedBf16::from_weight_bits(&bits, usize::MAX, 2).is_err());
    let mut off = values.clone();
    off[4] += f32::EPSILON;
    let err = PackedBf16::from_weight_f32(&off, 2, 3).unwrap_err();
    assert!(
        matches!(err, loraq_amx::AmxError::NotBf16 { index: 4, .. }),
        "{err}"
    );
    let Some(amx) = amx() else { return };
    let x = [1f32; 8];
    let mut out = [0f32; 8];
    let err = amx
        .matmul_packed(
            MatrixMut::row_major(&mut out, 4, 2, 2).unwrap(),
            MatrixRef::row_major(&x, 4, 2).unwrap(),
            Planes::Three,
            &from_bits,
            Accumulate::Replace,
        )
        .unwrap_err();
    assert!(
        matches!(err, loraq_amx::AmxError::ShapeMismatch { .. }),
        "{err}"
    );
}
