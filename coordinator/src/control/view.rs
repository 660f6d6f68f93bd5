//! A coordinator's copy of the cluster state, kept exact by list + watch.
//!
//! [`ClusterView`] is plain data with a pure [`apply`](ClusterView::apply); the
//! [`Watcher`] task lists every key under the prefix once, then applies each watch batch
//! and publishes the new view on a `watch` channel. When the registry becomes unreachable
//! the last view stays published (coordinators keep routing on it) and the watcher keeps
//! trying; when it returns, a fresh listing replaces the view.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use strata_common::cluster::{decode, ModelSpec, ReplicaRecord, ReplicaState, WorkerRecord};
use strata_common::registry::keys::{KeyKind, Keys};
use strata_common::registry::{Event, Listing, Registry};
use strata_common::tenant::TenantRecord;
use strata_common::{ModelName, ReplicaId, WorkerId};
use tokio::sync::watch;
use tracing::{info, warn};

#[derive(Debug, Clone, Default)]
pub struct ClusterView {
    pub models: BTreeMap<ModelName, ModelSpec>,
    /// By model, then replica id.
    pub replicas: BTreeMap<ModelName, BTreeMap<ReplicaId, ReplicaRecord>>,
    pub workers: BTreeMap<WorkerId, WorkerRecord>,
    pub drained: BTreeSet<WorkerId>,
    /// The leader coordinator's id, when one holds the key.
    pub leader: Option<String>,
    /// Tenants made through the admin API.
    pub tenants: BTreeMap<String, TenantRecord>,
    /// Live coordinators (each bound to its lease).
    pub coordinators: BTreeSet<String>,
    pub revision: i64,
    /// Whether the last contact with the registry succeeded.
    pub connected: bool,
    /// Unix milliseconds since when the registry has been unreachable (None: reachable):
    /// what this view shows may be out of date.
    pub stale_since_ms: Option<u64>,
    /// Workers whose registration went away lately, kept for a while to be listed (lost
    /// or left, since when), newest last.
    pub departed: BTreeMap<WorkerId, Departed>,
}

/// A worker that is no longer registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Departed {
    /// Its last registration.
    pub record: WorkerRecord,
    /// Unix milliseconds when this view saw it go.
    pub since_ms: u64,
    /// It said it was leaving (a shutdown); otherwise its lease ran out (a crash, a network
    /// cut, a pause longer than the lease).
    pub left: bool,
}

impl Departed {
    pub fn state(&self) -> &'static str {
        if self.left {
            "left"
        } else {
            "lost"
        }
    }

    pub fn reason(&self) -> &'static str {
        if self.left {
            "shut down"
        } else {
            "its lease expired: the process died, or could not reach the registry"
        }
    }
}

/// How long a departed worker stays listed, and how many are.
pub const DEPARTED_RETENTION_MS: u64 = 10 * 60 * 1000;
pub const MAX_DEPARTED: usize = 256;

impl ClusterView {
    pub fn from_listing(keys: &Keys, listing: &Listing) -> Self {
        let mut v = ClusterView { revision: listing.revision, connected: true, ..Default::default() };
        for e in &listing.entries {
            v.put(keys, &e.key, &e.value);
        }
        v
    }

    /// Applies one watch event.
    pub fn apply(&mut self, keys: &Keys, ev: &Event) {
        match ev {
            Event::Put(e) => self.put(keys, &e.key, &e.value),
            Event::Delete { key, .. } => self.remove(keys, key),
        }
        self.revision = self.revision.max(ev.revision());
    }

    fn put(&mut self, keys: &Keys, key: &str, value: &[u8]) {
        let Some(kind) = keys.parse(key) else { return };
        // A record that does not parse, breaks a range, or is filed under another key is
        // ignored (and whatever it replaced is forgotten): the leader acts only on records
        // it can trust.
        let bad = |e: strata_common::Error| warn!(key, error = %e, "ignoring a malformed registry record");
        match kind {
            KeyKind::Worker(id) => {
                let w = decode::<WorkerRecord>(key, value).and_then(|w| w.check(id).map(|()| w));
                match w {
                    Ok(w) => {
                        self.departed.remove(&w.id);
                        self.workers.insert(w.id.clone(), w);
                    }
                    Err(e) => {
                        self.workers.remove(id);
                        bad(e)
                    }
                }
            }
            KeyKind::Model(name) => {
                match decode::<ModelSpec>(key, value).and_then(|m| m.check(name).map(|()| m)) {
                    Ok(m) => {
                        self.models.insert(m.name.clone(), m);
                    }
                    Err(e) => {
                        self.models.remove(name);
                        bad(e)
                    }
                }
            }
            KeyKind::Replica { model, id } => {
                let r = decode::<ReplicaRecord>(key, value).and_then(|r| r.check(model, id).map(|()| r));
                match r {
                    Ok(r) => {
                        self.replicas.entry(model.into()).or_default().insert(r.id.clone(), r);
                    }
                    Err(e) => {
                        if let Some(rs) = self.replicas.get_mut(model) {
                            rs.remove(id);
                        }
                        bad(e)
                    }
                }
            }
            KeyKind::Drain(w) => {
                self.drained.insert(w.into());
            }
            KeyKind::Leader => {
                self.leader = Some(String::from_utf8_lossy(&value[..value.len().min(256)]).into_owned())
            }
            KeyKind::Tenant(name) => {
                match decode::<TenantRecord>(key, value).and_then(|t| t.check(name).map(|()| t)) {
                    Ok(t) => {
                        self.tenants.insert(t.name.clone(), t);
                    }
                    Err(e) => {
                        self.tenants.remove(name);
                        bad(e)
                    }
                }
            }
            KeyKind::Coordinator(id) => {
                self.coordinators.insert(id.to_string());
            }
        }
    }

    fn remove(&mut self, keys: &Keys, key: &str) {
        match keys.parse(key) {
            Some(KeyKind::Worker(w)) => {
                if let Some(record) = self.workers.remove(w) {
                    self.depart(record, strata_common::cluster::now_ms());
                }
            }
            Some(KeyKind::Model(m)) => {
                self.models.remove(m);
            }
            Some(KeyKind::Replica { model, id }) => {
                if let Some(rs) = self.replicas.get_mut(model) {
                    rs.remove(id);
                    if rs.is_empty() {
                        self.replicas.remove(model);
                    }
                }
            }
            Some(KeyKind::Drain(w)) => {
                self.drained.remove(w);
            }
            Some(KeyKind::Leader) => self.leader = None,
            Some(KeyKind::Tenant(t)) => {
                self.tenants.remove(t);
            }
            Some(KeyKind::Coordinator(c)) => {
                self.coordinators.remove(c);
            }
            None => {}
        }
    }

    /// Lists `record` as departed at `now_ms`, forgetting the ones past retention and the
    /// oldest beyond the bound.
    pub fn depart(&mut self, record: WorkerRecord, now_ms: u64) {
        let left = record.leaving;
        self.departed.insert(record.id.clone(), Departed { record, since_ms: now_ms, left });
        self.departed.retain(|_, d| now_ms.saturating_sub(d.since_ms) < DEPARTED_RETENTION_MS);
        while self.departed.len() > MAX_DEPARTED {
            let oldest = self.departed.iter().min_by_key(|(_, d)| d.since_ms).map(|(id, _)| id.clone());
            match oldest {
                Some(id) => self.departed.remove(&id),
                None => break,
            };
        }
    }

    /// A fresh listing's view, keeping what `before` knew of departed workers and listing
    /// those registered then and gone now.
    pub fn refreshed(mut self, before: &ClusterView) -> Self {
        let now = strata_common::cluster::now_ms();
        let mut departed = before.departed.clone();
        departed.retain(|id, _| !self.workers.contains_key(id));
        self.departed = departed;
        for (id, w) in &before.workers {
            if !self.workers.contains_key(id) {
                self.depart(w.clone(), now);
            }
        }
        self
    }

    /// Marks the view out of date from `now_ms` (kept if already so).
    pub fn disconnect(&mut self, now_ms: u64) {
        self.connected = false;
        self.stale_since_ms.get_or_insert(now_ms);
    }

    /// Every replica of every model.
    pub fn all_replicas(&self) -> impl Iterator<Item = &ReplicaRecord> {
        self.replicas.values().flat_map(|m| m.values())
    }

    /// Replicas of `model` that take requests.
    pub fn ready_replicas<'a>(&'a self, model: &str) -> impl Iterator<Item = &'a ReplicaRecord> + 'a {
        self.replicas
            .get(model)
            .into_iter()
            .flat_map(|m| m.values())
            .filter(|r| r.state == ReplicaState::Ready)
    }
}

/// Keeps a [`ClusterView`] published.
pub struct Watcher {
    rx: watch::Receiver<Arc<ClusterView>>,
    task: tokio::task::JoinHandle<()>,
}

impl Watcher {
    /// Starts watching; the first view is published once the registry answers.
    pub fn start(registry: Arc<dyn Registry>, keys: Keys) -> Self {
        let (tx, rx) = watch::channel(Arc::new(ClusterView::default()));
        let task = tokio::spawn(run(registry, keys, tx));
        Watcher { rx, task }
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.rx.clone()
    }

    pub fn current(&self) -> Arc<ClusterView> {
        self.rx.borrow().clone()
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(registry: Arc<dyn Registry>, keys: Keys, tx: watch::Sender<Arc<ClusterView>>) {
    let mut backoff = Duration::from_millis(100);
    let mut lost = false;
    loop {
        let listing = match registry.list(&keys.root()).await {
            Ok(l) => l,
            Err(e) => {
                if !lost {
                    warn!(error = %e, "registry unreachable; routing on the last known state");
                    lost = true;
                    tx.send_modify(|v| Arc::make_mut(v).disconnect(strata_common::cluster::now_ms()));
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        if lost {
            info!("registry reachable again; view refreshed");
            lost = false;
        }
        backoff = Duration::from_millis(100);
        let before = tx.borrow().clone();
        let mut view = ClusterView::from_listing(&keys, &listing).refreshed(&before);
        let from = listing.revision + 1;
        tx.send_replace(Arc::new(view.clone()));
        let mut stream = match registry.watch(&keys.root(), from).await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "cannot watch the registry; listing again");
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        while let Some(batch) = stream.next().await {
            match batch {
                Ok(events) => {
                    for ev in &events {
                        view.apply(&keys, ev);
                    }
                    tx.send_replace(Arc::new(view.clone()));
                }
                Err(e) => {
                    warn!(error = %e, "registry watch broke; listing again");
                    break;
                }
            }
        }
        tx.send_modify(|v| Arc::make_mut(v).disconnect(strata_common::cluster::now_ms()));
        lost = true;
        tokio::time::sleep(backoff).await;
    }
}

#[cfg(test)]
mod tests {
    use strata_common::cluster::encode;
    use strata_common::registry::Entry;

    use super::*;

    fn put(key: String, value: Vec<u8>, rev: i64) -> Event {
        Event::Put(Entry { key, value, mod_revision: rev, lease: None })
    }

    #[test]
    fn events_keep_the_view_exact() {
        let k = Keys::new("/s");
        let mut v = ClusterView::default();
        let r = ReplicaRecord {
            id: "m-1".into(),
            model: "m".into(),
            state: ReplicaState::Ready,
            reason: String::new(),
            workers: vec!["w1".into()],
            leader_address: "a:1".into(),
            generation: 1,
            since_ms: 0,
            created_ms: 0,
        };
        v.apply(&k, &put(k.replica("m", "m-1"), encode(&r), 3));
        v.apply(&k, &put(k.drain("w2"), Vec::new(), 4));
        v.apply(&k, &put(k.leader(), b"c1".to_vec(), 5));
        v.apply(&k, &put(k.worker("junk"), b"not json".to_vec(), 6));
        assert_eq!(v.ready_replicas("m").count(), 1);
        assert!(v.drained.contains("w2"));
        assert_eq!(v.leader.as_deref(), Some("c1"));
        assert!(v.workers.is_empty(), "malformed values are ignored");
        assert_eq!(v.revision, 6);
        v.apply(&k, &Event::Delete { key: k.replica("m", "m-1"), mod_revision: 7 });
        v.apply(&k, &Event::Delete { key: k.leader(), mod_revision: 8 });
        assert!(v.replicas.is_empty() && v.leader.is_none());
        let t = TenantRecord {
            name: "t".into(),
            weight: 1.0,
            limits: Default::default(),
            keys: vec![],
            incarnation: String::new(),
        };
        v.apply(&k, &put(k.tenant("t"), encode(&t), 9));
        v.apply(&k, &put(k.tenant("u"), encode(&t), 10));
        v.apply(&k, &put(k.coordinator("c1"), Vec::new(), 11));
        assert_eq!(
            v.tenants.keys().collect::<Vec<_>>(),
            ["t"],
            "a tenant filed under another name is ignored"
        );
        assert!(v.coordinators.contains("c1"));
        v.apply(&k, &Event::Delete { key: k.tenant("t"), mod_revision: 12 });
        v.apply(&k, &Event::Delete { key: k.coordinator("c1"), mod_revision: 13 });
        assert!(v.tenants.is_empty() && v.coordinators.is_empty());
    }

    #[test]
    fn records_out_of_range_or_under_another_key_are_ignored() {
        use crate::control::plan::tests::spec;
        use strata_common::cluster::{Capacity, WorkerRecord};
        let k = Keys::new("/s");
        let mut v = ClusterView::default();
        v.apply(&k, &put(k.model("huge"), encode(&spec("huge", 1, u32::MAX)), 1));
        v.apply(&k, &put(k.model("zero"), encode(&spec("zero", 0, 1)), 2));
        v.apply(&k, &put(k.model("alias"), encode(&spec("other", 1, 1)), 3));
        v.apply(&k, &put(k.model("ok"), encode(&spec("ok", 1, 2)), 4));
        assert_eq!(v.models.keys().map(|m| m.as_str()).collect::<Vec<_>>(), ["ok"]);
        let worker = |id: &str, address: &str| WorkerRecord {
            id: id.into(),
            address: address.into(),
            capacity: Capacity::default(),
            assignment: None,
            started_ms: 0,
            leaving: false,
        };
        v.apply(&k, &put(k.worker("w1"), encode(&worker("w1", "127.0.0.1:7000")), 5));
        // A record under w1's key naming w2, then one with an unusable address: neither is
        // used, and w1's good record is forgotten rather than kept stale.
        v.apply(&k, &put(k.worker("w2"), encode(&worker("w1", "127.0.0.1:1")), 6));
        assert_eq!(v.workers.len(), 1);
        v.apply(&k, &put(k.worker("w1"), encode(&worker("w1", "no port here")), 7));
        assert!(v.workers.is_empty());
    }

    /// A worker whose key goes stays listed as departed: "left" when it said it was leaving,
    /// "lost" when its lease ran out; registering again takes it off the list, and the list
    /// is bounded.
    #[test]
    fn departed_workers_stay_listed_for_a_while() {
        use strata_common::cluster::{Capacity, WorkerRecord};
        let k = Keys::new("/s");
        let mut v = ClusterView::default();
        let worker = |id: &str, leaving: bool| WorkerRecord {
            id: id.into(),
            address: "127.0.0.1:7000".into(),
            capacity: Capacity::default(),
            assignment: None,
            started_ms: 0,
            leaving,
        };
        v.apply(&k, &put(k.worker("w1"), encode(&worker("w1", false)), 1));
        v.apply(&k, &put(k.worker("w2"), encode(&worker("w2", true)), 2));
        v.apply(&k, &Event::Delete { key: k.worker("w1"), mod_revision: 3 });
        v.apply(&k, &Event::Delete { key: k.worker("w2"), mod_revision: 4 });
        assert!(v.workers.is_empty());
        let states: Vec<(&str, &str)> = v.departed.iter().map(|(id, d)| (id.as_str(), d.state())).collect();
        assert_eq!(states, [("w1", "lost"), ("w2", "left")]);
        v.apply(&k, &put(k.worker("w1"), encode(&worker("w1", false)), 5));
        assert!(!v.departed.contains_key("w1") && v.workers.contains_key("w1"));
        // A fresh listing that no longer has w1 lists it as departed too.
        let fresh = ClusterView::default().refreshed(&v);
        assert!(fresh.departed.contains_key("w1") && fresh.departed.contains_key("w2"));
        // Bounded in number and in time.
        let mut v = ClusterView::default();
        for i in 0..MAX_DEPARTED + 10 {
            v.depart(worker(&format!("w{i}"), false), 1_000 + i as u64);
        }
        assert_eq!(v.departed.len(), MAX_DEPARTED);
        v.depart(worker("late", false), 1_000 + DEPARTED_RETENTION_MS + 500);
        assert!(v.departed.len() < MAX_DEPARTED, "{}", v.departed.len());
        // An outage marks the view stale from its start.
        v.disconnect(7);
        v.disconnect(9);
        assert_eq!((v.connected, v.stale_since_ms), (false, Some(7)));
    }

    #[test]
    fn random_record_bytes_never_panic_the_view() {
        use rand::{Rng, SeedableRng};
        let k = Keys::new("/s");
        let mut v = ClusterView::default();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let keys = [k.worker("w"), k.model("m"), k.replica("m", "r"), k.leader(), k.drain("w")];
        let samples = [&br#"{"id":"w","address":"a:1","capacity":{"device_kind":"cpu","device_count":1,"memory_bytes":1},"started_ms":0}"#[..], br#"{"name":"m","model_dir":"/m","tp":1,"pp":1,"replicas":1}"#];
        for i in 0..3000 {
            let mut bytes = samples[i % 2].to_vec();
            for _ in 0..rng.random_range(0..4) {
                let at = rng.random_range(0..bytes.len());
                bytes[at] = rng.random();
            }
            v.apply(&k, &put(keys[i % keys.len()].clone(), bytes, i as i64));
        }
    }
}
