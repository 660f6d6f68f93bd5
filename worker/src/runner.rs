//! The engine's actor: one thread owns the [`Engine`], callers hold an [`EngineHandle`].
//!
//! Requests arrive over a channel and wait in a bounded queue; between steps the runner
//! admits waiting requests up to `max_num_seqs`, steps the engine, and delivers each
//! token to its sequence's stream. A [`SequenceStream`] cancels its sequence when dropped,
//! so a caller that goes away frees its KV blocks at the next step boundary. When the
//! queue is full, [`EngineHandle::submit`] fails at once with `Overloaded`; when the
//! runner is gone, with `Unavailable`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use strata_common::{Error, FinishReason, Result, SamplingParams};
use tokio::sync::mpsc as tmpsc;
use tracing::{debug, error};

use crate::backend::Backend;
use crate::engine::{Engine, SeqId, TokenLogprobs};

/// Limits of one runner.
#[derive(Debug, Clone)]
pub struct RunnerLimits {
    /// Most sequences generating at once.
    pub max_num_seqs: usize,
    /// Most requests waiting to start; beyond it submissions are refused.
    pub max_waiting: usize,
}

impl Default for RunnerLimits {
    fn default() -> Self {
        RunnerLimits {
            max_num_seqs: 64,
            max_waiting: 256,
        }
    }
}

/// What a sequence's stream receives.
#[derive(Debug)]
pub enum SeqEvent {
    Token {
        token: u32,
        logprobs: Option<TokenLogprobs>,
        finish: Option<FinishReason>,
    },
    Failed(Error),
}

/// A point-in-time view of the runner's load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_free: usize,
    pub kv_blocks_total: usize,
}

enum Command {
    Submit {
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
        events: tmpsc::UnboundedSender<SeqEvent>,
    },
    Cancel(SeqId),
}

#[derive(Default)]
struct Shared {
    running: AtomicUsize,
    waiting: AtomicUsize,
    kv_free: AtomicUsize,
    kv_total: AtomicUsize,
    next_id: AtomicU64,
}

/// Cloneable handle to a runner thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    limits: RunnerLimits,
}

/// Tokens of one sequence, in order; cancels the sequence when dropped.
pub struct SequenceStream {
    id: SeqId,
    rx: tmpsc::UnboundedReceiver<SeqEvent>,
    tx: mpsc::Sender<Command>,
    done: bool,
}

impl SequenceStream {
    /// The next event; None once the sequence has finished (or the runner died before
    /// finishing it, which the caller reports as unavailable).
    pub async fn next(&mut self) -> Option<SeqEvent> {
        let ev = self.rx.recv().await;
        if matches!(
            ev,
            Some(SeqEvent::Token {
                finish: Some(_),
                ..
            }) | Some(SeqEvent::Failed(_))
                | None
        ) {
            self.done = true;
        }
        ev
    }
}

impl Drop for SequenceStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::Cancel(self.id));
        }
    }
}

impl EngineHandle {
    /// Starts a runner thread that owns `engine`.
    pub fn spawn<B: Backend>(engine: Engine<B>, limits: RunnerLimits, name: &str) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        shared
            .kv_free
            .store(engine.free_blocks(), Ordering::Relaxed);
        shared
            .kv_total
            .store(engine.total_blocks(), Ordering::Relaxed);
        let runner = Runner {
            engine,
            rx,
            shared: shared.clone(),
            waiting: VecDeque::new(),
            streams: Vec::new(),
            limits: limits.clone(),
        };
        std::thread::Builder::new()
            .name(format!("engine-{name}"))
            .spawn(move || runner.run())
            .map_err(|e| Error::Internal(format!("cannot start the engine thread: {e}")))?;
        Ok(EngineHandle { tx, shared, limits })
    }

    /// Queues a sequence; its tokens arrive on the returned stream.
    pub fn submit(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<SequenceStream> {
        let waiting = self.shared.waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.limits.max_waiting {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Overloaded(format!(
                "{waiting} requests already waiting (limit {})",
                self.limits.max_waiting
            )));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = tmpsc::unbounded_channel();
        if self
            .tx
            .send(Command::Submit {
                id,
                prompt,
                params,
                events,
            })
            .is_err()
        {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Unavailable("the engine has stopped".into()));
        }
        Ok(SequenceStream {
            id,
            rx,
            tx: self.tx.clone(),
            done: false,
        })
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.shared.running.load(Ordering::Relaxed),
            waiting: self.shared.waiting.load(Ordering::Relaxed),
            kv_blocks_free: self.shared.kv_free.load(Ordering::Relaxed),
            kv_blocks_total: self.shared.kv_total.load(Ordering::Relaxed),
        }
    }

    /// Outstanding work, for least-loaded routing.
    pub fn load(&self) -> usize {
        let s = self.stats();
        s.running + s.waiting
    }
}

struct Waiting {
    id: SeqId,
    prompt: Vec<u32>,
    params: SamplingParams,
    events: tmpsc::UnboundedSender<SeqEvent>,
}

struct Runner<B: Backend> {
    engine: Engine<B>,
    rx: mpsc::Receiver<Command>,
    shared: Arc<Shared>,
    waiting: VecDeque<Waiting>,
    /// Event senders of running sequences.
    streams: Vec<(SeqId, tmpsc::UnboundedSender<SeqEvent>)>,
    limits: RunnerLimits,
}

impl<B: Backend> Runner<B> {
    fn run(mut self) {
        loop {
            let idle = self.engine.num_running() == 0 && self.waiting.is_empty();
            if idle {
                match self.rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return, // every handle is gone
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            self.admit();
            if self.engine.num_running() > 0 {
                self.step();
            }
            self.publish();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                id,
                prompt,
                params,
                events,
            } => self.waiting.push_back(Waiting {
                id,
                prompt,
                params,
                events,
            }),
            Command::Cancel(id) => {
                if let Some(i) = self.waiting.iter().position(|w| w.id == id) {
                    self.waiting.remove(i);
                    self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                } else if self.engine.cancel(id) {
                    self.streams.retain(|(s, _)| *s != id);
                    debug!(seq = id, "cancelled");
                }
            }
        }
    }

    fn admit(&mut self) {
        while self.engine.num_running() < self.limits.max_num_seqs {
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            if w.events.is_closed() {
                continue;
            }
            match self.engine.add(w.id, w.prompt, w.params) {
                Ok(()) => self.streams.push((w.id, w.events)),
                Err(e) => {
                    let _ = w.events.send(SeqEvent::Failed(e));
                }
            }
        }
    }

    fn step(&mut self) {
        match self.engine.step() {
            Ok(events) => {
                for ev in events {
                    let Some(i) = self.streams.iter().position(|(s, _)| *s == ev.seq) else {
                        continue;
                    };
                    let finished = ev.finish.is_some();
                    let sent = self.streams[i].1.send(SeqEvent::Token {
                        token: ev.token,
                        logprobs: ev.logprobs,
                        finish: ev.finish,
                    });
                    if finished {
                        self.streams.swap_remove(i);
                    } else if sent.is_err() {
                        // The caller went away: free the sequence now.
                        self.engine.cancel(ev.seq);
                        self.streams.swap_remove(i);
                        debug!(seq = ev.seq, "caller gone, sequence cancelled");
                    }
                }
            }
            Err(e) => {
                error!(error = %e, "engine step failed; failing its sequences");
                for (id, events) in self.streams.drain(..) {
                    self.engine.cancel(id);
                    let _ = events.send(SeqEvent::Failed(Error::Unavailable(format!(
                        "engine step failed: {e}"
                    ))));
                }
            }
        }
    }

    fn publish(&self) {
        self.shared
            .running
            .store(self.engine.num_running(), Ordering::Relaxed);
        self.shared
            .kv_free
            .store(self.engine.free_blocks(), Ordering::Relaxed);
    }
}
