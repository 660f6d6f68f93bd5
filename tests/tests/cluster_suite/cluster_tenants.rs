//! Tenants in a real cluster (etcd, two `strata coordinator`s, a `strata worker`): a
//! tenant and its key made through one coordinator's admin API work on the other; limits
//! are split between the live coordinators; a revoked key stops working everywhere; usage
//! summed over both coordinators equals what the clients received, and still does after a
//! coordinator restarts.

use std::time::Duration;

use strata_proto::admin::v1 as apb;
use strata_proto::admin::v1::admin_client::AdminClient;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::cluster::{eventually, Cluster, Timing};
use strata_tests::{fixtures_dir, token_request};
use tonic::transport::Channel;
use tonic::Code;

async fn admin(endpoint: &str) -> AdminClient<Channel> {
    AdminClient::connect(endpoint.to_string()).await.expect("connect admin")
}

fn keyed<T>(msg: T, key: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    r
}

/// One generation of `n` tokens after a 3-token prompt; the tokens received.
async fn generate(endpoint: &str, key: &str, n: u32) -> Result<usize, tonic::Status> {
    let mut c = InferenceClient::connect(endpoint.to_string()).await.unwrap();
    let r = c.generate(keyed(token_request("m", vec![1, 2, 3], n), key)).await?;
    Ok(r.into_inner().token_ids.len())
}

async fn usage(endpoint: &str) -> Option<apb::UsageRow> {
    let req = apb::GetUsageRequest { tenant: "billed".into(), ..Default::default() };
    let rows = admin(endpoint).await.get_usage(req).await.ok()?.into_inner().rows;
    rows.into_iter().find(|r| r.model == "m")
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_made_tenants_work_everywhere_and_usage_survives_a_restart() {
    let mut cluster = Cluster::start(2, 1, Timing::default());
    let dir = fixtures_dir().join("llama_gqa").to_string_lossy().into_owned();
    cluster.deploy_ready("m", &dir, 1, 1, Duration::from_secs(120)).await;
    let (a, b) = (cluster.coordinators[0].endpoint(), cluster.coordinators[1].endpoint());
    // Open until a key exists.
    generate(&b, "anything", 2).await.expect("no keys yet: inference is open");
    let limits = apb::TenantLimits { max_concurrent: Some(2), ..Default::default() };
    let set = apb::SetTenantRequest { name: "team".into(), weight: None, limits: Some(limits) };
    admin(&a).await.set_tenant(set).await.unwrap();
    let made =
        admin(&a).await.create_api_key(apb::CreateApiKeyRequest { tenant: "team".into() }).await.unwrap();
    let made = made.into_inner();
    assert!(made.key.starts_with("sk-strata-") && made.key.len() > 40, "{}", made.key);
    let listed = admin(&b).await.list_tenants(apb::ListTenantsRequest {}).await.unwrap().into_inner();
    let team = listed.tenants.iter().find(|t| t.name == "team");
    let keys = team.map(|t| t.keys.iter().map(|k| k.id.clone()).collect::<Vec<_>>());
    assert_eq!(keys, Some(vec![made.key_id.clone()]), "listed by id, never by key: {listed:?}");
    // The key works on the coordinator that made it at once, and on the other once its
    // view has the tenant; callers without a key are refused now.
    assert_eq!(generate(&a, &made.key, 2).await.unwrap(), 2);
    eventually("the key works on the second coordinator", Duration::from_secs(10), || async {
        generate(&b, &made.key, 2).await.ok()
    })
    .await;
    assert_eq!(generate(&b, "anything", 2).await.unwrap_err().code(), Code::Unauthenticated);
    split_limits(&a, &made.key).await;

    // Usage: a tenant whose every call the test counts.
    let billed = apb::SetTenantRequest { name: "billed".into(), ..Default::default() };
    admin(&b).await.set_tenant(billed).await.unwrap();
    let key =
        admin(&b).await.create_api_key(apb::CreateApiKeyRequest { tenant: "billed".into() }).await.unwrap();
    let key = key.into_inner().key;
    eventually("the billed key works on the first coordinator", Duration::from_secs(10), || async {
        let mut c = InferenceClient::connect(a.clone()).await.ok()?;
        // ListModels: authenticated, generates nothing (so usage stays exact).
        let req = strata_proto::inference::v1::ListModelsRequest {};
        c.list_models(keyed(req, &key)).await.ok()
    })
    .await;
    let mut delivered = 0u64;
    let mut requests = 0u64;
    for (i, ep) in [&a, &b, &a, &b, &b].into_iter().enumerate() {
        delivered += generate(ep, &key, 3 + i as u32).await.unwrap() as u64;
        requests += 1;
    }
    let want = (requests, 3 * requests, delivered);
    let seen = |r: &apb::UsageRow| (r.requests, r.prompt_tokens, r.generated_tokens);
    // The other coordinator writes its records every couple of seconds.
    let mut last = None;
    let summed = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            last = usage(&a).await;
            if last.as_ref().is_some_and(|r| seen(r) == want) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(summed.is_ok(), "usage {last:?}, want (requests, prompt, generated) = {want:?}");
    // Restart coordinator a: it writes its last records as it stops; its successor reads them.
    cluster.coordinators[0].signal("TERM");
    let _ = cluster.coordinators[0].child.wait();
    let c = cluster.add_coordinator(&[]).endpoint();
    let after =
        eventually("usage after a restart", Duration::from_secs(15), || async { usage(&c).await }).await;
    assert_eq!(seen(&after), want, "{after:?}");

    let revoke = apb::RevokeApiKeyRequest { tenant: "team".into(), key_id: made.key_id.clone() };
    admin(&c).await.revoke_api_key(revoke).await.unwrap();
    eventually("the revoked key is refused everywhere", Duration::from_secs(10), || async {
        let codes = [generate(&b, &made.key, 1).await, generate(&c, &made.key, 1).await];
        codes.iter().all(|r| r.as_ref().is_err_and(|s| s.code() == Code::Unauthenticated)).then_some(())
    })
    .await;
    let config_tenant = apb::SetTenantRequest { name: "default".into(), ..Default::default() };
    let refused = admin(&c).await.set_tenant(config_tenant).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
}

/// max_concurrent 2 over two live coordinators: one stream each.
async fn split_limits(endpoint: &str, key: &str) {
    let mut c = InferenceClient::connect(endpoint.to_string()).await.unwrap();
    // A long stream that is not read stays in flight.
    let held = c.generate_stream(keyed(token_request("m", vec![1, 2, 3], 400), key)).await.unwrap();
    let second = generate(endpoint, key, 2).await.unwrap_err();
    assert_eq!(second.code(), Code::ResourceExhausted, "{second:?}");
    assert!(second.message().contains("50% share"), "{}", second.message());
    drop(held);
    eventually("the stream's slot frees when it is cancelled", Duration::from_secs(10), || async {
        generate(endpoint, key, 2).await.ok()
    })
    .await;
}
