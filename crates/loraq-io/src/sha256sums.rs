//! `SHA256SUMS` files in the format `sha256sum -c` checks:
//! one line per file, `<64 hex digits><two spaces><relative path>`.

use crate::error::{IoError, OsContext, Result};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

/// File name of the checksum list.
pub const SHA256SUMS_FILE: &str = "SHA256SUMS";

/// Hex SHA-256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).at(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).at(path)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Hex SHA-256 of bytes.
pub fn sha256_bytes(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn collect_files(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).at(dir)? {
        let entry = entry.at(dir)?;
        let path = entry.path();
        let kind = entry.file_type().at(&path)?;
        if kind.is_dir() {
            collect_files(root, &path, out)?;
        } else if kind.is_file() {
            let rel = path.strip_prefix(root).expect("under root").to_path_buf();
            if rel != Path::new(SHA256SUMS_FILE) {
                out.push(rel);
            }
        }
    }
    Ok(())
}

/// Writes `dir/SHA256SUMS` covering every other file under `dir`, sorted by path.
pub fn write_sha256sums(dir: &Path) -> Result<()> {
    let mut files = Vec::new();
    collect_files(dir, dir, &mut files)?;
    files.sort();
    let lines = files
        .par_iter()
        .map(|rel| {
            let digest = sha256_file(&dir.join(rel))?;
            Ok(format!(
                "{digest}  {}\n",
                rel.to_string_lossy().replace('\\', "/")
            ))
        })
        .collect::<Result<Vec<String>>>()?;
    let path = dir.join(SHA256SUMS_FILE);
    std::fs::write(&path, lines.concat()).at(&path)
}

/// Checks every line of `dir/SHA256SUMS`; returns the number of files verified.
pub fn verify_sha256sums(dir: &Path) -> Result<usize> {
    let path = dir.join(SHA256SUMS_FILE);
    let text = std::fs::read_to_string(&path).at(&path)?;
    let entries = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let (digest, name) = line
                .split_once("  ")
                .or_else(|| line.split_once(" *"))
                .filter(|(d, _)| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()))
                .ok_or_else(|| IoError::Json {
                    path: path.clone(),
                    reason: format!("malformed line {line:?}"),
                })?;
            Ok((digest.to_ascii_lowercase(), name.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    entries.par_iter().try_for_each(|(digest, name)| {
        let file = dir.join(name);
        if !file.is_file() {
            return Err(IoError::Missing {
                path: file,
                context: format!(" (listed in {})", path.display()),
            });
        }
        if sha256_file(&file)? != *digest {
            return Err(IoError::Checksum {
                path: path.clone(),
                file: name.clone(),
            });
        }
        Ok(())
    })?;
    Ok(entries.len())
}
