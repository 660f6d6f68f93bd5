//! Attacks an ordinary key holder or a stranger can make with small requests, against a
//! real `strata serve`: each must get a clear error (or be shed) while the server's memory
//! stays bounded and other callers are answered.

use std::path::Path;

use serde_json::json;
use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::{fixtures_dir, http, Server};

/// The server's peak resident memory so far (VmHWM), in MiB.
pub fn peak_rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the server's status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kib / 1024
}

/// The GQA fixture with Llama 3.1's tool template (`tools | tojson(indent=4)`) and a
/// 512-byte token in its vocabulary, as real vocabularies have (runs of spaces, `=`):
/// the bytes the context could hold as text then far exceed what real text holds.
fn model_with_tool_template(dir: &Path) {
    let src = fixtures_dir().join("llama_gqa");
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let template = fixtures_dir().join("../chat_templates/templates/llama31_tools.jinja");
    std::fs::copy(template, dir.join("chat_template.jinja")).unwrap();
    let path = dir.join("tokenizer.json");
    let mut tok: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let long = "=".repeat(512);
    tok["added_tokens"].as_array_mut().unwrap().push(json!({
        "id": 384, "content": long, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": false
    }));
    std::fs::write(&path, tok.to_string()).unwrap();
}

/// `n` tools whose parameters nest `depth` deep with `width` keys at the bottom:
/// `tojson(indent=4)` writes each bottom key behind `4 × depth` spaces.
fn nested_tools(n: usize, depth: usize, width: usize) -> serde_json::Value {
    let mut leaf = serde_json::Map::new();
    for k in 0..width {
        leaf.insert(format!("k{k}"), json!(k));
    }
    let mut v = serde_json::Value::Object(leaf);
    for _ in 0..depth {
        v = json!({ "p": v });
    }
    let tool = json!({"type": "function", "function": {"name": "f", "parameters": v}});
    json!(vec![tool; n])
}

/// Tokenizing is bounded by the model's context on every path: a small chat body whose
/// template multiplies its tools, a prompt far past the context, and concurrent gRPC
/// `Tokenize` calls are refused after a piece of their text is counted (never tokenized
/// whole), naming the field; the server's memory stays within a bound; and a text that
/// fits still gets its ids.
#[test]
fn tokenizing_is_bounded_by_the_context_on_every_path() {
    let dir = tempfile::tempdir().unwrap();
    model_with_tool_template(dir.path());
    let model = dir.path().to_string_lossy().to_string();
    let server = Server::start(&["--model", &model, "--name", "m", "--http-listen", "127.0.0.1:0"]);
    let addr = server.out.passed("http").unwrap()["address"].as_str().unwrap().to_string();
    let before = peak_rss_mib(server.child.id());

    // ~60 KB of JSON that the template writes out as megabytes.
    let tools = nested_tools(8, 60, 120);
    let messages = json!([{"role": "user", "content": "hi"}]);
    let body = json!({"model": "m", "messages": messages, "tools": tools});
    assert!(body.to_string().len() < 100_000);
    for path in ["/tokenize", "/v1/chat/completions"] {
        let (status, reply) = http::post(&addr, path, None, &body);
        assert_eq!(status, 400, "{path}: {reply}");
        let message = reply["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("more than 512 tokens"), "{path}: {reply}");
        assert_eq!(reply["error"]["param"], "messages", "{path}: {reply}");
    }

    // A prompt of ~400 KB: within the bytes 512 tokens of the long token could be, far
    // past what they are.
    let long = "lorem ipsum dolor sit amet ".repeat(15_000);
    let (status, reply) = http::post(&addr, "/tokenize", None, &json!({"model": "m", "prompt": long}));
    assert_eq!(status, 400, "{reply}");
    assert!(reply["error"]["message"].as_str().unwrap().contains("more than 512 tokens"), "{reply}");

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = InferenceClient::connect(server.endpoint()).await.unwrap();
        let calls = (0..8).map(|_| {
            let mut c = client.clone();
            let text = long.clone();
            async move { c.tokenize(pb::TokenizeRequest { model: "m".into(), text }).await }
        });
        for r in futures::future::join_all(calls).await {
            let e = r.expect_err("a text past the context");
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
            assert!(e.message().contains("more than 512 tokens"), "{e:?}");
        }
        // A text that fits: the same ids over gRPC and HTTP.
        let mut c = client.clone();
        let short = "lorem ipsum ".repeat(20);
        let ids = c
            .tokenize(pb::TokenizeRequest { model: "m".into(), text: short.clone() })
            .await
            .unwrap()
            .into_inner()
            .token_ids;
        let (status, reply) = http::post(&addr, "/tokenize", None, &json!({"model": "m", "prompt": short}));
        assert_eq!(status, 200, "{reply}");
        assert_eq!(strata_tests::ids(&reply["tokens"]), ids);
        assert_eq!(reply["max_model_len"], 512);
    });

    let grew = peak_rss_mib(server.child.id()).saturating_sub(before);
    assert!(grew < 300, "the server's peak memory grew by {grew} MiB");
}

/// Request bodies that trickle in cannot hold the HTTP listener: a tenant's bodies past
/// its 256 arriving at once are refused at once (429, connection closed), the rest are
/// cut once they fall behind the minimum rate, and `/health` and completions are answered
/// throughout and after.
#[test]
fn trickling_request_bodies_cannot_hold_the_http_api() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let gqa = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let server = Server::start(&["--model", &gqa, "--name", "m", "--http-listen", "127.0.0.1:0"]);
    let addr = server.out.passed("http").unwrap()["address"].as_str().unwrap().to_string();
    let started = std::time::Instant::now();
    let slow: Vec<TcpStream> = (0..300)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            let head = "POST /v1/completions HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{";
            s.write_all(head.as_bytes()).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
            s
        })
        .collect();
    let (status, _) = http::request(&addr, "GET", "/health", None, None).unwrap();
    assert_eq!(status, 200, "health while bodies trickle");
    let mut refused = 0;
    for mut s in slow {
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        let reply = String::from_utf8_lossy(&reply);
        if reply.starts_with("HTTP/1.1 429") {
            refused += 1;
        } else {
            assert!(reply.starts_with("HTTP/1.1 400"), "a trickling body: {reply}");
            assert!(reply.contains("too slowly"), "{reply}");
        }
    }
    assert_eq!(refused, 300 - 256, "bodies past the tenant's bound are refused");
    assert!(started.elapsed() < std::time::Duration::from_secs(25), "held for {:?}", started.elapsed());
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 2});
    let (status, reply) = http::post(&addr, "/v1/completions", None, &body);
    assert_eq!(status, 200, "{reply}");
}

/// `strata serve` runs replicas with more ranks than the process has threads: with two
/// pool threads, `--tp 4` and `--tp 2 --pp 2` once failed their first canary (two ranks
/// blocked in a collective held both threads the others needed). Each rank now has a pool
/// of its own, and the output is HF's.
#[tokio::test(flavor = "multi_thread")]
async fn serve_runs_replicas_with_more_ranks_than_threads() {
    let dir = fixtures_dir().join("llama_gqa");
    let model = dir.to_string_lossy().to_string();
    let r = strata_tests::reference(&dir);
    let (prompt, want) = (strata_tests::ids(&r["prompt_ids"]), strata_tests::ids(&r["greedy_ids"]));
    for split in [&["--tp", "4"][..], &["--tp", "2", "--pp", "2"]] {
        let mut args = vec!["--model", &model, "--name", "m"];
        args.extend_from_slice(split);
        let server = Server::start_with_env(&args, &[("RAYON_NUM_THREADS", "2")]);
        let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
        let request = strata_tests::token_request("m", prompt.clone(), want.len() as u32);
        let got = c.generate(request).await.unwrap_or_else(|e| panic!("{split:?}: {e:?}")).into_inner();
        assert_eq!(got.token_ids, want, "{split:?}");
    }
}

/// `strata serve` honours the canary timings (flags and `[coordinator]` alike; it once
/// used the defaults whatever was set): canaries every 0.2 s show as steps of an idle
/// replica, ten within seconds where the default interval gives one.
#[test]
fn serve_runs_canaries_at_the_configured_interval() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("strata.toml");
    std::fs::write(&config, "[coordinator]\ncanary_interval_s = 0.2\ncanary_timeout_s = 5.0\n").unwrap();
    let model = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let config = config.to_string_lossy().to_string();
    let mut server = Server::spawn(&[
        "--config",
        &config,
        "--model",
        &model,
        "--name",
        "m",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let metrics = server.out.wait_event("metrics", std::time::Duration::from_secs(60), "strata serve");
    let metrics = metrics["address"].as_str().unwrap().to_string();
    server.addr = server.wait_ready();
    let steps = || {
        let text = strata_tests::http::scrape(&metrics);
        strata_tests::http::sample(&text, "strata_batch_tokens_count", &[("model", "m")]).unwrap_or(0.0)
    };
    let first = steps();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while steps() < first + 10.0 {
        assert!(std::time::Instant::now() < deadline, "canaries not at 0.2 s: {} steps", steps() - first);
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A request whose bytes are not a whole protobuf message (truncated mid-field) is the
/// caller's error, INVALID_ARGUMENT, not INTERNAL.
#[tokio::test(flavor = "multi_thread")]
async fn a_truncated_protobuf_request_is_invalid_argument() {
    let model = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let server = Server::start(&["--model", &model, "--name", "m"]);
    let tcp = tokio::net::TcpStream::connect(&server.addr).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let req = tonic::codegen::http::Request::post(format!(
        "http://{}/strata.inference.v1.Inference/Tokenize",
        server.addr
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let (response, mut body) = send.ready().await.unwrap().send_request(req, false).unwrap();
    // Field 1 (model) says 10 bytes and 2 follow.
    let message = [0x0a, 10, b'm', b'x'];
    let mut frame = vec![0u8, 0, 0, 0, message.len() as u8];
    frame.extend_from_slice(&message);
    body.send_data(frame.into(), true).unwrap();
    let response = response.await.unwrap();
    let headers = response.headers().clone();
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        chunk.unwrap();
    }
    let trailers = body.trailers().await.unwrap().unwrap_or_default();
    let status = headers.get("grpc-status").or_else(|| trailers.get("grpc-status")).expect("a grpc-status");
    assert_eq!(status, "3", "INVALID_ARGUMENT: {headers:?} {trailers:?}");
}

/// A fuzz pass over the multipart upload a key holder sends to `/v1/files`: a valid form
/// mutated (bytes flipped, cut, inserted, boundaries broken) is stored or refused with a
/// 4xx, never a 5xx or a crash, and the server answers after.
#[test]
fn mutated_multipart_uploads_are_refused_cleanly() {
    use std::io::{Read, Write};
    let data = tempfile::tempdir().unwrap();
    let gqa = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let dir = data.path().to_string_lossy().to_string();
    let server =
        Server::start(&["--model", &gqa, "--name", "m", "--http-listen", "127.0.0.1:0", "--data-dir", &dir]);
    let addr = server.out.passed("http").unwrap()["address"].as_str().unwrap().to_string();
    let boundary = "b0undary";
    let line =
        r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","prompt":"x"}}"#;
    let valid = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.jsonl\"\r\n\
         Content-Type: application/jsonl\r\n\r\n{line}\r\n--{boundary}--\r\n"
    )
    .into_bytes();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n.max(1) as u64) as usize
    };
    let specials: &[&[u8]] = &[b"\r\n", b"--", b"--b0undary", b"\"", b";", b"\0", b"\xff"];
    let mut statuses = std::collections::BTreeMap::new();
    for _ in 0..200 {
        let mut body = valid.clone();
        for _ in 0..1 + next(3) {
            match next(4) {
                0 => {
                    let at = next(body.len());
                    body[at] ^= 1 << next(8);
                }
                1 => body.truncate(next(body.len() + 1)),
                _ => {
                    let at = next(body.len() + 1);
                    let s = specials[next(specials.len())];
                    body.splice(at..at, s.iter().copied());
                }
            }
        }
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
        let head = format!(
            "POST /v1/files HTTP/1.0\r\nHost: s\r\nContent-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        let _ = s.write_all(&body);
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        let reply = String::from_utf8_lossy(&reply);
        let status: u16 = reply.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        assert!(status == 200 || (400..500).contains(&status), "a mutated form got {status}: {reply:.300}");
        *statuses.entry(status).or_insert(0) += 1;
    }
    assert!(statuses.keys().any(|&s| s >= 400), "the mutations reached the parser: {statuses:?}");
    let (status, _) = http::request(&addr, "GET", "/health", None, None).unwrap();
    assert_eq!(status, 200);
}
