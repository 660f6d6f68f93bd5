//! `POST /v1/messages`: Anthropic's Messages API on the chat request path.
//!
//! A Messages body is translated into a chat completions body (system prompt, content
//! blocks, `tool_use` and `tool_result` blocks, tools with `input_schema`, `tool_choice`
//! `auto | any | tool | none`, `thinking`), built and run as a chat request — the same
//! admission, keys, tenants, metrics and traces — and its answer reshaped: content blocks
//! (`thinking`, `text`, `tool_use`) with Anthropic's stop reasons, or, streamed, the
//! Messages events (`message_start`, `content_block_start`/`_delta`/`_stop`,
//! `message_delta`, `message_stop`). Errors keep their HTTP status and take Anthropic's
//! shape (`{"type": "error", "error": {"type", "message"}}`).

use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde_json::{json, Map, Value as Json};

use super::error::ApiError;
use super::params::Fields;

/// The Messages API's top-level fields; any other is refused, naming it.
const KNOWN: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "metadata",
    "thinking",
    "service_tier",
];

/// An error in Anthropic's shape, with the status it had.
pub fn error(e: ApiError) -> Response {
    (e.status, axum::Json(error_body(&e))).into_response()
}

/// Anthropic's error object (also what a stream sends when it fails after it started).
fn error_body(e: &ApiError) -> Json {
    let kind = match e.status.as_u16() {
        400 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    // Cut as OpenAI-shaped errors are: a message may quote what the caller sent.
    json!({"type": "error", "error": {"type": kind, "message": super::error::cut(&e.message)}})
}

/// The chat completions body of a Messages body.
pub fn to_chat(mut f: Fields) -> Result<Fields, ApiError> {
    if let Some(unknown) = f.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            unknown.clone(),
            format!("{unknown}: unknown parameter of the Messages API"),
        ));
    }
    if !f.get("max_tokens").is_some_and(Json::is_u64) {
        return Err(ApiError::invalid("max_tokens", "max_tokens is required: a positive integer"));
    }
    let mut out = Map::new();
    for key in ["model", "max_tokens", "temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = f.remove(key) {
            out.insert(key.into(), v);
        }
    }
    if let Some(stop) = f.remove("stop_sequences") {
        out.insert("stop".into(), stop);
    }
    if out.get("stream").and_then(Json::as_bool) == Some(true) {
        out.insert("stream_options".into(), json!({"include_usage": true}));
    }
    let mut messages = Vec::new();
    match f.remove("system") {
        None | Some(Json::Null) => {}
        Some(system) => messages.push(json!({"role": "system", "content": text_of("system", &system)?})),
    }
    let Some(Json::Array(list)) = f.remove("messages") else {
        return Err(ApiError::invalid("messages", "messages is required: an array of {role, content}"));
    };
    for (i, m) in list.iter().enumerate() {
        messages.extend(message(i, m)?);
    }
    out.insert("messages".into(), Json::Array(messages));
    if let Some(Json::Array(tools)) = f.remove("tools") {
        let tools: Vec<Json> = tools
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let name = t.get("name").and_then(Json::as_str).ok_or_else(|| {
                    ApiError::invalid(format!("tools[{i}].name"), "every tool needs a name")
                })?;
                let mut function = json!({"name": name, "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))});
                if let Some(d) = t.get("description") {
                    function["description"] = d.clone();
                }
                Ok(json!({"type": "function", "function": function}))
            })
            .collect::<Result<_, ApiError>>()?;
        out.insert("tools".into(), Json::Array(tools));
    }
    if let Some(choice) = f.remove("tool_choice") {
        let (choice, parallel) = tool_choice(&choice)?;
        out.insert("tool_choice".into(), choice);
        if let Some(p) = parallel {
            out.insert("parallel_tool_calls".into(), json!(p));
        }
    }
    if let Some(thinking) = f.remove("thinking") {
        let on = match thinking.get("type").and_then(Json::as_str) {
            Some("enabled") => true,
            Some("disabled") => false,
            _ => return Err(ApiError::invalid("thinking", "thinking.type must be enabled or disabled")),
        };
        out.insert("chat_template_kwargs".into(), json!({"enable_thinking": on}));
    }
    Ok(out)
}

fn tool_choice(c: &Json) -> Result<(Json, Option<bool>), ApiError> {
    let parallel = c.get("disable_parallel_tool_use").and_then(Json::as_bool).map(|d| !d);
    let choice = match c.get("type").and_then(Json::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match c.get("name").and_then(Json::as_str) {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => {
                return Err(ApiError::invalid("tool_choice.name", "tool_choice of type tool names the tool"))
            }
        },
        _ => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                "tool_choice.type must be auto, any, tool or none",
            ))
        }
    };
    Ok((choice, parallel))
}

/// Text of a string or of text blocks.
fn text_of(field: &str, v: &Json) -> Result<String, ApiError> {
    match v {
        Json::String(s) => Ok(s.clone()),
        Json::Array(blocks) => blocks
            .iter()
            .map(|b| match (b.get("type").and_then(Json::as_str), b.get("text").and_then(Json::as_str)) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => Err(ApiError::invalid(field, format!("{field}: only text blocks are supported here"))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|t| t.join("\n")),
        _ => Err(ApiError::invalid(field, format!("{field} must be a string or an array of text blocks"))),
    }
}

/// The chat messages of Messages message `i`: tool results become `tool` messages.
fn message(i: usize, m: &Json) -> Result<Vec<Json>, ApiError> {
    let field = format!("messages[{i}]");
    let role = match m.get("role").and_then(Json::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => return Err(ApiError::invalid(format!("{field}.role"), "role must be user or assistant")),
    };
    let blocks = match m.get("content") {
        Some(Json::String(s)) => return Ok(vec![json!({"role": role, "content": s})]),
        Some(Json::Array(b)) => b,
        _ => return Err(ApiError::invalid(format!("{field}.content"), "content must be a string or blocks")),
    };
    let (mut out, mut text, mut calls, mut thinking) = (Vec::new(), Vec::new(), Vec::new(), String::new());
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{field}.content[{j}]");
        match b.get("type").and_then(Json::as_str) {
            Some("text") => text.push(b.get("text").and_then(Json::as_str).unwrap_or("").to_string()),
            Some("thinking") => thinking.push_str(b.get("thinking").and_then(Json::as_str).unwrap_or("")),
            Some("tool_use") if role == "assistant" => calls.push(json!({
                "id": b.get("id").cloned().unwrap_or(Json::Null),
                "type": "function",
                "function": {
                    "name": b.get("name").cloned().unwrap_or(Json::Null),
                    "arguments": b.get("input").cloned().unwrap_or(json!({})).to_string(),
                },
            })),
            Some("tool_result") if role == "user" => {
                let content = match b.get("content") {
                    None | Some(Json::Null) => String::new(),
                    Some(c) => text_of(&format!("{at}.content"), c)?,
                };
                out.push(json!({"role": "tool", "tool_call_id": b.get("tool_use_id").cloned().unwrap_or(Json::Null), "content": content}));
            }
            other => {
                return Err(ApiError::invalid(
                    format!("{at}.type"),
                    format!("content blocks of type {} are not supported here", other.unwrap_or("(none)")),
                ))
            }
        }
    }
    if !text.is_empty() || !calls.is_empty() || !thinking.is_empty() {
        let mut msg = json!({"role": role, "content": text.join("\n")});
        if !calls.is_empty() {
            msg["tool_calls"] = Json::Array(calls);
        }
        if !thinking.is_empty() {
            msg["reasoning_content"] = json!(thinking);
        }
        out.insert(0, msg);
    }
    Ok(out)
}

fn stop_reason(finish: Option<&str>) -> Json {
    match finish {
        Some("length") => json!("max_tokens"),
        Some("tool_calls") => json!("tool_use"),
        Some(_) => json!("end_turn"),
        None => Json::Null,
    }
}

/// The Messages response of a chat completion.
pub fn from_chat(chat: &Json) -> Json {
    let choice = &chat["choices"][0];
    let m = &choice["message"];
    let mut content = Vec::new();
    if let Some(r) = m.get("reasoning_content").and_then(Json::as_str).filter(|r| !r.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if let Some(t) = m.get("content").and_then(Json::as_str).filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": t}));
    }
    for call in m.get("tool_calls").and_then(Json::as_array).into_iter().flatten() {
        let input = call["function"]["arguments"]
            .as_str()
            .and_then(|a| serde_json::from_str(a).ok())
            .unwrap_or(json!({}));
        content.push(
            json!({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": input}),
        );
    }
    json!({
        "id": format!("msg_{}", chat["id"].as_str().unwrap_or("")),
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": stop_reason(choice["finish_reason"].as_str()),
        "stop_sequence": Json::Null,
        "usage": {"input_tokens": chat["usage"]["prompt_tokens"], "output_tokens": chat["usage"]["completion_tokens"]},
    })
}

/// Which content block is open in a stream.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Block {
    Thinking,
    Text,
    Tool(u64),
}

/// Reshapes a chat stream into Messages events.
struct Events {
    index: usize,
    open: Option<Block>,
    finish: Option<String>,
    out: Vec<Event>,
}

fn event(kind: &str, data: Json) -> Event {
    Event::default().event(kind).data(data.to_string())
}

impl Events {
    fn start(&mut self, block: Block, body: Json) {
        self.stop();
        self.out.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.index, "content_block": body}),
        ));
        self.open = Some(block);
    }

    fn stop(&mut self) {
        if self.open.take().is_some() {
            self.out.push(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.index}),
            ));
            self.index += 1;
        }
    }

    fn delta(&mut self, delta: Json) {
        self.out.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
        ));
    }

    /// The events of one chat chunk.
    fn chunk(&mut self, chunk: &Json) {
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.stop();
            let delta =
                json!({"stop_reason": stop_reason(self.finish.as_deref()), "stop_sequence": Json::Null});
            let usage =
                json!({"output_tokens": usage["completion_tokens"], "input_tokens": usage["prompt_tokens"]});
            self.out.push(event(
                "message_delta",
                json!({"type": "message_delta", "delta": delta, "usage": usage}),
            ));
        }
        let Some(choice) = chunk["choices"].as_array().and_then(|c| c.first()) else { return };
        let d = &choice["delta"];
        if let Some(r) = d.get("reasoning_content").and_then(Json::as_str).filter(|r| !r.is_empty()) {
            if self.open != Some(Block::Thinking) {
                self.start(Block::Thinking, json!({"type": "thinking", "thinking": "", "signature": ""}));
            }
            self.delta(json!({"type": "thinking_delta", "thinking": r}));
        }
        if let Some(t) = d.get("content").and_then(Json::as_str).filter(|t| !t.is_empty()) {
            if self.open != Some(Block::Text) {
                self.start(Block::Text, json!({"type": "text", "text": ""}));
            }
            self.delta(json!({"type": "text_delta", "text": t}));
        }
        for call in d.get("tool_calls").and_then(Json::as_array).into_iter().flatten() {
            let index = call["index"].as_u64().unwrap_or(0);
            if self.open != Some(Block::Tool(index)) {
                let body = json!({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}});
                self.start(Block::Tool(index), body);
            }
            if let Some(a) = call["function"]["arguments"].as_str().filter(|a| !a.is_empty()) {
                self.delta(json!({"type": "input_json_delta", "partial_json": a}));
            }
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            self.finish = Some(f.to_string());
        }
    }
}

/// The Messages event stream of a started chat stream.
pub fn stream(
    chunks: impl Stream<Item = super::respond::Out> + Send + 'static,
    id: String,
    model: String,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    use super::respond::Out;
    let message = json!({
        "id": format!("msg_{id}"), "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": Json::Null, "stop_sequence": Json::Null, "usage": {"input_tokens": 0, "output_tokens": 0},
    });
    let first =
        futures::stream::iter([event("message_start", json!({"type": "message_start", "message": message}))]);
    let mut state = Events { index: 0, open: None, finish: None, out: Vec::new() };
    let rest = chunks.flat_map(move |out| {
        match out {
            Out::Chunk(c) => state.chunk(&c),
            Out::Error(e) => state.out.push(event("error", error_body(&e))),
            Out::Done => {
                state.stop();
                state.out.push(event("message_stop", json!({"type": "message_stop"})));
            }
        }
        futures::stream::iter(std::mem::take(&mut state.out))
    });
    Sse::new(first.chain(rest).map(Ok))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Probed: a 1 MB model name came back whole in the error. Messages are cut as
    /// OpenAI-shaped errors are.
    #[test]
    fn errors_do_not_echo_megabytes_of_the_request() {
        let e = ApiError::not_found(format!("model {:?}", "m".repeat(1 << 20)));
        let body = error_body(&e);
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.len() < 2048, "{} bytes", message.len());
        assert!(message.starts_with("model \"mmm"), "{message:.40}");
    }
}
