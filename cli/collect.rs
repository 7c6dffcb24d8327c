//! `loraq collect`: answers from a running vLLM or llama.cpp server, written in the
//! answers format `loraq compare` reads, resumable record by record (docs/collect.md).

use crate::progress;
use anyhow::{Context, Result, anyhow, bail};
use loraq_collect::output::{HEADER_FORMAT, HEADER_VERSION, Header, sha256_file};
use loraq_collect::{AnswersOut, Client, Engine, EngineKind, Question, RunOptions, Target};
use loraq_eval::answers::check_question;
use loraq_io::limits::elide;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

/// Collect the option tokens' log-probabilities of every record from a running
/// serving engine (vLLM or llama.cpp's llama-server).
#[derive(clap::Args)]
pub struct Args {
    /// The server's base URL, e.g. http://127.0.0.1:8080 (plain http).
    #[arg(long)]
    server: String,
    /// vllm (/v1/completions with logprob_token_ids), llama-cpp (llama-server's
    /// /completion with logit bias on the options) or openai (the standard
    /// /v1/completions top-k logprobs only; needs --tokenizer).
    #[arg(long, value_parser = ["vllm", "llama-cpp", "openai"])]
    engine: String,
    /// The served base model's name, as the server's /v1/models lists it (vLLM:
    /// --served-model-name; llama-server: --alias, else the model path).
    #[arg(long)]
    model: String,
    /// vLLM (and openai): the adapter's served name (--lora-modules NAME=PATH);
    /// requests go to it.
    #[arg(long, conflicts_with_all = ["lora_id"])]
    adapter: Option<String>,
    /// llama.cpp: the adapter's id in /lora-adapters (llama-server --lora FILE
    /// --lora-init-without-apply); every request sets it to --lora-scale and every other
    /// adapter to 0. Without it every adapter is at 0: the base.
    #[arg(long)]
    lora_id: Option<u32>,
    /// llama.cpp: the scale of --lora-id.
    #[arg(long, default_value_t = 1.0, requires = "lora_id")]
    lora_scale: f64,
    /// Records (JSON Lines: id, group?, tokens, options, option_tokens, gold?; the
    /// format `loraq run` reads).
    #[arg(long)]
    records: PathBuf,
    /// Answers output (JSON Lines), appended record by record. A re-run with the same
    /// --out skips the ids already there; its header OUT.collect.json must match.
    #[arg(long)]
    out: PathBuf,
    /// openai: the model's tokenizer.json, which gives each option token's text (the
    /// standard API keys its top-k by text).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// openai: how many top log-probabilities to ask for; an option outside them is
    /// missing (the record goes to OUT.incomplete.jsonl).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    top_logprobs: u32,
    /// Requests in flight.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Attempts per request on connection errors, timeouts, HTTP 429 and 5xx (with
    /// exponential backoff from 0.5 s, at most 30 s between attempts).
    #[arg(long, default_value_t = 6)]
    attempts: u32,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

/// Runs `loraq collect`.
pub fn run(args: Args) -> Result<()> {
    let kind = EngineKind::parse(&args.engine).expect("clap checked the engine");
    if kind == EngineKind::LlamaCpp && args.adapter.is_some() {
        bail!("--adapter names a vLLM adapter; llama.cpp's are chosen by --lora-id");
    }
    if kind == EngineKind::Vllm && args.lora_id.is_some() {
        bail!("--lora-id is llama.cpp's; a vLLM adapter is chosen by --adapter NAME");
    }
    if !(args.lora_scale.is_finite()) {
        bail!("--lora-scale {} is not a finite number", args.lora_scale);
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0 && args.timeout <= 86_400.0) {
        bail!(
            "--timeout {} must be a number of seconds in (0, 86400]",
            args.timeout
        );
    }
    // The answers file and its siblings are appended to, never over the records (or
    // the working directory), symlinks resolved.
    for out in [
        args.out.clone(),
        loraq_collect::output::header_path(&args.out),
        loraq_collect::output::incomplete_path(&args.out),
    ] {
        loraq_io::check_output_path(&out, &[args.records.as_path()])
            .with_context(|| format!("--out {}", args.out.display()))?;
    }
    let records = loraq_model::read_records(&args.records)?;
    let questions = questions(&args.records, records, kind)?;
    let records_sha256 = sha256_file(&args.records)?;
    let target = Target {
        kind,
        model: args.model.clone(),
        adapter: args.adapter.clone(),
        lora_id: args.lora_id,
        lora_scale: args.lora_scale,
        top_logprobs: args.top_logprobs,
    };
    let option_texts = match (kind, &args.tokenizer) {
        (EngineKind::OpenAi, Some(path)) => option_texts(path, &questions)?,
        (EngineKind::OpenAi, None) => bail!(
            "--engine openai needs --tokenizer TOKENIZER.json: the standard API keys its top-k by token text"
        ),
        (_, Some(_)) => bail!("--tokenizer is for --engine openai"),
        (_, None) => HashMap::new(),
    };
    let client = Client::new(&args.server, Duration::from_secs_f64(args.timeout));
    let mut engine = Engine::connect(target, client, &questions)?;
    if kind == EngineKind::OpenAi {
        let ambiguous = option_texts.values().filter(|t| t.is_none()).count();
        if ambiguous > 0 {
            eprintln!(
                "warning: {ambiguous} option tokens share their text with another token of the vocabulary; their records go to the incomplete file"
            );
        }
        engine.warnings.push(
            "the standard API has no tokenizer endpoint: the records' tokens are not checked against the server's tokenizer".into(),
        );
        engine.option_texts = option_texts;
    }
    for warning in &engine.warnings {
        eprintln!("warning: {warning}");
    }
    let header = Header {
        format: HEADER_FORMAT.into(),
        version: HEADER_VERSION,
        engine: kind.name().into(),
        model: args.model.clone(),
        adapter: args.adapter.clone(),
        lora_id: args.lora_id,
        lora_scale: args.lora_id.map(|_| args.lora_scale),
        values: kind.values().into(),
        records: args.records.display().to_string(),
        records_sha256,
        records_count: questions.len(),
        server: engine.client.base().to_string(),
        server_version: engine.server_version.clone(),
    };
    let (mut out, resumed) = AnswersOut::open(&args.out, &header, &questions)?;
    for note in &resumed.notes {
        eprintln!("note: {note}");
    }
    if !resumed.done.is_empty() {
        eprintln!(
            "loraq collect: resuming {}: {} of {} records already answered",
            args.out.display(),
            resumed.done.len(),
            questions.len()
        );
    }
    let pending = questions.len() - resumed.done.len();
    let bar = progress::bar(pending as u64, "collect");
    let tick = |done: usize, _total: usize| {
        bar.set_position(done as u64);
        let secs = bar.elapsed().as_secs_f64();
        if secs > 0.0 {
            bar.set_message(format!("{:.1} records/s", done as f64 / secs));
        }
    };
    let options = RunOptions {
        concurrency: args.concurrency,
        attempts: args.attempts,
        ..RunOptions::default()
    };
    let result = loraq_collect::collect(
        &engine,
        &questions,
        &resumed.done,
        &mut out,
        &options,
        &tick,
    );
    bar.finish_and_clear();
    let summary = result.with_context(|| {
        format!(
            "collecting into {} (the answers written so far are kept; run the same command again to resume)",
            args.out.display()
        )
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!("{}", args.out.display());
    }
    eprintln!(
        "loraq collect: {} answers written ({} incomplete, {} already there) of {} records in {:.1} s ({:.1} records/s, {} requests, {} retried) from {} ({})",
        summary.written,
        summary.incomplete,
        summary.already_done,
        summary.records,
        summary.seconds,
        summary.records_per_second,
        summary.requests,
        summary.retries,
        engine.client.base(),
        engine.server_version
    );
    if summary.incomplete + resumed.incomplete > 0 {
        eprintln!(
            "warning: {} records lack some option's value; they are in {} and not in the answers",
            summary.incomplete + resumed.incomplete,
            loraq_collect::output::incomplete_path(&args.out).display()
        );
    }
    Ok(())
}

/// The text of every option token as `tokenizer` decodes it alone, `None` where
/// another token of the vocabulary decodes to the same text (a top-k keyed by text
/// could not tell them apart).
fn option_texts(
    path: &std::path::Path,
    questions: &[Question],
) -> Result<HashMap<u32, Option<String>>> {
    let tokenizer = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| anyhow!("--tokenizer {}: {e}", path.display()))?;
    let decode = |id: u32| {
        tokenizer
            .decode(&[id], false)
            .map_err(|e| anyhow!("--tokenizer {}: decoding token {id}: {e}", path.display()))
    };
    let mut texts: HashMap<u32, Option<String>> = HashMap::new();
    for q in questions {
        for t in &q.option_tokens {
            if !texts.contains_key(t) {
                texts.insert(*t, Some(decode(*t)?));
            }
        }
    }
    let mut owners: HashMap<String, u32> = texts
        .iter()
        .filter_map(|(id, t)| t.clone().map(|t| (t, *id)))
        .collect();
    let size = u32::try_from(tokenizer.get_vocab_size(true))
        .map_err(|_| anyhow!("--tokenizer {}: vocabulary too large", path.display()))?;
    for id in 0..size {
        let text = decode(id)?;
        if let Some(owner) = owners.get(&text).copied()
            && owner != id
        {
            texts.insert(owner, None);
            owners.remove(&text);
        }
    }
    Ok(texts)
}

/// The records as questions, refused (with file, line and id) where `loraq compare`
/// would refuse their answers or the engine cannot be asked them.
fn questions(
    path: &std::path::Path,
    records: Vec<loraq_model::Record>,
    kind: EngineKind,
) -> Result<Vec<Question>> {
    let mut first_line: HashMap<String, u64> = HashMap::with_capacity(records.len());
    let mut questions = Vec::with_capacity(records.len());
    for r in records {
        let shown_id = elide(&format!("{:?}", r.id));
        let at =
            |reason: String| anyhow!("{}:{}: record {shown_id}: {reason}", path.display(), r.line);
        check_question(&r.id, &r.options, r.gold.as_deref())
            .map_err(|reason| at(format!("{reason} (loraq compare would refuse its answer)")))?;
        if let Some(first) = first_line.insert(r.id.clone(), r.line) {
            return Err(at(format!(
                "duplicate id (first at line {first}): answers are paired by id"
            )));
        }
        let tokens = r.tokens.clone().ok_or_else(|| {
            at("has no tokens: loraq collect sends token ids (tokenize the records first)".into())
        })?;
        let option_tokens = r
            .option_tokens
            .clone()
            .ok_or_else(|| at("has no option_tokens".into()))?;
        let q = Question {
            id: r.id,
            group: r.group,
            prompt: r.prompt,
            tokens,
            options: r.options,
            option_tokens,
            gold: r.gold,
            line: r.line,
        };
        loraq_collect::engine::check_question(kind, &q).map_err(at)?;
        questions.push(q);
    }
    Ok(questions)
}
