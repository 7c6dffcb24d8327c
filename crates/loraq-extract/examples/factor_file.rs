//! Factors a raw little-endian f32 delta file (as the `factorize` bench writes it) and
//! prints the seconds the factorization took, its residual and the wall and CPU seconds
//! per stage (`stages`, `stages_cpu`: CPU of all threads), as one JSON line. Used by
//! `scripts/bench_svd_reference.py --interleave` to time loraq and torch alternately on
//! a shared machine. A tool for that script, not a usage example: the examples of the
//! libraries are the workspace's top-level `examples/` (README.md, "Using the libraries").
//!
//! With FACTORS_OUT it also splits (balanced) and casts the factors to bf16 as `loraq
//! extract` does, writes lora_B (`[ROWS, RANK]`) then lora_A (`[RANK, COLS]`) there as
//! raw little-endian bf16, and adds the cast's seconds and error to the line, so the
//! script can measure the exact residual after the cast against torch's.
//!
//! With `--warm-up` it first runs the same factorization once untimed and reports that
//! run's seconds as `cold_seconds`: the script calls `torch.svd_lowrank` once before it
//! times it, and this gives loraq the same. The first factorization in a process
//! touches every buffer it allocates for the first time (about 135 MB here), which on
//! the development VM costs up to 8 ms per MB right after torch's run; `loraq extract`
//! pays that once per run, not once per projection (benches/README.md, "Warm runs on
//! both sides").
//!
//! With `--pair MERGED BASE` it times the whole per-projection work instead, from two raw
//! little-endian bf16 files (`merged`, `base`; the `factorize` bench writes the pair its
//! delta comes from): the delta with its norm and floor, the factorization and the bf16
//! cast, as the `extract_projection` bench and `loraq extract` run them
//! (`factor_projection_at_rank`), after one untimed run with `--warm-up`.
//!
//! `cargo run --release -p loraq-extract --example factor_file -- [--warm-up] FILE ROWS COLS FLOOR [RANK [FACTORS_OUT]]`
//! `cargo run --release -p loraq-extract --example factor_file -- [--warm-up] --pair MERGED BASE ROWS COLS [RANK]`

use loraq_extract::factor::{FactorParams, Method, factorize, process_cpu_seconds};
use loraq_extract::factoring::factor_projection_at_rank;
use loraq_extract::floor::PairBytes;
use loraq_extract::split::{Split, split_and_cast};
use loraq_io::DType;
use std::time::Instant;

/// Runs `work` and returns its result and seconds; with `warm_up`, runs it once untimed
/// first and also returns that run's seconds as the `cold_seconds` JSON field.
fn timed<T>(warm_up: bool, mut work: impl FnMut() -> T) -> (T, f64, String) {
    let cold = warm_up.then(|| {
        let started = Instant::now();
        work();
        format!(", \"cold_seconds\": {}", started.elapsed().as_secs_f64())
    });
    let started = Instant::now();
    let result = work();
    (
        result,
        started.elapsed().as_secs_f64(),
        cold.unwrap_or_default(),
    )
}

/// `--pair MERGED BASE ROWS COLS [RANK]`: the whole run on the bf16 pair, timed warm
/// when `warm_up` (the second of two runs, the delta's buffer handed from the first).
fn whole_run(args: &[String], warm_up: bool) {
    if args.len() < 4 {
        eprintln!("usage: factor_file [--warm-up] --pair MERGED BASE ROWS COLS [RANK]");
        std::process::exit(2);
    }
    let rows: usize = args[2].parse().expect("ROWS");
    let cols: usize = args[3].parse().expect("COLS");
    let rank: usize = args.get(4).map_or(256, |r| r.parse().expect("RANK"));
    let read = |path: &String| std::fs::read(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let pair = PairBytes::from_bytes(
        "file",
        DType::BF16,
        read(&args[0]),
        read(&args[1]),
        args[0].clone().into(),
        args[1].clone().into(),
    )
    .expect("a pair of equal lengths");
    let mut spare = Vec::new();
    let par = faer::Par::rayon(0);
    let ((f, cast, floor), seconds, cold) = timed(warm_up, || {
        factor_projection_at_rank("file", &pair, [rows, cols], rank, par, &mut spare)
            .expect("bf16 factors")
    });
    println!(
        "{{\"seconds\": {seconds}, \"residual\": {:e}, \"floor\": {floor:e}, \"cast_error\": {:e}, \"rank\": {}, \"passes\": {}, \"converged\": {}{}}}",
        f.truncation_residual(rank),
        cast.cast_error,
        cast.rank,
        f.passes,
        f.converged,
        cold
    );
}

fn main() {
    let mut args: Vec<String> = std::env::args().collect();
    let warm_up = args.get(1).is_some_and(|a| a == "--warm-up");
    if warm_up {
        args.remove(1);
    }
    if args.get(1).is_some_and(|a| a == "--pair") {
        whole_run(&args[2..], warm_up);
        return;
    }
    if args.len() < 5 {
        eprintln!("usage: factor_file [--warm-up] FILE ROWS COLS FLOOR [RANK [FACTORS_OUT]]");
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
    let (f, seconds, cold) = timed(warm_up, || {
        factorize("file", &delta, rows, cols, &params).expect("factorize")
    });
    // Wall and CPU seconds per stage, summed over iterations, in first-seen order.
    let mut totals: Vec<(&str, f64, f64)> = Vec::new();
    for stage in &f.stages {
        match totals.iter_mut().find(|(n, _, _)| *n == stage.name) {
            Some(entry) => {
                entry.1 += stage.seconds;
                entry.2 += stage.cpu_seconds;
            }
            None => totals.push((stage.name, stage.seconds, stage.cpu_seconds)),
        }
    }
    let mut cast = String::new();
    if let Some(out) = args.get(6) {
        let started = Instant::now();
        let started_cpu = process_cpu_seconds();
        let factors = split_and_cast("file", &f, rank, Split::Balanced, faer::Par::rayon(0))
            .expect("bf16 factors");
        let cast_seconds = started.elapsed().as_secs_f64();
        let cast_cpu = process_cpu_seconds() - started_cpu;
        let mut bytes = factors.b_bf16.clone();
        bytes.extend_from_slice(&factors.a_bf16);
        std::fs::write(out, bytes).expect("write the factors");
        totals.push(("cast", cast_seconds, cast_cpu));
        cast = format!(
            ", \"cast_error\": {:e}, \"rank\": {}",
            factors.cast_error, factors.rank
        );
    }
    let listed = |cpu: bool| -> String {
        totals
            .iter()
            .map(|&(name, wall, cpu_seconds)| {
                format!("\"{name}\": {:.4}", if cpu { cpu_seconds } else { wall })
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "{{\"seconds\": {seconds}, \"residual\": {:e}, \"passes\": {}, \"converged\": {}, \"stages\": {{{}}}, \"stages_cpu\": {{{}}}{}{cast}}}",
        f.truncation_residual(rank),
        f.passes,
        f.converged,
        listed(false),
        listed(true),
        cold
    );
}
