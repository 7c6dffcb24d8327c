//! Factors a raw little-endian f32 delta file (as the `factorize` bench writes it) and
//! prints the seconds the factorization took and its residual, as one JSON line. Used by
//! `scripts/bench_svd_reference.py --interleave` to time loraq and torch alternately on
//! a shared machine. A tool for that script, not a usage example: the examples of the
//! libraries are the workspace's top-level `examples/` (README.md, "Using the libraries").
//!
//! `cargo run --release -p loraq-extract --example factor_file -- FILE ROWS COLS FLOOR [RANK]`

use loraq_extract::factor::{FactorParams, Method, factorize};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: factor_file FILE ROWS COLS FLOOR [RANK]");
        std::process::exit(2);
    }
    let rows: usize = args[2].parse().expect("ROWS");
    let cols: usize = args[3].parse().expect("COLS");
    let floor: f64 = args[4].parse().expect("FLOOR");
    let rank: usize = args.get(5).map_or(256, |r| r.parse().expect("RANK"));
    let bytes = std::fs::read(&args[1]).expect("read the delta file");
    let delta: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let params = FactorParams {
        max_rank: rank,
        method: Method::Randomized,
        floor: Some(floor),
        ..FactorParams::default()
    };
    let started = Instant::now();
    let f = factorize("file", &delta, rows, cols, &params).expect("factorize");
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{{\"seconds\": {seconds}, \"residual\": {:e}, \"passes\": {}, \"converged\": {}}}",
        f.truncation_residual(rank),
        f.passes,
        f.converged
    );
}
