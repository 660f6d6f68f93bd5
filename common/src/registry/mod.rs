//! The cluster's shared state: a small key-value store with leases and watches.
//!
//! [`Registry`] is the seam. `etcd::EtcdRegistry` (feature `etcd`) is the cluster
//! implementation (a real etcd through `etcd-client`); [`memory::MemoryRegistry`] keeps the same semantics in
//! this process — revisions, leases that lapse, watches that replay from a revision — so
//! `strata serve` and the control plane's tests run without etcd. Callers never know
//! which one they hold.
//!
//! The operations are the ones the control plane needs and no more:
//! - **leases** bind a process's keys to its liveness: a worker's registration vanishes
//!   when it stops refreshing its lease, and every watcher learns of it;
//! - **create-if-absent** is the election primitive (the leader key is created with the
//!   candidate's lease, the classic etcd recipe);
//! - **guarded commits** apply writes only while a key still holds a value, so a
//!   coordinator that lost leadership cannot overwrite its successor's decisions;
//! - **list + watch from a revision** keeps a local view exact: list once, then apply every
//!   event after the listing's revision; when a watch breaks, list again.
//!
//! Keys are plain strings; [`keys::Keys`] lays out Strata's key space under a prefix.

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod keys;
pub mod memory;

use std::time::Duration;

use futures::stream::BoxStream;

use crate::error::Result;

/// A lease's id, as etcd numbers them.
pub type LeaseId = i64;

/// One stored key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: Vec<u8>,
    /// Revision of the store when this key was last written.
    pub mod_revision: i64,
    /// The lease the key is bound to, if any.
    pub lease: Option<LeaseId>,
}

/// A change to a watched key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Put(Entry),
    Delete { key: String, mod_revision: i64 },
}

impl Event {
    pub fn key(&self) -> &str {
        match self {
            Event::Put(e) => &e.key,
            Event::Delete { key, .. } => key,
        }
    }

    pub fn revision(&self) -> i64 {
        match self {
            Event::Put(e) => e.mod_revision,
            Event::Delete { mod_revision, .. } => *mod_revision,
        }
    }
}

/// Every key under a prefix at one revision.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    pub entries: Vec<Entry>,
    /// The store's revision when the listing was taken; watch from `revision + 1`.
    pub revision: i64,
}

/// Batches of events in revision order. The stream ends or yields an error when the
/// connection to the store breaks or the start revision was compacted; the consumer then
/// lists again and watches from the new revision.
pub type EventStream = BoxStream<'static, Result<Vec<Event>>>;

/// One write of a guarded commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put { key: String, value: Vec<u8>, lease: Option<LeaseId> },
    Delete { key: String },
}

/// A condition a guarded commit needs: `key` currently holds exactly `value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    pub key: String,
    pub value: Vec<u8>,
}

/// The store behind the control plane. Errors are classified: a store that cannot be
/// reached is `Unavailable`; a lapsed lease is `NotFound`.
#[async_trait::async_trait]
pub trait Registry: Send + Sync + 'static {
    /// "etcd" or "memory", for logs.
    fn kind(&self) -> &'static str;

    /// A new lease that lapses `ttl` after its last refresh.
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId>;
    /// Refreshes a lease; `NotFound` when it has already lapsed (its keys are gone).
    async fn keep_alive(&self, lease: LeaseId) -> Result<()>;
    /// Ends a lease now, deleting its keys.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<()>;

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<()>;
    async fn get(&self, key: &str) -> Result<Option<Entry>>;
    /// Every key starting with `prefix`, in key order.
    async fn list(&self, prefix: &str) -> Result<Listing>;
    async fn delete(&self, key: &str) -> Result<()>;
    /// Writes `key` only if it does not exist; true when it was created.
    async fn create(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<bool>;
    /// Applies `ops` atomically if `guard` holds; false (and nothing written) otherwise.
    async fn commit_if(&self, guard: &Guard, ops: Vec<Op>) -> Result<bool>;
    /// Changes to keys under `prefix` from revision `from` (inclusive) on.
    async fn watch(&self, prefix: &str, from: i64) -> Result<EventStream>;
}
