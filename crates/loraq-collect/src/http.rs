//! A blocking HTTP/1.1 JSON client (ureq) with a per-request timeout, and the
//! classification of failures into worth retrying or not.

use serde_json::Value;
use std::time::Duration;

/// Largest response body read, in bytes: a request for a few options' values is a
/// few kilobytes; a server answering with gigabytes is refused, not buffered.
pub const MAX_RESPONSE_BYTES: u64 = 64 << 20;

/// How one request failed.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// Worth another attempt: no connection, a timeout, HTTP 429 or 5xx.
    Transient(String),
    /// Retrying cannot help: another HTTP status, or a body that is not JSON.
    Permanent(String),
}

impl Failure {
    /// The message.
    pub fn message(&self) -> &str {
        match self {
            Failure::Transient(m) | Failure::Permanent(m) => m,
        }
    }
}

/// A JSON client of one server.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
    base: String,
}

impl Client {
    /// A client of the server at `base` (`http://host:port`, no trailing slash
    /// needed), each request limited to `timeout`.
    pub fn new(base: &str, timeout: Duration) -> Client {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        Client {
            agent,
            base: base.trim_end_matches('/').to_string(),
        }
    }

    /// The server's base URL, as errors name it.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `GET path`, the body parsed as JSON.
    pub fn get(&self, path: &str) -> std::result::Result<Value, Failure> {
        let response = self.agent.get(format!("{}{path}", self.base)).call();
        read(response)
    }

    /// `POST path` with a JSON body, the answer parsed as JSON.
    pub fn post(&self, path: &str, body: &Value) -> std::result::Result<Value, Failure> {
        let response = self
            .agent
            .post(format!("{}{path}", self.base))
            .send_json(body);
        read(response)
    }
}

fn read(
    response: std::result::Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> std::result::Result<Value, Failure> {
    let mut response = response.map_err(|e| Failure::Transient(e.to_string()))?;
    let status = response.status().as_u16();
    let text = response
        .body_mut()
        .with_config()
        .limit(MAX_RESPONSE_BYTES)
        .read_to_string()
        .map_err(|e| Failure::Transient(format!("HTTP {status}, reading the body: {e}")))?;
    if status == 429 || (500..600).contains(&status) {
        return Err(Failure::Transient(format!(
            "HTTP {status}: {}",
            loraq_io::limits::elide(&text)
        )));
    }
    if !(200..300).contains(&status) {
        return Err(Failure::Permanent(format!(
            "HTTP {status}: {}",
            loraq_io::limits::elide(&text)
        )));
    }
    serde_json::from_str(&text).map_err(|e| {
        Failure::Permanent(format!(
            "the body is not JSON ({e}): {}",
            loraq_io::limits::elide(&text)
        ))
    })
}

/// Wait before attempt `attempt` (1-based count of failures so far): 0.5 s doubled
/// each time, at most 30 s, plus up to a quarter of it derived from `salt` so that
/// workers that failed together do not retry together.
pub fn backoff(attempt: u32, salt: u64) -> Duration {
    let base_ms = 500u64.saturating_mul(1u64 << attempt.saturating_sub(1).min(6));
    let base_ms = base_ms.min(30_000);
    let jitter = salt
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(attempt % 64)
        % (base_ms / 4 + 1);
    Duration::from_millis(base_ms + jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_capped() {
        assert!(backoff(1, 0) >= Duration::from_millis(500));
        assert!(backoff(1, 7) <= Duration::from_millis(625));
        assert!(backoff(2, 3) >= Duration::from_millis(1000));
        assert!(backoff(20, 9) <= Duration::from_millis(37_500));
        assert!(backoff(20, 9) >= Duration::from_millis(30_000));
    }
}
