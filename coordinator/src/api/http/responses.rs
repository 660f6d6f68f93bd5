//! `POST /v1/responses`: OpenAI's Responses API on the chat request path.
//!
//! The body's `input` (text, or message, `function_call` and `function_call_output`
//! items), `instructions`, function `tools`, `tool_choice`, `text.format` and
//! `reasoning.effort` become a chat completions body, run as a chat request (same keys,
//! tenants, metrics, traces), and its answer is reshaped into output items (`reasoning`,
//! `message`, `function_call`), or, streamed, into the Responses events. A stored
//! response (`store`, default true) keeps its conversation in a bounded store, so a
//! later request continues it with `previous_response_id` — only the same tenant's.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::response::sse::{Event, Sse};
use futures::{Stream, StreamExt};
use serde_json::{json, Map, Value as Json};

use super::error::ApiError;
use super::params::Fields;
use super::respond::Out;
use crate::tenant::Owner;

/// The Responses API's top-level fields; any other is refused, naming it.
const KNOWN: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "text",
    "reasoning",
    "previous_response_id",
    "store",
    "metadata",
    "user",
    "truncation",
    "include",
    "service_tier",
];

/// Bytes of conversations the store keeps; the oldest go first.
pub const STORE_BYTES: usize = 64 << 20;

/// Bytes of conversations one tenant keeps: past them its own oldest go, so one tenant
/// cannot flush everyone's.
pub const TENANT_STORE_BYTES: usize = STORE_BYTES / 4;

/// Conversations of stored responses, by response id, each its owner's (a tenant deleted
/// and made again is another owner: it cannot continue the old one's conversations).
///
/// A conversation is kept as its JSON text, so the bytes counted are the bytes held (kept
/// as JSON values they once held ~35× what was counted); it is parsed again when continued.
#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    /// id → (owner, the conversation's chat messages as JSON text).
    entries: HashMap<String, (Owner, String)>,
    /// Each owner's ids, oldest first, and the bytes they hold.
    owners: HashMap<Owner, (VecDeque<String>, usize)>,
    bytes: usize,
}

impl StoreInner {
    /// Drops `owner`'s oldest conversation; false when it has none.
    fn evict_oldest_of(&mut self, owner: &Owner) -> bool {
        let Some((order, held)) = self.owners.get_mut(owner) else { return false };
        let Some(id) = order.pop_front() else { return false };
        if let Some((_, text)) = self.entries.remove(&id) {
            let size = text.len() + id.len();
            *held -= size;
            self.bytes -= size;
        }
        if order.is_empty() {
            self.owners.remove(owner);
        }
        true
    }

    /// The owner holding the most bytes.
    fn largest(&self) -> Option<Owner> {
        self.owners.iter().max_by_key(|(_, (_, held))| *held).map(|(o, _)| o.clone())
    }
}

impl ResponseStore {
    fn put(&self, id: String, owner: &Owner, messages: Vec<Json>) {
        let mut text = Json::Array(messages).to_string();
        text.shrink_to_fit();
        let size = text.len() + id.len();
        if size > TENANT_STORE_BYTES {
            tracing::debug!(bytes = size, "a conversation too large to store");
            return;
        }
        let mut s = self.inner.lock().expect("response store");
        while s.owners.get(owner).is_some_and(|(_, held)| held + size > TENANT_STORE_BYTES) {
            s.evict_oldest_of(owner);
        }
        // Past the whole store's bound, the owner holding the most gives way.
        while s.bytes + size > STORE_BYTES {
            let Some(largest) = s.largest() else { break };
            s.evict_oldest_of(&largest);
        }
        s.bytes += size;
        let (order, held) = s.owners.entry(owner.clone()).or_default();
        order.push_back(id.clone());
        *held += size;
        s.entries.insert(id, (owner.clone(), text));
    }

    /// The conversation of a stored response of `owner`'s; another's is not found.
    fn get(&self, id: &str, owner: &Owner) -> Option<Vec<Json>> {
        let text = {
            let s = self.inner.lock().expect("response store");
            s.entries.get(id).filter(|e| &e.0 == owner).map(|e| e.1.clone())?
        };
        serde_json::from_str(&text).ok()
    }
}

/// A translated request: the chat body, and what the response echoes.
pub struct Translated {
    pub chat: Fields,
    /// The conversation's chat messages (for the store).
    pub messages: Vec<Json>,
    pub store: bool,
    pub echo: Map<String, Json>,
}

/// The chat completions body of a Responses body (`tenant` may continue its own stored
/// responses).
pub fn to_chat(mut f: Fields, store: &ResponseStore, tenant: &Owner) -> Result<Translated, ApiError> {
    if let Some(unknown) = f.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            unknown.clone(),
            format!("{unknown}: unknown parameter of the Responses API"),
        ));
    }
    let mut chat = Map::new();
    let mut echo = Map::new();
    for key in ["model", "temperature", "top_p", "stream", "parallel_tool_calls", "tool_choice"] {
        if let Some(v) = f.remove(key) {
            echo.insert(key.into(), v.clone());
            chat.insert(key.into(), v);
        }
    }
    if let Some(n) = f.remove("max_output_tokens") {
        echo.insert("max_output_tokens".into(), n.clone());
        chat.insert("max_tokens".into(), n);
    }
    if chat.get("stream").and_then(Json::as_bool) == Some(true) {
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    let mut messages = match f.get("previous_response_id").and_then(Json::as_str) {
        Some(id) => store
            .get(id, tenant)
            .ok_or_else(|| ApiError::not_found(format!("previous_response_id: no stored response {id:?}")))?,
        None => Vec::new(),
    };
    if let Some(Json::String(i)) = f.get("instructions") {
        // Instructions apply to this turn: they replace any the conversation had.
        messages.retain(|m| m["role"] != "system");
        messages.insert(0, json!({"role": "system", "content": i}));
    }
    messages.extend(input(f.remove("input"))?);
    chat.insert("messages".into(), Json::Array(messages.clone()));
    if let Some(Json::Array(tools)) = f.remove("tools") {
        let converted = tools.iter().enumerate().map(|(i, t)| tool(i, t)).collect::<Result<Vec<_>, _>>()?;
        echo.insert("tools".into(), Json::Array(tools));
        chat.insert("tools".into(), Json::Array(converted));
    }
    if let Some(Json::Object(text)) = f.get("text") {
        if let Some(format) = text.get("format") {
            let rf = match format.get("type").and_then(Json::as_str) {
                Some("json_schema") => json!({"type": "json_schema", "json_schema": {
                    "name": format.get("name").cloned().unwrap_or(json!("output")),
                    "schema": format.get("schema").cloned().unwrap_or(Json::Null),
                }}),
                _ => format.clone(),
            };
            chat.insert("response_format".into(), rf);
        }
    }
    if let Some(effort) = f.get("reasoning").and_then(|r| r.get("effort")).filter(|e| !e.is_null()) {
        chat.insert("reasoning_effort".into(), effort.clone());
    }
    if let Some(tc) = chat.get("tool_choice").cloned() {
        // The Responses API names a function flat: {"type": "function", "name": …}.
        if let Some(name) = tc.get("name").filter(|_| tc.get("function").is_none()) {
            chat.insert("tool_choice".into(), json!({"type": "function", "function": {"name": name}}));
        }
    }
    for key in ["previous_response_id", "instructions", "metadata", "text"] {
        if let Some(v) = f.remove(key) {
            echo.insert(key.into(), v);
        }
    }
    let store = f.get("store").and_then(Json::as_bool).unwrap_or(true);
    Ok(Translated { chat, messages, store, echo })
}

fn tool(i: usize, t: &Json) -> Result<Json, ApiError> {
    if t.get("type").and_then(Json::as_str) != Some("function") {
        return Err(ApiError::invalid(format!("tools[{i}].type"), "only function tools are supported"));
    }
    let mut function = Map::new();
    for key in ["name", "description", "parameters", "strict"] {
        if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
            function.insert(key.into(), v.clone());
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

/// Chat messages of `input`: a string, or message and function-call items.
fn input(v: Option<Json>) -> Result<Vec<Json>, ApiError> {
    let items = match v {
        Some(Json::String(s)) => return Ok(vec![json!({"role": "user", "content": s})]),
        Some(Json::Array(items)) => items,
        _ => return Err(ApiError::invalid("input", "input is required: text or an array of items")),
    };
    let mut out: Vec<Json> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match item.get("type").and_then(Json::as_str) {
            None | Some("message") => {
                let role = item.get("role").and_then(Json::as_str).unwrap_or("user");
                let content = match item.get("content") {
                    Some(Json::String(s)) => s.clone(),
                    Some(Json::Array(parts)) => parts
                        .iter()
                        .map(|p| match p.get("type").and_then(Json::as_str) {
                            Some("input_text" | "output_text" | "text") => {
                                Ok(p.get("text").and_then(Json::as_str).unwrap_or(""))
                            }
                            other => Err(ApiError::invalid(
                                format!("input[{i}].content"),
                                format!(
                                    "content parts of type {} are not supported",
                                    other.unwrap_or("(none)")
                                ),
                            )),
                        })
                        .collect::<Result<Vec<_>, _>>()?
                        .join("\n"),
                    _ => return Err(ApiError::invalid(format!("input[{i}].content"), "content is required")),
                };
                out.push(json!({"role": role, "content": content}));
            }
            Some("function_call") => {
                let call = json!({"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}});
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" && last.get("tool_calls").is_some() => {
                        last["tool_calls"].as_array_mut().expect("tool_calls is an array").push(call)
                    }
                    _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
            }
            Some("function_call_output") => {
                let output = match &item["output"] {
                    Json::String(s) => s.clone(),
                    other => other.to_string(),
                };
                out.push(json!({"role": "tool", "tool_call_id": item["call_id"], "content": output}));
            }
            Some("reasoning") => {}
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("input[{i}].type"),
                    format!("items of type {other} are not supported"),
                ))
            }
        }
    }
    Ok(out)
}

/// The response object around `output`.
fn response(
    id: &str,
    created: u64,
    status: &str,
    output: Vec<Json>,
    usage: Json,
    echo: &Map<String, Json>,
) -> Json {
    let mut r = json!({
        "id": id, "object": "response", "created_at": created, "status": status,
        "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Json::Null },
        "error": Json::Null, "output": output, "usage": usage,
        "parallel_tool_calls": echo.get("parallel_tool_calls").cloned().unwrap_or(json!(true)),
        "tool_choice": echo.get("tool_choice").cloned().unwrap_or(json!("auto")),
        "tools": echo.get("tools").cloned().unwrap_or(json!([])),
        "metadata": echo.get("metadata").cloned().unwrap_or(json!({})),
    });
    for key in
        ["model", "temperature", "top_p", "max_output_tokens", "previous_response_id", "instructions", "text"]
    {
        if let Some(v) = echo.get(key) {
            r[key] = v.clone();
        }
    }
    r
}

fn usage_of(u: &Json) -> Json {
    json!({
        "input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"], "total_tokens": u["total_tokens"],
        "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0},
    })
}

/// The output items and assistant chat message of one reply.
fn items(id: &str, reasoning: &str, text: &str, calls: &[(String, String, String)]) -> (Vec<Json>, Json) {
    let mut output = Vec::new();
    if !reasoning.is_empty() {
        output.push(json!({"type": "reasoning", "id": format!("rs_{id}"), "summary": [],
            "content": [{"type": "reasoning_text", "text": reasoning}]}));
    }
    if !text.is_empty() || calls.is_empty() {
        output.push(
            json!({"type": "message", "id": format!("msg_{id}"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}),
        );
    }
    for (i, (call_id, name, args)) in calls.iter().enumerate() {
        output.push(json!({"type": "function_call", "id": format!("fc_{id}_{i}"), "call_id": call_id,
            "name": name, "arguments": args, "status": "completed"}));
    }
    let mut message = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        let calls: Vec<Json> = calls
            .iter()
            .map(|(c, n, a)| json!({"id": c, "type": "function", "function": {"name": n, "arguments": a}}))
            .collect();
        message["tool_calls"] = Json::Array(calls);
    }
    (output, message)
}

/// The Responses object of a chat completion; stores its conversation when asked.
pub fn from_chat(chat: &Json, t: Translated, store: &ResponseStore, tenant: &Owner) -> Json {
    let id = format!("resp_{}", chat["id"].as_str().unwrap_or(""));
    let choice = &chat["choices"][0];
    let m = &choice["message"];
    let calls: Vec<(String, String, String)> = m["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let s = |v: &Json| v.as_str().unwrap_or("").to_string();
            (s(&c["id"]), s(&c["function"]["name"]), s(&c["function"]["arguments"]))
        })
        .collect();
    let text = m["content"].as_str().unwrap_or("");
    let (output, message) = items(&id, m["reasoning_content"].as_str().unwrap_or(""), text, &calls);
    if t.store {
        let mut conversation = t.messages;
        conversation.push(message);
        store.put(id.clone(), tenant, conversation);
    }
    let status = if choice["finish_reason"] == "length" { "incomplete" } else { "completed" };
    response(&id, chat["created"].as_u64().unwrap_or(0), status, output, usage_of(&chat["usage"]), &t.echo)
}

#[path = "responses_stream.rs"]
mod streaming;
pub use streaming::stream;

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(tenant: &str, incarnation: &str) -> Owner {
        Owner { tenant: tenant.into(), incarnation: incarnation.into() }
    }

    #[test]
    fn stored_conversations_are_the_owners_own_and_bounded() {
        let store = ResponseStore::default();
        let alice = owner("alice", "1");
        store.put("r1".into(), &alice, vec![json!({"role": "user", "content": "hi"})]);
        assert_eq!(store.get("r1", &alice).unwrap().len(), 1);
        assert!(store.get("r1", &owner("bob", "1")).is_none(), "another tenant's response is not found");
        assert!(
            store.get("r1", &owner("alice", "2")).is_none(),
            "alice deleted and made again is another owner"
        );
        let big = "x".repeat(TENANT_STORE_BYTES / 3);
        for i in 0..4 {
            store.put(format!("big{i}"), &alice, vec![json!(big.clone())]);
        }
        let inner = store.inner.lock().unwrap();
        assert!(inner.owners[&alice].1 <= TENANT_STORE_BYTES, "{}", inner.bytes);
        assert!(
            !inner.entries.contains_key("r1") && !inner.entries.contains_key("big0"),
            "the oldest went first"
        );
    }

    /// Probed: one tenant's conversations flushed everyone's, and "64 MiB" held 2.4 GB.
    /// What is counted is what is held, and a tenant past its share evicts its own.
    #[test]
    fn one_tenant_cannot_flush_anothers_conversations() {
        let store = ResponseStore::default();
        let (quiet, loud) = (owner("quiet", "1"), owner("loud", "1"));
        store.put("mine".into(), &quiet, vec![json!({"role": "user", "content": "keep me"})]);
        let chunk = "y".repeat(1 << 20);
        for i in 0..((2 * STORE_BYTES) >> 20) {
            store.put(format!("l{i}"), &loud, vec![json!({"role": "user", "content": chunk.clone()})]);
        }
        assert!(store.get("mine", &quiet).is_some(), "the quiet tenant's conversation was flushed");
        let inner = store.inner.lock().unwrap();
        let held: usize = inner.entries.iter().map(|(id, (_, text))| id.len() + text.capacity()).sum();
        assert!(
            held <= STORE_BYTES && held <= inner.bytes + inner.entries.len() * 64,
            "{held} held, {} counted",
            inner.bytes
        );
        assert!(inner.owners[&loud].1 <= TENANT_STORE_BYTES);
    }

    #[test]
    fn input_items_become_chat_messages() {
        let items = json!([
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "now", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]);
        let m = input(Some(items)).unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[1]["tool_calls"].as_array().unwrap().len(), 2, "calls of one turn share a message");
        assert_eq!(m[2], json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"}));
        let bad = input(Some(json!([{"type": "computer_call"}]))).unwrap_err();
        assert_eq!(bad.param.as_deref(), Some("input[0].type"));
    }
}
