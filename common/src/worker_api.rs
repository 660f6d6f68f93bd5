//! The seam between the coordinator and a worker process: everything the request path and
//! the control plane ask of a worker, in domain types.
//!
//! Two implementations: worker.v1 over gRPC (the coordinator's client, for workers in
//! other processes) and the worker's own agent (for workers in this process, as in
//! `strata serve`). Callers hold an `Arc<dyn WorkerApi>` and never know which; the
//! worker.v1 server is itself a thin adapter over the agent's implementation, so both
//! paths run the same worker code.

use std::time::Duration;

use futures::stream::BoxStream;

use crate::cluster::{Assignment, EngineLimits};
use crate::device::DType;
use crate::error::Result;
use crate::events::{EngineStats, SeqEvent};
use crate::ids::{ModelName, ReplicaId, WorkerId};
use crate::sampling::SamplingParams;
use crate::shard::Parallelism;

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

/// One rank of a replica for a worker to load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLoad {
    pub replica: ReplicaId,
    pub model: ModelName,
    /// Model directory as the worker sees it.
    pub model_dir: String,
    /// Weight dtype; None keeps the checkpoint's.
    pub dtype: Option<DType>,
    /// Weight matrices quantized at load: "int8", or "" for the worker's own setting.
    pub quantize: String,
    pub par: Parallelism,
    pub rank: usize,
    /// Rank 0's rendezvous address (ranks > 0 only).
    pub rendezvous: Option<String>,
    pub limits: EngineLimits,
    /// The replica's group secret, the same for every rank (see `LoadShardRequest`).
    pub group_secret: Vec<u8>,
}

/// Bounds of a group secret on the wire.
pub const GROUP_SECRET_BYTES: std::ops::RangeInclusive<usize> = 16..=64;

/// What a worker holds and how busy it is.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerStatus {
    pub worker_id: WorkerId,
    pub assignment: Option<Assignment>,
    pub draining: bool,
    pub stats: EngineStats,
    /// Shard loads this process has started.
    pub loads: u64,
    /// Sequences the shard it holds has accepted (rank 0).
    pub served: u64,
}

/// The small files of a model directory that a coordinator needs (config, tokenizer);
/// absent optional files are empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelFiles {
    pub config_json: Vec<u8>,
    pub generation_config_json: Vec<u8>,
    pub tokenizer_json: Vec<u8>,
    pub tokenizer_config_json: Vec<u8>,
}

impl ModelFiles {
    /// The files by their names in a model directory.
    pub fn named(&self) -> [(&'static str, &[u8]); 4] {
        [
            ("config.json", &self.config_json),
            ("generation_config.json", &self.generation_config_json),
            ("tokenizer.json", &self.tokenizer_json),
            ("tokenizer_config.json", &self.tokenizer_config_json),
        ]
    }
}

/// A worker, wherever it runs. Errors of class `Unavailable` mean the worker (or the
/// replica it leads) may be gone: try another.
#[async_trait::async_trait]
pub trait WorkerApi: Send + Sync {
    /// Starts `job` on `replica`, which this worker must lead (rank 0).
    async fn generate(&self, replica: &ReplicaId, job: &Job) -> Result<EventStream>;
    /// The load of the replica this worker leads (zeros when it leads none).
    async fn stats(&self) -> Result<EngineStats>;
    /// Starts loading a shard; rank 0 answers its rendezvous address for the other ranks.
    async fn load_shard(&self, load: ShardLoad) -> Result<Option<String>>;
    /// Drops the shard of `replica`, if this worker holds it.
    async fn unload_shard(&self, replica: &ReplicaId) -> Result<()>;
    async fn status(&self) -> Result<WorkerStatus>;
    /// Proves a step still goes through every rank of `replica` within `limit`; answers
    /// how long it took.
    async fn canary(&self, replica: &ReplicaId, limit: Duration) -> Result<Duration>;
    /// Stops `replica` taking new sequences; running ones finish.
    async fn drain(&self, replica: &ReplicaId) -> Result<()>;
    /// The small files of `model_dir` as this worker reads them.
    async fn model_files(&self, model_dir: &str) -> Result<ModelFiles>;
}
