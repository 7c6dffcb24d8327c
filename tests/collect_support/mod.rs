//! Helpers of the tests that run a real llama-server (collect, GGUF export, GGUF
//! quantize): the fixture (a tiny Qwen3.5 GGUF and a LoRA GGUF written by llama.cpp's
//! own converters), records, the one llama-server process helper (spawned, waited
//! until healthy, killed when dropped), and reading answers files.
#![allow(dead_code)] // each test file uses its own subset

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The llama-server binary named by `LORAQ_LLAMA_SERVER` (`.ci/run` builds it with
/// scripts/build-llama-server.sh and sets the variable). Without it the test is
/// skipped with a note on a developer's machine, and fails under CI (`CI` set).
pub fn llama_server() -> Option<PathBuf> {
    match std::env::var_os("LORAQ_LLAMA_SERVER") {
        Some(p) if !p.is_empty() => Some(p.into()),
        _ if std::env::var_os("CI").is_some() => {
            panic!("LORAQ_LLAMA_SERVER is not set under CI: .ci/run must build llama-server")
        }
        _ => {
            eprintln!("skipped: LORAQ_LLAMA_SERVER is not set (see .ci/run)");
            None
        }
    }
}

/// The converters kept beside the server by scripts/build-llama-server.sh:
/// `<cache>/bin/llama-server` -> `<cache>/llama.cpp`.
pub fn llama_cpp_python_side(server: &Path) -> PathBuf {
    server
        .parent()
        .and_then(Path::parent)
        .expect("llama-server under <cache>/bin")
        .join("llama.cpp")
}

/// The fixture under `dir`: `hf/` (transformers checkpoint + tokenizer), `adapter/`
/// (PEFT), `base-f32.gguf`, `adapter-f32.gguf`.
pub fn fixture(python: &Path, server: &Path, dir: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python)
        .arg(root.join("scripts/collect_fixture.py"))
        .arg("--llama-cpp")
        .arg(llama_cpp_python_side(server))
        .arg("--model")
        .arg(root.join("tests/data/model/qwen3_5"))
        .arg("--out")
        .arg(dir)
        .output()
        .expect("run the fixture script");
    assert!(
        out.status.success(),
        "collect_fixture.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `n` deterministic records over a vocabulary of 128: prompts of 1-40 tokens,
/// four options with distinct tokens, a gold option, two groups.
pub fn write_records(path: &Path, n: usize) {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |m: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % m
    };
    let mut text = String::new();
    for i in 0..n {
        let len = 1 + next(40) as usize;
        let tokens: Vec<u64> = (0..len).map(|_| next(128)).collect();
        let mut options: Vec<u64> = Vec::new();
        while options.len() < 4 {
            let t = next(128);
            if !options.contains(&t) {
                options.push(t);
            }
        }
        let gold = ["A", "B", "C", "D"][next(4) as usize];
        let group = if i % 3 == 0 { "g3" } else { "g1" };
        text.push_str(&format!(
            "{{\"id\": \"r{i}\", \"group\": \"{group}\", \"tokens\": {tokens:?}, \"options\": [\"A\", \"B\", \"C\", \"D\"], \"option_tokens\": {options:?}, \"gold\": \"{gold}\"}}\n"
        ));
    }
    std::fs::write(path, text).expect("write records");
}

/// A free local port (bound, then released for the server to take).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A llama-server process, killed when dropped.
pub struct Server {
    child: Child,
    /// Its base URL.
    pub url: String,
    /// Its log file.
    pub log: PathBuf,
}

impl Server {
    /// Starts llama-server on `port` with the fixture's base and adapter (loaded at
    /// scale 0), 2 slots, an f32 KV cache, and waits until /health answers 200.
    pub fn start(binary: &Path, dir: &Path, port: u16, log_name: &str) -> Server {
        Server::start_with(binary, dir, port, log_name, &[])
    }

    /// [`Server::start`] with more llama-server arguments.
    pub fn start_with(
        binary: &Path,
        dir: &Path,
        port: u16,
        log_name: &str,
        extra: &[&str],
    ) -> Server {
        let mut args = vec!["--lora-init-without-apply", "--alias", "fixture"];
        args.extend_from_slice(extra);
        Server::launch(
            binary,
            &dir.join("base-f32.gguf"),
            &[&dir.join("adapter-f32.gguf")],
            &dir.join(log_name),
            port,
            &args,
        )
    }

    /// Starts llama-server on `port` serving `model` with the LoRA adapters `loras`
    /// (ids 0, 1, ... in order), a context of 128, 2 slots, 2 threads, no web UI and
    /// no warm-up, its stderr in `log`, `extra` arguments after those; waits until
    /// /health answers 200 (panicking with the log if the server exits or takes more
    /// than 120 s).
    pub fn launch(
        binary: &Path,
        model: &Path,
        loras: &[&Path],
        log: &Path,
        port: u16,
        extra: &[&str],
    ) -> Server {
        let log_file = std::fs::File::create(log).expect("server log");
        let mut command = Command::new(binary);
        command.arg("-m").arg(model);
        for lora in loras {
            command.arg("--lora").arg(lora);
        }
        let child = command
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "-c",
                "128",
                "-np",
                "2",
                "--threads",
                "2",
                "--no-webui",
                "--no-warmup",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("start llama-server");
        let mut server = Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log: log.to_path_buf(),
        };
        server.wait_healthy();
        server
    }

    fn wait_healthy(&mut self) {
        let started = Instant::now();
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(2)))
            .http_status_as_error(false)
            .build()
            .into();
        while started.elapsed() < Duration::from_secs(120) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "llama-server exited ({status}) before it was healthy; its log:\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            if let Ok(r) = agent.get(format!("{}/health", self.url)).call()
                && r.status().as_u16() == 200
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "llama-server did not become healthy in 120 s; its log:\n{}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An answers file as id -> (line, log-softmax over the options), through
/// loraq-eval's reader (the one `loraq compare` uses).
pub fn read_answers(path: &Path) -> HashMap<String, Vec<f64>> {
    let mut map = HashMap::new();
    for answer in loraq_eval::AnswersReader::open(path).expect("open answers") {
        let answer = answer.expect("a valid answer");
        assert!(
            map.insert(answer.id.clone(), answer.log_probs).is_none(),
            "{}: id {} twice",
            path.display(),
            answer.id
        );
    }
    map
}

/// The largest |difference| of log-softmax over all options of all ids, and the
/// share of ids whose top option (first maximum) is the same; the two files must
/// hold the same ids.
pub fn agreement(a: &HashMap<String, Vec<f64>>, b: &HashMap<String, Vec<f64>>) -> (f64, f64) {
    assert_eq!(a.len(), b.len(), "different numbers of answers");
    let top = |v: &[f64]| {
        v.iter()
            .enumerate()
            .fold((0, f64::NEG_INFINITY), |(bi, bv), (i, x)| {
                if *x > bv { (i, *x) } else { (bi, bv) }
            })
            .0
    };
    let mut max_diff = 0f64;
    let mut same = 0usize;
    for (id, x) in a {
        let y = b
            .get(id)
            .unwrap_or_else(|| panic!("id {id} missing from the other file"));
        for (p, q) in x.iter().zip(y) {
            max_diff = max_diff.max((p - q).abs());
        }
        same += usize::from(top(x) == top(y));
    }
    (max_diff, same as f64 / a.len() as f64)
}

/// `loraq collect` of `records` from `server` (engine llama-cpp, model alias
/// "fixture", 2 requests at a time) into `out`, with the server's LoRA adapter of id
/// `lora_id` at scale 1 or with none; the answers read back ([`read_answers`]).
pub fn collect_answers(
    server: &Server,
    records: &Path,
    out: &Path,
    lora_id: Option<&str>,
) -> HashMap<String, Vec<f64>> {
    use crate::common::{loraq, ok, s};
    let mut args = vec![
        "collect",
        "--server",
        &server.url,
        "--engine",
        "llama-cpp",
        "--model",
        "fixture",
        "--records",
        s(records),
        "--out",
        s(out),
        "--concurrency",
        "2",
    ];
    if let Some(id) = lora_id {
        args.extend(["--lora-id", id, "--lora-scale", "1"]);
    }
    ok(loraq(&args));
    read_answers(out)
}

/// `loraq run` of `records` on `model` into `out` with the `extra` arguments (an
/// adapter, activation rounding, ...); the answers read back ([`read_answers`]).
pub fn run_answers(
    model: &Path,
    records: &Path,
    out: &Path,
    extra: &[&str],
) -> HashMap<String, Vec<f64>> {
    use crate::common::{loraq, ok, run_args};
    let mut args = run_args(model, records, out);
    args.extend_from_slice(extra);
    ok(loraq(&args));
    read_answers(out)
}
