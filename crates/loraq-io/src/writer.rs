//! Streaming safetensors writers.
//!
//! The header is computed from the shapes before any data is written, so a
//! checkpoint of any size is written one tensor at a time with constant memory.
//! Past a size limit the output is sharded as Hugging Face does:
//! `model-00001-of-00003.safetensors` plus `model.safetensors.index.json`.
//!
//! A writer can bypass the page cache ([`WriteCaching::Direct`]): large outputs that
//! nothing reads back at once (`loraq quantize`) then go from one reused, aligned
//! buffer straight to the disk instead of being copied into gigabytes of freshly
//! allocated page-cache memory.

use crate::checkpoint::{INDEX_FILE, SINGLE_FILE};
use crate::dtype::DType;
use crate::error::{IoError, OsContext, Result};
use crate::header::byte_size;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};

/// Whether a writer's files go through the page cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WriteCaching {
    /// Ordinary buffered writes: the file stays cached for whoever reads it next.
    #[default]
    PageCache,
    /// Direct I/O (Linux `O_DIRECT`) in aligned chunks of [`DIRECT_CHUNK`] bytes from
    /// one reused buffer, the unaligned tail written buffered; plain buffered writes
    /// where the OS or the file system refuses direct I/O. The bytes written are the
    /// same either way. Worth it for outputs of gigabytes: each byte is copied once
    /// into memory the writer already holds instead of into newly allocated page
    /// cache (which a virtual machine's host may have to fault in page by page), and
    /// the files do not evict the inputs from the cache. Reading the file back soon
    /// after costs a disk read.
    Direct,
}

/// Bytes per direct write: large enough that the disk streams, small enough to stay
/// a constant, reused buffer.
pub const DIRECT_CHUNK: usize = 8 << 20;

/// Alignment of direct writes (buffer address, file offset and length): 4096 covers
/// the logical block sizes of common disks and the block sizes of common file systems.
/// A file system that needs more refuses the first write, and the writer goes on
/// buffered.
const DIRECT_ALIGN: usize = 4096;

/// A file written in aligned chunks with `O_DIRECT` while that works, buffered after.
#[cfg(target_os = "linux")]
struct DirectFile {
    file: File,
    /// [`DIRECT_CHUNK`] + [`DIRECT_ALIGN`] bytes; the chunk starts at `start`, the
    /// first aligned address.
    buffer: Vec<u8>,
    start: usize,
    /// Bytes of the chunk filled.
    filled: usize,
    /// File offset of the chunk.
    offset: u64,
    /// Whether `O_DIRECT` is still set on `file`.
    direct: bool,
}

#[cfg(target_os = "linux")]
impl DirectFile {
    /// Creates (or truncates) `path` for direct writes, or plain writes where the file
    /// system cannot open it for direct I/O.
    fn create(path: &Path) -> std::io::Result<DirectFile> {
        let (file, direct) = open_direct(path)?;
        let mut buffer = vec![0u8; DIRECT_CHUNK + DIRECT_ALIGN];
        let start = buffer.as_mut_ptr().align_offset(DIRECT_ALIGN);
        Ok(DirectFile {
            file,
            buffer,
            start,
            filled: 0,
            offset: 0,
            direct,
        })
    }

    fn write_all(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            let take = (DIRECT_CHUNK - self.filled).min(bytes.len());
            let at = self.start + self.filled;
            self.buffer[at..at + take].copy_from_slice(&bytes[..take]);
            self.filled += take;
            bytes = &bytes[take..];
            if self.filled == DIRECT_CHUNK {
                self.write_chunk()?;
            }
        }
        Ok(())
    }

    /// Writes the filled part of the chunk at its offset: direct when it is a whole
    /// number of aligned blocks (every chunk but the last), buffered otherwise.
    fn write_chunk(&mut self) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let chunk = &self.buffer[self.start..self.start + self.filled];
        if self.direct && chunk.len().is_multiple_of(DIRECT_ALIGN) {
            match self.file.write_all_at(chunk, self.offset) {
                Ok(()) => {}
                // EINVAL: an alignment this file system does not take. The whole chunk
                // again, buffered (a short direct write may have written part of it).
                Err(e) if e.kind() == ErrorKind::InvalidInput => {
                    stop_direct(&self.file)?;
                    self.direct = false;
                    self.file.write_all_at(chunk, self.offset)?;
                }
                Err(e) => return Err(e),
            }
        } else {
            if self.direct {
                stop_direct(&self.file)?;
                self.direct = false;
            }
            self.file.write_all_at(chunk, self.offset)?;
        }
        self.offset += chunk.len() as u64;
        self.filled = 0;
        Ok(())
    }

    /// Writes the last, partial chunk.
    fn finish(&mut self) -> std::io::Result<()> {
        if self.filled > 0 {
            self.write_chunk()?;
        }
        Ok(())
    }
}

/// Clears `O_DIRECT`: the rest of the file is written through the page cache.
#[cfg(target_os = "linux")]
fn stop_direct(file: &File) -> std::io::Result<()> {
    use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
    let flags = fcntl_getfl(file)?;
    fcntl_setfl(file, flags - OFlags::DIRECT)?;
    Ok(())
}

/// Opens `path` for writing with `O_DIRECT`; without it (and `false`) where the file
/// system does not offer direct I/O.
#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> std::io::Result<(File, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    let mut direct = options.clone();
    direct.custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32);
    match direct.open(path) {
        Ok(file) => Ok((file, true)),
        Err(e) if e.kind() == ErrorKind::InvalidInput => Ok((options.open(path)?, false)),
        Err(e) => Err(e),
    }
}

/// Where a [`SafetensorsWriter`]'s bytes go.
enum Sink {
    Buffered(BufWriter<File>),
    #[cfg(target_os = "linux")]
    Direct(DirectFile),
}

impl Sink {
    fn create(path: &Path, caching: WriteCaching) -> std::io::Result<Sink> {
        #[cfg(target_os = "linux")]
        if caching == WriteCaching::Direct {
            return Ok(Sink::Direct(DirectFile::create(path)?));
        }
        // Direct I/O is Linux's O_DIRECT only; elsewhere every file is buffered.
        let _ = caching;
        Ok(Sink::Buffered(BufWriter::with_capacity(
            1 << 20,
            File::create(path)?,
        )))
    }

    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::Buffered(out) => out.write_all(bytes),
            #[cfg(target_os = "linux")]
            Sink::Direct(out) => out.write_all(bytes),
        }
    }

    fn finish(&mut self) -> std::io::Result<()> {
        match self {
            Sink::Buffered(out) => out.flush(),
            #[cfg(target_os = "linux")]
            Sink::Direct(out) => out.finish(),
        }
    }
}

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
    out: Sink,
    specs: Vec<TensorSpec>,
    next: usize,
}

impl SafetensorsWriter {
    /// Creates `path` and writes the header for `specs` (through the page cache).
    pub fn create(
        path: &Path,
        specs: Vec<TensorSpec>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<SafetensorsWriter> {
        Self::create_with(path, specs, metadata, WriteCaching::PageCache)
    }

    /// [`SafetensorsWriter::create`] with the given caching of the file.
    pub fn create_with(
        path: &Path,
        specs: Vec<TensorSpec>,
        metadata: &BTreeMap<String, String>,
        caching: WriteCaching,
    ) -> Result<SafetensorsWriter> {
        let header = header_bytes(path, &specs, metadata)?;
        let mut out = Sink::create(path, caching).at(path)?;
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
        self.out.finish().at(&self.path)
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
    caching: WriteCaching,
}

impl CheckpointWriter {
    /// Plans the shards (greedily, in spec order; a tensor larger than the limit gets
    /// a shard of its own) and opens the first one (written through the page cache).
    pub fn new(
        dir: &Path,
        specs: Vec<TensorSpec>,
        max_shard_bytes: usize,
        metadata: BTreeMap<String, String>,
    ) -> Result<CheckpointWriter> {
        Self::new_with(
            dir,
            specs,
            max_shard_bytes,
            metadata,
            WriteCaching::PageCache,
        )
    }

    /// [`CheckpointWriter::new`] with the given caching of the shards (the index is
    /// small and always written through the page cache).
    pub fn new_with(
        dir: &Path,
        specs: Vec<TensorSpec>,
        max_shard_bytes: usize,
        metadata: BTreeMap<String, String>,
        caching: WriteCaching,
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
            caching,
        };
        writer.open_shard()?;
        Ok(writer)
    }

    fn open_shard(&mut self) -> Result<()> {
        if let Some((name, specs)) = self.plan.get(self.shard) {
            self.current = Some(SafetensorsWriter::create_with(
                &self.dir.join(name),
                specs.clone(),
                &self.metadata,
                self.caching,
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
