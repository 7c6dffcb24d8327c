//! The GGUF reader: one file, or the files of a split model read as one.
//!
//! Layout (GGUF v2 and v3, little-endian; `ggml/src/gguf.cpp`,
//! `gguf_init_from_file_impl`, and `gguf-py/gguf/gguf_reader.py`, `GGUFReader`):
//! magic `GGUF`, version (u32), tensor count (u64), metadata count (u64); the
//! metadata pairs (key string, value type u32, value); the tensor infos (name string,
//! dimension count u32, dimensions u64 each, innermost first, ggml type u32, data
//! offset u64); padding to the alignment (`general.alignment`, u32, a power of two,
//! default 32); the data section. Strings are a u64 byte length and UTF-8 bytes.
//!
//! Everything is checked as ggml's own reader checks it, with checked arithmetic on
//! every count, dimension and offset: a count that the bytes left cannot hold, an
//! unknown value or tensor type, a nested array, a duplicate key or tensor name, a
//! tensor name of 64 bytes or more (`GGML_MAX_NAME`), more than 4 dimensions, a row
//! that is not a whole number of blocks, a size that overflows, an offset other than
//! the previous tensor's end padded to the alignment (ggml requires exactly that), or
//! data past the end of the file. The file is memory-mapped; tensor data is read
//! zero-copy.

use crate::error::{GgufError, Result, os};
use crate::ggml_type::GgmlType;
use crate::value::{MetadataArray, MetadataValue, ValueType};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// `GGUF` as a little-endian u32.
pub const GGUF_MAGIC: u32 = 0x4655_4747;
/// The version loraq writes.
pub const GGUF_VERSION: u32 = 3;
/// The data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key of the data alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Longest tensor name ggml stores, plus its terminating zero (`GGML_MAX_NAME`).
pub const MAX_TENSOR_NAME_BYTES: usize = 64;
/// Most dimensions a ggml tensor has (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// The split model keys (`gguf-py/gguf/constants.py`, `Keys.Split`).
pub const SPLIT_NO_KEY: &str = "split.no";
/// Number of files of a split model.
pub const SPLIT_COUNT_KEY: &str = "split.count";
/// Number of tensors over all files of a split model.
pub const SPLIT_TENSORS_COUNT_KEY: &str = "split.tensors.count";

/// One tensor's entry in a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    /// The tensor name (e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Its ggml type.
    pub ggml_type: GgmlType,
    /// Dimensions in ggml order, innermost (contiguous) first: `[in_features,
    /// out_features]` for a linear's weight.
    pub dims: Vec<u64>,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Bytes of data.
    pub byte_len: u64,
}

impl GgufTensorInfo {
    /// The shape in row-major order, outermost first (torch's order: `[out_features,
    /// in_features]` for a linear's weight). The data is laid out row-major in it.
    pub fn shape(&self) -> Vec<usize> {
        // Each dimension was checked to fit in usize when the file was read.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements.
    pub fn element_count(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }
}

/// Little-endian reads over the mapped file, each checked against its end.
struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn format(&self, reason: String) -> GgufError {
        GgufError::Format {
            path: self.path.to_path_buf(),
            reason,
        }
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.format(format!(
                "truncated: {} at byte {} needs {n} bytes, the file has {} left",
                what(),
                self.pos,
                self.remaining()
            )));
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(&|| format!("the length of {}", what()))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| self.format(format!("{} is not valid UTF-8: {e}", what())))
    }

    /// A count of items each at least `min_bytes` long, refused when the bytes
    /// left cannot hold that many (so no allocation is sized from a hostile count).
    fn count(&mut self, min_bytes: u64, what: &dyn Fn() -> String) -> Result<usize> {
        let n = self.u64(what)?;
        if n.checked_mul(min_bytes)
            .is_none_or(|need| need > self.remaining())
        {
            return Err(self.format(format!(
                "{} is {n}, more than the {} bytes left in the file can hold",
                what(),
                self.remaining()
            )));
        }
        Ok(n as usize)
    }
}

fn read_scalar(
    cur: &mut Cursor<'_>,
    ty: ValueType,
    what: &dyn Fn() -> String,
) -> Result<MetadataValue> {
    Ok(match ty {
        ValueType::U8 => MetadataValue::U8(u8::from_le_bytes(cur.array(what)?)),
        ValueType::I8 => MetadataValue::I8(i8::from_le_bytes(cur.array(what)?)),
        ValueType::U16 => MetadataValue::U16(u16::from_le_bytes(cur.array(what)?)),
        ValueType::I16 => MetadataValue::I16(i16::from_le_bytes(cur.array(what)?)),
        ValueType::U32 => MetadataValue::U32(u32::from_le_bytes(cur.array(what)?)),
        ValueType::I32 => MetadataValue::I32(i32::from_le_bytes(cur.array(what)?)),
        ValueType::F32 => MetadataValue::F32(f32::from_le_bytes(cur.array(what)?)),
        ValueType::U64 => MetadataValue::U64(u64::from_le_bytes(cur.array(what)?)),
        ValueType::I64 => MetadataValue::I64(i64::from_le_bytes(cur.array(what)?)),
        ValueType::F64 => MetadataValue::F64(f64::from_le_bytes(cur.array(what)?)),
        ValueType::Bool => match cur.array::<1>(what)?[0] {
            0 => MetadataValue::Bool(false),
            1 => MetadataValue::Bool(true),
            other => {
                return Err(
                    cur.format(format!("{} is a bool of value {other}, not 0 or 1", what()))
                );
            }
        },
        ValueType::String => MetadataValue::String(cur.string(what)?),
        ValueType::Array => {
            let element = cur.u32(&|| format!("the element type of {}", what()))?;
            let element = ValueType::from_id(element).ok_or_else(|| {
                cur.format(format!("{} has unknown element type {element}", what()))
            })?;
            if element == ValueType::Array {
                return Err(cur.format(format!(
                    "{} is an array of arrays, which ggml does not read",
                    what()
                )));
            }
            let n = cur.count(element.min_bytes(), &|| {
                format!("the element count of {}", what())
            })?;
            let mut items = Vec::with_capacity(n);
            for i in 0..n {
                items.push(read_scalar(cur, element, &|| {
                    format!("element {i} of {}", what())
                })?);
            }
            MetadataValue::Array(collect_array(element, items))
        }
    })
}

fn collect_array(element: ValueType, items: Vec<MetadataValue>) -> MetadataArray {
    macro_rules! gather {
        ($variant:ident) => {
            MetadataArray::$variant(
                items
                    .into_iter()
                    .filter_map(|v| match v {
                        MetadataValue::$variant(x) => Some(x),
                        _ => None,
                    })
                    .collect(),
            )
        };
    }
    match element {
        ValueType::U8 => gather!(U8),
        ValueType::I8 => gather!(I8),
        ValueType::U16 => gather!(U16),
        ValueType::I16 => gather!(I16),
        ValueType::U32 => gather!(U32),
        ValueType::I32 => gather!(I32),
        ValueType::F32 => gather!(F32),
        ValueType::Bool => gather!(Bool),
        ValueType::String => gather!(String),
        ValueType::U64 => gather!(U64),
        ValueType::I64 => gather!(I64),
        // Nested arrays were refused before.
        ValueType::F64 | ValueType::Array => gather!(F64),
    }
}

/// One GGUF file, memory-mapped, its header validated.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    map: Option<Mmap>,
    version: u32,
    metadata: Vec<(String, MetadataValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

impl GgufFile {
    /// Opens and validates a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(os(path))?;
        let len = file.metadata().map_err(os(path))?.len();
        // A zero-length file cannot be mapped on every platform; it is refused below
        // as truncated either way.
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the file is mapped read-only; like every memory-mapped reader
            // (safetensors, llama.cpp) this assumes no other process truncates it
            // while it is open.
            Some(unsafe { Mmap::map(&file) }.map_err(os(path))?)
        };
        GgufFile::parse(path, map)
    }

    /// Parses GGUF bytes held in memory (the fuzz target's entry point); `path`
    /// names them in errors. Tensor data can then be read as from a file.
    pub fn from_bytes(path: impl AsRef<Path>, bytes: &[u8]) -> Result<GgufFile> {
        let path = path.as_ref();
        let map = if bytes.is_empty() {
            None
        } else {
            let mut anon = memmap2::MmapMut::map_anon(bytes.len()).map_err(os(path))?;
            anon.copy_from_slice(bytes);
            Some(anon.make_read_only().map_err(os(path))?)
        };
        GgufFile::parse(path, map)
    }

    fn parse(path: &Path, map: Option<Mmap>) -> Result<GgufFile> {
        let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
        let mut cur = Cursor {
            path,
            bytes,
            pos: 0,
        };
        let magic = cur.u32(&|| "the magic".into())?;
        if magic != GGUF_MAGIC {
            return Err(cur.format(format!(
                "the magic is {:?}, not \"GGUF\"",
                String::from_utf8_lossy(&magic.to_le_bytes())
            )));
        }
        let version = cur.u32(&|| "the version".into())?;
        if !(2..=GGUF_VERSION).contains(&version) {
            return Err(cur.format(format!(
                "version {version}: loraq reads GGUF versions 2 and 3 (version 1 has 32-bit counts; ggml reads nothing newer than 3)"
            )));
        }
        let tensor_count = cur.u64(&|| "the tensor count".into())?;
        let kv_count = cur.u64(&|| "the metadata count".into())?;
        // Each pair takes at least 13 bytes, each tensor info at least 24.
        for (count, min, what) in [
            (kv_count, 13u64, "metadata count"),
            (tensor_count, 24, "tensor count"),
        ] {
            if count
                .checked_mul(min)
                .is_none_or(|need| need > cur.remaining())
            {
                return Err(cur.format(format!(
                    "the {what} is {count}, more than the {} bytes left in the file can hold",
                    cur.remaining()
                )));
            }
        }
        let mut metadata = Vec::with_capacity(kv_count as usize);
        let mut metadata_index = HashMap::with_capacity(kv_count as usize);
        for i in 0..kv_count {
            let key = cur.string(&|| format!("the key of metadata pair {i}"))?;
            if key.is_empty() {
                return Err(cur.format(format!("metadata pair {i} has an empty key")));
            }
            let meta = |reason: String| GgufError::Metadata {
                path: path.to_path_buf(),
                key: key.clone(),
                reason,
            };
            if metadata_index.contains_key(&key) {
                return Err(meta("appears more than once".into()));
            }
            let ty = cur.u32(&|| format!("the type of key {key:?}"))?;
            let ty =
                ValueType::from_id(ty).ok_or_else(|| meta(format!("unknown value type {ty}")))?;
            let value = read_scalar(&mut cur, ty, &|| format!("the value of key {key:?}"))?;
            metadata_index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }
        let alignment = match metadata_index.get(ALIGNMENT_KEY).map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(MetadataValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(MetadataValue::U32(a)) => {
                return Err(GgufError::Metadata {
                    path: path.to_path_buf(),
                    key: ALIGNMENT_KEY.into(),
                    reason: format!("alignment {a} is not a power of two"),
                });
            }
            Some(other) => {
                return Err(GgufError::Metadata {
                    path: path.to_path_buf(),
                    key: ALIGNMENT_KEY.into(),
                    reason: format!("is of type {}, not UINT32", other.value_type()),
                });
            }
        };
        let mut tensors = Vec::with_capacity(tensor_count as usize);
        let mut tensor_index = HashMap::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let name = cur.string(&|| format!("the name of tensor {i}"))?;
            let bad = |reason: String| GgufError::Tensor {
                path: path.to_path_buf(),
                tensor: name.clone(),
                reason,
            };
            if name.len() >= MAX_TENSOR_NAME_BYTES {
                return Err(bad(format!(
                    "the name is {} bytes long; ggml stores at most {} (GGML_MAX_NAME)",
                    name.len(),
                    MAX_TENSOR_NAME_BYTES - 1
                )));
            }
            if tensor_index.contains_key(&name) {
                return Err(bad("appears more than once".into()));
            }
            let n_dims = cur.u32(&|| format!("the dimension count of tensor {name:?}"))?;
            if n_dims as usize > MAX_DIMS {
                return Err(bad(format!(
                    "{n_dims} dimensions; ggml tensors have at most {MAX_DIMS}"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                dims.push(cur.u64(&|| format!("dimension {d} of tensor {name:?}"))?);
            }
            let type_id = cur.u32(&|| format!("the type of tensor {name:?}"))?;
            let offset = cur.u64(&|| format!("the data offset of tensor {name:?}"))?;
            let ggml_type = GgmlType::from_id(type_id)
                .ok_or_else(|| bad(format!("unknown ggml type {type_id}")))?;
            // ggml keeps dimensions and element counts in int64_t.
            let elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64 && usize::try_from(n).is_ok())
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow the element count")))?;
            let row = dims.first().copied().unwrap_or(1);
            let row_bytes = ggml_type.row_bytes(row).ok_or_else(|| {
                bad(format!(
                    "{ggml_type} stores blocks of {} elements, but a row has {row}",
                    ggml_type.block().elements
                ))
            })?;
            let rows = elements.checked_div(row).unwrap_or(0);
            let byte_len = row_bytes
                .checked_mul(rows)
                .filter(|&n| usize::try_from(n).is_ok())
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow the byte size")))?;
            tensor_index.insert(name.clone(), tensors.len());
            tensors.push(GgufTensorInfo {
                name,
                ggml_type,
                dims,
                offset,
                byte_len,
            });
        }
        let data_start = pad(cur.pos as u64, alignment)
            .ok_or_else(|| cur.format("the data section start overflows".into()))?;
        let file_len = bytes.len() as u64;
        let mut expected = 0u64;
        for t in &tensors {
            let bad = |reason: String| GgufError::Tensor {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                reason,
            };
            if t.offset != expected {
                return Err(bad(format!(
                    "data offset {} where ggml expects {expected} (the previous tensor's end padded to the alignment {alignment})",
                    t.offset
                )));
            }
            let end = data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.byte_len))
                .ok_or_else(|| bad("the data end overflows".into()))?;
            if end > file_len {
                return Err(bad(format!(
                    "data [{}, {end}) runs past the end of the file ({file_len} bytes)",
                    end - t.byte_len
                )));
            }
            expected = t
                .offset
                .checked_add(t.byte_len)
                .and_then(|e| pad(e, alignment))
                .ok_or_else(|| bad("the next offset overflows".into()))?;
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            version,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            alignment,
            data_start,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Offset of the data section from the start of the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// Every metadata pair, in file order.
    pub fn metadata(&self) -> &[(String, MetadataValue)] {
        &self.metadata
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The tensor of that name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's data, zero-copy.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let t = self.tensor(name).ok_or_else(|| GgufError::Tensor {
            path: self.path.clone(),
            tensor: name.into(),
            reason: "no such tensor in the file".into(),
        })?;
        // Bounds were checked against the file length when it was opened.
        let start = (self.data_start + t.offset) as usize;
        let bytes: &[u8] = self.map.as_deref().unwrap_or(&[]);
        Ok(&bytes[start..start + t.byte_len as usize])
    }
}

/// `n` rounded up to a multiple of `alignment` (a power of two), or `None` on overflow.
pub fn pad(n: u64, alignment: u64) -> Option<u64> {
    n.checked_add(alignment - 1).map(|x| x & !(alignment - 1))
}

/// The first file's name parts of a split model: `PREFIX-NNNNN-of-MMMMM.gguf` gives
/// `(PREFIX, NNNNN, MMMMM)` (llama.cpp's `llama_split_path`, gguf-py's
/// `SHARD_NAME_FORMAT`).
pub fn split_name_parts(file_name: &str) -> Option<(&str, u32, u32)> {
    let stem = file_name.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, number) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(number) || !digits(count) {
        return None;
    }
    Some((prefix, number.parse().ok()?, count.parse().ok()?))
}

/// The name of file `number` (1-based) of `count` of a split model.
pub fn split_file_name(prefix: &str, number: u32, count: u32) -> String {
    format!("{prefix}-{number:05}-of-{count:05}.gguf")
}

/// A GGUF model: one file, or every file of a split model (`split.count` > 1),
/// opened as one. Metadata comes from the first file (where the converter and
/// `gguf-split` write it); tensors from all.
#[derive(Debug)]
pub struct GgufModel {
    files: Vec<GgufFile>,
    /// Tensor name -> (file, index in that file).
    index: HashMap<String, (usize, usize)>,
}

impl GgufModel {
    /// Opens a GGUF file; when it is the first of a split model
    /// (`NAME-00001-of-0000N.gguf` with `split.count` N), opens the other files
    /// beside it and checks each one's `split.no` and `split.count`, the total tensor
    /// count against `split.tensors.count`, and that no tensor is in two files.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufModel> {
        let path = path.as_ref();
        let first = GgufFile::open(path)?;
        let split_u16 = |file: &GgufFile, key: &str| -> Result<Option<u64>> {
            match file.get(key) {
                None => Ok(None),
                Some(v) => v
                    .to_i128()
                    .and_then(|x| u64::try_from(x).ok())
                    .map(Some)
                    .ok_or_else(|| GgufError::Metadata {
                        path: file.path().to_path_buf(),
                        key: key.into(),
                        reason: format!("{v:?} is not a non-negative integer"),
                    }),
            }
        };
        let count = split_u16(&first, SPLIT_COUNT_KEY)?.unwrap_or(1);
        let mut files = vec![first];
        if count > 1 {
            let file_name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let (prefix, number, name_count) = split_name_parts(&file_name).ok_or_else(|| GgufError::Metadata {
                path: path.to_path_buf(),
                key: SPLIT_COUNT_KEY.into(),
                reason: format!("{count} files, but the name is not NAME-00001-of-{count:05}.gguf, so the others cannot be found"),
            })?;
            if number != 1 || u64::from(name_count) != count {
                return Err(GgufError::Metadata {
                    path: path.to_path_buf(),
                    key: SPLIT_COUNT_KEY.into(),
                    reason: format!(
                        "{count} files: open the first, {}",
                        split_file_name(prefix, 1, count as u32)
                    ),
                });
            }
            for n in 2..=name_count {
                let other = path.with_file_name(split_file_name(prefix, n, name_count));
                files.push(GgufFile::open(&other)?);
            }
        }
        for (i, file) in files.iter().enumerate() {
            if count > 1 {
                let no = split_u16(file, SPLIT_NO_KEY)?;
                let c = split_u16(file, SPLIT_COUNT_KEY)?;
                if no != Some(i as u64) || c != Some(count) {
                    return Err(GgufError::Metadata {
                        path: file.path().to_path_buf(),
                        key: SPLIT_NO_KEY.into(),
                        reason: format!(
                            "file {} of {count} has split.no {no:?} and split.count {c:?} (expected {i} and {count})",
                            i + 1
                        ),
                    });
                }
            }
        }
        let mut index = HashMap::new();
        for (f, file) in files.iter().enumerate() {
            for (t, info) in file.tensors().iter().enumerate() {
                if let Some((other, _)) = index.insert(info.name.clone(), (f, t)) {
                    return Err(GgufError::Tensor {
                        path: file.path().to_path_buf(),
                        tensor: info.name.clone(),
                        reason: format!("is also in {}", files[other].path().display()),
                    });
                }
            }
        }
        if count > 1
            && let Some(total) = files[0].get(SPLIT_TENSORS_COUNT_KEY)
            && total.to_i128() != Some(index.len() as i128)
        {
            return Err(GgufError::Metadata {
                path: files[0].path().to_path_buf(),
                key: SPLIT_TENSORS_COUNT_KEY.into(),
                reason: format!(
                    "says {total:?} tensors, the {count} files hold {}",
                    index.len()
                ),
            });
        }
        Ok(GgufModel { files, index })
    }

    /// The first file's path.
    pub fn path(&self) -> &Path {
        self.files[0].path()
    }

    /// The files, first to last.
    pub fn files(&self) -> &[GgufFile] {
        &self.files
    }

    /// The model's metadata (the first file's).
    pub fn metadata(&self) -> &[(String, MetadataValue)] {
        self.files[0].metadata()
    }

    /// The value of a metadata key (the first file's).
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.files[0].get(key)
    }

    /// Every tensor, file by file in file order.
    pub fn tensors(&self) -> impl Iterator<Item = &GgufTensorInfo> {
        self.files.iter().flat_map(|f| f.tensors().iter())
    }

    /// The number of tensors.
    pub fn tensor_count(&self) -> usize {
        self.index.len()
    }

    /// The tensor of that name and the file holding it.
    pub fn tensor(&self, name: &str) -> Option<(&GgufFile, &GgufTensorInfo)> {
        self.index
            .get(name)
            .map(|&(f, t)| (&self.files[f], &self.files[f].tensors()[t]))
    }

    /// A string metadata value, or an error naming the file and key.
    pub fn require_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong_type(key, v, "STRING"))
    }

    /// A non-negative integer metadata value, or an error naming the file and key.
    pub fn require_usize(&self, key: &str) -> Result<usize> {
        let v = self.require(key)?;
        v.to_i128()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| self.wrong_type(key, v, "a non-negative integer"))
    }

    /// A non-negative integer metadata value when present.
    pub fn optional_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.require_usize(key).map(Some),
        }
    }

    /// A number (float or integer) metadata value when present.
    pub fn optional_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .to_f64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, v, "a number")),
        }
    }

    fn require(&self, key: &str) -> Result<&MetadataValue> {
        self.get(key).ok_or_else(|| GgufError::Metadata {
            path: self.path().to_path_buf(),
            key: key.into(),
            reason: "missing".into(),
        })
    }

    fn wrong_type(&self, key: &str, v: &MetadataValue, wanted: &str) -> GgufError {
        GgufError::Metadata {
            path: self.path().to_path_buf(),
            key: key.into(),
            reason: format!("is {} {v:?}, not {wanted}", v.value_type()),
        }
    }

    /// A tensor's data as f32, row-major in [`GgufTensorInfo::shape`]: F32, F16 and
    /// BF16 are converted exactly; other types are refused by name until their
    /// decoders are wired in.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let (file, info) = self.tensor(name).ok_or_else(|| GgufError::Tensor {
            path: self.path().to_path_buf(),
            tensor: name.into(),
            reason: "no such tensor in the model".into(),
        })?;
        let bytes = file.tensor_bytes(name)?;
        decode_f32(file.path(), info, bytes)
    }
}

/// Decodes a float tensor's bytes to f32 (F32, F16, BF16).
pub fn decode_f32(path: &Path, info: &GgufTensorInfo, bytes: &[u8]) -> Result<Vec<f32>> {
    Ok(match info.ggml_type {
        GgmlType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        GgmlType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        GgmlType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(GgufError::Tensor {
                path: path.to_path_buf(),
                tensor: info.name.clone(),
                reason: format!(
                    "unsupported GGUF tensor type {other}: loraq decodes F32, F16 and BF16"
                ),
            });
        }
    })
}
