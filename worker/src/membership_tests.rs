//! Registration against the in-memory registry (etcd's semantics without etcd): the record
//! follows the assignment, a lapsed lease is replaced with the shard still held, an
//! unreachable registry is retried while the worker serves on, and leaving is immediate.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_common::cluster::{decode, ShardState, WorkerRecord};
use strata_common::model_roots::ModelRoots;
use strata_common::registry::keys::Keys;
use strata_common::registry::memory::MemoryRegistry;
use strata_common::registry::{Entry, EventStream, Guard, LeaseId, Listing, Op, Registry};
use strata_common::{Error, Parallelism, Result};

use super::{Announcement, Membership};
use crate::agent::tests::{agent, shard, wait_state};
use crate::agent::WorkerAgent;

const TTL: Duration = Duration::from_secs(2);

fn announcement(agent: &WorkerAgent) -> Announcement {
    Announcement {
        address: "127.0.0.1:7001".into(),
        capacity: agent.config().capacity(Some("node-a")).unwrap(),
        ttl: TTL,
        keepalive: Duration::from_millis(100),
    }
}

/// Polls `check` every 10 ms until it answers, failing after `limit`.
async fn until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "gave up after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The worker's record and the lease it lives by, when there is one.
async fn record(registry: &dyn Registry, key: &str) -> Option<(WorkerRecord, Option<LeaseId>)> {
    let entry = registry.get(key).await.unwrap()?;
    Some((decode(key, &entry.value).unwrap(), entry.lease))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_record_follows_the_assignment_and_leaving_removes_it_at_once() {
    let registry = Arc::new(MemoryRegistry::new());
    let keys = Keys::new("/t");
    let key = keys.worker("w1");
    let a = agent("w1", ModelRoots::default());
    let m = Membership::start(registry.clone(), keys, a.clone(), announcement(&a));
    let mut registered = m.registered();
    registered.wait_for(|r| *r).await.unwrap();
    let (rec, lease) = record(&*registry, &key).await.expect("the record");
    assert_eq!(
        (rec.id.as_str(), rec.address.as_str(), rec.capacity.node.as_str()),
        ("w1", "127.0.0.1:7001", "node-a")
    );
    assert_eq!(rec.assignment, None);
    assert_eq!(lease, m.lease(), "the record lives by the membership's lease");

    a.load(shard("r1", Parallelism::NONE, 0, None)).unwrap();
    let held = until("the record to show the loaded shard", Duration::from_secs(60), || async {
        let (rec, _) = record(&*registry, &key).await?;
        rec.assignment.filter(|a| a.state == ShardState::Ready)
    })
    .await;
    assert_eq!((held.replica.as_str(), held.rank), ("r1", 0));
    assert_eq!(record(&*registry, &key).await.unwrap().0.started_ms, rec.started_ms, "same process");

    m.leave().await;
    assert!(record(&*registry, &key).await.is_none(), "leaving revokes the lease and the record with it");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lapsed_lease_is_replaced_with_the_shard_still_held() {
    let registry = Arc::new(MemoryRegistry::new());
    let keys = Keys::new("/t");
    let key = keys.worker("w1");
    let a = agent("w1", ModelRoots::default());
    a.load(shard("r1", Parallelism::NONE, 0, None)).unwrap();
    wait_state(&a, ShardState::Ready);
    let m = Membership::start(registry.clone(), keys, a.clone(), announcement(&a));
    m.registered().wait_for(|r| *r).await.unwrap();
    let first = m.lease().expect("a lease");

    registry.expire_lease(first); // as if the process had been paused past its TTL
    let (rec, lease) = until("a registration under a new lease", Duration::from_secs(10), || async {
        record(&*registry, &key).await.filter(|(_, l)| l.is_some_and(|l| l != first))
    })
    .await;
    assert_eq!(lease, m.lease());
    let held = rec.assignment.expect("the shard is still announced");
    assert_eq!((held.replica.as_str(), held.state), ("r1", ShardState::Ready));
    assert_eq!(a.status().loads, 1, "nothing was reloaded");
    m.leave().await;
}

/// A registry that can be cut off: while down, every call is `Unavailable`.
struct Outage {
    inner: MemoryRegistry,
    down: AtomicBool,
    refused: AtomicUsize,
}

impl Outage {
    fn check(&self) -> Result<()> {
        if self.down.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(Error::Unavailable("the registry is cut off".into()));
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Registry for Outage {
    fn kind(&self) -> &'static str {
        "memory"
    }
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        self.check()?;
        self.inner.grant_lease(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        self.check()?;
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        self.check()?;
        self.inner.revoke_lease(lease).await
    }
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<()> {
        self.check()?;
        self.inner.put(key, value, lease).await
    }
    async fn get(&self, key: &str) -> Result<Option<Entry>> {
        self.check()?;
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Listing> {
        self.check()?;
        self.inner.list(prefix).await
    }
    async fn delete(&self, key: &str) -> Result<()> {
        self.check()?;
        self.inner.delete(key).await
    }
    async fn create(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<bool> {
        self.check()?;
        self.inner.create(key, value, lease).await
    }
    async fn commit_if(&self, guard: &Guard, ops: Vec<Op>) -> Result<bool> {
        self.check()?;
        self.inner.commit_if(guard, ops).await
    }
    async fn watch(&self, prefix: &str, from: i64) -> Result<EventStream> {
        self.check()?;
        self.inner.watch(prefix, from).await
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_registry_is_retried_and_a_long_outage_ends_in_a_new_lease() {
    let registry = Arc::new(Outage { inner: MemoryRegistry::new(), down: true.into(), refused: 0.into() });
    let keys = Keys::new("/t");
    let key = keys.worker("w1");
    let a = agent("w1", ModelRoots::default());
    a.load(shard("r1", Parallelism::NONE, 0, None)).unwrap();
    let m = Membership::start(registry.clone(), keys, a.clone(), announcement(&a));

    // Down from the start: the worker keeps trying and is not registered.
    until("three refused registrations", Duration::from_secs(10), || async {
        (registry.refused.load(Ordering::SeqCst) >= 3).then_some(())
    })
    .await;
    assert!(!*m.registered().borrow());
    registry.down.store(false, Ordering::SeqCst);
    m.registered().wait_for(|r| *r).await.unwrap();
    let first = m.lease().expect("a lease");

    // Down for longer than the lease: the worker serves on, and when the registry is back
    // it registers again under a new lease, still holding its shard.
    wait_state(&a, ShardState::Ready);
    registry.down.store(true, Ordering::SeqCst);
    registry.inner.expire_lease(first); // what TTL seconds without a refresh do
    assert!(a.serving("r1").is_ok(), "the shard serves through the outage");
    let refused = registry.refused.load(Ordering::SeqCst);
    until("a refused refresh", Duration::from_secs(10), || async {
        (registry.refused.load(Ordering::SeqCst) > refused).then_some(())
    })
    .await;
    registry.down.store(false, Ordering::SeqCst);
    let (rec, _) = until("a registration under a new lease", Duration::from_secs(10), || async {
        let entry = registry.inner.get(&key).await.unwrap()?;
        let rec: WorkerRecord = decode(&key, &entry.value).unwrap();
        (entry.lease.is_some_and(|l| l != first)).then_some((rec, entry.lease))
    })
    .await;
    assert_eq!(rec.assignment.map(|a| a.replica.to_string()), Some("r1".to_string()));
    m.leave().await;
}
