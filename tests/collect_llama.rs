//! `loraq collect` against a real llama-server (built by scripts/build-llama-server.sh,
//! named by LORAQ_LLAMA_SERVER) serving a tiny Qwen3.5 GGUF and a LoRA GGUF written
//! by llama.cpp's own converters from the same weights `loraq run` reads: the base and
//! the adapter answers must agree with `loraq run`'s, a killed server or a killed
//! collect must resume to the same answers with every record exactly once.

mod collect_support;
mod common;

use collect_support::*;
use common::{loraq, ok, oracle_python, s, stderr};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Records in the agreement test.
const RECORDS: usize = 300;

/// Largest |difference| of per-option log-softmax allowed between llama.cpp and
/// `loraq run` on the same f32 weights (docs/collect.md, "Agreement with loraq run").
const LOG_SOFTMAX_TOLERANCE: f64 = 2.5e-2;

fn collect_args<'a>(server: &'a str, records: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "collect",
        "--server",
        server,
        "--engine",
        "llama-cpp",
        "--model",
        "fixture",
        "--records",
        records,
        "--out",
        out,
    ]
}

#[test]
fn llama_server_answers_agree_with_loraq_run_on_the_base_and_the_adapter() {
    let Some(binary) = llama_server() else { return };
    let Some(python) = oracle_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fixture(&python, &binary, d);
    let records = d.join("records.jsonl");
    write_records(&records, RECORDS);
    let server = Server::start(&binary, d, free_port(), "server.log");

    // loraq run on the safetensors the GGUFs were converted from.
    let (hf, adapter) = (d.join("hf"), d.join("adapter"));
    ok(loraq(&[
        "run",
        "--model",
        s(&hf),
        "--records",
        s(&records),
        "--out",
        s(&d.join("run-base.jsonl")),
    ]));
    ok(loraq(&[
        "run",
        "--model",
        s(&hf),
        "--adapter",
        s(&adapter),
        "--records",
        s(&records),
        "--out",
        s(&d.join("run-lora.jsonl")),
    ]));

    let base_out = d.join("llama-base.jsonl");
    let mut args = collect_args(&server.url, s(&records), s(&base_out));
    args.extend(["--concurrency", "3", "--json"]);
    let o = ok(loraq(&args));
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary["written"], RECORDS, "{summary}");
    assert_eq!(summary["incomplete"], 0, "{summary}");

    // The standard API only (llama-server's /v1/completions): the full-vocabulary
    // top-k keyed by token text, options matched through the tokenizer. It can name
    // neither adapter scales nor cache_prompt, so it gets a server of its own: the
    // adapter at global scale 0 and no prompt cache (with the cache, 3% of these
    // random prompts came back wrong on this hybrid model: docs/collect.md).
    let plain = Server::start_with(
        &binary,
        d,
        free_port(),
        "server-openai.log",
        &["--no-cache-prompt"],
    );
    let set = ureq::post(format!("{}/lora-adapters", plain.url))
        .send_json(serde_json::json!([{"id": 0, "scale": 0.0}]))
        .unwrap();
    assert_eq!(set.status().as_u16(), 200);
    let tokenizer = hf.join("tokenizer.json");
    let openai_out = d.join("openai-base.jsonl");
    // The OpenAI-compatible engine with a top-k of `top`, its --json summary returned.
    let collect_openai = |top: &str, out: &Path| -> serde_json::Value {
        let o = ok(loraq(&[
            "collect",
            "--server",
            &plain.url,
            "--engine",
            "openai",
            "--model",
            "fixture",
            "--tokenizer",
            s(&tokenizer),
            "--top-logprobs",
            top,
            "--records",
            s(&records),
            "--out",
            s(out),
            "--json",
        ]));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let summary = collect_openai("128", &openai_out);
    assert_eq!(summary["written"], RECORDS, "{summary}");
    let (openai_diff, openai_same) = agreement(
        &read_answers(&d.join("run-base.jsonl")),
        &read_answers(&openai_out),
    );
    eprintln!(
        "openai engine vs run (base): max |d log-softmax| {openai_diff:.3e}, same top {openai_same}"
    );
    assert!(
        openai_same >= 0.99 && openai_diff <= LOG_SOFTMAX_TOLERANCE,
        "{openai_diff} {openai_same}"
    );
    // With a top-3, options outside it are missing, not guessed.
    let top3 = d.join("openai-top3.jsonl");
    let summary = collect_openai("3", &top3);
    let (written, incomplete) = (
        summary["written"].as_u64().unwrap(),
        summary["incomplete"].as_u64().unwrap(),
    );
    assert!(
        incomplete > 0 && written + incomplete == RECORDS as u64,
        "{summary}"
    );
    assert_eq!(
        lines(&d.join("openai-top3.jsonl.incomplete.jsonl")),
        incomplete as usize
    );

    drop(plain);
    let lora_out = d.join("llama-lora.jsonl");
    let mut args = collect_args(&server.url, s(&records), s(&lora_out));
    args.extend(["--lora-id", "0", "--lora-scale", "1", "--concurrency", "3"]);
    ok(loraq(&args));

    let header: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(d.join("llama-lora.jsonl.collect.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(header["engine"], "llama-cpp");
    assert_eq!(header["lora_id"], 0);
    assert!(
        header["server_version"]
            .as_str()
            .unwrap()
            .starts_with("llama.cpp "),
        "{header}"
    );

    let run_base = read_answers(&d.join("run-base.jsonl"));
    let run_lora = read_answers(&d.join("run-lora.jsonl"));
    let llama_base = read_answers(&base_out);
    let llama_lora = read_answers(&lora_out);
    let (base_diff, base_same) = agreement(&run_base, &llama_base);
    let (lora_diff, lora_same) = agreement(&run_lora, &llama_lora);
    // The adapter must move the answers far more than the engines differ, or the
    // agreement would not show that llama.cpp applied it.
    let (adapter_effect, adapter_same) = agreement(&run_base, &run_lora);
    eprintln!(
        "collect vs run: base max |d log-softmax| {base_diff:.3e}, same top {base_same}; adapter {lora_diff:.3e}, same top {lora_same}; adapter's own effect {adapter_effect:.3e}, same top {adapter_same}"
    );
    assert!(
        base_same >= 0.99 && lora_same >= 0.99,
        "top-option agreement {base_same} / {lora_same}"
    );
    assert!(base_diff <= LOG_SOFTMAX_TOLERANCE, "base: {base_diff}");
    assert!(lora_diff <= LOG_SOFTMAX_TOLERANCE, "adapter: {lora_diff}");
    assert!(
        adapter_effect > 20.0 * LOG_SOFTMAX_TOLERANCE && adapter_same < 0.95,
        "the adapter changes little: {adapter_effect}, same top {adapter_same}"
    );

    // compare reads the collected files as they are.
    let o = ok(loraq(&[
        "compare",
        "--reference",
        s(&d.join("run-lora.jsonl")),
        "--candidate",
        s(&lora_out),
        "--json",
        "-",
    ]));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["n"], RECORDS);
    assert!(report["flip_rate"].as_f64().unwrap() <= 0.01, "{report}");

    // A re-run finds everything done and sends nothing.
    let mut args = collect_args(&server.url, s(&records), s(&lora_out));
    args.extend(["--lora-id", "0", "--json"]);
    let o = ok(loraq(&args));
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary["already_done"], RECORDS, "{summary}");
    assert_eq!(summary["requests"], 0, "{summary}");

    // Another setup on the same --out is refused, naming the field.
    let mut args = collect_args(&server.url, s(&records), s(&lora_out));
    args.extend(["--lora-id", "0", "--lora-scale", "0.5"]);
    let o = loraq(&args);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("lora_scale was Some(1.0)"),
        "{}",
        stderr(&o)
    );

    // A model the server does not serve, an adapter id it does not have.
    let x = d.join("x.jsonl");
    let mut args = collect_args(&server.url, s(&records), s(&x));
    args[6] = "other";
    let o = loraq(&args);
    assert!(
        stderr(&o).contains("does not serve model \"other\""),
        "{}",
        stderr(&o)
    );
    let mut args = collect_args(&server.url, s(&records), s(&x));
    args.extend(["--lora-id", "3"]);
    let o = loraq(&args);
    assert!(
        stderr(&o).contains("no adapter with id 3"),
        "{}",
        stderr(&o)
    );
    drop(server);
}

/// Lines of a file (0 when absent).
fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.lines().count())
}

/// Starts `loraq collect` in the background.
fn spawn_collect(args: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_loraq"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start loraq collect")
}

fn wait_for_lines(path: &Path, n: usize) {
    let started = Instant::now();
    while lines(path) < n {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "{} never reached {n} lines",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_server_or_a_killed_collect_resumes_to_the_uninterrupted_answers() {
    let Some(binary) = llama_server() else { return };
    let Some(python) = oracle_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fixture(&python, &binary, d);
    let records = d.join("records.jsonl");
    let n = 240;
    write_records(&records, n);
    let port = free_port();
    let server = Server::start(&binary, d, port, "server-1.log");
    let url = server.url.clone();
    let lora = ["--lora-id", "0", "--concurrency", "2"];

    // The uninterrupted run.
    let whole = d.join("whole.jsonl");
    let mut args = collect_args(&server.url, s(&records), s(&whole));
    args.extend(lora);
    ok(loraq(&args));

    // The server is killed mid-run: collect gives up after its attempts (the
    // answers it had stay), the server comes back, the same command completes.
    let cut = d.join("server-killed.jsonl");
    let mut args = collect_args(&url, s(&records), s(&cut));
    args.extend(lora);
    args.extend(["--attempts", "2"]);
    let child = spawn_collect(&args);
    wait_for_lines(&cut, 60);
    server.kill();
    let o = child.wait_with_output().unwrap();
    assert!(
        !o.status.success(),
        "collect finished although the server was killed"
    );
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("gave up after 2 attempt(s)")
            && e.contains("run the same command again to resume"),
        "{e}"
    );
    let before = lines(&cut);
    assert!(before >= 60 && before < n, "{before} lines after the kill");
    let server = Server::start(&binary, d, port, "server-2.log");
    let o = ok(loraq(&[&args[..], &["--json"]].concat()));
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary["already_done"], before, "{summary}");
    assert_eq!(summary["written"], n - before, "{summary}");

    // collect itself is killed (SIGKILL) mid-run, then run again.
    let killed = d.join("collect-killed.jsonl");
    let mut args = collect_args(&url, s(&records), s(&killed));
    args.extend(lora);
    let mut child = spawn_collect(&args);
    wait_for_lines(&killed, 60);
    child.kill().unwrap();
    child.wait().unwrap();
    ok(loraq(&args));

    let whole = read_answers(&whole);
    for resumed in [&cut, &killed] {
        // read_answers refuses an id twice; agreement needs the same ids.
        let answers = read_answers(resumed);
        assert_eq!(answers.len(), n, "{}", resumed.display());
        let (diff, same) = agreement(&whole, &answers);
        eprintln!(
            "{}: max |d log-softmax| against the uninterrupted run {diff:.3e}, same top {same}",
            resumed.display()
        );
        assert_eq!(same, 1.0, "{}", resumed.display());
        assert!(diff <= 1e-3, "{}: {diff}", resumed.display());
    }
    drop(server);
}
