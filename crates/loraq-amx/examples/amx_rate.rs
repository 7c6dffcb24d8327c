//! GFLOP/s of the AMX products against faer's f32 GEMM on the factorization's shapes:
//! a 17408x5120 row-major delta times a 5120x272 basis (`W = D V`, pass W) and the
//! delta's transpose times a 17408x272 basis (`Z = D^T Q`, pass Z), from the process's
//! CPU time (all threads), the minimum of three runs: a figure that means something on a
//! machine shared with other work, single-threaded (`RAYON_NUM_THREADS=1`).
//!
//! `cargo run --release -p loraq-amx --example amx_rate [ROWS COLS WIDTH]`
//!
//! `amx_rate linear [TOKENS IN_FEATURES OUT_FEATURES]` times instead the prefill linears'
//! product `x W^T` (x f32, three planes; W bf16) on the demo model's shapes and the
//! 27B's (or the one given), with the weight packed on every call (`Amx::matmul`) and
//! packed once (`Amx::matmul_packed`), in f32-product GFLOP/s and GFLOP/s of bf16 tile
//! work (three tile products per f32 product).

use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};
use loraq_amx::{Accumulate, Amx, MatrixMut, MatrixRef, Operand, PackedBf16, Planes, round_bf16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn cpu_seconds() -> f64 {
    let mut ts = Timespec::default();
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    unsafe { clock_gettime(2, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[repr(C)]
#[derive(Default)]
struct Timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

unsafe extern "C" {
    /// CLOCK_PROCESS_CPUTIME_ID = 2 on Linux.
    fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
}

fn best_of_three(mut run: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            let start = cpu_seconds();
            run();
            cpu_seconds() - start
        })
        .fold(f64::INFINITY, f64::min)
}

/// The linears' product `x W^T` on `(tokens, in_features, out_features)` shapes.
fn linears(shapes: &[(usize, usize, usize)]) {
    let Some(amx) = Amx::detect() else {
        println!("AMX not usable here");
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for &(tokens, in_features, out_features) in shapes {
        let x: Vec<f32> = (0..tokens * in_features)
            .map(|_| rng.random_range(-2f32..2.0))
            .collect();
        let weight: Vec<f32> = (0..out_features * in_features)
            .map(|_| round_bf16(rng.random_range(-0.05f32..0.05)))
            .collect();
        let bits: Vec<u16> = weight.iter().map(|w| (w.to_bits() >> 16) as u16).collect();
        let start = cpu_seconds();
        let packed = PackedBf16::from_weight_bits(&bits, out_features, in_features).unwrap();
        let pack_seconds = cpu_seconds() - start;
        println!(
            "{tokens:>5} x {in_features:>5} -> {out_features:>5}  packing the weight once {pack_seconds:7.3} s CPU  {:7.2} GB/s of bf16",
            2.0 * bits.len() as f64 / pack_seconds * 1e-9
        );
        let mut out = vec![0f32; tokens * out_features];
        let xv = MatrixRef::row_major(&x, tokens, in_features).unwrap();
        let flops = 2.0 * tokens as f64 * in_features as f64 * out_features as f64;
        let report = |name: &str, seconds: f64| {
            println!(
                "{tokens:>5} x {in_features:>5} -> {out_features:>5}  {name:<22} {seconds:7.3} s CPU  {:7.1} GFLOP/s f32, {:7.1} bf16 work",
                flops / seconds * 1e-9,
                3.0 * flops / seconds * 1e-9
            );
        };
        report(
            "weight packed per call",
            best_of_three(|| {
                amx.matmul(
                    MatrixMut::row_major(&mut out, tokens, out_features, out_features).unwrap(),
                    Operand::new(xv, Planes::Three),
                    Operand::new(
                        MatrixRef::row_major(&weight, out_features, in_features)
                            .unwrap()
                            .transpose(),
                        Planes::One,
                    ),
                    Accumulate::Replace,
                )
                .unwrap()
            }),
        );
        report(
            "weight packed once",
            best_of_three(|| {
                amx.matmul_packed(
                    MatrixMut::row_major(&mut out, tokens, out_features, out_features).unwrap(),
                    xv,
                    Planes::Three,
                    &packed,
                    Accumulate::Replace,
                )
                .unwrap()
            }),
        );
    }
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("linear") {
        let args: Vec<usize> = std::env::args()
            .skip(2)
            .map(|a| a.parse().expect("a number"))
            .collect();
        match args[..] {
            [t, i, o] => linears(&[(t, i, o)]),
            _ => linears(&[
                // The demo model (hidden 512, intermediate 1536): gate/up, down,
                // in_proj_qkv, q_proj with its gate.
                (2048, 512, 1536),
                (2048, 1536, 512),
                (512, 512, 1024),
                (512, 512, 512),
                // The 27B's MLP (hidden 5120, intermediate 17408).
                (512, 5120, 17408),
                (512, 17408, 5120),
            ]),
        }
        return;
    }
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let (rows, cols, width) = match args[..] {
        [r, c, w] => (r, c, w),
        _ => (17408, 5120, 272),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    // A delta-like matrix: the difference of two bf16 values (mostly two planes).
    let delta: Vec<f32> = (0..rows * cols)
        .map(|_| {
            let base = round_bf16(rng.random_range(-0.05f32..0.05));
            round_bf16(base + rng.random_range(-0.005f32..0.005)) - base
        })
        .collect();
    let v = Mat::<f32>::from_fn(cols, width, |_, _| rng.random_range(-1f32..1.0));
    let q = Mat::<f32>::from_fn(rows, width, |_, _| rng.random_range(-1f32..1.0));
    let v_data: Vec<f32> = (0..width)
        .flat_map(|j| (0..cols).map(move |i| (i, j)))
        .map(|(i, j)| v[(i, j)])
        .collect();
    let q_data: Vec<f32> = (0..width)
        .flat_map(|j| (0..rows).map(move |i| (i, j)))
        .map(|(i, j)| q[(i, j)])
        .collect();
    let flops = 2.0 * rows as f64 * cols as f64 * width as f64;
    let d = MatRef::from_row_major_slice(&delta, rows, cols);
    let report = |name: &str, seconds: f64| {
        println!(
            "{name:<48} {seconds:7.3} s CPU  {:7.1} GFLOP/s",
            flops / seconds * 1e-9
        );
    };
    let mut w = Mat::<f32>::zeros(rows, width);
    report(
        "pass W, faer f32 (V^T D^T)^T",
        best_of_three(|| {
            matmul(
                w.as_mut().transpose_mut(),
                Accum::Replace,
                v.transpose(),
                d.transpose(),
                1.0,
                Par::rayon(0),
            )
        }),
    );
    let mut z = Mat::<f32>::zeros(cols, width);
    report(
        "pass Z, faer f32 D^T Q",
        best_of_three(|| {
            matmul(
                z.as_mut(),
                Accum::Replace,
                d.transpose(),
                q.as_ref(),
                1.0,
                Par::rayon(0),
            )
        }),
    );
    let Some(amx) = Amx::detect() else {
        println!("AMX not usable here");
        return;
    };
    let dv = MatrixRef::row_major(&delta, rows, cols).unwrap();
    let vv = MatrixRef::col_major(&v_data, cols, width).unwrap();
    let qv = MatrixRef::col_major(&q_data, rows, width).unwrap();
    let mut out_w = vec![0f32; rows * width];
    let mut out_z = vec![0f32; cols * width];
    let configurations = [
        (
            Planes::Two,
            Planes::Two,
            "two planes each (3 tile products)",
        ),
        (
            Planes::Two,
            Planes::One,
            "two planes of D, bf16 of the basis (2)",
        ),
        (Planes::Three, Planes::Three, "three planes each (6)"),
    ];
    for (d_planes, basis_planes, name) in configurations {
        report(
            &format!("pass W, AMX, {name}"),
            best_of_three(|| {
                amx.matmul(
                    MatrixMut::col_major(&mut out_w, rows, width, rows).unwrap(),
                    Operand::new(dv, d_planes),
                    Operand::new(vv, basis_planes),
                    Accumulate::Replace,
                )
                .unwrap()
            }),
        );
        report(
            &format!("pass Z, AMX, {name}"),
            best_of_three(|| {
                amx.matmul(
                    MatrixMut::col_major(&mut out_z, cols, width, cols).unwrap(),
                    Operand::new(dv.transpose(), d_planes),
                    Operand::new(qv, basis_planes),
                    Accumulate::Replace,
                )
                .unwrap()
            }),
        );
    }
}
