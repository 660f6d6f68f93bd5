//! Fair admission: which waiting request a model's replicas take next when they are full.
//!
//! Each coordinator keeps one [`Gate`] per model. A request holds a [`Slot`] of the gate
//! while it generates; the gate has as many slots as the model's ready replicas run
//! sequences at once (`max_num_seqs` each), split among the live coordinators as tenants'
//! limits are. When the slots are taken, requests wait in the gate's queue (bounded in
//! length, and in time by the route wait and the caller's deadline), and a freed slot goes
//! to the best waiting request:
//!
//! - **priority first**: online requests before batch requests;
//! - **weighted fair queuing** between tenants within a priority: each request gets a
//!   virtual finish tag `max(V, tenant's last tag) + cost / weight` (cost: prompt plus
//!   `max_tokens`), and the smallest tag goes first; so under overload each tenant's share
//!   of tokens follows its weight, whoever sends more;
//! - **headroom for others**: while other tenants have used the model recently, one
//!   tenant may hold at most the slots minus one per such tenant (at most half the slots
//!   kept back), so a tenant flooding the model cannot occupy every slot and another
//!   tenant's next request starts without waiting for the flood's requests to end.
//!
//! Requests never wait while slots are free (the gate is work-conserving), and a request
//! answered from the response cache takes no slot.
//!
//! A request's `n` choices enter together ([`Gate::enter_many`]): all their slots at once or
//! none, so a request never holds part of its choices' slots while it waits for the rest
//! (holding them starved other tenants, then failed); more choices than the tenant may
//! hold now are refused at once, and a waiting group is not passed by later requests.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use strata_common::{Error, Result};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::admission::Priority;
use crate::routing::GateSize;

/// How long a tenant counts as using a model after its last request.
pub const ACTIVE_WINDOW: Duration = Duration::from_secs(10);

/// What one request asks of the gate.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub tenant: String,
    pub weight: f64,
    pub priority: Priority,
    /// Prompt plus max_tokens.
    pub cost: u64,
}

#[derive(Debug, Default)]
struct TenantState {
    in_flight: usize,
    /// The tenant's last virtual finish tag.
    finish: f64,
    last_seen: Option<Instant>,
}

impl TenantState {
    fn recent(&self, now: Instant) -> bool {
        self.last_seen.is_some_and(|at| now.duration_since(at) < ACTIVE_WINDOW)
    }
}

/// Queue order: priority class, finish tag (as ordered bits: tags are ≥ 0), arrival.
type QueueKey = (u8, u64, u64);

struct Waiter {
    tenant: String,
    finish: f64,
    /// Slots it takes together.
    count: usize,
    tx: oneshot::Sender<()>,
}

#[derive(Default)]
struct State {
    slots: usize,
    in_flight: usize,
    /// Virtual time: the finish tag of the last request admitted.
    virtual_time: f64,
    tenants: HashMap<String, TenantState>,
    queue: BTreeMap<QueueKey, Waiter>,
    arrivals: u64,
}

impl State {
    /// Tenants that used the model within [`ACTIVE_WINDOW`] of `now`.
    fn active(&self, now: Instant) -> usize {
        self.tenants.values().filter(|s| s.recent(now)).count()
    }

    /// The most slots `tenant` may hold, `active` tenants (see [`State::active`]) having
    /// used the model recently.
    fn cap(&self, tenant: &str, active: usize, now: Instant) -> usize {
        let own = self.tenants.get(tenant).is_some_and(|s| s.recent(now));
        let others = active - usize::from(own);
        self.slots - others.min(self.slots / 2)
    }

    fn tag(&mut self, t: &Ticket) -> f64 {
        let s = self.tenants.entry(t.tenant.clone()).or_default();
        let start = self.virtual_time.max(s.finish);
        s.finish = start + t.cost.max(1) as f64 / t.weight.max(1e-3);
        s.finish
    }

    fn admit(&mut self, tenant: &str, finish: f64) {
        self.in_flight += 1;
        self.virtual_time = self.virtual_time.max(finish);
        self.tenants.entry(tenant.to_string()).or_default().in_flight += 1;
    }

    /// Hands free slots to the best waiting requests that may take theirs: in queue order,
    /// skipping those whose tenant would pass its cap; a request whose slots are not all
    /// free yet stops the handing out, so later ones never pass it.
    fn dispatch(&mut self, now: Instant) {
        let active = self.active(now);
        while self.in_flight < self.slots {
            let held = |t: &str| self.tenants.get(t).map_or(0, |s| s.in_flight);
            let next = self
                .queue
                .iter()
                .find(|(_, w)| held(&w.tenant) + w.count <= self.cap(&w.tenant, active, now))
                .map(|(k, w)| (*k, w.count));
            let Some((key, count)) = next else { return };
            if self.in_flight + count > self.slots {
                return;
            }
            let w = self.queue.remove(&key).expect("found above");
            if w.tx.is_closed() {
                continue; // it gave up waiting
            }
            for _ in 0..count {
                self.admit(&w.tenant, w.finish);
            }
            if w.tx.send(()).is_err() {
                for _ in 0..count {
                    self.release(&w.tenant);
                }
            }
        }
    }

    fn release(&mut self, tenant: &str) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(s) = self.tenants.get_mut(tenant) {
            s.in_flight = s.in_flight.saturating_sub(1);
        }
    }
}

/// One model's admission gate on this coordinator.
#[derive(Default)]
pub struct Gate {
    state: Mutex<State>,
    /// The model `strata_admission_waiting{model}` and `strata_admission_in_flight{model}`
    /// are published for (resolved on each publish: an undeployed model's series go, and
    /// come back if it is deployed again).
    model: Option<String>,
}

fn gauges(model: &str) -> (Gauge, Gauge) {
    type Gauges = Family<crate::request::metrics::ModelLabel, Gauge>;
    static G: OnceLock<(Gauges, Gauges)> = OnceLock::new();
    let (waiting, in_flight) = G.get_or_init(|| {
        let (w, f) = (Gauges::default(), Gauges::default());
        let register = strata_common::metrics::register;
        register(
            "admission_waiting",
            "Requests waiting in the fair-admission queue for a replica slot",
            w.clone(),
        );
        register("admission_in_flight", "Requests holding a replica slot of this coordinator", f.clone());
        let (forget_w, forget_f) = (w.clone(), f.clone());
        strata_common::metrics::on_forget_model(move |model| {
            let label = crate::request::metrics::ModelLabel { model: model.to_string() };
            forget_w.remove(&label);
            forget_f.remove(&label);
        });
        (w, f)
    });
    let label = crate::request::metrics::ModelLabel { model: model.to_string() };
    (waiting.get_or_create(&label).clone(), in_flight.get_or_create(&label).clone())
}

/// A request's hold on one of the model's slots; dropping it frees the slot for the next
/// waiting request.
pub struct Slot {
    gate: Arc<Gate>,
    tenant: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.gate.state();
        s.release(&self.tenant);
        s.dispatch(Instant::now());
        self.gate.publish(&s);
    }
}

impl Gate {
    /// A gate for `model`, publishing its gauges (a front end keeps one per model).
    pub fn for_model(model: &str) -> Gate {
        gauges(model);
        Gate { state: Mutex::default(), model: Some(model.to_string()) }
    }

    /// Publishes the queue's length and the slots in use.
    fn publish(&self, s: &State) {
        if let Some(model) = &self.model {
            let (waiting, in_flight) = gauges(model);
            waiting.set(s.queue.len() as i64);
            in_flight.set(s.in_flight as i64);
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a slot (`size`: the model's slots and waiting room now) until `give_up`;
    /// refused at once when the waiting room is full.
    pub async fn enter(self: &Arc<Self>, t: &Ticket, size: GateSize, give_up: Instant) -> Result<Slot> {
        let mut slots = self.enter_many(t, 1, size, give_up).await?;
        Ok(slots.pop().expect("one slot"))
    }

    /// Waits for `n` slots taken together (a request's choices); refused at once when the
    /// tenant may not hold that many now, or when the waiting room is full.
    pub async fn enter_many(
        self: &Arc<Self>,
        t: &Ticket,
        n: usize,
        size: GateSize,
        give_up: Instant,
    ) -> Result<Vec<Slot>> {
        let n = n.max(1);
        let slots = || (0..n).map(|_| Slot { gate: self.clone(), tenant: t.tenant.clone() }).collect();
        let rx = {
            let now = Instant::now();
            let mut s = self.state();
            s.slots = size.slots.max(1);
            s.tenants.entry(t.tenant.clone()).or_default().last_seen = Some(now);
            s.dispatch(now); // the slots may have grown since the last release
            let cap = s.cap(&t.tenant, s.active(now), now);
            if n > cap {
                return Err(Error::Overloaded(format!(
                    "{n} choices cannot run together: tenant {:?} may hold {cap} of the model's {} slots while other tenants use it",
                    t.tenant, s.slots
                )));
            }
            let finish = s.tag(t);
            let held = s.tenants.get(&t.tenant).map_or(0, |x| x.in_flight);
            if s.queue.is_empty() && s.in_flight + n <= s.slots && held + n <= cap {
                for _ in 0..n {
                    s.admit(&t.tenant, finish);
                }
                self.publish(&s);
                return Ok(slots());
            }
            // The waiting room is shared by the tenants using the model: a full room
            // refuses a tenant only once it has its share of it waiting, so one tenant
            // filling the room cannot shut the others out (the room then holds at most
            // twice its size).
            let share = size.queue.div_ceil(s.active(now).max(1)).max(1);
            let own = s.queue.values().filter(|w| w.tenant == t.tenant).count();
            let full = s.queue.len() >= size.queue && own >= share;
            if full || s.queue.len() >= size.queue.saturating_mul(2) {
                return Err(Error::Overloaded(format!(
                    "{} requests are waiting for this model's replicas ({own} of tenant {:?}, its share {share}), as many as may",
                    s.queue.len(),
                    t.tenant
                )));
            }
            let (tx, rx) = oneshot::channel();
            let class = match t.priority {
                Priority::Online => 0,
                Priority::Batch => 1,
            };
            s.arrivals += 1;
            let key = (class, finish.to_bits(), s.arrivals);
            s.queue.insert(key, Waiter { tenant: t.tenant.clone(), finish, count: n, tx });
            s.dispatch(now);
            self.publish(&s);
            rx
        };
        let mut rx = rx;
        match tokio::time::timeout_at(give_up, &mut rx).await {
            Ok(Ok(())) => Ok(slots()),
            _ => {
                // Closed first, so no slot is handed over after the check below; one
                // handed over just before is this request's after all.
                rx.close();
                if rx.try_recv().is_ok() {
                    return Ok(slots());
                }
                Err(Error::Overloaded("no replica slot came free while the request waited".into()))
            }
        }
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.state().queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket(tenant: &str, weight: f64, priority: Priority) -> Ticket {
        Ticket { tenant: tenant.into(), weight, priority, cost: 10 }
    }

    fn size(slots: usize) -> GateSize {
        GateSize { slots, queue: 100 }
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    /// Probed: one tenant filled the shared waiting room and the others were refused. A
    /// full room refuses only a tenant that has its share of it waiting.
    #[tokio::test]
    async fn a_tenant_filling_the_waiting_room_does_not_shut_out_another() {
        let gate = Arc::new(Gate::default());
        let room = GateSize { slots: 1, queue: 4 };
        let _held = gate.enter(&ticket("a", 1.0, Priority::Online), room, far()).await.unwrap();
        let b_seen = gate.enter(&ticket("b", 1.0, Priority::Online), room, Instant::now()).await.map(|_| ());
        assert!(b_seen.is_err(), "b waited no time: refused, but now it uses the model");
        let mut waiting = Vec::new();
        for _ in 0..4 {
            let g = gate.clone();
            waiting.push(tokio::spawn(async move {
                g.enter(&ticket("a", 1.0, Priority::Online), room, far()).await.map(|_| ())
            }));
            tokio::task::yield_now().await;
        }
        assert_eq!(gate.waiting(), 4, "a fills the room (nobody else waits)");
        let e = gate.enter(&ticket("a", 1.0, Priority::Online), room, far()).await.map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("its share 2"), "{e}");
        let g = gate.clone();
        let b = tokio::spawn(async move {
            g.enter(&ticket("b", 1.0, Priority::Online), room, far()).await.map(|_| ())
        });
        tokio::task::yield_now().await;
        assert_eq!(gate.waiting(), 5, "b waits although the room is full: it is under its share");
        b.abort();
        waiting.iter().for_each(|w| w.abort());
    }

    #[tokio::test]
    async fn a_flooding_tenant_leaves_a_slot_and_waiting_requests_go_by_weight() {
        let gate = Arc::new(Gate::default());
        // b used the model a moment ago: a may hold 4 - 1 slots.
        let b = gate.enter(&ticket("b", 1.0, Priority::Online), size(4), far()).await.unwrap();
        drop(b);
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(gate.enter(&ticket("a", 1.0, Priority::Online), size(4), far()).await.unwrap());
        }
        let a4 = {
            let g = gate.clone();
            tokio::spawn(async move {
                g.enter(&ticket("a", 1.0, Priority::Online), size(4), far()).await.map(|_| ())
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(gate.waiting(), 1, "a's fourth request waits: the last slot is kept for b");
        let b_ticket = ticket("b", 1.0, Priority::Online);
        let b_now = tokio::time::timeout(Duration::from_secs(1), gate.enter(&b_ticket, size(4), far()));
        let b_slot = b_now.await.expect("b starts at once").unwrap();
        // Everything taken; queue: a (weight 1) then c (weight 4) and a batch request.
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for (name, weight, priority) in [("batch", 1.0, Priority::Batch), ("c", 4.0, Priority::Online)] {
            let (g, order) = (gate.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let slot = g.enter(&ticket(name, weight, priority), size(4), far()).await.unwrap();
                order.lock().unwrap().push(name);
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(slot);
            }));
            tokio::task::yield_now().await;
        }
        drop(b_slot); // frees one: c goes first (a is at its cap; c's tag beats the batch class)
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(*order.lock().unwrap(), ["c"]);
        held.clear();
        a4.await.unwrap().unwrap();
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["c", "batch"], "batch work comes last");
    }

    #[tokio::test]
    async fn waiting_requests_are_served_in_proportion_to_their_tenants_weights() {
        let gate = Arc::new(Gate::default());
        let holder = gate.enter(&ticket("z", 1.0, Priority::Online), size(1), far()).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        // x queues four requests first, then y (four times x's weight) queues four.
        for (name, weight) in
            [("x", 1.0), ("x", 1.0), ("x", 1.0), ("x", 1.0), ("y", 4.0), ("y", 4.0), ("y", 4.0), ("y", 4.0)]
        {
            let (g, order) = (gate.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let _slot = g.enter(&ticket(name, weight, Priority::Online), size(1), far()).await.unwrap();
                order.lock().unwrap().push(name);
            }));
            while gate.waiting() < waiters.len() {
                tokio::task::yield_now().await;
            }
        }
        drop(holder);
        for w in waiters {
            w.await.unwrap();
        }
        // Finish tags: x 20, 30, 40, 50; y 12.5, 15, 17.5, 20 (x's 20 came first).
        assert_eq!(*order.lock().unwrap(), ["y", "y", "y", "x", "y", "x", "x", "x"]);
    }

    #[tokio::test]
    async fn waiting_is_bounded_in_time_and_length() {
        let gate = Arc::new(Gate::default());
        let _one = gate.enter(&ticket("a", 1.0, Priority::Online), size(1), far()).await.unwrap();
        let soon = Instant::now() + Duration::from_millis(20);
        let e = gate.enter(&ticket("a", 1.0, Priority::Online), size(1), soon).await.err().unwrap();
        assert_eq!(e.class(), strata_common::ErrorClass::Overloaded);
        assert_eq!(gate.waiting(), 1, "a waiter that gave up is skipped when a slot frees");
        drop(_one);
        assert_eq!(gate.waiting(), 0);
        // More slots (a replica came up) admit at once.
        let _x = gate.enter(&ticket("a", 1.0, Priority::Online), size(1), far()).await.unwrap();
        let _y = gate.enter(&ticket("a", 1.0, Priority::Online), size(2), far()).await.unwrap();
    }

    /// Probed: `n` equal to the slots held part of them while waiting for the rest, and
    /// another tenant waited tens of seconds. A group takes all its slots at once or none.
    #[tokio::test]
    async fn choices_enter_together_or_not_at_all() {
        let gate = Arc::new(Gate::default());
        let four = size(4);
        let a = gate.enter_many(&ticket("a", 1.0, Priority::Online), 2, four, far()).await.unwrap();
        let g = gate.clone();
        let b =
            tokio::spawn(
                async move { g.enter_many(&ticket("b", 1.0, Priority::Online), 3, four, far()).await },
            );
        while gate.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(gate.state().in_flight, 2, "the waiting group holds no slot");
        drop(a);
        let b = tokio::time::timeout(Duration::from_secs(5), b).await.unwrap().unwrap().unwrap();
        assert_eq!((b.len(), gate.state().in_flight), (3, 3));
        drop(b);
        assert_eq!(gate.state().in_flight, 0, "every slot comes back");
    }

    #[tokio::test]
    async fn more_choices_than_the_tenant_may_hold_are_refused_at_once() {
        let gate = Arc::new(Gate::default());
        let _a = gate.enter(&ticket("a", 1.0, Priority::Online), size(4), far()).await.unwrap();
        let started = Instant::now();
        let refused = gate.enter_many(&ticket("b", 1.0, Priority::Online), 4, size(4), far()).await;
        let e = refused.err().expect("four choices while another tenant uses the model");
        assert!(e.to_string().contains("cannot run together"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(1), "refused at once");
        assert_eq!(gate.state().in_flight, 1);
        assert!(gate.enter_many(&ticket("b", 1.0, Priority::Online), 3, size(4), far()).await.is_ok());
    }
}
