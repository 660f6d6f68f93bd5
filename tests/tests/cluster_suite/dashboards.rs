//! A real Prometheus scrapes a real cluster (etcd, a coordinator, two workers holding one
//! TP=2 replica) under a short load. Every panel of the Grafana dashboards in
//! deploy/grafana, run through Prometheus's query API, returns data; the metrics agree
//! with what the load generator observed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::cluster::{Cluster, Timing};
use strata_tests::prometheus::Prometheus;
use strata_tests::{fixtures_dir, token_request};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every panel query in the dashboards: (dashboard file, panel title, expression).
fn panel_queries() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    let dir = deploy_dir().join("grafana/dashboards");
    for entry in std::fs::read_dir(&dir).expect("deploy/grafana/dashboards") {
        let path = entry.unwrap().path();
        let d: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).expect("dashboard JSON");
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        for panel in d["panels"].as_array().expect("panels") {
            for target in panel["targets"].as_array().expect("targets") {
                let expr = target["expr"].as_str().expect("a PromQL expression");
                out.push((file.clone(), panel["title"].as_str().unwrap().to_string(), expr.to_string()));
            }
        }
    }
    assert!(out.len() >= 30, "three dashboards' panels: {}", out.len());
    out
}

/// Grafana's variables as a dashboard viewer with the defaults would have them.
fn as_grafana_would(expr: &str) -> String {
    expr.replace("$__rate_interval", "30s").replace("$__range", "5m").replace("$model", ".*")
}

/// What the load generator saw answered.
struct Load {
    ok: usize,
    streams: usize,
    errors: usize,
}

async fn load(endpoint: &str) -> Load {
    let mut c = InferenceClient::connect(endpoint.to_string()).await.unwrap();
    let mut n = Load { ok: 0, streams: 0, errors: 0 };
    for i in 0..12u32 {
        let r = c.generate(token_request("gqa", vec![1, 2 + i, 3, 4], 6)).await.expect("generate");
        assert_eq!(r.into_inner().token_ids.len(), 6);
        n.ok += 1;
    }
    for i in 0..3u32 {
        let mut s = c.generate_stream(token_request("gqa", vec![5, 6 + i], 5)).await.unwrap().into_inner();
        while s.message().await.unwrap().is_some() {}
        n.streams += 1;
    }
    let bad = strata_proto::inference::v1::GenerateRequest {
        max_tokens: Some(0),
        ..token_request("gqa", vec![1], 1)
    };
    assert!(c.generate(bad).await.is_err());
    n.errors += 1;
    n
}

#[tokio::test(flavor = "multi_thread")]
async fn prometheus_scrapes_the_cluster_and_every_panel_has_data() {
    let cluster = Cluster::start(1, 2, Timing::default());
    let coordinator = &cluster.coordinators[0];
    let dir = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    cluster.deploy_ready("gqa", &dir, 2, 1, Duration::from_secs(60)).await;
    let n = load(&coordinator.endpoint()).await;

    let metrics = |p: &strata_tests::cluster::Proc| p.metrics.clone().expect("metrics address announced");
    let prometheus = Prometheus::start(&[
        ("strata-coordinator", vec![metrics(coordinator)]),
        ("strata-worker", cluster.workers.iter().map(metrics).collect()),
    ]);

    // Counts equal what the load generator saw, once Prometheus has scraped after it.
    let finished = (n.ok + n.streams) as f64;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let requests = prometheus.scalar("sum(strata_requests_total)");
        let up = prometheus.scalar("sum(up)");
        if requests == Some(finished) && up == Some(3.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "scrape never showed {finished} requests (last {requests:?}, up {up:?})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(prometheus.scalar("sum(strata_time_to_first_token_seconds_count)"), Some(finished));
    assert_eq!(prometheus.scalar("sum(strata_request_errors_total)"), Some(n.errors as f64));
    assert_eq!(
        prometheus.scalar(
            r#"sum(strata_grpc_server_handled_total{job="strata-coordinator",grpc_method="Generate",grpc_code="OK"})"#
        ),
        Some(n.ok as f64)
    );
    // The workers ran the same sequences (plus canaries); both ranks stepped.
    let queued =
        prometheus.scalar(r#"sum(strata_request_queue_time_seconds_count{job="strata-worker"})"#).unwrap();
    assert!(queued >= finished, "{queued} sequences queued on the replica for {finished} requests");
    let ranks = prometheus.query("strata_rank_step_seconds_count > 0").unwrap();
    assert_eq!(ranks.len(), 2, "one step series per rank: {ranks:?}");
    assert_eq!(prometheus.scalar(r#"sum(strata_cluster_replicas{state="ready"})"#), Some(1.0));
    assert_eq!(prometheus.scalar(r#"sum(strata_cluster_workers{state="ready"})"#), Some(2.0));
    assert_eq!(prometheus.scalar("sum(strata_coordinator_leader)"), Some(1.0));

    // Every panel returns data (rates need a couple of scrapes after the load: poll).
    let queries = panel_queries();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut empty: Vec<String> = Vec::new();
    for (file, title, expr) in &queries {
        let expr = as_grafana_would(expr);
        loop {
            match prometheus.query(&expr) {
                Err(e) => panic!("{file} / {title}: Prometheus refused the query: {e}"),
                Ok(r) if !r.is_empty() => break,
                Ok(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(250)).await,
                Ok(_) => {
                    empty.push(format!("{file} / {title}: {expr}"));
                    break;
                }
            }
        }
    }
    assert!(empty.is_empty(), "panels without data:\n{}", empty.join("\n"));
}
