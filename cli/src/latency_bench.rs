//! `strata model latency`: what the serving path adds to a tiny generation.
//!
//! Runs N one-token greedy generations of a fixed prompt either in-process (the engine
//! directly, as `strata generate` does) or through a running server's unary Generate
//! over gRPC, and reports the latency distribution. Comparing the two, measured one after
//! the other on the same model, gives the overhead of gRPC, tokenization and routing.

use std::time::Instant;

use serde::Serialize;
use strata_common::SamplingParams;
use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;

use crate::local::{LocalModel, Prompt};

#[derive(Debug, Serialize)]
pub struct LatencyReport {
    pub mode: String,
    pub requests: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
}

const PROMPT: &str = "The quick brown fox";

pub fn in_process(model: &mut LocalModel, requests: usize) -> anyhow::Result<LatencyReport> {
    let params = SamplingParams { max_new_tokens: 1, ..Default::default() };
    let mut samples = Vec::with_capacity(requests);
    for i in 0..requests + requests / 10 {
        let t = Instant::now();
        model.generate(Prompt::Text(PROMPT.into()), params.clone(), |_| {})?;
        if i >= requests / 10 {
            samples.push(t.elapsed().as_secs_f64() * 1e3); // the first tenth warms up
        }
    }
    Ok(report("in-process", samples))
}

pub async fn over_grpc(endpoint: &str, model: &str, requests: usize) -> anyhow::Result<LatencyReport> {
    let mut client = InferenceClient::connect(crate::client::endpoint_url(endpoint)).await?;
    let req = pb::GenerateRequest {
        model: model.into(),
        prompt: Some(pb::generate_request::Prompt::Text(PROMPT.into())),
        max_tokens: Some(1),
        // A benchmark measures the replicas, never the response cache.
        cache: Some(false),
        ..Default::default()
    };
    let mut samples = Vec::with_capacity(requests);
    for i in 0..requests + requests / 10 {
        let t = Instant::now();
        client.generate(req.clone()).await.map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?;
        if i >= requests / 10 {
            samples.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(report("grpc", samples))
}

fn report(mode: &str, ms: Vec<f64>) -> LatencyReport {
    use strata_common::stats::{mean, percentile};
    let pct = |p: f64| percentile(&ms, p);
    LatencyReport {
        mode: mode.into(),
        requests: ms.len(),
        p50_ms: pct(0.5),
        p90_ms: pct(0.9),
        p99_ms: pct(0.99),
        mean_ms: mean(&ms),
    }
}

/// One streamed request's times: to the first token and to the end, in milliseconds.
struct Streamed {
    first_ms: f64,
    total_ms: f64,
}

/// Streaming over gRPC (GenerateStream) and over the OpenAI-style HTTP API (SSE), the same
/// greedy request alternately on one server, so both see the same load and noise.
pub async fn streaming_grpc_vs_http(
    endpoint: &str,
    http: &str,
    model: &str,
    requests: usize,
    tokens: u32,
) -> anyhow::Result<Vec<LatencyReport>> {
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    let grpc = InferenceClient::connect(crate::client::endpoint_url(endpoint)).await?;
    let client: Client<_, Full<bytes::Bytes>> =
        Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let req = pb::GenerateRequest {
        model: model.into(),
        prompt: Some(pb::generate_request::Prompt::Text(PROMPT.into())),
        max_tokens: Some(tokens),
        ignore_eos: true,
        // A benchmark measures the replicas, never the response cache.
        cache: Some(false),
        ..Default::default()
    };
    let body = serde_json::json!({
        "model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": true, "stream": true,
        "cache": false,
    })
    .to_string();
    let url = format!("{}/v1/completions", http.trim_end_matches('/').trim_end_matches("/v1"));
    let over_grpc = |mut c: InferenceClient<tonic::transport::Channel>| {
        let req = req.clone();
        async move {
            let t = Instant::now();
            let mut s =
                c.generate_stream(req).await.map_err(|s| anyhow::anyhow!("{}", s.message()))?.into_inner();
            let mut first = None;
            while s.message().await.map_err(|s| anyhow::anyhow!("{}", s.message()))?.is_some() {
                first.get_or_insert_with(|| t.elapsed());
            }
            let first_ms = first.unwrap_or_default().as_secs_f64() * 1e3;
            anyhow::Ok(Streamed { first_ms, total_ms: t.elapsed().as_secs_f64() * 1e3 })
        }
    };
    let over_http = || {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        async move {
            let t = Instant::now();
            let request = hyper::Request::post(&url)
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(bytes::Bytes::from(body)))?;
            let mut resp = client.request(request).await?.into_body();
            let mut first = None;
            let mut seen = Vec::new();
            while let Some(frame) = resp.frame().await {
                if let Ok(data) = frame?.into_data() {
                    if first.is_none() && data.windows(6).any(|w| w == b"\"text\"") {
                        first = Some(t.elapsed());
                    }
                    seen.extend_from_slice(&data);
                }
            }
            anyhow::ensure!(
                seen.windows(6).any(|w| w == b"[DONE]"),
                "the HTTP stream did not end with [DONE]"
            );
            let first_ms = first.unwrap_or_default().as_secs_f64() * 1e3;
            anyhow::Ok(Streamed { first_ms, total_ms: t.elapsed().as_secs_f64() * 1e3 })
        }
    };
    let (mut g, mut h) = (Vec::new(), Vec::new());
    for i in 0..requests + requests / 10 {
        let (a, b) = if i % 2 == 0 {
            let a = over_grpc(grpc.clone()).await?;
            (a, over_http().await?)
        } else {
            let b = over_http().await?;
            (over_grpc(grpc.clone()).await?, b)
        };
        if i >= requests / 10 {
            g.push(a);
            h.push(b);
        }
    }
    let split = |v: &[Streamed], f: fn(&Streamed) -> f64| v.iter().map(f).collect::<Vec<f64>>();
    Ok(vec![
        report("grpc-stream-first-token", split(&g, |s| s.first_ms)),
        report("http-sse-first-token", split(&h, |s| s.first_ms)),
        report("grpc-stream-total", split(&g, |s| s.total_ms)),
        report("http-sse-total", split(&h, |s| s.total_ms)),
    ])
}
