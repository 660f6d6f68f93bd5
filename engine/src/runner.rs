//! The engine's actor: one thread owns the [`Engine`], callers hold an [`EngineHandle`].
//!
//! Requests arrive over a channel and go to the engine, whose scheduler decides when they
//! run; between steps the runner takes new requests and cancellations, steps the engine,
//! and delivers each token to its sequence's stream. A [`SequenceStream`] cancels its sequence when dropped,
//! so a caller that goes away frees its KV blocks at the next step boundary. When the
//! queue is full, [`EngineHandle::submit`] fails at once with `Overloaded`; when the
//! runner is gone, with `Unavailable`.
//!
//! **Health.** [`EngineHandle::canary`] proves that a step can still go through every rank
//! of the replica: it is answered after the next successful step (when the engine is
//! idle, a one-token canary sequence makes one). A step that fails for lack of a rank
//! (`Unavailable`) marks the runner broken: its sequences fail, new submissions and
//! canaries fail at once, and [`EngineHandle::broken`] says why — a live process with a
//! dead model does not look healthy.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use strata_common::{EngineStats, Error, Result, SamplingParams, SeqEvent};
use tokio::sync::mpsc as tmpsc;
use tracing::{debug, debug_span, error, Span};

use crate::engine::{Engine, SeqId};
use crate::guide::Guide;
use crate::metrics::RunnerMetrics;
use crate::scheduler::{Scheduled, SchedulerStats};

/// Limits of one runner.
#[derive(Debug, Clone)]
pub struct RunnerLimits {
    /// Most requests waiting to start; beyond it submissions are refused.
    pub max_waiting: usize,
    /// Events a sequence's stream holds for a caller that reads slower than the engine
    /// generates (HTTP/2 flow control holds more in transit). A caller that leaves this
    /// many unread has its sequence cancelled, with one slot kept for the error that says so.
    pub stream_buffer: usize,
}

impl Default for RunnerLimits {
    fn default() -> Self {
        let max_waiting = strata_common::config::EngineSettings::MAX_WAITING;
        RunnerLimits { max_waiting, stream_buffer: STREAM_BUFFER }
    }
}

enum Command {
    Submit(Box<Submission>),
    Cancel(SeqId),
    Canary(tokio::sync::oneshot::Sender<Result<()>>),
}

/// Sequence ids at and above this are the runner's own canaries.
const CANARY_IDS: u64 = 1 << 62;

/// The default [`RunnerLimits::stream_buffer`].
pub const STREAM_BUFFER: usize = 1024;

#[derive(Default)]
struct Shared {
    running: AtomicUsize,
    /// Submitted, not yet handed to the engine.
    queued: AtomicUsize,
    /// Queued inside the engine's scheduler.
    waiting: AtomicUsize,
    kv_free: AtomicUsize,
    kv_total: AtomicUsize,
    max_context: AtomicUsize,
    block_size: AtomicUsize,
    next_id: AtomicU64,
    /// Sequence streams not yet dropped: running, waiting, or finished but not read to
    /// the end (their events still held here).
    open: AtomicUsize,
    /// Set once a step failed for lack of a rank; the replica cannot serve again.
    broken: std::sync::Mutex<Option<String>>,
    /// Steps completed, how long the last took, and when the one running began.
    steps: std::sync::Mutex<Progress>,
}

/// How a replica's steps are going: what a canary that timed out looks at before it
/// blames the replica (a healthy replica under load takes seconds a step).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Progress {
    /// Steps completed so far.
    pub steps: u64,
    /// How long the last completed step took.
    pub last_step: std::time::Duration,
    /// When the step running now began, if one is.
    pub running_since: Option<Instant>,
}

impl Progress {
    /// Whether a replica that was at `before` when a canary was sent, and is at `self`
    /// now that the canary's time is up, is still working: a step has completed since,
    /// or the step running now has not run past three times the last one's length.
    pub fn still_working(&self, before: &Progress) -> bool {
        if self.steps > before.steps {
            return true;
        }
        match self.running_since {
            Some(since) => since.elapsed() <= self.last_step * 3,
            None => false,
        }
    }
}

/// Cloneable handle to a runner thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    limits: RunnerLimits,
    /// Most open sequence streams: running slots plus the waiting queue.
    max_open: usize,
}

/// Tokens of one sequence, in order; cancels the sequence when dropped.
pub struct SequenceStream {
    id: SeqId,
    rx: tmpsc::Receiver<SeqEvent>,
    tx: mpsc::Sender<Command>,
    done: bool,
    shared: Arc<Shared>,
}

impl SequenceStream {
    /// The next event; None once the sequence has finished (or the runner died before
    /// finishing it, which the caller reports as unavailable).
    pub async fn next(&mut self) -> Option<SeqEvent> {
        let ev = self.rx.recv().await;
        if matches!(ev, Some(SeqEvent::Token { finish: Some(_), .. }) | Some(SeqEvent::Failed(_)) | None) {
            self.done = true;
        }
        ev
    }
}

impl Drop for SequenceStream {
    fn drop(&mut self) {
        self.shared.open.fetch_sub(1, Ordering::SeqCst);
        if !self.done {
            let _ = self.tx.send(Command::Cancel(self.id));
        }
    }
}

impl EngineHandle {
    /// Starts a runner thread that owns `engine`.
    pub fn spawn(engine: Engine, limits: RunnerLimits, name: &str) -> Result<Self> {
        let (handle, runner) = Self::unspawned(engine, limits);
        std::thread::Builder::new()
            .name(format!("engine-{name}"))
            .spawn(move || runner.run())
            .map_err(|e| Error::Internal(format!("cannot start the engine thread: {e}")))?;
        Ok(handle)
    }

    /// A handle and the runner it talks to, not yet on a thread of its own (tests drive
    /// the runner's state by hand).
    fn unspawned(engine: Engine, limits: RunnerLimits) -> (Self, Runner) {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        shared.kv_free.store(engine.free_blocks(), Ordering::Relaxed);
        shared.kv_total.store(engine.total_blocks(), Ordering::Relaxed);
        shared.block_size.store(engine.block_size(), Ordering::Relaxed);
        shared.max_context.store(engine.max_context(), Ordering::Relaxed);

        let engine_slots = engine.max_num_seqs();
        let metrics = RunnerMetrics::new(engine.labels());
        metrics.kv_total.set(engine.total_blocks() as i64);
        let runner = Runner {
            last_stats: engine.scheduler_stats(),
            engine,
            rx,
            shared: shared.clone(),
            metrics,
            streams: HashMap::new(),
            canaries: Vec::new(),
            next_canary: CANARY_IDS,
            compiler: None,
        };
        let max_open = engine_slots + limits.max_waiting;
        (EngineHandle { tx, shared, limits, max_open }, runner)
    }

    /// Queues a sequence; its tokens arrive on the returned stream.
    pub fn submit(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<SequenceStream> {
        self.submit_resumed(prompt, Vec::new(), params)
    }

    /// Queues a sequence that continues after `generated` (see [`Engine::add_resumed`]).
    pub fn submit_resumed(
        &self,
        prompt: Vec<u32>,
        generated: Vec<u32>,
        params: SamplingParams,
    ) -> Result<SequenceStream> {
        if let Some(why) = self.broken() {
            return Err(Error::Unavailable(format!("the replica is broken: {why}")));
        }
        let queued = self.shared.queued.fetch_add(1, Ordering::SeqCst);
        let waiting = queued + self.shared.waiting.load(Ordering::SeqCst);
        if waiting >= self.limits.max_waiting {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Overloaded(format!(
                "{waiting} requests already waiting (limit {})",
                self.limits.max_waiting
            )));
        }
        // Finished streams nobody has read count too: their events are held here.
        let open = self.shared.open.fetch_add(1, Ordering::SeqCst);
        let max_open = self.max_open;
        if open >= max_open {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            self.shared.open.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Overloaded(format!(
                "{open} sequence streams are open (running, waiting, or finished but not read to the end; limit {max_open})"
            )));
        }
        let id = SeqId(self.shared.next_id.fetch_add(1, Ordering::Relaxed));
        let (events, rx) = tmpsc::channel(self.limits.stream_buffer.max(2));
        // From here the stream owns the open slot (dropping it gives the slot back).
        let stream = SequenceStream { id, rx, tx: self.tx.clone(), done: false, shared: self.shared.clone() };
        let (submitted, span) = (Instant::now(), Span::current());
        let caller = Caller { events, submitted, span };
        let reply = self.tx.clone();
        let submit = Command::Submit(Box::new(Submission {
            id,
            prompt,
            generated,
            params,
            caller,
            guide: None,
            reply,
        }));
        if self.tx.send(submit).is_err() {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Unavailable("the engine has stopped".into()));
        }
        Ok(stream)
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.shared.running.load(Ordering::Relaxed),
            waiting: self.shared.waiting.load(Ordering::Relaxed) + self.shared.queued.load(Ordering::Relaxed),
            kv_blocks_free: self.shared.kv_free.load(Ordering::Relaxed),
            kv_blocks_total: self.shared.kv_total.load(Ordering::Relaxed),
            block_size: self.shared.block_size.load(Ordering::Relaxed),
            max_context: self.shared.max_context.load(Ordering::Relaxed),
        }
    }

    /// Outstanding work, for least-loaded routing.
    pub fn load(&self) -> usize {
        let s = self.stats();
        s.running + s.waiting
    }

    /// Why the replica can no longer run steps, if it cannot.
    pub fn broken(&self) -> Option<String> {
        self.shared.broken.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How its steps are going ([`Progress`]).
    pub fn progress(&self) -> Progress {
        *self.shared.steps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Resolves once a step has gone through every rank after this call (an error if the
    /// step failed, the replica is broken, or the runner is gone). The caller bounds the
    /// wait: a rank that hangs makes this hang.
    pub async fn canary(&self) -> Result<()> {
        if let Some(why) = self.broken() {
            return Err(Error::Unavailable(format!("the replica is broken: {why}")));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx.send(Command::Canary(tx)).map_err(|_| Error::Unavailable("the engine has stopped".into()))?;
        rx.await.map_err(|_| Error::Unavailable("the engine stopped before the canary step".into()))?
    }
}

struct Runner {
    engine: Engine,
    rx: mpsc::Receiver<Command>,
    shared: Arc<Shared>,
    metrics: RunnerMetrics,
    /// Scheduler counters as last published.
    last_stats: SchedulerStats,
    /// The engine's sequences: where their events go, and when they reached each stage.
    streams: HashMap<SeqId, Live>,
    /// Canaries answered by the next step.
    canaries: Vec<tokio::sync::oneshot::Sender<Result<()>>>,
    next_canary: u64,
    /// Compiles constraints off this thread (started with the first constrained request).
    compiler: Option<compile::Compiler>,
}

struct Submission {
    id: SeqId,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    params: SamplingParams,
    caller: Caller,
    /// A constrained sequence's guide, once compiled ([`compile`]).
    guide: Option<Guide>,
    /// Where a compiled submission comes back to the runner.
    reply: mpsc::Sender<Command>,
}

/// A submission's way back to its caller.
struct Caller {
    events: tmpsc::Sender<SeqEvent>,
    submitted: Instant,
    /// The caller's span: the sequence's stages and steps join its trace.
    span: Span,
}

/// The span of a step over `seqs`: a child of the first traced sequence's span, linked to
/// the other sequences' (one step serves many requests; each request's trace shows it).
fn step_span(streams: &HashMap<SeqId, Live>, seqs: &[Scheduled]) -> Span {
    // Nothing records step spans (no export): skip the per-sequence lookups too.
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return Span::none();
    }
    let mut traced = seqs.iter().filter_map(|s| streams.get(&s.id)).filter(|l| !l.span.is_none());
    let Some(first) = traced.next() else { return Span::none() };
    let span = debug_span!(parent: &first.span, "engine.step", seqs = seqs.len() as i64);
    for other in traced {
        span.follows_from(&other.span);
    }
    span
}

enum Stage {
    Queue,
    Prefill,
    Decode,
}

/// A span for a sequence's stage under its caller's span (none for an untraced caller).
fn stage_span(parent: &Span, stage: Stage) -> Span {
    if parent.is_none() {
        return Span::none();
    }
    match stage {
        Stage::Queue => debug_span!(parent: parent, "queue"),
        Stage::Prefill => debug_span!(parent: parent, "prefill"),
        Stage::Decode => debug_span!(parent: parent, "decode"),
    }
}

/// A sequence the runner delivers to.
struct Live {
    events: tmpsc::Sender<SeqEvent>,
    /// The caller's span, parent of the stage spans and of steps.
    span: Span,
    /// The stage it is in (queue, prefill, decode), closed when the next begins.
    stage: Span,
    submitted: Instant,
    /// First taken off the queue.
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    tokens: u32,
}

impl Runner {
    fn run(mut self) {
        loop {
            if !self.engine.has_work() {
                match self.rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return, // every handle is gone
                }
            }
            self.turn();
        }
    }

    /// One turn of the loop: the commands waiting, a step if the engine has work, the
    /// counters published.
    fn turn(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            self.handle(cmd);
        }
        if self.engine.has_work() {
            self.step();
        }
        self.publish();
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(s) if s.params.constraint.is_some() && s.guide.is_none() => {
                // Still counted as queued until it comes back compiled (or fails there).
                self.compile(s);
            }
            Command::Submit(s) => {
                let Submission { id, prompt, generated, params, caller, guide, reply: _ } = *s;
                self.admit(id, prompt, generated, params, caller, guide);
                // Counted as waiting (published) before it stops counting as queued, so a
                // concurrent submission never sees it in neither and overfills the queue.
                self.publish();
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            }
            Command::Cancel(id) => {
                if self.engine.cancel(id) {
                    debug!(seq = %id, "cancelled");
                }
                self.streams.remove(&id);
            }
            Command::Canary(reply) => {
                if let Some(why) = self.broken() {
                    let _ = reply.send(Err(Error::Unavailable(format!("the replica is broken: {why}"))));
                    return;
                }
                self.canaries.push(reply);
                if !self.engine.has_work() {
                    // One prompt token, one output token: the cheapest step through every rank.
                    let id = SeqId(self.next_canary);
                    self.next_canary += 1;
                    let params = SamplingParams { max_new_tokens: 1, ignore_eos: true, ..Default::default() };
                    if let Err(e) = self.engine.add(id, vec![0], params) {
                        for c in self.canaries.drain(..) {
                            let _ = c.send(Err(Error::Internal(format!("canary sequence: {e}"))));
                        }
                    }
                }
            }
        }
    }

    /// Hands a constrained submission to the compile thread; it comes back as a
    /// submission with its guide, or fails its caller there.
    fn compile(&mut self, s: Box<Submission>) {
        let Some(grammars) = self.engine.grammars() else {
            // No compiler: the engine refuses it, naming why.
            let Submission { id, prompt, generated, params, caller, .. } = *s;
            self.admit(id, prompt, generated, params, caller, None);
            self.publish();
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            return;
        };
        let compiler =
            self.compiler.get_or_insert_with(|| compile::Compiler::start(grammars, self.shared.clone()));
        compiler.send(s);
    }

    fn admit(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        generated: Vec<u32>,
        params: SamplingParams,
        Caller { events, submitted, span }: Caller,
        guide: Option<Guide>,
    ) {
        if events.is_closed() {
            return;
        }
        if let Some(why) = self.broken() {
            let _ = events
                .try_send(SeqEvent::Failed(Error::Unavailable(format!("the replica is broken: {why}"))));
            return;
        }
        let added = match guide {
            Some(guide) => self.engine.add_guided(id, prompt, generated, params, Some(guide)),
            None => self.engine.add_resumed(id, prompt, generated, params),
        };
        match added {
            Ok(()) => {
                let stage = stage_span(&span, Stage::Queue);
                let live =
                    Live { events, span, stage, submitted, admitted: None, first_token: None, tokens: 0 };
                self.streams.insert(id, live);
            }
            Err(e) => {
                let _ = events.try_send(SeqEvent::Failed(e));
            }
        }
    }

    /// Hands a token to its sequence's stream. A caller gone, or one that has left its
    /// stream buffer unread, has its sequence cancelled (the latter told why in
    /// the slot kept for it): a client that never reads holds a bounded buffer, not a
    /// sequence generating into memory.
    fn deliver(&mut self, ev: crate::engine::StepEvent, now: Instant) {
        let Some(live) = self.streams.get_mut(&ev.seq) else { return };
        let finished = ev.finish.is_some();
        live.tokens += 1;
        let first = *live.first_token.get_or_insert_with(|| {
            let since = live.admitted.unwrap_or(live.submitted);
            self.metrics.prefill_time.observe(now.duration_since(since).as_secs_f64());
            live.stage = stage_span(&live.span, Stage::Decode);
            now
        });
        if finished {
            let decode = now.duration_since(first).as_secs_f64();
            self.metrics.decode_time.observe(decode);
            if live.tokens > 1 {
                self.metrics.time_per_output_token.observe(decode / f64::from(live.tokens - 1));
            }
        }
        let stream = &live.events;
        if !finished && stream.capacity() <= 1 && !stream.is_closed() {
            let _ = stream.try_send(SeqEvent::Failed(Error::Overloaded(format!(
                "the caller left {} tokens unread; the sequence was cancelled",
                stream.max_capacity() - 1
            ))));
            self.engine.cancel(ev.seq);
            self.streams.remove(&ev.seq);
            debug!(seq = %ev.seq, "caller not reading, sequence cancelled");
            return;
        }
        if let Some(prompt) = ev.prompt_logprobs {
            let _ = stream.try_send(SeqEvent::Prompt(prompt));
        }
        let sent = match ev.embedding {
            Some(v) => stream.try_send(SeqEvent::Embedding(v)),
            None => {
                stream.try_send(SeqEvent::Token { token: ev.token, logprobs: ev.logprobs, finish: ev.finish })
            }
        };
        if finished {
            self.streams.remove(&ev.seq);
        } else if sent.is_err() {
            // The caller went away: free the sequence now.
            self.engine.cancel(ev.seq);
            self.streams.remove(&ev.seq);
            debug!(seq = %ev.seq, "caller gone, sequence cancelled");
        }
    }

    fn broken(&self) -> Option<String> {
        self.shared.broken.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn step(&mut self) {
        let streams = &self.streams;
        let began = Instant::now();
        self.shared.steps.lock().unwrap_or_else(|p| p.into_inner()).running_since = Some(began);
        let result = self.engine.step_traced(|seqs| step_span(streams, seqs));
        {
            let mut p = self.shared.steps.lock().unwrap_or_else(|p| p.into_inner());
            *p = Progress { steps: p.steps + 1, last_step: began.elapsed(), running_since: None };
        }
        let mut non_finite = false;
        for a in self.engine.take_aborted() {
            non_finite |= a.non_finite;
            if let Some(live) = self.streams.remove(&a.seq) {
                let _ = live.events.try_send(SeqEvent::Failed(a.error));
            }
        }
        match result {
            Ok(events) => {
                for c in self.canaries.drain(..) {
                    let verdict = match non_finite {
                        true => Err(Error::Unavailable("the step produced non-finite logits".into())),
                        false => Ok(()),
                    };
                    let _ = c.send(verdict);
                }
                let now = Instant::now();
                self.record_step(now);
                for ev in events {
                    self.deliver(ev, now);
                }
            }
            Err(e) => {
                error!(error = %e, "engine step failed; failing its sequences");
                if e.class() == strata_common::ErrorClass::Unavailable {
                    *self.shared.broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                }
                for c in self.canaries.drain(..) {
                    let _ = c.send(Err(Error::Unavailable(format!("canary step failed: {e}"))));
                }
                // Canary sequences have no stream; drop them with the rest.
                let canaries: Vec<SeqId> = (CANARY_IDS..self.next_canary).map(SeqId).collect();
                for id in canaries {
                    self.engine.cancel(id);
                }
                for (id, live) in self.streams.drain() {
                    self.engine.cancel(id);
                    let _ = live
                        .events
                        .try_send(SeqEvent::Failed(Error::Unavailable(format!("engine step failed: {e}"))));
                }
            }
        }
    }

    /// Queue time of the sequences the step admitted, its batch size, and the scheduler's
    /// counters since the last step.
    fn record_step(&mut self, now: Instant) {
        let m = &self.metrics;
        for id in self.engine.take_admitted() {
            if let Some(live) = self.streams.get_mut(&id) {
                if live.admitted.is_none() {
                    live.admitted = Some(now);
                    live.stage = stage_span(&live.span, Stage::Prefill);
                    m.queue_time.observe(now.duration_since(live.submitted).as_secs_f64());
                }
            }
        }
        m.batch_tokens.observe(self.engine.last_step_tokens() as f64);
        let stats = self.engine.scheduler_stats();
        m.preemptions.inc_by(stats.preemptions - self.last_stats.preemptions);
        m.prefix_queries.inc_by(stats.prefix_query_tokens - self.last_stats.prefix_query_tokens);
        m.prefix_hits.inc_by(stats.prefix_hit_tokens - self.last_stats.prefix_hit_tokens);
        m.window_released.inc_by(stats.window_released_blocks - self.last_stats.window_released_blocks);
        self.last_stats = stats;
    }

    fn publish(&self) {
        let (all, waiting) = (self.engine.num_running(), self.engine.num_waiting());
        let free = self.engine.free_blocks();
        self.shared.running.store(all - waiting, Ordering::Relaxed);
        self.shared.waiting.store(waiting, Ordering::SeqCst);
        self.shared.kv_free.store(free, Ordering::Relaxed);
        self.metrics.running.set((all - waiting) as i64);
        self.metrics.waiting.set(waiting as i64);
        let total = self.engine.total_blocks();
        self.metrics.kv_blocks(total - free, total);
    }
}

mod compile;
#[cfg(test)]
mod tests;
