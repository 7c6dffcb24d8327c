//! The GGUF writer: metadata of every type, tensors padded to the alignment, in the
//! layout [`crate::reader`] describes (version 3, offsets as ggml expects them: each
//! tensor at the previous one's end padded to the alignment, as gguf-py's
//! `GGUFWriter.write_ti_data_to_file` places them).
//!
//! The writer holds the tensors in memory and writes one file; commands stage its
//! path through loraq-io ([`loraq_io::StagedOutputs`]), library callers use
//! [`GgufWriter::write_atomically`].

use crate::error::{GgufError, Result, os};
use crate::ggml_type::GgmlType;
use crate::reader::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, MAX_DIMS, MAX_TENSOR_NAME_BYTES,
    pad,
};
use crate::value::{MetadataArray, MetadataValue};
use std::collections::HashSet;
use std::io::{BufWriter, Write};
use std::path::Path;

struct PendingTensor {
    name: String,
    ggml_type: GgmlType,
    /// ggml order, innermost first.
    dims: Vec<u64>,
    data: Vec<u8>,
}

/// A GGUF file being assembled.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetadataValue)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
}

fn refused(path: &Path, tensor: &str, reason: String) -> GgufError {
    GgufError::Tensor {
        path: path.to_path_buf(),
        tensor: tensor.into(),
        reason,
    }
}

impl GgufWriter {
    /// An empty file: no metadata, no tensors.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Adds a metadata pair; a key already added, or an empty one, is refused.
    /// `general.alignment` must be a UINT32 power of two: it sets the data alignment.
    pub fn add_metadata(&mut self, key: impl Into<String>, value: MetadataValue) -> Result<()> {
        let key = key.into();
        let bad = |reason: &str| GgufError::Metadata {
            path: "<gguf writer>".into(),
            key: key.clone(),
            reason: reason.into(),
        };
        if key.is_empty() {
            return Err(bad("empty key"));
        }
        if self.keys.contains(&key) {
            return Err(bad("added twice"));
        }
        if key == ALIGNMENT_KEY && !matches!(value, MetadataValue::U32(a) if a.is_power_of_two()) {
            return Err(bad("must be a UINT32 power of two"));
        }
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(())
    }

    /// Adds a tensor: `shape` in row-major order, outermost first (`[out_features,
    /// in_features]` for a linear's weight), `data` its bytes in ggml's layout for
    /// `ggml_type`. Refuses a name added twice or too long for ggml, more than 4
    /// dimensions, a row that is not a whole number of blocks, and data of the wrong
    /// size.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ggml_type: GgmlType,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<()> {
        let name = name.into();
        let here = Path::new("<gguf writer>");
        if self.names.contains(&name) {
            return Err(refused(here, &name, "added twice".into()));
        }
        let (dims, expected) = tensor_dims_and_bytes(here, &name, ggml_type, shape)?;
        if expected != data.len() as u64 {
            return Err(refused(
                here,
                &name,
                format!(
                    "{} bytes of data, shape {shape:?} in {ggml_type} needs {expected}",
                    data.len()
                ),
            ));
        }
        self.names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            ggml_type,
            dims,
            data,
        });
        Ok(())
    }

    fn alignment(&self) -> u64 {
        self.metadata
            .iter()
            .find_map(|(k, v)| match (k.as_str(), v) {
                (ALIGNMENT_KEY, MetadataValue::U32(a)) => Some(u64::from(*a)),
                _ => None,
            })
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Writes the file at `path` (created or truncated).
    pub fn write(&self, path: &Path) -> Result<()> {
        let file = std::fs::File::create(path).map_err(os(path))?;
        let mut out = BufWriter::new(file);
        let mut header = self.metadata_header(self.tensors.len());
        let alignment = self.alignment();
        let mut offset = 0u64;
        for t in &self.tensors {
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offset =
                pad(offset + t.data.len() as u64, alignment).expect("in-memory sizes fit in u64");
        }
        let data_start = pad(header.len() as u64, alignment).expect("in-memory sizes fit in u64");
        header.resize(data_start as usize, 0);
        out.write_all(&header).map_err(os(path))?;
        let zeros = vec![0u8; alignment as usize];
        for t in &self.tensors {
            out.write_all(&t.data).map_err(os(path))?;
            let padding = pad(t.data.len() as u64, alignment).expect("fits") - t.data.len() as u64;
            out.write_all(&zeros[..padding as usize])
                .map_err(os(path))?;
        }
        out.into_inner()
            .map_err(|e| GgufError::Os {
                path: path.to_path_buf(),
                source: e.into_error(),
            })?
            .sync_all()
            .map_err(os(path))
    }

    /// Writes the metadata added so far and the tensors `specs` (none may have been
    /// added with [`GgufWriter::add_tensor`]) at `path`, asking `data` for each tensor's
    /// bytes in order, one at a time, so that a model larger than memory streams
    /// through: the header is complete before the first byte of data (every tensor's
    /// size follows from its type and shape). A tensor whose bytes do not have the
    /// size its spec implies is refused.
    pub fn write_streamed<E: From<GgufError>>(
        &self,
        path: &Path,
        specs: &[TensorSpec],
        data: &mut dyn FnMut(usize) -> std::result::Result<Vec<u8>, E>,
    ) -> std::result::Result<(), E> {
        if let Some(t) = self.tensors.first() {
            return Err(refused(
                path,
                &t.name,
                "added with add_tensor to a streamed file".into(),
            )
            .into());
        }
        let mut names = HashSet::new();
        let mut sizes = Vec::with_capacity(specs.len());
        let mut infos = Vec::with_capacity(specs.len());
        for spec in specs {
            if !names.insert(spec.name.as_str()) {
                return Err(refused(path, &spec.name, "added twice".into()).into());
            }
            let (dims, bytes) =
                tensor_dims_and_bytes(path, &spec.name, spec.ggml_type, &spec.shape)?;
            sizes.push(bytes);
            infos.push(dims);
        }
        let file = std::fs::File::create(path).map_err(os(path))?;
        let mut out = BufWriter::new(file);
        let alignment = self.alignment();
        let mut header = self.metadata_header(specs.len());
        let mut offset = 0u64;
        for ((spec, dims), &bytes) in specs.iter().zip(&infos).zip(&sizes) {
            put_string(&mut header, &spec.name);
            header.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&spec.ggml_type.id().to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offset = offset
                .checked_add(bytes)
                .and_then(|end| pad(end, alignment))
                .ok_or_else(|| refused(path, &spec.name, "file size overflows 64 bits".into()))?;
        }
        let data_start = pad(header.len() as u64, alignment).expect("in-memory sizes fit in u64");
        header.resize(data_start as usize, 0);
        out.write_all(&header).map_err(os(path))?;
        let zeros = vec![0u8; alignment as usize];
        for (index, (spec, &bytes)) in specs.iter().zip(&sizes).enumerate() {
            let tensor = data(index)?;
            if tensor.len() as u64 != bytes {
                return Err(refused(
                    path,
                    &spec.name,
                    format!("{} bytes of data, its spec needs {bytes}", tensor.len()),
                )
                .into());
            }
            out.write_all(&tensor).map_err(os(path))?;
            let padding = pad(bytes, alignment).expect("checked above") - bytes;
            out.write_all(&zeros[..padding as usize])
                .map_err(os(path))?;
        }
        out.into_inner()
            .map_err(|e| GgufError::Os {
                path: path.to_path_buf(),
                source: e.into_error(),
            })?
            .sync_all()
            .map_err(os(path))?;
        Ok(())
    }

    /// Magic, version, counts and metadata pairs of a file of `tensor_count` tensors.
    fn metadata_header(&self, tensor_count: usize) -> Vec<u8> {
        let mut header = Vec::new();
        header.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
        header.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        header.extend_from_slice(&(tensor_count as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut header, key);
            header.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut header, value);
        }
        header
    }

    /// Writes the file so that `path` appears only when complete
    /// ([`loraq_io::write_file_atomically`]).
    pub fn write_atomically(&self, path: &Path) -> Result<()> {
        loraq_io::write_file_atomically(path, |temp| self.write(temp))
    }
}

/// ggml's dimensions (innermost first) and the byte size of a tensor of `shape`
/// (outermost first) in `ggml_type`, refusing more than 4 dimensions and rows that are
/// not whole blocks.
fn tensor_dims_and_bytes(
    path: &Path,
    name: &str,
    ggml_type: GgmlType,
    shape: &[usize],
) -> Result<(Vec<u64>, u64)> {
    if name.len() >= MAX_TENSOR_NAME_BYTES {
        return Err(refused(
            path,
            name,
            format!(
                "name longer than ggml's {} bytes",
                MAX_TENSOR_NAME_BYTES - 1
            ),
        ));
    }
    if shape.len() > MAX_DIMS {
        return Err(refused(
            path,
            name,
            format!("{} dimensions, ggml has at most {MAX_DIMS}", shape.len()),
        ));
    }
    let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
    let row = dims.first().copied().unwrap_or(1);
    let rows = dims.iter().skip(1).try_fold(1u64, |a, &d| a.checked_mul(d));
    let bytes = ggml_type
        .row_bytes(row)
        .zip(rows)
        .and_then(|(r, n)| r.checked_mul(n))
        .ok_or_else(|| {
            refused(
                path,
                name,
                format!("shape {shape:?} is not whole {ggml_type} blocks"),
            )
        })?;
    Ok((dims, bytes))
}

/// One tensor of a file written by [`GgufWriter::write_streamed`]: its data comes
/// later.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// GGUF name.
    pub name: String,
    /// Stored type.
    pub ggml_type: GgmlType,
    /// Shape, outermost first (`[out_features, in_features]` for a linear's weight).
    pub shape: Vec<usize>,
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &MetadataValue) {
    match value {
        MetadataValue::U8(x) => out.push(*x),
        MetadataValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::Bool(x) => out.push(u8::from(*x)),
        MetadataValue::String(s) => put_string(out, s),
        MetadataValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::Array(a) => {
            out.extend_from_slice(&a.element_type().id().to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            macro_rules! each {
                ($v:expr, $variant:ident) => {
                    for x in $v {
                        put_value(out, &MetadataValue::$variant(x.clone()));
                    }
                };
            }
            match a {
                MetadataArray::U8(v) => each!(v, U8),
                MetadataArray::I8(v) => each!(v, I8),
                MetadataArray::U16(v) => each!(v, U16),
                MetadataArray::I16(v) => each!(v, I16),
                MetadataArray::U32(v) => each!(v, U32),
                MetadataArray::I32(v) => each!(v, I32),
                MetadataArray::F32(v) => each!(v, F32),
                MetadataArray::Bool(v) => each!(v, Bool),
                MetadataArray::String(v) => each!(v, String),
                MetadataArray::U64(v) => each!(v, U64),
                MetadataArray::I64(v) => each!(v, I64),
                MetadataArray::F64(v) => each!(v, F64),
            }
        }
    }
}
