//! Fuzzes safetensors header parsing and checkpoint opening: the input is split into
//! a shard's bytes and an index file's text; both must be refused with an error,
//! never a panic, an out-of-bounds read or an allocation sized by the input.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = loraq_io::header::parse_header(std::path::Path::new("fuzz"), data);

    let split = data.first().map_or(0, |&b| usize::from(b)).min(data.len());
    let (index, shard) = data.split_at(split);
    let Ok(dir) = tempfile::tempdir() else { return };
    if std::fs::write(dir.path().join("model-00001-of-00001.safetensors"), shard).is_err() {
        return;
    }
    if std::fs::write(dir.path().join("model.safetensors.index.json"), index).is_err() {
        return;
    }
    if let Ok(ckpt) = loraq_io::Checkpoint::open(dir.path()) {
        let names: Vec<String> = ckpt.tensors().map(|t| t.name.clone()).collect();
        for name in names {
            let _ = ckpt.bytes(&name);
            let _ = ckpt.read_f32(&name);
        }
    }
});
