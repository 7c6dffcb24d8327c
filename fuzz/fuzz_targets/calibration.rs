//! Fuzzes the calibration statistics file (`loraq run --collect-stats`, read by
//! `extract --calibration`): a safetensors file whose metadata, names, dtypes,
//! shapes and values are checked. Must refuse or read; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(dir) = tempfile::tempdir() else { return };
    let path = dir.path().join("calibration.safetensors");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(stats) = loraq_io::read_activation_stats(&path) {
        let modules: Vec<String> = stats.input_sq_mean.keys().cloned().collect();
        for module in modules {
            let _ = stats.module(&module);
        }
    }
});
