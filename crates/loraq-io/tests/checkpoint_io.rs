//! Round trips and refusals of the checkpoint reader and writers.

use loraq_io::{
    AtomicDir, Checkpoint, CheckpointWriter, DType, IoError, TensorSpec, verify_sha256sums,
    write_safetensors_file, write_sha256sums,
};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A safetensors file assembled by hand from a header string and a data section.
fn raw_file(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

fn open_err(path: &Path) -> String {
    Checkpoint::open(path).unwrap_err().to_string()
}

#[test]
fn sharded_round_trip_preserves_every_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    std::fs::create_dir(&out).unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = (0..7)
        .map(|i| {
            let shape = vec![3 + i, 5];
            let values = (0..shape[0] * 5)
                .map(|j| (i * 100 + j) as f32 * 0.5)
                .collect();
            (
                format!("model.layers.{i}.mlp.up_proj.weight"),
                shape,
                values,
            )
        })
        .collect();
    let specs = tensors
        .iter()
        .map(|(n, s, _)| TensorSpec::new(n.clone(), DType::F32, s.clone()))
        .collect();
    let mut writer = CheckpointWriter::new(&out, specs, 200, BTreeMap::new()).unwrap();
    assert!(writer.shard_count() > 1);
    for (name, _, values) in &tensors {
        writer.write_tensor(name, &f32_bytes(values)).unwrap();
    }
    writer.finish().unwrap();
    assert!(out.join("model.safetensors.index.json").is_file());
    let ckpt = Checkpoint::open(&out).unwrap();
    assert_eq!(ckpt.len(), tensors.len());
    assert!(ckpt.shard_count() > 1);
    for (name, shape, values) in &tensors {
        assert_eq!(&ckpt.info(name).unwrap().shape, shape);
        assert_eq!(&ckpt.read_f32(name).unwrap(), values);
    }
}

#[test]
fn reads_a_file_written_by_python_safetensors() {
    // Written by scripts/make_io_fixture.py with the `safetensors` package.
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/io/python_written.safetensors");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path.with_extension("json")).unwrap())
            .unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    assert_eq!(
        ckpt.shard_metadata(0).get("format").map(String::as_str),
        Some("pt")
    );
    let tensors = expected["tensors"].as_object().unwrap();
    assert_eq!(ckpt.len(), tensors.len());
    for (name, t) in tensors {
        let info = ckpt.info(name).unwrap();
        assert_eq!(info.dtype.as_str(), t["dtype"].as_str().unwrap(), "{name}");
        let shape: Vec<usize> = serde_json::from_value(t["shape"].clone()).unwrap();
        assert_eq!(info.shape, shape, "{name}");
        if let Some(values) = t.get("values_f32") {
            let values: Vec<f64> = serde_json::from_value(values.clone()).unwrap();
            let got = ckpt.read_f32(name).unwrap();
            for (g, v) in got.iter().zip(&values) {
                assert!(
                    (*g as f64 == *v) || (g.is_nan() && v.is_nan()),
                    "{name}: {g} vs {v}"
                );
            }
        } else {
            let raw: Vec<u8> = serde_json::from_value(t["bytes"].clone()).unwrap();
            assert_eq!(ckpt.bytes(name).unwrap(), raw.as_slice(), "{name}");
        }
    }
}

#[test]
fn header_length_past_the_end_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&path, bytes).unwrap();
    let err = open_err(&path);
    assert!(
        err.contains("bad.safetensors") && err.contains("runs past the end"),
        "{err}"
    );
}

#[test]
fn truncated_file_shorter_than_the_length_prefix_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short.safetensors");
    std::fs::write(&path, [1u8, 2, 3]).unwrap();
    assert!(open_err(&path).contains("shorter than the 8-byte header length"));
}

#[test]
fn offsets_out_of_bounds_are_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("oob.safetensors");
    raw_file(
        &path,
        r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
        &[0u8; 8],
    );
    let err = open_err(&path);
    assert!(
        err.contains("tensor w") && err.contains("run past the end"),
        "{err}"
    );
}

#[test]
fn overlapping_offsets_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("overlap.safetensors");
    raw_file(
        &path,
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
        &[0u8; 12],
    );
    let err = open_err(&path);
    assert!(err.contains("tensor b") && err.contains("overlap"), "{err}");
}

#[test]
fn dtype_and_shape_not_matching_the_byte_range_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lying.safetensors");
    raw_file(
        &path,
        r#"{"w":{"dtype":"BF16","shape":[3,3],"data_offsets":[0,16]}}"#,
        &[0u8; 16],
    );
    let err = open_err(&path);
    assert!(
        err.contains("tensor w") && err.contains("needs 18 bytes"),
        "{err}"
    );
}

#[test]
fn unknown_dtype_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dtype.safetensors");
    raw_file(
        &path,
        r#"{"w":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}}"#,
        &[0u8; 1],
    );
    let err = open_err(&path);
    assert!(
        err.contains("tensor w") && err.contains("unknown dtype \"F7\""),
        "{err}"
    );
}

#[test]
fn shape_overflow_is_refused_without_panicking() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.safetensors");
    raw_file(
        &path,
        r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#,
        &[],
    );
    assert!(open_err(&path).contains("overflows"));
}

#[test]
fn invalid_header_json_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("json.safetensors");
    raw_file(&path, r#"{"w":{"dtype":"F32","#, &[]);
    assert!(open_err(&path).contains("not valid JSON"));
}

fn sharded_fixture(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("ckpt");
    std::fs::create_dir(&out).unwrap();
    let specs = vec![
        TensorSpec::new("a", DType::F32, vec![16]),
        TensorSpec::new("b", DType::F32, vec![16]),
    ];
    let mut writer = CheckpointWriter::new(&out, specs, 64, BTreeMap::new()).unwrap();
    writer.write_tensor("a", &[0u8; 64]).unwrap();
    writer.write_tensor("b", &[0u8; 64]).unwrap();
    writer.finish().unwrap();
    out
}

#[test]
fn index_naming_a_missing_shard_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = sharded_fixture(dir.path());
    std::fs::remove_file(out.join("model-00002-of-00002.safetensors")).unwrap();
    let err = open_err(&out);
    assert!(
        err.contains("model-00002-of-00002.safetensors") && err.contains("not found"),
        "{err}"
    );
}

#[test]
fn index_naming_a_tensor_missing_from_its_shard_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = sharded_fixture(dir.path());
    let index_path = out.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    let err = open_err(&out);
    assert!(
        err.contains("tensor ghost") && err.contains("missing from this shard"),
        "{err}"
    );
}

#[test]
fn invalid_index_json_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = sharded_fixture(dir.path());
    std::fs::write(
        out.join("model.safetensors.index.json"),
        "{\"weight_map\": [",
    )
    .unwrap();
    let err = open_err(&out);
    assert!(
        err.contains("model.safetensors.index.json") && err.contains("invalid JSON"),
        "{err}"
    );
}

#[test]
fn a_directory_without_weights_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    assert!(open_err(dir.path()).contains("not a checkpoint directory"));
    assert!(matches!(
        Checkpoint::open(dir.path().join("nope")),
        Err(IoError::Missing { .. })
    ));
}

#[test]
fn writer_refuses_tensors_out_of_order_or_of_the_wrong_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let specs = vec![
        TensorSpec::new("a", DType::BF16, vec![2]),
        TensorSpec::new("b", DType::BF16, vec![2]),
    ];
    let mut w =
        loraq_io::SafetensorsWriter::create(&path, specs.clone(), &BTreeMap::new()).unwrap();
    assert!(
        w.write_tensor("b", &[0; 4])
            .unwrap_err()
            .to_string()
            .contains("where a was declared")
    );
    assert!(
        w.write_tensor("a", &[0; 3])
            .unwrap_err()
            .to_string()
            .contains("needs 4")
    );
    w.write_tensor("a", &[0; 4]).unwrap();
    assert!(
        w.finish()
            .unwrap_err()
            .to_string()
            .contains("b was declared but never written")
    );
}

#[test]
fn failed_write_leaves_no_target_directory() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out");
    {
        let out = AtomicDir::create(&target, false, &[]).unwrap();
        std::fs::write(out.path().join("partial"), b"x").unwrap();
        // A check fails here: the directory is dropped without commit.
    }
    assert!(!target.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "temp dir left behind"
    );
}

#[test]
fn existing_target_is_refused_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out");
    std::fs::create_dir(&target).unwrap();
    std::fs::write(target.join("old"), b"old").unwrap();
    assert!(matches!(
        AtomicDir::create(&target, false, &[]),
        Err(IoError::OutputExists { .. })
    ));
    let out = AtomicDir::create(&target, true, &[]).unwrap();
    std::fs::write(out.path().join("new"), b"new").unwrap();
    out.commit().unwrap();
    assert!(target.join("new").is_file() && !target.join("old").exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn sha256sums_verify_and_detect_changes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.json"), b"{}\n").unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::fs::write(dir.path().join("sub/b.bin"), b"abc").unwrap();
    write_sha256sums(dir.path()).unwrap();
    let text = std::fs::read_to_string(dir.path().join("SHA256SUMS")).unwrap();
    // sha256("abc"), as `sha256sum` prints it.
    assert!(
        text.contains(
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad  sub/b.bin"
        )
    );
    assert_eq!(verify_sha256sums(dir.path()).unwrap(), 2);
    std::fs::write(dir.path().join("sub/b.bin"), b"abd").unwrap();
    assert!(matches!(
        verify_sha256sums(dir.path()),
        Err(IoError::Checksum { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn writer_round_trips_any_tensor_set(
        tensors in proptest::collection::vec(
            (proptest::collection::vec(0usize..5, 0..4), 0usize..3, any::<u64>()),
            1..8,
        ),
        shard_limit in 1usize..400,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let dtypes = [DType::BF16, DType::F32, DType::U8];
        let mut expected = Vec::new();
        for (i, (shape, d, seed)) in tensors.iter().enumerate() {
            let dtype = dtypes[*d];
            let n: usize = shape.iter().product::<usize>() * dtype.size_bytes();
            let bytes: Vec<u8> = (0..n).map(|j| (seed.wrapping_mul(j as u64 + 1) >> 7) as u8).collect();
            expected.push((TensorSpec::new(format!("t{i}"), dtype, shape.clone()), bytes));
        }
        let specs = expected.iter().map(|(s, _)| s.clone()).collect();
        let mut w = CheckpointWriter::new(dir.path(), specs, shard_limit, BTreeMap::new()).unwrap();
        for (spec, bytes) in &expected {
            w.write_tensor(&spec.name, bytes).unwrap();
        }
        w.finish().unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        prop_assert_eq!(ckpt.len(), expected.len());
        for (spec, bytes) in &expected {
            let info = ckpt.info(&spec.name).unwrap();
            prop_assert_eq!(info.dtype, spec.dtype);
            prop_assert_eq!(&info.shape, &spec.shape);
            prop_assert_eq!(ckpt.bytes(&spec.name).unwrap(), bytes.as_slice());
        }
    }
}

#[test]
fn single_file_written_in_memory_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    let values = [1.5f32, -2.0, 0.25];
    let bytes = f32_bytes(&values);
    write_safetensors_file(
        &path,
        &[(TensorSpec::new("x", DType::F32, vec![3]), &bytes)],
        &BTreeMap::new(),
    )
    .unwrap();
    assert_eq!(
        Checkpoint::open(&path).unwrap().read_f32("x").unwrap(),
        values
    );
}

#[test]
fn duplicate_tensor_names_in_a_header_are_refused() {
    // serde_json's map keeps the last of two equal keys, which hid the first tensor.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dup.safetensors");
    raw_file(
        &path,
        r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
        &[0u8; 8],
    );
    let err = open_err(&path);
    assert!(
        err.contains("dup.safetensors")
            && err.contains("tensor w")
            && err.contains("more than once"),
        "{err}"
    );
}

#[test]
fn control_characters_in_tensor_names_are_escaped_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("esc.safetensors");
    raw_file(
        &path,
        r#"{"w\u001b[2J":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
        &[0u8; 4],
    );
    let err = open_err(&path);
    assert!(!err.contains('\u{1b}'), "{err:?}");
    assert!(err.contains(r"w\u{1b}[2J"), "{err}");
}

#[test]
fn unconvertible_dtype_error_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ints.safetensors");
    raw_file(
        &path,
        r#"{"w":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}}"#,
        &[0u8; 4],
    );
    let err = Checkpoint::open(&path)
        .unwrap()
        .read_f32("w")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ints.safetensors") && err.contains("I16"),
        "{err}"
    );
}

#[test]
fn os_error_is_printed_once_in_the_error_chain() {
    // `loraq: {err:#}` prints every source; the message must not repeat it.
    let dir = tempfile::tempdir().unwrap();
    let not_a_dir = dir.path().join("file");
    std::fs::write(&not_a_dir, b"x").unwrap();
    let err = Checkpoint::open(not_a_dir.join("model.safetensors")).unwrap_err();
    let mut chain = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        chain += &format!(": {s}");
        source = s.source();
    }
    assert_eq!(chain.matches("os error").count(), 1, "{chain}");
}

/// The same checkpoint written through the page cache and with direct I/O: identical
/// files, byte for byte, for shards that end exactly on a direct chunk, cross several
/// chunks, and end in a short unaligned tail (written buffered), and for tiny ones.
#[test]
fn direct_writes_give_the_bytes_of_buffered_writes() {
    use loraq_io::WriteCaching;
    use loraq_io::writer::DIRECT_CHUNK;
    let dir = tempfile::tempdir().unwrap();
    // Tensor sizes in bytes: one chunk minus the header's share, two odd sizes past
    // a chunk boundary, a tiny one; then a small checkpoint on its own.
    let cases: Vec<Vec<usize>> = vec![
        vec![
            DIRECT_CHUNK - 4096,
            3 * DIRECT_CHUNK / 2 + 7,
            5,
            4096 * 3 + 1,
        ],
        vec![12],
    ];
    for (case, sizes) in cases.iter().enumerate() {
        let tensors: Vec<(String, Vec<u8>)> = sizes
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let bytes = (0..len)
                    .map(|j| (j.wrapping_mul(2654435761) >> 13) as u8 ^ i as u8)
                    .collect();
                (format!("t{i}"), bytes)
            })
            .collect();
        let specs: Vec<TensorSpec> = tensors
            .iter()
            .map(|(n, b)| TensorSpec::new(n.clone(), DType::U8, vec![b.len()]))
            .collect();
        let mut files = Vec::new();
        for (caching, max_shard) in [
            (WriteCaching::PageCache, usize::MAX),
            (WriteCaching::Direct, usize::MAX),
            (WriteCaching::PageCache, 2 * DIRECT_CHUNK),
            (WriteCaching::Direct, 2 * DIRECT_CHUNK),
        ] {
            let out = dir.path().join(format!("{case}-{caching:?}-{max_shard}"));
            std::fs::create_dir(&out).unwrap();
            let mut writer = CheckpointWriter::new_with(
                &out,
                specs.clone(),
                max_shard,
                BTreeMap::new(),
                caching,
            )
            .unwrap();
            for (name, bytes) in &tensors {
                writer.write_tensor(name, bytes).unwrap();
            }
            writer.finish().unwrap();
            let mut names: Vec<_> = std::fs::read_dir(&out)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            names.sort();
            let contents: Vec<_> = names
                .iter()
                .map(|n| (n.clone(), std::fs::read(out.join(n)).unwrap()))
                .collect();
            files.push(contents);
            let ckpt = Checkpoint::open(&out).unwrap();
            for (name, bytes) in &tensors {
                assert_eq!(ckpt.bytes(name).unwrap(), &bytes[..], "{name}");
            }
        }
        assert!(files[0] == files[1], "case {case}: one file");
        assert!(files[2] == files[3], "case {case}: shards");
    }
}
