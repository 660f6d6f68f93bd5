//! The reconciler's decisions, as a pure function of the cluster view.
//!
//! [`plan`] compares desired state (model specs) with actual state (replica records,
//! worker registrations) and returns [`Action`]s; the leader's driver carries them out
//! (registry writes, worker.v1 calls, long-running build/drain tasks) and the next view
//! shows the result. Nothing here does I/O, so every policy is unit-tested:
//!
//! - **scale up**: missing replicas become `pending` records; a pending replica gets
//!   `tp × pp` free workers of its device kind with room for a shard and its KV cache as
//!   soon as there are that many (oldest pending first; see [`placement`]), else its
//!   reason says what it waits for;
//! - **scale down**: surplus pending replicas are deleted, then loading ones drained, then
//!   the newest ready ones drained (in-flight requests finish first);
//! - **replacement**: replicas on drained workers or built from an older spec are kept
//!   until enough current replicas are ready, then drained (make before break);
//! - **failure**: a ready replica whose worker reports its shard failed, or no longer
//!   holds it, is marked failed; failed replicas are torn down and, after a while,
//!   forgotten; their workers become free;
//! - **leftovers**: a worker holding a shard of a replica that no longer exists is told
//!   to unload it.
//!
//! Replicas with a task in flight (`busy`) are left to that task.

use std::collections::{HashMap, HashSet};

use strata_common::cluster::{ModelSpec, ReplicaRecord, ReplicaState, ShardState, WorkerRecord};
use strata_common::{ModelName, ReplicaId, WorkerId};

use super::placement;
use super::view::ClusterView;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A new replica record, pending.
    CreatePending { model: ModelName, id: ReplicaId, generation: u64, reason: String },
    /// Give a pending (or new) replica its workers (rank order) and build it from the
    /// revision numbered `generation`.
    Assign { model: ModelName, id: ReplicaId, generation: u64, workers: Vec<WorkerId> },
    /// A pending replica keeps waiting, for this reason.
    Wait { model: ModelName, id: ReplicaId, reason: String },
    /// Go on building a loading replica (nobody is: e.g. a new leader took over).
    Build { model: ModelName, id: ReplicaId },
    /// Watch a ready replica's health.
    Monitor { model: ModelName, id: ReplicaId },
    /// No new requests; unload once in-flight ones finish.
    Drain { model: ModelName, id: ReplicaId, reason: String },
    /// Mark failed and tear down.
    Fail { model: ModelName, id: ReplicaId, reason: String },
    /// Unload a failed replica's ranks and forget it after the retention time.
    Teardown { model: ModelName, id: ReplicaId },
    /// Forget a replica record (a pending replica no longer needed).
    Delete { model: ModelName, id: ReplicaId },
    /// Tell a worker to drop a shard of a replica that no longer exists.
    Release { worker: WorkerId, replica: ReplicaId },
}

/// What the driver knows besides the view.
#[derive(Debug, Default)]
pub struct Inputs<'a> {
    /// Replicas with a build, drain or teardown task in flight.
    pub busy: HashSet<&'a str>,
    /// Ready replicas with a health monitor running.
    pub monitored: HashSet<&'a str>,
    /// Revisions whose next build must wait (failures backing off): (model, generation)
    /// → reason.
    pub backoff: HashMap<(&'a str, u64), String>,
    /// Workers with a release in flight.
    pub releasing: HashSet<&'a str>,
}

/// A fresh replica id for `model` (the driver supplies the randomness).
pub type NewId<'a> = &'a mut dyn FnMut(&str) -> ReplicaId;

pub fn plan(view: &ClusterView, inputs: &Inputs<'_>, new_id: NewId<'_>) -> Vec<Action> {
    let mut out = Vec::new();
    let mut free = placement::Free::new(free_workers(view));
    release_leftovers(view, inputs, &mut out);
    let mut names: Vec<&ModelName> = view.models.keys().chain(view.replicas.keys()).collect();
    names.sort();
    names.dedup();
    for name in names {
        plan_model(view, inputs, name, &mut free, new_id, &mut out);
    }
    // A replica being drained or failed needs no monitor.
    let ending: HashSet<ReplicaId> = out
        .iter()
        .filter_map(|a| match a {
            Action::Drain { id, .. } | Action::Fail { id, .. } => Some(id.clone()),
            _ => None,
        })
        .collect();
    out.retain(|a| !matches!(a, Action::Monitor { id, .. } if ending.contains(id)));
    out
}

/// Workers free for placement, most memory first, then by id (deterministic): not listed
/// by a live replica, holding no shard, not drained.
fn free_workers(view: &ClusterView) -> Vec<&WorkerRecord> {
    let mut reserved: HashSet<&str> = HashSet::new();
    for r in view.all_replicas() {
        if r.state != ReplicaState::Failed {
            reserved.extend(r.workers.iter().map(WorkerId::as_str));
        }
    }
    let mut free: Vec<&WorkerRecord> = view
        .workers
        .values()
        .filter(|w| !reserved.contains(w.id.as_str()))
        .filter(|w| w.assignment.is_none())
        .filter(|w| !view.drained.contains(&w.id) && !w.leaving)
        .collect();
    free.sort_by(|a, b| b.capacity.memory_bytes.cmp(&a.capacity.memory_bytes).then(a.id.cmp(&b.id)));
    free
}

/// Shards that no replica lists (at that rank) are released.
fn release_leftovers(view: &ClusterView, inputs: &Inputs<'_>, out: &mut Vec<Action>) {
    for w in view.workers.values() {
        let Some(a) = &w.assignment else { continue };
        let listed = view
            .replicas
            .get(&a.model)
            .and_then(|m| m.get(&a.replica))
            .is_some_and(|r| r.workers.get(a.rank as usize) == Some(&w.id));
        if !listed && !inputs.releasing.contains(w.id.as_str()) {
            out.push(Action::Release { worker: w.id.clone(), replica: a.replica.clone() });
        }
    }
}

/// One model's replicas, oldest first, and which of them a task is busy with.
#[derive(Clone)]
struct ModelState<'v> {
    name: &'v ModelName,
    recs: Vec<&'v ReplicaRecord>,
    busy: HashSet<&'v str>,
    /// Ready replicas this plan ends (fails, or drains off a leaving worker).
    failed_now: HashSet<&'v str>,
}

impl ModelState<'_> {
    fn busy(&self, r: &ReplicaRecord) -> bool {
        self.busy.contains(r.id.as_str())
    }
}

fn plan_model(
    view: &ClusterView,
    inputs: &Inputs<'_>,
    name: &ModelName,
    free: &mut placement::Free<'_>,
    new_id: NewId<'_>,
    out: &mut Vec<Action>,
) {
    let mut recs: Vec<&ReplicaRecord> =
        view.replicas.get(name).map(|r| r.values().collect()).unwrap_or_default();
    recs.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
    let busy = recs.iter().filter(|r| inputs.busy.contains(r.id.as_str())).map(|r| r.id.as_str()).collect();
    let mut st = ModelState { name, recs, busy, failed_now: HashSet::new() };
    resume_work(view, inputs, &mut st, out);
    let Some(spec) = view.models.get(name) else {
        return undeployed(&st, out);
    };
    // A canary's replicas are planned as a deployment of their own; everything else —
    // the serving revision's replicas, and any of revisions no longer deployed — as the
    // serving one's.
    let canary = spec.canary_spec();
    let (canary_recs, recs): (Vec<&ReplicaRecord>, Vec<&ReplicaRecord>) =
        st.recs.iter().partition(|r| canary.as_ref().is_some_and(|c| c.generation == r.generation));
    for (spec, recs) in std::iter::once((spec.clone(), recs)).chain(canary.map(|c| (c, canary_recs))) {
        let part = ModelState { recs, ..st.clone() };
        let keep = move_off(view, &spec, &part, out);
        let to_place = resize(&spec, &part, &keep, new_id, out);
        place(&spec, inputs, name, to_place, free, out);
    }
}

/// Failures the view already shows, and work in progress that no task is doing.
fn resume_work<'v>(view: &ClusterView, inputs: &Inputs<'_>, st: &mut ModelState<'v>, out: &mut Vec<Action>) {
    let m = st.name.clone();
    let ready: Vec<&'v ReplicaRecord> =
        st.recs.iter().copied().filter(|r| r.state == ReplicaState::Ready && !st.busy(r)).collect();
    for r in ready {
        // A worker shutting down takes its replica with it: drained, nobody blamed (its
        // other ranks may already hold nothing once it lets go).
        if let Some(reason) = leaving(view, r) {
            out.push(Action::Drain { model: m.clone(), id: r.id.clone(), reason });
            st.failed_now.insert(&r.id);
        } else if let Some(reason) = rank_trouble(view, r) {
            out.push(Action::Fail { model: m.clone(), id: r.id.clone(), reason });
            st.failed_now.insert(&r.id);
        }
    }
    for r in st.recs.iter().filter(|r| !st.busy(r) && !st.failed_now.contains(r.id.as_str())) {
        let (model, id) = (m.clone(), r.id.clone());
        match r.state {
            ReplicaState::Loading => out.push(Action::Build { model, id }),
            ReplicaState::Ready if !inputs.monitored.contains(r.id.as_str()) => {
                out.push(Action::Monitor { model, id })
            }
            ReplicaState::Draining => out.push(Action::Drain { model, id, reason: r.reason.clone() }),
            ReplicaState::Failed => out.push(Action::Teardown { model, id }),
            _ => {}
        }
    }
}

/// An undeployed model: everything goes.
fn undeployed(st: &ModelState<'_>, out: &mut Vec<Action>) {
    for r in st.recs.iter().filter(|r| !st.busy(r)) {
        let (model, id) = (st.name.clone(), r.id.clone());
        match r.state {
            ReplicaState::Pending => out.push(Action::Delete { model, id }),
            ReplicaState::Loading | ReplicaState::Ready if !st.failed_now.contains(r.id.as_str()) => {
                out.push(Action::Drain { model, id, reason: "model undeployed".into() })
            }
            _ => {}
        }
    }
}

/// Replicas that must move (on a drained worker, or of an older spec): not-yet-ready ones
/// go now, ready ones once replaced. Returns the live replicas that stay.
fn move_off<'v>(
    view: &ClusterView,
    spec: &ModelSpec,
    st: &ModelState<'v>,
    out: &mut Vec<Action>,
) -> Vec<&'v ReplicaRecord> {
    let on_drained = |r: &ReplicaRecord| {
        r.workers.iter().any(|w| view.drained.contains(w) || view.workers.get(w).is_some_and(|x| x.leaving))
    };
    let stale = |r: &ReplicaRecord| r.generation != spec.generation;
    let live =
        st.recs.iter().copied().filter(|r| r.state.is_live() && !st.failed_now.contains(r.id.as_str()));
    let (keep, moving): (Vec<&ReplicaRecord>, Vec<&ReplicaRecord>) =
        live.partition(|r| !on_drained(r) && !stale(r));
    let ready_kept = keep.iter().filter(|r| r.state == ReplicaState::Ready).count();
    for r in moving.iter().filter(|r| !st.busy(r)) {
        let why = if on_drained(r) { "a worker was drained" } else { "the model's spec changed" };
        let (model, id) = (st.name.clone(), r.id.clone());
        match r.state {
            ReplicaState::Pending => out.push(Action::Delete { model, id }),
            ReplicaState::Loading => out.push(Action::Drain { model, id, reason: why.into() }),
            _ if ready_kept >= spec.replicas as usize => {
                out.push(Action::Drain { model, id, reason: format!("{why}; replaced") })
            }
            _ => {}
        }
    }
    keep
}

/// A replica waiting for placement: (id, its current reason, whether its record exists).
type ToPlace = (ReplicaId, String, bool);

/// Scales `keep` to the desired count: surplus goes (pending first, then loading, then the
/// newest ready); a shortfall becomes new replicas to place. Returns what to place, oldest
/// first.
fn resize(
    spec: &ModelSpec,
    st: &ModelState<'_>,
    keep: &[&ReplicaRecord],
    new_id: NewId<'_>,
    out: &mut Vec<Action>,
) -> Vec<ToPlace> {
    let desired = spec.replicas as usize;
    let mut to_place: Vec<ToPlace> = keep
        .iter()
        .filter(|r| r.state == ReplicaState::Pending)
        .map(|r| (r.id.clone(), r.reason.clone(), true))
        .collect();
    if keep.len() <= desired {
        for _ in keep.len()..desired {
            to_place.push((new_id(st.name), String::new(), false));
        }
        return to_place;
    }
    let mut order: Vec<&ReplicaRecord> = Vec::new();
    order.extend(keep.iter().rev().filter(|r| r.state == ReplicaState::Pending));
    order.extend(keep.iter().rev().filter(|r| r.state == ReplicaState::Loading && !st.busy(r)));
    order.extend(keep.iter().rev().filter(|r| r.state == ReplicaState::Ready));
    for r in order.into_iter().take(keep.len() - desired) {
        let (model, id) = (st.name.clone(), r.id.clone());
        if r.state == ReplicaState::Pending {
            to_place.retain(|p| p.0 != r.id);
            out.push(Action::Delete { model, id });
        } else {
            out.push(Action::Drain { model, id, reason: "scaled down".into() });
        }
    }
    to_place
}

/// Assigns free workers to each replica to place, or records why it waits.
fn place(
    spec: &ModelSpec,
    inputs: &Inputs<'_>,
    name: &ModelName,
    to_place: Vec<ToPlace>,
    free: &mut placement::Free<'_>,
    out: &mut Vec<Action>,
) {
    let m = name.clone();
    for (id, current, exists) in to_place {
        let reason = match inputs.backoff.get(&(name.as_str(), spec.generation)) {
            Some(why) => why.clone(),
            None => match free.take(spec) {
                Ok(workers) => {
                    out.push(Action::Assign { model: m.clone(), id, generation: spec.generation, workers });
                    continue;
                }
                Err(why) => why,
            },
        };
        if !exists {
            out.push(Action::CreatePending { model: m.clone(), id, generation: spec.generation, reason });
        } else if current != reason {
            out.push(Action::Wait { model: m.clone(), id, reason });
        }
    }
}

/// Which of a replica's workers is shutting down, as a reason to drain it.
fn leaving(view: &ClusterView, r: &ReplicaRecord) -> Option<String> {
    r.workers.iter().enumerate().find_map(|(rank, w)| {
        view.workers
            .get(w)
            .filter(|rec| rec.leaving)
            .map(|_| format!("worker {w} (rank {rank}) is shutting down"))
    })
}

/// Why a ready replica cannot serve, from its workers' registrations: a worker that
/// reports its shard failed, or that is registered without the shard it should hold.
/// (A worker missing from the view is not a verdict: it may be re-registering; the
/// replica's monitor asks it directly.)
fn rank_trouble(view: &ClusterView, r: &ReplicaRecord) -> Option<String> {
    for (rank, w) in r.workers.iter().enumerate() {
        let Some(rec) = view.workers.get(w) else { continue };
        match &rec.assignment {
            Some(a) if a.replica == r.id && a.rank as usize == rank => {
                if a.state != ShardState::Failed {
                    continue;
                }
                // A rank that lost another names that one: the survivor is not to blame.
                if let Some((k, lost)) = a.lost_rank.and_then(|k| Some((k, r.workers.get(k as usize)?))) {
                    return Some(format!(
                        "rank {k} (worker {lost}) was lost: rank {rank} (worker {w}) lost its connection to it ({})",
                        a.error
                    ));
                }
                return Some(format!("rank {rank} (worker {w}) failed: {}", a.error));
            }
            Some(a) => {
                return Some(format!("rank {rank} (worker {w}) now holds rank {} of {}", a.rank, a.replica))
            }
            None => return Some(format!("rank {rank} (worker {w}) holds no shard (restarted?)")),
        }
    }
    None
}

#[cfg(test)]
pub(crate) mod tests;
