//! `strata.worker.v1.Worker`: the worker's [`WorkerApi`] over gRPC.
//!
//! A thin adapter: every call converts its message with `strata_common::wire` and asks
//! the in-process implementation, so a request that arrives over the network runs exactly
//! what `strata serve`'s in-process path runs. Generate streams one sequence of the
//! replica this worker leads; dropping the stream (the coordinator cancelled, its caller
//! went away, or its deadline passed) drops the sequence, which cancels it and frees its
//! KV blocks at the next step.

use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use strata_common::status::to_status;
use strata_common::wire;
use strata_common::worker_api::{EventStream, WorkerApi};
use strata_common::SeqEvent;
use strata_proto::worker::v1 as pb;
use strata_proto::worker::v1::worker_server::Worker;
use tonic::{Request, Response, Status};
use tracing::{info_span, Instrument};

use crate::in_process::InProcessWorker;

/// Canary limit when a request gives none.
const DEFAULT_CANARY_LIMIT: Duration = Duration::from_secs(10);

pub struct WorkerService {
    worker: InProcessWorker,
}

impl WorkerService {
    pub fn new(worker: InProcessWorker) -> Self {
        WorkerService { worker }
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
        let caller = strata_common::trace::from_metadata(request.metadata());
        let (replica, job) = wire::job_from_pb(request.into_inner()).map_err(to_status)?;
        let span = info_span!(
            "worker.generate",
            otel.kind = "server",
            request_id = %job.request_id,
            strata.replica = %replica,
            prompt_tokens = job.prompt.len() as i64,
            resumed_tokens = job.generated.len() as i64,
        );
        if let Some(cx) = &caller {
            strata_common::trace::set_parent(&span, cx);
        }
        let mut events =
            self.worker.generate(&replica, &job).instrument(span.clone()).await.map_err(to_status)?;
        // The engine validates asynchronously; wait for the first event so a bad request
        // is this call's status, not a broken stream.
        let first = events.next().await;
        if let Some(SeqEvent::Failed(e)) = first {
            return Err(to_status(e));
        }
        // The span lasts as long as the stream: it closes when the caller's call ends.
        let stream = responses(first, events).inspect(move |_| {
            let _ = &span;
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn stats(&self, _: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        let stats = self.worker.stats().await.map_err(to_status)?;
        Ok(Response::new(wire::stats_to_pb(stats)))
    }

    async fn load_shard(
        &self,
        request: Request<pb::LoadShardRequest>,
    ) -> Result<Response<pb::LoadShardResponse>, Status> {
        let load = wire::load_from_pb(request.into_inner()).map_err(to_status)?;
        let rendezvous = self.worker.load_shard(load).await.map_err(to_status)?;
        Ok(Response::new(pb::LoadShardResponse { rendezvous: rendezvous.unwrap_or_default() }))
    }

    async fn unload_shard(
        &self,
        request: Request<pb::UnloadShardRequest>,
    ) -> Result<Response<pb::UnloadShardResponse>, Status> {
        self.worker.unload_shard(&request.into_inner().replica_id.into()).await.map_err(to_status)?;
        Ok(Response::new(pb::UnloadShardResponse {}))
    }

    async fn status(&self, _: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let status = self.worker.status().await.map_err(to_status)?;
        Ok(Response::new(wire::status_to_pb(status)))
    }

    async fn canary(
        &self,
        request: Request<pb::CanaryRequest>,
    ) -> Result<Response<pb::CanaryResponse>, Status> {
        let r = request.into_inner();
        let limit = match r.timeout_ms {
            0 => DEFAULT_CANARY_LIMIT,
            ms => Duration::from_millis(ms as u64),
        };
        let took = self.worker.canary(&r.replica_id.into(), limit).await.map_err(to_status)?;
        Ok(Response::new(pb::CanaryResponse { elapsed_ms: took.as_millis().min(u32::MAX as u128) as u32 }))
    }

    async fn drain(&self, request: Request<pb::DrainRequest>) -> Result<Response<pb::DrainResponse>, Status> {
        self.worker.drain(&request.into_inner().replica_id.into()).await.map_err(to_status)?;
        Ok(Response::new(pb::DrainResponse {}))
    }

    async fn model_files(
        &self,
        request: Request<pb::ModelFilesRequest>,
    ) -> Result<Response<pb::ModelFilesResponse>, Status> {
        let files = self.worker.model_files(&request.into_inner().model_dir).await.map_err(to_status)?;
        Ok(Response::new(wire::files_to_pb(files)))
    }
}

/// The first event (already received) followed by the rest of the sequence's events,
/// ending after the last token or the first failure.
fn responses(
    first: Option<SeqEvent>,
    events: EventStream,
) -> impl Stream<Item = Result<pb::WorkerGenerateResponse, Status>> + Send {
    futures::stream::unfold((first, Some(events)), |(pending, events)| async move {
        let mut events = events?;
        let ev = match pending {
            Some(ev) => Some(ev),
            None => events.next().await,
        };
        let (item, last) = match ev {
            Some(SeqEvent::Token { token, logprobs, finish }) => {
                (Ok(wire::token_to_pb(token, logprobs, finish)), finish.is_some())
            }
            Some(SeqEvent::Prompt(prompt)) => (Ok(wire::prompt_to_pb(prompt)), false),
            Some(SeqEvent::Embedding(v)) => (Ok(wire::embedding_to_pb(v)), true),
            Some(SeqEvent::Failed(e)) => (Err(to_status(e)), true),
            None => (Err(Status::unavailable("the replica stopped before the sequence finished")), true),
        };
        Some((item, (None, (!last).then_some(events))))
    })
}
