//! Text prompts: records that give `prompt` (and option labels) instead of token ids
//! are tokenized with the model directory's `tokenizer.json`, exactly as Hugging Face
//! `tokenizers` does (no special tokens added: the prompt is the text the model sees).

use crate::error::{ModelError, Result};
use crate::records::Record;
use std::path::Path;

/// File name of a Hugging Face tokenizer in a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Fills `tokens` from `prompt`, and `option_tokens` from the option labels, for every
/// record that lacks them. Each option label must be a single token (as `" A"` is in
/// Qwen's vocabulary); records that already carry ids are left as they are, and the
/// tokenizer is only loaded when some record needs it. `source` names the records file
/// in errors.
pub fn tokenize_records(model_dir: &Path, records: &mut [Record], source: &Path) -> Result<()> {
    let needs =
        |r: &Record| (r.tokens.is_none() && r.prompt.is_some()) || r.option_tokens.is_none();
    if !records.iter().any(needs) {
        return Ok(());
    }
    let path = model_dir.join(TOKENIZER_FILE);
    let tokenizer = tokenizers::Tokenizer::from_file(&path).map_err(|e| ModelError::Record {
        path: source.to_path_buf(),
        line: records.iter().find(|r| needs(r)).map_or(0, |r| r.line),
        id: records
            .iter()
            .find(|r| needs(r))
            .map_or(String::new(), |r| r.id.clone()),
        reason: format!("needs {} to tokenize its text: {e}", path.display()),
    })?;
    let encode = |record: &Record, text: &str, what: &str| -> Result<Vec<u32>> {
        tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ModelError::Record {
                path: source.to_path_buf(),
                line: record.line,
                id: record.id.clone(),
                reason: format!("cannot tokenize {what}: {e}"),
            })
    };
    for record in records.iter_mut() {
        if record.tokens.is_none()
            && let Some(prompt) = &record.prompt
        {
            record.tokens = Some(encode(record, prompt, "the prompt")?);
        }
        if record.option_tokens.is_none() {
            let mut ids = Vec::with_capacity(record.options.len());
            for option in &record.options {
                match encode(record, option, "an option")?.as_slice() {
                    [id] => ids.push(*id),
                    other => {
                        return Err(ModelError::Record {
                            path: source.to_path_buf(),
                            line: record.line,
                            id: record.id.clone(),
                            reason: format!(
                                "option {option:?} is {} tokens {other:?}, not one; give option_tokens",
                                other.len()
                            ),
                        });
                    }
                }
            }
            record.option_tokens = Some(ids);
        }
    }
    Ok(())
}
