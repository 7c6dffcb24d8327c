//! Prompts stacked into one batch (`Model::last_hidden_batch`, what `score_records`
//! runs) give each prompt the hidden states it gets alone: the token mixers restart
//! at every prompt (zero convolution and delta-rule state, position 0, attention
//! within the prompt), so nothing leaks between neighbours.

use loraq_model::{LoadOptions, Model};
use loraq_synth::{Preset, SynthOptions, write_synth};

#[test]
fn a_batch_of_prompts_equals_the_prompts_run_alone() {
    let dir = tempfile::tempdir().unwrap();
    let pair = dir.path().join("pair");
    let options = SynthOptions {
        preset: Preset::Tiny,
        seed: 3,
        rank: None,
        lora_layers: None,
    };
    write_synth(&pair, &options, false, &mut |_, _, _| {}).unwrap();
    let model = Model::load(
        &pair.join("base"),
        Some(&pair.join("true-adapter")),
        &LoadOptions::default(),
    )
    .unwrap();
    // Lengths around the delta rule's chunk (64) and the attention tiles (64), and a
    // one-token prompt; tokens from an LCG over the tiny model's 256-token vocabulary.
    let mut state = 11u64;
    let prompts: Vec<Vec<u32>> = [1usize, 20, 64, 65, 150, 3]
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) % 256) as u32
                })
                .collect()
        })
        .collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut batch_layers = Vec::new();
    let batched = model
        .last_hidden_batch(&refs, Some(&mut batch_layers))
        .unwrap();
    assert_eq!(batched.len(), prompts.len());
    assert_eq!(batch_layers.len(), prompts.len());
    for (p, prompt) in prompts.iter().enumerate() {
        let mut layers = Vec::new();
        let alone = model
            .last_hidden_with_layers(prompt, &mut layers)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let together = batched[p].to_vec1::<f32>().unwrap();
        let close = |a: &[f32], b: &[f32], what: &str| {
            assert_eq!(a.len(), b.len());
            let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
            for (x, y) in a.iter().zip(b) {
                // Rows of a larger matrix product may be summed in another order.
                assert!(
                    (x - y).abs() <= 1e-5 * scale,
                    "prompt {p} ({} tokens), {what}: {x} vs {y}",
                    prompt.len()
                );
            }
        };
        close(&together, &alone, "final norm");
        assert_eq!(batch_layers[p].len(), layers.len());
        for (i, (a, b)) in batch_layers[p].iter().zip(&layers).enumerate() {
            close(a, b, &format!("layer {i}"));
        }
    }
}
