//! Cluster mode end to end: a real etcd, `strata coordinator` and `strata worker --etcd`
//! processes on free loopback ports, driven through the admin and inference APIs.
//!
//! Failures are real: workers and coordinators are killed with SIGKILL or paused with
//! SIGSTOP, and etcd is stopped and restarted. Every test checks that no request lost or
//! repeated a token: each stream's tokens equal the greedy reference computed in-process
//! from the same model files.
//!
//! Each test owns its etcd, processes and ports, so they run side by side like any others.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_common::{Parallelism, SamplingParams};
use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_proto::worker::v1 as wpb;
use strata_proto::worker::v1::worker_client::WorkerClient;
use strata_tests::cluster::{eventually, Cluster, Timing};
use strata_tests::{fixtures_dir, write_slow_model};
use tonic::transport::Channel;
use tonic::Code;

fn fixture(name: &str) -> String {
    fixtures_dir().join(name).to_string_lossy().to_string()
}

async fn admin(endpoint: &str) -> AdminClient<Channel> {
    AdminClient::connect(endpoint.to_string()).await.expect("connect admin")
}

async fn inference(endpoint: &str) -> InferenceClient<Channel> {
    InferenceClient::connect(endpoint.to_string()).await.expect("connect inference")
}

fn deploy_req(name: &str, dir: &str, tp: u32, replicas: u32) -> apb::DeployModelRequest {
    apb::DeployModelRequest {
        name: name.into(),
        model_dir: dir.into(),
        tp,
        pp: 1,
        replicas,
        ..Default::default()
    }
}

use strata_tests::token_request as gen_req;

/// Greedy continuations computed in-process from the same files (one rank).
fn reference(dir: &Path, prompts: &[Vec<u32>], n: u32) -> Vec<Vec<u32>> {
    let config = strata_engine::EngineConfig { kv_cache_bytes: 64 << 20, ..Default::default() };
    let mut e = strata_engine::replica::local_replica(dir, Parallelism::NONE, &config).unwrap();
    let mut out = vec![Vec::new(); prompts.len()];
    for (i, p) in prompts.iter().enumerate() {
        e.add(
            strata_engine::SeqId(i as u64),
            p.clone(),
            SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() },
        )
        .unwrap();
    }
    while e.has_work() {
        for ev in e.step().unwrap() {
            out[ev.seq.0 as usize].push(ev.token);
        }
    }
    out
}

fn prompts(n: usize, vocab: u32) -> Vec<Vec<u32>> {
    (0..n).map(|i| (0..5 + i % 7).map(|j| 1 + ((i * 131 + j * 17) as u32 % (vocab - 1))).collect()).collect()
}

/// Streams one request to the end; returns its tokens, or the status it ended with.
async fn stream_tokens(endpoint: String, req: pb::GenerateRequest) -> Result<Vec<u32>, tonic::Status> {
    stream_counted(endpoint, req, Arc::default()).await
}

/// [`stream_tokens`], adding every token received to `received` as it arrives.
async fn stream_counted(
    endpoint: String,
    req: pb::GenerateRequest,
    received: Arc<AtomicUsize>,
) -> Result<Vec<u32>, tonic::Status> {
    let mut c = inference(&endpoint).await;
    let mut s = c.generate_stream(req).await?.into_inner();
    let mut toks = Vec::new();
    while let Some(m) = s.message().await? {
        received.fetch_add(m.token_ids.len(), Ordering::SeqCst);
        toks.extend(m.token_ids);
        if m.finish_reason != 0 {
            break;
        }
    }
    Ok(toks)
}

async fn replicas(endpoint: &str, model: &str) -> Vec<apb::ReplicaStatus> {
    admin(endpoint)
        .await
        .list_replicas(apb::ListReplicasRequest { name: model.into() })
        .await
        .map(|r| r.into_inner().replicas)
        .unwrap_or_default()
}

fn ready(rs: &[apb::ReplicaStatus]) -> Vec<&apb::ReplicaStatus> {
    rs.iter().filter(|r| r.state == apb::ReplicaState::Ready as i32).collect()
}

/// Waits until `model` has exactly `n` replicas, all ready (failed ones being forgotten
/// do not count); returns them.
async fn wait_ready(endpoint: &str, model: &str, n: usize, limit: Duration) -> Vec<apb::ReplicaStatus> {
    eventually(&format!("{n} ready replicas of {model}"), limit, || async {
        let rs = replicas(endpoint, model).await;
        let live = rs.iter().filter(|r| r.state != apb::ReplicaState::Failed as i32).count();
        let ready: Vec<apb::ReplicaStatus> = ready(&rs).into_iter().cloned().collect();
        (ready.len() == n && live == n).then_some(ready)
    })
    .await
}

/// Running sequences on a worker (its engine, if it leads a replica).
async fn worker_running(cluster: &Cluster, address: &str) -> u32 {
    let mut c = WorkerClient::new(cluster.channel(address).await);
    c.stats(wpb::StatsRequest {}).await.map(|r| r.into_inner().running_sequences).unwrap_or(0)
}

async fn workers(endpoint: &str) -> Vec<apb::WorkerStatus> {
    let ws =
        admin(endpoint).await.list_workers(apb::ListWorkersRequest {}).await.unwrap().into_inner().workers;
    registered(ws)
}

fn slow_model() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("slow");
    write_slow_model(&model);
    (dir, model)
}

/// Streams 24-token greedy requests of `gqa`, four at a time, alternating between the
/// two coordinators, until `stop`; each prompt's index with what came back.
async fn load_until(
    endpoints: [String; 2],
    ps: Vec<Vec<u32>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    completed: Arc<AtomicUsize>,
) -> Vec<(usize, Result<Vec<u32>, tonic::Status>)> {
    let mut out = Vec::new();
    let mut i = 0;
    while !stop.load(Ordering::SeqCst) {
        let mut batch = Vec::new();
        for j in 0..4 {
            let k = (i * 4 + j) % ps.len();
            let ep = endpoints[(i + j) % 2].clone();
            batch.push((k, tokio::spawn(stream_tokens(ep, gen_req("gqa", ps[k].clone(), 24)))));
        }
        for (k, h) in batch {
            out.push((k, h.await.unwrap()));
            completed.fetch_add(1, Ordering::SeqCst);
        }
        i += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn deploy_then_scale_up_and_down_under_load_loses_nothing() {
    let mut cluster = Cluster::start(2, 4, Timing::default());
    let (a, b) = (cluster.coordinators[0].endpoint(), cluster.coordinators[1].endpoint());
    let dir = fixture("llama_gqa");
    let r = admin(&a).await.deploy_model(deploy_req("gqa", &dir, 1, 1)).await.unwrap().into_inner();
    assert_eq!(r.model.unwrap().desired_replicas, 1);
    wait_ready(&b, "gqa", 1, Duration::from_secs(30)).await;

    // A load through both coordinators for as long as the model scales 1 → 3 → 1.
    let ps = prompts(48, 256);
    let want = reference(Path::new(&dir), &ps, 24);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let completed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let done = || completed.load(std::sync::atomic::Ordering::SeqCst);
    let load = tokio::spawn(load_until([a.clone(), b.clone()], ps.clone(), stop.clone(), completed.clone()));
    eventually("the load running", Duration::from_secs(20), || async { (done() >= 8).then_some(()) }).await;
    let before_up = done();
    admin(&b)
        .await
        .scale_replicas(apb::ScaleReplicasRequest { name: "gqa".into(), replicas: 3 })
        .await
        .unwrap();
    let up = wait_ready(&a, "gqa", 3, Duration::from_secs(30)).await;
    let mut used: Vec<&String> = up.iter().flat_map(|r| &r.workers).collect();
    used.sort();
    used.dedup();
    assert_eq!(used.len(), 3, "three replicas on three different workers: {up:?}");
    // Requests reach the replicas that came: each added replica takes some of the load
    // before it is drained again.
    eventually("every replica serving", Duration::from_secs(20), || async {
        for r in &up {
            if cluster.worker_status(&r.workers[0]).await.served == 0 {
                return None;
            }
        }
        Some(())
    })
    .await;
    admin(&a)
        .await
        .scale_replicas(apb::ScaleReplicasRequest { name: "gqa".into(), replicas: 1 })
        .await
        .unwrap();
    let down = wait_ready(&b, "gqa", 1, Duration::from_secs(30)).await;
    let after_down = done();
    eventually("the load running on one replica", Duration::from_secs(20), || async {
        (done() >= after_down + 8).then_some(())
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let results = load.await.unwrap();
    // The load ran before, through and after the scaling (every replica served some).
    assert!(before_up >= 8 && after_down > before_up, "{before_up} then {after_down} requests");
    assert!(results.len() >= after_down + 8, "{} requests in all", results.len());
    for (n, (k, got)) in results.iter().enumerate() {
        let got = got.as_ref().unwrap_or_else(|e| panic!("request {n} failed: {e:?}"));
        assert_eq!(got, &want[*k], "request {n}: tokens differ from the greedy reference (lost or repeated)");
    }
    // The two drained replicas were unloaded: their workers are free again.
    let ws = eventually("two free workers", Duration::from_secs(20), || async {
        let ws = workers(&a).await;
        (ws.iter().filter(|w| w.replica.is_empty()).count() == 3).then_some(ws)
    })
    .await;
    assert_eq!(ws.len(), 4);
    assert!(ws.iter().any(|w| w.replica == down[0].id && w.shard_state == "ready"));

    // Not enough workers: the replica stays pending and says why.
    admin(&a).await.deploy_model(deploy_req("big", &dir, 2, 2)).await.unwrap();
    let pending = eventually("a pending replica with a reason", Duration::from_secs(20), || async {
        let rs = replicas(&a, "big").await;
        rs.iter()
            .find(|r| r.state == apb::ReplicaState::Pending as i32 && r.reason.contains("waiting for"))
            .cloned()
    })
    .await;
    let why = &pending.reason;
    assert!(why.starts_with("waiting for 2 free cpu workers with ≥ ") && why.ends_with(" (1 free)"), "{why}");
    // One more worker: both replicas of "big" can be placed (2 × 2 ranks on 4 free workers).
    cluster.add_worker(&[], None);
    wait_ready(&a, "big", 2, Duration::from_secs(40)).await;
    let big_want = reference(Path::new(&dir), &ps[..2], 12);
    for (i, p) in ps[..2].iter().enumerate() {
        let got = stream_tokens(b.clone(), gen_req("big", p.clone(), 12)).await.unwrap();
        assert_eq!(got, big_want[i], "tp=2 replica over two worker processes");
    }
    // Undeploy drains and frees everything.
    admin(&b).await.undeploy_model(apb::UndeployModelRequest { name: "big".into() }).await.unwrap();
    eventually("big's replicas gone", Duration::from_secs(30), || async {
        replicas(&a, "").await.iter().all(|r| r.model != "big").then_some(())
    })
    .await;
    let e = inference(&a).await.generate(gen_req("big", vec![1, 2], 2)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn killing_a_worker_mid_stream_resumes_every_stream_elsewhere() {
    let (_tmp, model) = slow_model();
    let mut cluster = Cluster::start(2, 3, Timing::default());
    let (a, b) = (cluster.coordinators[0].endpoint(), cluster.coordinators[1].endpoint());
    let dir = model.to_string_lossy().to_string();
    admin(&a).await.deploy_model(deploy_req("slow", &dir, 1, 2)).await.unwrap();
    let rs = wait_ready(&a, "slow", 2, Duration::from_secs(60)).await;
    let ps = prompts(8, 2048);
    let want = reference(&model, &ps, 64);
    let received = Arc::new(AtomicUsize::new(0));
    let streams: Vec<_> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let ep = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(stream_counted(ep, gen_req("slow", p.clone(), 64), received.clone()))
        })
        .collect();
    // Kill a worker that is generating right now.
    let by_id: HashMap<String, String> =
        workers(&a).await.into_iter().map(|w| (w.id.clone(), w.address.clone())).collect();
    let victim = eventually("a busy worker", Duration::from_secs(20), || async {
        for r in &rs {
            let id = &r.workers[0];
            if worker_running(&cluster, &by_id[id]).await > 0 {
                return Some(id.clone());
            }
        }
        None
    })
    .await;
    // Mid-stream: every stream has tokens behind it, and the victim still generates.
    eventually("tokens on every stream", Duration::from_secs(20), || async {
        (received.load(Ordering::SeqCst) >= 8 * 4).then_some(())
    })
    .await;
    assert!(worker_running(&cluster, &by_id[&victim]).await > 0, "the victim still has sequences to lose");
    cluster.worker_mut(&victim).kill();
    let killed = Instant::now();
    for (i, (h, want)) in streams.into_iter().zip(&want).enumerate() {
        let got = h.await.unwrap().unwrap_or_else(|e| panic!("stream {i} failed: {e:?}"));
        assert_eq!(&got, want, "stream {i}: tokens lost or repeated across the failover");
    }
    // Some of them were running on the victim when it died: they resumed elsewhere.
    eprintln!("all streams complete {:?} after the kill", killed.elapsed());
    // The failed replica is replaced from the free worker.
    let now = wait_ready(&b, "slow", 2, Duration::from_secs(60)).await;
    assert!(now.iter().all(|r| !r.workers.contains(&victim)), "{now:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_follower_rank_fails_its_replica_and_streams_resume() {
    let (_tmp, model) = slow_model();
    let mut cluster = Cluster::start(1, 5, Timing::default());
    let a = cluster.coordinators[0].endpoint();
    let dir = model.to_string_lossy().to_string();
    admin(&a).await.deploy_model(deploy_req("slow", &dir, 2, 2)).await.unwrap();
    let rs = wait_ready(&a, "slow", 2, Duration::from_secs(60)).await;
    let ps = prompts(6, 2048);
    let want = reference(&model, &ps, 48);
    let received = Arc::new(AtomicUsize::new(0));
    let streams: Vec<_> = ps
        .iter()
        .map(|p| tokio::spawn(stream_counted(a.clone(), gen_req("slow", p.clone(), 48), received.clone())))
        .collect();
    let by_id: HashMap<String, String> =
        workers(&a).await.into_iter().map(|w| (w.id.clone(), w.address.clone())).collect();
    let busy = eventually("a busy replica", Duration::from_secs(20), || async {
        for r in &rs {
            if worker_running(&cluster, &by_id[&r.workers[0]]).await > 0 {
                return Some(r.clone());
            }
        }
        None
    })
    .await;
    eventually("tokens on every stream", Duration::from_secs(20), || async {
        (received.load(Ordering::SeqCst) >= 6 * 4).then_some(())
    })
    .await;
    let follower = busy.workers[1].clone();
    cluster.worker_mut(&follower).kill();
    // Watch for the failed record while the streams run: once they finish, the record may
    // already have been retired (failed retention) and replaced.
    let failed = tokio::spawn({
        let (a, id) = (a.clone(), busy.id.clone());
        async move {
            eventually("the replica marked failed", Duration::from_secs(60), || {
                let (a, id) = (a.clone(), id.clone());
                async move {
                    replicas(&a, "slow")
                        .await
                        .into_iter()
                        .find(|r| r.id == id && r.state == apb::ReplicaState::Failed as i32)
                }
            })
            .await
        }
    });
    for (i, (h, want)) in streams.into_iter().zip(&want).enumerate() {
        let got = h.await.unwrap().unwrap_or_else(|e| panic!("stream {i} failed: {e:?}"));
        assert_eq!(&got, want, "stream {i}");
    }
    let failed = failed.await.unwrap();
    assert!(!failed.reason.is_empty());
    // Rebuilt from the survivor and the free worker.
    let now = wait_ready(&a, "slow", 2, Duration::from_secs(60)).await;
    assert!(now.iter().all(|r| !r.workers.contains(&follower)), "{now:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_rank_fails_its_canary_while_its_lease_lives() {
    // A live process with a dead model is not healthy: the follower is stopped (SIGSTOP)
    // but its lease outlives the test's wait, so only the canary can notice.
    let timing = Timing { lease_ttl: 60.0, canary_interval: 0.5, canary_timeout: 1.5 };
    let cluster = Cluster::start(1, 4, timing);
    let a = cluster.coordinators[0].endpoint();
    let dir = fixture("llama_gqa");
    admin(&a).await.deploy_model(deploy_req("gqa", &dir, 2, 1)).await.unwrap();
    let rs = wait_ready(&a, "gqa", 1, Duration::from_secs(30)).await;
    let follower = rs[0].workers[1].clone();
    cluster.worker(&follower).signal("STOP");
    let t = Instant::now();
    let failed = eventually("the canary to fail the replica", Duration::from_secs(20), || async {
        replicas(&a, "gqa")
            .await
            .into_iter()
            .find(|r| r.id == rs[0].id && r.state == apb::ReplicaState::Failed as i32)
    })
    .await;
    let took = t.elapsed();
    assert!(failed.reason.contains("canary"), "{}", failed.reason);
    assert!(workers(&a).await.iter().any(|w| w.id == follower), "the paused worker is still registered");
    eprintln!("paused rank detected by the canary in {took:?}");
    // Traffic goes to the replacement (two free workers).
    let now = wait_ready(&a, "gqa", 1, Duration::from_secs(30)).await;
    assert!(!now[0].workers.contains(&follower));
    let want = reference(Path::new(&dir), &[vec![1, 2, 3]], 8);
    assert_eq!(stream_tokens(a.clone(), gen_req("gqa", vec![1, 2, 3], 8)).await.unwrap(), want[0]);
    cluster.worker(&follower).signal("CONT");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_leader_coordinator_can_die() {
    let mut cluster = Cluster::start(2, 3, Timing::default());
    let dir = fixture("llama_gqa");
    let leader = cluster.leader(Duration::from_secs(10)).await;
    let other = 1 - leader;
    let survivor = cluster.coordinators[other].endpoint();
    admin(&survivor).await.deploy_model(deploy_req("gqa", &dir, 1, 1)).await.unwrap();
    wait_ready(&survivor, "gqa", 1, Duration::from_secs(30)).await;
    cluster.coordinators[leader].kill();
    let killed = Instant::now();
    // Routing through the survivor never stops.
    let want = reference(Path::new(&dir), &[vec![5, 6, 7]], 8);
    assert_eq!(stream_tokens(survivor.clone(), gen_req("gqa", vec![5, 6, 7], 8)).await.unwrap(), want[0]);
    let successor = format!("c{other}");
    eventually("the survivor elected", Duration::from_secs(15), || async {
        let r = admin(&survivor).await.get_leader(apb::GetLeaderRequest {}).await.ok()?.into_inner();
        (r.leader_id == successor).then_some(())
    })
    .await;
    let took = killed.elapsed();
    assert!(took < Duration::from_secs_f64(cluster.timing.lease_ttl * 2.0 + 2.0), "took over after {took:?}");
    eprintln!("new leader elected {took:?} after the old one was killed");
    // The new leader reconciles: a scale-up is carried out.
    admin(&survivor)
        .await
        .scale_replicas(apb::ScaleReplicasRequest { name: "gqa".into(), replicas: 2 })
        .await
        .unwrap();
    wait_ready(&survivor, "gqa", 2, Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_etcd_outage_keeps_serving_and_workers_are_readopted() {
    let mut cluster = Cluster::start(2, 3, Timing::default());
    let (a, b) = (cluster.coordinators[0].endpoint(), cluster.coordinators[1].endpoint());
    let dir = fixture("llama_gqa");
    admin(&a).await.deploy_model(deploy_req("gqa", &dir, 1, 2)).await.unwrap();
    let before = wait_ready(&a, "gqa", 2, Duration::from_secs(30)).await;
    let pids: Vec<u32> = cluster.workers.iter().map(|w| w.pid()).collect();
    let ids_of_workers: Vec<String> = (0..cluster.workers.len()).map(|n| format!("w{n}")).collect();
    let mut loads = Vec::new();
    for w in &ids_of_workers {
        loads.push(cluster.worker_status(w).await.loads);
    }
    let want = reference(Path::new(&dir), &[vec![9, 8, 7, 6]], 10);

    cluster.etcd.stop();
    // Longer than the lease TTL (every lease would have lapsed), serving all along.
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs_f64(cluster.timing.lease_ttl * 2.0) {
        for ep in [&a, &b] {
            let got = stream_tokens(ep.clone(), gen_req("gqa", vec![9, 8, 7, 6], 10)).await;
            assert_eq!(got.unwrap(), want[0], "routing on the last known state during the outage");
        }
    }
    cluster.etcd.resume();
    // Same replicas, same workers, no process restarted, nothing reloaded.
    eventually("every worker registered again", Duration::from_secs(30), || async {
        (workers(&a).await.len() == 3).then_some(())
    })
    .await;
    let after = wait_ready(&b, "gqa", 2, Duration::from_secs(30)).await;
    let ids = |rs: &[apb::ReplicaStatus]| {
        let mut v: Vec<(String, Vec<String>)> =
            rs.iter().map(|r| (r.id.clone(), r.workers.clone())).collect();
        v.sort();
        v
    };
    assert_eq!(ids(&after), ids(&before), "replicas survived the outage unchanged");
    assert_eq!(cluster.workers.iter().map(|w| w.pid()).collect::<Vec<_>>(), pids);
    for (w, before) in ids_of_workers.iter().zip(&loads) {
        assert_eq!(cluster.worker_status(w).await.loads, *before, "{w}: reloaded");
    }

    // A lease that lapses (revoked behind the worker's back) makes the worker register
    // again with the shard it holds, and it is re-adopted: same replica, no reload.
    let reg = strata_common::registry::etcd::EtcdRegistry::connect(&[cluster.etcd.endpoint()]).await.unwrap();
    use strata_common::registry::Registry;
    let victim = before[0].workers[0].clone();
    let key = format!("/strata/workers/{victim}");
    let revoked = reg.get(&key).await.unwrap().expect("registered").lease.expect("leased");
    reg.revoke_lease(revoked).await.unwrap();
    eventually("the worker registered under a new lease", Duration::from_secs(15), || async {
        let lease = reg.get(&key).await.ok()??.lease?;
        (lease != revoked).then_some(())
    })
    .await;
    let again = wait_ready(&a, "gqa", 2, Duration::from_secs(20)).await;
    assert_eq!(ids(&again), ids(&before), "the worker was re-adopted with its shard");
    assert_eq!(cluster.worker_status(&victim).await.loads, 1, "no reload");
    assert_eq!(stream_tokens(a.clone(), gen_req("gqa", vec![9, 8, 7, 6], 10)).await.unwrap(), want[0]);
    // And the cluster still reconciles after all that.
    admin(&a)
        .await
        .scale_replicas(apb::ScaleReplicasRequest { name: "gqa".into(), replicas: 3 })
        .await
        .unwrap();
    wait_ready(&b, "gqa", 3, Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn deadlines_auth_and_bad_requests_get_clear_statuses() {
    let (_tmp, model) = slow_model();
    let mut cluster = Cluster::start(0, 2, Timing::default());
    cluster.add_coordinator(&["--admin-token", "s3cret", "--api-key", "client-key"]);
    let a = cluster.coordinators[0].endpoint();
    let dir = model.to_string_lossy().to_string();
    // Admin calls need the admin token; a client key is not one.
    let mut ad = admin(&a).await;
    let e = ad.list_models(apb::ListModelsRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = ad.list_models(with("client-key", apb::ListModelsRequest {})).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // Bad deployments name the field. The model directory is checked through the workers
    // this coordinator knows (with none yet, a deployment is accepted and checked at load).
    eventually("the coordinator to see both workers", Duration::from_secs(20), || async {
        (workers_with(&a, "s3cret").await.len() == 2).then_some(())
    })
    .await;
    let cases = [
        (deploy_req("bad name", &dir, 1, 1), Code::InvalidArgument, "name"),
        (deploy_req("m", "/nonexistent/model", 1, 1), Code::InvalidArgument, "model_dir"),
        (deploy_req("m", &dir, 3, 1), Code::InvalidArgument, "tp"),
        (
            apb::DeployModelRequest { dtype: "int3".into(), ..deploy_req("m", &dir, 1, 1) },
            Code::InvalidArgument,
            "dtype",
        ),
    ];
    for (req, code, field) in cases {
        let e = ad.deploy_model(with("s3cret", req)).await.unwrap_err();
        assert_eq!(e.code(), code, "{e:?}");
        assert!(e.message().contains(field), "{field}: {}", e.message());
    }
    let e = ad
        .scale_replicas(with("s3cret", apb::ScaleReplicasRequest { name: "nope".into(), replicas: 2 }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    ad.deploy_model(with("s3cret", deploy_req("slow", &dir, 1, 1))).await.unwrap();
    let rs = eventually("ready", Duration::from_secs(60), || {
        let mut ad = ad.clone();
        async move {
            let rs = ad
                .list_replicas(with("s3cret", apb::ListReplicasRequest { name: "slow".into() }))
                .await
                .ok()?;
            let rs = rs.into_inner().replicas;
            (ready(&rs).len() == 1).then_some(rs)
        }
    })
    .await;

    // Inference needs a client key when keys are configured; the admin token is not one.
    let mut inf = inference(&a).await;
    let e = inf.generate(gen_req("slow", vec![1, 2], 2)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = inf.generate(with("s3cret", gen_req("slow", vec![1, 2], 2))).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = inf.generate(with("client-key", gen_req("slow", vec![99_999], 2))).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("prompt.token_ids"), "{}", e.message());

    // A caller's deadline bounds the stream; the sequence is cancelled on the worker.
    let mut req = with("client-key", gen_req("slow", vec![1, 2, 3], 2000));
    req.set_timeout(Duration::from_millis(1500));
    let t = Instant::now();
    let mut s = inf.generate_stream(req).await.unwrap().into_inner();
    let mut got = 0;
    let end = loop {
        match s.message().await {
            Ok(Some(m)) => got += m.token_ids.len(),
            Ok(None) => panic!("the stream ended without an error after {got} tokens"),
            Err(e) => break e,
        }
    };
    assert_eq!(end.code(), Code::DeadlineExceeded, "{end:?}");
    assert!(t.elapsed() < Duration::from_millis(2500), "{:?}", t.elapsed());
    assert!(got > 0 && got < 2000);
    let mut req = with("client-key", gen_req("slow", vec![1, 2, 3], 2000));
    req.set_timeout(Duration::from_millis(800));
    let e = inf.generate(req).await.unwrap_err();
    assert!(matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled), "{e:?}");
    let leader = workers_with(&a, "s3cret").await.into_iter().find(|w| w.id == rs[0].workers[0]).unwrap();
    eventually("the worker to drop the expired sequences", Duration::from_secs(5), || async {
        (worker_running(&cluster, &leader.address).await == 0).then_some(())
    })
    .await;
}

fn with<T>(token: &str, req: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(req);
    r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

async fn workers_with(endpoint: &str, token: &str) -> Vec<apb::WorkerStatus> {
    let mut r = tonic::Request::new(apb::ListWorkersRequest {});
    r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    registered(admin(endpoint).await.list_workers(r).await.unwrap().into_inner().workers)
}

/// The workers still registered (not those listed a while after they left or were lost).
fn registered(ws: Vec<apb::WorkerStatus>) -> Vec<apb::WorkerStatus> {
    ws.into_iter().filter(|w| !matches!(w.state.as_str(), "left" | "lost")).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn draining_a_worker_moves_its_replica_first_and_coordinators_fetch_model_files() {
    // The workers see the model at a path the coordinator cannot read, as on separate
    // machines, so the coordinator asks a worker for config.json and tokenizer.json.
    // `/proc/self/cwd/gqa` is absolute yet names a different directory in each process:
    // the workers' working directory holds `gqa`, the coordinator's does not.
    let root = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(fixtures_dir().join("llama_gqa"), root.path().join("gqa")).unwrap();
    let mut cluster = Cluster::start(1, 0, Timing::default());
    cluster.add_worker(&[], Some(root.path()));
    cluster.add_worker(&[], Some(root.path()));
    let a = cluster.coordinators[0].endpoint();
    admin(&a).await.deploy_model(deploy_req("gqa", "/proc/self/cwd/gqa", 1, 1)).await.unwrap();
    let before = wait_ready(&a, "gqa", 1, Duration::from_secs(30)).await;
    let want = reference(&fixtures_dir().join("llama_gqa"), &[vec![4, 4, 4]], 8);
    let got = eventually("the tokenizer fetched from a worker", Duration::from_secs(10), || async {
        stream_tokens(a.clone(), gen_req("gqa", vec![4, 4, 4], 8)).await.ok()
    })
    .await;
    assert_eq!(got, want[0]);
    let t =
        inference(&a).await.tokenize(pb::TokenizeRequest { model: "gqa".into(), text: "hello".into() }).await;
    assert!(!t.unwrap().into_inner().token_ids.is_empty());

    let old = before[0].workers[0].clone();
    admin(&a)
        .await
        .drain_worker(apb::DrainWorkerRequest { worker_id: old.clone(), undrain: false })
        .await
        .unwrap();
    let moved = eventually("the replica moved off the drained worker", Duration::from_secs(30), || async {
        let rs = replicas(&a, "gqa").await;
        (rs.len() == 1 && ready(&rs).len() == 1 && !rs[0].workers.contains(&old)).then_some(rs)
    })
    .await;
    assert_ne!(moved[0].id, before[0].id);
    let ws = workers(&a).await;
    let w = ws.iter().find(|w| w.id == old).unwrap();
    assert!(w.draining && w.replica.is_empty(), "{w:?}");
    assert_eq!(stream_tokens(a.clone(), gen_req("gqa", vec![4, 4, 4], 8)).await.unwrap(), want[0]);
    let e = admin(&a)
        .await
        .drain_worker(apb::DrainWorkerRequest { worker_id: "nobody".into(), undrain: false })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_sharing_a_prefix_go_to_the_replica_that_holds_it() {
    let cluster = Cluster::start(2, 2, Timing::default());
    let (a, b) = (cluster.coordinators[0].endpoint(), cluster.coordinators[1].endpoint());
    let dir = fixture("llama_gqa");
    admin(&a).await.deploy_model(deploy_req("gqa", &dir, 1, 2)).await.unwrap();
    wait_ready(&a, "gqa", 2, Duration::from_secs(30)).await;
    // Two families of prompts, each sharing a 48-token prefix, from both coordinators.
    let family = |f: u32, i: u32| -> Vec<u32> {
        (0..48).map(|t| 3 + (t * 7 + f * 101) % 250).chain([200 + i]).collect()
    };
    for i in 0..8 {
        for f in 0..2 {
            let ep = if i % 2 == 0 { a.clone() } else { b.clone() };
            stream_tokens(ep, gen_req("gqa", family(f, i), 2)).await.unwrap();
        }
    }
    // Sequences each replica's leader accepted, as the workers report them.
    let mut served = Vec::new();
    for w in ["w0", "w1"] {
        served.push(cluster.worker_status(w).await.served);
    }
    // Each family stayed on one replica: the split is 8/8 or 16/0, never anything between.
    served.sort();
    assert!(served == [8, 8] || served == [0, 16], "requests per replica: {served:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_is_ready_only_once_registered() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let mut cluster = Cluster::start(0, 0, Timing::default());
    cluster.etcd.stop();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let health = format!("127.0.0.1:{port}");
    cluster.add_worker(&["--health-listen", &health], None);
    let status = |service: &'static str| {
        let health = health.clone();
        async move {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{health}"))
                .ok()?
                .connect()
                .await
                .ok()?;
            let r = HealthClient::new(channel)
                .check(HealthCheckRequest { service: service.into() })
                .await
                .ok()?;
            Some(r.into_inner().status)
        }
    };
    // The registry is down: the process is alive (plaintext health port, no certificate
    // needed) but worker.v1 is not ready.
    assert_eq!(status("").await, Some(ServingStatus::Serving as i32));
    assert_eq!(status("strata.worker.v1.Worker").await, Some(ServingStatus::NotServing as i32));
    cluster.etcd.resume();
    eventually("the worker ready after registering", Duration::from_secs(20), || async {
        (status("strata.worker.v1.Worker").await == Some(ServingStatus::Serving as i32)).then_some(())
    })
    .await;
}
