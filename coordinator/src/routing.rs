//! The seam between the request path and wherever replicas live.
//!
//! A [`Catalog`] names the served models; each [`ModelEntry`] carries what the coordinator
//! needs to admit a request (config, tokenizer) and its [`Routes`]: which [`Replica`] takes
//! the next request. `strata serve` fills the catalog with in-process engine runners
//! ([`LocalRoutes`]); cluster mode fills it from the registry, with replicas reached over
//! worker.v1. The generation path (`generation.rs`) — including failover — is written
//! once against these traits.

use std::sync::Arc;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::StreamExt;
use strata_common::{Error, ModelConfig, Result, SamplingParams};
use strata_worker::{EngineHandle, EngineStats, SeqEvent};

use crate::tokenizer::Tokenizer;

/// One sequence to run: a prompt, the tokens already streamed to the caller (non-empty
/// when resuming after a replica failed), and how to sample.
#[derive(Debug, Clone)]
pub struct Job {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub generated: Vec<u32>,
    pub params: SamplingParams,
}

/// A sequence's events; dropping the stream cancels the sequence on its replica. The
/// stream ending without a finished token means the replica went away.
pub type EventStream = BoxStream<'static, SeqEvent>;

/// Somewhere a sequence can run.
#[async_trait::async_trait]
pub trait Replica: Send + Sync {
    fn id(&self) -> &str;
    /// Starts `job`. Errors of class `Unavailable` mean "try another replica";
    /// `Overloaded` means this one is full.
    async fn submit(&self, job: &Job) -> Result<EventStream>;
}

/// Which replica of one model takes the next request.
#[async_trait::async_trait]
pub trait Routes: Send + Sync {
    /// The replica for `prompt`, leaving out `exclude` (replicas this request already
    /// failed on or found full); None when no other replica is ready.
    fn pick(&self, prompt: &[u32], exclude: &[String]) -> Option<Arc<dyn Replica>>;
    /// A request found `replica` unusable (hint: route around it until told otherwise).
    fn report_failure(&self, _replica: &str) {}
    /// Waits up to `limit` for the set of ready replicas to change; false if it cannot
    /// change (in-process replicas never come back) or did not.
    async fn wait_for_change(&self, _limit: Duration) -> bool {
        false
    }
    /// Ready replicas.
    fn ready(&self) -> usize;
    /// Load over all replicas.
    fn stats(&self) -> EngineStats;
}

/// A served model.
pub struct ModelEntry {
    pub name: String,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub routes: Arc<dyn Routes>,
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

/// Index of the smallest load; the first on ties. `loads` must not be empty.
pub fn least_loaded(loads: &[usize]) -> usize {
    loads.iter().enumerate().min_by_key(|(i, l)| (**l, *i)).map(|(i, _)| i).unwrap_or(0)
}

/// An engine runner of this process.
pub struct LocalReplica {
    pub id: String,
    pub handle: EngineHandle,
}

/// The events of an in-process sequence as a stream.
pub fn sequence_events(seq: strata_worker::SequenceStream) -> EventStream {
    futures::stream::unfold(seq, |mut seq| async move { seq.next().await.map(|ev| (ev, seq)) }).boxed()
}

#[async_trait::async_trait]
impl Replica for LocalReplica {
    fn id(&self) -> &str {
        &self.id
    }

    async fn submit(&self, job: &Job) -> Result<EventStream> {
        let seq =
            self.handle.submit_resumed(job.prompt.clone(), job.generated.clone(), job.params.clone())?;
        Ok(sequence_events(seq))
    }
}

/// In-process replicas, least outstanding work first.
pub struct LocalRoutes {
    pub replicas: Vec<Arc<LocalReplica>>,
}

#[async_trait::async_trait]
impl Routes for LocalRoutes {
    fn pick(&self, _prompt: &[u32], exclude: &[String]) -> Option<Arc<dyn Replica>> {
        let live: Vec<&Arc<LocalReplica>> = self
            .replicas
            .iter()
            .filter(|r| !exclude.contains(&r.id) && r.handle.broken().is_none())
            .collect();
        if live.is_empty() {
            return None;
        }
        let loads: Vec<usize> = live.iter().map(|r| r.handle.load()).collect();
        Some(live[least_loaded(&loads)].clone() as Arc<dyn Replica>)
    }

    fn ready(&self) -> usize {
        self.replicas.iter().filter(|r| r.handle.broken().is_none()).count()
    }

    fn stats(&self) -> EngineStats {
        sum_stats(self.replicas.iter().map(|r| r.handle.stats()))
    }
}

pub fn sum_stats(stats: impl Iterator<Item = EngineStats>) -> EngineStats {
    stats.fold(EngineStats::default(), |a, s| EngineStats {
        running: a.running + s.running,
        waiting: a.waiting + s.waiting,
        kv_blocks_free: a.kv_blocks_free + s.kv_blocks_free,
        kv_blocks_total: a.kv_blocks_total + s.kv_blocks_total,
    })
}

#[cfg(test)]
mod tests {
    use super::least_loaded;

    #[test]
    fn least_loaded_prefers_idle_then_first() {
        assert_eq!(least_loaded(&[3, 1, 2]), 1);
        assert_eq!(least_loaded(&[2, 0, 0]), 1);
        assert_eq!(least_loaded(&[5]), 0);
    }
}
