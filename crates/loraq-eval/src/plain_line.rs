//! The fast path of the answers reader: a scanner for the plain shape of an answers
//! line, falling back to serde_json for everything else.
//!
//! A line takes this path when it is one JSON object whose keys are written without
//! escapes and appear at most once, with `id` a string, `options` an array of
//! strings, exactly one of `logits` / `probs` an array of numbers, `group` and
//! `gold` strings or null, strings without escapes or control characters, and any
//! other field a value of the same simple kinds (nested arrays and objects,
//! `true` / `false` / `null`, numbers without an exponent). Anything else (an escape,
//! `NaN`, a missing or repeated field, malformed JSON) returns `None`, and the caller
//! parses the line with serde_json exactly as before, so that every line gives the
//! same record or the same error whichever path reads it.
//!
//! Numbers: a decimal `-?(0|[1-9][0-9]*)\.[0-9]+` of at most 19 digits (a leading
//! `0` before the point not counted) whose digits, read as an integer $m$, stay
//! below $2^{53}$ with at most 22 digits after the point is $m / 10^k$ in
//! one correctly rounded division of two exact f64 values, which is what serde_json
//! computes for it (`f64_from_parts`, and the correctly rounded value its
//! `float_roundtrip` feature computes); any other number is handed to
//! `serde_json::from_slice::<f64>` on its own.

use std::borrow::Cow;

/// Which array holds the values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ValuesField {
    /// `logits`.
    Logits,
    /// `probs`.
    Probs,
}

impl ValuesField {
    /// The JSON key.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Logits => "logits",
            Self::Probs => "probs",
        }
    }
}

/// The fields of a line of the plain shape; the options and values were appended to
/// the vectors given to [`scan_plain_line`].
#[derive(Debug)]
pub(crate) struct PlainLine<'a> {
    /// `id`.
    pub id: &'a str,
    /// `group` (absent or null: `None`).
    pub group: Option<&'a str>,
    /// `gold` (absent or null: `None`).
    pub gold: Option<&'a str>,
    /// Which of `logits` / `probs` the values came from.
    pub field: ValuesField,
}

/// Powers of ten exactly representable in f64.
const EXACT_POW10: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

/// Nesting of unknown fields' values the scanner follows before it leaves the line to
/// serde_json.
const MAX_SKIP_DEPTH: usize = 32;

/// Scans one line (with its newline, if any). On `Some`, the options were appended
/// to `options` and the values to `values`; on `None` both may hold a partial
/// line's entries, which the caller removes.
pub(crate) fn scan_plain_line<'a>(
    line: &'a [u8],
    options: &mut Vec<Cow<'a, str>>,
    values: &mut Vec<Option<f64>>,
) -> Option<PlainLine<'a>> {
    const ID: u8 = 1;
    const GROUP: u8 = 2;
    const OPTIONS: u8 = 4;
    const VALUES: u8 = 8;
    const GOLD: u8 = 16;
    // One check of the whole line instead of one per string: every byte outside a
    // string must be ASCII syntax for the scan to succeed, so the line is valid UTF-8
    // exactly when each string the scan reads is.
    let text = std::str::from_utf8(line).ok()?;
    let mut c = Cursor {
        bytes: line,
        text,
        pos: 0,
    };
    c.skip_ws();
    c.eat(b'{')?;
    let mut seen = 0u8;
    let mut id = None;
    let mut group = None;
    let mut gold = None;
    let mut field = None;
    loop {
        c.skip_ws();
        let key = c.string()?;
        c.skip_ws();
        c.eat(b':')?;
        c.skip_ws();
        let bit = match key {
            "id" => ID,
            "group" => GROUP,
            "options" => OPTIONS,
            // Both arrays given is an error serde's path words.
            "logits" | "probs" => VALUES,
            "gold" => GOLD,
            _ => 0,
        };
        if seen & bit != 0 {
            return None;
        }
        seen |= bit;
        match key {
            "id" => id = Some(c.string()?),
            "group" => group = c.string_or_null()?,
            "gold" => gold = c.string_or_null()?,
            "options" => c.string_array(options)?,
            "logits" => {
                c.number_array(values)?;
                field = Some(ValuesField::Logits);
            }
            "probs" => {
                c.number_array(values)?;
                field = Some(ValuesField::Probs);
            }
            _ => c.skip_value(0)?,
        }
        c.skip_ws();
        match c.next()? {
            b',' => {}
            b'}' => break,
            _ => return None,
        }
    }
    c.skip_ws();
    if c.pos != line.len() || seen & OPTIONS == 0 {
        return None;
    }
    Some(PlainLine {
        id: id?,
        group,
        gold,
        field: field?,
    })
}

struct Cursor<'a> {
    bytes: &'a [u8],
    /// `bytes` as text (valid UTF-8).
    text: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    #[inline]
    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Some(b)
    }

    #[inline]
    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.next()? == byte).then_some(())
    }

    /// JSON whitespace: space, tab, line feed, carriage return.
    #[inline]
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.pos.checked_add(word.len())?;
        (self.bytes.get(self.pos..end)? == word).then(|| self.pos = end)
    }

    /// A string without escapes or control characters (its quotes are ASCII, hence
    /// on character boundaries of the text).
    #[inline]
    fn string(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let start = self.pos;
        loop {
            match self.next()? {
                b'"' => break,
                b'\\' | 0..=0x1F => return None,
                _ => {}
            }
        }
        self.text.get(start..self.pos - 1)
    }

    fn string_or_null(&mut self) -> Option<Option<&'a str>> {
        if self.peek()? == b'n' {
            self.literal(b"null")?;
            Some(None)
        } else {
            Some(Some(self.string()?))
        }
    }

    /// `[` then items separated by `,` then `]`, each read by `item`.
    #[inline]
    fn array(&mut self, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'[')?;
        self.skip_ws();
        if self.peek()? == b']' {
            self.pos += 1;
            return Some(());
        }
        loop {
            self.skip_ws();
            item(self)?;
            self.skip_ws();
            match self.next()? {
                b',' => {}
                b']' => return Some(()),
                _ => return None,
            }
        }
    }

    fn string_array(&mut self, out: &mut Vec<Cow<'a, str>>) -> Option<()> {
        self.array(|c| {
            out.push(Cow::Borrowed(c.string()?));
            Some(())
        })
    }

    fn number_array(&mut self, out: &mut Vec<Option<f64>>) -> Option<()> {
        self.array(|c| {
            out.push(Some(c.number()?));
            Some(())
        })
    }

    /// A JSON number as serde_json reads it into an f64 (module docs).
    #[inline]
    fn number(&mut self) -> Option<f64> {
        let start = self.pos;
        let negative = self.peek()? == b'-';
        if negative {
            self.pos += 1;
        }
        // Up to 19 digits cannot overflow a u64 (no check per digit); more, or a
        // significand of 2^53 or more, leave the number to serde_json.
        let mut significand: u64 = 0;
        let mut digits = 0usize;
        match self.next()? {
            b'0' => {}
            d @ b'1'..=b'9' => {
                significand = u64::from(d - b'0');
                digits = 1;
                while let Some(d @ b'0'..=b'9') = self.peek() {
                    significand = significand
                        .wrapping_mul(10)
                        .wrapping_add(u64::from(d - b'0'));
                    digits += 1;
                    self.pos += 1;
                }
            }
            _ => return None,
        }
        if self.peek() != Some(b'.') {
            return self.number_by_serde(start);
        }
        self.pos += 1;
        let fraction_start = self.pos;
        while let Some(d @ b'0'..=b'9') = self.peek() {
            significand = significand
                .wrapping_mul(10)
                .wrapping_add(u64::from(d - b'0'));
            self.pos += 1;
        }
        let fraction_digits = self.pos - fraction_start;
        if digits + fraction_digits > 19
            || fraction_digits == 0
            || matches!(self.peek(), Some(b'e' | b'E' | b'+' | b'-' | b'.'))
            || significand >= 1 << 53
            || fraction_digits >= EXACT_POW10.len()
        {
            return self.number_by_serde(start);
        }
        let magnitude = significand as f64 / EXACT_POW10[fraction_digits];
        Some(if negative { -magnitude } else { magnitude })
    }

    /// The number starting at `start` (its maximal run of number characters) read by
    /// serde_json on its own; `None` where serde_json refuses it.
    #[cold]
    fn number_by_serde(&mut self, start: usize) -> Option<f64> {
        self.pos = start;
        while let Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') = self.peek() {
            self.pos += 1;
        }
        serde_json::from_slice::<f64>(&self.bytes[start..self.pos]).ok()
    }

    /// Skips a value of a field the format does not read.
    fn skip_value(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_SKIP_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'[' => self.array(|c| c.skip_value(depth + 1)),
            b'{' => {
                self.pos += 1;
                self.skip_ws();
                if self.peek()? == b'}' {
                    self.pos += 1;
                    return Some(());
                }
                loop {
                    self.skip_ws();
                    self.string()?;
                    self.skip_ws();
                    self.eat(b':')?;
                    self.skip_ws();
                    self.skip_value(depth + 1)?;
                    self.skip_ws();
                    match self.next()? {
                        b',' => {}
                        b'}' => return Some(()),
                        _ => return None,
                    }
                }
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            // serde_json skips numbers by their syntax alone (1e999 included): take
            // only plain decimals here, serde's path the rest.
            b'-' | b'0'..=b'9' => {
                let start = self.pos;
                self.number()?;
                let token = &self.bytes[start..self.pos];
                (!token.iter().any(|b| matches!(b, b'e' | b'E'))).then_some(())
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(line: &str) -> Option<(String, Vec<String>, Vec<f64>)> {
        let mut options = Vec::new();
        let mut values = Vec::new();
        let plain = scan_plain_line(line.as_bytes(), &mut options, &mut values)?;
        Some((
            plain.id.to_string(),
            options.iter().map(|o| o.to_string()).collect(),
            values.into_iter().map(|v| v.expect("number")).collect(),
        ))
    }

    #[test]
    fn plain_lines_scan_and_others_fall_back() {
        let (id, options, values) =
            scan(r#"{"id": "q1", "options": ["A", "B"], "logits": [-0.5, 2], "x": {"y": [1.5, null, true]}}"#)
                .unwrap();
        assert_eq!((id.as_str(), options.len()), ("q1", 2));
        assert_eq!(values, vec![-0.5, 2.0]);
        for fallback in [
            r#"{"id": "q\"1", "options": ["A", "B"], "logits": [0.5, 2]}"#,
            r#"{"id": "q1", "options": ["A", "B"], "logits": [NaN, 2]}"#,
            r#"{"id": "q1", "options": ["A", "B"], "logits": [0.5, null]}"#,
            r#"{"id": "q1", "id": "q2", "options": ["A", "B"], "logits": [0.5, 2]}"#,
            r#"{"id": "q1", "options": ["A", "B"], "logits": [0.5, 2], "probs": [0.5, 0.5]}"#,
            r#"{"id": "q1", "options": ["A", "B"]}"#,
            r#"{"id": "q1", "options": ["A", "B"], "logits": [0.5, 2]} x"#,
            r#"{"id": "q1", "options": ["A", "B"], "logits": [0.5, 2],}"#,
            r#"{"id": "q1", "options": ["A", "B"], "logits": [01.5, 2]}"#,
            r#"{"id": "q1", "options": ["A", "B"], "logits": [1.5, 2], "n": 1e999}"#,
        ] {
            assert!(scan(fallback).is_none(), "{fallback}");
        }
    }

    /// Random decimals (1 to 12 integer digits, 1 to 24 fraction digits, leading
    /// zeros, both signs; a 64-bit LCG): the scanner's value equals serde_json's and,
    /// on the fast path's domain (module docs), Rust's correctly rounded
    /// `str::parse`, bit for bit.
    #[test]
    fn random_decimals_match_serde_json_and_str_parse() {
        let mut state = 1u64;
        let mut next = |bound: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % bound
        };
        for _ in 0..200_000 {
            let mut token = String::new();
            if next(2) == 0 {
                token.push('-');
            }
            let integer_digits = 1 + next(12);
            let zero_integer = next(3) == 0;
            for i in 0..integer_digits {
                if zero_integer {
                    token.push('0');
                    break;
                }
                let low = u64::from(i == 0);
                token.push(char::from(b'0' + (low + next(10 - low)) as u8));
            }
            token.push('.');
            let leading_zeros = next(4) * next(4);
            for _ in 0..leading_zeros {
                token.push('0');
            }
            for _ in 0..1 + next(24 - leading_zeros) {
                token.push(char::from(b'0' + next(10) as u8));
            }
            let mut c = Cursor {
                bytes: token.as_bytes(),
                text: &token,
                pos: 0,
            };
            let ours = c.number().unwrap();
            assert_eq!(c.pos, token.len(), "{token}");
            let serde: f64 = serde_json::from_str(&token).unwrap();
            assert_eq!(ours.to_bits(), serde.to_bits(), "{token}");
            // The fast path's domain, where m / 10^k is correctly rounded.
            let (integer, fraction) = token.trim_start_matches('-').split_once('.').unwrap();
            let written = fraction.len() + if integer == "0" { 0 } else { integer.len() };
            let m: u64 = format!("{integer}{fraction}").parse().unwrap_or(u64::MAX);
            if written <= 19 && fraction.len() <= 22 && m < 1 << 53 {
                let parsed: f64 = token.parse().unwrap();
                assert_eq!(ours.to_bits(), parsed.to_bits(), "{token}");
            }
        }
    }

    #[test]
    fn numbers_match_serde_json() {
        for token in [
            "0.0",
            "-0.0",
            "1.5",
            "-3.1416",
            "0.1",
            "0.30000000000000004",
            "123456789.123456",
            "9007199254740993.0",
            "1e5",
            "-2E-3",
            "17",
            "-0",
            "18446744073709551616",
            "1.25e+2",
            "0.0000000000000000000000001",
        ] {
            let mut c = Cursor {
                bytes: token.as_bytes(),
                text: token,
                pos: 0,
            };
            let ours = c.number().unwrap();
            let theirs: f64 = serde_json::from_str(token).unwrap();
            assert_eq!(ours.to_bits(), theirs.to_bits(), "{token}");
            assert_eq!(c.pos, token.len(), "{token}");
        }
    }
}
