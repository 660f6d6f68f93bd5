//! Prompt prefixes as chained block hashes, the one definition shared by the engine's
//! prefix cache and the coordinator's prefix-affinity routing.
//!
//! Block `i`'s hash covers its tokens and block `i − 1`'s hash, so two prompts share
//! their first `k` hashes exactly when they share their first `k` full blocks. The hash is
//! SipHash with fixed keys: equal across processes of one build, which is all routing
//! across coordinators needs.

use std::hash::{Hash, Hasher};

/// Positions per KV block unless configured otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Hash of a full block: its tokens chained with the previous block's hash.
pub type BlockHash = u64;

/// The hash of the block `tokens` that follows the block hashed `parent` (0 for the first).
pub fn chain_hash(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The chain's root for a sequence of cache salt `salt` (0, the unsalted root, for None):
/// sequences of different salts share no block hash, so no cached block.
pub fn salt_root(salt: Option<u64>) -> BlockHash {
    match salt {
        None => 0,
        // A domain of its own: no run of tokens hashes to it by design.
        Some(s) => chain_hash(u64::MAX, &[s as u32, (s >> 32) as u32, u32::MAX, 0x5a17]),
    }
}

/// Chained hashes of each full `block_size` block of `tokens` (a partial tail has none).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    block_hashes_from(0, tokens, block_size)
}

/// [`block_hashes`] from the chain root `root` ([`salt_root`]).
pub fn block_hashes_from(root: BlockHash, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut parent: BlockHash = root;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|chunk| {
            parent = chain_hash(parent, chunk);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_share_hashes_exactly() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999;
        let (ha, hb) = (block_hashes(&a, 8), block_hashes(&b, 8));
        assert_eq!(ha.len(), 5);
        assert_eq!(ha[..2], hb[..2]);
        assert!(ha[2..].iter().zip(&hb[2..]).all(|(x, y)| x != y), "a change poisons every later block");
        assert_eq!(block_hashes(&a[..7], 8), Vec::<BlockHash>::new());
        assert_ne!(block_hashes(&a, 4)[..1], block_hashes(&a, 8)[..1]);
    }

    #[test]
    fn salts_share_no_hash() {
        let a: Vec<u32> = (0..32).collect();
        let (x, y) =
            (block_hashes_from(salt_root(Some(1)), &a, 8), block_hashes_from(salt_root(Some(2)), &a, 8));
        assert!(x.iter().all(|h| !y.contains(h)), "two salts share a block");
        assert_eq!(
            block_hashes_from(salt_root(None), &a, 8),
            block_hashes(&a, 8),
            "None is the unsalted chain"
        );
        assert_eq!(x, block_hashes_from(salt_root(Some(1)), &a, 8), "a salt is stable");
    }
}
