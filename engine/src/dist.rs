//! Running one engine step across the ranks of a `tp × pp` replica.
//!
//! The leader (rank 0) owns the scheduler. Every step it sends the plan — token ids, the
//! batch layout and which rows need logits — to every other rank; each rank runs its
//! shard ([`run_rank_step`]): the first stage embeds, stages pass hidden states to the
//! next stage's rank of the same TP index, TP groups all-reduce inside the layers, and
//! the last stage's TP rank 0 returns the logits to the leader, which samples. Any
//! communication failure (a rank died, or stopped answering within the receive timeout)
//! fails the step with `Unavailable`; the leader's engine then fails its sequences.
//!
//! [`StepExecutor`] is the engine's view of all this; [`LocalExecutor`] is the one-rank
//! case with no communication at all.

use std::time::Instant;

use strata_common::{Error, ModelConfig, Parallelism, Result, ShardPlan};
use tracing::{debug_span, Span};

use crate::backend::{Backend, BatchLayout};
use crate::comm::plan::{encode_step, LeaderMessage, PlanBounds, StepPlan};
use crate::comm::{bytes_f32, f32_bytes, Communicator};
use crate::logits::{Draw, LogitsWanted, StepOutput};
use crate::model::Model;

/// What the engine needs from whatever runs its steps.
pub trait StepExecutor: Send {
    fn config(&self) -> &ModelConfig;
    /// Allocates `num_blocks` KV blocks on every rank.
    fn alloc_kv(&mut self, num_blocks: usize, block_size: usize) -> Result<()>;
    /// Runs one step and returns, for `logit_rows`, what `wanted` asks — their logits
    /// (`[rows, vocab]`), greedy picks or candidates — and, when `draws` is not empty (one
    /// per logit row; only where [`StepExecutor::draws_on_device`]), each row's drawn
    /// token.
    fn execute(
        &mut self,
        ids: &[u32],
        layout: &BatchLayout,
        logit_rows: &[usize],
        wanted: LogitsWanted,
        draws: &[Draw],
    ) -> Result<StepOutput>;
    /// Whether steps draw sampled tokens where the logits are ([`crate::logits::draw`]):
    /// one rank whose backend does. Tensor- and pipeline-parallel replicas sample on the
    /// leader's host.
    fn draws_on_device(&self) -> bool {
        false
    }
    /// Weight bytes on the leader rank.
    fn weight_bytes(&self) -> usize;
    /// Bytes of one K or V element in the KV cache (every rank runs the same backend).
    fn kv_element_bytes(&self) -> usize;
    /// Weight bytes the leader rank reads per decode step.
    fn decode_bytes_per_token(&self) -> usize;
    /// The leader's communication counters (None on a single rank).
    fn comm_stats(&self) -> Option<crate::comm::CommStats> {
        None
    }
}

/// KV bytes per position on the rank that needs the most (all ranks allocate the same
/// number of blocks, so the busiest rank decides).
fn max_kv_bytes_per_position(config: &ModelConfig, par: Parallelism, element: usize) -> Result<usize> {
    let plan = ShardPlan::new(config, par)?;
    Ok(plan
        .ranks
        .iter()
        .map(|r| 2 * r.layers.len() * r.kv_heads.len() * config.head_dim * element)
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

/// One rank, no communication.
pub struct LocalExecutor<B: Backend> {
    pub model: Model<B>,
    kv: Vec<B::KvLayer>,
}

impl<B: Backend> LocalExecutor<B> {
    pub fn new(model: Model<B>) -> Self {
        LocalExecutor { model, kv: Vec::new() }
    }
}

impl<B: Backend> StepExecutor for LocalExecutor<B> {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }
    fn alloc_kv(&mut self, num_blocks: usize, block_size: usize) -> Result<()> {
        self.kv = self.model.alloc_kv(num_blocks, block_size)?;
        Ok(())
    }
    fn execute(
        &mut self,
        ids: &[u32],
        layout: &BatchLayout,
        logit_rows: &[usize],
        wanted: LogitsWanted,
        draws: &[Draw],
    ) -> Result<StepOutput> {
        let started = Instant::now();
        let (model, kv) = (&self.model, &mut self.kv);
        let out =
            on_pool(model.backend(), None, || model.forward(ids, layout, kv, logit_rows, wanted, draws))?;
        self.model.metrics.step(started.elapsed());
        Ok(out)
    }
    fn draws_on_device(&self) -> bool {
        self.model.backend().draws_on_device()
    }
    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }
    fn kv_element_bytes(&self) -> usize {
        self.model.backend().kv_element_bytes()
    }
    fn decode_bytes_per_token(&self) -> usize {
        self.model.decode_bytes_per_token()
    }
}

/// Runs a step's ops where their parallel loops start cheaply. A backend whose ops fan out
/// over rayon's pool ([`Backend::uses_thread_pool`]) runs the step inside `pool` — a
/// rank's own, when ranks of one group share a process (a rank blocked in a collective
/// must not hold a worker its peers need) — or else inside the global pool, so each loop
/// starts on a worker that takes part in it instead of handing itself over and sleeping.
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

/// Rank 0 of a multi-rank replica.
pub struct LeaderExecutor<B: Backend> {
    model: Model<B>,
    kv: Vec<B::KvLayer>,
    comm: Box<dyn Communicator>,
    /// Its own thread pool when the other ranks are threads of this process.
    pool: Option<rayon::ThreadPool>,
    /// Whether steps draw tokens on the device (see [`StepExecutor::draws_on_device`]).
    device_draws: bool,
}

impl<B: Backend> LeaderExecutor<B> {
    /// `pool`: see [`rank_pool`]; None when the other ranks are other processes.
    pub fn new(model: Model<B>, mut comm: Box<dyn Communicator>, pool: Option<rayon::ThreadPool>) -> Self {
        // The last stage draws: on one rank, or on every TP rank from the vocabulary
        // gathered on their devices (equal shards), rank 0's tokens being the step's.
        let tp = model.shard.par.tp;
        let device_draws = model.backend().draws_on_device()
            && (tp == 1
                || (model.config.vocab_size.is_multiple_of(tp)
                    && model.backend().captures_collectives(comm.as_mut())));
        LeaderExecutor { model, kv: Vec::new(), comm, pool, device_draws }
    }
}

impl<B: Backend> StepExecutor for LeaderExecutor<B> {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }
    fn alloc_kv(&mut self, num_blocks: usize, block_size: usize) -> Result<()> {
        // Every rank allocates exactly the leader's block count: slots index all of them.
        let init = LeaderMessage::Init { num_blocks, block_size }.encode();
        for r in 1..self.comm.world() {
            self.comm.send(r, &init)?;
        }
        self.kv = self.model.alloc_kv(num_blocks, block_size)?;
        Ok(())
    }
    fn execute(
        &mut self,
        ids: &[u32],
        layout: &BatchLayout,
        logit_rows: &[usize],
        wanted: LogitsWanted,
        draws: &[Draw],
    ) -> Result<StepOutput> {
        if !draws.is_empty() && !self.device_draws {
            return Err(Error::Internal("a multi-rank step was asked to draw on the device".into()));
        }
        // The current span is the engine's step: every rank's step becomes its child.
        let trace = strata_common::trace::context_of(&Span::current());
        let msg = encode_step(ids, layout, (logit_rows, wanted, draws), trace.as_ref());
        for r in 1..self.comm.world() {
            self.comm.send(r, &msg)?;
        }
        let span = match trace {
            Some(_) => debug_span!("rank.step", rank = 0i64, tokens = ids.len() as i64),
            None => Span::none(),
        };
        let own = span.in_scope(|| {
            let step = RankStep { ids, layout, logit_rows, wanted, draws };
            run_rank_step(&self.model, &mut self.kv, self.comm.as_mut(), self.pool.as_ref(), step)
        })?;
        match own {
            Some(out) => Ok(out),
            None => {
                // The last stage's TP rank 0 replies.
                let from = self.model.shard.par.world() - self.model.shard.par.tp;
                StepOutput::from_f32s(wanted, draws.len(), bytes_f32(&self.comm.recv(from)?))
            }
        }
    }
    fn draws_on_device(&self) -> bool {
        self.device_draws
    }
    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }
    fn kv_element_bytes(&self) -> usize {
        self.model.backend().kv_element_bytes()
    }
    fn decode_bytes_per_token(&self) -> usize {
        self.model.decode_bytes_per_token()
    }
    fn comm_stats(&self) -> Option<crate::comm::CommStats> {
        Some(self.comm.stats())
    }
}

impl<B: Backend> Drop for LeaderExecutor<B> {
    fn drop(&mut self) {
        let shutdown = LeaderMessage::Shutdown.encode();
        for r in 1..self.comm.world() {
            let _ = self.comm.send(r, &shutdown);
        }
    }
}

/// This rank's part of a step, timed. Returns the step's output on the last stage's TP
/// rank 0.
fn run_rank_step<B: Backend>(
    model: &Model<B>,
    kv: &mut [B::KvLayer],
    comm: &mut dyn Communicator,
    pool: Option<&rayon::ThreadPool>,
    step: RankStep<'_>,
) -> Result<Option<StepOutput>> {
    let started = Instant::now();
    let out = on_pool(model.backend(), pool, || rank_step(model, kv, comm, step))?;
    model.metrics.step(started.elapsed());
    Ok(out)
}

/// A step's inputs, as every rank gets them.
struct RankStep<'a> {
    ids: &'a [u32],
    layout: &'a BatchLayout,
    logit_rows: &'a [usize],
    wanted: LogitsWanted,
    /// Tokens to draw on the device (every rank of the last stage draws; see
    /// [`LeaderExecutor::new`]).
    draws: &'a [Draw],
}

fn rank_step<B: Backend>(
    model: &Model<B>,
    kv: &mut [B::KvLayer],
    comm: &mut dyn Communicator,
    step: RankStep<'_>,
) -> Result<Option<StepOutput>> {
    let RankStep { ids, layout, logit_rows, wanted, draws } = step;
    let lead = model.shard.is_last_stage() && model.shard.shard.tp_rank == 0;
    // Decode steps replay from graphs where the replica's collectives and hand-offs are
    // device work (NCCL); then only reduced rows reach the host.
    if let Some(out) = model.replayed(ids, layout, kv, (logit_rows, wanted, draws), comm)? {
        return Ok(lead.then_some(out));
    }
    let x = model.stage_input(ids, comm)?;
    let x = model.run_layers(x, layout, kv, comm)?;
    if !model.shard.is_last_stage() {
        model.backend().send_hidden(&x, model.next_stage_rank(), comm)?;
        return Ok(None);
    }
    let out = model.step_output(&x, (logit_rows, wanted, draws), comm)?;
    Ok(lead.then_some(out))
}

/// The loop of every rank but the leader: allocate the KV cache the leader asks for, then
/// run steps until told to stop. `pool`: see [`rank_pool`]; None for a rank that is the
/// only one of its group in this process.
pub fn follower_loop<B: Backend>(
    model: Model<B>,
    mut comm: Box<dyn Communicator>,
    pool: Option<rayon::ThreadPool>,
) -> Result<()> {
    let LeaderMessage::Init { num_blocks, block_size } = LeaderMessage::decode(&comm.recv_idle(0)?, None)?
    else {
        return Err(Error::Internal("the leader's first message is not the KV cache size".into()));
    };
    let mut kv = model.alloc_kv(num_blocks, block_size)?;
    let bounds = PlanBounds { num_blocks, block_size, vocab_size: model.config.vocab_size };
    let rank = comm.rank();
    let last_lead = model.shard.is_last_stage() && model.shard.shard.tp_rank == 0;
    loop {
        let plan = match LeaderMessage::decode(&comm.recv_idle(0)?, Some(bounds))? {
            LeaderMessage::Step(plan) => plan,
            LeaderMessage::Shutdown => return Ok(()),
            LeaderMessage::Init { .. } => {
                return Err(Error::Internal("the leader sent a second KV cache size".into()))
            }
        };
        let StepPlan { ids, layout, logit_rows, wanted, draws, trace } = plan;
        let span = match &trace {
            Some(cx) => {
                let span = debug_span!("rank.step", rank = rank as i64, tokens = ids.len() as i64);
                strata_common::trace::set_parent(&span, cx);
                span
            }
            None => Span::none(),
        };
        let step = RankStep { ids: &ids, layout: &layout, logit_rows: &logit_rows, wanted, draws: &draws };
        let out = span.in_scope(|| run_rank_step(&model, &mut kv, comm.as_mut(), pool.as_ref(), step))?;
        if let (true, Some(out)) = (last_lead, out) {
            if rank != 0 {
                comm.send(0, f32_bytes(&out.into_f32s(wanted)))?;
            }
        }
    }
}
