//! Tool calls out of a model's text: the formats models emit, parsed whole or as a stream.
//!
//! Each [`ToolFormat`] reads a text into content (what lies outside the calls) and calls
//! (a name and the arguments' JSON text). The same reader serves streaming: it runs on the
//! text so far and reports only what can no longer change — content stops before anything
//! that could be the start of a call marker, a call's arguments grow as they are
//! generated — and [`ToolStream`] sends the difference since the last chunk. So a streamed
//! answer is, joined, exactly the unstreamed one (the tests check every split).
//!
//! Formats (named as vLLM's `--tool-call-parser` names them, so command lines carry over):
//! `hermes` (Hermes, Qwen: `<tool_call>{json}</tool_call>`), `llama3_json` (Llama 3.x:
//! the reply is `{"name", "parameters"}` objects separated by `;`, optionally after
//! `<|python_tag|>`), `mistral` (`[TOOL_CALLS]` then a JSON array, or `name[ARGS]{json}`),
//! `deepseek_v3` (DeepSeek's `<｜tool▁call▁begin｜>` blocks) and `openai` (gpt-oss's
//! harmony channels: `to=functions.NAME … <|message|>{json}<|call|>`).
//!
//! Calls forced by `tool_choice` (`required`, a named function) are not read from a
//! model's format: the output is constrained to JSON ([`crate::request::tools::forced`])
//! and read as such, whatever the model.

use serde_json::Value as Json;

#[path = "tools_forced.rs"]
pub mod forced;

/// A model family's tool-call format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
    DeepseekV3,
    Openai,
}

/// DeepSeek's markers (full-width bars and the lower-one-eighth block).
const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";

impl ToolFormat {
    /// The format vLLM's parser of this name reads.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "hermes" | "qwen" | "qwen3" => ToolFormat::Hermes,
            "llama3_json" | "llama4_json" => ToolFormat::Llama3Json,
            "mistral" => ToolFormat::Mistral,
            "deepseek_v3" | "deepseek_v31" => ToolFormat::DeepseekV3,
            "openai" => ToolFormat::Openai,
            _ => return None,
        })
    }

    pub const NAMES: &'static str = "hermes, llama3_json, mistral, deepseek_v3, openai";

    /// The format a chat template writes tool calls in, judged by its markers.
    pub fn detect(template: &str) -> Option<Self> {
        if template.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if template.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if template.contains("tool▁call▁begin") {
            Some(ToolFormat::DeepseekV3)
        } else if template.contains("<|channel|>") {
            Some(ToolFormat::Openai)
        } else if template.contains("<|python_tag|>") || template.contains("\"parameters\"") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The markers that open a call region: content is held back while it ends in a
    /// prefix of one.
    fn starts(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hermes => &["<tool_call>"],
            ToolFormat::Llama3Json => &["<|python_tag|>", "{"],
            ToolFormat::Mistral => &["[TOOL_CALLS]"],
            ToolFormat::DeepseekV3 => &[DS_CALLS_BEGIN, DS_CALL_BEGIN],
            ToolFormat::Openai => &["<|channel|>", "<|start|>"],
        }
    }

    /// Content and calls of `text`. With `partial`, `text` is a prefix of the output:
    /// only what later text cannot change is reported (content short of a possible
    /// marker, arguments as far as generated, names once complete).
    pub fn read(self, text: &str, partial: bool) -> Parsed {
        match self {
            ToolFormat::Hermes => read_hermes(text, partial),
            ToolFormat::Llama3Json => read_llama3(text, partial),
            ToolFormat::Mistral => read_mistral(text, partial),
            ToolFormat::DeepseekV3 => read_deepseek(text, partial),
            ToolFormat::Openai => read_harmony(text, partial),
        }
        .held_back(self.starts(), partial)
    }
}

/// A text read for tool calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<Call>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Call {
    /// None until the whole name has been generated.
    pub name: Option<String>,
    /// The arguments' JSON text as far as generated.
    pub arguments: String,
}

impl Parsed {
    /// Content that ends in a prefix of a start marker (or in whitespace, which a call
    /// after it would trim) is cut before it while partial and no call has begun.
    fn held_back(mut self, starts: &[&str], partial: bool) -> Self {
        if partial && self.calls.is_empty() {
            let cut = possible_marker_start(&self.content, starts);
            self.content.truncate(cut);
            self.content.truncate(self.content.trim_end().len());
        }
        self
    }
}

/// Where in `text` a suffix begins that is a proper prefix of one of `markers` (the
/// text's length when none).
pub(crate) fn possible_marker_start(text: &str, markers: &[&str]) -> usize {
    let mut cut = text.len();
    for m in markers {
        for (i, _) in m.char_indices().skip(1).chain([(m.len(), ' ')]) {
            let prefix = &m[..i];
            if i < m.len() && text.ends_with(prefix) {
                cut = cut.min(text.len() - prefix.len());
            }
        }
    }
    cut
}

/// Reasoning written between `<think>` and `</think>` (DeepSeek-R1, Qwen3 and their
/// kin), and the reply after it. `starts_inside`: the prompt opened the block already.
pub fn split_think(text: &str, partial: bool, starts_inside: bool) -> (String, &str) {
    const OPEN: &str = "<think>";
    const CLOSE: &str = "</think>";
    let body = if starts_inside {
        text
    } else {
        let t = text.trim_start();
        match t.strip_prefix(OPEN) {
            Some(body) => body,
            None if partial && OPEN.starts_with(t) => return (String::new(), ""),
            None => return (String::new(), text),
        }
    };
    match body.find(CLOSE) {
        Some(i) => (body[..i].to_string(), body[i + CLOSE.len()..].trim_start()),
        None if partial => (body[..possible_marker_start(body, &[CLOSE])].to_string(), ""),
        None => (body.to_string(), ""),
    }
}

/// gpt-oss's reasoning: its `analysis` channel.
pub fn harmony_reasoning(text: &str, partial: bool) -> String {
    let mut out = String::new();
    for message in text.split("<|channel|>").skip(1) {
        let Some(body) =
            message.strip_prefix("analysis").and_then(|m| m.split_once("<|message|>")).map(|x| x.1)
        else {
            continue;
        };
        let ends: &[&str] = &["<|end|>", "<|start|>", "<|channel|>"];
        match ends.iter().filter_map(|e| body.find(e)).min() {
            Some(e) => out.push_str(&body[..e]),
            None if partial => out.push_str(&body[..possible_marker_start(body, ends)]),
            None => out.push_str(body),
        }
    }
    out
}

/// The text before `end` in `s` (all of `s` less a possible partial `end` while partial),
/// and whether `end` was found.
fn until<'a>(s: &'a str, end: &str, partial: bool) -> (&'a str, bool) {
    match s.find(end) {
        Some(i) => (&s[..i], true),
        None if partial => (&s[..possible_marker_start(s, &[end])], false),
        None => (s, false),
    }
}

fn read_hermes(text: &str, partial: bool) -> Parsed {
    let mut out = Parsed::default();
    let Some(first) = text.find("<tool_call>") else {
        out.content = text.to_string();
        return out;
    };
    out.content = text[..first].trim_end().to_string();
    let mut rest = &text[first..];
    while let Some(body) = rest.strip_prefix("<tool_call>") {
        let (inner, closed) = until(body, "</tool_call>", partial);
        out.calls.push(json_call(inner, !closed && partial));
        if !closed {
            break;
        }
        rest = body[inner.len() + "</tool_call>".len()..].trim_start();
    }
    out
}

fn read_llama3(text: &str, partial: bool) -> Parsed {
    let body = text.strip_prefix("<|python_tag|>").unwrap_or(text);
    let trimmed = body.trim_start();
    if partial && trimmed.is_empty() {
        return Parsed::default(); // the tag alone: calls may follow
    }
    if !trimmed.starts_with('{') {
        return Parsed { content: text.to_string(), calls: Vec::new() };
    }
    let mut out = Parsed::default();
    let pieces = split_top_level(trimmed, ';');
    for (i, piece) in pieces.iter().enumerate() {
        let last = i + 1 == pieces.len();
        let piece = piece.trim();
        if !piece.is_empty() {
            out.calls.push(json_call(piece, partial && last));
        }
    }
    out
}

fn read_mistral(text: &str, partial: bool) -> Parsed {
    let Some(first) = text.find("[TOOL_CALLS]") else {
        return Parsed { content: text.to_string(), calls: Vec::new() };
    };
    let mut out = Parsed { content: text[..first].trim_end().to_string(), calls: Vec::new() };
    let body = text[first + "[TOOL_CALLS]".len()..].trim_start();
    if body.starts_with('[') {
        out.calls = json_array_calls(body, partial);
        return out;
    }
    // name[ARGS]{json}, repeated after further [TOOL_CALLS] markers.
    let blocks: Vec<&str> = body.split("[TOOL_CALLS]").collect();
    for (i, block) in blocks.iter().enumerate() {
        let (name, mut args) = match block.find("[ARGS]") {
            Some(i) => (Some(block[..i].trim().to_string()), &block[i + "[ARGS]".len()..]),
            None => (None, ""),
        };
        if partial && i + 1 == blocks.len() {
            args = &args[..possible_marker_start(args, &["[TOOL_CALLS]"])];
        }
        out.calls.push(Call { name, arguments: args.trim().to_string() });
    }
    out
}

fn read_deepseek(text: &str, partial: bool) -> Parsed {
    let start = [DS_CALLS_BEGIN, DS_CALL_BEGIN].iter().filter_map(|m| text.find(m)).min();
    let Some(first) = start else { return Parsed { content: text.to_string(), calls: Vec::new() } };
    let mut out = Parsed { content: text[..first].trim_end().to_string(), calls: Vec::new() };
    for block in text[first..].split(DS_CALL_BEGIN).skip(1) {
        let (inner, _) = until(block, DS_CALL_END, partial);
        let inner = inner.split(DS_CALLS_END).next().unwrap_or("");
        let Some(sep) = inner.find(DS_SEP) else {
            out.calls.push(Call::default());
            continue;
        };
        let after = &inner[sep + DS_SEP.len()..];
        // V3: function<sep>NAME\n```json\nARGS\n```; V3.1: NAME<sep>ARGS.
        let (name, args) = if inner[..sep].trim() == "function" {
            match after.find('\n') {
                Some(nl) => {
                    let args = after[nl + 1..].trim_start_matches("```json").trim_start();
                    let (args, _) = until(args, "```", partial);
                    (Some(after[..nl].trim().to_string()), args.trim_end().to_string())
                }
                None => (None, String::new()),
            }
        } else {
            (Some(inner[..sep].trim().to_string()), after.trim().to_string())
        };
        out.calls.push(Call { name, arguments: args });
    }
    out
}

fn read_harmony(text: &str, partial: bool) -> Parsed {
    let mut out = Parsed::default();
    if !text.contains("<|channel|>") {
        out.content = text.to_string();
        return out;
    }
    for message in text.split("<|channel|>").skip(1) {
        let Some(m) = message.find("<|message|>") else {
            if message.contains(" to=functions.") {
                out.calls.push(Call::default());
            }
            continue;
        };
        let header = &message[..m];
        let body = &message[m + "<|message|>".len()..];
        let ends: &[&str] = &["<|call|>", "<|end|>", "<|return|>", "<|start|>"];
        let end = ends.iter().filter_map(|e| body.find(e)).min();
        let body = match end {
            Some(e) => &body[..e],
            None if partial => &body[..possible_marker_start(body, ends)],
            None => body,
        };
        if let Some(at) = header.find("to=functions.") {
            let name = header[at + "to=functions.".len()..].split([' ', '<']).next().unwrap_or("");
            out.calls.push(Call { name: Some(name.to_string()), arguments: body.to_string() });
        } else if header.starts_with("final") && out.calls.is_empty() {
            out.content.push_str(body);
        }
    }
    out
}

/// A call written as a JSON object `{"name": …, "arguments" | "parameters": …}`. While
/// `partial`, the arguments are the value's text as far as generated (when the name comes
/// first, as every format writes it).
fn json_call(text: &str, partial: bool) -> Call {
    let text = text.trim();
    if let Ok(Json::Object(o)) = serde_json::from_str::<Json>(text) {
        let name = o.get("name").and_then(Json::as_str).map(str::to_string);
        let args = o
            .get("arguments")
            .or_else(|| o.get("parameters"))
            .cloned()
            .unwrap_or(Json::Object(Default::default()));
        let arguments = match args {
            Json::String(s) => s,
            v => value_text(text, &v),
        };
        return Call { name, arguments };
    }
    if !partial {
        return Call { name: None, arguments: text.to_string() };
    }
    let name = key_string(text, "name");
    let arguments = ["\"arguments\"", "\"parameters\""]
        .iter()
        .find_map(|k| text.find(k).map(|i| &text[i + k.len()..]))
        .and_then(|rest| rest.trim_start().strip_prefix(':'))
        .map(|v| value_prefix(v.trim_start()))
        .unwrap_or_default();
    Call { name, arguments }
}

/// The text of the arguments value as the model wrote it (spacing kept), found by
/// serializing it when the raw slice cannot be located.
fn value_text(text: &str, v: &Json) -> String {
    for k in ["\"arguments\"", "\"parameters\""] {
        if let Some(i) = text.find(k) {
            if let Some(rest) = text[i + k.len()..].trim_start().strip_prefix(':') {
                let prefix = value_prefix(rest.trim_start());
                if serde_json::from_str::<Json>(&prefix).ok().as_ref() == Some(v) {
                    return prefix;
                }
            }
        }
    }
    v.to_string()
}

/// The complete string value of `"key"` in a partial JSON object, if generated.
fn key_string(text: &str, key: &str) -> Option<String> {
    let at = text.find(&format!("\"{key}\""))?;
    let rest = text[at + key.len() + 2..].trim_start().strip_prefix(':')?.trim_start();
    let mut de = serde_json::Deserializer::from_str(rest).into_iter::<String>();
    de.next()?.ok()
}

/// Where a left-to-right read of JSON text stands: inside a string or not, and how deep
/// in objects and arrays.
#[derive(Default)]
struct JsonScan {
    depth: i32,
    in_str: bool,
    escaped: bool,
}

impl JsonScan {
    /// Reads `c`: `Some(c)` for a character outside strings (brackets already counted),
    /// None inside a string or for its quotes.
    fn feed(&mut self, c: char) -> Option<char> {
        if self.in_str {
            match (self.escaped, c) {
                (true, _) => self.escaped = false,
                (false, '\\') => self.escaped = true,
                (false, '"') => self.in_str = false,
                _ => {}
            }
            return None;
        }
        match c {
            '"' => {
                self.in_str = true;
                return None;
            }
            '{' | '[' => self.depth += 1,
            '}' | ']' => self.depth -= 1,
            _ => {}
        }
        Some(c)
    }
}

/// The longest prefix of `s` that is still inside one JSON value (it ends where the
/// value's outermost bracket closes).
fn value_prefix(s: &str) -> String {
    let mut scan = JsonScan::default();
    for (i, c) in s.char_indices() {
        match scan.feed(c) {
            Some('}' | ']') if scan.depth == 0 => return s[..=i].to_string(),
            // The object around a bare value closed.
            Some('}' | ']') if scan.depth < 0 => return s[..i].trim_end().to_string(),
            Some(',') if scan.depth == 0 => return s[..i].trim_end().to_string(),
            _ => {}
        }
    }
    s.to_string()
}

/// The calls of a JSON array of `{"name", "arguments" | "parameters"}` objects (the text
/// from its `[`).
pub(crate) fn json_array_calls(text: &str, partial: bool) -> Vec<Call> {
    let inner = text.trim_start().strip_prefix('[').unwrap_or(text);
    let pieces = split_top_level(inner, ',');
    let n = pieces.len();
    pieces
        .into_iter()
        .enumerate()
        .filter_map(|(i, piece)| {
            let piece = piece.trim();
            // The last piece ends where the array does.
            let piece = if i + 1 == n { piece.strip_suffix(']').unwrap_or(piece).trim_end() } else { piece };
            piece.starts_with('{').then(|| json_call(piece, partial && i + 1 == n))
        })
        .collect()
}

/// `s` split at `sep` where it is outside strings, objects and arrays.
fn split_top_level(s: &str, sep: char) -> Vec<&str> {
    let (mut scan, mut from) = (JsonScan::default(), 0);
    let mut out = Vec::new();
    for (i, c) in s.char_indices() {
        if scan.feed(c) == Some(sep) && scan.depth == 0 {
            out.push(&s[from..i]);
            from = i + c.len_utf8();
        }
    }
    out.push(&s[from..]);
    out
}

/// A whole reply read: reasoning (`reasoning_content`), then content and calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reply {
    pub reasoning: String,
    pub parsed: Parsed,
}

/// What a stream sends next for one choice.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    /// The start of call `index` (its name) or more of its arguments.
    Call {
        index: usize,
        name: Option<String>,
        arguments: String,
    },
}

/// Reads a reply's text so far (`true`: partial) — a [`ToolStream`]'s reader.
pub type ReplyFn = Box<dyn Fn(&str, bool) -> Reply + Send + Sync>;

/// One choice's streamed reply: text in, deltas out.
pub struct ToolStream {
    reader: ReplyFn,
    text: String,
    sent: Parsed,
    sent_reasoning: String,
}

impl ToolStream {
    pub fn new(reader: impl Fn(&str, bool) -> Reply + Send + Sync + 'static) -> Self {
        ToolStream {
            reader: Box::new(reader),
            text: String::new(),
            sent: Parsed::default(),
            sent_reasoning: String::new(),
        }
    }

    /// The deltas `more` text makes (`last`: the output ends with it).
    pub fn push(&mut self, more: &str, last: bool) -> Vec<Delta> {
        self.text.push_str(more);
        let Reply { reasoning, parsed: now } = (self.reader)(&self.text, !last);
        let mut out = Vec::new();
        if let Some(new) = grow(&mut self.sent_reasoning, reasoning) {
            out.push(Delta::Reasoning(new));
        }
        if let Some(new) = grow(&mut self.sent.content, now.content) {
            out.push(Delta::Content(new));
        }
        for (index, call) in now.calls.into_iter().enumerate() {
            if let Some(sent) = self.sent.calls.get_mut(index) {
                if let Some(arguments) = grow(&mut sent.arguments, call.arguments) {
                    out.push(Delta::Call { index, name: None, arguments });
                }
            } else if index == self.sent.calls.len() && call.name.is_some() {
                // A call is announced with its name, in order, with its arguments so far.
                out.push(Delta::Call { index, name: call.name.clone(), arguments: call.arguments.clone() });
                self.sent.calls.push(call);
            }
        }
        out
    }
}

/// What `now` adds to `sent` (which becomes `now`), when it extends it by anything.
fn grow(sent: &mut String, now: String) -> Option<String> {
    let new = now.strip_prefix(sent.as_str()).filter(|n| !n.is_empty())?.to_string();
    *sent = now;
    Some(new)
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
