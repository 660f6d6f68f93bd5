//! Nothing inside the cluster trusts a stranger (real processes, real TLS).
//!
//! A worker's worker.v1 refuses clients without a certificate from the cluster CA, and
//! refuses a worker's certificate for what only coordinators may do; junk bytes on its
//! port leave it alive, registered and serving. A cluster role on a non-loopback address
//! needs credentials (or `--insecure`). Deployments stay under `--model-root`. A static
//! replica's rendezvous refuses a rank without the group secret.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_proto::worker::v1 as wpb;
use strata_proto::worker::v1::worker_client::WorkerClient;
use strata_tests::cluster::{eventually, Certs, Cluster, Timing};
use strata_tests::etcd::Etcd;
use strata_tests::{fixtures_dir, spawn_captured, strata_bin, token_request, Server};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
use tonic::Code;

fn gqa() -> String {
    fixtures_dir().join("llama_gqa").to_string_lossy().to_string()
}

fn deploy(name: &str, dir: &str) -> apb::DeployModelRequest {
    apb::DeployModelRequest {
        name: name.into(),
        model_dir: dir.into(),
        tp: 1,
        pp: 1,
        replicas: 1,
        ..Default::default()
    }
}

async fn ready_replicas(endpoint: &str, model: &str) -> usize {
    ready_replicas_with(endpoint, model, None).await
}

async fn ready_replicas_with(endpoint: &str, model: &str, token: Option<&str>) -> usize {
    let Ok(mut admin) = AdminClient::connect(endpoint.to_string()).await else { return 0 };
    let req = apb::ListReplicasRequest { name: model.into() };
    let req = match token {
        Some(t) => bearing(t, req),
        None => tonic::Request::new(req),
    };
    let Ok(r) = admin.list_replicas(req).await else { return 0 };
    r.into_inner().replicas.iter().filter(|r| r.state == apb::ReplicaState::Ready as i32).count()
}

async fn generate_works(endpoint: &str) -> bool {
    let Ok(mut c) = InferenceClient::connect(endpoint.to_string()).await else { return false };
    c.generate(token_request("gqa", vec![1, 2, 3], 4))
        .await
        .is_ok_and(|r| r.into_inner().token_ids.len() == 4)
}

/// A status call over `channel`, or why it failed.
async fn status_over(channel: Result<tonic::transport::Channel, String>) -> Result<(), String> {
    let mut c = WorkerClient::new(channel?);
    c.status(wpb::StatusRequest {}).await.map(|_| ()).map_err(|s| format!("{s:?}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn strangers_are_refused_and_a_worker_certificate_cannot_drive_a_worker() {
    let cluster = Cluster::start(1, 1, Timing::default());
    let a = cluster.coordinators[0].endpoint();
    AdminClient::connect(a.clone()).await.unwrap().deploy_model(deploy("gqa", &gqa())).await.unwrap();
    eventually("a ready replica", Duration::from_secs(30), || async {
        (ready_replicas(&a, "gqa").await == 1).then_some(())
    })
    .await;
    let addr = cluster.workers[0].addr.clone();

    // No TLS at all.
    let plain =
        Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.map_err(|e| e.to_string());
    assert!(status_over(plain).await.is_err(), "a plaintext client reached worker.v1");
    // TLS that trusts the cluster CA but presents no certificate.
    let ca = std::fs::read(cluster.certs.path("ca.crt")).unwrap();
    let anonymous =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)).domain_name("strata-worker");
    let anon = async {
        Endpoint::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(anonymous)
            .unwrap()
            .connect()
            .await
            .map_err(|e| e.to_string())
    };
    assert!(status_over(anon.await).await.is_err(), "a client without a certificate reached worker.v1");
    // A coordinator certificate from another CA.
    let strangers = Certs::new();
    assert!(
        status_over(strangers.channel(&addr, "coordinator").await).await.is_err(),
        "another CA's certificate"
    );

    // A worker's certificate: it may read status, not drive the worker.
    let as_worker = cluster.certs.channel(&addr, "worker").await.unwrap();
    let mut w = WorkerClient::new(as_worker);
    w.status(wpb::StatusRequest {}).await.expect("any member reads status");
    let e = w.drain(wpb::DrainRequest { replica_id: String::new() }).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("Drain is for coordinators"), "{}", e.message());
    let e = w.model_files(wpb::ModelFilesRequest { model_dir: "/etc".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let load = wpb::LoadShardRequest {
        replica_id: "x".into(),
        model_dir: gqa(),
        tp: 1,
        pp: 1,
        ..Default::default()
    };
    assert_eq!(w.load_shard(load).await.unwrap_err().code(), Code::PermissionDenied);

    // Junk on the worker's port: the worker stays up, registered and serving.
    for junk in
        [&[0xffu8; 4096][..], b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\xff\xff\xff\xff", b"\x16\x03\x01\xff\xff"]
    {
        if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
            let _ = s.write_all(junk);
        }
    }
    let worker_listed = async {
        let mut admin = AdminClient::connect(a.clone()).await.unwrap();
        admin
            .list_workers(apb::ListWorkersRequest {})
            .await
            .unwrap()
            .into_inner()
            .workers
            .iter()
            .any(|x| x.id == "w0" && x.state == "up")
    };
    assert!(worker_listed.await, "the worker is still registered");
    eventually("generation after the junk", Duration::from_secs(10), || async {
        generate_works(&a).await.then_some(())
    })
    .await;
    assert_eq!(ready_replicas(&a, "gqa").await, 1);
}

/// Runs `strata ARGS…` expecting it to refuse to start; returns its stderr.
fn refused(args: &[&str]) -> String {
    let out = Command::new(strata_bin()).args(args).env("RUST_LOG", "warn").output().unwrap();
    assert!(!out.status.success(), "strata {args:?} started");
    String::from_utf8_lossy(&out.stderr).to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn cluster_roles_beyond_loopback_need_credentials_or_insecure() {
    let etcd = Etcd::start();
    let ep = etcd.endpoint();
    for role in ["worker", "coordinator"] {
        let e = refused(&[role, "--etcd", &ep, "--listen", "0.0.0.0:0"]);
        assert!(e.contains("--cluster-cert") && e.contains("--insecure"), "{role}: {e}");
    }
    let e = refused(&["worker", "--etcd", &ep, "--cluster-cert", "/nonexistent.crt"]);
    assert!(e.contains("together"), "{e}");
    // --insecure: it starts (and says so in its log, for people).
    let mut cmd = Command::new(strata_bin());
    cmd.args(["coordinator", "--etcd", &ep, "--listen", "0.0.0.0:0", "--insecure"]).env("RUST_LOG", "warn");
    let (mut child, out) = spawn_captured(&mut cmd);
    out.wait_event("ready", Duration::from_secs(30), "insecure coordinator");
    let _ = child.kill();
    let _ = child.wait();
}

fn bearing<T>(token: &str, req: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(req);
    r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

#[tokio::test(flavor = "multi_thread")]
async fn deployments_stay_under_the_model_roots_and_every_admin_action_is_audited() {
    let root = tempfile::tempdir().unwrap();
    let model = root.path().join("gqa");
    std::fs::create_dir(&model).unwrap();
    for f in std::fs::read_dir(fixtures_dir().join("llama_gqa")).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), model.join(f.file_name())).unwrap();
    }
    let root_s = root.path().to_string_lossy().to_string();
    let mut cluster = Cluster::start(0, 0, Timing::default());
    cluster.add_coordinator(&["--model-root", &root_s, "--admin-token", "the-admin-token"]);
    cluster.add_worker(&["--model-root", &root_s], None);
    let a = cluster.coordinators[0].endpoint();
    let mut admin = AdminClient::connect(a.clone()).await.unwrap();
    let t = |req| bearing("the-admin-token", req);
    // Refused for want of credentials: audited too.
    let e = admin
        .scale_replicas(apb::ScaleReplicasRequest { name: "gqa".into(), replicas: 3 })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let wrong = bearing("a-guess", apb::DrainWorkerRequest { worker_id: "w0".into(), undrain: false });
    assert_eq!(admin.drain_worker(wrong).await.unwrap_err().code(), Code::PermissionDenied);
    let e = admin.deploy_model(t(deploy("gqa", &gqa()))).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains(&root_s), "the error names the root: {}", e.message());
    let e = admin.deploy_model(t(deploy("gqa", "gqa"))).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("absolute"), "{}", e.message());
    let e = admin.deploy_model(t(deploy("gqa", &format!("{root_s}/../etc")))).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    admin.deploy_model(t(deploy("gqa", &model.to_string_lossy()))).await.expect("a model under the root");

    let audit = admin
        .list_audit(bearing("the-admin-token", apb::ListAuditRequest { limit: 0 }))
        .await
        .unwrap()
        .into_inner()
        .entries;
    let got: Vec<(&str, &str)> =
        audit.iter().rev().map(|e| (e.action.as_str(), e.outcome.as_str())).collect();
    let outcomes: Vec<(&str, &str)> = got.iter().map(|(a, o)| (*a, o.split(':').next().unwrap())).collect();
    assert_eq!(
        outcomes,
        [
            ("ScaleReplicas", "Unauthenticated"),
            ("DrainWorker", "PermissionDenied"),
            ("DeployModel", "PermissionDenied"),
            ("DeployModel", "InvalidArgument"),
            ("DeployModel", "InvalidArgument"),
            ("DeployModel", "ok"),
        ],
        "{audit:#?}"
    );
    let last = &audit[0];
    assert!(
        last.caller.starts_with("admin-token sha256:") && !last.caller.contains("the-admin-token"),
        "{last:?}"
    );
    assert!(audit[5].caller.starts_with("anonymous"), "{:?}", audit[5]);
    assert_eq!((last.target.as_str(), last.coordinator.as_str()), ("gqa", "c0"));
    assert!(last.detail.contains(&root_s), "{last:?}");
    let e = admin.list_audit(apb::ListAuditRequest { limit: 0 }).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "reading the audit log takes the admin token too");
    eventually("a ready replica", Duration::from_secs(30), || async {
        (ready_replicas_with(&a, "gqa", Some("the-admin-token")).await == 1).then_some(())
    })
    .await;
    assert!(generate_works(&a).await);
}

#[test]
fn a_static_rendezvous_refuses_a_rank_without_the_secret() {
    let model = gqa();
    let secret = "a-group-secret-of-some-length";
    let mut server = Server::spawn(&[
        "--model",
        &model,
        "--name",
        "gqa",
        "--tp",
        "2",
        "--worker-rendezvous",
        "127.0.0.1:0",
        "--rendezvous-secret",
        secret,
    ]);
    let announced = server.out.wait_event("rendezvous", Duration::from_secs(60), "strata serve");
    let rendezvous = announced["address"].as_str().unwrap().to_string();
    let rank = |secret: &str| {
        Command::new(strata_bin())
            .args(["worker", "--model", &model, "--tp", "2", "--rank", "1", "--rendezvous", &rendezvous])
            .args(["--rendezvous-secret", secret])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let out = rank("not-the-group-secret-at-all").wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("group secret"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut good = rank(secret);
    server.addr = server.wait_ready();
    let rt = tokio::runtime::Runtime::new().unwrap();
    assert!(rt.block_on(generate_works(&format!("http://{}", server.addr))));
    let _ = good.kill();
    let _ = good.wait();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_leader_distrusts_what_it_reads_from_the_registry() {
    use strata_common::registry::etcd::EtcdRegistry;
    use strata_common::registry::keys::Keys;
    use strata_common::registry::Registry;
    let mut cluster = Cluster::start(0, 1, Timing::default());
    let reg = EtcdRegistry::connect(&[cluster.etcd.endpoint()]).await.unwrap();
    let keys = Keys::new(&cluster.prefix);
    // A leader key no lease keeps alive, a model asking for 2^32 − 1 replicas, one with
    // tp 0, and a worker record filed under another worker's key with a bad address.
    reg.put(&keys.leader(), b"ghost".to_vec(), None).await.unwrap();
    let model = |name: &str, tp: u32, replicas: u64| {
        format!(r#"{{"name":"{name}","model_dir":"{}","tp":{tp},"pp":1,"replicas":{replicas}}}"#, gqa())
            .into_bytes()
    };
    reg.put(&keys.model("huge"), model("huge", 1, u32::MAX as u64), None).await.unwrap();
    reg.put(&keys.model("zero"), model("zero", 0, 1), None).await.unwrap();
    let w0 = reg.get(&keys.worker("w0")).await.unwrap().expect("w0 registered");
    let forged = String::from_utf8(w0.value).unwrap().replace(&cluster.workers[0].addr, "nowhere");
    reg.put(&keys.worker("w9"), forged.into_bytes(), None).await.unwrap();

    cluster.add_coordinator(&[]);
    assert_eq!(
        cluster.leader(Duration::from_secs(20)).await,
        0,
        "the coordinator removed the stale key and leads"
    );
    let a = cluster.coordinators[0].endpoint();
    AdminClient::connect(a.clone()).await.unwrap().deploy_model(deploy("gqa", &gqa())).await.unwrap();
    eventually("a ready replica beside the bogus records", Duration::from_secs(30), || async {
        (ready_replicas(&a, "gqa").await == 1).then_some(())
    })
    .await;
    assert!(generate_works(&a).await);
    assert!(cluster.coordinators[0].running(), "the leader is alive");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replica_drained_behind_the_leaders_back_is_replaced() {
    let cluster = Cluster::start(1, 2, Timing::default());
    let a = cluster.coordinators[0].endpoint();
    let mut admin = AdminClient::connect(a.clone()).await.unwrap();
    admin.deploy_model(deploy("gqa", &gqa())).await.unwrap();
    let list = |admin: AdminClient<tonic::transport::Channel>| async move {
        let mut admin = admin;
        let r = admin.list_replicas(apb::ListReplicasRequest { name: "gqa".into() }).await.ok()?.into_inner();
        r.replicas.into_iter().find(|r| r.state == apb::ReplicaState::Ready as i32)
    };
    let old = eventually("a ready replica", Duration::from_secs(30), || list(admin.clone())).await;
    // A drain sent straight to the worker (a coordinator's certificate can; a stranger's
    // cannot): the replica takes no requests, so it must not stay "ready".
    let mut w = WorkerClient::new(cluster.channel(&old.leader_address).await);
    w.drain(wpb::DrainRequest { replica_id: old.id.clone() }).await.unwrap();
    let new = eventually("a replacement replica", Duration::from_secs(30), || async {
        list(admin.clone()).await.filter(|r| r.id != old.id)
    })
    .await;
    assert_ne!(new.id, old.id);
    eventually("generation on the replacement", Duration::from_secs(10), || async {
        generate_works(&a).await.then_some(())
    })
    .await;
}
