//! [`WorkerApi`] over worker.v1: the coordinator's one client of a worker in another
//! process.
//!
//! The channel connects lazily and reconnects by itself; a connection that cannot be made
//! within [`CONNECT_TIMEOUT`] fails the call with `Unavailable`, which callers treat as a
//! worker that may be gone. Each call carries its own deadline, so a stopped worker
//! cannot hold a reconcile task or a routing poll.

use std::collections::VecDeque;
use std::time::Duration;

use futures::StreamExt;
use strata_common::status::from_status;
use strata_common::wire;
use strata_common::worker_api::{EventStream, Job, ModelFiles, ShardLoad, WorkerApi, WorkerStatus};
use strata_common::{EngineStats, Error, ReplicaId, Result, SeqEvent};
use strata_proto::worker::v1 as pb;
use strata_proto::worker::v1::worker_client::WorkerClient;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// tokenizer.json of a large vocabulary is several MiB.
const MAX_MESSAGE: usize = 256 << 20;
/// Deadlines of the short calls.
const STATUS_TIMEOUT: Duration = Duration::from_secs(2);
const LOAD_TIMEOUT: Duration = Duration::from_secs(10);
const UNLOAD_TIMEOUT: Duration = Duration::from_secs(5);
const FILES_TIMEOUT: Duration = Duration::from_secs(10);

pub struct GrpcWorker {
    address: String,
    client: WorkerClient<Channel>,
}

fn request<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.set_timeout(timeout);
    r
}

impl GrpcWorker {
    /// A client for the worker at `address` ("host:port"); nothing connects until a call.
    /// With `tls`, the connection is mutual TLS and the worker must prove its role.
    pub fn connect_lazy(address: &str, tls: Option<&ClientTlsConfig>) -> Result<Self> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| Error::Internal(format!("worker address {address:?}: {e}")))?;
        if let Some(tls) = tls {
            endpoint = endpoint
                .tls_config(tls.clone())
                .map_err(|e| Error::Internal(format!("cluster TLS for {address}: {e}")))?;
        }
        let endpoint = endpoint
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        let client = WorkerClient::new(endpoint.connect_lazy())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        Ok(GrpcWorker { address: address.to_string(), client })
    }

    fn peer(&self) -> String {
        format!("worker at {}", self.address)
    }
}

#[async_trait::async_trait]
impl WorkerApi for GrpcWorker {
    async fn generate(&self, replica: &ReplicaId, job: &Job) -> Result<EventStream> {
        let peer = format!("replica {replica} at {}", self.address);
        let mut client = self.client.clone();
        let mut call = tonic::Request::new(wire::job_to_pb(replica, job));
        // The attempt's span: the worker's spans join the caller's trace.
        strata_common::trace::inject(&tracing::Span::current(), call.metadata_mut());
        let stream = client.generate(call).await.map_err(|s| from_status(&s, &peer))?.into_inner();
        // Each message carries tokens; the last carries the finish reason. After the last
        // event (finished or failed) the stream ends, releasing the call.
        let events = futures::stream::unfold(
            (Some(stream), VecDeque::new(), peer),
            |(mut stream, mut queue, peer)| async move {
                loop {
                    if let Some(ev) = queue.pop_front() {
                        return Some((ev, (stream, queue, peer)));
                    }
                    let s = stream.as_mut()?;
                    let failed =
                        |e: Error| Some((SeqEvent::Failed(e), (None, VecDeque::new(), peer.clone())));
                    match s.message().await {
                        Ok(Some(m)) => match wire::events_from_pb(m) {
                            Ok(evs) => {
                                if evs.last().is_some_and(SeqEvent::is_last) {
                                    stream = None;
                                }
                                queue.extend(evs);
                            }
                            Err(e) => return failed(Error::Internal(format!("{peer}: {e}"))),
                        },
                        Ok(None) => return None,
                        Err(s) => return failed(from_status(&s, &peer)),
                    }
                }
            },
        );
        Ok(events.boxed())
    }

    async fn stats(&self) -> Result<EngineStats> {
        let r = self.client.clone().stats(request(pb::StatsRequest {}, STATUS_TIMEOUT)).await;
        Ok(wire::stats_from_pb(&r.map_err(|s| from_status(&s, &self.peer()))?.into_inner()))
    }

    async fn load_shard(&self, load: ShardLoad) -> Result<Option<String>> {
        let r = self.client.clone().load_shard(request(wire::load_to_pb(&load), LOAD_TIMEOUT)).await;
        let rendezvous = r.map_err(|s| from_status(&s, &self.peer()))?.into_inner().rendezvous;
        Ok((!rendezvous.is_empty()).then_some(rendezvous))
    }

    async fn unload_shard(&self, replica: &ReplicaId) -> Result<()> {
        let req = pb::UnloadShardRequest { replica_id: replica.to_string() };
        self.client
            .clone()
            .unload_shard(request(req, UNLOAD_TIMEOUT))
            .await
            .map_err(|s| from_status(&s, &self.peer()))?;
        Ok(())
    }

    async fn status(&self) -> Result<WorkerStatus> {
        let r = self.client.clone().status(request(pb::StatusRequest {}, STATUS_TIMEOUT)).await;
        wire::status_from_pb(r.map_err(|s| from_status(&s, &self.peer()))?.into_inner())
    }

    async fn canary(&self, replica: &ReplicaId, limit: Duration) -> Result<Duration> {
        let req = pb::CanaryRequest {
            replica_id: replica.to_string(),
            timeout_ms: limit.as_millis().min(u32::MAX as u128) as u32,
        };
        let r = self.client.clone().canary(request(req, limit + Duration::from_secs(1))).await;
        Ok(Duration::from_millis(
            r.map_err(|s| from_status(&s, &self.peer()))?.into_inner().elapsed_ms as u64,
        ))
    }

    async fn drain(&self, replica: &ReplicaId) -> Result<()> {
        let req = pb::DrainRequest { replica_id: replica.to_string() };
        self.client
            .clone()
            .drain(request(req, UNLOAD_TIMEOUT))
            .await
            .map_err(|s| from_status(&s, &self.peer()))?;
        Ok(())
    }

    async fn model_files(&self, model_dir: &str) -> Result<ModelFiles> {
        let req = pb::ModelFilesRequest { model_dir: model_dir.to_string() };
        let r = self.client.clone().model_files(request(req, FILES_TIMEOUT)).await;
        Ok(wire::files_from_pb(r.map_err(|s| from_status(&s, &self.peer()))?.into_inner()))
    }
}
