//! Reasoning and tool calls in chat responses: the assistant message with
//! `reasoning_content` and `tool_calls`, and streamed deltas of each (a call's name
//! first, then its arguments as they are generated).

use serde_json::{json, Value as Json};
use strata_common::FinishReason;

use crate::request::reply::ReplyReader;
use crate::request::tools::forced::ToolPlan;
use crate::request::tools::{Delta, ToolStream};

/// OpenAI's finish reason: `length` wins; a reply with calls ends in `tool_calls`
/// (except a named tool_choice, which OpenAI ends in `stop`).
pub fn finish_reason(
    plan: Option<&ToolPlan>,
    finish: Option<FinishReason>,
    calls: usize,
) -> Option<&'static str> {
    match (finish?, plan) {
        (FinishReason::Length, _) => Some("length"),
        (_, Some(plan)) => Some(plan.finish_reason(calls)),
        _ => Some("stop"),
    }
}

/// A call's id: unique per response, choice and call.
fn call_id(prefix: &str, index: usize) -> String {
    format!("call_{prefix}_{index}")
}

/// The assistant message of a whole reply and its finish reason.
pub fn message(
    reader: Option<&ReplyReader>,
    text: String,
    finish: Option<FinishReason>,
    prefix: &str,
) -> (Json, Option<&'static str>) {
    let Some(reader) = reader else {
        return (json!({"role": "assistant", "content": text}), finish_reason(None, finish, 0));
    };
    let reply = reader.read(&text, false);
    let parsed = reply.parsed;
    let calls: Vec<Json> = parsed
        .calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "id": call_id(prefix, i),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })
        })
        .collect();
    let content =
        if parsed.content.is_empty() && !calls.is_empty() { Json::Null } else { json!(parsed.content) };
    let mut m = json!({"role": "assistant", "content": content});
    if reader.reasoning.is_some() {
        m["reasoning_content"] = json!(reply.reasoning);
    }
    if !calls.is_empty() {
        m["tool_calls"] = Json::Array(calls);
    }
    (m, finish_reason(reader.tools.as_ref(), finish, parsed.calls.len()))
}

/// One choice's streamed reply, read for reasoning and tool calls.
pub struct StreamedCalls {
    stream: ToolStream,
    prefix: String,
    calls: usize,
    plan: Option<ToolPlan>,
}

impl StreamedCalls {
    pub fn new(reader: &ReplyReader, prefix: String) -> Self {
        let plan = reader.tools.clone();
        let reader = reader.clone();
        StreamedCalls {
            stream: ToolStream::new(move |t, partial| reader.read(t, partial)),
            prefix,
            calls: 0,
            plan,
        }
    }

    /// The chat delta of `text` (`finish` set on the last) and its finish reason.
    pub fn delta(&mut self, text: &str, finish: Option<FinishReason>) -> (Json, Option<&'static str>) {
        let mut content = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        for d in self.stream.push(text, finish.is_some()) {
            match d {
                Delta::Reasoning(r) => reasoning.push_str(&r),
                Delta::Content(c) => content.push_str(&c),
                Delta::Call { index, name, arguments } => {
                    let mut call = json!({"index": index, "function": {"arguments": arguments}});
                    if let Some(name) = name {
                        self.calls = self.calls.max(index + 1);
                        call["id"] = json!(call_id(&self.prefix, index));
                        call["type"] = json!("function");
                        call["function"]["name"] = json!(name);
                    }
                    calls.push(call);
                }
            }
        }
        let mut delta = json!({"content": content});
        let quiet = content.is_empty() && (!calls.is_empty() || !reasoning.is_empty());
        if !reasoning.is_empty() {
            delta["reasoning_content"] = json!(reasoning);
        }
        if !calls.is_empty() {
            delta["tool_calls"] = Json::Array(calls);
        }
        if quiet {
            delta["content"] = Json::Null;
        }
        (delta, finish_reason(self.plan.as_ref(), finish, self.calls))
    }
}
