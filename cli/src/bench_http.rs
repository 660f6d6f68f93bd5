//! `strata bench --api openai | openai-chat`: the same load over OpenAI's HTTP API
//! (streamed `/v1/completions` or `/v1/chat/completions`), so Strata and any
//! OpenAI-compatible server (vLLM, SGLang) are measured with one tool.
//!
//! Prompts are text (random words, `--input-len` of them: a server tokenizes them its own
//! way; the input tokens reported are the server's `usage`). Each server-sent chunk that
//! carries text is a token event for TTFT and ITL; output tokens are the server's count.

use std::time::Instant;

use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value as Json};

use crate::bench::{BenchArgs, Outcome};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Most bytes of one server-sent chunk or error body read.
const MAX_EVENT: usize = 1 << 20;

/// Words prompts are made of.
const WORDS: &[&str] = &[
    "the", "river", "stone", "light", "over", "quiet", "market", "north", "paper", "green", "slow", "window",
];

/// The text prompts of a run (the shared prefix as in the gRPC workload: seed-independent).
pub fn prompts(args: &BenchArgs) -> Vec<String> {
    let mut prefix_rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let prefix: Vec<&str> =
        (0..args.shared_prefix).map(|_| WORDS[prefix_rng.random_range(0..WORDS.len())]).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    (0..args.requests)
        .map(|_| {
            let mut p = prefix.clone();
            p.extend((args.shared_prefix..args.input_len).map(|_| WORDS[rng.random_range(0..WORDS.len())]));
            p.join(" ")
        })
        .collect()
}

/// The base URL (without `/v1`) of `--endpoint`.
pub fn base(endpoint: &str) -> anyhow::Result<String> {
    let endpoint = crate::client::endpoint_url(endpoint);
    if !endpoint.starts_with("http://") {
        bail!("--endpoint {endpoint:?}: --api openai needs the HTTP API's http://HOST:PORT");
    }
    Ok(endpoint.trim_end_matches('/').trim_end_matches("/v1").to_string())
}

/// What one request of the benchmark asks for.
pub struct Call {
    pub model: String,
    pub max_tokens: u32,
    /// Chat completions (else completions).
    pub chat: bool,
    /// Leave out `cache: false` (Strata's extension; vLLM ignores it).
    pub response_cache: bool,
}

/// Checks that `model` is served (GET /v1/models).
pub async fn check_model(
    client: &HttpClient,
    base: &str,
    model: &str,
    key: Option<&str>,
) -> anyhow::Result<()> {
    let mut req = hyper::Request::get(format!("{base}/v1/models"));
    if let Some(k) = key {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let resp = client.request(req.body(Full::new(Bytes::new()))?).await.context("GET /v1/models")?;
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), MAX_EVENT)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("GET /v1/models: {e}"))?
        .to_bytes();
    if !status.is_success() {
        bail!("GET /v1/models: {status}: {}", String::from_utf8_lossy(&body));
    }
    let models: Json = serde_json::from_slice(&body).context("GET /v1/models: not JSON")?;
    let ids: Vec<&str> =
        models["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str()).collect();
    if !ids.contains(&model) {
        bail!("model {model:?} is not served; served: {ids:?}");
    }
    Ok(())
}

/// One streamed request; the outcome and the server's count of prompt tokens.
pub async fn one(
    client: HttpClient,
    base: String,
    call: Call,
    prompt: String,
    key: Option<String>,
) -> anyhow::Result<(Outcome, usize)> {
    let Call { model, max_tokens, chat, response_cache } = call;
    let (path, mut body) = if chat {
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": prompt}]}))
    } else {
        ("/v1/completions", json!({"prompt": prompt}))
    };
    for (k, v) in [
        ("model", json!(model)),
        ("max_tokens", json!(max_tokens)),
        ("stream", json!(true)),
        ("stream_options", json!({"include_usage": true})),
        ("ignore_eos", json!(true)),
        ("temperature", json!(0)),
    ] {
        body[k] = v;
    }
    if !response_cache {
        body["cache"] = json!(false);
    }
    let mut req =
        hyper::Request::post(format!("{base}{path}")).header(hyper::header::CONTENT_TYPE, "application/json");
    if let Some(k) = &key {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let start = Instant::now();
    let resp = client.request(req.body(Full::new(Bytes::from(body.to_string())))?).await?;
    if !resp.status().is_success() {
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_EVENT).collect().await;
        let text = body.map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned()).unwrap_or_default();
        bail!("{status}: {text}");
    }
    let mut body = resp.into_body();
    let (mut buf, mut last, mut ttft, mut itls) = (Vec::new(), start, None, Vec::new());
    let (mut tokens, mut prompt_tokens) = (0, 0);
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        buf.extend_from_slice(&data);
        if buf.len() > MAX_EVENT {
            bail!("a server-sent event over {MAX_EVENT} bytes");
        }
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let Some(data) = std::str::from_utf8(&event)?.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let chunk: Json = serde_json::from_str(data).context("a chunk that is not JSON")?;
            if let Some(e) = chunk.get("error") {
                bail!("the stream failed: {e}");
            }
            if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
                tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
                prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
            }
            let c = &chunk["choices"][0];
            let text = c["text"].as_str().or_else(|| c["delta"]["content"].as_str()).unwrap_or("");
            if text.is_empty() {
                continue;
            }
            let now = Instant::now();
            match ttft {
                None => ttft = Some((now - start).as_secs_f64() * 1e3),
                Some(_) => itls.push((now - last).as_secs_f64() * 1e3),
            }
            last = now;
        }
    }
    let ttft = ttft.context("the stream ended without text")?;
    Ok((Outcome { ttft, itls, e2e: (last - start).as_secs_f64() * 1e3, tokens }, prompt_tokens))
}
