//! The Helm chart, proved without Kubernetes (none can run here):
//! - Helm's own Go SDK lints and renders it for a matrix of values, every object passes
//!   the Kubernetes 1.30 schemas in strict mode, the values schema refuses bad values, and
//!   the Dockerfiles copy and run what exists (tests/helm/check_chart.py);
//! - what it renders runs: the etcd, coordinator and worker containers' command, args and
//!   env, and the model-deploying hook Job's, start as local processes — Service DNS names
//!   swapped for loopback ports, mounted Secrets and volumes for files — and the cluster
//!   comes up (etcd and the cluster over the TLS the chart generates), the hook deploys the model, and a request through the coordinator returns
//!   tokens.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use strata_tests::cluster::eventually;
use strata_tests::etcd::etcd_bin;
use strata_tests::{fixtures_dir, strata_bin, token_request};

fn python() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/pyenv/bin/python")
}

fn check_chart(extra: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("helm/check_chart.py");
    let out = Command::new(python())
        .arg(script)
        .args(extra)
        .env("STRATA_BIN", strata_bin())
        .output()
        .expect("run tests/helm/check_chart.py");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "chart checks failed:\n{text}");
    text
}

#[test]
fn the_chart_lints_renders_and_validates_against_kubernetes_schemas() {
    let report = check_chart(&[]);
    assert!(report.contains("chart ok"), "{report}");
    for case in [
        "default",
        "cpu",
        "external-etcd",
        "tls-cert-manager",
        "monitoring",
        "three-models",
        "existing-secrets",
        "gpu-two-images",
        "small",
        "ingress",
    ] {
        assert!(report.contains(&format!("ok: {case}:")), "case {case} missing:\n{report}");
    }
}

/// A loopback port free now and not handed out before by this test. Every port a
/// rendered process listens on comes from here (none binds port 0): a process binding
/// port 0 could be given a port picked for another that has not bound it yet.
fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap();
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// One rendered object by kind and name suffix.
fn object<'a>(objs: &'a [Value], kind: &str, suffix: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"].as_str().is_some_and(|n| n.ends_with(suffix)))
        .unwrap_or_else(|| panic!("no {kind} *{suffix} rendered"))
}

/// A rendered container as a local process.
struct Local {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Drop for Local {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- {} ---\n{}", self.name, std::fs::read_to_string(&self.log).unwrap_or_default());
        }
    }
}

/// How a pod's world maps onto this machine: text substitutions (DNS names and ports to
/// loopback, mount paths to directories) and the values of Secrets.
struct World {
    subst: Vec<(String, String)>,
    secrets: HashMap<(String, String), String>,
    dir: PathBuf,
}

impl World {
    fn map(&self, s: &str, pod: &str) -> String {
        let mut s = s.replace("$(POD_NAME)", pod);
        for (from, to) in &self.subst {
            s = s.replace(from.as_str(), to);
        }
        s
    }

    /// The container's argv (command + args; the image's entrypoint is `strata`) and env.
    fn argv_env(&self, c: &Value, pod: &str) -> (Vec<String>, Vec<(String, String)>) {
        let strs = |v: &Value| -> Vec<String> {
            v.as_array()
                .map(|a| a.iter().map(|x| self.map(x.as_str().unwrap(), pod)).collect())
                .unwrap_or_default()
        };
        let mut argv = strs(&c["command"]);
        argv.extend(strs(&c["args"]));
        let mut env = Vec::new();
        for e in c["env"].as_array().into_iter().flatten() {
            let name = e["name"].as_str().unwrap().to_string();
            let value = if let Some(v) = e["value"].as_str() {
                self.map(v, pod)
            } else if e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name" {
                pod.to_string()
            } else if e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName" {
                "this-machine".to_string()
            } else if let Some(r) = e["valueFrom"]["secretKeyRef"].as_object() {
                let key = (r["name"].as_str().unwrap().to_string(), r["key"].as_str().unwrap().to_string());
                self.secrets
                    .get(&key)
                    .unwrap_or_else(|| panic!("env {name}: no rendered secret {key:?}"))
                    .clone()
            } else {
                panic!("env {name}: a source the test cannot provide: {e}")
            };
            env.push((name, value));
        }
        (argv, env)
    }

    fn start(&self, c: &Value, pod: &str) -> Local {
        let (argv, env) = self.argv_env(c, pod);
        let (program, args) = match argv.first().map(String::as_str) {
            Some("etcd") => (etcd_bin(), &argv[1..]),
            _ => (strata_bin(), &argv[..]),
        };
        let log = self.dir.join(format!("{pod}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(program)
            .args(args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .envs(env)
            .current_dir(&self.dir)
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start a rendered container");
        Local { name: pod.to_string(), child, log }
    }

    /// Runs a container to completion (the hook Job's); its exit status and log.
    fn run(&self, c: &Value, pod: &str) -> (bool, String) {
        let (argv, env) = self.argv_env(c, pod);
        let out = Command::new(strata_bin())
            .args(&argv)
            .env_clear()
            .envs(env)
            .output()
            .expect("run a rendered container");
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    }
}

fn decode_b64(s: &str) -> String {
    let out = Command::new("base64").arg("-d").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    use std::io::Write;
    out.stdin.as_ref().unwrap().write_all(s.as_bytes()).unwrap();
    String::from_utf8(out.wait_with_output().unwrap().stdout).unwrap()
}

/// The rendered Secrets: every value by (secret, key), and the TLS Secrets' files written
/// where the pods mount them (`<dir>/tls` for the cluster's, `<dir>/etcd-tls` for etcd's).
fn secrets(objs: &[Value], dir: &Path) -> HashMap<(String, String), String> {
    let mut out = HashMap::new();
    for s in objs.iter().filter(|o| o["kind"] == "Secret") {
        let name = s["metadata"]["name"].as_str().unwrap().to_string();
        let files = match name.as_str() {
            n if n.ends_with("-cluster-tls") => Some(dir.join("tls")),
            n if n.ends_with("-etcd-tls") => Some(dir.join("etcd-tls")),
            n if n.ends_with("-api-keys") => Some(dir.join("api-keys")),
            n if n.ends_with("-config") => Some(dir.join("config")),
            _ => None,
        };
        let data =
            s["data"].as_object().into_iter().flatten().map(|(k, v)| (k, decode_b64(v.as_str().unwrap())));
        let plain = s["stringData"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k, v.as_str().unwrap().to_string()));
        for (k, value) in data.chain(plain) {
            if let Some(files) = &files {
                std::fs::create_dir_all(files).unwrap();
                std::fs::write(files.join(k), &value).unwrap();
            }
            out.insert((name.clone(), k.clone()), value);
        }
    }
    out
}

/// The model volume: the fixture under the name the values give it (a copy: model roots
/// refuse a symlink out of the root).
fn model_volume(dir: &Path) -> PathBuf {
    let models = dir.join("models");
    std::fs::create_dir_all(models.join("demo")).unwrap();
    for f in std::fs::read_dir(fixtures_dir().join("llama_gqa")).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, models.join("demo").join(f.file_name().unwrap())).unwrap();
        }
    }
    models
}

impl World {
    /// This world with a pod's own substitutions first (its listen ports).
    fn with(&self, own: Vec<(String, String)>) -> World {
        let subst = own.into_iter().chain(self.subst.iter().cloned()).collect();
        World { subst, secrets: self.secrets.clone(), dir: self.dir.clone() }
    }
}

fn container(o: &Value) -> &Value {
    &o["spec"]["template"]["spec"]["containers"][0]
}

/// Starts the etcd members, each on its own loopback ports.
fn start_etcd(world: &World, etcd: &Value, ports: &[(u16, u16, u16)]) -> Vec<Local> {
    let name = etcd["metadata"]["name"].as_str().unwrap();
    let mut out = Vec::new();
    for (i, (client, peer, metrics)) in ports.iter().enumerate() {
        let pod = format!("{name}-{i}");
        let data = world.dir.join(&pod);
        let own = world.with(vec![
            ("0.0.0.0:2379".into(), format!("127.0.0.1:{client}")),
            ("0.0.0.0:2380".into(), format!("127.0.0.1:{peer}")),
            ("0.0.0.0:2381".into(), format!("127.0.0.1:{metrics}")),
            ("--data-dir=/var/lib/etcd/data".into(), format!("--data-dir={}", data.display())),
        ]);
        out.push(own.start(container(etcd), &pod));
    }
    out
}

/// Starts the coordinators (the first on `first_port`, the Service's address) and the
/// workers, each worker's health port at the port returned for it.
fn start_strata(
    world: &World,
    objs: &[Value],
    first_port: u16,
    http_port: u16,
    ns: &str,
) -> (Vec<Local>, Vec<u16>) {
    let coordinator = object(objs, "Deployment", "-coordinator");
    let worker = object(objs, "StatefulSet", "-worker");
    let worker_svc = worker["spec"]["serviceName"].as_str().unwrap();
    let mut procs = Vec::new();
    for i in 0..coordinator["spec"]["replicas"].as_u64().unwrap() {
        let port = if i == 0 { first_port } else { free_port() };
        let http = if i == 0 { http_port } else { free_port() };
        let own = world.with(vec![
            ("0.0.0.0:50051".into(), format!("127.0.0.1:{port}")),
            ("0.0.0.0:8000".into(), format!("127.0.0.1:{http}")),
            ("0.0.0.0:9400".into(), format!("127.0.0.1:{}", free_port())),
        ]);
        procs.push(own.start(container(coordinator), &format!("strata-coordinator-{i}")));
    }
    let mut health_ports = Vec::new();
    for i in 0..worker["spec"]["replicas"].as_u64().unwrap() {
        let pod = format!("{}-{i}", worker["metadata"]["name"].as_str().unwrap());
        let (port, health) = (free_port(), free_port());
        health_ports.push(health);
        let own = world.with(vec![
            (format!("{pod}.{worker_svc}.{ns}.svc:7000"), format!("127.0.0.1:{port}")),
            ("0.0.0.0:7000".into(), format!("127.0.0.1:{port}")),
            ("0.0.0.0:7001".into(), format!("127.0.0.1:{health}")),
            ("0.0.0.0:9400".into(), format!("127.0.0.1:{}", free_port())),
        ]);
        procs.push(own.start(container(worker), &pod));
    }
    (procs, health_ports)
}

/// The hook Job: each init container in order (retried as the Job would be, until the
/// coordinators answer), then its main container, whose listing must name the model.
async fn run_hook(world: &World, job: &Value) {
    let spec = &job["spec"]["template"]["spec"];
    for (i, c) in spec["initContainers"].as_array().unwrap().iter().enumerate() {
        let pod = format!("deploy-models-{i}");
        let last = std::sync::Mutex::new(String::new());
        let deployed = tokio::time::timeout(
            Duration::from_secs(90),
            eventually("the hook's deploy to succeed", Duration::from_secs(90), || async {
                let (ok, out) = world.run(c, &pod);
                *last.lock().unwrap() = out;
                ok.then_some(())
            }),
        )
        .await;
        assert!(deployed.is_ok(), "the hook's deploy never succeeded: {}", last.lock().unwrap());
    }
    eventually("the hook's listing to name the model", Duration::from_secs(30), || async {
        let (ok, listing) = world.run(&spec["containers"][0], "deploy-models");
        (ok && listing.lines().any(|l| l.starts_with("demo "))).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn what_the_chart_renders_runs_as_a_cluster() {
    let tmp = tempfile::tempdir().unwrap();
    check_chart(&["--render", tmp.path().to_str().unwrap()]);
    let objs: Vec<Value> =
        serde_json::from_slice(&std::fs::read(tmp.path().join("manifests.json")).unwrap()).unwrap();
    let ns = "inference";
    let secrets = secrets(&objs, tmp.path());
    let models = model_volume(tmp.path());
    let etcd = object(&objs, "StatefulSet", "-etcd");
    let etcd_name = etcd["metadata"]["name"].as_str().unwrap().to_string();
    let service = object(&objs, "Service", "strata")["metadata"]["name"].as_str().unwrap().to_string();

    // Service DNS names become loopback ports; mount paths become directories.
    let members = etcd["spec"]["replicas"].as_u64().unwrap() as usize;
    let etcd_ports: Vec<(u16, u16, u16)> =
        (0..members).map(|_| (free_port(), free_port(), free_port())).collect();
    let coordinator_port = free_port();
    let mut subst: Vec<(String, String)> = vec![
        ("/etc/strata/tls".into(), tmp.path().join("tls").to_string_lossy().into()),
        ("/etc/strata/etcd".into(), tmp.path().join("etcd-tls").to_string_lossy().into()),
        ("/etc/strata/api-keys".into(), tmp.path().join("api-keys").to_string_lossy().into()),
        ("/etc/strata/config".into(), tmp.path().join("config").to_string_lossy().into()),
        ("/etc/etcd/tls".into(), tmp.path().join("etcd-tls").to_string_lossy().into()),
        ("=/models".into(), format!("={}", models.display())),
        (format!("http://{service}.{ns}.svc:50051"), format!("http://127.0.0.1:{coordinator_port}")),
    ];
    for (i, (client, peer, _)) in etcd_ports.iter().enumerate() {
        let host = format!("{etcd_name}-{i}.{etcd_name}.{ns}.svc");
        subst.push((format!("{host}:2379"), format!("127.0.0.1:{client}")));
        subst.push((format!("{host}:2380"), format!("127.0.0.1:{peer}")));
    }
    let world = World { subst, secrets, dir: tmp.path().to_path_buf() };
    let _etcd = start_etcd(&world, etcd, &etcd_ports);
    let http_port = free_port();
    let (_strata, health_ports) = start_strata(&world, &objs, coordinator_port, http_port, ns);
    run_hook(&world, object(&objs, "Job", "-deploy-models")).await;

    // `helm test`'s pod, as rendered, gets tokens with the key the chart made for it
    // (accepted by its hash, beside a hashed API key); a caller without one is refused.
    let test_pod = &object(&objs, "Pod", "-test-generate")["spec"]["containers"][0];
    let out = eventually("tokens through the coordinator", Duration::from_secs(90), || async {
        let (ok, out) = world.run(test_pod, "test-generate");
        ok.then_some(out)
    })
    .await;
    assert!(out.contains("4 tokens"), "{out}");
    let endpoint = format!("http://127.0.0.1:{coordinator_port}");
    let mut c =
        strata_proto::inference::v1::inference_client::InferenceClient::connect(endpoint).await.unwrap();
    let refused = c.generate(token_request("demo", vec![1, 2, 3], 4)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");

    // The OpenAI-style API on the rendered HTTP port, with the chart's API key.
    let http = format!("127.0.0.1:{http_port}");
    let key = world
        .secrets
        .iter()
        .find(|((_, k), _)| k == "api-keys")
        .map(|(_, v)| v.lines().next().unwrap().to_string());
    let body = serde_json::json!({"model": "demo", "prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": true});
    let (status, answer) = strata_tests::http::post(&http, "/v1/completions", key.as_deref(), &body);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 3);
    assert_eq!(strata_tests::http::post(&http, "/v1/completions", None, &body).0, 401);

    // The kubelet's probes, as rendered: gRPC health on the coordinator's port and on each
    // worker's plaintext health port, for the services the readiness probes name.
    let probe = |c: &Value| -> (u64, String) {
        let g = &c["readinessProbe"]["grpc"];
        (g["port"].as_u64().unwrap(), g["service"].as_str().unwrap_or("").to_string())
    };
    let (c_port, c_service) = probe(container(object(&objs, "Deployment", "-coordinator")));
    assert_eq!(c_port, 50051, "the coordinator is probed on its gRPC port");
    assert_serving(coordinator_port, &c_service).await;
    let (w_port, w_service) = probe(container(object(&objs, "StatefulSet", "-worker")));
    assert_eq!(w_port, 7001, "workers are probed on the health port");
    for port in health_ports {
        assert_serving(port, &w_service).await;
        assert_serving(port, "").await;
    }

    // Workers name their node (the downward API's spec.nodeName) for placement, and the
    // hook's deployment runs on the device kind of the chart's mode.
    let token = world.secrets.iter().find(|((_, k), _)| k == "admin-token").map(|(_, v)| v.clone());
    let token = token.expect("the chart's admin token");
    fn with<T>(token: &str, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        r
    }
    use strata_proto::admin::v1 as apb;
    let endpoint = format!("http://127.0.0.1:{coordinator_port}");
    let mut admin = apb::admin_client::AdminClient::connect(endpoint).await.unwrap();
    let ws = admin.list_workers(with(&token, apb::ListWorkersRequest {})).await;
    let ws = ws.unwrap().into_inner().workers;
    assert!(!ws.is_empty() && ws.iter().all(|w| w.node == "this-machine"), "{ws:?}");
    let ms = admin.list_models(with(&token, apb::ListModelsRequest {})).await;
    let ms = ms.unwrap().into_inner().models;
    assert!(ms.iter().any(|m| m.name == "demo" && m.device == "cpu"), "{ms:?}");
}

/// What a kubelet gRPC probe of `service` on `port` sees: SERVING.
async fn assert_serving(port: u16, service: &str) {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{health_check_response::ServingStatus, HealthCheckRequest};
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .expect("connect to the probe port");
    let mut c = HealthClient::new(channel);
    let r = c.check(HealthCheckRequest { service: service.into() }).await.expect("health check").into_inner();
    assert_eq!(r.status, ServingStatus::Serving as i32, "port {port} service {service:?}");
}
