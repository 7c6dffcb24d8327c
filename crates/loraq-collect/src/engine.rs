//! The serving engines: what each request looks like, how each answer is read, and
//! the checks made before the first request. docs/collect.md explains each field
//! with the engine's source it relies on.

use crate::error::{CollectError, Result};
use crate::http::{Client, Failure};
use crate::question::{Question, Scores};
use loraq_io::limits::elide;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Most option tokens one vLLM request may ask `logprob_token_ids` for (vLLM's limit).
pub const MAX_VLLM_OPTION_TOKENS: usize = 128;

/// The logit bias llama-server adds to every option token so that the options are
/// the top candidates and the returned probabilities are the softmax over them: the
/// rest of the vocabulary then holds a share of about e^-100 of the mass.
pub const LLAMA_OPTION_BIAS: f64 = 100.0;

/// How far from 1 the options' probabilities from llama-server may sum before the
/// answer is refused (the bias did not take: the server ignored `logit_bias`).
pub const LLAMA_SUM_TOLERANCE: f64 = 1e-3;

/// vLLM writes a log-probability of `-inf` as this number.
pub const VLLM_NEG_INF: f64 = -9999.0;

/// Which server API is spoken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// vLLM's OpenAI-compatible server, `/v1/completions` with `logprob_token_ids`.
    Vllm,
    /// llama.cpp's `llama-server`, `/completion` with logit bias and post-sampling
    /// probabilities.
    LlamaCpp,
    /// Any OpenAI-compatible `/v1/completions`: only the standard `logprobs` (the
    /// top-k, keyed by token text); an option outside the top-k is missing.
    #[serde(rename = "openai")]
    OpenAi,
}

impl EngineKind {
    /// Parses `vllm` or `llama-cpp`.
    pub fn parse(text: &str) -> Option<EngineKind> {
        match text {
            "vllm" => Some(EngineKind::Vllm),
            "llama-cpp" => Some(EngineKind::LlamaCpp),
            "openai" => Some(EngineKind::OpenAi),
            _ => None,
        }
    }

    /// The name on the command line and in the header.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::LlamaCpp => "llama-cpp",
            EngineKind::OpenAi => "openai",
        }
    }

    /// What the values written as `logits` are for this engine.
    pub fn values(self) -> &'static str {
        match self {
            EngineKind::Vllm => {
                "full-vocabulary log-probabilities of the option tokens (raw, before sampling parameters)"
            }
            EngineKind::LlamaCpp => {
                "log of the softmax over the option tokens (logit bias +100 on the options, temperature 1)"
            }
            EngineKind::OpenAi => {
                "full-vocabulary log-probabilities of the option tokens from the top-k (logprobs), matched by token text"
            }
        }
    }
}

/// Which model (and adapter) requests go to.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// The engine.
    pub kind: EngineKind,
    /// The served base model's name (vLLM: the served model name; llama.cpp: the
    /// model's id in `/v1/models`, its `--alias` or path).
    pub model: String,
    /// vLLM: the adapter's name (`--lora-modules NAME=PATH`); requests go to it.
    pub adapter: Option<String>,
    /// llama.cpp: the adapter's id in `/lora-adapters`; requests apply it at
    /// `lora_scale` and every other adapter at 0.
    pub lora_id: Option<u32>,
    /// llama.cpp: the scale of `lora_id`.
    pub lora_scale: f64,
    /// openai: how many top log-probabilities to ask for (`logprobs`).
    pub top_logprobs: u32,
}

/// A target bound to a server, after the checks made before the first request.
pub struct Engine {
    /// What is asked.
    pub target: Target,
    /// The HTTP client.
    pub client: Client,
    /// llama.cpp: the ids of every adapter the server loaded (each request lists
    /// all of them, so none is left at a scale another request set).
    pub lora_ids: Vec<u32>,
    /// The server's version as it reports it.
    pub server_version: String,
    /// Warnings found by the checks (the tokenizer round trip, option labels).
    pub warnings: Vec<String>,
    /// openai: the text of each option token, as the standard API keys its
    /// top-k; `None` where the text is not unique in the vocabulary (the answer
    /// could not tell that token from another).
    pub option_texts: std::collections::HashMap<u32, Option<String>>,
}

/// Distinct option tokens of a question, in first-seen order.
fn distinct_options(q: &Question) -> Vec<u32> {
    let mut ids: Vec<u32> = Vec::with_capacity(q.option_tokens.len());
    for t in &q.option_tokens {
        if !ids.contains(t) {
            ids.push(*t);
        }
    }
    ids
}

/// The llama-server `/completion` body for `q`: the prompt's ids as given, one
/// generated token, the option tokens biased by [`LLAMA_OPTION_BIAS`], the sampler
/// chain reduced to temperature 1 (then the final softmax), probabilities after
/// sampling for as many candidates as there are options, every adapter listed with
/// its scale, and no prompt cache.
pub fn llama_request(q: &Question, lora: &[(u32, f64)]) -> Value {
    let ids = distinct_options(q);
    let bias: Vec<Value> = ids.iter().map(|t| json!([t, LLAMA_OPTION_BIAS])).collect();
    let lora: Vec<Value> = lora
        .iter()
        .map(|(id, scale)| json!({"id": id, "scale": scale}))
        .collect();
    json!({
        "prompt": q.tokens,
        "n_predict": 1,
        "n_probs": ids.len(),
        "post_sampling_probs": true,
        "logit_bias": bias,
        "samplers": ["temperature"],
        "temperature": 1.0,
        "lora": lora,
        "cache_prompt": false,
        "stream": false,
    })
}

/// Reads llama-server's answer to [`llama_request`]: `completion_probabilities[0]
/// .top_probs[] = {id, token, prob}`; each option's value is ln(prob). An option
/// not among them (its probability rounded to 0 in f32, or outranked by a token
/// more than 100 nats above it) is `None`.
pub fn llama_parse(q: &Question, body: &Value) -> std::result::Result<Scores, String> {
    if body.get("truncated").and_then(Value::as_bool) == Some(true) {
        return Err("the server truncated the prompt (longer than its context, --ctx-size)".into());
    }
    if let Some(n) = body.get("tokens_evaluated").and_then(Value::as_u64)
        && n != q.tokens.len() as u64
    {
        return Err(format!(
            "the server evaluated {n} prompt tokens, the record has {}",
            q.tokens.len()
        ));
    }
    let top = body
        .get("completion_probabilities")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(|first| first.get("top_probs"))
        .and_then(Value::as_array)
        .ok_or("no completion_probabilities[0].top_probs in the answer (is n_probs honoured?)")?;
    let mut found: Vec<(u64, f64)> = Vec::with_capacity(top.len());
    for entry in top {
        let id = entry
            .get("id")
            .and_then(Value::as_u64)
            .ok_or("a top_probs entry without an integer id")?;
        let prob = entry
            .get("prob")
            .and_then(Value::as_f64)
            .ok_or("a top_probs entry without a numeric prob (post_sampling_probs ignored?)")?;
        if !(prob.is_finite() && prob > 0.0 && prob <= 1.0 + 1e-6) {
            return Err(format!("token {id} has probability {prob}, not in (0, 1]"));
        }
        found.push((id, prob));
    }
    let values: Vec<Option<f64>> = q
        .option_tokens
        .iter()
        .map(|t| {
            found
                .iter()
                .find(|(id, _)| *id == u64::from(*t))
                .map(|(_, p)| p.ln())
        })
        .collect();
    if values.iter().all(Option::is_some) {
        let sum: f64 = distinct_options(q)
            .iter()
            .filter_map(|t| found.iter().find(|(id, _)| *id == u64::from(*t)))
            .map(|(_, p)| p)
            .sum();
        if (sum - 1.0).abs() > LLAMA_SUM_TOLERANCE {
            return Err(format!(
                "the options' probabilities sum to {sum}, not 1: the server did not apply logit_bias to the options"
            ));
        }
    }
    Ok(Scores { values })
}

/// The vLLM `/v1/completions` body for `q`: the prompt's ids, one generated token
/// (greedy), `logprob_token_ids` = the option tokens, keyed by id in the answer.
pub fn vllm_request(q: &Question, model: &str) -> Value {
    json!({
        "model": model,
        "prompt": q.tokens,
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": 1,
        "logprob_token_ids": distinct_options(q),
        "return_tokens_as_token_ids": true,
        "stream": false,
    })
}

/// Reads vLLM's answer to [`vllm_request`]: `choices[0].logprobs.top_logprobs[0]`
/// maps `"token_id:<id>"` to the full-vocabulary log-probability of that token at
/// the first generated position; -9999.0 is `-inf`. An option missing from the map
/// (a server that ignores `logprob_token_ids`) is `None`.
pub fn vllm_parse(q: &Question, body: &Value) -> std::result::Result<Scores, String> {
    if let Some(n) = body.pointer("/usage/prompt_tokens").and_then(Value::as_u64)
        && n != q.tokens.len() as u64
    {
        return Err(format!(
            "the server counted {n} prompt tokens, the record has {} (did it add special tokens?)",
            q.tokens.len()
        ));
    }
    let top = body
        .pointer("/choices/0/logprobs/top_logprobs/0")
        .and_then(Value::as_object)
        .ok_or("no choices[0].logprobs.top_logprobs[0] in the answer")?;
    let mut values = Vec::with_capacity(q.option_tokens.len());
    for t in &q.option_tokens {
        let key = format!("token_id:{t}");
        let value = match top.get(&key) {
            None => None,
            Some(v) => {
                let lp = v
                    .as_f64()
                    .ok_or_else(|| format!("{key} is {v}, not a number"))?;
                if lp == VLLM_NEG_INF {
                    Some(f64::NEG_INFINITY)
                } else if lp.is_finite() && lp <= 1e-6 {
                    Some(lp.min(0.0))
                } else {
                    return Err(format!("{key} has log-probability {lp}, not in [-inf, 0]"));
                }
            }
        };
        values.push(value);
    }
    Ok(Scores { values })
}

/// The standard `/v1/completions` body for `q`: the prompt's ids, one greedy token,
/// the top `k` log-probabilities.
pub fn openai_request(q: &Question, model: &str, k: u32) -> Value {
    json!({
        "model": model,
        "prompt": q.tokens,
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": k,
        "stream": false,
    })
}

/// Reads a standard `/v1/completions` answer: `choices[0].logprobs.top_logprobs[0]`
/// (a map from token text to log-probability, the legacy completions format) or
/// `choices[0].logprobs.content[0].top_logprobs` (a list of `{token, logprob}`, the
/// chat format some servers use for completions too). Each option is looked up by its
/// token's text (`texts`); one whose text is not unique, or that is not in the top-k,
/// is `None`.
pub fn openai_parse(
    q: &Question,
    texts: &std::collections::HashMap<u32, Option<String>>,
    body: &Value,
) -> std::result::Result<Scores, String> {
    let logprobs = body
        .pointer("/choices/0/logprobs")
        .ok_or("no choices[0].logprobs in the answer (does the server support logprobs?)")?;
    let mut top: Vec<(String, f64)> = Vec::new();
    if let Some(map) = logprobs
        .pointer("/top_logprobs/0")
        .and_then(Value::as_object)
    {
        for (text, v) in map {
            let lp = v
                .as_f64()
                .ok_or_else(|| format!("top_logprobs[0][{text:?}] is {v}, not a number"))?;
            top.push((text.clone(), lp));
        }
    } else if let Some(list) = logprobs
        .pointer("/content/0/top_logprobs")
        .and_then(Value::as_array)
    {
        for entry in list {
            let text = entry
                .get("token")
                .and_then(Value::as_str)
                .ok_or("a top_logprobs entry without a token")?;
            let lp = entry
                .get("logprob")
                .and_then(Value::as_f64)
                .ok_or("a top_logprobs entry without a logprob")?;
            top.push((text.to_string(), lp));
        }
    } else {
        return Err(format!(
            "choices[0].logprobs has neither top_logprobs[0] nor content[0].top_logprobs: {}",
            elide(&logprobs.to_string())
        ));
    }
    let mut values = Vec::with_capacity(q.option_tokens.len());
    for t in &q.option_tokens {
        let Some(Some(text)) = texts.get(t) else {
            values.push(None);
            continue;
        };
        let value = match top.iter().find(|(k, _)| k == text) {
            None => None,
            Some((_, lp)) if *lp == VLLM_NEG_INF || *lp == f64::NEG_INFINITY => {
                Some(f64::NEG_INFINITY)
            }
            Some((_, lp)) if lp.is_finite() && *lp <= 1e-6 => Some(lp.min(0.0)),
            Some((k, lp)) => {
                return Err(format!(
                    "token {k:?} has log-probability {lp}, not in [-inf, 0]"
                ));
            }
        };
        values.push(value);
    }
    Ok(Scores { values })
}

/// Checks a question can be sent to `kind`: token ids present, at most
/// [`MAX_VLLM_OPTION_TOKENS`] distinct option tokens for vLLM.
pub fn check_question(kind: EngineKind, q: &Question) -> std::result::Result<(), String> {
    if q.tokens.is_empty() {
        return Err("empty prompt (no tokens)".into());
    }
    if q.option_tokens.len() != q.options.len() {
        return Err(format!(
            "{} options but {} option_tokens",
            q.options.len(),
            q.option_tokens.len()
        ));
    }
    let distinct = distinct_options(q).len();
    if kind == EngineKind::Vllm && distinct > MAX_VLLM_OPTION_TOKENS {
        return Err(format!(
            "{distinct} distinct option tokens; vLLM's logprob_token_ids takes at most {MAX_VLLM_OPTION_TOKENS}"
        ));
    }
    Ok(())
}

fn names_in_model_list(list: &Value) -> Vec<String> {
    list.get("data")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

impl Engine {
    /// Connects to the server and checks, before the first request, that it serves
    /// the model (and the adapter), that every token of `questions` is inside its
    /// vocabulary, and that its tokenizer agrees with the records on a sample
    /// (disagreement on a record's text is an error; a failed round trip of ids
    /// without text, or option labels that are not their token's text, a warning).
    pub fn connect(target: Target, client: Client, questions: &[Question]) -> Result<Engine> {
        let server = client.base().to_string();
        let fail = |reason: String| CollectError::Preflight {
            server: server.clone(),
            reason,
        };
        let get = |path: &str| {
            client
                .get(path)
                .map_err(|e| fail(format!("GET {path}: {}", e.message())))
        };
        let models = get("/v1/models")?;
        let names = names_in_model_list(&models);
        let shown = names
            .iter()
            .map(|n| format!("{:?}", elide(n)))
            .collect::<Vec<_>>()
            .join(", ");
        if !names.contains(&target.model) {
            return Err(fail(format!(
                "the server does not serve model {:?}; /v1/models lists [{shown}]",
                target.model
            )));
        }
        let mut engine = Engine {
            target,
            client: client.clone(),
            lora_ids: Vec::new(),
            server_version: String::new(),
            warnings: Vec::new(),
            option_texts: std::collections::HashMap::new(),
        };
        let mut n_vocab = None;
        match engine.target.kind {
            EngineKind::OpenAi => {
                // The standard API has no version or tokenizer endpoint.
                engine.server_version = format!(
                    "openai-compatible (models owned by {})",
                    models
                        .pointer("/data/0/owned_by")
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                );
                if let Some(adapter) = &engine.target.adapter
                    && !names.contains(adapter)
                {
                    return Err(fail(format!(
                        "the server does not serve {adapter:?}; /v1/models lists [{shown}]"
                    )));
                }
                return Ok(engine);
            }
            EngineKind::Vllm => {
                if let Some(adapter) = &engine.target.adapter
                    && !names.contains(adapter)
                {
                    return Err(fail(format!(
                        "the server does not serve adapter {adapter:?} (start it with --enable-lora --lora-modules {adapter}=PATH); /v1/models lists [{shown}]"
                    )));
                }
                let version = get("/version")?;
                engine.server_version = format!(
                    "vllm {}",
                    version
                        .get("version")
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                );
            }
            EngineKind::LlamaCpp => {
                let adapters = get("/lora-adapters")?;
                let list = adapters.as_array().ok_or_else(|| {
                    fail(format!(
                        "GET /lora-adapters answered {adapters}, not a list"
                    ))
                })?;
                for a in list {
                    let id = a.get("id").and_then(Value::as_u64).ok_or_else(|| {
                        fail(format!("GET /lora-adapters: an entry without an id: {a}"))
                    })?;
                    engine.lora_ids.push(
                        u32::try_from(id)
                            .map_err(|_| fail(format!("adapter id {id} out of range")))?,
                    );
                }
                if let Some(id) = engine.target.lora_id
                    && !engine.lora_ids.contains(&id)
                {
                    return Err(fail(format!(
                        "no adapter with id {id}; /lora-adapters lists ids {:?} (start llama-server with --lora FILE --lora-init-without-apply)",
                        engine.lora_ids
                    )));
                }
                let props = get("/props")?;
                engine.server_version = format!(
                    "llama.cpp {}",
                    props
                        .get("build_info")
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                );
                n_vocab = models
                    .pointer("/data/0/meta/n_vocab")
                    .or_else(|| models.pointer("/models/0/meta/n_vocab"))
                    .and_then(Value::as_u64);
            }
        }
        if let Some(n_vocab) = n_vocab {
            for q in questions {
                if let Some(t) = q
                    .tokens
                    .iter()
                    .chain(&q.option_tokens)
                    .find(|t| u64::from(**t) >= n_vocab)
                {
                    return Err(fail(format!(
                        "record {:?} (line {}) has token {t}, outside the server's vocabulary of {n_vocab}",
                        elide(&q.id),
                        q.line
                    )));
                }
            }
        }
        engine.check_tokenizer(questions)?;
        Ok(engine)
    }

    fn tokenize(&self, text: &str) -> std::result::Result<Vec<u64>, Failure> {
        let body = match self.target.kind {
            EngineKind::LlamaCpp => json!({"content": text, "add_special": false}),
            EngineKind::Vllm | EngineKind::OpenAi => {
                json!({"model": self.target.model, "prompt": text, "add_special_tokens": false})
            }
        };
        let answer = self.client.post("/tokenize", &body)?;
        answer
            .get("tokens")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| Failure::Permanent(format!("/tokenize answered {answer}")))
    }

    fn detokenize(&self, tokens: &[u32]) -> std::result::Result<String, Failure> {
        let (body, field) = match self.target.kind {
            EngineKind::LlamaCpp => (json!({"tokens": tokens}), "content"),
            EngineKind::Vllm | EngineKind::OpenAi => (
                json!({"model": self.target.model, "tokens": tokens}),
                "prompt",
            ),
        };
        let answer = self.client.post("/detokenize", &body)?;
        answer
            .get(field)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| Failure::Permanent(format!("/detokenize answered {answer}")))
    }

    /// The tokenizer check on up to 8 records spread over the file.
    fn check_tokenizer(&mut self, questions: &[Question]) -> Result<()> {
        let sample: Vec<&Question> = if questions.len() <= 8 {
            questions.iter().collect()
        } else {
            (0..8)
                .map(|i| &questions[i * questions.len() / 8])
                .collect()
        };
        let server = self.client.base().to_string();
        for q in sample {
            let ours: Vec<u64> = q.tokens.iter().map(|t| u64::from(*t)).collect();
            let shown_id = elide(&q.id);
            if let Some(text) = &q.prompt {
                let theirs = self.tokenize(text).map_err(|e| CollectError::Preflight {
                    server: server.clone(),
                    reason: format!("POST /tokenize for record {shown_id:?}: {}", e.message()),
                })?;
                if theirs != ours {
                    return Err(CollectError::Preflight {
                        server,
                        reason: format!(
                            "the server's tokenizer does not agree with record {shown_id:?} (line {}): its prompt text gives {} tokens there, the record has {}; the server runs another tokenizer (or another model) than the records were made with",
                            q.line,
                            theirs.len(),
                            ours.len()
                        ),
                    });
                }
            } else {
                match self
                    .detokenize(&q.tokens)
                    .and_then(|text| self.tokenize(&text))
                {
                    Ok(theirs) if theirs == ours => {}
                    Ok(_) => self.warnings.push(format!(
                        "record {shown_id:?} (line {}): the server's tokenizer does not give back the record's tokens from their own text (not proof of another tokenizer: the tokens may not be the canonical tokenization of their text)",
                        q.line
                    )),
                    Err(e) => self.warnings.push(format!(
                        "tokenizer check skipped: the server's /tokenize or /detokenize failed: {}",
                        e.message()
                    )),
                }
            }
            for (label, token) in q.options.iter().zip(&q.option_tokens) {
                if let Ok(text) = self.detokenize(std::slice::from_ref(token))
                    && text.trim() != label.trim()
                {
                    self.warnings.push(format!(
                        "record {shown_id:?}: option {:?} is scored on token {token}, which the server's tokenizer writes as {:?}",
                        elide(label),
                        elide(&text)
                    ));
                    break;
                }
            }
        }
        Ok(())
    }

    /// Sends one question and reads the answer.
    pub fn score(&self, q: &Question) -> std::result::Result<Scores, Failure> {
        match self.target.kind {
            EngineKind::LlamaCpp => {
                let lora: Vec<(u32, f64)> = self
                    .lora_ids
                    .iter()
                    .map(|id| {
                        let scale = if Some(*id) == self.target.lora_id {
                            self.target.lora_scale
                        } else {
                            0.0
                        };
                        (*id, scale)
                    })
                    .collect();
                let body = self.client.post("/completion", &llama_request(q, &lora))?;
                llama_parse(q, &body).map_err(Failure::Permanent)
            }
            EngineKind::Vllm => {
                let model = self.target.adapter.as_deref().unwrap_or(&self.target.model);
                let body = self
                    .client
                    .post("/v1/completions", &vllm_request(q, model))?;
                vllm_parse(q, &body).map_err(Failure::Permanent)
            }
            EngineKind::OpenAi => {
                let model = self.target.adapter.as_deref().unwrap_or(&self.target.model);
                let request = openai_request(q, model, self.target.top_logprobs);
                let body = self.client.post("/v1/completions", &request)?;
                openai_parse(q, &self.option_texts, &body).map_err(Failure::Permanent)
            }
        }
    }

    /// The request's path, as errors name it.
    pub fn request_path(&self) -> &'static str {
        match self.target.kind {
            EngineKind::LlamaCpp => "POST /completion",
            EngineKind::Vllm | EngineKind::OpenAi => "POST /v1/completions",
        }
    }
}
