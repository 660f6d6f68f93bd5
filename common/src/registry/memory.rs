//! The in-process registry: etcd's semantics without etcd.
//!
//! One mutex guards a sorted map, a revision counter, the leases and a bounded history of
//! events; a broadcast channel carries each committed batch to watchers. Every write bumps
//! the revision once, as etcd does, so a watch that starts from a listing's revision sees
//! exactly the changes after it. Leases lapse on a reaper thread (every 50 ms) even when
//! nobody touches the store, so a lapsed worker is noticed as it would be with etcd. The
//! history keeps the last [`HISTORY`] events; a watch from an older revision fails like a
//! compacted etcd watch and the caller lists again.
//!
//! Time is Tokio's clock: made inside a runtime, leases lapse on a task of that runtime, so
//! a test under paused time (`start_paused`) sees them lapse in virtual time, at once and
//! exactly when due.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::broadcast;
use tokio::time::Instant;

use super::{Entry, Event, EventStream, Guard, LeaseId, Listing, Op, Registry};
use crate::error::{Error, Result};

/// Events kept for watches that start in the past.
pub const HISTORY: usize = 10_000;

struct Lease {
    ttl: Duration,
    expires: Instant,
    keys: HashSet<String>,
}

#[derive(Default)]
struct State {
    revision: i64,
    kvs: BTreeMap<String, Entry>,
    leases: HashMap<LeaseId, Lease>,
    next_lease: LeaseId,
    history: VecDeque<Event>,
}

struct Shared {
    state: Mutex<State>,
    events: broadcast::Sender<Vec<Event>>,
}

/// A registry living in this process; clones share the store.
#[derive(Clone)]
pub struct MemoryRegistry {
    shared: Arc<Shared>,
}

impl Default for MemoryRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryRegistry {
    pub fn new() -> Self {
        let (events, _) = broadcast::channel(1024);
        let shared = Arc::new(Shared { state: Mutex::new(State::default()), events });
        let weak = Arc::downgrade(&shared);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    while reap(&weak) {
                        tokio::time::sleep(REAP_EVERY).await;
                    }
                });
            }
            Err(_) => {
                std::thread::Builder::new()
                    .name("registry-leases".into())
                    .spawn(move || {
                        while reap(&weak) {
                            std::thread::sleep(REAP_EVERY);
                        }
                    })
                    .expect("spawn the lease reaper");
            }
        }
        MemoryRegistry { shared }
    }

    /// Ends a lease as if it had lapsed (tests of lapse handling).
    pub fn expire_lease(&self, lease: LeaseId) {
        let mut st = self.lock();
        let batch = st.drop_lease(lease);
        self.publish(st, batch);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish(&self, st: std::sync::MutexGuard<'_, State>, batch: Vec<Event>) {
        if !batch.is_empty() {
            // Sent under the lock, so batches reach watchers in revision order.
            let _ = self.shared.events.send(batch);
        }
        drop(st);
    }
}

/// How often lapsed leases are looked for.
const REAP_EVERY: Duration = Duration::from_millis(50);

/// Drops the leases that have lapsed (and their keys); false once the registry is gone.
fn reap(shared: &Weak<Shared>) -> bool {
    let Some(shared) = shared.upgrade() else { return false };
    let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
    let batch = st.drop_lapsed(Instant::now());
    if !batch.is_empty() {
        let _ = shared.events.send(batch);
    }
    true
}

impl State {
    fn drop_lapsed(&mut self, now: Instant) -> Vec<Event> {
        let lapsed: Vec<LeaseId> =
            self.leases.iter().filter(|(_, l)| l.expires <= now).map(|(id, _)| *id).collect();
        lapsed.into_iter().flat_map(|id| self.drop_lease(id)).collect()
    }

    fn record(&mut self, ev: Event) {
        self.history.push_back(ev);
        if self.history.len() > HISTORY {
            self.history.pop_front();
        }
    }

    fn put(&mut self, key: &str, value: Vec<u8>, lease: Option<LeaseId>, revision: i64) -> Result<Event> {
        if let Some(id) = lease {
            let l = self.leases.get_mut(&id).ok_or_else(|| Error::NotFound(format!("lease {id:x}")))?;
            l.keys.insert(key.to_string());
        }
        if let Some(old) = self.kvs.get(key).and_then(|e| e.lease) {
            if Some(old) != lease {
                if let Some(l) = self.leases.get_mut(&old) {
                    l.keys.remove(key);
                }
            }
        }
        let entry = Entry { key: key.to_string(), value, mod_revision: revision, lease };
        self.kvs.insert(key.to_string(), entry.clone());
        Ok(Event::Put(entry))
    }

    fn delete(&mut self, key: &str, revision: i64) -> Option<Event> {
        let old = self.kvs.remove(key)?;
        if let Some(l) = old.lease.and_then(|id| self.leases.get_mut(&id)) {
            l.keys.remove(key);
        }
        Some(Event::Delete { key: key.to_string(), mod_revision: revision })
    }

    /// Removes a lease and its keys in one revision; returns the events.
    fn drop_lease(&mut self, id: LeaseId) -> Vec<Event> {
        let Some(lease) = self.leases.remove(&id) else { return Vec::new() };
        if lease.keys.is_empty() {
            return Vec::new();
        }
        self.revision += 1;
        let rev = self.revision;
        let mut keys: Vec<String> = lease.keys.into_iter().collect();
        keys.sort();
        let batch: Vec<Event> = keys.iter().filter_map(|k| self.delete(k, rev)).collect();
        for ev in &batch {
            self.record(ev.clone());
        }
        batch
    }

    fn guard_holds(&self, guard: &Guard) -> bool {
        self.kvs.get(&guard.key).is_some_and(|e| e.value == guard.value)
    }

    fn check_lease(&self, lease: Option<LeaseId>) -> Result<()> {
        match lease {
            Some(id) if !self.leases.contains_key(&id) => Err(Error::NotFound(format!("lease {id:x}"))),
            _ => Ok(()),
        }
    }
}

#[async_trait::async_trait]
impl Registry for MemoryRegistry {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        let mut st = self.lock();
        st.next_lease += 1;
        let id = st.next_lease;
        st.leases.insert(id, Lease { ttl, expires: Instant::now() + ttl, keys: HashSet::new() });
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        let mut st = self.lock();
        // A lease past its time is gone even if the reaper has not come round yet.
        let batch = st.drop_lapsed(Instant::now());
        let alive = st.leases.get_mut(&lease).map(|l| l.expires = Instant::now() + l.ttl).is_some();
        self.publish(st, batch);
        alive.then_some(()).ok_or_else(|| Error::NotFound(format!("lease {lease:x}")))
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        self.expire_lease(lease);
        Ok(())
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<()> {
        let mut st = self.lock();
        st.check_lease(lease)?;
        st.revision += 1;
        let rev = st.revision;
        let ev = st.put(key, value, lease, rev)?;
        st.record(ev.clone());
        self.publish(st, vec![ev]);
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>> {
        Ok(self.lock().kvs.get(key).cloned())
    }

    async fn list(&self, prefix: &str) -> Result<Listing> {
        let st = self.lock();
        let entries = st
            .kvs
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, e)| e.clone())
            .collect();
        Ok(Listing { entries, revision: st.revision })
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let mut st = self.lock();
        if !st.kvs.contains_key(key) {
            return Ok(());
        }
        st.revision += 1;
        let rev = st.revision;
        let batch: Vec<Event> = st.delete(key, rev).into_iter().collect();
        for ev in &batch {
            st.record(ev.clone());
        }
        self.publish(st, batch);
        Ok(())
    }

    async fn create(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<bool> {
        let mut st = self.lock();
        if st.kvs.contains_key(key) {
            return Ok(false);
        }
        st.check_lease(lease)?;
        st.revision += 1;
        let rev = st.revision;
        let ev = st.put(key, value, lease, rev)?;
        st.record(ev.clone());
        self.publish(st, vec![ev]);
        Ok(true)
    }

    async fn commit_if(&self, guard: &Guard, ops: Vec<Op>) -> Result<bool> {
        let mut st = self.lock();
        if !st.guard_holds(guard) {
            return Ok(false);
        }
        for op in &ops {
            if let Op::Put { lease, .. } = op {
                st.check_lease(*lease)?;
            }
        }
        if ops.is_empty() {
            return Ok(true);
        }
        st.revision += 1;
        let rev = st.revision;
        let mut batch = Vec::new();
        for op in ops {
            match op {
                Op::Put { key, value, lease } => batch.push(st.put(&key, value, lease, rev)?),
                Op::Delete { key } => batch.extend(st.delete(&key, rev)),
            }
        }
        for ev in &batch {
            st.record(ev.clone());
        }
        self.publish(st, batch);
        Ok(true)
    }

    async fn watch(&self, prefix: &str, from: i64) -> Result<EventStream> {
        let st = self.lock();
        // Subscribed under the lock, and every batch is sent under it: the live stream
        // starts exactly after the history replayed here.
        let rx = self.shared.events.subscribe();
        let oldest = st.history.front().map(|e| e.revision()).unwrap_or(st.revision + 1);
        if from < oldest && st.history.len() >= HISTORY {
            return Err(Error::NotFound(format!(
                "revision {from} has been compacted (oldest kept: {oldest})"
            )));
        }
        let prefix = prefix.to_string();
        let mut replay: Vec<Vec<Event>> = Vec::new();
        for ev in st.history.iter().filter(|e| e.revision() >= from && e.key().starts_with(&prefix)) {
            match replay.last_mut() {
                Some(b) if b[0].revision() == ev.revision() => b.push(ev.clone()),
                _ => replay.push(vec![ev.clone()]),
            }
        }
        let after = st.revision;
        drop(st);
        let replayed = futures::stream::iter(replay.into_iter().map(Ok));
        Ok(replayed.chain(live(prefix, rx, after)).boxed())
    }
}

/// Live batches after revision `after`, filtered to `prefix`. A watcher that falls more
/// than the channel's capacity behind gets an error (and lists again).
fn live(
    prefix: String,
    rx: broadcast::Receiver<Vec<Event>>,
    after: i64,
) -> impl futures::Stream<Item = Result<Vec<Event>>> + Send + 'static {
    futures::stream::unfold(Some(rx), move |rx| {
        let prefix = prefix.clone();
        async move {
            let mut rx = rx?;
            loop {
                match rx.recv().await {
                    Ok(batch) => {
                        let kept: Vec<Event> = batch
                            .into_iter()
                            .filter(|e| e.revision() > after && e.key().starts_with(&prefix))
                            .collect();
                        if !kept.is_empty() {
                            return Some((Ok(kept), Some(rx)));
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let e = Error::Unavailable(format!("watch fell {n} batches behind; list again"));
                        return Some((Err(e), None));
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        }
    })
}
