//! The registry's contract, checked against both implementations: a real etcd server
//! (started by the test on free loopback ports) and the in-process registry.
//!
//! Each check runs the same code on both, so `strata serve` (in-memory) and cluster mode
//! (etcd) see the same semantics: revisions, leases that lapse and take their keys with
//! them, create-if-absent, guarded commits, and watches that resume from a revision.

use std::time::{Duration, Instant};

use futures::StreamExt;
use strata_common::registry::etcd::EtcdRegistry;
use strata_common::registry::memory::MemoryRegistry;
use strata_common::registry::{Event, Guard, Op, Registry};
use strata_common::ErrorClass;
use strata_tests::etcd::Etcd;

async fn next_events(s: &mut strata_common::registry::EventStream) -> Vec<Event> {
    tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("a watch event within 10 s")
        .expect("the watch is open")
        .expect("no watch error")
}

async fn contract(reg: &dyn Registry, prefix: &str) {
    let k = |s: &str| format!("{prefix}/{s}");
    // Puts, gets, listing in key order at one revision.
    reg.put(&k("b"), b"2".to_vec(), None).await.unwrap();
    reg.put(&k("a"), b"1".to_vec(), None).await.unwrap();
    reg.put(&format!("{prefix}x/outside"), b"no".to_vec(), None).await.unwrap();
    let listing = reg.list(&format!("{prefix}/")).await.unwrap();
    let keys: Vec<&str> = listing.entries.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, [k("a"), k("b")], "{}: listing", reg.kind());
    assert!(listing.revision >= listing.entries.iter().map(|e| e.mod_revision).max().unwrap());
    assert_eq!(reg.get(&k("a")).await.unwrap().unwrap().value, b"1");
    assert!(reg.get(&k("missing")).await.unwrap().is_none());

    // A watch from the listing's revision sees exactly what happened after it.
    let mut watch = reg.watch(&format!("{prefix}/"), listing.revision + 1).await.unwrap();
    reg.put(&k("c"), b"3".to_vec(), None).await.unwrap();
    reg.delete(&k("a")).await.unwrap();
    let mut seen = next_events(&mut watch).await;
    if seen.len() < 2 {
        seen.extend(next_events(&mut watch).await);
    }
    assert!(matches!(&seen[0], Event::Put(e) if e.key == k("c") && e.value == b"3"), "{seen:?}");
    assert!(matches!(&seen[1], Event::Delete { key, .. } if *key == k("a")), "{seen:?}");
    assert!(seen[1].revision() > seen[0].revision());

    // A watch started in the past replays history from that revision.
    let mut replay = reg.watch(&format!("{prefix}/"), listing.revision + 1).await.unwrap();
    let first = next_events(&mut replay).await;
    assert!(matches!(&first[0], Event::Put(e) if e.key == k("c")), "{}: replay {first:?}", reg.kind());

    // Create-if-absent: exactly one winner.
    assert!(reg.create(&k("leader"), b"me".to_vec(), None).await.unwrap());
    assert!(!reg.create(&k("leader"), b"you".to_vec(), None).await.unwrap());
    assert_eq!(reg.get(&k("leader")).await.unwrap().unwrap().value, b"me");

    // Guarded commits apply only while the guard holds, atomically.
    let mine = Guard { key: k("leader"), value: b"me".to_vec() };
    let theirs = Guard { key: k("leader"), value: b"you".to_vec() };
    let ops = vec![Op::Put { key: k("d"), value: b"4".to_vec(), lease: None }, Op::Delete { key: k("b") }];
    assert!(!reg.commit_if(&theirs, ops.clone()).await.unwrap());
    assert!(reg.get(&k("d")).await.unwrap().is_none(), "a failed guard writes nothing");
    assert!(reg.commit_if(&mine, ops).await.unwrap());
    assert!(reg.get(&k("d")).await.unwrap().is_some() && reg.get(&k("b")).await.unwrap().is_none());

    // Leases: keys bound to a lease vanish when it lapses, and watchers see it.
    let lease = reg.grant_lease(Duration::from_secs(1)).await.unwrap();
    reg.put(&k("w1"), b"alive".to_vec(), Some(lease)).await.unwrap();
    // Time itself is what is tested here: 1.2 s of refreshes outlive a 1 s lease.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        reg.keep_alive(lease).await.expect("a live lease refreshes");
    }
    assert!(reg.get(&k("w1")).await.unwrap().is_some(), "a refreshed lease keeps its keys");
    let from = reg.list(&format!("{prefix}/")).await.unwrap().revision + 1;
    let mut w = reg.watch(&k("w1"), from).await.unwrap();
    let t = Instant::now();
    let gone = next_events(&mut w).await;
    assert!(matches!(&gone[0], Event::Delete { key, .. } if *key == k("w1")), "{gone:?}");
    // etcd checks leases about every 500 ms; a 1 s lease is gone within a few seconds.
    assert!(t.elapsed() < Duration::from_secs(6), "{}: lease lapsed after {:?}", reg.kind(), t.elapsed());
    let e = reg.keep_alive(lease).await.expect_err("a lapsed lease cannot be refreshed");
    assert_eq!(e.class(), ErrorClass::NotFound, "{e}");
    let e = reg.put(&k("w2"), b"x".to_vec(), Some(lease)).await.expect_err("a put on a lapsed lease fails");
    assert_eq!(e.class(), ErrorClass::NotFound, "{e}");

    // Revoking ends a lease at once.
    let lease = reg.grant_lease(Duration::from_secs(30)).await.unwrap();
    reg.put(&k("w3"), b"x".to_vec(), Some(lease)).await.unwrap();
    reg.revoke_lease(lease).await.unwrap();
    assert!(reg.get(&k("w3")).await.unwrap().is_none());
    assert_eq!(reg.get(&format!("{prefix}x/outside")).await.unwrap().unwrap().value, b"no");
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_registry_keeps_the_contract() {
    let reg = MemoryRegistry::new();
    contract(&reg, "/t").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn etcd_registry_keeps_the_contract() {
    let etcd = Etcd::start();
    let reg = EtcdRegistry::connect(&[etcd.endpoint()]).await.unwrap();
    contract(&reg, "/t").await;
    // Two clusters under different prefixes share one etcd without seeing each other.
    contract(&reg, "/other-cluster").await;
    assert!(reg.list("/t/").await.unwrap().entries.iter().all(|e| e.key.starts_with("/t/")));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_etcd_outage_is_unavailable_and_then_recovers() {
    let mut etcd = Etcd::start();
    let reg = EtcdRegistry::connect(&[etcd.endpoint()]).await.unwrap();
    reg.put("/o/k", b"before".to_vec(), None).await.unwrap();
    let lease = reg.grant_lease(Duration::from_secs(5)).await.unwrap();
    reg.put("/o/live", b"x".to_vec(), Some(lease)).await.unwrap();
    let rev = reg.list("/o/").await.unwrap().revision;
    let mut watch = reg.watch("/o/", rev + 1).await.unwrap();
    etcd.stop();
    let t = Instant::now();
    let e = reg.get("/o/k").await.expect_err("etcd is down");
    assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
    assert!(t.elapsed() < Duration::from_secs(8), "an unreachable etcd answers within the call timeout");
    let ended = tokio::time::timeout(Duration::from_secs(15), watch.next()).await.expect("the watch notices");
    assert!(!matches!(ended, Some(Ok(_))), "a broken watch ends or errors: {ended:?}");
    etcd.resume();
    // The same client reconnects by itself; data survived; leases were extended on restart.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match reg.get("/o/k").await {
            Ok(v) => {
                assert_eq!(v.unwrap().value, b"before");
                break;
            }
            Err(e) if Instant::now() < deadline => {
                eprintln!("waiting for etcd: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("etcd did not come back: {e}"),
        }
    }
    reg.keep_alive(lease).await.expect("the lease survived the restart");
    assert!(reg.get("/o/live").await.unwrap().is_some());
}

#[test]
fn memory_registry_expires_leases_without_callers() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let reg = MemoryRegistry::new();
        let lease = reg.grant_lease(Duration::from_millis(200)).await.unwrap();
        reg.put("/m/k", b"v".to_vec(), Some(lease)).await.unwrap();
        let mut w = reg.watch("/m/", 0).await.unwrap();
        let put = next_events(&mut w).await;
        assert!(matches!(&put[0], Event::Put(_)));
        let gone = next_events(&mut w).await;
        assert!(matches!(&gone[0], Event::Delete { .. }), "{gone:?}");
        // A forced lapse (what a test of lapse handling uses) behaves the same.
        let lease = reg.grant_lease(Duration::from_secs(60)).await.unwrap();
        reg.put("/m/k2", b"v".to_vec(), Some(lease)).await.unwrap();
        reg.expire_lease(lease);
        assert!(reg.get("/m/k2").await.unwrap().is_none());
    });
}
