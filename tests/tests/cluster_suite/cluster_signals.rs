//! What the cluster says about itself when things go away, with real processes: a worker
//! shut down with SIGTERM takes its replica with it as a drain that blames no rank and is
//! listed as `left`; one killed with SIGKILL is listed as `lost`; a model whose replicas
//! wait for workers is refused at once, naming why; and while etcd is down the admin CLI
//! says its view is stale and a refused write is one line.

use std::time::{Duration, Instant};

use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::cluster::{eventually, Cluster, Timing};
use strata_tests::{fixtures_dir, strata_bin, token_request};
use tonic::transport::Channel;

async fn admin(endpoint: &str) -> AdminClient<Channel> {
    AdminClient::connect(endpoint.to_string()).await.expect("connect admin")
}

async fn replicas(endpoint: &str, model: &str) -> Vec<apb::ReplicaStatus> {
    let req = apb::ListReplicasRequest { name: model.into() };
    admin(endpoint).await.list_replicas(req).await.map(|r| r.into_inner().replicas).unwrap_or_default()
}

async fn worker_state(endpoint: &str, id: &str) -> Option<apb::WorkerStatus> {
    let ws = admin(endpoint).await.list_workers(apb::ListWorkersRequest {}).await.ok()?.into_inner().workers;
    ws.into_iter().find(|w| w.id == id)
}

fn deploy(name: &str, tp: u32) -> apb::DeployModelRequest {
    apb::DeployModelRequest {
        name: name.into(),
        model_dir: fixtures_dir().join("llama_gqa").to_string_lossy().into_owned(),
        tp,
        pp: 1,
        replicas: 1,
        ..Default::default()
    }
}

/// `strata admin --endpoint E ARGS`: (success, stdout, stderr).
fn admin_cli(endpoint: &str, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(strata_bin())
        .args(["admin", "--endpoint", endpoint])
        .args(args)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

#[tokio::test(flavor = "multi_thread")]
async fn departures_outages_and_pending_models_are_reported_as_they_are() {
    let mut cluster = Cluster::start(1, 3, Timing::default());
    let a = cluster.coordinators[0].endpoint();
    cluster.deploy_ready("gqa", &deploy("gqa", 2).model_dir, 2, 1, Duration::from_secs(60)).await;
    // Two more ranks with one worker free: pending (placed after gqa, by name, when
    // workers free up).
    admin(&a).await.deploy_model(deploy("wide", 2)).await.unwrap();
    let pending_since = Instant::now();

    // SIGTERM rank 0: the replica is drained (nobody blamed) and rebuilt on the rest.
    let old = replicas(&a, "gqa").await.into_iter().next().unwrap();
    let leader = old.workers[0].clone();
    cluster.worker(&leader).signal("TERM");
    // Polled rather than awaited once: a failed record would show for the coordinator's
    // failed retention (3 s here), and the poll is 100 ms.
    let deadline = Instant::now() + Duration::from_secs(60);
    let rebuilt = loop {
        let rs = replicas(&a, "gqa").await;
        let failed: Vec<_> = rs.iter().filter(|r| r.state == apb::ReplicaState::Failed as i32).collect();
        assert!(failed.is_empty(), "a graceful exit failed a replica: {failed:?}");
        let ready =
            rs.iter().find(|r| r.state == apb::ReplicaState::Ready as i32 && !r.workers.contains(&leader));
        if let Some(r) = ready {
            break r.clone();
        }
        assert!(Instant::now() < deadline, "gqa was not rebuilt without the worker that left: {rs:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_ne!(rebuilt.id, old.id);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = cluster.worker_mut(&leader).child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the worker did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(status.success(), "SIGTERM is a clean exit: {status:?}");
    let left = eventually("the worker listed as left", Duration::from_secs(10), || async {
        worker_state(&a, &leader).await.filter(|w| w.state == "left")
    })
    .await;
    assert!(left.state_since_ms > 0 && left.reason.contains("shut down"), "{left:?}");

    // SIGKILL another: listed as lost once its lease runs out.
    let victim = rebuilt.workers[1].clone();
    cluster.worker_mut(&victim).kill();
    let lost = eventually("the killed worker listed as lost", Duration::from_secs(20), || async {
        worker_state(&a, &victim).await.filter(|w| w.state == "lost")
    })
    .await;
    assert!(lost.reason.contains("lease"), "{lost:?}");
    // A lost worker holds nothing: it is not listed with the shard it held when it died.
    assert!(lost.replica.is_empty() && lost.shard_state.is_empty(), "{lost:?}");
    let (ok, out, _) = admin_cli(&a, &["workers"]);
    assert!(ok && out.contains("lost") && out.contains("left"), "{out}");

    // The pending model: refused at once (once it has waited out the grace), naming why.
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(pending_since.elapsed())).await;
    let mut c = InferenceClient::connect(a.clone()).await.unwrap();
    let started = Instant::now();
    let e = c.generate(token_request("wide", vec![1, 2, 3], 2)).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2), "waited {:?}", started.elapsed());
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("pending") && e.message().contains("waiting for 2 free"), "{}", e.message());

    // etcd away: listings say they are stale; a write is refused in one line.
    cluster.etcd.stop();
    let (_, _, stderr) =
        eventually("the admin CLI says the view is stale", Duration::from_secs(20), || async {
            let r = admin_cli(&a, &["workers"]);
            r.2.contains("stale").then_some(r)
        })
        .await;
    assert!(stderr.contains("registry"), "{stderr}");
    let (ok, _, stderr) = admin_cli(&a, &["scale", "--name", "gqa", "--replicas", "2"]);
    assert!(!ok, "a write without etcd cannot succeed");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(!stderr.contains("metadata") && !stderr.contains("Status {"), "{stderr}");
    cluster.etcd.resume();
}

/// Probed: after kill -9 of rank 0 the replica's reason blamed the surviving rank, whose
/// link to rank 0 broke first. The survivor now says which rank it lost, and that one is
/// named.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_rank_0_is_the_rank_blamed() {
    let mut cluster = Cluster::start(1, 2, Timing::default());
    let a = cluster.coordinators[0].endpoint();
    cluster.deploy_ready("gqa", &deploy("gqa", 2).model_dir, 2, 1, Duration::from_secs(60)).await;
    let r = replicas(&a, "gqa").await.into_iter().next().unwrap();
    let (leader, survivor) = (r.workers[0].clone(), r.workers[1].clone());
    cluster.worker_mut(&leader).kill();
    let failed = eventually("the replica fails", Duration::from_secs(20), || {
        let (a, id) = (a.clone(), r.id.clone());
        async move {
            let rs = replicas(&a, "gqa").await;
            rs.into_iter().find(|x| x.id == id && x.state == apb::ReplicaState::Failed as i32)
        }
    })
    .await;
    assert!(failed.reason.starts_with(&format!("rank 0 (worker {leader})")), "{failed:?}");
    assert!(
        !failed.reason.contains(&format!("worker {survivor}) failed")),
        "the survivor blamed: {failed:?}"
    );
}
