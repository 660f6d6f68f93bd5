//! Iteration-level scheduling (continuous batching) for one replica.
//!
//! The scheduler does no I/O and no tensor math: [`Scheduler::schedule`] returns the plan
//! for one engine step and [`Scheduler::complete`] is told its outcome (vLLM's shape). Each
//! step it
//! 1. continues running sequences, online before batch and oldest first within each: a
//!    decode token each, or the next chunk of a prompt still being prefilled, within the
//!    step's token budget;
//! 2. when blocks run out, **preempts** the last of that order (the newest batch sequence,
//!    else the newest online one): their blocks go back to the pool and they return to the
//!    front of their priority's queue, to be recomputed from their prompt plus the tokens
//!    they already produced (nothing is lost or produced twice);
//! 3. admits waiting sequences, online before batch and FIFO within each, while the budget,
//!    `max_num_seqs` and the cache allow, reusing cached prefix blocks; a prompt longer
//!    than the budget is prefilled in chunks across steps, so decodes keep flowing and no
//!    prompt starves.
//!
//! Blocks come from the [`BlockPool`] in a [`BlockTable`] that gives them back when
//! dropped, so every path that ends a sequence (finish, cancel, abort) frees its cache
//! by dropping it; preemption clears the table and keeps the sequence.

use std::collections::VecDeque;

use strata_common::sampling::Priority;
use strata_common::Error;

use crate::kv::{chain_hash, BlockHash, BlockPool, BlockTable};
use crate::step::SeqId;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks + decodes) in one step.
    pub max_batched_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig { max_num_seqs: 64, max_batched_tokens: 512 }
    }
}

/// A sequence as the scheduler sees it.
#[derive(Debug)]
pub struct SeqData {
    pub id: SeqId,
    /// Prompt and generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose K and V are in the cache.
    pub computed: usize,
    /// Its KV blocks; given back to the pool when the sequence is dropped.
    pub blocks: BlockTable,
    /// Hashes of this sequence's full blocks registered so far.
    hashes: Vec<BlockHash>,
    /// Online sequences are admitted before batch ones and preempted after them.
    pub priority: Priority,
}

impl SeqData {
    pub fn new(id: SeqId, prompt: Vec<u32>) -> Self {
        SeqData {
            id,
            tokens: prompt,
            computed: 0,
            blocks: BlockTable::default(),
            hashes: Vec::new(),
            priority: Priority::Online,
        }
    }

    pub fn with_priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }
}

/// One sequence's share of a step: compute tokens `start..end`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    pub start: usize,
    pub end: usize,
    /// The chunk reaches the sequence's last token, so a new token is sampled.
    pub sample: bool,
}

#[derive(Debug, Default)]
pub struct Schedule {
    pub seqs: Vec<Scheduled>,
    /// Sequences moved back to the queue this step.
    pub preempted: Vec<SeqId>,
    /// Sequences that left the queue this step (a preempted one leaves it again).
    pub admitted: Vec<SeqId>,
    /// Sequences that can never fit in the cache; they are removed.
    pub aborted: Vec<(SeqId, Error)>,
}

impl Schedule {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.end - s.start).sum()
    }
}

/// Counters since the scheduler started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_query_tokens: u64,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    pub prefix_hit_tokens: u64,
    /// KV blocks given back while their sequences ran, their positions behind every
    /// layer's attention window.
    pub window_released_blocks: u64,
}

pub struct Scheduler {
    pub stats: SchedulerStats,
    config: SchedulerConfig,
    /// Every layer attends within this many positions: blocks behind it are released.
    window: Option<usize>,
    pool: BlockPool,
    waiting: VecDeque<SeqData>,
    /// Oldest first.
    running: Vec<SeqData>,
}

impl Scheduler {
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn new(config: SchedulerConfig, pool: BlockPool) -> Self {
        Scheduler {
            stats: SchedulerStats::default(),
            config,
            window: None,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    /// Releases a running sequence's blocks once they fall behind `window` positions (a
    /// model whose every layer attends within that window): its KV memory is then what
    /// the window needs, not its length.
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Queues a new sequence behind every other of its priority (online ones go before
    /// every waiting batch sequence).
    pub fn add(&mut self, seq: SeqData) {
        let at = self.waiting.iter().position(|w| w.priority > seq.priority).unwrap_or(self.waiting.len());
        self.waiting.insert(at, seq);
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seq(id).is_some()
    }

    pub fn seq(&self, id: SeqId) -> Option<&SeqData> {
        self.running.iter().find(|s| s.id == id).or_else(|| self.waiting.iter().find(|s| s.id == id))
    }

    /// Removes a sequence wherever it is and frees its blocks; false if unknown.
    pub fn remove(&mut self, id: SeqId) -> bool {
        // Dropping the sequence gives its blocks back.
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            drop(self.running.remove(i));
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            drop(self.waiting.remove(i));
        } else {
            return false;
        }
        true
    }

    /// Plans one step. Running sequences are continued first, then waiting ones admitted.
    pub fn schedule(&mut self) -> Schedule {
        let mut plan = Schedule::default();
        let mut budget = self.config.max_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let (computed, len) = (self.running[i].computed, self.running[i].tokens.len());
            let want = (len - computed).min(budget);
            if !self.grow_running(i, computed + want, &mut plan) {
                break; // `i` itself was preempted or aborted: it was the newest
            }
            let seq = &self.running[i];
            plan.seqs.push(Scheduled {
                id: seq.id,
                start: computed,
                end: computed + want,
                sample: computed + want == len,
            });
            budget -= want;
            i += 1;
        }
        if plan.preempted.is_empty() {
            self.admit(&mut plan, budget);
        }
        plan
    }

    /// Makes room for running sequence `i` to hold `positions` positions, preempting newer
    /// sequences as needed. False when `i` had to go itself.
    fn grow_running(&mut self, i: usize, positions: usize, plan: &mut Schedule) -> bool {
        loop {
            let seq = &mut self.running[i];
            if self.pool.grow(&mut seq.blocks, positions).is_ok() {
                return true;
            }
            let newest = self.running.len() - 1;
            if newest == i && plan.seqs.is_empty() && i == 0 {
                // Alone and still too big: the cache can never hold it.
                let seq = self.running.remove(i); // dropped below: its blocks go back
                let capacity = self.pool.num_blocks() * self.pool.block_size();
                plan.aborted.push((
                    seq.id,
                    Error::Overloaded(format!(
                        "sequence needs {positions} positions; the KV cache holds {capacity}"
                    )),
                ));
                return false;
            }
            let victim = self.running.remove(newest);
            plan.preempted.push(victim.id);
            self.preempt(victim);
            if newest == i {
                return false;
            }
        }
    }

    /// Sends a running sequence back to the head of its priority's waiting line.
    fn preempt(&mut self, mut seq: SeqData) {
        self.stats.preemptions += 1;
        seq.blocks.clear();
        seq.computed = 0;
        seq.hashes.clear();
        let at = self.waiting.iter().position(|w| w.priority >= seq.priority).unwrap_or(self.waiting.len());
        self.waiting.insert(at, seq);
    }

    fn admit(&mut self, plan: &mut Schedule, mut budget: usize) {
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(seq) = self.waiting.front_mut() else { break };
            if seq.blocks.is_empty() && self.pool.prefix_caching() {
                // Reuse cached full blocks, but always leave the last token to compute:
                // its logits choose the next token.
                let bs = self.pool.block_size();
                let usable = (seq.tokens.len() - 1) / bs;
                let hashes = self.pool.block_hashes(&seq.tokens[..usable * bs]);
                seq.blocks = self.pool.acquire_prefix(&hashes);
                seq.computed = seq.blocks.len() * bs;
                seq.hashes = hashes[..seq.blocks.len()].to_vec();
            }
            let want = (seq.tokens.len() - seq.computed).min(budget);
            if self.pool.grow(&mut seq.blocks, seq.computed + want).is_err() {
                // FIFO: nobody overtakes the head. Its cached prefix stays findable.
                seq.blocks.clear();
                seq.computed = 0;
                seq.hashes.clear();
                break;
            }
            plan.seqs.push(Scheduled {
                id: seq.id,
                start: seq.computed,
                end: seq.computed + want,
                sample: seq.computed + want == seq.tokens.len(),
            });
            budget -= want;
            if self.pool.prefix_caching() {
                self.stats.prefix_query_tokens += seq.tokens.len() as u64;
                self.stats.prefix_hit_tokens += seq.computed as u64;
            }
            plan.admitted.push(seq.id);
            let seq = self.waiting.pop_front().expect("front exists");
            // Running stays ordered online before batch, oldest first within each: the last
            // is the one preempted first.
            let at =
                self.running.iter().position(|r| r.priority > seq.priority).unwrap_or(self.running.len());
            self.running.insert(at, seq);
        }
    }

    /// Records a step's outcome: chunks computed, and the token sampled for each
    /// sequence whose chunk reached its end.
    pub fn complete(&mut self, plan: &Schedule, sampled: &[(SeqId, u32)]) {
        let bs = self.pool.block_size();
        for item in &plan.seqs {
            let Some(seq) = self.running.iter_mut().find(|s| s.id == item.id) else { continue };
            seq.computed = item.end;
            while seq.hashes.len() < seq.computed / bs {
                let b = seq.hashes.len();
                let parent = seq.hashes.last().copied().unwrap_or(0);
                let h = chain_hash(parent, &seq.tokens[b * bs..(b + 1) * bs]);
                seq.hashes.push(h);
                self.pool.register(seq.blocks[b], h);
            }
            // The next position attends back to `computed + 1 - window`: whole blocks
            // before that are never read again.
            if let Some(w) = self.window {
                let keep_from = (seq.computed + 1).saturating_sub(w) / bs;
                self.stats.window_released_blocks += seq.blocks.release_front(keep_from) as u64;
            }
        }
        for &(id, token) in sampled {
            if let Some(seq) = self.running.iter_mut().find(|s| s.id == id) {
                seq.tokens.push(token);
            }
        }
    }
}

#[cfg(test)]
mod tests;
