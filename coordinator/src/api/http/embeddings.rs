//! `POST /v1/embeddings`: OpenAI's embeddings API over a decoder model's pooled final
//! hidden states (see the engine's `embed` module for the pooling).
//!
//! `input` is a string, strings, token ids or arrays of ids (at most [`MAX_INPUTS`]); each
//! becomes one request on the same admission, routing, failover, keys, tenants and
//! metrics as a completion, answered by the replica with a vector and no token. Inputs
//! run at most as many at once as the model's slots and the tenant allow, in order.
//! `encoding_format` `float` (default) or `base64` (little-endian f32s, what OpenAI's Python
//! client asks for); `dimensions` only as the model's width. Extensions: `pooling`
//! (`last`, `mean`, `cls`) and `normalize` override the model's.

use std::sync::Arc;

use base64::Engine as _;
use futures::StreamExt;
use serde_json::{json, Value as Json};
use strata_common::{Embed, Pooling, SamplingParams};

use super::error::ApiError;
use super::params::{self, Fields};
use crate::frontend::admission::{self, GenerateRequest, Priority, Prompt};
use crate::frontend::FrontEnd;
use crate::routing::Catalog;
use crate::tenant::Caller;

/// Most inputs of one request (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

const FIELDS: &[&str] = &[
    "model",
    "input",
    "encoding_format",
    "dimensions",
    "user",
    "pooling",
    "normalize",
    "truncate_prompt_tokens",
];

/// A parsed request: one domain request per input, and how to answer.
pub struct EmbedJob {
    model: String,
    requests: Vec<GenerateRequest>,
    base64: bool,
}

/// The inputs of a body, as completions read prompts (under `input`).
fn inputs(f: &Fields) -> Result<Vec<Prompt>, ApiError> {
    let mut as_prompt = f.clone();
    match f.get("input") {
        None | Some(Json::Null) => return Err(ApiError::invalid("input", "input is required")),
        Some(Json::Array(items)) if items.len() > MAX_INPUTS => {
            return Err(ApiError::invalid("input", format!("at most {MAX_INPUTS} inputs")))
        }
        Some(Json::String(s)) if s.is_empty() => {
            return Err(ApiError::invalid("input", "input must not be empty"))
        }
        Some(v) => as_prompt.insert("prompt".into(), v.clone()),
    };
    let prompts = super::completions::prompts_bounded(&as_prompt, MAX_INPUTS).map_err(|mut e| {
        e.param = Some("input".into());
        e.message = e.message.replace("prompt", "input");
        e
    })?;
    if prompts.iter().any(|p| matches!(p, Prompt::Text(t) if t.is_empty())) {
        return Err(ApiError::invalid("input", "an input must not be empty"));
    }
    Ok(prompts)
}

/// A /v1/embeddings body (built on the blocking pool: inputs are tokenized here).
pub fn build(models: &dyn Catalog, f: Fields) -> Result<EmbedJob, ApiError> {
    if let Some(k) = f.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(ApiError::invalid(k.clone(), format!("{k}: unknown parameter")));
    }
    let model_name = match params::string(&f, "model")? {
        Some(m) if !m.is_empty() => m.to_string(),
        _ => {
            return Err(ApiError::invalid("model", "model is required: name a served model (GET /v1/models)"))
        }
    };
    let model = models.get(&model_name).map_err(ApiError::from)?;
    let base64 = match params::string(&f, "encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid("encoding_format", format!("{other:?} is not float or base64")))
        }
    };
    let width = model.config.hidden_size;
    if let Some(d) = params::uint(&f, "dimensions", u32::MAX as u64)? {
        if d as usize != width {
            return Err(ApiError::invalid(
                "dimensions",
                format!("model {model_name:?} embeds in {width} dimensions only"),
            ));
        }
    }
    if f.get("truncate_prompt_tokens").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::invalid(
            "truncate_prompt_tokens",
            "truncation is not supported: send at most the context",
        ));
    }
    let pooling = params::string(&f, "pooling")?.map(Pooling::parse).transpose()?;
    let embed = Embed { pooling, normalize: params::boolean(&f, "normalize")? };
    let mut requests = Vec::new();
    for input in inputs(&f)? {
        let ids = admission::prompt_ids(&input, &model)?;
        requests.push(GenerateRequest {
            model: model_name.clone(),
            prompt: Some(Prompt::TokenIds(ids)),
            max_tokens: Some(1),
            fill_context: false,
            params: SamplingParams { temperature: 0.0, embed: Some(embed), ..Default::default() },
            priority: Priority::Online,
            cache: true,
        });
    }
    Ok(EmbedJob { model: model_name, requests, base64 })
}

/// Runs every input of `job` (a bounded number at once, answers in order) and shapes
/// OpenAI's list.
pub async fn answer(front: &FrontEnd, job: EmbedJob, id: String, who: &Caller) -> Result<Json, ApiError> {
    let slots = front.models().get(&job.model).map_err(ApiError::from)?.routes.gate_size().slots;
    let at_once = slots.min(who.max_concurrent().map_or(usize::MAX, |m| m as usize)).max(1);
    let base64 = job.base64;
    let runs = job.requests.into_iter().enumerate().map(|(i, r)| {
        let request_id = format!("{id}-{i}");
        async move {
            let started = front.begin(r, request_id, None, who).await.map_err(rename)?;
            let prompt_tokens = started.prompt_ids.len();
            let mut rx = started.rx;
            while let Some(chunk) = rx.recv().await {
                if let Some(v) = chunk.map_err(rename)?.embedding {
                    return Ok((prompt_tokens, v));
                }
            }
            Err(ApiError::from(strata_common::Error::Internal(
                "the replica answered with no embedding".into(),
            )))
        }
    });
    let done: Vec<Result<(usize, Vec<f32>), ApiError>> =
        futures::stream::iter(runs).buffered(at_once).collect().await;
    let mut data = Vec::with_capacity(done.len());
    let mut tokens = 0;
    for (i, d) in done.into_iter().enumerate() {
        let (n, v) = d?;
        tokens += n;
        let embedding = if base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            json!(v)
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    Ok(json!({
        "object": "list",
        "id": format!("embd-{id}"),
        "model": job.model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
}

/// Admission names the prompt `prompt`; this API calls it `input`.
fn rename(e: strata_common::Error) -> ApiError {
    ApiError::from_domain(e, |field| field.starts_with("prompt").then(|| "input".to_string()))
}

/// The route.
pub async fn route(
    state: Arc<super::HttpState>,
    who: Caller,
    body: bytes::Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let job = match super::build_job(&state, &who, body, build).await {
        Ok(job) => job,
        Err(e) => return e.into_response(),
    };
    match answer(&state.front, job, state.next_id(), &who).await {
        Ok(body) => axum::Json(body).into_response(),
        Err(e) => e.into_response(),
    }
}
