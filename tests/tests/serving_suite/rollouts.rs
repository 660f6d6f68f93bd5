//! Rollouts on `strata serve` (in-process workers, the cluster admin API over the
//! in-memory registry): a canary at 10% takes a binomially plausible share of distinct
//! prompts, sticky per prefix; responses (gRPC and HTTP) and metrics name the revision;
//! promote under load moves every request to the new revision with none failing; rolling
//! back a canary under load takes effect at once, and a rollback after a promote returns
//! to the old revision. The admin CLI deploys and rolls out typed builds that clients
//! old and new read alike.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::cluster::eventually;
use strata_tests::http::{post, request, sample, scrape};
use strata_tests::{fixtures_dir, strata_bin, token_request, Server};
use tonic::transport::Channel;

const MODEL: &str = "llama_gqa";
/// Tokens every test prompt starts with (a "system prompt" longer than a KV block).
const SHARED: usize = 40;

/// A copy of the fixture as the new revision's directory (same tokenizer, other path).
fn second_revision(dir: &Path) -> String {
    let to = dir.join("v2");
    std::fs::create_dir_all(&to).unwrap();
    for f in std::fs::read_dir(fixtures_dir().join(MODEL)).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
    }
    to.to_string_lossy().into_owned()
}

/// `strata serve` with two replicas of the fixture as "m" and room for two more; returns
/// the server and its metrics and HTTP addresses.
fn serve(dir: &Path) -> (Server, String, String) {
    let model = fixtures_dir().join(MODEL);
    let mut server = Server::spawn(&[
        "--model",
        model.to_str().unwrap(),
        "--name",
        "m",
        "--replicas",
        "2",
        "--spare-workers",
        "2",
        "--model-root",
        dir.to_str().unwrap(),
        "--metrics-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ]);
    let metrics = server.out.wait_event("metrics", Duration::from_secs(60), "strata serve");
    server.addr = server.wait_ready();
    let http = server.out.passed("http").expect("the HTTP API announces its address");
    let address = |v: serde_json::Value| v["address"].as_str().unwrap().to_string();
    (server, address(metrics), address(http))
}

/// A distinct prompt: the shared prefix, then tokens of its own.
fn prompt(i: u64) -> Vec<u32> {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut own = (0..12).map(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 380) as u32 + 3
    });
    (0..SHARED as u32).map(|t| t % 300 + 3).chain(own.by_ref()).collect()
}

/// The revision that served one greedy request.
async fn served(c: &mut InferenceClient<Channel>, ids: Vec<u32>) -> u64 {
    c.generate(token_request("m", ids, 2)).await.expect("request succeeds").into_inner().revision
}

async fn rollout(admin: &mut AdminClient<Channel>) -> apb::RolloutResponse {
    admin.get_rollout(apb::GetRolloutRequest { name: "m".into() }).await.unwrap().into_inner()
}

/// Waits until the revisions of "m"'s replicas (ready or not) are exactly `want` (revision
/// → ready replicas).
async fn replicas_settle(admin: &AdminClient<Channel>, want: &[(u64, usize)], limit: Duration) {
    let want: HashMap<u64, usize> = want.iter().copied().collect();
    eventually(&format!("replicas of revisions {want:?}"), limit, || {
        let mut admin = admin.clone();
        let want = want.clone();
        async move {
            let list = admin.list_replicas(apb::ListReplicasRequest { name: "m".into() }).await.ok()?;
            let mut seen: HashMap<u64, usize> = HashMap::new();
            for r in list.into_inner().replicas {
                let n = seen.entry(r.generation).or_default();
                if r.state == apb::ReplicaState::Ready as i32 {
                    *n += 1;
                }
            }
            (seen == want).then_some(())
        }
    })
    .await;
}

/// The admin CLI's output for `args`.
fn admin_cli(endpoint: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(strata_bin())
        .args(["admin", "--endpoint", endpoint])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "strata admin {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Streams requests from `tasks` clients until stopped, recording each one's start and
/// revision, and every failure.
struct Load {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<(Instant, u64)>>>,
    failures: Arc<Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(endpoint: String, tasks: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let (seen, failures) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
        let next = Arc::new(AtomicU64::new(1_000_000));
        let tasks = (0..tasks)
            .map(|_| {
                let (stop, seen, failures, next) =
                    (stop.clone(), seen.clone(), failures.clone(), next.clone());
                let endpoint = endpoint.clone();
                tokio::spawn(async move {
                    let mut c = InferenceClient::connect(endpoint).await.unwrap();
                    while !stop.load(Ordering::Relaxed) {
                        let at = Instant::now();
                        let ids = prompt(next.fetch_add(1, Ordering::Relaxed));
                        match Load::one(&mut c, ids).await {
                            Ok(revision) => seen.lock().unwrap().push((at, revision)),
                            Err(e) => failures.lock().unwrap().push(e),
                        }
                    }
                })
            })
            .collect();
        Load { stop, seen, failures, tasks }
    }

    /// One streamed request: the revision of its last message.
    async fn one(c: &mut InferenceClient<Channel>, ids: Vec<u32>) -> Result<u64, String> {
        let mut s =
            c.generate_stream(token_request("m", ids, 8)).await.map_err(|e| e.to_string())?.into_inner();
        let mut revision = 0;
        let mut tokens = 0;
        while let Some(m) = s.message().await.map_err(|e| e.to_string())? {
            revision = m.revision;
            tokens += m.token_ids.len();
        }
        if tokens != 8 {
            return Err(format!("{tokens} tokens instead of 8"));
        }
        Ok(revision)
    }

    /// Requests started since `t`, by revision.
    fn since(&self, t: Instant) -> HashMap<u64, usize> {
        let mut by = HashMap::new();
        for (at, r) in self.seen.lock().unwrap().iter() {
            if *at >= t {
                *by.entry(*r).or_default() += 1;
            }
        }
        by
    }

    async fn finish(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let f = self.failures.lock().unwrap().clone();
        f
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_canary_takes_its_share_and_promote_moves_every_request_without_failures() {
    let dir = tempfile::tempdir().unwrap();
    let v2 = second_revision(dir.path());
    let (server, metrics, http) = serve(dir.path());
    let ep = server.endpoint();
    let mut admin = AdminClient::connect(ep.clone()).await.unwrap();
    let mut c = InferenceClient::connect(ep.clone()).await.unwrap();
    assert_eq!(served(&mut c, prompt(0)).await, 1, "the deployment starts at revision 1");

    let out = admin_cli(&ep, &["rollout", "--name", "m", "--model", &v2, "--canary", "10%"]);
    assert!(out.contains("canary"), "{out}");
    replicas_settle(&admin, &[(1, 2), (2, 1)], Duration::from_secs(60)).await;

    // Distinct prompts behind one shared prefix: ~10% go to the canary.
    let n = 400u64;
    let mut by_revision: HashMap<u64, usize> = HashMap::new();
    let mut first: HashMap<u64, u64> = HashMap::new();
    for i in 1..=n {
        let r = served(&mut c, prompt(i)).await;
        *by_revision.entry(r).or_default() += 1;
        first.insert(i, r);
    }
    let canary = by_revision.get(&2).copied().unwrap_or(0);
    // Binomial(400, 0.1): mean 40, standard deviation 6; ±4.5 sd.
    assert!((13..=67).contains(&canary), "{canary} of {n} requests went to the 10% canary: {by_revision:?}");
    assert_eq!(by_revision.get(&1).copied().unwrap_or(0) + canary, n as usize, "{by_revision:?}");
    eprintln!("split: {canary} of {n} requests to the 10% canary");
    // Sticky per prefix: a prompt that continues an earlier one goes the same way.
    for i in 1..=60 {
        let mut longer = prompt(i);
        longer.extend((0..24).map(|t| (t * 7 + i as u32) % 380 + 3));
        assert_eq!(served(&mut c, longer).await, first[&i], "prompt {i} continued on another revision");
    }
    // Metrics count what the clients saw (the first request and the continuations too).
    let text = scrape(&metrics);
    let counted =
        |r: &str| sample(&text, "strata_revision_requests_total", &[("model", "m"), ("revision", r)]);
    let continued_canary = (1..=60).filter(|i| first[i] == 2).count();
    assert_eq!(counted("2"), Some((canary + continued_canary) as f64));
    // OpenAI-style responses name the revision as their system fingerprint.
    let (status, body) = post(
        &http,
        "/v1/completions",
        None,
        &serde_json::json!({"model": "m", "prompt": "hi", "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{body}");
    assert!(body["system_fingerprint"].as_str().is_some_and(|f| f == "r1" || f == "r2"), "{body}");

    // Promote under load: nothing fails, and once the old replicas are gone every
    // request is served by revision 2.
    let load = Load::start(ep.clone(), 4);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let out = admin_cli(&ep, &["rollout", "promote", "--name", "m"]);
    assert!(out.contains("serving"), "{out}");
    replicas_settle(&admin, &[(2, 2)], Duration::from_secs(60)).await;
    let settled = Instant::now();
    eventually("requests after the promotion", Duration::from_secs(10), || {
        let n = load.since(settled).values().sum::<usize>();
        async move { (n >= 20).then_some(()) }
    })
    .await;
    let after = load.since(settled);
    let failures = load.finish().await;
    assert!(failures.is_empty(), "requests failed during the promotion: {failures:?}");
    assert_eq!(after.keys().copied().collect::<Vec<_>>(), [2], "{after:?}");
    let r = rollout(&mut admin).await;
    let states: Vec<(u64, &str)> = r.revisions.iter().map(|v| (v.revision, v.state.as_str())).collect();
    assert_eq!(states, [(2, "serving"), (1, "replaced")]);
    assert_eq!(r.revisions[0].model_dir, v2);

    // A rollback with no canary returns to revision 1 (its replicas are rebuilt).
    let load = Load::start(ep.clone(), 2);
    admin_cli(&ep, &["rollout", "rollback", "--name", "m"]);
    replicas_settle(&admin, &[(1, 2)], Duration::from_secs(60)).await;
    let failures = load.finish().await;
    assert!(failures.is_empty(), "requests failed during the rollback: {failures:?}");
    assert_eq!(served(&mut c, prompt(7)).await, 1);
    let r = rollout(&mut admin).await;
    let states: Vec<(u64, &str)> = r.revisions.iter().map(|v| (v.revision, v.state.as_str())).collect();
    assert_eq!(states, [(1, "serving"), (2, "rolled_back")]);
}

#[tokio::test(flavor = "multi_thread")]
async fn rolling_back_a_canary_under_load_takes_effect_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let v2 = second_revision(dir.path());
    let (server, _metrics, _http) = serve(dir.path());
    let ep = server.endpoint();
    let mut admin = AdminClient::connect(ep.clone()).await.unwrap();
    let start = apb::StartRolloutRequest {
        name: "m".into(),
        model_dir: v2,
        canary_percent: 50.0,
        ..Default::default()
    };
    let r = admin.start_rollout(start.clone()).await.unwrap().into_inner();
    assert_eq!((r.revisions[1].revision, r.revisions[1].state.as_str()), (2, "canary"));
    assert_eq!(r.revisions[1].desired_replicas, 1, "half of two replicas");
    let again = admin.start_rollout(start).await.unwrap_err();
    assert_eq!(again.code(), tonic::Code::FailedPrecondition, "{again:?}");
    replicas_settle(&admin, &[(1, 2), (2, 1)], Duration::from_secs(60)).await;

    let began = Instant::now();
    let load = Load::start(ep.clone(), 4);
    eventually("both revisions serving", Duration::from_secs(20), || {
        let by = load.since(began);
        async move { (by.get(&1).is_some_and(|&n| n >= 5) && by.get(&2).is_some_and(|&n| n >= 5)).then_some(()) }
    })
    .await;
    let called = Instant::now();
    let r =
        admin.rollback_rollout(apb::RollbackRolloutRequest { name: "m".into() }).await.unwrap().into_inner();
    let returned = Instant::now();
    assert_eq!(r.revisions.len(), 2, "{r:?}");
    assert_eq!((r.revisions[1].revision, r.revisions[1].state.as_str()), (2, "rolled_back"));
    // The canary's replica drains (in-flight requests finish) and goes.
    replicas_settle(&admin, &[(1, 2)], Duration::from_secs(5)).await;
    let gone = called.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = load.since(returned);
    let failures = load.finish().await;
    assert!(failures.is_empty(), "requests failed during the rollback: {failures:?}");
    assert_eq!(after.keys().copied().collect::<Vec<_>>(), [1], "every request after the call: {after:?}");
    assert!(gone < Duration::from_secs(5), "the canary took {gone:?} to go");
    eprintln!("rollback: call {:?}, canary gone after {gone:?}", returned - called);
}

/// `strata admin deploy` and `rollout` send a typed build; statuses carry it typed and as
/// the flat fields older clients read, and both forms of a request deploy the same.
#[tokio::test(flavor = "multi_thread")]
async fn the_admin_cli_deploys_typed_builds_that_old_and_new_clients_read() {
    let dir = tempfile::tempdir().unwrap();
    let v2 = second_revision(dir.path());
    let (server, _metrics, _http) = serve(dir.path());
    let ep = server.endpoint();
    let mut admin = AdminClient::connect(ep.clone()).await.unwrap();
    let out = admin_cli(
        &ep,
        &["--json", "deploy", "--name", "t", "--model", &v2, "--dtype", "F32", "--max-waiting", "7"],
    );
    let shown: serde_json::Value = serde_json::from_str(&out).unwrap();
    let shown = &shown[0];
    assert_eq!((shown["dtype"].as_str(), shown["device"].as_str()), (Some("f32"), Some("cpu")), "{shown}");
    let models = admin.list_models(apb::ListModelsRequest {}).await.unwrap().into_inner().models;
    let t = models.iter().find(|m| m.name == "t").expect("t is deployed");
    let b = t.build.clone().expect("a typed build");
    assert_eq!(
        (b.dtype(), b.device(), b.tp, b.pp, b.ep),
        (apb::DataType::F32, apb::DeviceKind::Cpu, 1, 1, 1)
    );
    assert_eq!((t.dtype.as_str(), t.device.as_str(), t.model_dir.as_str()), ("f32", "cpu", v2.as_str()));
    assert_eq!(t.scheduler.unwrap().max_waiting, 7);
    // The same deployment in an old client's flat fields changes nothing.
    let flat = apb::DeployModelRequest {
        name: "t".into(),
        model_dir: v2.clone(),
        dtype: "f32".into(),
        device: "cpu".into(),
        tp: 1,
        pp: 1,
        replicas: 1,
        scheduler: Some(apb::SchedulerLimits { max_waiting: 7, ..Default::default() }),
        ..Default::default()
    };
    let again = admin.deploy_model(flat).await.unwrap().into_inner().model.unwrap();
    assert_eq!(again.generation, t.generation, "the same build is the same revision");
    let bad = apb::DeployModelRequest {
        name: "u".into(),
        model_dir: v2.clone(),
        dtype: "int4".into(),
        ..Default::default()
    };
    let e = admin.deploy_model(bad).await.unwrap_err();
    assert!(e.code() == tonic::Code::InvalidArgument && e.message().contains("dtype"), "{e:?}");
    // A rollout changes only what it names.
    let out = admin_cli(&ep, &["--json", "rollout", "--name", "t", "--dtype", "bf16", "--canary", "50%"]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    let canary = &r["revisions"][1];
    assert_eq!((canary["state"].as_str(), canary["dtype"].as_str()), (Some("canary"), Some("bf16")), "{r}");
    assert_eq!(
        (canary["device"].as_str(), canary["model_dir"].as_str()),
        (Some("cpu"), Some(v2.as_str())),
        "{r}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deployment_brings_its_own_chat_template_and_tool_call_format() {
    let dir = tempfile::tempdir().unwrap();
    let v2 = second_revision(dir.path());
    let (server, _metrics, http) = serve(dir.path());
    let ep = server.endpoint();
    let template = dir.path().join("chat.jinja");
    let source = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>";
    std::fs::write(&template, source).unwrap();
    let t = template.to_str().unwrap();
    let out = std::process::Command::new(strata_bin())
        .args(["admin", "--endpoint", &ep, "deploy", "--name", "bad", "--model", &v2])
        .args(["--chat-template", t, "--tool-call-parser", "xml"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "an unknown tool-call format is refused");
    assert!(String::from_utf8_lossy(&out.stderr).contains("tool_call_parser"));
    admin_cli(
        &ep,
        &["deploy", "--name", "chatty", "--model", &v2, "--chat-template", t, "--tool-call-parser", "hermes"],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let info = loop {
        let (status, body) = request(&http, "GET", "/tokenizer_info?model=chatty", None, None).unwrap();
        if status == 200 {
            break serde_json::from_str::<serde_json::Value>(&body).unwrap();
        }
        assert!(Instant::now() < deadline, "chatty never loaded: {status} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The deployment's template is the operator's file: it is used, never shown to callers.
    assert_eq!(info["chat_template"], serde_json::Value::Null, "{info}");
    let _ = source;
    // A file that is no chat template (a key, a config named by mistake) is refused.
    let secret = dir.path().join("id_ed25519");
    std::fs::write(&secret, "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjE\n").unwrap();
    let out = std::process::Command::new(strata_bin())
        .args(["admin", "--endpoint", &ep, "deploy", "--name", "leak", "--model", &v2])
        .args(["--chat-template", secret.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success(), "a key file shipped as a chat template");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a chat template"), "{:?}", out);
    let chat = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = post(&http, "/v1/chat/completions", None, &chat("chatty"));
        if status == 200 {
            break;
        }
        assert!(status == 503 && Instant::now() < deadline, "{status} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rendered = post(
        &http,
        "/tokenize",
        None,
        &json!({"model": "chatty", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .1;
    let direct = post(
        &http,
        "/tokenize",
        None,
        &json!({"model": "chatty", "prompt": "<user>hi<assistant>", "add_special_tokens": false}),
    )
    .1;
    assert_eq!(rendered["tokens"], direct["tokens"], "rendered with the deployment's template");
    let (status, e) = post(&http, "/v1/chat/completions", None, &chat("m"));
    assert_eq!(status, 400, "the other deployment keeps its model's own (none): {e}");
}
