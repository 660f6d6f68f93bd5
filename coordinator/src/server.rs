//! `strata.inference.v1.Inference`: the public API, served by every coordinator.
//!
//! Validation and tokenization happen here ([`request::admit`](crate::request::admit)); the
//! generation itself is [`generation::start`](crate::generation::start), shared by the
//! unary and the streaming call, so their texts are the same by construction.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::Stream;
use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_server::Inference;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};
use tracing::{info_span, Instrument};

use crate::generation::{self, finish_to_pb};
use crate::models::ModelSet;
use crate::request::admit;
use crate::status::to_status;

pub struct InferenceService {
    models: ModelSet,
    next_request: AtomicU64,
}

impl InferenceService {
    pub fn new(models: ModelSet) -> Self {
        InferenceService { models, next_request: AtomicU64::new(1) }
    }

    fn request_id(&self, given: &str) -> String {
        if given.is_empty() {
            format!("req-{}", self.next_request.fetch_add(1, Ordering::Relaxed))
        } else {
            given.to_string()
        }
    }

    fn start(&self, req: &pb::GenerateRequest) -> Result<(Vec<u32>, generation::ChunkRx), Status> {
        let model = self.models.get(&req.model).map_err(to_status)?;
        let admitted = admit(req, &model).map_err(to_status)?;
        let prompt_ids = admitted.prompt_ids.clone();
        let rx = generation::start(model, admitted).map_err(to_status)?;
        Ok((prompt_ids, rx))
    }
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Inference for InferenceService {
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        let req = request.into_inner();
        let request_id = self.request_id(&req.request_id);
        let span = info_span!("generate", request_id = %request_id, model = %req.model);
        async move {
            let (prompt_ids, mut rx) = self.start(&req)?;
            let mut out = pb::GenerateResponse { request_id, ..Default::default() };
            while let Some(chunk) = rx.recv().await {
                let chunk = chunk.map_err(to_status)?;
                out.text.push_str(&chunk.text);
                out.token_ids.extend(chunk.token_ids);
                out.logprobs.extend(chunk.logprobs);
                if let Some(f) = chunk.finish {
                    out.finish_reason = finish_to_pb(f) as i32;
                    break;
                }
            }
            out.usage = Some(pb::Usage {
                prompt_tokens: prompt_ids.len() as u32,
                completion_tokens: out.token_ids.len() as u32,
            });
            out.prompt_token_ids = prompt_ids;
            Ok(Response::new(out))
        }
        .instrument(span)
        .await
    }

    type GenerateStreamStream = GenerateStream;

    async fn generate_stream(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<GenerateStream>, Status> {
        let req = request.into_inner();
        let request_id = self.request_id(&req.request_id);
        let (prompt_ids, rx) = self.start(&req)?;
        let prompt_tokens = prompt_ids.len() as u32;
        let mut completion_tokens = 0u32;
        let stream = ReceiverStream::new(rx).map(move |chunk| {
            let chunk = chunk.map_err(to_status)?;
            completion_tokens += chunk.token_ids.len() as u32;
            let finish = chunk.finish.map(finish_to_pb);
            Ok(pb::GenerateStreamResponse {
                request_id: request_id.clone(),
                text: chunk.text,
                token_ids: chunk.token_ids,
                logprobs: chunk.logprobs,
                finish_reason: finish.unwrap_or(pb::FinishReason::Unspecified) as i32,
                usage: finish.map(|_| pb::Usage { prompt_tokens, completion_tokens }),
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let req = request.into_inner();
        let model = self.models.get(&req.model).map_err(to_status)?;
        let token_ids = model.tokenizer.encode(&req.text).map_err(to_status)?;
        Ok(Response::new(pb::TokenizeResponse { token_ids }))
    }

    async fn list_models(
        &self,
        _: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let models = self
            .models
            .iter()
            .map(|m| {
                let s = m.stats();
                pb::ModelInfo {
                    name: m.name.clone(),
                    architecture: m.config.architecture.hf_class().to_string(),
                    max_context: m.config.max_position_embeddings as u32,
                    vocab_size: m.config.vocab_size as u32,
                    replicas: m.replicas.len() as u32,
                    running_sequences: s.running as u32,
                    waiting_requests: s.waiting as u32,
                    kv_blocks_free: s.kv_blocks_free as u64,
                    kv_blocks_total: s.kv_blocks_total as u64,
                }
            })
            .collect();
        Ok(Response::new(pb::ListModelsResponse { models }))
    }
}
