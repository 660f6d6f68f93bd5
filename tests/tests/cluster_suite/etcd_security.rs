//! A cluster on an etcd with TLS, client certificates and etcd's own authentication, each
//! role with only the keys it needs (the roles docs/SECURITY.md documents):
//! coordinators read and write `/strata` (which covers `/strata.audit/`), workers only
//! `/strata/workers/`.

use std::process::Command;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, Identity, Permission, TlsOptions};
use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::cluster::{eventually, Certs, Cluster, Timing};
use strata_tests::etcd::Etcd;
use strata_tests::{fixtures_dir, strata_bin, token_request};

/// Users and roles, then authentication on: set up with the root user over TLS.
async fn secure(etcd: &Etcd, certs: &Certs) {
    let read = |f: &str| std::fs::read(certs.path(f)).unwrap();
    let tls = TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(read("ca.crt")))
        .identity(Identity::from_pem(read("coordinator.crt"), read("coordinator.key")));
    let mut c = Client::connect([etcd.endpoint()], Some(ConnectOptions::new().with_tls(tls))).await.unwrap();
    c.user_add("root", "root-password", None).await.unwrap();
    c.user_grant_role("root", "root").await.unwrap();
    for (role, prefix) in [("strata-coordinator", "/strata"), ("strata-worker", "/strata/workers/")] {
        c.role_add(role).await.unwrap();
        c.role_grant_permission(role, Permission::read_write(prefix).with_prefix()).await.unwrap();
    }
    for (user, role) in [("coordinator", "strata-coordinator"), ("worker", "strata-worker")] {
        c.user_add(user, format!("{user}-password"), None).await.unwrap();
        c.user_grant_role(user, role).await.unwrap();
    }
    c.auth_enable().await.unwrap();
}

fn registry_flags(certs: &Certs, role: &str, password: &str) -> Vec<String> {
    [
        ("--etcd-ca", certs.path("ca.crt")),
        ("--etcd-cert", certs.path(&format!("{role}.crt"))),
        ("--etcd-key", certs.path(&format!("{role}.key"))),
        ("--etcd-user", role.to_string()),
        ("--etcd-password", password.to_string()),
    ]
    .into_iter()
    .flat_map(|(f, v)| [f.to_string(), v])
    .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cluster_runs_on_an_etcd_with_tls_and_auth() {
    let certs = Certs::new();
    let issued = Command::new(strata_bin())
        .args(["cert", "issue", "--ca", &certs.path(""), "--name", "etcd", "--out", &certs.path("")])
        .output()
        .unwrap();
    assert!(issued.status.success(), "{}", String::from_utf8_lossy(&issued.stderr));
    let etcd = Etcd::start_tls(
        certs.dir.path().join("etcd.crt"),
        certs.dir.path().join("etcd.key"),
        certs.dir.path().join("ca.crt"),
    );
    secure(&etcd, &certs).await;

    // A wrong password, or no client certificate: the process refuses to start.
    let ep = etcd.endpoint();
    let mut wrong = vec!["worker".to_string(), "--etcd".into(), ep.clone()];
    wrong.extend(registry_flags(&certs, "worker", "not-the-password"));
    let out = Command::new(strata_bin()).args(&wrong).output().unwrap();
    assert!(!out.status.success(), "a worker with a wrong etcd password started");

    let mut cluster = Cluster::start_on(etcd, 0, 0, Timing::default());
    cluster.coordinator_flags = registry_flags(&certs, "coordinator", "coordinator-password");
    cluster.worker_flags = registry_flags(&certs, "worker", "worker-password");
    cluster.add_coordinator(&[]);
    cluster.add_worker(&[], None);
    let a = cluster.coordinators[0].endpoint();
    let mut admin = AdminClient::connect(a.clone()).await.unwrap();
    let dir = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let deploy = apb::DeployModelRequest {
        name: "gqa".into(),
        model_dir: dir,
        tp: 1,
        pp: 1,
        replicas: 1,
        ..Default::default()
    };
    admin.deploy_model(deploy).await.unwrap();
    eventually("a ready replica on the secured etcd", Duration::from_secs(30), || async {
        let r = AdminClient::connect(a.clone())
            .await
            .ok()?
            .list_replicas(apb::ListReplicasRequest { name: "gqa".into() })
            .await
            .ok()?;
        r.into_inner().replicas.iter().any(|r| r.state == apb::ReplicaState::Ready as i32).then_some(())
    })
    .await;
    let mut c = InferenceClient::connect(a.clone()).await.unwrap();
    assert_eq!(
        c.generate(token_request("gqa", vec![1, 2, 3], 3)).await.unwrap().into_inner().token_ids.len(),
        3
    );
    let audit = admin.list_audit(apb::ListAuditRequest { limit: 10 }).await.unwrap().into_inner().entries;
    assert_eq!(audit.len(), 1, "the audit entry went to the secured etcd");
}
