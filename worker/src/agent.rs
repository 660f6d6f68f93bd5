//! A worker's shard slot: what `strata worker` holds and how it got there.
//!
//! The agent knows nothing of gRPC or etcd: it implements the `WorkerApi` seam
//! ([`in_process`](crate::in_process)), [`service`](crate::service) serves that over
//! worker.v1, and [`membership`](crate::membership) publishes its
//! assignment in the worker's registration. A worker holds at most one shard — one rank
//! of one replica — because a rank uses the whole device (all cores on a CPU, one GPU).
//!
//! Loading runs on its own thread and is tagged with an epoch: a thread that finishes
//! after its shard was unloaded (or replaced) changes nothing. Rank 0 binds the
//! replica's rendezvous listener before `load` returns, so the coordinator can hand its
//! address to the other ranks at once. Rank 0 then owns the engine (scheduler + leader
//! executor); other ranks run the follower loop until rank 0 shuts them down or dies.

use std::net::{IpAddr, TcpListener};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use strata_common::cluster::{Assignment, Capacity, ShardState};
use strata_common::model_roots::ModelRoots;
use strata_common::worker_api::ShardLoad;
use strata_common::{EngineStats, Error, Parallelism, Result};
use strata_engine::backend::BackendOptions;
use strata_engine::metrics::ReplicaLabels;
use strata_engine::replica::{
    check_device, leader_with_external_ranks, local_replica, run_worker_rank, RankJoin, RankThreads,
};
use strata_engine::{EngineConfig, EngineHandle, RunnerLimits};
use tokio::sync::watch;
use tracing::{error, info, warn};

/// How this worker runs shards.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub id: String,
    /// Address replica rendezvous listeners bind.
    pub bind_ip: IpAddr,
    /// Host other ranks reach those listeners at.
    pub advertise_host: String,
    /// Device, numerics; the dtype of a deployment overrides `dtype`.
    pub backend: BackendOptions,
    /// Engine settings a deployment does not override.
    pub engine: EngineConfig,
    pub runner: RunnerLimits,
    /// Directories a shard may be loaded from (and model files read from).
    pub model_roots: ModelRoots,
    /// Whose threads its ranks run on: their own where other workers share the process.
    pub rank_threads: RankThreads,
}

impl AgentConfig {
    /// What this worker offers the cluster: its device, the device's free and total memory,
    /// the machine (`node`; default: the host name) and the KV cache a shard gets here.
    pub fn capacity(&self, node: Option<&str>) -> Result<Capacity> {
        let device = self.backend.device;
        let (free, total) = strata_engine::replica::device_memory(device)?;
        // Under a memory utilization the worker offers what the fraction leaves, and a
        // shard's KV cache takes whatever its weights leave of that (none is promised).
        let (memory_bytes, kv_cache_bytes) = match self.engine.memory_utilization {
            Some(f) => {
                let cap = (total as f64 * f) as u64;
                // 0 would read as "not known": a full device offers one byte.
                (free.min(cap.saturating_sub(total.saturating_sub(free))).max(1), 0)
            }
            None => (free, self.engine.kv_cache_bytes as u64),
        };
        Ok(Capacity {
            device_kind: device.kind(),
            device_count: 1,
            memory_bytes,
            memory_total_bytes: total,
            node: node.map_or_else(strata_common::host::hostname, str::to_owned),
            kv_cache_bytes,
        })
    }
}

enum Slot {
    Loading,
    Leader(EngineHandle),
    Follower,
    Failed(String),
}

struct Held {
    request: ShardLoad,
    /// Sequences accepted for this shard (rank 0).
    served: u64,
    /// Rank 0's rendezvous address.
    rendezvous: Option<String>,
    slot: Slot,
    /// Failed having lost its connection to this rank (see `Assignment::lost_rank`).
    lost_rank: Option<u32>,
}

#[derive(Default)]
struct Inner {
    epoch: u64,
    held: Option<Held>,
    draining: bool,
    /// Shard loads started.
    loads: u64,
}

/// What `Status` reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentStatus {
    pub assignment: Option<Assignment>,
    pub draining: bool,
    pub stats: EngineStats,
    /// Shard loads started since the process began.
    pub loads: u64,
    /// Sequences the held shard has accepted.
    pub served: u64,
}

pub struct WorkerAgent {
    cfg: AgentConfig,
    inner: Mutex<Inner>,
    /// Bumped on every change of the assignment (membership re-publishes it).
    changed: watch::Sender<u64>,
    /// Shutting down: announced in the worker's record; no new shard is loaded.
    leaving: std::sync::atomic::AtomicBool,
}

impl WorkerAgent {
    pub fn new(cfg: AgentConfig) -> Result<Arc<Self>> {
        check_device(cfg.backend.device)?;
        let (changed, _) = watch::channel(0);
        Ok(Arc::new(WorkerAgent {
            cfg,
            inner: Mutex::new(Inner::default()),
            changed,
            leaving: Default::default(),
        }))
    }

    /// The process is shutting down: say so in the record (membership re-publishes it) and
    /// load nothing new.
    pub fn begin_leaving(&self) {
        self.leaving.store(true, std::sync::atomic::Ordering::Relaxed);
        self.notify();
    }

    pub fn leaving(&self) -> bool {
        self.leaving.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn id(&self) -> &str {
        &self.cfg.id
    }

    pub fn config(&self) -> &AgentConfig {
        &self.cfg
    }

    /// Notified whenever the assignment changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn notify(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Starts loading `req`; returns rank 0's rendezvous address. Idempotent for the shard
    /// already held; refuses another while one is held.
    pub fn load(self: &Arc<Self>, req: ShardLoad) -> Result<Option<String>> {
        validate(&req, &self.cfg.model_roots)?;
        if self.leaving() {
            return Err(Error::Unavailable(format!("worker {} is shutting down", self.cfg.id)));
        }
        let mut inner = self.lock();
        if let Some(h) = &inner.held {
            if h.request == req && !matches!(h.slot, Slot::Failed(_)) {
                return Ok(h.rendezvous.clone());
            }
            if !matches!(h.slot, Slot::Failed(_)) {
                return Err(Error::FailedPrecondition(format!(
                    "worker {} holds rank {} of replica {}; unload it first",
                    self.cfg.id, h.request.rank, h.request.replica
                )));
            }
        }
        inner.epoch += 1;
        inner.loads += 1;
        let epoch = inner.epoch;
        let mut rendezvous_listener = None;
        let mut rendezvous = None;
        if req.rank == 0 && req.par.world() > 1 {
            let l = TcpListener::bind((self.cfg.bind_ip, 0)).map_err(|e| {
                Error::Unavailable(format!("cannot bind a rendezvous on {}: {e}", self.cfg.bind_ip))
            })?;
            let addr = l.local_addr().map_err(|e| Error::Internal(format!("rendezvous address: {e}")))?;
            rendezvous = Some(format!("{}:{}", self.cfg.advertise_host, addr.port()));
            rendezvous_listener = Some(l);
        }
        inner.held = Some(Held {
            request: req.clone(),
            served: 0,
            rendezvous: rendezvous.clone(),
            slot: Slot::Loading,
            lost_rank: None,
        });
        inner.draining = false;
        drop(inner);
        self.notify();
        info!(replica = %req.replica, model = %req.model, rank = req.rank, tp = req.par.tp, pp = req.par.pp, "loading shard");
        let agent = self.clone();
        std::thread::Builder::new()
            .name(format!("load-{}", req.replica))
            .spawn(move || agent.run_shard(epoch, req, rendezvous_listener))
            .map_err(|e| Error::Internal(format!("cannot start the loading thread: {e}")))?;
        Ok(rendezvous)
    }

    /// The loading thread: leader or follower, until the shard ends.
    fn run_shard(self: Arc<Self>, epoch: u64, req: ShardLoad, listener: Option<TcpListener>) {
        let dir = PathBuf::from(&req.model_dir);
        let labels = ReplicaLabels { model: req.model.to_string(), replica: req.replica.to_string() };
        let mut backend = self.cfg.backend.clone();
        if req.dtype.is_some() {
            backend.dtype = req.dtype;
        }
        if !req.quantize.is_empty() {
            // Checked on the wire: only names the engine knows arrive here.
            backend.quantize = strata_engine::backend::Quantization::parse(&req.quantize).unwrap_or_default();
        }
        if req.rank == 0 {
            let mut engine = self.cfg.engine.clone();
            engine.backend = backend;
            engine.labels = labels;
            let limits = &req.limits;
            if limits.max_num_seqs > 0 {
                engine.scheduler.max_num_seqs = limits.max_num_seqs as usize;
            }
            if limits.max_batched_tokens > 0 {
                engine.scheduler.max_batched_tokens = limits.max_batched_tokens as usize;
            }
            if limits.kv_cache_bytes > 0 {
                // A deployment's own KV size wins over the worker's memory utilization.
                engine.kv_cache_bytes = usize::try_from(limits.kv_cache_bytes).unwrap_or(usize::MAX);
                engine.memory_utilization = None;
            }
            if limits.max_model_len > 0 {
                engine.max_model_len = Some(limits.max_model_len as usize);
            }
            let built = match listener {
                Some(l) => leader_with_external_ranks(
                    &dir,
                    req.par,
                    &engine,
                    (l, &req.group_secret),
                    self.cfg.rank_threads,
                ),
                None => local_replica(&dir, Parallelism::NONE, &engine),
            };
            let slot = match built.and_then(|e| EngineHandle::spawn(e, self.cfg.runner.clone(), &req.replica))
            {
                Ok(handle) => {
                    info!(replica = %req.replica, "replica leader ready");
                    Slot::Leader(handle)
                }
                Err(e) => {
                    error!(replica = %req.replica, error = %e, "loading rank 0 failed");
                    Slot::Failed(e.to_string())
                }
            };
            self.set(epoch, slot);
            return;
        }
        use std::net::ToSocketAddrs;
        let resolved =
            req.rendezvous.as_deref().and_then(|a| a.to_socket_addrs().ok()).and_then(|mut a| a.next());
        let Some(addr) = resolved else {
            return self.set(epoch, Slot::Failed(format!("bad rendezvous address {:?}", req.rendezvous)));
        };
        let joined = || self.set(epoch, Slot::Follower);
        let join = RankJoin {
            par: req.par,
            rank: req.rank,
            rendezvous: addr,
            secret: &req.group_secret,
            labels,
            threads: self.cfg.rank_threads,
        };
        match run_worker_rank(&dir, join, &backend, joined) {
            Ok(()) => {
                info!(replica = %req.replica, rank = req.rank, "rank 0 shut the replica down");
                self.clear(epoch);
            }
            Err(e) => {
                warn!(replica = %req.replica, rank = req.rank, error = %e, "rank stopped");
                if let Error::RankLost { rank, .. } = &e {
                    self.lost(epoch, *rank as u32);
                }
                self.set(epoch, Slot::Failed(e.to_string()));
            }
        }
    }

    /// Records that the shard of `epoch` failed for losing `rank`.
    fn lost(&self, epoch: u64, rank: u32) {
        let mut inner = self.lock();
        if inner.epoch == epoch {
            if let Some(h) = inner.held.as_mut() {
                h.lost_rank = Some(rank);
            }
        }
    }

    fn set(&self, epoch: u64, slot: Slot) {
        let mut inner = self.lock();
        if inner.epoch != epoch {
            return; // unloaded or replaced meanwhile; `slot` (an engine, say) is dropped
        }
        if let Some(h) = inner.held.as_mut() {
            h.slot = slot;
        }
        drop(inner);
        self.notify();
    }

    fn clear(&self, epoch: u64) {
        let mut inner = self.lock();
        if inner.epoch == epoch {
            inner.held = None;
            inner.draining = false;
            drop(inner);
            self.notify();
        }
    }

    /// Drops the shard of `replica`, if that is the one held. Dropping rank 0's engine
    /// sends the other ranks their shutdown.
    pub fn unload(&self, replica: &str) {
        let mut inner = self.lock();
        if inner.held.as_ref().is_some_and(|h| h.request.replica == replica) {
            inner.epoch += 1;
            let held = inner.held.take();
            inner.draining = false;
            drop(inner);
            let served = held.as_ref().map(|h| h.served).unwrap_or(0);
            drop(held);
            info!(replica, served, "shard unloaded");
            self.notify();
        }
    }

    /// Whether the replica this worker leads takes no new requests.
    pub fn draining(&self) -> bool {
        self.lock().draining
    }

    /// Stops taking new requests for `replica` (rank 0).
    pub fn drain(&self, replica: &str) -> Result<()> {
        self.leader(replica)?;
        self.lock().draining = true;
        Ok(())
    }

    /// The engine of `replica` when this worker leads it and takes requests. An empty
    /// `replica` matches whatever it leads.
    pub fn leader(&self, replica: &str) -> Result<EngineHandle> {
        let inner = self.lock();
        let Some(h) = &inner.held else {
            return Err(Error::Unavailable(format!("worker {} holds no replica", self.cfg.id)));
        };
        if !replica.is_empty() && h.request.replica != replica {
            return Err(Error::Unavailable(format!(
                "worker {} serves replica {}, not {replica}",
                self.cfg.id, h.request.replica
            )));
        }
        match &h.slot {
            Slot::Leader(handle) => Ok(handle.clone()),
            Slot::Loading => {
                Err(Error::Unavailable(format!("replica {} is still loading", h.request.replica)))
            }
            Slot::Failed(e) => Err(Error::Unavailable(format!("replica {} failed: {e}", h.request.replica))),
            Slot::Follower => Err(Error::Unavailable(format!(
                "worker {} is rank {} of replica {}, not its leader",
                self.cfg.id, h.request.rank, h.request.replica
            ))),
        }
    }

    /// [`leader`](Self::leader) for a new request, refusing while draining.
    pub fn serving(&self, replica: &str) -> Result<EngineHandle> {
        let handle = self.leader(replica)?;
        let mut inner = self.lock();
        if inner.draining {
            return Err(Error::Unavailable(format!("replica {replica} is draining")));
        }
        if let Some(h) = inner.held.as_mut() {
            h.served += 1;
        }
        Ok(handle)
    }

    pub fn status(&self) -> AgentStatus {
        let inner = self.lock();
        let Some(h) = &inner.held else {
            return AgentStatus { draining: inner.draining, loads: inner.loads, ..Default::default() };
        };
        let (state, error, stats) = match &h.slot {
            Slot::Loading => (ShardState::Loading, String::new(), EngineStats::default()),
            Slot::Follower => (ShardState::Ready, String::new(), EngineStats::default()),
            Slot::Failed(e) => (ShardState::Failed, e.clone(), EngineStats::default()),
            Slot::Leader(handle) => match handle.broken() {
                Some(why) => (ShardState::Failed, why, handle.stats()),
                None => (ShardState::Ready, String::new(), handle.stats()),
            },
        };
        AgentStatus {
            assignment: Some(Assignment {
                replica: h.request.replica.clone(),
                model: h.request.model.clone(),
                rank: h.request.rank as u32,
                state,
                lost_rank: h.lost_rank.filter(|_| state == ShardState::Failed),
                error,
            }),
            draining: inner.draining,
            stats,
            loads: inner.loads,
            served: h.served,
        }
    }
}

fn validate(req: &ShardLoad, roots: &ModelRoots) -> Result<()> {
    if req.replica.is_empty() {
        return Err(Error::invalid("replica_id", "must not be empty"));
    }
    roots.check(&req.model_dir)?;
    if req.par.tp == 0 || req.par.pp == 0 {
        return Err(Error::invalid("tp", "tp and pp must be at least 1"));
    }
    if req.rank >= req.par.world() {
        return Err(Error::invalid(
            "rank",
            format!("{} is outside a replica of {} ranks", req.rank, req.par.world()),
        ));
    }
    if req.rank > 0 && req.rendezvous.as_deref().unwrap_or("").is_empty() {
        return Err(Error::invalid("rendezvous", "ranks > 0 need rank 0's rendezvous address"));
    }
    Ok(())
}

#[cfg(test)]
#[path = "agent_tests.rs"]
pub(crate) mod tests;
