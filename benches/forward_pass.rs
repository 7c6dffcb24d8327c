//! The native Qwen3.5 forward pass on the demo-sized model (`loraq synth --preset demo`:
//! 8 hybrid layers, hidden 512, Gated DeltaNet and gated attention) with its rank-32
//! adapter applied unmerged through the fused kernels, as `loraq run` loads it: a
//! 128-token prompt (prefill), and a one-token prompt, the shape of a decode step (every
//! linear at batch 1; the model runs whole prompts and keeps no cache between calls).
//!
//! `cargo bench --bench forward_pass` (benches/README.md).

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use loraq_model::{LoadOptions, Model};
use loraq_synth::{Preset, SynthOptions, write_synth};

const PROMPT: usize = 128;

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
    let tokens: Vec<u32> = (0..PROMPT as u32).map(|t| (t * 37 + 11) % 200).collect();

    let mut group = c.benchmark_group("forward_demo");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(10));
    group.throughput(Throughput::Elements(PROMPT as u64));
    group.bench_function("prefill_128_tokens", |b| {
        b.iter(|| model.last_hidden(&tokens).expect("forward"))
    });
    group.throughput(Throughput::Elements(1));
    group.bench_function("one_token", |b| {
        b.iter(|| model.last_hidden(&tokens[..1]).expect("forward"))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
