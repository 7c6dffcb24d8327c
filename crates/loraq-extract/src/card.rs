//! The model card (README.md) `loraq extract` writes into the adapter directory, in the
//! shape of published adapter cards: YAML front matter the Hub reads (base_model,
//! library_name, tags), then source and base, modules and ranks, the residual against
//! the bf16 floor, the quantization-aware target, how to load it in PEFT with the class
//! whose module names match, how to serve it in vLLM, and the license files copied.
//!
//! Rendered from the typed [`ExtractionReport`], never from its JSON, so a renamed field
//! fails to compile instead of printing a blank.

use crate::report::{ExtractionReport, ModuleReport};
use loraq_io::module_name::MULTIMODAL_TEXT_PREFIX;
use loraq_io::{AdapterNaming, ModuleName};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// How many of the worst modules the card lists.
const WORST_MODULES_LISTED: usize = 5;

/// A YAML double-quoted scalar (backslash and quote escaped, control characters as
/// `\uXXXX`), so that any id or path stays one valid value.
fn yaml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A Python string literal (repr-style, double-quoted).
fn python_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A shell word: unchanged when it is made of safe characters, else single-quoted.
fn shell_word(s: &str) -> String {
    let safe = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@+,".contains(c));
    if safe {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Layers as ranges: `[0, 1, 2, 5]` -> `0-2, 5`.
fn layer_ranges(layers: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            layers[i].to_string()
        } else {
            format!("{}-{}", layers[i], layers[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// The order statistic at fraction `q` of sorted values (nearest rank).
fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// One row of the modules table: the module kind (block.module), its layers, shape and
/// written rank.
struct ModuleGroup {
    layers: Vec<usize>,
    count: usize,
}

fn module_groups(report: &ExtractionReport) -> BTreeMap<(String, [usize; 2], usize), ModuleGroup> {
    let rows = report
        .modules
        .iter()
        .map(|m| (&m.module, m.shape, m.adapter_rank))
        .chain(
            report
                .corrections
                .iter()
                .map(|c| (&c.module, c.shape, c.adapter_rank)),
        );
    let mut groups: BTreeMap<(String, [usize; 2], usize), ModuleGroup> = BTreeMap::new();
    for (module, shape, rank) in rows {
        let (kind, layer) = match ModuleName::parse(&format!("{module}.weight")) {
            Some(n) => (
                format!("{}.{}", n.block.as_str(), n.kind.as_str()),
                Some(n.layer),
            ),
            None => (module.clone(), None),
        };
        let group = groups.entry((kind, shape, rank)).or_insert(ModuleGroup {
            layers: Vec::new(),
            count: 0,
        });
        group.count += 1;
        group.layers.extend(layer);
    }
    for g in groups.values_mut() {
        g.layers.sort_unstable();
        g.layers.dedup();
    }
    groups
}

fn residual_section(out: &mut String, report: &ExtractionReport) {
    let _ = writeln!(out, "## Fidelity\n");
    if report.modules.is_empty() {
        let _ = writeln!(out, "No module of the merge was factored.\n");
        return;
    }
    let _ = writeln!(
        out,
        "Each module's residual ||merged - (base + BA)|| over the bf16 rounding floor of the merged weight \
         (the error the merge's own bf16 rounding left; 1 = at the floor, where no adapter can do better). \
         The truncation residual uses the f32 factors; the second row adds the bf16 cast of the factors as written. \
         Refusal threshold: {} x floor.\n",
        report.max_residual_ratio
    );
    let sorted = |f: &dyn Fn(&ModuleReport) -> f64| -> Vec<f64> {
        let mut v: Vec<f64> = report.modules.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let _ = writeln!(out, "| residual / floor | min | median | max |");
    let _ = writeln!(out, "|---|---:|---:|---:|");
    for (label, values) in [
        (
            "truncation (f32 factors)",
            sorted(&|m: &ModuleReport| m.ratio),
        ),
        (
            "after the bf16 cast",
            sorted(&|m: &ModuleReport| m.ratio_after_cast),
        ),
    ] {
        let _ = writeln!(
            out,
            "| {label} | {:.4} | {:.4} | {:.4} |",
            values[0],
            nearest_rank(&values, 0.5),
            values[values.len() - 1]
        );
    }
    let mut worst: Vec<&ModuleReport> = report.modules.iter().collect();
    worst.sort_by(|a, b| b.ratio.total_cmp(&a.ratio));
    worst.truncate(WORST_MODULES_LISTED);
    let _ = writeln!(out, "\nWorst modules:\n");
    let _ = writeln!(
        out,
        "| module | shape | rank | residual / floor | after cast / floor | expected at the floor |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|");
    for m in worst {
        let _ = writeln!(
            out,
            "| `{}` | {}x{} | {} | {:.4} | {:.4} | {:.4} |",
            m.module, m.shape[0], m.shape[1], m.rank, m.ratio, m.ratio_after_cast, m.expected_ratio
        );
    }
    if !report.totals.above_threshold.is_empty() {
        let _ = writeln!(
            out,
            "\n**{} module(s) are above the threshold** and were written because of `--allow-residual`: {}.",
            report.totals.above_threshold.len(),
            report
                .totals
                .above_threshold
                .iter()
                .map(|m| format!("`{m}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if !report.zero_delta.is_empty() {
        let _ = writeln!(
            out,
            "\n{} tensor(s) differ from the base only by signed zeros and are not in the adapter.",
            report.zero_delta.len()
        );
    }
    out.push('\n');
}

fn target_section(out: &mut String, report: &ExtractionReport) {
    let Some(t) = &report.target_base else {
        return;
    };
    let _ = writeln!(out, "## Quantization-aware target\n");
    let _ = writeln!(
        out,
        "Extracted for the base `{}`: the adapter factors merged - dequant(Q(base)), i.e. the LoRA plus, \
         within its rank, the strongest directions of that base's quantization error. \
         It is meant for that quantized base; on the full-precision base it is off by that correction.\n",
        t.target_base
    );
    if t.extra_rank > 0 {
        let _ = writeln!(
            out,
            "- `--extra-rank {}`: every LoRA module carries {} ranks more than the plain adapter.",
            t.extra_rank, t.extra_rank
        );
    }
    if let Some(k) = t.correction_rank {
        let _ = writeln!(
            out,
            "- `--all-layers`: {} module(s) the LoRA leaves alone carry a rank-{k} correction of the quantization error.",
            report.corrections.len()
        );
    }
    if let Some(c) = &t.activation_stats {
        let _ = writeln!(
            out,
            "- Weighted by the input second moments of `{}` ({} tokens, {} records): the error minimized is the one that reaches the module outputs.",
            c.path.display(),
            c.tokens,
            c.records
        );
    }
    let fmt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.4e}"));
    let _ = writeln!(
        out,
        "\n||merged - (target + BA)|| relative to ||merged||, over the LoRA's modules:\n"
    );
    let _ = writeln!(out, "| adapter | relative | weighted (output error) |");
    let _ = writeln!(out, "|---|---:|---:|");
    let _ = writeln!(
        out,
        "| plain (merged - base) | {:.4e} | {} |",
        t.totals.plain_relative,
        fmt(t.totals.plain_weighted_relative)
    );
    let _ = writeln!(
        out,
        "| quantization-aware (this adapter) | {:.4e} | {} |",
        t.totals.quantization_aware_relative,
        fmt(t.totals.quantization_aware_weighted_relative)
    );
    if let Some(c) = &t.totals.corrections {
        let _ = writeln!(
            out,
            "| modules the LoRA leaves alone: no adapter -> corrected | {:.4e} -> {:.4e} | {} -> {} |",
            c.plain_relative,
            c.quantization_aware_relative,
            fmt(c.plain_weighted_relative),
            fmt(c.quantization_aware_weighted_relative)
        );
    }
    out.push('\n');
}

fn loading_section(out: &mut String, report: &ExtractionReport, adapter_path: &str) {
    let class = &report.loading_class;
    let multimodal = report
        .modules
        .iter()
        .any(|m| m.module.starts_with(MULTIMODAL_TEXT_PREFIX));
    let _ = writeln!(out, "## Load it with PEFT\n");
    match (report.names, multimodal) {
        (AdapterNaming::Checkpoint, true) => {
            let _ = writeln!(
                out,
                "The adapter names its modules as the checkpoint does (`model.language_model.layers.*`), \
                 so load the base with the checkpoint's own class, `{class}`. \
                 `AutoModelForCausalLM` builds the text-only class, whose modules are `model.layers.*`: \
                 PEFT would apply none of this adapter there and only warn \"Found missing adapter keys\". \
                 For that class, extract with `--names text`.\n"
            );
        }
        (AdapterNaming::Text, true) => {
            let _ = writeln!(
                out,
                "The adapter names its modules as `AutoModelForCausalLM` does (`model.layers.*`, written with `--names text`), \
                 so load the base with `AutoModelForCausalLM`. The checkpoint's own class names them \
                 `model.language_model.layers.*`: PEFT would apply none of this adapter there and only warn \
                 \"Found missing adapter keys\". vLLM builds the checkpoint's own class too: serve an adapter \
                 extracted with the default `--names checkpoint`.\n"
            );
        }
        (_, false) => {
            let _ = writeln!(
                out,
                "The checkpoint is text-only: its module names (`model.layers.*`) are the ones \
                 `AutoModelForCausalLM` uses.\n"
            );
        }
    }
    let revision = report.base.revision.as_deref().map_or(String::new(), |r| {
        format!(", revision={}", python_string(r))
    });
    let _ = writeln!(out, "```python");
    let _ = writeln!(out, "from peft import PeftModel");
    let _ = writeln!(out, "from transformers import {class}\n");
    let _ = writeln!(
        out,
        "base = {class}.from_pretrained({}{revision}, dtype=\"auto\")",
        python_string(&report.base_model_name_or_path)
    );
    let _ = writeln!(
        out,
        "model = PeftModel.from_pretrained(base, {})",
        python_string(adapter_path)
    );
    let _ = writeln!(out, "```\n");

    let name = std::path::Path::new(adapter_path)
        .file_name()
        .map_or("adapter".to_string(), |n| n.to_string_lossy().into_owned());
    let _ = writeln!(out, "## Serve it with vLLM\n");
    let _ = writeln!(out, "```sh");
    let _ = writeln!(
        out,
        "vllm serve {}{} --enable-lora --max-lora-rank {} --lora-modules {}",
        shell_word(&report.base_model_name_or_path),
        report
            .base
            .revision
            .as_deref()
            .map_or(String::new(), |r| format!(" --revision {}", shell_word(r))),
        report.r,
        shell_word(&format!("{name}={adapter_path}"))
    );
    let _ = writeln!(out, "```\n");
    let _ = writeln!(
        out,
        "`r` = {} is the smallest rank vLLM serves that covers every module, so `--max-lora-rank {}` is enough; \
         requests name the adapter as `\"model\": \"{name}\"`.\n",
        report.r, report.r
    );
}

/// The model card of an extraction: Markdown with YAML front matter. `adapter_path` is
/// where the adapter directory will be (absolute), used in the loading examples.
pub fn render_model_card(report: &ExtractionReport, adapter_path: &str) -> String {
    let mut out = String::new();
    let base_id = &report.base_model_name_or_path;
    let _ = writeln!(out, "---");
    let _ = writeln!(out, "base_model: {}", yaml_string(base_id));
    let _ = writeln!(out, "library_name: peft");
    let _ = writeln!(out, "pipeline_tag: text-generation");
    let _ = writeln!(out, "tags:");
    let _ = writeln!(
        out,
        "- {}",
        yaml_string(&format!("base_model:adapter:{base_id}"))
    );
    for tag in ["lora", "peft", "loraq"] {
        let _ = writeln!(out, "- {tag}");
    }
    let _ = writeln!(out, "---\n");

    let title = std::path::Path::new(adapter_path)
        .file_name()
        .map_or("LoRA adapter".to_string(), |n| {
            n.to_string_lossy().into_owned()
        });
    let _ = writeln!(out, "# {title}\n");
    let _ = writeln!(
        out,
        "A PEFT LoRA adapter extracted by loraq {} from a fine-tune released as merged weights: \
         the difference between the merge and its base, factored back into LoRA pairs and \
         certified against the bf16 rounding floor of the merge. Base + this adapter reproduces \
         the merged model.\n",
        report.version
    );

    let _ = writeln!(out, "## Source and base\n");
    let _ = writeln!(out, "| | id or path | revision | config.json SHA-256 |");
    let _ = writeln!(out, "|---|---|---|---|");
    let revision = |r: &Option<String>| r.as_deref().unwrap_or("not recorded").to_string();
    let sha = |s: &Option<String>| s.as_deref().unwrap_or("-").to_string();
    let _ = writeln!(
        out,
        "| source (merged) | `{}` | {} | {} |",
        report.merged.path.display(),
        revision(&report.merged.revision),
        sha(&report.merged.config_sha256)
    );
    let _ = writeln!(
        out,
        "| base | `{base_id}` | {} | {} |",
        revision(&report.base.revision),
        sha(&report.base.config_sha256)
    );
    if base_id != &report.base.path.display().to_string() {
        let _ = writeln!(
            out,
            "\nThe base was read from `{}`.",
            report.base.path.display()
        );
    }
    out.push('\n');

    let _ = writeln!(out, "## Modules and ranks\n");
    let _ = writeln!(
        out,
        "{} modules, {} parameters in bf16; `r` = `lora_alpha` = {}. Modules of another rank are set \
         through `rank_pattern` / `alpha_pattern` with alpha = rank, so the scale is 1 everywhere \
         (also in runtimes that ignore the patterns). Target modules: {}. Module names: `{}`.\n",
        report.totals.modules,
        report.totals.parameters,
        report.r,
        report
            .target_modules
            .iter()
            .map(|m| format!("`{m}`"))
            .collect::<Vec<_>>()
            .join(", "),
        report.names
    );
    let _ = writeln!(out, "| module | layers | count | shape | rank |");
    let _ = writeln!(out, "|---|---|---:|---|---:|");
    for ((kind, shape, rank), g) in module_groups(report) {
        let _ = writeln!(
            out,
            "| `{kind}` | {} | {} | {}x{} | {rank} |",
            if g.layers.is_empty() {
                "-".to_string()
            } else {
                layer_ranges(&g.layers)
            },
            g.count,
            shape[0],
            shape[1]
        );
    }
    out.push('\n');

    residual_section(&mut out, report);
    target_section(&mut out, report);
    loading_section(&mut out, report, adapter_path);

    let _ = writeln!(out, "## Files\n");
    let _ = writeln!(
        out,
        "`adapter_model.safetensors` and `adapter_config.json` (PEFT), `manifest.json` (inputs, modules, \
         ranks), `extraction_report.json` (every module's figures), this README.md, and `SHA256SUMS` \
         (`sha256sum -c SHA256SUMS`) over every file.\n"
    );
    let _ = writeln!(out, "## License\n");
    let licenses: Vec<&String> = report
        .copied
        .iter()
        .filter(|f| {
            let name = f.rsplit('/').next().unwrap_or(f).to_ascii_uppercase();
            name.starts_with("LICENSE")
                || name.starts_with("LICENCE")
                || name.starts_with("COPYING")
                || name.starts_with("NOTICE")
        })
        .collect();
    if licenses.is_empty() {
        let _ = writeln!(
            out,
            "No license file was copied from the source (`loraq extract --copy LICENSE`); \
             the licenses of the source and of the base apply."
        );
    } else {
        let _ = writeln!(
            out,
            "Copied from the source: {}. The licenses of the source and of the base apply.",
            licenses
                .iter()
                .map(|f| format!("[`{f}`]({f})"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let others: Vec<&String> = report
        .copied
        .iter()
        .filter(|f| !licenses.contains(f))
        .collect();
    if !others.is_empty() {
        let _ = writeln!(
            out,
            "\nAlso copied from the source: {}.",
            others
                .iter()
                .map(|f| format!("`{f}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ranges_join_consecutive_layers() {
        assert_eq!(layer_ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(layer_ranges(&[40]), "40");
        assert_eq!(layer_ranges(&[]), "");
    }

    #[test]
    fn quoting_keeps_ids_and_paths_one_value() {
        assert_eq!(yaml_string(r#"a "b"\c"#), r#""a \"b\"\\c""#);
        assert_eq!(shell_word("/srv/models/base"), "/srv/models/base");
        assert_eq!(shell_word("/srv/my model's"), r"'/srv/my model'\''s'");
        assert_eq!(python_string("Qwen/Qwen3.5-9B"), "\"Qwen/Qwen3.5-9B\"");
    }
}
