//! Running one engine [`Step`] across the ranks of a `tp × pp` replica.
//!
//! The leader (rank 0) owns the scheduler. Every step it sends the step — encoded once
//! ([`crate::comm::plan`]) — to every other rank; each rank runs its shard
//! ([`Model::run_step`]): the first stage embeds, stages pass hidden states to the next
//! stage's rank of the same TP index, TP groups all-reduce inside the layers, and the last
//! stage's TP rank 0 returns the [`StepOutput`] to the leader, which samples. A one-rank
//! replica is the same code with [`Solo`] collectives: nothing is sent, and its own rank
//! is the one that returns the output. Any communication failure (a rank died, or stopped
//! answering within the receive timeout) fails the step with `Unavailable`; the leader's
//! engine then fails its sequences.
//!
//! [`StepExecutor`] is the engine's view of all this; [`LeaderExecutor`] runs it on rank 0
//! and [`follower_loop`] on every other rank.

use std::time::Instant;

use strata_common::{Error, ModelConfig, Parallelism, Result, ShardPlan};
use tracing::{debug_span, Span};

use crate::backend::Backend;
use crate::comm::plan::{encode_step, LeaderMessage, PlanBounds};
use crate::comm::{bytes_f32, f32_bytes, CommStats, DeviceCollectives, Solo};
use crate::logits::StepOutput;
use crate::model::Model;
use crate::step::{KvBlocks, Step};

/// What the engine needs from whatever runs its steps.
pub trait StepExecutor: Send {
    fn config(&self) -> &ModelConfig;
    /// Allocates the KV cache `kv` says on every rank.
    fn alloc_kv(&mut self, kv: KvBlocks) -> Result<()>;
    /// Runs one step and returns, for its logit rows, what it asks for — their logits
    /// (`[rows, vocab]`), greedy picks or candidates — and, when it draws (only where
    /// [`StepExecutor::draws_on_device`]), each row's drawn token.
    fn execute(&mut self, step: &Step) -> Result<StepOutput>;
    /// Whether steps draw sampled tokens where the logits are ([`crate::logits::draw`]).
    fn draws_on_device(&self) -> bool {
        false
    }
    /// Whether steps take token masks ([`Step::masks`]) and apply them where the logits
    /// are: a replica of one rank whose backend masks on the device.
    fn masks_on_device(&self) -> bool {
        false
    }
    /// Weight bytes on the leader rank.
    fn weight_bytes(&self) -> usize;
    /// Bytes of one K or V element in the KV cache (every rank runs the same backend).
    fn kv_element_bytes(&self) -> usize;
    /// Weight bytes the leader rank reads per decode step.
    fn decode_bytes_per_token(&self) -> usize;
    /// The leader's communication counters (None on a single rank).
    fn comm_stats(&self) -> Option<CommStats> {
        None
    }
}

/// KV bytes per position on the rank that needs the most (all ranks allocate the same
/// number of blocks, so the busiest rank decides): a storage for each of its layers, or
/// for each slot its layers share ([`strata_common::KvGroups`]).
fn max_kv_bytes_per_position(config: &ModelConfig, par: Parallelism, element: usize) -> Result<usize> {
    let plan = ShardPlan::new(config, par)?;
    let groups = config.kv_groups();
    Ok(plan
        .ranks
        .iter()
        .map(|r| {
            let (width, shared) = config.kv_layer_width(r.kv_heads.len());
            groups.slots_of(r.layers.clone()).len() * width * if shared { 1 } else { 2 } * element
        })
        .max()
        .unwrap_or(0))
}

/// Blocks of `block_size` positions that `kv_cache_bytes` buys on every rank, at
/// `element` bytes per K or V value.
pub fn kv_blocks(
    config: &ModelConfig,
    par: Parallelism,
    kv_cache_bytes: usize,
    block_size: usize,
    element: usize,
) -> Result<usize> {
    let per_block = max_kv_bytes_per_position(config, par, element)? * block_size;
    let n = kv_cache_bytes / per_block.max(1);
    if n == 0 {
        return Err(Error::invalid(
            "kv_cache_memory",
            format!("{kv_cache_bytes} bytes hold no block of {per_block} bytes"),
        ));
    }
    if n > u32::MAX as usize {
        return Err(Error::invalid(
            "kv_cache_memory",
            format!("{n} blocks exceed the {} a cache can index", u32::MAX),
        ));
    }
    Ok(n)
}

/// Runs a step's ops where their parallel loops start cheaply. A backend whose ops fan out
/// over rayon's pool ([`crate::backend::Tensors::uses_thread_pool`]) runs the step inside
/// `pool` — a rank's own, when ranks of one group share a process (a rank blocked in a
/// collective must not hold a worker its peers need) — or else inside the global pool, so
/// each loop starts on a worker that takes part in it instead of handing itself over and
/// sleeping.
fn on_pool<B: Backend, R: Send>(
    backend: &B,
    pool: Option<&rayon::ThreadPool>,
    f: impl FnOnce() -> R + Send,
) -> R {
    match (backend.uses_thread_pool(), pool) {
        (false, _) => f(),
        (true, Some(p)) => p.install(f),
        (true, None) => rayon::scope(|_| f()),
    }
}

/// A rank's own thread pool, for ranks that share a process with the other ranks of their
/// group: the global pool's threads divided among the `world` ranks.
pub fn rank_pool(rank: usize, world: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads((rayon::current_num_threads() / world.max(1)).max(1))
        .thread_name(move |i| format!("rank-{rank}-pool-{i}"))
        .build()
        .map_err(|e| Error::Internal(format!("rank {rank}'s thread pool: {e}")))
}

/// One rank's model, KV cache and collectives: what every rank, leader or follower, runs
/// its part of a step with.
struct Rank<B: Backend> {
    model: Model<B>,
    kv: Vec<B::KvLayer>,
    comm: Box<dyn DeviceCollectives<B>>,
    /// Its own thread pool when the other ranks are threads of this process.
    pool: Option<rayon::ThreadPool>,
}

impl<B: Backend> Rank<B> {
    /// This rank's part of `step`, timed, inside a `rank.step` span that joins the
    /// leader's trace where the step carries one (multi-rank replicas only).
    fn run(&mut self, step: &Step) -> Result<Option<StepOutput>> {
        let span = match (&step.trace, self.model.shard.par.world() > 1) {
            (Some(cx), true) => {
                let rank = self.model.shard.shard.rank;
                let span = debug_span!("rank.step", rank = rank as i64, tokens = step.num_tokens() as i64);
                if rank != 0 {
                    strata_common::trace::set_parent(&span, cx);
                }
                span
            }
            _ => Span::none(),
        };
        let started = Instant::now();
        let Rank { model, kv, comm, pool } = self;
        let out = span.in_scope(|| {
            on_pool(model.backend(), pool.as_ref(), || model.run_step(step, kv, comm.as_mut()))
        })?;
        model.metrics.step(started.elapsed());
        Ok(out)
    }
}

/// Rank 0 of a replica: of a one-rank replica, the only one.
pub struct LeaderExecutor<B: Backend> {
    rank: Rank<B>,
    /// Whether steps draw tokens on the device (see [`StepExecutor::draws_on_device`]).
    device_draws: bool,
}

impl<B: Backend> LeaderExecutor<B> {
    /// The leader of a replica whose ranks talk through `comm`. `pool`: see [`rank_pool`];
    /// None when the other ranks are other processes.
    pub fn new(
        model: Model<B>,
        comm: Box<dyn DeviceCollectives<B>>,
        pool: Option<rayon::ThreadPool>,
    ) -> Self {
        // The last stage draws: on one rank, or on every TP rank from the vocabulary
        // gathered on their devices (equal shards), rank 0's tokens being the step's.
        let tp = model.shard.par.tp;
        let device_draws = model.backend().draws_on_device()
            && (tp == 1 || (model.config.vocab_size.is_multiple_of(tp) && comm.in_stream_order()));
        LeaderExecutor { rank: Rank { model, kv: Vec::new(), comm, pool }, device_draws }
    }

    /// A one-rank replica: the same executor, with collectives that have no one to talk to.
    pub fn solo(model: Model<B>) -> Self {
        Self::new(model, Box::new(Solo), None)
    }

    fn world(&self) -> usize {
        self.rank.model.shard.par.world()
    }

    pub fn model(&self) -> &Model<B> {
        &self.rank.model
    }
}

impl<B: Backend> StepExecutor for LeaderExecutor<B> {
    fn config(&self) -> &ModelConfig {
        &self.rank.model.config
    }
    fn alloc_kv(&mut self, kv: KvBlocks) -> Result<()> {
        // Every rank allocates exactly the leader's block counts: slots index all of them.
        let init = LeaderMessage::Init(kv).encode();
        for r in 1..self.world() {
            self.rank.comm.host().send(r, &init)?;
        }
        self.rank.kv = self.rank.model.alloc_kv(kv)?;
        Ok(())
    }
    fn execute(&mut self, step: &Step) -> Result<StepOutput> {
        step.check_shape()?;
        if step.draws_tokens() && !self.device_draws {
            return Err(Error::Internal("a step was asked to draw where its replica cannot".into()));
        }
        if step.masks.is_some() && !self.masks_on_device() {
            return Err(Error::Internal(
                "a step brought token masks to a replica that cannot apply them".into(),
            ));
        }
        if self.world() > 1 {
            let msg = encode_step(step);
            for r in 1..self.world() {
                self.rank.comm.host().send(r, &msg)?;
            }
        }
        match self.rank.run(step)? {
            Some(out) => Ok(out),
            None => {
                // The last stage's TP rank 0 replies.
                let par = self.rank.model.shard.par;
                let reply = self.rank.comm.host().recv(par.world() - par.tp)?;
                let hidden = step.hidden_rows.len() * self.rank.model.config.hidden_size;
                StepOutput::from_f32s(step.wanted, step.draws.len(), hidden, bytes_f32(&reply))
            }
        }
    }
    fn draws_on_device(&self) -> bool {
        self.device_draws
    }
    fn masks_on_device(&self) -> bool {
        self.world() == 1 && self.rank.model.backend().masks_on_device()
    }
    fn weight_bytes(&self) -> usize {
        self.rank.model.weight_bytes()
    }
    fn kv_element_bytes(&self) -> usize {
        self.rank.model.backend().kv_element_bytes()
    }
    fn decode_bytes_per_token(&self) -> usize {
        self.rank.model.decode_bytes_per_token()
    }
    fn comm_stats(&self) -> Option<CommStats> {
        (self.world() > 1).then(|| self.rank.comm.stats())
    }
}

impl<B: Backend> Drop for LeaderExecutor<B> {
    fn drop(&mut self) {
        let shutdown = LeaderMessage::Shutdown.encode();
        for r in 1..self.world() {
            let _ = self.rank.comm.host().send(r, &shutdown);
        }
    }
}

/// The loop of every rank but the leader: allocate the KV cache the leader asks for, then
/// run steps until told to stop. `pool`: see [`rank_pool`]; None for a rank that is the
/// only one of its group in this process.
pub fn follower_loop<B: Backend>(
    model: Model<B>,
    comm: Box<dyn DeviceCollectives<B>>,
    pool: Option<rayon::ThreadPool>,
) -> Result<()> {
    let mut rank = Rank { model, kv: Vec::new(), comm, pool };
    // Waiting for rank 0, a broken link means rank 0 is gone: that is whom to blame.
    let lost_leader = |e: Error| match e.class() {
        strata_common::ErrorClass::Unavailable => Error::RankLost { rank: 0, reason: e.to_string() },
        _ => e,
    };
    let first = rank.comm.host().recv_idle(0).map_err(lost_leader)?;
    let LeaderMessage::Init(kv) = LeaderMessage::decode(&first, None)? else {
        return Err(Error::Internal("the leader's first message is not the KV cache size".into()));
    };
    rank.kv = rank.model.alloc_kv(kv)?;
    let kv_groups = rank.model.config.kv_groups().num_groups();
    let bounds = PlanBounds { kv, kv_groups, vocab_size: rank.model.config.vocab_size };
    loop {
        let message = rank.comm.host().recv_idle(0).map_err(lost_leader)?;
        let step = match LeaderMessage::decode(&message, Some(bounds))? {
            LeaderMessage::Step(step) => step,
            LeaderMessage::Shutdown => return Ok(()),
            LeaderMessage::Init(_) => {
                return Err(Error::Internal("the leader sent a second KV cache size".into()))
            }
        };
        if let Some(out) = rank.run(&step)? {
            rank.comm.host().send(0, f32_bytes(&out.into_f32s(step.wanted)))?;
        }
    }
}

#[cfg(test)]
mod tests;
