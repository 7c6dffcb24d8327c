//! The collection loop: workers send requests (`concurrency` in flight), retry the
//! transient failures with backoff, and hand answers to the one writer, which
//! appends them as they come.

use crate::engine::Engine;
use crate::error::{CollectError, Result};
use crate::http::{Failure, backoff};
use crate::output::AnswersOut;
use crate::question::{Question, Scores};
use loraq_io::limits::elide;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Most requests in flight (`--concurrency`).
pub const MAX_CONCURRENCY: usize = 1024;

/// How requests are sent.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Requests in flight, 1..=[`MAX_CONCURRENCY`].
    pub concurrency: usize,
    /// Attempts per request before giving up on transient failures (at least 1).
    pub attempts: u32,
    /// Sleep used between attempts; tests shorten it.
    pub backoff_scale: f64,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            concurrency: 4,
            attempts: 6,
            backoff_scale: 1.0,
        }
    }
}

/// What a collection did, as `--json` prints it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Records in the records file.
    pub records: usize,
    /// Answered before this run (resumed).
    pub already_done: usize,
    /// Answers written by this run to the answers file.
    pub written: usize,
    /// Written by this run to the incomplete file.
    pub incomplete: usize,
    /// Requests sent (attempts included).
    pub requests: u64,
    /// Attempts that failed transiently and were retried.
    pub retries: u64,
    /// Wall time of the requests, in seconds.
    pub seconds: f64,
    /// Records answered per second by this run.
    pub records_per_second: f64,
}

/// Why an answer lacks options, as the incomplete file says it.
const MISSING_REASON: &str = "the engine did not return every option's value (openai: not in the top-k; llama.cpp: probability 0 in f32 or outranked by more than the bias; vllm: logprob_token_ids not honoured)";

/// Asks `engine` every question of `questions` not in `done`, writing each answer to
/// `out` as it comes. `progress(done_now, pending)` is called after each answer.
/// On a failure that retrying did not cure, the answers already received are still
/// written, the workers stop taking new questions, and the error is returned.
pub fn collect(
    engine: &Engine,
    questions: &[Question],
    done: &std::collections::HashSet<String>,
    out: &mut AnswersOut,
    options: &RunOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Summary> {
    if options.concurrency == 0 || options.concurrency > MAX_CONCURRENCY {
        return Err(CollectError::Options(format!(
            "--concurrency {} is outside 1..={MAX_CONCURRENCY}",
            options.concurrency
        )));
    }
    if options.attempts == 0 {
        return Err(CollectError::Options(
            "at least one attempt per request".into(),
        ));
    }
    let pending: Vec<&Question> = questions.iter().filter(|q| !done.contains(&q.id)).collect();
    let mut summary = Summary {
        records: questions.len(),
        already_done: questions.len() - pending.len(),
        ..Summary::default()
    };
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let requests = AtomicU64::new(0);
    let retries = AtomicU64::new(0);
    let started = Instant::now();
    let mut first_error: Option<CollectError> = None;
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<(usize, std::result::Result<Scores, CollectError>)>();
        for worker in 0..options.concurrency.min(pending.len().max(1)) {
            let tx = tx.clone();
            let (next, stop, requests, retries, pending) =
                (&next, &stop, &requests, &retries, &pending);
            scope.spawn(move || {
                loop {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(q) = pending.get(i) else { break };
                    let result = ask(engine, q, options, worker as u64, stop, requests, retries);
                    if tx.send((i, result)).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        for (i, result) in rx {
            let q = pending[i];
            match result {
                Ok(scores) => {
                    match out.write(q, &scores, MISSING_REASON) {
                        Ok(true) => summary.written += 1,
                        Ok(false) => summary.incomplete += 1,
                        Err(e) => {
                            stop.store(true, Ordering::Relaxed);
                            first_error.get_or_insert(e);
                        }
                    }
                    progress(summary.written + summary.incomplete, pending.len());
                }
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    first_error.get_or_insert(e);
                }
            }
        }
    });
    out.sync()?;
    summary.requests = requests.load(Ordering::Relaxed);
    summary.retries = retries.load(Ordering::Relaxed);
    summary.seconds = started.elapsed().as_secs_f64();
    summary.records_per_second =
        (summary.written + summary.incomplete) as f64 / summary.seconds.max(1e-9);
    match first_error {
        Some(e) => Err(e),
        None => Ok(summary),
    }
}

/// One question with its retries.
fn ask(
    engine: &Engine,
    q: &Question,
    options: &RunOptions,
    salt: u64,
    stop: &AtomicBool,
    requests: &AtomicU64,
    retries: &AtomicU64,
) -> std::result::Result<Scores, CollectError> {
    let request = || {
        format!(
            "{} for record {:?} (line {})",
            engine.request_path(),
            elide(&q.id),
            q.line
        )
    };
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        requests.fetch_add(1, Ordering::Relaxed);
        match engine.score(q) {
            Ok(scores) => return Ok(scores),
            Err(Failure::Permanent(reason)) => {
                return Err(CollectError::Server {
                    server: engine.client.base().to_string(),
                    request: request(),
                    reason,
                });
            }
            Err(Failure::Transient(last)) => {
                if attempt >= options.attempts || stop.load(Ordering::Relaxed) {
                    return Err(CollectError::Unavailable {
                        server: engine.client.base().to_string(),
                        request: request(),
                        attempts: attempt,
                        last,
                    });
                }
                retries.fetch_add(1, Ordering::Relaxed);
                let wait = backoff(attempt, salt.wrapping_add(u64::from(attempt)));
                std::thread::sleep(Duration::from_secs_f64(
                    wait.as_secs_f64() * options.backoff_scale,
                ));
            }
        }
    }
}
