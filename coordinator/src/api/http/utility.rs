//! vLLM's utility routes, with its request and response fields: `POST /tokenize` (a
//! prompt, or chat messages rendered with the model's template, to token ids),
//! `POST /detokenize` (token ids to text), `GET /tokenizer_info` (special tokens, chat
//! template, context: what evaluation harnesses tokenize with remotely) and `GET /version`;
//! and the errors every route the API does not have gets, in OpenAI's shape, naming the
//! method and path. As in vLLM, `model` may be left out where the caller can use one
//! model only.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde_json::{json, Value as Json};

use super::error::ApiError;
use super::params::{self, Fields};
use super::HttpState;
use crate::routing::ModelEntry;
use crate::tenant::Caller;

/// What `/tokenize` reads; anything else is refused, naming it.
const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "return_token_strs",
    "chat_template_kwargs",
    "tools",
];

/// What `/detokenize` reads.
const DETOKENIZE_FIELDS: &[&str] = &["model", "tokens"];

pub async fn version() -> Response {
    axum::Json(json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

/// The 404 of a route the API does not have.
pub async fn no_route(method: Method, uri: Uri) -> Response {
    let mut e = ApiError::not_found(format!("Invalid URL ({method} {})", uri.path()));
    e.code = Some("unknown_url");
    e.into_response()
}

/// The 405 of a route that exists for other methods.
pub async fn wrong_method(method: Method, uri: Uri) -> Response {
    let mut e = ApiError::not_found(format!("{method} is not allowed on {}", uri.path()));
    e.status = StatusCode::METHOD_NOT_ALLOWED;
    e.code = Some("method_not_allowed");
    e.into_response()
}

pub async fn tokenize(
    State(state): State<Arc<HttpState>>,
    Extension(who): Extension<Caller>,
    body: Bytes,
) -> Response {
    route(&state, who, body, (TOKENIZE_FIELDS, "/tokenize"), tokenize_fields).await
}

pub async fn detokenize(
    State(state): State<Arc<HttpState>>,
    Extension(who): Extension<Caller>,
    body: Bytes,
) -> Response {
    route(&state, who, body, (DETOKENIZE_FIELDS, "/detokenize"), detokenize_fields).await
}

/// A model route's answer: the body's fields checked against what `route` reads, its
/// model one the caller may use.
async fn route(
    state: &HttpState,
    who: Caller,
    body: Bytes,
    (fields, route): (&'static [&'static str], &'static str),
    answer: fn(&ModelEntry, Fields) -> Result<Json, ApiError>,
) -> Response {
    let models = state.front.models().clone();
    let tenant = who.tenant().to_string();
    let done = blocking(state, &tenant, body, move |f| {
        known(&f, fields, route)?;
        let model = model(&*models, &f, &who)?;
        answer(&model, f)
    });
    done.await.unwrap_or_else(|e| e.into_response())
}

fn detokenize_fields(model: &ModelEntry, f: Fields) -> Result<Json, ApiError> {
    let Some(Json::Array(list)) = f.get("tokens") else {
        return Err(ApiError::invalid("tokens", "tokens is required: an array of token ids"));
    };
    let vocab = model.config.vocab_size as u64;
    let ids = list
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_u64() {
            Some(id) if id < vocab => Ok(id as u32),
            _ => Err(ApiError::invalid(
                format!("tokens[{i}]"),
                format!("{t} is not a token id of model {:?} (vocabulary of {vocab})", model.name),
            )),
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let text = model.tokenizer.decode(&ids).map_err(ApiError::from)?;
    Ok(json!({"prompt": text}))
}

/// The parsed body's answer, computed on the blocking pool under the front end's budget
/// of text worked on at once (tokenizing megabytes is not for the async threads).
async fn blocking(
    state: &HttpState,
    tenant: &str,
    body: Bytes,
    answer: impl FnOnce(Fields) -> Result<Json, ApiError> + Send + 'static,
) -> Result<Response, ApiError> {
    let permit = state.front.texts().acquire(tenant, body.len()).await;
    let done = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        params::object(&body).and_then(answer)
    })
    .await;
    let json =
        done.map_err(|e| ApiError::from(strata_common::Error::Internal(format!("answering: {e}"))))??;
    Ok(axum::Json(json).into_response())
}

/// Refuses a field the route does not read, naming it.
fn known(f: &Fields, fields: &[&str], route: &str) -> Result<(), ApiError> {
    match f.keys().find(|k| !fields.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(k.clone(), format!("{route} takes no parameter {k:?}"))),
        None => Ok(()),
    }
}

/// The body's model, if the caller may use it (another is not found, as if not served).
fn model(
    models: &dyn crate::routing::Catalog,
    f: &Fields,
    who: &Caller,
) -> Result<Arc<ModelEntry>, ApiError> {
    named_model(models, params::string(f, "model")?, who)
}

/// Model `name`, or without a name the one model the caller may use.
fn named_model(
    models: &dyn crate::routing::Catalog,
    name: Option<&str>,
    who: &Caller,
) -> Result<Arc<ModelEntry>, ApiError> {
    let model = match name.filter(|m| !m.is_empty()) {
        Some(name) => models.get(name).map_err(ApiError::from)?,
        None => {
            let mut usable: Vec<_> =
                models.all().into_iter().filter(|m| who.may_use(&m.name).is_ok()).collect();
            if usable.len() != 1 {
                return Err(ApiError::invalid(
                    "model",
                    format!("model is required: {} models are served (GET /v1/models)", usable.len()),
                ));
            }
            usable.remove(0)
        }
    };
    who.may_use(&model.name).map_err(|_| ApiError::not_found(format!("model {:?}", model.name)))?;
    Ok(model)
}

/// `GET /tokenizer_info[?model=NAME]`: the model's special tokens (as tokenizer_config.json
/// names them), chat template and context, in vLLM's fields.
pub async fn tokenizer_info(
    State(state): State<Arc<HttpState>>,
    Extension(who): Extension<Caller>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> Response {
    if let Some(k) = query.keys().find(|k| k.as_str() != "model") {
        return ApiError::invalid(k.clone(), format!("/tokenizer_info takes no parameter {k:?}"))
            .into_response();
    }
    let model = match named_model(&**state.front.models(), query.get("model").map(String::as_str), &who) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let mut info = serde_json::Map::new();
    for name in ["bos_token", "eos_token", "unk_token", "pad_token"] {
        info.insert(name.into(), model.tokenizer.specials().get(name).cloned().unwrap_or(Json::Null));
    }
    // The model's own template only: one the operator set (a deployment's, `serve
    // --chat-template`) is the operator's file, not for every key holder to read.
    let template = model.tokenizer.chat_template().filter(|t| !t.is_operators()).and_then(|t| t.source());
    info.insert("chat_template".into(), json!(template));
    info.insert("model_max_length".into(), json!(model.max_context()));
    info.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    info.insert("model".into(), json!(model.name));
    axum::Json(Json::Object(info)).into_response()
}

fn tokenize_fields(model: &ModelEntry, mut f: Fields) -> Result<Json, ApiError> {
    // Bounded by the context as generation is: text past it is refused, not tokenized whole.
    let context = model.max_context();
    let chat = f.contains_key("messages");
    let text = match (f.get("prompt"), chat) {
        (Some(_), true) => return Err(ApiError::invalid("messages", "give prompt or messages, not both")),
        (Some(Json::String(p)), false) => p.clone(),
        (Some(_), false) => return Err(ApiError::invalid("prompt", "prompt must be a string")),
        (None, true) => render(model, &mut f, context)?,
        (None, false) => return Err(ApiError::invalid("prompt", "prompt (or messages) is required")),
    };
    // A rendered chat carries its special tokens already (as vLLM's default says).
    let special = params::boolean(&f, "add_special_tokens")?.unwrap_or(!chat);
    let ids = model.tokenizer.encode_with(&text, context, special).map_err(ApiError::from)?;
    if ids.len() > context {
        let field = if chat { "messages" } else { "prompt" };
        return Err(ApiError::invalid(
            field,
            format!("{} tokens; the model's context is {context} tokens", ids.len()),
        ));
    }
    let strs = match params::boolean(&f, "return_token_strs")? {
        Some(true) => Json::from(ids.iter().map(|&t| model.tokenizer.token_text(t)).collect::<Vec<_>>()),
        _ => Json::Null,
    };
    Ok(json!({"count": ids.len(), "max_model_len": context, "tokens": ids, "token_strs": strs}))
}

/// Chat messages as the model's template renders them for a chat completion.
fn render(model: &ModelEntry, f: &mut Fields, context: usize) -> Result<String, ApiError> {
    let input = super::completions::chat_input(f)?;
    if model.tokenizer.chat_template().is_none() {
        return Err(ApiError::invalid("messages", format!("model {:?} has no chat template", model.name)));
    }
    Ok(model.tokenizer.render_chat(&input, context)?)
}
