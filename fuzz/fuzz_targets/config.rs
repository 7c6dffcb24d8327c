//! Fuzzes config.json: parsing (text_config nesting, layer types, quantization
//! config) and every accessor the commands use on a parsed config. Must refuse or
//! parse; never panic, never allocate by a size the file states without a bound.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use loraq_io::ModelConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(config) = ModelConfig::from_json_str(text, Path::new("config.json")) {
        let _ = config.architecture.is_hybrid();
        let _ = config.text();
        for key in ["head_dim", "num_attention_heads", "num_key_value_heads", "rms_norm_eps"] {
            let _ = config.text_usize(key);
            let _ = config.text_f64(key);
        }
        if let Some(q) = &config.quantization {
            let _ = q.scheme_name();
        }
    }
});
