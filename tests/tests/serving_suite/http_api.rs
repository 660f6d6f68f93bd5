//! The OpenAI-style HTTP API of a real `strata serve`: OpenAI's official Python client
//! (tests/python/openai_client.py), the same tokens as gRPC and as HF transformers, the
//! probes, API keys, a client that disconnects cancelling its sequence, and the response
//! cache.

use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::http::{post, request, sse_data};
use strata_tests::{fixtures_dir, ids, reference, write_slow_model, Server};

const KEY: &str = "sk-test-key";

/// A copy of a fixture model with a ChatML chat template (the fixtures have none).
pub(crate) fn chat_model(fixture: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures_dir().join(fixture)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    add_template(dir.path());
    dir
}

fn add_template(dir: &Path) {
    let path = dir.join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["chat_template"] = json!(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    );
    std::fs::write(path, config.to_string()).unwrap();
}

/// Starts `strata serve` with the HTTP API; returns it and the HTTP address.
pub(crate) fn serve_http(model: &Path, extra: &[&str]) -> (Server, String) {
    let mut args = vec!["--model", model.to_str().unwrap(), "--name", "m", "--http-listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let server = Server::start(&args);
    let http = server.out.passed("http").expect("the HTTP API announces its address");
    let http = http["address"].as_str().unwrap().to_string();
    (server, http)
}

async fn grpc_text(server: &Server, key: &str, prompt: &str, max_tokens: u32) -> String {
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    let mut req = tonic::Request::new(pb::GenerateRequest {
        model: "m".into(),
        prompt: Some(pb::generate_request::Prompt::Text(prompt.into())),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    });
    req.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    c.generate(req).await.unwrap().into_inner().text
}

#[tokio::test(flavor = "multi_thread")]
async fn openais_python_client_works_against_strata() {
    let model = chat_model("llama_gqa");
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().to_str().unwrap();
    let (server, http) = serve_http(model.path(), &["--api-key", KEY, "--data-dir", data_dir]);
    let prompt = "The quick brown fox";
    let greedy = grpc_text(&server, KEY, prompt, 8).await;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join("target/pyenv/bin/python");
    assert!(python.exists(), "{} missing: run `make prerequisites`", python.display());
    let expected = json!({"prompt": prompt, "greedy": greedy}).to_string();
    let script = root.join("tests/python/openai_client.py");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&python)
            .arg(script)
            .args([&format!("http://{http}/v1"), "m", KEY, &expected])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "openai client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("10 passed"), "{stdout}");
}

#[test]
fn token_prompts_give_hf_transformers_greedy_tokens() {
    let dir = fixtures_dir().join("llama_gqa");
    let r = reference(&dir);
    let (_server, http) = serve_http(&dir, &[]);
    let prompt = ids(&r["prompt_ids"]);
    let want = ids(&r["greedy_ids"]);
    let body = json!({
        "model": "m", "prompt": prompt, "max_tokens": want.len(), "temperature": 0,
        "ignore_eos": true, "logprobs": 0,
    });
    let (status, v) = post(&http, "/v1/completions", None, &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], want.len());
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    // The text of HF's tokens, token by token.
    let tokenizer = strata_coordinator::request::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let texts: Vec<String> = want.iter().map(|&t| tokenizer.token_text(t)).collect();
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!(texts));
    assert_eq!(v["choices"][0]["text"], tokenizer.decode(&want).unwrap());
    assert_eq!(v["choices"][0]["text"], r["greedy_text"]);
}

#[test]
fn probes_are_open_and_everything_else_needs_the_key() {
    let model = chat_model("llama_gqa");
    let (server, http) = serve_http(model.path(), &["--api-key", KEY, "--metrics-listen", "127.0.0.1:0"]);
    assert_eq!(request(&http, "GET", "/health", None, None).unwrap().0, 200);
    assert_eq!(request(&http, "GET", "/ready", None, None).unwrap().0, 200);
    let (status, body) = request(&http, "GET", "/v1/models", None, None).unwrap();
    assert_eq!(status, 401, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["error"]["code"], "invalid_api_key");
    assert_eq!(request(&http, "GET", "/v1/models", Some(KEY), None).unwrap().0, 200);
    let (status, body) =
        post(&http, "/v1/completions", Some(KEY), &json!({"model": "m", "prompt": "x", "max_tokens": 99999}));
    assert_eq!((status, &body["error"]["param"]), (400, &json!("max_tokens")), "{body}");
    let (status, body) = request(&http, "POST", "/v1/completions", Some(KEY), None).unwrap();
    assert_eq!(status, 400, "{body}");
    assert_eq!(request(&http, "GET", "/v1/nothing", Some(KEY), None).unwrap().0, 404);
    // The HTTP API's metrics count what the client saw, by route template and status.
    let metrics = server.out.passed("metrics").unwrap()["address"].as_str().unwrap().to_string();
    let (_, text) = strata_tests::prometheus::http_get(&metrics, "/metrics").unwrap();
    for (route, status) in
        [("/v1/models", 401), ("/v1/models", 200), ("/v1/completions", 400), ("(unmatched)", 404)]
    {
        let line = format!(
            "strata_http_requests_total{{route=\"{route}\",method=\"{}\",status=\"{status}\"}}",
            if route == "/v1/completions" { "POST" } else { "GET" }
        );
        let n: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .unwrap_or_else(|| panic!("{line} missing"))
            .trim()
            .parse()
            .unwrap();
        assert!(n >= 1.0, "{line} {n}");
    }
}

#[test]
fn a_chat_request_without_a_template_is_a_clear_error() {
    let dir = fixtures_dir().join("llama_gqa");
    let (_server, http) = serve_http(&dir, &[]);
    let (status, body) = post(
        &http,
        "/v1/chat/completions",
        None,
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("no chat template"), "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_disconnects_cancels_its_sequence() {
    let tmp = tempfile::tempdir().unwrap();
    write_slow_model(tmp.path());
    add_template(tmp.path());
    let (server, http) = serve_http(tmp.path(), &[]);
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    let body = json!({
        "model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1900,
        "ignore_eos": true, "stream": true,
    })
    .to_string();
    let mut s = std::net::TcpStream::connect(&http).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while sse_data(&seen).len() < 4 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let running = |m: pb::ListModelsResponse| m.models[0].running_sequences;
    assert_eq!(running(c.list_models(pb::ListModelsRequest {}).await.unwrap().into_inner()), 1);
    drop(s); // the client goes away mid-generation
    let started = Instant::now();
    loop {
        let m = c.list_models(pb::ListModelsRequest {}).await.unwrap().into_inner();
        if running(m.clone()) == 0 && m.models[0].kv_blocks_free == m.models[0].kv_blocks_total {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "sequence still running after disconnect: {m:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A replica lost mid-stream with no other to resume on: the stream ends with an error
/// event, which OpenAI's client raises as its `APIError`.
#[test]
fn an_error_after_streaming_started_is_raised_by_the_client() {
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    write_slow_model(tmp.path());
    add_template(tmp.path());
    let model = tmp.path().to_str().unwrap();
    let mut server = Server::spawn(&[
        "--model",
        model,
        "--name",
        "m",
        "--tp",
        "2",
        "--worker-rendezvous",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--route-wait",
        "0.5",
    ]);
    let rendezvous = server.out.wait_event("rendezvous", Duration::from_secs(60), "strata serve");
    let mut worker = std::process::Command::new(strata_tests::strata_bin())
        .args(["worker", "--model", model, "--tp", "2", "--rank", "1", "--rendezvous"])
        .arg(rendezvous["address"].as_str().unwrap())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    server.addr = server.wait_ready();
    let http = server.out.passed("http").unwrap()["address"].as_str().unwrap().to_string();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut client = std::process::Command::new(root.join("target/pyenv/bin/python"))
        .arg(root.join("tests/python/openai_stream_error.py"))
        .args([&format!("http://{http}/v1"), "m"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(client.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "started");
    worker.kill().unwrap(); // the replica's other rank dies mid-generation
    worker.wait().unwrap();
    let outcome: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    client.wait().unwrap();
    assert_eq!(outcome["raised"], "APIError", "{outcome}");
    assert!(outcome["message"].as_str().unwrap().contains("unavailable"), "{outcome}");
}

/// Every replica's queue full: 429 with Retry-After, as OpenAI's clients expect to back off.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_queue_answers_429() {
    let tmp = tempfile::tempdir().unwrap();
    write_slow_model(tmp.path());
    let extra = ["--max-num-seqs", "1", "--max-waiting", "1", "--metrics-listen", "127.0.0.1:0"];
    let (server, http) = serve_http(tmp.path(), &extra);
    let metrics = server.out.passed("metrics").expect("the metrics address is announced");
    let metrics = metrics["address"].as_str().unwrap().to_string();
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    let mut running =
        c.generate_stream(strata_tests::token_request("m", vec![1, 2], 1500)).await.unwrap().into_inner();
    assert!(running.message().await.unwrap().is_some());
    // The next request waits in the coordinator's queue for the one slot; then it is full.
    let mut w = c.clone();
    let _waiting =
        tokio::spawn(async move { w.generate(strata_tests::token_request("m", vec![1, 3], 4)).await });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while strata_tests::http::sample(
        &strata_tests::http::scrape(&metrics),
        "strata_admission_waiting",
        &[("model", "m")],
    ) != Some(1.0)
    {
        assert!(std::time::Instant::now() < deadline, "the request never queued");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let body = json!({"model": "m", "prompt": [1, 4], "max_tokens": 4}).to_string();
    let mut s = std::net::TcpStream::connect(&http).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    assert!(raw.starts_with("HTTP/1.0 429"), "{raw}");
    assert!(raw.to_ascii_lowercase().contains("\r\nretry-after: 1\r\n"), "{raw}");
    let (_, json) = raw.split_once("\r\n\r\n").unwrap();
    let json: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(json["error"]["type"], "rate_limit_error", "{json}");
}

/// The response cache over HTTP: a repeated greedy completion is the same response, taken
/// from the cache (its hit counted); `"cache": false` generates again.
#[test]
fn a_repeated_greedy_completion_comes_from_the_response_cache() {
    let dir = fixtures_dir().join("llama_gqa");
    let (server, http) = serve_http(&dir, &["--metrics-listen", "127.0.0.1:0"]);
    let metrics = server.out.passed("metrics").expect("the metrics address is announced");
    let metrics = metrics["address"].as_str().unwrap().to_string();
    let hits = || {
        let (status, text) = request(&metrics, "GET", "/metrics", None, None).expect("scrape /metrics");
        assert_eq!(status, 200);
        let line = text.lines().find(|l| l.starts_with("strata_response_cache_hits_total{model=\"m\"}"));
        line.and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok()).unwrap_or(0.0)
    };
    let body = json!({"model": "m", "prompt": [3, 1, 4, 1, 5], "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (status, first) = post(&http, "/v1/completions", None, &body);
    assert_eq!(status, 200, "{first}");
    let (_, again) = post(&http, "/v1/completions", None, &body);
    assert_eq!((&again["choices"], &again["usage"]), (&first["choices"], &first["usage"]));
    assert_eq!(hits(), 1.0);
    let mut fresh = body.clone();
    fresh["cache"] = json!(false);
    let (_, generated) = post(&http, "/v1/completions", None, &fresh);
    assert_eq!(generated["choices"], first["choices"]);
    assert_eq!(hits(), 1.0, "an opted-out request is generated");
}

/// Peak resident bytes of a process (VmHWM).
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).unwrap();
    kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
}

/// A chat template multiplies a caller's data (Llama 3.1 writes `tools |
/// tojson(indent=4)`; 50 levels of nesting put 200 bytes of indentation before each of 2M
/// leaves: 400 MB from a 4 MB body). The rendering stops at what the model's context
/// holds as text: a clear 400, the server's peak memory bounded (it grew by ~190 MiB,
/// the parsed body and the template's copy of it; 2.5 GB before the bound), and it
/// answers `/health` meanwhile.
#[test]
fn a_chat_template_cannot_multiply_a_body_into_gigabytes() {
    let model = chat_model("llama_gqa");
    let template = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/chat_templates/templates/llama31_tools.jinja"),
    )
    .unwrap();
    let path = model.path().join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["chat_template"] = json!(template);
    std::fs::write(&path, config.to_string()).unwrap();
    let (server, http) = serve_http(model.path(), &[]);
    let before = peak_rss(server.child.id());
    let leaves = serde_json::Value::Array(vec![json!(1); 2_000_000]);
    let nested = (0..50).fold(leaves, |v, _| json!([v]));
    let tool =
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": nested}}});
    let body = json!({"model": "m", "max_tokens": 4, "tools": [tool],
        "messages": [{"role": "user", "content": "hi"}]});
    let post_it = {
        let http = http.clone();
        std::thread::spawn(move || post(&http, "/v1/chat/completions", None, &body))
    };
    while !post_it.is_finished() {
        let t = Instant::now();
        let (status, _) = request(&http, "GET", "/health", None, None).unwrap();
        assert_eq!(status, 200);
        assert!(t.elapsed() < Duration::from_secs(2), "/health took {:?} during the rendering", t.elapsed());
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, err) = post_it.join().unwrap();
    assert_eq!(status, 400, "{err}");
    let message = err["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("bytes"), "{err}");
    let grown = peak_rss(server.child.id()).saturating_sub(before);
    eprintln!("peak memory grew by {} MiB", grown >> 20);
    assert!(grown < 400 << 20, "peak memory grew by {} MiB", grown >> 20);
    // Still serving.
    let ok = json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(post(&http, "/v1/chat/completions", None, &ok).0, 200);
}

/// The context a request may have is the one `/v1/models` and `ListModels` report —
/// `--max-model-len`, or a KV cache too small for the model's whole context — and a request
/// for more is a 400 naming `max_tokens` when it arrives, never a failure midway (nor a
/// 429 that clients would retry). A chat without `max_tokens` fills exactly that context.
#[tokio::test(flavor = "multi_thread")]
async fn the_context_limit_is_reported_and_enforced_on_arrival() {
    let model = chat_model("llama_gqa");
    let cases = [
        (&["--max-model-len", "100"][..], false),
        (&["--kv-cache-memory", "64KiB", "--log-format", "json"][..], true),
    ];
    for (extra, limited_by_kv) in cases {
        let (server, http) = serve_http(model.path(), extra);
        let (status, body) = request(&http, "GET", "/v1/models", None, None).unwrap();
        assert_eq!(status, 200, "{body}");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        let context = body["data"][0]["max_model_len"].as_u64().unwrap();
        if limited_by_kv {
            assert!((64..512).contains(&context), "the KV cache's limit: {body}");
            // ... which the server warned about when it started.
            let warned = |log: String| {
                log.lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .any(|v| v["level"] == "WARN" && v["fields"]["kv_positions"].as_u64() == Some(context))
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            while !warned(server.log()) {
                assert!(Instant::now() < deadline, "no warning that the KV cache limits the context");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        } else {
            assert_eq!(context, 100, "{body}");
        }
        let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
        let listed = c.list_models(pb::ListModelsRequest {}).await.unwrap().into_inner();
        assert_eq!(listed.models[0].max_context as u64, context);

        let ask = |max_tokens: u64| json!({"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "ignore_eos": true});
        let (status, body) = post(&http, "/v1/completions", None, &ask(context - 3));
        assert_eq!((status, &body["error"]["param"]), (400, &json!("max_tokens")), "{body}");
        let (status, body) = post(&http, "/v1/completions", None, &ask(context - 4));
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"].as_u64(), Some(context - 4), "{body}");

        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "go"}], "ignore_eos": true});
        let (status, body) = post(&http, "/v1/chat/completions", None, &chat);
        assert_eq!(status, 200, "{body}");
        let usage = &body["usage"];
        let total = usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap();
        assert_eq!((total, &body["choices"][0]["finish_reason"]), (context, &json!("length")), "{body}");
    }
}

/// vLLM's utility routes answer with its fields — `/tokenize` gives HF transformers' ids
/// and counts a chat as a chat completion does, `/detokenize` inverts it — and a path or
/// method the API does not have is an OpenAI-shaped error naming it.
#[tokio::test(flavor = "multi_thread")]
async fn utility_routes_and_unknown_routes_answer_in_openais_shape() {
    let model = chat_model("llama_gqa");
    let r = reference(&fixtures_dir().join("llama_gqa"));
    let (_server, http) = serve_http(model.path(), &["--api-key", KEY]);
    let (status, body) = request(&http, "GET", "/version", None, None).unwrap();
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, body["version"].as_str()), (200, Some(env!("CARGO_PKG_VERSION"))));

    let text = r["text_prompt"].as_str().unwrap();
    let tokenize = json!({"model": "m", "prompt": text, "return_token_strs": true});
    assert_eq!(post(&http, "/tokenize", None, &tokenize).0, 401, "the API key guards it");
    let (status, body) = post(&http, "/tokenize", Some(KEY), &tokenize);
    assert_eq!(status, 200, "{body}");
    assert_eq!(ids(&body["tokens"]), ids(&r["text_prompt_ids"]), "HF transformers' ids: {body}");
    let count = r["text_prompt_ids"].as_array().unwrap().len();
    assert_eq!(body["count"], count);
    assert_eq!(
        (body["max_model_len"].as_u64(), body["token_strs"].as_array().map(Vec::len)),
        (Some(512), Some(count))
    );
    let bare = json!({"model": "m", "prompt": text, "add_special_tokens": false});
    let (_, body) = post(&http, "/tokenize", Some(KEY), &bare);
    let (status, back) =
        post(&http, "/detokenize", Some(KEY), &json!({"model": "m", "tokens": body["tokens"]}));
    assert_eq!((status, back["prompt"].as_str()), (200, Some(text)), "{back}");

    let messages = json!([{"role": "user", "content": "hello there"}]);
    let (_, counted) = post(&http, "/tokenize", Some(KEY), &json!({"model": "m", "messages": messages}));
    let chat = json!({"model": "m", "messages": messages, "max_tokens": 1});
    let (status, done) = post(&http, "/v1/chat/completions", Some(KEY), &chat);
    assert_eq!(status, 200, "{done}");
    assert_eq!(counted["count"], done["usage"]["prompt_tokens"], "{counted} {done}");

    let refused = |path: &str, body: serde_json::Value| post(&http, path, Some(KEY), &body);
    let (status, e) = refused("/tokenize", json!({"model": "m", "prompt": "x", "truncate": 3}));
    assert_eq!((status, &e["error"]["param"]), (400, &json!("truncate")), "{e}");
    let (status, e) = refused("/detokenize", json!({"model": "m", "tokens": [5, 99999]}));
    assert_eq!((status, &e["error"]["param"]), (400, &json!("tokens[1]")), "{e}");
    let (status, e) = refused("/tokenize", json!({"model": "nope", "prompt": "x"}));
    assert_eq!(status, 404, "{e}");

    for (method, path, want, code) in [
        ("GET", "/v1/nothing", 404, "unknown_url"),
        ("POST", "/v2/completions", 404, "unknown_url"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("DELETE", "/tokenize", 405, "method_not_allowed"),
    ] {
        let (status, body) = request(&http, method, path, Some(KEY), None).unwrap();
        let body: serde_json::Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{method} {path}: {e}: {body}"));
        assert_eq!((status, body["error"]["code"].as_str()), (want, Some(code)), "{method} {path}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(method) && message.contains(path), "{message}");
    }
}

/// The README's chat example, as written, against a model `strata model random` writes with
/// `make demo`'s shape: a random model has a chat template too, and the streamed chat ends
/// with `[DONE]`.
#[test]
fn the_readmes_chat_example_works_on_the_demo_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("llama");
    let shape = ["--arch", "llama", "--layers", "2", "--hidden", "256", "--heads", "8", "--kv-heads", "4"];
    let out = std::process::Command::new(strata_tests::strata_bin())
        .args(["model", "random"])
        .args(shape)
        .args(["--intermediate", "768", "--vocab", "2048", "--out", model.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (_server, http) = serve_http(&model, &[]);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "Hello"}], "stream": true});
    let (status, text) = request(&http, "POST", "/v1/chat/completions", None, Some(&body)).unwrap();
    assert_eq!(status, 200, "{text}");
    let events = sse_data(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let chunks: Vec<serde_json::Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().any(|c| c["choices"][0]["finish_reason"].is_string()));
}
