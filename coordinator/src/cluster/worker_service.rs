//! `strata.worker.v1.Worker`: a worker's agent over gRPC.
//!
//! Generate streams one sequence of the replica this worker leads; dropping the stream
//! (the coordinator cancelled, its caller went away, or its deadline passed) drops the
//! `SequenceStream`, which cancels the sequence and frees its KV blocks at the next step.

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use strata_common::cluster::ShardState;
use strata_common::{Error, Parallelism, SamplingParams};
use strata_proto::worker::v1 as pb;
use strata_proto::worker::v1::worker_server::Worker;
use strata_worker::SeqEvent;
use tonic::{Request, Response, Status};

use super::agent::{LoadRequest, WorkerAgent};
use crate::status::to_status;

pub struct WorkerService {
    agent: Arc<WorkerAgent>,
}

impl WorkerService {
    pub fn new(agent: Arc<WorkerAgent>) -> Self {
        WorkerService { agent }
    }
}

/// Sampling parameters of a worker request (proto3 zeros read as "unset").
pub fn params_from_pb(r: &pb::WorkerGenerateRequest) -> SamplingParams {
    SamplingParams {
        temperature: r.temperature,
        top_k: r.top_k,
        top_p: if r.top_p == 0.0 { 1.0 } else { r.top_p },
        min_p: r.min_p,
        repetition_penalty: if r.repetition_penalty == 0.0 { 1.0 } else { r.repetition_penalty },
        presence_penalty: r.presence_penalty,
        frequency_penalty: r.frequency_penalty,
        seed: r.seed,
        max_new_tokens: r.max_tokens,
        ignore_eos: r.ignore_eos,
        stop_token_ids: r.stop_token_ids.clone(),
        stop: Vec::new(),
        logprobs: r.logprobs,
    }
}

/// The worker request for `params` (stop strings stay with the coordinator).
pub fn params_to_pb(p: &SamplingParams, out: &mut pb::WorkerGenerateRequest) {
    out.temperature = p.temperature;
    out.top_k = p.top_k;
    out.top_p = p.top_p;
    out.min_p = p.min_p;
    out.repetition_penalty = p.repetition_penalty;
    out.presence_penalty = p.presence_penalty;
    out.frequency_penalty = p.frequency_penalty;
    out.seed = p.seed;
    out.max_tokens = p.max_new_tokens;
    out.ignore_eos = p.ignore_eos;
    out.stop_token_ids = p.stop_token_ids.clone();
    out.logprobs = p.logprobs;
}

fn stats_pb(s: strata_worker::EngineStats) -> pb::StatsResponse {
    pb::StatsResponse {
        running_sequences: s.running as u32,
        waiting_requests: s.waiting as u32,
        kv_blocks_free: s.kv_blocks_free as u64,
        kv_blocks_total: s.kv_blocks_total as u64,
    }
}

type TokenStream = Pin<Box<dyn Stream<Item = Result<pb::WorkerGenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Worker for WorkerService {
    type GenerateStream = TokenStream;

    async fn generate(
        &self,
        request: Request<pb::WorkerGenerateRequest>,
    ) -> Result<Response<TokenStream>, Status> {
        let req = request.into_inner();
        let engine = self.agent.serving(&req.replica_id).map_err(to_status)?;
        let params = params_from_pb(&req);
        let mut seq = engine
            .submit_resumed(req.prompt_token_ids, req.generated_token_ids, params)
            .map_err(to_status)?;
        // The engine validates asynchronously; wait for the first event so a bad request
        // is this call's status, not a broken stream.
        let first = seq.next().await;
        if let Some(SeqEvent::Failed(e)) = first {
            return Err(to_status(e));
        }
        let stream = async_stream(first, seq);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn stats(&self, _: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        Ok(Response::new(stats_pb(self.agent.status().stats)))
    }

    async fn load_shard(
        &self,
        request: Request<pb::LoadShardRequest>,
    ) -> Result<Response<pb::LoadShardResponse>, Status> {
        let r = request.into_inner();
        let req = LoadRequest {
            replica: r.replica_id,
            model: r.model,
            model_dir: r.model_dir,
            dtype: r.dtype,
            par: Parallelism { tp: r.tp as usize, pp: r.pp as usize },
            rank: r.rank as usize,
            rendezvous: (!r.rendezvous.is_empty()).then_some(r.rendezvous),
            max_num_seqs: r.max_num_seqs as usize,
            max_batched_tokens: r.max_batched_tokens as usize,
            kv_cache_bytes: r.kv_cache_bytes as usize,
        };
        let rendezvous = self.agent.load(req).map_err(to_status)?;
        Ok(Response::new(pb::LoadShardResponse { rendezvous: rendezvous.unwrap_or_default() }))
    }

    async fn unload_shard(
        &self,
        request: Request<pb::UnloadShardRequest>,
    ) -> Result<Response<pb::UnloadShardResponse>, Status> {
        let agent = self.agent.clone();
        let replica = request.into_inner().replica_id;
        // Dropping an engine joins nothing but may block briefly on the shutdown sends.
        tokio::task::spawn_blocking(move || agent.unload(&replica))
            .await
            .map_err(|e| Status::internal(format!("unload: {e}")))?;
        Ok(Response::new(pb::UnloadShardResponse {}))
    }

    async fn status(&self, _: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let st = self.agent.status();
        let shard = st.assignment.map(|a| pb::Shard {
            replica_id: a.replica,
            model: a.model,
            rank: a.rank,
            state: match a.state {
                ShardState::Loading => pb::ShardState::Loading,
                ShardState::Ready => pb::ShardState::Ready,
                ShardState::Failed => pb::ShardState::Failed,
            } as i32,
            error: a.error,
        });
        Ok(Response::new(pb::StatusResponse {
            worker_id: self.agent.id().to_string(),
            shard,
            draining: st.draining,
            stats: Some(stats_pb(st.stats)),
        }))
    }

    async fn canary(
        &self,
        request: Request<pb::CanaryRequest>,
    ) -> Result<Response<pb::CanaryResponse>, Status> {
        let r = request.into_inner();
        let engine = self.agent.leader(&r.replica_id).map_err(to_status)?;
        let limit = Duration::from_millis(if r.timeout_ms == 0 { 10_000 } else { r.timeout_ms as u64 });
        let started = Instant::now();
        match tokio::time::timeout(limit, engine.canary()).await {
            Ok(Ok(())) => {
                Ok(Response::new(pb::CanaryResponse { elapsed_ms: started.elapsed().as_millis() as u32 }))
            }
            Ok(Err(e)) => Err(to_status(e)),
            Err(_) => Err(to_status(Error::DeadlineExceeded(format!(
                "replica {}: no step came back within {} ms",
                r.replica_id,
                limit.as_millis()
            )))),
        }
    }

    async fn drain(&self, request: Request<pb::DrainRequest>) -> Result<Response<pb::DrainResponse>, Status> {
        self.agent.drain(&request.into_inner().replica_id).map_err(to_status)?;
        Ok(Response::new(pb::DrainResponse {}))
    }

    async fn model_files(
        &self,
        request: Request<pb::ModelFilesRequest>,
    ) -> Result<Response<pb::ModelFilesResponse>, Status> {
        let dir = request.into_inner().model_dir;
        let files = tokio::task::spawn_blocking(move || read_model_files(Path::new(&dir)))
            .await
            .map_err(|e| Status::internal(format!("model files: {e}")))?
            .map_err(to_status)?;
        Ok(Response::new(files))
    }
}

/// The small files of a model directory; config.json and tokenizer.json must exist.
pub fn read_model_files(dir: &Path) -> strata_common::Result<pb::ModelFilesResponse> {
    let read = |name: &str, required: bool| -> strata_common::Result<Vec<u8>> {
        let p = dir.join(name);
        match std::fs::read(&p) {
            Ok(b) => Ok(b),
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(Error::model_file(&p, format!("cannot read: {e}"))),
        }
    };
    if !dir.is_dir() {
        return Err(Error::model_file(dir, "not a directory on this worker"));
    }
    Ok(pb::ModelFilesResponse {
        config_json: read("config.json", true)?,
        generation_config_json: read("generation_config.json", false)?,
        tokenizer_json: read("tokenizer.json", true)?,
        tokenizer_config_json: read("tokenizer_config.json", false)?,
    })
}

fn event_pb(ev: SeqEvent) -> Result<pb::WorkerGenerateResponse, Status> {
    match ev {
        SeqEvent::Token { token, logprobs, finish } => {
            let mut t = pb::WorkerToken { token_id: token, ..Default::default() };
            if let Some(l) = logprobs {
                t.logprob = Some(l.logprob);
                t.top_token_ids = l.top.iter().map(|x| x.0).collect();
                t.top_logprobs = l.top.iter().map(|x| x.1).collect();
            }
            Ok(pb::WorkerGenerateResponse {
                tokens: vec![t],
                finish_reason: finish.map(|f| f.as_str().to_string()).unwrap_or_default(),
            })
        }
        SeqEvent::Failed(e) => Err(to_status(e)),
    }
}

/// The first event (already received) followed by the rest of the sequence's events.
fn async_stream(
    first: Option<SeqEvent>,
    seq: strata_worker::SequenceStream,
) -> impl Stream<Item = Result<pb::WorkerGenerateResponse, Status>> + Send {
    let ended = |e: &Result<pb::WorkerGenerateResponse, Status>| match e {
        Ok(m) => !m.finish_reason.is_empty(),
        Err(_) => true,
    };
    futures::stream::unfold((first, Some(seq)), move |(pending, seq)| async move {
        let mut seq = seq?;
        let ev = match pending {
            Some(ev) => Some(ev),
            None => seq.next().await,
        };
        let item = match ev {
            Some(ev) => event_pb(ev),
            None => Err(Status::unavailable("the replica stopped before the sequence finished")),
        };
        let next = if ended(&item) { None } else { Some(seq) };
        Some((item, (None, next)))
    })
}
