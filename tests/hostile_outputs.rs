//! Outputs a hostile (or careless) user points at the wrong place: over the command's
//! own inputs or the working directory (refused even with --force), existing files
//! (refused without --force), several outputs of which one cannot be written (none
//! appears), 240-character names, stale temporaries of a killed run, and `extract
//! --copy` through symlinks. Issue 16, classes 2, 5, 6, 7, 8 and 9 (long names).

mod common;

use common::{assert_refused, data, loraq, ok, run_args, s, stderr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `loraq args` run in the working directory `cwd`.
fn loraq_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_loraq"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run loraq")
}

/// Every entry of `dir` (names, sorted).
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A tiny synthetic pair under `dir/pair`.
fn tiny_pair(dir: &Path) -> PathBuf {
    let pair = dir.join("pair");
    ok(loraq(&["synth", "--preset", "tiny", "--out", s(&pair)]));
    pair
}

/// The files under `dir` with their contents, to prove a refused command left an input
/// untouched.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.push((path.clone(), std::fs::read(&path).unwrap()));
            }
        }
    }
    files.sort();
    files
}

#[test]
fn force_never_replaces_or_wraps_an_input() {
    let dir = tempfile::tempdir().unwrap();
    let pair = tiny_pair(dir.path());
    let (base, merged) = (pair.join("base"), pair.join("merged"));
    let before = snapshot(&pair);

    // extract --out BASE --force would replace the base by the adapter.
    let o = loraq(&[
        "extract",
        "--merged",
        s(&merged),
        "--base",
        s(&base),
        "--out",
        s(&base),
        "--force",
    ]);
    assert_refused(&o, &[s(&base), "is the input", "with or without --force"]);

    // quantize --in PAIR/base --out PAIR --force would delete the sibling checkpoints.
    let o = loraq(&[
        "quantize",
        "--in",
        s(&base),
        "--out",
        s(&pair),
        "--scheme",
        "fp8-tensor",
        "--force",
    ]);
    assert_refused(&o, &[s(&pair), "contains the input", s(&base)]);

    // An output inside an input, and one spelled through a symlink to the input.
    let o = loraq(&[
        "quantize",
        "--in",
        s(&base),
        "--out",
        s(&base.join("fp8")),
        "--scheme",
        "fp8-tensor",
    ]);
    assert_refused(&o, &["lies inside the input"]);
    let link = dir.path().join("link-to-merged");
    std::os::unix::fs::symlink(&merged, &link).unwrap();
    let o = loraq(&[
        "extract",
        "--merged",
        s(&merged),
        "--base",
        s(&base),
        "--out",
        s(&link),
        "--force",
    ]);
    assert_refused(&o, &[s(&link), s(&merged)]);

    assert_eq!(snapshot(&pair), before, "an input changed");
}

#[test]
fn force_never_replaces_the_working_directory_or_its_ancestors() {
    // The input lies apart from the working directory, so only the latter is at stake.
    let inputs = tempfile::tempdir().unwrap();
    let pair = tiny_pair(inputs.path());
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    std::fs::write(work.join("keep.txt"), "mine").unwrap();
    let base = pair.join("base");
    for out in [".", s(&work), "..", s(dir.path())] {
        let o = loraq_in(
            &work,
            &[
                "quantize",
                "--in",
                s(&base),
                "--out",
                out,
                "--scheme",
                "fp8-tensor",
                "--force",
            ],
        );
        assert_refused(&o, &["the working directory"]);
        let o = loraq_in(
            &work,
            &["synth", "--preset", "tiny", "--out", out, "--force"],
        );
        assert_refused(&o, &["the working directory"]);
    }
    // The demo replaces a directory holding its marker: never the working directory.
    std::fs::write(work.join(".loraq-demo"), "written by loraq demo\n").unwrap();
    let o = loraq_in(&work, &["demo", "--out", "."]);
    assert_refused(&o, &["the working directory"]);
    assert_eq!(names(&work), [".loraq-demo", "keep.txt"]);
}

#[test]
fn file_outputs_over_their_inputs_are_refused_even_with_force() {
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records.jsonl");
    std::fs::copy(data().join("records.jsonl"), &records).unwrap();
    let original = std::fs::read(&records).unwrap();
    let model = data().join("qwen3_5");
    let mut args = run_args(&model, &records, &records);
    args.push("--force");
    let o = loraq(&args);
    assert_refused(&o, &[s(&records), "is the input"]);
    assert_eq!(std::fs::read(&records).unwrap(), original);

    let reference = dir.path().join("reference.jsonl");
    ok(loraq(&run_args(&model, &records, &reference)));
    let answers = std::fs::read(&reference).unwrap();
    for flag in ["--json", "--markdown", "--plot"] {
        let o = loraq(&[
            "compare",
            "--reference",
            s(&reference),
            "--candidate",
            s(&reference),
            flag,
            s(&reference),
            "--force",
        ]);
        assert_refused(&o, &[s(&reference), "is the input"]);
    }
    assert_eq!(std::fs::read(&reference).unwrap(), answers);
}

#[test]
fn existing_file_outputs_are_refused_without_force() {
    let dir = tempfile::tempdir().unwrap();
    let (model, records) = (data().join("qwen3_5"), data().join("records.jsonl"));
    let answers = dir.path().join("answers.jsonl");
    std::fs::write(&answers, "precious\n").unwrap();
    let run = |extra: &[&str]| {
        let mut args = run_args(&model, &records, &answers);
        args.extend_from_slice(extra);
        loraq(&args)
    };
    assert_refused(&run(&[]), &[s(&answers), "already exists", "--force"]);
    assert_eq!(std::fs::read_to_string(&answers).unwrap(), "precious\n");
    ok(run(&["--force"]));
    assert!(
        std::fs::read_to_string(&answers)
            .unwrap()
            .starts_with("{\"id\"")
    );

    let report = dir.path().join("report.json");
    std::fs::write(&report, "precious\n").unwrap();
    let compare = |extra: &[&str]| {
        let mut args = vec![
            "compare",
            "--reference",
            s(&answers),
            "--candidate",
            s(&answers),
        ];
        args.extend_from_slice(&["--json", s(&report)]);
        args.extend_from_slice(extra);
        loraq(&args)
    };
    assert_refused(&compare(&[]), &[s(&report), "already exists"]);
    assert_eq!(std::fs::read_to_string(&report).unwrap(), "precious\n");
    ok(compare(&["--force"]));
    assert!(std::fs::read_to_string(&report).unwrap().starts_with('{'));
    assert_eq!(names(dir.path()), ["answers.jsonl", "report.json"]);
}

#[test]
fn several_outputs_appear_all_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let (model, records) = (data().join("qwen3_5"), data().join("records.jsonl"));
    let answers = dir.path().join("ans.jsonl");
    // --collect-stats names a directory: a file can never be written there.
    let unwritable = dir.path().join("stats");
    std::fs::create_dir(&unwritable).unwrap();
    std::fs::write(unwritable.join("keep"), "x").unwrap();
    for force in [false, true] {
        let mut args = run_args(&model, &records, &answers);
        args.extend_from_slice(&["--collect-stats", s(&unwritable)]);
        if force {
            args.push("--force");
        }
        let o = loraq(&args);
        assert_refused(&o, &["--collect-stats", s(&unwritable)]);
        assert_eq!(
            names(dir.path()),
            ["stats"],
            "force {force}: partial output"
        );
    }
    // A forced run whose second output fails keeps the first output's old content.
    std::fs::write(&answers, "old answers\n").unwrap();
    let o = loraq(&[
        "run",
        "--model",
        s(&model),
        "--records",
        s(&records),
        "--out",
        s(&answers),
        "--hidden-out",
        s(&dir.path().join("missing-dir/hidden.safetensors")),
        "--force",
    ]);
    assert_refused(&o, &["--hidden-out"]);
    assert_eq!(std::fs::read_to_string(&answers).unwrap(), "old answers\n");
    assert_eq!(names(dir.path()), ["ans.jsonl", "stats"]);

    // compare: the plot cannot be written, so neither is the JSON report.
    let report = dir.path().join("report.json");
    let o = loraq(&[
        "compare",
        "--reference",
        s(&data().join("expected-qwen3_5.jsonl")),
        "--candidate",
        s(&data().join("expected-qwen3_5.jsonl")),
        "--json",
        s(&report),
        "--plot",
        s(&unwritable),
    ]);
    assert_refused(&o, &["--plot", s(&unwritable)]);
    assert!(!report.exists());
}

#[test]
fn a_240_character_output_name_works() {
    let dir = tempfile::tempdir().unwrap();
    let long = "a".repeat(240);
    let pair = dir.path().join(&long);
    ok(loraq(&["synth", "--preset", "tiny", "--out", s(&pair)]));
    ok(loraq(&[
        "synth",
        "--preset",
        "tiny",
        "--out",
        s(&pair),
        "--force",
    ]));
    let answers = dir.path().join(format!("{}.jsonl", "b".repeat(234)));
    ok(loraq(&run_args(
        &data().join("qwen3_5"),
        &data().join("records.jsonl"),
        &answers,
    )));
    assert_eq!(
        names(dir.path()),
        [long, answers.file_name().unwrap().to_string_lossy().into()]
    );
}

#[test]
fn stale_temporaries_of_a_killed_run_are_reported_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pair");
    // A pid above Linux's pid_max (2^22) is never running: what a killed run left.
    let dead_tmp = dir.path().join(".pair.loraq-tmp-4999999-17");
    std::fs::create_dir(&dead_tmp).unwrap();
    std::fs::write(dead_tmp.join("partial.safetensors"), "x").unwrap();
    let dead_old = dir.path().join(".pair.loraq-old-4999998-3");
    std::fs::create_dir(&dead_old).unwrap();
    // pid 1 runs: another writer's temporary is reported and left alone.
    let live = dir.path().join(".pair.loraq-tmp-1-5");
    std::fs::create_dir(&live).unwrap();
    let o = ok(loraq(&["synth", "--preset", "tiny", "--out", s(&out)]));
    let text = stderr(&o);
    for path in [&dead_tmp, &dead_old] {
        assert!(
            text.contains(&format!("{}: left by loraq process", path.display())),
            "{text}"
        );
        assert!(!path.exists(), "{} not removed", path.display());
    }
    assert!(
        text.contains(&format!("{}: belongs to running process 1", live.display())),
        "{text}"
    );
    assert!(live.exists());
    assert_eq!(names(dir.path()), [".pair.loraq-tmp-1-5", "pair"]);

    // The same for a file output (run) and a forced directory replace (quantize).
    let answers = dir.path().join("answers.jsonl");
    let stale = dir.path().join(".answers.jsonl.loraq-tmp-4999999-1");
    std::fs::write(&stale, "partial").unwrap();
    let o = ok(loraq(&run_args(
        &data().join("qwen3_5"),
        &data().join("records.jsonl"),
        &answers,
    )));
    assert!(
        stderr(&o).contains("left by loraq process 4999999"),
        "{}",
        stderr(&o)
    );
    assert!(!stale.exists());
    let quantized = dir.path().join("q");
    let base = out.join("base");
    let quantize = |extra: &[&str]| {
        let mut args = vec!["quantize", "--in", s(&base), "--out", s(&quantized)];
        args.extend_from_slice(&["--scheme", "fp8-tensor"]);
        args.extend_from_slice(extra);
        ok(loraq(&args))
    };
    quantize(&[]);
    let stale = dir.path().join(".q.loraq-old-4999999-9");
    std::fs::create_dir(&stale).unwrap();
    let o = quantize(&["--force"]);
    assert!(
        stderr(&o).contains("left by loraq process 4999999"),
        "{}",
        stderr(&o)
    );
    assert!(!stale.exists() && quantized.join("config.json").is_file());
}

#[test]
fn extract_copy_follows_no_directory_symlink_and_nothing_outside_the_merge() {
    let dir = tempfile::tempdir().unwrap();
    let pair = tiny_pair(dir.path());
    let (base, merged) = (pair.join("base"), pair.join("merged"));
    std::fs::write(merged.join("LICENSE"), "Apache-2.0\n").unwrap();
    // A link to the merged directory itself: followed, the walk repeats every file
    // down to the kernel's symlink limit (two such links make it exponential).
    std::os::unix::fs::symlink(".", merged.join("loop-a")).unwrap();
    let out = dir.path().join("adapter");
    let o = ok(loraq(&[
        "extract",
        "--merged",
        s(&merged),
        "--base",
        s(&base),
        "--out",
        s(&out),
        "--rank",
        "8",
        "--copy",
        "**LICENSE",
        "--json",
    ]));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["copied"], serde_json::json!(["LICENSE"]));
    assert!(!out.join("loop-a").exists());

    // A matched file that resolves outside the merged directory is refused.
    let secret = dir.path().join("secret.txt");
    std::fs::write(&secret, "not for the adapter").unwrap();
    std::os::unix::fs::symlink(&secret, merged.join("NOTICE")).unwrap();
    let out2 = dir.path().join("adapter2");
    let o = loraq(&[
        "extract",
        "--merged",
        s(&merged),
        "--base",
        s(&base),
        "--out",
        s(&out2),
        "--rank",
        "8",
        "--copy",
        "NOTICE",
    ]);
    assert_refused(&o, &["NOTICE", "outside the merged directory"]);
    assert!(!out2.exists());

    // A Hugging Face cache snapshot links its files into the repo's blobs/: copied.
    let repo = dir.path().join("hub/models--org--merged");
    let snapshot = repo.join("snapshots/0123abc");
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    for entry in std::fs::read_dir(&merged).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            let blob = repo.join("blobs").join(entry.file_name());
            std::fs::copy(entry.path(), &blob).unwrap();
            let target = Path::new("../../blobs").join(entry.file_name());
            std::os::unix::fs::symlink(target, snapshot.join(entry.file_name())).unwrap();
        }
    }
    let out3 = dir.path().join("adapter3");
    let o = ok(loraq(&[
        "extract",
        "--merged",
        s(&snapshot),
        "--base",
        s(&base),
        "--out",
        s(&out3),
        "--rank",
        "8",
        "--copy",
        "LICENSE",
        "--json",
    ]));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["copied"], serde_json::json!(["LICENSE"]));
    assert_eq!(
        std::fs::read_to_string(out3.join("LICENSE")).unwrap(),
        "Apache-2.0\n"
    );
}
