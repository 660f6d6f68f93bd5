//! `strata.inference.v1.Inference`: the public API, served by every coordinator.
//!
//! This file only translates: a `GenerateRequest` message becomes the domain request that
//! the process's [`FrontEnd`] admits and runs, shared by the unary and the streaming
//! call (and the HTTP API), so their texts are the same by construction.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_server::Inference;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::request::span::request_span;

use strata_common::status::to_status;
use strata_common::{wire, Error, SamplingParams};

use super::auth::caller_of;
use crate::frontend::admission::{GenerateRequest, Priority, Prompt};
use crate::frontend::FrontEnd;
use crate::request::generation;
use crate::tenant::Caller;

/// The domain request of an inference.v1 message; a constraint naming no kind is an error.
pub fn request_from_pb(req: &pb::GenerateRequest) -> Result<GenerateRequest, Error> {
    let prompt = req.prompt.as_ref().map(|p| match p {
        pb::generate_request::Prompt::Text(t) => Prompt::Text(t.clone()),
        pb::generate_request::Prompt::TokenIds(ids) => Prompt::TokenIds(ids.ids.clone()),
    });
    let mut params = SamplingParams {
        ignore_eos: req.ignore_eos,
        stop_token_ids: req.stop_token_ids.clone(),
        stop: req.stop.clone(),
        logprobs: req.logprobs,
        prompt_logprobs: req.prompt_logprobs,
        constraint: req.constraint.clone().map(wire::constraint_from_pb).transpose()?,
        ..SamplingParams::default()
    };
    wire::apply_sampling(&req.sampling.unwrap_or_default(), &mut params);
    Ok(GenerateRequest {
        model: req.model.clone(),
        prompt,
        max_tokens: req.max_tokens,
        fill_context: false,
        priority: Priority::Online,
        params,
        cache: req.cache.unwrap_or(true),
    })
}

/// Sampling knobs live under `sampling.` in inference.v1; admission names them bare.
fn api_field_names(e: Error) -> Error {
    match e {
        Error::InvalidArgument { field, reason }
            if !matches!(
                field.as_str(),
                "max_tokens" | "stop" | "logprobs" | "prompt_logprobs" | "model" | "constraint"
            ) && !field.starts_with("prompt") =>
        {
            Error::invalid(format!("sampling.{field}"), reason)
        }
        other => other,
    }
}

/// Served behind [`super::auth::CallerLayer`], which names each call's caller.
pub struct InferenceService {
    front: Arc<FrontEnd>,
    next_request: AtomicU64,
}

/// The caller's deadline from the `grpc-timeout` header, a little early so that our
/// DEADLINE_EXCEEDED reaches the caller before the transport's own timer cancels the call.
pub fn deadline<T>(request: &Request<T>) -> Option<tokio::time::Instant> {
    let v = request.metadata().get("grpc-timeout")?.to_str().ok()?;
    let cut = v.char_indices().last()?.0;
    let (digits, unit) = v.split_at(cut);
    let n: u64 = digits.parse().ok()?;
    let d = match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    };
    let margin = (d / 20).min(Duration::from_millis(20));
    // A deadline too far away to represent is no deadline (never a panic on overflow).
    tokio::time::Instant::now().checked_add(d - margin)
}

impl InferenceService {
    pub fn new(front: Arc<FrontEnd>) -> Self {
        InferenceService { front, next_request: AtomicU64::new(1) }
    }

    fn request_id(&self, given: &str) -> String {
        if given.is_empty() {
            format!("req-{}", self.next_request.fetch_add(1, Ordering::Relaxed))
        } else {
            given.to_string()
        }
    }

    async fn start(
        &self,
        req: &pb::GenerateRequest,
        request_id: &str,
        deadline: Option<tokio::time::Instant>,
        caller: &Caller,
    ) -> Result<(Vec<u32>, generation::ChunkRx), Status> {
        let request = request_from_pb(req).map_err(to_status)?;
        let id = request_id.to_string();
        let started = self
            .front
            .begin(request, id, deadline, caller)
            .await
            .map_err(|e| to_status(api_field_names(e)))?;
        Ok((started.prompt_ids, started.rx))
    }
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Inference for InferenceService {
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        let who = caller_of(&request)?;
        let deadline = deadline(&request);
        let caller = strata_common::trace::from_metadata(request.metadata());
        let req = request.into_inner();
        let request_id = self.request_id(&req.request_id);
        let span = request_span(&req.model, &request_id, false, caller.as_ref());
        async move {
            let (prompt_ids, mut rx) = self.start(&req, &request_id, deadline, &who).await?;
            let mut out = pb::GenerateResponse { request_id, ..Default::default() };
            while let Some(chunk) = rx.recv().await {
                let chunk = chunk.map_err(to_status)?;
                out.text.push_str(&chunk.text);
                out.token_ids.extend(chunk.token_ids);
                out.logprobs.extend(chunk.logprobs.into_iter().map(wire::logprobs_to_pb));
                out.prompt_logprobs
                    .extend(chunk.prompt_logprobs.into_iter().flatten().map(wire::logprobs_to_pb));
                out.revision = chunk.revision;
                if let Some(f) = chunk.finish {
                    out.finish_reason = wire::finish_to_pb(f) as i32;
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
        let who = caller_of(&request)?;
        let deadline = deadline(&request);
        let caller = strata_common::trace::from_metadata(request.metadata());
        let req = request.into_inner();
        let request_id = self.request_id(&req.request_id);
        let span = request_span(&req.model, &request_id, true, caller.as_ref());
        let (prompt_ids, rx) = self.start(&req, &request_id, deadline, &who).instrument(span).await?;
        let prompt_tokens = prompt_ids.len() as u32;
        let mut completion_tokens = 0u32;
        let stream = ReceiverStream::new(rx).map(move |chunk| {
            let chunk = chunk.map_err(to_status)?;
            completion_tokens += chunk.token_ids.len() as u32;
            let finish = chunk.finish.map(wire::finish_to_pb);
            Ok(pb::GenerateStreamResponse {
                request_id: request_id.clone(),
                text: chunk.text,
                token_ids: chunk.token_ids,
                logprobs: chunk.logprobs.into_iter().map(wire::logprobs_to_pb).collect(),
                prompt_logprobs: chunk
                    .prompt_logprobs
                    .into_iter()
                    .flatten()
                    .map(wire::logprobs_to_pb)
                    .collect(),
                finish_reason: finish.unwrap_or(pb::FinishReason::Unspecified) as i32,
                usage: finish.map(|_| pb::Usage { prompt_tokens, completion_tokens }),
                revision: chunk.revision,
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let who = caller_of(&request)?;
        let req = request.into_inner();
        let model = self.front.models().get(&req.model).map_err(to_status)?;
        who.may_use(&model.name).map_err(to_status)?;
        let text = req.text;
        // Bounded by the context as generation is, under the front end's text budget.
        let permit = self.front.texts().acquire(who.tenant(), text.len()).await;
        let token_ids = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let context = model.max_context();
            let ids = model.tokenizer.encode(&text, context)?;
            if ids.len() > context {
                return Err(strata_common::Error::invalid(
                    "text",
                    format!("{} tokens; the model's context is {context} tokens", ids.len()),
                ));
            }
            Ok(ids)
        })
        .await
        .map_err(|e| Status::internal(format!("tokenize: {e}")))?
        .map_err(to_status)?;
        Ok(Response::new(pb::TokenizeResponse { token_ids }))
    }

    async fn list_models(
        &self,
        request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let who = caller_of(&request)?;
        let mut models = Vec::new();
        // A tenant sees the models it may use, as on the HTTP API.
        for m in self.front.models().all().into_iter().filter(|m| who.may_use(&m.name).is_ok()) {
            let s = m.routes.stats().await;
            models.push(pb::ModelInfo {
                name: m.name.clone(),
                architecture: m.config.architecture.hf_class().to_string(),
                max_context: m.max_context() as u32,
                vocab_size: m.config.vocab_size as u32,
                replicas: m.routes.ready() as u32,
                running_sequences: s.running as u32,
                waiting_requests: s.waiting as u32,
                kv_blocks_free: s.kv_blocks_free as u64,
                kv_blocks_total: s.kv_blocks_total as u64,
            });
        }
        Ok(Response::new(pb::ListModelsResponse { models }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_timeout(v: &str) -> Request<()> {
        let mut r = Request::new(());
        r.metadata_mut().insert("grpc-timeout", v.parse().unwrap());
        r
    }

    #[tokio::test]
    async fn grpc_timeouts_parse_and_absurd_ones_are_no_deadline() {
        let now = tokio::time::Instant::now();
        let d = deadline(&with_timeout("2S")).unwrap();
        assert!(d > now + Duration::from_millis(1900) && d <= now + Duration::from_secs(3));
        assert_eq!(deadline(&with_timeout(&format!("{}H", u64::MAX))), None, "overflow is no deadline");
        assert_eq!(deadline(&with_timeout("5X")), None, "unknown unit");
        assert_eq!(deadline(&with_timeout("S")), None, "no digits");
        assert_eq!(deadline(&Request::new(())), None);
    }

    #[tokio::test]
    async fn random_grpc_timeouts_never_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let alphabet = b"0123456789HMSmun -+.xyz";
        for _ in 0..5000 {
            let len = rng.random_range(1..24);
            let v: String = (0..len).map(|_| alphabet[rng.random_range(0..alphabet.len())] as char).collect();
            let Ok(value) = v.trim().parse::<tonic::metadata::MetadataValue<_>>() else { continue };
            let mut r = Request::new(());
            r.metadata_mut().insert("grpc-timeout", value);
            let _ = deadline(&r); // a deadline or none, never a panic
        }
    }

    /// A fuzz pass over what a caller sends on inference.v1: a valid GenerateRequest
    /// mutated (bytes flipped, cut, inserted) decodes to an error or a message, which
    /// becomes a domain request or an error naming a field: never a panic.
    #[test]
    fn mutated_generate_requests_decode_and_convert_without_panics() {
        use prost::Message;
        use rand::{Rng, SeedableRng};
        let valid = pb::GenerateRequest {
            model: "m".into(),
            prompt: Some(pb::generate_request::Prompt::Text("hello world".into())),
            max_tokens: Some(8),
            stop: vec!["x".into()],
            constraint: Some(strata_common::wire::constraint_to_pb(&strata_common::Constraint::Regex(
                "a+".into(),
            ))),
            ..Default::default()
        }
        .encode_to_vec();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(59);
        for _ in 0..20_000 {
            let mut b = valid.clone();
            for _ in 0..rng.random_range(1..4) {
                match rng.random_range(0..3) {
                    0 if !b.is_empty() => {
                        let at = rng.random_range(0..b.len());
                        b[at] ^= 1 << rng.random_range(0..8);
                    }
                    1 => b.truncate(rng.random_range(0..=b.len())),
                    _ => b.insert(rng.random_range(0..=b.len()), rng.random()),
                }
            }
            if let Ok(m) = pb::GenerateRequest::decode(&b[..]) {
                let _ = request_from_pb(&m);
            }
        }
    }
}
