//! Memory-mapped Hugging Face checkpoints: a single safetensors file, a directory
//! with `model.safetensors`, or a sharded directory with
//! `model.safetensors.index.json`.
//!
//! Opening reads only the headers, so a checkpoint of any size opens at once;
//! tensor data is read from the mappings on demand, one tensor at a time.

use crate::config::ModelConfig;
use crate::convert::{decode_to_f32, first_non_finite};
use crate::dtype::DType;
use crate::error::{IoError, OsContext, Result};
use crate::header::{element_count, parse_header};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// File name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of a sharded checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of the model configuration.
pub const CONFIG_FILE: &str = "config.json";

/// Where one tensor lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Index of the shard holding it (see [`Checkpoint::shard_path`]).
    pub shard: usize,
    /// Absolute byte range within the shard file.
    pub byte_range: Range<usize>,
}

impl TensorInfo {
    /// Number of elements.
    pub fn element_count(&self) -> usize {
        element_count(&self.shape).expect("validated when the header was parsed")
    }

    /// Number of bytes.
    pub fn byte_len(&self) -> usize {
        self.byte_range.len()
    }

    /// `(rows, cols)` of a 2-D tensor, `None` otherwise.
    pub fn matrix_shape(&self) -> Option<(usize, usize)> {
        match self.shape.as_slice() {
            &[rows, cols] => Some((rows, cols)),
            _ => None,
        }
    }
}

struct Shard {
    path: PathBuf,
    map: Mmap,
    metadata: BTreeMap<String, String>,
}

/// An opened checkpoint: every shard mapped, every header validated.
pub struct Checkpoint {
    root: PathBuf,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorInfo>,
    config: Option<ModelConfig>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("root", &self.root)
            .field("shards", &self.shards.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|source| IoError::opening(path, source, ""))?;
    // SAFETY: the mapping is read-only; a file truncated by another process while
    // mapped would fault, which is the accepted contract of every mmap-based
    // checkpoint reader (safetensors, candle, transformers).
    unsafe { Mmap::map(&file) }.at(path)
}

impl Checkpoint {
    /// Opens a checkpoint directory (sharded or single-file) or one safetensors file.
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|source| IoError::opening(path, source, ""))?;
        if meta.is_file() {
            let mut ckpt = Checkpoint::empty(path.to_path_buf());
            ckpt.add_shard(path, None)?;
            return Ok(ckpt);
        }
        let mut ckpt = Checkpoint::empty(path.to_path_buf());
        let config_path = path.join(CONFIG_FILE);
        if config_path.is_file() {
            ckpt.config = Some(ModelConfig::from_file(&config_path)?);
        }
        let index_path = path.join(INDEX_FILE);
        if index_path.is_file() {
            ckpt.open_sharded(&index_path)?;
        } else if path.join(SINGLE_FILE).is_file() {
            ckpt.add_shard(&path.join(SINGLE_FILE), None)?;
        } else {
            return Err(IoError::Missing {
                path: path.join(SINGLE_FILE),
                context: format!(" (nor {INDEX_FILE}): not a checkpoint directory"),
            });
        }
        Ok(ckpt)
    }

    fn empty(root: PathBuf) -> Checkpoint {
        Checkpoint {
            root,
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            config: None,
        }
    }

    fn open_sharded(&mut self, index_path: &Path) -> Result<()> {
        let text = std::fs::read_to_string(index_path).at(index_path)?;
        let index: serde_json::Value = serde_json::from_str(&text).map_err(|e| IoError::Json {
            path: index_path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let weight_map = index
            .get("weight_map")
            .and_then(|w| w.as_object())
            .ok_or_else(|| IoError::Json {
                path: index_path.to_path_buf(),
                reason: "missing object field weight_map".into(),
            })?;
        let mut by_shard: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (tensor, shard) in weight_map {
            let shard = shard.as_str().ok_or_else(|| IoError::Json {
                path: index_path.to_path_buf(),
                reason: format!("weight_map entry of {tensor} is not a file name"),
            })?;
            if shard.contains('/') || shard.contains('\\') || shard == ".." {
                return Err(IoError::Index {
                    path: index_path.to_path_buf(),
                    reason: format!("shard name {shard:?} of {tensor} is not a plain file name"),
                });
            }
            by_shard.entry(shard).or_default().push(tensor);
        }
        let dir = index_path.parent().unwrap_or(Path::new("."));
        for (shard, names) in by_shard {
            let shard_path = dir.join(shard);
            if !shard_path.is_file() {
                return Err(IoError::Missing {
                    path: shard_path,
                    context: format!(
                        " (named by {INDEX_FILE} for {} tensors, e.g. {})",
                        names.len(),
                        names[0]
                    ),
                });
            }
            self.add_shard(&shard_path, Some(&names))?;
        }
        Ok(())
    }

    /// Maps one shard and registers its tensors. With `expected`, every listed
    /// tensor must be in the shard and only those are registered (as loaders do).
    fn add_shard(&mut self, path: &Path, expected: Option<&[&str]>) -> Result<()> {
        let map = map_file(path)?;
        let header = parse_header(path, &map)?;
        let shard = self.shards.len();
        let mut in_file: BTreeMap<&str, TensorInfo> = BTreeMap::new();
        for entry in &header.entries {
            let start = header.data_start + entry.data_range.start;
            let end = header.data_start + entry.data_range.end;
            in_file.insert(
                &entry.name,
                TensorInfo {
                    name: entry.name.clone(),
                    dtype: entry.dtype,
                    shape: entry.shape.clone(),
                    shard,
                    byte_range: start..end,
                },
            );
        }
        let names: Vec<&str> = match expected {
            Some(list) => list.to_vec(),
            None => in_file.keys().copied().collect(),
        };
        for name in names {
            let info = in_file.remove(name).ok_or_else(|| IoError::Index {
                path: path.to_path_buf(),
                reason: format!(
                    "tensor {name} is named by {INDEX_FILE} but missing from this shard"
                ),
            })?;
            if let Some(previous) = self.tensors.get(name) {
                return Err(IoError::Index {
                    path: path.to_path_buf(),
                    reason: format!(
                        "tensor {name} is also in {}",
                        self.shards[previous.shard].path.display()
                    ),
                });
            }
            self.tensors.insert(name.to_string(), info);
        }
        self.shards.push(Shard {
            path: path.to_path_buf(),
            map,
            metadata: header.metadata,
        });
        Ok(())
    }

    /// The checkpoint of another format (a GGUF model, loraq-gguf) converted into
    /// the safetensors file this was opened from: `root` names the original in
    /// messages and `config` is its configuration.
    pub fn converted_from(mut self, root: PathBuf, config: ModelConfig) -> Checkpoint {
        self.root = root;
        self.config = Some(config);
        self
    }

    /// The path the checkpoint was opened from.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The parsed config.json, when the directory has one.
    pub fn config(&self) -> Option<&ModelConfig> {
        self.config.as_ref()
    }

    /// Number of shard files.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Path of shard `i`.
    pub fn shard_path(&self, i: usize) -> &Path {
        &self.shards[i].path
    }

    /// `__metadata__` of shard `i`.
    pub fn shard_metadata(&self, i: usize) -> &BTreeMap<String, String> {
        &self.shards[i].metadata
    }

    /// Every tensor, sorted by name.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = &TensorInfo> {
        self.tensors.values()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor's location, or `None`.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// The tensor's location, or a [`IoError::TensorNotFound`].
    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| IoError::TensorNotFound {
                root: self.root.clone(),
                tensor: name.to_string(),
            })
    }

    /// The tensor's stored bytes, zero-copy from the mapping.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.info(name)?;
        Ok(&self.shards[info.shard].map[info.byte_range.clone()])
    }

    /// The tensor converted to f32 (BF16, F16, F32, F64, F8_E4M3, F8_E5M2).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.info(name)?.element_count()];
        self.read_f32_into(name, &mut out)?;
        Ok(out)
    }

    /// Converts the tensor to f32 into `out`, which must hold exactly its elements.
    pub fn read_f32_into(&self, name: &str, out: &mut [f32]) -> Result<()> {
        let info = self.info(name)?;
        let bytes = &self.shards[info.shard].map[info.byte_range.clone()];
        if !info.dtype.is_float() {
            return Err(IoError::Unconvertible {
                path: self.shards[info.shard].path.clone(),
                tensor: name.to_string(),
                dtype: info.dtype.to_string(),
            });
        }
        if out.len() != info.element_count() {
            return Err(IoError::Tensor {
                path: self.shards[info.shard].path.clone(),
                tensor: name.to_string(),
                reason: format!(
                    "destination holds {} elements, tensor has {}",
                    out.len(),
                    info.element_count()
                ),
            });
        }
        let decoded = decode_to_f32(info.dtype, bytes, out);
        debug_assert!(decoded);
        Ok(())
    }

    /// [`Checkpoint::read_f32`], refusing a NaN or infinite value with the file, the
    /// tensor and the element's index.
    pub fn read_f32_finite(&self, name: &str) -> Result<Vec<f32>> {
        let values = self.read_f32(name)?;
        self.ensure_finite(name, &values)?;
        Ok(values)
    }

    /// A BF16 tensor's values as stored, refusing another dtype, and a NaN or infinite
    /// value with the file, the tensor and the element.
    pub fn read_bf16_finite(&self, name: &str) -> Result<Vec<half::bf16>> {
        let info = self.info(name)?;
        if info.dtype != DType::BF16 {
            return Err(IoError::Tensor {
                path: self.shards[info.shard].path.clone(),
                tensor: name.to_string(),
                reason: format!("expected BF16, found {}", info.dtype),
            });
        }
        let values: Vec<half::bf16> = self
            .bytes(name)?
            .chunks_exact(2)
            .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
            .collect();
        match values.iter().position(|v| !v.is_finite()) {
            None => Ok(values),
            Some(index) => Err(self.non_finite_error(name, index, values[index].to_f32())),
        }
    }

    /// Refuses `values` (the tensor `name` of this checkpoint, decoded by any means)
    /// when one is NaN or infinite, naming the file, the tensor and the element.
    pub fn ensure_finite(&self, name: &str, values: &[f32]) -> Result<()> {
        match first_non_finite(values) {
            None => Ok(()),
            Some(index) => Err(self.non_finite_error(name, index, values[index])),
        }
    }

    /// The refusal of element `index` of the tensor `name`, found NaN or infinite
    /// (`value`) by whatever decoded it, naming the file, the tensor and the element.
    pub fn non_finite_error(&self, name: &str, index: usize, value: f32) -> IoError {
        let path = match self.tensors.get(name) {
            Some(info) => self.shards[info.shard].path.clone(),
            None => self.root.clone(),
        };
        IoError::Tensor {
            path,
            tensor: name.to_string(),
            reason: format!("element {index} is {value} (a weight must be finite)"),
        }
    }

    /// Refuses a float tensor holding a NaN or infinite value, decoding its stored
    /// bytes chunk by chunk without allocating the whole tensor; integer tensors
    /// (packed 4-bit codes) pass.
    pub fn ensure_stored_finite(&self, name: &str) -> Result<()> {
        const CHUNK: usize = 1 << 14;
        let info = self.info(name)?;
        if !info.dtype.is_float() {
            return Ok(());
        }
        let width = info.dtype.size_bytes();
        let bytes = self.bytes(name)?;
        let mut buffer = vec![0f32; CHUNK];
        for (c, chunk) in bytes.chunks(CHUNK * width).enumerate() {
            let values = &mut buffer[..chunk.len() / width];
            decode_to_f32(info.dtype, chunk, values);
            if let Some(i) = values.iter().position(|x| !x.is_finite()) {
                return Err(IoError::Tensor {
                    path: self.shards[info.shard].path.clone(),
                    tensor: name.to_string(),
                    reason: format!(
                        "element {} is {} (a weight must be finite)",
                        c * CHUNK + i,
                        values[i]
                    ),
                });
            }
        }
        Ok(())
    }

    /// Reads a U8 tensor's raw bytes (packed 4-bit weights and the like).
    pub fn read_u8(&self, name: &str) -> Result<&[u8]> {
        let info = self.info(name)?;
        if info.dtype != DType::U8 {
            return Err(IoError::Tensor {
                path: self.shards[info.shard].path.clone(),
                tensor: name.to_string(),
                reason: format!("expected U8, found {}", info.dtype),
            });
        }
        self.bytes(name)
    }
}
