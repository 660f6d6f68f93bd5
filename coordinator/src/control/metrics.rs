//! What a coordinator measures of the cluster: replicas by model and state, workers by
//! state, whether it reaches the registry and whether it leads (gauges, from its view of
//! the registry), and counters of canary failures, replica builds, admin actions and
//! leadership changes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use strata_common::cluster::{ReplicaState, ShardState};
use strata_common::metrics::register;
use tokio::sync::watch;

use super::view::ClusterView;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaLabels {
    model: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    model: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: String,
    outcome: &'static str,
}

struct ControlMetrics {
    replicas: Family<ReplicaLabels, Gauge>,
    workers: Family<StateLabel, Gauge>,
    models: Gauge,
    registry_connected: Gauge,
    leader: Gauge,
    canary_failures: Family<ModelLabel, Counter>,
    replica_builds: Family<OutcomeLabels, Counter>,
    admin_actions: Family<ActionLabels, Counter>,
    leader_elections: Counter,
    /// The replica label sets last written, to remove those of models that went away.
    replica_series: Mutex<BTreeSet<(String, &'static str)>>,
}

const REPLICA_STATES: [ReplicaState; 5] = [
    ReplicaState::Pending,
    ReplicaState::Loading,
    ReplicaState::Ready,
    ReplicaState::Draining,
    ReplicaState::Failed,
];

const WORKER_STATES: [&str; 5] = ["idle", "loading", "ready", "failed", "drained"];

fn metrics() -> &'static ControlMetrics {
    static METRICS: OnceLock<ControlMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let m = ControlMetrics {
            replicas: Family::default(),
            workers: Family::default(),
            models: Gauge::default(),
            registry_connected: Gauge::default(),
            leader: Gauge::default(),
            canary_failures: Family::default(),
            replica_builds: Family::default(),
            admin_actions: Family::default(),
            leader_elections: Counter::default(),
            replica_series: Mutex::new(BTreeSet::new()),
        };
        register(
            "cluster_replicas",
            "Replicas by model and state, as this coordinator sees them",
            m.replicas.clone(),
        );
        register(
            "cluster_workers",
            "Registered workers by state (idle, loading, ready, failed, drained)",
            m.workers.clone(),
        );
        register("cluster_models", "Models deployed", m.models.clone());
        register(
            "registry_connected",
            "1 while the last contact with the registry (etcd) succeeded",
            m.registry_connected.clone(),
        );
        register("coordinator_leader", "1 while this coordinator is the leader", m.leader.clone());
        register("canary_failures", "Canaries that failed or timed out, by model", m.canary_failures.clone());
        register(
            "replica_builds",
            "Replica builds by model and outcome (ready, failed)",
            m.replica_builds.clone(),
        );
        register(
            "admin_actions",
            "Audited admin calls by action and outcome (ok, error)",
            m.admin_actions.clone(),
        );
        register("leader_elections", "Times this coordinator became the leader", m.leader_elections.clone());
        let (canaries, builds) = (m.canary_failures.clone(), m.replica_builds.clone());
        strata_common::metrics::on_forget_model(move |model| {
            canaries.remove(&ModelLabel { model: model.to_string() });
            for outcome in ["ready", "failed"] {
                builds.remove(&OutcomeLabels { model: model.to_string(), outcome });
            }
        });
        m
    })
}

/// Sets the gauges from `view`, as coordinator `me` sees it.
pub fn observe_view(view: &ClusterView, me: &str) {
    let m = metrics();
    let mut replicas: BTreeMap<(&str, &'static str), i64> = BTreeMap::new();
    for (model, rs) in &view.replicas {
        for state in REPLICA_STATES {
            replicas.insert((model.as_str(), state.as_str()), 0);
        }
        for r in rs.values() {
            *replicas.entry((model.as_str(), r.state.as_str())).or_default() += 1;
        }
    }
    // Every state of a present model is written; models that went away leave the family.
    let mut series = m.replica_series.lock().unwrap_or_else(|p| p.into_inner());
    let now: BTreeSet<(String, &'static str)> = replicas.keys().map(|(m, s)| (m.to_string(), *s)).collect();
    for (model, state) in series.difference(&now) {
        m.replicas.remove(&ReplicaLabels { model: model.clone(), state });
    }
    for ((model, state), n) in replicas {
        m.replicas.get_or_create(&ReplicaLabels { model: model.to_string(), state }).set(n);
    }
    *series = now;
    drop(series);
    let mut workers: BTreeMap<&'static str, i64> = WORKER_STATES.iter().map(|s| (*s, 0)).collect();
    for (id, w) in &view.workers {
        let state = match (&w.assignment, view.drained.contains(id)) {
            (_, true) => "drained",
            (None, false) => "idle",
            (Some(a), false) => match a.state {
                ShardState::Loading => "loading",
                ShardState::Ready => "ready",
                ShardState::Failed => "failed",
            },
        };
        *workers.entry(state).or_default() += 1;
    }
    for (state, n) in workers {
        m.workers.get_or_create(&StateLabel { state }).set(n);
    }
    m.models.set(view.models.len() as i64);
    m.registry_connected.set(i64::from(view.connected));
    m.leader.set(i64::from(view.leader.as_deref() == Some(me)));
}

/// Keeps the gauges current until the view's sender goes.
pub async fn follow(mut view: watch::Receiver<Arc<ClusterView>>, me: String) {
    loop {
        observe_view(&view.borrow_and_update(), &me);
        if view.changed().await.is_err() {
            return;
        }
    }
}

pub fn canary_failed(model: &str) {
    metrics().canary_failures.get_or_create(&ModelLabel { model: model.to_string() }).inc();
}

pub fn replica_built(model: &str, ok: bool) {
    let outcome = if ok { "ready" } else { "failed" };
    let m = metrics();
    m.replica_builds.get_or_create(&OutcomeLabels { model: model.to_string(), outcome }).inc();
    // Present (at zero) once a model has a replica, before the first canary fails.
    m.canary_failures.get_or_create(&ModelLabel { model: model.to_string() }).inc_by(0);
}

pub fn admin_action(action: &str, ok: bool) {
    let outcome = if ok { "ok" } else { "error" };
    metrics().admin_actions.get_or_create(&ActionLabels { action: action.to_string(), outcome }).inc();
}

pub fn elected() {
    metrics().leader_elections.inc();
}
