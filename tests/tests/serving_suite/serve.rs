//! `strata serve` end to end: the real binary on a free loopback port, called through the
//! generated Rust client — unary and streaming Generate, cancellation, every error
//! status, health, reflection and graceful shutdown.

use std::time::{Duration, Instant};

use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::{fixtures_dir, ids, reference, write_slow_model, Server};
use tonic::transport::Channel;
use tonic::Code;

async fn client(server: &Server) -> InferenceClient<Channel> {
    InferenceClient::connect(server.endpoint()).await.expect("connect")
}

fn fixture(name: &str) -> String {
    fixtures_dir().join(name).to_string_lossy().to_string()
}

use strata_tests::token_request as request;

fn text_request(model: &str, text: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        model: model.into(),
        prompt: Some(pb::generate_request::Prompt::Text(text.into())),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    }
}

async fn collect_stream(
    c: &mut InferenceClient<Channel>,
    req: pb::GenerateRequest,
) -> Vec<pb::GenerateStreamResponse> {
    let mut s = c.generate_stream(req).await.expect("stream starts").into_inner();
    let mut out = Vec::new();
    while let Some(m) = s.message().await.expect("stream message") {
        out.push(m);
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn unary_and_streaming_generate_match_the_reference() {
    let server = Server::start(&["--model", &fixture("llama_gqa"), "--model", &fixture("qwen2_bias_tied")]);
    let mut c = client(&server).await;
    for name in ["llama_gqa", "qwen2_bias_tied"] {
        let r = reference(&fixtures_dir().join(name));
        let prompt = ids(&r["prompt_ids"]);
        let want = ids(&r["greedy_ids"]);
        let unary = c.generate(request(name, prompt.clone(), 32)).await.unwrap().into_inner();
        assert_eq!(unary.token_ids, want, "{name}: unary greedy tokens");
        assert_eq!(unary.text, r["greedy_text"].as_str().unwrap());
        assert_eq!(unary.finish_reason, pb::FinishReason::Length as i32);
        let usage = unary.usage.unwrap();
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (prompt.len() as u32, 32));
        assert_eq!(unary.prompt_token_ids, prompt);

        let msgs = collect_stream(&mut c, request(name, prompt.clone(), 32)).await;
        let tokens: Vec<u32> = msgs.iter().flat_map(|m| m.token_ids.clone()).collect();
        let text: String = msgs.iter().map(|m| m.text.as_str()).collect();
        assert_eq!(tokens, want, "{name}: streamed tokens");
        assert_eq!(text, unary.text, "{name}: concatenated deltas equal the unary text");
        let last = msgs.last().unwrap();
        assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);
        assert_eq!(last.usage.as_ref().unwrap().completion_tokens, 32);
        assert!(msgs[..msgs.len() - 1].iter().all(|m| m.finish_reason == 0 && m.usage.is_none()));
    }

    // Text prompts, stop strings and logprobs behave as in-process.
    let unary = c.generate(text_request("llama_gqa", "The quick brown fox", 24)).await.unwrap().into_inner();
    let chars: Vec<(usize, char)> = unary.text.char_indices().collect();
    let stop = unary.text[chars[6].0..chars[9].0].to_string();
    let cut = unary.text.find(&stop).unwrap();
    let mut req = text_request("llama_gqa", "The quick brown fox", 24);
    req.stop = vec![stop.clone()];
    req.logprobs = Some(2);
    let msgs = collect_stream(&mut c, req.clone()).await;
    let text: String = msgs.iter().map(|m| m.text.as_str()).collect();
    assert_eq!(text, &unary.text[..cut], "stop {stop:?}");
    assert_eq!(msgs.last().unwrap().finish_reason, pb::FinishReason::Stop as i32);
    let lps: Vec<_> = msgs.iter().flat_map(|m| m.logprobs.clone()).collect();
    let toks: Vec<u32> = msgs.iter().flat_map(|m| m.token_ids.clone()).collect();
    assert_eq!(lps.len(), toks.len());
    assert!(lps.iter().all(|l| l.top.len() == 2 && l.top[0].token_id == l.token_id));
    let u = c.generate(req).await.unwrap().into_inner();
    assert_eq!(u.text, text);

    let models = c.list_models(pb::ListModelsRequest {}).await.unwrap().into_inner().models;
    let names: Vec<_> = models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["llama_gqa", "qwen2_bias_tied"]);
    assert_eq!(models[1].architecture, "Qwen2ForCausalLM");
    let t = c
        .tokenize(pb::TokenizeRequest { model: "llama_gqa".into(), text: "The quick brown fox".into() })
        .await
        .unwrap();
    assert_eq!(
        t.into_inner().token_ids,
        ids(&reference(&fixtures_dir().join("llama_gqa"))["text_prompt_ids"])
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_map_to_status_codes_naming_the_field() {
    let server = Server::start(&["--model", &fixture("llama_gqa"), "--name", "m"]);
    let mut c = client(&server).await;
    let ok = || request("m", vec![1, 2, 3], 4);
    let cases: Vec<(pb::GenerateRequest, Code, &str)> = vec![
        (pb::GenerateRequest { model: "nope".into(), ..ok() }, Code::NotFound, "nope"),
        (pb::GenerateRequest { model: "".into(), ..ok() }, Code::InvalidArgument, "model"),
        (
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams { temperature: -0.5, ..Default::default() }),
                ..ok()
            },
            Code::InvalidArgument,
            "temperature",
        ),
        (
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams { top_p: Some(0.0), ..Default::default() }),
                ..ok()
            },
            Code::InvalidArgument,
            "top_p",
        ),
        (
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams { top_p: Some(1.5), ..Default::default() }),
                ..ok()
            },
            Code::InvalidArgument,
            "top_p",
        ),
        (pb::GenerateRequest { max_tokens: Some(0), ..ok() }, Code::InvalidArgument, "max_tokens"),
        (pb::GenerateRequest { max_tokens: Some(600), ..ok() }, Code::InvalidArgument, "max_tokens"),
        (pb::GenerateRequest { prompt: None, ..ok() }, Code::InvalidArgument, "prompt"),
        (text_request("m", "", 4), Code::InvalidArgument, "prompt"),
        (request("m", vec![], 4), Code::InvalidArgument, "prompt"),
        (request("m", vec![1; 600], 4), Code::InvalidArgument, "context"),
        (request("m", vec![1, 100000], 4), Code::InvalidArgument, "token_ids"),
        (pb::GenerateRequest { logprobs: Some(50), ..ok() }, Code::InvalidArgument, "logprobs"),
        // 3.5 MB of text: refused by its size, before any tokenizing.
        (text_request("m", &"lorem ipsum ".repeat(300_000), 4), Code::InvalidArgument, "cannot fit"),
    ];
    for (req, code, word) in cases {
        for streaming in [false, true] {
            let status = if streaming {
                match c.generate_stream(req.clone()).await {
                    Err(s) => s,
                    Ok(r) => r.into_inner().message().await.expect_err("stream should fail"),
                }
            } else {
                c.generate(req.clone()).await.expect_err("should fail")
            };
            assert_eq!(status.code(), code, "{req:?}: {status:?}");
            assert!(status.message().contains(word), "{:?} should name {word}", status.message());
        }
    }
    // The server is still healthy after all that.
    assert_eq!(c.generate(ok()).await.unwrap().into_inner().token_ids.len(), 4);
}

async fn model_stats(c: &mut InferenceClient<Channel>) -> pb::ModelInfo {
    c.list_models(pb::ListModelsRequest {}).await.unwrap().into_inner().models.remove(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn cancelled_streams_free_their_sequence() {
    let tmp = tempfile::tempdir().unwrap();
    write_slow_model(tmp.path());
    let server = Server::start(&["--model", &tmp.path().to_string_lossy(), "--name", "slow"]);
    let mut c = client(&server).await;
    let mut s = c.generate_stream(request("slow", vec![1, 5, 9], 1900)).await.unwrap().into_inner();
    for _ in 0..3 {
        assert!(s.message().await.unwrap().is_some());
    }
    let busy = model_stats(&mut c).await;
    assert_eq!(busy.running_sequences, 1);
    assert!(busy.kv_blocks_free < busy.kv_blocks_total);
    drop(s); // the client goes away mid-generation
    let started = Instant::now();
    loop {
        let m = model_stats(&mut c).await;
        if m.running_sequences == 0 && m.kv_blocks_free == m.kv_blocks_total {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(2), "sequence still running after cancel: {m:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // 1900 tokens take far longer than that: the sequence ended because it was cancelled.
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_queue_answers_resource_exhausted() {
    let tmp = tempfile::tempdir().unwrap();
    write_slow_model(tmp.path());
    let mut server = Server::spawn(&[
        "--model",
        &tmp.path().to_string_lossy(),
        "--name",
        "slow",
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "1",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let metrics = server.out.wait_event("metrics", Duration::from_secs(60), "strata serve");
    let metrics = metrics["address"].as_str().unwrap().to_string();
    server.addr = server.wait_ready();
    let mut c = client(&server).await;
    let mut running = c.generate_stream(request("slow", vec![1, 2], 1500)).await.unwrap().into_inner();
    assert!(running.message().await.unwrap().is_some());
    // The one slot is taken: the next request waits in the coordinator's queue (its call
    // returns when it gets the slot), the one after finds the queue full.
    let mut w = c.clone();
    let _waiting = tokio::spawn(async move { w.generate(request("slow", vec![1, 3], 4)).await });
    wait_queued(&metrics, "slow", 1.0).await;
    let status = c.generate(request("slow", vec![1, 4], 4)).await.expect_err("queue is full");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
}

/// Polls until `model`'s fair-admission queue holds `n` requests.
async fn wait_queued(metrics: &str, model: &str, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = strata_tests::http::scrape(metrics);
        if strata_tests::http::sample(&text, "strata_admission_waiting", &[("model", model)]) == Some(n) {
            return;
        }
        assert!(Instant::now() < deadline, "the queue never held {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn health_and_reflection_are_served() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let server = Server::start(&["--model", &fixture("llama_gqa")]);
    let channel = Channel::from_shared(server.endpoint()).unwrap().connect().await.unwrap();
    let mut h = HealthClient::new(channel.clone());
    for service in ["", "strata.inference.v1.Inference"] {
        let r = h.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
    }
    let mut refl = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut resp = refl.server_reflection_info(tokio_stream::iter(vec![req])).await.unwrap().into_inner();
    let msg = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else { panic!("{msg:?}") };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in ["strata.inference.v1.Inference", "strata.admin.v1.Admin", "grpc.health.v1.Health"] {
        assert!(names.iter().any(|n| n == want), "{want} missing from {names:?}");
    }
    // The same through v1alpha, which many clients still speak.
    use tonic_reflection::pb::v1alpha as alpha;
    let channel = Channel::from_shared(server.endpoint()).unwrap().connect().await.unwrap();
    let mut refl = alpha::server_reflection_client::ServerReflectionClient::new(channel);
    let req = alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(alpha::server_reflection_request::MessageRequest::ListServices(String::new())),
    };
    let mut resp = refl.server_reflection_info(tokio_stream::iter(vec![req])).await.unwrap().into_inner();
    let msg = resp.message().await.unwrap().unwrap();
    let Some(alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        msg.message_response
    else {
        panic!("{msg:?}")
    };
    assert!(list.service.iter().any(|s| s.name == "strata.inference.v1.Inference"), "{:?}", list.service);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_in_flight_streams_and_exits_zero() {
    let tmp = tempfile::tempdir().unwrap();
    write_slow_model(tmp.path());
    let mut server =
        Server::start(&["--model", &tmp.path().to_string_lossy(), "--name", "slow", "--drain-timeout", "60"]);
    let mut c = client(&server).await;
    let mut s = c.generate_stream(request("slow", vec![1, 2, 3], 200)).await.unwrap().into_inner();
    let mut tokens = s.message().await.unwrap().unwrap().token_ids.len();
    let pid = server.child.id().to_string();
    let kill = std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(kill.success());
    let mut finish = 0;
    while let Some(m) = s.message().await.expect("the in-flight stream completes") {
        tokens += m.token_ids.len();
        finish = m.finish_reason;
    }
    assert_eq!((tokens, finish), (200, pb::FinishReason::Length as i32));
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = server.child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "server did not exit after draining");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status {status:?}: {}", server.log());
    assert!(InferenceClient::connect(server.endpoint()).await.is_err(), "no new connections after shutdown");
}

/// A Python grpcio client (stubs generated from proto/ by grpcio-tools) calls the server.
/// `make test` installs grpcio and grpcio-tools into target/pyenv; STRATA_PYTHON overrides.
#[test]
fn python_grpcio_client_calls_the_server() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let python = std::env::var_os("STRATA_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("target/pyenv/bin/python"));
    assert!(
        python.exists(),
        "{} missing: run `make prerequisites` (creates target/pyenv with grpcio and grpcio-tools)",
        python.display()
    );
    let server = Server::start(&["--model", &fixture("llama_gqa"), "--name", "tiny"]);
    let out = std::process::Command::new(&python)
        .arg(root.join("tests/python/grpc_client.py"))
        .args([server.addr.as_str(), "tiny"])
        .arg(root.join("proto"))
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("5 passed, 0 failed"), "{stdout}");
}

#[test]
fn bench_reports_vllm_style_metrics() {
    let server = Server::start(&["--model", &fixture("llama_gqa"), "--name", "tiny"]);
    let out = std::process::Command::new(strata_tests::strata_bin())
        .args(["bench", "--endpoint", &server.endpoint(), "--model", "tiny", "--requests", "12"])
        .args([
            "--concurrency",
            "4",
            "--input-len",
            "40",
            "--output-len",
            "9",
            "--shared-prefix",
            "32",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(12), Some(0)));
    assert_eq!(r["output_tokens"].as_u64(), Some(12 * 9));
    assert_eq!(r["input_tokens"].as_u64(), Some(12 * 40));
    for metric in ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"] {
        let m = &r[metric];
        let (p50, p90, p99) =
            (m["p50"].as_f64().unwrap(), m["p90"].as_f64().unwrap(), m["p99"].as_f64().unwrap());
        assert!(p50 > 0.0 && p50 <= p90 && p90 <= p99, "{metric}: {m}");
    }
    assert!(r["e2e_ms"]["p50"].as_f64() >= r["ttft_ms"]["p50"].as_f64());
    let tput = r["output_tokens_per_s"].as_f64().unwrap();
    let expect = 108.0 / r["duration_s"].as_f64().unwrap();
    assert!((tput - expect).abs() < 1e-6 * expect, "{tput} vs {expect}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_embedded_cluster_answers_the_admin_api() {
    // `strata serve` runs the cluster's control plane on the in-memory registry: its
    // replicas are listed, and models can be deployed, scaled and undeployed at run time
    // on spare in-process workers.
    use strata_proto::admin::v1 as apb;
    use strata_proto::admin::v1::admin_client::AdminClient;
    let server = Server::start(&["--model", &fixture("llama_gqa"), "--name", "m", "--spare-workers", "2"]);
    let mut admin = AdminClient::connect(server.endpoint()).await.unwrap();
    let rs = admin.list_replicas(apb::ListReplicasRequest::default()).await.unwrap().into_inner().replicas;
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].state, apb::ReplicaState::Ready as i32);
    assert!(rs[0].reason.contains("canary"), "{}", rs[0].reason);
    let ws = admin.list_workers(apb::ListWorkersRequest {}).await.unwrap().into_inner().workers;
    assert_eq!(ws.len(), 3);
    admin
        .deploy_model(apb::DeployModelRequest {
            name: "q".into(),
            model_dir: fixture("qwen2_bias_tied"),
            tp: 1,
            pp: 1,
            replicas: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    let r = reference(&fixtures_dir().join("qwen2_bias_tied"));
    let prompt = ids(&r["prompt_ids"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let got = loop {
        match client(&server).await.generate(request("q", prompt.clone(), 32)).await {
            Ok(g) => break g.into_inner(),
            Err(e) if Instant::now() < deadline => {
                assert!(matches!(e.code(), Code::NotFound | Code::Unavailable), "{e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the deployed model never served: {e:?}"),
        }
    };
    assert_eq!(got.token_ids, ids(&r["greedy_ids"]));
    // Only two spare workers: a third replica waits, and says why.
    admin.scale_replicas(apb::ScaleReplicasRequest { name: "q".into(), replicas: 3 }).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rs = admin
            .list_replicas(apb::ListReplicasRequest { name: "q".into() })
            .await
            .unwrap()
            .into_inner()
            .replicas;
        if rs.iter().any(|r| r.state == apb::ReplicaState::Pending as i32 && r.reason.contains("0 free")) {
            break;
        }
        assert!(Instant::now() < deadline, "{rs:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    admin.undeploy_model(apb::UndeployModelRequest { name: "q".into() }).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let rs =
            admin.list_replicas(apb::ListReplicasRequest::default()).await.unwrap().into_inner().replicas;
        if rs.iter().all(|r| r.model == "m") {
            break;
        }
        assert!(Instant::now() < deadline, "{rs:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let e = client(&server).await.generate(request("q", prompt, 4)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deployment_asking_for_more_memory_than_there_is_waits_and_the_server_lives() {
    use strata_proto::admin::v1 as apb;
    use strata_proto::admin::v1::admin_client::AdminClient;
    let args = ["--model", &fixture("llama_gqa"), "--name", "m", "--spare-workers", "1", "--route-wait", "2"];
    let server = Server::start(&[&args[..], &["--http-listen", "127.0.0.1:0"]].concat());
    let http = server.out.passed("http").unwrap()["address"].as_str().unwrap().to_string();
    let mut admin = AdminClient::connect(server.endpoint()).await.unwrap();
    let huge = apb::DeployModelRequest {
        name: "huge".into(),
        model_dir: fixture("llama_gqa"),
        tp: 1,
        pp: 1,
        replicas: 1,
        scheduler: Some(apb::SchedulerLimits { kv_cache_bytes: 1 << 50, ..Default::default() }),
        ..Default::default()
    };
    admin.deploy_model(huge).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    // Placement sees that no worker has the memory: the replica waits, saying so, and
    // nothing is loaded.
    let pending = loop {
        let rs = admin
            .list_replicas(apb::ListReplicasRequest { name: "huge".into() })
            .await
            .unwrap()
            .into_inner()
            .replicas;
        if let Some(r) = rs.into_iter().find(|r| r.reason.contains("memory")) {
            break r;
        }
        assert!(Instant::now() < deadline, "no replica waiting for memory");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(pending.state, apb::ReplicaState::Pending as i32, "{pending:?}");
    assert!(pending.reason.ends_with("(1 free: 0 fit, 1 with too little memory)"), "{}", pending.reason);
    // /ready per model says where each stands; a request for the waiting one is refused
    // (once it has waited out the grace: the route wait here), naming why.
    let ready = |path: &str| strata_tests::http::request(&http, "GET", path, None, None).unwrap();
    assert_eq!(ready("/ready?model=m").0, 200);
    assert_eq!(ready("/ready?model=nope").0, 404);
    let (status, body) = ready("/ready?model=huge");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (status, body["state"].as_str(), body["ready_replicas"].as_u64()),
        (503, Some("pending"), Some(0))
    );
    assert!(body["reason"].as_str().unwrap().contains("memory"), "{body}");
    let req = serde_json::json!({"model": "huge", "prompt": "hi", "max_tokens": 2});
    let started = Instant::now();
    let (status, body) =
        strata_tests::http::request(&http, "POST", "/v1/completions", None, Some(&req)).unwrap();
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("pending") && body.contains("memory"), "{body}");
    // The process and its other model are unharmed.
    let r = reference(&fixtures_dir().join("llama_gqa"));
    let got = client(&server).await.generate(request("m", ids(&r["prompt_ids"]), 8)).await.unwrap();
    assert_eq!(got.into_inner().token_ids, ids(&r["greedy_ids"])[..8]);
}

#[tokio::test(flavor = "multi_thread")]
async fn serve_checks_api_keys_and_the_admin_token_like_a_coordinator() {
    use strata_proto::admin::v1 as apb;
    use strata_proto::admin::v1::admin_client::AdminClient;
    fn with<T>(token: &str, req: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(req);
        r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        r
    }
    let server = Server::start_with_env(
        &["--model", &fixture("llama_gqa"), "--name", "m", "--api-key", "k1"],
        &[("STRATA_ADMIN_TOKEN", "adm")],
    );
    let mut c = client(&server).await;
    let e = c.list_models(pb::ListModelsRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = c.list_models(with("nope", pb::ListModelsRequest {})).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let models = c.list_models(with("k1", pb::ListModelsRequest {})).await.unwrap().into_inner().models;
    assert_eq!(models[0].name, "m");
    let mut admin = AdminClient::connect(server.endpoint()).await.unwrap();
    let e = admin.list_workers(with("k1", apb::ListWorkersRequest {})).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "a client key is not the admin token: {e:?}");
    assert!(admin.list_workers(with("adm", apb::ListWorkersRequest {})).await.is_ok());
}

/// `strata bench --api-key` (or STRATA_API_KEY) loads a server that requires a key; without
/// one it stops at once with the server's refusal.
#[test]
fn bench_sends_the_api_key() {
    let server =
        Server::start(&["--model", &fixture("llama_gqa"), "--name", "tiny", "--api-key", "sk-bench-key"]);
    let bench = |key: Option<&str>| {
        let mut c = std::process::Command::new(strata_tests::strata_bin());
        c.args(["bench", "--endpoint", &server.endpoint(), "--model", "tiny", "--requests", "3"])
            .args(["--input-len", "8", "--output-len", "2", "--json"])
            .env_remove("STRATA_API_KEY");
        if let Some(k) = key {
            c.env("STRATA_API_KEY", k);
        }
        c.output().unwrap()
    };
    let refused = bench(None);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("Unauthenticated"), "{err}");
    let out = bench(Some("sk-bench-key"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(3), Some(0)));
}

/// `strata bench --api openai | openai-chat` loads the HTTP API (streamed), with the key.
#[test]
fn bench_measures_the_openai_api_too() {
    let model = super::http_api::chat_model("llama_gqa");
    let args = ["--model", model.path().to_str().unwrap(), "--name", "tiny", "--api-key", "sk-bench-key"];
    let server = Server::start(&[&args[..], &["--http-listen", "127.0.0.1:0"]].concat());
    let http = server.out.passed("http").expect("the HTTP API announces its address");
    let http = format!("http://{}", http["address"].as_str().unwrap());
    for api in ["openai", "openai-chat"] {
        let out = std::process::Command::new(strata_tests::strata_bin())
            .args(["bench", "--api", api, "--endpoint", &http, "--model", "tiny", "--requests", "4"])
            .args(["--concurrency", "2", "--input-len", "6", "--output-len", "3", "--json"])
            .env("STRATA_API_KEY", "sk-bench-key")
            .output()
            .unwrap();
        assert!(out.status.success(), "{api}: {}", String::from_utf8_lossy(&out.stderr));
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(4), Some(0)), "{api}: {r}");
        assert_eq!(r["output_tokens"], 12, "{api}: the server's count: {r}");
        assert!(r["input_tokens"].as_u64().unwrap() >= 4 * 6, "{api}: the server's count: {r}");
        assert!(r["ttft_ms"]["p50"].as_f64().unwrap() > 0.0, "{r}");
    }
    let wrong = std::process::Command::new(strata_tests::strata_bin())
        .args(["bench", "--api", "openai", "--endpoint", &http, "--model", "tiny", "--requests", "1"])
        .env("STRATA_API_KEY", "wrong")
        .output()
        .unwrap();
    assert!(!wrong.status.success(), "a wrong key fails the run");
}

/// The listen addresses are bound before any model loads: a port in use is the error, not
/// the weights that a load would have found missing.
#[test]
fn a_port_in_use_fails_before_the_models_load() {
    let model = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(strata_tests::fixtures_dir().join("llama_gqa").join(f), model.path().join(f)).unwrap();
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let free = "127.0.0.1:0".to_string();
    for (flag, grpc, http) in [("--listen", &port, &free), ("--http-listen", &free, &port)] {
        let out = std::process::Command::new(strata_tests::strata_bin())
            .args(["serve", model.path().to_str().unwrap(), "--listen", grpc, "--http-listen", http])
            .env("RUST_LOG", "error")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(stderr.contains(&format!("{flag} {port}")), "{flag}: {stderr}");
        assert!(!stderr.contains("safetensors"), "{flag}: failed on the weights first: {stderr}");
    }
    // vLLM's --port moves the HTTP API (on by default); the error says how to move it.
    let out = std::process::Command::new(strata_tests::strata_bin())
        .args(["serve", model.path().to_str().unwrap(), "--listen", &free, "--port"])
        .arg(taken.local_addr().unwrap().port().to_string())
        .env("RUST_LOG", "error")
        .env_remove("STRATA_HTTP_LISTEN")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("--http-listen {port}")) && stderr.contains("--http-listen off"),
        "{stderr}"
    );
}

/// `strata serve DIR` serves the OpenAI HTTP API beside gRPC without being asked: `--port`
/// alone places it (vLLM's spelling), and `--http-listen off` leaves only gRPC.
#[test]
fn serve_speaks_http_beside_grpc_by_default() {
    let model = strata_tests::fixtures_dir().join("llama_gqa");
    let spawn = |extra: &[&str]| {
        let mut cmd = std::process::Command::new(strata_tests::strata_bin());
        cmd.args(["serve", model.to_str().unwrap(), "--name", "m", "--listen", "127.0.0.1:0"])
            .args(extra)
            .env_remove("STRATA_HTTP_LISTEN")
            .env("RUST_LOG", "info");
        strata_tests::spawn_captured(&mut cmd)
    };
    let (mut child, out) = spawn(&["--port", "0"]);
    let http = out.wait_event("http", std::time::Duration::from_secs(60), "strata serve");
    let address = http["address"].as_str().unwrap().to_string();
    out.wait_event("ready", std::time::Duration::from_secs(60), "strata serve");
    let (status, body) = strata_tests::prometheus::http_get(&address, "/v1/models").unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"m\""), "{body}");
    child.kill().unwrap();
    child.wait().unwrap();
    let (mut child, out) = spawn(&["--http-listen", "off"]);
    out.wait_event("ready", std::time::Duration::from_secs(60), "strata serve");
    // The HTTP API is announced before the ready line, when there is one.
    assert!(out.passed("http").is_none(), "{}", out.log());
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A deployment's own `--quantize int8`: the workers load its weights quantized — its
/// logprobs are those of the same model quantized in-process, not the f32 model's.
#[tokio::test(flavor = "multi_thread")]
async fn a_deployment_can_quantize_its_weights() {
    let dir = fixture("llama_gqa");
    let server = Server::start(&["--model", &dir, "--name", "m", "--spare-workers", "1"]);
    let admin = |args: &[&str]| {
        let out = std::process::Command::new(strata_tests::strata_bin())
            .args(["admin", "--endpoint", &server.endpoint(), "--json"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    admin(&["deploy", "--name", "q", "--model", &dir, "--quantize", "int8"]);
    let models: serde_json::Value = serde_json::from_str(&admin(&["models"])).unwrap();
    let q = models.as_array().unwrap().iter().find(|m| m["name"] == "q").unwrap().clone();
    assert_eq!(q["quantize"], "int8", "{models}");
    let generate = |extra: &[&str]| -> Vec<f64> {
        let out = std::process::Command::new(strata_tests::strata_bin())
            .args(["generate", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--logprobs", "1", "--json"])
            .args(extra)
            .output()
            .unwrap();
        if !out.status.success() {
            return Vec::new();
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["logprobs"].as_array().unwrap().iter().map(|l| l["logprob"].as_f64().unwrap()).collect()
    };
    let endpoint = server.endpoint();
    let deadline = Instant::now() + Duration::from_secs(30);
    let served = loop {
        let got = generate(&["--endpoint", &endpoint, "--model", "q"]);
        if !got.is_empty() {
            break got;
        }
        assert!(Instant::now() < deadline, "q never served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let int8 = generate(&["--model", &dir, "--quantize", "int8"]);
    let f32 = generate(&["--model", &dir]);
    let close =
        |a: &[f64], b: &[f64]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-4);
    assert!(close(&served, &int8), "served {served:?}, int8 in-process {int8:?}");
    assert!(!close(&served, &f32), "served {served:?} equals the unquantized {f32:?}");
    // A CUDA deployment cannot be int8: refused, naming the field.
    let out = std::process::Command::new(strata_tests::strata_bin())
        .args(["admin", "--endpoint", &endpoint, "deploy", "--name", "g", "--model", &dir])
        .args(["--quantize", "int8", "--device", "cuda"])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("quantize"));
}
