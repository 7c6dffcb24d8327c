//! Checkpoints written by real producers decode to exactly what the producer's own
//! dequantization gives: compressed-tensors 0.20.0 (what llm-compressor writes NVFP4
//! with; tests/data/quant/ct_nvfp4 from scripts/quant_ct_fixture.py) and NVIDIA
//! ModelOpt 0.47.0 (tests/data/quant/modelopt_nvfp4 from
//! scripts/quant_modelopt_fixture.py), whose quantization our canonical nvfp4 must
//! also reproduce byte for byte.

use loraq_quant::{QuantizedBase, StoredWeight};
use std::path::PathBuf;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/quant/ct_nvfp4")
}

#[test]
fn compressed_tensors_nvfp4_decodes_like_compressed_tensors() {
    let base = QuantizedBase::open(fixture()).unwrap();
    let mut checked = 0;
    for (module, rows, cols) in [
        ("model.layers.0.mlp.up_proj", 48, 96),
        ("model.layers.0.mlp.down_proj", 8, 16),
    ] {
        let name = format!("{module}.weight");
        let weight = base.weight(&name).unwrap();
        assert_eq!(
            (weight.out_features, weight.in_features),
            (rows, cols),
            "{name}"
        );
        assert!(matches!(
            weight.stored,
            StoredWeight::Nvfp4CompressedTensors { .. }
        ));
        let decoded = base.read_weight_f32(&name).unwrap();
        let bytes = std::fs::read(fixture().join(format!("{module}.expected.f32"))).unwrap();
        let expected: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(decoded.len(), expected.len());
        for (i, (d, e)) in decoded.iter().zip(&expected).enumerate() {
            assert_eq!(
                d.to_bits(),
                e.to_bits(),
                "{name}[{}, {}]: {d} vs {e}",
                i / cols,
                i % cols
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 2);
    assert_eq!(base.weights().count(), 2, "scales are not weights");
}

fn modelopt_fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/quant/modelopt_nvfp4")
}

fn read_f32(path: PathBuf) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// NVIDIA ModelOpt 0.47.0 (scripts/quant_modelopt_fixture.py): the canonical
/// formula gives ModelOpt's bytes, and the ModelOpt layout decodes like its
/// `dequantize`.
#[test]
fn modelopt_nvfp4_codes_scales_and_decode_match_modelopt() {
    const MODULE: &str = "model.layers.0.mlp.up_proj";
    let (rows, cols) = (64, 128);
    let base = QuantizedBase::open(modelopt_fixture()).unwrap();
    let name = format!("{MODULE}.weight");
    assert!(matches!(
        base.weight(&name).unwrap().stored,
        StoredWeight::Nvfp4ModelOpt { .. }
    ));
    let decoded = base.read_weight_f32(&name).unwrap();
    let expected = read_f32(modelopt_fixture().join("expected.f32"));
    assert_eq!(decoded.len(), rows * cols);
    for (i, (d, e)) in decoded.iter().zip(&expected).enumerate() {
        assert_eq!(
            d.to_bits(),
            e.to_bits(),
            "decode [{}, {}]: {d} vs {e}",
            i / cols,
            i % cols
        );
    }

    let source: Vec<f32> = std::fs::read(modelopt_fixture().join("source.bf16"))
        .unwrap()
        .chunks_exact(2)
        .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
        .collect();
    let view = loraq_quant::WeightView::new(&name, rows, cols, &source).unwrap();
    let ours = loraq_quant::scheme::quantize_nvfp4(view).unwrap();
    let ckpt = base.checkpoint();
    assert_eq!(ours.packed, ckpt.bytes(&name).unwrap(), "packed codes");
    assert_eq!(
        ours.block_scales,
        ckpt.bytes(&format!("{MODULE}.weight_scale")).unwrap(),
        "block scales"
    );
    let global = ckpt.read_f32(&format!("{MODULE}.weight_scale_2")).unwrap()[0];
    assert_eq!(
        ours.global_scale,
        loraq_quant::Nvfp4GlobalScale::Multiplier(global)
    );
    // And our fake-quant is ModelOpt's quantize-then-dequantize.
    let fake = loraq_quant::Scheme::Nvfp4.fake_quant(view).unwrap();
    for (i, (f, e)) in fake.iter().zip(&expected).enumerate() {
        assert_eq!(
            f.to_bits(),
            e.to_bits(),
            "fake-quant [{}, {}]",
            i / cols,
            i % cols
        );
    }
}
