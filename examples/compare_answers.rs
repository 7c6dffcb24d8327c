//! Compare two answers files with `loraq-eval`: answer flips, KL, the paired accuracy
//! test and calibration, as `loraq compare` reports them.
//!
//! ```sh
//! cargo run --release --example compare_answers                 # two generated files
//! cargo run --release --example compare_answers -- REFERENCE CANDIDATE
//! ```
//!
//! Without arguments it writes 2,000 four-option questions to a temporary directory: a
//! reference and a candidate whose logits are the reference's plus noise (the shape of
//! a quantized model's answers against the full-precision model's).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::bail;
use loraq_eval::{CompareOptions, compare_files};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scratch = tempfile::tempdir()?;
    let (reference, candidate) = match args.as_slice() {
        [] => write_example_files(scratch.path(), 2000)?,
        [r, c] => (PathBuf::from(r), PathBuf::from(c)),
        _ => bail!("usage: compare_answers [REFERENCE CANDIDATE]"),
    };

    // Paired by id; 15 calibration bins and 10,000 bootstrap resamples by default.
    let comparison = compare_files(&reference, &candidate, &CompareOptions::default())?;
    let r = &comparison.report;
    println!("{} questions paired", r.n);
    println!(
        "answers changed: {} ({:.2}%, 95% interval {:.2}%-{:.2}%)",
        r.flips,
        100.0 * r.flip_rate,
        100.0 * r.flip_rate_ci95[0],
        100.0 * r.flip_rate_ci95[1]
    );
    println!(
        "KL(reference || candidate): mean {:.2e}, p99 {:.2e}, max {:.2e} nats",
        r.kl.mean, r.kl.p99, r.kl.max
    );
    if let (Some(delta), Some(p)) = (r.accuracy.delta, r.accuracy.mcnemar_p) {
        println!(
            "accuracy change {:+.2} points, McNemar p = {p:.3}",
            100.0 * delta
        );
    }
    // The same table `loraq compare` prints.
    println!("\n{}", loraq_eval::render::text_table(&comparison));
    Ok(())
}

/// Writes `reference.jsonl` and `candidate.jsonl` (JSON Lines: id, group, options,
/// logits, gold; docs/evaluation.md) with `n` questions.
fn write_example_files(dir: &std::path::Path, n: usize) -> anyhow::Result<(PathBuf, PathBuf)> {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (mut reference, mut candidate) = (String::new(), String::new());
    for i in 0..n {
        let logits: Vec<f64> = (0..4).map(|_| rng.random_range(-3.0..3.0)).collect();
        let noisy: Vec<f64> = logits
            .iter()
            .map(|l| l + rng.random_range(-0.3..0.3))
            .collect();
        // Gold follows the reference's answer three times in four.
        let top = (0..4).fold(0, |b, k| if logits[k] > logits[b] { k } else { b });
        let gold = if rng.random_bool(0.75) {
            top
        } else {
            rng.random_range(0..4)
        };
        for (out, l) in [(&mut reference, &logits), (&mut candidate, &noisy)] {
            writeln!(
                out,
                r#"{{"id": "q{i}", "group": "{}", "options": ["A", "B", "C", "D"], "logits": [{:.4}, {:.4}, {:.4}, {:.4}], "gold": "{}"}}"#,
                ["arc", "mmlu"][i % 2],
                l[0],
                l[1],
                l[2],
                l[3],
                ["A", "B", "C", "D"][gold]
            )?;
        }
    }
    let (r, c) = (dir.join("reference.jsonl"), dir.join("candidate.jsonl"));
    std::fs::write(&r, reference)?;
    std::fs::write(&c, candidate)?;
    Ok((r, c))
}
