//! The answers file, its header and its incomplete-answers file: written record by
//! record (appended, flushed with each line, fsynced in batches), resumed by id.
//!
//! `OUT` holds only answer lines, so `loraq compare` reads it as it is; the header
//! `OUT.collect.json` says what was asked of which server; `OUT.incomplete.jsonl`
//! holds the questions some of whose options the engine did not return.

use crate::error::{CollectError, Result};
use crate::question::{AnswerLine, IncompleteLine, Question, Scores};
use loraq_io::limits::{CappedLine, MAX_JSON_LINE_BYTES, elide, read_capped_line};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The header format's name.
pub const HEADER_FORMAT: &str = "loraq-collect";
/// The header format's version.
pub const HEADER_VERSION: u32 = 1;

/// What a collection asked of which server: `OUT.collect.json`. A re-run resumes
/// only when the fields that decide the answers are the same.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Always [`HEADER_FORMAT`].
    pub format: String,
    /// [`HEADER_VERSION`].
    pub version: u32,
    /// `vllm` or `llama-cpp`.
    pub engine: String,
    /// The served base model's name.
    pub model: String,
    /// vLLM: the adapter's served name.
    pub adapter: Option<String>,
    /// llama.cpp: the adapter's id.
    pub lora_id: Option<u32>,
    /// llama.cpp: the adapter's scale (null without an adapter).
    pub lora_scale: Option<f64>,
    /// What the `logits` written are (docs/collect.md).
    pub values: String,
    /// The records file as given.
    pub records: String,
    /// SHA-256 of the records file's bytes.
    pub records_sha256: String,
    /// Number of records.
    pub records_count: usize,
    /// The server's base URL when the header was written (not compared on resume:
    /// a server may come back on another port).
    pub server: String,
    /// The server's version when the header was written (a change is reported, not
    /// refused).
    pub server_version: String,
}

impl Header {
    /// The fields compared on resume, by name.
    fn decisive(&self) -> [(&'static str, String); 6] {
        [
            ("engine", self.engine.clone()),
            ("model", self.model.clone()),
            ("adapter", format!("{:?}", self.adapter)),
            ("lora_id", format!("{:?}", self.lora_id)),
            ("lora_scale", format!("{:?}", self.lora_scale)),
            ("records_sha256", self.records_sha256.clone()),
        ]
    }
}

/// SHA-256 of a file's bytes, in hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(CollectError::io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(CollectError::io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// `OUT` + `suffix`.
fn sibling(out: &Path, suffix: &str) -> PathBuf {
    let mut name = out.as_os_str().to_os_string();
    name.push(suffix);
    PathBuf::from(name)
}

/// The header's path for answers file `out`.
pub fn header_path(out: &Path) -> PathBuf {
    sibling(out, ".collect.json")
}

/// The incomplete-answers file's path for answers file `out`.
pub fn incomplete_path(out: &Path) -> PathBuf {
    sibling(out, ".incomplete.jsonl")
}

/// What opening found.
#[derive(Debug, Default)]
pub struct Resumed {
    /// Ids already answered (in either file).
    pub done: HashSet<String>,
    /// Answer lines already in `OUT`.
    pub answers: usize,
    /// Lines already in the incomplete file.
    pub incomplete: usize,
    /// Notes for the user (a cut last line removed, a changed server version).
    pub notes: Vec<String>,
}

/// The open output: the answers file and the incomplete file, appended to.
pub struct AnswersOut {
    answers_path: PathBuf,
    incomplete_path: PathBuf,
    answers: File,
    incomplete: File,
    unsynced: usize,
    last_sync: Instant,
    sync_every: usize,
}

/// Lines between two fsyncs, at most (and at most 2 s between them).
pub const SYNC_EVERY_LINES: usize = 64;
const SYNC_EVERY: Duration = Duration::from_secs(2);

impl AnswersOut {
    /// Opens `out` for `questions`: a new collection writes the header first; an
    /// existing one is resumed if its header's decisive fields equal `header`'s,
    /// and its lines are checked (each a valid answer, of a record of this file,
    /// with the record's options, no id twice). A last line cut short (a crash in
    /// the middle of a write) is removed and reported.
    pub fn open(
        out: &Path,
        header: &Header,
        questions: &[Question],
    ) -> Result<(AnswersOut, Resumed)> {
        let hpath = header_path(out);
        let ipath = incomplete_path(out);
        let mut resumed = Resumed::default();
        let exists = |p: &Path| p.try_exists().map_err(CollectError::io(p));
        if exists(&hpath)? {
            let text = std::fs::read_to_string(&hpath).map_err(CollectError::io(&hpath))?;
            let old: Header = serde_json::from_str(&text).map_err(|e| CollectError::Resume {
                path: hpath.clone(),
                reason: format!("not a loraq collect header: {e}"),
            })?;
            if old.format != HEADER_FORMAT || old.version != HEADER_VERSION {
                return Err(CollectError::Resume {
                    path: hpath,
                    reason: format!(
                        "format {:?} version {}, expected {HEADER_FORMAT:?} version {HEADER_VERSION}",
                        old.format, old.version
                    ),
                });
            }
            for ((name, was), (_, now)) in old.decisive().iter().zip(header.decisive().iter()) {
                if was != now {
                    return Err(CollectError::Resume {
                        path: hpath,
                        reason: format!(
                            "{name} was {was} when these answers were collected, now {now}: refusing to mix answers of two setups in one file (choose another --out, or remove {} and its siblings to start over)",
                            out.display()
                        ),
                    });
                }
            }
            if old.server_version != header.server_version {
                resumed.notes.push(format!(
                    "the server's version changed since the answers began: {} then, {} now",
                    old.server_version, header.server_version
                ));
            }
        } else {
            for p in [out, ipath.as_path()] {
                if exists(p)? && std::fs::metadata(p).map_err(CollectError::io(p))?.len() > 0 {
                    return Err(CollectError::Resume {
                        path: p.to_path_buf(),
                        reason: format!(
                            "exists without the header {} that loraq collect writes first: not a collection to resume (choose another --out)",
                            hpath.display()
                        ),
                    });
                }
            }
            let text = serde_json::to_string_pretty(header).expect("the header serializes");
            loraq_io::write_file_atomically(&hpath, |temp| {
                let mut f = File::create(temp).map_err(|e| loraq_io::IoError::Os {
                    path: temp.to_path_buf(),
                    source: e,
                })?;
                f.write_all(format!("{text}\n").as_bytes())
                    .and_then(|()| f.sync_all())
                    .map_err(|e| loraq_io::IoError::Os {
                        path: temp.to_path_buf(),
                        source: e,
                    })
            })?;
        }
        let by_id: HashMap<&str, &Question> =
            questions.iter().map(|q| (q.id.as_str(), q)).collect();
        let mut first_line: HashMap<String, (PathBuf, u64)> = HashMap::new();
        let answers = open_append(out, &mut resumed)?;
        resumed.answers = check_answers(out, &by_id, &mut first_line)?;
        let incomplete = open_append(&ipath, &mut resumed)?;
        resumed.incomplete = check_incomplete(&ipath, &by_id, &mut first_line)?;
        resumed.done = first_line.into_keys().collect();
        Ok((
            AnswersOut {
                answers_path: out.to_path_buf(),
                incomplete_path: ipath,
                answers,
                incomplete,
                unsynced: 0,
                last_sync: Instant::now(),
                sync_every: SYNC_EVERY_LINES,
            },
            resumed,
        ))
    }

    /// Writes the answer to `q`: to the answers file when every option has a value
    /// (as `logits`, or as `probs` when one is `-inf`, which `logits` cannot hold),
    /// else to the incomplete file with `reason`. Returns whether it was complete.
    pub fn write(&mut self, q: &Question, scores: &Scores, reason: &str) -> Result<bool> {
        let complete: Option<Vec<f64>> = scores.values.iter().copied().collect();
        let (line, path, file) = match complete {
            Some(values) => {
                let line = answer_line(q, &values);
                (line, &self.answers_path, &mut self.answers)
            }
            None => {
                let line = serde_json::to_string(&IncompleteLine {
                    id: &q.id,
                    options: &q.options,
                    logits: scores.values.clone(),
                    reason,
                })
                .expect("an incomplete line serializes");
                (line, &self.incomplete_path, &mut self.incomplete)
            }
        };
        let is_answer = path == &self.answers_path;
        // One write of the whole line: a process killed around it leaves the line
        // whole or absent (a machine crash may cut it; open() removes a cut line).
        file.write_all(format!("{line}\n").as_bytes())
            .map_err(CollectError::io(path))?;
        self.unsynced += 1;
        if self.unsynced >= self.sync_every || self.last_sync.elapsed() >= SYNC_EVERY {
            self.sync()?;
        }
        Ok(is_answer)
    }

    /// Makes every line written so far durable.
    pub fn sync(&mut self) -> Result<()> {
        self.answers
            .sync_data()
            .map_err(CollectError::io(&self.answers_path))?;
        self.incomplete
            .sync_data()
            .map_err(CollectError::io(&self.incomplete_path))?;
        self.unsynced = 0;
        self.last_sync = Instant::now();
        Ok(())
    }
}

/// The answers-format line of `q` with one value per option: `logits` when all are
/// finite, else `probs` (softmax over the finite ones, 0 for `-inf`).
fn answer_line(q: &Question, values: &[f64]) -> String {
    if values.iter().all(|v| v.is_finite()) {
        return serde_json::to_string(&AnswerLine {
            id: &q.id,
            group: q.group.as_deref(),
            options: &q.options,
            logits: values.to_vec(),
            gold: q.gold.as_deref(),
        })
        .expect("an answer line serializes");
    }
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exp: Vec<f64> = values.iter().map(|v| (v - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    let probs: Vec<f64> = exp.iter().map(|e| e / sum).collect();
    serde_json::json!({
        "id": q.id, "group": q.group, "options": q.options, "probs": probs, "gold": q.gold,
    })
    .to_string()
}

/// Opens `path` for appending (created if absent), first cutting a last line that
/// has no newline (left by a crash in the middle of a write).
fn open_append(path: &Path, resumed: &mut Resumed) -> Result<File> {
    let mut file = OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .open(path)
        .map_err(CollectError::io(path))?;
    let len = file.metadata().map_err(CollectError::io(path))?.len();
    if len > 0 {
        let mut last = [0u8; 1];
        file.seek(SeekFrom::Start(len - 1))
            .and_then(|_| file.read_exact(&mut last))
            .map_err(CollectError::io(path))?;
        if last[0] != b'\n' {
            // Find the last newline, reading backwards in blocks.
            let mut end = len;
            let mut keep = 0u64;
            let mut buf = vec![0u8; 1 << 16];
            'search: while end > 0 {
                let start = end.saturating_sub(buf.len() as u64);
                let n = usize::try_from(end - start).expect("a block fits in memory");
                file.seek(SeekFrom::Start(start))
                    .and_then(|_| file.read_exact(&mut buf[..n]))
                    .map_err(CollectError::io(path))?;
                if let Some(i) = buf[..n].iter().rposition(|&b| b == b'\n') {
                    keep = start + i as u64 + 1;
                    break 'search;
                }
                end = start;
            }
            file.set_len(keep).map_err(CollectError::io(path))?;
            file.sync_all().map_err(CollectError::io(path))?;
            resumed.notes.push(format!(
                "{}: removed a last line cut short at byte {keep} ({} bytes, no newline: a crash in the middle of a write); its record is asked again",
                path.display(),
                len - keep
            ));
        }
    }
    Ok(file)
}

fn note_id(
    id: &str,
    path: &Path,
    line: u64,
    by_id: &HashMap<&str, &Question>,
    first_line: &mut HashMap<String, (PathBuf, u64)>,
) -> Result<()> {
    let shown = elide(id);
    if !by_id.contains_key(id) {
        return Err(CollectError::Resume {
            path: path.to_path_buf(),
            reason: format!(
                "line {line}: id {shown:?} is not in the records file (the records changed since?)"
            ),
        });
    }
    if let Some((p, l)) = first_line.insert(id.to_string(), (path.to_path_buf(), line)) {
        return Err(CollectError::Resume {
            path: path.to_path_buf(),
            reason: format!(
                "line {line}: id {shown:?} was already answered at {}:{l}",
                p.display()
            ),
        });
    }
    Ok(())
}

/// Checks every line of an existing answers file with loraq-eval's reader, and
/// its ids and options against the records; returns the count.
fn check_answers(
    path: &Path,
    by_id: &HashMap<&str, &Question>,
    first_line: &mut HashMap<String, (PathBuf, u64)>,
) -> Result<usize> {
    let reader = loraq_eval::AnswersReader::open(path).map_err(|e| CollectError::Resume {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut count = 0;
    for answer in reader {
        let answer = answer.map_err(|e| CollectError::Resume {
            path: path.to_path_buf(),
            reason: format!("{e} (not an answers file loraq collect wrote?)"),
        })?;
        note_id(&answer.id, path, answer.line, by_id, first_line)?;
        let q = by_id[answer.id.as_str()];
        if answer.options != q.options {
            return Err(CollectError::Resume {
                path: path.to_path_buf(),
                reason: format!(
                    "line {}: id {:?} has options {:?}, the record has {:?} (the records changed since?)",
                    answer.line,
                    elide(&answer.id),
                    answer.options,
                    q.options
                ),
            });
        }
        count += 1;
    }
    Ok(count)
}

#[derive(Deserialize)]
struct IncompleteId {
    id: String,
}

fn check_incomplete(
    path: &Path,
    by_id: &HashMap<&str, &Question>,
    first_line: &mut HashMap<String, (PathBuf, u64)>,
) -> Result<usize> {
    let mut reader = BufReader::new(File::open(path).map_err(CollectError::io(path))?);
    let mut buf = Vec::new();
    let mut line = 0u64;
    let mut count = 0;
    loop {
        buf.clear();
        line += 1;
        match read_capped_line(&mut reader, &mut buf, MAX_JSON_LINE_BYTES)
            .map_err(CollectError::io(path))?
        {
            CappedLine::End => return Ok(count),
            CappedLine::TooLong => {
                return Err(CollectError::Resume {
                    path: path.to_path_buf(),
                    reason: format!("line {line}: longer than {MAX_JSON_LINE_BYTES} bytes"),
                });
            }
            CappedLine::Line => {}
        }
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let entry: IncompleteId =
            serde_json::from_slice(&buf).map_err(|e| CollectError::Resume {
                path: path.to_path_buf(),
                reason: format!("line {line}: not an incomplete-answer line: {e}"),
            })?;
        note_id(&entry.id, path, line, by_id, first_line)?;
        count += 1;
    }
}
