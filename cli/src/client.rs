//! `strata generate --endpoint`: the same flags and JSON as the in-process form, over gRPC.

use std::io::Write;

use anyhow::{anyhow, Context};
use strata_common::{wire, FinishReason};
use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;

use crate::cli::GenerateArgs;
use crate::local::{GenerateOutput, LogprobEntry};

pub fn request_from_args(args: &GenerateArgs) -> pb::GenerateRequest {
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(t), _) => pb::generate_request::Prompt::Text(t.clone()),
        (None, ids) => {
            pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: ids.clone().unwrap_or_default() })
        }
    };
    let p = args.sampling();
    pb::GenerateRequest {
        model: args.model.clone(),
        prompt: Some(prompt),
        sampling: Some(wire::sampling_to_pb(&p)),
        max_tokens: Some(args.max_tokens),
        stop: p.stop,
        stop_token_ids: p.stop_token_ids,
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs,
        request_id: String::new(),
        cache: None,
        constraint: p.constraint.as_ref().map(wire::constraint_to_pb),
        prompt_logprobs: None,
    }
}

/// The finish reason of a finished response: an unset or unknown value is an error.
fn finish_from_pb(v: i32) -> anyhow::Result<FinishReason> {
    wire::finish_from_pb(v)?.ok_or_else(|| anyhow!("the server's last message carries no finish_reason"))
}

fn logprobs_from_pb(l: Vec<pb::TokenLogprob>) -> Vec<LogprobEntry> {
    l.into_iter()
        .map(|l| LogprobEntry {
            token_id: l.token_id,
            logprob: l.logprob,
            top: l.top.into_iter().map(|t| (t.token_id, t.logprob)).collect(),
        })
        .collect()
}

fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow!("{:?}: {}", s.code(), s.message())
}

/// A server address as the clients connect to it: `HOST:PORT` alone means plaintext
/// `http://HOST:PORT` (as grpcurl and vLLM's clients take it).
pub fn endpoint_url(endpoint: &str) -> String {
    if endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    }
}

pub async fn generate_remote(args: &GenerateArgs, endpoint: &str) -> anyhow::Result<()> {
    let mut client = InferenceClient::connect(endpoint_url(endpoint))
        .await
        .with_context(|| format!("cannot connect to --endpoint {endpoint}"))?;
    let mut req = tonic::Request::new(request_from_args(args));
    if let Some(key) = &args.api_key {
        let value = format!("Bearer {key}").parse().context("--api-key: not a valid header value")?;
        req.metadata_mut().insert("authorization", value);
    }
    let want_logprobs = args.logprobs.is_some();
    let mut stdout = std::io::stdout();
    let out = if args.stream {
        let mut stream = client.generate_stream(req).await.map_err(status_error)?.into_inner();
        let mut out = GenerateOutput {
            prompt_ids: args.prompt_ids.clone().unwrap_or_default(),
            token_ids: Vec::new(),
            text: String::new(),
            finish_reason: FinishReason::Length,
            logprobs: want_logprobs.then(Vec::new),
        };
        while let Some(msg) = stream.message().await.map_err(status_error)? {
            if !args.json {
                stdout.write_all(msg.text.as_bytes())?;
                stdout.flush()?;
            }
            out.text.push_str(&msg.text);
            out.token_ids.extend(msg.token_ids);
            if let Some(l) = out.logprobs.as_mut() {
                l.extend(logprobs_from_pb(msg.logprobs));
            }
            if msg.finish_reason != pb::FinishReason::Unspecified as i32 {
                out.finish_reason = finish_from_pb(msg.finish_reason)?;
            }
        }
        if args.prompt.is_some() {
            // The stream does not repeat the prompt; ask the server how it tokenized it.
            let text = args.prompt.clone().unwrap_or_default();
            let t = client
                .tokenize(pb::TokenizeRequest { model: args.model.clone(), text })
                .await
                .map_err(status_error)?;
            out.prompt_ids = t.into_inner().token_ids;
        }
        out
    } else {
        let r = client.generate(req).await.map_err(status_error)?.into_inner();
        if !args.json {
            stdout.write_all(r.text.as_bytes())?;
        }
        GenerateOutput {
            prompt_ids: r.prompt_token_ids,
            token_ids: r.token_ids,
            text: r.text,
            finish_reason: finish_from_pb(r.finish_reason)?,
            logprobs: want_logprobs.then(|| logprobs_from_pb(r.logprobs)),
        }
    };
    if args.json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        println!();
        eprintln!("[{} tokens, finish_reason={}]", out.token_ids.len(), out.finish_reason.as_str());
    }
    Ok(())
}
