//! Prefix affinity balanced with least outstanding work.
//!
//! A replica that already holds a prompt's prefix in its KV cache skips that prefill, so
//! requests sharing a prefix should go where the prefix went before — unless that replica
//! is much busier than the others. [`PrefixIndex`] remembers, per block of prompt tokens
//! (`strata_common::prefix`: the chained hashes the engine's prefix cache keys its blocks
//! by, at the replicas' block size), which replica the prefix was last sent to: an
//! approximate radix tree, bounded and evicted least recently used (SGLang's cache-aware
//! router does the same with a real tree). [`select`] is the pure decision: the
//! longest-matching replica if its load is within the slack of the least loaded,
//! otherwise the least loaded.

use std::collections::HashMap;
use std::sync::Mutex;

use strata_common::prefix::block_hashes;

use super::{least_loaded, prompt_key, Candidate, Policy};

/// The policy: a [`PrefixIndex`] of the model's prompts.
pub struct PrefixAffinity {
    index: Mutex<PrefixIndex>,
}

impl PrefixAffinity {
    /// Remembers at most `blocks` prompt blocks.
    pub fn new(blocks: usize) -> Self {
        PrefixAffinity { index: Mutex::new(PrefixIndex::new(blocks)) }
    }

    fn index(&self) -> std::sync::MutexGuard<'_, PrefixIndex> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Policy for PrefixAffinity {
    fn pick(&self, prompt: &[u32], block_size: usize, candidates: &[Candidate<'_>]) -> usize {
        let hashes = block_hashes(prompt, block_size);
        let mut index = self.index();
        let i = select(candidates, index.best(&hashes, candidates), prompt_key(prompt, block_size));
        index.record(&hashes, candidates[i].id);
        i
    }

    fn forget(&self, replica: &str) {
        self.index().forget(replica);
    }
}

/// How much busier than the least loaded replica the affine one may be and still win.
pub fn slack(min_outstanding: usize) -> usize {
    2 + min_outstanding / 2
}

/// Picks a candidate. `affinity` is (candidate index, blocks matched) from the index.
/// `candidates` must not be empty.
pub fn select(candidates: &[Candidate<'_>], affinity: Option<(usize, usize)>, key: u64) -> usize {
    let min = candidates.iter().map(|c| c.outstanding).min().unwrap_or(0);
    if let Some((i, blocks)) = affinity {
        if blocks > 0 && candidates[i].outstanding <= min + slack(min) {
            return i;
        }
    }
    least_loaded(candidates, key)
}

/// Which replica each prompt prefix was last routed to.
pub struct PrefixIndex {
    entries: HashMap<u64, (String, u64)>,
    capacity: usize,
    clock: u64,
}

impl PrefixIndex {
    /// Remembers at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        PrefixIndex { entries: HashMap::new(), capacity: capacity.max(1), clock: 0 }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The candidate holding the longest prefix of `hashes`, and how many blocks match.
    pub fn best(&self, hashes: &[u64], candidates: &[Candidate<'_>]) -> Option<(usize, usize)> {
        for (n, h) in hashes.iter().enumerate().rev() {
            if let Some((replica, _)) = self.entries.get(h) {
                if let Some(i) = candidates.iter().position(|c| c.id == replica) {
                    return Some((i, n + 1));
                }
            }
        }
        None
    }

    /// Records that `hashes` went to `replica`.
    pub fn record(&mut self, hashes: &[u64], replica: &str) {
        self.clock += 1;
        for h in hashes {
            self.entries.insert(*h, (replica.to_string(), self.clock));
        }
        if self.entries.len() > self.capacity {
            // Evict the oldest quarter at once (amortised O(1) per insert).
            let mut ages: Vec<u64> = self.entries.values().map(|(_, t)| *t).collect();
            let cut = ages.len() - self.capacity * 3 / 4;
            let (_, nth, _) = ages.select_nth_unstable(cut);
            let threshold = *nth;
            self.entries.retain(|_, (_, t)| *t > threshold);
        }
    }

    /// Forgets a replica (it left).
    pub fn forget(&mut self, replica: &str) {
        self.entries.retain(|_, (r, _)| r != replica);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: usize = 16;

    fn hashes(p: &[u32]) -> Vec<u64> {
        strata_common::prefix::block_hashes(p, BLOCK)
    }

    fn key(p: &[u32]) -> u64 {
        prompt_key(p, BLOCK)
    }

    fn cands<'a>(ids: &'a [&'a str], loads: &[usize]) -> Vec<Candidate<'a>> {
        ids.iter().zip(loads).map(|(id, &outstanding)| Candidate { id, outstanding }).collect()
    }

    #[test]
    fn shared_prefixes_stick_to_their_replica_until_it_is_much_busier() {
        let ids = ["a", "b", "c"];
        let mut index = PrefixIndex::new(1000);
        let system: Vec<u32> = (0..64).collect();
        let mut p1 = system.clone();
        p1.extend([900, 901]);
        let mut p2 = system.clone();
        p2.extend([700]);
        index.record(&hashes(&p1), "b");
        let c = cands(&ids, &[0, 1, 0]);
        let aff = index.best(&hashes(&p2), &c);
        assert_eq!(aff, Some((1, 4)), "four full blocks shared");
        assert_eq!(select(&c, aff, key(&p2)), 1, "affinity beats a slightly lower load");
        let c = cands(&ids, &[0, 9, 0]);
        let aff = index.best(&hashes(&p2), &c);
        assert_ne!(select(&c, aff, key(&p2)), 1, "a much busier replica loses its affinity");
        // A replica that is no longer a candidate cannot match.
        let c = cands(&["a", "c"], &[0, 0]);
        assert_eq!(index.best(&hashes(&p2), &c), None);
    }

    #[test]
    fn without_affinity_the_least_loaded_wins_and_ties_are_stable() {
        let ids = ["a", "b", "c"];
        let prompt = [1u32, 2, 3];
        assert_eq!(select(&cands(&ids, &[3, 1, 2]), None, key(&prompt)), 1);
        let tied = cands(&ids, &[0, 0, 0]);
        let first = select(&tied, None, key(&prompt));
        for _ in 0..5 {
            assert_eq!(select(&tied, None, key(&prompt)), first, "the same prompt picks the same replica");
        }
        // Different prompts spread over the tied replicas.
        let picks: std::collections::HashSet<usize> =
            (0..64u32).map(|i| select(&tied, None, key(&[i, i + 1]))).collect();
        assert_eq!(picks.len(), 3, "{picks:?}");
    }

    #[test]
    fn the_index_stays_bounded_and_keeps_recent_prefixes() {
        let mut index = PrefixIndex::new(100);
        for i in 0..1000u32 {
            let p: Vec<u32> = (0..BLOCK as u32).map(|t| t + i * 1000).collect();
            index.record(&hashes(&p), if i % 2 == 0 { "a" } else { "b" });
        }
        assert!(index.len() <= 100);
        let last: Vec<u32> = (0..BLOCK as u32).map(|t| t + 999 * 1000).collect();
        let c = cands(&["a", "b"], &[0, 0]);
        assert_eq!(index.best(&hashes(&last), &c), Some((1, 1)));
        index.forget("b");
        assert_eq!(index.best(&hashes(&last), &c), None);
    }
}
