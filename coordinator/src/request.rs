//! Turning an `inference.v1.GenerateRequest` into token ids and sampling parameters.
//!
//! Every check names the offending field as the API spells it; the coordinator rejects
//! bad requests before they reach a worker.

use strata_common::{Error, Result, SamplingParams};
use strata_proto::inference::v1 as pb;

use crate::routing::ModelEntry;

/// Default `max_tokens` when a request leaves it out.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// A validated request, ready for a replica.
#[derive(Debug)]
pub struct Admitted {
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
}

pub fn admit(req: &pb::GenerateRequest, model: &ModelEntry) -> Result<Admitted> {
    let prompt_ids = match &req.prompt {
        None => return Err(Error::invalid("prompt", "missing: set text or token_ids")),
        Some(pb::generate_request::Prompt::Text(t)) => {
            if t.is_empty() {
                return Err(Error::invalid("prompt.text", "must not be empty"));
            }
            model.tokenizer.encode(t)?
        }
        Some(pb::generate_request::Prompt::TokenIds(ids)) => {
            if ids.ids.is_empty() {
                return Err(Error::invalid("prompt.token_ids", "must not be empty"));
            }
            let vocab = model.config.vocab_size;
            if let Some(bad) = ids.ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::invalid(
                    "prompt.token_ids",
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                ));
            }
            ids.ids.clone()
        }
    };
    let context = model.config.max_position_embeddings;
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
        None => DEFAULT_MAX_TOKENS.min(room),
    };
    let s = req.sampling.unwrap_or_default();
    let params = SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p.unwrap_or(1.0),
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        max_new_tokens: max_tokens,
        ignore_eos: req.ignore_eos,
        stop_token_ids: req.stop_token_ids.clone(),
        stop: req.stop.clone(),
        logprobs: req.logprobs,
    };
    params.validate().map_err(|e| match e {
        Error::InvalidArgument { field, reason }
            if field != "max_tokens" && field != "stop" && field != "logprobs" =>
        {
            Error::invalid(format!("sampling.{field}"), reason)
        }
        other => other,
    })?;
    Ok(Admitted { prompt_ids, params })
}
