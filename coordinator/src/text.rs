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

use crate::tokenizer::Tokenizer;

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
            return Ok(Delta {
                text: String::new(),
                stopped: true,
            });
        }
        self.ids.push(id);
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let after = self.tokenizer.decode(&self.ids[self.prefix..])?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.starts_with(&before)
        {
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
            let search_from = self
                .emitted
                .saturating_sub(self.stop.iter().map(String::len).max().unwrap_or(0));
            let search_from = floor_char_boundary(&self.text, search_from);
            let hit = self
                .stop
                .iter()
                .filter_map(|s| {
                    self.text[search_from..]
                        .find(s.as_str())
                        .map(|i| search_from + i)
                })
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
        Delta {
            text,
            stopped: self.stopped,
        }
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}
