//! GFLOP/s of the AMX products against faer's f32 GEMM on the factorization's shapes:
//! a 17408x5120 row-major delta times a 5120x272 basis (`W = D V`, pass W) and the
//! delta's transpose times a 17408x272 basis (`Z = D^T Q`, pass Z), from the process's
//! CPU time (all threads), the minimum of three runs: a figure that means something on a
//! machine shared with other work, single-threaded (`RAYON_NUM_THREADS=1`).
//!
//! `cargo run --release -p loraq-amx --example amx_rate [ROWS COLS WIDTH]`

use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};
use loraq_amx::{Accumulate, Amx, MatrixMut, MatrixRef, Operand, Planes, round_bf16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn cpu_seconds() -> f64 {
    let mut ts = libc_timespec::default();
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    unsafe { clock_gettime(2, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[repr(C)]
#[derive(Default)]
struct libc_timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

unsafe extern "C" {
    /// CLOCK_PROCESS_CPUTIME_ID = 2 on Linux.
    fn clock_gettime(clock: i32, ts: *mut libc_timespec) -> i32;
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

fn main() {
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
    let v = Mat::<f32>::from_fn(cols, width, |_, _| round_bf16(rng.random_range(-1f32..1.0)));
    let q = Mat::<f32>::from_fn(rows, width, |_, _| round_bf16(rng.random_range(-1f32..1.0)));
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
    for (planes, name) in [
        (Planes::Three, "three planes of D (exact)"),
        (Planes::Two, "two planes of D"),
    ] {
        report(
            &format!("pass W, AMX, {name}, bf16 V"),
            best_of_three(|| {
                amx.matmul(
                    MatrixMut::col_major(&mut out_w, rows, width, rows).unwrap(),
                    Operand::new(dv, planes),
                    Operand::new(vv, Planes::One),
                    Accumulate::Replace,
                )
                .unwrap()
            }),
        );
        report(
            &format!("pass Z, AMX, {name}, bf16 Q"),
            best_of_three(|| {
                amx.matmul(
                    MatrixMut::col_major(&mut out_z, cols, width, cols).unwrap(),
                    Operand::new(dv.transpose(), planes),
                    Operand::new(qv, Planes::One),
                    Accumulate::Replace,
                )
                .unwrap()
            }),
        );
    }
}
