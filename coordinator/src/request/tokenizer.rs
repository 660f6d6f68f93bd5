//! The model's tokenizer (`tokenizer.json`, through the `tokenizers` crate).
//!
//! The coordinator tokenizes and detokenizes; workers see token ids only. The model's
//! chat template travels with its tokenizer, as in HF transformers.

use std::path::Path;

use strata_common::{Error, Result};

use crate::request::chat::{ChatInput, ChatSettings, ChatTemplate};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The model's chat template, when it ships one.
    chat: Option<ChatTemplate>,
    /// Bytes of the longest token's text: a text longer than `n ×` this cannot be fewer
    /// than `n` tokens, so an over-long prompt is refused before any tokenizing.
    longest_token: usize,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` as tokenizer_config.json names them.
    specials: serde_json::Map<String, serde_json::Value>,
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_dir_with(dir, &ChatSettings::default())
    }

    /// The tokenizer of the model in `dir`, its chat template under `chat`.
    pub fn from_dir_with(dir: &Path, chat: &ChatSettings) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::model_file(&path, "missing (needed to turn text into tokens)"));
        }
        let bytes = strata_common::files::read_bounded(&path, strata_common::files::MAX_TOKENIZER_FILE)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| Error::model_file(&path, format!("cannot load tokenizer: {e}")))?;
        let longest_token = inner.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1);
        let chat = ChatTemplate::from_dir_with(dir, chat)?;
        let specials = ChatTemplate::specials(dir)?;
        Ok(Tokenizer { inner, chat, longest_token, specials })
    }

    /// The special tokens tokenizer_config.json names (`bos_token`, `eos_token`, …).
    pub fn specials(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.specials
    }

    /// The model's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// Most bytes of text that could still be at most `tokens` tokens.
    pub fn max_text_bytes(&self, tokens: usize) -> usize {
        // Normalizers may drop characters; the margin keeps the bound on the safe side.
        tokens.saturating_mul(self.longest_token).saturating_mul(2).max(4096)
    }

    /// Token ids of `text`, with the special tokens the tokenizer's template adds (BOS).
    /// Text longer than `max_tokens` tokens could ever be is refused before tokenizing.
    /// Blocks for as long as tokenizing takes: call it off the async runtime.
    pub fn encode(&self, text: &str, max_tokens: usize) -> Result<Vec<u32>> {
        self.encode_with(text, max_tokens, true)
    }

    /// As [`encode`](Self::encode); `add_special_tokens` false leaves out what the
    /// tokenizer's template adds (a rendered chat prompt writes its own BOS).
    ///
    /// A text with clearly more than `max_tokens` tokens is refused after tokenizing a
    /// piece at a time ([`Counter`]), never whole: tokenizing costs ~220 bytes of memory a
    /// byte of text, and the byte bound alone lets through ~50× what real text holds.
    pub fn encode_with(&self, text: &str, max_tokens: usize, add_special_tokens: bool) -> Result<Vec<u32>> {
        let limit = self.max_text_bytes(max_tokens);
        if text.len() > limit {
            return Err(Error::invalid(
                "prompt",
                format!(
                    "{} bytes of text cannot fit in {max_tokens} tokens (at most {limit} bytes)",
                    text.len()
                ),
            ));
        }
        let mut counter = self.counter("prompt", max_tokens);
        counter.feed(text.as_bytes(), true)?;
        self.encode_whole(text, add_special_tokens)
    }

    /// Tokenizes all of `text` at once (its memory is ~220× the text's).
    fn encode_whole(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        // A tokenizer.json whose pre-tokenizer regex backtracks can panic inside the
        // tokenizers crate ("retry-limit-in-match over"): that is this text's error.
        let encoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.inner.encode(text, add_special_tokens)
        }))
        .map_err(|_| {
            Error::invalid(
                "prompt",
                "the model's tokenizer gave up on this text (its pattern matching hit a limit)",
            )
        })?;
        let enc = encoded.map_err(|e| Error::invalid("prompt", format!("cannot tokenize: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The conversation `input` rendered with the model's chat template, stopped once it
    /// holds clearly more than `max_tokens` tokens (counted as it is written) or more
    /// bytes than they could be: a caller's tools written with `tojson(indent=4)` never
    /// grow past the context however the template multiplies them.
    pub fn render_chat(&self, input: &ChatInput, max_tokens: usize) -> Result<String> {
        let Some(template) = &self.chat else {
            return Err(Error::invalid("messages", "the model has no chat template"));
        };
        let mut counter = self.counter("messages", max_tokens);
        template.render_watched(input, self.max_text_bytes(max_tokens), &mut |text, last| {
            counter.feed(text, last)
        })
    }

    /// A [`Counter`] of a text (named `field` in its error) that may hold `max_tokens`.
    pub fn counter<'a>(&'a self, field: &'a str, max_tokens: usize) -> Counter<'a> {
        Counter { tokenizer: self, field, max_tokens, counted: 0, tokens: 0, pieces: 0 }
    }

    /// The text of one token as a client sees it (logprobs): its decoded text, or its
    /// vocabulary entry when decoding it alone gives nothing (a special token, a byte).
    pub fn token_text(&self, id: u32) -> String {
        match self.inner.decode(&[id], false) {
            Ok(t) if !t.is_empty() && !t.contains('\u{FFFD}') => t,
            _ => self.inner.id_to_token(id).unwrap_or_default(),
        }
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| Error::Internal(format!("cannot detokenize: {e}")))
    }
}

/// Bytes of text a [`Counter`] tokenizes at a time (a few MiB of the tokenizer's memory).
pub const PIECE_BYTES: usize = 32 << 10;

/// Tokens a cut between two pieces may add to their count (a word cut in two, a prefix
/// the normalizer writes at each piece's start): the count less this is never more than
/// the whole text's.
const CUT_SLACK: usize = 4;

/// Counts the tokens of a text that grows (a chat template's output) or is long, a piece
/// at a time, and stops it once it holds clearly more than the context: memory stays at
/// one piece's however long the text, and a text that fits is tokenized whole afterwards
/// (the count is a bound, not the ids). A text no longer than the context in bytes (a
/// token is at least one byte) or than one piece is not counted.
pub struct Counter<'a> {
    tokenizer: &'a Tokenizer,
    field: &'a str,
    max_tokens: usize,
    /// Bytes of the text counted so far.
    counted: usize,
    tokens: usize,
    pieces: usize,
}

impl Counter<'_> {
    /// Counts what `text` (all of it so far; it only grows) holds past what was counted,
    /// in whole pieces, and the rest too when `last`. An error names the field once the
    /// count passes the context.
    pub fn feed(&mut self, text: &[u8], last: bool) -> Result<()> {
        let short = text.len() <= self.max_tokens.max(PIECE_BYTES);
        if last && self.counted == 0 && short {
            return Ok(());
        }
        while text.len() - self.counted >= PIECE_BYTES || (last && self.counted < text.len()) {
            let end = piece_end(text, self.counted);
            let piece = String::from_utf8_lossy(&text[self.counted..end]);
            self.tokens += self.tokenizer.encode_whole(&piece, false)?.len();
            self.pieces += 1;
            self.counted = end;
            if self.tokens.saturating_sub(self.pieces * CUT_SLACK) > self.max_tokens {
                return Err(Error::invalid(
                    self.field,
                    format!(
                        "more than {} tokens (the first {} bytes alone hold {}); the model's context is {} tokens",
                        self.max_tokens, self.counted, self.tokens, self.max_tokens
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Where the piece of `text` from `start` ends: [`PIECE_BYTES`] on, moved back to the
/// last white space within its last KiB (so words stay whole) and to a character's
/// start; the text's end when that comes first.
fn piece_end(text: &[u8], start: usize) -> usize {
    let end = start + PIECE_BYTES;
    if end >= text.len() {
        return text.len();
    }
    let floor = end - 1024;
    let cut = (floor..end).rev().find(|&i| text[i].is_ascii_whitespace()).unwrap_or(end);
    // A UTF-8 continuation byte is never a character's start.
    (start + 1..=cut).rev().find(|&i| text[i] & 0xC0 != 0x80).unwrap_or(cut)
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_common::ErrorClass;

    /// The 512-byte word in the test vocabulary: the bytes a context could hold as text
    /// then far exceed what real text holds, as in real vocabularies.
    fn long_word() -> String {
        "x".repeat(512)
    }

    /// A word-level tokenizer whose pre-tokenizer splits on `pattern`.
    fn tokenizer(pattern: &str) -> (tempfile::TempDir, Tokenizer) {
        tokenizer_with(pattern, None)
    }

    /// [`tokenizer`], with a chat template.
    fn tokenizer_with(pattern: &str, template: Option<&str>) -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 2, long_word(): 3}, "unk_token": "[UNK]"}
        });
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        if let Some(t) = template {
            std::fs::write(dir.path().join("chat_template.jinja"), t).unwrap();
        }
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, t)
    }

    #[test]
    fn a_backtracking_pattern_is_an_error_not_a_panic() {
        let (_d, t) = tokenizer("(a+)+b");
        let text = "a".repeat(30) + "!";
        let e = t.encode(&text, 1 << 20).unwrap_err();
        assert_eq!(e.class(), ErrorClass::InvalidInput, "{e}");
        assert!(t.encode("a b", 16).is_ok());
    }

    #[test]
    fn text_too_long_for_the_context_is_refused_before_tokenizing() {
        let (_d, t) = tokenizer(" ");
        let e = t.encode(&"a ".repeat(1 << 20), 128).unwrap_err();
        assert!(e.to_string().contains("cannot fit in 128 tokens"), "{e}");
    }

    #[test]
    fn a_text_past_the_context_is_refused_after_counting_a_piece() {
        let (_d, t) = tokenizer(" ");
        let text = "a ".repeat(100_000);
        assert!(text.len() <= t.max_text_bytes(1000), "within the byte bound");
        let e = t.encode(&text, 1000).unwrap_err();
        assert_eq!(e.class(), ErrorClass::InvalidInput, "{e}");
        let message = e.to_string();
        assert!(message.contains("more than 1000 tokens"), "{message}");
        let piece = piece_end(text.as_bytes(), 0);
        assert!(message.contains(&format!("the first {piece} bytes")), "one piece counted: {message}");
    }

    #[test]
    fn a_long_text_that_fits_gets_the_ids_of_tokenizing_it_whole() {
        let (_d, t) = tokenizer(" ");
        // 600 tokens in ~150 KB: counted in pieces, then tokenized whole.
        let text = format!("{} ", long_word()).repeat(300) + "a b";
        assert!(text.len() > 4 * PIECE_BYTES);
        let ids = t.encode(&text, 700).unwrap();
        assert_eq!(ids, t.encode_whole(&text, true).unwrap());
        assert_eq!(ids.len(), 603);
        assert!(t.encode(&text, 300).is_err(), "clearly past the context");
    }

    #[test]
    fn pieces_end_at_white_space_or_a_character_start() {
        let text = "é".repeat(PIECE_BYTES);
        let end = piece_end(text.as_bytes(), 0);
        assert!(text.is_char_boundary(end) && end <= PIECE_BYTES && end > PIECE_BYTES - 4, "{end}");
        let spaced = format!("{} {}", "a".repeat(PIECE_BYTES - 100), "b".repeat(PIECE_BYTES));
        assert_eq!(piece_end(spaced.as_bytes(), 0), PIECE_BYTES - 100);
        assert_eq!(piece_end(b"short", 0), 5);
    }

    #[test]
    fn a_chat_rendering_stops_once_it_passes_the_context() {
        let template = "{% for t in tools %}{{ t | tojson(indent=4) }}{% endfor %}{{ messages[0].content }}";
        let (_d, t) = tokenizer_with(" ", Some(template));
        let mut nested = serde_json::json!({"k": "a"});
        for _ in 0..40 {
            nested = serde_json::json!({"a": nested, "b": "b"});
        }
        let input = ChatInput {
            messages: vec![serde_json::json!({"role": "user", "content": "a"})],
            tools: Some(vec![nested; 50]),
            ..Default::default()
        };
        let e = t.render_chat(&input, 1000).unwrap_err();
        assert_eq!(e.class(), ErrorClass::InvalidInput, "{e}");
        assert!(e.to_string().contains("more than 1000 tokens"), "{e}");
        assert!(e.to_string().contains("messages"), "names the field: {e}");
        // Within the context, the same template renders.
        let small = ChatInput { tools: Some(vec![serde_json::json!({"k": "a"})]), ..input };
        assert!(t.render_chat(&small, 1000).is_ok());
    }
}
