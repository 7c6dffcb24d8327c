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

/// The last layer runs its queries (or Gated DeltaNet's output path), residual and MLP
/// on each prompt's last row only; a model loaded with input statistics runs every
/// row. The two must give the same bits (the same arithmetic on the rows kept), with
/// the last layer full attention (the tiny preset) and Gated DeltaNet (the preset cut
/// to its first three layers), for batches padded up to 16 kept rows, batches of more
/// prompts than that, and a prompt short enough to run unpruned.
#[test]
fn the_last_layer_on_the_last_rows_equals_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let pair = dir.path().join("pair");
    let options = SynthOptions {
        preset: Preset::Tiny,
        seed: 5,
        rank: None,
        lora_layers: None,
    };
    write_synth(&pair, &options, false, &mut |_, _, _| {}).unwrap();
    // The same weights with the last (full attention) layer dropped: a Gated DeltaNet
    // layer last. The loader reads tensors by name, so layer 3's stay unread.
    let cut = dir.path().join("cut");
    std::fs::create_dir(&cut).unwrap();
    for entry in std::fs::read_dir(pair.join("merged")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), cut.join(entry.file_name())).unwrap();
    }
    let config_path = cut.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    let text = config
        .get_mut("text_config")
        .unwrap_or_else(|| panic!("no text_config"));
    let types = text["layer_types"].as_array().unwrap().clone();
    assert_eq!(types.last().unwrap(), "full_attention");
    text["layer_types"] = serde_json::Value::Array(types[..types.len() - 1].to_vec());
    text["num_hidden_layers"] = serde_json::json!(types.len() - 1);
    std::fs::write(&config_path, config.to_string()).unwrap();

    let mut state = 7u64;
    let mut prompt = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) % 256) as u32
            })
            .collect()
    };
    let batches: Vec<Vec<Vec<u32>>> = vec![
        [1usize, 20, 64, 65, 150, 3]
            .iter()
            .map(|&n| prompt(n))
            .collect(),
        (0..20).map(|i| prompt(5 + i % 7)).collect(),
        vec![prompt(9)],
        vec![prompt(40)],
    ];
    for model_dir in [pair.join("merged"), cut] {
        let pruned = Model::load(&model_dir, None, &LoadOptions::default()).unwrap();
        let every_row = Model::load(
            &model_dir,
            None,
            &LoadOptions {
                collect_input_stats: true,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        for batch in &batches {
            let refs: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
            let run = |model: &Model| {
                let mut layers = Vec::new();
                let hidden: Vec<Vec<u32>> = model
                    .last_hidden_batch(&refs, Some(&mut layers))
                    .unwrap()
                    .iter()
                    .map(|t| {
                        t.to_vec1::<f32>()
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect()
                    })
                    .collect();
                let layers: Vec<Vec<Vec<u32>>> = layers
                    .iter()
                    .map(|per| {
                        per.iter()
                            .map(|l| l.iter().map(|v| v.to_bits()).collect())
                            .collect()
                    })
                    .collect();
                (hidden, layers)
            };
            let lengths: Vec<usize> = batch.iter().map(Vec::len).collect();
            assert!(
                run(&pruned) == run(&every_row),
                "{}: prompts of {lengths:?} tokens",
                model_dir.display()
            );
        }
    }
}
