//! Host-side bookkeeping of the paged KV cache, with prefix caching.
//!
//! The cache is a pool of fixed-size blocks (vLLM's PagedAttention idea): a sequence owns
//! a block table, the list of blocks holding its positions in order. Blocks are
//! reference-counted so sequences with a common prefix share them.
//!
//! **Prefix caching.** A full block is identified by a hash of its tokens chained with
//! the hash of the block before it, so equal hashes mean equal prefixes. When a block's
//! last user lets go of it, a hashed block is not wiped: it becomes *evictable*, still
//! findable by hash, and is reused by the next sequence whose prompt starts the same way.
//! Allocation takes never-used blocks first, then evicts the least recently used
//! evictable block. All operations are O(1) per block except LRU eviction, O(log n).
//! The backend owns the storage; this module only decides which block holds what.

use std::collections::{BTreeMap, HashMap};

use strata_common::{Error, Result};

pub use strata_common::prefix::{chain_hash, BlockHash, DEFAULT_BLOCK_SIZE};

#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    num_blocks: usize,
    prefix_caching: bool,
    /// Blocks holding nothing reusable.
    free: Vec<u32>,
    refs: Vec<u32>,
    hash_of: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, u32>,
    /// Unreferenced hashed blocks by last use (tick → block), oldest first.
    evictable: BTreeMap<u64, u32>,
    last_use: Vec<u64>,
    tick: u64,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::with_prefix_caching(num_blocks, block_size, false)
    }

    pub fn with_prefix_caching(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        assert!(block_size > 0);
        BlockPool {
            block_size,
            num_blocks,
            prefix_caching,
            // Reversed so blocks are handed out from 0 upwards.
            free: (0..num_blocks as u32).rev().collect(),
            refs: vec![0; num_blocks],
            hash_of: vec![None; num_blocks],
            cached: HashMap::new(),
            evictable: BTreeMap::new(),
            last_use: vec![0; num_blocks],
            tick: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Blocks an allocation can take now (free plus evictable).
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Unreferenced blocks that still hold a cached prefix.
    pub fn num_cached_idle(&self) -> usize {
        self.evictable.len()
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    fn take_one(&mut self) -> Option<u32> {
        let block = match self.free.pop() {
            Some(b) => b,
            None => {
                let (&tick, &b) = self.evictable.iter().next()?;
                self.evictable.remove(&tick);
                if let Some(h) = self.hash_of[b as usize].take() {
                    if self.cached.get(&h) == Some(&b) {
                        self.cached.remove(&h);
                    }
                }
                b
            }
        };
        self.refs[block as usize] = 1;
        Some(block)
    }

    /// Grows `table` so that it holds `positions` positions; all or nothing.
    pub fn grow(&mut self, table: &mut Vec<u32>, positions: usize) -> Result<()> {
        let need = self.blocks_for(positions).saturating_sub(table.len());
        if need > self.num_free() {
            return Err(Error::Overloaded(format!(
                "KV cache full: need {need} more blocks, {} free of {}",
                self.num_free(),
                self.num_blocks
            )));
        }
        for _ in 0..need {
            let b = self.take_one().expect("checked above");
            table.push(b);
        }
        Ok(())
    }

    /// Lets go of every block of `table`; hashed blocks stay findable until evicted.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            let r = &mut self.refs[b as usize];
            debug_assert!(*r > 0, "block {b} released twice");
            *r -= 1;
            if *r == 0 {
                if self.hash_of[b as usize].is_some() {
                    self.tick += 1;
                    self.last_use[b as usize] = self.tick;
                    self.evictable.insert(self.tick, b);
                } else {
                    self.free.push(b);
                }
            }
        }
    }

    /// Hashes of the full blocks of `tokens`, chained.
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        strata_common::prefix::block_hashes(tokens, self.block_size)
    }

    /// Takes a reference to the cached blocks holding the longest cached prefix of
    /// `hashes`; returns them in order (empty when prefix caching is off).
    pub fn acquire_prefix(&mut self, hashes: &[BlockHash]) -> Vec<u32> {
        let mut blocks = Vec::new();
        if !self.prefix_caching {
            return blocks;
        }
        for h in hashes {
            let Some(&b) = self.cached.get(h) else { break };
            if self.refs[b as usize] == 0 {
                self.evictable.remove(&self.last_use[b as usize]);
            }
            self.refs[b as usize] += 1;
            blocks.push(b);
        }
        blocks
    }

    /// Records that `block` now holds the full block with hash `hash`.
    pub fn register(&mut self, block: u32, hash: BlockHash) {
        if !self.prefix_caching || self.hash_of[block as usize].is_some() {
            return;
        }
        self.hash_of[block as usize] = Some(hash);
        self.cached.entry(hash).or_insert(block);
    }

    /// The flat slot of position `pos` of a sequence with this block table.
    pub fn slot(&self, table: &[u32], pos: usize) -> u32 {
        table[pos / self.block_size] * self.block_size as u32 + (pos % self.block_size) as u32
    }
}

/// The hash of a block holding `tokens` after a prefix whose last block hashed to `parent`
/// (0 for the first block).
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_and_release_return_every_block() {
        let mut pool = BlockPool::new(4, 16);
        let mut a = Vec::new();
        pool.grow(&mut a, 17).unwrap();
        assert_eq!(a.len(), 2);
        pool.grow(&mut a, 32).unwrap();
        assert_eq!(a.len(), 2, "32 positions still fit in two blocks");
        let mut b = Vec::new();
        pool.grow(&mut b, 33).unwrap_err();
        assert!(b.is_empty(), "a failed grow takes nothing");
        pool.grow(&mut b, 20).unwrap();
        assert_eq!(pool.num_free(), 0);
        pool.release(&mut a);
        pool.release(&mut b);
        assert_eq!(pool.num_free(), 4);
        assert!(a.is_empty() && b.is_empty());
    }

    #[test]
    fn slots_follow_the_block_table() {
        let pool = BlockPool::new(8, 4);
        let table = [5, 2];
        assert_eq!(pool.slot(&table, 0), 20);
        assert_eq!(pool.slot(&table, 3), 23);
        assert_eq!(pool.slot(&table, 4), 8);
    }

    #[test]
    fn hashes_chain_over_the_prefix() {
        let pool = BlockPool::new(1, 2);
        let a = pool.block_hashes(&[1, 2, 3, 4, 5]);
        let b = pool.block_hashes(&[9, 2, 3, 4]);
        assert_eq!(a.len(), 2, "only full blocks are hashed");
        assert_ne!(a[1], b[1], "same tokens after a different prefix hash differently");
        assert_eq!(a, pool.block_hashes(&[1, 2, 3, 4, 6, 7])[..2]);
    }

    #[test]
    fn released_prefixes_are_reused_then_evicted_lru() {
        let mut pool = BlockPool::with_prefix_caching(3, 2, true);
        let hashes = pool.block_hashes(&[1, 2, 3, 4]);
        let mut a = Vec::new();
        pool.grow(&mut a, 4).unwrap();
        pool.register(a[0], hashes[0]);
        pool.register(a[1], hashes[1]);
        let blocks = a.clone();
        pool.release(&mut a);
        assert_eq!((pool.num_free(), pool.num_cached_idle()), (3, 2));

        // A sequence with the same first block shares it.
        let got = pool.acquire_prefix(&pool.block_hashes(&[1, 2, 9, 9]));
        assert_eq!(got, vec![blocks[0]]);
        assert_eq!(pool.num_cached_idle(), 1);
        let mut shared = got;
        pool.release(&mut shared);

        // Allocating everything evicts the cached blocks, least recently used first.
        let mut c = Vec::new();
        pool.grow(&mut c, 6).unwrap();
        assert_eq!(pool.num_free(), 0);
        assert!(pool.acquire_prefix(&hashes).is_empty(), "evicted blocks are not found");
        pool.release(&mut c);
        assert_eq!(pool.num_free(), 3);
    }

    #[test]
    fn disabled_prefix_caching_never_shares() {
        let mut pool = BlockPool::new(2, 2);
        let h = pool.block_hashes(&[1, 2]);
        let mut a = Vec::new();
        pool.grow(&mut a, 2).unwrap();
        pool.register(a[0], h[0]);
        pool.release(&mut a);
        assert!(pool.acquire_prefix(&h).is_empty());
        assert_eq!(pool.num_free(), 2);
    }
}
