//! Outputs (directories and single files) that appear only when complete, all of a
//! command's outputs or none of them, and never over the command's own inputs.
//!
//! Everything is written into a hidden temporary sibling of its target
//! (`.NAME.loraq-tmp-PID-NONCE`, see [`sibling_stem`] for long names); only
//! [`StagedOutputs::commit`] (or [`AtomicDir::commit`], [`write_file_atomically`])
//! moves it into place. A failure at any point (a check that refuses the input, a full
//! disk, a later output that cannot be placed) removes the temporaries and puts back
//! whatever an earlier output of the same commit had replaced.
//!
//! Three rules hold before anything is written ([`check_output_path`]):
//! - an output that is, contains or lies inside one of the command's inputs, or that is
//!   the working directory or one of its ancestors, is refused, with or without
//!   `--force` (paths compared after resolving symlinks);
//! - an existing output is refused unless `force`, and a file output never replaces a
//!   directory (nor a directory output a file);
//! - temporary siblings an earlier, killed run left beside the output are found
//!   ([`sweep_stale_siblings`]), removed when the process named in them is gone, and
//!   reported either way.
//!
//! A forced replace is one `renameat2(RENAME_EXCHANGE)` on Linux file systems that
//! have it: the target always names either the old or the new output. Elsewhere the
//! old output is renamed aside first and renamed back if the new one cannot be renamed
//! in.

use crate::error::{IoError, OsContext, Result};
use sha2::{Digest, Sha256};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Longest output name (in bytes) used whole in its temporary siblings' names. A
/// sibling adds at most 33 bytes (`.`, `.loraq-tmp-`, a pid of at most 10 digits, `-`
/// and a nonce of at most 10 digits), so 200 keeps every sibling under Linux's
/// NAME_MAX of 255 bytes.
const SIBLING_STEM_MAX_BYTES: usize = 200;

/// Bytes of a long output name kept before its hash in a sibling's name.
const SIBLING_STEM_PREFIX_BYTES: usize = 160;

/// The part of an output's temporary siblings' names that identifies the output: its
/// file name when at most 200 bytes long, else its first 160 bytes (cut at a character
/// boundary), `~` and 16 hex digits of the SHA-256 of the whole name, so a
/// 240-character output name still has siblings within NAME_MAX.
pub fn sibling_stem(name: &str) -> String {
    if name.len() <= SIBLING_STEM_MAX_BYTES {
        return name.to_string();
    }
    let mut cut = SIBLING_STEM_PREFIX_BYTES;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    let digest = Sha256::digest(name.as_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}~{hash}", &name[..cut])
}

/// A nonce that differs between siblings made by one process (a counter) and between
/// processes that reuse a pid (the clock's nanoseconds).
fn nonce() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::from(d.subsec_nanos()));
    // 10 digits at most: 1e9 nanoseconds plus the counter times 1e9 would overflow the
    // width, so the counter only perturbs the low digits.
    (nanos + COUNTER.fetch_add(1, Ordering::Relaxed)) % 10_000_000_000
}

/// The hidden sibling `.{stem}.loraq-{tag}-{pid}-{nonce}` of `target`, in the same
/// directory so renames between them stay on one file system.
fn sibling(target: &Path, tag: &str) -> Result<PathBuf> {
    let name = target.file_name().ok_or_else(|| IoError::Write {
        path: target.to_path_buf(),
        reason: "output path has no file or directory name".into(),
    })?;
    let stem = sibling_stem(&name.to_string_lossy());
    Ok(target.with_file_name(format!(
        ".{stem}.loraq-{tag}-{}-{}",
        std::process::id(),
        nonce()
    )))
}

/// The hidden temporary sibling [`write_file_atomically`] writes `path` into:
/// `.{stem}.loraq-tmp-{pid}-{nonce}` in the same directory ([`sibling_stem`]).
pub fn temp_file_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(
        ".{}.loraq-tmp-{}-{}",
        sibling_stem(&name),
        std::process::id(),
        nonce()
    ))
}

/// Writes the file `path` so that it appears only when complete: `write` fills a
/// temporary sibling ([`temp_file_sibling`]), which is renamed onto `path` (replacing
/// it) if `write` succeeded and removed otherwise, so a refused input or a full disk
/// leaves neither a partial file nor the temporary behind. Library writers use it; the
/// commands stage their outputs with [`StagedOutputs`], which adds the rules on inputs
/// and existing files.
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

// ---------------------------------------------------------------------------------
// Paths: inputs, outputs, the working directory.

/// `path` as the file system will resolve it once the output is created: absolute,
/// its longest existing ancestor with every symlink resolved, then the components
/// that do not exist yet, taken lexically (`.` dropped, `..` going up, as it will once
/// those directories are created).
fn resolve(path: &Path) -> Result<PathBuf> {
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().at(path)?.join(path)
    };
    let mut existing = absolute.as_path();
    let mut rest: Vec<Component<'_>> = Vec::new();
    let mut resolved = loop {
        match std::fs::canonicalize(existing) {
            Ok(p) => break p,
            Err(_) => match (existing.parent(), existing.components().next_back()) {
                (Some(parent), Some(last)) => {
                    rest.push(last);
                    existing = parent;
                }
                // The root itself does not resolve: nothing to compare against.
                _ => break existing.to_path_buf(),
            },
        }
    };
    for component in rest.into_iter().rev() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                resolved.pop();
            }
            other => resolved.push(other),
        }
    }
    Ok(resolved)
}

/// The entry an output replaces: its resolved parent directory joined with its own
/// name, without following a symlink at the output itself (a rename replaces the link,
/// not what it points to).
fn resolve_entry(path: &Path) -> Result<PathBuf> {
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            Ok(resolve(parent)?.join(name))
        }
        _ => resolve(path),
    }
}

/// How an output path relates to another path, or `None` when they are apart.
fn overlap(output: &Path, other: &Path) -> Option<&'static str> {
    if output == other {
        Some("is")
    } else if other.starts_with(output) {
        Some("contains")
    } else if output.starts_with(other) {
        Some("lies inside")
    } else {
        None
    }
}

/// Refuses an output that would destroy or write into one of the command's inputs or
/// the working directory, whatever `--force` says: an output that is, contains or lies
/// inside any of `inputs`, or that is the working directory or one of its ancestors.
/// Both sides are compared after resolving symlinks (the inputs wholly, the output's
/// existing ancestors, and the output itself both as the entry a rename would replace
/// and as what a symlink there points to), so `--out` spelled through a link, `..` or
/// a relative path is caught as well.
pub fn check_output_path(output: &Path, inputs: &[&Path]) -> Result<()> {
    let entry = resolve_entry(output)?;
    let pointed = resolve(output)?;
    for input in inputs {
        let resolved_input = resolve(input)?;
        for candidate in [&entry, &pointed] {
            if let Some(relation) = overlap(candidate, &resolved_input) {
                return Err(IoError::OutputOverInput {
                    output: output.to_path_buf(),
                    relation,
                    input: input.to_path_buf(),
                });
            }
        }
    }
    if let Ok(cwd) = std::env::current_dir().and_then(std::fs::canonicalize) {
        for candidate in [&entry, &pointed] {
            if cwd.starts_with(candidate) {
                let relation = if *candidate == cwd { "is" } else { "contains" };
                return Err(IoError::OutputOverWorkingDir {
                    output: output.to_path_buf(),
                    relation,
                    cwd,
                });
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Siblings a killed run left behind.

/// What became of a temporary sibling an earlier run left beside an output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StaleOutcome {
    /// Its process is gone: removed.
    Removed,
    /// Its process is still running (another loraq writing the same output, or a
    /// pid reused since): left alone.
    InUse,
    /// Its process is gone but the removal failed (the reason).
    NotRemoved(String),
}

/// A hidden `.NAME.loraq-tmp-*` / `.NAME.loraq-old-*` sibling of an output, left by a
/// run that was killed before it could remove it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleSibling {
    /// The sibling.
    pub path: PathBuf,
    /// The process that made it (from its name).
    pub pid: u32,
    /// What was done with it.
    pub outcome: StaleOutcome,
}

impl std::fmt::Display for StaleSibling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (path, pid) = (self.path.display(), self.pid);
        match &self.outcome {
            StaleOutcome::Removed => write!(
                f,
                "{path}: left by loraq process {pid}, which is gone (killed?): removed"
            ),
            StaleOutcome::InUse => write!(
                f,
                "{path}: belongs to running process {pid} (another loraq writing this output?): left alone"
            ),
            StaleOutcome::NotRemoved(reason) => write!(
                f,
                "{path}: left by loraq process {pid}, which is gone, but cannot be removed: {reason}"
            ),
        }
    }
}

/// The pid in a sibling name's tail `tmp-{pid}[-{nonce}]` / `old-{pid}[-{nonce}]`.
fn sibling_pid(tail: &str) -> Option<u32> {
    let rest = tail
        .strip_prefix("tmp-")
        .or_else(|| tail.strip_prefix("old-"))?;
    let (pid, nonce) = rest.split_once('-').unwrap_or((rest, "0"));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || !digits(nonce) {
        return None;
    }
    pid.parse().ok()
}

/// Whether process `pid` runs. Without /proc it cannot be told, so it is assumed to
/// run (nothing is removed).
fn process_is_running(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    let proc = Path::new("/proc");
    !proc.join("self").exists() || proc.join(pid.to_string()).exists()
}

/// Finds the temporary siblings (`.{stem}.loraq-tmp-*`, `.{stem}.loraq-old-*`) that
/// earlier runs left beside `target`, removes those whose process is gone and returns
/// every one found with what was done. The current process's own siblings are not
/// touched.
pub fn sweep_stale_siblings(target: &Path) -> Vec<StaleSibling> {
    let (Some(name), Some(parent)) = (target.file_name(), target.parent()) else {
        return Vec::new();
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let prefix = format!(".{}.loraq-", sibling_stem(&name.to_string_lossy()));
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let entry_name = entry.file_name();
        let entry_name = entry_name.to_string_lossy();
        let Some(pid) = entry_name.strip_prefix(&prefix).and_then(sibling_pid) else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        let path = target.with_file_name(&*entry_name);
        let outcome = if process_is_running(pid) {
            StaleOutcome::InUse
        } else {
            let removed = match entry.file_type() {
                Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
                _ => std::fs::remove_file(&path),
            };
            match removed {
                Ok(()) => StaleOutcome::Removed,
                Err(e) => StaleOutcome::NotRemoved(e.to_string()),
            }
        };
        found.push(StaleSibling { path, pid, outcome });
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    found
}

// ---------------------------------------------------------------------------------
// Renames.

/// Whether a rename flag failed only because the file system (or kernel) lacks it.
#[cfg(target_os = "linux")]
fn flag_unsupported(e: &rustix::io::Errno) -> bool {
    use rustix::io::Errno;
    [Errno::INVAL, Errno::NOSYS, Errno::NOTSUP, Errno::OPNOTSUPP].contains(e)
}

#[cfg(test)]
thread_local! {
    /// Tests of the fallback path switch the exchange off on their thread.
    static NO_EXCHANGE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Swaps `a` and `b` atomically (both must exist). `Ok(false)` where the file system
/// cannot exchange.
fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    #[cfg(test)]
    if NO_EXCHANGE.with(std::cell::Cell::get) {
        return Ok(false);
    }
    #[cfg(target_os = "linux")]
    {
        use rustix::fs::{CWD, RenameFlags, renameat_with};
        match renameat_with(CWD, a, CWD, b, RenameFlags::EXCHANGE) {
            Ok(()) => Ok(true),
            Err(e) if flag_unsupported(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (a, b);
        Ok(false)
    }
}

/// Renames `from` to `to` unless `to` exists (then `ErrorKind::AlreadyExists`), so an
/// output that appeared after the checks is not clobbered; a plain rename where the
/// file system cannot refuse.
fn rename_no_replace(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use rustix::fs::{CWD, RenameFlags, renameat_with};
        match renameat_with(CWD, from, CWD, to, RenameFlags::NOREPLACE) {
            Ok(()) => return Ok(()),
            Err(e) if flag_unsupported(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    std::fs::rename(from, to)
}

/// Removes a file or a directory tree.
fn remove_any(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    }
}

// ---------------------------------------------------------------------------------
// Staged outputs.

/// Whether an output is one file or a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// A single file.
    File,
    /// A directory.
    Dir,
}

impl OutputKind {
    fn noun(self) -> &'static str {
        match self {
            OutputKind::File => "file",
            OutputKind::Dir => "directory",
        }
    }
}

/// Where one staged output stands.
#[derive(Debug)]
enum Placement {
    /// The temporary holds the new output; the target is untouched.
    Staged,
    /// The new output is at the target; `old` holds what it replaced (the temporary's
    /// path after an exchange, an `-old-` sibling after the fallback), if anything.
    Placed {
        old: Option<PathBuf>,
        exchanged: bool,
    },
    /// A rollback failed: the temporary may hold the user's old output and must not be
    /// removed.
    Stranded,
}

#[derive(Debug)]
struct Staged {
    target: PathBuf,
    temp: PathBuf,
    kind: OutputKind,
    placement: Placement,
}

/// The outputs of one command, each written into a temporary sibling and committed
/// together: all of them appear, or none does and every target keeps what it held.
///
/// Every output is checked when staged, before the work that fills it: it must not
/// overlap an input or the working directory ([`check_output_path`]) or another output
/// of the same command, an existing target needs `force` and the same kind (file or
/// directory), and stale siblings of earlier killed runs are swept
/// ([`StagedOutputs::stale_siblings`]).
#[derive(Debug)]
pub struct StagedOutputs {
    inputs: Vec<PathBuf>,
    force: bool,
    staged: Vec<Staged>,
    resolved_targets: Vec<PathBuf>,
    stale: Vec<StaleSibling>,
    committed: bool,
}

impl StagedOutputs {
    /// Outputs of a command reading `inputs`; `force` lets them replace existing
    /// outputs (never an input).
    pub fn new(inputs: &[&Path], force: bool) -> StagedOutputs {
        StagedOutputs {
            inputs: inputs.iter().map(|p| p.to_path_buf()).collect(),
            force,
            staged: Vec::new(),
            resolved_targets: Vec::new(),
            stale: Vec::new(),
            committed: false,
        }
    }

    fn check(&mut self, target: &Path, kind: OutputKind) -> Result<()> {
        let inputs: Vec<&Path> = self.inputs.iter().map(PathBuf::as_path).collect();
        check_output_path(target, &inputs)?;
        if target.file_name().is_none() {
            return Err(IoError::Write {
                path: target.to_path_buf(),
                reason: format!("not a {} name", kind.noun()),
            });
        }
        let resolved = resolve_entry(target)?;
        for (earlier, staged) in self.resolved_targets.iter().zip(&self.staged) {
            if let Some(relation) = overlap(&resolved, earlier) {
                return Err(IoError::OutputOverOutput {
                    output: target.to_path_buf(),
                    relation,
                    other: staged.target.clone(),
                });
            }
        }
        if let Ok(meta) = std::fs::symlink_metadata(target) {
            if !self.force {
                return Err(IoError::OutputExists {
                    path: target.to_path_buf(),
                });
            }
            // A symlink is replaced as a file is (the link, not what it points to).
            let existing = if meta.is_dir() {
                OutputKind::Dir
            } else {
                OutputKind::File
            };
            if existing != kind {
                return Err(IoError::OutputKindMismatch {
                    path: target.to_path_buf(),
                    existing: existing.noun(),
                    output: kind.noun(),
                });
            }
        }
        self.stale.extend(sweep_stale_siblings(target));
        self.resolved_targets.push(resolved);
        Ok(())
    }

    /// Stages the file `target`: checks it, then creates its empty temporary sibling
    /// (so an unwritable directory fails now, before the work) and returns that path
    /// for the writer to fill (it may recreate the file).
    pub fn stage_file(&mut self, target: &Path) -> Result<PathBuf> {
        self.check(target, OutputKind::File)?;
        let temp = sibling(target, "tmp")?;
        std::fs::File::create_new(&temp).at(&temp)?;
        self.staged.push(Staged {
            target: target.to_path_buf(),
            temp: temp.clone(),
            kind: OutputKind::File,
            placement: Placement::Staged,
        });
        Ok(temp)
    }

    /// Stages the directory `target`: checks it, creates its parent directories and its
    /// empty temporary sibling, and returns that path to write into.
    pub fn stage_dir(&mut self, target: &Path) -> Result<PathBuf> {
        self.check(target, OutputKind::Dir)?;
        if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).at(parent)?;
        }
        let temp = sibling(target, "tmp")?;
        std::fs::create_dir(&temp).at(&temp)?;
        self.staged.push(Staged {
            target: target.to_path_buf(),
            temp: temp.clone(),
            kind: OutputKind::Dir,
            placement: Placement::Staged,
        });
        Ok(temp)
    }

    /// Siblings of the staged outputs that earlier, killed runs left behind: removed
    /// where their process is gone. Commands report them on stderr.
    pub fn stale_siblings(&self) -> &[StaleSibling] {
        &self.stale
    }

    /// Moves every staged output into place, or none: when one cannot be placed,
    /// those already placed are put back (the replaced outputs restored) and the error
    /// is returned. Replaced outputs are removed only once all are in place.
    pub fn commit(mut self) -> Result<Vec<PathBuf>> {
        for index in 0..self.staged.len() {
            if let Err(e) = self.place(index) {
                for earlier in (0..index).rev() {
                    self.unplace(earlier);
                }
                return Err(e);
            }
        }
        self.committed = true;
        for staged in &self.staged {
            if let Placement::Placed { old: Some(old), .. } = &staged.placement {
                // Best effort: the outputs are in place; an old copy that cannot be
                // removed is a stale sibling the next run on this output reports.
                let _ = remove_any(old);
            }
        }
        Ok(self.staged.iter().map(|s| s.target.clone()).collect())
    }

    fn place(&mut self, index: usize) -> Result<()> {
        let force = self.force;
        let staged = &mut self.staged[index];
        let (temp, target) = (&staged.temp, &staged.target);
        if std::fs::symlink_metadata(target).is_err() {
            match rename_no_replace(temp, target) {
                Ok(()) => {
                    staged.placement = Placement::Placed {
                        old: None,
                        exchanged: false,
                    };
                    return Ok(());
                }
                // Appeared since the checks: replace it only if forced.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && force => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    return Err(IoError::OutputExists {
                        path: target.clone(),
                    });
                }
                Err(e) => return Err(e).at(target),
            }
        } else if !force {
            return Err(IoError::OutputExists {
                path: target.clone(),
            });
        }
        if exchange(temp, target).at(target)? {
            // The temporary now holds the old output.
            staged.placement = Placement::Placed {
                old: Some(temp.clone()),
                exchanged: true,
            };
            return Ok(());
        }
        let old = sibling(target, "old")?;
        std::fs::rename(target, &old).at(target)?;
        if let Err(e) = std::fs::rename(temp, target) {
            if std::fs::rename(&old, target).is_err() {
                return Err(IoError::Write {
                    path: target.clone(),
                    reason: format!(
                        "cannot rename the new {} into place ({e}) nor the old one back: it is at {}",
                        staged.kind.noun(),
                        old.display()
                    ),
                });
            }
            return Err(e).at(target);
        }
        staged.placement = Placement::Placed {
            old: Some(old),
            exchanged: false,
        };
        Ok(())
    }

    /// Puts back what `place` did (best effort: a failure strands the temporary, which
    /// is then kept, not removed).
    fn unplace(&mut self, index: usize) {
        let staged = &mut self.staged[index];
        let (temp, target) = (&staged.temp, &staged.target);
        let undone = match &staged.placement {
            Placement::Placed {
                old: Some(_),
                exchanged: true,
            } => exchange(temp, target),
            Placement::Placed {
                old: Some(old),
                exchanged: false,
            } => std::fs::rename(target, temp)
                .and_then(|()| std::fs::rename(old, target))
                .map(|()| true),
            Placement::Placed { old: None, .. } => std::fs::rename(target, temp).map(|()| true),
            Placement::Staged | Placement::Stranded => Ok(true),
        };
        staged.placement = if matches!(undone, Ok(true)) {
            Placement::Staged
        } else {
            Placement::Stranded
        };
    }
}

impl Drop for StagedOutputs {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        for staged in &self.staged {
            if matches!(staged.placement, Placement::Staged) {
                // Best effort: the error being propagated matters more than this one.
                let _ = remove_any(&staged.temp);
            }
        }
    }
}

/// A directory being written, renamed into place by [`AtomicDir::commit`]: a
/// [`StagedOutputs`] of one directory.
#[derive(Debug)]
pub struct AtomicDir {
    outputs: StagedOutputs,
    target: PathBuf,
    temp: PathBuf,
}

impl AtomicDir {
    /// Starts writing `target` for a command reading `inputs`. Refuses a target that
    /// overlaps an input or the working directory (always) and an existing target
    /// unless `force` ([`StagedOutputs`]).
    pub fn create(target: impl AsRef<Path>, force: bool, inputs: &[&Path]) -> Result<AtomicDir> {
        let target = target.as_ref().to_path_buf();
        let mut outputs = StagedOutputs::new(inputs, force);
        let temp = outputs.stage_dir(&target)?;
        Ok(AtomicDir {
            outputs,
            target,
            temp,
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

    /// Siblings of the target that earlier, killed runs left behind
    /// ([`StagedOutputs::stale_siblings`]).
    pub fn stale_siblings(&self) -> &[StaleSibling] {
        self.outputs.stale_siblings()
    }

    /// Moves the finished directory into place (exchanging it with the old target
    /// when forced).
    pub fn commit(self) -> Result<PathBuf> {
        self.outputs.commit()?;
        Ok(self.target)
    }
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

    #[test]
    fn long_output_names_keep_their_siblings_within_name_max() {
        let dir = tempfile::tempdir().unwrap();
        let long = "a".repeat(240);
        let stem = sibling_stem(&long);
        assert!(stem.len() <= SIBLING_STEM_MAX_BYTES, "{}", stem.len());
        assert_ne!(
            sibling_stem(&"a".repeat(241)),
            stem,
            "the hash tells names apart"
        );
        // Multi-byte characters are cut at a boundary.
        let wide = "é".repeat(120);
        assert!(sibling_stem(&wide).starts_with('é'));
        for name in [long.as_str(), wide.as_str()] {
            let target = dir.path().join(name);
            let temp = temp_file_sibling(&target);
            assert!(temp.file_name().unwrap().len() <= 255);
            let mut outputs = StagedOutputs::new(&[], false);
            let staged = outputs.stage_file(&target).unwrap();
            assert!(staged.file_name().unwrap().len() <= 255);
            std::fs::write(&staged, "x").unwrap();
            outputs.commit().unwrap();
            let dir_target = dir.path().join(format!("d{name}"));
            let out = AtomicDir::create(&dir_target, false, &[]).unwrap();
            out.commit().unwrap();
        }
        assert_eq!(names(dir.path()).len(), 4);
    }

    #[test]
    fn outputs_over_inputs_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join("models");
        let base = models.join("base");
        std::fs::create_dir_all(&base).unwrap();
        std::fs::write(base.join("model.safetensors"), "w").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&base, &link).unwrap();
        let inputs = [base.as_path()];
        let refused = |out: &Path, relation: &str| {
            let err = check_output_path(out, &inputs).unwrap_err();
            assert!(
                matches!(&err, IoError::OutputOverInput { relation: r, .. } if *r == relation),
                "{}: {err}",
                out.display()
            );
            let text = err.to_string();
            assert!(text.contains(&out.display().to_string()), "{text}");
            assert!(text.contains(&base.display().to_string()), "{text}");
        };
        refused(&base, "is");
        refused(&models, "contains");
        refused(&base.join("adapter"), "lies inside");
        refused(&link, "is");
        refused(&link.join("new/deeper"), "lies inside");
        refused(&models.join("new/../base"), "is");
        refused(&dir.path().join("link/.."), "contains");
        check_output_path(&models.join("adapter"), &inputs).unwrap();
        // The input named through the link is resolved as well.
        let err = check_output_path(&base, &[link.as_path()]).unwrap_err();
        assert!(matches!(err, IoError::OutputOverInput { .. }), "{err}");
    }

    #[test]
    fn the_working_directory_and_its_ancestors_are_refused() {
        let cwd = std::env::current_dir().unwrap();
        for out in [
            cwd.clone(),
            cwd.parent().unwrap().to_path_buf(),
            PathBuf::from("."),
        ] {
            let err = check_output_path(&out, &[]).unwrap_err();
            assert!(matches!(err, IoError::OutputOverWorkingDir { .. }), "{err}");
        }
        check_output_path(&cwd.join("new-output"), &[]).unwrap();
    }

    #[test]
    fn existing_files_are_refused_unless_forced_and_kinds_must_match() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("answers.jsonl");
        std::fs::write(&file, "old").unwrap();
        let err = StagedOutputs::new(&[], false)
            .stage_file(&file)
            .unwrap_err();
        assert!(matches!(err, IoError::OutputExists { .. }), "{err}");
        let err = StagedOutputs::new(&[], true).stage_dir(&file).unwrap_err();
        assert!(matches!(err, IoError::OutputKindMismatch { .. }), "{err}");
        let err = StagedOutputs::new(&[], true)
            .stage_file(dir.path())
            .unwrap_err();
        assert!(
            matches!(
                err,
                IoError::OutputKindMismatch { .. } | IoError::OutputOverInput { .. }
            ),
            "{err}"
        );
        let mut outputs = StagedOutputs::new(&[], true);
        let temp = outputs.stage_file(&file).unwrap();
        std::fs::write(&temp, "new").unwrap();
        outputs.commit().unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "new");
        assert_eq!(names(dir.path()), ["answers.jsonl"]);
        // The same output twice in one command.
        let mut outputs = StagedOutputs::new(&[], true);
        outputs.stage_file(&file).unwrap();
        let err = outputs.stage_file(&file).unwrap_err();
        assert!(matches!(err, IoError::OutputOverOutput { .. }), "{err}");
    }

    fn commit_fails_after_the_first_output_and_restores_it(exchange_available: bool) {
        NO_EXCHANGE.with(|c| c.set(!exchange_available));
        let dir = tempfile::tempdir().unwrap();
        let (first, second) = (dir.path().join("answers.jsonl"), dir.path().join("stats"));
        std::fs::write(&first, "old answers").unwrap();
        let mut outputs = StagedOutputs::new(&[], true);
        let temp = outputs.stage_file(&first).unwrap();
        std::fs::write(&temp, "new answers").unwrap();
        let temp2 = outputs.stage_dir(&second).unwrap();
        // The second output cannot be placed: its temporary vanished (as on a file
        // system that fails the rename).
        std::fs::remove_dir(&temp2).unwrap();
        let err = outputs.commit().unwrap_err();
        assert!(matches!(err, IoError::Os { .. }), "{err}");
        assert_eq!(std::fs::read_to_string(&first).unwrap(), "old answers");
        assert_eq!(names(dir.path()), ["answers.jsonl"]);
        NO_EXCHANGE.with(|c| c.set(false));
    }

    #[test]
    fn a_failed_commit_puts_back_what_it_replaced_with_exchange() {
        commit_fails_after_the_first_output_and_restores_it(true);
    }

    #[test]
    fn a_failed_commit_puts_back_what_it_replaced_without_exchange() {
        commit_fails_after_the_first_output_and_restores_it(false);
    }

    #[test]
    fn exchange_swaps_two_entries_where_the_file_system_has_it() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, "a").unwrap();
        std::fs::create_dir(&b).unwrap();
        if exchange(&a, &b).unwrap() {
            assert!(a.is_dir());
            assert_eq!(std::fs::read_to_string(&b).unwrap(), "a");
        } else {
            eprintln!("skipped: this file system cannot exchange (the fallback is tested)");
        }
    }

    #[test]
    fn forced_replace_without_exchange_leaves_no_sibling() {
        NO_EXCHANGE.with(|c| c.set(true));
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("old"), "old").unwrap();
        let out = AtomicDir::create(&target, true, &[]).unwrap();
        std::fs::write(out.path().join("new"), "new").unwrap();
        out.commit().unwrap();
        assert_eq!(names(&target), ["new"]);
        assert_eq!(names(dir.path()), ["out"]);
        NO_EXCHANGE.with(|c| c.set(false));
    }

    #[test]
    fn stale_siblings_of_dead_processes_are_removed_and_live_ones_reported() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("adapter");
        // A pid above Linux's pid_max (2^22) never runs.
        let dead = dir.path().join(".adapter.loraq-tmp-4999999-12345");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("partial"), "x").unwrap();
        let dead_old = dir.path().join(".adapter.loraq-old-4999998-1");
        std::fs::write(&dead_old, "x").unwrap();
        // pid 1 always runs.
        let live = dir.path().join(".adapter.loraq-tmp-1-7");
        std::fs::write(&live, "x").unwrap();
        // Not siblings of this output.
        std::fs::write(dir.path().join(".adapter2.loraq-tmp-4999999-1"), "x").unwrap();
        std::fs::write(dir.path().join(".adapter.loraq-tmp-x-1"), "x").unwrap();
        let out = AtomicDir::create(&target, false, &[]).unwrap();
        let found = out.stale_siblings().to_vec();
        assert_eq!(found.len(), 3, "{found:?}");
        let outcome = |p: &Path| found.iter().find(|s| s.path == p).unwrap().outcome.clone();
        assert_eq!(outcome(&dead), StaleOutcome::Removed);
        assert_eq!(outcome(&dead_old), StaleOutcome::Removed);
        assert_eq!(outcome(&live), StaleOutcome::InUse);
        assert!(found[0].to_string().contains("loraq process"));
        out.commit().unwrap();
        assert!(!dead.exists() && !dead_old.exists() && live.exists());
    }
}
