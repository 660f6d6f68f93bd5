//! The caller text a front end parses, renders and tokenizes at once: one byte budget
//! shared by every API (gRPC `Generate` and `Tokenize`, the HTTP routes, batch lines).
//!
//! Parsing JSON costs ~50× its bytes and tokenizing ~220× (the tokenizers crate keeps
//! offsets and alignments per byte), so eight concurrent 4 MiB gRPC `Tokenize` calls, each
//! within its own message bound, once took a server's memory. Every such job is charged its
//! text's bytes (at least [`MIN_CHARGE`]; at most the whole budget, which then runs alone)
//! and waits until they are free:
//!
//! - **a lane for small work**: texts up to [`SMALL_TEXT`] take from a budget of their own,
//!   so a 4-token completion never queues behind megabytes of someone's `/tokenize`;
//! - **a share per tenant**: larger texts take from the shared budget, and first from their
//!   tenant's share of it (half), so one tenant's big calls always leave room for
//!   another's.
//!
//! Waiters are served in order within each budget (tokio's semaphores are fair).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Texts up to this many bytes go through the small lane.
pub const SMALL_TEXT: usize = 64 << 10;

/// The least a job is charged (its JSON and bookkeeping cost something too).
pub const MIN_CHARGE: usize = 4 << 10;

/// How the budget is sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextBudgetOptions {
    /// Bytes of larger texts being worked on at once, across tenants.
    pub total_bytes: usize,
    /// Bytes of small texts being worked on at once.
    pub small_bytes: usize,
}

impl Default for TextBudgetOptions {
    fn default() -> Self {
        TextBudgetOptions { total_bytes: 16 << 20, small_bytes: 4 << 20 }
    }
}

/// The budget (see the module).
pub struct TextBudget {
    opts: TextBudgetOptions,
    small: Arc<Semaphore>,
    large: Arc<Semaphore>,
    /// Each tenant's share of `large`; a tenant's entry goes when none of it is held.
    tenants: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// Bytes held from the budget; given back on drop.
#[derive(Debug)]
pub struct TextPermit {
    _lane: OwnedSemaphorePermit,
    _share: Option<OwnedSemaphorePermit>,
}

impl Default for TextBudget {
    fn default() -> Self {
        Self::new(TextBudgetOptions::default())
    }
}

impl TextBudget {
    pub fn new(opts: TextBudgetOptions) -> Self {
        let opts = TextBudgetOptions {
            total_bytes: opts.total_bytes.clamp(MIN_CHARGE, u32::MAX as usize),
            small_bytes: opts.small_bytes.clamp(SMALL_TEXT, u32::MAX as usize),
        };
        TextBudget {
            opts,
            small: Arc::new(Semaphore::new(opts.small_bytes)),
            large: Arc::new(Semaphore::new(opts.total_bytes)),
            tenants: Mutex::default(),
        }
    }

    pub fn options(&self) -> TextBudgetOptions {
        self.opts
    }

    /// Most bytes one tenant holds of the shared budget.
    fn share(&self) -> usize {
        (self.opts.total_bytes / 2).max(MIN_CHARGE)
    }

    /// Waits until `tenant` may work on `bytes` of text; what it holds goes back when the
    /// permit drops.
    pub async fn acquire(&self, tenant: &str, bytes: usize) -> TextPermit {
        let charge = bytes.max(MIN_CHARGE);
        if charge <= SMALL_TEXT {
            let lane = acquire(&self.small, charge).await;
            return TextPermit { _lane: lane, _share: None };
        }
        let charge = charge.min(self.opts.total_bytes);
        let share = {
            let mut tenants = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
            let full = self.share();
            // Forget tenants that hold nothing, so names cannot grow the map without bound.
            tenants.retain(|_, s| Arc::strong_count(s) > 1);
            tenants.entry(tenant.to_string()).or_insert_with(|| Arc::new(Semaphore::new(full))).clone()
        };
        let share = acquire(&share, charge.min(self.share())).await;
        let lane = acquire(&self.large, charge).await;
        TextPermit { _lane: lane, _share: Some(share) }
    }
}

async fn acquire(semaphore: &Arc<Semaphore>, n: usize) -> OwnedSemaphorePermit {
    match semaphore.clone().acquire_many_owned(n as u32).await {
        Ok(p) => p,
        Err(_) => unreachable!("the budget's semaphores are never closed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MIB: usize = 1 << 20;

    fn budget() -> TextBudget {
        TextBudget::new(TextBudgetOptions { total_bytes: 8 * MIB, small_bytes: SMALL_TEXT * 2 })
    }

    async fn granted(f: impl std::future::Future<Output = TextPermit>) -> Option<TextPermit> {
        tokio::time::timeout(Duration::from_millis(100), f).await.ok()
    }

    #[tokio::test]
    async fn small_texts_never_wait_behind_large_ones() {
        let b = budget();
        let _a = b.acquire("a", 4 * MIB).await;
        let _b = b.acquire("b", 4 * MIB).await;
        assert!(granted(b.acquire("c", MIB)).await.is_none(), "the shared budget is full");
        let small = granted(b.acquire("c", 100)).await;
        assert!(small.is_some(), "a small text waited behind large ones");
        // The small lane has its own bound.
        let _s2 = granted(b.acquire("c", SMALL_TEXT)).await.expect("second small text");
        assert!(granted(b.acquire("d", SMALL_TEXT)).await.is_none(), "past the small lane's budget");
        drop(small);
        assert!(granted(b.acquire("d", SMALL_TEXT)).await.is_some());
    }

    #[tokio::test]
    async fn one_tenant_holds_at_most_half_of_the_shared_budget() {
        let b = budget();
        let _first = b.acquire("greedy", 3 * MIB).await;
        let waiting = granted(b.acquire("greedy", 2 * MIB)).await;
        assert!(waiting.is_none(), "a tenant went past its share");
        let other = granted(b.acquire("other", 4 * MIB)).await;
        assert!(other.is_some(), "another tenant found no room");
    }

    #[tokio::test]
    async fn a_text_larger_than_the_budget_runs_alone_and_bytes_come_back() {
        let b = budget();
        let whole = b.acquire("a", 100 * MIB).await;
        assert!(granted(b.acquire("b", MIB)).await.is_none());
        drop(whole);
        assert!(granted(b.acquire("b", MIB)).await.is_some(), "the bytes came back on drop");
        assert!(b.tenants.lock().unwrap().len() <= 2);
    }
}
