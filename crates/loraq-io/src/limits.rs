//! Limits on sizes that come from files and flags, checked before anything is
//! allocated, and the helpers that apply them. docs/formats.md lists every limit
//! and why it was chosen.
//!
//! A file is outside input: a `num_hidden_layers` of 2^40 or an endless line must
//! give an error naming the file, not an allocation failure or a read that never
//! ends. Each limit is far above every published model and every real use.

use std::io::BufRead;

/// Most decoder layers a config.json may declare (published models have at most a
/// few hundred; per-layer tables are allocated from this count).
pub const MAX_LAYERS: usize = 4096;

/// Largest width a config.json may declare for hidden, intermediate and head sizes
/// and head counts: $2^{20}$, about 20 times the widest published projection
/// (Qwen3.5's largest intermediate size is in the tens of thousands).
pub const MAX_DIMENSION: usize = 1 << 20;

/// Largest vocabulary a config.json may declare: $2^{24}$ (published vocabularies hold
/// a few hundred thousand tokens).
pub const MAX_VOCAB: usize = 1 << 24;

/// Longest prompt `loraq run` scores, in tokens: 2^18 = 262,144, Qwen3.5's native
/// context length. Attention runs in blocks, so memory grows linearly up to it.
pub const MAX_PROMPT_TOKENS: usize = 1 << 18;

/// Longest line of a JSON Lines file (records, answers), in bytes: 16 MiB. A
/// 262,144-token prompt written as ids takes under 2 MiB; the cap turns a file
/// without newlines (`/dev/zero`) into an error instead of an endless read.
pub const MAX_JSON_LINE_BYTES: usize = 16 << 20;

/// Absolute bound on `--threads`: more threads than this only oversubscribe any
/// machine loraq runs on, and each costs a stack.
pub const MAX_THREADS: usize = 1024;

/// Threads per logical core allowed by `--threads`: the work is compute-bound, so
/// threads beyond the cores gain nothing, and rayon's idle workers spin on the
/// cores the busy ones need (`extract --threads 500` on 2 cores never finished).
pub const MAX_THREADS_PER_CORE: usize = 4;

/// Characters of an outside string (id, option, tensor name) that an error
/// message shows before eliding the rest.
pub const MAX_SHOWN_CHARS: usize = 200;

/// The most `--threads` this machine accepts: [`MAX_THREADS_PER_CORE`] times its
/// logical cores, at most [`MAX_THREADS`].
pub fn thread_limit() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.saturating_mul(MAX_THREADS_PER_CORE).min(MAX_THREADS)
}

/// Checks a `--threads` count: 0 (all cores) or 1..=[`thread_limit`]; the error
/// says the limit and why.
pub fn check_threads(threads: usize) -> Result<usize, String> {
    let limit = thread_limit();
    if threads > limit {
        return Err(format!(
            "{threads} threads is above the limit of {limit} ({MAX_THREADS_PER_CORE} per logical core, at most {MAX_THREADS}): the work is compute-bound, more threads only oversubscribe the cores"
        ));
    }
    Ok(threads)
}

/// `text` as an error message shows it: control characters escaped as `{:?}`
/// escapes them (a tensor name cannot move the cursor of a terminal), and cut to
/// [`MAX_SHOWN_CHARS`] characters with an ellipsis and the full length in bytes.
pub fn elide(text: &str) -> String {
    let mut shown = String::new();
    for (count, c) in text.chars().enumerate() {
        if count == MAX_SHOWN_CHARS {
            shown.push_str(&format!("... ({} bytes in all)", text.len()));
            return shown;
        }
        if c.is_control() {
            shown.extend(c.escape_debug());
        } else {
            shown.push(c);
        }
    }
    shown
}

/// What [`read_capped_line`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum CappedLine {
    /// The end of the input: nothing was read.
    End,
    /// A line (with its newline, if any) was appended to the buffer.
    Line,
    /// The line is longer than the cap; the buffer holds its first `cap + 1` bytes.
    TooLong,
}

/// Appends the next line of `reader` (up to and including `\n`) to `buf`, reading
/// at most `cap + 1` bytes of it, so that input without newlines cannot grow the
/// buffer without bound.
pub fn read_capped_line(
    reader: &mut impl BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
) -> std::io::Result<CappedLine> {
    let start = buf.len();
    loop {
        let available = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok(if buf.len() == start {
                CappedLine::End
            } else {
                CappedLine::Line
            });
        }
        let room = (cap + 1).saturating_sub(buf.len() - start);
        let (take, done) = match available.iter().position(|&b| b == b'\n') {
            Some(i) if i < room => (i + 1, true),
            _ => (available.len().min(room), false),
        };
        buf.extend_from_slice(&available[..take]);
        reader.consume(take);
        if done {
            return Ok(CappedLine::Line);
        }
        if buf.len() - start > cap {
            return Ok(CappedLine::TooLong);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elide_escapes_control_characters_and_cuts_long_text() {
        assert_eq!(elide("a\u{1b}[31mb\n"), "a\\u{1b}[31mb\\n");
        let long = "x".repeat(10_000);
        let shown = elide(&long);
        assert!(shown.len() < 300, "{shown}");
        assert!(shown.ends_with("... (10000 bytes in all)"), "{shown}");
        assert_eq!(elide("plain.name"), "plain.name");
    }

    #[test]
    fn capped_line_reader_stops_at_the_cap_on_endless_input() {
        // An endless line (as /dev/zero gives) stops after cap + 1 bytes.
        let mut endless = std::io::BufReader::with_capacity(7, std::io::repeat(0));
        let mut buf = Vec::new();
        let found = read_capped_line(&mut endless, &mut buf, 100).unwrap();
        assert_eq!(found, CappedLine::TooLong);
        assert_eq!(buf.len(), 101);
        // Lines under the cap come back whole, the last one without a newline.
        let mut text = std::io::BufReader::with_capacity(3, &b"ab\ncdef\ngh"[..]);
        let mut lines = Vec::new();
        loop {
            let mut line = Vec::new();
            match read_capped_line(&mut text, &mut line, 5).unwrap() {
                CappedLine::End => break,
                CappedLine::Line => lines.push(line),
                CappedLine::TooLong => panic!("no line is over 5 bytes"),
            }
        }
        assert_eq!(
            lines,
            vec![b"ab\n".to_vec(), b"cdef\n".to_vec(), b"gh".to_vec()]
        );
        // A line of exactly cap bytes plus its newline fits.
        let mut exact = std::io::BufReader::new(&b"12345\nx"[..]);
        let mut line = Vec::new();
        assert_eq!(
            read_capped_line(&mut exact, &mut line, 5).unwrap(),
            CappedLine::Line
        );
        assert_eq!(line, b"12345\n");
    }

    #[test]
    fn thread_counts_above_the_limit_are_refused() {
        assert!(check_threads(0).is_ok());
        assert!(check_threads(1).is_ok());
        let err = check_threads(100_000).unwrap_err();
        assert!(err.contains("limit"), "{err}");
        assert!(check_threads(MAX_THREADS + 1).is_err());
    }
}
