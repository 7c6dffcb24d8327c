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
//! iterator) or one batch of lines ([`AnswersReader::next_batch`], parsed in
//! parallel) at a time.

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{EvalError, Result};
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
    failed: bool,
}

impl AnswersReader<BufReader<File>> {
    /// Opens an answers file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|error| EvalError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        Ok(Self::new(BufReader::with_capacity(1 << 20, file), path))
    }
}

impl<R: BufRead> AnswersReader<R> {
    /// Reads answers from `reader`; `path` names the source in error messages.
    pub fn new(reader: R, path: impl Into<PathBuf>) -> Self {
        Self {
            reader,
            path: path.into(),
            line: 0,
            buf: Vec::new(),
            failed: false,
        }
    }

    /// The file name used in error messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The error for a line over [`MAX_JSON_LINE_BYTES`] (a file without newlines,
    /// such as /dev/zero, would otherwise be read without end).
    fn line_too_long(&self) -> EvalError {
        EvalError::Json {
            path: self.path.clone(),
            line: self.line + 1,
            message: format!(
                "line longer than {MAX_JSON_LINE_BYTES} bytes, the limit of an answers record (docs/formats.md)"
            ),
        }
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
                    return Some(Err(self.line_too_long()));
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

/// Lines read in one go, parsed in parallel by [`LineBatch::parse`].
#[derive(Debug, Default)]
pub struct LineBatch {
    bytes: Vec<u8>,
    /// (start, end, 1-based line number) of each non-blank line.
    lines: Vec<(usize, usize, u64)>,
}

impl LineBatch {
    /// Parses every line (in parallel); the first failing line, in file order, is
    /// the error.
    pub fn parse(&self, path: &Path) -> Result<Vec<AnswerView<'_>>> {
        use rayon::prelude::*;
        let parsed: Vec<Result<AnswerView<'_>>> = self
            .lines
            .par_iter()
            .map(|&(start, end, line)| parse_line(&self.bytes[start..end], path, line))
            .collect();
        parsed.into_iter().collect()
    }

    /// Number of (non-blank) lines.
    pub fn len(&self) -> usize {
        self.lines.len()
    }

    /// No lines.
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }
}

impl<R: BufRead> AnswersReader<R> {
    /// Reads up to `max_lines` non-blank lines into `batch` (cleared first); false at
    /// the end of the file (or after an error).
    pub fn next_batch(&mut self, batch: &mut LineBatch, max_lines: usize) -> Result<bool> {
        batch.bytes.clear();
        batch.lines.clear();
        if self.failed {
            return Ok(false);
        }
        while batch.lines.len() < max_lines {
            let start = batch.bytes.len();
            match read_capped_line(&mut self.reader, &mut batch.bytes, MAX_JSON_LINE_BYTES) {
                Ok(CappedLine::End) => break,
                Ok(CappedLine::Line) => {}
                Ok(CappedLine::TooLong) => {
                    self.failed = true;
                    return Err(self.line_too_long());
                }
                Err(error) => {
                    self.failed = true;
                    return Err(EvalError::Io {
                        path: self.path.clone(),
                        error,
                    });
                }
            }
            self.line += 1;
            if batch.bytes[start..].iter().all(u8::is_ascii_whitespace) {
                batch.bytes.truncate(start);
                continue;
            }
            batch.lines.push((start, batch.bytes.len(), self.line));
        }
        Ok(!batch.lines.is_empty())
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
    let invalid = |reason: String| EvalError::InvalidRecord {
        path: path.to_path_buf(),
        line,
        id: id.to_string(),
        reason,
    };
    if id.is_empty() {
        return Err(invalid("empty id".into()));
    }
    let options: Vec<Cow<'a, str>> = raw
        .options
        .ok_or_else(|| missing("options"))?
        .into_iter()
        .map(|o| o.0)
        .collect();
    check_question(&id, &options, None).map_err(invalid)?;
    let (field, values) = match (raw.logits, raw.probs) {
        (Some(logits), None) => ("logits", logits),
        (None, Some(probs)) => ("probs", probs),
        (Some(_), Some(_)) => return Err(invalid("both `logits` and `probs` given".into())),
        (None, None) => return Err(missing("logits")),
    };
    if values.len() != options.len() {
        return Err(invalid(format!(
            "{field} has {} entries but options has {}",
            values.len(),
            options.len()
        )));
    }
    let mut finite = Vec::with_capacity(values.len());
    for (index, value) in values.iter().enumerate() {
        match value {
            Some(v) if v.is_finite() => finite.push(*v),
            _ => {
                return Err(EvalError::NonFinite {
                    path: path.to_path_buf(),
                    line,
                    id: id.into_owned(),
                    field,
                    index,
                    value: replaced.first().cloned().unwrap_or_else(|| "null".into()),
                });
            }
        }
    }
    let (probs, log_probs) = if field == "logits" {
        softmax_and_log(&finite)
    } else {
        if let Some((index, v)) = finite.iter().enumerate().find(|(_, v)| **v < 0.0) {
            return Err(invalid(format!("probs[{index}] = {v} is negative")));
        }
        let sum: f64 = finite.iter().sum();
        if (sum - 1.0).abs() > PROBS_SUM_TOLERANCE {
            return Err(invalid(format!(
                "probs sum to {sum}, not 1 (tolerance {PROBS_SUM_TOLERANCE})"
            )));
        }
        let probs: Vec<f64> = finite.iter().map(|p| p / sum).collect();
        let log_probs = probs.iter().map(|p| p.ln()).collect();
        (probs, log_probs)
    };
    let gold = match raw.gold {
        None => None,
        Some(JsonStr(gold)) => check_question(&id, &options, Some(&gold)).map_err(invalid)?,
    };
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

/// p = softmax(l) as exp(l - max) / sum, and log p = (l - max) - ln(sum).
pub fn softmax_and_log(logits: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // log_probs holds l - max and probs exp(l - max) until both are normalized.
    let mut log_probs: Vec<f64> = logits.iter().map(|l| l - max).collect();
    let mut probs: Vec<f64> = log_probs.iter().map(|s| s.exp()).collect();
    let sum: f64 = probs.iter().sum();
    let log_sum = sum.ln();
    probs.iter_mut().for_each(|e| *e /= sum);
    log_probs.iter_mut().for_each(|s| *s -= log_sum);
    (probs, log_probs)
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
