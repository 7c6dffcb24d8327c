//! Fuzzes the GGUF reader: the input as a GGUF file (header, metadata, tensor infos,
//! data offsets), then every tensor's bytes and, for float types, its values; then
//! the input as the first file of a split model beside a valid second file. Every
//! input must end in an error or a result: never a panic, an out-of-bounds read or
//! an allocation sized by a count from the input.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(file) = loraq_gguf::GgufFile::from_bytes("fuzz.gguf", data) {
        for t in file.tensors() {
            if let Ok(bytes) = file.tensor_bytes(&t.name) {
                let _ = loraq_gguf::reader::decode_f32(file.path(), t, bytes);
            }
        }
    }
    let Ok(dir) = tempfile::tempdir() else { return };
    let first = dir.path().join("m-00001-of-00002.gguf");
    if std::fs::write(&first, data).is_err() {
        return;
    }
    let second: &[u8] = include_bytes!("../../tests/data/gguf/split-00002-of-00003.gguf");
    if std::fs::write(dir.path().join("m-00002-of-00002.gguf"), second).is_err() {
        return;
    }
    if let Ok(model) = loraq_gguf::GgufModel::open(&first) {
        let names: Vec<String> = model.tensors().map(|t| t.name.clone()).collect();
        for name in names {
            let _ = model.read_f32(&name);
        }
        let _ = loraq_gguf::BaseLayout::from_gguf(&model);
    }
});
