//! A prompt's logprobs in the shapes clients read them: vLLM's `prompt_logprobs` list, and
//! the echoed prompt's entries at the head of a completion's `logprobs` (`echo` with
//! `logprobs`, what evaluation harnesses score log-likelihoods with).
//!
//! The replica computes them in prefill (one per prompt token after the first, each with
//! its rank and the most likely alternatives); the first prompt token has none, so both
//! shapes start with `null`.

use serde_json::{json, Map, Value as Json};
use strata_common::TokenLogprobs;

use crate::request::tokenizer::Tokenizer;

/// What a request asked of its prompt's logprobs: vLLM's list with `listed` alternatives,
/// the echoed prompt's entries with `echoed`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptLogprobsWanted {
    pub listed: Option<u32>,
    pub echoed: Option<u32>,
}

impl PromptLogprobsWanted {
    /// The alternatives the replica must report: enough for both shapes.
    pub fn top(&self) -> Option<u32> {
        self.listed.max(self.echoed)
    }
}

/// vLLM's `prompt_logprobs`: `null` for the first token, then for each token a map of token
/// id → `{logprob, rank, decoded_token}` holding the prompt token and the `n` most likely.
pub fn listed(tok: &Tokenizer, lps: &[TokenLogprobs], n: u32) -> Json {
    let entry = |logprob: f32, rank: u32, id: u32| json!({"logprob": logprob, "rank": rank, "decoded_token": tok.token_text(id)});
    let mut out = Vec::with_capacity(lps.len() + 1);
    out.push(Json::Null);
    for lp in lps {
        let mut m = Map::new();
        m.insert(lp.token_id.to_string(), entry(lp.logprob, lp.rank, lp.token_id));
        for (i, &(id, p)) in lp.top.iter().take(n as usize).enumerate() {
            m.entry(id.to_string()).or_insert_with(|| entry(p, i as u32 + 1, id));
        }
        out.push(Json::Object(m));
    }
    Json::Array(out)
}

/// A completion's `logprobs` with the echoed prompt's entries before `generated`'s (whose
/// `text_offset`s already count the echoed text): the prompt's tokens, their logprobs
/// (`null` for the first) and `n` alternatives each.
pub fn with_echo(tok: &Tokenizer, prompt: &[u32], lps: &[TokenLogprobs], n: u32, generated: Json) -> Json {
    let mut tokens = Vec::with_capacity(prompt.len());
    let mut token_logprobs = vec![Json::Null];
    let mut top = vec![Json::Null];
    let mut offsets = Vec::with_capacity(prompt.len());
    let mut at = 0;
    for &id in prompt {
        let text = tok.token_text(id);
        offsets.push(json!(at));
        at += text.len();
        tokens.push(json!(text));
    }
    for lp in lps {
        token_logprobs.push(json!(lp.logprob));
        let alts: Map<String, Json> =
            lp.top.iter().take(n as usize).map(|&(id, p)| (tok.token_text(id), json!(p))).collect();
        top.push(Json::Object(alts));
    }
    let mut out = json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets});
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(Json::Array(rest)), Some(Json::Array(head))) = (generated.get(key), out.get_mut(key)) {
            head.extend(rest.iter().cloned());
        }
    }
    out
}
