//! `strata bench`: a load generator for a running server, reporting what vLLM's serving
//! benchmark reports, with the same definitions:
//! - **TTFT**: request sent → first token received;
//! - **ITL**: gaps between consecutive tokens of a request (all gaps of all requests);
//! - **TPOT**: per request, (end-to-end − TTFT) / (output tokens − 1);
//! - **E2E latency**: request sent → last token received;
//! - throughputs over the whole run's wall time.
//!
//! Over gRPC (`--api grpc`, the default) prompts are token ids (so their length is
//! exact): an optional prefix shared by every request, then random ids. Over OpenAI's HTTP
//! API (`--api openai` streams /v1/completions, `--api openai-chat` /v1/chat/completions;
//! see [`crate::bench_http`]) they are text of as many words. Requests are greedy with EOS
//! ignored, so every request produces exactly `--output-len` tokens. Arrivals are either
//! closed-loop (`--concurrency C` requests in flight) or open-loop Poisson
//! (`--request-rate R`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;
use tokio::sync::Semaphore;
use tonic::metadata::{Ascii, MetadataValue};

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Server to load, e.g. http://127.0.0.1:50051 (HOST:PORT alone is plaintext).
    #[arg(long)]
    pub endpoint: String,
    /// Let the server answer repeated requests from its response cache (off: the
    /// requests ask it not to, so the benchmark measures the replicas).
    #[arg(long)]
    pub response_cache: bool,
    /// Served model name.
    #[arg(long)]
    pub model: String,
    /// Number of requests to send.
    #[arg(long, default_value_t = 100)]
    pub requests: usize,
    /// Requests in flight at once (closed loop).
    #[arg(long, conflicts_with = "request_rate")]
    pub concurrency: Option<usize>,
    /// Poisson arrival rate in requests per second (open loop).
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Prompt length in tokens (including the shared prefix).
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 64)]
    pub output_len: u32,
    /// Leading prompt tokens shared by every request (e.g. a system prompt).
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
    /// Seed of the random prompts (the same seed, the same requests).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The API key the server expects (sent as "authorization: Bearer").
    #[arg(long, env = "STRATA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Which API to load: inference.v1 over gRPC, or OpenAI's HTTP API (--endpoint is then
    /// the HTTP address) streaming completions or chat completions.
    #[arg(long, value_enum, default_value = "grpc")]
    pub api: BenchApi,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchApi {
    Grpc,
    Openai,
    OpenaiChat,
}

/// `message` as a request carrying the API key, if there is one.
fn authed<T>(message: T, key: &Option<MetadataValue<Ascii>>) -> tonic::Request<T> {
    let mut req = tonic::Request::new(message);
    if let Some(k) = key {
        req.metadata_mut().insert("authorization", k.clone());
    }
    req
}

#[derive(Debug, Serialize, Default)]
pub struct Stats {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

fn stats(v: &mut [f64]) -> Stats {
    use strata_common::stats::{mean, percentile};
    if v.is_empty() {
        return Stats::default();
    }
    let pct = |p: f64| percentile(v, p);
    Stats { mean: mean(v), p50: pct(0.5), p90: pct(0.9), p99: pct(0.99) }
}

#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub request_throughput: f64,
    pub output_tokens_per_s: f64,
    pub total_tokens_per_s: f64,
    pub ttft_ms: Stats,
    pub itl_ms: Stats,
    pub tpot_ms: Stats,
    pub e2e_ms: Stats,
}

/// One request's timings and output tokens.
pub struct Outcome {
    pub ttft: f64,
    pub itls: Vec<f64>,
    pub e2e: f64,
    pub tokens: usize,
}

async fn one(
    mut client: InferenceClient<tonic::transport::Channel>,
    req: tonic::Request<pb::GenerateRequest>,
) -> anyhow::Result<Outcome> {
    let start = Instant::now();
    let mut stream = client
        .generate_stream(req)
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    let mut last = start;
    let mut ttft = None;
    let mut itls = Vec::new();
    let mut tokens = 0;
    while let Some(msg) =
        stream.message().await.map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
    {
        if msg.token_ids.is_empty() {
            continue;
        }
        let now = Instant::now();
        match ttft {
            None => ttft = Some((now - start).as_secs_f64() * 1e3),
            Some(_) => itls.push((now - last).as_secs_f64() * 1e3),
        }
        last = now;
        tokens += msg.token_ids.len();
    }
    let ttft = ttft.context("the stream ended without a token")?;
    Ok(Outcome { ttft, itls, e2e: (last - start).as_secs_f64() * 1e3, tokens })
}

pub async fn run(args: BenchArgs) -> anyhow::Result<BenchReport> {
    if args.requests == 0 || args.input_len == 0 || args.output_len == 0 {
        bail!("--requests, --input-len and --output-len must be at least 1");
    }
    if args.shared_prefix >= args.input_len {
        bail!(
            "--shared-prefix ({}) must be shorter than --input-len ({})",
            args.shared_prefix,
            args.input_len
        );
    }
    if matches!(args.concurrency, Some(0)) || args.request_rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        bail!("--concurrency must be at least 1 and --request-rate positive");
    }
    let bar = ProgressBar::new(args.requests as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let (outcomes, failed, duration) = match args.api {
        BenchApi::Grpc => over_grpc(&args, &bar).await?,
        BenchApi::Openai | BenchApi::OpenaiChat => over_http(&args, &bar).await?,
    };
    bar.finish_and_clear();
    Ok(report(&args, &outcomes, failed, duration))
}

/// Runs `futures` (one per request, started after its gap, at most `--concurrency` at
/// once): the outcomes with their prompt tokens, the failures, the wall time.
async fn drive<F>(
    args: &BenchArgs,
    bar: &ProgressBar,
    gaps: Vec<f64>,
    futures: Vec<F>,
) -> anyhow::Result<(Vec<(Outcome, usize)>, usize, f64)>
where
    F: std::future::Future<Output = anyhow::Result<(Outcome, usize)>> + Send + 'static,
{
    let limit = args.concurrency.unwrap_or(if args.request_rate.is_some() { usize::MAX >> 4 } else { 1 });
    let permits = Arc::new(Semaphore::new(limit.min(Semaphore::MAX_PERMITS)));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(futures.len());
    for (f, gap) in futures.into_iter().zip(gaps) {
        if gap > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        }
        let permit = permits.clone().acquire_owned().await?;
        let bar = bar.clone();
        tasks.push(tokio::spawn(async move {
            let r = f.await;
            drop(permit);
            bar.inc(1);
            r
        }));
    }
    let mut outcomes = Vec::new();
    let mut failed = 0;
    for t in tasks {
        match t.await? {
            Ok(o) => outcomes.push(o),
            Err(e) => {
                failed += 1;
                bar.println(format!("request failed: {e:#}"));
            }
        }
    }
    Ok((outcomes, failed, started.elapsed().as_secs_f64()))
}

async fn over_grpc(
    args: &BenchArgs,
    bar: &ProgressBar,
) -> anyhow::Result<(Vec<(Outcome, usize)>, usize, f64)> {
    let key = match &args.api_key {
        Some(k) => Some(format!("Bearer {k}").parse().context("--api-key: not a valid header value")?),
        None => None,
    };
    let channel = tonic::transport::Endpoint::from_shared(crate::client::endpoint_url(&args.endpoint))
        .with_context(|| format!("--endpoint {:?}", args.endpoint))?
        .connect()
        .await
        .with_context(|| format!("cannot connect to {}", args.endpoint))?;
    let mut client = InferenceClient::new(channel.clone());
    let listed = client.list_models(authed(pb::ListModelsRequest {}, &key)).await;
    let models = listed.map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?.into_inner().models;
    let info = models.iter().find(|m| m.name == args.model).with_context(|| {
        format!(
            "model {:?} is not served; served: {:?}",
            args.model,
            models.iter().map(|m| &m.name).collect::<Vec<_>>()
        )
    })?;
    let vocab = info.vocab_size.max(4);
    let (prompts, gaps) = workload(args, vocab);
    let futures: Vec<_> = prompts
        .into_iter()
        .map(|prompt| {
            let len = prompt.len();
            let req = pb::GenerateRequest {
                model: args.model.clone(),
                prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt })),
                max_tokens: Some(args.output_len),
                ignore_eos: true,
                // A benchmark measures the replicas, not the response cache, unless asked.
                cache: (!args.response_cache).then_some(false),
                ..Default::default()
            };
            let req = authed(req, &key);
            let client = InferenceClient::new(channel.clone());
            async move { one(client, req).await.map(|o| (o, len)) }
        })
        .collect();
    drive(args, bar, gaps, futures).await
}

async fn over_http(
    args: &BenchArgs,
    bar: &ProgressBar,
) -> anyhow::Result<(Vec<(Outcome, usize)>, usize, f64)> {
    use crate::bench_http::{base, check_model, prompts, HttpClient};
    let base = base(&args.endpoint)?;
    let client: HttpClient =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    check_model(&client, &base, &args.model, args.api_key.as_deref()).await?;
    let (_, gaps) = workload(args, 4);
    let chat = args.api == BenchApi::OpenaiChat;
    let futures: Vec<_> = prompts(args)
        .into_iter()
        .map(|prompt| {
            let call = crate::bench_http::Call {
                model: args.model.clone(),
                max_tokens: args.output_len,
                chat,
                response_cache: args.response_cache,
            };
            crate::bench_http::one(client.clone(), base.clone(), call, prompt, args.api_key.clone())
        })
        .collect();
    drive(args, bar, gaps, futures).await
}

/// The prompts and the gaps before each request. The shared prefix does not depend on
/// --seed, so a run with another seed shares it (how a prefix-cache hit is measured: warm
/// with one seed, measure with another).
fn workload(args: &BenchArgs, vocab: u32) -> (Vec<Vec<u32>>, Vec<f64>) {
    let mut prefix_rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let prefix: Vec<u32> = (0..args.shared_prefix).map(|_| prefix_rng.random_range(3..vocab)).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let prompts: Vec<Vec<u32>> = (0..args.requests)
        .map(|_| {
            let mut p = prefix.clone();
            p.extend((args.shared_prefix..args.input_len).map(|_| rng.random_range(3..vocab)));
            p
        })
        .collect();
    let gaps: Vec<f64> = match args.request_rate {
        Some(rate) => (0..args.requests).map(|_| -(1.0 - rng.random::<f64>()).ln() / rate).collect(),
        None => vec![0.0; args.requests],
    };
    (prompts, gaps)
}

fn report(args: &BenchArgs, outcomes: &[(Outcome, usize)], failed: usize, duration: f64) -> BenchReport {
    let input_tokens: usize = outcomes.iter().map(|o| o.1).sum();
    let outcomes: Vec<&Outcome> = outcomes.iter().map(|o| &o.0).collect();
    let output_tokens: usize = outcomes.iter().map(|o| o.tokens).sum();
    let mut ttft: Vec<f64> = outcomes.iter().map(|o| o.ttft).collect();
    let mut itl: Vec<f64> = outcomes.iter().flat_map(|o| o.itls.iter().copied()).collect();
    let mut tpot: Vec<f64> =
        outcomes.iter().filter(|o| o.tokens > 1).map(|o| (o.e2e - o.ttft) / (o.tokens - 1) as f64).collect();
    let mut e2e: Vec<f64> = outcomes.iter().map(|o| o.e2e).collect();
    BenchReport {
        requests: args.requests,
        completed: outcomes.len(),
        failed,
        duration_s: duration,
        input_tokens,
        output_tokens,
        request_throughput: outcomes.len() as f64 / duration,
        output_tokens_per_s: output_tokens as f64 / duration,
        total_tokens_per_s: (input_tokens + output_tokens) as f64 / duration,
        ttft_ms: stats(&mut ttft),
        itl_ms: stats(&mut itl),
        tpot_ms: stats(&mut tpot),
        e2e_ms: stats(&mut e2e),
    }
}

pub fn print_human(r: &BenchReport) {
    println!("requests            {} completed, {} failed, in {:.2} s", r.completed, r.failed, r.duration_s);
    println!("request throughput  {:.2} req/s", r.request_throughput);
    println!("output tokens/s     {:.1}", r.output_tokens_per_s);
    println!("total tokens/s      {:.1}", r.total_tokens_per_s);
    for (name, s) in [("TTFT", &r.ttft_ms), ("ITL", &r.itl_ms), ("TPOT", &r.tpot_ms), ("E2E", &r.e2e_ms)] {
        println!(
            "{name:<5} ms  mean {:>9.2}  p50 {:>9.2}  p90 {:>9.2}  p99 {:>9.2}",
            s.mean, s.p50, s.p90, s.p99
        );
    }
}
