//! Batch jobs survive their coordinator: a 200-request batch whose `strata serve` is
//! killed (SIGKILL) midway finishes after a restart on the same data directory, with each
//! request answered exactly once, and its answers equal the same requests sent online.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_tests::http::{post, request, upload};
use strata_tests::{write_slow_model, Server};

fn serve(model: &str, data: &str) -> (Server, String) {
    let server = Server::start(&[
        "--model",
        model,
        "--name",
        "m",
        "--http-listen",
        "127.0.0.1:0",
        "--data-dir",
        data,
        "--batch-concurrency",
        "8",
    ]);
    let http = server.out.passed("http").expect("the HTTP API announces its address");
    (server, http["address"].as_str().unwrap().to_string())
}

fn batch(http: &str, id: &str) -> Value {
    let (status, body) = request(http, "GET", &format!("/v1/batches/{id}"), None, None).unwrap();
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn body(i: usize) -> Value {
    json!({"model": "m", "prompt": format!("request number {i}"), "max_tokens": 16, "temperature": 0, "ignore_eos": true})
}

/// Uploads one /v1/completions request per body (custom ids c0, c1, …) and creates a
/// batch over them; returns its id.
fn create_batch(http: &str, bodies: Vec<Value>) -> String {
    let lines: Vec<String> = bodies
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            json!({"custom_id": format!("c{i}"), "method": "POST", "url": "/v1/completions", "body": b})
                .to_string()
        })
        .collect();
    let file = upload(http, None, "requests.jsonl", &lines.join("\n"));
    let batch =
        json!({"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"});
    let (status, created) = post(http, "/v1/batches", None, &batch);
    assert_eq!(status, 200, "{created}");
    created["id"].as_str().unwrap().to_string()
}

#[test]
fn a_batch_survives_a_coordinator_kill_and_answers_each_request_once() {
    let model = tempfile::tempdir().unwrap();
    write_slow_model(model.path());
    let model = model.path().to_str().unwrap().to_string();
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().to_str().unwrap();
    let (mut server, http) = serve(&model, data_dir);

    let id = create_batch(&http, (0..200).map(body).collect());

    // Kill the coordinator once part of the batch is done.
    let started = Instant::now();
    let before = loop {
        let b = batch(&http, &id);
        let done = b["request_counts"]["completed"].as_u64().unwrap();
        if done >= 20 {
            break done;
        }
        assert!(started.elapsed() < Duration::from_secs(120), "batch did not progress: {b}");
        std::thread::sleep(Duration::from_millis(10));
    };
    server.child.kill().unwrap(); // SIGKILL: no drain, no final save
    server.child.wait().unwrap();
    assert!(before < 200, "the batch finished before the kill; nothing was tested");

    let (_server, http) = serve(&model, data_dir);
    let started = Instant::now();
    let b = loop {
        let b = batch(&http, &id);
        if b["status"] == "completed" {
            break b;
        }
        assert!(b["status"] == "in_progress" || b["status"] == "finalizing", "{b}");
        assert!(started.elapsed() < Duration::from_secs(180), "batch did not finish after the restart: {b}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(b["request_counts"], json!({"total": 200, "completed": 200, "failed": 0}), "{b}");
    let out_id = b["output_file_id"].as_str().unwrap();
    let (status, text) = request(&http, "GET", &format!("/v1/files/{out_id}/content"), None, None).unwrap();
    assert_eq!(status, 200);
    let results: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut ids: Vec<&str> = results.iter().map(|r| r["custom_id"].as_str().unwrap()).collect();
    ids.sort();
    let mut want: Vec<String> = (0..200).map(|i| format!("c{i}")).collect();
    want.sort();
    assert_eq!(ids, want, "each request answered exactly once");
    // Answers equal the same requests sent online (greedy, so deterministic).
    for r in results.iter().step_by(40) {
        let i: usize = r["custom_id"].as_str().unwrap()[1..].parse().unwrap();
        let (status, online) = post(&http, "/v1/completions", None, &body(i));
        assert_eq!(status, 200);
        assert_eq!(r["response"]["body"]["choices"][0]["text"], online["choices"][0]["text"], "c{i}");
    }
}

#[test]
fn strata_batch_run_resumes_after_an_interruption() {
    let model = tempfile::tempdir().unwrap();
    write_slow_model(model.path());
    let data = tempfile::tempdir().unwrap();
    let (_server, http) = serve(model.path().to_str().unwrap(), data.path().to_str().unwrap());
    let work = tempfile::tempdir().unwrap();
    let input = work.path().join("requests.jsonl");
    let output = work.path().join("results.jsonl");
    let lines: Vec<String> = (0..60)
        .map(|i| {
            json!({"custom_id": format!("c{i}"), "method": "POST", "url": "/v1/completions", "body": body(i)})
                .to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let run = || {
        let mut cmd = std::process::Command::new(strata_tests::strata_bin());
        cmd.args(["batch", "run", "--endpoint", &format!("http://{http}/v1"), "--concurrency", "2"])
            .arg("--input")
            .arg(&input)
            .arg("--output")
            .arg(&output)
            .env("RUST_LOG", "warn");
        cmd
    };
    let count = || std::fs::read_to_string(&output).map(|t| t.lines().count()).unwrap_or(0);
    let mut first =
        run().stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let started = Instant::now();
    while count() < 10 {
        assert!(started.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(10));
    }
    first.kill().unwrap();
    first.wait().unwrap();
    let interrupted = count();
    assert!(interrupted < 60, "finished before the interruption; nothing was tested");
    let out = run().output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let results: Vec<Value> =
        std::fs::read_to_string(&output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut ids: Vec<&str> = results.iter().map(|r| r["custom_id"].as_str().unwrap()).collect();
    ids.sort();
    let mut want: Vec<String> = (0..60).map(|i| format!("c{i}")).collect();
    want.sort();
    assert_eq!(ids, want, "each request once, the {interrupted} done before the interruption kept");
    assert!(results.iter().all(|r| r["response"]["status_code"] == 200));
    let (_, online) = post(&http, "/v1/completions", None, &body(7));
    let seven = results.iter().find(|r| r["custom_id"] == "c7").unwrap();
    assert_eq!(seven["response"]["body"]["choices"][0]["text"], online["choices"][0]["text"]);
}

/// `strata serve` of a slow model (written into `model`) with a data directory and metrics;
/// returns it and its HTTP and metrics addresses.
fn serve_metered(
    model: &std::path::Path,
    data: &std::path::Path,
    extra: &[&str],
) -> (Server, String, String) {
    write_slow_model(model);
    let args = [
        "--model",
        model.to_str().unwrap(),
        "--name",
        "m",
        "--http-listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    let server = Server::start(&[&args[..], extra].concat());
    let address = |event: &str| server.out.passed(event).unwrap()["address"].as_str().unwrap().to_string();
    let (http, metrics) = (address("http"), address("metrics"));
    (server, http, metrics)
}

/// The batch's in-flight gauge as Prometheus scrapes it.
fn batch_in_flight(metrics: &str) -> f64 {
    let (_, text) = strata_tests::prometheus::http_get(metrics, "/metrics").unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("strata_batch_requests_in_flight "))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

fn wait_in_flight(metrics: &str, want: f64, what: &str) {
    let started = Instant::now();
    while batch_in_flight(metrics) != want {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{what}: {} in flight",
            batch_in_flight(metrics)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Online requests come first: a batch gives up one slot per online request in flight,
/// down to one (it always moves), and takes them back when online traffic ends.
#[tokio::test(flavor = "multi_thread")]
async fn online_requests_come_first_and_a_batch_always_moves() {
    use strata_proto::inference::v1::inference_client::InferenceClient;
    let (model, data) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (server, http, metrics) =
        serve_metered(model.path(), data.path(), &["--batch-concurrency", "4", "--max-num-seqs", "16"]);
    let bodies = (0..40)
        .map(|i| json!({"model": "m", "prompt": format!("job {i}"), "max_tokens": 120, "temperature": 0, "ignore_eos": true}))
        .collect();
    let id = create_batch(&http, bodies);
    wait_in_flight(&metrics, 4.0, "the batch fills its four slots");

    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    let mut online = Vec::new();
    for i in 0..5u32 {
        let mut s = c
            .generate_stream(strata_tests::token_request("m", vec![1, 2 + i], 1500))
            .await
            .unwrap()
            .into_inner();
        assert!(s.message().await.unwrap().is_some());
        online.push(s);
    }
    // Five online requests against four slots: the batch keeps one request moving.
    wait_in_flight(&metrics, 1.0, "the batch yields to online requests");
    drop(online);
    wait_in_flight(&metrics, 4.0, "the batch takes its slots back");
    let (status, cancelled) = post(&http, &format!("/v1/batches/{id}/cancel"), None, &json!({}));
    assert_eq!(status, 200, "{cancelled}");
}

/// A batch whose runs keep ending with their process (a crash it causes would repeat at
/// every restart) is failed after three, not resumed into the same end; and a line past
/// the size limit fails its batch naming the line, before anything runs.
#[test]
fn a_batch_is_not_resumed_into_the_same_crash_and_long_lines_are_refused() {
    let model = tempfile::tempdir().unwrap();
    write_slow_model(model.path());
    let model = model.path().to_str().unwrap().to_string();
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().to_str().unwrap();
    let (mut server, http) = serve(&model, data_dir);
    let id = create_batch(&http, (0..50).map(body).collect());
    let started = Instant::now();
    while batch(&http, &id)["status"] != "in_progress" {
        assert!(started.elapsed() < Duration::from_secs(60), "{}", batch(&http, &id));
        std::thread::sleep(Duration::from_millis(10));
    }
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    // As if three runs had ended with the process before any request did.
    let path = data.path().join("batches").join(format!("{id}.json"));
    let mut record: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    record["runs_without_progress"] = json!(3);
    std::fs::write(&path, record.to_string()).unwrap();

    let (_server, http) = serve(&model, data_dir);
    let b = wait_status(&http, &id, "failed");
    assert!(b["errors"]["data"][0]["message"].as_str().unwrap().contains("not resumed again"), "{b}");

    let ok = json!({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body(0)});
    let long = json!({"custom_id": "b", "method": "POST", "url": "/v1/completions",
        "body": {"model": "m", "prompt": "x".repeat(1 << 20)}});
    let file = upload(&http, None, "requests.jsonl", &format!("{ok}\n{long}\n"));
    let create =
        json!({"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"});
    let (status, created) = post(&http, "/v1/batches", None, &create);
    assert_eq!(status, 200, "{created}");
    let b = wait_status(&http, created["id"].as_str().unwrap(), "failed");
    let error = &b["errors"]["data"][0];
    assert_eq!((&error["code"], &error["line"]), (&json!("invalid_request"), &json!(2)), "{b}");
    assert!(error["message"].as_str().unwrap().contains("at most 1048576"), "{b}");
}

fn wait_status(http: &str, id: &str, status: &str) -> Value {
    let started = Instant::now();
    loop {
        let b = batch(http, id);
        if b["status"] == status {
            return b;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "not {status}: {b}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `--batch-concurrency` is one budget for every batch (three batches took three times
/// it): while three run side by side, never more than it are in flight.
#[test]
fn batches_share_one_concurrency_budget() {
    let (model, data) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (_server, http, metrics) = serve_metered(model.path(), data.path(), &["--batch-concurrency", "3"]);
    let ids: Vec<String> = (0..3).map(|_| create_batch(&http, (0..12).map(body).collect())).collect();
    let (started, mut most) = (Instant::now(), 0.0f64);
    while !ids.iter().all(|id| batch(&http, id)["status"] == "completed") {
        most = most.max(batch_in_flight(&metrics));
        assert!(started.elapsed() < Duration::from_secs(180), "the batches did not finish");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(most >= 2.0, "the batches ran side by side ({most} in flight at most)");
    assert!(most <= 3.0, "{most} batch requests in flight against a budget of 3");
}

/// A tenant's files are bounded (4,000 uploads once went through in two seconds, and
/// uploads side by side once passed the limit together): of 1,040 uploads sent 16 at a
/// time exactly 1,000 are kept, the rest refused naming the limit; one more goes through
/// once one is deleted. A name longer than 255 bytes is refused.
#[test]
fn a_tenants_files_are_bounded() {
    let data = tempfile::tempdir().unwrap();
    let model = strata_tests::fixtures_dir().join("llama_gqa");
    let (_server, http) = serve(model.to_str().unwrap(), data.path().to_str().unwrap());
    let line =
        json!({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body(0)}).to_string();
    let (status, refused) = strata_tests::http::try_upload(&http, None, &"n".repeat(256), &line);
    assert_eq!(status, 400, "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("at most 255"), "{refused}");
    let first = upload(&http, None, "f.jsonl", &line);
    let outcomes: Vec<(u16, Value)> = std::thread::scope(|s| {
        let senders: Vec<_> = (0..16)
            .map(|_| {
                s.spawn(|| {
                    (0..65)
                        .map(|_| strata_tests::http::try_upload(&http, None, "f.jsonl", &line))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        senders.into_iter().flat_map(|t| t.join().unwrap()).collect()
    });
    let kept = outcomes.iter().filter(|(status, _)| *status == 200).count();
    assert_eq!(kept, 999, "uploads side by side kept past the limit");
    let (status, refused) = outcomes.iter().find(|(status, _)| *status != 200).unwrap();
    assert_eq!(*status, 400, "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("at most 1000"), "{refused}");
    let (status, listed) = request(&http, "GET", "/v1/files?limit=7", None, None).unwrap();
    assert_eq!(status, 200, "{listed}");
    let listed: Value = serde_json::from_str(&listed).unwrap();
    assert_eq!((listed["data"].as_array().unwrap().len(), listed["has_more"].as_bool()), (7, Some(true)));
    let id = first["id"].as_str().unwrap();
    let (status, _) = request(&http, "DELETE", &format!("/v1/files/{id}"), None, None).unwrap();
    assert_eq!(status, 200);
    assert!(upload(&http, None, "f.jsonl", &line)["id"].is_string());
}

/// What a batch keeps is bounded: `metadata` as OpenAI bounds it (16 pairs of short
/// strings; 2 MB of it once took gigabytes and the owner's listing took the server down),
/// a tenant's unfinished batches (16), and a restart finds every file and batch again from
/// the per-tenant index.
#[test]
fn batch_metadata_and_unfinished_batches_are_bounded() {
    let data = tempfile::tempdir().unwrap();
    let model = tempfile::tempdir().unwrap();
    write_slow_model(model.path());
    let (server, http) = serve(model.path().to_str().unwrap(), data.path().to_str().unwrap());
    let lines: Vec<String> = (0..40)
        .map(|i| {
            json!({"custom_id": format!("c{i}"), "method": "POST", "url": "/v1/completions", "body": body(i)})
                .to_string()
        })
        .collect();
    let file = upload(&http, None, "requests.jsonl", &lines.join("\n"));
    let create = |metadata: Value| {
        let b = json!({"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h", "metadata": metadata});
        post(&http, "/v1/batches", None, &b)
    };
    let (status, refused) = create(json!({"note": "x".repeat(1 << 20)}));
    assert_eq!(status, 400, "{refused}");
    assert_eq!(refused["error"]["param"], "metadata.note", "{refused}");
    let many: serde_json::Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    assert_eq!(create(Value::Object(many)).0, 400);
    for i in 0..16 {
        let (status, created) = create(json!({"n": i.to_string()}));
        assert_eq!(status, 200, "{created}");
    }
    let (status, refused) = create(json!({}));
    assert_eq!(status, 429, "the 17th unfinished batch: {refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("at most 16"), "{refused}");
    drop(server);
    let (_server, http) = serve(model.path().to_str().unwrap(), data.path().to_str().unwrap());
    let (status, listed) = request(&http, "GET", "/v1/files", None, None).unwrap();
    assert_eq!(status, 200, "{listed}");
    let listed: Value = serde_json::from_str(&listed).unwrap();
    assert!(listed["data"].as_array().unwrap().iter().any(|f| f["id"] == file["id"]), "{listed}");
    let (status, page) = request(&http, "GET", "/v1/batches?limit=5", None, None).unwrap();
    assert_eq!(status, 200, "{page}");
    let page: Value = serde_json::from_str(&page).unwrap();
    assert_eq!((page["data"].as_array().unwrap().len(), page["has_more"].as_bool()), (5, Some(true)));
}
