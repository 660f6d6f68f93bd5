//! The model's tokenizer (`tokenizer.json`, through the `tokenizers` crate).
//!
//! The coordinator tokenizes and detokenizes; workers see token ids only.

use std::path::Path;

use strata_common::{Error, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::model_file(&path, "missing (needed to turn text into tokens)"));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::model_file(&path, format!("cannot load tokenizer: {e}")))?;
        Ok(Tokenizer { inner })
    }

    /// Token ids of `text`, with the special tokens the tokenizer's template adds (BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| Error::invalid("prompt", format!("cannot tokenize: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| Error::Internal(format!("cannot detokenize: {e}")))
    }
}
