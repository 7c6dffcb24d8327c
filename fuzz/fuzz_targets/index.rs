//! Fuzzes the sharded-checkpoint index: the input is `model.safetensors.index.json`
//! beside two valid shards (`model-00001-of-00002.safetensors` holding `a`,
//! `model-00002-of-00002.safetensors` holding `b`). Whatever the index says (missing
//! or extra shards, names outside the directory, tensors mapped to the wrong shard,
//! duplicate keys), opening must end in an error or a checkpoint whose every tensor
//! reads; never a panic.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use loraq_io::{DType, TensorSpec, write_safetensors_file};

/// The shards, written once; each run copies them next to its own index.
fn shards() -> &'static (tempfile::TempDir, [PathBuf; 2]) {
    static SHARDS: OnceLock<(tempfile::TempDir, [PathBuf; 2])> = OnceLock::new();
    SHARDS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let write = |file: &str, name: &str| {
            let path = dir.path().join(file);
            let bytes = [0u8; 8];
            let spec = TensorSpec::new(name.to_string(), DType::F32, vec![2]);
            write_safetensors_file(&path, &[(spec, &bytes[..])], &Default::default())
                .expect("write shard");
            path
        };
        let a = write("model-00001-of-00002.safetensors", "a");
        let b = write("model-00002-of-00002.safetensors", "b");
        (dir, [a, b])
    })
}

fuzz_target!(|data: &[u8]| {
    let (_, shard_paths) = shards();
    let Ok(dir) = tempfile::tempdir() else { return };
    for shard in shard_paths {
        let name = shard.file_name().expect("shard name");
        if std::fs::copy(shard, dir.path().join(name)).is_err() {
            return;
        }
    }
    if std::fs::write(dir.path().join(loraq_io::INDEX_FILE), data).is_err() {
        return;
    }
    for root in [dir.path(), Path::new(&dir.path().join(loraq_io::INDEX_FILE))] {
        if let Ok(ckpt) = loraq_io::Checkpoint::open(root) {
            let names: Vec<String> = ckpt.tensors().map(|t| t.name.clone()).collect();
            for name in names {
                let _ = ckpt.read_f32(&name);
            }
        }
    }
});
