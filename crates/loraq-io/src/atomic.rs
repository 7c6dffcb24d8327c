//! Output directories that appear only when complete.
//!
//! Everything is written into a hidden temporary sibling of the target; only
//! [`AtomicDir::commit`] renames it into place. A failure at any point (a check
//! that refuses the input, a full disk) drops the temporary directory and leaves
//! no partial output behind.

use crate::error::{IoError, OsContext, Result};
use std::path::{Path, PathBuf};

/// A directory being written, renamed into place by [`AtomicDir::commit`].
#[derive(Debug)]
pub struct AtomicDir {
    target: PathBuf,
    temp: PathBuf,
    force: bool,
    committed: bool,
}

fn sibling(target: &Path, tag: &str) -> Result<PathBuf> {
    let name = target.file_name().ok_or_else(|| IoError::Write {
        path: target.to_path_buf(),
        reason: "output path has no directory name".into(),
    })?;
    let parent = target.parent().unwrap_or(Path::new(""));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    Ok(parent.join(format!(
        ".{}.loraq-{tag}-{}-{nanos}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

impl AtomicDir {
    /// Starts writing `target`. Refuses an existing target unless `force`.
    pub fn create(target: impl AsRef<Path>, force: bool) -> Result<AtomicDir> {
        let target = target.as_ref().to_path_buf();
        if target.exists() && !force {
            return Err(IoError::OutputExists { path: target });
        }
        if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).at(parent)?;
        }
        let temp = sibling(&target, "tmp")?;
        std::fs::create_dir(&temp).at(&temp)?;
        Ok(AtomicDir {
            target,
            temp,
            force,
            committed: false,
        })
    }

    /// The temporary directory to write into.
    pub fn path(&self) -> &Path {
        &self.temp
    }

    /// The final location.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Renames the finished directory into place (replacing the target when forced).
    pub fn commit(mut self) -> Result<PathBuf> {
        if self.target.exists() {
            if !self.force {
                return Err(IoError::OutputExists {
                    path: self.target.clone(),
                });
            }
            let old = sibling(&self.target, "old")?;
            std::fs::rename(&self.target, &old).at(&self.target)?;
            std::fs::rename(&self.temp, &self.target).at(&self.target)?;
            let removed = if old.is_dir() {
                std::fs::remove_dir_all(&old)
            } else {
                std::fs::remove_file(&old)
            };
            removed.at(&old)?;
        } else {
            std::fs::rename(&self.temp, &self.target).at(&self.target)?;
        }
        self.committed = true;
        Ok(self.target.clone())
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: the error being propagated matters more than this one.
            let _ = std::fs::remove_dir_all(&self.temp);
        }
    }
}
