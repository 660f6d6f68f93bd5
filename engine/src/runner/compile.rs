//! The runner's compile thread: constraints are compiled here, never on the engine's
//! thread, so a schema that takes milliseconds to compile delays its own request only,
//! not every sequence's next token.
//!
//! Compiles run one at a time (a cache hit is a clone); a submission keeps its place in
//! the queued count while it compiles, so backpressure still counts it. The thread holds
//! no sender to the runner of its own — each submission carries one back — so it never
//! keeps a finished runner alive, and it ends when the runner drops its [`Compiler`].

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use strata_common::SeqEvent;
use tracing::warn;

use super::{Command, Shared, Submission};
use crate::guide::{prepare_guide, Grammars};

pub(super) struct Compiler {
    tx: mpsc::Sender<Box<Submission>>,
    shared: Arc<Shared>,
}

impl Compiler {
    pub(super) fn start(grammars: Arc<Grammars>, shared: Arc<Shared>) -> Self {
        let (tx, rx) = mpsc::channel::<Box<Submission>>();
        let counters = shared.clone();
        let run = move || {
            for mut s in rx {
                if s.caller.events.is_closed() {
                    shared.queued.fetch_sub(1, Ordering::SeqCst);
                    continue;
                }
                match prepare_guide(Some(&grammars), &s.params, &s.generated) {
                    Ok(guide) => {
                        s.guide = guide;
                        let reply = s.reply.clone();
                        if reply.send(Command::Submit(s)).is_err() {
                            shared.queued.fetch_sub(1, Ordering::SeqCst);
                        }
                    }
                    Err(e) => {
                        let _ = s.caller.events.try_send(SeqEvent::Failed(e));
                        shared.queued.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            }
        };
        if let Err(e) = std::thread::Builder::new().name("constraints".into()).spawn(run) {
            // Without the thread every submission sent fails on the closed channel below.
            warn!(error = %e, "cannot start the constraint compile thread");
        }
        Compiler { tx, shared: counters }
    }

    /// Queues `s` for compiling; if the thread is gone, fails its caller.
    pub(super) fn send(&self, s: Box<Submission>) {
        if let Err(mpsc::SendError(s)) = self.tx.send(s) {
            let error = strata_common::Error::Internal("the constraint compile thread is gone".into());
            let _ = s.caller.events.try_send(SeqEvent::Failed(error));
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        }
    }
}
