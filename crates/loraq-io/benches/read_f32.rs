//! Reading a 17408x5120 bf16 projection (Qwen3.8-27B's MLP shape) from a mapped
//! file into f32. Throughput is reported in GB/s of bf16 bytes read.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use loraq_io::{Checkpoint, DType, TensorSpec, write_safetensors_file};
use std::collections::BTreeMap;

fn read_projection(c: &mut Criterion) {
    let (rows, cols) = (17408usize, 5120usize);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("model.safetensors");
    let bytes: Vec<u8> = (0..rows * cols)
        .flat_map(|i| loraq_io::convert::f32_to_bf16_bits((i % 977) as f32 * 1e-3).to_le_bytes())
        .collect();
    let spec = TensorSpec::new("w", DType::BF16, vec![rows, cols]);
    write_safetensors_file(&path, &[(spec, &bytes)], &BTreeMap::new()).expect("write");
    drop(bytes);
    let ckpt = Checkpoint::open(&path).expect("open");
    let mut out = vec![0f32; rows * cols];
    let mut group = c.benchmark_group("read_f32");
    group.throughput(Throughput::Bytes((rows * cols * 2) as u64));
    group.sample_size(20);
    group.bench_function("bf16_17408x5120_into", |b| {
        b.iter(|| ckpt.read_f32_into("w", &mut out).expect("read"))
    });
    group.bench_function("bf16_17408x5120_alloc", |b| {
        b.iter(|| ckpt.read_f32("w").expect("read"))
    });
    group.finish();
}

criterion_group!(benches, read_projection);
criterion_main!(benches);
