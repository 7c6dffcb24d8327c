//! Fuzzes adapter_config.json: the input is the config of an adapter directory whose
//! weights are the committed PEFT fixture (tests/data/peft/peft-adapter). Opening
//! must refuse the config or yield modules whose factors read; never a panic (rank
//! and alpha patterns, scales, ranks that disagree with the tensors).
#![no_main]

use libfuzzer_sys::fuzz_target;
use loraq_io::LoraAdapter;

const WEIGHTS: &[u8] =
    include_bytes!("../../tests/data/peft/peft-adapter/adapter_model.safetensors");

fuzz_target!(|data: &[u8]| {
    let Ok(dir) = tempfile::tempdir() else { return };
    if std::fs::write(dir.path().join("adapter_model.safetensors"), WEIGHTS).is_err()
        || std::fs::write(dir.path().join("adapter_config.json"), data).is_err()
    {
        return;
    }
    if let Ok(adapter) = LoraAdapter::open(dir.path()) {
        for module in &adapter.modules {
            let _ = adapter.config.scale_for(&module.module_path);
            let _ = adapter.read_a_f32(&module.module_path);
            let _ = adapter.read_b_f32(&module.module_path);
            let _ = adapter.factor_dtype(&module.module_path);
        }
    }
});
