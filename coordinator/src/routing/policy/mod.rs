//! Routing policies: which of a model's ready replicas a request goes to.
//!
//! The router ([`super::cluster::ClusterRoutes`]) narrows a request's choice to the ready
//! replicas of its revision that it has not failed on, with each one's outstanding work;
//! a [`Policy`] picks one of them. One file per policy, built by name ([`PolicyKind`],
//! `--routing-policy`); every policy passes the same contract tests (below), so the next
//! one (KV-aware, from the replicas' block events) is one more file.
//!
//! - [`PrefixAffinity`] (the default): where the prompt's prefix went before, unless that
//!   replica is much busier than the least loaded;
//! - [`LeastOutstanding`]: the least loaded replica.
//!
//! Ties go by a rendezvous hash of the prompt's first block, so that coordinators that
//! see the same loads send identical prompts to the same replica.

use std::hash::{Hash, Hasher};

use strata_common::prefix::chain_hash;
use strata_common::{Error, Result};

mod least_outstanding;
mod prefix_affinity;

pub use least_outstanding::LeastOutstanding;
pub use prefix_affinity::{PrefixAffinity, PrefixIndex};

/// A ready replica and its outstanding requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<'a> {
    pub id: &'a str,
    pub outstanding: usize,
}

/// How a router chooses among a model's usable replicas.
pub trait Policy: Send + Sync {
    /// The index in `candidates` (never empty) of the replica `prompt` goes to;
    /// `block_size` is the replicas' KV block size (what prefixes are hashed by).
    fn pick(&self, prompt: &[u32], block_size: usize, candidates: &[Candidate<'_>]) -> usize;
    /// `replica` left the model: forget what is kept about it.
    fn forget(&self, _replica: &str) {}
}

/// The policies, by the names `--routing-policy` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PolicyKind {
    #[default]
    PrefixAffinity,
    LeastOutstanding,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 2] = [PolicyKind::PrefixAffinity, PolicyKind::LeastOutstanding];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::PrefixAffinity => "prefix-affinity",
            PolicyKind::LeastOutstanding => "least-outstanding",
        }
    }

    /// The policy called `name`; an error naming the known ones otherwise.
    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|k| k.name()).collect();
            Error::invalid("routing_policy", format!("unknown policy {name:?}; one of {}", known.join(", ")))
        })
    }

    /// A fresh policy of this kind (one per model: what it remembers is the model's).
    pub fn build(self) -> Box<dyn Policy> {
        match self {
            PolicyKind::PrefixAffinity => Box::new(PrefixAffinity::new(PREFIX_BLOCKS_KEPT)),
            PolicyKind::LeastOutstanding => Box::new(LeastOutstanding),
        }
    }
}

/// Prompt blocks a prefix-affinity policy remembers per model.
const PREFIX_BLOCKS_KEPT: usize = 1 << 16;

fn hash64(v: impl Hash) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

/// What identical prompts agree on: the hash of their first block (or of the whole prompt
/// when shorter).
pub fn prompt_key(prompt: &[u32], block_size: usize) -> u64 {
    chain_hash(0, &prompt[..prompt.len().min(block_size.max(1))])
}

/// The least loaded candidate, ties broken by a rendezvous hash of `key`.
pub fn least_loaded(candidates: &[Candidate<'_>], key: u64) -> usize {
    let min = candidates.iter().map(|c| c.outstanding).min().unwrap_or(0);
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.outstanding == min)
        .max_by_key(|(_, c)| hash64((key, c.id)))
        .map(|(i, _)| i)
        .unwrap_or(0)
}

/// The contract every policy keeps.
#[cfg(test)]
mod contract {
    use super::*;

    const BLOCK: usize = 16;

    fn cands<'a>(ids: &'a [String], loads: &[usize]) -> Vec<Candidate<'a>> {
        ids.iter().zip(loads).map(|(id, &outstanding)| Candidate { id, outstanding }).collect()
    }

    fn prompts() -> Vec<Vec<u32>> {
        (0..200u32).map(|i| (0..(i % 50 + 1)).map(|t| (t * 7 + i * 13) % 1000).collect()).collect()
    }

    /// Always a candidate's index; a lone candidate is picked.
    #[test]
    fn every_policy_picks_a_candidate() {
        for kind in PolicyKind::ALL {
            let p = kind.build();
            let ids: Vec<String> = (0..5).map(|i| format!("r{i}")).collect();
            for (n, prompt) in prompts().iter().enumerate() {
                let loads: Vec<usize> = (0..5).map(|i| (n * 31 + i * 17) % 9).collect();
                let size = n % 5 + 1;
                let i = p.pick(prompt, BLOCK, &cands(&ids[..size], &loads[..size]));
                assert!(i < size, "{}: index {i} of {size}", kind.name());
            }
            assert_eq!(p.pick(&[1, 2, 3], BLOCK, &cands(&ids[..1], &[40])), 0, "{}", kind.name());
        }
    }

    /// No replica starves while another is swamped: when one candidate is idle and the
    /// others far busier, the idle one is picked, whatever went before.
    #[test]
    fn every_policy_sends_work_to_an_idle_replica_when_the_others_are_swamped() {
        for kind in PolicyKind::ALL {
            let p = kind.build();
            let ids: Vec<String> = (0..3).map(|i| format!("r{i}")).collect();
            for prompt in prompts() {
                p.pick(&prompt, BLOCK, &cands(&ids, &[0, 0, 0])); // history, wherever it went
            }
            for prompt in prompts() {
                let i = p.pick(&prompt, BLOCK, &cands(&ids, &[50, 0, 50]));
                assert_eq!(i, 1, "{}: picked a replica with 50 outstanding over an idle one", kind.name());
            }
        }
    }

    /// Two coordinators (two fresh policies) that see the same loads send the same prompt
    /// to the same replica, and prompts spread over equally loaded replicas.
    #[test]
    fn every_policy_agrees_across_coordinators_and_spreads_ties() {
        for kind in PolicyKind::ALL {
            let (a, b) = (kind.build(), kind.build());
            let ids: Vec<String> = (0..3).map(|i| format!("r{i}")).collect();
            let tied = cands(&ids, &[2, 2, 2]);
            let mut used = std::collections::HashSet::new();
            for prompt in prompts() {
                let (x, y) = (a.pick(&prompt, BLOCK, &tied), b.pick(&prompt, BLOCK, &tied));
                assert_eq!(x, y, "{}: two coordinators disagree", kind.name());
                used.insert(x);
            }
            assert_eq!(used.len(), 3, "{}: ties all went to {used:?}", kind.name());
        }
    }

    /// A replica that left is never picked again (it is not a candidate), and forgetting
    /// it leaves the policy working.
    #[test]
    fn every_policy_forgets_a_replica_that_left() {
        for kind in PolicyKind::ALL {
            let p = kind.build();
            let ids: Vec<String> = (0..3).map(|i| format!("r{i}")).collect();
            for prompt in prompts() {
                p.pick(&prompt, BLOCK, &cands(&ids, &[0, 0, 0]));
            }
            p.forget("r1");
            let rest = [ids[0].clone(), ids[2].clone()];
            for prompt in prompts() {
                assert!(p.pick(&prompt, BLOCK, &cands(&rest, &[0, 0])) < 2, "{}", kind.name());
            }
        }
    }

    #[test]
    fn policies_are_built_by_their_names() {
        for kind in PolicyKind::ALL {
            assert_eq!(PolicyKind::parse(kind.name()).unwrap(), kind);
        }
        let e = PolicyKind::parse("round-robin").unwrap_err().to_string();
        assert!(e.contains("prefix-affinity") && e.contains("least-outstanding"), "{e}");
        assert_eq!(PolicyKind::default(), PolicyKind::PrefixAffinity);
    }
}
