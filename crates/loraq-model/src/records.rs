//! Records in (prompt tokens + option tokens), answers out: the JSON Lines formats
//! of docs/model.md and docs/evaluation.md ("The answers format").

use crate::error::{ModelError, Result};
use crate::model::Model;
use loraq_io::limits::{CappedLine, MAX_JSON_LINE_BYTES, MAX_PROMPT_TOKENS, read_capped_line};
use serde::{Deserialize, Serialize};
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

/// One question to score.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Record {
    /// Question id.
    pub id: String,
    /// Benchmark or subset.
    #[serde(default)]
    pub group: Option<String>,
    /// Prompt text (needs a tokenizer, which `loraq run` does not have yet).
    #[serde(default)]
    pub prompt: Option<String>,
    /// Prompt token ids.
    #[serde(default)]
    pub tokens: Option<Vec<u32>>,
    /// Option labels.
    pub options: Vec<String>,
    /// The vocabulary id scored for each option, in the order of `options`.
    #[serde(default)]
    pub option_tokens: Option<Vec<u32>>,
    /// The gold option label, if known.
    #[serde(default)]
    pub gold: Option<String>,
    /// 1-based line of the record in its file (0 when built in memory).
    #[serde(skip)]
    pub line: u64,
}

/// One scored question, as the answers format writes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OptionAnswer {
    /// Question id.
    pub id: String,
    /// Benchmark or subset.
    pub group: Option<String>,
    /// Option labels.
    pub options: Vec<String>,
    /// Logit of each option's token at the last prompt position.
    pub logits: Vec<f64>,
    /// The gold label.
    pub gold: Option<String>,
}

/// Reads a records file (JSON Lines; blank lines skipped).
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    let file_err = |source| ModelError::File {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = BufReader::new(std::fs::File::open(path).map_err(file_err)?);
    let mut records = Vec::new();
    let mut line = Vec::new();
    let mut line_no = 0u64;
    loop {
        line.clear();
        line_no += 1;
        match read_capped_line(&mut reader, &mut line, MAX_JSON_LINE_BYTES).map_err(file_err)? {
            CappedLine::End => break,
            CappedLine::Line => {}
            CappedLine::TooLong => {
                return Err(ModelError::Record {
                    path: path.to_path_buf(),
                    line: line_no,
                    id: String::new(),
                    reason: format!(
                        "line longer than {MAX_JSON_LINE_BYTES} bytes, the limit of a JSON Lines record (docs/formats.md)"
                    ),
                });
            }
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let mut record: Record = serde_json::from_slice(&line).map_err(|e| ModelError::Record {
            path: path.to_path_buf(),
            line: line_no,
            id: String::new(),
            reason: format!("not a record: {e}"),
        })?;
        record.line = line_no;
        records.push(record);
    }
    Ok(records)
}

/// How [`score_records`] reports where it is.
#[derive(Default)]
pub struct ScoreOptions<'a> {
    /// The records file, named in errors.
    pub source: PathBuf,
    /// Called after each batch of records ([`BATCH_TOKENS`]) with the number done so
    /// far.
    pub on_record: Option<&'a (dyn Fn(usize) + Sync)>,
}

/// Checks a record against the model and returns its prompt and option tokens.
fn validate<'r>(
    model: &Model,
    record: &'r Record,
    source: &Path,
) -> Result<(&'r [u32], &'r [u32])> {
    let bad = |reason: String| ModelError::Record {
        path: source.to_path_buf(),
        line: record.line,
        id: record.id.clone(),
        reason,
    };
    let c = &model.config;
    let tokens = match (&record.tokens, &record.prompt) {
        (Some(t), _) => t.as_slice(),
        (None, Some(_)) => {
            return Err(bad(
                "has a text prompt but no tokens; tokenize it first (tokenize_records, which `loraq run` calls)"
                    .into(),
            ));
        }
        (None, None) => return Err(bad("has neither tokens nor prompt".into())),
    };
    if tokens.is_empty() {
        return Err(bad("empty prompt (no tokens)".into()));
    }
    if tokens.len() > MAX_PROMPT_TOKENS {
        return Err(bad(format!(
            "prompt of {} tokens is longer than loraq's limit of {MAX_PROMPT_TOKENS} tokens (docs/formats.md)",
            tokens.len()
        )));
    }
    if tokens.len() > c.max_position_embeddings {
        return Err(bad(format!(
            "prompt of {} tokens is longer than max_position_embeddings {}",
            tokens.len(),
            c.max_position_embeddings
        )));
    }
    if let Some((i, t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, t)| **t as usize >= c.vocab)
    {
        return Err(bad(format!(
            "prompt token {t} at position {i} is outside the vocabulary of {}",
            c.vocab
        )));
    }
    let option_tokens = record
        .option_tokens
        .as_deref()
        .ok_or_else(|| bad("has no option_tokens".into()))?;
    if option_tokens.len() != record.options.len() || option_tokens.is_empty() {
        return Err(bad(format!(
            "{} options but {} option_tokens",
            record.options.len(),
            option_tokens.len()
        )));
    }
    if let Some((o, t)) = record
        .options
        .iter()
        .zip(option_tokens)
        .find(|(_, t)| **t as usize >= c.vocab)
    {
        return Err(bad(format!(
            "option {} has token {t}, outside the vocabulary of {}",
            loraq_io::limits::elide(&format!("{o:?}")),
            c.vocab
        )));
    }
    if let Some(gold) = &record.gold
        && !record.options.contains(gold)
    {
        return Err(bad(format!(
            "gold {} is not one of the options",
            loraq_io::limits::elide(&format!("{gold:?}"))
        )));
    }
    Ok((tokens, option_tokens))
}

/// Last-position hidden states of every record: the output of each decoder layer
/// (before the final norm) and the final-norm output.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HiddenStates {
    /// Hidden size.
    pub hidden: usize,
    /// Per decoder layer, `[records, hidden]` row-major.
    pub layers: Vec<Vec<f32>>,
    /// The final norm's output, `[records, hidden]`.
    pub final_norm: Vec<f32>,
}

/// Scores every record: the logits of its option tokens at the last prompt position.
///
/// All records are validated before the first forward pass, so a bad record fails
/// fast and names its file, line and id.
pub fn score_records(
    model: &Model,
    records: &[Record],
    options: &ScoreOptions<'_>,
) -> Result<Vec<OptionAnswer>> {
    Ok(score(model, records, options, false)?.0)
}

/// [`score_records`], also returning every layer's last-position hidden state.
pub fn score_records_with_hidden(
    model: &Model,
    records: &[Record],
    options: &ScoreOptions<'_>,
) -> Result<(Vec<OptionAnswer>, HiddenStates)> {
    score(model, records, options, true)
}

fn score(
    model: &Model,
    records: &[Record],
    options: &ScoreOptions<'_>,
    collect_hidden: bool,
) -> Result<(Vec<OptionAnswer>, HiddenStates)> {
    let checked = records
        .iter()
        .map(|r| validate(model, r, &options.source))
        .collect::<Result<Vec<_>>>()?;
    let mut answers = Vec::with_capacity(records.len());
    let mut states = HiddenStates {
        hidden: model.config.hidden,
        layers: vec![
            Vec::new();
            if collect_hidden {
                model.config.layer_types.len()
            } else {
                0
            }
        ],
        final_norm: Vec::new(),
    };
    let mut per_layer = Vec::new();
    let mut done = 0;
    for batch in prompt_batches(&checked, BATCH_TOKENS) {
        let prompts: Vec<&[u32]> = checked[batch.clone()].iter().map(|(t, _)| *t).collect();
        let hidden = model.last_hidden_batch(&prompts, collect_hidden.then_some(&mut per_layer))?;
        for (p, (hidden, i)) in hidden.iter().zip(batch).enumerate() {
            let (record, option_tokens) = (&records[i], checked[i].1);
            if collect_hidden {
                for (dst, src) in states.layers.iter_mut().zip(&per_layer[p]) {
                    dst.extend_from_slice(src);
                }
                states
                    .final_norm
                    .extend(
                        hidden
                            .to_vec1::<f32>()
                            .map_err(|source| ModelError::Tensor {
                                context: "final hidden state".into(),
                                source,
                            })?,
                    );
            }
            let logits = model.logits_of(hidden, option_tokens)?;
            // The weights were checked finite when loaded; an overflow in the forward
            // pass can still give NaN, which the answers format cannot hold.
            if let Some((option, logit)) = record
                .options
                .iter()
                .zip(&logits)
                .find(|(_, l)| !l.is_finite())
            {
                return Err(ModelError::Record {
                    path: options.source.clone(),
                    line: record.line,
                    id: record.id.clone(),
                    reason: format!(
                        "the logit of option {} is {logit} (the forward pass overflowed); no answers written",
                        loraq_io::limits::elide(&format!("{option:?}"))
                    ),
                });
            }
            answers.push(OptionAnswer {
                id: record.id.clone(),
                group: record.group.clone(),
                options: record.options.clone(),
                logits: logits.into_iter().map(f64::from).collect(),
                gold: record.gold.clone(),
            });
            done += 1;
        }
        if let Some(f) = options.on_record {
            f(done);
        }
    }
    Ok((answers, states))
}

/// Prompt tokens run together in one [`Model::last_hidden_batch`] call: consecutive
/// records are stacked until the next would pass this many tokens (a longer prompt
/// runs alone), so the linears multiply matrices of a thousand rows or more whatever
/// the prompts' length: enough that packing a weight for the AMX tiles (once per
/// product) costs little beside the product.
pub const BATCH_TOKENS: usize = 2048;

/// Consecutive index ranges of `checked` whose prompts hold at most `budget` tokens
/// together (or one prompt, when it alone is longer).
fn prompt_batches(checked: &[(&[u32], &[u32])], budget: usize) -> Vec<std::ops::Range<usize>> {
    let mut batches = Vec::new();
    let mut start = 0;
    let mut tokens = 0;
    for (i, (prompt, _)) in checked.iter().enumerate() {
        if i > start && tokens + prompt.len() > budget {
            batches.push(start..i);
            start = i;
            tokens = 0;
        }
        tokens += prompt.len();
    }
    if start < checked.len() {
        batches.push(start..checked.len());
    }
    batches
}

/// Writes hidden states as a safetensors file (`layers.{i}` and `norm`, F32
/// `[records, hidden]`), the input of `loraq compare-hidden`; atomically.
pub fn write_hidden(path: &Path, states: &HiddenStates) -> Result<()> {
    let records = states
        .final_norm
        .len()
        .checked_div(states.hidden)
        .unwrap_or(0);
    let mut named: Vec<(String, &[f32])> = states
        .layers
        .iter()
        .enumerate()
        .map(|(i, v)| (format!("layers.{i}"), v.as_slice()))
        .collect();
    named.push(("norm".into(), &states.final_norm));
    let bytes: Vec<Vec<u8>> = named
        .iter()
        .map(|(_, v)| loraq_io::convert::f32_to_le_bytes(v))
        .collect();
    let tensors: Vec<(loraq_io::TensorSpec, &[u8])> = named
        .iter()
        .zip(&bytes)
        .map(|((name, _), b)| {
            (
                loraq_io::TensorSpec::new(
                    name.clone(),
                    loraq_io::DType::F32,
                    vec![records, states.hidden],
                ),
                b.as_slice(),
            )
        })
        .collect();
    loraq_io::write_file_atomically(path, |temp| {
        loraq_io::write_safetensors_file(temp, &tensors, &Default::default())
            .map_err(ModelError::from)
    })
}

/// Writes answers as JSON Lines atomically: a temporary sibling file renamed into
/// place, so a reader never sees a partial file.
pub fn write_answers(path: &Path, answers: &[OptionAnswer]) -> Result<()> {
    loraq_io::write_file_atomically(path, |temp| {
        let write = || -> std::io::Result<()> {
            let mut w = BufWriter::new(std::fs::File::create(temp)?);
            for a in answers {
                serde_json::to_writer(&mut w, a)?;
                w.write_all(b"\n")?;
            }
            w.into_inner().map_err(|e| e.into_error())?.sync_all()
        };
        write().map_err(|source| ModelError::File {
            path: path.to_path_buf(),
            source,
        })
    })
}
