//! An in-process cluster for control-plane tests: the in-memory registry, scripted workers
//! ([`worker::ScriptedWorker`]) registered with leases as real workers register, and
//! coordinators built from the same parts `strata coordinator` runs (the registry view,
//! the election and reconciler, the catalog and router, the front end) — no processes,
//! no ports. A worker can be killed (its lease lapses and it stops answering) or told to
//! misbehave ([`worker::Fault`]).
//!
//! Timings are short (a 3 s lease, a 50 ms reconcile tick) so that what a real cluster
//! does in seconds happens here in a fraction of one; tests wait for outcomes with
//! [`until`], never for fixed times.

pub mod worker;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use strata_common::cluster::{encode, Build, Capacity, DeviceKind, EngineLimits, ModelSpec, WorkerRecord};
use strata_common::registry::keys::Keys;
use strata_common::registry::memory::MemoryRegistry;
use strata_common::registry::{LeaseId, Registry};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::control::leader::{Election, LeaderConfig};
use crate::control::tasks::Timings;
use crate::control::view::{ClusterView, Watcher};
use crate::frontend::{FrontEnd, FrontEndOptions};
use crate::routing::catalog::ClusterCatalog;
use crate::routing::clients::WorkerClients;
use crate::routing::policy::PolicyKind;
use worker::ScriptedWorker;

/// A worker's and a coordinator's lease: long enough that a loaded 2-core host running
/// the whole suite never lets one lapse by accident (tests kill leases on purpose).
pub const LEASE: Duration = Duration::from_secs(3);

/// The fixture model every test deploys (read from the repository's fixtures).
pub fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/llama_gqa")
}

/// Polls `check` every 20 ms until it answers, failing the test after `limit` (Tokio's
/// clock: virtual under paused time).
pub async fn until<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "gave up after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A registered worker: the scripted worker and the lease its record lives by.
struct Member {
    worker: Arc<ScriptedWorker>,
    lease: LeaseId,
    keeper: JoinHandle<()>,
}

pub struct TestCluster {
    pub registry: Arc<MemoryRegistry>,
    pub keys: Keys,
    /// How every coordinator reaches the workers.
    pub clients: Arc<WorkerClients>,
    members: Vec<Member>,
}

impl Default for TestCluster {
    fn default() -> Self {
        TestCluster {
            registry: Arc::new(MemoryRegistry::new()),
            keys: Keys::new("/test"),
            clients: Arc::new(WorkerClients::new()),
            members: Vec::new(),
        }
    }
}

impl TestCluster {
    fn registry(&self) -> Arc<dyn Registry> {
        self.registry.clone()
    }

    /// Registers a CPU worker with 1 GiB free, as `strata worker` does: its record bound
    /// to a lease it keeps alive, rewritten whenever the shard it holds changes.
    pub async fn add_worker(&mut self, id: &str) -> Arc<ScriptedWorker> {
        let worker = Arc::new(ScriptedWorker::new(id));
        self.clients.register(&worker.address, worker.clone());
        let record = WorkerRecord {
            id: id.into(),
            address: worker.address.clone(),
            capacity: Capacity {
                device_kind: DeviceKind::Cpu,
                device_count: 1,
                memory_bytes: 1 << 30,
                ..Default::default()
            },
            assignment: None,
            started_ms: 1,
            leaving: false,
        };
        let key = self.keys.worker(id);
        let lease = self.registry.grant_lease(LEASE).await.unwrap();
        self.registry.put(&key, encode(&record), Some(lease)).await.unwrap();
        let (registry, held) = (self.registry(), worker.clone());
        let mut changed = worker.subscribe();
        let keeper = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(LEASE / 5) => {
                        if registry.keep_alive(lease).await.is_err() {
                            return;
                        }
                    }
                    r = changed.changed() => {
                        let record = WorkerRecord { assignment: held.assignment(), ..record.clone() };
                        if r.is_err() || registry.put(&key, encode(&record), Some(lease)).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
        self.members.push(Member { worker: worker.clone(), lease, keeper });
        worker
    }

    /// Kills a worker: it stops answering and its lease lapses (its record goes).
    pub fn kill(&self, id: &str) {
        let m = self.members.iter().find(|m| m.worker.id.as_str() == id).expect("a registered worker");
        m.worker.set_fault(worker::Fault::Partitioned);
        m.keeper.abort();
        self.registry.expire_lease(m.lease);
    }

    pub fn worker(&self, id: &str) -> Arc<ScriptedWorker> {
        self.members.iter().find(|m| m.worker.id.as_str() == id).expect("a registered worker").worker.clone()
    }

    /// Starts a coordinator named `id`.
    pub fn coordinator(&self, id: &str) -> Node {
        let watcher = Watcher::start(self.registry(), self.keys.clone());
        let election = Election::start(
            self.registry(),
            self.keys.clone(),
            watcher.subscribe(),
            self.clients.clone(),
            leader_config(id),
        );
        let catalog = ClusterCatalog::start(watcher.subscribe(), self.clients.clone(), PolicyKind::default())
            .expect("a catalog");
        let front = FrontEnd::new(catalog.clone(), FrontEndOptions::default());
        Node { id: id.to_string(), watcher, election: Some(election), front }
    }

    /// Writes a deployment of the fixture: `replicas` replicas of `tp` ranks.
    pub async fn deploy(&self, name: &str, tp: u32, replicas: u32) {
        let spec = ModelSpec {
            name: name.into(),
            build: Build {
                model_dir: model_dir().to_string_lossy().into_owned(),
                dtype: None,
                device: Some(DeviceKind::Cpu),
                tp,
                pp: 1,
                ep: 1,
                limits: EngineLimits::default(),
                chat: Default::default(),
                quantize: String::new(),
            },
            weight_bytes_per_rank: 0,
            replicas,
            generation: 1,
            created_ms: 1,
            rollout: Default::default(),
        };
        spec.validate().unwrap();
        self.registry.put(&self.keys.model(name), encode(&spec), None).await.unwrap();
    }
}

fn leader_config(id: &str) -> LeaderConfig {
    LeaderConfig {
        id: id.to_string(),
        lease_ttl: LEASE,
        keepalive: LEASE / 5,
        timings: Timings {
            canary_interval: Duration::from_millis(100),
            canary_timeout: Duration::from_secs(1),
            load_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(2),
            failed_retention: Duration::from_secs(1),
        },
        tick: Duration::from_millis(50),
    }
}

/// A coordinator of a [`TestCluster`].
pub struct Node {
    pub id: String,
    watcher: Watcher,
    election: Option<Election>,
    pub front: Arc<FrontEnd>,
}

impl Node {
    /// The registry as this coordinator sees it now.
    pub fn view(&self) -> Arc<ClusterView> {
        self.watcher.current()
    }

    pub fn leading(&self) -> bool {
        self.election.as_ref().is_some_and(|e| *e.leading.borrow())
    }

    /// Shuts down cleanly: gives leadership up at once.
    pub async fn resign(&mut self) {
        if let Some(e) = self.election.take() {
            e.resign().await;
        }
    }

    /// Dies: stops campaigning and refreshing its lease without a word; the lease lapses
    /// after its TTL.
    pub fn crash(&mut self) {
        if let Some(e) = self.election.take() {
            e.crash();
        }
    }
}

#[cfg(test)]
mod tests;
