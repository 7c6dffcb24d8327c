//! Quantized bases (written by loraq-quant from the tiny synth base): both linear
//! backends run them — dense on loraq-quant's exact f32 decode, kernels on the stored
//! codes — and must agree; the quantization must be visible against the bf16 base.

use loraq_io::Checkpoint;
use loraq_model::{LinearBackend, LoadOptions, Model, Record, ScoreOptions, score_records};
use loraq_quant::Scheme;
use loraq_quant::layout::{
    DEFAULT_SKIP, Layout, QuantizeOptions, compile_skip, plan_quantization, write_quantized,
};
use loraq_synth::{Preset, SynthOptions, write_synth};
use std::path::{Path, PathBuf};

fn records() -> Vec<Record> {
    (0..6u32)
        .map(|i| Record {
            id: format!("r{i}"),
            group: None,
            prompt: None,
            tokens: Some((0..5 + i).map(|t| (t * 37 + i * 11) % 256).collect()),
            options: vec!["A".into(), "B".into(), "C".into()],
            option_tokens: Some(vec![3 + i, 100 + i, 200 + i]),
            gold: None,
            line: 0,
        })
        .collect()
}

fn logits(model: &Path, adapter: &Path, backend: LinearBackend) -> Vec<f64> {
    let options = LoadOptions {
        backend,
        ..LoadOptions::default()
    };
    let model = Model::load(model, Some(adapter), &options).unwrap();
    score_records(&model, &records(), &ScoreOptions::default())
        .unwrap()
        .into_iter()
        .flat_map(|a| a.logits)
        .collect()
}

fn quantize(input: &Path, out: &Path, scheme: &str) {
    let scheme: Scheme = scheme.parse().unwrap();
    let options = QuantizeOptions {
        scheme,
        layout: Layout::default_for(scheme),
        skip: compile_skip(
            &DEFAULT_SKIP
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>(),
        )
        .unwrap(),
        max_shard_bytes: 1 << 30,
    };
    let checkpoint = Checkpoint::open(input).unwrap();
    let plan = plan_quantization(&checkpoint, &options).unwrap();
    std::fs::create_dir_all(out).unwrap();
    write_quantized(&checkpoint, &plan, &options, out, &mut |_| {}).unwrap();
}

/// The tiny synthetic pair (seed 3) written under `dir`; returns its directory.
fn tiny_synth(dir: &Path) -> PathBuf {
    let synth = dir.join("synth");
    let options = SynthOptions {
        preset: Preset::Tiny,
        seed: 3,
        rank: None,
        lora_layers: None,
    };
    write_synth(&synth, &options, false, &mut |_, _, _| {}).unwrap();
    synth
}

#[test]
fn fp8_and_nvfp4_bases_run_on_both_backends() {
    let dir = tempfile::tempdir().unwrap();
    let synth = tiny_synth(dir.path());
    let adapter = synth.join("true-adapter");
    let reference = logits(&synth.join("base"), &adapter, LinearBackend::Dense);
    for scheme in ["fp8-block128", "nvfp4"] {
        let quantized = dir.path().join(scheme);
        quantize(&synth.join("base"), &quantized, scheme);
        let dense = logits(&quantized, &adapter, LinearBackend::Dense);
        let kernels = logits(&quantized, &adapter, LinearBackend::Kernels);
        let scale = reference.iter().fold(1f64, |m, v| m.max(v.abs()));
        let backend_gap = dense
            .iter()
            .zip(&kernels)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        let quant_effect = dense
            .iter()
            .zip(&reference)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        eprintln!(
            "{scheme}: backends differ by {backend_gap:.2e}, quantization moves logits by {quant_effect:.2e}"
        );
        // Same decoded weights, different summation order: f32 rounding only.
        assert!(backend_gap < 1e-4, "{scheme}: {backend_gap}");
        assert!(
            quant_effect > 100.0 * backend_gap,
            "{scheme}: {quant_effect}"
        );
    }
}

/// A backend asked for by name runs every linear or refuses, naming the module and the
/// format; `Auto` runs what the CPU kernels cannot on the dense path and counts where
/// each linear went; the reference backend agrees with the CPU kernels.
#[test]
fn backends_refuse_what_they_cannot_run_and_auto_counts_where_each_linear_went() {
    let dir = tempfile::tempdir().unwrap();
    let synth = tiny_synth(dir.path());
    let adapter = synth.join("true-adapter");
    let per_tensor = dir.path().join("fp8-tensor");
    quantize(&synth.join("base"), &per_tensor, "fp8-tensor");
    // The error's message with its source (the module and the kernels' reason).
    let load = |model: &Path, backend| {
        Model::load(
            model,
            Some(&adapter),
            &LoadOptions {
                backend,
                ..LoadOptions::default()
            },
        )
        .map_err(|err| match std::error::Error::source(&err) {
            Some(source) => format!("{err}: {source}"),
            None => err.to_string(),
        })
    };
    for backend in [LinearBackend::Kernels, LinearBackend::Reference] {
        let message = load(&per_tensor, backend).unwrap_err();
        assert!(
            message.contains("fp8-tensor") && message.contains("layers.0."),
            "{backend:?}: {message}"
        );
    }
    // Auto: the quantized linears dense, the excluded (bf16) ones on the CPU kernels.
    let auto = load(&per_tensor, LinearBackend::Auto).unwrap();
    let counts = auto.linears_by_backend();
    // The CPU kernels' linears count as "cpu+amx" where AMX runs their prefill.
    let on_cpu =
        counts.get("cpu").copied().unwrap_or(0) + counts.get("cpu+amx").copied().unwrap_or(0);
    assert!(counts["dense"] > 0 && on_cpu > 0, "{counts:?}");
    let dense = load(&per_tensor, LinearBackend::Dense).unwrap();
    assert_eq!(
        dense
            .linears_by_backend()
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        ["dense"]
    );
    // The bf16 base: every linear on the kernels, reference and CPU within f32 rounding.
    let cpu = logits(&synth.join("base"), &adapter, LinearBackend::Kernels);
    let reference = logits(&synth.join("base"), &adapter, LinearBackend::Reference);
    let scale = cpu.iter().fold(1f64, |m, v| m.max(v.abs()));
    let gap = cpu
        .iter()
        .zip(&reference)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()))
        / scale;
    assert!(gap < 1e-4, "reference and CPU kernels differ by {gap}");
}
