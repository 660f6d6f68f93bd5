//! Placement by device in a real cluster (etcd, `strata coordinator`, `strata worker`
//! processes): workers report their device, memory and machine; a deployment names its
//! device kind; ranks go only to workers of that kind with room for their shard and KV
//! cache, and a replica that cannot be placed says why. Only CPU workers can run here, so
//! a `cuda` deployment must stay pending — on a cluster with GPU workers the same rule
//! places it (the planner's unit tests cover mixed kinds and GPU memory).

use std::time::Duration;

use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_tests::cluster::{eventually, Cluster, Timing};
use strata_tests::fixtures_dir;
use tonic::transport::Channel;

async fn admin(endpoint: &str) -> AdminClient<Channel> {
    AdminClient::connect(endpoint.to_string()).await.expect("connect admin")
}

fn deploy(name: &str, tp: u32, device: &str, kv_cache_bytes: u64) -> apb::DeployModelRequest {
    apb::DeployModelRequest {
        name: name.into(),
        model_dir: fixtures_dir().join("llama_gqa").to_string_lossy().into_owned(),
        tp,
        pp: 1,
        replicas: 1,
        device: device.into(),
        scheduler: Some(apb::SchedulerLimits { kv_cache_bytes, ..Default::default() }),
        ..Default::default()
    }
}

/// The replicas of `model` once one is in `state` with a reason containing `reason`.
async fn replica_in(
    endpoint: &str,
    model: &str,
    state: apb::ReplicaState,
    reason: &str,
) -> apb::ReplicaStatus {
    eventually(&format!("{model} {state:?} ({reason})"), Duration::from_secs(30), || async {
        let mut a = admin(endpoint).await;
        let rs = a.list_replicas(apb::ListReplicasRequest { name: model.into() }).await.ok()?.into_inner();
        rs.replicas.into_iter().find(|r| r.state == state as i32 && r.reason.contains(reason))
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn ranks_go_to_workers_of_the_right_device_with_room_and_tp_groups_share_a_machine() {
    let mut cluster = Cluster::start(1, 0, Timing::default());
    for node in ["rack-a", "rack-b", "rack-a"] {
        cluster.add_worker(&["--node", node], None);
    }
    let a = cluster.coordinators[0].endpoint();
    let workers = eventually("three workers registered", Duration::from_secs(30), || async {
        let ws = admin(&a).await.list_workers(apb::ListWorkersRequest {}).await.ok()?.into_inner().workers;
        (ws.len() == 3 && ws.iter().all(|w| w.state == "up")).then_some(ws)
    })
    .await;
    for w in &workers {
        assert_eq!((w.device_kind.as_str(), w.device_count), ("cpu", 1), "{w:?}");
        assert!(w.memory_bytes > 0 && w.memory_total_bytes >= w.memory_bytes, "{w:?}");
        assert_eq!(w.kv_cache_bytes, 64 << 20, "the worker's --kv-cache-memory: {w:?}");
    }
    let node = |id: &str| workers.iter().find(|w| w.id == id).map(|w| w.node.clone()).unwrap();
    assert_eq!((node("w0"), node("w1"), node("w2")), ("rack-a".into(), "rack-b".into(), "rack-a".into()));

    // A cuda deployment on CPU workers waits, and says for what. The coordinator read the
    // model's config.json: one rank holds the whole checkpoint (541,952 bytes).
    let m = admin(&a).await.deploy_model(deploy("on-gpu", 1, "cuda", 0)).await.unwrap().into_inner();
    let m = m.model.unwrap();
    assert_eq!((m.device.as_str(), m.weight_bytes_per_rank), ("cuda", 541_952));
    let r = replica_in(&a, "on-gpu", apb::ReplicaState::Pending, "cuda").await;
    assert_eq!(
        r.reason,
        "waiting for 1 free cuda worker with ≥ 0.5 MiB free besides their KV cache \
         (3 free: 0 fit, 3 of another kind (cpu))"
    );

    // A KV cache no worker has room for: pending, for memory.
    admin(&a).await.deploy_model(deploy("too-big", 1, "cpu", 1 << 50)).await.unwrap();
    let r = replica_in(&a, "too-big", apb::ReplicaState::Pending, "memory").await;
    assert!(r.reason.contains("(3 free: 0 fit, 3 with too little memory)"), "{}", r.reason);

    // No device named: the coordinator's default (cpu). TP=2 goes to the one machine with
    // two free workers.
    let m = admin(&a).await.deploy_model(deploy("tp2", 2, "", 0)).await.unwrap().into_inner().model.unwrap();
    assert_eq!(m.device, "cpu");
    let r = replica_in(&a, "tp2", apb::ReplicaState::Ready, "").await;
    let mut ranks = r.workers.clone();
    ranks.sort();
    assert_eq!(ranks, ["w0", "w2"], "both ranks on rack-a");
    // The others still wait; their reasons now count the two busy workers out.
    let r = replica_in(&a, "on-gpu", apb::ReplicaState::Pending, "(1 free: 0 fit").await;
    assert!(r.reason.ends_with("1 of another kind (cpu))"), "{}", r.reason);

    // A bad device is refused naming the field.
    let e = admin(&a).await.deploy_model(deploy("bad", 1, "tpu", 0)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("device"), "{e:?}");
}
