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
    let mut client = InferenceClient::connect(endpoint.to_string()).await?;
    let req = pb::GenerateRequest {
        model: model.into(),
        prompt: Some(pb::generate_request::Prompt::Text(PROMPT.into())),
        max_tokens: Some(1),
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
