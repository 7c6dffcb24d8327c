//! Outputs (directories and single files) that appear only when complete.
//!
//! Everything is written into a hidden temporary sibling of the target; only
//! [`AtomicDir::commit`] (or [`write_file_atomically`], once its writer succeeded)
//! renames it into place. A failure at any point (a check that refuses the input, a
//! full disk) removes the temporary and leaves no partial output behind.

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

/// The hidden temporary sibling [`write_file_atomically`] writes `path` into:
/// `.{name}.loraq-tmp-{pid}` in the same directory (so the rename stays on one file
/// system).
pub fn temp_file_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    path.with_file_name(format!(".{name}.loraq-tmp-{}", std::process::id()))
}

/// Writes the file `path` so that it appears only when complete: `write` fills a
/// temporary sibling ([`temp_file_sibling`]), which is renamed onto `path` (replacing
/// it) if `write` succeeded and removed otherwise, so a refused input or a full disk
/// leaves neither a partial file nor the temporary behind.
pub fn write_file_atomically<E: From<IoError>>(
    path: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let temp = temp_file_sibling(path);
    let result = write(&temp).and_then(|()| std::fs::rename(&temp, path).at(path).map_err(E::from));
    if result.is_err() {
        // Best effort: the error being returned matters more than this one.
        let _ = std::fs::remove_file(&temp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_file_appears_only_when_its_writer_succeeded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("answers.jsonl");
        write_file_atomically(&path, |temp| std::fs::write(temp, "complete").at(temp)).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "complete");
        assert_eq!(names(dir.path()), ["answers.jsonl"]);

        // A writer that fails halfway (a full disk) leaves the old file and no temporary.
        let failed = write_file_atomically(&path, |temp| {
            std::fs::write(temp, "partial").at(temp)?;
            Err(IoError::Write {
                path: temp.to_path_buf(),
                reason: "disk full".into(),
            })
        });
        assert!(matches!(failed, Err(IoError::Write { .. })), "{failed:?}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "complete");
        assert_eq!(names(dir.path()), ["answers.jsonl"]);
    }

    #[test]
    fn a_failed_rename_removes_the_temporary() {
        let dir = tempfile::tempdir().unwrap();
        // The target is a non-empty directory: renaming a file onto it fails.
        let path = dir.path().join("out");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("keep"), "x").unwrap();
        let failed = write_file_atomically(&path, |temp| std::fs::write(temp, "data").at(temp));
        assert!(matches!(failed, Err(IoError::Os { .. })), "{failed:?}");
        assert_eq!(names(dir.path()), ["out"]);
    }
}
