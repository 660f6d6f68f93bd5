//! Which revision takes a request while a canary runs: a weighted split that is sticky
//! per prompt prefix, so a conversation keeps the revision whose KV cache holds it.
//!
//! A split must spread different requests by weight and send requests that extend one
//! another (a conversation's turns) the same way. Hashing a fixed prefix does neither
//! well: when every prompt starts with the same system prompt or chat-template header,
//! its first blocks are the same for all and the whole of the traffic would go one way.
//! So the key is where a prompt *leaves* the prefixes it shares with others:
//! [`SplitIndex`] remembers, per block boundary of the prompts it has seen (the chained
//! block hashes of `strata_common::prefix`), which tokens followed it and whether
//! different prompts went different ways there (a *branch*). A prompt's key is the hash
//! of its tokens up to its deepest branch, plus the tokens where prompts first differed
//! there, plus [`KEY_TOKENS`] more. Two turns of one conversation share all of those
//! (once its first message is that long), different conversations differ in them, and a
//! shared system prompt of any length drops out.
//!
//! The index is bounded (least recently used boundaries are forgotten) and lives per
//! coordinator and model; coordinators that saw different traffic may key a prompt
//! differently while they learn, which costs a cache miss, never a wrong answer.

use std::collections::HashMap;

use strata_common::prefix::chain_hash;
use strata_common::rollout::FULL_WEIGHT;

/// Tokens past the point where prompts differ that a key covers.
pub const KEY_TOKENS: usize = 8;

struct Boundary {
    /// The tokens that followed it (up to a block), as first seen and extended since.
    next: Vec<u32>,
    /// Where within `next` prompts first went different ways (None: they never have).
    split_at: Option<usize>,
    used: u64,
}

/// What prompts went where after each block boundary.
pub struct SplitIndex {
    boundaries: HashMap<u64, Boundary>,
    capacity: usize,
    clock: u64,
}

/// Common length of `a` and `b`.
fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SplitIndex {
    /// Remembers at most `capacity` boundaries.
    pub fn new(capacity: usize) -> Self {
        SplitIndex { boundaries: HashMap::new(), capacity: capacity.max(1), clock: 0 }
    }

    /// Records `prompt` (in blocks of `block` tokens) and returns its split key.
    pub fn key(&mut self, prompt: &[u32], block: usize) -> u64 {
        let block = block.max(1);
        self.clock += 1;
        // The prefix through the deepest branch's first differing token.
        let mut through = 0;
        let mut at = 0;
        let mut hash = 0u64;
        loop {
            let segment = &prompt[at..prompt.len().min(at + block)];
            let b = self.boundaries.entry(hash).or_insert_with(|| Boundary {
                next: segment.to_vec(),
                split_at: None,
                used: 0,
            });
            b.used = self.clock;
            let c = common(&b.next, segment);
            if c < b.next.len().min(segment.len()) {
                b.split_at = Some(b.split_at.map_or(c, |s| s.min(c)));
            } else if segment.len() > b.next.len() {
                b.next = segment.to_vec();
            }
            if let Some(s) = b.split_at {
                through = at + s + 1;
            }
            if segment.len() < block {
                break;
            }
            hash = chain_hash(hash, segment);
            at += block;
        }
        self.evict();
        let end = prompt.len().min(through.saturating_sub(1) + KEY_TOKENS);
        chain_hash(0, &prompt[..end])
    }

    fn evict(&mut self) {
        if self.boundaries.len() <= self.capacity {
            return;
        }
        let mut ages: Vec<u64> = self.boundaries.values().map(|b| b.used).collect();
        let cut = ages.len() - self.capacity * 3 / 4;
        let (_, nth, _) = ages.select_nth_unstable(cut);
        let threshold = *nth;
        self.boundaries.retain(|_, b| b.used > threshold);
    }

    pub fn len(&self) -> usize {
        self.boundaries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.boundaries.is_empty()
    }
}

/// Whether a request with split `key` goes to a canary taking `weight_bp` basis points.
pub fn to_canary(key: u64, weight_bp: u32) -> bool {
    // splitmix64's finaliser: chained hashes are uniform already, but cheap insurance.
    let mut z = key.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z % FULL_WEIGHT as u64) < weight_bp as u64
}

#[cfg(test)]
mod tests;
