//! `loraq compare` at scale: two answers files of 100,000 and 1,000,000 questions
//! with 4 options (random logits, the candidate a perturbed copy in shuffled
//! order, gold and four groups), compared end to end with the default options
//! (15 bins, 10,000 bootstrap resamples). Time per question should not grow with
//! the number of questions.
//!
//! `cargo bench -p loraq-eval --bench compare`

use std::fmt::Write as _;
use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use loraq_eval::{CompareOptions, compare_files};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn write_files(dir: &Path, n: usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(n as u64);
    let groups = ["mmlu", "arc", "gsm", "piqa"];
    let mut reference = String::with_capacity(n * 130);
    let mut candidate_lines = Vec::with_capacity(n);
    for i in 0..n {
        let logits: Vec<f64> = (0..4).map(|_| rng.random_range(-4.0..4.0)).collect();
        let noisy: Vec<f64> = logits
            .iter()
            .map(|l| l + rng.random_range(-0.5..0.5))
            .collect();
        let gold = ["A", "B", "C", "D"][rng.random_range(0..4)];
        let line = |l: &[f64]| {
            format!(
                r#"{{"id": "q{i}", "group": "{}", "options": ["A", "B", "C", "D"], "logits": [{:.4}, {:.4}, {:.4}, {:.4}], "gold": "{gold}"}}"#,
                groups[i % 4],
                l[0],
                l[1],
                l[2],
                l[3]
            )
        };
        let _ = writeln!(reference, "{}", line(&logits));
        candidate_lines.push(line(&noisy));
    }
    candidate_lines.shuffle(&mut rng);
    std::fs::write(dir.join("reference.jsonl"), reference).unwrap();
    std::fs::write(dir.join("candidate.jsonl"), candidate_lines.join("\n")).unwrap();
}

fn bench_compare(c: &mut Criterion) {
    let mut group = c.benchmark_group("compare");
    group.sample_size(10);
    for n in [100_000usize, 1_000_000] {
        let dir = tempfile::tempdir().unwrap();
        write_files(dir.path(), n);
        let options = CompareOptions::default();
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(format!("{n}_questions_4_options"), |b| {
            b.iter(|| {
                compare_files(
                    dir.path().join("reference.jsonl"),
                    dir.path().join("candidate.jsonl"),
                    &options,
                )
                .unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_compare);
criterion_main!(benches);
