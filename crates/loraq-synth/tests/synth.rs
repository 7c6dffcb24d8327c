//! The synthetic triples: determinism, the merge formula, magnitudes and module set.

use loraq_io::convert::bf16_ulp;
use loraq_io::{Checkpoint, LoraAdapter, ModuleKind, ModuleName};
use loraq_synth::{Preset, SynthOptions, write_synth};
use std::path::Path;

fn tiny(out: &Path, seed: u64, lora_layers: Option<std::ops::RangeInclusive<usize>>) {
    let options = SynthOptions {
        preset: Preset::Tiny,
        seed,
        rank: None,
        lora_layers,
    };
    write_synth(out, &options, false, &mut |_, _, _| {}).unwrap();
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for sub in ["base", "merged", "true-adapter"] {
        let mut names: Vec<_> = std::fs::read_dir(dir.join(sub))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        for p in names {
            out.push((p.display().to_string(), std::fs::read(&p).unwrap()));
        }
    }
    out
}

#[test]
fn same_seed_gives_identical_files_and_another_seed_differs() {
    let dir = tempfile::tempdir().unwrap();
    tiny(&dir.path().join("a"), 7, None);
    tiny(&dir.path().join("b"), 7, None);
    tiny(&dir.path().join("c"), 8, None);
    let (a, b, c) = (
        files(&dir.path().join("a")),
        files(&dir.path().join("b")),
        files(&dir.path().join("c")),
    );
    assert_eq!(a.len(), b.len());
    for ((_, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y);
    }
    assert!(a.iter().zip(&c).any(|((_, x), (_, y))| x != y));
}

#[test]
fn merged_is_base_plus_true_adapter_rounded_once_to_bf16() {
    let dir = tempfile::tempdir().unwrap();
    tiny(&dir.path().join("t"), 3, None);
    let base = Checkpoint::open(dir.path().join("t/base")).unwrap();
    let merged = Checkpoint::open(dir.path().join("t/merged")).unwrap();
    let adapter = LoraAdapter::open(dir.path().join("t/true-adapter")).unwrap();
    assert!(!adapter.modules.is_empty());
    for m in &adapter.modules {
        let name = format!("{}.weight", m.module_path);
        let (w, mw) = (
            base.read_f32(&name).unwrap(),
            merged.read_f32(&name).unwrap(),
        );
        let (a, b) = (
            adapter.read_a_f32(&m.module_path).unwrap(),
            adapter.read_b_f32(&m.module_path).unwrap(),
        );
        for i in 0..m.out_features {
            for j in 0..m.in_features {
                // Independent recomputation in f64: the stored merge must be the
                // nearest bf16 to base + B A (within half an ulp), up to the f32
                // arithmetic the merge is specified in (a few f32 ulps, which can
                // decide a value that lands on a bf16 tie).
                let d: f64 = (0..m.rank)
                    .map(|k| b[i * m.rank + k] as f64 * a[k * m.in_features + j] as f64)
                    .sum();
                let exact = w[i * m.in_features + j] as f64 + m.scale * d;
                let got = mw[i * m.in_features + j];
                assert!(
                    (got as f64 - exact).abs()
                        <= 0.5 * bf16_ulp(got)
                            + 8.0 * f64::from(f32::EPSILON) * (exact.abs() + d.abs()),
                    "{name}[{i},{j}]: {got} vs {exact}"
                );
            }
        }
    }
}

#[test]
fn deltas_are_a_few_to_tens_of_ulps_so_the_floor_is_a_small_share() {
    let dir = tempfile::tempdir().unwrap();
    tiny(&dir.path().join("t"), 5, None);
    let base = Checkpoint::open(dir.path().join("t/base")).unwrap();
    let merged = Checkpoint::open(dir.path().join("t/merged")).unwrap();
    let adapter = LoraAdapter::open(dir.path().join("t/true-adapter")).unwrap();
    for m in &adapter.modules {
        let name = format!("{}.weight", m.module_path);
        let (w, mw) = (
            base.read_f32(&name).unwrap(),
            merged.read_f32(&name).unwrap(),
        );
        let delta: f64 = w
            .iter()
            .zip(&mw)
            .map(|(a, b)| ((b - a) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let floor: f64 = (mw.iter().map(|&x| bf16_ulp(x).powi(2)).sum::<f64>() / 12.0).sqrt();
        let share = floor / delta;
        assert!(
            (0.002..=0.04).contains(&share),
            "{name}: floor / delta = {share}"
        );
    }
}

#[test]
fn module_set_ranks_and_layers_follow_the_options() {
    let dir = tempfile::tempdir().unwrap();
    tiny(&dir.path().join("t"), 1, Some(2..=3));
    let base = Checkpoint::open(dir.path().join("t/base")).unwrap();
    let merged = Checkpoint::open(dir.path().join("t/merged")).unwrap();
    let adapter = LoraAdapter::open(dir.path().join("t/true-adapter")).unwrap();
    // Layer 2 is linear attention (12 linears incl. in_proj_a/b), layer 3 full
    // attention: 5 + 3 + 4 + 3 modules in all.
    assert_eq!(adapter.modules.len(), 5 + 3 + 4 + 3);
    for m in &adapter.modules {
        let name = ModuleName::parse(&format!("{}.weight", m.module_path)).unwrap();
        assert!((2..=3).contains(&name.layer));
        let expected_rank = match name.kind {
            ModuleKind::InProjA | ModuleKind::InProjB => m.out_features,
            _ => 8,
        };
        assert_eq!(m.rank, expected_rank, "{}", m.module_path);
    }
    assert_eq!(adapter.config.rank_pattern.len(), 2);
    assert_eq!(
        adapter.config.rank_pattern,
        adapter
            .config
            .alpha_pattern
            .iter()
            .map(|(k, v)| (k.clone(), *v as usize))
            .collect()
    );
    for t in merged.tensors() {
        let adapted =
            ModuleName::parse(&t.name).is_some_and(|m| m.is_linear_weight() && m.layer >= 2);
        assert_eq!(
            base.bytes(&t.name).unwrap() == merged.bytes(&t.name).unwrap(),
            !adapted,
            "{}",
            t.name
        );
    }
    let base_only: Vec<_> = base
        .tensors()
        .filter(|t| !merged.contains(&t.name))
        .map(|t| t.name.as_str())
        .collect();
    assert!(base_only.iter().all(|n| n.starts_with("mtp.")) && base_only.len() == 4);
    let config = merged.config().unwrap();
    assert_eq!(config.num_hidden_layers, 4);
    assert_eq!(config.layer_types[3], loraq_io::LayerType::FullAttention);
}

#[test]
fn an_existing_output_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keep"), b"x").unwrap();
    let options = SynthOptions {
        preset: Preset::Tiny,
        seed: 0,
        rank: None,
        lora_layers: None,
    };
    let err = write_synth(dir.path(), &options, false, &mut |_, _, _| {}).unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    assert!(dir.path().join("keep").is_file());
}

#[test]
fn projection_pair_is_the_module_write_synth_writes() {
    let dir = tempfile::tempdir().unwrap();
    tiny(&dir.path().join("t"), 5, None);
    let base = Checkpoint::open(dir.path().join("t/base")).unwrap();
    let merged = Checkpoint::open(dir.path().join("t/merged")).unwrap();
    let adapter = LoraAdapter::open(dir.path().join("t/true-adapter")).unwrap();
    let m = adapter
        .modules
        .iter()
        .find(|m| m.module_path.ends_with("mlp.down_proj"))
        .expect("the tiny preset adapts down_proj");
    let name = format!("{}.weight", m.module_path);
    let pair =
        loraq_synth::projection_pair(&name, m.out_features, m.in_features, m.rank, 5).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&pair.base), bits(&base.read_f32(&name).unwrap()));
    assert_eq!(bits(&pair.merged), bits(&merged.read_f32(&name).unwrap()));
    assert_eq!(
        bits(&pair.lora_a),
        bits(&adapter.read_a_f32(&m.module_path).unwrap())
    );
    assert_eq!(
        bits(&pair.lora_b),
        bits(&adapter.read_b_f32(&m.module_path).unwrap())
    );
    assert!(loraq_synth::projection_pair(&name, 8, 8, 9, 5).is_err());
    assert!(loraq_synth::projection_pair(&name, 0, 8, 1, 5).is_err());
}
