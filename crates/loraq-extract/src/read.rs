//! Tensor bytes read with positioned reads (`pread`) rather than through the mapping,
//! and the reader that runs ahead of the factoring.
//!
//! Every page a scan touches through an mmap stays in the process's resident set until
//! the mapping goes, so comparing two 27B checkpoints through their mappings would make
//! the peak RSS the size of both. Positioned reads go through the page cache instead, so
//! memory stays at a few blocks per thread plus the one delta being factored.

use crate::error::{ExtractError, Result};
use crate::floor::{PairBytes, read_pair};
use crate::plan::{ExtractionPlan, ModuleRole};
use crate::timeline;
use loraq_io::{Checkpoint, TensorInfo};
use std::fs::File;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, sync_channel};

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

/// What the reader hands the factoring for each planned module, in plan order: the
/// LoRA module's two tensors read (or the error reading them), `None` for a module
/// the factoring reads itself (a correction).
pub struct PairQueue {
    pairs: Receiver<Option<Result<PairBytes>>>,
}

impl PairQueue {
    /// The next planned module's pair, waiting for the reader if it is still reading.
    pub fn next_pair(&self) -> Option<Result<PairBytes>> {
        let span = timeline::Span::start();
        let pair = self
            .pairs
            .recv()
            .expect("the reader sends one item per planned module");
        span.end("wait for reader", "");
        pair
    }
}

/// Runs `body` with a reader on a thread of its own that reads the LoRA modules' pairs
/// of `modules` in order, one module ahead of `body`: while a module is factored, the
/// next one's two tensors are read. The channel is a rendezvous (capacity 0), so the
/// reader holds at most one read pair while it waits, and memory stays at two modules'
/// bytes and one delta; reading is overlapped as long as a pair reads faster than a
/// module factors (at disk speed, 0.4 s for the largest 27B pair against 1.5-2.5 s of
/// factoring).
///
/// When the rest of the scan, running beside, has refused a tensor
/// ([`crate::scan::PendingScan::refused_so_far`]), the reader hands the factoring that
/// refusal instead of the next pair, so a merge that is not base + LoRA is refused
/// without factoring the rest of the model first.
pub fn with_reader_ahead<T>(
    plan: &ExtractionPlan,
    body: impl FnOnce(&PairQueue) -> Result<T>,
) -> Result<T> {
    let (merged, base, modules) = (&plan.merged, &plan.base, &plan.modules);
    let merged_files = ShardFiles::open(merged)?;
    let base_files = ShardFiles::open(base)?;
    std::thread::scope(|scope| {
        let (sender, receiver) = sync_channel::<Option<Result<PairBytes>>>(0);
        let (merged_files, base_files) = (&merged_files, &base_files);
        std::thread::Builder::new()
            .name("pair reader".into())
            .spawn_scoped(scope, move || {
                for planned in modules {
                    let refusals = plan.pending.refused_so_far();
                    if !refusals.is_empty() {
                        // In place of every remaining pair: a LoRA module's stops the
                        // factoring (a correction reads its own tensors and goes on).
                        if sender
                            .send(Some(Err(ExtractError::Refused { refusals })))
                            .is_err()
                        {
                            break;
                        }
                        continue;
                    }
                    let pair = (planned.role == ModuleRole::Lora).then(|| {
                        let span = timeline::Span::start();
                        let tensor = &planned.projection.tensor;
                        let pair = read_pair(merged, base, merged_files, base_files, tensor);
                        span.end("read pair", tensor);
                        pair
                    });
                    if sender.send(pair).is_err() {
                        // The factoring stopped (an error): nothing more to read.
                        break;
                    }
                }
            })
            .map_err(|source| ExtractError::Read {
                path: merged.root().to_path_buf(),
                source,
            })?;
        body(&PairQueue { pairs: receiver })
    })
}

impl ShardFiles {
    /// The tensor's bytes, read into a buffer allocated for them. The buffer is not
    /// zero-filled first: on Linux the bytes are read straight into its spare capacity
    /// and the length set only once every byte has been written. A buffer this large
    /// is a fresh mapping, so it is also marked for transparent huge pages: the read
    /// then faults it in 2 MiB at a time instead of 4 KiB (the system time of reading
    /// a 27B model's projections was mostly these page faults).
    pub fn read_tensor(&self, info: &TensorInfo) -> Result<Vec<u8>> {
        let len = info.byte_len();
        let (path, file) = &self.files[info.shard];
        let error = |source| ExtractError::Read {
            path: path.clone(),
            source,
        };
        let position = info.byte_range.start as u64;
        let mut buf = Vec::with_capacity(len);
        advise_huge_pages(buf.spare_capacity_mut());
        read_into_spare(file, &mut buf, len, position).map_err(error)?;
        Ok(buf)
    }
}

/// Reads `len` bytes at `position` into `buf`'s spare capacity (empty, at least `len`)
/// and sets its length to `len` once all of them are read.
#[cfg(target_os = "linux")]
fn read_into_spare(
    file: &File,
    buf: &mut Vec<u8>,
    len: usize,
    position: u64,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    assert!(buf.is_empty() && buf.capacity() >= len);
    let mut done = 0usize;
    while done < len {
        let offset = position
            .checked_add(done as u64)
            .and_then(|o| libc::off_t::try_from(o).ok())
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: the destination is buf's allocation from `done` to `len`, inside its
        // capacity; pread writes at most `len - done` bytes there and reads none.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                buf.as_mut_ptr().add(done).cast(),
                len - done,
                offset,
            )
        };
        match n {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            n => done += n as usize,
        }
    }
    // SAFETY: pread wrote every byte of 0..len above.
    unsafe { buf.set_len(len) };
    Ok(())
}

/// Elsewhere the buffer is zero-filled, then read into.
#[cfg(not(target_os = "linux"))]
fn read_into_spare(
    file: &File,
    buf: &mut Vec<u8>,
    len: usize,
    position: u64,
) -> std::io::Result<()> {
    buf.resize(len, 0);
    read_at(file, buf, position)
}

/// Marks the 2 MiB-aligned part of `buf` for transparent huge pages (Linux; a hint: a
/// refusal, e.g. with huge pages off, changes nothing).
#[cfg(target_os = "linux")]
pub(crate) fn advise_huge_pages<T>(buf: &mut [std::mem::MaybeUninit<T>]) {
    const HUGE: usize = 2 << 20;
    let start = buf.as_mut_ptr() as usize;
    let aligned = start.next_multiple_of(HUGE);
    let end = (start + std::mem::size_of_val(buf)) / HUGE * HUGE;
    if end > aligned {
        // SAFETY: the range lies inside `buf`'s allocation; MADV_HUGEPAGE changes how
        // its pages are backed, not their contents.
        unsafe {
            libc::madvise(
                aligned as *mut libc::c_void,
                end - aligned,
                libc::MADV_HUGEPAGE,
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn advise_huge_pages<T>(_: &mut [std::mem::MaybeUninit<T>]) {}

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
