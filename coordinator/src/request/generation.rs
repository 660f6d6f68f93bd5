//! One request's generation on the coordinator side: route it to a replica, turn the
//! tokens that come back into text deltas, apply stop strings — and survive replicas
//! dying under it.
//!
//! [`crate::frontend::FrontEnd::begin`] brings every request here once it is
//! admitted and holds a slot. Unary and streaming calls share this path: both read
//! [`Chunk`]s from the channel [`start`] returns. When the receiver is dropped (the caller cancelled or
//! disconnected), the task ends and drops its replica stream, which cancels the sequence
//! on the replica and frees its KV blocks.
//!
//! **Failover.** When the replica's stream breaks or reports `Unavailable` (a worker died,
//! its replica failed its canary, it is draining), the request is resubmitted to another
//! ready replica with the prompt plus every token already streamed to the caller; the new
//! replica prefills them and continues after them, and the text stream carries on, so the
//! caller sees one uninterrupted stream with no token lost or repeated. Sampled requests
//! get a seed from the coordinator when they bring none, so the continuation draws from
//! the same random stream. When no other replica is ready, the request waits for one (up
//! to [`RouteLimits::wait`], never past the caller's deadline).
//!
//! **Deadlines.** A caller's gRPC deadline bounds the whole generation: when it passes, the
//! stream ends with `DEADLINE_EXCEEDED` and the sequence is cancelled on the replica.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use strata_common::{Error, ErrorClass, FinishReason, Result, SeqEvent, TokenLogprobs};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, warn, Instrument, Span};

use crate::frontend::admission::{Admitted, Priority};
use crate::frontend::cache::{Key, ResponseCache};
use crate::request::metrics::{served_by, RequestTimer};
use crate::request::span;
use crate::request::text::TextStream;
use crate::routing::{EventStream, Job, ModelEntry};
use crate::tenant::usage::Account;

/// What one generated token adds to a response.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Chunk {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    /// On the first chunk of a request that asked for them: the prompt's logprobs, one per
    /// prompt token after the first.
    pub prompt_logprobs: Option<Vec<TokenLogprobs>>,
    /// An embedding request's answer (the only chunk, finished).
    pub embedding: Option<Vec<f32>>,
    pub finish: Option<FinishReason>,
    /// The model revision that generated it.
    pub revision: u64,
}

/// Chunks of one generation, in order; the last has `finish` set (or is an error).
pub type ChunkRx = mpsc::Receiver<Result<Chunk>>;

/// Whether a request stops waiting for its model's replicas (see `Run::stall`).
enum Stall {
    /// Refused now, with why.
    Now(Error),
    /// Refused at this instant unless a replica is ready first.
    At(Instant),
    No,
}

/// How long and how often a request looks for a replica.
#[derive(Debug, Clone, Copy)]
pub struct RouteLimits {
    /// Longest wait for a ready replica (at the start, or after one failed).
    pub wait: Duration,
    /// Most replicas one request may fail over between.
    pub max_failovers: usize,
    /// How long a model's replicas may wait for workers (pending) before its requests stop
    /// waiting with them: after that a request is refused at once, naming why they wait.
    pub pending_grace: Duration,
}

impl Default for RouteLimits {
    fn default() -> Self {
        RouteLimits {
            wait: Duration::from_secs(60),
            max_failovers: 8,
            pending_grace: Duration::from_secs(10),
        }
    }
}

/// Counts an online request while it lives (in its front end's count, which batch jobs
/// yield to).
pub struct OnlineGuard(Arc<AtomicUsize>);

impl OnlineGuard {
    pub fn new(p: Priority, count: &Arc<AtomicUsize>) -> Option<Self> {
        (p == Priority::Online).then(|| {
            count.fetch_add(1, Ordering::Relaxed);
            OnlineGuard(count.clone())
        })
    }
}

impl Drop for OnlineGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where a request goes: the revision the split chose when it began, its response cache
/// key when it is cacheable (and the cache that keeps the response), and the count of
/// online requests it belongs to.
pub struct Target {
    pub revision: u64,
    pub cache: Option<(Key, Arc<ResponseCache>)>,
    pub online: Arc<AtomicUsize>,
    /// `--access-log`: one info line when the request finishes (request id, model, tenant,
    /// tokens, outcome, duration; the trace id through its span).
    pub access_log: bool,
}

/// Submits the request and streams its chunks. Errors that happen before the first
/// token (bad request, every replica full, none ready) are returned here, so they become
/// the call's status.
pub async fn start(
    model: Arc<ModelEntry>,
    admitted: Admitted,
    request_id: String,
    deadline: Option<Instant>,
    limits: RouteLimits,
    target: Target,
    account: Account,
) -> Result<ChunkRx> {
    let online = OnlineGuard::new(admitted.params.priority, &target.online);
    let stop = admitted.params.stop.clone();
    let mut params = admitted.params;
    if !params.is_greedy() && params.seed.is_none() {
        params.seed = Some(rand::random());
    }
    let timer = RequestTimer::start(&model.name, admitted.prompt_ids.len());
    // Called inside the request's span (see `span::request_span`).
    let span = Span::current();
    span::admitted(&span, &model.name, &params, admitted.prompt_ids.len());
    let job = Job { request_id, prompt: admitted.prompt_ids, generated: Vec::new(), params };
    let mut run = Run {
        model,
        job,
        excluded: Vec::new(),
        deadline,
        limits,
        failovers: 0,
        timer,
        span: span.clone(),
        attempt: Attempt::default(),
        revision: target.revision,
        record: target.cache.map(|(k, cache)| (k, cache, Vec::new())),
        access_log: target.access_log,
        account,
        prompt_logprobs: None,
        _online: online,
    };
    let (replica, stream) = run.submit().await.inspect_err(|e| run.fail_now(e))?;
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(
        async move {
            let model = run.model.clone();
            let mut text = TextStream::new(&model.tokenizer, stop);
            run.stream(replica, stream, &mut text, tx).await;
        }
        .instrument(span),
    );
    Ok(rx)
}

struct Run {
    model: Arc<ModelEntry>,
    job: Job,
    /// Replicas this request failed on or found full.
    excluded: Vec<String>,
    deadline: Option<Instant>,
    limits: RouteLimits,
    failovers: usize,
    timer: RequestTimer,
    /// The request's span, and the attempt now streaming (its child).
    span: Span,
    attempt: Attempt,
    /// The revision it is bound for.
    revision: u64,
    /// A cacheable request: its key, the cache and the chunks streamed so far.
    record: Option<(Key, Arc<ResponseCache>, Vec<Chunk>)>,
    /// Whether its end is logged ([`Target::access_log`]).
    access_log: bool,
    /// The tenant's usage record and its hold on the tenant's limits.
    account: Account,
    /// The prompt's logprobs from the replica, until the first token carries them.
    prompt_logprobs: Option<Vec<TokenLogprobs>>,
    _online: Option<OnlineGuard>,
}

/// The replica a request is on, and the span of that attempt.
#[derive(Default)]
struct Attempt {
    replica: String,
    ranks: usize,
    /// The revision the replica was built from.
    revision: u64,
    span: Option<Span>,
}

/// Whether a replica's refusal sends the request to another replica (it is gone, or full).
pub fn retry_elsewhere(e: &Error) -> bool {
    matches!(e.class(), ErrorClass::Unavailable | ErrorClass::Overloaded)
}

/// What a sequence's next event means for the request.
#[derive(Debug)]
pub enum Turn {
    /// The prompt's logprobs, before the first token.
    Prompt(Vec<TokenLogprobs>),
    /// An embedding request's answer.
    Embedding(Vec<f32>),
    /// A token for the caller.
    Token { token: u32, logprobs: Option<TokenLogprobs>, finish: Option<FinishReason> },
    /// The replica was lost mid-stream: resume elsewhere (if failovers remain).
    Lost(Error),
    /// The request itself failed: tell the caller.
    Failed(Error),
}

/// The failover policy for one event: `Unavailable` and a stream that ends unfinished are
/// the replica's fault (resume elsewhere); any other error is the request's.
pub fn turn(event: Option<SeqEvent>, replica: &str) -> Turn {
    match event {
        Some(SeqEvent::Token { token, logprobs, finish }) => Turn::Token { token, logprobs, finish },
        Some(SeqEvent::Prompt(p)) => Turn::Prompt(p),
        Some(SeqEvent::Embedding(v)) => Turn::Embedding(v),
        Some(SeqEvent::Failed(e)) if e.class() == ErrorClass::Unavailable => Turn::Lost(e),
        Some(SeqEvent::Failed(e)) => Turn::Failed(e),
        None => Turn::Lost(Error::Unavailable(format!("replica {replica} went away mid-stream"))),
    }
}

impl Run {
    fn expired(&self) -> Error {
        Error::DeadlineExceeded(format!(
            "request {} ran past its deadline after {} tokens",
            self.job.request_id,
            self.job.generated.len()
        ))
    }

    /// Whether the model's replicas will not serve soon: refused now (none to have —
    /// scaled to 0, undeployed — or pending for workers past the grace), or when pending
    /// ones will have waited out the grace. Read from the view once.
    fn stall(&self) -> Stall {
        use strata_common::cluster::ReplicaState;
        let Some(unready) = self.model.routes.unready() else { return Stall::No };
        let now = strata_common::cluster::now_ms();
        let pending_for = Duration::from_millis(now.saturating_sub(unready.since_ms));
        let refuse = || {
            Stall::Now(Error::Unavailable(format!(
                "model {:?} has no ready replica: {}",
                self.model.name,
                unready.describe(now)
            )))
        };
        match unready.state {
            None => refuse(),
            Some(ReplicaState::Pending) if pending_for >= self.limits.pending_grace => refuse(),
            Some(ReplicaState::Pending) => Stall::At(
                Instant::now() + (self.limits.pending_grace - pending_for) + Duration::from_millis(1),
            ),
            Some(_) => Stall::No,
        }
    }

    /// Finds a replica that accepts the job.
    async fn submit(&mut self) -> Result<(String, EventStream)> {
        let give_up = Instant::now() + self.limits.wait;
        let give_up = self.deadline.map_or(give_up, |d| d.min(give_up));
        let mut last: Option<Error> = None;
        loop {
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(self.expired());
            }
            if let Some(replica) = self.model.routes.pick(&self.job.prompt, self.revision, &self.excluded) {
                let id = replica.id().to_string();
                let n = self.excluded.len() + 1;
                let attempt = span::attempt_span(&self.span, &id, replica.ranks(), n);
                let submit = replica.submit(&self.job).instrument(attempt.clone());
                let submitted = match self.deadline {
                    Some(d) => match tokio::time::timeout_at(d, submit).await {
                        Ok(r) => r,
                        Err(_) => return Err(self.expired()),
                    },
                    None => submit.await,
                };
                match submitted {
                    Ok(stream) => {
                        let ranks = replica.ranks();
                        let revision = self.model.routes.replica_revision(&id).unwrap_or(0);
                        served_by(&self.model.name, revision);
                        self.attempt = Attempt { replica: id.clone(), ranks, revision, span: Some(attempt) };
                        return Ok((id, stream));
                    }
                    Err(e) if retry_elsewhere(&e) => {
                        if e.class() == ErrorClass::Unavailable {
                            self.model.routes.report_failure(&id);
                        }
                        warn!(request = %self.job.request_id, replica = %id, error = %e, "replica refused; trying another");
                        self.excluded.push(id);
                        last = Some(e);
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            // No replica left to try: full ones answer for themselves; otherwise wait for
            // the set of ready replicas to change (a replacement being built).
            if let Some(e) = &last {
                if e.class() == ErrorClass::Overloaded {
                    return Err(last.take().expect("checked"));
                }
            }
            // Wake when pending replicas would have waited too long, to say so.
            let until = match self.stall() {
                Stall::Now(e) => return Err(e),
                Stall::At(t) => t.min(give_up),
                Stall::No => give_up,
            };
            let now = Instant::now();
            let changed = now < until && self.model.routes.wait_for_change(until - now).await;
            if !changed && until < give_up {
                continue;
            }
            if !changed {
                if self.deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(self.expired());
                }
                return Err(last.unwrap_or_else(|| {
                    Error::Unavailable(format!("model {:?} has no ready replica", self.model.name))
                }));
            }
            // Replicas that failed before may have been replaced under the same id only if
            // rebuilt; ids are never reused, so the exclusions stay.
        }
    }

    /// Streams the sequence's chunks to `tx`, failing over as needed.
    async fn stream(
        &mut self,
        mut replica: String,
        mut events: EventStream,
        text: &mut TextStream<'_>,
        tx: mpsc::Sender<Result<Chunk>>,
    ) {
        use futures::StreamExt;
        loop {
            let next = match self.deadline {
                Some(d) => match tokio::time::timeout_at(d, events.next()).await {
                    Ok(ev) => ev,
                    Err(_) => {
                        return self.fail(&tx, self.expired()).await;
                    }
                },
                None => events.next().await,
            };
            let lost = match turn(next, &replica) {
                Turn::Embedding(v) => return self.embedded(&tx, &replica, v).await,
                Turn::Prompt(p) => {
                    if self.job.generated.is_empty() {
                        self.prompt_logprobs = Some(p); // a failed replica's are replaced
                    }
                    continue;
                }
                Turn::Token { token, logprobs, finish } => {
                    let prompt_logprobs = match self.take_prompt_logprobs(&replica) {
                        Ok(p) => p,
                        Err(e) => return self.fail(&tx, e).await,
                    };
                    self.job.generated.push(token);
                    let chunk = match token_chunk(text, token, logprobs, finish) {
                        Ok(c) => Chunk { revision: self.attempt.revision, prompt_logprobs, ..c },
                        Err(e) => return self.fail(&tx, e).await,
                    };
                    let finish = chunk.finish;
                    self.keep(&chunk);
                    if tx.send(Ok(chunk)).await.is_err() {
                        return; // dropping `events` cancels the sequence if it still runs
                    }
                    self.timer.token();
                    self.account.delivered(1);
                    if let Some(reason) = finish {
                        self.timer.finished(reason);
                        self.record_end(Ok(reason));
                        self.store(&replica);
                        return;
                    }
                    continue;
                }
                Turn::Lost(e) => e,
                Turn::Failed(e) => return self.fail(&tx, e).await,
            };
            self.attempt.span = None; // the lost attempt ends here
            self.model.routes.report_failure(&replica);
            self.excluded.push(replica.clone());
            self.failovers += 1;
            if self.failovers > self.limits.max_failovers {
                return self.fail(&tx, lost).await;
            }
            self.timer.failover();
            info!(
                request = %self.job.request_id,
                from = %replica,
                tokens_streamed = self.job.generated.len(),
                error = %lost,
                "replica lost mid-stream; resuming on another"
            );
            match self.submit().await {
                Ok((id, s)) => {
                    info!(request = %self.job.request_id, to = %id, "resumed");
                    replica = id;
                    events = s;
                }
                Err(e) => return self.fail(&tx, e).await,
            }
        }
    }

    /// Answers an embedding request with `v`, checked against the request and the model.
    async fn embedded(&mut self, tx: &mpsc::Sender<Result<Chunk>>, replica: &str, v: Vec<f32>) {
        let width = self.model.config.hidden_size;
        if self.job.params.embed.is_none() || v.len() != width {
            let why = format!("replica {replica} answered with {} values where {width} were due", v.len());
            return self.fail(tx, Error::Internal(why)).await;
        }
        let finish = Some(FinishReason::Stop);
        let chunk =
            Chunk { embedding: Some(v), finish, revision: self.attempt.revision, ..Default::default() };
        self.keep(&chunk);
        if tx.send(Ok(chunk)).await.is_ok() {
            self.timer.finished(FinishReason::Stop);
            self.record_end(Ok(FinishReason::Stop));
            self.store(replica);
        }
    }

    /// The prompt logprobs the first token carries: those the replica sent, checked against
    /// the request (one per prompt token after the first, as many alternatives as asked).
    fn take_prompt_logprobs(&mut self, replica: &str) -> Result<Option<Vec<TokenLogprobs>>> {
        let Some(top) = self.job.params.prompt_logprobs else { return Ok(None) };
        if !self.job.generated.is_empty() {
            return Ok(None);
        }
        let bad = |why: String| Error::Internal(format!("replica {replica} {why}"));
        let p = self.prompt_logprobs.take().ok_or_else(|| bad("sent no prompt logprobs".into()))?;
        let want = self.job.prompt.len() - 1;
        if p.len() != want {
            return Err(bad(format!("sent {} prompt logprobs for {want} tokens", p.len())));
        }
        if p.iter().zip(&self.job.prompt[1..]).any(|(l, &t)| l.token_id != t || l.top.len() > top as usize) {
            return Err(bad("sent prompt logprobs of other tokens".into()));
        }
        Ok(Some(p))
    }

    /// Keeps a copy of `chunk` for the response cache (cacheable requests only).
    fn keep(&mut self, chunk: &Chunk) {
        if let Some((_, _, chunks)) = &mut self.record {
            chunks.push(chunk.clone());
        }
    }

    /// Stores the finished response when one replica of the key's revision made all of it.
    fn store(&mut self, replica: &str) {
        let Some((key, cache, chunks)) = self.record.take() else { return };
        if self.failovers == 0 && self.model.routes.replica_revision(replica) == Some(key.revision()) {
            cache.put(key, chunks);
        }
    }

    /// Ends the request with `e`, counted by its status code.
    async fn fail(&mut self, tx: &mpsc::Sender<Result<Chunk>>, e: Error) {
        self.fail_now(&e);
        let _ = tx.send(Err(e)).await;
    }

    /// Counts and records a failure (the caller reports it).
    fn fail_now(&mut self, e: &Error) {
        self.timer.failed(e);
        self.account.failed();
        self.record_end(Err(e));
    }

    /// Records the outcome on the request's span and closes the attempt's.
    fn record_end(&mut self, end: std::result::Result<FinishReason, &Error>) {
        let a = &self.attempt;
        let tokens = self.job.generated.len();
        if self.access_log {
            // One line per request (inside its span: JSON logs carry its trace_id).
            let (outcome, error) = match &end {
                Ok(reason) => (reason.as_str(), String::new()),
                Err(e) => ("error", e.to_string()),
            };
            info!(
                target: "strata::access",
                request = %self.job.request_id,
                model = %self.model.name,
                tenant = self.account.tenant(),
                prompt_tokens = self.job.prompt.len(),
                tokens,
                outcome,
                error = %error,
                replica = %a.replica,
                failovers = self.failovers,
                duration_ms = self.timer.elapsed().as_millis() as u64,
                "request"
            );
        } else {
            match &end {
                Ok(reason) => {
                    debug!(finish_reason = reason.as_str(), tokens, replica = %a.replica, "request finished")
                }
                Err(e) => debug!(error = %e, tokens, "request failed"),
            }
        }
        span::finished(&self.span, &a.replica, a.ranks, self.failovers, tokens, end);
        self.attempt.span = None;
    }
}

fn token_chunk(
    text: &mut TextStream<'_>,
    token: u32,
    logprobs: Option<TokenLogprobs>,
    finish: Option<FinishReason>,
) -> Result<Chunk> {
    let delta = text.push(token)?;
    let mut chunk = Chunk {
        text: delta.text,
        token_ids: vec![token],
        logprobs: logprobs.into_iter().collect(),
        prompt_logprobs: None,
        embedding: None,
        finish: if delta.stopped { Some(FinishReason::Stop) } else { finish },
        revision: 0,
    };
    if chunk.finish.is_some() {
        chunk.text.push_str(&text.finish()?.text);
    }
    Ok(chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_replicas_resume_and_bad_requests_fail() {
        let token = SeqEvent::Token { token: 7, logprobs: None, finish: None };
        assert!(matches!(turn(Some(token), "r"), Turn::Token { token: 7, .. }));
        let gone = SeqEvent::Failed(Error::Unavailable("worker died".into()));
        assert!(matches!(turn(Some(gone), "r"), Turn::Lost(_)));
        match turn(None, "r9") {
            Turn::Lost(e) => assert!(e.to_string().contains("r9"), "{e}"),
            other => panic!("{other:?}"),
        }
        let bad = SeqEvent::Failed(Error::invalid("prompt", "too long"));
        assert!(matches!(turn(Some(bad), "r"), Turn::Failed(_)));
        let relayed =
            SeqEvent::Failed(Error::Relayed { class: ErrorClass::Unavailable, message: "x".into() });
        assert!(
            matches!(turn(Some(relayed), "r"), Turn::Lost(_)),
            "the class decides, wherever it came from"
        );
    }

    #[test]
    fn only_gone_or_full_replicas_are_retried_elsewhere() {
        assert!(retry_elsewhere(&Error::Unavailable("x".into())));
        assert!(retry_elsewhere(&Error::Overloaded("x".into())));
        assert!(!retry_elsewhere(&Error::invalid("max_tokens", "x")));
        assert!(!retry_elsewhere(&Error::DeadlineExceeded("x".into())));
        assert!(!retry_elsewhere(&Error::Internal("x".into())));
    }
}
