//! What llama.cpp's `convert_hf_to_gguf.py` writes for a `qwen3` / `qwen35`
//! checkpoint, apart from the tensor bytes: the metadata (general keys, the
//! architecture's hyperparameters, the tokenizer) and the value changes it makes to
//! tensors before writing them. docs/gguf.md ("Quantized GGUF bases") lists every
//! fact with the converter's file and symbol, and what loraq leaves out.
//!
//! The general keys are those a checkpoint directory gives without a model card
//! (`Metadata.load` in `gguf-py/gguf/metadata.py`: `_name_or_path` of config.json,
//! the directory's name, generation_config.json's sampling settings); the
//! hyperparameters those of `TextModel.set_gguf_parameters` (`conversion/base.py`)
//! and, for `qwen35`, `Qwen3NextModel.set_gguf_parameters` and
//! `_Qwen35MRopeMixin` (`conversion/qwen.py`); the tokenizer that of
//! `TextModel._set_vocab_gpt2` and `gguf.SpecialVocab` (`gguf-py/gguf/vocab.py`).

use crate::error::{GgufError, Result};
use crate::names::GgufArch;
use crate::value::{MetadataArray, MetadataValue};
use crate::vhead::{VHeadLayout, gather_columns, gather_rows};
use loraq_io::ModelConfig;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// `gguf.TokenType` (`gguf-py/gguf/constants.py`).
const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;
const TOKEN_UNUSED: i32 = 5;

/// `GGML_QUANT_VERSION` of gguf-py and of llama-quantize.
pub const QUANTIZATION_VERSION: u32 = 2;

/// Metadata pairs in the order the converter adds them.
pub type MetadataList = Vec<(String, MetadataValue)>;

fn convert_error(path: &Path, reason: impl Into<String>) -> GgufError {
    GgufError::Convert {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The general keys the converter writes before the hyperparameters
/// (`Metadata.set_gguf_meta_model`): sampling settings from generation_config.json,
/// `general.name`, `.version`, `.organization`, `.finetune`, `.basename`,
/// `.size_label`. `dir` is the checkpoint directory, `total_params` every element of
/// every tensor written.
pub fn general_metadata(
    arch: GgufArch,
    dir: &Path,
    config: &ModelConfig,
    total_params: u64,
) -> Result<MetadataList> {
    let mut out: MetadataList = vec![
        (
            "general.architecture".into(),
            MetadataValue::String(arch.as_str().into()),
        ),
        ("general.type".into(), MetadataValue::String("model".into())),
    ];
    // Metadata.load: generation_config.json (unreadable or invalid: ignored, as there).
    let generation: Value = std::fs::read_to_string(dir.join("generation_config.json"))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(Value::Null);
    let sampling: [(&str, &[&str], SamplingKind); 12] = [
        ("sequence", &["sequence"], SamplingKind::String),
        ("top_k", &["top_k"], SamplingKind::I32),
        ("top_p", &["top_p"], SamplingKind::F32),
        ("min_p", &["min_p"], SamplingKind::F32),
        ("xtc_probability", &["xtc_probability"], SamplingKind::F32),
        ("xtc_threshold", &["xtc_threshold"], SamplingKind::F32),
        ("temp", &["temperature"], SamplingKind::F32),
        ("penalty_last_n", &["penalty_last_n"], SamplingKind::I32),
        (
            "penalty_repeat",
            &["penalty_repeat", "repetition_penalty"],
            SamplingKind::F32,
        ),
        ("mirostat", &["mirostat"], SamplingKind::I32),
        ("mirostat_tau", &["mirostat_tau"], SamplingKind::F32),
        ("mirostat_eta", &["mirostat_eta"], SamplingKind::F32),
    ];
    for (key, sources, kind) in sampling {
        let Some(value) = sources
            .iter()
            .find_map(|s| generation.get(*s).filter(|v| !v.is_null()))
        else {
            continue;
        };
        let converted = match kind {
            SamplingKind::String => value.as_str().map(|s| MetadataValue::String(s.into())),
            SamplingKind::I32 => value
                .as_i64()
                .and_then(|v| i32::try_from(v).ok())
                .map(MetadataValue::I32),
            SamplingKind::F32 => value.as_f64().map(|v| MetadataValue::F32(v as f32)),
        };
        let value = converted.ok_or_else(|| {
            convert_error(
                &dir.join("generation_config.json"),
                format!("{key}: {value} is not the type GGUF stores"),
            )
        })?;
        out.push((format!("general.sampling.{key}"), value));
    }
    // apply_metadata_heuristic: _name_or_path (a model id, not a path), then the
    // directory's name; each fills what is still missing.
    let mut id = ModelId::default();
    if let Some(name) = config.raw.get("_name_or_path").and_then(Value::as_str)
        && name.matches('/').count() <= 1
    {
        id.fill(&model_id_components(name, total_params));
    }
    let dir_name = std::fs::canonicalize(dir)
        .unwrap_or_else(|_| dir.to_path_buf())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if !dir_name.is_empty() {
        id.fill(&model_id_components(&dir_name, total_params));
    }
    let name = id.name.clone().unwrap_or(dir_name);
    out.push(("general.name".into(), MetadataValue::String(name)));
    for (key, value) in [
        ("general.version", &id.version),
        ("general.organization", &id.organization),
        ("general.finetune", &id.finetune),
        ("general.basename", &id.basename),
    ] {
        if let Some(value) = value {
            out.push((key.into(), MetadataValue::String(value.clone())));
        }
    }
    let size_label = id
        .size_label
        .clone()
        .unwrap_or_else(|| rounded_parameter_count(total_params));
    if total_params > 0 || id.size_label.is_some() {
        out.push((
            "general.size_label".into(),
            MetadataValue::String(size_label),
        ));
    }
    Ok(out)
}

#[derive(Clone, Copy)]
enum SamplingKind {
    String,
    I32,
    F32,
}

/// The parts of a model id (`get_model_id_components`) that end up in metadata.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct ModelId {
    name: Option<String>,
    organization: Option<String>,
    basename: Option<String>,
    finetune: Option<String>,
    version: Option<String>,
    size_label: Option<String>,
}

impl ModelId {
    fn fill(&mut self, other: &ModelId) {
        let pairs = [
            (&mut self.name, &other.name),
            (&mut self.organization, &other.organization),
            (&mut self.basename, &other.basename),
            (&mut self.finetune, &other.finetune),
            (&mut self.version, &other.version),
            (&mut self.size_label, &other.size_label),
        ];
        for (mine, theirs) in pairs {
            if mine.is_none() {
                mine.clone_from(theirs);
            }
        }
    }
}

/// Python's `str.title()` for one word: a letter after a letter is lowered, any other
/// letter raised.
fn python_title(word: &str) -> String {
    let mut out = String::with_capacity(word.len());
    let mut after_letter = false;
    for c in word.chars() {
        if c.is_alphabetic() {
            if after_letter {
                out.extend(c.to_lowercase());
            } else {
                out.extend(c.to_uppercase());
            }
            after_letter = true;
        } else {
            out.push(c);
            after_letter = false;
        }
    }
    out
}

/// Python's `str.islower()`: some cased letter, and none upper case.
fn python_islower(word: &str) -> bool {
    word.chars().any(|c| c.is_lowercase()) && !word.chars().any(|c| c.is_uppercase())
}

/// `Metadata.id_to_title`: words title-cased unless an acronym, a version or a number.
fn id_to_title(id: &str) -> String {
    id.trim()
        .replace('-', " ")
        .split_whitespace()
        .map(|w| {
            let versionish = w.starts_with(|c: char| c.is_ascii_digit()) || is_version_word(w);
            if python_islower(w) && !versionish {
                python_title(w)
            } else {
                w.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `v\d+(\.\d+)*`, whole word.
fn is_version_word(w: &str) -> bool {
    w.strip_prefix('v').is_some_and(is_dotted_number)
}

/// `\d+(\.\d+)*`.
fn is_dotted_number(s: &str) -> bool {
    !s.is_empty()
        && s.split('.')
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

/// `(v|iter)?\d+([.]\d+)*`, case-insensitive.
fn is_version_part(part: &str) -> bool {
    let lower = part.to_ascii_lowercase();
    let rest = lower
        .strip_prefix("iter")
        .or_else(|| lower.strip_prefix('v'))
        .unwrap_or(&lower);
    is_dotted_number(rest) || is_dotted_number(&lower)
}

/// `i?q\d(_\w)*|b?fp?(16|32)`, case-insensitive.
fn is_quant_type_part(part: &str) -> bool {
    let lower = part.to_ascii_lowercase();
    let q = lower.strip_prefix('i').unwrap_or(&lower);
    if let Some(rest) = q.strip_prefix('q') {
        let mut chars = rest.chars();
        if chars.next().is_some_and(|c| c.is_ascii_digit()) {
            let tail: String = chars.collect();
            // (_\w)*: pairs of '_' and one word character
            let bytes = tail.as_bytes();
            if bytes.len().is_multiple_of(2)
                && bytes
                    .chunks(2)
                    .all(|p| p[0] == b'_' && (p[1].is_ascii_alphanumeric() || p[1] == b'_'))
            {
                return true;
            }
        }
    }
    let f = lower.strip_prefix('b').unwrap_or(&lower);
    let f = f.strip_prefix('f').unwrap_or("");
    let f = f.strip_prefix('p').unwrap_or(f);
    f == "16" || f == "32"
}

/// `(([A]|\d+[x])?\d+([._]\d+)?[KMBT][\d]?|small|mini|medium|large|x?xl)`,
/// case-insensitive.
fn is_size_part(part: &str) -> bool {
    let lower = part.to_ascii_lowercase();
    if ["small", "mini", "medium", "large", "xl", "xxl"].contains(&lower.as_str()) {
        return true;
    }
    let b = lower.as_bytes();
    // try the optional prefixes: none, "a", "\d+x"
    let mut starts = vec![0usize];
    if b.first() == Some(&b'a') {
        starts.push(1);
    }
    let digits = b.iter().take_while(|c| c.is_ascii_digit()).count();
    if digits > 0 && b.get(digits) == Some(&b'x') {
        starts.push(digits + 1);
    }
    starts.into_iter().any(|s| size_tail(&b[s..]))
}

/// `\d+([._]\d+)?[kmbt]\d?` on lowercase bytes.
fn size_tail(b: &[u8]) -> bool {
    let mut i = b.iter().take_while(|c| c.is_ascii_digit()).count();
    if i == 0 {
        return false;
    }
    if matches!(b.get(i), Some(b'.' | b'_')) {
        let more = b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        if more > 0 {
            i += 1 + more;
        }
    }
    if !matches!(b.get(i), Some(b'k' | b'm' | b'b' | b't')) {
        return false;
    }
    i += 1;
    if b.get(i).is_some_and(|c| c.is_ascii_digit()) {
        i += 1;
    }
    i == b.len()
}

/// `Metadata.get_model_id_components` (gguf-py/gguf/metadata.py).
fn model_id_components(model_id: &str, total_params: u64) -> ModelId {
    if model_id.contains(' ') {
        return ModelId {
            name: Some(id_to_title(model_id)),
            ..ModelId::default()
        };
    }
    let (org, full) = match model_id.split_once('/') {
        Some((org, full)) => (Some(org), full),
        None => (None, model_id),
    };
    let org = org.filter(|o| !o.starts_with('.'));
    let mut parts: Vec<String> = full
        .split('-')
        .filter(|p| !p.is_empty())
        .map(String::from)
        .collect();
    #[derive(Default, Clone)]
    struct Kinds {
        basename: bool,
        size_label: bool,
        finetune: bool,
        version: bool,
        quant_type: bool,
    }
    impl Kinds {
        fn is_empty(&self) -> bool {
            !(self.basename || self.size_label || self.finetune || self.version || self.quant_type)
        }
        fn count(&self) -> usize {
            [
                self.basename,
                self.size_label,
                self.finetune,
                self.version,
                self.quant_type,
            ]
            .iter()
            .filter(|&&k| k)
            .count()
        }
    }
    let mut kinds = vec![Kinds::default(); parts.len()];
    for i in 0..parts.len() {
        let part = parts[i].clone();
        if is_version_part(&part) {
            kinds[i].version = true;
        } else if is_quant_type_part(&part) {
            kinds[i].quant_type = true;
            parts[i] = part.to_uppercase();
        } else if i > 0 && is_size_part(&part) {
            let mut part = part.replace('_', ".");
            let chars: Vec<char> = part.chars().collect();
            if chars.last().is_some_and(|c| c.is_ascii_digit()) && chars.len() >= 2 {
                // bloom-7b1 -> 7.1B
                let n = chars.len();
                part = format!(
                    "{}.{}{}",
                    chars[..n - 2].iter().collect::<String>(),
                    chars[n - 1],
                    chars[n - 2]
                );
            }
            let chars: Vec<char> = part.chars().collect();
            let n = chars.len();
            if n > 1 && chars[n - 2].is_ascii_digit() && "kmbt".contains(chars[n - 1]) {
                part = format!(
                    "{}{}",
                    chars[..n - 1].iter().collect::<String>(),
                    chars[n - 1].to_ascii_uppercase()
                );
            }
            if total_params != 0 {
                let chars: Vec<char> = part.chars().collect();
                let n = chars.len();
                let scale = " KMBT".find(chars[n - 1]);
                let number: Option<f64> = chars[..n - 1].iter().collect::<String>().parse().ok();
                if let (Some(scale), Some(number)) = (scale, number) {
                    let label = number * 1000f64.powi(scale as i32);
                    let total = total_params as f64;
                    if (label - total).abs() > (7 * total_params / 8) as f64 {
                        kinds[i].finetune = true;
                        part = format!(
                            "{}{}",
                            chars[..n - 1].iter().collect::<String>(),
                            chars[n - 1].to_ascii_lowercase()
                        );
                    }
                }
            }
            if kinds[i].is_empty() {
                kinds[i].size_label = true;
            }
            parts[i] = part;
        } else if i > 0
            && ["chat", "instruct", "vision", "lora"].contains(&part.to_ascii_lowercase().as_str())
        {
            kinds[i].finetune = true;
        }
    }
    // word-based size labels give way to a number-based one
    if parts
        .iter()
        .zip(&kinds)
        .any(|(p, k)| k.size_label && p.chars().any(|c| c.is_ascii_digit()))
    {
        for (p, k) in parts.iter().zip(kinds.iter_mut()) {
            if k.size_label && p.chars().all(char::is_alphabetic) {
                k.size_label = false;
            }
        }
    }
    let mut at_start = true;
    for (p, k) in parts.iter().zip(kinds.iter_mut()) {
        let starts_alpha = p.chars().next().is_some_and(char::is_alphabetic);
        if at_start && ((k.is_empty() && starts_alpha) || k.version) {
            k.basename = true;
        } else {
            at_start = false;
            if k.is_empty() {
                k.finetune = true;
            }
        }
    }
    for k in kinds.iter_mut().rev() {
        if k.basename && k.count() > 1 {
            k.basename = false;
        } else {
            break;
        }
    }
    let join = |pick: &dyn Fn(&Kinds) -> bool| {
        let mut seen: Vec<&str> = Vec::new();
        for (p, k) in parts.iter().zip(&kinds) {
            if pick(k) {
                seen.push(p);
            }
        }
        (!seen.is_empty()).then(|| seen.join("-"))
    };
    let mut basename = join(&|k| k.basename);
    let size_label = {
        let mut labels: Vec<&str> = Vec::new();
        for (p, k) in parts.iter().zip(&kinds) {
            if k.size_label && !labels.contains(&p.as_str()) {
                labels.push(p);
            }
        }
        (!labels.is_empty()).then(|| labels.join("-"))
    };
    let finetune = join(&|k| k.finetune);
    let version = join(&|k| k.version && !k.basename);
    if size_label.is_none() && finetune.is_none() && version.is_none() {
        basename = None;
    }
    ModelId {
        name: Some(id_to_title(full)),
        organization: org.map(id_to_title),
        basename,
        finetune,
        version,
        size_label,
    }
}

/// `model_weight_count_rounded_notation(n, min_digits=2)` (gguf-py/gguf/utility.py):
/// `284K`, `1.5M`, `8.2B`.
pub fn rounded_parameter_count(params: u64) -> String {
    let n = params as f64;
    let (scaled, suffix) = if n > 1e12 {
        (n * 1e-12, "T")
    } else if n > 1e9 {
        (n * 1e-9, "B")
    } else if n > 1e6 {
        (n * 1e-6, "M")
    } else {
        (n * 1e-3, "K")
    };
    let integer_digits = format!("{}", scaled.round_ties_even() as u64);
    let digits = integer_digits.trim_start_matches('0').len();
    let fix = 2usize.saturating_sub(digits);
    format!("{scaled:.fix$}{suffix}")
}

/// The first of `keys` present in `hparams` (`ModelBase.find_hparam`).
fn find_hparam<'a>(hparams: &'a Value, keys: &[&str]) -> Option<&'a Value> {
    keys.iter().find_map(|k| hparams.get(*k))
}

fn as_u32(path: &Path, key: &str, value: &Value) -> Result<MetadataValue> {
    value
        .as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .map(MetadataValue::U32)
        .ok_or_else(|| convert_error(path, format!("{key}: {value} is not a UINT32")))
}

fn as_f32(path: &Path, key: &str, value: &Value) -> Result<MetadataValue> {
    value
        .as_f64()
        .map(|v| MetadataValue::F32(v as f32))
        .ok_or_else(|| convert_error(path, format!("{key}: {value} is not a number")))
}

/// The hyperparameters `set_gguf_parameters` writes for `arch`, in its order, without
/// `general.file_type` (llama-quantize writes it last; the caller adds it).
pub fn hyperparameters(arch: GgufArch, config: &ModelConfig, path: &Path) -> Result<MetadataList> {
    let hp = config.text();
    let a = arch.as_str();
    let mut out: MetadataList = Vec::new();
    let need = |key: &str| {
        hp.get(key)
            .ok_or_else(|| convert_error(path, format!("{key} missing")))
    };
    out.push((
        format!("{a}.block_count"),
        as_u32(path, "num_hidden_layers", need("num_hidden_layers")?)?,
    ));
    let hparam_keys: [(&str, &[&str]); 5] = [
        (
            "context_length",
            &[
                "max_position_embeddings",
                "n_ctx",
                "n_positions",
                "max_length",
                "max_sequence_length",
                "model_max_length",
            ],
        ),
        ("embedding_length", &["hidden_size", "n_embd", "dim"]),
        (
            "feed_forward_length",
            &[
                "prefix_dense_intermediate_size",
                "dense_intermediate_size",
                "intermediate_size",
                "n_inner",
                "hidden_dim",
            ],
        ),
        (
            "attention.head_count",
            &["num_attention_heads", "n_head", "n_heads"],
        ),
        (
            "attention.head_count_kv",
            &["num_key_value_heads", "n_kv_heads"],
        ),
    ];
    for (key, sources) in hparam_keys {
        if let Some(value) = find_hparam(hp, sources).filter(|v| !v.is_null()) {
            out.push((format!("{a}.{key}"), as_u32(path, key, value)?));
        }
    }
    if hp.get("is_causal") == Some(&Value::Bool(false)) {
        out.push((format!("{a}.attention.causal"), MetadataValue::Bool(false)));
    }
    let rope = rope_parameters(hp);
    let rope_params = rope.get("full_attention").unwrap_or(&rope);
    if let Some(rope_type) = rope_params.get("rope_type").and_then(Value::as_str) {
        let factor = rope_params.get("factor").filter(|v| !v.is_null());
        let scaling = |kind: &str| {
            (
                format!("{a}.rope.scaling.type"),
                MetadataValue::String(kind.into()),
            )
        };
        match (rope_type, factor) {
            ("linear", Some(factor)) => {
                out.push(scaling("linear"));
                out.push((
                    format!("{a}.rope.scaling.factor"),
                    as_f32(path, "factor", factor)?,
                ));
            }
            ("yarn", Some(factor)) => {
                out.push(scaling("yarn"));
                out.push((
                    format!("{a}.rope.scaling.factor"),
                    as_f32(path, "factor", factor)?,
                ));
                let original = rope_params
                    .get("original_max_position_embeddings")
                    .ok_or_else(|| {
                        convert_error(path, "yarn rope without original_max_position_embeddings")
                    })?;
                out.push((
                    format!("{a}.rope.scaling.original_context_length"),
                    as_u32(path, "original_max_position_embeddings", original)?,
                ));
                let optional: [(&str, &[&str]); 4] = [
                    ("yarn_ext_factor", &["extrapolation_factor"]),
                    ("yarn_attn_factor", &["attention_factor", "attn_factor"]),
                    ("yarn_beta_fast", &["beta_fast"]),
                    ("yarn_beta_slow", &["beta_slow"]),
                ];
                for (key, sources) in optional {
                    if let Some(v) = find_hparam(rope_params, sources).filter(|v| !v.is_null()) {
                        out.push((format!("{a}.rope.scaling.{key}"), as_f32(path, key, v)?));
                    }
                }
            }
            ("su" | "longrope", _) => out.push(scaling("longrope")),
            _ => {}
        }
    }
    if let Some(sections) = rope.get("mrope_section") {
        let mut sections: Vec<i32> = sections
            .as_array()
            .and_then(|s| {
                s.iter()
                    .map(|v| v.as_i64().and_then(|v| i32::try_from(v).ok()))
                    .collect::<Option<Vec<i32>>>()
            })
            .ok_or_else(|| convert_error(path, "mrope_section is not a list of integers"))?;
        while sections.len() < 4 {
            sections.push(0);
        }
        sections.truncate(4);
        out.push((
            format!("{a}.rope.dimension_sections"),
            MetadataValue::Array(MetadataArray::I32(sections)),
        ));
    }
    if let Some(theta) = rope_params.get("rope_theta").filter(|v| !v.is_null()) {
        out.push((
            format!("{a}.rope.freq_base"),
            as_f32(path, "rope_theta", theta)?,
        ));
    }
    if let Some(theta) = rope
        .get("sliding_attention")
        .and_then(|s| s.get("rope_theta"))
    {
        out.push((
            format!("{a}.rope.freq_base_swa"),
            as_f32(path, "rope_theta", theta)?,
        ));
    }
    if let Some(eps) = find_hparam(hp, &["rms_norm_eps", "norm_eps"]).filter(|v| !v.is_null()) {
        out.push((
            format!("{a}.attention.layer_norm_rms_epsilon"),
            as_f32(path, "rms_norm_eps", eps)?,
        ));
    }
    if let Some(eps) = find_hparam(
        hp,
        &["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"],
    )
    .filter(|v| !v.is_null())
    {
        out.push((
            format!("{a}.attention.layer_norm_epsilon"),
            as_f32(path, "layer_norm_eps", eps)?,
        ));
    }
    if find_hparam(
        hp,
        &["num_local_experts", "num_experts", "n_routed_experts"],
    )
    .is_some_and(|v| !v.is_null())
    {
        return Err(convert_error(
            path,
            "a mixture-of-experts model: loraq converts the dense qwen3 and qwen35 only",
        ));
    }
    if let Some(head_dim) = hp.get("head_dim").filter(|v| !v.is_null()) {
        out.push((
            format!("{a}.attention.key_length"),
            as_u32(path, "head_dim", head_dim)?,
        ));
        out.push((
            format!("{a}.attention.value_length"),
            as_u32(path, "head_dim", head_dim)?,
        ));
    }
    if arch == GgufArch::Qwen35 {
        let linear: [(&str, &str); 4] = [
            ("ssm.conv_kernel", "linear_conv_kernel_dim"),
            ("ssm.state_size", "linear_key_head_dim"),
            ("ssm.group_count", "linear_num_key_heads"),
            ("ssm.time_step_rank", "linear_num_value_heads"),
        ];
        for (key, source) in linear {
            out.push((format!("{a}.{key}"), as_u32(path, source, need(source)?)?));
        }
        let inner = need("linear_value_head_dim")?
            .as_u64()
            .zip(need("linear_num_value_heads")?.as_u64())
            .and_then(|(d, n)| d.checked_mul(n))
            .ok_or_else(|| convert_error(path, "linear value heads x head dim"))?;
        out.push((
            format!("{a}.ssm.inner_size"),
            as_u32(path, "linear value heads x head dim", &Value::from(inner))?,
        ));
        if let Some(types) = hp.get("layer_types").and_then(Value::as_array) {
            let recurrent: Vec<bool> = types
                .iter()
                .map(|t| t.as_str() == Some("linear_attention"))
                .collect();
            out.push((
                format!("{a}.attention.recurrent_layers"),
                MetadataValue::Array(MetadataArray::Bool(recurrent)),
            ));
        }
        let interval = hp
            .get("full_attention_interval")
            .cloned()
            .unwrap_or(Value::from(4));
        out.push((
            format!("{a}.full_attention_interval"),
            as_u32(path, "full_attention_interval", &interval)?,
        ));
        let head_dim = match hp.get("head_dim").and_then(Value::as_u64) {
            Some(d) => d,
            None => {
                need("hidden_size")?.as_u64().unwrap_or(0)
                    / need("num_attention_heads")?
                        .as_u64()
                        .filter(|&n| n > 0)
                        .unwrap_or(1)
            }
        };
        let partial = rope
            .get("partial_rotary_factor")
            .and_then(Value::as_f64)
            .unwrap_or(0.25);
        // int(rope_dim * partial_rotary_factor): truncation toward zero
        let rope_dim = (head_dim as f64 * partial) as u64;
        out.push((
            format!("{a}.rope.dimension_count"),
            as_u32(path, "rope dimensions", &Value::from(rope_dim))?,
        ));
        if rope.get("mrope_section").is_none() {
            out.push((
                format!("{a}.rope.dimension_sections"),
                MetadataValue::Array(MetadataArray::I32(vec![11, 11, 10, 0])),
            ));
        }
    }
    Ok(out)
}

/// `ModelBase.rope_parameters`: `rope_parameters`, else `rope_scaling`, with the
/// top-level `rope_theta`, `partial_rotary_factor` and
/// `original_max_position_embeddings` mirrored in.
fn rope_parameters(hp: &Value) -> Value {
    let mut rope = hp
        .get("rope_parameters")
        .or_else(|| hp.get("rope_scaling"))
        .filter(|v| v.is_object())
        .cloned()
        .unwrap_or_else(|| Value::Object(Default::default()));
    let map = rope.as_object_mut().expect("an object");
    if !map.contains_key("full_attention") && !map.contains_key("sliding_attention") {
        if !map.contains_key("rope_theta")
            && let Some(theta) = hp.get("rope_theta").filter(|v| !v.is_null())
        {
            map.insert("rope_theta".into(), theta.clone());
        }
        if !map.contains_key("rope_type")
            && let Some(kind) = map.get("type").cloned()
        {
            map.insert("rope_type".into(), kind);
        }
        for key in ["partial_rotary_factor", "original_max_position_embeddings"] {
            if !map.contains_key(key)
                && let Some(v) = hp.get(key).filter(|v| !v.is_null())
            {
                map.insert(key.into(), v.clone());
            }
        }
    }
    rope
}

/// The tokenizer metadata the converter embeds from `dir/tokenizer.json` (and
/// tokenizer_config.json, config.json, chat_template.jinja / .json), as
/// `_set_vocab_gpt2` does for qwen3 (when there is no `tokenizer.model`) and qwen35
/// (any tokenizer whose model has a token -> id vocabulary; without merges, as a
/// WordLevel one, llama.cpp will not load the file, as it will not load the
/// converter's):
/// model `gpt2`, the pre-tokenizer, the token list padded to `vocab_size` with
/// `[PAD{i}]`, token types, merges, special token ids, add_bos / add_eos, the chat
/// template. A missing tokenizer.json is refused, as the converter refuses it.
pub fn tokenizer_metadata(
    arch: GgufArch,
    dir: &Path,
    config: &ModelConfig,
) -> Result<MetadataList> {
    let tokenizer_path = dir.join("tokenizer.json");
    let text = std::fs::read_to_string(&tokenizer_path).map_err(|e| {
        convert_error(
            &tokenizer_path,
            format!("cannot read the tokenizer ({e}); llama.cpp's converter needs it too"),
        )
    })?;
    let tokenizer: Value = serde_json::from_str(&text)
        .map_err(|e| convert_error(&tokenizer_path, format!("not JSON: {e}")))?;
    let bad = |reason: String| convert_error(&tokenizer_path, reason);
    let model = tokenizer
        .get("model")
        .ok_or_else(|| bad("no \"model\"".into()))?;
    if arch == GgufArch::Qwen3 && dir.join("tokenizer.model").exists() {
        return Err(bad(
            "a SentencePiece tokenizer.model beside it: the converter would embed that one (llama), which loraq does not"
                .into(),
        ));
    }
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            bad("model.vocab is not a token -> id object (the converter's gpt2 vocabulary reads one)".into())
        })?;
    let mut by_id: std::collections::BTreeMap<u64, String> = std::collections::BTreeMap::new();
    for (token, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("token {token:?} has id {id}")))?;
        by_id.insert(id, token.clone());
    }
    struct Added {
        content: String,
        special: bool,
    }
    let added_tokens = tokenizer
        .get("added_tokens")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut added: std::collections::BTreeMap<u64, Added> = std::collections::BTreeMap::new();
    for entry in &added_tokens {
        let (Some(id), Some(content)) = (
            entry.get("id").and_then(Value::as_u64),
            entry.get("content").and_then(Value::as_str),
        ) else {
            return Err(bad(format!("added token {entry} without id and content")));
        };
        by_id.insert(id, content.to_string());
        added.insert(
            id,
            Added {
                content: content.to_string(),
                special: entry
                    .get("special")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            },
        );
    }
    let added_contents: std::collections::HashSet<&str> =
        added.values().map(|a| a.content.as_str()).collect();
    let vocab_size = match config.text().get("vocab_size").and_then(Value::as_u64) {
        Some(v) => v,
        None => by_id.len() as u64,
    };
    if let Some((&max, _)) = by_id.last_key_value()
        && max >= vocab_size
    {
        return Err(bad(format!(
            "token id {max} is not below vocab_size {vocab_size} (config.json)"
        )));
    }
    let mut tokens = Vec::with_capacity(vocab_size as usize);
    let mut types = Vec::with_capacity(vocab_size as usize);
    for i in 0..vocab_size {
        match by_id.get(&i) {
            None => {
                tokens.push(format!("[PAD{i}]"));
                types.push(TOKEN_UNUSED);
            }
            Some(token) if added_contents.contains(token.as_str()) => {
                let special = added.get(&i).is_some_and(|a| a.special);
                if special || looks_special(token) {
                    tokens.push(token.clone());
                    types.push(TOKEN_CONTROL);
                } else {
                    tokens.push(token.replace('\u{2581}', " "));
                    types.push(TOKEN_USER_DEFINED);
                }
            }
            Some(token) => {
                tokens.push(token.clone());
                types.push(TOKEN_NORMAL);
            }
        }
    }
    let mut out: MetadataList = vec![
        (
            "tokenizer.ggml.model".into(),
            MetadataValue::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".into(),
            MetadataValue::String(pre_tokenizer(arch).into()),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            MetadataValue::Array(MetadataArray::String(tokens)),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            MetadataValue::Array(MetadataArray::I32(types)),
        ),
    ];
    let merges = merges(model.get("merges"), &tokenizer_path)?;
    if !merges.is_empty() {
        out.push((
            "tokenizer.ggml.merges".into(),
            MetadataValue::Array(MetadataArray::String(merges)),
        ));
    }
    out.extend(special_vocab(dir, &tokenizer, &added_tokens, vocab_size)?);
    Ok(out)
}

/// The pre-tokenizer name loraq writes: the one llama.cpp's converter gives the
/// architecture's published tokenizers (Qwen3's hash is `qwen2`, Qwen3.5's
/// `qwen35` in `get_vocab_base_pre`). loraq does not hash the tokenizer's output as
/// the converter does (docs/gguf.md).
pub fn pre_tokenizer(arch: GgufArch) -> &'static str {
    match arch {
        GgufArch::Qwen3 => "qwen2",
        GgufArch::Qwen35 => "qwen35",
    }
}

/// `TextModel.does_token_look_special`.
fn looks_special(token: &str) -> bool {
    ["<pad>", "<mask>", "<2mass>", "[@BOS@]"].contains(&token)
        || (token.starts_with("<|") && token.ends_with("|>"))
        || (token.starts_with("<\u{ff5c}") && token.ends_with("\u{ff5c}>"))
        || (token.starts_with("<unused") && token.ends_with('>'))
}

/// `SpecialVocab._try_load_from_tokenizer_json`'s merges: strings as they are, pairs
/// joined by a space with spaces inside a part written as U+0120.
fn merges(merges: Option<&Value>, path: &Path) -> Result<Vec<String>> {
    let Some(list) = merges.and_then(Value::as_array).filter(|l| !l.is_empty()) else {
        return Ok(Vec::new());
    };
    let bad = || convert_error(path, "unknown tokenizer merges format");
    if list[0].is_string() {
        return list
            .iter()
            .map(|m| m.as_str().map(String::from).ok_or_else(bad))
            .collect();
    }
    list.iter()
        .map(|pair| {
            let pair = pair.as_array().filter(|p| p.len() == 2).ok_or_else(bad)?;
            let part = |v: &Value| {
                v.as_str()
                    .map(|s| s.replace(' ', "\u{0120}"))
                    .ok_or_else(bad)
            };
            Ok(format!("{} {}", part(&pair[0])?, part(&pair[1])?))
        })
        .collect()
}

/// `gguf.SpecialVocab(dir, load_merges=True).add_to_gguf` without the merges: special
/// token ids (tokenizer_config.json's `*_token` found among the added tokens, then
/// config.json's `*_token_id`), add_bos / add_eos (the post-processor, then
/// tokenizer_config.json), the chat template, the normalizer flags.
fn special_vocab(
    dir: &Path,
    tokenizer: &Value,
    added_tokens: &[Value],
    vocab_size: u64,
) -> Result<MetadataList> {
    let config_path = dir.join("tokenizer_config.json");
    let tokenizer_config: Option<Value> = match std::fs::read_to_string(&config_path) {
        Ok(text) => Some(
            serde_json::from_str(&text)
                .map_err(|e| convert_error(&config_path, format!("not JSON: {e}")))?,
        ),
        Err(_) => None,
    };
    // ('bos', 'eos', 'unk', 'sep', 'pad', 'cls', 'mask'); cls has no GGUF key (the
    // writer has no add_cls_token_id) and is skipped there.
    const TYPES: [(&str, Option<&str>); 7] = [
        ("bos", Some("tokenizer.ggml.bos_token_id")),
        ("eos", Some("tokenizer.ggml.eos_token_id")),
        ("unk", Some("tokenizer.ggml.unknown_token_id")),
        ("sep", Some("tokenizer.ggml.seperator_token_id")),
        ("pad", Some("tokenizer.ggml.padding_token_id")),
        ("cls", None),
        ("mask", Some("tokenizer.ggml.mask_token_id")),
    ];
    let mut ids: Vec<(&'static str, u64)> = Vec::new();
    let set_id =
        |ids: &mut Vec<(&'static str, u64)>, typ: &'static str, id: Option<i64>| -> Result<()> {
            let Some(id) = id else { return Ok(()) };
            if id < 0 {
                return Err(convert_error(
                    dir,
                    format!("invalid value for special token type {typ}: {id}"),
                ));
            }
            if (id as u64) < vocab_size && !ids.iter().any(|(t, _)| *t == typ) {
                ids.push((typ, id as u64));
            }
            Ok(())
        };
    let mut add_special: Vec<(&str, bool)> = Vec::new();
    let mut chat_template: Option<MetadataValue> = None;
    let mut lowercase: Option<bool> = None;
    let mut strip_accents: Option<bool> = None;
    if let Some(normalizer) = tokenizer.get("normalizer").filter(|n| !n.is_null()) {
        parse_normalizer(normalizer, &mut lowercase, &mut strip_accents);
    }
    if let Some(post) = tokenizer.get("post_processor").filter(|p| !p.is_null()) {
        let processors = post
            .get("processors")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_else(|| vec![post.clone()]);
        for processor in processors {
            match processor.get("type").and_then(Value::as_str) {
                Some("ByteLevel") => {
                    for typ in ["bos", "eos"] {
                        if !add_special.iter().any(|(t, _)| *t == typ) {
                            add_special.push((typ, false));
                        }
                    }
                }
                Some(other @ ("RobertaProcessing" | "TemplateProcessing")) => {
                    return Err(convert_error(
                        &dir.join("tokenizer.json"),
                        format!(
                            "post_processor {other}: loraq embeds the byte-level tokenizers of qwen3 / qwen35, whose post-processor is ByteLevel or none"
                        ),
                    ));
                }
                _ => {}
            }
        }
    }
    if let Some(tc) = &tokenizer_config {
        let chat_alt = chat_template_alternative(dir)?;
        match tc.get("chat_template").cloned().or(chat_alt) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => chat_template = Some(MetadataValue::String(s)),
            Some(Value::Array(list)) => {
                // a list of named templates: the default one is tokenizer.chat_template,
                // the others tokenizer.chat_template.NAME (GGUFWriter.add_chat_template)
                return Err(convert_error(
                    &config_path,
                    format!(
                        "{} named chat templates: loraq embeds a single template",
                        list.len()
                    ),
                ));
            }
            Some(_) => {}
        }
        for (typ, _) in TYPES {
            if let Some(Value::Bool(add)) = tc.get(format!("add_{typ}_token"))
                && !add_special.iter().any(|(t, _)| *t == typ)
            {
                add_special.push((typ, *add));
            }
            let content = match tc.get(format!("{typ}_token")) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Object(o)) => match o.get("content").and_then(Value::as_str) {
                    Some(s) => s.to_string(),
                    None => continue,
                },
                _ => continue,
            };
            let id = added_tokens
                .iter()
                .find(|a| a.get("content").and_then(Value::as_str) == Some(content.as_str()))
                .and_then(|a| a.get("id"))
                .and_then(Value::as_i64);
            set_id(&mut ids, typ, id)?;
        }
    }
    // _try_load_from_config_json
    let config_json = dir.join(loraq_io::CONFIG_FILE);
    if let Ok(text) = std::fs::read_to_string(&config_json)
        && let Ok(config) = serde_json::from_str::<Value>(&text)
    {
        for (typ, _) in TYPES {
            let key = format!("{typ}_token_id");
            let id = config
                .get(&key)
                .filter(|v| !v.is_null())
                .or_else(|| config.get("text_config").and_then(|t| t.get(&key)));
            set_id(&mut ids, typ, id.and_then(Value::as_i64))?;
        }
    }
    let mut out: MetadataList = Vec::new();
    for (typ, id) in ids {
        let key = TYPES.iter().find(|(t, _)| *t == typ).and_then(|(_, k)| *k);
        if let Some(key) = key {
            let id = u32::try_from(id)
                .map_err(|_| convert_error(dir, format!("{typ} token id {id} is not a UINT32")))?;
            out.push((key.into(), MetadataValue::U32(id)));
        }
    }
    for (typ, add) in add_special {
        let key = match typ {
            "bos" => "tokenizer.ggml.add_bos_token",
            "eos" => "tokenizer.ggml.add_eos_token",
            "sep" => "tokenizer.ggml.add_sep_token",
            _ => continue,
        };
        out.push((key.into(), MetadataValue::Bool(add)));
    }
    if let Some(template) = chat_template {
        out.push(("tokenizer.chat_template".into(), template));
    }
    if let Some(lower) = lowercase {
        out.push((
            "tokenizer.ggml.normalizer.lowercase".into(),
            MetadataValue::Bool(lower),
        ));
    }
    if let Some(strip) = strip_accents {
        out.push((
            "tokenizer.ggml.normalizer.strip_accents".into(),
            MetadataValue::Bool(strip),
        ));
    }
    Ok(out)
}

/// chat_template.jinja, else chat_template.json's `chat_template`.
fn chat_template_alternative(dir: &Path) -> Result<Option<Value>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        if dir.join("additional_chat_templates").is_dir() {
            return Err(convert_error(
                &jinja,
                "additional_chat_templates: loraq embeds a single template",
            ));
        }
        let text =
            std::fs::read_to_string(&jinja).map_err(|e| convert_error(&jinja, e.to_string()))?;
        return Ok(Some(Value::String(text)));
    }
    let json = dir.join("chat_template.json");
    if json.is_file() {
        let text =
            std::fs::read_to_string(&json).map_err(|e| convert_error(&json, e.to_string()))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| convert_error(&json, format!("not JSON: {e}")))?;
        return Ok(value.get("chat_template").cloned());
    }
    Ok(None)
}

/// `SpecialVocab._parse_normalizer`.
fn parse_normalizer(normalizer: &Value, lowercase: &mut Option<bool>, strip: &mut Option<bool>) {
    match normalizer.get("type").and_then(Value::as_str) {
        Some("Lowercase") => *lowercase = Some(true),
        Some("StripAccents") => *strip = Some(true),
        Some("BertNormalizer") => {
            if let Some(v) = normalizer.get("lowercase").and_then(Value::as_bool) {
                *lowercase = Some(v);
            }
            if let Some(v) = normalizer.get("strip_accents").and_then(Value::as_bool) {
                *strip = Some(v);
            }
        }
        Some("Sequence") => {
            for n in normalizer
                .get("normalizers")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                parse_normalizer(n, lowercase, strip);
            }
        }
        _ => {}
    }
}

/// A checkpoint tensor as the converter writes it: its GGUF name and shape
/// (outermost first) and its values changed as `Qwen3NextModel.modify_tensors` and
/// `_LinearAttentionVReorderBase.modify_tensors` change them for `qwen35` (in f32,
/// after widening): `A_log -> -exp(A_log)`, `+ 1` on every norm but
/// `linear_attn.norm`, `conv1d` squeezed, the value heads reordered.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvertedTensor {
    /// GGUF name.
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub values: Vec<f32>,
}

/// Which checkpoint tensors the converter leaves out of a text model: the MTP block
/// (`mtp.*`, loraq converts as `--no-mtp` does) and a multimodal checkpoint's vision
/// tower (it goes to the mmproj file).
pub fn is_left_out(checkpoint_name: &str) -> bool {
    checkpoint_name.starts_with("mtp.")
        || checkpoint_name.starts_with("model.mtp.")
        || checkpoint_name.starts_with("model.visual.")
        || checkpoint_name.starts_with("visual.")
}

/// The GGUF name and shape of checkpoint tensor `name` of shape `shape` (after the
/// converter's squeeze of `conv1d`), or an error naming `path` when the architecture
/// has no such tensor.
pub fn converted_name_and_shape(
    arch: GgufArch,
    path: &Path,
    name: &str,
    shape: &[usize],
) -> Result<(String, Vec<usize>)> {
    let gguf_name =
        crate::names::gguf_tensor_name(arch, name).ok_or_else(|| GgufError::Tensor {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            reason: format!(
                "llama.cpp's {arch} has no tensor for it (the converter refuses it too)"
            ),
        })?;
    let shape = if gguf_name.ends_with("ssm_conv1d.weight") {
        // torch's squeeze(): every dimension of 1 goes
        shape.iter().copied().filter(|&d| d != 1).collect()
    } else {
        shape.to_vec()
    };
    Ok((gguf_name, shape))
}

/// Applies the converter's value changes to checkpoint tensor `name` (`values` its
/// f32 values in the checkpoint's order, `shape` its converted shape from
/// [`converted_name_and_shape`]). `f16_source`: the checkpoint stores the tensor in
/// f16, which the converter keeps (it widens only the other types to f32), so its
/// arithmetic rounds to f16 after each operation as torch's does.
pub fn convert_values(
    arch: GgufArch,
    layout: Option<&VHeadLayout>,
    name: &str,
    shape: &[usize],
    values: &mut [f32],
    f16_source: bool,
) {
    if arch != GgufArch::Qwen35 {
        return;
    }
    let round = |v: f32| {
        if f16_source {
            half::f16::from_f32(v).to_f32()
        } else {
            v
        }
    };
    if name.ends_with(".A_log") {
        // exp in f64 rounded once: the correctly rounded f32 (torch's f32 exp, MKL's
        // vsExp where torch has MKL, is within one unit in the last place of it and
        // depends on the CPU; docs/gguf.md).
        for v in values.iter_mut() {
            *v = -round(f64::from(*v).exp() as f32);
        }
    } else if name.ends_with("norm.weight") && !name.ends_with("linear_attn.norm.weight") {
        for v in values.iter_mut() {
            *v = round(*v + 1.0);
        }
    }
    let Some(layout) = layout.filter(|l| l.reorders()) else {
        return;
    };
    if !name.contains("linear_attn.") {
        return;
    }
    let row_len = if shape.len() >= 2 {
        shape[1..].iter().product()
    } else {
        1
    };
    let qk = 2 * layout.num_k_heads * layout.head_k_dim;
    let v_dim = layout.head_v_dim;
    if name.contains(".in_proj_qkv.") || name.contains(".conv1d") {
        let gather = layout.permutation(v_dim);
        gather_rows(values, row_len, qk, &gather);
    } else if name.contains(".in_proj_z.") {
        gather_rows(values, row_len, 0, &layout.permutation(v_dim));
    } else if name.contains(".in_proj_a.") || name.contains(".in_proj_b.") {
        gather_rows(values, row_len, 0, &layout.permutation(1));
    } else if name.ends_with(".A_log") || name.ends_with(".dt_bias") {
        gather_rows(values, 1, 0, &layout.permutation(1));
    } else if name.contains(".out_proj.") {
        let row_len = shape.last().copied().unwrap_or(1);
        gather_columns(values, row_len, &layout.permutation(v_dim));
    }
}

/// The value-head layout of a Qwen3.5 config (`None` for qwen3 or without linear
/// attention).
pub fn v_head_layout(config: &ModelConfig) -> Option<VHeadLayout> {
    let get = |k| config.text_usize(k);
    Some(VHeadLayout {
        num_k_heads: get("linear_num_key_heads")?,
        num_v_heads: get("linear_num_value_heads")?,
        head_k_dim: get("linear_key_head_dim")?,
        head_v_dim: get("linear_value_head_dim")?,
    })
}

/// The checkpoint directory a path names (the file's directory for a single
/// `.safetensors` file).
pub fn checkpoint_dir(path: &Path) -> PathBuf {
    if path.is_file() {
        path.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    } else {
        path.to_path_buf()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_split_as_gguf_py_splits_them() {
        let id = model_id_components("Qwen3-8B", 8_190_000_000);
        assert_eq!(id.name.as_deref(), Some("Qwen3 8B"));
        assert_eq!(id.basename.as_deref(), Some("Qwen3"));
        assert_eq!(id.size_label.as_deref(), Some("8B"));
        let id = model_id_components("qwen3", 284_032);
        assert_eq!(id.name.as_deref(), Some("Qwen3"));
        assert_eq!(id.basename, None);
        let id = model_id_components("Qwen/Qwen3.5-9B-Instruct", 9_000_000_000);
        assert_eq!(id.organization.as_deref(), Some("Qwen"));
        assert_eq!(id.finetune.as_deref(), Some("Instruct"));
        assert_eq!(id.size_label.as_deref(), Some("9B"));
        assert_eq!(rounded_parameter_count(284_032), "284K");
        assert_eq!(rounded_parameter_count(1_500_000), "1.5M");
        assert_eq!(rounded_parameter_count(8_190_000_000), "8.2B");
    }
}
