//! The seam between the request path and wherever replicas live.
//!
//! A [`Catalog`] names the served models; each [`ModelEntry`] carries what the coordinator
//! needs to admit a request (config, tokenizer) and its [`Routes`]: which [`Replica`] takes
//! the next request. Both `strata serve` and cluster mode fill the catalog from the
//! registry view; replicas are reached through the `WorkerApi` seam (in-process workers
//! directly, others over worker.v1). The generation path (`generation.rs`) — including failover — is written
//! once against these traits.
//!
//! - [`cluster`]: one model's routes from the registry view; replicas reached through the
//!   `WorkerApi` seam ([`clients`]: gRPC or in-process, [`grpc_worker`]: the gRPC one);
//! - [`policy`]: which usable replica a request goes to — one file per policy (prefix
//!   affinity, least outstanding), built by name, each passing the same contract tests;
//! - [`split`]: which revision takes a request while a canary runs (sticky per prefix);
//! - [`catalog`]: the served models as the registry view says, with their tokenizers.

use std::sync::Arc;
use std::time::Duration;

use strata_common::{EngineStats, Error, ModelConfig, Result};

use crate::request::tokenizer::Tokenizer;

pub mod catalog;
pub mod clients;
pub mod cluster;
pub mod grpc_worker;
pub mod policy;
pub mod split;
pub mod suspects;

pub use strata_common::worker_api::{EventStream, Job};

/// Somewhere a sequence can run.
#[async_trait::async_trait]
pub trait Replica: Send + Sync {
    fn id(&self) -> &str;
    /// How many ranks (processes or threads holding a shard) serve it.
    fn ranks(&self) -> usize {
        1
    }
    /// Starts `job`. Errors of class `Unavailable` mean "try another replica";
    /// `Overloaded` means this one is full.
    async fn submit(&self, job: &Job) -> Result<EventStream>;
}

/// Which replica of one model takes the next request.
#[async_trait::async_trait]
pub trait Routes: Send + Sync {
    /// The replica for `prompt`, bound for `revision` (what [`Routes::revision_for`]
    /// decided when the request began), leaving out `exclude` (replicas this request
    /// already failed on or found full); None when no other replica is ready.
    fn pick(&self, prompt: &[u32], revision: u64, exclude: &[String]) -> Option<Arc<dyn Replica>>;
    /// A request found `replica` unusable (hint: route around it until told otherwise).
    fn report_failure(&self, _replica: &str) {}
    /// Waits up to `limit` for the set of ready replicas to change; false if it cannot
    /// change (in-process replicas never come back) or did not.
    async fn wait_for_change(&self, _limit: Duration) -> bool {
        false
    }
    /// Ready replicas.
    fn ready(&self) -> usize;
    /// Why no replica is ready (None while one is): the furthest along of the model's
    /// replicas, as the registry says.
    fn unready(&self) -> Option<Unready> {
        None
    }
    /// The revision a request with `prompt` goes to (a deployment's spec generation; the
    /// canary's for its share of prompts), decided once when it begins: it is routed
    /// there, failovers included, and its response cached for it.
    fn revision_for(&self, _prompt: &[u32]) -> u64 {
        0
    }
    /// The revision `replica` was built from, when known.
    fn replica_revision(&self, _replica: &str) -> Option<u64> {
        Some(0)
    }
    /// Load over all ready replicas, as they report it now.
    async fn stats(&self) -> EngineStats;

    /// The longest prompt + output every ready replica accepts, as they last reported it
    /// (None before any has).
    fn max_context(&self) -> Option<usize> {
        None
    }
    /// This coordinator's share of the ready replicas' sequence slots and waiting room:
    /// the size of its fair-admission gate for the model.
    fn gate_size(&self) -> GateSize {
        GateSize { slots: usize::MAX, queue: usize::MAX }
    }
}

/// Where a model without a ready replica stands: its most advanced replica's state
/// (loading before pending before draining or failed), why, and since when; no state when
/// it is to have none (scaled to 0, or no longer deployed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unready {
    pub state: Option<strata_common::cluster::ReplicaState>,
    pub reason: String,
    /// Unix milliseconds of the state's start (0 without a replica).
    pub since_ms: u64,
}

impl Unready {
    /// "pending (waiting for 1 free worker) for 12s", "no replica (scaled to 0)".
    pub fn describe(&self, now_ms: u64) -> String {
        let Some(state) = self.state else { return format!("no replica ({})", self.reason) };
        let secs = now_ms.saturating_sub(self.since_ms) / 1000;
        match self.reason.is_empty() {
            true => format!("{} for {secs}s", state.as_str()),
            false => format!("{} ({}) for {secs}s", state.as_str(), self.reason),
        }
    }
}

/// How many requests a coordinator may run on a model at once, and how many may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateSize {
    pub slots: usize,
    pub queue: usize,
}

/// A served model.
pub struct ModelEntry {
    pub name: String,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub routes: Arc<dyn Routes>,
}

impl ModelEntry {
    /// The longest prompt + output a request may ask for: the model's context, or less
    /// where the replicas say so (`--max-model-len`, a KV cache too small for a full one).
    pub fn max_context(&self) -> usize {
        let model = self.config.max_position_embeddings;
        self.routes.max_context().map_or(model, |c| c.min(model))
    }
}

/// The models a coordinator serves.
pub trait Catalog: Send + Sync {
    /// The model called `name`: `NotFound` naming the served ones, `InvalidInput` when empty.
    fn get(&self, name: &str) -> Result<Arc<ModelEntry>>;
    /// Every served model, by name.
    fn all(&self) -> Vec<Arc<ModelEntry>>;
}

/// The error for a model name that is not served.
pub fn not_found(name: &str, served: &[String]) -> Error {
    if name.is_empty() {
        return Error::invalid("model", "must name a served model");
    }
    Error::NotFound(format!("model {name:?}; served: {}", served.join(", ")))
}
