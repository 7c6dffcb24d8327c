//! The native Qwen3.5 forward pass on the demo-sized model (`loraq synth --preset demo`:
//! 8 hybrid layers, hidden 512, Gated DeltaNet and gated attention) with its rank-32
//! adapter applied unmerged through the fused kernels, as `loraq run` loads it: prefill
//! of one prompt of 512 and of 4096 tokens, 24 prompts of 20 tokens run as one batch
//! (what `loraq run` does with short records), one prompt of 20 tokens alone, and a
//! one-token prompt, the shape of a decode step (every linear at batch 1; the model runs
//! whole prompts and keeps no cache between calls).
//!
//! `cargo bench --bench forward_pass` (benches/README.md); beside transformers:
//! `benches/prefill_vs_transformers.sh` (docs/model.md, "Speed").

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use loraq_model::{LoadOptions, Model};
use loraq_synth::{Preset, SynthOptions, write_synth};

/// `count` prompts of `length` tokens from a fixed LCG over the demo vocabulary.
fn prompts(count: usize, length: usize) -> Vec<Vec<u32>> {
    let mut state = 12345u64;
    (0..count)
        .map(|_| {
            (0..length)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) % 4096) as u32
                })
                .collect()
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let pair = dir.path().join("pair");
    let options = SynthOptions {
        preset: Preset::Demo,
        seed: 1,
        rank: None,
        lora_layers: None,
    };
    write_synth(&pair, &options, false, &mut |_, _, _| {}).expect("synthetic demo pair");
    let model = Model::load(
        &pair.join("base"),
        Some(&pair.join("true-adapter")),
        &LoadOptions::default(),
    )
    .expect("load the demo base and adapter");

    let mut group = c.benchmark_group("forward_demo");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(10));
    for length in [512, 4096] {
        let prompt = prompts(1, length).remove(0);
        group.throughput(Throughput::Elements(length as u64));
        group.bench_function(format!("prefill_{length}_tokens"), |b| {
            b.iter(|| model.last_hidden(&prompt).expect("forward"))
        });
    }
    let short = prompts(24, 20);
    let batch: Vec<&[u32]> = short.iter().map(Vec::as_slice).collect();
    group.throughput(Throughput::Elements(24 * 20));
    group.bench_function("prefill_24x20_tokens_batched", |b| {
        b.iter(|| model.last_hidden_batch(&batch, None).expect("forward"))
    });
    group.throughput(Throughput::Elements(20));
    group.bench_function("prefill_20_tokens_alone", |b| {
        b.iter(|| model.last_hidden(&short[0]).expect("forward"))
    });
    group.throughput(Throughput::Elements(1));
    group.bench_function("one_token", |b| {
        b.iter(|| model.last_hidden(&short[0][..1]).expect("forward"))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
