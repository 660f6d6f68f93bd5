//! Incremental detokenization and stop strings.
//!
//! Decoding token by token is wrong for byte-level tokenizers: one character can span
//! several tokens, and some tokenizers change a token's text depending on its neighbours.
//! [`TextStream`] keeps a short window of recent ids (the idea TGI and vLLM use): it decodes
//! the window with and without the newest tokens and emits only the difference, and holds
//! text back while it ends in an incomplete UTF-8 sequence (U+FFFD). So deltas never split
//! a character, and their concatenation equals decoding all ids at once.
//!
//! Stop strings are matched on the decoded text; text that could still turn into a stop
//! string is held back until it cannot, so a stream never shows text that the final
//! response cuts.

use strata_common::Result;

use crate::request::tokenizer::Tokenizer;

pub struct TextStream<'t> {
    tokenizer: &'t Tokenizer,
    ids: Vec<u32>,
    /// Start of the decoding window in `ids`.
    prefix: usize,
    /// Ids up to here have been turned into text.
    read: usize,
    /// All text produced so far (before stop-string cutting).
    text: String,
    /// Bytes of `text` already handed to the caller.
    emitted: usize,
    stop: Vec<String>,
    stopped: bool,
}

/// What one new token added.
#[derive(Debug, Default, PartialEq)]
pub struct Delta {
    /// Text now safe to show.
    pub text: String,
    /// A stop string matched; the text was cut just before it.
    pub stopped: bool,
}

impl<'t> TextStream<'t> {
    pub fn new(tokenizer: &'t Tokenizer, stop: Vec<String>) -> Self {
        TextStream {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
            emitted: 0,
            stop,
            stopped: false,
        }
    }

    /// Adds one generated token.
    pub fn push(&mut self, id: u32) -> Result<Delta> {
        if self.stopped {
            return Ok(Delta { text: String::new(), stopped: true });
        }
        self.ids.push(id);
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let after = self.tokenizer.decode(&self.ids[self.prefix..])?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.starts_with(&before) {
            self.text.push_str(&after[before.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        Ok(self.release(false))
    }

    /// Flushes what is held back at the end of the generation.
    pub fn finish(&mut self) -> Result<Delta> {
        if !self.stopped && self.read < self.ids.len() {
            let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
            let after = self.tokenizer.decode(&self.ids[self.prefix..])?;
            if let Some(rest) = after.strip_prefix(before.as_str()) {
                self.text.push_str(rest);
            }
            self.read = self.ids.len();
        }
        Ok(self.release(true))
    }

    /// The full text as it stands (cut at a stop string if one matched).
    pub fn text(&self) -> &str {
        &self.text
    }

    fn release(&mut self, at_end: bool) -> Delta {
        if !self.stopped {
            // Earliest stop string match anywhere in the unreleased-or-recent text.
            let search_from =
                self.emitted.saturating_sub(self.stop.iter().map(String::len).max().unwrap_or(0));
            let search_from = floor_char_boundary(&self.text, search_from);
            let hit = self
                .stop
                .iter()
                .filter_map(|s| self.text[search_from..].find(s.as_str()).map(|i| search_from + i))
                .min();
            if let Some(at) = hit {
                self.text.truncate(at.max(self.emitted));
                self.stopped = true;
            }
        }
        let mut end = self.text.len();
        if !self.stopped && !at_end {
            // Hold back a suffix that is a proper prefix of some stop string.
            for s in &self.stop {
                for (cut, _) in s.char_indices().skip(1) {
                    if self.text.ends_with(&s[..cut]) {
                        end = end.min(self.text.len() - cut);
                    }
                }
            }
        }
        let end = end.max(self.emitted);
        let text = self.text[self.emitted..end].to_string();
        self.emitted = end;
        Delta { text, stopped: self.stopped }
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn tokenizer() -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/llama_gqa");
        Tokenizer::from_dir(&dir).unwrap()
    }

    fn stream_all(tok: &Tokenizer, ids: &[u32], stop: &[&str]) -> (Vec<String>, String, bool) {
        let mut s = TextStream::new(tok, stop.iter().map(|s| s.to_string()).collect());
        let mut deltas = Vec::new();
        let mut stopped = false;
        for &id in ids {
            let d = s.push(id).unwrap();
            deltas.push(d.text);
            if d.stopped {
                stopped = true;
                break;
            }
        }
        deltas.push(s.finish().unwrap().text);
        (deltas, s.text().to_string(), stopped)
    }

    #[test]
    fn deltas_never_split_characters_and_add_up_to_the_text() {
        let tok = tokenizer();
        let text = "Café naïve 日本語 🙂 fox";
        let ids = tok.encode(text, 4096).unwrap();
        assert!(ids.len() > text.chars().count() / 2, "multi-byte characters span tokens");
        let (deltas, full, stopped) = stream_all(&tok, &ids, &[]);
        assert!(!stopped);
        for d in &deltas {
            assert!(!d.contains('\u{FFFD}'), "delta {d:?} holds a broken character");
        }
        assert_eq!(deltas.concat(), full);
        assert_eq!(full, text);
    }

    #[test]
    fn stop_strings_cut_and_are_never_streamed() {
        let tok = tokenizer();
        let ids = tok.encode("The quick brown fox jumps", 4096).unwrap();
        let (deltas, full, stopped) = stream_all(&tok, &ids, &["brown", "zzz"]);
        assert!(stopped);
        assert_eq!(full, "The quick ");
        assert_eq!(deltas.concat(), full);
        // A stop string spanning several tokens is matched too, and text that only looked
        // like a stop string's start is released at the end.
        let (deltas, full, stopped) = stream_all(&tok, &ids, &["fox jumps over"]);
        assert!(!stopped);
        assert_eq!(full, "The quick brown fox jumps");
        assert_eq!(deltas.concat(), full);
    }
}
