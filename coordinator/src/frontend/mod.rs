//! The request path's owner: one [`FrontEnd`] per process (a coordinator node, `strata
//! serve`), shared by gRPC, the HTTP API and batch jobs.
//!
//! It owns what the path keeps between requests — the catalog of served models, the
//! response cache, each model's fair-admission gate, the usage ledger and the count of
//! online requests in flight — so two front ends (two coordinators in one test process)
//! share none of it. Metric handles are the only process-wide state left on the path.
//!
//! A request waits or is refused at these places, in this order; every refusal is a
//! [`strata_common::Error`] whose kind the APIs map to their status codes:
//!
//! 1. the catalog: an unknown model is `NotFound`;
//! 2. the caller's tenant: a model it may not use is `PermissionDenied`, a `max_tokens`
//!    over its cap `InvalidInput`;
//! 3. [`admission`]: the request's own fields against the model (`InvalidInput`);
//! 4. the tenant's limits: requests, tokens and concurrency (`RateLimited`, with the time
//!    after which a retry can pass);
//! 5. the response cache: a hit is answered here, with no replica;
//! 6. the model's gate ([`crate::frontend::fair`]): waits, fairly across tenants, for one of
//!    the slots the ready replicas have — no longer than the route wait and the caller's
//!    deadline (`Unavailable`, or `DeadlineExceeded` when the deadline passed);
//! 7. the replica ([`generation::start`]): a full or failed one sends the request to
//!    another, waiting for one to be ready within the same bounds; the replica's
//!    scheduler queues it behind the running sequences.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use strata_common::{Error, Result};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{Instrument, Span};

pub mod admission;
pub mod cache;
pub mod fair;
pub mod texts;

use self::admission::{admit, Admitted, GenerateRequest, Priority, Prompt};
use self::cache::{Key, Response, ResponseCache};
use self::fair::{Gate, Slot, Ticket};
use self::texts::{TextBudget, TextBudgetOptions};
use crate::request::generation::{self, ChunkRx, RouteLimits, Target};
use crate::request::metrics::{failed, served_by, RequestTimer};
use crate::request::span;
use crate::routing::{Catalog, ModelEntry};
use crate::tenant::limits::Ask;
use crate::tenant::usage::{Account, Ledger};
use crate::tenant::Caller;

/// What a front end is built with.
#[derive(Debug, Clone, Copy)]
pub struct FrontEndOptions {
    pub route: RouteLimits,
    /// Bytes of responses the response cache keeps (0: none).
    pub response_cache_bytes: usize,
    /// Caller text parsed and tokenized at once ([`texts`]).
    pub texts: TextBudgetOptions,
    /// One info log line per finished request (`--access-log`).
    pub access_log: bool,
}

impl Default for FrontEndOptions {
    fn default() -> Self {
        FrontEndOptions {
            route: RouteLimits::default(),
            response_cache_bytes: DEFAULT_CACHE_BYTES,
            texts: TextBudgetOptions::default(),
            access_log: false,
        }
    }
}

/// The response cache's size when none is configured.
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;

/// A request on its way: the prompt's ids and the chunks to come.
pub struct Started {
    pub model: Arc<ModelEntry>,
    pub prompt_ids: Vec<u32>,
    pub rx: ChunkRx,
}

/// The request path of one process (see the module).
pub struct FrontEnd {
    models: Arc<dyn Catalog>,
    limits: RouteLimits,
    cache: Arc<ResponseCache>,
    gates: Mutex<HashMap<String, Arc<Gate>>>,
    ledger: Arc<Ledger>,
    online: Arc<AtomicUsize>,
    texts: TextBudget,
    access_log: bool,
}

impl FrontEnd {
    pub fn new(models: Arc<dyn Catalog>, opts: FrontEndOptions) -> Arc<Self> {
        Arc::new(FrontEnd {
            models,
            limits: opts.route,
            cache: Arc::new(ResponseCache::new(opts.response_cache_bytes)),
            gates: Mutex::default(),
            ledger: Arc::default(),
            online: Arc::default(),
            texts: TextBudget::new(opts.texts),
            access_log: opts.access_log,
        })
    }

    /// The served models.
    pub fn models(&self) -> &Arc<dyn Catalog> {
        &self.models
    }

    pub fn limits(&self) -> RouteLimits {
        self.limits
    }

    /// What each tenant used, as this process counts it.
    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// The caller text parsed and tokenized at once, across every API.
    pub fn texts(&self) -> &TextBudget {
        &self.texts
    }

    pub fn cache(&self) -> &ResponseCache {
        &self.cache
    }

    /// How many online requests this front end is generating now (batch jobs yield to
    /// them).
    pub fn online_in_flight(&self) -> usize {
        self.online.load(Ordering::Relaxed)
    }

    /// The gate of `model`.
    fn gate(&self, model: &str) -> Arc<Gate> {
        let mut gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        gates.entry(model.to_string()).or_insert_with(|| Arc::new(Gate::for_model(model))).clone()
    }

    /// Every API's way in: finds the model, admits the request (tokenizing text off the
    /// async runtime: a long prompt takes milliseconds to seconds) and starts it, through
    /// the places the module lists. Failures are counted in the request metrics and the
    /// tenant's usage; their field names are admission's (an API renames them as it
    /// spells them).
    pub async fn begin(
        &self,
        request: GenerateRequest,
        request_id: String,
        deadline: Option<Instant>,
        caller: &Caller,
    ) -> Result<Started> {
        self.begin_in(request, request_id, deadline, caller, None).await
    }

    /// [`begin`](Self::begin) in a slot already taken for it ([`FrontEnd::take_slots`]), if
    /// given (a request's choices take theirs together).
    pub async fn begin_in(
        &self,
        request: GenerateRequest,
        request_id: String,
        deadline: Option<Instant>,
        caller: &Caller,
        slot: Option<Slot>,
    ) -> Result<Started> {
        Span::current().record("strata.tenant", caller.tenant());
        // Unknown names share one label, so a caller cannot grow the metrics without bound.
        let model = self.models.get(&request.model).inspect_err(|e| self.refuse(caller, "(unknown)", e))?;
        let cache_wanted = request.cache;
        let (admitted, mut account) = self
            .admit_for(&model, request, caller)
            .await
            .inspect_err(|e| self.refuse(caller, &model.name, e))?;
        let prompt_ids = admitted.prompt_ids.clone();
        let revision = model.routes.revision_for(&prompt_ids);
        let key =
            Key::of(caller.tenant(), &model.name, revision, &prompt_ids, &admitted.params, cache_wanted);
        if let Some(response) = key.as_ref().and_then(|k| self.cache.get(k)) {
            account.cached();
            let rx = replay(&model, &admitted, response, account);
            return Ok(Started { model, prompt_ids, rx });
        }
        let slot = match slot {
            Some(slot) => Ok(slot),
            None => self.take_slot(&model, &admitted, caller, &request_id, deadline).await,
        };
        match slot {
            Ok(slot) => account.hold(slot),
            Err(e) => {
                failed(&model.name, &e);
                account.failed();
                return Err(e);
            }
        }
        let target = Target {
            revision,
            cache: key.map(|k| (k, self.cache.clone())),
            online: self.online.clone(),
            access_log: self.access_log,
        };
        let rx =
            generation::start(model.clone(), admitted, request_id, deadline, self.limits, target, account)
                .await?;
        Ok(Started { model, prompt_ids, rx })
    }

    /// Waits for one of the model's fair-admission slots (see [`crate::frontend::fair`]), no
    /// longer than the route wait and the caller's deadline.
    async fn take_slot(
        &self,
        model: &ModelEntry,
        admitted: &Admitted,
        caller: &Caller,
        request_id: &str,
        deadline: Option<Instant>,
    ) -> Result<Slot> {
        let ticket = Ticket {
            tenant: caller.tenant().to_string(),
            weight: caller.weight(),
            priority: admitted.params.priority,
            cost: (admitted.prompt_ids.len() + admitted.params.max_new_tokens as usize) as u64,
        };
        let give_up = Instant::now() + self.limits.wait;
        let give_up = deadline.map_or(give_up, |d| d.min(give_up));
        let entered = self.gate(&model.name).enter(&ticket, model.routes.gate_size(), give_up).await;
        entered.map_err(|e| match deadline {
            Some(d) if Instant::now() >= d => Error::DeadlineExceeded(format!(
                "request {request_id} waited past its deadline for a replica slot"
            )),
            _ => e,
        })
    }

    /// `n` of `model`'s slots for one request's choices, taken together or not at all (see
    /// [`fair`]); `cost` is their prompts' and outputs' tokens together.
    pub async fn take_slots(
        &self,
        model: &str,
        caller: &Caller,
        (n, cost, priority): (usize, u64, Priority),
        deadline: Option<Instant>,
    ) -> Result<Vec<Slot>> {
        let entry = self.models.get(model)?;
        caller.may_use(&entry.name)?;
        let ticket = Ticket { tenant: caller.tenant().to_string(), weight: caller.weight(), priority, cost };
        let give_up = Instant::now() + self.limits.wait;
        let give_up = deadline.map_or(give_up, |d| d.min(give_up));
        self.gate(&entry.name).enter_many(&ticket, n, entry.routes.gate_size(), give_up).await
    }

    /// A request refused before admission: counted in the request metrics and the
    /// tenant's usage.
    fn refuse(&self, caller: &Caller, model: &str, e: &Error) {
        failed(model, e);
        self.ledger.refused(caller, model, e);
    }

    /// Admits the request for `caller`: its model, its `max_tokens` cap, the request's own
    /// checks, then the tenant's limits.
    async fn admit_for(
        &self,
        model: &Arc<ModelEntry>,
        request: GenerateRequest,
        caller: &Caller,
    ) -> Result<(Admitted, Account)> {
        caller.may_use(&model.name)?;
        let cap = caller.max_tokens_cap();
        if let (Some(n), Some(cap)) = (request.max_tokens, cap) {
            if n > cap {
                return Err(Error::invalid(
                    "max_tokens",
                    format!("{n} exceeds tenant {:?}'s max_tokens_per_request of {cap}", caller.tenant()),
                ));
            }
        }
        let admitted = match &request.prompt {
            Some(Prompt::Text(text) | Prompt::Chat(text)) => {
                let permit = self.texts.acquire(caller.tenant(), text.len()).await;
                let entry = model.clone();
                tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    admit(&request, &entry)
                })
                .await
                .map_err(|e| Error::Internal(format!("admission: {e}")))?
            }
            _ => admit(&request, model),
        };
        let mut admitted = admitted?;
        admitted.params.cache_salt = Some(cache_salt(caller, admitted.params.cache_salt));
        if let Some(cap) = cap {
            // A request that named no max_tokens gets the tenant's cap.
            admitted.params.max_new_tokens = admitted.params.max_new_tokens.min(cap);
        }
        let prompt_tokens = admitted.prompt_ids.len();
        let ask = Ask { prompt_tokens: prompt_tokens as u32, max_tokens: admitted.params.max_new_tokens };
        let permit = caller.admit(ask)?;
        let account = Account::open(self.ledger.clone(), caller, &model.name, prompt_tokens, permit);
        Ok((admitted, account))
    }
}

/// The cache salt of `caller`'s request: its tenant's (name and incarnation) mixed with the
/// request's own `cache_salt`, so no tenant's prompt reads another's cached blocks (a
/// prompt another tenant sent once answered 100× faster than an unseen one).
fn cache_salt(caller: &Caller, own: Option<u64>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let owner = caller.owner();
    (owner.tenant, owner.incarnation, own).hash(&mut h);
    h.finish()
}

/// A cached response, streamed as it was the first time (counted as a request, served by
/// no replica).
fn replay(model: &ModelEntry, admitted: &Admitted, response: Response, mut account: Account) -> ChunkRx {
    let span = Span::current();
    span::admitted(&span, &model.name, &admitted.params, admitted.prompt_ids.len());
    let mut timer = RequestTimer::start(&model.name, admitted.prompt_ids.len());
    served_by(&model.name, response.first().map_or(0, |c| c.revision));
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(
        async move {
            for (i, c) in response.iter().enumerate() {
                if tx.send(Ok(c.clone())).await.is_err() {
                    return;
                }
                timer.token();
                account.delivered(c.token_ids.len());
                if let Some(reason) = c.finish {
                    timer.finished(reason);
                    span::finished(&Span::current(), CACHE_REPLICA, 0, 0, i + 1, Ok(reason));
                }
            }
        }
        .instrument(span),
    );
    rx
}

/// What responses replayed from the cache name as their replica (spans, logs).
const CACHE_REPLICA: &str = "response-cache";

#[cfg(test)]
mod tests;
