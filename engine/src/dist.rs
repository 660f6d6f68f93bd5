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

use strata_common::{Error, ModelConfig, Parallelism, Result, ShardPlan};

use crate::backend::{Backend, BatchLayout, SeqSlice};
use crate::comm::{bytes_f32, f32_bytes, Communicator};
use crate::logits::{LogitsWanted, StepLogits};
use crate::model::{Model, NoComm};

/// What the engine needs from whatever runs its steps.
pub trait StepExecutor: Send {
    fn config(&self) -> &ModelConfig;
    /// Allocates `num_blocks` KV blocks on every rank.
    fn alloc_kv(&mut self, num_blocks: usize, block_size: usize) -> Result<()>;
    /// Runs one step and returns, for `logit_rows`, what `wanted` asks: their logits
    /// (`[rows, vocab]`) or their greedy picks.
    fn execute(
        &mut self,
        ids: &[u32],
        layout: &BatchLayout,
        logit_rows: &[usize],
        wanted: LogitsWanted,
    ) -> Result<StepLogits>;
    /// Weight bytes on the leader rank.
    fn weight_bytes(&self) -> usize;
    /// Weight bytes the leader rank reads per decode step.
    fn decode_bytes_per_token(&self) -> usize;
    /// The leader's communication counters (None on a single rank).
    fn comm_stats(&self) -> Option<crate::comm::CommStats> {
        None
    }
}

/// KV bytes per position on the rank that needs the most (all ranks allocate the same
/// number of blocks, so the busiest rank decides).
pub fn max_kv_bytes_per_position(config: &ModelConfig, par: Parallelism) -> Result<usize> {
    let plan = ShardPlan::new(config, par)?;
    Ok(plan
        .ranks
        .iter()
        .map(|r| 2 * r.layers.len() * r.kv_heads.len() * config.head_dim * 4)
        .max()
        .unwrap_or(0))
}

/// Blocks of `block_size` positions that `kv_cache_bytes` buys on every rank.
pub fn kv_blocks(
    config: &ModelConfig,
    par: Parallelism,
    kv_cache_bytes: usize,
    block_size: usize,
) -> Result<usize> {
    let per_block = max_kv_bytes_per_position(config, par)? * block_size;
    let n = kv_cache_bytes / per_block.max(1);
    if n == 0 {
        return Err(Error::invalid(
            "kv_cache_memory",
            format!("{kv_cache_bytes} bytes hold no block of {per_block} bytes"),
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
    ) -> Result<StepLogits> {
        let mut none = NoComm;
        let x = self.model.embed_tokens(ids, &mut none)?;
        let x = self.model.run_layers(x, layout, &mut self.kv, &mut none)?;
        self.model.step_logits(&x, logit_rows, wanted, &mut none)
    }
    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }
    fn decode_bytes_per_token(&self) -> usize {
        self.model.decode_bytes_per_token()
    }
}

/// Rank 0 of a multi-rank replica.
pub struct LeaderExecutor<B: Backend> {
    model: Model<B>,
    kv: Vec<B::KvLayer>,
    comm: Box<dyn Communicator>,
}

impl<B: Backend> LeaderExecutor<B> {
    pub fn new(model: Model<B>, comm: Box<dyn Communicator>) -> Self {
        LeaderExecutor { model, kv: Vec::new(), comm }
    }
}

impl<B: Backend> StepExecutor for LeaderExecutor<B> {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }
    fn alloc_kv(&mut self, num_blocks: usize, block_size: usize) -> Result<()> {
        // Every rank allocates exactly the leader's block count: slots index all of them.
        let mut init = vec![MSG_INIT];
        put(&mut init, num_blocks);
        put(&mut init, block_size);
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
    ) -> Result<StepLogits> {
        let msg = encode_step(ids, layout, logit_rows, wanted);
        for r in 1..self.comm.world() {
            self.comm.send(r, &msg)?;
        }
        let own =
            run_rank_step(&self.model, &mut self.kv, self.comm.as_mut(), ids, layout, logit_rows, wanted)?;
        match own {
            Some(logits) => Ok(logits),
            None => {
                let from = self.model.shard.par.world() - self.model.shard.par.tp;
                StepLogits::from_f32s(wanted, bytes_f32(&self.comm.recv(from)?))
            }
        }
    }
    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
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
        for r in 1..self.comm.world() {
            let _ = self.comm.send(r, &[MSG_SHUTDOWN]);
        }
    }
}

/// This rank's part of a step. Returns the logits (or picks) on the last stage's TP rank 0.
pub fn run_rank_step<B: Backend>(
    model: &Model<B>,
    kv: &mut [B::KvLayer],
    comm: &mut dyn Communicator,
    ids: &[u32],
    layout: &BatchLayout,
    logit_rows: &[usize],
    wanted: LogitsWanted,
) -> Result<Option<StepLogits>> {
    let s = &model.shard.shard;
    let tp = model.shard.par.tp;
    let b = model.backend();
    let x = if s.stage == 0 {
        model.embed_tokens(ids, comm)?
    } else {
        let data = bytes_f32(&comm.recv((s.stage - 1) * tp + s.tp_rank)?);
        if data.len() != ids.len() * model.config.hidden_size {
            return Err(Error::Internal(format!(
                "rank {}: hidden states of {} values for {} tokens",
                s.rank,
                data.len(),
                ids.len()
            )));
        }
        b.upload(data, ids.len(), model.config.hidden_size)?
    };
    let x = model.run_layers(x, layout, kv, comm)?;
    if !model.shard.is_last_stage() {
        comm.send((s.stage + 1) * tp + s.tp_rank, f32_bytes(&b.to_host(&x)?))?;
        return Ok(None);
    }
    let logits = model.step_logits(&x, logit_rows, wanted, comm)?;
    Ok((s.tp_rank == 0).then_some(logits))
}

/// The loop of every rank but the leader: allocate the KV cache the leader asks for, then
/// run steps until told to stop.
pub fn follower_loop<B: Backend>(model: Model<B>, mut comm: Box<dyn Communicator>) -> Result<()> {
    let init = comm.recv_idle(0)?;
    if init.first() != Some(&MSG_INIT) {
        return Err(Error::Internal("the leader's first message is not the KV cache size".into()));
    }
    let mut r = Reader { b: &init, at: 1 };
    let (num_blocks, block_size) = (r.u32()? as usize, r.u32()? as usize);
    let mut kv = model.alloc_kv(num_blocks, block_size)?;
    let rank = comm.rank();
    let last_lead = model.shard.is_last_stage() && model.shard.shard.tp_rank == 0;
    loop {
        let msg = comm.recv_idle(0)?;
        if msg.first() == Some(&MSG_SHUTDOWN) {
            return Ok(());
        }
        let (ids, layout, rows, wanted) = decode_step(&msg)?;
        let logits = run_rank_step(&model, &mut kv, comm.as_mut(), &ids, &layout, &rows, wanted)?;
        if let (true, Some(l)) = (last_lead, logits) {
            if rank != 0 {
                comm.send(0, f32_bytes(&l.into_f32s()))?;
            }
        }
    }
}

const MSG_STEP: u8 = 1;
const MSG_SHUTDOWN: u8 = 2;
const MSG_INIT: u8 = 3;

fn put(out: &mut Vec<u8>, v: usize) {
    out.extend_from_slice(&(v as u32).to_le_bytes());
}

fn put_all(out: &mut Vec<u8>, v: impl ExactSizeIterator<Item = usize>) {
    put(out, v.len());
    for x in v {
        put(out, x);
    }
}

/// Serialises a step plan (u32 little-endian fields).
pub fn encode_step(ids: &[u32], layout: &BatchLayout, logit_rows: &[usize], wanted: LogitsWanted) -> Vec<u8> {
    let mut out = vec![MSG_STEP];
    put_all(&mut out, ids.iter().map(|&x| x as usize));
    put_all(&mut out, layout.positions.iter().map(|&x| x as usize));
    put_all(&mut out, layout.slots.iter().map(|&x| x as usize));
    put(&mut out, layout.block_size);
    put(&mut out, layout.seqs.len());
    for s in &layout.seqs {
        put(&mut out, s.token_start);
        put(&mut out, s.num_tokens);
        put(&mut out, s.context_before);
        put_all(&mut out, s.block_table.iter().map(|&x| x as usize));
    }
    put_all(&mut out, logit_rows.iter().copied());
    put(&mut out, (wanted == LogitsWanted::Greedy) as usize);
    out
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn u32(&mut self) -> Result<u32> {
        let bytes = self
            .b
            .get(self.at..self.at + 4)
            .ok_or_else(|| Error::Internal("truncated step message".into()))?;
        self.at += 4;
        Ok(u32::from_le_bytes(bytes.try_into().expect("4 bytes")))
    }
    fn vec(&mut self) -> Result<Vec<u32>> {
        let n = self.u32()? as usize;
        (0..n).map(|_| self.u32()).collect()
    }
}

pub fn decode_step(msg: &[u8]) -> Result<(Vec<u32>, BatchLayout, Vec<usize>, LogitsWanted)> {
    if msg.first() != Some(&MSG_STEP) {
        return Err(Error::Internal("not a step message".into()));
    }
    let mut r = Reader { b: msg, at: 1 };
    let ids = r.vec()?;
    let positions = r.vec()?;
    let slots = r.vec()?;
    let block_size = r.u32()? as usize;
    let n = r.u32()? as usize;
    let mut seqs = Vec::with_capacity(n);
    for _ in 0..n {
        seqs.push(SeqSlice {
            token_start: r.u32()? as usize,
            num_tokens: r.u32()? as usize,
            context_before: r.u32()? as usize,
            block_table: r.vec()?,
        });
    }
    let rows = r.vec()?.into_iter().map(|x| x as usize).collect();
    let wanted = match r.u32()? {
        0 => LogitsWanted::Full,
        1 => LogitsWanted::Greedy,
        w => return Err(Error::Internal(format!("a step message asks for logits form {w}"))),
    };
    Ok((ids, BatchLayout { positions, slots, seqs, block_size }, rows, wanted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_messages_round_trip() {
        let layout = BatchLayout {
            positions: vec![0, 1, 7],
            slots: vec![32, 33, 71],
            seqs: vec![
                SeqSlice { token_start: 0, num_tokens: 2, context_before: 0, block_table: vec![2] },
                SeqSlice { token_start: 2, num_tokens: 1, context_before: 7, block_table: vec![4, 0] },
            ],
            block_size: 16,
        };
        let msg = encode_step(&[5, 6, 9], &layout, &[1, 2], LogitsWanted::Greedy);
        let (ids, back, rows, wanted) = decode_step(&msg).unwrap();
        assert_eq!(ids, vec![5, 6, 9]);
        assert_eq!(rows, vec![1, 2]);
        assert_eq!(wanted, LogitsWanted::Greedy);
        assert_eq!((back.positions, back.slots, back.block_size), (layout.positions, layout.slots, 16));
        assert_eq!(back.seqs[1].block_table, vec![4, 0]);
        assert!(decode_step(&msg[..msg.len() - 3]).is_err());
    }
}
