//! Tensor bytes read with positioned reads (`pread`) rather than through the mapping.
//!
//! Every page a scan touches through an mmap stays in the process's resident set until
//! the mapping goes, so comparing two 27B checkpoints through their mappings would make
//! the peak RSS the size of both. Positioned reads go through the page cache instead, so
//! memory stays at a few blocks per thread plus the one delta being factored.

use crate::error::{ExtractError, Result};
use loraq_io::{Checkpoint, TensorInfo};
use std::fs::File;
use std::path::PathBuf;

/// The shard files of a checkpoint, open for positioned reads.
pub struct ShardFiles {
    files: Vec<(PathBuf, File)>,
}

impl ShardFiles {
    /// Opens every shard of `checkpoint`.
    pub fn open(checkpoint: &Checkpoint) -> Result<ShardFiles> {
        let files = (0..checkpoint.shard_count())
            .map(|i| {
                let path = checkpoint.shard_path(i).to_path_buf();
                let file = File::open(&path).map_err(|source| ExtractError::Read {
                    path: path.clone(),
                    source,
                })?;
                Ok((path, file))
            })
            .collect::<Result<_>>()?;
        Ok(ShardFiles { files })
    }

    /// Fills `buf` with the tensor's bytes starting `offset` bytes into the tensor.
    pub fn read(&self, info: &TensorInfo, offset: usize, buf: &mut [u8]) -> Result<()> {
        let end = offset
            .checked_add(buf.len())
            .filter(|&e| e <= info.byte_len())
            .ok_or_else(|| ExtractError::BadShape {
                module: info.name.clone(),
                what: format!(
                    "read of {} bytes at {offset} past the tensor's {} bytes",
                    buf.len(),
                    info.byte_len()
                ),
            })?;
        debug_assert!(end <= info.byte_len());
        let (path, file) = &self.files[info.shard];
        let position = (info.byte_range.start + offset) as u64;
        read_at(file, buf, position).map_err(|source| ExtractError::Read {
            path: path.clone(),
            source,
        })
    }
}

#[cfg(unix)]
fn read_at(file: &File, buf: &mut [u8], position: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, position)
}

#[cfg(windows)]
fn read_at(file: &File, mut buf: &mut [u8], mut position: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        let n = file.seek_read(buf, position)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf = &mut buf[n..];
        position += n as u64;
    }
    Ok(())
}
