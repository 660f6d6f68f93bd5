//! A scripted worker for control-plane tests: it holds shards and answers every
//! `WorkerApi` call at once, without an engine, and can be told to fail the way real
//! workers do — drop a stream after some tokens, answer late, or stop answering
//! (partitioned or killed).
//!
//! Its tokens depend only on the job's prompt and position, so a sequence resumed on
//! another replica continues where it was cut: `next = (Σ prompt + position) mod 97 + 3`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt;
use strata_common::cluster::{Assignment, ShardState};
use strata_common::worker_api::{EventStream, Job, ModelFiles, ShardLoad, WorkerApi, WorkerStatus};
use strata_common::{EngineStats, Error, FinishReason, ReplicaId, Result, SeqEvent, WorkerId};

/// The context a scripted worker's replica reports (the fixture model's is 512).
pub const CONTEXT: usize = 300;

/// How a scripted worker misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    #[default]
    None,
    /// Every stream that would run longer ends, without a finish, after this many tokens.
    DropAfter(usize),
    /// Every call waits this long first.
    Delay(Duration),
    /// Every call fails as unreachable.
    Partitioned,
}

/// The token at `position` (counting the prompt) of a sequence whose prompt is `prompt`.
pub fn token_at(prompt: &[u32], position: usize) -> u32 {
    let sum: u64 = prompt.iter().map(|&t| t as u64).sum();
    ((sum + position as u64) % 97) as u32 + 3
}

pub struct ScriptedWorker {
    pub id: WorkerId,
    pub address: String,
    shard: Mutex<Option<ShardLoad>>,
    fault: Mutex<Fault>,
    /// Sequences started on it.
    pub jobs: AtomicUsize,
    /// Canaries it answered.
    pub canaries: AtomicUsize,
    /// Bumped whenever the shard it holds changes (its registration is rewritten).
    changed: tokio::sync::watch::Sender<u64>,
}

impl ScriptedWorker {
    pub fn new(id: &str) -> Self {
        ScriptedWorker {
            id: id.into(),
            address: format!("{id}.test:1"),
            shard: Mutex::new(None),
            fault: Mutex::new(Fault::None),
            jobs: AtomicUsize::new(0),
            canaries: AtomicUsize::new(0),
            changed: tokio::sync::watch::Sender::new(0),
        }
    }

    pub fn set_fault(&self, f: Fault) {
        *self.fault.lock().unwrap() = f;
    }

    /// Notified whenever the shard it holds changes.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// What its registration announces, as a real worker's does: the shard it holds.
    pub fn assignment(&self) -> Option<Assignment> {
        self.shard.lock().unwrap().as_ref().map(|s| Assignment {
            replica: s.replica.clone(),
            model: s.model.clone(),
            rank: s.rank as u32,
            state: ShardState::Ready,
            error: String::new(),
            lost_rank: None,
        })
    }

    /// The replica whose shard it holds, if any.
    pub fn replica(&self) -> Option<ReplicaId> {
        self.shard.lock().unwrap().as_ref().map(|s| s.replica.clone())
    }

    /// Applies the fault every call meets first.
    async fn reach(&self) -> Result<()> {
        let fault = *self.fault.lock().unwrap();
        match fault {
            Fault::Partitioned => Err(Error::Unavailable(format!("worker {} is unreachable", self.id))),
            Fault::Delay(d) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
            Fault::None | Fault::DropAfter(_) => Ok(()),
        }
    }

    fn leads(&self, replica: &ReplicaId) -> Result<()> {
        match &*self.shard.lock().unwrap() {
            Some(s) if &s.replica == replica && s.rank == 0 => Ok(()),
            _ => Err(Error::Unavailable(format!("worker {} does not lead replica {replica}", self.id))),
        }
    }
}

#[async_trait::async_trait]
impl WorkerApi for ScriptedWorker {
    async fn generate(&self, replica: &ReplicaId, job: &Job) -> Result<EventStream> {
        self.reach().await?;
        self.leads(replica)?;
        self.jobs.fetch_add(1, Ordering::SeqCst);
        let drop_after = match *self.fault.lock().unwrap() {
            Fault::DropAfter(n) => Some(n),
            _ => None,
        };
        let (prompt, done) = (job.prompt.clone(), job.generated.len());
        let left = (job.params.max_new_tokens as usize).saturating_sub(done);
        let shown = drop_after.map_or(left, |n| n.min(left));
        let events = (0..shown).map(move |i| {
            let last = i + 1 == left && drop_after.is_none_or(|n| left <= n);
            SeqEvent::Token {
                token: token_at(&prompt, prompt.len() + done + i),
                logprobs: None,
                finish: last.then_some(FinishReason::Length),
            }
        });
        Ok(futures::stream::iter(events.collect::<Vec<_>>()).boxed())
    }

    async fn stats(&self) -> Result<EngineStats> {
        self.reach().await?;
        Ok(EngineStats {
            kv_blocks_free: 64,
            kv_blocks_total: 64,
            block_size: 16,
            max_context: CONTEXT,
            ..Default::default()
        })
    }

    async fn load_shard(&self, load: ShardLoad) -> Result<Option<String>> {
        self.reach().await?;
        let rendezvous = (load.rank == 0).then(|| format!("{}/rendezvous", self.address));
        *self.shard.lock().unwrap() = Some(load);
        self.changed.send_modify(|n| *n += 1);
        Ok(rendezvous)
    }

    async fn unload_shard(&self, replica: &ReplicaId) -> Result<()> {
        self.reach().await?;
        let mut shard = self.shard.lock().unwrap();
        if shard.as_ref().is_some_and(|s| &s.replica == replica) {
            *shard = None;
            self.changed.send_modify(|n| *n += 1);
        }
        Ok(())
    }

    async fn status(&self) -> Result<WorkerStatus> {
        self.reach().await?;
        let assignment = self.assignment();
        Ok(WorkerStatus {
            worker_id: self.id.clone(),
            assignment,
            draining: false,
            stats: EngineStats::default(),
            loads: 0,
            served: self.jobs.load(Ordering::SeqCst) as u64,
        })
    }

    async fn canary(&self, replica: &ReplicaId, _limit: Duration) -> Result<Duration> {
        self.reach().await?;
        self.leads(replica)?;
        self.canaries.fetch_add(1, Ordering::SeqCst);
        Ok(Duration::from_millis(1))
    }

    async fn drain(&self, replica: &ReplicaId) -> Result<()> {
        self.reach().await?;
        self.leads(replica)
    }

    async fn model_files(&self, model_dir: &str) -> Result<ModelFiles> {
        self.reach().await?;
        Err(Error::Unavailable(format!("a scripted worker reads no files ({model_dir})")))
    }
}
