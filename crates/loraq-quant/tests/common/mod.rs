//! Loading the committed oracle vectors of `scripts/quant_oracle.py`.
#![allow(dead_code)] // each test binary uses a different part

use serde_json::Value;
use std::path::PathBuf;

/// `tests/data/quant` at the workspace root.
pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/quant")
}

/// The parsed manifest.json.
pub fn manifest() -> Value {
    let path = data_dir().join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("manifest.json parses")
}

/// Raw bytes of a vector file named in the manifest.
pub fn bytes(name: &Value) -> Vec<u8> {
    let name = name.as_str().expect("file name");
    let path = data_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A little-endian f32 file.
pub fn f32s(name: &Value) -> Vec<f32> {
    bytes(name)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A little-endian bf16 file, widened to f32.
pub fn bf16s(name: &Value) -> Vec<f32> {
    bytes(name)
        .chunks_exact(2)
        .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
        .collect()
}

/// A usize field.
pub fn usize_of(value: &Value) -> usize {
    value.as_u64().expect("unsigned integer") as usize
}

/// Lower-case hex SHA-256 of f32 values as little-endian bytes.
pub fn sha256_f32(values: &[f32]) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for v in values {
        hasher.update(v.to_le_bytes());
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
