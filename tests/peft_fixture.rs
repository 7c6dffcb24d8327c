//! Extraction of a merge made by the real client: a tiny random Qwen3.5 model from
//! transformers, a PEFT LoRA (r 8, alpha 16, non-zero B) merged by PEFT's
//! `merge_and_unload` and saved in bf16 (scripts/peft_fixture.py, run once; that script
//! also checked that `PeftModel.from_pretrained` loads our adapter and reproduces the
//! merged logits, see tests/data/peft/peft_check.json).

use loraq_io::convert::bf16_ulp;
use loraq_io::{Checkpoint, LoraAdapter};
use std::path::Path;
use std::process::Command;

/// scale * B A as f64, row-major [out, in].
fn delta(adapter: &LoraAdapter, module: &str) -> Vec<f64> {
    let m = adapter.module(module).unwrap();
    let (a, b) = (
        adapter.read_a_f32(module).unwrap(),
        adapter.read_b_f32(module).unwrap(),
    );
    let mut out = vec![0f64; m.out_features * m.in_features];
    for i in 0..m.out_features {
        for k in 0..m.rank {
            let coef = m.scale * b[i * m.rank + k] as f64;
            for j in 0..m.in_features {
                out[i * m.in_features + j] += coef * a[k * m.in_features + j] as f64;
            }
        }
    }
    out
}

#[test]
fn extraction_of_a_peft_merge_reproduces_peft_deltas_within_the_floor() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/peft");
    let dir = tempfile::tempdir().unwrap();
    let ours_dir = dir.path().join("adapter");
    let status = Command::new(env!("CARGO_BIN_EXE_loraq"))
        .args(["extract", "--merged"])
        .arg(data.join("merged"))
        .arg("--base")
        .arg(data.join("base"))
        .arg("--out")
        .arg(&ours_dir)
        .args(["--rank", "8"])
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let ours = LoraAdapter::open(&ours_dir).unwrap();
    let peft = LoraAdapter::open(data.join("peft-adapter")).unwrap();
    let merged = Checkpoint::open(data.join("merged")).unwrap();
    assert_eq!(ours.modules.len(), peft.modules.len());
    for p in &peft.modules {
        let o = ours
            .module(&p.module_path)
            .unwrap_or_else(|| panic!("{} missing", p.module_path));
        // PEFT's r = 8 exceeds in_proj_a / in_proj_b's 4 rows: their delta has rank 4,
        // which ours keeps at full width through rank_pattern.
        assert_eq!(
            o.rank,
            p.rank.min(p.out_features).min(p.in_features),
            "{}",
            p.module_path
        );
        let m = merged
            .read_f32(&format!("{}.weight", p.module_path))
            .unwrap();
        let floor = (m.iter().map(|&x| bf16_ulp(x).powi(2)).sum::<f64>() / 12.0).sqrt();
        let (d_ours, d_peft) = (delta(&ours, &p.module_path), delta(&peft, &p.module_path));
        let diff = d_ours
            .iter()
            .zip(&d_peft)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm = d_peft.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!(
            diff <= 1.1 * floor,
            "{}: |ours - peft| = {diff:.3e}, floor {floor:.3e}",
            p.module_path
        );
        assert!(
            floor < 0.1 * norm,
            "{}: the delta must stand above the floor",
            p.module_path
        );
    }
    let check: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("peft_check.json")).unwrap())
            .unwrap();
    assert_eq!(check["same_top_token"], 1.0);
}
