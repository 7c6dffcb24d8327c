//! `loraq compare` on one million four-option questions: two answers files (random
//! logits; the candidate the reference plus noise, in shuffled order; gold answers and
//! four groups), read, paired by id and compared with the default options (15
//! calibration bins, 10,000 paired bootstrap resamples).
//!
//! `cargo bench --bench compare_answers_1m` (benches/README.md).

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use loraq_eval::{CompareOptions, compare_files};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const QUESTIONS: usize = 1_000_000;

fn write_answers(dir: &Path) {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut reference = String::with_capacity(QUESTIONS * 130);
    let mut candidate = Vec::with_capacity(QUESTIONS);
    for i in 0..QUESTIONS {
        let logits: [f64; 4] = std::array::from_fn(|_| rng.random_range(-4.0..4.0));
        let noisy = logits.map(|l| l + rng.random_range(-0.5..0.5));
        let gold = ["A", "B", "C", "D"][rng.random_range(0..4)];
        let line = |l: [f64; 4]| {
            format!(
                r#"{{"id": "q{i}", "group": "{}", "options": ["A", "B", "C", "D"], "logits": [{:.4}, {:.4}, {:.4}, {:.4}], "gold": "{gold}"}}"#,
                ["arc", "mmlu", "gsm", "piqa"][i % 4],
                l[0],
                l[1],
                l[2],
                l[3]
            )
        };
        let _ = writeln!(reference, "{}", line(logits));
        candidate.push(line(noisy));
    }
    candidate.shuffle(&mut rng);
    std::fs::write(dir.join("reference.jsonl"), reference).expect("write reference");
    std::fs::write(dir.join("candidate.jsonl"), candidate.join("\n")).expect("write candidate");
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    write_answers(dir.path());
    let options = CompareOptions::default();
    let mut group = c.benchmark_group("compare");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(30));
    group.throughput(Throughput::Elements(QUESTIONS as u64));
    group.bench_function("1m_questions_4_options", |b| {
        b.iter(|| {
            compare_files(
                dir.path().join("reference.jsonl"),
                dir.path().join("candidate.jsonl"),
                &options,
            )
            .expect("compare")
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
