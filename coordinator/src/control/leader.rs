//! Leader election and the reconcile loop.
//!
//! Every coordinator campaigns: it holds a lease and tries to create `<prefix>/leader`
//! with its id, bound to that lease (the etcd election recipe; whoever creates the key
//! leads, and the key vanishes with its holder's lease). The winner reconciles; the others
//! wait for the key to go. A leader that dies stops refreshing its lease, so another
//! coordinator takes over within the lease TTL; one that shuts down revokes its lease and
//! hands over at once. Every write a leader makes is guarded by the key still holding its
//! id, so a coordinator that lost leadership without noticing cannot overwrite its
//! successor. While the registry is unreachable nobody can write, and a leader whose lease
//! survives the outage (etcd extends leases when it restarts) simply carries on.
//!
//! The loop: every tick (or view change) take the view with this leader's own writes
//! applied, [`plan`](super::plan::plan) the actions, carry them out. Long work runs as
//! [`tasks`](super::tasks), at most one per replica (plus a health monitor per ready
//! replica).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_common::cluster::{now_ms, ReplicaRecord, ReplicaState};
use strata_common::registry::keys::Keys;
use strata_common::registry::{Guard, LeaseId, Op, Registry};
use strata_common::ErrorClass;
use strata_common::{ModelName, ReplicaId, WorkerId};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, info_span, warn, Instrument};

use super::plan::{plan, Action, Inputs};
use super::tasks::{self, Ctx, Timings, Writer};
use super::view::ClusterView;
use crate::routing::clients::WorkerClients;

#[derive(Debug, Clone)]
pub struct LeaderConfig {
    /// This coordinator's id (the leader key's value).
    pub id: String,
    pub lease_ttl: Duration,
    /// How often the election lease is refreshed.
    pub keepalive: Duration,
    pub timings: Timings,
    /// Longest pause between two plans.
    pub tick: Duration,
}

/// Campaigns for leadership forever; reconciles while leading. `leading` says whether
/// this coordinator leads right now.
pub struct Election {
    task: JoinHandle<()>,
    lease: Arc<Mutex<Option<LeaseId>>>,
    registry: Arc<dyn Registry>,
    pub leading: watch::Receiver<bool>,
}

impl Election {
    pub fn start(
        registry: Arc<dyn Registry>,
        keys: Keys,
        view: watch::Receiver<Arc<ClusterView>>,
        clients: Arc<WorkerClients>,
        cfg: LeaderConfig,
    ) -> Self {
        let (tx, leading) = watch::channel(false);
        let lease = Arc::new(Mutex::new(None));
        let task = tokio::spawn(campaign(registry.clone(), keys, view, clients, cfg, tx, lease.clone()));
        Election { task, lease, registry, leading }
    }

    /// Stops campaigning without giving anything up, as a coordinator that dies: its lease
    /// lapses after its TTL (tests of a leader's death).
    #[cfg(test)]
    pub fn crash(self) {
        self.task.abort();
    }

    /// Stops campaigning and gives leadership up at once (revokes the lease).
    pub async fn resign(self) {
        self.task.abort();
        let lease = *self.lease.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = lease {
            let _ = self.registry.revoke_lease(l).await;
        }
    }
}

async fn campaign(
    registry: Arc<dyn Registry>,
    keys: Keys,
    mut view: watch::Receiver<Arc<ClusterView>>,
    clients: Arc<WorkerClients>,
    cfg: LeaderConfig,
    leading: watch::Sender<bool>,
    current: Arc<Mutex<Option<LeaseId>>>,
) {
    let retry = cfg.keepalive.max(Duration::from_millis(50));
    loop {
        let lease = match registry.grant_lease(cfg.lease_ttl).await {
            Ok(l) => l,
            Err(_) => {
                tokio::time::sleep(retry).await;
                continue;
            }
        };
        *current.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
        // Presence: tenants' limits are split among the live coordinators.
        if let Err(e) = registry.put(&keys.coordinator(&cfg.id), Vec::new(), Some(lease)).await {
            warn!(error = %e, "cannot announce this coordinator; retrying with the next lease");
        }
        let lapsed = Arc::new(AtomicBool::new(false));
        // Ends with the campaign, however it ends (a lapse, a resignation, an abort).
        let keeper = AbortOnDrop(tokio::spawn(keep_alive(registry.clone(), lease, retry, lapsed.clone())));
        while !lapsed.load(Ordering::SeqCst) {
            let won = match registry.create(&keys.leader(), cfg.id.as_bytes().to_vec(), Some(lease)).await {
                Ok(true) => true,
                Ok(false) => match registry.get(&keys.leader()).await {
                    Ok(Some(e)) if e.value == cfg.id.as_bytes() => true,
                    Ok(Some(e)) if e.lease.is_none() => {
                        // A leader key no lease keeps alive would stop elections forever:
                        // nobody wrote it by campaigning. Remove it (if unchanged) and run.
                        warn!(holder = %String::from_utf8_lossy(&e.value), "removing a leader key without a lease");
                        let guard = Guard { key: keys.leader(), value: e.value };
                        let _ = registry.commit_if(&guard, vec![Op::Delete { key: keys.leader() }]).await;
                        false
                    }
                    _ => false,
                },
                Err(_) => false,
            };
            if won {
                info!(coordinator = %cfg.id, "elected leader; reconciling");
                super::metrics::elected();
                leading.send_replace(true);
                let term = info_span!("leader.term", coordinator = %cfg.id);
                lead(&registry, &keys, &view, &clients, &cfg, &lapsed).instrument(term).await;
                leading.send_replace(false);
                info!(coordinator = %cfg.id, "no longer the leader");
                continue;
            }
            // Someone else leads: wait for the key to go (or our lease to lapse).
            let _ = tokio::time::timeout(retry, async {
                loop {
                    if view.borrow_and_update().leader.is_none() {
                        return;
                    }
                    if view.changed().await.is_err() {
                        return;
                    }
                }
            })
            .await;
        }
        drop(keeper);
        warn!(coordinator = %cfg.id, "election lease lapsed; campaigning again");
    }
}

/// A task that is aborted when its handle is dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn keep_alive(registry: Arc<dyn Registry>, lease: LeaseId, every: Duration, lapsed: Arc<AtomicBool>) {
    loop {
        tokio::time::sleep(every).await;
        match registry.keep_alive(lease).await {
            Ok(()) => {}
            Err(e) if e.class() == ErrorClass::NotFound => {
                lapsed.store(true, Ordering::SeqCst);
                return;
            }
            Err(_) => {} // unreachable: keep trying; nobody else can take over meanwhile
        }
    }
}

#[derive(Default)]
struct Tasks {
    busy: HashMap<ReplicaId, JoinHandle<()>>,
    monitors: HashMap<ReplicaId, JoinHandle<()>>,
    releasing: HashMap<WorkerId, JoinHandle<()>>,
}

impl Tasks {
    fn reap(&mut self) {
        self.busy.retain(|_, h| !h.is_finished());
        self.monitors.retain(|_, h| !h.is_finished());
        self.releasing.retain(|_, h| !h.is_finished());
    }

    fn abort_all(&mut self) {
        for h in self.busy.values().chain(self.monitors.values()).chain(self.releasing.values()) {
            h.abort();
        }
    }
}

async fn lead(
    registry: &Arc<dyn Registry>,
    keys: &Keys,
    view: &watch::Receiver<Arc<ClusterView>>,
    clients: &Arc<WorkerClients>,
    cfg: &LeaderConfig,
    lapsed: &AtomicBool,
) {
    let ctx = Arc::new(Ctx {
        writer: Writer::new(registry.clone(), keys.clone(), &cfg.id),
        clients: clients.clone(),
        view: view.clone(),
        timings: cfg.timings.clone(),
        failures: Mutex::new(HashMap::new()),
        addresses: Mutex::new(HashMap::new()),
    });
    let mut tasks = Tasks::default();
    let mut changes = view.clone();
    while !ctx.writer.lost() && !lapsed.load(Ordering::SeqCst) {
        tasks.reap();
        let v = ctx.view_now();
        if v.connected {
            let backoff = ctx.backoff();
            let inputs = Inputs {
                busy: tasks.busy.keys().map(ReplicaId::as_str).collect(),
                monitored: tasks.monitors.keys().map(ReplicaId::as_str).collect(),
                backoff: backoff.iter().map(|((m, g), v)| ((m.as_str(), *g), v.clone())).collect(),
                releasing: tasks.releasing.keys().map(WorkerId::as_str).collect::<HashSet<_>>(),
            };
            let mut new_id = |model: &str| ReplicaId::new(format!("{model}-{:08x}", rand::random::<u32>()));
            let actions = plan(&v, &inputs, &mut new_id);
            for a in actions {
                execute(&ctx, &v, &mut tasks, a).await;
                if ctx.writer.lost() {
                    break;
                }
            }
        }
        changes.borrow_and_update();
        let _ = tokio::time::timeout(cfg.tick, changes.changed()).await;
    }
    tasks.abort_all();
}

/// Spawns a replica task (`build`, `monitor`, `drain`, `teardown`) in a span of its own:
/// the control plane's traces, one per task.
fn spawn_task<F, Fut>(
    name: &'static str,
    ctx: &Arc<Ctx>,
    model: ModelName,
    id: ReplicaId,
    task: F,
) -> JoinHandle<()>
where
    F: FnOnce(Arc<Ctx>, ModelName, ReplicaId) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let span = info_span!("replica.task", otel.name = %format_args!("replica.{name}"), model = %model, replica = %id);
    tokio::spawn(task(ctx.clone(), model, id).instrument(span))
}

fn record(v: &ClusterView, model: &str, id: &str) -> Option<ReplicaRecord> {
    v.replicas.get(model).and_then(|m| m.get(id)).cloned()
}

async fn execute(ctx: &Arc<Ctx>, v: &ClusterView, tasks: &mut Tasks, action: Action) {
    let warn_write =
        |e: strata_common::Error| warn!(error = %e, "registry write failed; retrying next round");
    match action {
        Action::CreatePending { model, id, generation, reason } => {
            let now = now_ms();
            let rec = ReplicaRecord {
                id,
                model,
                state: ReplicaState::Pending,
                reason,
                workers: Vec::new(),
                leader_address: String::new(),
                generation,
                since_ms: now,
                created_ms: now,
            };
            info!(replica = %rec.id, model = %rec.model, reason = %rec.reason, "replica pending");
            if let Err(e) = ctx.writer.put(&rec).await {
                warn_write(e);
            }
        }
        Action::Assign { model, id, generation, workers } => {
            let now = now_ms();
            let mut rec = record(v, &model, &id).unwrap_or(ReplicaRecord {
                id: id.clone(),
                model: model.clone(),
                state: ReplicaState::Pending,
                reason: String::new(),
                workers: Vec::new(),
                leader_address: String::new(),
                generation,
                since_ms: now,
                created_ms: now,
            });
            rec.workers = workers.clone();
            rec.generation = generation;
            let reason = format!("loading on {}", workers.join(", "));
            match ctx.set_state(rec, ReplicaState::Loading, reason).await {
                Ok(()) => {
                    tasks.busy.insert(id.clone(), spawn_task("build", ctx, model, id, tasks::build));
                }
                Err(e) => warn_write(e),
            }
        }
        Action::Wait { model, id, reason } => {
            if let Some(mut rec) = record(v, &model, &id) {
                rec.reason = reason;
                if let Err(e) = ctx.writer.put(&rec).await {
                    warn_write(e);
                }
            }
        }
        Action::Build { model, id } => {
            tasks.busy.insert(id.clone(), spawn_task("build", ctx, model, id, tasks::build));
        }
        Action::Monitor { model, id } => {
            tasks.monitors.insert(id.clone(), spawn_task("monitor", ctx, model, id, tasks::monitor));
        }
        Action::Drain { model, id, reason } => {
            if let Some(m) = tasks.monitors.remove(&id) {
                m.abort();
            }
            let Some(rec) = record(v, &model, &id) else { return };
            if rec.state != ReplicaState::Draining {
                if let Err(e) = ctx.set_state(rec, ReplicaState::Draining, reason).await {
                    return warn_write(e);
                }
            }
            tasks.busy.insert(id.clone(), spawn_task("drain", ctx, model, id, tasks::drain));
        }
        Action::Fail { model, id, reason } => {
            if let Some(m) = tasks.monitors.remove(&id) {
                m.abort();
            }
            let Some(rec) = record(v, &model, &id) else { return };
            warn!(replica = %id, %reason, "replica failed");
            if let Err(e) = ctx.set_state(rec, ReplicaState::Failed, reason).await {
                return warn_write(e);
            }
            tasks.busy.insert(id.clone(), spawn_task("teardown", ctx, model, id, tasks::teardown));
        }
        Action::Teardown { model, id } => {
            tasks.busy.insert(id.clone(), spawn_task("teardown", ctx, model, id, tasks::teardown));
        }
        Action::Delete { model, id } => {
            if let Err(e) = ctx.writer.delete(&model, &id).await {
                warn_write(e);
            }
        }
        Action::Release { worker, replica } => {
            tasks
                .releasing
                .insert(worker.clone(), tokio::spawn(tasks::release(ctx.clone(), worker, replica)));
        }
    }
}
