//! The leader's long-running work on one replica: build, monitor, drain, tear down.
//!
//! Each task reads the replica from the leader's view, talks to its workers through the
//! `WorkerApi` seam and records the outcome through the [`Writer`]; it never decides policy
//! (that is [`plan`](super::plan)). A task that fails a replica only writes `failed`; the
//! next plan schedules the teardown. Every write is guarded by the leadership key, so a
//! coordinator that lost leadership mid-task cannot overwrite its successor.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_common::cluster::{encode, now_ms, ReplicaRecord, ReplicaState, ShardState, WorkerRecord};
use strata_common::registry::keys::Keys;
use strata_common::registry::{Guard, Op, Registry};
use strata_common::worker_api::{ShardLoad, WorkerStatus};
use strata_common::{Error, ModelName, ReplicaId, Result, WorkerId};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, info_span, warn, Instrument};

use super::view::ClusterView;
use crate::routing::clients::WorkerClients;

/// A model's revision: what failed loads back off per (a canary that cannot load does not
/// hold up the serving revision's replacements).
pub type RevisionKey = (ModelName, u64);

/// How long a model's builds wait after `failures` failed loads in a row: 1 s, doubling,
/// at most 60 s.
pub fn load_backoff(failures: u32) -> Duration {
    Duration::from_secs(1 << failures.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

/// Why a model's next build waits, `since` its last of `failures` failed loads; None once
/// the backoff has passed.
pub fn backoff_reason(failures: u32, since: Duration, why: &str) -> Option<String> {
    (failures > 0 && since < load_backoff(failures)).then(|| {
        let s = if failures == 1 { "" } else { "s" };
        format!("backing off after {failures} failed load{s} (last: {why})")
    })
}

/// An error from a worker call, naming the worker by its id.
fn on_worker(w: &WorkerRecord, e: Error) -> Error {
    Error::Relayed { class: e.class(), message: format!("worker {}: {e}", w.id) }
}

/// Timings of the control plane.
#[derive(Debug, Clone)]
pub struct Timings {
    /// How often a ready replica's canary runs.
    pub canary_interval: Duration,
    /// How long a canary may take before the replica counts as broken.
    pub canary_timeout: Duration,
    /// Longest a replica may take to load and pass its first canary.
    pub load_timeout: Duration,
    /// Longest a draining replica waits for its in-flight requests.
    pub drain_timeout: Duration,
    /// How long failed replicas stay listed before they are forgotten.
    pub failed_retention: Duration,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            canary_interval: Duration::from_secs(5),
            canary_timeout: Duration::from_secs(10),
            load_timeout: Duration::from_secs(600),
            drain_timeout: Duration::from_secs(30),
            failed_retention: Duration::from_secs(30),
        }
    }
}

/// Replica writes, guarded by leadership, with the leader's own writes visible at once.
pub struct Writer {
    registry: Arc<dyn Registry>,
    keys: Keys,
    guard: Guard,
    /// Writes the view may not show yet: (model, id) → record (None: deleted).
    overlay: Mutex<HashMap<(ModelName, ReplicaId), Option<ReplicaRecord>>>,
    lost: AtomicBool,
}

impl Writer {
    pub fn new(registry: Arc<dyn Registry>, keys: Keys, leader_id: &str) -> Self {
        let guard = Guard { key: keys.leader(), value: leader_id.as_bytes().to_vec() };
        Writer { registry, keys, guard, overlay: Mutex::new(HashMap::new()), lost: AtomicBool::new(false) }
    }

    /// True once a guarded write found another coordinator leading.
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    async fn commit(&self, op: Op) -> Result<()> {
        match self.registry.commit_if(&self.guard, vec![op]).await {
            Ok(true) => Ok(()),
            Ok(false) => {
                self.lost.store(true, Ordering::SeqCst);
                Err(Error::FailedPrecondition("this coordinator is no longer the leader".into()))
            }
            Err(e) => Err(e),
        }
    }

    pub async fn put(&self, rec: &ReplicaRecord) -> Result<()> {
        let key = self.keys.replica(&rec.model, &rec.id);
        self.commit(Op::Put { key, value: encode(rec), lease: None }).await?;
        self.lock().insert((rec.model.clone(), rec.id.clone()), Some(rec.clone()));
        Ok(())
    }

    pub async fn delete(&self, model: &ModelName, id: &ReplicaId) -> Result<()> {
        self.commit(Op::Delete { key: self.keys.replica(model, id) }).await?;
        self.lock().insert((model.clone(), id.clone()), None);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(ModelName, ReplicaId), Option<ReplicaRecord>>> {
        self.overlay.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `view` with this leader's writes applied; writes the view already shows are
    /// dropped from the overlay.
    pub fn overlay(&self, view: &ClusterView) -> ClusterView {
        let mut out = view.clone();
        let mut overlay = self.lock();
        overlay.retain(|(model, id), want| {
            let have = view.replicas.get(model).and_then(|m| m.get(id));
            have != want.as_ref()
        });
        for ((model, id), want) in overlay.iter() {
            match want {
                Some(r) => {
                    out.replicas.entry(model.clone()).or_default().insert(id.clone(), r.clone());
                }
                None => {
                    if let Some(m) = out.replicas.get_mut(model) {
                        m.remove(id);
                        if m.is_empty() {
                            out.replicas.remove(model);
                        }
                    }
                }
            }
        }
        out
    }
}

/// What every task needs.
pub struct Ctx {
    pub writer: Writer,
    pub clients: Arc<WorkerClients>,
    pub view: watch::Receiver<Arc<ClusterView>>,
    pub timings: Timings,
    /// Failed loads per model: (count, when the last one failed, its reason).
    pub failures: Mutex<HashMap<RevisionKey, (u32, Instant, String)>>,
    /// Every worker's last registered address, kept after its registration vanishes.
    pub addresses: Mutex<HashMap<WorkerId, String>>,
}

impl Ctx {
    pub fn view_now(&self) -> ClusterView {
        let v = self.view.borrow().clone();
        let mut addresses = self.addresses.lock().unwrap_or_else(|p| p.into_inner());
        for w in v.workers.values() {
            addresses.insert(w.id.clone(), w.address.clone());
        }
        drop(addresses);
        self.writer.overlay(&v)
    }

    fn known_address(&self, worker: &str) -> Option<String> {
        self.addresses.lock().unwrap_or_else(|p| p.into_inner()).get(worker).cloned()
    }

    fn record(&self, model: &str, id: &str) -> Option<ReplicaRecord> {
        self.view_now().replicas.get(model).and_then(|m| m.get(id)).cloned()
    }

    /// Writes `rec` in `state` for `reason`.
    pub async fn set_state(&self, mut rec: ReplicaRecord, state: ReplicaState, reason: String) -> Result<()> {
        if rec.state != state {
            info!(replica = %rec.id, model = %rec.model, from = rec.state.as_str(), to = state.as_str(), %reason, "replica state");
        }
        rec.state = state;
        rec.reason = reason;
        rec.since_ms = now_ms();
        self.writer.put(&rec).await
    }

    async fn fail(&self, rec: ReplicaRecord, reason: String) {
        warn!(replica = %rec.id, %reason, "replica failed");
        if let Err(e) = self.set_state(rec, ReplicaState::Failed, reason).await {
            warn!(error = %e, "could not record the failure; the next plan retries");
        }
    }

    fn note_load_failure(&self, revision: RevisionKey, reason: &str) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let e = f.entry(revision).or_insert((0, Instant::now(), String::new()));
        e.0 += 1;
        e.1 = Instant::now();
        e.2 = reason.to_string();
    }

    /// Revisions whose next build must wait, and why.
    pub fn backoff(&self) -> HashMap<RevisionKey, String> {
        let f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        f.iter()
            .filter_map(|(m, (n, at, why))| backoff_reason(*n, at.elapsed(), why).map(|r| (m.clone(), r)))
            .collect()
    }

    fn worker(&self, id: &str) -> Result<WorkerRecord> {
        self.view_now()
            .workers
            .get(id)
            .cloned()
            .ok_or_else(|| Error::Unavailable(format!("worker {id} is not registered")))
    }

    async fn status(&self, w: &WorkerRecord) -> Result<WorkerStatus> {
        self.clients.get(&w.address)?.status().await.map_err(|e| on_worker(w, e))
    }

    async fn canary(&self, w0: &WorkerRecord, replica: &ReplicaId) -> Result<Duration> {
        let worker = self.clients.get(&w0.address)?;
        worker.canary(replica, self.timings.canary_timeout).await.map_err(|e| on_worker(w0, e))
    }

    async fn unload(&self, w: &WorkerRecord, replica: &ReplicaId) {
        let Ok(worker) = self.clients.get(&w.address) else { return };
        if let Err(e) = worker.unload_shard(replica).await {
            warn!(worker = %w.id, %replica, error = %e, "unload failed (the worker may be gone)");
        }
    }

    /// Unloads every rank of `rec` it can reach, rank 0 first (which shuts the others).
    async fn unload_all(&self, rec: &ReplicaRecord) {
        let view = self.view_now();
        for w in &rec.workers {
            if let Some(w) = view.workers.get(w) {
                self.unload(w, &rec.id).await;
            }
        }
    }
}

/// Loads every rank, waits for rank 0's engine, runs the first canary, marks ready.
pub async fn build(ctx: Arc<Ctx>, model: ModelName, id: ReplicaId) {
    let Some(rec) = ctx.record(&model, &id) else { return };
    match try_build(&ctx, &rec).await {
        Ok(reason) => {
            let Some(now) = ctx.record(&model, &id) else { return };
            if now.state != ReplicaState::Loading {
                return;
            }
            let w0 = ctx.worker(&rec.workers[0]).map(|w| w.address).unwrap_or_default();
            let mut ready = now;
            ready.leader_address = w0;
            if ctx.set_state(ready, ReplicaState::Ready, reason).await.is_ok() {
                super::metrics::replica_built(&model, true);
                ctx.failures
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&(model.clone(), rec.generation));
            }
        }
        Err(e) => {
            if ctx.writer.lost() {
                return;
            }
            let reason = e.to_string();
            super::metrics::replica_built(&model, false);
            ctx.note_load_failure((model.clone(), rec.generation), &reason);
            if let Some(now) = ctx.record(&model, &id) {
                ctx.fail(now, format!("loading failed: {reason}")).await;
            }
        }
    }
}

async fn try_build(ctx: &Ctx, rec: &ReplicaRecord) -> Result<String> {
    let view = ctx.view_now();
    let spec = view
        .models
        .get(&rec.model)
        .ok_or_else(|| Error::NotFound(format!("model {}", rec.model)))?
        .build_spec(rec.generation)
        .ok_or_else(|| {
            Error::NotFound(format!(
                "revision {} of model {} is no longer deployed",
                rec.generation, rec.model
            ))
        })?;
    let workers: Vec<WorkerRecord> = rec.workers.iter().map(|w| ctx.worker(w)).collect::<Result<_>>()?;
    if workers.is_empty() {
        // The record this task read has no placement (yet): nothing to load.
        return Err(Error::Unavailable(format!("replica {} has no workers assigned", rec.id)));
    }
    let started = Instant::now();
    // A fresh group secret per load: only the ranks assigned here can join its rendezvous.
    let mut group_secret = vec![0u8; 32];
    rand::TryRngCore::try_fill_bytes(&mut rand::rngs::OsRng, &mut group_secret)
        .map_err(|e| Error::Internal(format!("no randomness for a group secret: {e}")))?;
    let request = |rank: usize, rendezvous: Option<String>| ShardLoad {
        group_secret: group_secret.clone(),
        replica: rec.id.clone(),
        model: rec.model.clone(),
        model_dir: spec.build.model_dir.clone(),
        dtype: spec.build.dtype,
        quantize: spec.build.quantize.clone(),
        par: spec.parallelism(),
        rank,
        rendezvous,
        limits: spec.build.limits.clone(),
    };
    let load = |w: &WorkerRecord, req: ShardLoad| {
        let worker = ctx.clients.get(&w.address);
        let w = w.clone();
        async move { worker?.load_shard(req).await.map_err(|e| on_worker(&w, e)) }
    };
    let rendezvous = load(&workers[0], request(0, None)).await?;
    for (rank, w) in workers.iter().enumerate().skip(1) {
        load(w, request(rank, rendezvous.clone())).await?;
    }
    // Wait for rank 0's engine (it needs every other rank), watching for failures.
    let deadline = started + ctx.timings.load_timeout;
    let mut unreachable: HashMap<WorkerId, Instant> = HashMap::new();
    // Small models load in milliseconds: poll quickly at first, then every 200 ms.
    let mut poll = Duration::from_millis(5);
    'wait: loop {
        if Instant::now() > deadline {
            return Err(Error::Unavailable(format!("not loaded within {:?}", ctx.timings.load_timeout)));
        }
        for (rank, w) in workers.iter().enumerate() {
            match ctx.status(w).await {
                Ok(st) => {
                    unreachable.remove(&w.id);
                    let shard = st.assignment.filter(|s| s.replica == rec.id);
                    let Some(shard) = shard else {
                        return Err(Error::Unavailable(format!(
                            "rank {rank} (worker {}) dropped its shard",
                            w.id
                        )));
                    };
                    match shard.state {
                        ShardState::Failed => {
                            return Err(Error::Unavailable(format!(
                                "rank {rank} (worker {}): {}",
                                w.id, shard.error
                            )))
                        }
                        ShardState::Ready if rank == 0 => break 'wait,
                        _ => {}
                    }
                }
                Err(e) => {
                    let since = *unreachable.entry(w.id.clone()).or_insert_with(Instant::now);
                    if since.elapsed() > Duration::from_secs(5) {
                        return Err(Error::Unavailable(format!(
                            "rank {rank} (worker {}) unreachable: {e}",
                            w.id
                        )));
                    }
                }
            }
        }
        tokio::time::sleep(poll).await;
        poll = (poll * 2).min(Duration::from_millis(200));
    }
    let ms = ctx
        .canary(&workers[0], &rec.id)
        .await
        .map_err(|e| Error::Unavailable(format!("first canary: {e}")))?
        .as_millis();
    info!(replica = %rec.id, model = %rec.model, load_ms = started.elapsed().as_millis() as u64, canary_ms = ms as u64, "replica built");
    Ok(format!(
        "canary through {} rank{} in {ms} ms",
        workers.len(),
        if workers.len() == 1 { "" } else { "s" }
    ))
}

/// Canaries a ready replica every interval; a canary that fails or times out, or a rank
/// whose worker vanished and does not answer, fails the replica.
pub async fn monitor(ctx: Arc<Ctx>, model: ModelName, id: ReplicaId) {
    let mut re_registering: Option<WorkerId> = None;
    loop {
        tokio::time::sleep(ctx.timings.canary_interval).await;
        let view = ctx.view_now();
        let Some(rec) = view.replicas.get(&model).and_then(|m| m.get(&id)).cloned() else { return };
        if rec.state != ReplicaState::Ready {
            return;
        }
        // Ranks whose registration is gone: ask them directly before any verdict.
        let mut lost = None;
        for (rank, w) in rec.workers.iter().enumerate() {
            if view.workers.contains_key(w) {
                continue;
            }
            let Some(last) = last_known_address(&ctx, &rec, rank) else {
                lost = Some(format!("rank {rank} (worker {w}) left the cluster"));
                break;
            };
            let probe = WorkerRecord { address: last, ..placeholder(w) };
            match ctx.status(&probe).await {
                Ok(st) if st.assignment.as_ref().is_some_and(|s| s.replica == id) => {
                    if re_registering.as_ref() != Some(w) {
                        info!(worker = %w, replica = %id, "worker's lease lapsed but it still serves this replica; waiting for it to register again");
                        re_registering = Some(w.clone());
                    }
                }
                Ok(_) => {
                    lost =
                        Some(format!("rank {rank} (worker {w}) lost its lease and no longer holds the shard"))
                }
                Err(e) => {
                    lost = Some(format!("rank {rank} (worker {w}) lost its lease and does not answer: {e}"))
                }
            }
            if lost.is_some() {
                break;
            }
        }
        if let Some(reason) = lost {
            return ctx.fail(rec, reason).await;
        }
        let Some(w0) = rec.workers.first() else { return };
        let addr =
            view.workers.get(w0).map(|w| w.address.clone()).unwrap_or_else(|| rec.leader_address.clone());
        let w0rec = WorkerRecord { address: addr, ..placeholder(w0) };
        let canary = info_span!("replica.canary", model = %model, replica = %id);
        if let Err(e) = ctx.canary(&w0rec, &id).instrument(canary).await {
            if ctx
                .view_now()
                .replicas
                .get(&model)
                .and_then(|m| m.get(&id))
                .is_some_and(|r| r.state == ReplicaState::Ready)
            {
                super::metrics::canary_failed(&model);
                return ctx.fail(rec, format!("canary failed: {e}")).await;
            }
            return;
        }
    }
}

/// The address a replica's rank was reached at (rank 0's is in the record; others are
/// remembered from the last view that had them).
fn last_known_address(ctx: &Ctx, rec: &ReplicaRecord, rank: usize) -> Option<String> {
    if rank == 0 && !rec.leader_address.is_empty() {
        return Some(rec.leader_address.clone());
    }
    ctx.known_address(&rec.workers[rank])
}

fn placeholder(id: &WorkerId) -> WorkerRecord {
    WorkerRecord {
        id: id.clone(),
        address: String::new(),
        capacity: strata_common::cluster::Capacity::default(),
        assignment: None,
        started_ms: 0,
        leaving: false,
    }
}

/// Stops new requests, waits for in-flight ones (bounded), unloads, forgets the replica.
pub async fn drain(ctx: Arc<Ctx>, model: ModelName, id: ReplicaId) {
    let Some(rec) = ctx.record(&model, &id) else { return };
    let view = ctx.view_now();
    if let Some(w0) = rec.workers.first().and_then(|w| view.workers.get(w)) {
        if let Ok(worker) = ctx.clients.get(&w0.address) {
            let _ = worker.drain(&id).await;
            let until = Instant::now() + ctx.timings.drain_timeout;
            while Instant::now() < until {
                match worker.stats().await {
                    Ok(s) if s.outstanding() == 0 => break,
                    Ok(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                    Err(_) => break, // gone: nothing left to wait for
                }
            }
        }
    }
    ctx.unload_all(&rec).await;
    info!(replica = %id, model = %model, "replica drained and unloaded");
    if let Err(e) = ctx.writer.delete(&model, &id).await {
        warn!(error = %e, "could not delete the drained replica; the next plan retries");
    }
}

/// Unloads a failed replica's ranks; forgets it once the retention time has passed.
pub async fn teardown(ctx: Arc<Ctx>, model: ModelName, id: ReplicaId) {
    let Some(rec) = ctx.record(&model, &id) else { return };
    ctx.unload_all(&rec).await;
    let age = Duration::from_millis(now_ms().saturating_sub(rec.since_ms));
    if let Some(left) = ctx.timings.failed_retention.checked_sub(age) {
        tokio::time::sleep(left).await;
    }
    if ctx.record(&model, &id).is_some_and(|r| r.state == ReplicaState::Failed) {
        if let Err(e) = ctx.writer.delete(&model, &id).await {
            warn!(error = %e, "could not forget the failed replica; the next plan retries");
        }
    }
}

/// Tells a worker to drop a shard of a replica that no longer exists.
pub async fn release(ctx: Arc<Ctx>, worker: WorkerId, replica: ReplicaId) {
    if let Ok(w) = ctx.worker(&worker) {
        info!(worker = %worker, replica = %replica, "releasing a leftover shard");
        ctx.unload(&w, &replica).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_backoff_doubles_to_a_minute() {
        let secs: Vec<u64> = (1..=9).map(|n| load_backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(load_backoff(u32::MAX).as_secs(), 60);
    }

    #[test]
    fn a_model_waits_only_while_its_backoff_runs() {
        let r = backoff_reason(3, Duration::from_secs(2), "no such file").unwrap();
        assert!(r.contains("3 failed loads") && r.contains("no such file"), "{r}");
        assert!(backoff_reason(3, Duration::from_secs(4), "x").is_none(), "4 s have passed");
        assert_eq!(
            backoff_reason(1, Duration::ZERO, "x").unwrap(),
            "backing off after 1 failed load (last: x)"
        );
        assert!(backoff_reason(0, Duration::ZERO, "x").is_none());
    }
}
