//! `loraq collect --engine vllm` against a stand-in server that answers with the
//! vLLM response bodies under tests/data/collect/vllm/ (written from vLLM 0.33's
//! response models, docs/collect.md says which): the requests loraq sends, the
//! answers it writes, retries on 503, the refusals. There is no GPU here to run vLLM
//! itself; scripts/gpu-check.sh runs the real thing.

mod common;

use common::{loraq, ok, s, stderr};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

fn recorded(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/collect/vllm")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// The log-probability the stand-in gives token `id`: distinct per id, always < 0.
fn rule(id: u64) -> f64 {
    -0.05 - 0.1 * (id % 50) as f64
}

/// How the stand-in answers /v1/completions.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// 503 to every third request, the recorded completion otherwise.
    Flaky,
    /// The recorded 400 error.
    BadRequest,
    /// A body that is not JSON.
    Garbage,
}

/// A stand-in vLLM server on a free port; every request body it got is kept.
struct Standin {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

fn respond(stream: &mut TcpStream, status: u16, body: &str) {
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

fn serve(mode: Mode) -> Standin {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let kept = bodies.clone();
    std::thread::spawn(move || {
        let mut completions = 0u64;
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request_line = String::new();
            reader.read_line(&mut request_line).unwrap();
            let mut length = 0usize;
            loop {
                let mut h = String::new();
                reader.read_line(&mut h).unwrap();
                if h == "\r\n" || h.is_empty() {
                    break;
                }
                if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap();
                }
            }
            let mut body = vec![0u8; length];
            reader.read_exact(&mut body).unwrap();
            let body: Value = if length > 0 {
                serde_json::from_slice(&body).unwrap()
            } else {
                Value::Null
            };
            let path = request_line
                .split_whitespace()
                .nth(1)
                .unwrap_or("")
                .to_string();
            match path.as_str() {
                "/v1/models" => respond(&mut stream, 200, &recorded("models.json").to_string()),
                "/version" => respond(&mut stream, 200, &recorded("version.json").to_string()),
                "/detokenize" => {
                    // The ids as text, one character each, which /tokenize reads back.
                    let mut answer = recorded("detokenize.json");
                    let text: String = body["tokens"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| char::from_u32(0x100 + t.as_u64().unwrap() as u32).unwrap())
                        .collect();
                    answer["prompt"] = json!(text);
                    respond(&mut stream, 200, &answer.to_string());
                }
                "/tokenize" => {
                    let mut answer = recorded("tokenize.json");
                    let ids: Vec<u32> = body["prompt"]
                        .as_str()
                        .unwrap()
                        .chars()
                        .map(|c| c as u32 - 0x100)
                        .collect();
                    answer["count"] = json!(ids.len());
                    answer["tokens"] = json!(ids);
                    respond(&mut stream, 200, &answer.to_string());
                }
                "/v1/completions" => {
                    kept.lock().unwrap().push(body.clone());
                    completions += 1;
                    match mode {
                        Mode::BadRequest => {
                            respond(&mut stream, 400, &recorded("error-400.json").to_string())
                        }
                        Mode::Garbage => respond(&mut stream, 200, "<html>proxy error</html>"),
                        Mode::Flaky if completions % 3 == 1 => {
                            respond(&mut stream, 503, "{\"error\": \"busy\"}")
                        }
                        Mode::Flaky => {
                            let mut answer = recorded("completion.json");
                            let top: serde_json::Map<String, Value> = body["logprob_token_ids"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .map(|t| {
                                    (
                                        format!("token_id:{}", t.as_u64().unwrap()),
                                        json!(rule(t.as_u64().unwrap())),
                                    )
                                })
                                .collect();
                            answer["choices"][0]["logprobs"]["top_logprobs"][0] =
                                Value::Object(top);
                            answer["usage"]["prompt_tokens"] =
                                json!(body["prompt"].as_array().unwrap().len());
                            respond(&mut stream, 200, &answer.to_string());
                        }
                    }
                }
                _ => respond(&mut stream, 404, "{\"detail\": \"Not Found\"}"),
            }
        }
    });
    Standin { url, bodies }
}

fn records(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("records.jsonl");
    let mut text = String::new();
    for i in 0..12u64 {
        let tokens: Vec<u64> = (0..1 + i % 5).map(|k| (i * 7 + k * 3) % 100).collect();
        let options: Vec<u64> = (0..4).map(|k| 10 + (i + k * 13) % 90).collect();
        text.push_str(&format!(
            "{{\"id\": \"v{i}\", \"tokens\": {tokens:?}, \"options\": [\"A\", \"B\", \"C\", \"D\"], \"option_tokens\": {options:?}, \"gold\": \"A\"}}\n"
        ));
    }
    std::fs::write(&path, text).unwrap();
    path
}

fn args<'a>(url: &'a str, records: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "collect",
        "--server",
        url,
        "--engine",
        "vllm",
        "--model",
        "Qwen/Qwen3.8-27B-FP8",
        "--adapter",
        "adapter",
        "--records",
        records,
        "--out",
        out,
        "--concurrency",
        "2",
    ]
}

#[test]
fn vllm_requests_and_answers_follow_the_recorded_protocol_and_503s_are_retried() {
    let standin = serve(Mode::Flaky);
    let dir = tempfile::tempdir().unwrap();
    let records = records(dir.path());
    let out = dir.path().join("answers.jsonl");
    let o = ok(loraq(
        &[&args(&standin.url, s(&records), s(&out))[..], &["--json"]].concat(),
    ));
    let summary: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary["written"], 12, "{summary}");
    assert!(summary["retries"].as_u64().unwrap() >= 4, "{summary}");

    // Every request: the adapter's name, the prompt's ids, the option ids, the flags
    // that make vLLM return them keyed by id.
    let record_lines: Vec<Value> = std::fs::read_to_string(&records)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let bodies = standin.bodies.lock().unwrap().clone();
    for r in &record_lines {
        let sent = bodies
            .iter()
            .find(|b| b["prompt"] == r["tokens"])
            .expect("a request per record");
        assert_eq!(sent["model"], "adapter");
        assert_eq!(sent["logprob_token_ids"], r["option_tokens"]);
        assert_eq!(sent["logprobs"], 1);
        assert_eq!(sent["max_tokens"], 1);
        assert_eq!(sent["return_tokens_as_token_ids"], true);
    }
    // The answers hold the values the server gave, per option, in option order.
    for line in std::fs::read_to_string(&out).unwrap().lines() {
        let a: Value = serde_json::from_str(line).unwrap();
        let r = record_lines.iter().find(|r| r["id"] == a["id"]).unwrap();
        let expected: Vec<f64> = r["option_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| rule(t.as_u64().unwrap()))
            .collect();
        // serde_json's default float parser may be 1 ulp off the shortest printing.
        let got: Vec<f64> = a["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), expected.len(), "{line}");
        for (g, e) in got.iter().zip(&expected) {
            assert!((g - e).abs() <= 1e-12, "{line}: {g} vs {e}");
        }
        assert_eq!(a["gold"], "A");
    }
    let header: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("answers.jsonl.collect.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(header["server_version"], "vllm 0.33.0");
    assert_eq!(header["adapter"], "adapter");
}

#[test]
fn vllm_refusals_name_the_server_the_request_and_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let records = records(dir.path());

    let standin = serve(Mode::BadRequest);
    let out = dir.path().join("a.jsonl");
    let o = loraq(&args(&standin.url, s(&records), s(&out)));
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("POST /v1/completions for record \"v")
            && e.contains("HTTP 400")
            && e.contains("logprobs` must be set"),
        "{e}"
    );

    let standin = serve(Mode::Garbage);
    let out = dir.path().join("b.jsonl");
    let o = loraq(&args(&standin.url, s(&records), s(&out)));
    let e = stderr(&o);
    assert!(
        e.contains("the body is not JSON") && e.contains("proxy error"),
        "{e}"
    );

    let standin = serve(Mode::Flaky);
    let out = dir.path().join("c.jsonl");
    let mut a = args(&standin.url, s(&records), s(&out));
    a[8] = "other-adapter";
    let e = stderr(&loraq(&a));
    assert!(
        e.contains("does not serve adapter \"other-adapter\"") && e.contains("--lora-modules"),
        "{e}"
    );

    // Nothing listens: connection errors are retried, then reported.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let e = stderr(&loraq(&args(&url, s(&records), s(&out))));
    assert!(e.contains("GET /v1/models"), "{e}");
}
