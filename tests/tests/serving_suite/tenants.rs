//! Tenants on `strata serve` (tenants from the configuration file): a tenant flooding at
//! ten times its request rate gets RESOURCE_EXHAUSTED with retry hints while another
//! tenant's calls keep succeeding at their unloaded latency; a token quota holds to within
//! one request; `max_tokens_per_request` caps and refuses; OpenAI's Python client sees a
//! 429 with Retry-After; usage equals what the clients received.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::{fixtures_dir, token_request, Server};
use tonic::transport::Channel;
use tonic::Code;
use tonic_types::StatusExt;

const CONFIG: &str = r#"
[[coordinator.tenants]]
name = "flood"
keys = ["flood-key"]
[coordinator.tenants.limits]
requests_per_second = 2
max_concurrent = 1

[[coordinator.tenants]]
name = "steady"
keys = ["steady-key"]

[[coordinator.tenants]]
name = "metered"
keys = ["meter-key"]
[coordinator.tenants.limits]
tokens_per_minute = 120

[[coordinator.tenants]]
name = "narrow"
keys = ["narrow-key"]
[coordinator.tenants.limits]
max_tokens_per_request = 4
models = ["m"]

[[coordinator.tenants]]
name = "elsewhere"
keys = ["elsewhere-key"]
[coordinator.tenants.limits]
models = ["other"]
"#;

/// `strata serve` of the gqa fixture as model "m" with `tenants` as its configuration file
/// (kept in `dir`) and `extra` flags.
fn serve_tenants(dir: &Path, tenants: &str, extra: &[&str]) -> Server {
    let config = dir.join("strata.toml");
    std::fs::write(&config, tenants).unwrap();
    let model = fixtures_dir().join("llama_gqa");
    let args = ["--config", config.to_str().unwrap(), "--model", model.to_str().unwrap(), "--name", "m"];
    Server::start(&[&args[..], extra].concat())
}

fn keyed<T>(msg: T, key: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    r
}

/// Time to the first streamed token of a small request.
async fn ttft(c: &mut InferenceClient<Channel>, key: &str) -> Duration {
    let t0 = Instant::now();
    let mut s =
        c.generate_stream(keyed(token_request("m", vec![5, 6, 7, 8], 4), key)).await.unwrap().into_inner();
    let first = s.message().await.unwrap();
    let at = t0.elapsed();
    assert!(first.is_some());
    while s.message().await.unwrap().is_some() {}
    at
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// What one flooding task saw.
#[derive(Default)]
struct Flood {
    ok: AtomicUsize,
    limited: AtomicUsize,
}

/// Sends the flood tenant's requests at `per_second` until `stop`, checking every refusal.
async fn flood(endpoint: String, per_second: f64, stop: Arc<AtomicBool>, seen: Arc<Flood>) {
    let mut c = InferenceClient::connect(endpoint).await.unwrap();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_second));
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        match c.generate(keyed(token_request("m", vec![1, 2, 3, 4, 5, 6, 7, 8], 16), "flood-key")).await {
            Ok(_) => seen.ok.fetch_add(1, Ordering::Relaxed),
            Err(s) => {
                assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
                let retry = s.get_details_retry_info().expect("RetryInfo in the status details");
                assert!(retry.retry_delay.is_some_and(|d| d > Duration::ZERO), "{retry:?}");
                assert!(s.metadata().get("retry-after").is_some(), "{:?}", s.metadata());
                seen.limited.fetch_add(1, Ordering::Relaxed)
            }
        };
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flooding_tenant_is_limited_and_another_keeps_its_latency() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve_tenants(dir.path(), CONFIG, &["--http-listen", "127.0.0.1:0"]);
    let ep = server.endpoint();
    let mut c = InferenceClient::connect(ep.clone()).await.unwrap();
    let denied = c.generate(token_request("m", vec![1, 2], 2)).await.unwrap_err();
    assert_eq!(denied.code(), Code::Unauthenticated, "keys exist, so a call needs one");
    for _ in 0..3 {
        ttft(&mut c, "steady-key").await; // warm up
    }
    let mut unloaded = Vec::new();
    for _ in 0..12 {
        unloaded.push(ttft(&mut c, "steady-key").await);
    }
    // The flood: ten times the tenant's 2 requests/s, from four connections.
    let (stop, seen) = (Arc::new(AtomicBool::new(false)), Arc::new(Flood::default()));
    let started = Instant::now();
    let flooders: Vec<_> =
        (0..4).map(|_| tokio::spawn(flood(ep.clone(), 5.0, stop.clone(), seen.clone()))).collect();
    let mut loaded = Vec::new();
    for _ in 0..12 {
        loaded.push(ttft(&mut c, "steady-key").await);
    }
    while started.elapsed() < Duration::from_secs(2) {
        loaded.push(ttft(&mut c, "steady-key").await);
    }
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let (ok, limited) = (seen.ok.load(Ordering::Relaxed), seen.limited.load(Ordering::Relaxed));
    assert!(limited > 0, "the flood was never refused");
    assert!((ok as f64) <= 2.0 * elapsed + 2.0 + 1.0, "{ok} admitted in {elapsed:.1} s at 2/s (burst 2)");
    let (before, after) = (median(unloaded), median(loaded.clone()));
    // Baselines under 10 ms count as 10 ms: below that a 2-core machine's scheduling noise
    // is the same size as the latency itself.
    let bound = 2 * before.max(Duration::from_millis(10));
    assert!(
        after <= bound,
        "steady's p50 TTFT {after:?} under the flood vs {before:?} unloaded (bound {bound:?})"
    );
    eprintln!("steady p50 TTFT {before:?} → {after:?} under a 10× flood ({ok} admitted, {limited} refused)");

    quotas_and_caps(&ep).await;
    usage_equals_what_clients_received(&ep, 3 + 12 + loaded.len()).await;
    let http = server.out.passed("http").expect("the HTTP API announces its address");
    openai_client_sees_429(http["address"].as_str().unwrap()).await;
    more_choices_than_may_run_are_refused(http["address"].as_str().unwrap());
}

/// The metered tenant's 120 tokens/min, the narrow tenant's max_tokens cap.
async fn quotas_and_caps(ep: &str) {
    let mut c = InferenceClient::connect(ep.to_string()).await.unwrap();
    let t0 = Instant::now();
    let mut consumed = 0u64;
    let refusal = loop {
        // 10 prompt tokens + 20 generated (EOS ignored): 30 tokens each.
        match c.generate(keyed(token_request("m", (1..=10).collect(), 20), "meter-key")).await {
            Ok(r) => consumed += 10 + r.into_inner().token_ids.len() as u64,
            Err(s) => break s,
        }
        assert!(consumed < 1000, "the quota never refused");
    };
    assert_eq!(refusal.code(), Code::ResourceExhausted, "{refusal:?}");
    let refill = 2.0 * t0.elapsed().as_secs_f64(); // 120/min = 2 tokens/s
    assert!(consumed as f64 <= 120.0 + refill, "{consumed} tokens used of a 120-token quota");
    assert!(consumed + 30 > 120, "refused with room left: {consumed} used");
    let wait = refusal.get_details_retry_info().and_then(|r| r.retry_delay).unwrap();
    assert!(wait >= Duration::from_secs(1), "30 tokens at 2/s take seconds, said {wait:?}");
    // max_tokens_per_request = 4: more is refused, naming the field; none is capped.
    let over = c.generate(keyed(token_request("m", vec![1, 2, 3], 5), "narrow-key")).await.unwrap_err();
    assert_eq!(over.code(), Code::InvalidArgument);
    assert!(over.message().contains("max_tokens"), "{}", over.message());
    let mut unnamed = token_request("m", vec![1, 2, 3], 1);
    unnamed.max_tokens = None;
    let capped = c.generate(keyed(unnamed, "narrow-key")).await.unwrap().into_inner();
    assert_eq!(capped.token_ids.len(), 4, "a request naming no max_tokens gets the tenant's cap");
    // Over gRPC as over HTTP, a tenant sees only its models and tokenizes with no other.
    use strata_proto::inference::v1 as pb;
    let listed = |key: &'static str| {
        let mut c = c.clone();
        async move {
            let r = c.list_models(keyed(pb::ListModelsRequest {}, key)).await.unwrap().into_inner();
            r.models.into_iter().map(|m| m.name).collect::<Vec<_>>()
        }
    };
    assert_eq!(listed("narrow-key").await, ["m"]);
    assert!(listed("elsewhere-key").await.is_empty());
    let tokenize = |key| keyed(pb::TokenizeRequest { model: "m".into(), text: "hello".into() }, key);
    assert!(!c.tokenize(tokenize("narrow-key")).await.unwrap().into_inner().token_ids.is_empty());
    let e = c.tokenize(tokenize("elsewhere-key")).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // A call without a key is refused by the auth layer before any handler.
    let e = c.list_models(pb::ListModelsRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
}

/// The admin API's usage of the steady tenant equals what its streams delivered.
async fn usage_equals_what_clients_received(ep: &str, steady_requests: usize) {
    let mut admin = AdminClient::connect(ep.to_string()).await.unwrap();
    let rows = admin
        .get_usage(apb::GetUsageRequest { tenant: "steady".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .rows;
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!((r.tenant.as_str(), r.model.as_str()), ("steady", "m"));
    assert_eq!(r.requests, steady_requests as u64);
    assert_eq!(r.prompt_tokens, 4 * steady_requests as u64);
    assert_eq!(r.generated_tokens, 4 * steady_requests as u64);
    assert_eq!((r.errors, r.rate_limited), (0, 0));
    let flood = admin
        .get_usage(apb::GetUsageRequest { tenant: "flood".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .rows;
    assert!(flood[0].rate_limited > 0 && flood[0].errors >= flood[0].rate_limited, "{flood:?}");
}

/// OpenAI's Python client over the flood tenant's rate: RateLimitError with Retry-After.
async fn openai_client_sees_429(http: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join("target/pyenv/bin/python");
    assert!(python.exists(), "{} missing: run `make prerequisites`", python.display());
    let script = root.join("tests/python/openai_rate_limit.py");
    let base = format!("http://{http}/v1");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&python).arg(script).args([&base, "m", "flood-key"]).output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("rate limit ok"), "{stdout}");
}

/// `n` beyond the tenant's `max_concurrent` could never run at once: its choices would hold
/// slots while waiting for each other. A 400 naming the limit; a tenant without the cap
/// gets its choices.
fn more_choices_than_may_run_are_refused(http: &str) {
    use strata_tests::http::post;
    let body = serde_json::json!({"model": "m", "prompt": "hi", "max_tokens": 2, "n": 2});
    let (status, err) = post(http, "/v1/completions", Some("flood-key"), &body);
    assert_eq!(status, 400, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("max_concurrent"), "{err}");
    let (status, ok) = post(http, "/v1/completions", Some("steady-key"), &body);
    assert_eq!(status, 200, "{ok}");
    assert_eq!(ok["choices"].as_array().unwrap().len(), 2);
    // A tenant sees only the models it may use.
    use strata_tests::http::request;
    let models = |key: &str| {
        let (status, text) = request(http, "GET", "/v1/models", Some(key), None).unwrap();
        assert_eq!(status, 200, "{text}");
        let list: serde_json::Value = serde_json::from_str(&text).unwrap();
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(models("narrow-key"), ["m"]);
    assert!(models("elsewhere-key").is_empty());
    assert_eq!(request(http, "GET", "/v1/models/m", Some("elsewhere-key"), None).unwrap().0, 404);
}

/// Batch files and jobs belong to the tenant that made them; its batch requests count in
/// its usage.
#[tokio::test(flavor = "multi_thread")]
async fn batches_belong_to_their_tenant() {
    use serde_json::json;
    use strata_tests::http::{post, request, upload};
    let dir = tempfile::tempdir().unwrap();
    let tenants = "[[coordinator.tenants]]\nname = \"a\"\nkeys = [\"a-key\"]\n\
                   [[coordinator.tenants]]\nname = \"b\"\nkeys = [\"b-key\"]\n";
    let data = dir.path().join("data");
    let extra = ["--http-listen", "127.0.0.1:0", "--data-dir", data.to_str().unwrap()];
    let server = serve_tenants(dir.path(), tenants, &extra);
    let http = server.out.passed("http").unwrap()["address"].as_str().unwrap().to_string();
    let line = |i: usize| {
        let body = json!({"model": "m", "prompt": format!("line {i}"), "max_tokens": 3, "ignore_eos": true});
        json!({"custom_id": format!("c{i}"), "method": "POST", "url": "/v1/completions", "body": body})
            .to_string()
    };
    let file = upload(&http, Some("a-key"), "in.jsonl", &format!("{}\n{}", line(0), line(1)));
    let id = file["id"].as_str().unwrap().to_string();
    let get = |path: String, key: &str| request(&http, "GET", &path, Some(key), None).unwrap();
    let (_, listed) = get("/v1/files".into(), "b-key");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&listed).unwrap()["data"], json!([]));
    assert_eq!(get(format!("/v1/files/{id}"), "b-key").0, 404);
    assert_eq!(get(format!("/v1/files/{id}/content"), "b-key").0, 404);
    let create = json!({"input_file_id": id, "endpoint": "/v1/completions", "completion_window": "24h"});
    assert_eq!(post(&http, "/v1/batches", Some("b-key"), &create).0, 400, "b cannot batch a's file");
    let (status, batch) = post(&http, "/v1/batches", Some("a-key"), &create);
    assert_eq!(status, 200, "{batch}");
    let batch_id = batch["id"].as_str().unwrap().to_string();
    assert_eq!(get(format!("/v1/batches/{batch_id}"), "b-key").0, 404);
    let done = strata_tests::cluster::eventually("a's batch completes", Duration::from_secs(60), || {
        let (status, body) = get(format!("/v1/batches/{batch_id}"), "a-key");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        std::future::ready((status == 200 && v["status"] == "completed").then_some(v))
    })
    .await;
    assert_eq!(done["request_counts"]["completed"], 2, "{done}");
    let mut admin = AdminClient::connect(server.endpoint()).await.unwrap();
    let rows = admin.get_usage(apb::GetUsageRequest { tenant: "a".into(), ..Default::default() }).await;
    let rows = rows.unwrap().into_inner().rows;
    assert_eq!((rows[0].requests, rows[0].generated_tokens), (2, 6), "{rows:?}");

    // A tenant deleted and made again under its name is another tenant: it does not
    // inherit the first one's files.
    let make = |admin: &mut AdminClient<Channel>| {
        let mut admin = admin.clone();
        async move {
            admin.set_tenant(apb::SetTenantRequest { name: "c".into(), ..Default::default() }).await.unwrap();
            let key = admin.create_api_key(apb::CreateApiKeyRequest { tenant: "c".into() }).await.unwrap();
            key.into_inner().key
        }
    };
    let first = make(&mut admin).await;
    let left = upload(&http, Some(&first), "left.jsonl", &line(0));
    let left = left["id"].as_str().unwrap().to_string();
    assert_eq!(get(format!("/v1/files/{left}"), &first).0, 200);
    admin.delete_tenant(apb::DeleteTenantRequest { name: "c".into() }).await.unwrap();
    let again = make(&mut admin).await;
    let (_, listed) = get("/v1/files".into(), &again);
    assert_eq!(serde_json::from_str::<serde_json::Value>(&listed).unwrap()["data"], json!([]), "{listed}");
    assert_eq!(get(format!("/v1/files/{left}"), &again).0, 404);
    assert_eq!(get(format!("/v1/files/{left}/content"), &again).0, 404);
}

/// With the replica's four sequence slots taken by a tenant that floods without limits,
/// another tenant's requests still start at once (a slot is kept for it) and its p50 TTFT
/// stays within 2× of its unloaded value; the flood's requests wait in the coordinator's
/// fair queue instead of the engine's FIFO one.
#[tokio::test(flavor = "multi_thread")]
async fn fair_admission_keeps_a_slot_for_other_tenants() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = "[[coordinator.tenants]]\nname = \"flood\"\nkeys = [\"flood-key\"]\n\
                   [[coordinator.tenants]]\nname = \"steady\"\nkeys = [\"steady-key\"]\n";
    let server = serve_tenants(dir.path(), tenants, &["--max-num-seqs", "4"]);
    let ep = server.endpoint();
    let mut c = InferenceClient::connect(ep.clone()).await.unwrap();
    for _ in 0..3 {
        ttft(&mut c, "steady-key").await;
    }
    let mut unloaded = Vec::new();
    for _ in 0..12 {
        unloaded.push(ttft(&mut c, "steady-key").await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let flooders: Vec<_> = (0..16)
        .map(|_| {
            let (ep, stop, done) = (ep.clone(), stop.clone(), done.clone());
            tokio::spawn(async move {
                let mut c = InferenceClient::connect(ep).await.unwrap();
                while !stop.load(Ordering::Relaxed) {
                    let req = keyed(token_request("m", vec![1, 2, 3, 4, 5, 6, 7, 8], 48), "flood-key");
                    c.generate(req).await.expect("the flood waits its turn, it is not refused");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    while done.load(Ordering::Relaxed) < 4 {
        tokio::time::sleep(Duration::from_millis(10)).await; // the flood is under way
    }
    let mut loaded = Vec::new();
    for _ in 0..12 {
        loaded.push(ttft(&mut c, "steady-key").await);
    }
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.await.unwrap();
    }
    let (before, after) = (median(unloaded), median(loaded));
    let bound = 2 * before.max(Duration::from_millis(10));
    eprintln!("steady p50 TTFT {before:?} → {after:?} beside 16 unlimited flood streams on 4 slots");
    assert!(
        after <= bound,
        "steady's p50 TTFT {after:?} under the flood vs {before:?} unloaded (bound {bound:?})"
    );
}

/// Probed: a prompt another tenant sent answered in milliseconds against a second for an
/// unseen one. A tenant's prompts read only its own cached blocks (the coordinator salts
/// every request with its tenant): the engine's prefix-cache hits grow for the tenant that
/// repeats its prompt, not for another sending the same.
#[tokio::test(flavor = "multi_thread")]
async fn tenants_share_no_cached_prefix() {
    use strata_tests::http::{sample, scrape};
    let dir = tempfile::tempdir().unwrap();
    let tenants = "[[coordinator.tenants]]\nname = \"a\"\nkeys = [\"a-key\"]\n\
                   [[coordinator.tenants]]\nname = \"b\"\nkeys = [\"b-key\"]\n";
    let mut server = {
        let config = dir.path().join("strata.toml");
        std::fs::write(&config, tenants).unwrap();
        let model = fixtures_dir().join("llama_gqa");
        let args = ["--config", config.to_str().unwrap(), "--model", model.to_str().unwrap(), "--name", "m"];
        Server::spawn(&[&args[..], &["--metrics-listen", "127.0.0.1:0"]].concat())
    };
    let metrics = server.out.wait_event("metrics", Duration::from_secs(60), "strata serve");
    let metrics = metrics["address"].as_str().unwrap().to_string();
    server.addr = server.wait_ready();
    let hits =
        || sample(&scrape(&metrics), "strata_prefix_cache_hits_total", &[("model", "m")]).unwrap_or(0.0);
    let c = InferenceClient::connect(server.endpoint()).await.unwrap();
    let prompt: Vec<u32> = (1..=64).collect();
    let send = |key: &'static str| {
        let mut c = c.clone();
        let prompt = prompt.clone();
        async move { c.generate(keyed(token_request("m", prompt, 1), key)).await.unwrap() }
    };
    send("a-key").await;
    let before = hits();
    send("b-key").await;
    assert_eq!(hits(), before, "b's prompt read a's cached blocks");
    send("a-key").await;
    assert!(hits() >= before + 48.0, "a's own repeat reads its cached blocks: {} → {}", before, hits());
}
