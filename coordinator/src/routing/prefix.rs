//! The routing policy: prefix affinity balanced with least outstanding work.
//!
//! A replica that already holds a prompt's prefix in its KV cache skips that prefill, so
//! requests sharing a prefix should go where the prefix went before — unless that replica
//! is much busier than the others. [`PrefixIndex`] remembers, per block of prompt tokens
//! (`strata_common::prefix`: the chained hashes the engine's prefix cache keys its blocks
//! by, at the replicas' block size), which replica the
//! prefix was last sent to: an approximate radix tree, bounded and evicted least recently
//! used (SGLang's cache-aware router does the same with a real tree). [`select`] is the
//! pure decision: the longest-matching replica if its load is within the slack of the
//! least loaded, otherwise the least loaded, ties broken by a rendezvous hash of the
//! prompt so that identical prompts from different coordinators agree.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use strata_common::prefix::chain_hash;

/// A ready replica and its outstanding requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<'a> {
    pub id: &'a str,
    pub outstanding: usize,
}

fn hash64(v: impl Hash) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

/// What identical prompts agree on when no replica holds their prefix: the hash of their
/// first block (or of the whole prompt when shorter).
pub fn prompt_key(prompt: &[u32], block_size: usize) -> u64 {
    chain_hash(0, &prompt[..prompt.len().min(block_size.max(1))])
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
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.outstanding == min)
        .max_by_key(|(_, c)| hash64((key, c.id)))
        .map(|(i, _)| i)
        .unwrap_or(0)
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

    fn block_hashes(p: &[u32]) -> Vec<u64> {
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
        index.record(&block_hashes(&p1), "b");
        let c = cands(&ids, &[0, 1, 0]);
        let aff = index.best(&block_hashes(&p2), &c);
        assert_eq!(aff, Some((1, 4)), "four full blocks shared");
        assert_eq!(select(&c, aff, key(&p2)), 1, "affinity beats a slightly lower load");
        let c = cands(&ids, &[0, 9, 0]);
        let aff = index.best(&block_hashes(&p2), &c);
        assert_ne!(select(&c, aff, key(&p2)), 1, "a much busier replica loses its affinity");
        // A replica that is no longer a candidate cannot match.
        let c = cands(&["a", "c"], &[0, 0]);
        assert_eq!(index.best(&block_hashes(&p2), &c), None);
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
            index.record(&block_hashes(&p), if i % 2 == 0 { "a" } else { "b" });
        }
        assert!(index.len() <= 100);
        let last: Vec<u32> = (0..BLOCK as u32).map(|t| t + 999 * 1000).collect();
        let c = cands(&["a", "b"], &[0, 0]);
        assert_eq!(index.best(&block_hashes(&last), &c), Some((1, 1)));
        index.forget("b");
        assert_eq!(index.best(&block_hashes(&last), &c), None);
    }
}
