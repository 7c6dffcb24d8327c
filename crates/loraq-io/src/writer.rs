//! Streaming safetensors writers.
//!
//! The header is computed from the shapes before any data is written, so a
//! checkpoint of any size is written one tensor at a time with constant memory.
//! Past a size limit the output is sharded as Hugging Face does:
//! `model-00001-of-00003.safetensors` plus `model.safetensors.index.json`.

use crate::checkpoint::{INDEX_FILE, SINGLE_FILE};
use crate::dtype::DType;
use crate::error::{IoError, OsContext, Result};
use crate::header::byte_size;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Name, dtype and shape of a tensor to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A new spec.
    pub fn new(name: impl Into<String>, dtype: DType, shape: Vec<usize>) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape,
        }
    }

    fn byte_len(&self, path: &Path) -> Result<usize> {
        byte_size(self.dtype, &self.shape).ok_or_else(|| IoError::Write {
            path: path.to_path_buf(),
            reason: format!("tensor {} of shape {:?} overflows", self.name, self.shape),
        })
    }
}

/// Builds the header bytes (length prefix included), padded with spaces to a
/// multiple of 8 so the data section starts aligned.
fn header_bytes(
    path: &Path,
    specs: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut json = String::from("{");
    if !metadata.is_empty() {
        json.push_str("\"__metadata__\":");
        json.push_str(&serde_json::to_string(metadata).expect("strings serialize"));
    }
    let mut offset = 0usize;
    for spec in specs {
        let len = spec.byte_len(path)?;
        let end = offset.checked_add(len).ok_or_else(|| IoError::Write {
            path: path.to_path_buf(),
            reason: "total size overflows".into(),
        })?;
        if json.len() > 1 {
            json.push(',');
        }
        json.push_str(&serde_json::to_string(&spec.name).expect("strings serialize"));
        json.push_str(&format!(
            ":{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{offset},{end}]}}",
            spec.dtype,
            serde_json::to_string(&spec.shape).expect("integers serialize"),
        ));
        offset = end;
    }
    json.push('}');
    while (json.len() + 8) % 8 != 0 {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    Ok(out)
}

/// Writes one safetensors file whose tensors arrive one at a time, in spec order.
pub struct SafetensorsWriter {
    path: PathBuf,
    out: BufWriter<File>,
    specs: Vec<TensorSpec>,
    next: usize,
}

impl SafetensorsWriter {
    /// Creates `path` and writes the header for `specs`.
    pub fn create(
        path: &Path,
        specs: Vec<TensorSpec>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<SafetensorsWriter> {
        let header = header_bytes(path, &specs, metadata)?;
        let file = File::create(path).at(path)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&header).at(path)?;
        Ok(SafetensorsWriter {
            path: path.to_path_buf(),
            out,
            specs,
            next: 0,
        })
    }

    /// Name of the tensor the writer expects next, if any.
    pub fn next_tensor(&self) -> Option<&str> {
        self.specs.get(self.next).map(|s| s.name.as_str())
    }

    /// Writes the next tensor's bytes; `name` must be the next spec's.
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let spec = self.specs.get(self.next).ok_or_else(|| IoError::Write {
            path: self.path.clone(),
            reason: format!("tensor {name} written after the last declared tensor"),
        })?;
        if spec.name != name {
            return Err(IoError::Write {
                path: self.path.clone(),
                reason: format!("tensor {name} written where {} was declared", spec.name),
            });
        }
        let expected = spec.byte_len(&self.path)?;
        if bytes.len() != expected {
            return Err(IoError::Write {
                path: self.path.clone(),
                reason: format!(
                    "tensor {name}: {} bytes written, {} x {:?} needs {expected}",
                    bytes.len(),
                    spec.dtype,
                    spec.shape
                ),
            });
        }
        self.out.write_all(bytes).at(&self.path)?;
        self.next += 1;
        Ok(())
    }

    /// Flushes the file; every declared tensor must have been written.
    ///
    /// No fsync: outputs appear through [`crate::AtomicDir`] only after every file
    /// is complete, and forcing gigabytes to disk per shard would dominate the time
    /// of `quantize` and `synth`.
    pub fn finish(mut self) -> Result<()> {
        if let Some(spec) = self.specs.get(self.next) {
            return Err(IoError::Write {
                path: self.path.clone(),
                reason: format!("tensor {} was declared but never written", spec.name),
            });
        }
        self.out.flush().at(&self.path)
    }
}

/// Writes a small safetensors file whose tensors are all in memory.
pub fn write_safetensors_file(
    path: &Path,
    tensors: &[(TensorSpec, &[u8])],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let specs = tensors.iter().map(|(s, _)| s.clone()).collect();
    let mut writer = SafetensorsWriter::create(path, specs, metadata)?;
    for (spec, bytes) in tensors {
        writer.write_tensor(&spec.name, bytes)?;
    }
    writer.finish()
}

/// Writes a checkpoint directory's tensors, sharded past `max_shard_bytes`.
pub struct CheckpointWriter {
    dir: PathBuf,
    /// File name and specs of every shard, in order.
    plan: Vec<(String, Vec<TensorSpec>)>,
    metadata: BTreeMap<String, String>,
    current: Option<SafetensorsWriter>,
    shard: usize,
    total_bytes: usize,
}

impl CheckpointWriter {
    /// Plans the shards (greedily, in spec order; a tensor larger than the limit gets
    /// a shard of its own) and opens the first one.
    pub fn new(
        dir: &Path,
        specs: Vec<TensorSpec>,
        max_shard_bytes: usize,
        metadata: BTreeMap<String, String>,
    ) -> Result<CheckpointWriter> {
        let mut groups: Vec<Vec<TensorSpec>> = Vec::new();
        let mut group_bytes = 0usize;
        let mut total_bytes = 0usize;
        for spec in specs {
            let len = spec.byte_len(dir)?;
            total_bytes = total_bytes.checked_add(len).ok_or_else(|| IoError::Write {
                path: dir.to_path_buf(),
                reason: "total size overflows".into(),
            })?;
            match groups.last_mut() {
                Some(group) if group_bytes.saturating_add(len) <= max_shard_bytes => {
                    group.push(spec);
                    group_bytes += len;
                }
                _ => {
                    groups.push(vec![spec]);
                    group_bytes = len;
                }
            }
        }
        let count = groups.len();
        let plan = groups
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                let name = if count == 1 {
                    SINGLE_FILE.to_string()
                } else {
                    format!("model-{:05}-of-{count:05}.safetensors", i + 1)
                };
                (name, g)
            })
            .collect();
        let mut writer = CheckpointWriter {
            dir: dir.to_path_buf(),
            plan,
            metadata,
            current: None,
            shard: 0,
            total_bytes,
        };
        writer.open_shard()?;
        Ok(writer)
    }

    fn open_shard(&mut self) -> Result<()> {
        if let Some((name, specs)) = self.plan.get(self.shard) {
            self.current = Some(SafetensorsWriter::create(
                &self.dir.join(name),
                specs.clone(),
                &self.metadata,
            )?);
        }
        Ok(())
    }

    /// Number of shard files planned.
    pub fn shard_count(&self) -> usize {
        self.plan.len()
    }

    /// Writes the next tensor (in the order of the specs given to [`CheckpointWriter::new`]).
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        if self
            .current
            .as_ref()
            .is_some_and(|w| w.next_tensor().is_none())
        {
            self.current.take().expect("checked").finish()?;
            self.shard += 1;
            self.open_shard()?;
        }
        match self.current.as_mut() {
            Some(w) => w.write_tensor(name, bytes),
            None => Err(IoError::Write {
                path: self.dir.clone(),
                reason: format!("tensor {name} written after the last declared tensor"),
            }),
        }
    }

    /// Finishes the last shard and writes the index when sharded.
    pub fn finish(mut self) -> Result<()> {
        if let Some(w) = self.current.take() {
            w.finish()?;
        }
        if self.shard + 1 < self.plan.len() {
            let missing = &self.plan[self.shard + 1].1[0].name;
            return Err(IoError::Write {
                path: self.dir.clone(),
                reason: format!("tensor {missing} was declared but never written"),
            });
        }
        if self.plan.len() > 1 {
            let weight_map: BTreeMap<&str, &str> = self
                .plan
                .iter()
                .flat_map(|(file, specs)| {
                    specs.iter().map(move |s| (s.name.as_str(), file.as_str()))
                })
                .collect();
            let index = serde_json::json!({
                "metadata": {"total_size": self.total_bytes},
                "weight_map": weight_map,
            });
            let path = self.dir.join(INDEX_FILE);
            let text = serde_json::to_string_pretty(&index).expect("index serializes");
            std::fs::write(&path, text + "\n").at(&path)?;
        }
        Ok(())
    }
}
