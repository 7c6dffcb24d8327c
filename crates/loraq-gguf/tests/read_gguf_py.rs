//! The reader against gguf-py: tests/data/gguf/ holds files written by gguf-py's
//! GGUFWriter (every metadata type, a custom alignment, float and Q8_0 tensors of
//! 1 to 4 dimensions, a model split in three files) and expected.json, each file as
//! gguf-py's GGUFReader reads it (scripts/gguf_oracle.py fixtures). Also hostile
//! headers: every one an error naming the file (and the tensor or key), no panic.

use loraq_gguf::{GgufError, GgufFile, GgufModel, MetadataArray, MetadataValue};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/gguf")
}

fn expected() -> Vec<Value> {
    let text = std::fs::read_to_string(data_dir().join("expected.json")).unwrap();
    serde_json::from_str::<Value>(&text)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn json_of_array(a: &MetadataArray) -> Vec<Value> {
    match a {
        MetadataArray::U8(v) => v.iter().map(|&x| x.into()).collect(),
        MetadataArray::I8(v) => v.iter().map(|&x| x.into()).collect(),
        MetadataArray::U16(v) => v.iter().map(|&x| x.into()).collect(),
        MetadataArray::I16(v) => v.iter().map(|&x| x.into()).collect(),
        MetadataArray::U32(v) => v.iter().map(|&x| x.into()).collect(),
        MetadataArray::I32(v) => v.iter().map(|&x| x.into()).collect(),
        MetadataArray::F32(v) => v.iter().map(|&x| f64::from(x).into()).collect(),
        MetadataArray::Bool(v) => v.iter().map(|&x| x.into()).collect(),
        MetadataArray::String(v) => v.iter().map(|x| x.as_str().into()).collect(),
        MetadataArray::U64(v) => v.iter().map(|&x| x.into()).collect(),
        MetadataArray::I64(v) => v.iter().map(|&x| x.into()).collect(),
        MetadataArray::F64(v) => v.iter().map(|&x| x.into()).collect(),
    }
}

fn json_of(v: &MetadataValue) -> Value {
    match v {
        MetadataValue::U8(x) => (*x).into(),
        MetadataValue::I8(x) => (*x).into(),
        MetadataValue::U16(x) => (*x).into(),
        MetadataValue::I16(x) => (*x).into(),
        MetadataValue::U32(x) => (*x).into(),
        MetadataValue::I32(x) => (*x).into(),
        MetadataValue::F32(x) => f64::from(*x).into(),
        MetadataValue::Bool(x) => (*x).into(),
        MetadataValue::String(x) => x.as_str().into(),
        MetadataValue::Array(a) => json_of_array(a).into(),
        MetadataValue::U64(x) => (*x).into(),
        MetadataValue::I64(x) => (*x).into(),
        MetadataValue::F64(x) => (*x).into(),
    }
}

/// Equal, numbers compared as integers when both are, else to the last bit a
/// decimal round trip may lose (serde_json's float parsing is not always correctly
/// rounded).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            if let (Some(p), Some(q)) = (x.as_i64(), y.as_i64()) {
                return p == q;
            }
            if let (Some(p), Some(q)) = (x.as_u64(), y.as_u64()) {
                return p == q;
            }
            let (p, q) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            p == q || (p - q).abs() <= 4.0 * f64::EPSILON * p.abs().max(q.abs())
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(p, q))
        }
        _ => a == b,
    }
}

fn check_file(file: &GgufFile, want: &Value) {
    let name = want["file"].as_str().unwrap();
    assert_eq!(
        file.alignment(),
        want["alignment"].as_u64().unwrap(),
        "{name}"
    );
    assert_eq!(
        file.data_start(),
        want["data_offset"].as_u64().unwrap(),
        "{name}"
    );
    let metadata = want["metadata"].as_array().unwrap();
    assert_eq!(file.metadata().len(), metadata.len(), "{name}");
    for ((key, value), w) in file.metadata().iter().zip(metadata) {
        assert_eq!(key, w["key"].as_str().unwrap(), "{name}");
        assert_eq!(
            value.value_type().name(),
            w["type"].as_str().unwrap(),
            "{name} {key}"
        );
        if let MetadataValue::Array(a) = value {
            assert_eq!(
                a.element_type().name(),
                w["element"].as_str().unwrap(),
                "{name} {key}"
            );
        }
        assert!(
            same(&json_of(value), &w["value"]),
            "{name} {key}: {value:?} vs {}",
            w["value"]
        );
    }
    let tensors = want["tensors"].as_array().unwrap();
    assert_eq!(file.tensors().len(), tensors.len(), "{name}");
    for (t, w) in file.tensors().iter().zip(tensors) {
        assert_eq!(t.name, w["name"].as_str().unwrap());
        assert_eq!(
            t.ggml_type.name(),
            w["type"].as_str().unwrap(),
            "{}",
            t.name
        );
        let dims: Vec<u64> = w["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(t.offset, w["offset"].as_u64().unwrap(), "{}", t.name);
        let bytes = file.tensor_bytes(&t.name).unwrap();
        let digest: String = Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(digest, w["sha256"].as_str().unwrap(), "{}", t.name);
        if let Some(values) = w.get("values") {
            let ours = loraq_gguf::reader::decode_f32(file.path(), t, bytes).unwrap();
            let theirs: Vec<f64> = values
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            assert_eq!(ours.len(), theirs.len(), "{}", t.name);
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                // gguf-py's values are f32 (or f16 / bf16) widened to f64, printed
                // exactly; serde_json's parse of the decimal may miss the last f64
                // bit, never the f32.
                assert_eq!(*a, *b as f32, "{} element {i}", t.name);
            }
        }
    }
}

#[test]
fn reads_what_gguf_py_wrote_as_gguf_py_reads_it() {
    for want in expected() {
        let path = data_dir().join(want["file"].as_str().unwrap());
        check_file(&GgufFile::open(&path).unwrap(), &want);
    }
    // The every-type file's float tensors in row-major order: the 4-D one's shape
    // is the reverse of ggml's dimensions.
    let file = GgufFile::open(data_dir().join("every-type.gguf")).unwrap();
    assert_eq!(file.tensor("four.f32").unwrap().shape(), vec![2, 1, 3, 2]);
    assert_eq!(file.tensor("rows.q8_0").unwrap().byte_len, 2 * 34 * 2);
}

#[test]
fn reads_a_split_model_as_one() {
    let want = expected();
    let model = GgufModel::open(data_dir().join("split-00001-of-00003.gguf")).unwrap();
    assert_eq!(model.files().len(), 3);
    assert_eq!(model.tensor_count(), 5);
    assert_eq!(model.require_str("general.name").unwrap(), "split fixture");
    assert_eq!(model.require_usize("qwen3.block_count").unwrap(), 2);
    for (i, w) in want[1..].iter().enumerate() {
        for t in w["tensors"].as_array().unwrap() {
            let name = t["name"].as_str().unwrap();
            let (file, _) = model.tensor(name).unwrap();
            assert!(
                file.path().ends_with(w["file"].as_str().unwrap()),
                "{name} in file {i}"
            );
            let values: Vec<f32> = t["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            let ours = model.read_f32(name).unwrap();
            assert_eq!(ours, values, "{name}");
        }
    }
    // Opening another file than the first names the first.
    let err = GgufModel::open(data_dir().join("split-00002-of-00003.gguf")).unwrap_err();
    assert!(
        err.to_string().contains("split-00001-of-00003.gguf"),
        "{err}"
    );
    // A missing file of the set is an error naming it.
    let dir = tempfile::tempdir().unwrap();
    for n in [1, 2] {
        let name = format!("split-0000{n}-of-00003.gguf");
        std::fs::copy(data_dir().join(&name), dir.path().join(&name)).unwrap();
    }
    let err = GgufModel::open(dir.path().join("split-00001-of-00003.gguf")).unwrap_err();
    assert!(
        err.to_string().contains("split-00003-of-00003.gguf"),
        "{err}"
    );
    // Two files claiming the same place in the set are refused.
    std::fs::copy(
        data_dir().join("split-00002-of-00003.gguf"),
        dir.path().join("split-00003-of-00003.gguf"),
    )
    .unwrap();
    let err = GgufModel::open(dir.path().join("split-00001-of-00003.gguf")).unwrap_err();
    assert!(err.to_string().contains("split.no"), "{err}");
}

/// A GGUF file assembled by hand, so that each field can be made hostile.
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, tensors: u64, kvs: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(tensors).u64(kvs);
        r
    }
    fn u32(&mut self, x: u32) -> &mut Raw {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u64(&mut self, x: u64) -> &mut Raw {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Raw {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn kv_u32(&mut self, key: &str, x: u32) -> &mut Raw {
        self.str(key).u32(4).u32(x)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Raw {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad_data(&mut self, bytes: usize) -> &mut Raw {
        let start = self.0.len().div_ceil(32) * 32;
        self.0.resize(start + bytes, 0);
        self
    }
}

fn refused(bytes: &[u8]) -> String {
    match GgufFile::from_bytes("hostile.gguf", bytes) {
        Ok(_) => panic!("accepted a hostile file"),
        Err(e) => {
            let text = e.to_string();
            assert!(text.starts_with("hostile.gguf"), "{text}");
            text
        }
    }
}

#[test]
fn hostile_headers_are_refused_naming_file_and_tensor() {
    // Every truncation of a valid file is an error, never a panic.
    let whole = std::fs::read(data_dir().join("every-type.gguf")).unwrap();
    let file = GgufFile::from_bytes("hostile.gguf", &whole).unwrap();
    assert_eq!(file.tensors().len(), 5);
    for cut in 0..whole.len() {
        if GgufFile::from_bytes("hostile.gguf", &whole[..cut]).is_ok() {
            // Only cuts inside the last tensor's padding leave a readable file.
            let last = file.tensors().last().unwrap();
            assert!(
                cut as u64 >= file.data_start() + last.offset + last.byte_len,
                "cut {cut}"
            );
        }
    }
    assert!(refused(b"").contains("truncated"));
    assert!(refused(b"GGML\x03\0\0\0").contains("magic"));
    assert!(refused(&Raw::header(1, 0, 0).0).contains("version 1"));
    assert!(refused(&Raw::header(4, 0, 0).0).contains("version 4"));
    assert!(refused(&Raw::header(3, u64::MAX, 0).0).contains("tensor count"));
    assert!(refused(&Raw::header(3, 0, 1 << 60).0).contains("metadata count"));
    let mut r = Raw::header(3, 0, 1);
    r.u64(u64::MAX).u64(0).u64(0);
    assert!(refused(&r.0).contains("truncated"));
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(13).u32(0);
    assert!(refused(&r.0).contains("unknown value type 13"));
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(9).u32(9).u64(1);
    assert!(refused(&r.0).contains("array of arrays"));
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(9).u32(10).u64(u64::MAX / 2);
    assert!(refused(&r.0).contains("element count"));
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(7);
    r.0.push(2);
    assert!(refused(&r.0).contains("not 0 or 1"));
    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("k", 1).kv_u32("k", 2);
    assert!(refused(&r.0).contains("key k: appears more than once"));
    let mut r = Raw::header(3, 0, 1);
    r.kv_u32("general.alignment", 48);
    assert!(refused(&r.0).contains("not a power of two"));
    let mut r = Raw::header(3, 0, 1);
    r.str("general.alignment").u32(8).str("32");
    assert!(refused(&r.0).contains("not UINT32"));
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(8).u64(2);
    r.0.extend_from_slice(&[0xff, 0xfe]);
    assert!(refused(&r.0).contains("UTF-8"));

    let tensor = |dims: &[u64], ty: u32, offset: u64, data: usize| {
        let mut r = Raw::header(3, 1, 0);
        r.tensor("blk.0.attn_q.weight", dims, ty, offset)
            .pad_data(data);
        r.0
    };
    assert!(GgufFile::from_bytes("ok.gguf", &tensor(&[4, 2], 0, 0, 32)).is_ok());
    let e = refused(&tensor(&[4, 2], 0, 0, 31));
    assert!(
        e.contains("tensor blk.0.attn_q.weight") && e.contains("past the end"),
        "{e}"
    );
    assert!(refused(&tensor(&[4, 2], 0, 32, 64)).contains("ggml expects 0"));
    assert!(refused(&tensor(&[4, 2], 4, 0, 32)).contains("unknown ggml type 4"));
    assert!(refused(&tensor(&[4, 2], 99, 0, 32)).contains("unknown ggml type 99"));
    assert!(refused(&tensor(&[1 << 40, 1 << 40], 0, 0, 32)).contains("overflow"));
    assert!(refused(&tensor(&[u64::MAX, 1], 0, 0, 32)).contains("overflow"));
    assert!(refused(&tensor(&[(1 << 62) - 1], 0, 0, 32)).contains("overflow"));
    assert!(refused(&tensor(&[33, 1], 8, 0, 64)).contains("blocks of 32"));
    assert!(refused(&tensor(&[1, 1, 1, 1, 1], 0, 0, 32)).contains("5 dimensions"));
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[1], 0, 0)
        .tensor("a", &[1], 0, 32)
        .pad_data(64);
    assert!(refused(&r.0).contains("tensor a: appears more than once"));
    let long = "x".repeat(64);
    let mut r = Raw::header(3, 1, 0);
    r.tensor(&long, &[1], 0, 0).pad_data(32);
    assert!(refused(&r.0).contains("GGML_MAX_NAME"));
    let mut r = Raw::header(3, 1, 0);
    r.str("a").u32(u32::MAX).u64(0).u64(0);
    assert!(refused(&r.0).contains("dimensions"));
    // Errors from a missing file name it.
    let missing = GgufFile::open("/nonexistent/x.gguf").unwrap_err();
    assert!(matches!(missing, GgufError::Os { .. }));
}
