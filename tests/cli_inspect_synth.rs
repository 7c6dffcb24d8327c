//! End-to-end tests of `loraq synth` and `loraq inspect`.

mod common;

use common::loraq;
use std::path::Path;

fn synth_tiny(out: &Path) {
    let o = loraq(&[
        "synth",
        "--preset",
        "tiny",
        "--out",
        out.to_str().unwrap(),
        "--seed",
        "3",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn inspect_lists_the_real_module_set_of_a_synth_pair() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pair");
    synth_tiny(&out);
    let o = loraq(&["inspect", out.join("base").to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["architecture"], "qwen3_5");
    assert_eq!(v["layer_pattern"], "LLLA");
    assert_eq!(v["quantization"], "none");
    assert!(v["shards"].as_u64().unwrap() > 1);
    let modules: Vec<String> = v["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            format!(
                "{}.{}",
                m["block"].as_str().unwrap(),
                m["module"].as_str().unwrap()
            )
        })
        .collect();
    for expected in [
        "linear_attn.in_proj_qkv",
        "linear_attn.in_proj_z",
        "linear_attn.in_proj_a",
        "linear_attn.in_proj_b",
        "linear_attn.out_proj",
        "linear_attn.conv1d",
        "linear_attn.A_log",
        "linear_attn.dt_bias",
        "self_attn.q_proj",
        "self_attn.k_norm",
        "mlp.down_proj",
    ] {
        assert!(
            modules.iter().any(|m| m == expected),
            "{expected} missing from {modules:?}"
        );
    }
    let human = loraq(&["inspect", out.join("merged").to_str().unwrap()]);
    let text = String::from_utf8(human.stdout).unwrap();
    assert!(
        text.contains("architecture  qwen3_5") && text.contains("in_proj_qkv"),
        "{text}"
    );
}

#[test]
fn synth_refuses_an_existing_output_with_exit_status_2() {
    let dir = tempfile::tempdir().unwrap();
    let o = loraq(&[
        "synth",
        "--preset",
        "tiny",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.starts_with("loraq: ") && err.contains("already exists"),
        "{err}"
    );
}

#[test]
fn inspect_of_a_truncated_shard_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pair");
    synth_tiny(&out);
    let shard = out.join("base/model-00002-of-00004.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let o = loraq(&["inspect", out.join("base").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("model-00002-of-00004.safetensors") && err.contains("tensor "),
        "{err}"
    );
}
