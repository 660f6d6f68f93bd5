//! The metrics a server exposes agree with what a client observed: requests by finish
//! reason and errors by status code, the time-to-first-token histogram's count, tokens;
//! the engine's per-sequence timings, cache and batch gauges; each rank's steps and
//! all-reduces; the gRPC server's calls by method and code.

use std::time::Duration;

use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::http::{sample, scrape};
use strata_tests::{fixtures_dir, token_request, Server};

#[tokio::test(flavor = "multi_thread")]
async fn request_metrics_agree_with_the_client() {
    let model = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let mut server =
        Server::spawn(&["--model", &model, "--name", "m", "--tp", "2", "--metrics-listen", "127.0.0.1:0"]);
    let metrics = server.out.wait_event("metrics", Duration::from_secs(60), "strata serve");
    let metrics = metrics["address"].as_str().unwrap().to_string();
    server.addr = server.wait_ready();
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    for i in 0..5 {
        let r = c.generate(token_request("m", vec![1, 2 + i, 3], 4)).await.unwrap().into_inner();
        assert_eq!(r.token_ids.len(), 4);
    }
    let mut s = c.generate_stream(token_request("m", vec![1, 9], 3)).await.unwrap().into_inner();
    while s.message().await.unwrap().is_some() {}
    let bad = strata_proto::inference::v1::GenerateRequest {
        max_tokens: Some(0),
        ..token_request("m", vec![1], 1)
    };
    assert!(c.generate(bad).await.is_err());

    let m = [("model", "m")];
    // A quiet moment: no canary step in flight, and both ranks' records of the last step in.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let text = loop {
        let text = scrape(&metrics);
        let steps = sample(&text, "strata_batch_tokens_count", &m);
        let rank_steps =
            |r: &str| sample(&text, "strata_rank_step_seconds_count", &[("model", "m"), ("rank", r)]);
        let idle = sample(&text, "strata_num_requests_running", &m) == Some(0.0)
            && sample(&text, "strata_kv_blocks_used", &m) == Some(0.0);
        if idle && rank_steps("0") == steps && rank_steps("1") == steps {
            break text;
        }
        assert!(std::time::Instant::now() < deadline, "the server never went quiet: {text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        sample(&text, "strata_requests_total", &[("model", "m"), ("finish_reason", "length")]),
        Some(6.0),
        "{text}"
    );
    assert_eq!(sample(&text, "strata_time_to_first_token_seconds_count", &m), Some(6.0));
    assert_eq!(sample(&text, "strata_e2e_request_latency_seconds_count", &m), Some(6.0));
    assert_eq!(sample(&text, "strata_inter_token_latency_seconds_count", &m), Some(5.0 * 3.0 + 2.0));
    assert_eq!(sample(&text, "strata_generation_tokens_total", &m), Some(23.0));
    assert_eq!(sample(&text, "strata_prompt_tokens_total", &m), Some(5.0 * 3.0 + 2.0));
    assert_eq!(
        sample(&text, "strata_request_errors_total", &[("model", "m"), ("code", "INVALID_ARGUMENT")]),
        Some(1.0)
    );
    assert!(text.trim_end().ends_with("# EOF"), "OpenMetrics exposition");

    // The engine: one queue, prefill and decode time per sequence that reached it (the
    // refused request never did), every prompt token looked up in the prefix cache.
    for name in [
        "strata_request_queue_time_seconds_count",
        "strata_request_prefill_time_seconds_count",
        "strata_request_decode_time_seconds_count",
        "strata_time_per_output_token_seconds_count",
    ] {
        assert_eq!(sample(&text, name, &m), Some(6.0), "{name}");
    }
    // (Canaries, one prompt token each, are looked up too.)
    let queries = sample(&text, "strata_prefix_cache_queries_total", &m).expect("prefix-cache queries");
    assert!((17.0..20.0).contains(&queries), "{queries} prompt tokens looked up");
    assert_eq!(sample(&text, "strata_num_requests_running", &m), Some(0.0));
    assert_eq!(sample(&text, "strata_num_requests_waiting", &m), Some(0.0));
    let kv_total = sample(&text, "strata_kv_blocks_total", &m).expect("KV blocks total");
    assert!(kv_total > 0.0);
    assert_eq!(sample(&text, "strata_kv_blocks_used", &m), Some(0.0), "every sequence gave its blocks back");
    // Every step ran on both ranks, with two all-reduces per layer plus the embedding's.
    let steps = sample(&text, "strata_batch_tokens_count", &m).expect("engine steps");
    assert!(steps >= 4.0 * 5.0 + 2.0, "at least one step per token: {steps}");
    for rank in ["0", "1"] {
        let labels = [("model", "m"), ("rank", rank)];
        assert_eq!(sample(&text, "strata_rank_step_seconds_count", &labels), Some(steps), "rank {rank}");
        let reduces = sample(&text, "strata_all_reduce_seconds_count", &labels).expect("all-reduces");
        assert!(reduces >= steps * 3.0, "rank {rank}: {reduces} all-reduces in {steps} steps");
        assert!(sample(&text, "strata_all_reduce_bytes_total", &labels).unwrap() > 0.0);
    }

    // The gRPC server: handled calls by method and status code.
    let grpc = |method: &str, code: &str| {
        let labels =
            [("grpc_service", "strata.inference.v1.Inference"), ("grpc_method", method), ("grpc_code", code)];
        sample(&text, "strata_grpc_server_handled_total", &labels)
    };
    assert_eq!(grpc("Generate", "OK"), Some(5.0), "{text}");
    assert_eq!(grpc("Generate", "INVALID_ARGUMENT"), Some(1.0));
    assert_eq!(grpc("GenerateStream", "OK"), Some(1.0));
    let handling = [("grpc_service", "strata.inference.v1.Inference"), ("grpc_method", "Generate")];
    assert_eq!(sample(&text, "strata_grpc_server_handling_seconds_count", &handling), Some(6.0));
}

/// Repeated deterministic requests are answered from the coordinator's response cache:
/// the same tokens, text and finish, streamed or unary, with no engine work (the engine's
/// per-sequence queue count does not move) and the hits in the metrics. Sampling without a
/// seed is never cached; with a seed it is; a caller can opt out; a changed deployment (a
/// new revision) does not answer from the old one's responses.
#[tokio::test(flavor = "multi_thread")]
async fn repeated_deterministic_requests_come_from_the_response_cache() {
    use strata_proto::inference::v1 as pb;
    let model = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let spare = ["--spare-workers", "1", "--metrics-listen", "127.0.0.1:0"];
    let mut server = Server::spawn(&[&["--model", &model, "--name", "m"][..], &spare].concat());
    let metrics = server.out.wait_event("metrics", Duration::from_secs(60), "strata serve");
    let metrics = metrics["address"].as_str().unwrap().to_string();
    server.addr = server.wait_ready();
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    let m = [("model", "m")];
    let count = |name: &str| sample(&scrape(&metrics), name, &m).unwrap_or(0.0);
    // Sequences the engines took, summed over replicas (a new revision is a new series).
    let engine_seqs = || {
        let text = scrape(&metrics);
        let series = text.lines().filter(|l| l.starts_with("strata_request_queue_time_seconds_count{"));
        series.filter_map(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok()).sum::<f64>()
    };

    let greedy = pb::GenerateRequest { cache: None, ..token_request("m", vec![1, 5, 9], 6) };
    let first = c.generate(greedy.clone()).await.unwrap().into_inner();
    assert_eq!((engine_seqs(), count("strata_response_cache_misses_total")), (1.0, 1.0));
    let again = c.generate(greedy.clone()).await.unwrap().into_inner();
    assert_eq!(
        (again.token_ids, again.text, again.finish_reason),
        (first.token_ids.clone(), first.text, first.finish_reason)
    );
    let mut s = c.generate_stream(greedy.clone()).await.unwrap().into_inner();
    let mut streamed = Vec::new();
    while let Some(msg) = s.message().await.unwrap() {
        streamed.extend(msg.token_ids);
    }
    assert_eq!(streamed, first.token_ids, "the stream replays the same tokens");
    assert_eq!(engine_seqs(), 1.0, "no replica step for the two repeats");
    assert_eq!(count("strata_response_cache_hits_total"), 2.0);
    let finished =
        sample(&scrape(&metrics), "strata_requests_total", &[("model", "m"), ("finish_reason", "length")]);
    assert_eq!(finished, Some(3.0), "replayed requests are requests");
    // Opting out generates.
    let fresh = pb::GenerateRequest { cache: Some(false), ..greedy.clone() };
    assert_eq!(c.generate(fresh).await.unwrap().into_inner().token_ids, first.token_ids);
    assert_eq!(engine_seqs(), 2.0);
    // Sampling: never cached without a seed; cached with one.
    let sampled = |seed: Option<u64>| pb::GenerateRequest {
        sampling: Some(pb::SamplingParams { temperature: 0.9, seed, ..Default::default() }),
        cache: None,
        ..token_request("m", vec![2, 4, 6], 8)
    };
    for _ in 0..2 {
        c.generate(sampled(None)).await.unwrap();
    }
    assert_eq!(engine_seqs(), 4.0, "an unseeded sample is drawn anew every time");
    let a = c.generate(sampled(Some(11))).await.unwrap().into_inner();
    let b = c.generate(sampled(Some(11))).await.unwrap().into_inner();
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!((engine_seqs(), count("strata_response_cache_hits_total")), (5.0, 3.0));
    // A changed deployment is a new revision: its first answer is generated again.
    new_revision(&server.endpoint()).await;
    let (before, hits) = (engine_seqs(), count("strata_response_cache_hits_total"));
    let renewed = c.generate(greedy.clone()).await.unwrap().into_inner();
    assert_eq!(renewed.token_ids, first.token_ids, "same weights, same tokens");
    assert_eq!(count("strata_response_cache_hits_total"), hits, "not from the old revision's cache");
    assert_eq!(engine_seqs(), before + 1.0, "the new revision generated it");
}

/// Redeploys model `m` with a changed spec and waits until only replicas of the new
/// revision serve it.
async fn new_revision(endpoint: &str) {
    use strata_proto::admin::v1 as apb;
    let mut admin = apb::admin_client::AdminClient::connect(endpoint.to_string()).await.unwrap();
    let spec = admin.list_models(apb::ListModelsRequest {}).await.unwrap().into_inner().models;
    let old = spec.iter().find(|s| s.name == "m").unwrap().clone();
    let changed = apb::DeployModelRequest {
        name: "m".into(),
        model_dir: old.model_dir.clone(),
        tp: 1,
        pp: 1,
        replicas: 1,
        scheduler: Some(apb::SchedulerLimits { max_num_seqs: 7, ..Default::default() }),
        ..Default::default()
    };
    let generation = admin.deploy_model(changed).await.unwrap().into_inner().model.unwrap().generation;
    assert_eq!(generation, old.generation + 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let rs =
            admin.list_replicas(apb::ListReplicasRequest { name: "m".into() }).await.unwrap().into_inner();
        let ready = apb::ReplicaState::Ready as i32;
        if rs.replicas.iter().all(|r| r.generation == generation && r.state == ready)
            && !rs.replicas.is_empty()
        {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "the new revision never took over: {rs:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What `strata serve` says of itself: its in-memory registry connected, itself the leader,
/// its models; the KV cache's use as a fraction; the process's CPU, memory and files; and a
/// model undeployed leaves no series behind.
#[tokio::test(flavor = "multi_thread")]
async fn serve_reports_its_cluster_its_process_and_forgets_undeployed_models() {
    use strata_proto::admin::v1 as apb;
    use strata_proto::admin::v1::admin_client::AdminClient;
    let model = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let args = ["--model", &model, "--name", "m", "--spare-workers", "1", "--metrics-listen", "127.0.0.1:0"];
    let mut server = Server::spawn(&args);
    let metrics = server.out.wait_event("metrics", Duration::from_secs(60), "strata serve");
    let metrics = metrics["address"].as_str().unwrap().to_string();
    server.addr = server.wait_ready();
    let mut admin = AdminClient::connect(server.endpoint()).await.unwrap();
    let q = apb::DeployModelRequest {
        name: "q".into(),
        model_dir: model.clone(),
        tp: 1,
        pp: 1,
        replicas: 1,
        ..Default::default()
    };
    admin.deploy_model(q).await.unwrap();
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while c.generate(token_request("q", vec![1, 2, 3], 2)).await.is_err() {
        assert!(std::time::Instant::now() < deadline, "q never served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let text = scrape(&metrics);
    assert_eq!(sample(&text, "strata_registry_connected", &[]), Some(1.0), "{text}");
    assert_eq!(sample(&text, "strata_coordinator_leader", &[]), Some(1.0));
    assert_eq!(sample(&text, "strata_cluster_models", &[]), Some(2.0));
    let usage = sample(&text, "strata_kv_cache_usage", &[("model", "m")]).expect("KV usage");
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    assert!(sample(&text, "process_resident_memory_bytes", &[]).unwrap() > 1e6);
    assert!(sample(&text, "process_open_fds", &[]).unwrap() > 0.0);
    assert!(sample(&text, "process_cpu_seconds_total", &[]).unwrap() > 0.0);
    assert_eq!(
        sample(&text, "strata_requests_total", &[("model", "q"), ("finish_reason", "length")]),
        Some(1.0)
    );
    admin.undeploy_model(apb::UndeployModelRequest { name: "q".into() }).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let text = scrape(&metrics);
        if !text.contains("model=\"q\"") {
            assert!(text.contains("model=\"m\""), "m's series stay: {text}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "q's series stayed after undeploy: {text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
