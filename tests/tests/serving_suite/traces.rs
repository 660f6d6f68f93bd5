//! One request is one trace across processes: the caller's `traceparent` reaches the
//! coordinator, the worker leading the replica and every rank, and each exports its spans
//! over OTLP to a receiver in this test (the OpenTelemetry project's own service
//! definition). A failover shows up in the trace as a second attempt.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_proto::worker::v1 as wpb;
use strata_proto::worker::v1::worker_client::WorkerClient;
use strata_tests::cluster::{eventually, Cluster, Timing};
use strata_tests::otlp::{OtlpReceiver, ReceivedSpan};
use strata_tests::{fixtures_dir, token_request, write_slow_model, Server};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn traced<T>(message: T, trace_id: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut().insert("traceparent", format!("00-{trace_id}-{CALLER_SPAN}-01").parse().unwrap());
    r
}

/// Processes export to `receiver`, in batches every 100 ms.
fn traced_cluster(receiver: &OtlpReceiver, workers: usize) -> Cluster {
    let env =
        [("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "100")];
    Cluster::start_with_env(1, workers, Timing::default(), &env)
}

/// Every span's parent is another span of the trace, or the caller's span.
fn unlinked(spans: &[ReceivedSpan]) -> Vec<String> {
    let ids: HashSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    spans
        .iter()
        .filter(|s| s.parent_span_id != CALLER_SPAN && !ids.contains(s.parent_span_id.as_str()))
        .map(|s| format!("{} ({}) under {:?}", s.name, s.service, s.parent_span_id))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn one_request_is_one_trace_through_every_rank() {
    let receiver = OtlpReceiver::start().await;
    let cluster = traced_cluster(&receiver, 2);
    let dir = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    cluster.deploy_ready("gqa", &dir, 2, 1, Duration::from_secs(60)).await;
    let mut c = InferenceClient::connect(cluster.coordinators[0].endpoint()).await.unwrap();
    // Untraced first, then the traced request alone.
    c.generate(token_request("gqa", vec![1, 2], 2)).await.expect("warm-up");
    let mut req = token_request("gqa", vec![3, 4, 5], 5);
    req.request_id = "traced-1".into();
    let r = c.generate(traced(req, TRACE_ID)).await.expect("traced request").into_inner();
    assert_eq!(r.token_ids.len(), 5);

    // Wait until the coordinator's request span, the worker's and both ranks' steps are in
    // and every span's parent has arrived too.
    let spans = eventually("the whole trace", Duration::from_secs(30), || async {
        let spans = receiver.trace(TRACE_ID);
        let has = |service: &str, name: &str| spans.iter().any(|s| s.service == service && s.name == name);
        let ranks: HashSet<i64> =
            spans.iter().filter(|s| s.name == "rank.step").filter_map(|s| s.int("rank")).collect();
        let complete = has("strata-coordinator", "text_completion gqa")
            && has("strata-coordinator", "attempt")
            && has("strata-worker", "worker.generate")
            && has("strata-worker", "engine.step")
            && ranks == HashSet::from([0, 1])
            && unlinked(&spans).is_empty();
        complete.then_some(spans)
    })
    .await;

    let root = spans.iter().find(|s| s.name == "text_completion gqa").unwrap();
    assert_eq!(root.parent_span_id, CALLER_SPAN, "the request span is the caller's child");
    assert_eq!(root.str("gen_ai.operation.name"), Some("text_completion"));
    assert_eq!(root.str("gen_ai.request.model"), Some("gqa"));
    assert_eq!(root.str("gen_ai.response.model"), Some("gqa"));
    assert_eq!(root.str("gen_ai.response.id"), Some("traced-1"));
    assert_eq!(root.int("gen_ai.request.max_tokens"), Some(5));
    assert_eq!(root.float("gen_ai.request.temperature"), Some(0.0));
    assert_eq!(root.int("gen_ai.usage.input_tokens"), Some(3));
    assert_eq!(root.int("gen_ai.usage.output_tokens"), Some(5));
    assert_eq!(root.strings("gen_ai.response.finish_reasons"), Some(vec!["length".to_string()]));
    assert_eq!(root.int("strata.ranks"), Some(2));
    assert_eq!(root.int("strata.failovers"), Some(0));
    assert!(root.str("strata.replica").is_some_and(|r| r.starts_with("gqa-")));
    assert_eq!(root.str("strata.tenant"), Some("default"), "an open server's callers are the default tenant");
    // The ranks' steps run in two worker processes, each under the leader's step span.
    let steps: HashSet<&str> =
        spans.iter().filter(|s| s.name == "engine.step").map(|s| s.span_id.as_str()).collect();
    for s in spans.iter().filter(|s| s.name == "rank.step") {
        assert!(steps.contains(s.parent_span_id.as_str()), "rank {:?} not under a step", s.int("rank"));
    }
    let by_name: HashMap<&str, usize> = spans.iter().fold(HashMap::new(), |mut m, s| {
        *m.entry(s.name.as_str()).or_default() += 1;
        m
    });
    for stage in ["queue", "prefill", "decode"] {
        assert_eq!(by_name.get(stage), Some(&1), "one {stage} span: {by_name:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failover_is_a_second_attempt_in_the_same_trace() {
    const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
    let receiver = OtlpReceiver::start().await;
    let mut cluster = traced_cluster(&receiver, 2);
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("slow");
    write_slow_model(&model);
    cluster.deploy_ready("slow", &model.to_string_lossy(), 1, 2, Duration::from_secs(60)).await;
    let endpoint = cluster.coordinators[0].endpoint();
    let mut c = InferenceClient::connect(endpoint.clone()).await.unwrap();
    let mut admin = AdminClient::connect(endpoint).await.unwrap();
    let mut stream = c
        .generate_stream(traced(token_request("slow", vec![1, 2, 3], 48), TRACE))
        .await
        .unwrap()
        .into_inner();
    let mut tokens = stream.message().await.unwrap().expect("a first token").token_ids;
    // Kill the worker generating it.
    let workers = admin.list_workers(apb::ListWorkersRequest {}).await.unwrap().into_inner().workers;
    let mut victim = None;
    for w in &workers {
        let mut wc = WorkerClient::new(cluster.channel(&w.address).await);
        let stats = wc.stats(wpb::StatsRequest {}).await.unwrap().into_inner();
        if stats.running_sequences > 0 {
            victim = Some(w.id.clone());
        }
    }
    let victim = victim.expect("a worker runs the stream");
    cluster.worker_mut(&victim).kill();
    let killed = Instant::now();
    while let Some(m) = stream.message().await.expect("the stream survives the kill") {
        tokens.extend(m.token_ids);
    }
    assert_eq!(tokens.len(), 48, "every token, once (resumed {:?} after the kill)", killed.elapsed());

    let scrape = cluster.coordinators[0].metrics.clone().expect("metrics address");
    let (_, text) = strata_tests::prometheus::http_get(&scrape, "/metrics").unwrap();
    assert!(text.lines().any(|l| l == "strata_failovers_total{model=\"slow\"} 1"), "{text}");

    // The victim died with its spans open; the resumed attempt's subtree is whole.
    let spans = eventually("the resumed trace", Duration::from_secs(30), || async {
        let spans = receiver.trace(TRACE);
        let root = spans.iter().find(|s| s.name == "text_completion slow")?;
        let attempts = spans.iter().filter(|s| s.name == "attempt").count();
        let resumed = spans.iter().any(|s| s.name == "worker.generate" && s.int("resumed_tokens") > Some(0));
        (root.int("strata.failovers") == Some(1) && attempts == 2 && resumed).then_some(spans)
    })
    .await;
    let root = spans.iter().find(|s| s.name == "text_completion slow").unwrap();
    let attempts: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.name == "attempt").collect();
    for a in &attempts {
        assert_eq!(a.parent_span_id, root.span_id, "attempts are the request's children");
    }
    let replicas: HashSet<&str> = attempts.iter().filter_map(|a| a.str("strata.replica")).collect();
    assert_eq!(replicas.len(), 2, "the second attempt ran on the other replica");
    assert_eq!(root.int("gen_ai.usage.output_tokens"), Some(48));
    let second = attempts.iter().find(|a| a.int("strata.attempt") == Some(2)).expect("attempt 2");
    let resumed =
        spans.iter().find(|s| s.name == "worker.generate" && s.int("resumed_tokens") > Some(0)).unwrap();
    assert_eq!(resumed.parent_span_id, second.span_id, "the surviving worker's span is under attempt 2");
    assert_eq!(resumed.service, "strata-worker");
}

#[tokio::test(flavor = "multi_thread")]
async fn json_logs_carry_the_callers_trace_id() {
    const TRACE: &str = "5b8aa5a2d2c872e8321cf37308d69df2";
    let model = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let env = [("RUST_LOG", "info,strata_coordinator=debug")];
    let server = Server::start_with_env(&["--model", &model, "--name", "m", "--log-format", "json"], &env);
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    c.generate(traced(token_request("m", vec![1, 2], 3), TRACE)).await.expect("generate");
    let line = eventually("the request's log line", Duration::from_secs(10), || async {
        server.log().lines().find(|l| l.contains("request finished")).map(str::to_string)
    })
    .await;
    let v: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    assert_eq!(v["fields"]["message"], "request finished");
    assert_eq!(v["fields"]["tokens"], 3);
    assert_eq!(v["span"]["trace_id"], TRACE, "{v}");
    assert_eq!(v["span"]["gen_ai.request.model"], "m", "{v}");
    for l in server.log().lines().filter(|l| !l.trim().is_empty()) {
        serde_json::from_str::<serde_json::Value>(l)
            .unwrap_or_else(|e| panic!("a log line is not JSON ({e}): {l}"));
    }
}

/// `--access-log`: one info line per finished request, its fields structured (with
/// `--log-format json`) and the caller's trace id on it through the request's span.
#[tokio::test(flavor = "multi_thread")]
async fn the_access_log_has_a_line_per_request_with_its_trace_id() {
    let dir = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let server = Server::start(&["--model", &dir, "--name", "m", "--access-log", "--log-format", "json"]);
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    let mut req = token_request("m", vec![3, 4, 5], 3);
    req.request_id = "logged-1".into();
    c.generate(traced(req, TRACE_ID)).await.expect("request");
    let line = eventually("the request's access-log line", Duration::from_secs(10), || async {
        server.log().lines().find_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            (v["target"] == "strata::access" && v["fields"]["request"] == "logged-1").then_some(v)
        })
    })
    .await;
    let f = &line["fields"];
    assert_eq!(
        (f["model"].as_str(), f["tokens"].as_u64(), f["outcome"].as_str()),
        (Some("m"), Some(3), Some("length"))
    );
    assert_eq!(f["prompt_tokens"].as_u64(), Some(3), "{line}");
    assert_eq!(line["level"], "INFO");
    assert!(line.to_string().contains(TRACE_ID), "the trace id is on the line: {line}");
}
