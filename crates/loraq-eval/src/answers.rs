//! The answers format: JSON Lines, one multiple-choice question per line.
//!
//! ```text
//! {"id": str, "group": str?, "options": [str], "logits": [f64], "gold": str|null}
//! ```
//!
//! `probs` may stand instead of `logits`. Rules, each checked with the file name and
//! line number in the error:
//! - `id` is a non-empty string; `options` has at least two distinct strings;
//! - exactly one of `logits` / `probs`, as long as `options`, every entry finite
//!   (`NaN`, `Infinity` and `null` are refused by name);
//! - `probs` are non-negative and sum to 1 within [`PROBS_SUM_TOLERANCE`]; they are
//!   divided by their sum;
//! - `gold`, when present and not null, is one of `options`;
//! - unknown fields are ignored, blank lines are skipped.
//!
//! The reader streams: it holds one line ([`AnswersReader::next_view`], the
//! iterator) or one block of about 4 MiB of whole lines ([`AnswersReader::next_block`],
//! parsed in parallel by [`LineBlock::parse`]) at a time; lines of the plain shape are
//! scanned directly, every other line parsed by serde_json (docs/evaluation.md,
//! "Scale").

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{EvalError, Result};
use crate::plain_line::{ValuesField, scan_plain_line};
use loraq_io::limits::{CappedLine, MAX_JSON_LINE_BYTES, elide, read_capped_line};

/// How far the sum of a `probs` array may be from 1 before the record is refused.
/// Wide enough for float32 writers and values printed with a few decimals.
pub const PROBS_SUM_TOLERANCE: f64 = 1e-3;

/// One validated answer: a question, its options and the model's distribution.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// Question id, unique within a file; the key that pairs two files.
    pub id: String,
    /// Benchmark or subset the question belongs to, if given.
    pub group: Option<String>,
    /// Option labels, in the order of `probs`.
    pub options: Vec<String>,
    /// Probabilities p = softmax(logits) (or the given `probs`, divided by their sum).
    pub probs: Vec<f64>,
    /// Natural logarithms of `probs`, computed as log-softmax from logits so that
    /// near-certain answers keep the precision of their small probabilities
    /// (`-inf` only where a given probability is exactly 0).
    pub log_probs: Vec<f64>,
    /// Index of the gold option in `options`, if the question has one.
    pub gold: Option<usize>,
    /// 1-based line number of the record in its file.
    pub line: u64,
}

/// A JSON string borrowed from the line when it has no escapes, owned otherwise.
struct JsonStr<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for JsonStr<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = JsonStr<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> std::result::Result<Self::Value, E> {
                Ok(JsonStr(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> std::result::Result<Self::Value, E> {
                Ok(JsonStr(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> std::result::Result<Self::Value, E> {
                Ok(JsonStr(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}

/// The JSON shape of one line; every field optional so that a missing one gets a
/// structured error instead of serde's message.
#[derive(Deserialize)]
struct RawAnswer<'a> {
    #[serde(borrow)]
    id: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    group: Option<JsonStr<'a>>,
    #[serde(borrow)]
    options: Option<Vec<JsonStr<'a>>>,
    logits: Option<Vec<Option<f64>>>,
    probs: Option<Vec<Option<f64>>>,
    #[serde(borrow, default)]
    gold: Option<JsonStr<'a>>,
}

/// One validated answer whose strings borrow from the line they were read from
/// where possible; [`AnswerView::into_owned`] gives an [`Answer`].
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerView<'a> {
    /// Question id.
    pub id: Cow<'a, str>,
    /// Group, if given.
    pub group: Option<Cow<'a, str>>,
    /// Option labels.
    pub options: Vec<Cow<'a, str>>,
    /// Probabilities (see [`Answer::probs`]).
    pub probs: Vec<f64>,
    /// Log-probabilities (see [`Answer::log_probs`]).
    pub log_probs: Vec<f64>,
    /// Index of the gold option.
    pub gold: Option<usize>,
    /// 1-based line number.
    pub line: u64,
}

impl AnswerView<'_> {
    /// Copies the strings out of the line.
    pub fn into_owned(self) -> Answer {
        Answer {
            id: self.id.into_owned(),
            group: self.group.map(Cow::into_owned),
            options: self.options.into_iter().map(Cow::into_owned).collect(),
            probs: self.probs,
            log_probs: self.log_probs,
            gold: self.gold,
            line: self.line,
        }
    }
}

/// Streaming reader of an answers file; an iterator of validated [`Answer`]s.
pub struct AnswersReader<R> {
    reader: R,
    path: PathBuf,
    line: u64,
    buf: Vec<u8>,
    /// The unfinished line after the last block ([`AnswersReader::next_block`]).
    carry: Vec<u8>,
    /// An error found while reading ahead, reported after the lines before it.
    pending: Option<EvalError>,
    failed: bool,
    /// The file's length when opened from a path.
    file_len: Option<u64>,
}

impl AnswersReader<BufReader<File>> {
    /// Opens an answers file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|error| EvalError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        let file_len = file.metadata().ok().map(|m| m.len());
        if let Some(len) = file_len {
            advise_will_need(&file, len);
        }
        let mut reader = Self::new(BufReader::with_capacity(1 << 20, file), path);
        reader.file_len = file_len;
        Ok(reader)
    }
}

/// Bytes at the start of a file that [`advise_will_need`] asks the kernel to read ahead:
/// a million questions' file is 126 MB; past this the usual readahead goes on.
const WILL_NEED_BYTES: u64 = 1 << 30;

/// Asks the kernel to start reading the first [`WILL_NEED_BYTES`] of `file` into the
/// page cache now (a hint; Linux only): `pair_files` opens both files before reading
/// the reference, so the candidate's pages missing from the cache are read from disk
/// while the reference is parsed, instead of one read at a time in its turn (the
/// perf inputs, on a machine shared with builds, were found 7% evicted).
fn advise_will_need(file: &File, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let len = len.min(WILL_NEED_BYTES) as libc::off_t;
        // SAFETY: the descriptor is open for the duration of the call (`file` is
        // borrowed); the advice changes what the page cache holds, never the file.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), 0, len, libc::POSIX_FADV_WILLNEED);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, len);
}

impl<R: BufRead> AnswersReader<R> {
    /// Reads answers from `reader`; `path` names the source in error messages.
    pub fn new(reader: R, path: impl Into<PathBuf>) -> Self {
        Self {
            reader,
            path: path.into(),
            line: 0,
            buf: Vec::new(),
            carry: Vec::new(),
            pending: None,
            failed: false,
            file_len: None,
        }
    }

    /// The length in bytes of the file read, when it was opened from a path
    /// ([`AnswersReader::open`]): an estimate of its size for callers that reserve
    /// memory, not a limit.
    pub fn file_len(&self) -> Option<u64> {
        self.file_len
    }

    /// The file name used in error messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next answer, borrowing from the reader's line buffer (no iterator can
    /// lend, hence a method); `None` at the end of the file or after an error.
    pub fn next_view(&mut self) -> Option<Result<AnswerView<'_>>> {
        if self.failed {
            return None;
        }
        loop {
            self.buf.clear();
            match read_capped_line(&mut self.reader, &mut self.buf, MAX_JSON_LINE_BYTES) {
                Ok(CappedLine::End) => return None,
                Ok(CappedLine::Line) => {}
                Ok(CappedLine::TooLong) => {
                    self.failed = true;
                    return Some(Err(line_too_long(&self.path, self.line + 1)));
                }
                Err(error) => {
                    self.failed = true;
                    return Some(Err(EvalError::Io {
                        path: self.path.clone(),
                        error,
                    }));
                }
            }
            self.line += 1;
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let view = parse_line(&self.buf, &self.path, self.line);
            self.failed = view.is_err();
            return Some(view);
        }
    }
}

/// Bytes of a block of whole lines the parallel reader reads at a time: large enough
/// that splitting it among threads costs nothing, small enough to stay in cache.
const BLOCK_BYTES: usize = 4 << 20;

/// Whole lines of an answers file read in one go ([`AnswersReader::next_block`]),
/// parsed in parallel by [`LineBlock::parse`].
#[derive(Debug, Default)]
pub struct LineBlock {
    bytes: Vec<u8>,
    /// 1-based line number of the block's first line.
    first_line: u64,
}

/// Validated answers of a run of lines, column by column: one vector of options and
/// one of probabilities for all of them (no allocation per line), strings borrowed
/// from the block where they have no escapes.
#[derive(Debug, Default)]
pub struct AnswerColumns<'a> {
    /// The answers in file order.
    pub rows: Vec<AnswerRow<'a>>,
    /// Every answer's options, in order; answer `r` has
    /// `options[r.start..r.start + r.width]`.
    pub options: Vec<Cow<'a, str>>,
    /// Probabilities, indexed as `options`.
    pub probs: Vec<f64>,
    /// Log-probabilities, indexed as `options`.
    pub log_probs: Vec<f64>,
    /// Values of the line being read.
    values: Vec<Option<f64>>,
}

/// One answer of [`AnswerColumns`].
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerRow<'a> {
    /// Question id.
    pub id: Cow<'a, str>,
    /// Group, if given.
    pub group: Option<Cow<'a, str>>,
    /// Start of the answer's options, probabilities and log-probabilities.
    pub start: usize,
    /// Number of options.
    pub width: usize,
    /// Index of the gold option.
    pub gold: Option<usize>,
    /// 1-based line number.
    pub line: u64,
}

impl<'a> AnswerColumns<'a> {
    /// Parses and validates one line (with its newline) and appends its answer; the
    /// same answer or error as [`parse_line`].
    pub fn push_line(&mut self, bytes: &'a [u8], path: &Path, line: u64) -> Result<()> {
        let start = self.options.len();
        self.values.clear();
        if let Some(plain) = scan_plain_line(bytes, &mut self.options, &mut self.values) {
            let checked = check_id(plain.id, path, line)
                .and_then(|()| check_options(plain.id, &self.options[start..], path, line))
                .and_then(|()| {
                    check_values_and_gold(
                        plain.id,
                        &self.options[start..],
                        plain.field,
                        &self.values,
                        plain.gold,
                        &[],
                        path,
                        line,
                        &mut self.probs,
                        &mut self.log_probs,
                    )
                });
            match checked {
                Ok(gold) => {
                    self.rows.push(AnswerRow {
                        id: Cow::Borrowed(plain.id),
                        group: plain.group.map(Cow::Borrowed),
                        start,
                        width: self.options.len() - start,
                        gold,
                        line,
                    });
                    return Ok(());
                }
                Err(error) => {
                    self.options.truncate(start);
                    return Err(error);
                }
            }
        }
        self.options.truncate(start);
        let view = parse_line(bytes, path, line)?;
        self.options.extend(view.options);
        self.probs.extend_from_slice(&view.probs);
        self.log_probs.extend_from_slice(&view.log_probs);
        self.rows.push(AnswerRow {
            id: view.id,
            group: view.group,
            start,
            width: self.options.len() - start,
            gold: view.gold,
            line,
        });
        Ok(())
    }

    /// The options of `row`.
    pub fn options_of(&self, row: &AnswerRow<'_>) -> &[Cow<'a, str>] {
        &self.options[row.start..row.start + row.width]
    }

    /// The columns emptied, their memory kept, for the lines of another block
    /// ([`LineBlock::parse_reusing`]): fresh columns for every block of a large file
    /// made the allocator hand back and fault in again about 7 MB per 4 MiB block,
    /// about half the page faults of a million-question comparison.
    pub fn recycle<'b>(self) -> AnswerColumns<'b> {
        let Self {
            rows,
            options,
            mut probs,
            mut log_probs,
            mut values,
        } = self;
        probs.clear();
        log_probs.clear();
        values.clear();
        AnswerColumns {
            rows: reuse_allocation(rows),
            options: reuse_allocation(options),
            probs,
            log_probs,
            values,
        }
    }
}

/// `vec` emptied and retyped to a type of the same layout (here: the same type with
/// another lifetime), keeping its allocation: std collects a mapped `into_iter`
/// of equal size and alignment in place (a test checks that the memory is kept).
fn reuse_allocation<T, U>(mut vec: Vec<T>) -> Vec<U> {
    vec.clear();
    vec.into_iter()
        .map(|_| unreachable!("the vector was cleared"))
        .collect()
}

/// The answers of one piece of a block, up to its first error.
#[derive(Debug)]
pub struct ParsedPiece<'a> {
    /// The answers read.
    pub columns: AnswerColumns<'a>,
    /// The error that stopped the piece (its line comes after every answer read).
    pub error: Option<EvalError>,
}

impl LineBlock {
    /// Bytes of whole lines in the block.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// The block holds no line.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Splits the block into about `pieces` runs of whole lines and parses them in
    /// parallel; every piece stops at its first bad line. Blank lines are skipped,
    /// lines longer than [`MAX_JSON_LINE_BYTES`] refused.
    pub fn parse(&self, path: &Path, pieces: usize) -> Vec<ParsedPiece<'_>> {
        self.parse_reusing(path, pieces, &mut Vec::new())
    }

    /// [`LineBlock::parse`] into columns taken from `spare` (emptied by
    /// [`AnswerColumns::recycle`]) while it has some, so that a file read block by
    /// block reuses the same memory instead of asking the allocator for more at
    /// every block.
    pub fn parse_reusing(
        &self,
        path: &Path,
        pieces: usize,
        spare: &mut Vec<AnswerColumns<'static>>,
    ) -> Vec<ParsedPiece<'_>> {
        use rayon::prelude::*;
        let ranges = self.split(pieces);
        let columns: Vec<AnswerColumns<'_>> = ranges
            .iter()
            .map(|_| {
                spare
                    .pop()
                    .map_or_else(AnswerColumns::default, AnswerColumns::recycle)
            })
            .collect();
        ranges
            .into_par_iter()
            .zip(columns)
            .map(|((start, end, first_line), mut columns)| {
                let error = self.parse_range(start, end, first_line, path, &mut columns);
                ParsedPiece { columns, error }
            })
            .collect()
    }

    /// (start, end, first line number) of about `pieces` runs of whole lines.
    fn split(&self, pieces: usize) -> Vec<(usize, usize, u64)> {
        let len = self.bytes.len();
        let step = len.div_ceil(pieces.max(1)).max(1);
        let mut ranges = Vec::with_capacity(pieces);
        let (mut start, mut line) = (0, self.first_line);
        while start < len {
            let end = match memchr::memchr(b'\n', &self.bytes[(start + step).min(len)..]) {
                Some(i) => (start + step).min(len) + i + 1,
                None => len,
            };
            ranges.push((start, end, line));
            line += count_newlines(&self.bytes[start..end]);
            start = end;
        }
        ranges
    }

    fn parse_range<'a>(
        &'a self,
        start: usize,
        end: usize,
        first_line: u64,
        path: &Path,
        columns: &mut AnswerColumns<'a>,
    ) -> Option<EvalError> {
        let bytes = &self.bytes[start..end];
        let mut line_start = 0;
        for line in first_line.. {
            if line_start == bytes.len() {
                break;
            }
            let line_end = memchr::memchr(b'\n', &bytes[line_start..])
                .map_or(bytes.len(), |i| line_start + i + 1);
            let text = &bytes[line_start..line_end];
            line_start = line_end;
            let content = text.strip_suffix(b"\n").unwrap_or(text);
            if content.len() > MAX_JSON_LINE_BYTES {
                return Some(line_too_long(path, line));
            }
            if !text.iter().all(u8::is_ascii_whitespace)
                && let Err(error) = columns.push_line(text, path, line)
            {
                return Some(error);
            }
        }
        None
    }
}

/// Newlines in `bytes` (SIMD: a byte-by-byte count was a tenth of the instructions of
/// a comparison).
fn count_newlines(bytes: &[u8]) -> u64 {
    memchr::memchr_iter(b'\n', bytes).count() as u64
}

/// The error for a line over [`MAX_JSON_LINE_BYTES`] (a file without newlines,
/// such as /dev/zero, would otherwise be read without end).
fn line_too_long(path: &Path, line: u64) -> EvalError {
    EvalError::Json {
        path: path.to_path_buf(),
        line,
        message: format!(
            "line longer than {MAX_JSON_LINE_BYTES} bytes, the limit of an answers record (docs/formats.md)"
        ),
    }
}

impl<R: BufRead> AnswersReader<R> {
    /// Reads the next whole lines, about 4 MiB of them, into `block`
    /// (replacing what it held); false at the end of the file or after an error.
    /// A line longer than [`MAX_JSON_LINE_BYTES`] is an error once that many bytes
    /// of it were read without a newline.
    pub fn next_block(&mut self, block: &mut LineBlock) -> Result<bool> {
        block.bytes.clear();
        if let Some(error) = self.pending.take() {
            return Err(error);
        }
        if self.failed {
            return Ok(false);
        }
        block.first_line = self.line + 1;
        block.bytes.append(&mut self.carry);
        let mut end_of_file = false;
        loop {
            let available = match self.reader.fill_buf() {
                Ok(available) => available,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    self.failed = true;
                    return Err(EvalError::Io {
                        path: self.path.clone(),
                        error,
                    });
                }
            };
            if available.is_empty() {
                end_of_file = true;
                break;
            }
            let searched = block.bytes.len();
            block.bytes.extend_from_slice(available);
            let taken = available.len();
            self.reader.consume(taken);
            if block.bytes.len() >= BLOCK_BYTES {
                match block.bytes[searched..].iter().rposition(|&b| b == b'\n') {
                    Some(_) => break,
                    None => {
                        // One unfinished line since the last newline.
                        let line_start = block.bytes[..searched]
                            .iter()
                            .rposition(|&b| b == b'\n')
                            .map_or(0, |i| i + 1);
                        if block.bytes.len() - line_start > MAX_JSON_LINE_BYTES {
                            // The lines before it come first, then the error.
                            block.bytes.truncate(line_start);
                            self.line += count_newlines(&block.bytes);
                            self.failed = true;
                            let error = line_too_long(&self.path, self.line + 1);
                            if block.bytes.is_empty() {
                                return Err(error);
                            }
                            self.pending = Some(error);
                            return Ok(true);
                        }
                    }
                }
            }
        }
        if !end_of_file {
            let last = block
                .bytes
                .iter()
                .rposition(|&b| b == b'\n')
                .expect("the loop stops after a newline");
            self.carry.extend_from_slice(&block.bytes[last + 1..]);
            block.bytes.truncate(last + 1);
        }
        self.line += count_newlines(&block.bytes);
        if end_of_file && block.bytes.last().is_some_and(|&b| b != b'\n') {
            self.line += 1;
        }
        Ok(!block.bytes.is_empty())
    }
}

impl<R: BufRead> Iterator for AnswersReader<R> {
    type Item = Result<Answer>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_view()
            .map(|view| view.map(AnswerView::into_owned))
    }
}

/// The rules a question obeys wherever it is read (answers here, records in
/// `loraq run`, so that run refuses what compare would refuse later): a non-empty
/// id, at least two options, no option twice, and a gold label, when given, among
/// the options. Returns the gold's index, or the reason (values elided).
pub fn check_question(
    id: &str,
    options: &[impl AsRef<str>],
    gold: Option<&str>,
) -> std::result::Result<Option<usize>, String> {
    if id.is_empty() {
        return Err("empty id".into());
    }
    if options.len() < 2 {
        return Err(format!(
            "{} option(s); a question needs at least 2",
            options.len()
        ));
    }
    let mut sorted: Vec<&str> = options.iter().map(AsRef::as_ref).collect();
    sorted.sort_unstable();
    if let Some(pair) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!(
            "option {} appears twice",
            elide(&format!("{:?}", pair[0]))
        ));
    }
    match gold {
        None => Ok(None),
        Some(gold) => match options.iter().position(|o| o.as_ref() == gold) {
            Some(index) => Ok(Some(index)),
            None => Err(format!(
                "gold {} is not one of the options",
                elide(&format!("{gold:?}"))
            )),
        },
    }
}

/// Parses and validates one line of an answers file.
pub fn parse_line<'a>(bytes: &'a [u8], path: &Path, line: u64) -> Result<AnswerView<'a>> {
    match serde_json::from_slice::<RawAnswer<'a>>(bytes) {
        Ok(raw) => validate(raw, &[], path, line),
        Err(err) => {
            // Python's json module writes NaN / Infinity, which is not JSON. Read them
            // as null so that validation names the field and position.
            let mut replaced = Vec::new();
            let sanitized = replace_non_finite_tokens(bytes, &mut replaced);
            match serde_json::from_slice::<RawAnswer<'_>>(&sanitized) {
                Ok(raw) if !replaced.is_empty() => {
                    let view = validate(raw, &replaced, path, line)?;
                    // The tokens were outside the fields loraq reads.
                    Ok(AnswerView {
                        id: Cow::Owned(view.id.into_owned()),
                        group: view.group.map(|g| Cow::Owned(g.into_owned())),
                        options: view
                            .options
                            .into_iter()
                            .map(|o| Cow::Owned(o.into_owned()))
                            .collect(),
                        probs: view.probs,
                        log_probs: view.log_probs,
                        gold: view.gold,
                        line: view.line,
                    })
                }
                _ => Err(EvalError::Json {
                    path: path.to_path_buf(),
                    line,
                    message: err.to_string(),
                }),
            }
        }
    }
}

fn validate<'a>(
    raw: RawAnswer<'a>,
    replaced: &[String],
    path: &Path,
    line: u64,
) -> Result<AnswerView<'a>> {
    let missing = |field| EvalError::MissingField {
        path: path.to_path_buf(),
        line,
        field,
    };
    let id = raw.id.ok_or_else(|| missing("id"))?.0;
    check_id(&id, path, line)?;
    let options: Vec<Cow<'a, str>> = raw
        .options
        .ok_or_else(|| missing("options"))?
        .into_iter()
        .map(|o| o.0)
        .collect();
    check_options(&id, &options, path, line)?;
    let (field, values) = match (raw.logits, raw.probs) {
        (Some(logits), None) => (ValuesField::Logits, logits),
        (None, Some(probs)) => (ValuesField::Probs, probs),
        (Some(_), Some(_)) => {
            return Err(invalid_record(
                &id,
                path,
                line,
                "both `logits` and `probs` given".into(),
            ));
        }
        (None, None) => return Err(missing("logits")),
    };
    let mut probs = Vec::with_capacity(values.len());
    let mut log_probs = Vec::with_capacity(values.len());
    let gold = check_values_and_gold(
        &id,
        &options,
        field,
        &values,
        raw.gold.as_ref().map(|g| g.0.as_ref()),
        replaced,
        path,
        line,
        &mut probs,
        &mut log_probs,
    )?;
    Ok(AnswerView {
        id,
        group: raw.group.map(|g| g.0),
        options,
        probs,
        log_probs,
        gold,
        line,
    })
}

fn invalid_record(id: &str, path: &Path, line: u64, reason: String) -> EvalError {
    EvalError::InvalidRecord {
        path: path.to_path_buf(),
        line,
        id: id.to_string(),
        reason,
    }
}

/// The id rule of [`check_question`], before the options are looked at.
fn check_id(id: &str, path: &Path, line: u64) -> Result<()> {
    if id.is_empty() {
        return Err(invalid_record(id, path, line, "empty id".into()));
    }
    Ok(())
}

/// The option rules of [`check_question`]; short lists are checked pair by pair
/// without allocating, and only a failing list goes through `check_question` for
/// its message.
fn check_options(id: &str, options: &[Cow<'_, str>], path: &Path, line: u64) -> Result<()> {
    const PAIRWISE: usize = 16;
    let valid = options.len() >= 2
        && (options.len() > PAIRWISE
            || (1..options.len()).all(|i| !options[..i].contains(&options[i])));
    if valid && options.len() <= PAIRWISE {
        return Ok(());
    }
    check_question(id, options, None)
        .map(drop)
        .map_err(|reason| invalid_record(id, path, line, reason))
}

/// The rules on the values and the gold label (after those on id and options), in
/// the order the errors are reported; appends the probabilities and their logarithms
/// (module docs) and returns the gold's index.
#[allow(clippy::too_many_arguments)]
fn check_values_and_gold(
    id: &str,
    options: &[Cow<'_, str>],
    field: ValuesField,
    values: &[Option<f64>],
    gold: Option<&str>,
    replaced: &[String],
    path: &Path,
    line: u64,
    probs: &mut Vec<f64>,
    log_probs: &mut Vec<f64>,
) -> Result<Option<usize>> {
    let name = field.name();
    if values.len() != options.len() {
        return Err(invalid_record(
            id,
            path,
            line,
            format!(
                "{name} has {} entries but options has {}",
                values.len(),
                options.len()
            ),
        ));
    }
    if let Some(index) = values.iter().position(|v| !v.is_some_and(f64::is_finite)) {
        return Err(EvalError::NonFinite {
            path: path.to_path_buf(),
            line,
            id: id.to_string(),
            field: name,
            index,
            value: replaced.first().cloned().unwrap_or_else(|| "null".into()),
        });
    }
    let finite = values.iter().map(|v| v.expect("checked finite"));
    let (probs_start, log_probs_start) = (probs.len(), log_probs.len());
    match field {
        ValuesField::Logits => {
            log_probs.extend(finite);
            softmax_and_log_in_place(&mut log_probs[log_probs_start..], probs);
        }
        ValuesField::Probs => {
            probs.extend(finite);
            let given = &mut probs[probs_start..];
            if let Some((index, v)) = given.iter().enumerate().find(|(_, v)| **v < 0.0) {
                let reason = format!("probs[{index}] = {v} is negative");
                probs.truncate(probs_start);
                return Err(invalid_record(id, path, line, reason));
            }
            let sum: f64 = given.iter().sum();
            if (sum - 1.0).abs() > PROBS_SUM_TOLERANCE {
                probs.truncate(probs_start);
                return Err(invalid_record(
                    id,
                    path,
                    line,
                    format!("probs sum to {sum}, not 1 (tolerance {PROBS_SUM_TOLERANCE})"),
                ));
            }
            given.iter_mut().for_each(|p| *p /= sum);
            log_probs.extend(given.iter().map(|p| p.ln()));
        }
    }
    match gold {
        None => Ok(None),
        Some(gold) => match options.iter().position(|o| o.as_ref() == gold) {
            Some(index) => Ok(Some(index)),
            None => {
                probs.truncate(probs_start);
                log_probs.truncate(log_probs_start);
                Err(invalid_record(
                    id,
                    path,
                    line,
                    check_question(id, options, Some(gold)).expect_err("gold not found"),
                ))
            }
        },
    }
}

/// p = softmax(l) as exp(l - max) / sum, and log p = (l - max) - ln(sum).
pub fn softmax_and_log(logits: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mut log_probs = logits.to_vec();
    let mut probs = Vec::with_capacity(logits.len());
    softmax_and_log_in_place(&mut log_probs, &mut probs);
    (probs, log_probs)
}

/// [`softmax_and_log`] with the logits given in `log_probs`, which receive log p,
/// and p appended to `probs`.
fn softmax_and_log_in_place(log_probs: &mut [f64], probs: &mut Vec<f64>) {
    let max = log_probs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // log_probs holds l - max and probs exp(l - max) until both are normalized.
    log_probs.iter_mut().for_each(|l| *l -= max);
    let start = probs.len();
    probs.extend(log_probs.iter().map(|s| s.exp()));
    let probs = &mut probs[start..];
    let sum: f64 = probs.iter().sum();
    let log_sum = sum.ln();
    probs.iter_mut().for_each(|e| *e /= sum);
    log_probs.iter_mut().for_each(|s| *s -= log_sum);
}

/// Replaces the bare tokens `NaN`, `Infinity` and `-Infinity` outside strings by
/// `null`, recording each replaced token.
fn replace_non_finite_tokens(bytes: &[u8], replaced: &mut Vec<String>) -> Vec<u8> {
    const TOKENS: [&[u8]; 3] = [b"-Infinity", b"Infinity", b"NaN"];
    let mut out = Vec::with_capacity(bytes.len());
    let mut in_string = false;
    let mut escaped = false;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else if b == b'"' {
            in_string = true;
        } else if let Some(token) = TOKENS.iter().find(|t| bytes[i..].starts_with(t)) {
            out.extend_from_slice(b"null");
            replaced.push(String::from_utf8_lossy(token).into_owned());
            i += token.len();
            continue;
        }
        out.push(b);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Answer> {
        parse_line(s.as_bytes(), Path::new("a.jsonl"), 7).map(AnswerView::into_owned)
    }

    #[test]
    fn logits_become_softmax_and_gold_an_index() {
        let a = parse(r#"{"id":"q","options":["A","B"],"logits":[0.0,0.0],"gold":"B"}"#).unwrap();
        assert_eq!(a.probs, vec![0.5, 0.5]);
        assert_eq!(a.gold, Some(1));
        assert_eq!(a.line, 7);
        assert!((a.log_probs[0] - 0.5f64.ln()).abs() < 1e-15);
    }

    #[test]
    fn nan_written_by_python_is_named() {
        let err = parse(r#"{"id":"q","options":["A","B"],"logits":[0.5, NaN]}"#).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("a.jsonl:7"), "{msg}");
        assert!(msg.contains("logits[1]") && msg.contains("NaN"), "{msg}");
    }

    #[test]
    fn nan_inside_a_string_is_not_a_number() {
        let a = parse(r#"{"id":"NaN","options":["NaN","Infinity"],"logits":[1,2]}"#).unwrap();
        assert_eq!(a.options, vec!["NaN", "Infinity"]);
    }

    /// Columns recycled from one block parse the next exactly as fresh ones do, and
    /// keep their memory.
    #[test]
    fn recycled_columns_parse_as_fresh_ones_and_keep_their_memory() {
        let text = |first: usize, n: usize| -> Vec<u8> {
            (first..first + n)
                .map(|i| {
                    format!(
                        "{{\"id\": \"q{i}\", \"group\": \"g{}\", \"options\": [\"A\", \"B\", \"C\"], \"logits\": [{}.5, 0.25, -1.0], \"gold\": \"B\"}}\n",
                        i % 3,
                        i % 5
                    )
                })
                .collect::<String>()
                .into_bytes()
        };
        let path = Path::new("a.jsonl");
        let mut spare: Vec<AnswerColumns<'static>> = Vec::new();
        for (first, n, pieces) in [(1, 400, 4), (401, 900, 3), (1301, 50, 6)] {
            let block = LineBlock {
                bytes: text(first, n),
                first_line: first as u64,
            };
            let fresh = block.parse(path, pieces);
            let held = spare.len();
            let reused = block.parse_reusing(path, pieces, &mut spare);
            assert_eq!(fresh.len(), reused.len());
            for (fresh, reused) in fresh.iter().zip(&reused) {
                assert!(fresh.error.is_none() && reused.error.is_none());
                assert_eq!(fresh.columns.rows, reused.columns.rows);
                assert_eq!(fresh.columns.options, reused.columns.options);
                assert_eq!(fresh.columns.probs, reused.columns.probs);
                assert_eq!(fresh.columns.log_probs, reused.columns.log_probs);
            }
            let rows: usize = reused.iter().map(|p| p.columns.rows.len()).sum();
            assert_eq!(rows, n);
            // Every spare was taken while there were pieces to parse.
            assert_eq!(spare.len(), held.saturating_sub(reused.len()));
            // Recycling keeps each column's memory.
            let memory = |c: &AnswerColumns<'_>| {
                (
                    (c.rows.as_ptr() as usize, c.rows.capacity()),
                    (c.options.as_ptr() as usize, c.options.capacity()),
                    (c.probs.as_ptr() as usize, c.probs.capacity()),
                )
            };
            let before: Vec<_> = reused.iter().map(|p| memory(&p.columns)).collect();
            spare.extend(reused.into_iter().map(|p| p.columns.recycle()));
            let after: Vec<_> = spare[spare.len() - before.len()..]
                .iter()
                .map(memory)
                .collect();
            assert_eq!(before, after);
            for columns in &spare {
                assert!(columns.rows.is_empty() && columns.options.is_empty());
                assert!(columns.probs.is_empty() && columns.log_probs.is_empty());
                assert!(columns.rows.capacity() > 0 && columns.options.capacity() > 0);
            }
        }
    }

    /// The read-ahead hint leaves what is read unchanged, on an empty file, a file
    /// and a device.
    #[cfg(unix)]
    #[test]
    fn the_read_ahead_hint_changes_nothing_read() {
        use std::io::Read as _;
        let dir = tempfile::tempdir().unwrap();
        let text = r#"{"id":"q","options":["A","B"],"logits":[0.0,1.0]}"#.repeat(1000);
        for (name, contents) in [("empty.jsonl", ""), ("full.jsonl", text.as_str())] {
            let path = dir.path().join(name);
            std::fs::write(&path, contents).unwrap();
            let mut file = File::open(&path).unwrap();
            advise_will_need(&file, contents.len() as u64);
            let mut read = String::new();
            file.read_to_string(&mut read).unwrap();
            assert_eq!(read, contents);
        }
        let null = File::open("/dev/null").unwrap();
        advise_will_need(&null, 0);
        let mut reader = AnswersReader::open("/dev/null").unwrap();
        assert!(reader.next().is_none());
    }

    #[test]
    fn probs_are_normalized_and_checked() {
        let a = parse(r#"{"id":"q","options":["A","B"],"probs":[0.25,0.7505]}"#).unwrap();
        assert!((a.probs[0] + a.probs[1] - 1.0).abs() < 1e-15);
        let err = parse(r#"{"id":"q","options":["A","B"],"probs":[0.2,0.7]}"#).unwrap_err();
        assert!(err.to_string().contains("sum to"), "{err}");
        let err = parse(r#"{"id":"q","options":["A","B"],"probs":[-0.1,1.1]}"#).unwrap_err();
        assert!(err.to_string().contains("negative"), "{err}");
    }
}
