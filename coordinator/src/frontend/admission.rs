//! Turning a generation request into token ids and sampling parameters.
//!
//! The request is a domain type, so every front end (gRPC today, HTTP next) builds one
//! and shares these checks. Every check names the offending field; sampling knobs are
//! named as in [`SamplingParams`] and a front end may prefix them as its API spells them
//! (inference.v1 nests them under `sampling.`). The coordinator rejects bad requests
//! before they reach a worker.

use strata_common::{Error, Result, SamplingParams};

use crate::routing::ModelEntry;

/// What the caller wants generated from.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    /// A rendered chat template: tokenized without the tokenizer's added special tokens,
    /// which the template writes itself.
    Chat(String),
    TokenIds(Vec<u32>),
}

pub use strata_common::sampling::Priority;

/// A generation request as every front end hands it to admission.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub model: String,
    /// None when the caller sent no prompt at all.
    pub prompt: Option<Prompt>,
    /// None: [`DEFAULT_MAX_TOKENS`] (or all the context leaves, with `fill_context`), or
    /// what the context leaves when that is less.
    pub max_tokens: Option<u32>,
    /// Without `max_tokens`, generate up to the end of the context (OpenAI's chat API).
    pub fill_context: bool,
    /// How to sample; `max_new_tokens` is set by admission from `max_tokens`.
    pub params: SamplingParams,
    pub priority: Priority,
    /// May be answered from the response cache (when deterministic); false always
    /// generates.
    pub cache: bool,
}

/// Default `max_tokens` when a request leaves it out.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// A validated request, ready for a replica.
#[derive(Debug)]
pub struct Admitted {
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
}

pub fn admit(req: &GenerateRequest, model: &ModelEntry) -> Result<Admitted> {
    let prompt_ids = match &req.prompt {
        None => return Err(Error::invalid("prompt", "missing: set text or token_ids")),
        Some(p) => prompt_ids(p, model)?,
    };
    let context = model.max_context();
    if prompt_ids.len() >= context {
        return Err(Error::invalid(
            "prompt",
            format!(
                "{} tokens; the model's context is {context} tokens, leaving no room to generate",
                prompt_ids.len()
            ),
        ));
    }
    let room = (context - prompt_ids.len()) as u32;
    let max_tokens = match req.max_tokens {
        Some(0) => return Err(Error::invalid("max_tokens", "must be at least 1")),
        Some(n) if n > room => {
            return Err(Error::invalid(
                "max_tokens",
                format!(
                    "{n} tokens after a {}-token prompt exceed the context of {context}",
                    prompt_ids.len()
                ),
            ))
        }
        Some(n) => n,
        None if req.fill_context => room,
        None => DEFAULT_MAX_TOKENS.min(room),
    };
    let params = SamplingParams { max_new_tokens: max_tokens, priority: req.priority, ..req.params.clone() };
    params.validate()?;
    Ok(Admitted { prompt_ids, params })
}

/// A prompt's token ids: text tokenized (a rendered chat without the tokenizer's added
/// special tokens), ids checked against the vocabulary. Blocks for as long as tokenizing
/// takes: call it off the async runtime.
pub fn prompt_ids(prompt: &Prompt, model: &ModelEntry) -> Result<Vec<u32>> {
    match prompt {
        Prompt::Text(t) => {
            if t.is_empty() {
                return Err(Error::invalid("prompt.text", "must not be empty"));
            }
            model.tokenizer.encode(t, model.config.max_position_embeddings)
        }
        Prompt::Chat(t) => {
            let ids = model.tokenizer.encode_with(t, model.config.max_position_embeddings, false)?;
            if ids.is_empty() {
                return Err(Error::invalid("messages", "the chat template rendered an empty prompt"));
            }
            Ok(ids)
        }
        Prompt::TokenIds(ids) => {
            if ids.is_empty() {
                return Err(Error::invalid("prompt.token_ids", "must not be empty"));
            }
            let vocab = model.config.vocab_size;
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::invalid(
                    "prompt.token_ids",
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                ));
            }
            Ok(ids.clone())
        }
    }
}
