//! The worker agent as a [`WorkerApi`]: what `strata serve` hands its coordinator for the
//! workers in its own process, and what the worker.v1 server adapts to gRPC, so a
//! request runs the same worker code whichever way it arrives.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use strata_common::worker_api::{EventStream, Job, ModelFiles, ShardLoad, WorkerApi, WorkerStatus};
use strata_common::{EngineStats, Error, ReplicaId, Result};
use strata_engine::SequenceStream;

use crate::agent::WorkerAgent;

/// The events of an in-process sequence as a stream; dropping it cancels the sequence.
pub fn sequence_events(seq: SequenceStream) -> EventStream {
    futures::stream::unfold(seq, |mut seq| async move { seq.next().await.map(|ev| (ev, seq)) }).boxed()
}

/// A worker of this process, reached without a network hop.
#[derive(Clone)]
pub struct InProcessWorker(pub Arc<WorkerAgent>);

#[async_trait::async_trait]
impl WorkerApi for InProcessWorker {
    async fn generate(&self, replica: &ReplicaId, job: &Job) -> Result<EventStream> {
        let engine = self.0.serving(replica)?;
        let seq = engine.submit_resumed(job.prompt.clone(), job.generated.clone(), job.params.clone())?;
        Ok(sequence_events(seq))
    }

    async fn stats(&self) -> Result<EngineStats> {
        Ok(self.0.status().stats)
    }

    async fn load_shard(&self, load: ShardLoad) -> Result<Option<String>> {
        self.0.load(load)
    }

    async fn unload_shard(&self, replica: &ReplicaId) -> Result<()> {
        // Dropping an engine joins nothing but may block briefly on the shutdown sends.
        let agent = self.0.clone();
        let replica = replica.to_string();
        tokio::task::spawn_blocking(move || agent.unload(&replica))
            .await
            .map_err(|e| Error::Internal(format!("unload: {e}")))
    }

    async fn status(&self) -> Result<WorkerStatus> {
        let st = self.0.status();
        Ok(WorkerStatus {
            worker_id: self.0.id().into(),
            assignment: st.assignment,
            draining: st.draining,
            stats: st.stats,
            loads: st.loads,
            served: st.served,
        })
    }

    async fn canary(&self, replica: &ReplicaId, limit: Duration) -> Result<Duration> {
        let engine = self.0.leader(replica)?;
        if self.0.draining() {
            // A drained replica takes no requests, so it is not healthy: the leader
            // replaces it unless it is draining the replica itself.
            return Err(Error::Unavailable(format!("replica {replica} is draining and takes no requests")));
        }
        let started = Instant::now();
        let before = engine.progress();
        match tokio::time::timeout(limit, engine.canary()).await {
            Ok(Ok(())) => Ok(started.elapsed()),
            Ok(Err(e)) => Err(e),
            // A replica under load takes seconds a step: its canary waits behind them. It
            // fails only when its steps have stopped (see Progress::still_working).
            Err(_) if engine.progress().still_working(&before) => {
                tracing::debug!(%replica, "canary step still queued behind long steps; the replica is working");
                Ok(started.elapsed())
            }
            Err(_) => Err(Error::DeadlineExceeded(format!(
                "replica {replica}: no step came back within {} ms, and none completed meanwhile",
                limit.as_millis()
            ))),
        }
    }

    async fn drain(&self, replica: &ReplicaId) -> Result<()> {
        self.0.drain(replica)
    }

    async fn model_files(&self, model_dir: &str) -> Result<ModelFiles> {
        let dir = self.0.config().model_roots.check(model_dir)?;
        tokio::task::spawn_blocking(move || read_model_files(&dir))
            .await
            .map_err(|e| Error::Internal(format!("model files: {e}")))?
    }
}

/// Largest model file served: tokenizer.json of a large vocabulary is tens of MiB; the
/// others are a few KiB.
const MAX_MODEL_FILE: u64 = 128 << 20;

/// The small files of a model directory — these four names only, regular files only;
/// config.json and tokenizer.json must exist.
fn read_model_files(dir: &Path) -> Result<ModelFiles> {
    let read = |name: &str, required: bool| -> Result<Vec<u8>> {
        let p = dir.join(name);
        if !required && std::fs::symlink_metadata(&p).is_err() {
            return Ok(Vec::new());
        }
        // Opened without blocking and checked on the open file: a FIFO is refused.
        strata_common::files::read_bounded(&p, MAX_MODEL_FILE)
    };
    if !dir.is_dir() {
        return Err(Error::model_file(dir, "not a directory on this worker"));
    }
    Ok(ModelFiles {
        config_json: read("config.json", true)?,
        generation_config_json: read("generation_config.json", false)?,
        tokenizer_json: read("tokenizer.json", true)?,
        tokenizer_config_json: read("tokenizer_config.json", false)?,
    })
}
