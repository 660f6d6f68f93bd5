//! The reconciler's decisions, as a pure function of the cluster view.
//!
//! [`plan`] compares desired state (model specs) with actual state (replica records,
//! worker registrations) and returns [`Action`]s; the leader's driver carries them out
//! (registry writes, worker.v1 calls, long-running build/drain tasks) and the next view
//! shows the result. Nothing here does I/O, so every policy is unit-tested:
//!
//! - **scale up**: missing replicas become `pending` records; a pending replica gets
//!   `tp × pp` free workers as soon as there are that many (oldest pending first), else
//!   its reason says how many it waits for;
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

use std::collections::{BTreeMap, HashMap, HashSet};

use strata_common::cluster::{ReplicaRecord, ReplicaState, ShardState, WorkerRecord};

use super::view::ClusterView;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A new replica record, pending.
    CreatePending { model: String, id: String, generation: u64, reason: String },
    /// Give a pending (or new) replica its workers (rank order) and build it.
    Assign { model: String, id: String, workers: Vec<String> },
    /// A pending replica keeps waiting, for this reason.
    Wait { model: String, id: String, reason: String },
    /// Go on building a loading replica (nobody is: e.g. a new leader took over).
    Build { model: String, id: String },
    /// Watch a ready replica's health.
    Monitor { model: String, id: String },
    /// No new requests; unload once in-flight ones finish.
    Drain { model: String, id: String, reason: String },
    /// Mark failed and tear down.
    Fail { model: String, id: String, reason: String },
    /// Unload a failed replica's ranks and forget it after the retention time.
    Teardown { model: String, id: String },
    /// Forget a replica record (a pending replica no longer needed).
    Delete { model: String, id: String },
    /// Tell a worker to drop a shard of a replica that no longer exists.
    Release { worker: String, replica: String },
}

/// What the driver knows besides the view.
#[derive(Debug, Default)]
pub struct Inputs<'a> {
    /// Replicas with a build, drain or teardown task in flight.
    pub busy: HashSet<&'a str>,
    /// Ready replicas with a health monitor running.
    pub monitored: HashSet<&'a str>,
    /// Models whose next build must wait (failures backing off): model → reason.
    pub backoff: HashMap<&'a str, String>,
    /// Workers with a release in flight.
    pub releasing: HashSet<&'a str>,
}

/// A fresh replica id for `model` (the driver supplies the randomness).
pub type NewId<'a> = &'a mut dyn FnMut(&str) -> String;

pub fn plan(view: &ClusterView, inputs: &Inputs<'_>, new_id: NewId<'_>) -> Vec<Action> {
    let mut out = Vec::new();
    let empty = BTreeMap::new();
    // Workers that are taken: listed by a replica that is not failed, or still holding a shard.
    let mut reserved: HashSet<&str> = HashSet::new();
    for r in view.all_replicas() {
        if r.state != ReplicaState::Failed {
            reserved.extend(r.workers.iter().map(String::as_str));
        }
    }
    let mut free: Vec<&WorkerRecord> = view
        .workers
        .values()
        .filter(|w| !reserved.contains(w.id.as_str()))
        .filter(|w| w.assignment.is_none())
        .filter(|w| !view.drained.contains(&w.id))
        .collect();
    // Most memory first, then by id: deterministic.
    free.sort_by(|a, b| b.capacity.memory_bytes.cmp(&a.capacity.memory_bytes).then(a.id.cmp(&b.id)));
    let mut free: Vec<&str> = free.into_iter().map(|w| w.id.as_str()).collect();

    // Leftover shards.
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

    let mut names: Vec<&String> = view.models.keys().chain(view.replicas.keys()).collect();
    names.sort();
    names.dedup();
    for name in names {
        let recs = view.replicas.get(name).unwrap_or(&empty);
        let mut recs: Vec<&ReplicaRecord> = recs.values().collect();
        recs.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
        let busy = |r: &ReplicaRecord| inputs.busy.contains(r.id.as_str());
        let m = name.clone();

        // Failures the view already shows.
        let mut failed_now: HashSet<&str> = HashSet::new();
        for r in recs.iter().filter(|r| r.state == ReplicaState::Ready && !busy(r)) {
            if let Some(reason) = rank_trouble(view, r) {
                out.push(Action::Fail { model: m.clone(), id: r.id.clone(), reason });
                failed_now.insert(&r.id);
            }
        }
        // Work in progress that nobody is doing.
        for r in recs.iter().filter(|r| !busy(r) && !failed_now.contains(r.id.as_str())) {
            match r.state {
                ReplicaState::Loading => out.push(Action::Build { model: m.clone(), id: r.id.clone() }),
                ReplicaState::Ready if !inputs.monitored.contains(r.id.as_str()) => {
                    out.push(Action::Monitor { model: m.clone(), id: r.id.clone() })
                }
                ReplicaState::Draining => {
                    out.push(Action::Drain { model: m.clone(), id: r.id.clone(), reason: r.reason.clone() })
                }
                ReplicaState::Failed => out.push(Action::Teardown { model: m.clone(), id: r.id.clone() }),
                _ => {}
            }
        }

        let Some(spec) = view.models.get(name) else {
            // Undeployed: everything goes.
            for r in recs.iter().filter(|r| !busy(r)) {
                match r.state {
                    ReplicaState::Pending => out.push(Action::Delete { model: m.clone(), id: r.id.clone() }),
                    ReplicaState::Loading | ReplicaState::Ready if !failed_now.contains(r.id.as_str()) => out
                        .push(Action::Drain {
                            model: m.clone(),
                            id: r.id.clone(),
                            reason: "model undeployed".into(),
                        }),
                    _ => {}
                }
            }
            continue;
        };
        let world = spec.world();
        let on_drained = |r: &ReplicaRecord| r.workers.iter().any(|w| view.drained.contains(w));
        let stale = |r: &ReplicaRecord| r.generation != spec.generation;
        let live: Vec<&ReplicaRecord> = recs
            .iter()
            .copied()
            .filter(|r| r.state.is_live() && !failed_now.contains(r.id.as_str()))
            .collect();
        let (keep, moving): (Vec<&ReplicaRecord>, Vec<&ReplicaRecord>) =
            live.iter().copied().partition(|r| !on_drained(r) && !stale(r));
        // Replicas that must move: not-yet-ready ones go now, ready ones once replaced.
        let ready_kept = keep.iter().filter(|r| r.state == ReplicaState::Ready).count();
        for r in moving.iter().filter(|r| !busy(r)) {
            let why = if on_drained(r) { "a worker was drained" } else { "the model's spec changed" };
            match r.state {
                ReplicaState::Pending => out.push(Action::Delete { model: m.clone(), id: r.id.clone() }),
                ReplicaState::Loading => {
                    out.push(Action::Drain { model: m.clone(), id: r.id.clone(), reason: why.into() })
                }
                _ if ready_kept >= spec.replicas as usize => out.push(Action::Drain {
                    model: m.clone(),
                    id: r.id.clone(),
                    reason: format!("{why}; replaced"),
                }),
                _ => {}
            }
        }
        let desired = spec.replicas as usize;
        // (id, current reason, exists): pending replicas to place, oldest first.
        let mut to_place: Vec<(String, String, bool)> = keep
            .iter()
            .filter(|r| r.state == ReplicaState::Pending)
            .map(|r| (r.id.clone(), r.reason.clone(), true))
            .collect();
        if keep.len() > desired {
            // Surplus: pending first, then loading, then the newest ready.
            let mut order: Vec<&ReplicaRecord> = Vec::new();
            order.extend(keep.iter().rev().filter(|r| r.state == ReplicaState::Pending));
            order.extend(keep.iter().rev().filter(|r| r.state == ReplicaState::Loading && !busy(r)));
            order.extend(keep.iter().rev().filter(|r| r.state == ReplicaState::Ready));
            for r in order.into_iter().take(keep.len() - desired) {
                if r.state == ReplicaState::Pending {
                    out.push(Action::Delete { model: m.clone(), id: r.id.clone() });
                    to_place.retain(|p| p.0 != r.id);
                } else {
                    out.push(Action::Drain {
                        model: m.clone(),
                        id: r.id.clone(),
                        reason: "scaled down".into(),
                    });
                }
            }
        } else {
            for _ in keep.len()..desired {
                to_place.push((new_id(name), String::new(), false));
            }
        }
        for (id, current, exists) in to_place {
            let reason = match inputs.backoff.get(name.as_str()) {
                Some(why) => why.clone(),
                None if free.len() >= world => {
                    let workers: Vec<String> = free.drain(..world).map(str::to_string).collect();
                    out.push(Action::Assign { model: m.clone(), id, workers });
                    continue;
                }
                None => format!(
                    "waiting for {world} free worker{} ({} free)",
                    if world == 1 { "" } else { "s" },
                    free.len()
                ),
            };
            if !exists {
                out.push(Action::CreatePending { model: m.clone(), id, generation: spec.generation, reason });
            } else if current != reason {
                out.push(Action::Wait { model: m.clone(), id, reason });
            }
        }
    }
    // A replica being drained or failed needs no monitor.
    let ending: HashSet<String> = out
        .iter()
        .filter_map(|a| match a {
            Action::Drain { id, .. } | Action::Fail { id, .. } => Some(id.clone()),
            _ => None,
        })
        .collect();
    out.retain(|a| !matches!(a, Action::Monitor { id, .. } if ending.contains(id)));
    out
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
                if a.state == ShardState::Failed {
                    return Some(format!("rank {rank} (worker {w}) failed: {}", a.error));
                }
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
mod tests;
