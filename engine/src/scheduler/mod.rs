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
//!
//! **Windows.** Where every layer attends within a sliding window, a sequence's blocks go
//! back as they fall behind it. Where a model mixes windowed and global layers (Gemma 2/3,
//! gpt-oss), its layers form KV groups ([`strata_common::KvGroups`]): a sequence has a
//! table per group, all from the one pool, a windowed group's released behind the window
//! while a global group's keeps every block — KV memory is what the windows need, and
//! goes wherever the running sequences need it. A cached prefix is reused only as far as
//! every group still holds what its next position reads.

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
        use strata_common::config::EngineSettings as S;
        SchedulerConfig { max_num_seqs: S::MAX_NUM_SEQS, max_batched_tokens: S::MAX_BATCHED_TOKENS }
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
    /// Its tables of KV groups 1, 2, … (`blocks` is group 0's), where the model has them.
    pub group_blocks: Vec<BlockTable>,
    /// Hashes of this sequence's full blocks registered so far.
    hashes: Vec<BlockHash>,
    /// The root its block hashes chain from: its cache salt's
    /// ([`strata_common::prefix::salt_root`]; 0 unsalted).
    pub root: BlockHash,
    /// Online sequences are admitted before batch ones and preempted after them.
    pub priority: Priority,
    /// Whether its prompt may start from cached blocks (false: every position is computed,
    /// as prompt logprobs need).
    pub reads_cache: bool,
    /// Most tokens of it one step computes (bounds what a step returns for its rows).
    pub max_chunk: usize,
}

impl SeqData {
    pub fn new(id: SeqId, prompt: Vec<u32>) -> Self {
        SeqData {
            id,
            tokens: prompt,
            computed: 0,
            blocks: BlockTable::default(),
            group_blocks: Vec::new(),
            hashes: Vec::new(),
            root: 0,
            priority: Priority::Online,
            reads_cache: true,
            max_chunk: usize::MAX,
        }
    }

    pub fn with_priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Lets go of its blocks (it starts again from nothing).
    fn clear_blocks(&mut self) {
        self.blocks.clear();
        self.group_blocks.iter_mut().for_each(BlockTable::clear);
        self.computed = 0;
        self.hashes.clear();
    }
}

/// The first block the position after `computed` reads under `window` (0: every block).
fn first_needed(window: Option<usize>, computed: usize, block_size: usize) -> usize {
    window.map_or(0, |w| (computed + 1).saturating_sub(w) / block_size)
}

/// KV group `group`'s hash of a block whose chained hash is `hash`: group 0's is the
/// chain's, the others' salted, so the one pool's cache never hands a group's block to
/// another group.
fn group_hash(hash: BlockHash, group: usize) -> BlockHash {
    if group == 0 {
        return hash;
    }
    chain_hash(hash, &[u32::MAX, group as u32])
}

/// Grows `seq`'s tables (one per KV group, `groups` beyond group 0's) to hold
/// `positions` positions; all or nothing in each.
fn grow(pool: &BlockPool, groups: usize, seq: &mut SeqData, positions: usize) -> bool {
    seq.group_blocks.resize_with(groups, BlockTable::default);
    pool.grow(&mut seq.blocks, positions).is_ok()
        && seq.group_blocks.iter_mut().all(|t| pool.grow(t, positions).is_ok())
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
    /// Each KV group's window (None: a global group): blocks behind it are released.
    /// Group 0's table is a sequence's `blocks`, the others' its `group_blocks`.
    windows: Vec<Option<usize>>,
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
            windows: vec![None],
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    /// Gives each sequence a block table per KV group, each group's `windows` entry its
    /// window: blocks behind it are released, so a windowed group's KV memory is what the
    /// window needs, not the sequence's length. One entry: every layer alike.
    pub fn with_kv_groups(mut self, windows: &[Option<usize>]) -> Self {
        if !windows.is_empty() {
            self.windows = windows.to_vec();
        }
        self
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// KV groups: a block table each per sequence.
    pub fn num_kv_groups(&self) -> usize {
        self.windows.len()
    }

    /// The windows of KV groups 1, 2, … (group 0's table is handled apart).
    fn other_groups(&self) -> &[Option<usize>] {
        &self.windows[1..]
    }

    /// The longest sequence the cache can ever hold: every block less what the windowed
    /// KV groups hold at most (a window, its ends and a chunk each), over the tables that
    /// keep every position.
    pub fn max_positions(&self) -> usize {
        let bs = self.pool.block_size();
        let chunk = self.config.max_batched_tokens.div_ceil(bs);
        let others = self.other_groups();
        let windowed: usize = others.iter().flatten().map(|w| w.div_ceil(bs) + 3 + chunk).sum();
        let keeping = 1 + others.iter().filter(|w| w.is_none()).count();
        self.pool.num_blocks().saturating_sub(windowed) / keeping * bs
    }

    /// Whether the cache bounds a sequence's length: some table keeps every position. When
    /// every KV group is windowed, blocks behind the windows go back as a sequence grows,
    /// and [`max_positions`](Self::max_positions) bounds only a prompt's chunks.
    pub fn bounds_sequences(&self) -> bool {
        self.windows.iter().any(Option::is_none)
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
            let seq = &self.running[i];
            let (computed, len) = (seq.computed, seq.tokens.len());
            let want = (len - computed).min(budget).min(seq.max_chunk);
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
            if grow(&self.pool, self.windows.len() - 1, &mut self.running[i], positions) {
                return true;
            }
            let newest = self.running.len() - 1;
            if newest == i && plan.seqs.is_empty() && i == 0 {
                // Alone and still too big: the cache can never hold it.
                let seq = self.running.remove(i); // dropped below: its blocks go back
                let capacity = self.max_positions();
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
        seq.clear_blocks();
        let at = self.waiting.iter().position(|w| w.priority >= seq.priority).unwrap_or(self.waiting.len());
        self.waiting.insert(at, seq);
    }

    fn admit(&mut self, plan: &mut Schedule, mut budget: usize) {
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(seq) = self.waiting.front_mut() else { break };
            if seq.blocks.is_empty() && self.pool.prefix_caching() && seq.reads_cache {
                reuse_prefix(&self.pool, &self.windows[1..], seq);
            }
            let want = (seq.tokens.len() - seq.computed).min(budget).min(seq.max_chunk);
            if !grow(&self.pool, self.windows.len() - 1, seq, seq.computed + want) {
                // FIFO: nobody overtakes the head. Its cached prefix stays findable.
                seq.clear_blocks();
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
                let parent = seq.hashes.last().copied().unwrap_or(seq.root);
                let h = chain_hash(parent, &seq.tokens[b * bs..(b + 1) * bs]);
                seq.hashes.push(h);
                self.pool.register(seq.blocks[b], h);
                for (g, table) in seq.group_blocks.iter().enumerate().filter(|(_, t)| b >= t.released()) {
                    self.pool.register(table[b], group_hash(h, g + 1));
                }
            }
            // The next position attends back to `computed + 1 - window`: whole blocks
            // before that are never read again.
            let tables = std::iter::once(&mut seq.blocks).chain(&mut seq.group_blocks);
            for (&window, table) in self.windows.iter().zip(tables) {
                let keep_from = first_needed(window, seq.computed, bs);
                self.stats.window_released_blocks += table.release_front(keep_from) as u64;
            }
        }
        for &(id, token) in sampled {
            if let Some(seq) = self.running.iter_mut().find(|s| s.id == id) {
                seq.tokens.push(token);
            }
        }
    }
}

/// Takes the longest cached prefix of `seq`'s prompt that every KV group still holds —
/// group 0's blocks from its start, each other group's from where the next position reads
/// back to — leaving the last token to compute: its logits choose the next token.
fn reuse_prefix(pool: &BlockPool, groups: &[Option<usize>], seq: &mut SeqData) {
    let bs = pool.block_size();
    let usable = (seq.tokens.len() - 1) / bs;
    let hashes = strata_common::prefix::block_hashes_from(seq.root, &seq.tokens[..usable * bs], bs);
    seq.blocks = pool.acquire_prefix(&hashes);
    let mut n = seq.blocks.len();
    if !groups.is_empty() {
        let salted: Vec<Vec<BlockHash>> =
            (1..=groups.len()).map(|g| hashes.iter().map(|&h| group_hash(h, g)).collect()).collect();
        // With no blocks reused every tail is empty and found. A group that misses drops
        // what the others took.
        seq.group_blocks = loop {
            let tails: Option<Vec<BlockTable>> = groups
                .iter()
                .zip(&salted)
                .map(|(&w, s)| pool.acquire_tail(&s[..n], first_needed(w, n * bs, bs)))
                .collect();
            if let Some(t) = tails {
                break t;
            }
            n -= 1;
        };
        seq.blocks.truncate(n);
    }
    seq.computed = n * bs;
    seq.hashes = hashes[..n].to_vec();
}

#[cfg(test)]
mod tests;
