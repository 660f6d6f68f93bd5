//! A worker's registration: its record under `<prefix>/workers/<id>`, bound to a lease.
//!
//! The lease is refreshed every `keepalive` (a third of its TTL by default); the record is rewritten whenever the
//! agent's assignment changes. When the registry is unreachable the worker keeps serving
//! what it holds and keeps trying. When its lease has lapsed (the registry was away longer
//! than the TTL, or the process was paused), it takes a new lease and registers again with
//! the assignment it still holds, so the leader coordinator re-adopts it — no restart, no
//! reload. Stopping revokes the lease, so the cluster learns at once that the worker left.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_common::cluster::{encode, now_ms, Capacity, WorkerRecord};
use strata_common::registry::keys::Keys;
use strata_common::registry::{LeaseId, Registry};
use strata_common::ErrorClass;
use tracing::{info, warn};

use crate::agent::WorkerAgent;

pub struct Membership {
    lease: Arc<Mutex<Option<LeaseId>>>,
    /// True once the record has been written (it stays true through registry outages:
    /// the worker serves on what it holds).
    registered: tokio::sync::watch::Receiver<bool>,
    /// The agent's change count the last record written carried.
    published: tokio::sync::watch::Receiver<u64>,
    task: tokio::task::JoinHandle<()>,
    registry: Arc<dyn Registry>,
}

/// Where and what the worker announces.
#[derive(Debug, Clone)]
pub struct Announcement {
    pub address: String,
    pub capacity: Capacity,
    pub ttl: Duration,
    /// How often the lease is refreshed (shorter than `ttl`).
    pub keepalive: Duration,
}

impl Membership {
    /// Starts registering `agent` and keeping the registration alive.
    pub fn start(
        registry: Arc<dyn Registry>,
        keys: Keys,
        agent: Arc<WorkerAgent>,
        ann: Announcement,
    ) -> Self {
        let lease = Arc::new(Mutex::new(None));
        let (registered_tx, registered) = tokio::sync::watch::channel(false);
        let (published_tx, published) = tokio::sync::watch::channel(0);
        let signals = Signals { lease: lease.clone(), registered: registered_tx, published: published_tx };
        let task = tokio::spawn(run(registry.clone(), keys, agent, ann, signals));
        Membership { lease, registered, published, task, registry }
    }

    /// Waits (up to `limit`) until the record written carries every change of the agent so
    /// far — its leaving, say. False if it did not in time (the registry is away).
    pub async fn published(&self, agent: &WorkerAgent, limit: Duration) -> bool {
        let want = *agent.subscribe().borrow();
        let mut rx = self.published.clone();
        let waited = tokio::time::timeout(limit, rx.wait_for(|&p| p >= want)).await;
        matches!(waited, Ok(Ok(_)))
    }

    /// Watches whether the worker has registered (false until its first record is written).
    pub fn registered(&self) -> tokio::sync::watch::Receiver<bool> {
        self.registered.clone()
    }

    /// The current lease (tests revoke it to simulate a lapse).
    pub fn lease(&self) -> Option<LeaseId> {
        *self.lease.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops refreshing and revokes the lease (the record disappears at once).
    pub async fn leave(self) {
        self.task.abort();
        if let Some(l) = self.lease() {
            if let Err(e) = self.registry.revoke_lease(l).await {
                warn!(error = %e, "could not revoke the worker's lease; it will lapse by itself");
            }
        }
    }
}

/// What the registration task tells the process: its lease, whether it registered, and the
/// agent's change count its last record carried.
struct Signals {
    lease: Arc<Mutex<Option<LeaseId>>>,
    registered: tokio::sync::watch::Sender<bool>,
    published: tokio::sync::watch::Sender<u64>,
}

async fn run(
    registry: Arc<dyn Registry>,
    keys: Keys,
    agent: Arc<WorkerAgent>,
    ann: Announcement,
    signals: Signals,
) {
    let Signals { lease: current, registered, published } = signals;
    let started_ms = now_ms();
    let key = keys.worker(agent.id());
    let mut changed = agent.subscribe();
    let refresh = ann.keepalive.max(Duration::from_millis(50));
    let record = |agent: &WorkerAgent| {
        encode(&WorkerRecord {
            id: agent.id().into(),
            address: ann.address.clone(),
            capacity: ann.capacity.clone(),
            assignment: agent.status().assignment,
            started_ms,
            leaving: agent.leaving(),
        })
    };
    let mut registered_before = false;
    let mut unreachable = false;
    loop {
        let lease = match registry.grant_lease(ann.ttl).await {
            Ok(l) => l,
            Err(e) => {
                if !unreachable {
                    warn!(error = %e, "registry unreachable; serving on, retrying registration");
                    unreachable = true;
                }
                tokio::time::sleep(refresh).await;
                continue;
            }
        };
        *current.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
        let mut dirty = true;
        'lease: loop {
            if dirty {
                let carried = *changed.borrow_and_update();
                match registry.put(&key, record(&agent), Some(lease)).await {
                    Ok(()) => {
                        dirty = false;
                        published.send_replace(carried);
                        if unreachable || !registered_before {
                            let held =
                                agent.status().assignment.map(|a| format!("{} rank {}", a.replica, a.rank));
                            info!(worker = agent.id(), lease = format!("{lease:x}"), holds = ?held, "registered");
                        }
                        registered_before = true;
                        registered.send_replace(true);
                        unreachable = false;
                    }
                    Err(e) if e.class() == ErrorClass::NotFound => break 'lease,
                    Err(e) => {
                        if !unreachable {
                            warn!(error = %e, "registry unreachable; serving on, retrying");
                            unreachable = true;
                        }
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(refresh) => {}
                r = changed.changed() => {
                    if r.is_err() {
                        return;
                    }
                    dirty = true;
                    continue;
                }
            }
            match registry.keep_alive(lease).await {
                Ok(()) => {
                    if unreachable {
                        dirty = true; // the registry is back: make sure the record is current
                    }
                }
                Err(e) if e.class() == ErrorClass::NotFound => {
                    warn!(worker = agent.id(), "lease lapsed; registering again with the shard still held");
                    break 'lease;
                }
                Err(e) => {
                    if !unreachable {
                        warn!(error = %e, "registry unreachable; serving on, retrying");
                        unreachable = true;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "membership_tests.rs"]
mod tests;
