//! Which revision takes a request while a canary runs: a weighted split that is sticky
//! per conversation, so a conversation keeps the revision whose KV cache holds it.
//!
//! A split must spread different requests by weight and send requests that extend one
//! another (a conversation's turns) the same way. Hashing a fixed prefix does neither
//! well: when every prompt starts with the same system prompt or chat-template header, its
//! first tokens are the same for all and the whole of the traffic would go one way; and
//! keying by where prompts were *once* seen to differ fails as soon as later prompts share
//! more than that. So [`SplitIndex`] remembers the prompts it has seen as paths of blocks
//! (the chained block hashes of `strata_common::prefix`): after each block boundary, the
//! different ways prompts went on from it (a few per boundary), each with the key of the
//! prompt that first went that way. A prompt that ends within, or extends, a path already
//! known takes that path's key — so every turn of a conversation has its first turn's key,
//! however long it grows. A prompt that leaves every known path (a new conversation) gets
//! a key of its own: the hash of its tokens through where it left them, plus
//! [`KEY_TOKENS`] more. A shared system prompt of any length is one path every
//! conversation leaves at a different place.
//!
//! The index is bounded (it remembers at most `capacity` ways in all, forgetting the least
//! recently used; one boundary keeps at most [`WAYS`]) and lives per coordinator and model; coordinators
//! that saw different traffic may key a prompt differently while they learn, which costs a
//! cache miss, never a wrong answer.

use std::collections::HashMap;

use strata_common::prefix::chain_hash;
use strata_common::rollout::FULL_WEIGHT;

/// Tokens past the point where a new prompt leaves the known ones that its key covers.
pub const KEY_TOKENS: usize = 8;

/// Most ways on from one boundary that are remembered (least recently used go first): a
/// bound on the scan of one boundary, far above the conversations that branch at one place
/// (every user message after a shared system prompt does).
pub const WAYS: usize = 4096;

/// One way prompts went on from a boundary.
struct Way {
    /// The tokens that followed (up to a block), as first seen and extended since.
    tokens: Vec<u32>,
    /// The key of the prompt that first went this way.
    key: u64,
    used: u64,
}

struct Boundary {
    ways: Vec<Way>,
}

/// The paths prompts took, block by block.
pub struct SplitIndex {
    boundaries: HashMap<u64, Boundary>,
    /// Most ways remembered in all.
    capacity: usize,
    /// Ways remembered now.
    ways: usize,
    clock: u64,
}

/// Common length of `a` and `b`.
fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How a prompt's segment after a boundary relates to the ways known there.
enum Step {
    /// It follows way `i` for all of a full block: go on to the next boundary.
    Through(usize),
    /// It ends within way `i`, or way `i` ends within it: the same path, its key.
    Along(usize),
    /// It leaves every known way after `common` tokens (none known: 0).
    Leaves { common: usize },
}

fn step(ways: &[Way], segment: &[u32], block: usize) -> Step {
    let mut best: Option<(usize, usize)> = None;
    for (i, w) in ways.iter().enumerate() {
        let c = common(&w.tokens, segment);
        if c == block {
            return Step::Through(i);
        }
        if best.is_none_or(|(_, b)| c > b) {
            best = Some((i, c));
        }
    }
    match best {
        Some((i, c)) if c == ways[i].tokens.len() || c == segment.len() => Step::Along(i),
        Some((_, c)) => Step::Leaves { common: c },
        None => Step::Leaves { common: 0 },
    }
}

impl SplitIndex {
    /// Remembers at most `capacity` ways (about a block of tokens each).
    pub fn new(capacity: usize) -> Self {
        SplitIndex { boundaries: HashMap::new(), capacity: capacity.max(1), ways: 0, clock: 0 }
    }

    /// Records `prompt` (in blocks of `block` tokens) and returns its split key.
    pub fn key(&mut self, prompt: &[u32], block: usize) -> u64 {
        let block = block.max(1);
        self.clock += 1;
        let clock = self.clock;
        let mut at = 0;
        let mut hash = 0u64;
        // The key of the path followed so far (None until one is known).
        let mut key: Option<u64> = None;
        loop {
            let segment = &prompt[at..prompt.len().min(at + block)];
            if segment.is_empty() {
                break; // ends at a boundary: the key of the path that led here
            }
            let b = self.boundaries.entry(hash).or_insert_with(|| Boundary { ways: Vec::new() });
            let k = match (step(&b.ways, segment, block), key) {
                (Step::Through(i) | Step::Along(i), _) => {
                    let w = &mut b.ways[i];
                    if segment.len() > w.tokens.len() {
                        w.tokens = segment.to_vec(); // the path grows with its conversation
                    }
                    w.used = clock;
                    w.key
                }
                (Step::Leaves { common }, inherited) => {
                    // Past the end of what is remembered of a known path, it goes on with
                    // that path's key; leaving known ways makes a new one.
                    let k = match inherited {
                        Some(k) if b.ways.is_empty() => k,
                        _ => chain_hash(0, &prompt[..prompt.len().min(at + common + KEY_TOKENS)]),
                    };
                    if b.ways.len() >= WAYS {
                        let oldest = (0..b.ways.len()).min_by_key(|&i| b.ways[i].used).expect("full");
                        b.ways.swap_remove(oldest);
                    } else {
                        self.ways += 1;
                    }
                    b.ways.push(Way { tokens: segment.to_vec(), key: k, used: clock });
                    k
                }
            };
            key = Some(k);
            if segment.len() < block {
                break;
            }
            hash = chain_hash(hash, segment);
            at += block;
        }
        self.evict();
        key.unwrap_or_else(|| chain_hash(0, &[]))
    }

    /// Past capacity, forgets the least recently used quarter of the ways (and boundaries
    /// left with none).
    fn evict(&mut self) {
        if self.ways <= self.capacity {
            return;
        }
        let mut ages: Vec<u64> =
            self.boundaries.values().flat_map(|b| b.ways.iter().map(|w| w.used)).collect();
        let cut = ages.len() - self.capacity * 3 / 4;
        let (_, nth, _) = ages.select_nth_unstable(cut);
        let threshold = *nth;
        for b in self.boundaries.values_mut() {
            b.ways.retain(|w| w.used > threshold);
        }
        self.boundaries.retain(|_, b| !b.ways.is_empty());
        self.ways = self.boundaries.values().map(|b| b.ways.len()).sum();
    }

    /// Ways remembered.
    pub fn len(&self) -> usize {
        self.ways
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
