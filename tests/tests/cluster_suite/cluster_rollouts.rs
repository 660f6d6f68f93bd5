//! A rollout in a real cluster (etcd, two `strata coordinator`s, two `strata worker`s): a
//! canary started through one coordinator's admin API takes its share of the other's
//! requests; a rollback through the second stops the first from routing to it; both
//! actions are in the audit log.

use std::time::Duration;

use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::cluster::{eventually, Cluster, Timing};
use strata_tests::{fixtures_dir, token_request};
use tonic::transport::Channel;

/// The revisions that served `n` distinct prompts (offset by `from`) on `endpoint`.
async fn revisions(endpoint: &str, from: u32, n: u32) -> Vec<u64> {
    let mut c: InferenceClient<Channel> = InferenceClient::connect(endpoint.to_string()).await.unwrap();
    let mut out = Vec::new();
    for i in from..from + n {
        // A shared 20-token prefix, then tokens of the prompt's own.
        let ids: Vec<u32> = (0..20).chain([i % 300 + 5, i / 300 + 7, (i * 31) % 377 + 3]).collect();
        out.push(
            c.generate(token_request("m", ids, 2)).await.expect("request succeeds").into_inner().revision,
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rollout_made_on_one_coordinator_routes_on_the_other() {
    let cluster = Cluster::start(2, 2, Timing::default());
    let fixture = fixtures_dir().join("llama_gqa");
    cluster.deploy_ready("m", &fixture.to_string_lossy(), 1, 1, Duration::from_secs(120)).await;
    let (a, b) = (cluster.coordinators[0].endpoint(), cluster.coordinators[1].endpoint());
    let v2 = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&fixture).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, v2.path().join(f.file_name().unwrap())).unwrap();
    }
    let mut admin_a = AdminClient::connect(a.clone()).await.unwrap();
    let start = apb::StartRolloutRequest {
        name: "m".into(),
        model_dir: v2.path().to_string_lossy().into_owned(),
        canary_percent: 50.0,
        ..Default::default()
    };
    admin_a.start_rollout(start).await.expect("start the rollout");
    eventually("the canary ready", Duration::from_secs(60), || {
        let mut admin = admin_a.clone();
        async move {
            let r = admin.get_rollout(apb::GetRolloutRequest { name: "m".into() }).await.ok()?.into_inner();
            (r.revisions.len() == 2 && r.revisions[1].ready_replicas == 1).then_some(())
        }
    })
    .await;
    // The other coordinator splits by the same weight once its view has the canary.
    let seen = eventually("the second coordinator routing to the canary", Duration::from_secs(20), || {
        let b = b.clone();
        async move {
            let r = revisions(&b, 0, 80).await;
            r.contains(&2).then_some(r)
        }
    })
    .await;
    let canary = seen.iter().filter(|&&r| r == 2).count();
    // Binomial(80, 0.5): mean 40, standard deviation 4.5; ±4.5 sd.
    assert!((20..=60).contains(&canary), "{canary} of 80 to a 50% canary: {seen:?}");
    assert!(seen.iter().all(|&r| r == 1 || r == 2), "{seen:?}");

    let mut admin_b = AdminClient::connect(b.clone()).await.unwrap();
    admin_b.rollback_rollout(apb::RollbackRolloutRequest { name: "m".into() }).await.expect("roll back");
    eventually("the first coordinator off the canary", Duration::from_secs(10), || {
        let a = a.clone();
        async move { revisions(&a, 1000, 40).await.iter().all(|&r| r == 1).then_some(()) }
    })
    .await;
    let audit = admin_a.list_audit(apb::ListAuditRequest { limit: 50 }).await.unwrap().into_inner();
    let actions: Vec<&str> = audit.entries.iter().map(|e| e.action.as_str()).collect();
    assert!(actions.contains(&"StartRollout") && actions.contains(&"RollbackRollout"), "{actions:?}");
}
