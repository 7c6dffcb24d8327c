//! Parsing and validation of one safetensors file's header.
//!
//! The format: 8 bytes little-endian `N`, then `N` bytes of JSON mapping tensor
//! names to `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to the
//! data section that follows the header), plus an optional `__metadata__` map of
//! strings. Every size from the file is checked before it is used.

use crate::dtype::DType;
use crate::error::{IoError, Result};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

/// Largest header accepted, as the reference implementation does (100 MB).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor entry of a header, validated against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// Byte range relative to the start of the data section.
    pub data_range: Range<usize>,
}

/// A validated safetensors header.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    /// Offset of the data section from the start of the file (8 + header length).
    pub data_start: usize,
    /// Entries in the order of their data offsets.
    pub entries: Vec<HeaderEntry>,
    /// The `__metadata__` map, empty when absent.
    pub metadata: BTreeMap<String, String>,
}

/// Number of elements of a shape, or `None` on overflow.
pub fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Byte size of a tensor of `dtype` and `shape`, or `None` on overflow.
pub fn byte_size(dtype: DType, shape: &[usize]) -> Option<usize> {
    element_count(shape)?.checked_mul(dtype.size_bytes())
}

/// Parses and validates the header of a safetensors file whose whole content
/// (or at least its first `file_len` bytes' worth of mapping) is `bytes`.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header> {
    let header_err = |reason: String| IoError::Header {
        path: path.to_path_buf(),
        reason,
    };
    let file_len = bytes.len();
    if file_len < 8 {
        return Err(header_err(format!(
            "file is {file_len} bytes, shorter than the 8-byte header length"
        )));
    }
    let declared = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if declared > MAX_HEADER_BYTES {
        return Err(header_err(format!(
            "header length {declared} exceeds the {MAX_HEADER_BYTES}-byte limit"
        )));
    }
    let header_len = usize::try_from(declared)
        .map_err(|_| header_err(format!("header length {declared} does not fit in memory")))?;
    let data_start = header_len
        .checked_add(8)
        .filter(|&end| end <= file_len)
        .ok_or_else(|| {
            header_err(format!(
                "header length {declared} runs past the end of the file ({file_len} bytes)"
            ))
        })?;
    let json = std::str::from_utf8(&bytes[8..data_start])
        .map_err(|e| header_err(format!("header is not UTF-8: {e}")))?;
    let value: HeaderObject = serde_json::from_str(json.trim_end_matches(' '))
        .map_err(|e| header_err(format!("header is not valid JSON (an object): {e}")))?;
    let object = value.0;
    // A JSON object may repeat a key; a map would keep the last and hide the other
    // tensor, so a repeated name is refused.
    let mut seen = std::collections::HashSet::with_capacity(object.len());
    if let Some((name, _)) = object.iter().find(|(name, _)| !seen.insert(name.as_str())) {
        return Err(IoError::Tensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            reason: "the name appears more than once in the header".into(),
        });
    }
    let data_len = file_len - data_start;

    let mut metadata = BTreeMap::new();
    let mut entries = Vec::with_capacity(object.len());
    for (name, entry) in &object {
        if name == "__metadata__" {
            let map = entry
                .as_object()
                .ok_or_else(|| header_err("__metadata__ is not an object".to_string()))?;
            for (k, v) in map {
                let v = v.as_str().ok_or_else(|| {
                    header_err(format!("__metadata__ value of {k:?} is not a string"))
                })?;
                metadata.insert(k.clone(), v.to_string());
            }
            continue;
        }
        entries.push(parse_entry(path, name, entry, data_len)?);
    }
    entries.sort_by_key(|e| (e.data_range.start, e.data_range.end));
    for pair in entries.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if b.data_range.start < a.data_range.end {
            return Err(IoError::Tensor {
                path: path.to_path_buf(),
                tensor: b.name.clone(),
                reason: format!(
                    "data_offsets {:?} overlap those of {} {:?}",
                    b.data_range, a.name, a.data_range
                ),
            });
        }
    }
    Ok(Header {
        data_start,
        entries,
        metadata,
    })
}

/// A header's top-level JSON object with every key in file order, repeats kept.
struct HeaderObject(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for HeaderObject {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = HeaderObject;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<HeaderObject, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    entries.push(entry);
                }
                Ok(HeaderObject(entries))
            }
        }
        d.deserialize_map(Visitor)
    }
}

fn parse_entry(
    path: &Path,
    name: &str,
    entry: &serde_json::Value,
    data_len: usize,
) -> Result<HeaderEntry> {
    let bad = |reason: String| IoError::Tensor {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        reason,
    };
    let obj = entry
        .as_object()
        .ok_or_else(|| bad("entry is not an object".into()))?;
    let dtype_str = obj
        .get("dtype")
        .and_then(|v| v.as_str())
        .ok_or_else(|| bad("missing string field dtype".into()))?;
    let dtype = DType::from_safetensors_name(dtype_str).ok_or_else(|| IoError::UnknownDtype {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        dtype: dtype_str.to_string(),
    })?;
    let shape = obj
        .get("shape")
        .and_then(|v| v.as_array())
        .ok_or_else(|| bad("missing array field shape".into()))?
        .iter()
        .map(|d| {
            d.as_u64()
                .and_then(|d| usize::try_from(d).ok())
                .ok_or_else(|| bad(format!("shape dimension {d} is not a non-negative integer")))
        })
        .collect::<Result<Vec<usize>>>()?;
    let offsets = obj
        .get("data_offsets")
        .and_then(|v| v.as_array())
        .filter(|a| a.len() == 2)
        .ok_or_else(|| bad("data_offsets is not a pair of integers".into()))?;
    let offset = |v: &serde_json::Value| {
        v.as_u64()
            .and_then(|o| usize::try_from(o).ok())
            .ok_or_else(|| bad(format!("data offset {v} is not a non-negative integer")))
    };
    let (begin, end) = (offset(&offsets[0])?, offset(&offsets[1])?);
    if begin > end {
        return Err(bad(format!("data_offsets [{begin}, {end}] are reversed")));
    }
    if end > data_len {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] run past the end of the data section ({data_len} bytes)"
        )));
    }
    let expected = byte_size(dtype, &shape)
        .ok_or_else(|| bad(format!("shape {shape:?} overflows the address space")))?;
    if end - begin != expected {
        return Err(bad(format!(
            "{dtype} x {shape:?} needs {expected} bytes but data_offsets [{begin}, {end}] hold {}",
            end - begin
        )));
    }
    Ok(HeaderEntry {
        name: name.to_string(),
        dtype,
        shape,
        data_range: begin..end,
    })
}
