//! Cluster-mode benchmark: real etcd, two coordinators and worker processes on loopback.
//!
//! Measures, for docs/PERFORMANCE.md:
//! 1. `ScaleReplicas` 1 → 2 until the new replica is ready (canary through every rank),
//!    for each model given (median of `--repeats`, scaling back down between repeats);
//! 2. `kill -9` of a worker that is streaming (6 streams over 2 replicas) until every
//!    stream has delivered its next token (client-side timestamps; the worst stream per
//!    kill, median over 3 kills);
//! 3. routing overhead: 1-token generations of the first model through a coordinator
//!    (alternating between the two) against the same call straight to a replica's rank 0
//!    over worker.v1.
//!
//! `cargo run --release -p strata-tests --bin cluster-bench -- --model DIR [--model DIR2]
//!  [--stream-model DIR] [--repeats 5] [--requests 500]` (needs target/release/strata:
//! set STRATA_BIN). Prints a JSON report on stdout, progress on stderr. The cluster runs
//! with mutual TLS, as the tests do; `STRATA_TEST_PLAIN_CLUSTER=1` runs it without, to
//! measure what TLS costs.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_proto::worker::v1 as wpb;
use strata_proto::worker::v1::worker_client::WorkerClient;
use strata_tests::cluster::{Cluster, Timing};

struct Args {
    models: Vec<PathBuf>,
    stream_model: Option<PathBuf>,
    repeats: usize,
    requests: usize,
}

fn parse() -> Args {
    let mut a = Args { models: Vec::new(), stream_model: None, repeats: 5, requests: 500 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            // Deployments name absolute directories (workers may run anywhere).
            "--model" => a.models.push(std::fs::canonicalize(val()).expect("--model DIR exists")),
            "--stream-model" => {
                a.stream_model = Some(std::fs::canonicalize(val()).expect("--stream-model DIR exists"))
            }
            "--repeats" => a.repeats = val().parse().expect("--repeats N"),
            "--requests" => a.requests = val().parse().expect("--requests N"),
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(!a.models.is_empty(), "give at least one --model DIR");
    a
}

use strata_common::stats::{median, percentile};

async fn ready_ids(
    admin: &mut AdminClient<tonic::transport::Channel>,
    model: &str,
) -> Vec<apb::ReplicaStatus> {
    admin
        .list_replicas(apb::ListReplicasRequest { name: model.into() })
        .await
        .map(|r| r.into_inner().replicas)
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r.state == apb::ReplicaState::Ready as i32)
        .collect()
}

async fn wait_ready(
    admin: &mut AdminClient<tonic::transport::Channel>,
    model: &str,
    n: usize,
) -> Vec<apb::ReplicaStatus> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let all = admin
            .list_replicas(apb::ListReplicasRequest { name: model.into() })
            .await
            .map(|r| r.into_inner().replicas)
            .unwrap_or_default();
        let ready: Vec<_> =
            all.iter().filter(|r| r.state == apb::ReplicaState::Ready as i32).cloned().collect();
        if ready.len() == n && all.len() == n {
            return ready;
        }
        assert!(Instant::now() < deadline, "{model}: {n} ready replicas never came: {all:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

use strata_tests::token_request as gen;

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args = parse();
    let mut report = serde_json::Map::new();
    let workers = 4;
    let mut cluster =
        Cluster::start(2, workers, Timing { lease_ttl: 3.0, canary_interval: 1.0, canary_timeout: 10.0 });
    let (a, b) = (cluster.coordinators[0].endpoint(), cluster.coordinators[1].endpoint());
    let mut admin = AdminClient::connect(a.clone()).await.unwrap();
    report.insert("scale".into(), scale_latency(&args, &mut admin, workers).await);
    report.insert("failover".into(), failover(&args, &mut cluster, &mut admin).await);
    report.insert("routing".into(), routing(&args, &cluster, &mut admin, &a, &b).await);
    println!("{}", serde_json::Value::Object(report));
}

type Admin = AdminClient<tonic::transport::Channel>;

/// Waits until `n` workers hold no shard (a drained replica's worker has unloaded).
async fn wait_free(admin: &mut Admin, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ws = admin.list_workers(apb::ListWorkersRequest {}).await.unwrap().into_inner().workers;
        if ws.iter().filter(|w| w.replica.is_empty() && !matches!(w.state.as_str(), "left" | "lost")).count()
            >= n
        {
            return;
        }
        assert!(Instant::now() < deadline, "{n} free workers never came: {ws:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// 1. Scale-up latency: ScaleReplicas 1 → 2 until the new replica is ready.
async fn scale_latency(args: &Args, admin: &mut Admin, workers: usize) -> serde_json::Value {
    let mut scale = Vec::new();
    for dir in &args.models {
        let name =
            dir.file_name().unwrap().to_string_lossy().replace(|c: char| !c.is_ascii_alphanumeric(), "-");
        admin
            .deploy_model(apb::DeployModelRequest {
                name: name.clone(),
                model_dir: dir.to_string_lossy().into(),
                tp: 1,
                pp: 1,
                replicas: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        wait_ready(admin, &name, 1).await;
        let mut times = Vec::new();
        for i in 0..args.repeats {
            let t = Instant::now();
            admin
                .scale_replicas(apb::ScaleReplicasRequest { name: name.clone(), replicas: 2 })
                .await
                .unwrap();
            wait_ready(admin, &name, 2).await;
            let s = t.elapsed().as_secs_f64();
            eprintln!("{name}: scale 1→2 ready in {s:.3} s (repeat {i})");
            times.push(s);
            admin
                .scale_replicas(apb::ScaleReplicasRequest { name: name.clone(), replicas: 1 })
                .await
                .unwrap();
            wait_ready(admin, &name, 1).await;
            wait_free(admin, workers - 1).await; // the drained worker unloads
        }
        scale.push(serde_json::json!({
            "model": name, "repeats": args.repeats,
            "scale_to_ready_s_median": median(&times), "scale_to_ready_s": times,
        }));
        admin.undeploy_model(apb::UndeployModelRequest { name: name.clone() }).await.unwrap();
        while !ready_ids(admin, &name).await.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        wait_free(admin, workers).await;
    }
    serde_json::json!(scale)
}

/// 2. Failover: kill -9 a streaming worker; time until every stream's next token.
async fn failover(args: &Args, cluster: &mut Cluster, admin: &mut Admin) -> serde_json::Value {
    let (a, b) = (cluster.coordinators[0].endpoint(), cluster.coordinators[1].endpoint());
    let stream_dir = args.stream_model.clone().unwrap_or_else(|| args.models[0].clone());
    admin
        .deploy_model(apb::DeployModelRequest {
            name: "s".into(),
            model_dir: stream_dir.to_string_lossy().into(),
            tp: 1,
            pp: 1,
            replicas: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut resume = Vec::new();
    for rep in 0..args.repeats.min(3) {
        let rs = wait_ready(admin, "s", 2).await;
        let ws = admin.list_workers(apb::ListWorkersRequest {}).await.unwrap().into_inner().workers;
        let addr = |id: &str| ws.iter().find(|w| w.id == id).unwrap().address.clone();
        let received = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let streams: Vec<_> = (0..6u32)
            .map(|i| {
                let ep = if i % 2 == 0 { a.clone() } else { b.clone() };
                let received = received.clone();
                tokio::spawn(async move {
                    let mut c = InferenceClient::connect(ep).await.unwrap();
                    let mut s =
                        c.generate_stream(gen("s", vec![1, 2 + i, 3, 4], 600)).await.unwrap().into_inner();
                    let mut times = Vec::new();
                    while let Some(m) = s.message().await.unwrap() {
                        times.push(Instant::now());
                        received.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        if m.finish_reason != 0 {
                            break;
                        }
                    }
                    times
                })
            })
            .collect();
        // Mid-stream: every stream has tokens behind it.
        while received.load(std::sync::atomic::Ordering::SeqCst) < 6 * 8 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The busier leader.
        let mut victim = rs[0].workers[0].clone();
        for r in &rs {
            let mut c = WorkerClient::new(cluster.channel(&addr(&r.workers[0])).await);
            if c.stats(wpb::StatsRequest {}).await.unwrap().into_inner().running_sequences > 0 {
                victim = r.workers[0].clone();
                break;
            }
        }
        cluster.worker_mut(&victim).kill();
        let killed = Instant::now();
        // The worst stream: on the killed worker, it resumed elsewhere (its prompt and
        // streamed tokens prefilled again); on the survivor, it waited for that prefill.
        let mut worst = 0f64;
        for h in streams {
            let times = h.await.unwrap();
            assert_eq!(times.len(), 600, "every stream completes");
            if let Some(f) = times.iter().find(|t| **t >= killed) {
                worst = worst.max(f.duration_since(killed).as_secs_f64());
            }
        }
        resume.push(worst);
        eprintln!("failover repeat {rep}: every stream's next token within {worst:.3} s of the kill");
        cluster.add_worker(&[], None);
    }
    serde_json::json!({
        "kill_to_every_streams_next_token_s_median": median(&resume),
        "kill_to_every_streams_next_token_s": resume,
    })
}

/// 3. Routing overhead: through a coordinator vs straight to rank 0, on the first model.
async fn routing(args: &Args, cluster: &Cluster, admin: &mut Admin, a: &str, b: &str) -> serde_json::Value {
    admin.undeploy_model(apb::UndeployModelRequest { name: "s".into() }).await.unwrap();
    admin
        .deploy_model(apb::DeployModelRequest {
            name: "r".into(),
            model_dir: args.models[0].to_string_lossy().into(),
            tp: 1,
            pp: 1,
            replicas: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    let rs = wait_ready(admin, "r", 2).await;
    let direct_addr = rs[0].leader_address.clone();
    let mut ca = InferenceClient::connect(a.to_string()).await.unwrap();
    let mut cb = InferenceClient::connect(b.to_string()).await.unwrap();
    let mut w = WorkerClient::new(cluster.channel(&direct_addr).await);
    let mut via = Vec::new();
    let mut direct = Vec::new();
    for i in 0..args.requests + 20 {
        let t = Instant::now();
        let c = if i % 2 == 0 { &mut ca } else { &mut cb };
        c.generate(gen("r", vec![1, 2, 3], 1)).await.unwrap();
        let v = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let mut s = w
            .generate(wpb::WorkerGenerateRequest {
                prompt_token_ids: vec![1, 2, 3],
                max_tokens: 1,
                ignore_eos: true,
                replica_id: rs[0].id.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        while s.message().await.unwrap().is_some() {}
        let d = t.elapsed().as_secs_f64() * 1e3;
        if i >= 20 {
            via.push(v);
            direct.push(d);
        }
    }
    serde_json::json!({
        "requests": args.requests,
        "via_coordinators_ms": {"p50": percentile(&via, 0.5), "p90": percentile(&via, 0.9), "p99": percentile(&via, 0.99)},
        "direct_to_worker_ms": {"p50": percentile(&direct, 0.5), "p90": percentile(&direct, 0.9), "p99": percentile(&direct, 0.99)},
        "overhead_p50_ms": percentile(&via, 0.5) - percentile(&direct, 0.5),
    })
}
