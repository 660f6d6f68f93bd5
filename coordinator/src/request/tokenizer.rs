//! The model's tokenizer (`tokenizer.json`, through the `tokenizers` crate).
//!
//! The coordinator tokenizes and detokenizes; workers see token ids only. The model's
//! chat template travels with its tokenizer, as in HF transformers.

use std::path::Path;

use strata_common::{Error, Result};

use crate::request::chat::{ChatSettings, ChatTemplate};

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

#[cfg(test)]
mod tests {
    use super::*;
    use strata_common::ErrorClass;

    /// A word-level tokenizer whose pre-tokenizer splits on `pattern`.
    fn tokenizer(pattern: &str) -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 2}, "unk_token": "[UNK]"}
        });
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
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
}
