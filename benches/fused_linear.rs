//! The fused "quantized base + LoRA" CPU linear on a projection of the 27b-slice shape
//! (17408 x 5120 up projection + a rank-256 LoRA, from a synthetic pair): decode (one
//! token) and prefill (128 tokens), for every base format the CPU kernels take (the
//! GGUF types Q4_K, Q6_K, Q8_0 and IQ4_XS among them), each base quantized by
//! `loraq-quant`. Decode throughput is in bytes the call reads (codes,
//! scales and both bf16 factors), so criterion reports effective bandwidth; prefill
//! throughput is in multiply-adds.
//!
//! `cargo bench --bench fused_linear` (benches/README.md).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use loraq_kernels::{Bf16Weight, CpuOptions, LoraAdapter, QuantLoraLinear, QuantizedWeight};
use loraq_quant::ggml::{GgmlType, GgmlWeight};
use loraq_quant::{Scheme, WeightView};

const NAME: &str = "model.language_model.layers.0.mlp.up_proj.weight";
const OUT: usize = 17408;
const IN: usize = 5120;
const RANK: usize = 256;
const PREFILL: usize = 128;

fn bench(c: &mut Criterion) {
    let pair = loraq_synth::projection_pair(NAME, OUT, IN, RANK, 1).expect("synthetic pair");
    let to_bf16 = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    let lora = || {
        LoraAdapter::new(
            RANK,
            IN,
            OUT,
            to_bf16(&pair.lora_a),
            to_bf16(&pair.lora_b),
            1.0,
        )
        .expect("adapter")
    };
    let view = WeightView::new(NAME, OUT, IN, &pair.base).expect("weight view");
    let mut bases = vec![(
        "bf16",
        QuantizedWeight::Bf16(Bf16Weight::new(OUT, IN, to_bf16(&pair.base))),
    )];
    for scheme in [
        Scheme::Fp8Block128,
        Scheme::Nvfp4,
        Scheme::Mxfp4,
        Scheme::Int4G128Asym,
    ] {
        bases.push((scheme.name(), scheme.quantize(view).expect("quantize")));
    }
    // The GGUF (llama.cpp) types a Q4_K_M / Q6_K / Q8_0 / IQ4_XS base runs its
    // linears in, quantized as llama-quantize does.
    for (name, ggml_type) in [
        ("gguf-q4_k", GgmlType::Q4_K),
        ("gguf-q6_k", GgmlType::Q6_K),
        ("gguf-q8_0", GgmlType::Q8_0),
        ("gguf-iq4_xs", GgmlType::IQ4_XS),
    ] {
        let weight = GgmlWeight::quantize(NAME, ggml_type, OUT, IN, &pair.base).expect("quantize");
        bases.push((name, QuantizedWeight::Ggml(weight)));
    }
    let x: Vec<f32> = (0..PREFILL * IN)
        .map(|i| (i * 7919 % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    let opts = CpuOptions::default();

    let mut decode = c.benchmark_group("fused_decode_17408x5120_r256_b1");
    decode
        .sample_size(10)
        .measurement_time(Duration::from_secs(3));
    let linears: Vec<(&str, QuantLoraLinear)> = bases
        .into_iter()
        .map(|(name, base)| {
            (
                name,
                QuantLoraLinear::new(base, Some(lora())).expect("linear"),
            )
        })
        .collect();
    for (name, linear) in &linears {
        decode.throughput(Throughput::Bytes(linear.weight_bytes() as u64));
        let mut y = vec![0f32; OUT];
        decode.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                linear
                    .forward(black_box(&x[..IN]), 1, &mut y, opts)
                    .expect("forward")
            })
        });
    }
    decode.finish();

    let mut prefill = c.benchmark_group("fused_prefill_17408x5120_r256_b128");
    prefill
        .sample_size(10)
        .measurement_time(Duration::from_secs(5));
    prefill.throughput(Throughput::Elements((PREFILL * OUT * (IN + RANK)) as u64));
    for (name, linear) in &linears {
        let mut y = vec![0f32; PREFILL * OUT];
        prefill.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                linear
                    .forward(black_box(&x), PREFILL, &mut y, opts)
                    .expect("forward")
            })
        });
    }
    prefill.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
