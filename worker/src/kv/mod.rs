//! Host-side bookkeeping of the paged KV cache.
//!
//! The cache is a pool of fixed-size blocks (vLLM's PagedAttention idea): a sequence owns
//! a block table, the list of blocks holding its positions in order, and grows it one
//! block at a time. Allocation and release are O(1) per block from a free list. The
//! backend owns the storage; this module only decides which block holds what.

use strata_common::{Error, Result};

/// Default positions per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    num_blocks: usize,
    free: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0);
        // Reversed so blocks are handed out from 0 upwards.
        BlockPool {
            block_size,
            num_blocks,
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// Grows `table` so that it holds `positions` positions; all or nothing.
    pub fn grow(&mut self, table: &mut Vec<u32>, positions: usize) -> Result<()> {
        let need = self.blocks_for(positions).saturating_sub(table.len());
        if need > self.free.len() {
            return Err(Error::Overloaded(format!(
                "KV cache full: need {need} more blocks, {} free of {}",
                self.free.len(),
                self.num_blocks
            )));
        }
        for _ in 0..need {
            table.push(self.free.pop().expect("checked above"));
        }
        Ok(())
    }

    /// Returns every block of `table` to the pool.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.free.append(table);
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
}
