//! The TeX in the doc comments survives rustdoc's Markdown and reaches KaTeX intact.
//!
//! Rustdoc renders doc comments as Markdown before the browser's KaTeX auto-render
//! (docs/katex-header.html) sees them, so inside `$...$`:
//!
//! - a backslash before ASCII punctuation is a Markdown escape and disappears: `\|` must
//!   be written `\\|`, `\,` as `\\,` (a backslash before a letter, `\sqrt`, stays);
//! - `'` becomes a typographic quote (smart punctuation): a prime is `^{\prime}`;
//! - a `*` may open emphasis: `\ast`.
//!
//! Every crate whose docs hold math also passes the header to docs.rs
//! (`[package.metadata.docs.rs]`, with `katex-header.html` in the crate).

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The doc-comment paragraphs of a source file (consecutive `///` or `//!` lines joined
/// with their line numbers), without code spans and code blocks, where `$` is no math.
fn doc_paragraphs(text: &str) -> Vec<(usize, String)> {
    let mut paragraphs = Vec::new();
    let mut current: Option<(usize, String)> = None;
    let mut in_code_block = false;
    for (number, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let doc = trimmed
            .strip_prefix("///")
            .or_else(|| trimmed.strip_prefix("//!"));
        match doc {
            Some(doc) if doc.trim().starts_with("```") => in_code_block = !in_code_block,
            Some(doc) if !in_code_block && !doc.trim().is_empty() => {
                let (_, paragraph) = current.get_or_insert((number + 1, String::new()));
                paragraph.push_str(doc);
                paragraph.push('\n');
            }
            _ => {
                if let Some(p) = current.take() {
                    paragraphs.push(p);
                }
            }
        }
    }
    paragraphs.extend(current);
    // Drop code spans (they may span lines): `$name` there is a shell variable, not math.
    paragraphs
        .into_iter()
        .map(|(line, text)| {
            let prose: Vec<&str> = text.split('`').step_by(2).collect();
            (line, prose.join(" "))
        })
        .collect()
}

/// What Markdown would do to the TeX of `math`, if anything.
fn markdown_damage(math: &str) -> Option<String> {
    let bytes = math.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if i + 1 < bytes.len() => {
                let next = bytes[i + 1];
                if next == b'\\' {
                    i += 2;
                    continue;
                }
                if next.is_ascii_punctuation() {
                    return Some(format!(
                        "`\\{}` loses its backslash (write `\\\\{}`)",
                        next as char, next as char
                    ));
                }
            }
            b'\'' => return Some("`'` becomes a typographic quote (write `^{\\prime}`)".into()),
            b'*' => return Some("`*` may open emphasis (write `\\ast`)".into()),
            _ => {}
        }
        i += 1;
    }
    None
}

#[test]
fn doc_comment_math_reaches_katex_intact() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut crates_with_math = Vec::new();
    let mut problems = Vec::new();
    let mut formulas = 0;
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        let crate_dir = entry.unwrap().path();
        let mut files = Vec::new();
        rust_files(&crate_dir.join("src"), &mut files);
        let mut has_math = false;
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for (line, paragraph) in doc_paragraphs(&text) {
                let pieces: Vec<&str> = paragraph.split('$').collect();
                if pieces.len().is_multiple_of(2) {
                    problems.push(format!("{}:{line}: an odd number of `$`", file.display()));
                    continue;
                }
                // Odd pieces are the math (`$$...$$` gives an empty piece either side).
                for math in pieces.iter().skip(1).step_by(2).filter(|m| !m.is_empty()) {
                    has_math = true;
                    formulas += 1;
                    if let Some(damage) = markdown_damage(math) {
                        problems.push(format!("{}:{line}: ${math}$: {damage}", file.display()));
                    }
                }
            }
        }
        if has_math {
            crates_with_math.push(crate_dir);
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // loraq-extract's factorization docs are the reason the header exists.
    assert!(
        formulas > 50,
        "only {formulas} formulas found: is the scan broken?"
    );
    for crate_dir in crates_with_math {
        let manifest = std::fs::read_to_string(crate_dir.join("Cargo.toml")).unwrap();
        assert!(
            manifest.contains(r#"rustdoc-args = ["--html-in-header", "katex-header.html"]"#),
            "{} has math in its docs but no KaTeX header for docs.rs",
            crate_dir.display()
        );
        let header = std::fs::read_to_string(crate_dir.join("katex-header.html")).unwrap();
        assert_eq!(
            header,
            std::fs::read_to_string(root.join("docs/katex-header.html")).unwrap()
        );
    }
}

#[test]
fn markdown_damage_is_detected() {
    assert!(markdown_damage(r"\|D\|_F").is_some());
    assert!(markdown_damage(r"s\,BA").is_some());
    assert!(markdown_damage("A' S^{-1}").is_some());
    assert!(markdown_damage(r"\rho^*(k)").is_some());
    assert!(markdown_damage(r"\\|D\\|_F + \sqrt{x} + A^{\prime} + \rho^\ast").is_none());
}
