//! The reconciler's policies on hand-built views (no network, no registry).

use strata_common::cluster::{Assignment, Build, Capacity, DeviceKind, EngineLimits, ModelSpec};

use super::*;

fn worker(id: &str) -> WorkerRecord {
    WorkerRecord {
        id: id.into(),
        address: format!("{id}:1"),
        capacity: Capacity {
            device_kind: DeviceKind::Cpu,
            device_count: 1,
            memory_bytes: 1 << 30,
            ..Capacity::default()
        },
        assignment: None,
        started_ms: 0,
        leaving: false,
    }
}

pub(crate) fn spec(name: &str, tp: u32, replicas: u32) -> ModelSpec {
    ModelSpec {
        name: name.into(),
        build: Build {
            model_dir: "/m".into(),
            dtype: None,
            device: None,
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
        created_ms: 0,
        rollout: Default::default(),
    }
}

fn replica(model: &str, id: &str, state: ReplicaState, workers: &[&str], created: u64) -> ReplicaRecord {
    ReplicaRecord {
        id: id.into(),
        model: model.into(),
        state,
        reason: String::new(),
        workers: workers.iter().map(|w| WorkerId::from(*w)).collect(),
        leader_address: String::new(),
        generation: 1,
        since_ms: created,
        created_ms: created,
    }
}

struct V(ClusterView);

impl V {
    fn new() -> Self {
        V(ClusterView::default())
    }
    fn workers(mut self, ids: &[&str]) -> Self {
        for id in ids {
            self.0.workers.insert((*id).into(), worker(id));
        }
        self
    }
    fn model(mut self, s: ModelSpec) -> Self {
        self.0.models.insert(s.name.clone(), s);
        self
    }
    /// Adds a replica and sets its workers' assignments to match.
    fn replica(mut self, r: ReplicaRecord) -> Self {
        for (rank, w) in r.workers.iter().enumerate() {
            if let Some(rec) = self.0.workers.get_mut(w) {
                if r.state != ReplicaState::Pending {
                    rec.assignment = Some(Assignment {
                        replica: r.id.clone(),
                        model: r.model.clone(),
                        rank: rank as u32,
                        state: ShardState::Ready,
                        error: String::new(),
                        lost_rank: None,
                    });
                }
            }
        }
        self.0.replicas.entry(r.model.clone()).or_default().insert(r.id.clone(), r);
        self
    }
}

fn run(view: &ClusterView, inputs: &Inputs<'_>) -> Vec<Action> {
    let mut n = 0;
    plan(view, inputs, &mut |m: &str| {
        n += 1;
        format!("{m}-new{n}").into()
    })
}

fn monitored<'a>(ids: &[&'a str]) -> Inputs<'a> {
    Inputs { monitored: ids.iter().copied().collect(), ..Default::default() }
}

#[test]
fn scale_up_places_new_replicas_on_free_workers_and_waits_for_the_rest() {
    let v = V::new().workers(&["w1", "w2", "w3"]).model(spec("m", 2, 2)).0;
    let a = run(&v, &Inputs::default());
    assert_eq!(
        a,
        vec![
            Action::Assign {
                model: "m".into(),
                id: "m-new1".into(),
                generation: 1,
                workers: vec!["w1".into(), "w2".into()]
            },
            Action::CreatePending {
                model: "m".into(),
                id: "m-new2".into(),
                generation: 1,
                reason: "waiting for 2 free workers (1 free)".into()
            },
        ]
    );
}

#[test]
fn a_pending_replica_gets_workers_when_they_appear() {
    let mut r = replica("m", "m-1", ReplicaState::Pending, &[], 1);
    r.reason = "waiting for 1 free worker (0 free)".into();
    let v = V::new().model(spec("m", 1, 1)).replica(r.clone()).0;
    assert!(run(&v, &Inputs::default()).is_empty(), "nothing to do while no worker is free");
    let v = V::new().workers(&["w9"]).model(spec("m", 1, 1)).replica(r).0;
    assert_eq!(
        run(&v, &Inputs::default()),
        vec![Action::Assign {
            model: "m".into(),
            id: "m-1".into(),
            generation: 1,
            workers: vec!["w9".into()]
        }]
    );
}

#[test]
fn scale_down_drains_the_newest_ready_replicas() {
    let v = V::new()
        .workers(&["w1", "w2", "w3"])
        .model(spec("m", 1, 1))
        .replica(replica("m", "a", ReplicaState::Ready, &["w1"], 1))
        .replica(replica("m", "b", ReplicaState::Ready, &["w2"], 2))
        .replica(replica("m", "c", ReplicaState::Ready, &["w3"], 3))
        .0;
    let a = run(&v, &monitored(&["a", "b", "c"]));
    assert_eq!(
        a,
        vec![
            Action::Drain { model: "m".into(), id: "c".into(), reason: "scaled down".into() },
            Action::Drain { model: "m".into(), id: "b".into(), reason: "scaled down".into() },
        ]
    );
}

#[test]
fn surplus_pending_replicas_go_before_any_ready_one() {
    let v = V::new()
        .workers(&["w1"])
        .model(spec("m", 1, 1))
        .replica(replica("m", "a", ReplicaState::Ready, &["w1"], 1))
        .replica(replica("m", "p", ReplicaState::Pending, &[], 2))
        .0;
    assert_eq!(run(&v, &monitored(&["a"])), vec![Action::Delete { model: "m".into(), id: "p".into() }]);
}

#[test]
fn a_failed_rank_fails_its_replica_and_a_replacement_is_placed() {
    let mut v = V::new()
        .workers(&["w1", "w2", "w3"])
        .model(spec("m", 1, 1))
        .replica(replica("m", "a", ReplicaState::Ready, &["w1"], 1))
        .0;
    v.workers.get_mut("w1").unwrap().assignment.as_mut().unwrap().state = ShardState::Failed;
    v.workers.get_mut("w1").unwrap().assignment.as_mut().unwrap().error = "peer gone".into();
    let a = run(&v, &monitored(&["a"]));
    assert!(
        matches!(&a[0], Action::Fail { id, reason, .. } if id == "a" && reason.contains("peer gone")),
        "{a:?}"
    );
    assert!(
        a.iter().any(|x| matches!(x, Action::Assign { workers, .. } if workers == &["w2".to_string()])),
        "a replacement goes to a free worker at once: {a:?}"
    );
}

/// Probed: after kill -9 of rank 0 the replica's reason blamed the surviving rank 1. A
/// rank that failed for losing another names that one.
#[test]
fn a_rank_that_lost_another_blames_the_one_it_lost() {
    let mut v = V::new()
        .workers(&["w1", "w2"])
        .model(spec("m", 2, 1))
        .replica(replica("m", "a", ReplicaState::Ready, &["w1", "w2"], 1))
        .0;
    let survivor = v.workers.get_mut("w2").unwrap().assignment.as_mut().unwrap();
    survivor.state = ShardState::Failed;
    survivor.error = "lost rank 0: receive from rank 0: early eof".into();
    survivor.lost_rank = Some(0);
    let a = run(&v, &monitored(&["a"]));
    let Action::Fail { reason, .. } = &a[0] else { panic!("{a:?}") };
    assert!(reason.starts_with("rank 0 (worker w1) was lost"), "{reason}");
}

#[test]
fn a_restarted_worker_fails_its_replica_but_a_missing_one_is_left_to_the_monitor() {
    let mut v = V::new()
        .workers(&["w1", "w2"])
        .model(spec("m", 2, 1))
        .replica(replica("m", "a", ReplicaState::Ready, &["w1", "w2"], 1))
        .0;
    v.workers.get_mut("w2").unwrap().assignment = None;
    let a = run(&v, &monitored(&["a"]));
    assert!(matches!(&a[0], Action::Fail { reason, .. } if reason.contains("holds no shard")), "{a:?}");
    // A worker absent from the view may be re-registering: no verdict here.
    v.workers.remove("w2");
    let a = run(&v, &monitored(&["a"]));
    assert!(a.is_empty(), "{a:?}");
}

/// A worker that says it is leaving takes its replica with it as a drain naming it, even
/// when its other rank already holds nothing; nothing new is placed on it.
#[test]
fn a_leaving_worker_drains_its_replica_and_blames_no_rank() {
    let mut v = V::new()
        .workers(&["w1", "w2", "w3"])
        .model(spec("m", 2, 1))
        .replica(replica("m", "a", ReplicaState::Ready, &["w1", "w2"], 1))
        .0;
    v.workers.get_mut("w1").unwrap().leaving = true;
    v.workers.get_mut("w2").unwrap().assignment = None;
    let a = run(&v, &monitored(&["a"]));
    assert!(
        a.iter().any(|x| matches!(x, Action::Drain { id, reason, .. }
            if id.as_str() == "a" && reason.contains("w1") && reason.contains("shutting down"))),
        "{a:?}"
    );
    assert!(!a.iter().any(|x| matches!(x, Action::Fail { .. })), "no rank is blamed: {a:?}");
    // w1 is not free for the replacement.
    assert!(
        !a.iter().any(|x| matches!(x, Action::Assign { workers, .. } if workers.iter().any(|w| w == "w1"))),
        "{a:?}"
    );
}

#[test]
fn failed_replicas_are_torn_down_and_their_workers_freed_after() {
    let v = V::new()
        .workers(&["w1"])
        .model(spec("m", 1, 1))
        .replica(replica("m", "a", ReplicaState::Failed, &["w1"], 1))
        .0;
    let a = run(&v, &Inputs::default());
    assert!(a.contains(&Action::Teardown { model: "m".into(), id: "a".into() }), "{a:?}");
    // w1 still holds the failed shard: not free yet, so the replacement waits.
    assert!(a.iter().any(|x| matches!(x, Action::CreatePending { .. })), "{a:?}");
}

#[test]
fn drained_workers_are_replaced_before_their_replica_is_drained() {
    let mut v = V::new()
        .workers(&["w1", "w2"])
        .model(spec("m", 1, 1))
        .replica(replica("m", "a", ReplicaState::Ready, &["w1"], 1))
        .0;
    v.drained.insert("w1".into());
    let a = run(&v, &monitored(&["a"]));
    assert_eq!(
        a,
        vec![Action::Assign {
            model: "m".into(),
            id: "m-new1".into(),
            generation: 1,
            workers: vec!["w2".into()]
        }],
        "make before break"
    );
    let v2 = V(v).replica(replica("m", "b", ReplicaState::Ready, &["w2"], 2)).0;
    let a = run(&v2, &monitored(&["a", "b"]));
    assert_eq!(
        a,
        vec![Action::Drain {
            model: "m".into(),
            id: "a".into(),
            reason: "a worker was drained; replaced".into()
        }]
    );
}

#[test]
fn undeployed_models_are_drained_and_leftover_shards_released() {
    let mut v = V::new()
        .workers(&["w1", "w2"])
        .replica(replica("gone", "a", ReplicaState::Ready, &["w1"], 1))
        .replica(replica("gone", "p", ReplicaState::Pending, &[], 2))
        .0;
    v.workers.get_mut("w2").unwrap().assignment = Some(Assignment {
        replica: "old".into(),
        model: "x".into(),
        rank: 0,
        state: ShardState::Ready,
        error: String::new(),
        lost_rank: None,
    });
    let a = run(&v, &monitored(&["a"]));
    assert_eq!(
        a,
        vec![
            Action::Release { worker: "w2".into(), replica: "old".into() },
            Action::Drain { model: "gone".into(), id: "a".into(), reason: "model undeployed".into() },
            Action::Delete { model: "gone".into(), id: "p".into() },
        ]
    );
}

#[test]
fn work_nobody_is_doing_is_resumed_and_busy_replicas_are_left_alone() {
    let v = V::new()
        .workers(&["w1", "w2", "w3"])
        .model(spec("m", 1, 3))
        .replica(replica("m", "l", ReplicaState::Loading, &["w1"], 1))
        .replica(replica("m", "r", ReplicaState::Ready, &["w2"], 2))
        .replica(replica("m", "d", ReplicaState::Draining, &["w3"], 3))
        .0;
    let a = run(&v, &Inputs::default());
    assert!(a.contains(&Action::Build { model: "m".into(), id: "l".into() }), "{a:?}");
    assert!(a.contains(&Action::Monitor { model: "m".into(), id: "r".into() }), "{a:?}");
    assert!(a.iter().any(|x| matches!(x, Action::Drain { id, .. } if id == "d")), "{a:?}");
    let busy = Inputs {
        busy: ["l", "d"].into_iter().collect(),
        monitored: ["r"].into_iter().collect(),
        ..Default::default()
    };
    let a = run(&v, &busy);
    assert!(a.iter().all(|x| matches!(x, Action::CreatePending { .. })), "{a:?}");
}

#[test]
fn failing_models_back_off() {
    let v = V::new().workers(&["w1"]).model(spec("m", 1, 1)).0;
    let inputs = Inputs {
        backoff: [(("m", 1), "retrying in 4 s".to_string())].into_iter().collect(),
        ..Default::default()
    };
    assert_eq!(
        run(&v, &inputs),
        vec![Action::CreatePending {
            model: "m".into(),
            id: "m-new1".into(),
            generation: 1,
            reason: "retrying in 4 s".into()
        }]
    );
}

/// Revision 1 serving on two ready replicas (w1, w2), revision 2 in canary with one
/// replica; w3 and w4 free.
fn rollout() -> (ModelSpec, V) {
    let mut s = spec("m", 1, 2);
    let next = strata_common::rollout::Revision::of(Build { model_dir: "/m2".into(), ..s.build.clone() }, 0);
    s.start_canary(next, 1000, 1).unwrap();
    let v = V::new()
        .workers(&["w1", "w2", "w3", "w4"])
        .model(s.clone())
        .replica(replica("m", "a", ReplicaState::Ready, &["w1"], 1))
        .replica(replica("m", "b", ReplicaState::Ready, &["w2"], 2));
    (s, v)
}

fn of_generation(mut r: ReplicaRecord, generation: u64) -> ReplicaRecord {
    r.generation = generation;
    r
}

#[test]
fn a_canary_is_built_beside_the_serving_revision() {
    let (_, v) = rollout();
    let a = run(&v.0, &monitored(&["a", "b"]));
    assert_eq!(
        a,
        vec![Action::Assign {
            model: "m".into(),
            id: "m-new1".into(),
            generation: 2,
            workers: vec!["w3".into()]
        }],
        "the serving replicas stay"
    );
    // Once it is ready nothing changes: both revisions serve.
    let (_, v) = rollout();
    let v = v.replica(of_generation(replica("m", "c", ReplicaState::Ready, &["w3"], 3), 2)).0;
    assert!(run(&v, &monitored(&["a", "b", "c"])).is_empty());
}

#[test]
fn a_rolled_back_canary_drains_at_once() {
    let (mut s, v) = rollout();
    s.rollback().unwrap();
    let v = v.model(s).replica(of_generation(replica("m", "c", ReplicaState::Ready, &["w3"], 3), 2)).0;
    assert_eq!(
        run(&v, &monitored(&["a", "b", "c"])),
        vec![Action::Drain {
            model: "m".into(),
            id: "c".into(),
            reason: "the model's spec changed; replaced".into()
        }]
    );
}

#[test]
fn a_promoted_canary_scales_up_before_the_old_revision_drains() {
    let (mut s, v) = rollout();
    s.promote().unwrap();
    let v = v.model(s).replica(of_generation(replica("m", "c", ReplicaState::Ready, &["w3"], 3), 2));
    let a = run(&v.0, &monitored(&["a", "b", "c"]));
    assert_eq!(
        a,
        vec![Action::Assign {
            model: "m".into(),
            id: "m-new1".into(),
            generation: 2,
            workers: vec!["w4".into()]
        }],
        "make before break: the old revision keeps serving"
    );
    let v = v.replica(of_generation(replica("m", "d", ReplicaState::Ready, &["w4"], 4), 2)).0;
    let a = run(&v, &monitored(&["a", "b", "c", "d"]));
    let drained: Vec<&str> = a
        .iter()
        .filter_map(|x| if let Action::Drain { id, .. } = x { Some(id.as_str()) } else { None })
        .collect();
    assert_eq!(drained, ["a", "b"], "{a:?}");
}

#[test]
fn a_canary_that_cannot_load_backs_off_alone() {
    let (_, v) = rollout();
    let inputs = Inputs {
        backoff: [(("m", 2), "loading failed".to_string())].into_iter().collect(),
        monitored: ["a"].into_iter().collect(),
        ..Default::default()
    };
    let v = v.0;
    let mut v2 = v.clone();
    v2.replicas.get_mut("m").unwrap().remove("b");
    let a = run(&v2, &inputs);
    assert!(
        a.iter().any(|x| matches!(x, Action::Assign { generation: 1, .. })),
        "the serving revision still gets its replacement: {a:?}"
    );
    assert!(
        a.iter().any(
            |x| matches!(x, Action::CreatePending { generation: 2, reason, .. } if reason == "loading failed")
        ),
        "{a:?}"
    );
}

#[test]
fn rolling_back_a_promotion_reuses_the_old_replicas_while_they_exist() {
    let (mut s, v) = rollout();
    s.promote().unwrap();
    // Promoted, the old replicas not yet drained (the new revision has one of two ready).
    s.rollback().unwrap();
    assert_eq!(s.generation, 1);
    let v = v.model(s).replica(of_generation(replica("m", "c", ReplicaState::Ready, &["w3"], 3), 2)).0;
    assert_eq!(
        run(&v, &monitored(&["a", "b", "c"])),
        vec![Action::Drain {
            model: "m".into(),
            id: "c".into(),
            reason: "the model's spec changed; replaced".into()
        }],
        "revision 1's replicas serve again as they are; nothing is rebuilt"
    );
}
