//! Running a parsed request and answering in OpenAI's shapes: one JSON response, or
//! server-sent events (`data: {chunk}` … `data: [DONE]`).
//!
//! Every choice is started before the response begins, so a request that cannot start
//! (bad prompt, unknown model, every replica full) gets an HTTP error status. A stream
//! that fails later sends `data: {"error": {…}}`, which OpenAI's clients raise as an
//! `APIError`. A client that goes away drops the body; that drops the choices' chunk
//! receivers, which cancels their sequences on the replicas.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use serde_json::{json, Map, Value as Json};
use strata_common::{FinishReason, TokenLogprobs};
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use super::completions::{rename, Api, Job};
use super::error::ApiError;
use super::prompt_logprobs;
use super::tool_calls::{self, StreamedCalls};
use super::HttpState;
use crate::frontend::{FrontEnd, Started};
use crate::request::generation::{self, Chunk};
use crate::request::span::request_span;
use crate::request::tokenizer::Tokenizer;
use crate::routing::ModelEntry;
use crate::tenant::Caller;
use strata_common::trace::TraceContext;

/// What identifies one response: its id, creation time and model.
#[derive(Clone)]
struct Head {
    id: String,
    created: u64,
    model: String,
}

impl Head {
    fn object(&self, api: Api, stream: bool) -> Map<String, Json> {
        let object = match (api, stream) {
            (Api::Completion, _) => "text_completion",
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
        };
        let mut m = Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(object));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m
    }
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// Starts every choice of `job`; the first that cannot start fails the request (and
/// dropping the others cancels them).
async fn start_all(
    front: &FrontEnd,
    job: &Job,
    head: &Head,
    who: &Caller,
    caller: Option<&TraceContext>,
) -> Result<Vec<Started>, ApiError> {
    // Choices start together and each holds a slot: more than can ever run at once would
    // hold every slot while waiting for the rest, starving other callers, then fail.
    let n = job.choices.len();
    let slots = front.models().get(&job.common.model).map_err(ApiError::from)?.routes.gate_size().slots;
    for (most, whose) in [
        (slots, "the model's slots on this coordinator"),
        (who.max_concurrent().map_or(usize::MAX, |m| m as usize), "the tenant's max_concurrent"),
    ] {
        if n > 1 && n > most {
            return Err(ApiError::invalid(
                "n",
                format!("{n} choices; at most {most} can run at once ({whose})"),
            ));
        }
    }
    // Several choices take their slots together, or wait holding none (see frontend::fair).
    let mut slots = match n {
        1 => Vec::new(),
        _ => {
            let cost = job.choices.iter().map(|c| choice_cost(&c.request)).sum();
            let priority = job.choices[0].request.priority;
            let taken = front.take_slots(&job.common.model, who, (n, cost, priority), None).await;
            taken.map_err(|e| ApiError::from_domain(e, rename(job)))?
        }
    };
    let starts = job.choices.iter().map(|c| {
        let request_id = format!("{}-{}", head.id, c.index);
        let span = request_span(&c.request.model, &request_id, job.common.stream, caller);
        front.begin_in(c.request.clone(), request_id, None, who, slots.pop()).instrument(span)
    });
    futures::future::try_join_all(starts).await.map_err(|e| ApiError::from_domain(e, rename(job)))
}

/// What a choice costs in the fair gate: its prompt's tokens and its most output.
fn choice_cost(r: &crate::frontend::admission::GenerateRequest) -> u64 {
    let prompt = match &r.prompt {
        Some(crate::frontend::admission::Prompt::TokenIds(ids)) => ids.len(),
        Some(crate::frontend::admission::Prompt::Text(t) | crate::frontend::admission::Prompt::Chat(t)) => {
            t.len() / 4
        }
        None => 0,
    };
    (prompt + r.max_tokens.unwrap_or(crate::frontend::admission::DEFAULT_MAX_TOKENS) as usize) as u64
}

impl Head {
    fn new(job: &Job, id: String) -> Self {
        let prefix = if job.api == Api::Chat { "chatcmpl" } else { "cmpl" };
        Head {
            id: format!("{prefix}-{id}"),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: job.common.model.clone(),
        }
    }
}

pub async fn run(state: Arc<HttpState>, job: Job, who: Caller, caller: Option<TraceContext>) -> Response {
    let head = Head::new(&job, state.next_id());
    let started = match start_all(&state.front, &job, &head, &who, caller.as_ref()).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    if job.common.stream {
        match first_events(started, &job).await {
            Ok((started, firsts)) => stream(job, head, started, firsts).into_response(),
            Err(e) => e.into_response(),
        }
    } else {
        match unary(&job, &head, started).await {
            Ok(body) => axum::Json(body).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

/// The whole (non-streamed) response body of `job` in OpenAI's shape, `id` naming it:
/// what a batch job's request gets, and what the APIs that reshape it (Messages,
/// Responses) start from.
pub async fn answer(
    front: &FrontEnd,
    job: &Job,
    id: String,
    who: &Caller,
    caller: Option<&TraceContext>,
) -> Result<Json, ApiError> {
    let head = Head::new(job, id);
    let started = start_all(front, job, &head, who, caller).await?;
    unary(job, &head, started).await
}

/// Everything one choice produced.
#[derive(Default)]
struct Collected {
    text: String,
    tokens: usize,
    logprobs: Vec<TokenLogprobs>,
    /// The prompt's, when asked for.
    prompt: Option<Vec<TokenLogprobs>>,
    finish: Option<FinishReason>,
    revision: u64,
}

/// What responses say served them: the model revision (OpenAI's field for "the backend
/// configuration the model runs with"); null where models have no revisions (static mode).
fn fingerprint(revision: u64) -> Json {
    match revision {
        0 => Json::Null,
        r => json!(format!("r{r}")),
    }
}

async fn collect(mut rx: generation::ChunkRx, job: &Job) -> Result<Collected, ApiError> {
    let mut c = Collected::default();
    while let Some(chunk) = rx.recv().await {
        let chunk = chunk.map_err(|e| ApiError::from_domain(e, rename(job)))?;
        c.text.push_str(&chunk.text);
        c.tokens += chunk.token_ids.len();
        c.logprobs.extend(chunk.logprobs);
        c.prompt = chunk.prompt_logprobs.or(c.prompt.take());
        c.revision = chunk.revision;
        if let Some(f) = chunk.finish {
            c.finish = Some(f);
            break;
        }
    }
    Ok(c)
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Json {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Prompt tokens of a request: each prompt once, however many choices continue it.
fn prompt_tokens(job: &Job, started: &[Started]) -> usize {
    let mut seen = Vec::new();
    let mut total = 0;
    for (c, s) in job.choices.iter().zip(started) {
        if !seen.contains(&c.prompt) {
            seen.push(c.prompt);
            total += s.prompt_ids.len();
        }
    }
    total
}

async fn unary(job: &Job, head: &Head, started: Vec<Started>) -> Result<Json, ApiError> {
    let prompt_tokens = prompt_tokens(job, &started);
    let tokenizers: Vec<Arc<crate::routing::ModelEntry>> = started.iter().map(|s| s.model.clone()).collect();
    let prompts: Vec<Vec<u32>> = started.iter().map(|s| s.prompt_ids.clone()).collect();
    let results = futures::future::try_join_all(started.into_iter().map(|s| collect(s.rx, job))).await?;
    let mut choices = Vec::with_capacity(results.len());
    let mut completion_tokens = 0;
    let revision = results.first().map_or(0, |c| c.revision);
    let wanted = job.common.prompt_logprobs;
    let mut listed_first = None;
    for (((choice, c), model), prompt) in job.choices.iter().zip(results).zip(&tokenizers).zip(&prompts) {
        completion_tokens += c.tokens;
        let finish = c.finish.map(finish_str);
        let tok = &model.tokenizer;
        let listed = wanted.listed.zip(c.prompt.as_deref()).map(|(n, p)| prompt_logprobs::listed(tok, p, n));
        let entry = match job.api {
            Api::Completion => {
                let echo = job.echo.as_ref().map(|e| e[choice.prompt].as_str()).unwrap_or("");
                let mut logprobs = job.choices[0]
                    .request
                    .params
                    .logprobs
                    .map(|_| completion_logprobs(tok, &c.logprobs, echo.len()));
                if let (Some(n), Some(p)) = (wanted.echoed, c.prompt.as_deref()) {
                    logprobs = logprobs.map(|lp| prompt_logprobs::with_echo(tok, prompt, p, n, lp));
                }
                let mut entry = json!({"index": choice.index, "text": format!("{echo}{}", c.text), "logprobs": logprobs, "finish_reason": finish});
                if let Some(l) = listed {
                    entry["prompt_logprobs"] = l;
                }
                entry
            }
            Api::Chat => {
                let logprobs =
                    job.choices[0].request.params.logprobs.map(|_| chat_logprobs(tok, &c.logprobs));
                let prefix = format!("{}_{}", head.id, choice.index);
                listed_first = listed_first.or(listed);
                let (message, finish) = tool_calls::message(job.reply.as_ref(), c.text, c.finish, &prefix);
                json!({
                    "index": choice.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                })
            }
        };
        choices.push(entry);
    }
    let mut body = head.object(job.api, false);
    body.insert("choices".into(), Json::Array(choices));
    if let Some(l) = listed_first {
        // vLLM's chat responses carry them beside the choices (the prompt is theirs alike).
        body.insert("prompt_logprobs".into(), l);
    }
    body.insert("usage".into(), usage(prompt_tokens, completion_tokens));
    body.insert("system_fingerprint".into(), fingerprint(revision));
    Ok(Json::Object(body))
}

/// /v1/completions logprobs: parallel arrays; `offset` is where this text starts in the
/// choice's whole text (for `text_offset`).
fn completion_logprobs(tok: &Tokenizer, lps: &[TokenLogprobs], offset: usize) -> Json {
    let mut tokens = Vec::with_capacity(lps.len());
    let mut token_logprobs = Vec::with_capacity(lps.len());
    let mut top = Vec::with_capacity(lps.len());
    let mut offsets = Vec::with_capacity(lps.len());
    let mut at = offset;
    for lp in lps {
        let text = tok.token_text(lp.token_id);
        offsets.push(at);
        at += text.len();
        tokens.push(text);
        token_logprobs.push(lp.logprob);
        let alts: Map<String, Json> = lp.top.iter().map(|&(id, p)| (tok.token_text(id), json!(p))).collect();
        top.push(Json::Object(alts));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

/// /v1/chat/completions logprobs: one entry per token with its alternatives.
fn chat_logprobs(tok: &Tokenizer, lps: &[TokenLogprobs]) -> Json {
    let entry = |id: u32, p: f32| {
        let text = tok.token_text(id);
        let bytes: Vec<u8> = text.as_bytes().to_vec();
        json!({"token": text, "logprob": p, "bytes": bytes})
    };
    let content: Vec<Json> = lps
        .iter()
        .map(|lp| {
            let mut e = entry(lp.token_id, lp.logprob);
            let top: Vec<Json> = lp.top.iter().map(|&(id, p)| entry(id, p)).collect();
            e["top_logprobs"] = Json::Array(top);
            e
        })
        .collect();
    json!({"content": content})
}

/// One event of a stream: a choice's chunk, or the end of a choice's stream.
type Tagged = (usize, Option<strata_common::Result<Chunk>>);

/// Every choice's first chunk, read before a stream's response head: a request its
/// replica refuses on arrival (a constraint that does not compile, a context it cannot
/// hold) is then an HTTP error status as it is unstreamed, never a 200 stream that fails
/// at once.
async fn first_events(
    mut started: Vec<Started>,
    job: &Job,
) -> Result<(Vec<Started>, Vec<Option<Chunk>>), ApiError> {
    let mut firsts = Vec::with_capacity(started.len());
    for s in &mut started {
        match s.rx.recv().await {
            Some(Err(e)) => return Err(ApiError::from_domain(e, rename(job))),
            Some(Ok(chunk)) => firsts.push(Some(chunk)),
            None => firsts.push(None),
        }
    }
    Ok((started, firsts))
}

/// The SSE body of `job`, a stream the server polls itself: no task or channel between
/// the choices' chunks and the connection.
fn stream(
    job: Job,
    head: Head,
    started: Vec<Started>,
    firsts: Vec<Option<Chunk>>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let events = SseEvents::new(job, head, started, firsts);
    Sse::new(futures::stream::unfold(events, |mut e| async move {
        let event = match e.next().await? {
            Out::Chunk(json) => data(&json),
            Out::Error(err) => data(&err.body()),
            Out::Done => Event::default().data("[DONE]"),
        };
        Some((Ok(event), e))
    }))
}

/// One thing a chat or completion stream says, before it is shaped for an API.
pub enum Out {
    /// A chunk in OpenAI's shape (the last, with `usage`, when asked for).
    Chunk(Json),
    /// The stream failed; nothing follows.
    Error(ApiError),
    /// The stream ended.
    Done,
}

/// Starts `job` and yields its stream as [`Out`]s, for APIs that reshape OpenAI's
/// chunks (Messages, Responses); an error before it starts is the Err.
pub async fn start_stream(
    state: &HttpState,
    job: Job,
    who: &Caller,
    caller: Option<TraceContext>,
) -> Result<(impl Stream<Item = Out> + Send + 'static, String), ApiError> {
    let head = Head::new(&job, state.next_id());
    let started = start_all(&state.front, &job, &head, who, caller.as_ref()).await?;
    let (started, firsts) = first_events(started, &job).await?;
    let id = head.id.clone();
    let events = SseEvents::new(job, head, started, firsts);
    Ok((futures::stream::unfold(events, |mut e| async move { e.next().await.map(|o| (o, e)) }), id))
}

fn data(json: &Json) -> Event {
    Event::default().data(json.to_string())
}

/// A stream's events: its first chunks (the assistant role, or the echoed prompt), an
/// event per chunk of every choice as they come, the usage when asked for, `[DONE]`. A
/// choice that fails ends the stream with the error's body (no `[DONE]`).
struct SseEvents {
    job: Job,
    head: Head,
    models: Vec<Arc<ModelEntry>>,
    merged: futures::stream::SelectAll<BoxStream<'static, Tagged>>,
    /// Events ready to go before the next chunk is awaited.
    ready: VecDeque<Out>,
    want_logprobs: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Per choice: the text's length so far (completions' logprob offsets).
    offsets: Vec<usize>,
    /// Per choice, when the reply is read for tool calls.
    calls: Vec<Option<StreamedCalls>>,
    /// Per choice, vLLM's `prompt_logprobs` until its first event carries them.
    listed: Vec<Option<Json>>,
    ended: bool,
}

impl SseEvents {
    /// The events of `started`, whose first chunks `firsts` were read already.
    fn new(job: Job, head: Head, started: Vec<Started>, mut firsts: Vec<Option<Chunk>>) -> Self {
        let prompt_tokens = prompt_tokens(&job, &started);
        let models: Vec<_> = started.iter().map(|s| s.model.clone()).collect();
        let prompts: Vec<(Vec<u32>, Option<Vec<TokenLogprobs>>)> = started
            .iter()
            .zip(&mut firsts)
            .map(|(s, f)| (s.prompt_ids.clone(), f.as_mut().and_then(|c| c.prompt_logprobs.take())))
            .collect();
        let streams = started.into_iter().zip(firsts).enumerate().map(|(i, (s, first))| {
            futures::stream::iter(first.map(|c| (i, Some(Ok(c)))))
                .chain(ReceiverStream::new(s.rx).map(move |c| (i, Some(c))))
                .chain(futures::stream::iter([(i, None)]))
                .boxed()
        });
        let want_logprobs = job.choices.first().and_then(|c| c.request.params.logprobs).is_some();
        let calls = job
            .choices
            .iter()
            .map(|c| job.reply.as_ref().map(|r| StreamedCalls::new(r, format!("{}_{}", head.id, c.index))))
            .collect();
        let wanted = job.common.prompt_logprobs;
        let listed = prompts
            .iter()
            .zip(&models)
            .map(|((_, p), m)| {
                wanted.listed.zip(p.as_deref()).map(|(n, p)| prompt_logprobs::listed(&m.tokenizer, p, n))
            })
            .collect();
        let mut events = SseEvents {
            offsets: vec![0; job.choices.len()],
            calls,
            listed,
            merged: futures::stream::select_all(streams),
            ready: VecDeque::new(),
            want_logprobs,
            prompt_tokens,
            completion_tokens: 0,
            models,
            head,
            job,
            ended: false,
        };
        events.opening_events(&prompts);
        events
    }

    /// Each choice's first event, before any chunk: the assistant's role (chat) or the
    /// echoed prompt (completions, with its logprobs when asked for).
    fn opening_events(&mut self, prompts: &[(Vec<u32>, Option<Vec<TokenLogprobs>>)]) {
        for (i, (prompt, lps)) in prompts.iter().enumerate() {
            let choice = &self.job.choices[i];
            let first = match (self.job.api, &self.job.echo) {
                (Api::Chat, _) => json!({"role": "assistant", "content": ""}),
                (Api::Completion, Some(echo)) => json!(echo[choice.prompt]),
                (Api::Completion, None) => continue,
            };
            self.offsets[i] = first.as_str().map_or(0, str::len);
            let logprobs = match (self.want_logprobs, self.job.common.prompt_logprobs.echoed, lps) {
                (true, Some(n), Some(p)) => {
                    let tok = &self.models[i].tokenizer;
                    prompt_logprobs::with_echo(tok, prompt, p, n, completion_logprobs(tok, &[], 0))
                }
                _ => Json::Null,
            };
            let mut event = chunk_event(&self.job, &self.head, choice.index, first, logprobs, None);
            self.add_listed(i, &mut event);
            self.ready.push_back(Out::Chunk(event));
        }
    }

    /// Puts choice `i`'s `prompt_logprobs` on `event` if no event of it carried them yet:
    /// in the choice for completions, beside the choices for chat (as vLLM does).
    fn add_listed(&mut self, i: usize, event: &mut Json) {
        if let Some(l) = self.listed[i].take() {
            match self.job.api {
                Api::Completion => event["choices"][0]["prompt_logprobs"] = l,
                Api::Chat => event["prompt_logprobs"] = l,
            }
        }
    }

    async fn next(&mut self) -> Option<Out> {
        if let Some(e) = self.ready.pop_front() {
            return Some(e);
        }
        while !self.ended {
            match self.merged.next().await {
                Some((_, None)) => continue,
                Some((i, Some(Ok(chunk)))) => return Some(Out::Chunk(self.chunk(i, chunk))),
                Some((_, Some(Err(e)))) => {
                    self.ended = true;
                    return Some(Out::Error(ApiError::from_domain(e, rename(&self.job))));
                }
                None => {
                    self.ended = true;
                    if self.job.common.include_usage {
                        let mut last = self.head.object(self.job.api, true);
                        last.insert("choices".into(), json!([]));
                        last.insert("usage".into(), usage(self.prompt_tokens, self.completion_tokens));
                        self.ready.push_back(Out::Chunk(Json::Object(last)));
                    }
                    self.ready.push_back(Out::Done);
                }
            }
        }
        self.ready.pop_front()
    }

    /// Choice `i`'s chunk as an event's JSON.
    fn chunk(&mut self, i: usize, chunk: Chunk) -> Json {
        self.completion_tokens += chunk.token_ids.len();
        let tok = &self.models[i].tokenizer;
        let logprobs = match (self.want_logprobs, self.job.api) {
            (false, _) => Json::Null,
            (true, Api::Completion) => completion_logprobs(tok, &chunk.logprobs, self.offsets[i]),
            (true, Api::Chat) => chat_logprobs(tok, &chunk.logprobs),
        };
        self.offsets[i] += chunk.text.len();
        let (content, finish) = match (self.job.api, &mut self.calls[i]) {
            (Api::Chat, Some(calls)) => calls.delta(&chunk.text, chunk.finish),
            (Api::Chat, None) => {
                (json!({"content": chunk.text}), tool_calls::finish_reason(None, chunk.finish, 0))
            }
            (Api::Completion, _) => (json!(chunk.text), tool_calls::finish_reason(None, chunk.finish, 0)),
        };
        let index = self.job.choices[i].index;
        let mut event = chunk_event(&self.job, &self.head, index, content, logprobs, None);
        event["choices"][0]["finish_reason"] = json!(finish);
        self.add_listed(i, &mut event);
        event["system_fingerprint"] = fingerprint(chunk.revision);
        event
    }
}

/// One chunk of one choice: `delta` for chat, `text` for completions.
fn chunk_event(
    job: &Job,
    head: &Head,
    index: u32,
    content: Json,
    logprobs: Json,
    finish: Option<FinishReason>,
) -> Json {
    let mut choice = json!({"index": index, "logprobs": logprobs, "finish_reason": finish.map(finish_str)});
    match job.api {
        Api::Chat => choice["delta"] = content,
        Api::Completion => choice["text"] = content,
    }
    let mut m = head.object(job.api, true);
    m.insert("choices".into(), json!([choice]));
    if job.common.include_usage {
        m.insert("usage".into(), Json::Null);
    }
    Json::Object(m)
}
