//! Routes of one model in cluster mode: its ready replicas from the registry view, each
//! reached over worker.v1 at its rank 0.
//!
//! Load is what this coordinator has outstanding on a replica, or what the replica last
//! reported (`Stats`, polled by the catalog) when that is more — the report also counts
//! other coordinators' requests. A replica a request just failed on is avoided for a few
//! seconds ([`Suspects`]), until the leader coordinator's verdict reaches the view.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use strata_common::cluster::ReplicaRecord;
use strata_common::{EngineStats, ReplicaId, Result};
use tokio::sync::watch;
use tokio::time::Instant;

use super::clients::WorkerClients;
use strata_common::prefix::DEFAULT_BLOCK_SIZE;

use super::policy::{Candidate, Policy, PolicyKind};
use super::split::{to_canary, SplitIndex};
use super::suspects::Suspects;
use super::{EventStream, GateSize, Job, Replica, Routes};
use crate::control::view::ClusterView;

#[derive(Default)]
struct ReplicaLoad {
    outstanding: AtomicUsize,
    /// Last `Stats` report: running + waiting, and KV blocks.
    reported: Mutex<EngineStats>,
}

pub struct ClusterRoutes {
    model: String,
    view: watch::Receiver<Arc<ClusterView>>,
    clients: Arc<WorkerClients>,
    loads: Mutex<HashMap<String, Arc<ReplicaLoad>>>,
    /// Which of the usable replicas a request goes to.
    policy: Box<dyn Policy>,
    suspects: Mutex<Suspects>,
    /// Where prompts part ways, for the split between revisions while a canary runs.
    split: Mutex<SplitIndex>,
    /// The replicas' KV block size, as they report it (0 until one has).
    block_size: AtomicUsize,
}

impl ClusterRoutes {
    pub fn new(
        model: &str,
        view: watch::Receiver<Arc<ClusterView>>,
        clients: Arc<WorkerClients>,
        policy: PolicyKind,
    ) -> Self {
        ClusterRoutes {
            model: model.to_string(),
            view,
            clients,
            loads: Mutex::new(HashMap::new()),
            policy: policy.build(),
            suspects: Mutex::new(Suspects::default()),
            // 32768 ways of up to a block of tokens: about 3 MiB.
            split: Mutex::new(SplitIndex::new(1 << 15)),
            block_size: AtomicUsize::new(0),
        }
    }

    fn block_size(&self) -> usize {
        match self.block_size.load(Ordering::Relaxed) {
            0 => DEFAULT_BLOCK_SIZE,
            n => n,
        }
    }

    /// The canary's generation when the split sends `prompt` to it. Prompts are recorded
    /// whether a canary runs or not, so that a rollout starts knowing where prompts part.
    fn split(&self, view: &ClusterView, prompt: &[u32]) -> Option<u64> {
        let key = self.split.lock().unwrap_or_else(|p| p.into_inner()).key(prompt, self.block_size());
        let canary = view.models.get(self.model.as_str())?.rollout.canary.as_ref()?;
        to_canary(key, canary.weight_bp).then_some(canary.revision.generation)
    }

    /// Which ready replicas (by the revision they were built from) a request bound for
    /// `revision` may go to: the canary's when that is the canary; otherwise the serving
    /// revision's, and those of a revision being replaced while the serving one has fewer
    /// ready replicas than desired (make before break).
    fn revision_filter(&self, view: &ClusterView, revision: u64) -> impl Fn(u64) -> bool {
        let spec = view.models.get(self.model.as_str());
        let canary = spec.and_then(|s| s.rollout.canary.as_ref()).map(|c| c.revision.generation);
        let to_canary = canary == Some(revision);
        let serving = spec.map(|s| s.generation);
        let desired = spec.map_or(0, |s| s.replicas as usize);
        let serving_ready =
            view.ready_replicas(&self.model).filter(|r| Some(r.generation) == serving).count();
        move |g: u64| {
            if to_canary {
                Some(g) == canary
            } else {
                Some(g) != canary && (Some(g) == serving || serving_ready < desired)
            }
        }
    }

    fn load(&self, replica: &str) -> Arc<ReplicaLoad> {
        self.loads.lock().unwrap_or_else(|p| p.into_inner()).entry(replica.to_string()).or_default().clone()
    }

    /// Ready replicas: (id, rank 0's address).
    pub fn ready_replicas(&self) -> Vec<(String, String)> {
        let view = self.view.borrow().clone();
        view.ready_replicas(&self.model).map(|r| (r.id.to_string(), r.leader_address.clone())).collect()
    }

    /// Asks every replica in `ready` for its load at once and records the answers (and the
    /// block size they report); returns each one's load, its last report when it does not
    /// answer.
    async fn refresh(&self, ready: &[(String, String)]) -> Vec<EngineStats> {
        let live = futures::future::join_all(ready.iter().map(|(_, address)| async move {
            match self.clients.get(address) {
                Ok(worker) => worker.stats().await.ok(),
                Err(_) => None,
            }
        }))
        .await;
        ready
            .iter()
            .zip(live)
            .map(|((id, _), live)| {
                let load = self.load(id);
                let mut reported = load.reported.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(s) = live {
                    if s.block_size > 0 {
                        self.block_size.store(s.block_size, Ordering::Relaxed);
                    }
                    *reported = s;
                }
                *reported
            })
            .collect()
    }

    /// Refreshes the reported load of each ready replica (called periodically).
    pub async fn poll_stats(&self) {
        self.refresh(&self.ready_replicas()).await;
        // Forget replicas that left.
        let ready: Vec<String> = self.ready_replicas().into_iter().map(|r| r.0).collect();
        let mut loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
        let gone: Vec<String> = loads.keys().filter(|k| !ready.contains(k)).cloned().collect();
        for g in gone {
            if loads.get(&g).is_some_and(|l| l.outstanding.load(Ordering::Relaxed) == 0) {
                loads.remove(&g);
                self.policy.forget(&g);
            }
        }
    }
}

#[async_trait::async_trait]
impl Routes for ClusterRoutes {
    fn revision_for(&self, prompt: &[u32]) -> u64 {
        let view = self.view.borrow().clone();
        let Some(spec) = view.models.get(self.model.as_str()) else { return 0 };
        self.split(&view, prompt).unwrap_or(spec.generation)
    }

    fn gate_size(&self) -> GateSize {
        let view = self.view.borrow();
        let limits =
            view.models.get(self.model.as_str()).map(|spec| spec.build.limits.clone()).unwrap_or_default();
        let or = |v: u32, default: usize| if v == 0 { default } else { v as usize };
        // A deployment that sets no limit runs with the engine's default.
        use strata_common::config::EngineSettings as Engine;
        let (replicas, coordinators) =
            (view.ready_replicas(&self.model).count(), view.coordinators.len().max(1));
        if replicas == 0 {
            // Nothing to share yet: requests wait for a replica on the request path (bounded
            // by the route wait), as they do when one fails.
            return GateSize { slots: usize::MAX, queue: usize::MAX };
        }
        let share = |per_replica: usize| (replicas * per_replica).div_ceil(coordinators);
        GateSize {
            slots: share(or(limits.max_num_seqs, Engine::MAX_NUM_SEQS)).max(1),
            queue: share(or(limits.max_waiting, Engine::MAX_WAITING)),
        }
    }

    fn replica_revision(&self, replica: &str) -> Option<u64> {
        let view = self.view.borrow();
        view.replicas.get(self.model.as_str())?.get(replica).map(|r| r.generation)
    }

    fn pick(&self, prompt: &[u32], revision: u64, exclude: &[String]) -> Option<Arc<dyn Replica>> {
        let suspects = self.suspects.lock().unwrap_or_else(|p| p.into_inner()).current(Instant::now());
        let view = self.view.borrow().clone();
        let usable: Vec<&ReplicaRecord> = view
            .ready_replicas(&self.model)
            .filter(|r| {
                !exclude.iter().any(|e| e == r.id.as_str()) && !suspects.iter().any(|s| s == r.id.as_str())
            })
            .collect();
        if usable.is_empty() {
            return None;
        }
        // Replicas of the request's revision; any other ready one rather than none.
        let wanted = self.revision_filter(&view, revision);
        let of_revision: Vec<&ReplicaRecord> =
            usable.iter().copied().filter(|r| wanted(r.generation)).collect();
        let chosen = if of_revision.is_empty() { usable } else { of_revision };
        let ready: Vec<(String, String)> =
            chosen.iter().map(|r| (r.id.to_string(), r.leader_address.clone())).collect();
        let loads: Vec<Arc<ReplicaLoad>> = ready.iter().map(|(id, _)| self.load(id)).collect();
        let outstanding: Vec<usize> = loads
            .iter()
            .map(|l| {
                let reported = *l.reported.lock().unwrap_or_else(|p| p.into_inner());
                l.outstanding.load(Ordering::Relaxed).max(reported.outstanding())
            })
            .collect();
        let candidates: Vec<Candidate<'_>> =
            ready.iter().zip(&outstanding).map(|((id, _), &o)| Candidate { id, outstanding: o }).collect();
        let i = self.policy.pick(prompt, self.block_size(), &candidates);
        Some(Arc::new(RemoteReplica {
            ranks: chosen[i].workers.len().max(1),
            id: ReplicaId::new(ready[i].0.as_str()),
            address: ready[i].1.clone(),
            clients: self.clients.clone(),
            load: loads[i].clone(),
        }))
    }

    fn report_failure(&self, replica: &str) {
        self.suspects.lock().unwrap_or_else(|p| p.into_inner()).report(replica, Instant::now());
    }

    async fn wait_for_change(&self, limit: Duration) -> bool {
        let mut rx = self.view.clone();
        rx.borrow_and_update();
        let deadline = tokio::time::Instant::now() + limit;
        // Suspicion expires too: wake up when it does, so a request can try again.
        let next = self.suspects.lock().unwrap_or_else(|p| p.into_inner()).next_expiry();
        let wake = next.unwrap_or(deadline).min(deadline);
        matches!(tokio::time::timeout_at(wake, rx.changed()).await, Ok(Ok(()))) || wake < deadline
    }

    fn ready(&self) -> usize {
        self.ready_replicas().len()
    }

    fn unready(&self) -> Option<super::Unready> {
        let view = self.view.borrow();
        unready(&view, &self.model)
    }

    fn max_context(&self) -> Option<usize> {
        // Per request (admission): read the view and the reports in place, no copies.
        let view = self.view.borrow();
        let loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
        view.ready_replicas(&self.model)
            .filter_map(|r| loads.get(r.id.as_str()))
            .map(|l| l.reported.lock().unwrap_or_else(|p| p.into_inner()).max_context)
            .filter(|&c| c > 0)
            .min()
    }

    async fn stats(&self) -> EngineStats {
        let ready = self.ready_replicas();
        let reports = self.refresh(&ready).await;
        EngineStats::sum(ready.iter().zip(reports).map(|((id, _), mut s)| {
            s.running = s.running.max(self.load(id).outstanding.load(Ordering::Relaxed));
            s
        }))
    }
}

/// A replica's rank 0, through the `WorkerApi` seam.
pub struct RemoteReplica {
    id: ReplicaId,
    ranks: usize,
    address: String,
    clients: Arc<WorkerClients>,
    load: Arc<ReplicaLoad>,
}

/// Decrements a replica's outstanding count when the request's stream is dropped.
struct Outstanding(Arc<ReplicaLoad>);

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

#[async_trait::async_trait]
impl Replica for RemoteReplica {
    fn id(&self) -> &str {
        &self.id
    }

    fn ranks(&self) -> usize {
        self.ranks
    }

    async fn submit(&self, job: &Job) -> Result<EventStream> {
        self.load.outstanding.fetch_add(1, Ordering::Relaxed);
        let guard = Outstanding(self.load.clone());
        let events = self.clients.get(&self.address)?.generate(&self.id, job).await?;
        // The load count is released when the caller drops the stream or it ends.
        Ok(futures::stream::unfold((events, Some(guard)), |(mut events, guard)| async move {
            let guard = guard?;
            let ev = events.next().await?;
            let next = (!ev.is_last()).then_some(guard);
            Some((ev, (events, next)))
        })
        .boxed())
    }
}

/// Why `model` has no ready replica in `view` (None when one is ready).
fn unready(view: &ClusterView, model: &str) -> Option<super::Unready> {
    use strata_common::cluster::ReplicaState as S;
    let replicas = view.replicas.get(model);
    let progress = |s: S| match s {
        S::Ready => 4,
        S::Loading => 3,
        S::Pending => 2,
        S::Draining => 1,
        S::Failed => 0,
    };
    let Some(best) = replicas.and_then(|rs| rs.values().max_by_key(|r| (progress(r.state), r.since_ms)))
    else {
        let reason = match view.models.get(model) {
            Some(spec) if spec.replicas == 0 => "scaled to 0 replicas",
            // Deployed, not yet reconciled: as good as pending from now.
            Some(_) => {
                let now = strata_common::cluster::now_ms();
                return Some(super::Unready {
                    state: Some(S::Pending),
                    reason: "not placed yet".into(),
                    since_ms: now,
                });
            }
            None => "not deployed",
        };
        return Some(super::Unready { state: None, reason: reason.into(), since_ms: 0 });
    };
    (best.state != S::Ready).then(|| super::Unready {
        state: Some(best.state),
        reason: best.reason.clone(),
        since_ms: best.since_ms,
    })
}

#[cfg(test)]
#[path = "cluster_tests.rs"]
mod tests;
