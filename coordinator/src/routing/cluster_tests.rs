//! Cluster routing without processes: a registry view made by hand, the router's choices
//! read off it (no replica is dialled: a pick only names one).

use std::collections::BTreeMap;
use std::sync::Arc;

use strata_common::cluster::{Build, DeviceKind, EngineLimits, ModelSpec, ReplicaRecord, ReplicaState};
use strata_common::rollout::Canary;
use strata_common::ReplicaId;
use tokio::sync::watch;

use super::*;
use crate::control::view::ClusterView;
use crate::routing::clients::WorkerClients;
use crate::routing::policy::PolicyKind;

fn spec(generation: u64, replicas: u32) -> ModelSpec {
    ModelSpec {
        name: "m".into(),
        build: Build {
            model_dir: "/models/m".into(),
            dtype: None,
            device: Some(DeviceKind::Cpu),
            tp: 1,
            pp: 1,
            ep: 1,
            limits: EngineLimits { max_num_seqs: 8, max_waiting: 20, ..Default::default() },
            chat: Default::default(),
            quantize: String::new(),
        },
        weight_bytes_per_rank: 0,
        replicas,
        generation,
        created_ms: 0,
        rollout: Default::default(),
    }
}

fn replica(id: &str, generation: u64, state: ReplicaState) -> ReplicaRecord {
    ReplicaRecord {
        id: ReplicaId::new(id),
        model: "m".into(),
        state,
        reason: String::new(),
        workers: vec![format!("w-{id}").into()],
        leader_address: format!("127.0.0.1:1/{id}"),
        generation,
        since_ms: 0,
        created_ms: 0,
    }
}

fn view(spec: ModelSpec, replicas: &[ReplicaRecord], coordinators: usize) -> ClusterView {
    let by_id: BTreeMap<_, _> = replicas.iter().map(|r| (r.id.clone(), r.clone())).collect();
    ClusterView {
        models: [("m".into(), spec)].into(),
        replicas: [("m".into(), by_id)].into(),
        coordinators: (0..coordinators).map(|i| format!("c{i}")).collect(),
        connected: true,
        ..Default::default()
    }
}

fn routes(v: ClusterView, policy: PolicyKind) -> (ClusterRoutes, watch::Sender<Arc<ClusterView>>) {
    let (tx, rx) = watch::channel(Arc::new(v));
    (ClusterRoutes::new("m", rx, Arc::new(WorkerClients::new()), policy), tx)
}

fn picks(r: &ClusterRoutes, revision: u64, exclude: &[&str]) -> Vec<String> {
    let exclude: Vec<String> = exclude.iter().map(|s| s.to_string()).collect();
    let mut seen: Vec<String> = (0..64u32)
        .filter_map(|i| r.pick(&[i, i + 1, i + 2], revision, &exclude).map(|p| p.id().to_string()))
        .collect();
    seen.sort();
    seen.dedup();
    seen
}

#[tokio::test]
async fn requests_go_to_ready_replicas_of_their_revision_and_around_failed_ones() {
    for policy in PolicyKind::ALL {
        let ready = ReplicaState::Ready;
        let v = view(
            spec(2, 2),
            &[
                replica("a", 2, ready),
                replica("b", 2, ready),
                replica("old", 1, ready),
                replica("loading", 2, ReplicaState::Loading),
            ],
            1,
        );
        let (r, _tx) = routes(v, policy);
        assert_eq!(r.ready(), 3);
        // The serving revision has its 2 replicas: the old revision's takes nothing; a
        // loading replica never does.
        assert_eq!(picks(&r, 2, &[]), ["a", "b"], "{policy:?}");
        assert_eq!(picks(&r, 2, &["a"]), ["b"], "{policy:?}: around a replica the request failed on");
        // A replica reported failed is avoided by every request for a while; with the
        // serving revision's replicas all out, any other ready one rather than none.
        r.report_failure("b");
        assert_eq!(picks(&r, 2, &[]), ["a"], "{policy:?}");
        assert_eq!(picks(&r, 2, &["a"]), ["old"], "{policy:?}");
        assert!(picks(&r, 2, &["a", "old"]).is_empty(), "{policy:?}: nothing usable");
    }
}

#[tokio::test]
async fn make_before_break_and_the_canary_take_their_own_requests() {
    let ready = ReplicaState::Ready;
    // A redeploy to generation 3 has one of its two replicas ready: the old revision's
    // keep serving beside it until the new one has them all.
    let v = view(spec(3, 2), &[replica("new", 3, ready), replica("old", 2, ready)], 1);
    let (r, tx) = routes(v, PolicyKind::LeastOutstanding);
    assert_eq!(picks(&r, 3, &[]), ["new", "old"]);
    tx.send(Arc::new(view(
        spec(3, 2),
        &[replica("new", 3, ready), replica("new2", 3, ready), replica("old", 2, ready)],
        1,
    )))
    .unwrap();
    assert_eq!(picks(&r, 3, &[]), ["new", "new2"], "the old revision is out once the new one is whole");

    // A canary at generation 4 with 50% of prompts: requests bound for it go to its
    // replica only, the others never do; prompts split between the two revisions.
    let mut s = spec(3, 1);
    let mut canary = s.revision();
    canary.generation = 4;
    s.rollout.canary = Some(Canary { revision: canary, weight_bp: 5000, replicas: 1 });
    tx.send(Arc::new(view(s, &[replica("stable", 3, ready), replica("canary", 4, ready)], 1))).unwrap();
    assert_eq!(picks(&r, 4, &[]), ["canary"]);
    assert_eq!(picks(&r, 3, &[]), ["stable"]);
    let to_canary = (0..200u32).filter(|i| r.revision_for(&[*i, 7, 7, 7]) == 4).count();
    assert!((40..160).contains(&to_canary), "{to_canary} of 200 prompts to a 50% canary");
    assert_eq!(r.replica_revision("canary"), Some(4));
}

#[tokio::test]
async fn the_gate_is_this_coordinators_share_of_the_ready_replicas_slots() {
    let ready = ReplicaState::Ready;
    let replicas = [replica("a", 1, ready), replica("b", 1, ready), replica("c", 1, ReplicaState::Failed)];
    // 2 ready replicas × 8 sequences and 20 waiting, shared by 3 coordinators (rounded up).
    let (r, tx) = routes(view(spec(1, 3), &replicas, 3), PolicyKind::PrefixAffinity);
    assert_eq!(r.gate_size(), GateSize { slots: 6, queue: 14 });
    // No ready replica: nothing to share; requests wait for one on the request path.
    tx.send(Arc::new(view(spec(1, 3), &replicas[2..], 3))).unwrap();
    assert_eq!(r.gate_size(), GateSize { slots: usize::MAX, queue: usize::MAX });
}

/// Without a ready replica, the routes say where the furthest-along one stands; a model to
/// have none says so without a state.
#[test]
fn an_unready_model_says_where_its_replicas_stand() {
    let pending = |id: &str, since_ms: u64| ReplicaRecord {
        reason: "waiting for 2 free workers (0 free)".into(),
        since_ms,
        ..replica(id, 1, ReplicaState::Pending)
    };
    let v = view(spec(1, 2), &[pending("r1", 1_000), replica("r2", 1, ReplicaState::Ready)], 1);
    assert_eq!(unready(&v, "m"), None);
    let v = view(spec(1, 2), &[pending("r1", 1_000), replica("r2", 1, ReplicaState::Failed)], 1);
    let u = unready(&v, "m").unwrap();
    assert_eq!((u.state, u.since_ms), (Some(ReplicaState::Pending), 1_000));
    assert_eq!(u.describe(13_500), "pending (waiting for 2 free workers (0 free)) for 12s");
    // A loading replica is further along than a pending one: that is what a request waits for.
    let v = view(spec(1, 2), &[pending("r1", 1_000), replica("r2", 1, ReplicaState::Loading)], 1);
    assert_eq!(unready(&v, "m").unwrap().state, Some(ReplicaState::Loading));
    let v = view(spec(1, 0), &[], 1);
    assert_eq!(unready(&v, "m").unwrap().describe(0), "no replica (scaled to 0 replicas)");
    assert_eq!(unready(&v, "other").unwrap().state, None);
    // Deployed and not reconciled yet: pending from now, so requests wait for the placement.
    let v = view(spec(1, 1), &[], 1);
    assert_eq!(unready(&v, "m").unwrap().state, Some(ReplicaState::Pending));
}
