//! The Responses API's streaming events, made from a chat stream's chunks: the response
//! created and in progress; each output item added, its deltas (reasoning text, output
//! text, function-call arguments) and done; the response completed (or incomplete) with
//! every item — and stored, when asked, once it is complete.

use super::*;

/// The item being streamed.
enum Open {
    Reasoning(String),
    Message(String),
    Call { call_id: String, name: String, args: String },
}

struct State {
    id: String,
    created: u64,
    seq: u64,
    output: Vec<Json>,
    open: Option<Open>,
    calls: Vec<(String, String, String)>,
    text: String,
    reasoning: String,
    finish: Option<String>,
    usage: Json,
    out: Vec<Event>,
    /// What the response echoes of the request.
    echo: Map<String, Json>,
    /// The conversation so far, to store with the reply once it is complete (None: not
    /// stored, or stored already).
    conversation: Option<Vec<Json>>,
    store: Arc<ResponseStore>,
    tenant: crate::tenant::Owner,
}

impl State {
    fn emit(&mut self, kind: &str, mut data: Json) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.out.push(Event::default().event(kind).data(data.to_string()));
    }

    fn item_id(&self) -> String {
        format!("{}_{}", self.id, self.output.len())
    }

    fn open(&mut self, open: Open) {
        self.close();
        let (index, id) = (self.output.len(), self.item_id());
        let item = match &open {
            Open::Reasoning(_) => json!({"type": "reasoning", "id": id, "summary": [], "content": []}),
            Open::Message(_) => {
                json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []})
            }
            Open::Call { call_id, name, .. } => json!({"type": "function_call", "id": id, "call_id": call_id,
                "name": name, "arguments": "", "status": "in_progress"}),
        };
        self.emit("response.output_item.added", json!({"output_index": index, "item": item}));
        if matches!(open, Open::Message(_)) {
            let part = json!({"type": "output_text", "text": "", "annotations": []});
            self.emit(
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
        }
        self.open = Some(open);
    }

    fn close(&mut self) {
        let Some(open) = self.open.take() else { return };
        let (index, id) = (self.output.len(), self.item_id());
        let at = json!({"item_id": id, "output_index": index, "content_index": 0});
        let item = match open {
            Open::Reasoning(text) => {
                self.emit("response.reasoning_text.done", with(&at, &[("text", json!(text))]));
                json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
            }
            Open::Message(text) => {
                self.emit(
                    "response.output_text.done",
                    with(&at, &[("text", json!(text)), ("logprobs", json!([]))]),
                );
                let part = json!({"type": "output_text", "text": text, "annotations": []});
                self.emit("response.content_part.done", with(&at, &[("part", part.clone())]));
                json!({"type": "message", "id": id, "status": "completed", "role": "assistant", "content": [part]})
            }
            Open::Call { call_id, name, args } => {
                self.emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "arguments": args, "name": name}),
                );
                json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": args, "status": "completed"})
            }
        };
        self.emit("response.output_item.done", json!({"output_index": index, "item": item}));
        self.output.push(item);
    }

    fn delta(&mut self, kind: &str, delta: &str) {
        let (index, id) = (self.output.len(), self.item_id());
        let mut data = json!({"item_id": id, "output_index": index, "delta": delta});
        if kind != "response.function_call_arguments.delta" {
            data["content_index"] = json!(0);
        }
        if kind == "response.output_text.delta" {
            data["logprobs"] = json!([]);
        }
        self.emit(kind, data);
    }

    fn chunk(&mut self, chunk: &Json) {
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.usage = usage_of(u);
        }
        let Some(choice) = chunk["choices"].as_array().and_then(|c| c.first()) else { return };
        let d = &choice["delta"];
        if let Some(r) = d.get("reasoning_content").and_then(Json::as_str).filter(|r| !r.is_empty()) {
            if !matches!(self.open, Some(Open::Reasoning(_))) {
                self.open(Open::Reasoning(String::new()));
            }
            if let Some(Open::Reasoning(t)) = &mut self.open {
                t.push_str(r);
            }
            self.reasoning.push_str(r);
            self.delta("response.reasoning_text.delta", r);
        }
        if let Some(t) = d.get("content").and_then(Json::as_str).filter(|t| !t.is_empty()) {
            if !matches!(self.open, Some(Open::Message(_))) {
                self.open(Open::Message(String::new()));
            }
            if let Some(Open::Message(m)) = &mut self.open {
                m.push_str(t);
            }
            self.text.push_str(t);
            self.delta("response.output_text.delta", t);
        }
        for call in d.get("tool_calls").and_then(Json::as_array).into_iter().flatten() {
            if let Some(name) = call["function"]["name"].as_str() {
                let call_id = call["id"].as_str().unwrap_or("").to_string();
                self.calls.push((call_id.clone(), name.to_string(), String::new()));
                self.open(Open::Call { call_id, name: name.to_string(), args: String::new() });
            }
            if let Some(a) = call["function"]["arguments"].as_str().filter(|a| !a.is_empty()) {
                if let Some(Open::Call { args, .. }) = &mut self.open {
                    args.push_str(a);
                }
                if let Some(last) = self.calls.last_mut() {
                    last.2.push_str(a);
                }
                self.delta("response.function_call_arguments.delta", a);
            }
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            self.finish = Some(f.to_string());
        }
    }

    fn done(&mut self) {
        self.close();
        if self.output.is_empty() {
            // An empty reply is still a message.
            self.open(Open::Message(String::new()));
            self.close();
        }
        let (_, message) = items(&self.id, &self.reasoning, &self.text, &self.calls);
        if let Some(mut conversation) = self.conversation.take() {
            conversation.push(message);
            self.store.put(self.id.clone(), &self.tenant, conversation);
        }
        let (kind, status) = match self.finish.as_deref() {
            Some("length") => ("response.incomplete", "incomplete"),
            _ => ("response.completed", "completed"),
        };
        let r = response(&self.id, self.created, status, self.output.clone(), self.usage.clone(), &self.echo);
        self.emit(kind, json!({"response": r}));
    }
}

/// `base` with `fields` set.
fn with(base: &Json, fields: &[(&str, Json)]) -> Json {
    let mut out = base.clone();
    for (k, v) in fields {
        out[*k] = v.clone();
    }
    out
}

/// The Responses event stream of a started chat stream.
pub fn stream(
    chunks: impl Stream<Item = Out> + Send + 'static,
    chat_id: String,
    t: Translated,
    store: Arc<ResponseStore>,
    tenant: crate::tenant::Owner,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let created =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut state = State {
        id: format!("resp_{chat_id}"),
        created,
        seq: 0,
        output: Vec::new(),
        open: None,
        calls: Vec::new(),
        text: String::new(),
        reasoning: String::new(),
        finish: None,
        usage: Json::Null,
        out: Vec::new(),
        conversation: t.store.then_some(t.messages),
        echo: t.echo,
        store,
        tenant,
    };
    let r = response(&state.id, created, "in_progress", Vec::new(), Json::Null, &state.echo);
    state.emit("response.created", json!({"response": r.clone()}));
    state.emit("response.in_progress", json!({"response": r}));
    let first = futures::stream::iter(std::mem::take(&mut state.out));
    let rest = chunks.flat_map(move |out| {
        match out {
            Out::Chunk(c) => state.chunk(&c),
            Out::Error(e) => {
                let data = json!({"code": e.code, "message": e.message, "param": e.param});
                state.emit("error", data);
            }
            Out::Done => state.done(),
        }
        futures::stream::iter(std::mem::take(&mut state.out))
    });
    Sse::new(first.chain(rest).map(Ok))
}
