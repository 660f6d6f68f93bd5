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
use std::sync::{Arc, Mutex, MutexGuard};

use strata_common::{Error, Result};

pub use strata_common::prefix::{chain_hash, BlockHash, DEFAULT_BLOCK_SIZE};

/// The pool's bookkeeping, shared by the pool and every block table holding its blocks.
#[derive(Debug)]
struct PoolState {
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

type Shared = Arc<Mutex<PoolState>>;

fn lock(state: &Shared) -> MutexGuard<'_, PoolState> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// The KV blocks of one replica. Blocks are handed out in [`BlockTable`]s, which give
/// them back when dropped or cleared: a sequence that ends any way at all (finished,
/// cancelled, preempted, aborted, its request dropped) cannot leak cache.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    num_blocks: usize,
    prefix_caching: bool,
    state: Shared,
}

/// A sequence's KV blocks, in order. Dropping (or clearing) it lets go of every block;
/// hashed blocks stay findable by prefix until evicted.
#[derive(Debug, Default)]
pub struct BlockTable {
    blocks: Vec<u32>,
    /// The pool the blocks came from (None while empty and never grown).
    pool: Option<Shared>,
    /// Entries `..released` went back early ([`release_front`](Self::release_front)):
    /// they keep their places (block 0 stands in) and are never read or written again.
    released: usize,
}

impl BlockTable {
    /// Lets go of every block now.
    pub fn clear(&mut self) {
        if let Some(pool) = &self.pool {
            let mut held = self.blocks.split_off(self.released.min(self.blocks.len()));
            if !held.is_empty() {
                lock(pool).release(&mut held);
            }
        }
        self.blocks.clear();
        self.released = 0;
    }

    /// Gives back the blocks before entry `upto` — positions that fell out of every
    /// layer's attention window and will never be read again — keeping the later ones at
    /// their places. Returns how many went back (hashed ones stay findable by prefix).
    pub fn release_front(&mut self, upto: usize) -> usize {
        let upto = upto.min(self.blocks.len());
        let Some(pool) = self.pool.as_ref().filter(|_| upto > self.released) else { return 0 };
        let mut gone = self.blocks[self.released..upto].to_vec();
        let n = gone.len();
        lock(pool).release(&mut gone);
        // A stand-in inside the cache: tables stay valid wherever they are checked.
        self.blocks[self.released..upto].fill(0);
        self.released = upto;
        n
    }

    /// Entries given back early.
    pub fn released(&self) -> usize {
        self.released
    }

    /// Lets go of the entries from `len` on, keeping the first `len`.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.blocks.len() {
            return;
        }
        let mut gone = self.blocks.split_off(len.max(self.released));
        if let Some(pool) = &self.pool {
            lock(pool).release(&mut gone);
        }
        self.blocks.truncate(len);
        self.released = self.released.min(len);
    }
}

impl std::ops::Deref for BlockTable {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.blocks
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.clear();
    }
}

impl PoolState {
    fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
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

    /// Another reference to the cached block holding `hash`, if one does (an idle one
    /// stops being evictable).
    fn take_cached(&mut self, hash: &BlockHash) -> Option<u32> {
        let b = *self.cached.get(hash)?;
        if self.refs[b as usize] == 0 {
            let tick = self.last_use[b as usize];
            self.evictable.remove(&tick);
        }
        self.refs[b as usize] += 1;
        Some(b)
    }

    fn release(&mut self, table: &mut Vec<u32>) {
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
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::with_prefix_caching(num_blocks, block_size, false)
    }

    pub fn with_prefix_caching(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        assert!(block_size > 0);
        let state = PoolState {
            // Reversed so blocks are handed out from 0 upwards.
            free: (0..num_blocks as u32).rev().collect(),
            refs: vec![0; num_blocks],
            hash_of: vec![None; num_blocks],
            cached: HashMap::new(),
            evictable: BTreeMap::new(),
            last_use: vec![0; num_blocks],
            tick: 0,
        };
        BlockPool { block_size, num_blocks, prefix_caching, state: Arc::new(Mutex::new(state)) }
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
        lock(&self.state).num_free()
    }

    /// Unreferenced blocks that still hold a cached prefix.
    pub fn num_cached_idle(&self) -> usize {
        lock(&self.state).evictable.len()
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// Grows `table` so that it holds `positions` positions; all or nothing.
    pub fn grow(&self, table: &mut BlockTable, positions: usize) -> Result<()> {
        let need = self.blocks_for(positions).saturating_sub(table.len());
        let mut state = lock(&self.state);
        if need > state.num_free() {
            return Err(Error::Overloaded(format!(
                "KV cache full: need {need} more blocks, {} free of {}",
                state.num_free(),
                self.num_blocks
            )));
        }
        table.pool.get_or_insert_with(|| self.state.clone());
        for _ in 0..need {
            let b = state.take_one().expect("checked above");
            table.blocks.push(b);
        }
        Ok(())
    }

    /// Hashes of the full blocks of `tokens`, chained.
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        strata_common::prefix::block_hashes(tokens, self.block_size)
    }

    /// A table referencing the cached blocks that hold the longest cached prefix of
    /// `hashes`, in order (empty when prefix caching is off).
    pub fn acquire_prefix(&self, hashes: &[BlockHash]) -> BlockTable {
        let mut table = BlockTable { blocks: Vec::new(), pool: Some(self.state.clone()), released: 0 };
        if !self.prefix_caching {
            return table;
        }
        let mut state = lock(&self.state);
        table.blocks.extend(hashes.iter().map_while(|h| state.take_cached(h)));
        table
    }

    /// A table holding the cached blocks of `hashes[from..]` at their places, the entries
    /// before `from` given back already (a windowed layer never reads them): None unless
    /// every one of those blocks is cached. With `from == hashes.len()`, an empty tail.
    pub fn acquire_tail(&self, hashes: &[BlockHash], from: usize) -> Option<BlockTable> {
        let from = from.min(hashes.len());
        let mut table = BlockTable { blocks: vec![0; from], pool: Some(self.state.clone()), released: from };
        // Without prefix caching nothing is cached: only an empty tail is found.
        let mut state = lock(&self.state);
        table.blocks.extend(hashes[from..].iter().map_while(|h| state.take_cached(h)));
        drop(state);
        // Short of the end, the table drops, giving back what it took.
        (table.blocks.len() == hashes.len()).then_some(table)
    }

    /// Records that `block` now holds the full block with hash `hash`.
    pub fn register(&self, block: u32, hash: BlockHash) {
        if !self.prefix_caching {
            return;
        }
        let mut state = lock(&self.state);
        if state.hash_of[block as usize].is_some() {
            return;
        }
        state.hash_of[block as usize] = Some(hash);
        state.cached.entry(hash).or_insert(block);
    }

    /// The flat slot of position `pos` of a sequence with this block table.
    pub fn slot(&self, table: &[u32], pos: usize) -> u32 {
        table[pos / self.block_size] * self.block_size as u32 + (pos % self.block_size) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_and_release_return_every_block() {
        let pool = BlockPool::new(4, 16);
        let mut a = BlockTable::default();
        pool.grow(&mut a, 17).unwrap();
        assert_eq!(a.len(), 2);
        pool.grow(&mut a, 32).unwrap();
        assert_eq!(a.len(), 2, "32 positions still fit in two blocks");
        let mut b = BlockTable::default();
        pool.grow(&mut b, 33).unwrap_err();
        assert!(b.is_empty(), "a failed grow takes nothing");
        pool.grow(&mut b, 20).unwrap();
        assert_eq!(pool.num_free(), 0);
        a.clear();
        assert!(a.is_empty());
        drop(b); // dropping a table gives its blocks back
        assert_eq!(pool.num_free(), 4);
    }

    /// Blocks behind a sliding window go back early, the table keeping its length; the
    /// rest go back when it is dropped, none twice; a cleared table starts again.
    #[test]
    fn blocks_released_early_go_back_once() {
        let pool = BlockPool::new(6, 4);
        let mut a = BlockTable::default();
        pool.grow(&mut a, 20).unwrap();
        assert_eq!((a.len(), pool.num_free()), (5, 1));
        assert_eq!(a.release_front(3), 3);
        assert_eq!((a.len(), a.released(), pool.num_free()), (5, 3, 4));
        assert_eq!(a.release_front(2), 0, "already released");
        pool.grow(&mut a, 24).unwrap();
        assert_eq!(a.release_front(9), 3, "up to the table's end");
        drop(a);
        assert_eq!(pool.num_free(), 6);
        let mut b = BlockTable::default();
        pool.grow(&mut b, 8).unwrap();
        b.release_front(1);
        b.clear();
        assert_eq!((b.released(), pool.num_free()), (0, 6));
        pool.grow(&mut b, 4).unwrap();
        assert_eq!(b.len(), 1);
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
        let pool = BlockPool::with_prefix_caching(3, 2, true);
        let hashes = pool.block_hashes(&[1, 2, 3, 4]);
        let mut a = BlockTable::default();
        pool.grow(&mut a, 4).unwrap();
        pool.register(a[0], hashes[0]);
        pool.register(a[1], hashes[1]);
        let blocks = a.to_vec();
        drop(a);
        assert_eq!((pool.num_free(), pool.num_cached_idle()), (3, 2));

        // A sequence with the same first block shares it.
        let got = pool.acquire_prefix(&pool.block_hashes(&[1, 2, 9, 9]));
        assert_eq!(got.to_vec(), vec![blocks[0]]);
        assert_eq!(pool.num_cached_idle(), 1);
        drop(got);

        // Allocating everything evicts the cached blocks, least recently used first.
        let mut c = BlockTable::default();
        pool.grow(&mut c, 6).unwrap();
        assert_eq!(pool.num_free(), 0);
        assert!(pool.acquire_prefix(&hashes).is_empty(), "evicted blocks are not found");
        drop(c);
        assert_eq!(pool.num_free(), 3);
    }

    /// A windowed layer's tail of a cached prefix: all of it or nothing, the entries before
    /// it stand-ins already given back; truncating gives back what is cut.
    #[test]
    fn tails_of_cached_prefixes_are_acquired_whole() {
        let pool = BlockPool::with_prefix_caching(4, 2, true);
        let hashes = pool.block_hashes(&[1, 2, 3, 4, 5, 6]);
        let mut a = BlockTable::default();
        pool.grow(&mut a, 6).unwrap();
        for (b, h) in a.iter().zip(&hashes) {
            pool.register(*b, *h);
        }
        let blocks = a.to_vec();
        a.release_front(1); // the window moved past block 0: it stays cached
        drop(a);
        let tail = pool.acquire_tail(&hashes, 1).unwrap();
        assert_eq!((tail.released(), &tail[1..]), (1, &blocks[1..]));
        assert_eq!(pool.num_cached_idle(), 1, "only block 0 is idle");
        drop(tail);
        let mut other = BlockTable::default();
        pool.grow(&mut other, 4).unwrap(); // takes the free block, then evicts the oldest
        let evicted = [blocks[0], blocks[1], blocks[2]].iter().filter(|b| other.contains(b)).count();
        assert_eq!(evicted, 1);
        let before = pool.num_free();
        let whole = pool.acquire_tail(&hashes, 0);
        assert!(whole.is_none(), "an evicted block: nothing");
        assert_eq!(pool.num_free(), before, "a failed tail takes nothing");
        assert!(pool.acquire_tail(&hashes, 3).is_some_and(|t| t.len() == 3 && t.released() == 3));
        let mut t = pool.acquire_tail(&hashes, 2).unwrap();
        t.truncate(2);
        assert_eq!((t.len(), t.released(), pool.num_free()), (2, 2, before));
    }

    #[test]
    fn disabled_prefix_caching_never_shares() {
        let pool = BlockPool::new(2, 2);
        let h = pool.block_hashes(&[1, 2]);
        let mut a = BlockTable::default();
        pool.grow(&mut a, 2).unwrap();
        pool.register(a[0], h[0]);
        drop(a);
        assert!(pool.acquire_prefix(&h).is_empty());
        assert_eq!(pool.num_free(), 2);
    }
}
