//! Reading OpenAI request bodies into domain requests, field by field, so every error
//! names the parameter as the caller spelled it.
//!
//! A field this server does not know is refused, naming it ([`refuse_unknown`]): a
//! parameter silently ignored is an answer to a different question. Fields that change
//! nothing about the output (`user`, `metadata`, `store`, …) are accepted. `null` is the
//! same as leaving a field out. Besides OpenAI's parameters, the vLLM-style extensions
//! `top_k`, `min_p`, `repetition_penalty`, `ignore_eos` and `stop_token_ids` are read, and
//! `cache` (false: never answer from the response cache); structured outputs are read by
//! [`super::structured`].

use serde_json::{Map, Value as Json};
use strata_common::sampling::MAX_LOGPROBS;
use strata_common::SamplingParams;

use super::error::ApiError;

/// Most choices one request may ask for (`n` × prompts).
pub const MAX_CHOICES: usize = 128;
/// Most stop strings per request, and most bytes in one.
pub const MAX_STOP: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;

pub type Fields = Map<String, Json>;

/// A request body: a JSON object.
pub fn object(body: &[u8]) -> Result<Fields, ApiError> {
    match serde_json::from_slice::<Json>(body) {
        Ok(Json::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::invalid("body", "the request body must be a JSON object")),
        Err(e) => Err(ApiError::invalid("body", format!("the request body is not valid JSON: {e}"))),
    }
}

fn field<'a>(f: &'a Fields, name: &str) -> Option<&'a Json> {
    f.get(name).filter(|v| !v.is_null())
}

fn kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

fn expected(name: &str, what: &str, got: &Json) -> ApiError {
    ApiError::invalid(name, format!("{name} must be {what}, got {}", kind(got)))
}

pub fn string<'a>(f: &'a Fields, name: &str) -> Result<Option<&'a str>, ApiError> {
    match field(f, name) {
        None => Ok(None),
        Some(Json::String(s)) => Ok(Some(s)),
        Some(v) => Err(expected(name, "a string", v)),
    }
}

pub fn boolean(f: &Fields, name: &str) -> Result<Option<bool>, ApiError> {
    match field(f, name) {
        None => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(expected(name, "true or false", v)),
    }
}

pub fn float(f: &Fields, name: &str) -> Result<Option<f32>, ApiError> {
    match field(f, name) {
        None => Ok(None),
        Some(Json::Number(n)) => Ok(n.as_f64().map(|x| x as f32)),
        Some(v) => Err(expected(name, "a number", v)),
    }
}

/// An integer in `0..=max`.
pub fn uint(f: &Fields, name: &str, max: u64) -> Result<Option<u64>, ApiError> {
    match field(f, name) {
        None => Ok(None),
        Some(Json::Number(n)) => match n.as_u64() {
            Some(x) if x <= max => Ok(Some(x)),
            _ => Err(ApiError::invalid(name, format!("{name} must be an integer from 0 to {max}, got {n}"))),
        },
        Some(v) => Err(expected(name, "an integer", v)),
    }
}

/// A float in `lo..=hi`.
fn float_in(f: &Fields, name: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match float(f, name)? {
        Some(x) if !(lo..=hi).contains(&x) => {
            Err(ApiError::invalid(name, format!("{name} must be from {lo} to {hi}, got {x}")))
        }
        other => Ok(other),
    }
}

/// Fields both generation routes read, or accept as bookkeeping that changes no output.
const SHARED_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "n",
    "best_of",
    "logit_bias",
    "stream",
    "stream_options",
    "seed",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "cache",
    "cache_salt",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structured_outputs",
    "logprobs",
    "prompt_logprobs",
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];
/// /v1/completions' own fields.
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "echo", "suffix"];
/// /v1/chat/completions' own fields.
pub const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "reasoning_effort",
    "modalities",
];

/// A 400 naming the first field of `f` that is neither shared nor in `own`.
pub fn refuse_unknown(f: &Fields, own: &[&str]) -> Result<(), ApiError> {
    match f.keys().find(|k| !SHARED_FIELDS.contains(&k.as_str()) && !own.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(k.clone(), format!("{k}: unknown parameter"))),
        None => Ok(()),
    }
}

/// The fields every generation request shares: model, sampling, `n`, `stream`.
#[derive(Debug, Clone)]
pub struct Common {
    pub model: String,
    pub max_tokens: Option<u32>,
    /// The name the caller gave the output length by (errors name it so).
    pub max_tokens_field: &'static str,
    pub n: usize,
    pub params: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    /// May be answered from the response cache.
    pub cache: bool,
    /// The field the caller constrained the output by (`response_format`,
    /// `guided_json`, …), which errors from compiling it name.
    pub constraint_field: Option<String>,
    /// The prompt's logprobs the response shows.
    pub prompt_logprobs: super::prompt_logprobs::PromptLogprobsWanted,
}

/// Reads the shared fields. `max_tokens_names` are the names the output length may go by
/// (chat takes `max_completion_tokens` too).
pub fn common(f: &Fields, max_tokens_names: &[&'static str]) -> Result<Common, ApiError> {
    let model = match string(f, "model")? {
        Some(m) if !m.is_empty() => m.to_string(),
        _ => {
            return Err(ApiError::invalid("model", "model is required: name a served model (GET /v1/models)"))
        }
    };
    let mut max_tokens = None;
    let mut max_tokens_field = "max_tokens";
    for name in max_tokens_names {
        if let Some(n) = uint(f, name, u32::MAX as u64)? {
            max_tokens = Some(n as u32);
            max_tokens_field = name;
        }
    }
    let n = uint(f, "n", MAX_CHOICES as u64)?.unwrap_or(1) as usize;
    if n == 0 {
        return Err(ApiError::invalid("n", "n must be at least 1"));
    }
    if let Some(best_of) = uint(f, "best_of", MAX_CHOICES as u64)? {
        if best_of as usize != n {
            return Err(ApiError::invalid("best_of", "best_of other than n is not supported"));
        }
    }
    if let Some(Json::Object(bias)) = field(f, "logit_bias") {
        if !bias.is_empty() {
            return Err(ApiError::invalid("logit_bias", "logit_bias is not supported"));
        }
    }
    let stream = boolean(f, "stream")?.unwrap_or(false);
    let include_usage = match field(f, "stream_options") {
        None => false,
        Some(Json::Object(o)) => boolean(o, "include_usage")
            .map_err(|_| ApiError::invalid("stream_options.include_usage", "must be true or false"))?
            .unwrap_or(false),
        Some(v) => return Err(expected("stream_options", "an object", v)),
    };
    if include_usage && !stream {
        return Err(ApiError::invalid("stream_options", "stream_options needs stream: true"));
    }
    let d = SamplingParams::default();
    let seed = match field(f, "seed") {
        None => None,
        // Any integer: negative seeds keep their bits.
        Some(Json::Number(x)) if x.is_i64() || x.is_u64() => {
            Some(x.as_u64().unwrap_or_else(|| x.as_i64().unwrap_or(0) as u64))
        }
        Some(v) => return Err(expected("seed", "an integer", v)),
    };
    let params = SamplingParams {
        // OpenAI's default temperature is 1 (sampling); 0 is greedy.
        temperature: float_in(f, "temperature", 0.0, 2.0)?.unwrap_or(1.0),
        top_p: float(f, "top_p")?.unwrap_or(d.top_p),
        top_k: uint(f, "top_k", u32::MAX as u64)?.map_or(d.top_k, |k| k as u32),
        min_p: float(f, "min_p")?.unwrap_or(d.min_p),
        repetition_penalty: float(f, "repetition_penalty")?.unwrap_or(d.repetition_penalty),
        presence_penalty: float_in(f, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        frequency_penalty: float_in(f, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        seed,
        ignore_eos: boolean(f, "ignore_eos")?.unwrap_or(false),
        stop_token_ids: stop_token_ids(f)?,
        stop: stop(f)?,
        cache_salt: cache_salt(f)?,
        ..d
    };
    let cache = boolean(f, "cache")?.unwrap_or(true);
    let (constraint, constraint_field) = super::structured::constraint(f)?.unzip();
    let listed = uint(f, "prompt_logprobs", MAX_LOGPROBS as u64)?.map(|n| n as u32);
    let prompt_logprobs = super::prompt_logprobs::PromptLogprobsWanted { listed, echoed: None };
    let params = SamplingParams { constraint, prompt_logprobs: listed, ..params };
    Ok(Common {
        model,
        max_tokens,
        max_tokens_field,
        n,
        params,
        stream,
        include_usage,
        cache,
        constraint_field,
        prompt_logprobs,
    })
}

/// vLLM's `cache_salt`: a non-empty string; requests share cached prefix blocks only with
/// requests of the same salt (and tenant).
fn cache_salt(f: &Fields) -> Result<Option<u64>, ApiError> {
    use std::hash::{Hash, Hasher};
    match string(f, "cache_salt")? {
        None => Ok(None),
        Some("") => Err(ApiError::invalid("cache_salt", "cache_salt must be a non-empty string")),
        Some(s) => {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            s.hash(&mut h);
            Ok(Some(h.finish()))
        }
    }
}

fn stop(f: &Fields) -> Result<Vec<String>, ApiError> {
    let list = match field(f, "stop") {
        None => Vec::new(),
        Some(Json::String(s)) => vec![s.clone()],
        Some(Json::Array(items)) => {
            let mut out = Vec::with_capacity(items.len().min(MAX_STOP));
            for item in items.iter() {
                match item {
                    Json::String(s) => out.push(s.clone()),
                    v => return Err(expected("stop", "a string or an array of strings", v)),
                }
            }
            out
        }
        Some(v) => return Err(expected("stop", "a string or an array of strings", v)),
    };
    if list.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOP} stop strings, got {}", list.len()),
        ));
    }
    if list.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!("a stop string may be at most {MAX_STOP_BYTES} bytes"),
        ));
    }
    Ok(list)
}

fn stop_token_ids(f: &Fields) -> Result<Vec<u32>, ApiError> {
    match field(f, "stop_token_ids") {
        None => Ok(Vec::new()),
        Some(Json::Array(items)) if items.len() <= MAX_STOP => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&x| x <= u32::MAX as u64)
                    .map(|x| x as u32)
                    .ok_or_else(|| expected("stop_token_ids", "an array of token ids", v))
            })
            .collect(),
        Some(v) => Err(expected("stop_token_ids", &format!("an array of at most {MAX_STOP} token ids"), v)),
    }
}

/// `logprobs` as /v1/completions takes it: how many alternatives to report per token.
pub fn completion_logprobs(f: &Fields) -> Result<Option<u32>, ApiError> {
    Ok(uint(f, "logprobs", MAX_LOGPROBS as u64)?.map(|n| n as u32))
}

/// `logprobs` (bool) and `top_logprobs` as /v1/chat/completions takes them.
pub fn chat_logprobs(f: &Fields) -> Result<Option<u32>, ApiError> {
    let top = uint(f, "top_logprobs", MAX_LOGPROBS as u64)?;
    match (boolean(f, "logprobs")?.unwrap_or(false), top) {
        (true, top) => Ok(Some(top.unwrap_or(0) as u32)),
        (false, Some(_)) => Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs: true")),
        (false, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: Json) -> Fields {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn unknown_parameters_are_refused_by_name_and_bookkeeping_is_accepted() {
        let e =
            refuse_unknown(&fields(json!({"model": "m", "prompt": "x", "temprature": 1})), COMPLETION_FIELDS)
                .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temprature"));
        let e = refuse_unknown(&fields(json!({"model": "m", "prompt": "x"})), CHAT_FIELDS).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"), "a completions field on chat");
        let ok =
            json!({"model": "m", "messages": [], "user": "u", "metadata": {}, "store": false, "tools": []});
        refuse_unknown(&fields(ok), CHAT_FIELDS).unwrap();
    }

    #[test]
    fn every_bad_field_is_named() {
        let cases = [
            (json!({}), "model"),
            (json!({"model": "m", "max_tokens": "5"}), "max_tokens"),
            (json!({"model": "m", "max_tokens": -1}), "max_tokens"),
            (json!({"model": "m", "n": 0}), "n"),
            (json!({"model": "m", "n": 1000}), "n"),
            (json!({"model": "m", "temperature": 3}), "temperature"),
            (json!({"model": "m", "presence_penalty": -2.5}), "presence_penalty"),
            (json!({"model": "m", "stop": 5}), "stop"),
            (json!({"model": "m", "stop": vec!["a"; 17]}), "stop"),
            (json!({"model": "m", "seed": 1.5}), "seed"),
            (json!({"model": "m", "stream": "yes"}), "stream"),
            (json!({"model": "m", "stream_options": {"include_usage": true}}), "stream_options"),
            (json!({"model": "m", "logit_bias": {"5": 10}}), "logit_bias"),
            (json!({"model": "m", "best_of": 3}), "best_of"),
            (json!({"model": "m", "cache": "no"}), "cache"),
        ];
        for (body, param) in cases {
            let e = common(&fields(body.clone()), &["max_tokens"]).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
        assert_eq!(object(b"[1]").unwrap_err().param.as_deref(), Some("body"));
        assert_eq!(object(b"{").unwrap_err().param.as_deref(), Some("body"));
    }

    #[test]
    fn defaults_are_openais_and_nulls_are_absent() {
        let c =
            common(&fields(json!({"model": "m", "seed": -1, "temperature": null})), &["max_tokens"]).unwrap();
        assert_eq!(c.params.temperature, 1.0);
        assert_eq!(c.params.seed, Some(u64::MAX));
        assert_eq!((c.n, c.stream, c.max_tokens, c.cache), (1, false, None, true));
        let opted_out = common(&fields(json!({"model": "m", "cache": false})), &["max_tokens"]).unwrap();
        assert!(!opted_out.cache);
        let f = fields(json!({"logprobs": true, "top_logprobs": 3}));
        assert_eq!(chat_logprobs(&f).unwrap(), Some(3));
        assert!(chat_logprobs(&fields(json!({"top_logprobs": 3}))).is_err());
    }
}
