//! Sampling parameters of one request, and why a sequence finished.
//!
//! Semantics follow what users of HF transformers and vLLM expect: temperature 0 (or
//! unset) is greedy; `repetition_penalty` is HF's (divide positive logits, multiply
//! negative ones, over prompt and output); `presence_penalty` and `frequency_penalty` are
//! OpenAI's (subtract, over output tokens only); top-k, top-p and min-p filter after
//! temperature. `validate` names the offending field.

use serde::{Deserialize, Serialize};

use crate::constraint::Constraint;
use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k filtering.
    pub top_k: u32,
    /// 1.0 means no nucleus filtering.
    pub top_p: f32,
    /// 0 means no min-p filtering.
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Seed of this request's random stream; None draws one from the OS.
    pub seed: Option<u64>,
    pub max_new_tokens: u32,
    /// Keep generating past EOS tokens.
    pub ignore_eos: bool,
    /// Extra token ids that end the sequence (the token is kept in the output).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the sequence; the text is cut before the match.
    pub stop: Vec<String>,
    /// Number of top alternatives to report per token; None reports no logprobs.
    pub logprobs: Option<u32>,
    /// Report the logprob of every prompt token after the ones before it (computed in
    /// prefill), with this many top alternatives each; None reports none.
    #[serde(default)]
    pub prompt_logprobs: Option<u32>,
    /// Who waits for it: the engine admits online sequences before batch ones and
    /// preempts batch ones first.
    #[serde(default)]
    pub priority: Priority,
    /// What the output must match (structured outputs); None leaves it free.
    #[serde(default)]
    pub constraint: Option<Constraint>,
    /// An embedding request: the prompt's pooled final hidden states are the answer, and
    /// nothing is generated. None generates.
    #[serde(default)]
    pub embed: Option<Embed>,
    /// Whose cached prefix blocks the prompt may read and add to: blocks are shared only
    /// among sequences of the same salt (None is a salt too: the unsalted). The front end
    /// sets the caller's tenant's, mixed with a request's own `cache_salt` (vLLM's), so
    /// one tenant cannot learn by timing what another sent.
    #[serde(default)]
    pub cache_salt: Option<u64>,
}

/// How an embedding request pools and scales its prompt's final hidden states.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Embed {
    /// None: the model's (its sentence-transformers pooling config, else the last token).
    pub pooling: Option<Pooling>,
    /// Scale to unit length; None: the model's (its sentence-transformers modules, else yes).
    pub normalize: Option<bool>,
}

/// Which positions' hidden states make an embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The last token's (decoder embedding models: the only one that saw the whole text).
    Last,
    /// The mean over every token.
    Mean,
    /// The first token's.
    Cls,
}

impl Pooling {
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Last => "last",
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
        }
    }

    /// The pooling called `name` (`last`, `mean`, `cls`).
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "last" => Ok(Pooling::Last),
            "mean" => Ok(Pooling::Mean),
            "cls" => Ok(Pooling::Cls),
            other => Err(Error::invalid("pooling", format!("{other:?} is not last, mean or cls"))),
        }
    }
}

/// Who waits for a request: a caller now (online) or a batch job (throughput first).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Priority {
    #[default]
    Online,
    Batch,
}

/// At most this many alternatives per token are reported.
pub const MAX_LOGPROBS: u32 = 20;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_new_tokens: 16,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            priority: Priority::Online,
            constraint: None,
            embed: None,
            cache_salt: None,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let finite = |name: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(Error::invalid(name, format!("must be a finite number, got {v}")))
            }
        };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if self.temperature < 0.0 {
            return Err(Error::invalid("temperature", format!("must be >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid("top_p", format!("must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::invalid("min_p", format!("must be in [0, 1], got {}", self.min_p)));
        }
        if self.repetition_penalty <= 0.0 {
            return Err(Error::invalid(
                "repetition_penalty",
                format!("must be > 0, got {}", self.repetition_penalty),
            ));
        }
        for (name, v) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(-2.0..=2.0).contains(&v) {
                return Err(Error::invalid(name, format!("must be in [-2, 2], got {v}")));
            }
        }
        if self.max_new_tokens == 0 {
            return Err(Error::invalid("max_tokens", "must be at least 1"));
        }
        for (field, n) in [("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)] {
            if n.is_some_and(|n| n > MAX_LOGPROBS) {
                return Err(Error::invalid(field, format!("at most {MAX_LOGPROBS}, got {}", n.unwrap_or(0))));
            }
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(Error::invalid("stop", "stop strings must not be empty"));
        }
        if let Some(c) = &self.constraint {
            c.validate()?;
        }
        if self.embed.is_some() && (self.constraint.is_some() || self.prompt_logprobs.is_some()) {
            return Err(Error::invalid(
                "embed",
                "an embedding request generates nothing to constrain or score",
            ));
        }
        Ok(())
    }
}

/// Why a sequence stopped generating.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// Reached `max_new_tokens` (or the context length).
    Length,
    /// Hit a stop string or a stop token id.
    Stop,
    /// Produced an end-of-sequence token.
    Eos,
    /// The caller went away.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Eos => "eos",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_fields() {
        let cases: Vec<(SamplingParams, &str)> = vec![
            (SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { top_p: 1.5, ..Default::default() }, "top_p"),
            (SamplingParams { min_p: 2.0, ..Default::default() }, "min_p"),
            (SamplingParams { max_new_tokens: 0, ..Default::default() }, "max_tokens"),
            (SamplingParams { repetition_penalty: 0.0, ..Default::default() }, "repetition_penalty"),
            (SamplingParams { logprobs: Some(99), ..Default::default() }, "logprobs"),
            (SamplingParams { prompt_logprobs: Some(21), ..Default::default() }, "prompt_logprobs"),
            (SamplingParams { temperature: f32::NAN, ..Default::default() }, "temperature"),
        ];
        for (p, field) in cases {
            let e = p.validate().unwrap_err();
            assert!(e.to_string().contains(field), "{e} should name {field}");
        }
        SamplingParams::default().validate().unwrap();
    }
}
