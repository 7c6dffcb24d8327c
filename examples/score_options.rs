//! Score multiple-choice questions with the native Qwen3.5 forward pass of
//! `loraq-model`, once on the merged model and once on the base with the adapter applied
//! unmerged, and compare the two answer sets with `loraq-eval`.
//!
//! ```sh
//! cargo run --release --example score_options
//! ```
//!
//! It synthesizes a tiny Qwen3.5-architecture pair (`loraq-synth`) in a temporary
//! directory; the two answer sets differ only by the merge's bf16 rounding, so few
//! answers change and the KL is small. `loraq run` and `loraq compare` do the same from
//! files (with `--model` a quantized base, the adapter runs on it).

use loraq_eval::{CompareOptions, compare_files};
use loraq_model::{LoadOptions, Model, Record, ScoreOptions, score_records, write_answers};
use loraq_synth::{Preset, SynthOptions, write_synth};

fn main() -> anyhow::Result<()> {
    let scratch = tempfile::tempdir()?;
    let pair = scratch.path().join("pair");
    let options = SynthOptions {
        preset: Preset::Tiny,
        seed: 1,
        rank: None,
        lora_layers: None,
    };
    write_synth(&pair, &options, false, &mut |_, _, _| {})?;

    // 40 questions of 24 random prompt tokens; each option is one vocabulary token.
    let records: Vec<Record> = (0..40u32)
        .map(|q| Record {
            id: format!("q{q}"),
            group: Some("synthetic".into()),
            prompt: None,
            tokens: Some((0..24).map(|t| (q * 31 + t * 17 + 5) % 256).collect()),
            options: vec!["A".into(), "B".into(), "C".into(), "D".into()],
            option_tokens: Some(vec![10, 20, 30, 40]),
            gold: None,
            line: 0,
        })
        .collect();

    let mut answer_files = Vec::new();
    for (name, model_dir, adapter) in [
        ("merged", pair.join("merged"), None),
        (
            "base + adapter",
            pair.join("base"),
            Some(pair.join("true-adapter")),
        ),
    ] {
        let model = Model::load(&model_dir, adapter.as_deref(), &LoadOptions::default())?;
        let answers = score_records(&model, &records, &ScoreOptions::default())?;
        println!(
            "{name:<15} q0 option logits {:?}",
            answers[0]
                .logits
                .iter()
                .map(|l| format!("{l:.4}"))
                .collect::<Vec<_>>()
        );
        let path = scratch
            .path()
            .join(format!("answers-{}.jsonl", answer_files.len()));
        write_answers(&path, &answers)?;
        answer_files.push(path);
    }

    let report = compare_files(
        &answer_files[0],
        &answer_files[1],
        &CompareOptions::default(),
    )?
    .report;
    println!(
        "adapter unmerged against the merge: {} of {} answers changed, mean KL {:.2e} nats",
        report.flips, report.n, report.kl.mean
    );
    Ok(())
}
