//! The control plane on the in-process cluster: the election, the reconciler, membership,
//! the catalog and the router, and failover — without processes.

use std::sync::atomic::Ordering;
use std::time::Duration;

use strata_common::cluster::ReplicaState;
use strata_common::registry::Registry;
use strata_common::SamplingParams;

use super::worker::{token_at, Fault};
use super::{until, Node, TestCluster};
use crate::frontend::admission::{GenerateRequest, Priority, Prompt};
use crate::tenant::Tenants;

const LIMIT: Duration = Duration::from_secs(15);

fn leaders(nodes: &[&Node]) -> Vec<String> {
    nodes.iter().filter(|n| n.leading()).map(|n| n.id.clone()).collect()
}

/// Waits until exactly one of `nodes` leads and the registry's leader key names it.
async fn one_leader(cluster: &TestCluster, nodes: &[&Node]) -> String {
    until("exactly one leader", LIMIT, || async {
        let now = leaders(nodes);
        let key = cluster.registry.get(&cluster.keys.leader()).await.ok()??;
        (now.len() == 1 && key.value == now[0].as_bytes()).then(|| now[0].clone())
    })
    .await
}

/// Ready replicas of `model` in `node`'s view, with their workers.
fn ready(node: &Node, model: &str) -> Vec<(String, Vec<String>)> {
    let view = node.view();
    view.ready_replicas(model)
        .map(|r| (r.id.to_string(), r.workers.iter().map(|w| w.to_string()).collect()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_coordinator_leads_and_another_takes_over_when_it_resigns_or_dies() {
    let cluster = TestCluster::default();
    let mut nodes = [cluster.coordinator("a"), cluster.coordinator("b"), cluster.coordinator("c")];
    let first = one_leader(&cluster, &nodes.iter().collect::<Vec<_>>()).await;
    // A leader that shuts down hands over at once (well within its lease).
    let at = nodes.iter().position(|n| n.id == first).unwrap();
    let began = std::time::Instant::now();
    nodes[at].resign().await;
    let second = one_leader(&cluster, &nodes.iter().collect::<Vec<_>>()).await;
    assert_ne!(second, first);
    assert!(began.elapsed() < super::LEASE, "a resignation took {:?}", began.elapsed());
    // One that dies is replaced once its lease lapses, and not before anyone noticed.
    let at = nodes.iter().position(|n| n.id == second).unwrap();
    nodes[at].crash();
    let third = one_leader(&cluster, &nodes.iter().collect::<Vec<_>>()).await;
    assert!(third != first && third != second, "{first} {second} {third}");
}

/// Under paused time the lease alone decides: a crashed leader's successor leads once
/// the lease it last refreshed lapses — never while it lives (at least TTL less one
/// refresh interval after the crash) and within a reaper tick of it.
#[tokio::test(start_paused = true)]
async fn a_crashed_leaders_lease_decides_when_its_successor_leads() {
    let cluster = TestCluster::default();
    let mut nodes = [cluster.coordinator("a"), cluster.coordinator("b")];
    let first = one_leader(&cluster, &nodes.iter().collect::<Vec<_>>()).await;
    let at = nodes.iter().position(|n| n.id == first).unwrap();
    let crashed = tokio::time::Instant::now();
    nodes[at].crash();
    let second = one_leader(&cluster, &nodes.iter().collect::<Vec<_>>()).await;
    let took = crashed.elapsed();
    assert_ne!(second, first);
    let refresh = super::LEASE / 5;
    assert!(took >= super::LEASE - refresh, "a successor led {took:?} after the crash, inside the lease");
    assert!(took <= super::LEASE + Duration::from_millis(200), "the successor waited {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_places_replicas_on_free_workers_and_every_coordinator_routes_to_them() {
    let mut cluster = TestCluster::default();
    for w in ["w1", "w2", "w3", "w4", "w5"] {
        cluster.add_worker(w).await;
    }
    let (a, b) = (cluster.coordinator("a"), cluster.coordinator("b"));
    cluster.deploy("m", 2, 2).await;
    let replicas = until("two ready replicas of two ranks", LIMIT, || async {
        let r = ready(&a, "m");
        (r.len() == 2).then_some(r)
    })
    .await;
    // The context the replicas report reaches every coordinator's catalog once they are
    // ready, before requests rely on it.
    for node in [&a, &b] {
        until("the replicas' context in the catalog", LIMIT, || async {
            let m = node.front.models().get("m").ok()?;
            (m.max_context() == super::worker::CONTEXT).then_some(())
        })
        .await;
    }
    let mut used: Vec<String> = replicas.iter().flat_map(|(_, ws)| ws.clone()).collect();
    used.sort();
    used.dedup();
    assert_eq!(used.len(), 4, "each rank on its own worker: {replicas:?}");
    // Each ready replica's ranks hold its shard (the worker learns of it before the view).
    let loaded = |r: &[(String, Vec<String>)]| {
        r.iter()
            .all(|(id, ws)| ws.iter().all(|w| cluster.worker(w).replica().is_some_and(|h| h.as_str() == id)))
    };
    until("every rank loaded on its worker", LIMIT, || async { loaded(&ready(&a, "m")).then_some(()) }).await;
    // Both coordinators (leader or not) serve requests through the ready replicas.
    let caller = Tenants::default().authenticate(None, "metadata").unwrap();
    for node in [&a, &b] {
        let prompt = vec![5, 6, 7];
        let tokens = until("a routable model", LIMIT, || generate(node, &caller, prompt.clone(), 6)).await;
        let want: Vec<u32> = (0..6).map(|i| token_at(&prompt, prompt.len() + i)).collect();
        assert_eq!(tokens, want, "via {}", node.id);
    }
    let leaders_served: usize =
        replicas.iter().map(|(_, ws)| cluster.worker(&ws[0]).jobs.load(Ordering::SeqCst)).sum();
    assert!(leaders_served >= 2, "requests go to replicas' rank 0");
    assert!(replicas.iter().all(|(_, ws)| cluster.worker(&ws[0]).canaries.load(Ordering::SeqCst) > 0));
}

/// One greedy request for `max` tokens; None while the model is not yet routable.
async fn generate(
    node: &Node,
    caller: &crate::tenant::Caller,
    prompt: Vec<u32>,
    max: u32,
) -> Option<Vec<u32>> {
    let request = GenerateRequest {
        model: "m".into(),
        prompt: Some(Prompt::TokenIds(prompt)),
        max_tokens: Some(max),
        fill_context: false,
        params: SamplingParams::default(),
        priority: Priority::Online,
        cache: false,
    };
    let mut started = node.front.begin(request, "t".into(), None, caller).await.ok()?;
    let mut ids = Vec::new();
    while let Some(chunk) = started.rx.recv().await {
        ids.extend(chunk.expect("no chunk fails").token_ids);
    }
    Some(ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_fails_its_replica_which_is_rebuilt_on_a_spare() {
    let mut cluster = TestCluster::default();
    for w in ["w1", "w2", "w3"] {
        cluster.add_worker(w).await;
    }
    let a = cluster.coordinator("a");
    cluster.deploy("m", 1, 2).await;
    let before = until("two ready replicas", LIMIT, || async {
        let r = ready(&a, "m");
        (r.len() == 2).then_some(r)
    })
    .await;
    let (dead_replica, dead) = (before[0].0.clone(), before[0].1[0].clone());
    cluster.kill(&dead);
    let after = until("a replacement on the spare", LIMIT, || async {
        let r = ready(&a, "m");
        (r.len() == 2 && r.iter().all(|(id, _)| *id != dead_replica)).then_some(r)
    })
    .await;
    let workers: Vec<&str> = after.iter().map(|(_, ws)| ws[0].as_str()).collect();
    assert!(!workers.contains(&dead.as_str()), "{after:?}");
    let view = a.view();
    let gone = view.replicas.get("m").and_then(|m| m.get(dead_replica.as_str()));
    assert!(gone.is_none_or(|r| r.state == ReplicaState::Failed), "{gone:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_its_replica_continues_on_another_with_no_token_lost_or_repeated() {
    let mut cluster = TestCluster::default();
    for w in ["w1", "w2"] {
        cluster.add_worker(w).await;
    }
    let a = cluster.coordinator("a");
    cluster.deploy("m", 1, 2).await;
    until("two ready replicas", LIMIT, || async { (ready(&a, "m").len() == 2).then_some(()) }).await;
    // The replica that takes the first request cuts every stream after that (3 tokens in);
    // the other does not. Distinct prompts (a full KV block each) until one met the
    // cutter: every one still gets all its tokens.
    let caller = Tenants::default().authenticate(None, "metadata").unwrap();
    let first: Vec<u32> = (0..20).collect();
    generate(&a, &caller, first, 2).await.expect("routable");
    let cutter = if cluster.worker("w1").jobs.load(Ordering::SeqCst) > 0 { "w1" } else { "w2" };
    cluster.worker(cutter).set_fault(Fault::DropAfter(3));
    let cut = || cluster.worker(cutter).jobs.load(Ordering::SeqCst);
    let before = cut();
    for p in 0..64u32 {
        let prompt: Vec<u32> = (0..20).map(|i| (p * 31 + i * 7) % 90 + 3).collect();
        let tokens = generate(&a, &caller, prompt.clone(), 8).await.expect("routable");
        let want: Vec<u32> = (0..8).map(|i| token_at(&prompt, prompt.len() + i)).collect();
        assert_eq!(tokens, want, "prompt {prompt:?}");
        if cut() > before {
            break;
        }
    }
    assert!(cut() > before, "a request met the cutting replica");
}
